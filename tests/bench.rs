//! `foldmoe bench` end to end on the CPU: the JSON report's fields and FLOP
//! counts, the multi-process step under `foldmoe launch`, and one-line
//! errors for bad flags. (The GPU figures live in BENCHMARKS.md; no timing
//! is asserted here.)

mod common;

use common::{foldmoe, stderr};
use serde_json::Value;

fn report(args: &[&str]) -> Value {
    let o = foldmoe(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8(o.stdout).unwrap();
    // One report, whatever the number of processes (rank 0's).
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `bench model` of the tiny model cut to 2 blocks, sequences of 64.
fn tiny(tokens: &str, warmup: &str, iters: &str, extra: &[&'static str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "bench",
        "model",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--layers",
        "2",
        "--seq-len",
        "64",
        "--tokens",
        tokens,
        "--warmup",
        warmup,
        "--iters",
        iters,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `foldmoe launch` of `nproc` processes running `command`.
fn launched(nproc: usize, command: &[String]) -> Vec<String> {
    let mut args: Vec<String> = ["launch", "--nproc-per-node", &nproc.to_string()]
        .iter()
        .map(|s| s.to_string())
        .chain(["--timeout".into(), "60".into(), "--".into()])
        .collect();
    args.extend_from_slice(command);
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

const SMALL: &[&str] = &[
    "--device",
    "cpu",
    "--model",
    "qwen3-30b-a3b-small",
    "--tokens",
    "256",
    "--warmup",
    "0",
    "--iters",
    "1",
];

#[test]
fn moe_layer_reports_time_and_megatron_flops() {
    let mut args = vec!["bench", "moe-layer"];
    args.extend_from_slice(SMALL);
    let r = report(&args);
    assert_eq!(r["bench"], "moe-layer");
    assert_eq!(r["backend"], "cpu");
    assert_eq!(r["dtype"], "f32");
    // qwen3-30b-a3b-small: hidden 128, 16 experts, top-4, expert ffn 64.
    let (t, d, e, k, f) = (256.0, 128.0, 16.0, 4.0, 64.0);
    let flops = 3.0 * t * (2.0 * d * e + k * 6.0 * d * f);
    assert_eq!(r["flops"].as_f64().unwrap(), flops);
    let ms = r["time_ms"].as_f64().unwrap();
    assert!(ms > 0.0 && ms >= r["time_ms_min"].as_f64().unwrap());
    let tflops = r["tflops"].as_f64().unwrap();
    assert!((tflops - flops / ms / 1e9).abs() <= 1e-9 * tflops.max(1.0));
}

/// `--fp8` times the layer with its experts in blockwise fp8 (the same
/// FLOPs), says so in the report, adds the fp8 products to `bench gemm`,
/// and is refused where it means nothing.
#[test]
fn moe_layer_and_model_take_fp8_experts() {
    for bench in ["moe-layer", "model"] {
        let mut args = vec!["bench", bench, "--fp8", "--layers", "1"];
        args.extend_from_slice(SMALL);
        let r = report(&args);
        assert_eq!(
            (r["bench"].as_str(), r["fp8_experts"].as_bool()),
            (Some(bench), Some(true))
        );
        assert!(r["time_ms"].as_f64().unwrap() > 0.0);
    }
    // bench gemm --fp8 adds the three fp8 products of each shape.
    let mut args = vec!["bench", "gemm", "--fp8"];
    args.extend_from_slice(SMALL);
    let r = report(&args);
    let rows = r["results"].as_array().unwrap();
    assert_eq!(rows.len(), 12);
    let fp8: Vec<_> = rows
        .iter()
        .filter(|row| row["product"].as_str().unwrap().ends_with("_fp8"))
        .collect();
    assert_eq!(fp8.len(), 6);
    for row in fp8 {
        assert!(row["tflops"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["fp8_vs_bf16"].as_f64().unwrap() > 0.0, "{row}");
    }
    let mut args = vec!["bench", "attention", "--fp8"];
    args.extend_from_slice(SMALL);
    let o = foldmoe(&args);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--fp8 applies to bench gemm, moe-layer and model"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn model_step_reports_tokens_per_second_and_a_finite_loss() {
    let mut args = vec!["bench", "model", "--layers", "2"];
    args.extend_from_slice(SMALL);
    let r = report(&args);
    assert_eq!(r["bench"], "model");
    assert_eq!(r["dims"]["layers"], 2);
    assert_eq!(r["dims"]["tokens"], 256);
    let loss = r["last_loss"].as_f64().unwrap();
    // Byte vocabulary of 256: a fresh model's loss is near ln 256 = 5.55.
    assert!((loss - 256f64.ln()).abs() < 0.5, "{loss}");
    let tps = r["tokens_per_s"].as_f64().unwrap();
    let ms = r["time_ms"].as_f64().unwrap();
    assert!((tps - 256.0 / (ms / 1e3)).abs() < 1e-6 * tps);
    // The CPU has no known peak, so no MFU.
    assert!(r["mfu"].is_null());
}

#[test]
fn gemm_reports_each_product_of_fc1_and_fc2() {
    let mut args = vec!["bench", "gemm"];
    args.extend_from_slice(SMALL);
    let r = report(&args);
    assert_eq!(r["bench"], "gemm");
    let rows = r["results"].as_array().unwrap();
    // 256 tokens × top-4 rows in 16 groups; hidden 128, expert ffn 64.
    let mut seen = Vec::new();
    for row in rows {
        let (m, k, n) = (
            row["m"].as_f64().unwrap(),
            row["k"].as_f64().unwrap(),
            row["n"].as_f64().unwrap(),
        );
        assert_eq!((m, row["groups"].as_u64().unwrap()), (1024.0, 16));
        let shape = row["shape"].as_str().unwrap();
        assert_eq!(
            (k, n),
            if shape == "fc1" {
                (128.0, 64.0)
            } else {
                (64.0, 128.0)
            }
        );
        let (ms, tflops) = (
            row["time_ms"].as_f64().unwrap(),
            row["tflops"].as_f64().unwrap(),
        );
        assert!(ms > 0.0);
        let want = 2.0 * m * k * n / ms / 1e9;
        assert!((tflops - want).abs() <= 1e-9 * want, "{row}");
        seen.push(format!("{shape} {}", row["product"].as_str().unwrap()));
    }
    let want: Vec<String> = ["fc1", "fc2"]
        .iter()
        .flat_map(|s| ["forward", "dgrad", "wgrad"].map(|p| format!("{s} {p}")))
        .collect();
    assert_eq!(seen, want);
}

#[test]
fn attention_counts_the_causal_half() {
    for (extra, hd, hv) in [(&[][..], 32.0, 32.0), (&["--mla"][..], 192.0, 128.0)] {
        let mut args = vec!["bench", "attention", "--seq-len", "64"];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(extra);
        let r = report(&args);
        assert_eq!(r["bench"], "attention");
        let dims = &r["dims"];
        assert_eq!(
            (dims["batch"].as_u64(), dims["seq_len"].as_u64()),
            (Some(4), Some(64))
        );
        assert_eq!(
            (dims["heads"].as_u64(), dims["kv_heads"].as_u64()),
            (Some(4), Some(1))
        );
        assert_eq!(dims["head_dim"].as_f64().unwrap(), hd);
        assert_eq!(dims["value_dim"].as_f64().unwrap(), hv);
        let fwd = 4.0 * 4.0 * 64.0 * 64.0 * (hd + hv);
        for (pass, flops) in [("forward", fwd), ("backward", 2.0 * fwd)] {
            let ms = r[format!("{pass}_ms")].as_f64().unwrap();
            let tflops = r[format!("{pass}_tflops")].as_f64().unwrap();
            let want = flops / ms / 1e9;
            assert!(
                ms > 0.0 && (tflops - want).abs() <= 1e-9 * want,
                "{pass}: {r}"
            );
        }
    }
}

#[test]
fn bad_flags_are_one_line_errors() {
    for (extra, expect) in [
        (&["--layers", "9"][..], "--layers 9"),
        (&["--tokens", "100"][..], "--tokens 100"),
        (&["--dtype", "fp8"][..], "--dtype fp8"),
        (&["--iters", "0"][..], "--iters 0"),
        (&["--model", "nope"][..], "nope"),
        (&["--head-dim", "64"][..], "--head-dim"),
    ] {
        // The bad flag replaces its value in SMALL (clap refuses a flag twice).
        let mut args = vec!["bench", "model"];
        for pair in SMALL.chunks(2) {
            if pair[0] != extra[0] {
                args.extend_from_slice(pair);
            }
        }
        args.extend_from_slice(extra);
        let o = foldmoe(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?} succeeded");
        assert!(err.contains(expect), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

#[test]
fn processes_time_one_parallel_step_and_rank_0_reports_it() {
    let args = launched(2, &tiny("256", "1", "2", &["--layout", "ep=2"]));
    let r = report(&strs(&args));
    assert_eq!(r["bench"], "model");
    assert_eq!(r["world"], 2);
    assert_eq!(r["layout"], "world=2,dp=2,ep=2,edp=1");
    // Weak scaling: 256 tokens on each of the 2 dp ranks.
    assert_eq!(r["dims"]["tokens"], 256);
    assert_eq!(r["tokens_per_gpu"].as_f64().unwrap(), 256.0);
    assert_eq!(r["tokens_per_step"], 512);
    let ms = r["time_ms"].as_f64().unwrap();
    assert!(ms > 0.0 && ms >= r["time_ms_min"].as_f64().unwrap());
    let tps = r["tokens_per_s"].as_f64().unwrap();
    assert!((tps - 512.0 / (ms / 1e3)).abs() < 1e-6 * tps);
    // TFLOP/s per GPU: the step's FLOPs shared by the 2 ranks.
    let (flops, tflops) = (
        r["flops_per_step"].as_f64().unwrap(),
        r["tflops"].as_f64().unwrap(),
    );
    assert!((tflops - flops / 2.0 / ms / 1e9).abs() <= 1e-9 * tflops.max(1.0));
    let share = r["comm_share"].as_f64().unwrap();
    assert!(share > 0.0 && share < 1.0, "{share}");
    assert!(r["last_loss"].as_f64().unwrap().is_finite());
    assert!(r["mfu"].is_null());
}

#[test]
fn a_data_parallel_step_is_one_device_step_on_the_global_batch() {
    // One step each (no warmup): the loss reported is the first step's,
    // from the same initial weights on the same 512 tokens.
    let one = report(&strs(&tiny("512", "0", "1", &[])));
    // Under launch the layout defaults to dp over the processes.
    let two = report(&strs(&launched(2, &tiny("256", "0", "1", &[]))));
    assert_eq!(two["layout"], "world=2,dp=2,edp=2");
    assert_eq!(two["flops_per_step"], one["flops_per_step"]);
    let (a, b) = (
        one["last_loss"].as_f64().unwrap(),
        two["last_loss"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() <= 1e-6 * a.abs(),
        "one device {a}, two ranks {b}"
    );
}

#[test]
fn layouts_are_refused_in_one_line_before_ranks_wait() {
    // Without launch a layout has no processes to span.
    let o = foldmoe(&strs(&tiny("256", "0", "1", &["--layout", "ep=2"])));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("--layout ep=2") && err.contains("foldmoe launch"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // A bad layout, and moe-layer, fail on every rank at once; launch then
    // names the first rank that failed.
    let start = std::time::Instant::now();
    let moe_layer: Vec<String> = ["bench", "moe-layer"]
        .iter()
        .chain(SMALL)
        .map(|s| s.to_string())
        .collect();
    for (command, expect) in [
        (
            tiny("256", "0", "1", &["--layout", "tp=3"]),
            "--layout tp=3",
        ),
        (
            tiny("256", "0", "1", &["--layout", "cp=3"]),
            "--layout cp=3",
        ),
        (moe_layer, "moe-layer times one device"),
    ] {
        let o = foldmoe(&strs(&launched(2, &command)));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{command:?} succeeded");
        assert!(o.stdout.is_empty(), "{command:?} reported");
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert!(lines.iter().any(|l| l.contains(expect)), "{err}");
        assert!(
            lines.iter().any(|l| l.starts_with("error: launch: rank")),
            "{err}"
        );
        // Each rank's error and launch's own: one line each.
        assert_eq!(lines.len(), err.trim().lines().count(), "{err}");
    }
    assert!(start.elapsed() < std::time::Duration::from_secs(20));
}

/// The overlap flags reach the launched trainer and change no bit of the
/// loss (two TCP processes, small buckets); the report has both the exposed
/// and the total communication time of a step.
#[test]
fn the_overlap_flags_keep_the_loss_and_both_communication_times_are_reported() {
    let buckets: &[&'static str] = &["--ddp-bucket-size", "5000"];
    let plain = report(&strs(&launched(2, &tiny("256", "0", "2", buckets))));
    let overlapped = report(&strs(&launched(
        2,
        &tiny(
            "256",
            "0",
            "2",
            &[
                "--ddp-bucket-size",
                "5000",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
            ],
        ),
    )));
    assert_eq!(plain["last_loss"], overlapped["last_loss"]);
    for r in [&plain, &overlapped] {
        for key in ["comm_exposed_ms", "comm_total_ms", "comm_blocked_host_ms"] {
            let ms = r[key].as_f64().unwrap();
            assert!(ms > 0.0 && ms.is_finite(), "{key} = {ms}");
        }
        // The CPU communicators have no device events: the host's clock.
        assert_eq!(r["comm_exposed_source"], "host clock");
        assert_eq!(r["comm_exposed_ms"], r["comm_blocked_host_ms"]);
    }
}

/// `--overlap-moe-expert-parallel-comm` reaches the launched trainer under
/// ep = 2 with four micro-batches (three paired turns a step) and changes
/// no bit of the loss; without ep it is refused in one line, and the
/// training-step flags are refused by the other benchmarks.
#[test]
fn the_expert_all_to_all_overlap_keeps_the_loss_and_needs_ep() {
    let args = |extra: &[&'static str]| {
        let mut all = vec!["--layout", "ep=2", "--micro-batches", "4"];
        all.extend_from_slice(extra);
        launched(2, &tiny("512", "0", "2", &all))
    };
    let plain = report(&strs(&args(&[])));
    let overlapped = report(&strs(&args(&["--overlap-moe-expert-parallel-comm"])));
    assert_eq!(plain["last_loss"], overlapped["last_loss"]);
    assert_eq!(overlapped["dims"]["micro_batches"], 4);
    assert_eq!(overlapped["overlap"]["moe_expert_parallel_comm"], true);
    assert_eq!(plain["overlap"]["moe_expert_parallel_comm"], false);
    let o = foldmoe(&strs(&tiny(
        "128",
        "0",
        "1",
        &["--overlap-moe-expert-parallel-comm"],
    )));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("needs ep > 1") && err.contains("ep = 1"),
        "{err}"
    );
    let o = foldmoe(&[
        "bench",
        "moe-layer",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--tokens",
        "64",
        "--micro-batches",
        "2",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--micro-batches applies to bench model only"),
        "{err}"
    );
}
