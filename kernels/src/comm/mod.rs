//! Collectives between ranks: the [`Communicator`] trait and its
//! implementations (DESIGN §7).
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
pub mod tcp;
pub mod timed;

use crate::backend::Device;
use crate::error::Result;
use crate::tensor::Tensor;

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
