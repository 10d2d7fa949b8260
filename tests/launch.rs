//! `foldmoe launch`: one process per rank, end to end with the built
//! binary. The processes of a run must train exactly like the same ranks as
//! threads, and a rank that dies or never appears must stop the run with an
//! error naming it, never a hang.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{foldmoe_command, losses, scratch, stderr};
use std::time::{Duration, Instant};

fn run(c: &mut Command) -> Output {
    c.output().expect("the foldmoe binary runs")
}

/// Small, fast training flags (as tests/cli.rs: 2 sequences of 128 bytes
/// per step).
fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--out",
        out.to_str().unwrap(),
        "--batch-tokens",
        "256",
        "--sample-tokens",
        "0",
        "--eval-every",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn launch_args(nproc: usize, timeout: &str, train: Vec<String>) -> Vec<String> {
    let mut args: Vec<String> = [
        "launch",
        "--nproc-per-node",
        &nproc.to_string(),
        "--timeout",
        timeout,
        "--",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(train);
    args
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The `error:` lines of a failed run, with a check that there is one.
fn error_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected failure: {}", stderr(o));
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got {err:?}");
    lines[0].to_string()
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn processes_train_exactly_like_threads() {
    let dir = scratch("equal");
    for (n, layout) in [(2, "ep=2"), (4, "tp=2,ep=2")] {
        let threads = dir.join(format!("threads-{n}"));
        let procs = dir.join(format!("procs-{n}"));
        let steps = ["--steps", "3", "--layout", layout];
        let mut with_ranks = steps.to_vec();
        let ranks = n.to_string();
        with_ranks.extend(["--ranks", &ranks]);
        let t = run(foldmoe_command().args(train_args(&threads, &with_ranks)));
        assert!(t.status.success(), "{}", stderr(&t));
        let p = run(foldmoe_command().args(launch_args(n, "60", train_args(&procs, &steps))));
        assert!(p.status.success(), "{}", stderr(&p));
        let (want, got) = (losses(&threads), losses(&procs));
        assert_eq!(got.len(), 3);
        // Bit for bit: the TCP communicator adds in the same order as the
        // threads' one.
        assert_eq!(
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{n} processes ({layout}): {got:?} vs threads {want:?}"
        );
        // Only rank 0 talks.
        let out = stdout(&p);
        assert_eq!(out.matches("foldmoe: training").count(), 1, "{out}");
        assert_eq!(out.matches("done:").count(), 1, "{out}");
        assert!(out.contains(&format!("on {n} ranks")), "{out}");
        assert!(procs.join("checkpoints/latest").exists());
    }
}

#[test]
fn a_rank_that_dies_stops_the_run_naming_it() {
    let dir = scratch("dies");
    let start = Instant::now();
    let o = run(foldmoe_command()
        .args(launch_args(
            2,
            "20",
            train_args(&dir.join("run"), &["--steps", "50", "--layout", "ep=2"]),
        ))
        .env("FOLDMOE_TEST_EXIT_AT_STEP", "1:2"));
    let took = start.elapsed();
    assert!(!o.status.success());
    let err = stderr(&o);
    let line = err
        .lines()
        .find(|l| l.starts_with("error: launch:"))
        .unwrap_or_else(|| panic!("no launch error line in {err:?}"));
    assert!(
        line.contains("rank 1 was killed by signal 6 (SIGABRT)"),
        "{line}"
    );
    // Rank 0 learnt of it from its lost connection, not from a timeout.
    assert!(line.contains("the other ranks stopped"), "{line}");
    assert!(err.contains("rank 1 disconnected"), "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_rank_that_never_appears_is_named_after_the_timeout() {
    let dir = scratch("absent");
    let port = free_port().to_string();
    let start = Instant::now();
    let o = run(foldmoe_command()
        .args(train_args(
            &dir.join("run"),
            &["--steps", "2", "--layout", "tp=2,ep=2"],
        ))
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
            ("FOLDMOE_COMM_TIMEOUT", "2"),
        ]));
    let line = error_line(&o);
    assert!(
        line.contains("ranks [1, 2, 3] of WORLD_SIZE = 4 never connected"),
        "{line}"
    );
    // A rank whose rank 0 never appears names the address it tried.
    let o = run(foldmoe_command()
        .args(train_args(&dir.join("run1"), &["--steps", "2"]))
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
            ("FOLDMOE_COMM_TIMEOUT", "2"),
        ]));
    let line = error_line(&o);
    assert!(
        line.contains(&format!(
            "could not reach rank 0 at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}"
        )),
        "{line}"
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(
        !dir.join("run1").exists(),
        "a rank other than 0 wrote its --out"
    );
}

#[test]
fn bad_launch_arguments_and_variables_are_one_line_errors() {
    let dir = scratch("bad");
    let line = error_line(&run(foldmoe_command().args([
        "launch",
        "--nproc-per-node",
        "0",
        "--",
        "train",
    ])));
    assert!(
        line.contains("--nproc-per-node 0: must be at least 1"),
        "{line}"
    );
    let line = error_line(&run(foldmoe_command().args([
        "launch",
        "--nproc-per-node",
        "2",
    ])));
    assert!(
        line.contains("give the foldmoe command after `--`"),
        "{line}"
    );
    // Without `--` the command's words are not taken for launch's own.
    let line = error_line(&run(foldmoe_command().args([
        "launch",
        "--nproc-per-node",
        "2",
        "train",
    ])));
    assert!(line.contains("train"), "{line}");
    let line = error_line(&run(foldmoe_command()
        .args(train_args(&dir.join("a"), &[]))
        .envs([("WORLD_SIZE", "2"), ("RANK", "2")])));
    assert!(
        line.contains("RANK = \"2\" is not below WORLD_SIZE = 2"),
        "{line}"
    );
    let line = error_line(&run(foldmoe_command()
        .args(train_args(&dir.join("b"), &[]))
        .envs([("WORLD_SIZE", "two")])));
    assert!(line.contains("WORLD_SIZE = \"two\""), "{line}");
    // --ranks must agree with the processes; every rank says so at once
    // (no waiting for each other), then launch names the first.
    let start = Instant::now();
    let o = run(foldmoe_command().args(launch_args(
        2,
        "20",
        train_args(&dir.join("c"), &["--ranks", "3"]),
    )));
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("--ranks 3 but WORLD_SIZE = 2"), "{err}");
    assert!(err.contains("error: launch: rank "), "{err}");
    // Every rank's error once, by the launcher, naming the ranks.
    assert_eq!(
        err.matches("--ranks 3 but WORLD_SIZE = 2").count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("ranks 0, 1: --ranks 3 but WORLD_SIZE = 2"),
        "{err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error")).count(),
        1,
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(15));
    assert!(!dir.join("c").exists());
}

#[test]
fn interrupting_launch_checkpoints_every_rank_and_exits_130() {
    let run_dir = scratch("sigint").join("run");
    let child = foldmoe_command()
        .args(launch_args(
            2,
            "30",
            train_args(&run_dir, &["--steps", "100000", "--layout", "ep=2"]),
        ))
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = run_dir.join("metrics.jsonl");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 2 {
        assert!(Instant::now() < deadline, "training never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    // To launch alone: it forwards the signal to its ranks.
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted at step"), "{err}");
    assert!(
        err.contains("launch: interrupted (SIGINT forwarded"),
        "{err}"
    );
    assert!(run_dir.join("checkpoints/latest").exists());
}
