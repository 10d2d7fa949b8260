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

pub mod local;
pub mod rendezvous;
pub mod solo;
pub mod tcp;
pub mod timed;

use std::sync::{Condvar, MutexGuard};
use std::time::Instant;

use crate::backend::Device;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, Tensor};

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
