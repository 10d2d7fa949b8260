//! Helpers of the tests that run the built `foldmoe` binary. Each test file
//! uses some of them, hence the `dead_code` allowances.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built binary, without the variables a launcher around the test run
/// may have set (a test run must not join someone else's world).
#[allow(dead_code)]
pub fn foldmoe_command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_foldmoe"));
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "FOLDMOE_COMM_TIMEOUT",
        "FOLDMOE_TEST_EXIT_AT_STEP",
    ] {
        c.env_remove(var);
    }
    c
}

/// Runs the binary with `args` to the end.
#[allow(dead_code)]
pub fn foldmoe(args: &[&str]) -> Output {
    foldmoe_command()
        .args(args)
        .output()
        .expect("the foldmoe binary runs")
}

/// An empty directory of this test process named by `tag`, removed with
/// everything in it when the value is dropped (a test's runs and
/// checkpoints do not pile up in the temporary directory).
#[allow(dead_code)]
pub fn scratch(tag: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("foldmoe-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A test's scratch directory (see [`scratch`]).
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The run's stderr as text.
#[allow(dead_code)]
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Small, fast training flags (2 sequences of 128 tokens per step, no
/// closing sample, validation every 2 steps).
#[allow(dead_code)]
pub const FAST: &[&str] = &[
    "--batch-tokens",
    "256",
    "--sample-tokens",
    "0",
    "--eval-every",
    "2",
];

/// The per-step losses a run wrote to its `summary.json`.
#[allow(dead_code)]
pub fn losses(run: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run.join("summary.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}
