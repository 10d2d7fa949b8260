//! A model crate outside the workspace (`tests/fixtures/model-crate/`), whose
//! only dependency is the facade: it builds, and its binary serves the whole
//! command line over its own declared models and layouts; a declaration the
//! layout rules refuse is a compile error through the facade.
//!
//! The crate is copied to a scratch directory (so nothing is written into
//! the source tree) with the workspace's `Cargo.lock` (the same dependency
//! versions) and built offline into a target directory of its own (the
//! test's `cargo` cannot share the one the running `cargo test` holds).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use common::stderr;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/model-crate");

/// A copy of the fixture crate in `dir`, its facade dependency pointing at
/// this checkout; with `main`, a package of its own name (`my-moe-bad`:
/// cargo keys a package's artifacts by its name and its path relative to
/// its workspace, which two copies share) whose `main.rs` is `main`.
fn copy_crate(dir: &Path, main: Option<&Path>) {
    let root = env!("CARGO_MANIFEST_DIR");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let manifest = std::fs::read_to_string(Path::new(FIXTURE).join("Cargo.toml")).unwrap();
    let mut manifest = manifest.replace("path = \"../../..\"", &format!("path = {root:?}"));
    if main.is_some() {
        manifest = manifest.replace("name = \"my-moe\"", "name = \"my-moe-bad\"");
    }
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::copy(Path::new(root).join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let source = main.map_or(Path::new(FIXTURE).join("src/main.rs"), Path::to_path_buf);
    std::fs::copy(source, dir.join("src/main.rs")).unwrap();
}

/// `cargo build` of the crate in `dir` into `target`, timed.
fn build(dir: &Path, target: &Path) -> (Output, f64) {
    let started = Instant::now();
    let out = Command::new(env!("CARGO"))
        .args(["build", "--offline", "--quiet", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", target)
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    (out, started.elapsed().as_secs_f64())
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn run(bin: &Path, args: &[&str]) -> Output {
    let out = Command::new(bin)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("the model crate's binary runs");
    assert!(out.status.success(), "{args:?} failed: {}", stderr(&out));
    out
}

#[test]
fn a_model_crate_gets_the_whole_command_line() {
    let dir = scratch_dir("model-crate");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("model-crate-target");
    copy_crate(&dir, None);
    let (out, secs) = build(&dir, &target);
    assert!(out.status.success(), "build failed: {}", stderr(&out));
    eprintln!("model crate built in {secs:.1} s");
    let bin = target.join("debug").join("my-moe");

    // `plan` knows the crate's models and their declared layouts.
    let plan = run(
        &bin,
        &[
            "plan",
            "--model",
            "my-moe",
            "--layout",
            "world=4,ep=4",
            "--json",
        ],
    );
    let json: serde_json::Value =
        serde_json::from_slice(&plan.stdout).expect("plan --json is JSON");
    assert_eq!(json["model"], "my-moe", "{json}");
    let unknown = Command::new(&bin)
        .args(["plan", "--model", "tiny"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    let err = stderr(&unknown);
    assert!(
        err.contains("unknown model `tiny`") && err.contains("my-moe, my-moe-small"),
        "{err}"
    );

    // `train` defaults to the first registered model and trains it.
    let runs = scratch_dir("model-crate-runs");
    let one = runs.join("one");
    let args = [
        "train",
        "--steps",
        "3",
        "--batch-tokens",
        "256",
        "--sample-tokens",
        "0",
    ];
    let out = run(
        &bin,
        &[&args[..], &["--out", one.to_str().unwrap()]].concat(),
    );
    let summary = std::fs::read_to_string(one.join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["model"], "my-moe", "{}", stderr(&out));
    assert_eq!(summary["steps"], 3);

    // Four ranks under the declared layout, selected by its name.
    let four = runs.join("four");
    let out = run(
        &bin,
        &[
            &args[..],
            &[
                "--ranks",
                "4",
                "--layout",
                "cpu-ep4",
                "--out",
                four.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    let summary = std::fs::read_to_string(four.join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["steps"], 3, "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&runs);
}

#[test]
fn a_refused_layout_is_a_compile_error_through_the_facade() {
    let dir = scratch_dir("model-crate-bad");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("model-crate-target");
    let bad = Path::new(FIXTURE).join("ui/ep_does_not_divide_experts.rs");
    copy_crate(&dir, Some(&bad));
    let (out, _) = build(&dir, &target);
    assert!(
        !out.status.success(),
        "a layout with ep = 3 over 4 experts built"
    );
    let err = stderr(&out);
    assert!(
        err.contains("ep = 3") && err.contains("experts = 4"),
        "{err}"
    );
}
