//! The engine under a parallel layout (docs/ARCHITECTURE.md §3, §8): N ranks, each holding
//! its shard of the model, computing together what one rank computes.
//!
//! - **Attention mesh** `tp × cp × dp`: attention and the
//!   dense MLP are tensor-parallel (column-parallel in, row-parallel out);
//!   between blocks the hidden states are split along the tokens of the
//!   micro-batch across the tp group (sequence parallelism), so every
//!   column-parallel input is an all-gather and every row-parallel output a
//!   reduce-scatter. The embedding and the head are split over the
//!   vocabulary, and the cross-entropy is computed vocabulary-parallel.
//! - **Expert mesh** `etp × ep × edp` over the same ranks (folding): the MoE
//!   layer routes its sequence-parallel shard of tokens, exchanges them over
//!   the ep group with an all-to-all-v, gathers them within etp (which splits
//!   the expert ffn), runs its local experts, and sends the results back.
//! - **Gradients**: parameters replicated across tp (norms, router, shared
//!   gate) see only their rank's tokens and are summed over tp; dense
//!   parameters are then reduced over dp×cp, expert parameters over edp, by
//!   the distributed optimizer's reduce-scatter ([`trainer`]).
//! - **Context parallel** (`cp`): each sequence in 2·cp chunks, cp rank i
//!   holding chunks i and 2·cp−1−i; attention all-gathers keys and values
//!   over cp ([`context`]), the rest runs on the rank's tokens, the MoE
//!   balancing statistics are summed over tp×cp.
//!
//! - **Pipeline** (`pp`, `vpp`): each stage holds its layers (the layout's
//!   `pp_rank_layers`) with its own tp×dp and expert meshes; micro-batches
//!   run in the 1F1B (or interleaved) order of [`pipeline`], activations and
//!   gradients travel by send/recv between stages, the last stage computes
//!   the loss, a tied embedding's gradient is summed between first and last.
//!
//! The equivalence to one rank is the contract: one rank with gradient
//! accumulation over the dp micro-batches gives the same losses and
//! gradients (`tests/parallel_equivalence.rs`).

pub mod context;
pub mod pipeline;
pub mod plan;
pub mod shard;
pub mod trainer;

pub use plan::ShardPlan;
pub use shard::{ShardSpec, Split, SplitAxis};
pub use trainer::Trainer;

use foldmoe_kernels::{Backend, Communicator, Group, ReduceOp, Tensor};

use super::documents::DocTensors;
use super::{EngineError, Result};
use crate::layout::{GroupKind, Layout};

/// One rank's place in a layout: its coordinates and the groups it belongs to.
#[derive(Clone, Debug)]
pub struct RankLayout {
    /// The layout (checked against the model).
    pub layout: Layout,
    /// This rank.
    pub rank: usize,
    /// Tensor-parallel group and this rank's index in it.
    pub tp: Group,
    /// Index in the tp group.
    pub tp_index: usize,
    /// Data-parallel group (dense gradients).
    pub dp: Group,
    /// Index in the dp group.
    pub dp_index: usize,
    /// Context-parallel group (the key/value exchange of attention).
    pub cp: Group,
    /// Index in the cp group.
    pub cp_index: usize,
    /// Data × context parallel group: where dense gradients are reduced and
    /// the dense optimizer state is sharded (the dp group when cp = 1).
    pub dp_cp: Group,
    /// Tensor × context parallel group: where the MoE balancing statistics
    /// and z-loss are reduced (the tp group when cp = 1).
    pub tp_cp: Group,
    /// Expert-parallel group (token all-to-all).
    pub ep: Group,
    /// Index in the ep group.
    pub ep_index: usize,
    /// Expert tensor-parallel group.
    pub etp: Group,
    /// Index in the etp group.
    pub etp_index: usize,
    /// Expert data-parallel group (expert gradients).
    pub edp: Group,
    /// Every rank of this rank's pipeline stage (MoE loads, gathers of shards).
    pub stage: Group,
    /// The pipeline: one rank per stage, same coordinates otherwise, in stage order.
    pub pp: Group,
    /// Index in the pp group (the pipeline stage).
    pub pp_index: usize,
    /// First and last stage of this rank's pipeline (tied embeddings).
    pub embedding: Group,
    /// Every rank (losses, aux losses, gradient norm, agreement to stop).
    pub world: Group,
}

impl RankLayout {
    /// `rank`'s groups under `layout`; an error for a rank outside the world.
    pub fn new(layout: &Layout, rank: usize) -> Result<Self> {
        if rank >= layout.world {
            return Err(EngineError::Invalid(format!(
                "rank {rank} is outside layout {} of world {}",
                layout.name, layout.world
            )));
        }
        let group = |kind| Group::new(layout.group_of(kind, rank));
        let index = |g: &Group| g.index_of(rank).unwrap_or(0);
        let cp = group(GroupKind::Cp);
        let (tp, dp, ep, etp, edp, pp) = (
            group(GroupKind::Tp),
            group(GroupKind::Dp),
            group(GroupKind::Ep),
            group(GroupKind::Etp),
            group(GroupKind::Edp),
            group(GroupKind::Pp),
        );
        let pp_index = index(&pp);
        let stage: Vec<usize> = (0..layout.world)
            .filter(|&r| layout.attention_coords(r).pp == pp_index)
            .collect();
        Ok(RankLayout {
            layout: layout.clone(),
            rank,
            tp_index: index(&tp),
            dp_index: index(&dp),
            cp_index: index(&cp),
            cp,
            dp_cp: group(GroupKind::DpCp),
            tp_cp: Group::new(layout.tp_cp_group(rank)),
            ep_index: index(&ep),
            etp_index: index(&etp),
            tp,
            dp,
            ep,
            etp,
            edp,
            stage: Group::new(stage),
            pp,
            pp_index,
            embedding: group(GroupKind::Embedding),
            world: Group::new((0..layout.world).collect()),
        })
    }

    /// Every group this rank communicates over, kind by kind in the same
    /// order on every rank: what a communicator that sets its groups up
    /// front (NCCL's split is collective over the world) is given.
    pub fn groups(&self) -> Vec<Group> {
        [
            &self.tp,
            &self.dp,
            &self.ep,
            &self.etp,
            &self.edp,
            &self.stage,
            &self.pp,
            &self.embedding,
            &self.world,
        ]
        .into_iter()
        // A middle stage takes no part in its pipeline's embedding group.
        .filter(|g| g.index_of(self.rank).is_some())
        .cloned()
        // Without cp these equal tp and dp: only context parallelism adds groups.
        .chain(if self.cp.size() > 1 {
            vec![self.cp.clone(), self.dp_cp.clone(), self.tp_cp.clone()]
        } else {
            Vec::new()
        })
        .collect()
    }
}

/// The groups a block's layers communicate over, with this rank's index in
/// each: what a layer is given when it is built (never the whole
/// [`RankLayout`]). For one rank every group is `[0]`.
#[derive(Clone, Debug)]
pub struct LayerGroups {
    /// Tensor-parallel group (attention heads, dense ffn, sequence shards).
    pub tp: Group,
    /// Index in `tp`.
    pub tp_index: usize,
    /// Context-parallel group (the key/value exchange of attention).
    pub cp: Group,
    /// Index in `cp`.
    pub cp_index: usize,
    /// Tensor × context parallel group (MoE balancing statistics and the
    /// capacity plan's view of the micro-batch).
    pub tp_cp: Group,
    /// Attention coordinates `(tp, cp)` of each member of `tp_cp`, in its order.
    pub tp_cp_coords: Vec<(usize, usize)>,
    /// Expert-parallel group (the token all-to-all).
    pub ep: Group,
    /// Index in `ep`.
    pub ep_index: usize,
    /// Expert tensor-parallel group (the expert ffn split).
    pub etp: Group,
    /// Index in `etp`.
    pub etp_index: usize,
    /// Every rank of the pipeline stage (tp × cp × dp): the ranks that route
    /// different tokens of the same layers (`global_aux` sums loads here).
    pub stage: Group,
}

impl LayerGroups {
    /// The groups of the one rank of a world of one.
    pub fn single() -> Self {
        let one = Group::new(vec![0]);
        LayerGroups {
            tp: one.clone(),
            tp_index: 0,
            cp: one.clone(),
            cp_index: 0,
            tp_cp: one.clone(),
            tp_cp_coords: vec![(0, 0)],
            ep: one.clone(),
            ep_index: 0,
            etp: one.clone(),
            etp_index: 0,
            stage: one,
        }
    }
}

impl RankLayout {
    /// The groups this rank's layers communicate over.
    pub fn layer_groups(&self) -> LayerGroups {
        let tp_cp_coords = self
            .tp_cp
            .ranks()
            .iter()
            .map(|&r| {
                let c = self.layout.attention_coords(r);
                (c.tp, c.cp)
            })
            .collect();
        LayerGroups {
            tp: self.tp.clone(),
            tp_index: self.tp_index,
            cp: self.cp.clone(),
            cp_index: self.cp_index,
            tp_cp: self.tp_cp.clone(),
            tp_cp_coords,
            ep: self.ep.clone(),
            ep_index: self.ep_index,
            etp: self.etp.clone(),
            etp_index: self.etp_index,
            stage: self.stage.clone(),
        }
    }
}

/// What a layer needs to run besides its weights and groups: the backend
/// and this rank's collectives.
pub struct Exec<'a, B: Backend> {
    /// The kernel backend.
    pub b: &'a B,
    /// The collectives of this rank.
    pub comm: &'a dyn Communicator<B>,
    /// The micro-batch of the optimizer step this call runs, in the
    /// trainer's schedule (its forward, or the rerun of recompute in its
    /// backward); `None` outside a training step (validation, inference,
    /// a layer's own tests). What state kept across a step's micro-batches
    /// (`global_aux`'s running loads) is keyed by.
    pub micro: Option<usize>,
    /// The micro-batch's documents, when it resets positions or masks
    /// attention at them (set by the model for its blocks).
    pub docs: Option<&'a DocTensors<B>>,
}

impl<B: Backend> Clone for Exec<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Exec<'_, B> {}

impl<'a, B: Backend> Exec<'a, B> {
    /// One rank's execution: the backend and collectives that return at once.
    pub fn solo(b: &'a B) -> Self {
        Exec {
            b,
            comm: &foldmoe_kernels::comm::solo::SoloComm,
            micro: None,
            docs: None,
        }
    }

    /// The same execution as part of micro-batch `micro` of a training step.
    pub fn at_micro(self, micro: usize) -> Self {
        Exec {
            micro: Some(micro),
            ..self
        }
    }

    /// Shards of `group` → their concatenation (all-gather; the identity
    /// for a group of one). Sequence-parallel rows → the whole micro-batch
    /// over tp.
    pub fn gather(&self, group: &Group, x: &Tensor<B>) -> Result<Tensor<B>> {
        if group.size() == 1 {
            return Ok(x.clone());
        }
        Ok(self.comm.all_gather(self.b, group, x)?)
    }

    /// Partial sums over `group` → this member's summed shard
    /// (reduce-scatter; the identity for a group of one).
    pub fn scatter(&self, group: &Group, x: &Tensor<B>) -> Result<Tensor<B>> {
        if group.size() == 1 {
            return Ok(x.clone());
        }
        Ok(self.comm.reduce_scatter(self.b, group, x)?)
    }

    /// Sum over `group` (the identity for a group of one).
    pub fn sum_over(&self, group: &Group, x: &Tensor<B>) -> Result<Tensor<B>> {
        if group.size() == 1 {
            return Ok(x.clone());
        }
        Ok(self.comm.all_reduce(self.b, group, x, ReduceOp::Sum)?)
    }
}

/// One rank's program context: the backend, the communicator and the rank's
/// place in the layout (what the model, the trainer and checkpoints use;
/// layers get [`Ctx::exec`] and their [`LayerGroups`]).
pub struct Ctx<'a, B: Backend> {
    /// The kernel backend.
    pub b: &'a B,
    /// The collectives of this rank.
    pub comm: &'a dyn Communicator<B>,
    /// This rank's groups.
    pub rank: &'a RankLayout,
}

impl<'a, B: Backend> Ctx<'a, B> {
    /// The backend and collectives, for a layer.
    pub fn exec(&self) -> Exec<'a, B> {
        Exec {
            b: self.b,
            comm: self.comm,
            micro: None,
            docs: None,
        }
    }

    /// Sum over `group` (the identity for a group of one).
    pub fn sum_over(&self, group: &Group, x: &Tensor<B>) -> Result<Tensor<B>> {
        self.exec().sum_over(group, x)
    }
}

/// Runs `f` on every rank of `layout` as threads of this process (the local
/// communicator), each with its [`Ctx`] — a world of one on the caller's
/// thread with [`foldmoe_kernels::comm::solo::SoloComm`]; returns the ranks'
/// results in rank order. A rank that fails aborts the world, so the others return an error
/// within `timeout` instead of waiting for it.
pub fn run_local_layout<B, T, F>(
    b: &B,
    layout: &Layout,
    timeout: std::time::Duration,
    f: F,
) -> Vec<Result<T>>
where
    B: Backend,
    T: Send,
    F: Fn(&Ctx<B>) -> Result<T> + Sync,
{
    if layout.world == 1 {
        // One rank: the caller's thread, collectives that return at once.
        let comm = foldmoe_kernels::comm::solo::SoloComm;
        let outcome = RankLayout::new(layout, 0).and_then(|rl| {
            f(&Ctx {
                b,
                comm: &comm,
                rank: &rl,
            })
        });
        return vec![outcome];
    }
    let results = foldmoe_kernels::comm::local::run_local(layout.world, timeout, |comm| {
        let rank = Communicator::<B>::rank(&comm);
        let outcome = RankLayout::new(layout, rank).and_then(|rl| {
            let ctx = Ctx {
                b,
                comm: &comm,
                rank: &rl,
            };
            f(&ctx)
        });
        if let Err(e) = &outcome {
            Communicator::<B>::abort(&comm, &e.to_string());
        }
        Ok(outcome)
    });
    results
        .into_iter()
        .map(|r| r.map_err(EngineError::from).and_then(|inner| inner))
        .collect()
}
