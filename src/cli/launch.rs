//! `foldmoe launch`: one process per rank on this node (docs/ARCHITECTURE.md §7).
//!
//! Starts `--nproc-per-node` copies of this executable with the
//! torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) set, so each one is one rank of the run and
//! meets the others through the rendezvous on the master address. It
//! forwards SIGINT and SIGTERM to them, and when one rank fails (a non-zero
//! exit or a signal) it gives the others `--timeout` seconds to stop (they
//! normally fail at once, their peer's connection gone), kills those still
//! running, and reports the rank that failed first.

use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::cli::error::CliError;

/// Variable giving every rank's communicator timeout, in seconds (set by
/// `launch` from `--timeout`; 30 s when unset).
pub const TIMEOUT_VAR: &str = "FOLDMOE_COMM_TIMEOUT";
/// The communicator timeout when [`TIMEOUT_VAR`] is unset: long enough for
/// a slow rank's step on a loaded CPU, short enough that a lost rank is
/// reported within a minute.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The master port of a multi-node run when `--master-port` is not given
/// (torchrun's).
const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// The options of `foldmoe launch`.
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchOptions {
    /// Processes (ranks) to start on this node.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Nodes taking part (each runs `foldmoe launch` with its --node-rank).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, from 0 to --nnodes - 1 (node 0 hosts rank 0).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, where rank 0 listens (default 127.0.0.1; needed
    /// with several nodes).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Port of rank 0's rendezvous (default: a free port on one node, 29500
    /// on several).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Seconds a rank waits for a silent peer, and this command waits for
    /// the other ranks once one has failed.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
    /// The foldmoe command every process runs, after `--` (e.g. `-- train
    /// --layout ep=2`).
    #[arg(last = true, value_name = "FOLDMOE ARGS")]
    pub command: Vec<String>,
}

/// The communicator timeout of this process: [`TIMEOUT_VAR`] or
/// [`DEFAULT_TIMEOUT`].
pub fn comm_timeout() -> Result<Duration, CliError> {
    match std::env::var(TIMEOUT_VAR) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(text) => seconds(&text).ok_or_else(|| {
            CliError::usage(format!(
                "{TIMEOUT_VAR} = {text:?}: must be a positive number of seconds"
            ))
        }),
    }
}

/// A positive, finite number of seconds.
fn seconds(text: &str) -> Option<Duration> {
    let s: f64 = text.trim().parse().ok()?;
    (s.is_finite() && s > 0.0 && s < 1e9).then(|| Duration::from_secs_f64(s))
}

/// The last SIGINT or SIGTERM received and not yet forwarded (0: none).
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn note_signal(sig: libc::c_int) {
    // Only an atomic store: the one thing a signal handler may safely do
    // here; the main loop forwards it.
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to [`note_signal`] instead of ending this
/// process, so it can pass them on and still collect its children.
fn catch_signals() -> Result<(), CliError> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installs a handler that only stores to an atomic, which
        // is async-signal-safe; `sa` is fully initialised before use.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = note_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(CliError::usage(format!(
                "launch: cannot install the handler of signal {sig}: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

/// The name of a signal number, for messages.
fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGHUP => "SIGHUP",
        libc::SIGILL => "SIGILL",
        libc::SIGINT => "SIGINT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// "exited with status 1" or "was killed by signal 6 (SIGABRT)".
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        (None, None) => format!("ended ({status})"),
    }
}

/// The checked launch plan.
struct Plan {
    world: usize,
    first_rank: usize,
    master_addr: String,
    master_port: u16,
    timeout: Duration,
}

fn check(opts: &LaunchOptions) -> Result<Plan, CliError> {
    let bad = |msg: String| Err(CliError::usage(format!("launch: {msg}")));
    if opts.nproc_per_node == 0 {
        return bad("--nproc-per-node 0: must be at least 1".into());
    }
    if opts.nnodes == 0 {
        return bad("--nnodes 0: must be at least 1".into());
    }
    if opts.node_rank >= opts.nnodes {
        return bad(format!(
            "--node-rank {} is not below --nnodes {}",
            opts.node_rank, opts.nnodes
        ));
    }
    let Some(timeout) = seconds(&opts.timeout.to_string()) else {
        return bad(format!(
            "--timeout {}: must be a positive number of seconds",
            opts.timeout
        ));
    };
    match opts.command.first().map(String::as_str) {
        None => {
            return bad(
                "nothing to run: give the foldmoe command after `--`, e.g. `foldmoe launch \
                 --nproc-per-node 2 -- train --layout ep=2`"
                    .into(),
            )
        }
        Some("launch") => return bad("the command after `--` cannot be `launch` itself".into()),
        Some(_) => {}
    }
    let master_addr = match (&opts.master_addr, opts.nnodes) {
        (Some(a), _) => a.clone(),
        (None, 1) => "127.0.0.1".to_string(),
        (None, n) => {
            return bad(format!(
                "--nnodes {n}: give --master-addr, the address of node 0 (where rank 0 listens)"
            ))
        }
    };
    let master_port = match (opts.master_port, opts.nnodes) {
        (Some(0), _) => return bad("--master-port 0: give a port from 1 to 65535".into()),
        (Some(p), _) => p,
        (None, 1) => free_port(&master_addr)?,
        (None, _) => DEFAULT_MULTI_NODE_PORT,
    };
    Ok(Plan {
        world: opts.nnodes * opts.nproc_per_node,
        first_rank: opts.node_rank * opts.nproc_per_node,
        master_addr,
        master_port,
        timeout,
    })
}

/// A port free on `addr` right now, for a one-node run: two runs on one
/// machine then do not collide on a fixed port. (Another program could take
/// it before rank 0 binds it; rank 0 then fails naming the address.)
fn free_port(addr: &str) -> Result<u16, CliError> {
    std::net::TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| CliError::usage(format!("launch: cannot find a free port on {addr}: {e}")))
}

/// One started rank.
struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    /// The rank's stderr reader: other lines are forwarded as they come,
    /// its `error:` lines kept for the launcher's own report.
    errors: Option<std::thread::JoinHandle<Vec<String>>>,
}

/// Forwards `stderr` of a rank line by line, except its `error:` lines,
/// which it returns (without the prefix) for the launcher to print once.
fn read_errors(stderr: std::process::ChildStderr) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let mut kept = Vec::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(|l| l.ok())
        {
            match line.strip_prefix("error: ") {
                Some(msg) => kept.push(msg.to_string()),
                None => {
                    let _ = writeln!(std::io::stderr(), "{line}");
                }
            }
        }
        kept
    })
}

/// Every rank's error messages, each distinct one once with the ranks that
/// gave it: `rank 1: …; ranks 0, 2: …`.
fn rank_errors(ranks: &mut [Rank]) -> String {
    let mut by_msg: Vec<(String, Vec<usize>)> = Vec::new();
    for r in ranks.iter_mut() {
        let msgs = r
            .errors
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        for msg in msgs {
            match by_msg.iter_mut().find(|(m, _)| *m == msg) {
                Some((_, who)) => who.push(r.rank),
                None => by_msg.push((msg, vec![r.rank])),
            }
        }
    }
    by_msg
        .into_iter()
        .map(|(msg, who)| {
            let names: Vec<String> = who.iter().map(|r| r.to_string()).collect();
            let label = if who.len() == 1 { "rank" } else { "ranks" };
            format!("{label} {}: {msg}", names.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Runs `foldmoe launch`: starts the ranks of this node, waits for them,
/// and fails naming the first rank that failed.
pub fn run(opts: LaunchOptions) -> Result<(), CliError> {
    let plan = check(&opts)?;
    let exe = std::env::current_exe()
        .map_err(|e| CliError::usage(format!("launch: cannot find this executable: {e}")))?;
    catch_signals()?;
    let mut ranks: Vec<Rank> = Vec::with_capacity(opts.nproc_per_node);
    for local in 0..opts.nproc_per_node {
        let rank = plan.first_rank + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&opts.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", plan.world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", opts.nproc_per_node.to_string())
            .env("MASTER_ADDR", &plan.master_addr)
            .env("MASTER_PORT", plan.master_port.to_string())
            .env(TIMEOUT_VAR, plan.timeout.as_secs_f64().to_string());
        die_with_parent(&mut cmd);
        cmd.stderr(std::process::Stdio::piped());
        match cmd.spawn() {
            Ok(mut child) => {
                let errors = child.stderr.take().map(read_errors);
                ranks.push(Rank {
                    rank,
                    child,
                    status: None,
                    errors,
                })
            }
            Err(e) => {
                for r in &mut ranks {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                }
                return Err(CliError::usage(format!(
                    "launch: cannot start rank {rank} ({}): {e}",
                    exe.display()
                )));
            }
        }
    }
    supervise(&mut ranks, plan.timeout)
}

/// Linux: the child gets SIGTERM when this process dies (even by SIGKILL),
/// so no rank is left running on its own.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only async-signal-safe functions (prctl, getppid, raise).
    let parent = std::process::id() as libc::pid_t;
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            // The parent may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::raise(libc::SIGTERM);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// Waits for every rank, forwarding signals; after the first failure, waits
/// at most `timeout` for the others and then kills them.
fn supervise(ranks: &mut [Rank], timeout: Duration) -> Result<(), CliError> {
    let mut forwarded: Option<i32> = None;
    // The first rank that failed, and what happened to it.
    let mut first: Option<(usize, String)> = None;
    let mut stop_by: Option<Instant> = None;
    let mut killed: Vec<usize> = Vec::new();
    loop {
        let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            forwarded = Some(sig);
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                // SAFETY: plain kill(2) on a child not yet reaped, so its pid
                // cannot have been reused.
                unsafe {
                    libc::kill(r.child.id() as libc::pid_t, sig);
                }
            }
        }
        // Failures seen in one sweep: a rank killed by a signal is more
        // likely the cause than its peers' errors about losing it.
        let mut failed_now: Vec<(usize, ExitStatus)> = Vec::new();
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    r.status = Some(status);
                    if !status.success() {
                        failed_now.push((r.rank, status));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(CliError::usage(format!(
                        "launch: cannot wait for rank {}: {e}",
                        r.rank
                    )))
                }
            }
        }
        if first.is_none() {
            use std::os::unix::process::ExitStatusExt;
            let cause = failed_now
                .iter()
                .find(|(_, s)| s.signal().is_some())
                .or(failed_now.first());
            if let Some(&(rank, status)) = cause {
                first = Some((rank, describe(status)));
                stop_by = Some(Instant::now() + timeout);
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        if stop_by.is_some_and(|t| Instant::now() >= t) {
            for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
                let _ = r.child.kill();
                r.status = r.child.wait().ok();
                killed.push(r.rank);
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    // The ranks have exited: their readers end with their pipes.
    let said = rank_errors(ranks);
    let Some((rank, what)) = first else {
        return Ok(());
    };
    let said = if said.is_empty() {
        String::new()
    } else {
        format!("; {said}")
    };
    let others = if killed.is_empty() {
        "the other ranks stopped".to_string()
    } else {
        format!(
            "ranks {killed:?} did not stop within {:?} and were killed",
            timeout
        )
    };
    if let Some(sig) = forwarded {
        // Interrupted by the user: the ranks saved what they could.
        return Err(CliError::Exit {
            code: 128 + sig,
            msg: format!(
                "launch: interrupted ({} forwarded to the ranks); rank {rank} {what}; {others}{said}",
                signal_name(sig)
            ),
        });
    }
    Err(CliError::Exit {
        code: 1,
        msg: format!("launch: rank {rank} {what}; {others}{said}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(nproc: usize, command: &[&str]) -> LaunchOptions {
        LaunchOptions {
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: None,
            master_port: Some(29400),
            timeout: 30.0,
            command: command.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn error(o: &LaunchOptions) -> String {
        match check(o) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_plan_numbers_ranks_by_node() {
        let mut o = opts(4, &["train"]);
        o.nnodes = 3;
        o.node_rank = 2;
        o.master_addr = Some("node0".into());
        o.master_port = None;
        let p = check(&o).unwrap();
        assert_eq!((p.world, p.first_rank), (12, 8));
        assert_eq!((p.master_addr.as_str(), p.master_port), ("node0", 29500));
        let p = check(&opts(2, &["train"])).unwrap();
        assert_eq!(
            (p.world, p.first_rank, p.master_addr.as_str()),
            (2, 0, "127.0.0.1")
        );
    }

    #[test]
    fn bad_options_are_named() {
        assert!(error(&opts(0, &["train"])).contains("--nproc-per-node 0"));
        assert!(error(&opts(2, &[])).contains("after `--`"));
        assert!(error(&opts(2, &["launch"])).contains("cannot be `launch`"));
        let mut o = opts(2, &["train"]);
        o.node_rank = 1;
        assert!(error(&o).contains("--node-rank 1 is not below --nnodes 1"));
        let mut o = opts(2, &["train"]);
        o.nnodes = 2;
        o.node_rank = 1;
        assert!(error(&o).contains("--master-addr"));
        let mut o = opts(2, &["train"]);
        o.timeout = 0.0;
        assert!(error(&o).contains("--timeout 0"));
        assert_eq!(seconds("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(seconds("-1"), None);
        assert_eq!(seconds("inf"), None);
    }
}
