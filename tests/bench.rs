//! `foldmoe bench` end to end on the CPU: the JSON report's fields and FLOP
//! counts, and one-line errors for bad flags. (The GPU figures live in
//! BENCHMARKS.md; no timing is asserted here.)

use std::process::{Command, Output};

use serde_json::Value;

fn foldmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_foldmoe"))
        .args(args)
        .output()
        .expect("the foldmoe binary runs")
}

fn report(args: &[&str]) -> Value {
    let o = foldmoe(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8(o.stdout).unwrap();
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
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
fn bad_flags_are_one_line_errors() {
    for (extra, expect) in [
        (&["--layers", "9"][..], "--layers 9"),
        (&["--tokens", "100"][..], "--tokens 100"),
        (&["--dtype", "fp8"][..], "--dtype fp8"),
        (&["--iters", "0"][..], "--iters 0"),
        (&["--model", "nope"][..], "nope"),
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
