//! The `foldmoe` command end to end: training runs, resume, generation, and
//! every kind of bad input the train issue lists (one-line error, non-zero
//! exit, nothing overwritten).

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{foldmoe, foldmoe_command, losses, scratch, stderr, FAST};

fn train(out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--out", out.to_str().unwrap()];
    args.extend_from_slice(FAST);
    args.extend_from_slice(extra);
    foldmoe(&args)
}

/// Asserts a failed run with a one-line `error:` message containing `needle`.
fn assert_fails_with(o: &Output, needle: &str) {
    assert!(
        !o.status.success(),
        "expected failure, got success: {}",
        stderr(o)
    );
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got {err:?}");
    assert!(
        lines[0].contains(needle),
        "error {:?} does not mention {needle:?}",
        lines[0]
    );
}

/// The newest complete checkpoint of a run directory (what `latest` names).
fn latest_dir(run: &std::path::Path) -> std::path::PathBuf {
    let root = run.join("checkpoints");
    let name = std::fs::read_to_string(root.join("latest")).unwrap();
    root.join(name.trim())
}

#[test]
fn train_writes_run_files_and_loss_falls() {
    let out = scratch("basic").join("run");
    let o = train(&out, &["--steps", "6"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in [
        "metrics.jsonl",
        "summary.json",
        "loss.png",
        "load_heatmap.png",
        "checkpoints/latest",
    ] {
        assert!(out.join(f).exists(), "missing {f}");
    }
    let ckpt = latest_dir(&out);
    for f in ["index.json", "rank-00000.safetensors", "rank-00000.json"] {
        assert!(ckpt.join(f).exists(), "missing {f} in {}", ckpt.display());
    }
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for key in [
        "steps",
        "losses",
        "final_loss",
        "val_loss",
        "tokens_per_s",
        "params_total",
        "params_active",
        "wall_s",
        "startup_peak_bytes",
        "shard_bytes",
        "first_step_s",
    ] {
        assert!(!s[key].is_null(), "summary.json lacks {key}");
    }
    let l = losses(&out);
    assert_eq!(l.len(), 6);
    assert!(l[5] < l[0] - 0.3, "loss did not fall: {l:?}");
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 6);
    for png in ["loss.png", "load_heatmap.png"] {
        assert_eq!(&std::fs::read(out.join(png)).unwrap()[..4], b"\x89PNG");
    }
    // Every step logs the tokens routed to each of tiny's 16 experts in its
    // 3 MoE layers (blocks 1-3): top-2 copies of the step's 256 tokens.
    for line in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let loads = v["expert_load"].as_object().unwrap();
        let keys: Vec<&str> = loads.keys().map(String::as_str).collect();
        assert_eq!(keys, ["layer_1", "layer_2", "layer_3"], "{line}");
        for counts in loads.values() {
            let counts: Vec<u64> = counts
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_u64().unwrap())
                .collect();
            assert_eq!(counts.len(), 16);
            assert_eq!(counts.iter().sum::<u64>(), 512, "{line}");
        }
    }
    // One TensorBoard event file, a scalar event per step.
    let events = event_files(&out);
    assert_eq!(events.len(), 1, "{events:?}");
    let records = records(&events[0]);
    assert_eq!(records.len(), 1 + 6, "file version, then one event a step");
    assert!(records[1].windows(9).any(|w| w == b"\x0a\x07lm loss"));
}

/// The TensorBoard event files of a run, oldest first.
fn event_files(run: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(run.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("events.out.tfevents."))
        .collect();
    files.sort();
    files
}

/// The payloads of an event file's TFRecords (the CRCs are the unit
/// tests' and TensorBoard's to check; here the framing's lengths are).
fn records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let (mut at, mut out) = (0, Vec::new());
    while at < bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        out.push(bytes[at + 12..at + 12 + len].to_vec());
        at += 16 + len;
    }
    assert_eq!(at, bytes.len(), "{} ends inside a record", path.display());
    out
}

/// The expert loads of each line of a run's metrics.jsonl.
fn expert_loads(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["expert_load"].clone())
        .collect()
}

/// `foldmoe report RUN_DIR`: the summary printed and both plots drawn
/// again from the log; a missing or corrupt run directory is one line.
#[test]
fn report_prints_the_summary_and_redraws_both_plots() {
    let dir = scratch("report");
    let run = dir.join("run");
    let o = train(&run, &["--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for png in ["loss.png", "load_heatmap.png"] {
        std::fs::remove_file(run.join(png)).unwrap();
    }
    let o = foldmoe(&["report", run.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "model `tiny`, 2 steps logged",
        "validation loss",
        "grad norm",
        "layer   1: 1024 tokens over 16 experts",
        "layer   3:",
        "load_heatmap.png",
    ] {
        assert!(text.contains(needle), "report lacks {needle:?}:\n{text}");
    }
    for png in ["loss.png", "load_heatmap.png"] {
        assert_eq!(&std::fs::read(run.join(png)).unwrap()[..4], b"\x89PNG");
    }
    assert_fails_with(
        &foldmoe(&["report", dir.join("absent").to_str().unwrap()]),
        "no such run directory",
    );
    assert_fails_with(
        &foldmoe(&["report", dir.to_str().unwrap()]),
        "not a foldmoe run directory",
    );
    let metrics = run.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"step\": 3, \"loss\"\n");
    std::fs::write(&metrics, text).unwrap();
    assert_fails_with(
        &foldmoe(&["report", run.to_str().unwrap()]),
        "metrics.jsonl line 3: not JSON",
    );
}

#[test]
fn same_seed_same_losses_and_resume_is_exact() {
    let dir = scratch("resume");
    let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
    assert!(train(&a, &["--steps", "6", "--seed", "5"]).status.success());
    assert!(train(&b, &["--steps", "6", "--seed", "5"]).status.success());
    assert_eq!(losses(&a), losses(&b), "two runs with one seed differ");
    let first = train(&c, &["--steps", "6", "--seed", "5", "--exit-after", "3"]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(losses(&c).len(), 3);
    let resumed = foldmoe(&["train", "--resume", c.to_str().unwrap()]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(
        losses(&c),
        losses(&a),
        "resumed run differs from the uninterrupted one"
    );
    assert_eq!(expert_loads(&c), expert_loads(&a), "resumed loads differ");
    // The resumed session writes a second event file: its file version, a
    // session start at step 4 (TensorBoard drops what an earlier session
    // wrote from there on), then steps 4-6.
    let events = event_files(&c);
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(records(&events[0]).len(), 1 + 3);
    let second = records(&events[1]);
    assert_eq!(second.len(), 1 + 1 + 3);
    assert_eq!(
        second[1][9..],
        [0x10, 4, 0x3a, 2, 0x08, 1],
        "session start at step 4"
    );
}

/// `--dtype bf16`: bf16 weights and compute (emulated on the CPU) with f32
/// masters; the loss falls, the dtype is kept in the checkpoint, and a
/// resumed run continues the uninterrupted one exactly.
#[test]
fn bf16_training_falls_and_resumes_exactly() {
    let dir = scratch("bf16");
    let (a, c) = (dir.join("a"), dir.join("c"));
    let bf16 = ["--steps", "6", "--seed", "5", "--dtype", "bf16"];
    let o = train(&a, &bf16);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("in bf16 (f32 master weights)"), "{stdout}");
    let l = losses(&a);
    assert!(l[5] < l[0] - 0.3, "loss did not fall: {l:?}");
    let first = train(&c, &[&bf16[..], &["--exit-after", "3"]].concat());
    assert!(first.status.success(), "{}", stderr(&first));
    let resumed = foldmoe(&["train", "--resume", c.to_str().unwrap()]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(losses(&c), l, "resumed bf16 run differs");
    assert_fails_with(
        &train(&dir.join("never"), &["--dtype", "f16"]),
        "--dtype f16: must be `f32` or `bf16`",
    );
}

/// `--fp8` (the routed experts' GEMMs in blockwise fp8, emulated on the
/// CPU) trains as bf16 does, within 2 % of its losses but not equal to them,
/// is kept on resume, and says so at start.
#[test]
fn fp8_training_tracks_bf16_and_resumes_exactly() {
    let dir = scratch("fp8");
    let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
    let bf16 = ["--steps", "8", "--seed", "5", "--dtype", "bf16"];
    let fp8 = [&bf16[..], &["--fp8"]].concat();
    let o = train(&a, &bf16);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = train(&b, &fp8);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("routed experts of 1 of 2 groups in blockwise fp8"),
        "{stdout}"
    );
    assert!(
        stderr(&o).contains("--fp8: group 0 stays in bf16"),
        "{}",
        stderr(&o)
    );
    let (l_bf16, l_fp8) = (losses(&a), losses(&b));
    assert_ne!(l_bf16, l_fp8, "fp8 changed nothing");
    for (x, y) in l_bf16.iter().zip(&l_fp8) {
        assert!(
            (x - y).abs() <= 0.02 * x,
            "bf16 {l_bf16:?} against fp8 {l_fp8:?}"
        );
    }
    let first = train(&c, &[&fp8[..], &["--exit-after", "4"]].concat());
    assert!(first.status.success(), "{}", stderr(&first));
    let resumed = foldmoe(&["train", "--resume", c.to_str().unwrap()]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(losses(&c), l_fp8, "resumed fp8 run differs");
}

#[test]
fn generate_continues_the_prompt() {
    let out = scratch("gen").join("run");
    assert!(train(&out, &["--steps", "2"]).status.success());
    let o = foldmoe(&[
        "generate",
        "--checkpoint",
        out.to_str().unwrap(),
        "--prompt",
        "In the",
        "--tokens",
        "20",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.starts_with("In the") && text.trim_end().len() > "In the".len(),
        "{text:?}"
    );
}

#[test]
fn bad_flags_give_one_line_errors_and_create_nothing() {
    let dir = scratch("flags");
    let out = dir.join("never");
    let o = train(&out, &["--model", "nope"]);
    assert_fails_with(&o, "unknown model `nope`");
    assert_fails_with(&train(&out, &["--steps", "0"]), "--steps 0");
    // Too large for this host: one line with the planner's estimate and
    // what is available, not a parameter-count limit.
    for model in ["deepseek-v3", "qwen3-30b-a3b"] {
        let o = foldmoe(&[
            "train",
            "--out",
            out.to_str().unwrap(),
            "--model",
            model,
            "--steps",
            "1",
        ]);
        assert_fails_with(&o, "the memory planner estimates");
        assert!(stderr(&o).contains("GiB is available"), "{}", stderr(&o));
    }
    assert_fails_with(
        &train(&out, &["--device", "cuda"]),
        "cuda backend not available",
    );
    assert!(!out.exists(), "a rejected run created its directory");
}

#[test]
fn bad_config_files_are_rejected() {
    let dir = scratch("config");
    let unknown = dir.join("unknown.toml");
    std::fs::write(&unknown, "stepz = 3\n").unwrap();
    assert_fails_with(
        &train(&dir.join("r1"), &["--config", unknown.to_str().unwrap()]),
        "stepz",
    );
    let wrong = dir.join("wrong.toml");
    std::fs::write(&wrong, "lr = \"fast\"\n").unwrap();
    assert_fails_with(
        &train(&dir.join("r2"), &["--config", wrong.to_str().unwrap()]),
        "invalid type",
    );
    let good = dir.join("good.toml");
    std::fs::write(&good, "steps = 2\nseed = 9\n").unwrap();
    let o = train(&dir.join("r3"), &["--config", good.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&dir.join("r3")).len(), 2);
}

#[test]
fn unwritable_out_and_existing_runs_are_refused() {
    let dir = scratch("out");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    assert_fails_with(&train(&file.join("run"), &["--steps", "1"]), "--out");
    let run = dir.join("run");
    assert!(train(&run, &["--steps", "1"]).status.success());
    let before = std::fs::read(run.join("summary.json")).unwrap();
    assert_fails_with(&train(&run, &["--steps", "1"]), "already holds a run");
    assert_eq!(std::fs::read(run.join("summary.json")).unwrap(), before);
}

#[test]
fn missing_truncated_and_altered_checkpoints_are_refused() {
    let dir = scratch("ckpt");
    let missing = dir.join("missing");
    assert_fails_with(
        &foldmoe(&["train", "--resume", missing.to_str().unwrap()]),
        "no checkpoint in",
    );
    assert_fails_with(
        &foldmoe(&["generate", "--checkpoint", missing.to_str().unwrap()]),
        "no checkpoint in",
    );
    let run = dir.join("run");
    assert!(train(&run, &["--steps", "1"]).status.success());
    let ckpt = latest_dir(&run);
    let tensors = ckpt.join("rank-00000.safetensors");
    let bytes = std::fs::read(&tensors).unwrap();
    let mut altered = bytes.clone();
    let n = altered.len();
    altered[n - 3] ^= 1;
    std::fs::write(&tensors, &altered).unwrap();
    assert_fails_with(
        &foldmoe(&["train", "--resume", run.to_str().unwrap(), "--steps", "3"]),
        "is corrupt",
    );
    std::fs::write(&tensors, &bytes[..bytes.len() / 2]).unwrap();
    assert_fails_with(
        &foldmoe(&["generate", "--checkpoint", run.to_str().unwrap()]),
        "truncated or altered",
    );
    std::fs::remove_file(&tensors).unwrap();
    assert_fails_with(
        &foldmoe(&["generate", "--checkpoint", run.to_str().unwrap()]),
        "rank-00000.safetensors is missing",
    );
    std::fs::write(&tensors, &bytes).unwrap();
    // An index naming a piece in a file it does not list.
    let index_path = ckpt.join("index.json");
    let good_index = std::fs::read_to_string(&index_path).unwrap();
    let mut index: serde_json::Value = serde_json::from_str(&good_index).unwrap();
    let mut piece = index["pieces"][0].clone();
    piece["file"] = "rank-00009.safetensors".into();
    index["pieces"].as_array_mut().unwrap().push(piece);
    std::fs::write(&index_path, index.to_string()).unwrap();
    assert_fails_with(
        &foldmoe(&["train", "--resume", run.to_str().unwrap(), "--steps", "2"]),
        "which it does not list",
    );
    // An index that lists a tensor whose pieces no file holds.
    let mut index: serde_json::Value = serde_json::from_str(&good_index).unwrap();
    let gone = index["pieces"][0]["tensor"].as_str().unwrap().to_string();
    index["pieces"]
        .as_array_mut()
        .unwrap()
        .retain(|p| p["tensor"].as_str() != Some(gone.as_str()));
    std::fs::write(&index_path, index.to_string()).unwrap();
    assert_fails_with(
        &foldmoe(&["generate", "--checkpoint", run.to_str().unwrap()]),
        &format!("of tensor {gone}"),
    );
    std::fs::write(&index_path, &good_index).unwrap();
    assert!(
        foldmoe(&["generate", "--checkpoint", run.to_str().unwrap()])
            .status
            .success()
    );
}

#[test]
fn non_finite_loss_stops_and_keeps_last_good_checkpoint() {
    let run = scratch("nan").join("run");
    let o = train(
        &run,
        &["--steps", "8", "--lr", "1e30", "--checkpoint-every", "1"],
    );
    assert_fails_with(&o, "training stopped at step");
    assert!(
        stderr(&o).contains("NaN") || stderr(&o).contains("non-finite"),
        "{}",
        stderr(&o)
    );
    // The checkpoint left behind is the one of the last finite step, and it loads.
    let config = std::fs::read_to_string(latest_dir(&run).join("index.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&config).unwrap();
    let step = meta["meta"]["step"].as_u64().unwrap();
    let failed_at = format!("training stopped at step {}", step + 1);
    assert!(
        stderr(&o).contains(&failed_at),
        "checkpoint step {step}; {}",
        stderr(&o)
    );
    let losses = meta["meta"]["losses"].as_array().unwrap();
    assert!(losses
        .iter()
        .all(|l| l.as_f64().is_some_and(f64::is_finite)));
    // It loads: a resume runs the next step, which diverges again at this
    // learning rate (the weights the last finite step left are huge).
    let next = (step + 1).to_string();
    let o = foldmoe(&["train", "--resume", run.to_str().unwrap(), "--steps", &next]);
    assert_fails_with(&o, &format!("training stopped at step {}", step + 1));
}

#[test]
fn ctrl_c_writes_a_checkpoint_then_exits() {
    let run = scratch("sigint").join("run");
    let child = foldmoe_command()
        .args(["train", "--out", run.to_str().unwrap(), "--steps", "100000"])
        .args(FAST)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = run.join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "training never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("interrupted at step"), "{}", stderr(&o));
    // The checkpoint loads: one more step trains from it.
    let resumed = foldmoe(&[
        "train",
        "--resume",
        run.to_str().unwrap(),
        "--exit-after",
        "1",
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
}

#[test]
fn plan_reports_published_counts_and_groups() {
    for (model, total, active) in [
        ("mixtral-8x7b", 46.7e9, 12.9e9),
        ("deepseek-v3", 671e9, 37e9),
    ] {
        let o = foldmoe(&["plan", "--model", model, "--json", "--rank", "3"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let got = v["params_total"].as_f64().unwrap();
        assert!((got / total - 1.0).abs() < 0.01, "{model}: total {got}");
        let got = v["params_active"].as_f64().unwrap();
        assert!((got / active - 1.0).abs() < 0.03, "{model}: active {got}");
        assert!(v["flops_per_token"].as_f64().unwrap() > 6.0 * active);
        let groups = v["groups"].as_array().unwrap();
        assert!(groups
            .iter()
            .any(|g| g[0] == "ep" && g[1].as_array().unwrap().contains(&3.into())));
    }
}

#[test]
fn plan_rejects_an_invalid_layout_with_the_macro_message() {
    let o = foldmoe(&[
        "plan",
        "--model",
        "mixtral-8x7b",
        "--layout",
        "world=6,ep=3",
    ]);
    // The same sentence as dsl-macros/tests/ui/layout/ep_does_not_divide_experts.stderr.
    assert_fails_with(&o, "ep = 3 does not divide experts = 8; choose ep in");
    assert_fails_with(&foldmoe(&["plan", "--layout", "tp=two"]), "tp=two");
}

#[test]
fn parallel_run_matches_one_rank_and_resumes_under_another_layout() {
    let dir = scratch("ranks");
    // dp2 with ep2: two micro-batches per step, one per dp rank; one rank
    // with --micro-batches 2 sees the same global batch.
    let one = train(&dir.join("one"), &["--steps", "4", "--micro-batches", "2"]);
    assert!(one.status.success(), "{}", stderr(&one));
    let par = train(
        &dir.join("par"),
        &[
            "--steps",
            "4",
            "--ranks",
            "2",
            "--layout",
            "ep=2",
            "--exit-after",
            "2",
        ],
    );
    assert!(par.status.success(), "{}", stderr(&par));
    // Resume the 2-rank checkpoint on 2 ranks under tensor parallelism.
    let resumed = foldmoe(&[
        "train",
        "--resume",
        dir.join("par").to_str().unwrap(),
        "--ranks",
        "2",
        "--layout",
        "tp=2",
        "--micro-batches",
        "2",
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let (want, got) = (losses(&dir.join("one")), losses(&dir.join("par")));
    assert_eq!(want.len(), got.len());
    for (step, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {step}: {a} vs {b}");
    }
    // The tokens routed per expert are the global batch's under dp2·ep2
    // and tp2, as on one rank.
    assert_eq!(
        expert_loads(&dir.join("par")),
        expert_loads(&dir.join("one"))
    );
}

/// `--overlap-param-gather` under dp2 (each step's parameter all-gathers
/// pending into the next step's forward, met by the validation runs and
/// the checkpoint of a stopped run) changes no bit of the losses or the
/// validation losses of a run that stops after two steps and resumes,
/// against the same buckets without the overlap.
#[test]
fn overlapped_param_gather_stops_and_resumes_with_the_same_bits() {
    let dir = scratch("pgather");
    let run = |name: &str, overlap: bool| {
        let out = dir.join(name);
        let mut args = vec![
            "--steps",
            "4",
            "--ranks",
            "2",
            "--layout",
            "dp=2",
            "--micro-batches",
            "2",
            "--ddp-bucket-size",
            "2000",
            "--exit-after",
            "2",
            // The checkpoint at step 2 meets the gathers pending, the
            // validation at step 3 those of the resumed run.
            "--eval-every",
            "3",
        ];
        if overlap {
            args.push("--overlap-param-gather");
        }
        // FAST's flags but its `--eval-every`.
        let at = FAST.iter().position(|f| *f == "--eval-every").unwrap();
        let mut all = vec!["train", "--out", out.to_str().unwrap()];
        all.extend(
            FAST.iter()
                .enumerate()
                .filter(|(i, _)| *i != at && *i != at + 1)
                .map(|(_, f)| *f),
        );
        all.extend_from_slice(&args);
        let first = foldmoe(&all);
        assert!(first.status.success(), "{}", stderr(&first));
        let resumed = foldmoe(&["train", "--resume", out.to_str().unwrap()]);
        assert!(resumed.status.success(), "{}", stderr(&resumed));
        let text = std::fs::read_to_string(out.join("summary.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        (v["losses"].clone(), v["val_losses"].clone())
    };
    let (want, got) = (run("plain", false), run("overlap", true));
    assert_eq!(want.0.as_array().map(Vec::len), Some(4), "{want:?}");
    assert!(want.1.as_array().is_some_and(|v| !v.is_empty()), "{want:?}");
    assert_eq!(got, want);
}

/// Context parallelism under `--layout`: two cp ranks (each holding two of
/// the four chunks of every sequence) train like one rank.
#[test]
fn context_parallel_run_matches_one_rank() {
    let dir = scratch("cp");
    let one = train(&dir.join("one"), &["--steps", "2"]);
    assert!(one.status.success(), "{}", stderr(&one));
    let cp = train(
        &dir.join("cp"),
        &["--steps", "2", "--ranks", "2", "--layout", "cp=2"],
    );
    assert!(cp.status.success(), "{}", stderr(&cp));
    let (want, got) = (losses(&dir.join("one")), losses(&dir.join("cp")));
    assert_eq!(want.len(), got.len());
    for (step, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {step}: {a} vs {b}");
    }
}

#[test]
fn bad_parallel_flags_give_one_line_errors() {
    let dir = scratch("badranks");
    assert_fails_with(
        &train(&dir.join("a"), &["--ranks", "3", "--layout", "tp=2"]),
        "tp",
    );
    assert_fails_with(
        &train(&dir.join("b"), &["--ranks", "2", "--micro-batches", "3"]),
        "--micro-batches 3",
    );
    assert_fails_with(
        &train(
            &dir.join("c"),
            &["--ranks", "2", "--layout", "world=4,ep=2"],
        ),
        "--ranks 2",
    );
    assert_fails_with(
        &train(&dir.join("d"), &["--capacity-factor", "0"]),
        "capacity-factor",
    );
    assert_fails_with(
        &train(&dir.join("e"), &["--ranks", "2", "--layout", "cp=3"]),
        "cp(3)",
    );
    assert_fails_with(
        &train(
            &dir.join("f"),
            &[
                "--ranks",
                "2",
                "--layout",
                "pp=2,vpp=2",
                "--micro-batches",
                "3",
            ],
        ),
        "multiple of pp = 2",
    );
    let g = dir.join("g");
    assert_fails_with(
        &train(&g, &["--ranks", "2", "--overlap-moe-expert-parallel-comm"]),
        "needs ep > 1",
    );
    assert!(!g.exists(), "a refused run created its directory");
    let h = dir.join("h");
    assert_fails_with(
        &train(
            &h,
            &[
                "--ranks",
                "2",
                "--layout",
                "ep=2",
                "--overlap-moe-expert-parallel-comm",
            ],
        ),
        "leave none to pair",
    );
    assert!(!h.exists(), "a refused run created its directory");
}

#[test]
fn train_accepts_a_model_config_file() {
    let dir = scratch("modelcfg");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/configs/tiny.toml");
    let from_file = train(
        &dir.join("file"),
        &["--steps", "2", "--model-config", config.to_str().unwrap()],
    );
    assert!(from_file.status.success(), "{}", stderr(&from_file));
    let named = train(&dir.join("named"), &["--steps", "2"]);
    assert!(named.status.success(), "{}", stderr(&named));
    assert_eq!(losses(&dir.join("file")), losses(&dir.join("named")));
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "name = \"x\"\nvocab = 0\n").unwrap();
    assert_fails_with(
        &train(&dir.join("bad"), &["--model-config", bad.to_str().unwrap()]),
        "--model-config",
    );
}

#[test]
fn a_device_from_the_config_file_is_never_silently_the_cpu() {
    let dir = scratch("cfgdevice");
    let cfg = dir.join("cuda.toml");
    std::fs::write(&cfg, "device = \"cuda\"\n").unwrap();
    let out = dir.join("run");
    let o = train(&out, &["--config", cfg.to_str().unwrap()]);
    assert_fails_with(&o, "--device cuda");
    assert!(!out.exists(), "nothing is created for a refused run");
}

/// `--layers N` keeps the model's first N blocks: the run trains fewer
/// parameters, keeps the cut on resume, and a bad N is a one-line error.
#[test]
fn layers_cuts_the_model_and_is_kept_on_resume() {
    let dir = scratch("layers");
    let params = |run: &Path| {
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap())
                .unwrap();
        s["params_total"].as_u64().unwrap()
    };
    let (full, cut) = (dir.join("full"), dir.join("cut"));
    let o = train(&full, &["--model", "tiny", "--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = train(&cut, &["--model", "tiny", "--layers", "2", "--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        params(&cut) < params(&full),
        "--layers 2: {} parameters, the whole model {}",
        params(&cut),
        params(&full)
    );
    let cut_params = params(&cut);
    let resumed = foldmoe(&["train", "--resume", cut.to_str().unwrap(), "--steps", "3"]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(params(&cut), cut_params, "the resumed run keeps the cut");
    assert_eq!(losses(&cut).len(), 3);
    assert_fails_with(
        &foldmoe(&["train", "--resume", cut.to_str().unwrap(), "--layers", "3"]),
        "--layers 3",
    );
    for bad in ["0", "9"] {
        let out = dir.join(format!("bad{bad}"));
        assert_fails_with(&train(&out, &["--layers", bad]), &format!("--layers {bad}"));
        assert!(!out.exists(), "nothing is created for a refused run");
    }
}

/// A run directory is owned by one run (issue 24, cases 1–5 and 8): a
/// resume into another run's directory, a resume of a finished run, a
/// different --model-config on resume, and a fresh run into a directory
/// with any run file are one-line errors that change no file; a resume into
/// an empty directory continues there and leaves the source untouched; the
/// resumed metrics hold each step once.
#[test]
fn run_directories_are_never_overwritten_and_resume_restores_the_log() {
    let dir = scratch("own");
    let (a, b) = (dir.join("a"), dir.join("b"));
    assert!(train(&a, &["--steps", "4", "--checkpoint-every", "2"])
        .status
        .success());
    assert!(train(&b, &["--steps", "2"]).status.success());
    let snapshot = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let mut files = Vec::new();
        let mut stack = vec![d.to_path_buf()];
        while let Some(p) = stack.pop() {
            for e in std::fs::read_dir(&p).unwrap().flatten() {
                let path = e.path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    files.push((path.display().to_string(), std::fs::read(&path).unwrap()));
                }
            }
        }
        files.sort();
        files
    };
    let (a0, b0) = (snapshot(&a), snapshot(&b));
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());
    // 1. --resume A --out B, B holding another run.
    assert_fails_with(
        &foldmoe(&["train", "--resume", a_s, "--out", b_s, "--steps", "6"]),
        "with --resume",
    );
    // 2. A finished run.
    assert_fails_with(
        &foldmoe(&["train", "--resume", a_s, "--steps", "4"]),
        "already at step 4",
    );
    // 3. Another model's config on resume.
    let config = dir.join("other.toml");
    let tiny = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/configs/tiny.toml"),
    )
    .unwrap();
    std::fs::write(&config, tiny.replace("expert_ffn = 128", "expert_ffn = 64")).unwrap();
    assert_fails_with(
        &foldmoe(&[
            "train",
            "--resume",
            a_s,
            "--model-config",
            config.to_str().unwrap(),
            "--steps",
            "6",
        ]),
        "not the checkpoint's",
    );
    // Flags that change the model's math or the data.
    assert_fails_with(
        &foldmoe(&[
            "train",
            "--resume",
            a_s,
            "--steps",
            "6",
            "--batch-tokens",
            "512",
        ]),
        "--batch-tokens 512 (the checkpoint's run has 256)",
    );
    assert_fails_with(
        &foldmoe(&["train", "--resume", a_s, "--steps", "6", "--dtype", "bf16"]),
        "--dtype bf16",
    );
    // 6. A batch no memory holds.
    assert_fails_with(
        &foldmoe(&[
            "train",
            "--out",
            dir.join("huge").to_str().unwrap(),
            "--batch-tokens",
            "12800000",
        ]),
        "the memory planner estimates",
    );
    // 4 and 5. A fresh run into a directory holding only a log, or only a
    // checkpoint.old.
    for file in ["metrics.jsonl", "checkpoint.old"] {
        let d = dir.join(format!("only-{file}"));
        std::fs::create_dir_all(d.join(file).parent().unwrap()).unwrap();
        if file.ends_with(".old") {
            std::fs::create_dir_all(d.join(file)).unwrap();
        } else {
            std::fs::write(d.join(file), "{\"step\": 1}\n").unwrap();
        }
        assert_fails_with(
            &train(&d, &["--steps", "1"]),
            &format!("already holds a run ({file})"),
        );
    }
    assert_eq!(snapshot(&a), a0, "a refused command changed the run in a");
    assert_eq!(snapshot(&b), b0, "a refused command changed the run in b");
    // A resume into an empty directory continues there, from a's step 4.
    let c = dir.join("c");
    let o = foldmoe(&[
        "train",
        "--resume",
        a_s,
        "--out",
        c.to_str().unwrap(),
        "--steps",
        "6",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(snapshot(&a), a0, "the resumed-from run changed");
    let steps = |d: &Path| -> Vec<u64> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(steps(&c), (1..=6).collect::<Vec<_>>());
    // c's TensorBoard files: a's (steps 1-4) copied, then c's own (5-6).
    let loss_events = |d: &Path| -> usize {
        event_files(d)
            .iter()
            .flat_map(|f| records(f))
            .filter(|r| r.windows(9).any(|w| w == b"\x0a\x07lm loss"))
            .count()
    };
    assert_eq!(event_files(&c).len(), 2);
    assert_eq!(loss_events(&c), 6);
    // After a kill between checkpoints the log runs past the checkpoint: a
    // resume cuts it back and writes each step once.
    let mut log = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    log.push_str("{\"step\": 5, \"loss\": 1.0}\n");
    std::fs::write(a.join("metrics.jsonl"), log).unwrap();
    let o = foldmoe(&["train", "--resume", a_s, "--steps", "6"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(steps(&a), (1..=6).collect::<Vec<_>>());
    assert_eq!(loss_events(&a), 6);
}

/// A run that stops before its first checkpoint does not claim one.
#[test]
fn a_failure_before_any_checkpoint_says_none_was_written() {
    let run = scratch("nockpt").join("run");
    let o = train(
        &run,
        &["--steps", "4", "--lr", "1e30", "--checkpoint-every", "100"],
    );
    assert_fails_with(&o, "no checkpoint was written");
}

/// `generate` streams (issue 24, case 7): a Ctrl-C keeps every byte printed
/// so far and exits 130 with one line; too many bytes asked is a one-line
/// error before anything loads.
#[test]
fn generate_streams_and_stops_cleanly_on_ctrl_c() {
    let run = scratch("genstream").join("run");
    assert!(train(&run, &["--steps", "1"]).status.success());
    assert_fails_with(
        &foldmoe(&[
            "generate",
            "--checkpoint",
            run.to_str().unwrap(),
            "--tokens",
            "1000001",
        ]),
        "--tokens 1000001",
    );
    let mut child = foldmoe_command()
        .args([
            "generate",
            "--checkpoint",
            run.to_str().unwrap(),
            "--tokens",
            "1000000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupt once bytes have arrived: they come as they are made.
    let mut stdout = child.stdout.take().unwrap();
    let mut printed = vec![0u8; 8];
    std::io::Read::read_exact(&mut stdout, &mut printed).unwrap();
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    std::io::Read::read_to_end(&mut stdout, &mut printed).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let line = stderr(&o);
    let made: usize = line
        .trim()
        .strip_prefix("error: interrupted after ")
        .and_then(|rest| rest.strip_suffix(" bytes"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(
        made >= 8,
        "{made} bytes made, 8 printed before the interrupt"
    );
    // Every byte made was printed (plus the closing newline).
    assert_eq!(printed.len(), made + 1);
}
