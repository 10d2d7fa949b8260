//! Crash safety of distributed checkpoints: a training process killed with
//! SIGKILL at random moments (most of its time is spent saving, with a
//! checkpoint every step) always leaves a checkpoint that resumes.

mod common;

use std::time::{Duration, Instant};

use common::{foldmoe, foldmoe_command, scratch, stderr};

#[test]
fn sigkill_during_saves_always_leaves_a_checkpoint_that_resumes() {
    let dir = scratch("crash");
    // A deterministic spread of kill delays after the first checkpoint.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next_delay = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        Duration::from_millis(50 + state % 900)
    };
    let mut kept_steps = Vec::new();
    for attempt in 0..5 {
        let run = dir.join(format!("run{attempt}"));
        let mut child = foldmoe_command()
            .args([
                "train",
                "--out",
                run.to_str().unwrap(),
                "--ranks",
                "2",
                "--layout",
                "tp=2",
                "--batch-tokens",
                "256",
                "--sample-tokens",
                "0",
                "--eval-every",
                "1000",
                "--steps",
                "1000",
                "--checkpoint-every",
                "1",
                "--keep-checkpoints",
                "2",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("the foldmoe binary runs");
        let latest = run.join("checkpoints").join("latest");
        let started = Instant::now();
        while !latest.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "attempt {attempt}: no checkpoint after 120 s"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "attempt {attempt}: exited early"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(next_delay());
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let name = std::fs::read_to_string(&latest).unwrap();
        kept_steps.push(name.trim().to_string());
        // Every rank's slices, moments included, load and verify; one more
        // step trains and saves.
        let o = foldmoe(&[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--exit-after",
            "1",
            "--sample-tokens",
            "0",
        ]);
        assert!(
            o.status.success(),
            "attempt {attempt} (killed after {}): resume failed: {}",
            name.trim(),
            stderr(&o)
        );
    }
    println!("killed with latest at {kept_steps:?}; every one resumed");
}
