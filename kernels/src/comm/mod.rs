//! Collectives between ranks: the [`Communicator`] trait and its
//! implementations (docs/ARCHITECTURE.md §7).
//!
//! - [`local`]: N ranks as threads of one process, exchanging through shared
//!   memory (tests and CPU runs);
//! - [`tcp`]: one process per rank, exchanging host copies over TCP
//!   (multi-process CPU runs started by `foldmoe launch`), with results
//!   bit-identical to [`local`]'s;
//! - [`rendezvous`]: how the processes of a run find each other
//!   (torchrun-style variables, a TCP rendezvous on the master address);
//! - [`timed`]: a wrapper measuring the time spent in collectives.
//!
//! Every collective runs over a [`Group`]: an ordered list of global ranks
//! (the layout's process groups). Reductions add contributions in group
//! order, so a run is bit-reproducible whatever the thread timing.
//!
//! A rank that fails must not leave the others waiting forever: a
//! communicator whose rank aborted (an error or a panic) makes every pending
//! and later collective on the other ranks return [`crate::KernelError::Comm`]
//! within the communicator's timeout.
//!
//! # Started collectives
//!
//! [`Communicator::reduce_scatter_start`],
//! [`Communicator::all_gather_start`] and
//! [`Communicator::all_to_all_v_start`] start a collective and return a
//! [`Pending`] handle at once; [`Pending::wait`] returns its result. The
//! local and TCP communicators run started collectives on a progress thread
//! of the handle, one at a time in the order they were started, while the
//! caller computes: the call takes its place among the group's calls when it
//! is started (so blocking and started calls on a group match their peers'
//! in the order the caller made them), and its values are copied to the
//! host then too, so the caller may change or drop its tensor at once. Every
//! rank must start its collectives in the same order (the progress thread
//! runs them in that order, whatever their groups). Results are the
//! blocking call's, bit for bit (the same code folds the contributions in
//! group order). Failure works as for blocking calls: the wait of a
//! collective whose turn came ends within the timeout, and once one started
//! collective has failed the later ones fail at once, naming the first
//! failure. NCCL queues a started collective on its communication stream
//! and leaves the compute stream free to run ahead; the wait (or dropping
//! the handle) makes the compute stream wait for it, with no host wait
//! (`cuda/nccl.rs`). Communicators without either (the one-rank
//! communicator) use the provided methods, which run the blocking call at
//! the start.

pub mod local;
pub mod rendezvous;
pub mod solo;
pub mod tcp;
pub mod timed;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::Device;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, HostData, Tensor};

/// An ordered set of global ranks that communicate together.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    ranks: Vec<usize>,
}

impl Group {
    /// A group of the given global ranks, in group order (no duplicates).
    pub fn new(ranks: Vec<usize>) -> Self {
        Group { ranks }
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The global ranks, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Position of global `rank` in the group, if it is a member.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }
}

/// How [`Communicator::all_reduce`] combines contributions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum, added in group order.
    Sum,
    /// Elementwise maximum.
    Max,
}

/// Collective operations of one rank over groups of ranks.
///
/// Every member of a group must call the same collectives on that group in
/// the same order; tensors are split and concatenated along dimension 0.
pub trait Communicator<B: Device>: Send + Sync {
    /// This rank's global index.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn world(&self) -> usize;

    /// Every member receives the elementwise `op` of all members' `t`
    /// (same shape and dtype on every member).
    fn all_reduce(&self, b: &B, group: &Group, t: &Tensor<B>, op: ReduceOp) -> Result<Tensor<B>>;
    /// Sum over members, then member `i` keeps the `i`-th of `group.size()`
    /// equal parts along dimension 0 (`t.shape()[0]` divisible by the size).
    fn reduce_scatter(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>>;
    /// Concatenation of every member's `t` along dimension 0, in group order
    /// (shapes may differ in dimension 0 only).
    fn all_gather(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>>;
    /// Member `i` sends rows `[Σ_{j<k} send_rows[j], …+send_rows[k])` of `t`
    /// to member `k`, and receives from every member the rows addressed to
    /// it, concatenated in group order. Returns the received tensor and the
    /// row count received from each member.
    fn all_to_all_v(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Tensor<B>, Vec<usize>)>;
    /// The root member's `t` on every member (`root` is a group index;
    /// non-root members' `t` gives only the expected shape and dtype).
    fn broadcast(&self, b: &B, group: &Group, root: usize, t: &Tensor<B>) -> Result<Tensor<B>>;
    /// Sends `t` to global rank `to` (matched by the next `recv` from this rank there).
    fn send(&self, b: &B, to: usize, t: &Tensor<B>) -> Result<()>;
    /// Receives the next tensor sent by global rank `from`.
    fn recv(&self, b: &B, from: usize) -> Result<Tensor<B>>;
    /// Returns once every member has called it.
    fn barrier(&self, group: &Group) -> Result<()>;
    /// Marks this rank failed with `reason`: the other ranks' pending and
    /// later collectives return an error naming this rank and the reason.
    fn abort(&self, reason: &str);

    /// Starts [`Self::reduce_scatter`] and returns at once (see the module
    /// docs, "Started collectives"); the provided method runs the blocking
    /// call here.
    fn reduce_scatter_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        Ok(Pending::ready(self.reduce_scatter(b, group, t)))
    }
    /// Starts [`Self::all_gather`] and returns at once (see the module docs,
    /// "Started collectives"); the provided method runs the blocking call
    /// here.
    fn all_gather_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        Ok(Pending::ready(self.all_gather(b, group, t)))
    }
    /// How long the device's compute stream waited for this communicator's
    /// collectives since the last call, timed with device events: the
    /// exposed communication of a device communicator, whose calls return
    /// once queued so host clocks miss it (NCCL). `None` where collectives
    /// run on the host (their exposed time is the caller's time blocked in
    /// calls and waits, [`timed::TimedComm`]). The first call starts the
    /// timing and returns zero. Call it once the device has finished its
    /// queued work, or it waits for that.
    fn device_wait_time(&self) -> Result<Option<Duration>> {
        Ok(None)
    }
    /// Starts [`Self::all_to_all_v`] when the caller knows the rows it
    /// will receive from each member (`recv_rows`: the MoE dispatcher has
    /// exchanged its counts first) and returns at once (see the module
    /// docs, "Started collectives"); the wait fails, naming both lists, if
    /// the members sent other counts. The provided method runs the
    /// blocking call here.
    fn all_to_all_v_start(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Pending<B>> {
        let outcome = self
            .all_to_all_v(b, group, t, send_rows)
            .and_then(|(out, got)| {
                let ctx = format!("all_to_all_v on group {:?}", group.ranks());
                check_recv_rows(&ctx, &got, recv_rows).map_err(|detail| KernelError::Comm {
                    rank: self.rank(),
                    detail,
                })?;
                Ok(out)
            });
        Ok(Pending::ready(outcome))
    }
}

/// Why a started `all_to_all_v` that expected `expected` rows from each
/// member but received `got` failed, if it did (`ctx` names the call).
pub(crate) fn check_recv_rows(
    ctx: &str,
    got: &[usize],
    expected: &[usize],
) -> std::result::Result<(), String> {
    if got == expected {
        Ok(())
    } else {
        Err(format!(
            "{ctx}: the members sent {got:?} rows, but this rank was told to expect \
             {expected:?}"
        ))
    }
}

/// One call of this rank on a group, its place among the group's calls
/// taken: the group, this rank's index in it, the call's number on it, and
/// its description. Taken when the caller makes the call, so started and
/// blocking calls keep the caller's order wherever they then run.
pub(crate) struct Call {
    pub(crate) group: Group,
    pub(crate) me: usize,
    pub(crate) seq: u64,
    /// "op on group [..] (call #k on this group)", prefixed to messages.
    pub(crate) ctx: String,
}

impl Call {
    /// Call number `seq` of `op` on `group`, where this rank is member `me`.
    pub(crate) fn new(group: &Group, me: usize, seq: u64, op: Op) -> Self {
        Call {
            group: group.clone(),
            me,
            seq,
            ctx: format!(
                "{} on group {:?} (call #{seq} on this group)",
                op.name(),
                group.ranks()
            ),
        }
    }
}

/// The calls one handle has made on each group, keyed by the group's ranks:
/// the next call's number there.
#[derive(Default)]
pub(crate) struct Calls {
    counts: Mutex<HashMap<Vec<usize>, u64>>,
}

impl Calls {
    /// Checks that `group` is a valid group of a world of `world` ranks
    /// containing `rank`, and takes its next call number there for `op`.
    pub(crate) fn enter(&self, rank: usize, world: usize, group: &Group, op: Op) -> Result<Call> {
        let ranks = group.ranks();
        let bad = |detail: String| crate::error::arg_err(op.name(), detail);
        if let Some(&r) = ranks.iter().find(|&&r| r >= world) {
            return Err(bad(format!(
                "group {ranks:?} names rank {r}, but the world has {world} ranks"
            )));
        }
        for (i, r) in ranks.iter().enumerate() {
            if ranks[..i].contains(r) {
                return Err(bad(format!("group {ranks:?} names rank {r} twice")));
            }
        }
        let me = group
            .index_of(rank)
            .ok_or_else(|| bad(format!("rank {rank} is not a member of group {ranks:?}")))?;
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(ranks.to_vec()).or_insert(0);
        let seq = *count;
        *count += 1;
        Ok(Call::new(group, me, seq, op))
    }
}

/// What a started collective's job delivers: this rank's result as host
/// values and its shape.
pub(crate) type Landed = Result<(HostData, Vec<usize>)>;

/// A collective started by [`Communicator::reduce_scatter_start`] or
/// [`Communicator::all_gather_start`]: [`Self::wait`] gives its result.
/// Dropping it without waiting still lets the collective run (the peers
/// count on this rank's contribution); only its result is lost.
pub struct Pending<B: Device> {
    state: PendingState<B>,
    /// Where the wait adds the time it blocked and the time the collective
    /// ran on its thread ([`timed::TimedComm`]).
    meter: Option<Arc<timed::Meter>>,
}

enum PendingState<B: Device> {
    /// Finished at the start (the provided methods).
    Ready(Result<Tensor<B>>),
    /// Running on a progress thread, which replies on `reply`; the result is
    /// uploaded on the waiting thread, in `dtype`.
    Started {
        b: B,
        /// The result, and how long the collective ran there.
        reply: Receiver<(Landed, Duration)>,
        dtype: DType,
        rank: usize,
        ctx: String,
    },
    /// Queued on the device, with its result's memory already given: the
    /// guard, when dropped, orders the caller's device work queued after it
    /// behind the collective (declared first, so it is dropped first).
    Queued {
        guard: Box<dyn Send>,
        out: Tensor<B>,
    },
}

impl<B: Device> Pending<B> {
    /// A collective that has already finished with `outcome`.
    pub fn ready(outcome: Result<Tensor<B>>) -> Self {
        Pending {
            state: PendingState::Ready(outcome),
            meter: None,
        }
    }

    /// A collective queued on the device that writes `out`; dropping
    /// `guard` must order later device work after it (see
    /// [`PendingState::Queued`]).
    pub fn queued(out: Tensor<B>, guard: Box<dyn Send>) -> Self {
        Pending {
            state: PendingState::Queued { guard, out },
            meter: None,
        }
    }

    /// Whether the collective already finished when it was started (the
    /// provided methods): its time was the start's.
    pub(crate) fn finished_at_start(&self) -> bool {
        matches!(self.state, PendingState::Ready(_))
    }

    /// The same collective, its wait measured into `meter`.
    pub(crate) fn metered(self, meter: Arc<timed::Meter>) -> Self {
        Pending {
            meter: Some(meter),
            ..self
        }
    }

    /// Waits until the collective has finished and returns its result (on
    /// `b`, in the dtype of the tensor it was started with).
    pub fn wait(self) -> Result<Tensor<B>> {
        let waited = Instant::now();
        let (outcome, ran) = match self.state {
            PendingState::Ready(outcome) => (outcome, Duration::ZERO),
            PendingState::Started {
                b,
                reply,
                dtype,
                rank,
                ctx,
            } => match reply.recv() {
                Ok((Ok((values, shape)), ran)) => {
                    (local::upload_as(&b, values, &shape, dtype), ran)
                }
                Ok((Err(e), ran)) => (Err(e), ran),
                Err(_) => (
                    Err(KernelError::Comm {
                        rank,
                        detail: format!("{ctx}: the progress thread stopped before finishing it"),
                    }),
                    Duration::ZERO,
                ),
            },
            // The host does not see the device's time: none is counted.
            PendingState::Queued { guard, out } => {
                drop(guard);
                (Ok(out), Duration::ZERO)
            }
        };
        if let Some(meter) = &self.meter {
            meter.add(waited.elapsed(), ran);
        }
        outcome
    }
}

/// One started collective waiting for its turn on a progress thread.
struct Job {
    /// "op on group [..] (call #k on this group)", for messages.
    ctx: String,
    run: Box<dyn FnOnce() -> Landed + Send>,
    reply: SyncSender<(Landed, Duration)>,
}

/// The progress thread of one communicator handle: runs started
/// collectives one at a time, in the order they were started. Started on
/// the first collective; it ends once the handle is dropped and the
/// collectives queued before are done (it is never joined: a wait for peers
/// ends within the communicator's timeout anyway).
pub(crate) struct Progress {
    rank: usize,
    queue: Mutex<Option<Sender<Job>>>,
}

impl Progress {
    /// The progress thread of rank `rank`'s handle (not started yet).
    pub(crate) fn new(rank: usize) -> Self {
        Progress {
            rank,
            queue: Mutex::new(None),
        }
    }

    /// Queues `run` (collective `ctx`, its place among its group's calls
    /// already taken) behind the collectives started before, and returns
    /// the handle that waits for it, uploading onto `b` as `dtype`.
    pub(crate) fn start<B: Device>(
        &self,
        b: &B,
        dtype: DType,
        ctx: String,
        run: impl FnOnce() -> Landed + Send + 'static,
    ) -> Result<Pending<B>> {
        let rank = self.rank;
        let stopped = |why: String| KernelError::Comm {
            rank,
            detail: format!("{ctx}: cannot start it: {why}"),
        };
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.is_none() {
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name(format!("comm-progress-{rank}"))
                .spawn(move || progress_loop(rank, rx))
                .map_err(|e| stopped(format!("the progress thread did not start: {e}")))?;
            *queue = Some(tx);
        }
        let (reply, reply_rx) = mpsc::sync_channel(1);
        let job = Job {
            ctx: ctx.clone(),
            run: Box::new(run),
            reply,
        };
        let sent = queue.as_ref().is_some_and(|q| q.send(job).is_ok());
        if !sent {
            return Err(stopped("the progress thread has stopped".into()));
        }
        Ok(Pending {
            state: PendingState::Started {
                b: b.clone(),
                reply: reply_rx,
                dtype,
                rank,
                ctx,
            },
            meter: None,
        })
    }
}

/// The progress thread's body: each job in turn; after a failure the later
/// jobs fail at once, naming it (their peers are released by the abort
/// that the failure leads to, or by their own timeout).
fn progress_loop(rank: usize, jobs: Receiver<Job>) {
    let mut failed: Option<String> = None;
    for job in jobs {
        let began = Instant::now();
        let outcome = match &failed {
            Some(why) => Err(KernelError::Comm {
                rank,
                detail: format!(
                    "{}: not run, an earlier started collective failed: {why}",
                    job.ctx
                ),
            }),
            None => catch_unwind(AssertUnwindSafe(job.run)).unwrap_or_else(|_| {
                Err(KernelError::Comm {
                    rank,
                    detail: format!("{}: panicked on the progress thread", job.ctx),
                })
            }),
        };
        if let Err(e) = &outcome {
            failed.get_or_insert_with(|| e.to_string());
        }
        // A waiter that went away needs no reply.
        let _ = job.reply.send((outcome, began.elapsed()));
    }
}

/// Which collective a member called, with the arguments every member must
/// agree on (what host-side communicators compare before moving data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce(ReduceOp),
    ReduceScatter,
    AllGather,
    AllToAllV,
    Broadcast { root: usize },
    Barrier,
}

impl Op {
    /// The collective's name, as the trait spells it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce(_) => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::AllToAllV => "all_to_all_v",
            Op::Broadcast { .. } => "broadcast",
            Op::Barrier => "barrier",
        }
    }
}

/// One member's call as the others see it: the op and its tensor's dtype and
/// shape.
pub(crate) struct CallSig<'a> {
    pub(crate) op: Op,
    pub(crate) dtype: DType,
    pub(crate) shape: &'a [usize],
}

/// Checks that the members (`ranks`, in group order) called the same op with
/// compatible tensors; the message, prefixed by `ctx`, names the first
/// member that disagrees. Every member runs it on the same calls, so all of
/// them reach the same verdict.
pub(crate) fn check_agreement(
    ctx: &str,
    ranks: &[usize],
    calls: &[CallSig],
) -> std::result::Result<(), String> {
    let first = &calls[0];
    if let Some(i) = calls.iter().position(|c| c.op.name() != first.op.name()) {
        return Err(format!(
            "{ctx}: rank {} called {} but rank {} called {}; every member must call the \
             same collectives on a group in the same order",
            ranks[0],
            first.op.name(),
            ranks[i],
            calls[i].op.name()
        ));
    }
    if let Some(i) = calls.iter().position(|c| c.op != first.op) {
        return Err(format!(
            "{ctx}: rank {} asked for {:?} but rank {} for {:?}; every member must pass the \
             same {}",
            ranks[0],
            first.op,
            ranks[i],
            calls[i].op,
            if matches!(first.op, Op::AllReduce(_)) {
                "reduce op"
            } else {
                "root"
            }
        ));
    }
    // Which call the others are compared with, and how.
    let (reference, same_shape, rule) = match first.op {
        Op::Barrier => return Ok(()),
        Op::AllReduce(_) | Op::ReduceScatter => {
            (0, true, "dtypes and shapes must be equal on every member")
        }
        Op::AllGather | Op::AllToAllV => (
            0,
            false,
            "dtypes, and dimensions after the first, must be equal on every member",
        ),
        Op::Broadcast { root } => (
            root,
            true,
            "every member must pass the root's dtype and shape",
        ),
    };
    let r = &calls[reference];
    let agrees = |c: &CallSig| {
        c.dtype == r.dtype
            && if same_shape {
                c.shape == r.shape
            } else {
                c.shape.len() == r.shape.len() && c.shape[1..] == r.shape[1..]
            }
    };
    match calls.iter().position(|c| !agrees(c)) {
        Some(i) => Err(format!(
            "{ctx}: rank {} passed {:?} {:?} but rank {} passed {:?} {:?}; {rule}",
            ranks[reference], r.dtype, r.shape, ranks[i], calls[i].dtype, calls[i].shape
        )),
        None => Ok(()),
    }
}

/// Why `all_to_all_v`'s arguments are wrong, if they are: the tensor needs a
/// first dimension, and `send_rows` one entry per member of a group of
/// `size`, summing to its rows.
pub(crate) fn all_to_all_v_args_error(
    shape: &[usize],
    size: usize,
    send_rows: &[usize],
) -> Option<crate::error::KernelError> {
    use crate::error::{arg_err, shape_err};
    let op = "all_to_all_v";
    local::needs_dim0(op, shape).or_else(|| {
        let total: usize = send_rows.iter().sum();
        if send_rows.len() != size {
            Some(arg_err(
                op,
                format!(
                    "send_rows {send_rows:?} has {} entries, but the group has {size} members",
                    send_rows.len()
                ),
            ))
        } else if total != shape[0] {
            Some(shape_err(
                op,
                format!(
                    "send_rows {send_rows:?} sum to {total}, but the tensor of shape \
                     {shape:?} has {} rows",
                    shape[0]
                ),
            ))
        } else {
            None
        }
    })
}

/// Why `reduce_scatter`'s tensor of `shape` cannot be split over a group of
/// `size`, if it cannot: it needs a first dimension divisible by the size.
pub(crate) fn reduce_scatter_args_error(shape: &[usize], size: usize) -> Option<KernelError> {
    let op = "reduce_scatter";
    local::needs_dim0(op, shape).or_else(|| {
        (!shape[0].is_multiple_of(size)).then(|| {
            crate::error::arg_err(
                op,
                format!(
                    "dimension 0 of shape {shape:?} is {}, not divisible by the group size {size}",
                    shape[0]
                ),
            )
        })
    })
}

/// Waits on `cv` for a change of the state `st` guards, until `deadline`;
/// past it, returns the error `timed_out` builds. The local and TCP
/// communicators wait for their peers with it.
pub(crate) fn wait_for_change<'a, S>(
    st: MutexGuard<'a, S>,
    cv: &Condvar,
    deadline: Instant,
    timed_out: impl FnOnce() -> KernelError,
) -> Result<MutexGuard<'a, S>> {
    let now = Instant::now();
    if now >= deadline {
        return Err(timed_out());
    }
    Ok(cv
        .wait_timeout(st, deadline - now)
        .unwrap_or_else(|p| p.into_inner())
        .0)
}

/// The error every call of rank `rank` returns once some rank has aborted
/// (`aborted`: the ranks in the order they aborted, with their reasons), or
/// `None` while none has. The local and TCP communicators share it.
pub(crate) fn abort_failure(
    rank: usize,
    aborted: &[(usize, String)],
    ctx: &str,
) -> Option<KernelError> {
    let (first, reason) = aborted.first()?;
    let who = if *first == rank {
        format!("this rank ({first}) aborted earlier")
    } else {
        format!("rank {first} aborted")
    };
    let mut detail = format!("{ctx}: {who}: {reason}");
    if aborted.len() > 1 {
        let later: Vec<usize> = aborted[1..].iter().map(|(r, _)| *r).collect();
        detail.push_str(&format!(" (then ranks {later:?} aborted)"));
    }
    Some(KernelError::Comm { rank, detail })
}
