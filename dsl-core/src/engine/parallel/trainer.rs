//! One training step of one rank under a layout, with the distributed
//! optimizer (Megatron-Core's `DistributedOptimizer` and its gradient buffers):
//!
//! 1. forward/backward of this dp rank's micro-batches;
//! 2. parameters replicated over tp are summed over tp (sequence parallelism
//!    gave each tp rank a part of their gradient), all in one all-reduce;
//! 3. gradients are packed into flat buckets — by data-parallel group (dp×cp
//!    for dense parameters, edp for experts), weight decay, and tp replication —
//!    each padded to a multiple of its group and reduce-scattered: a rank
//!    keeps the sum of one chunk of every bucket;
//! 4. the global norm adds every chunk once (tp-replicated buckets counted on
//!    tp rank 0 only), the clipping factor is applied inside AdamW;
//! 5. AdamW updates each chunk with the rank's moments (the optimizer state
//!    is sharded: 1/(dp·cp) of the dense moments, 1/edp of the experts'), and the
//!    updated chunks are all-gathered back into the parameters. With bf16
//!    parameters the rank also keeps an f32 master copy of its chunks, with
//!    f32 moments (Megatron-Core's fp32 main params, sharded the same way):
//!    the update runs on the master and the bf16 chunk gathered is its rounding.
//!
//! A non-finite loss or norm is seen by every rank (they are reduced first),
//! so all ranks refuse the step together.
//!
//! Buckets are cut to the run's [`DdpConfig`](crate::engine::optim::DdpConfig)
//! (Megatron-Core's `--ddp-bucket-size`): walking the parameters in backward order, a kind's
//! bucket closes once it holds the bucket size. With `overlap_grad_reduce`,
//! a bucket's reduce-scatter is started in the last micro-batch's backward
//! as soon as every block holding one of its parameters has run its
//! backward (buckets holding the embedding, the final norm, the head or MTP
//! modules start after the backward), on the communicator's progress
//! thread, and waited for before the norm. With `overlap_param_gather`,
//! each bucket's all-gather is started once its chunk is updated and left
//! pending across the step boundary, as Megatron-Core's
//! `--overlap-param-gather` does: the trainer keeps the started gathers
//! (`Trainer::gathers`, by bucket), and the next step's forward waits for
//! a bucket's gather only right before the first unit that reads one of
//! its parameters — the embedding, a block, the final norm and head (with
//! the embedding table when tied), an MTP module (with the embedding table)
//! — through the hook of [`Model::forward_chunk_with`], which is a scan and
//! nothing more once nothing is pending. The buckets are cut walking the
//! parameters backwards, but the update takes them (and starts their
//! gathers) in the order the next forward needs them — by the first unit
//! reading each, dense before expert at a tie (`gather_order`) — and the
//! progress thread (or NCCL's stream) runs them in start order, so the
//! first units' gathers are the first to land. A
//! bucket's parameters are settled for the rest of the step once its unit
//! has run: a recompute's rerun in the backward, and the later
//! micro-batches' forwards, read them as they are. Everything else that
//! reads the parameter values between steps settles every pending gather
//! first ([`Trainer::settle_params`]): the update itself (and so the
//! unoverlapped path), [`Trainer::evaluate`], [`Trainer::gather_full`],
//! a checkpoint's save and load, a step that fails or is refused (its
//! error returns with the parameters settled); a trainer dropped with
//! gathers pending drops them first (their results are buffers of their
//! own), and its model cannot be moved out. Code reading `Trainer::model`
//! directly between steps (generation from a live trainer, say) must call
//! `settle_params` first. Every element is summed over the
//! same ranks in the same group order as without overlap (a tp-replicated
//! bucket's tp sum is its own all-reduce instead of a part of one for all of
//! them), and the values the forward reads are the same, so the results are
//! bit-identical.

use std::collections::HashMap;

use foldmoe_kernels::{
    AdamWConfig, Backend, DType, Group, HostData, KernelError, Pending, ReduceOp, Tensor,
};

use super::pipeline::{turns, Mailbox, Op, Pass, Tag, Turn};
use super::shard::{place_block, upload_as, ShardSpec, Split, SplitAxis};
use super::Ctx;
use crate::engine::model::{BackwardCall, Batch, ForwardCall, ForwardUnit, MicroBatch, Model};
use crate::engine::optim::clip_coefficient;
use crate::engine::param::{try_each_param, Module, Param};
use crate::engine::trainer::{download_loads, load_imbalance, LayerLoad, StepStats, TrainConfig};
use crate::engine::{EngineError, Result};
use crate::spec::FfnSpec;

/// How a parameter is reduced and updated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Kind {
    /// A routed expert's (reduced over edp rather than dp).
    expert: bool,
    /// A matrix (1-d parameters get no weight decay).
    decay: bool,
    /// Replicated over tp (its gradient summed there first).
    tp_replicated: bool,
    /// The last pipeline stage's copy of a tied embedding table: its
    /// gradient is the first stage's, so the norm counts it there only.
    pp_copy: bool,
}

/// A flat buffer of parameters of one [`Kind`], and this rank's optimizer
/// state for its chunk.
struct Bucket<B: Backend> {
    kind: Kind,
    /// `(parameter index, offset, elements)` of each member, in order.
    members: Vec<(usize, usize, usize)>,
    /// Elements of all members.
    len: usize,
    /// Elements per data-parallel chunk (`len` padded to a multiple of the group).
    chunk: usize,
    m: Tensor<B>,
    v: Tensor<B>,
    /// f32 master copy of this rank's chunk (bf16 parameters), or none when
    /// the parameters are their own master.
    master: Option<Tensor<B>>,
}

/// A contiguous part of one parameter's block held by this rank's chunk of
/// a bucket: block elements `lo..hi` (row-major, flattened) at offset `at`
/// of the chunk.
pub(crate) struct ChunkPart {
    pub bucket: usize,
    pub param: usize,
    pub lo: usize,
    pub hi: usize,
    pub at: usize,
}

/// `(loss, aux loss, loads per MoE layer)` of [`Trainer::accumulate`].
pub type Accumulated<B> = (Tensor<B>, Tensor<B>, Vec<Tensor<B>>);

/// A full tensor assembled from every rank: `(name, shape, values)`.
pub type FullTensor = (String, Vec<usize>, Vec<f64>);

/// What [`Trainer::gather_full`] assembles.
pub enum Gather<'a, B: Backend> {
    /// The parameters.
    Values,
    /// Reduced gradients (from [`Trainer::reduce_gradients`]).
    Grads(&'a GradChunks<B>),
    /// AdamW first moments.
    ExpAvg,
    /// AdamW second moments.
    ExpAvgSq,
    /// f32 master copies (the parameters themselves where they have none).
    Master,
}

/// This rank's reduced gradient chunks, one per bucket.
pub struct GradChunks<B: Backend> {
    /// One `[chunk]` tensor per bucket.
    pub chunks: Vec<Tensor<B>>,
}

/// A rank's model shard, its optimizer chunks and the run's settings.
pub struct Trainer<B: Backend> {
    /// The model shard being trained. With `overlap_param_gather` its
    /// parameter values lag the last update between steps, until the next
    /// forward or [`Self::settle_params`] (see the module doc): read them
    /// after `settle_params`.
    pub model: Model<B>,
    /// Optimizer and schedule settings.
    pub cfg: TrainConfig,
    buckets: Vec<Bucket<B>>,
    /// Every parameter's kind, in optimizer order.
    kinds: Vec<Kind>,
    step: u64,
    /// Time the last [`Self::accumulate`] waited for other stages'
    /// activations and gradients (the pipeline bubble, with transfer time).
    pub pipeline_wait: std::time::Duration,
    /// The MTP modules' mean cross-entropy of the last [`Self::accumulate`],
    /// scaled as its loss (`[1]`; zero off the last stage and without MTP).
    mtp_loss: Option<Tensor<B>>,
    /// The last step's loads of this rank's MoE layers, `[E]` each in block
    /// order, as the step read them to the host (summed over the stage).
    loads: Vec<Vec<f64>>,
    /// Each parameter's block among this rank's blocks (optimizer order), or
    /// none for those outside blocks: when its gradient is final.
    owners: Vec<Option<usize>>,
    /// The reduce-scatters the last backward started, by bucket
    /// (`overlap_grad_reduce`).
    in_flight: Vec<Option<Pending<B>>>,
    /// The parameter all-gathers the last update started that nothing has
    /// waited for yet, by bucket (`overlap_param_gather`): while one is
    /// here, its members' values are the ones before that update. The next
    /// forward waits for each right before the first unit reading one of
    /// its parameters; every other reader settles them all first
    /// ([`Self::settle_params`]).
    gathers: Vec<Option<Pending<B>>>,
    /// The forward units reading each bucket's parameters (none: a
    /// parameter no unit claims, whose bucket any unit waits for).
    bucket_units: Vec<Vec<Option<ForwardUnit>>>,
    /// The buckets in the order the update takes them (and starts their
    /// all-gathers): by the first forward unit reading them, dense before
    /// expert at a tie, then by index (see [`gather_order`]).
    update_order: Vec<usize>,
}

impl<B: Backend> Drop for Trainer<B> {
    /// Drops the pending parameter all-gathers before the model: their
    /// results are buffers of their own (host copies on the CPU
    /// communicators; on NCCL, dropping a handle orders the compute stream
    /// behind its collective), so nothing waits and nothing is written. The
    /// model cannot be moved out of a trainer, so no reader gets it with
    /// gathers pending.
    fn drop(&mut self) {
        self.gathers.clear();
    }
}

/// Every parameter in optimizer order (dense, then experts): its kind and shard.
fn params_of<B: Backend>(model: &Model<B>) -> Vec<(Kind, usize, Option<Box<ShardSpec>>)> {
    let mut out = Vec::new();
    let copy = model
        .embed_is_copy()
        .then(|| model.embed.table.name.clone());
    let mut push = |p: &Param<B>, expert: bool| {
        let full_rank = p
            .shard
            .as_ref()
            .map_or(p.value.shape().len(), |s| s.full_shape.len());
        let tp_split = p
            .shard
            .as_ref()
            .is_some_and(|s| s.split_over(SplitAxis::Tp));
        let kind = Kind {
            expert,
            decay: full_rank > 1,
            tp_replicated: !expert && !tp_split,
            pp_copy: copy.as_ref() == Some(&p.name),
        };
        out.push((kind, p.value.numel(), p.shard.clone()));
    };
    model.visit_dense(&mut |p| push(p, false));
    model.visit_experts(&mut |p| push(p, true));
    out
}

/// The buckets of parameters `kinds_numels` (kind and elements, in
/// optimizer order) for a bucket size of `size` elements: walking the
/// parameters in backward (reverse) order, each kind fills its open bucket
/// and closes it once it holds `size` elements or more (Megatron-Core's
/// rule: parameters are never split). Each bucket lists its parameters in
/// optimizer order, and the buckets are ordered by their first parameter,
/// so `usize::MAX` gives one bucket per kind in order of first appearance.
fn plan_buckets(kinds_numels: &[(Kind, usize)], size: usize) -> Vec<(Kind, Vec<usize>)> {
    let mut closed: Vec<(Kind, Vec<usize>)> = Vec::new();
    let mut open: Vec<(Kind, Vec<usize>, usize)> = Vec::new();
    for (i, &(kind, numel)) in kinds_numels.iter().enumerate().rev() {
        let at = match open.iter().position(|o| o.0 == kind) {
            Some(at) => at,
            None => {
                open.push((kind, Vec::new(), 0));
                open.len() - 1
            }
        };
        open[at].1.push(i);
        open[at].2 += numel;
        if open[at].2 >= size {
            let (kind, members, _) = open.remove(at);
            closed.push((kind, members));
        }
    }
    closed.extend(open.into_iter().map(|(kind, members, _)| (kind, members)));
    for (_, members) in &mut closed {
        members.reverse();
    }
    closed.sort_by_key(|(_, members)| members[0]);
    closed
}

/// The forward unit reading each parameter of `model`, in optimizer order
/// (none for a parameter no unit claims, which should not happen).
fn param_units<B: Backend>(model: &Model<B>) -> Vec<Option<ForwardUnit>> {
    let mut unit_of: HashMap<*const Param<B>, ForwardUnit> = HashMap::new();
    let mut mark = |unit: ForwardUnit, p: &Param<B>| {
        unit_of.insert(std::ptr::from_ref(p), unit);
    };
    mark(ForwardUnit::Embedding, &model.embed.table);
    for (j, block) in model.blocks().enumerate() {
        block.visit_dense(&mut |p| mark(ForwardUnit::Block(j), p));
        if let Some(moe) = block.moe() {
            moe.experts
                .visit_params(&mut |p| mark(ForwardUnit::Block(j), p));
        }
    }
    model
        .final_norm
        .visit_params(&mut |p| mark(ForwardUnit::Head, p));
    model.head.visit_params(&mut |p| mark(ForwardUnit::Head, p));
    for (k, m) in model.mtp.iter().enumerate() {
        m.visit_dense(&mut |p| mark(ForwardUnit::Mtp(k), p));
        if let Some(moe) = m.block.moe() {
            moe.experts
                .visit_params(&mut |p| mark(ForwardUnit::Mtp(k), p));
        }
    }
    let mut units = Vec::new();
    let mut unit = |p: &Param<B>| units.push(unit_of.get(&std::ptr::from_ref(p)).copied());
    model.visit_dense(&mut unit);
    model.visit_experts(&mut unit);
    units
}

/// Each parameter's block among the rank's blocks, from its forward unit
/// (none for the embedding, the final norm, the head and the MTP modules).
fn param_owners(units: &[Option<ForwardUnit>]) -> Vec<Option<usize>> {
    units
        .iter()
        .map(|u| match u {
            Some(ForwardUnit::Block(j)) => Some(*j),
            _ => None,
        })
        .collect()
}

/// The order in which the update takes the buckets and starts their
/// all-gathers, so that the next forward's first units find theirs first
/// (the progress thread, or NCCL's stream, runs them in start order): by
/// the first unit of the forward reading one of a bucket's parameters
/// (embedding, blocks in order, final norm and head, MTP modules; a
/// parameter no unit claims counts as first), dense before expert at a tie,
/// then by bucket index. Without it every expert bucket would follow every
/// dense one (buckets are numbered by their first parameter, experts after
/// all dense parameters), and the first MoE block would wait for all the
/// dense gathers. The key of a bucket is the same on every rank of its
/// data-parallel group (they hold the same parameters), so every rank's
/// order follows one global order of the collectives and none can wait on
/// a peer that waits on it.
fn gather_order(kinds: &[Kind], units: &[Vec<Option<ForwardUnit>>], blocks: usize) -> Vec<usize> {
    let at = |u: &Option<ForwardUnit>| match u {
        None | Some(ForwardUnit::Embedding) => 0,
        Some(ForwardUnit::Block(j)) => 1 + j,
        Some(ForwardUnit::Head) => 1 + blocks,
        Some(ForwardUnit::Mtp(k)) => 2 + blocks + k,
    };
    let mut order: Vec<usize> = (0..kinds.len()).collect();
    order.sort_by_key(|&k| (units[k].iter().map(at).min(), kinds[k].expert, k));
    order
}

/// Waits for the pending parameter all-gathers of the buckets holding a
/// parameter that forward unit `unit` reads (`units`: each bucket's units)
/// and writes them in: the hook of the forward (a scan and nothing more
/// once none is pending).
fn settle_unit<B: Backend>(
    b: &B,
    model: &mut Model<B>,
    buckets: &[Bucket<B>],
    units: &[Vec<Option<ForwardUnit>>],
    gathers: &mut [Option<Pending<B>>],
    unit: ForwardUnit,
) -> Result<()> {
    let reads = |k: usize| units[k].iter().any(|u| u.is_none_or(|u| u == unit));
    settle_gathers(b, model, buckets, gathers, &reads)
}

/// Writes each bucket's full flat values `(bucket, values)` into its
/// members' values (in their shapes).
fn write_buckets<B: Backend>(
    b: &B,
    model: &mut Model<B>,
    buckets: &[Bucket<B>],
    landed: Vec<(usize, Tensor<B>)>,
) -> Result<()> {
    if landed.is_empty() {
        return Ok(());
    }
    let mut fresh: HashMap<usize, Tensor<B>> = HashMap::new();
    for (k, full) in landed {
        for &(i, offset, n) in &buckets[k].members {
            fresh.insert(i, b.narrow(&full, offset, n)?);
        }
    }
    let (mut i, mut outcome) = (0, Ok(()));
    visit_all_mut(model, &mut |p| {
        if let Some(flat) = fresh.remove(&i) {
            let shape = p.value.shape().to_vec();
            match flat.reshape(&shape) {
                Ok(v) if outcome.is_ok() => p.value = v,
                Ok(_) => {}
                Err(e) => outcome = Err(e),
            }
        }
        i += 1;
    });
    Ok(outcome?)
}

/// Waits, in bucket order, for the pending parameter all-gathers
/// (`gathers`) of the buckets `which` selects, and writes them into the
/// parameters; nothing to do (and no cost beyond a scan) when none is
/// pending.
fn settle_gathers<B: Backend>(
    b: &B,
    model: &mut Model<B>,
    buckets: &[Bucket<B>],
    gathers: &mut [Option<Pending<B>>],
    which: &dyn Fn(usize) -> bool,
) -> Result<()> {
    let (mut landed, mut failed) = (Vec::new(), None);
    for (k, gather) in gathers.iter_mut().enumerate() {
        if gather.is_some() && which(k) && failed.is_none() {
            if let Some(pending) = gather.take() {
                match pending.wait() {
                    Ok(full) => landed.push((k, full)),
                    Err(e) => failed = Some(e),
                }
            }
        }
    }
    // What landed before a failure is written all the same.
    write_buckets(b, model, buckets, landed)?;
    failed.map_or(Ok(()), |e| Err(e.into()))
}

fn visit_all_mut<B: Backend>(model: &mut Model<B>, f: &mut dyn FnMut(&mut Param<B>)) {
    model.visit_dense_mut(f);
    model.visit_experts_mut(f);
}

/// This rank's chunk (the `index`-th of `parts`, `chunk` elements each) of
/// the flat, zero-padded concatenation of `members`.
fn own_chunk<B: Backend>(
    b: &B,
    members: &[Tensor<B>],
    chunk: usize,
    parts: usize,
    index: usize,
) -> Result<Tensor<B>> {
    let flat = pack(b, members, chunk * parts)?;
    Ok(if parts > 1 {
        b.narrow(&flat, index * chunk, chunk)?
    } else {
        flat
    })
}

/// Flat concatenation of `parts`, zero-padded to `padded` elements.
fn pack<B: Backend>(b: &B, parts: &[Tensor<B>], padded: usize) -> Result<Tensor<B>> {
    let mut flat: Vec<Tensor<B>> = Vec::with_capacity(parts.len() + 1);
    let mut len = 0;
    for p in parts {
        len += p.numel();
        flat.push(p.clone().reshape(&[p.numel()])?);
    }
    if padded > len {
        flat.push(b.zeros(&[padded - len], parts[0].dtype())?);
    }
    let refs: Vec<&Tensor<B>> = flat.iter().collect();
    Ok(b.concat(&refs)?)
}

/// Bucket `bk`'s flat gradient from its members' gradients `parts`,
/// zero-padded to a multiple of its data-parallel `group`.
fn bucket_flat<B: Backend>(
    b: &B,
    bk: &Bucket<B>,
    parts: &[Tensor<B>],
    group: &Group,
) -> Result<Tensor<B>> {
    pack(b, parts, bk.chunk * group.size())
}

/// Starts the reduction of every bucket not started yet (`in_flight[k]`
/// none) whose parameters all have final gradients (`is_final` of their
/// owner block, see [`param_owners`]), in bucket order: a tp-replicated
/// bucket is summed over tp first (elementwise in tp order, as the
/// unoverlapped all-reduce of all of them), then every bucket's
/// reduce-scatter is started over its data-parallel group.
fn start_final_buckets<B: Backend>(
    ctx: &Ctx<B>,
    model: &Model<B>,
    buckets: &[Bucket<B>],
    owners: &[Option<usize>],
    in_flight: &mut [Option<Pending<B>>],
    is_final: &dyn Fn(Option<usize>) -> bool,
) -> Result<()> {
    let b = ctx.b;
    let ready: Vec<usize> = (0..buckets.len())
        .filter(|&k| {
            in_flight[k].is_none() && buckets[k].members.iter().all(|m| is_final(owners[m.0]))
        })
        .collect();
    if ready.is_empty() {
        return Ok(());
    }
    // A parameter no backward reached still holds a cleared gradient.
    let mut grads = Vec::new();
    model.visit_dense(&mut |p| grads.push(p.grad_or_zeros(b)));
    model.visit_experts(&mut |p| grads.push(p.grad_or_zeros(b)));
    let grads = grads.into_iter().collect::<Result<Vec<_>>>()?;
    for k in ready {
        let bk = &buckets[k];
        let group = if bk.kind.expert {
            &ctx.rank.edp
        } else {
            &ctx.rank.dp_cp
        };
        let parts: Vec<Tensor<B>> = bk.members.iter().map(|m| grads[m.0].clone()).collect();
        let mut flat = bucket_flat(b, bk, &parts, group)?;
        if bk.kind.tp_replicated {
            flat = ctx.sum_over(&ctx.rank.tp, &flat)?;
        }
        in_flight[k] = Some(if group.size() > 1 {
            ctx.comm.reduce_scatter_start(b, group, &flat)?
        } else {
            Pending::ready(Ok(flat))
        });
    }
    Ok(())
}

impl<B: Backend> Trainer<B> {
    /// A trainer with zero moments for this rank's chunks, and master
    /// copies of them taken from the parameters where `cfg.master_weights`
    /// applies to the model's dtype.
    pub fn new(b: &B, model: Model<B>, cfg: TrainConfig) -> Result<Self> {
        // Per layout, not per rank: a pipeline stage without MoE layers
        // runs its pairs without pausing.
        if let Some(e) = cfg.layout_error(model.rank.ep.size()) {
            return Err(EngineError::Invalid(e));
        }
        let (dp_cp, edp) = (model.rank.dp_cp.size(), model.rank.edp.size());
        let dtype = model.embed.table.value.dtype();
        let masters = cfg.master_weights.applies_to(dtype);
        let state = if masters { DType::F32 } else { dtype };
        let params = params_of(&model);
        let bucket_size = cfg
            .ddp
            .resolved_bucket_size(dp_cp)
            .map_err(EngineError::Invalid)?;
        let kinds_numels: Vec<(Kind, usize)> = params.iter().map(|(k, n, _)| (*k, *n)).collect();
        let mut buckets: Vec<Bucket<B>> = Vec::new();
        for (kind, members) in plan_buckets(&kinds_numels, bucket_size) {
            let mut bucket = Bucket {
                kind,
                members: Vec::new(),
                len: 0,
                chunk: 0,
                m: b.zeros(&[1], state)?,
                v: b.zeros(&[1], state)?,
                master: None,
            };
            for i in members {
                let numel = kinds_numels[i].1;
                bucket.members.push((i, bucket.len, numel));
                bucket.len += numel;
            }
            buckets.push(bucket);
        }
        let units = param_units(&model);
        let owners = param_owners(&units);
        let bucket_units = buckets
            .iter()
            .map(|bk| {
                let mut u: Vec<Option<ForwardUnit>> =
                    bk.members.iter().map(|m| units[m.0]).collect();
                u.dedup();
                u
            })
            .collect::<Vec<_>>();
        let bucket_kinds: Vec<Kind> = buckets.iter().map(|bk| bk.kind).collect();
        let update_order = gather_order(&bucket_kinds, &bucket_units, model.block_count());
        let mut values = Vec::new();
        if masters {
            model.visit_dense(&mut |p| values.push(p.value.clone()));
            model.visit_experts(&mut |p| values.push(p.value.clone()));
        }
        for bk in &mut buckets {
            let group = if bk.kind.expert {
                &model.rank.edp
            } else {
                &model.rank.dp_cp
            };
            let parts = if bk.kind.expert { edp } else { dp_cp };
            bk.chunk = bk.len.div_ceil(parts);
            bk.m = b.zeros(&[bk.chunk], state)?;
            bk.v = b.zeros(&[bk.chunk], state)?;
            if masters {
                let members: Vec<Tensor<B>> = bk
                    .members
                    .iter()
                    .map(|&(i, _, _)| values[i].clone())
                    .collect();
                let index = group.index_of(model.rank.rank).unwrap_or(0);
                let own = own_chunk(b, &members, bk.chunk, parts, index)?;
                bk.master = Some(b.cast(&own, DType::F32)?);
            }
        }
        Ok(Trainer {
            model,
            cfg,
            buckets,
            kinds: params.into_iter().map(|(k, _, _)| k).collect(),
            step: 0,
            pipeline_wait: std::time::Duration::ZERO,
            mtp_loss: None,
            loads: Vec::new(),
            owners,
            in_flight: Vec::new(),
            gathers: Vec::new(),
            bucket_units,
            update_order,
        })
    }

    /// Waits for every parameter all-gather still pending from the last
    /// update (`overlap_param_gather`) and writes it into the parameters;
    /// nothing to do when none is. What every reader of the parameter values
    /// outside a training step's forward calls first (the trainer's own
    /// ones do: [`Self::evaluate`], [`Self::gather_full`], the update, a
    /// refused step, a checkpoint's save and load); code reading
    /// [`Self::model`] directly between steps must call it too.
    pub fn settle_params(&mut self, b: &B) -> Result<()> {
        settle_gathers(
            b,
            &mut self.model,
            &self.buckets,
            &mut self.gathers,
            &|_| true,
        )
    }

    /// Buckets whose parameter all-gather the last update started and
    /// nothing has waited for yet (see [`Self::settle_params`]).
    pub fn pending_param_gathers(&self) -> usize {
        self.gathers.iter().filter(|g| g.is_some()).count()
    }

    /// Updates applied so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Sets the updates applied so far (a resumed run's step).
    pub fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    /// Calls `f` on every parameter this rank trains with its index in
    /// optimizer order (what [`ChunkPart::param`] names); stops at the first
    /// error.
    pub(crate) fn try_visit_params<'a>(
        &'a self,
        f: &mut dyn FnMut(usize, &'a Param<B>) -> Result<()>,
    ) -> Result<()> {
        debug_assert_eq!(
            self.pending_param_gathers(),
            0,
            "parameters read with all-gathers pending: settle_params first"
        );
        let mut i = 0;
        let mut outcome = Ok(());
        let mut visit = |p: &'a Param<B>| {
            if outcome.is_ok() {
                outcome = f(i, p);
            }
            i += 1;
        };
        self.model.visit_dense(&mut visit);
        self.model.visit_experts(&mut visit);
        outcome
    }

    /// The parts of parameters that this rank's optimizer chunks hold, bucket
    /// by bucket: what it owns of the distributed optimizer's state.
    pub(crate) fn chunk_parts(&self) -> Vec<ChunkPart> {
        let me = self.model.rank.rank;
        let mut out = Vec::new();
        for (bucket, bk) in self.buckets.iter().enumerate() {
            let index = self.group(bk.kind.expert).index_of(me).unwrap_or(0);
            let (c0, c1) = (index * bk.chunk, (index + 1) * bk.chunk);
            for &(param, offset, n) in &bk.members {
                let (lo, hi) = (offset.max(c0), (offset + n).min(c1));
                if lo < hi {
                    out.push(ChunkPart {
                        bucket,
                        param,
                        lo: lo - offset,
                        hi: hi - offset,
                        at: lo - c0,
                    });
                }
            }
        }
        out
    }

    /// Whether this rank is the one that writes bucket `bucket` to a
    /// checkpoint: a tp-replicated bucket is identical on every tp rank (tp
    /// rank 0 writes it), the last stage's copy of a tied embedding is the
    /// first stage's.
    pub(crate) fn writes_bucket(&self, bucket: usize) -> bool {
        let kind = self.buckets[bucket].kind;
        !(kind.pp_copy || kind.tp_replicated && self.model.rank.tp_index != 0)
    }

    /// Bucket `bucket`'s chunk of AdamW moments and f32 master (if kept).
    pub(crate) fn bucket_state(
        &self,
        bucket: usize,
    ) -> (&Tensor<B>, &Tensor<B>, Option<&Tensor<B>>) {
        let bk = &self.buckets[bucket];
        (&bk.m, &bk.v, bk.master.as_ref())
    }

    /// Elements of bucket `bucket`'s chunk.
    pub(crate) fn bucket_chunk(&self, bucket: usize) -> usize {
        self.buckets[bucket].chunk
    }

    /// Replaces one of bucket `bucket`'s state tensors (`slot` 0: first
    /// moment, 1: second moment, 2: f32 master), `[chunk]` in the state's
    /// dtype; a master is only replaced where the trainer keeps one.
    pub(crate) fn set_bucket_state(
        &mut self,
        bucket: usize,
        slot: usize,
        t: Tensor<B>,
    ) -> Result<()> {
        let bk = &mut self.buckets[bucket];
        if t.shape() != [bk.chunk] || t.dtype() != bk.m.dtype() {
            return Err(EngineError::Invalid(format!(
                "optimizer state of bucket {bucket}: got {:?} {:?}, expected [{}] {:?}",
                t.dtype(),
                t.shape(),
                bk.chunk,
                bk.m.dtype()
            )));
        }
        match slot {
            0 => bk.m = t,
            1 => bk.v = t,
            _ if bk.master.is_some() => bk.master = Some(t),
            _ => {}
        }
        Ok(())
    }

    /// Whether this rank keeps f32 master copies of its chunks.
    pub fn has_masters(&self) -> bool {
        self.buckets.iter().any(|bk| bk.master.is_some())
    }

    /// The data-parallel group of dense (`dp×cp`) or expert (`edp`) parameters.
    fn group(&self, expert: bool) -> &Group {
        if expert {
            &self.model.rank.edp
        } else {
            &self.model.rank.dp_cp
        }
    }

    /// Forward and backward of this dp rank's micro-batches (`(tokens,
    /// targets)` of `batch·seq_len` each) in the pipeline's 1F1B order
    /// (interleaved with vpp > 1; plain accumulation without a pipeline);
    /// gradients are this rank's, not yet reduced. Returns `(loss, aux,
    /// loads)` summed over the micro-batches (loss and aux scaled by
    /// `1 / (dp · micro-batches)`; the loss zero off the last stage), still
    /// local.
    pub fn accumulate(
        &mut self,
        ctx: &Ctx<B>,
        micro_batches: &[impl MicroBatch],
        seq_len: usize,
    ) -> Result<Accumulated<B>> {
        let b = ctx.b;
        if micro_batches.is_empty() {
            return Err(EngineError::Invalid(format!(
                "rank {}: step {}: no micro-batches given",
                ctx.rank.rank,
                self.step + 1
            )));
        }
        // Not over cp: a cp rank's loss is already its share of the micro-batch's mean.
        let scale = 1.0 / (micro_batches.len() * ctx.rank.dp.size()) as f64;
        // Cleared, not zeroed: the first backward's gradients are taken as
        // they are, and the last step's are freed before the forward.
        try_each_param(|g| visit_all_mut(&mut self.model, g), |p| p.clear_grad(b))?;
        let dtype = self.model.embed.table.value.dtype();
        let mut loss = b.zeros(&[1], dtype.acc())?;
        let mut aux = b.zeros(&[1], dtype)?;
        let mut loads: Vec<Option<Tensor<B>>> = Vec::new();
        let (pp, vpp) = (ctx.rank.pp.size(), self.model.chunk_count());
        let pp_ranks = ctx.rank.pp.ranks().to_vec();
        let last = pp * vpp - 1;
        let overlapped = self.cfg.overlap_moe_comm;
        let turns = turns(pp, vpp, micro_batches.len(), ctx.rank.pp_index, overlapped)?;
        let mut mailbox = Mailbox::new(
            &pp_ranks,
            ctx.rank.pp_index,
            vpp,
            micro_batches.len(),
            overlapped,
        )?;
        let mut saved = HashMap::new();
        self.pipeline_wait = std::time::Duration::ZERO;
        self.model.begin_step(micro_batches.len());
        let overlap = self.cfg.ddp.overlap_grad_reduce;
        self.in_flight = (0..self.buckets.len()).map(|_| None).collect();
        // Backward passes run per chunk, and this rank's blocks whose last
        // one has run (their gradients are final).
        let mut backwards = vec![0; vpp];
        let mut finished = vec![false; self.model.block_count()];
        let mut mtp_loss = b.zeros(&[1], dtype.acc())?;
        // MoE layers of the chunks before each chunk: where its loads go.
        let mut moe_before = vec![0; vpp + 1];
        for v in 0..vpp {
            moe_before[v + 1] = moe_before[v] + self.model.chunk_moe_layers(v);
        }
        loads.resize(moe_before[vpp], None);
        for turn in turns {
            let (f_op, b_op) = match turn {
                Turn::One(op) if op.pass == Pass::F => (Some(op), None),
                Turn::One(op) => (None, Some(op)),
                Turn::Pair { f, b } => (Some(f), Some(b)),
            };
            // What each side needs from the neighbouring stages, both taken
            // before either computes (a pair needs both to start).
            let waited = &mut self.pipeline_wait;
            let mut neighbour = |op: Op| -> Result<Option<Tensor<B>>> {
                let stage = self.model.virtual_stage(op.chunk);
                let edge = if op.pass == Pass::F { 0 } else { last };
                if stage == edge {
                    return Ok(None);
                }
                let tag = Tag {
                    pass: op.pass,
                    micro: op.micro,
                    stage,
                };
                let started = std::time::Instant::now();
                let x = mailbox.take(ctx, &pp_ranks, tag)?;
                *waited += started.elapsed();
                Ok(Some(x))
            };
            let input = f_op.map(&mut neighbour).transpose()?.flatten();
            let backward = match b_op {
                Some(op) => {
                    let output_grad = neighbour(op)?;
                    let chunk_saved = saved.remove(&(op.micro, op.chunk)).ok_or_else(|| {
                        EngineError::Invalid(format!(
                            "pipeline: backward of micro-batch {} chunk {} before its forward",
                            op.micro, op.chunk
                        ))
                    })?;
                    backwards[op.chunk] += 1;
                    Some((op, chunk_saved, output_grad))
                }
                None => None,
            };
            // The last micro-batch's backward of a chunk starts the
            // reductions of the gradients that are final.
            let reduce_now = overlap
                && backward
                    .as_ref()
                    .is_some_and(|(op, ..)| backwards[op.chunk] == micro_batches.len());
            // Each unit of a forward waits, right before it runs, for the
            // last update's all-gathers of its parameters (a scan and
            // nothing more once they have landed).
            let (buckets, units, owners) = (&self.buckets, &self.bucket_units, &self.owners);
            let gathers = &mut self.gathers;
            let mut before =
                |model: &mut Model<B>, unit| settle_unit(b, model, buckets, units, gathers, unit);
            let (in_flight, finished) = (&mut self.in_flight, &mut finished);
            let mut after_block = |model: &Model<B>, block| {
                if !reduce_now {
                    return Ok(());
                }
                finished[block] = true;
                let is_final = |o: Option<usize>| o.is_some_and(|j| finished[j]);
                start_final_buckets(ctx, model, buckets, owners, in_flight, &is_final)
            };
            let (out, input_grad) = match (f_op, backward) {
                (Some(op), None) => {
                    let out = self.model.forward_chunk_with(
                        &ctx.exec().at_micro(op.micro),
                        op.chunk,
                        input,
                        Batch::of(&micro_batches[op.micro]),
                        seq_len,
                        &mut before,
                    )?;
                    (Some((op, out)), None)
                }
                (None, Some((op, chunk_saved, output_grad))) => {
                    let d = self.model.backward_chunk_with(
                        &ctx.exec().at_micro(op.micro),
                        chunk_saved,
                        output_grad,
                        scale,
                        &mut after_block,
                    )?;
                    (None, Some((op, d)))
                }
                (Some(f), Some((op, chunk_saved, output_grad))) => {
                    let (out, d) = self.model.forward_backward_chunks(
                        ForwardCall {
                            ctx: ctx.exec().at_micro(f.micro),
                            chunk: f.chunk,
                            input,
                            batch: Batch::of(&micro_batches[f.micro]),
                            seq_len,
                        },
                        &mut before,
                        BackwardCall {
                            ctx: ctx.exec().at_micro(op.micro),
                            saved: chunk_saved,
                            output_grad,
                            loss_scale: scale,
                        },
                        &mut after_block,
                    )?;
                    (Some((f, out)), Some((op, d)))
                }
                (None, None) => continue,
            };
            if let Some((op, out)) = out {
                if let Some(l) = &out.loss {
                    b.axpy(&mut loss, scale, l)?;
                }
                if let Some(l) = &out.mtp_loss {
                    b.axpy(&mut mtp_loss, scale, l)?;
                }
                b.axpy(&mut aux, scale, &out.aux_loss)?;
                for (acc, l) in loads[moe_before[op.chunk]..].iter_mut().zip(out.moe_load) {
                    match acc {
                        Some(acc) => b.axpy(acc, 1.0, &l)?,
                        None => *acc = Some(l),
                    }
                }
                if let Some(h) = &out.hidden {
                    let stage = self.model.virtual_stage(op.chunk);
                    ctx.comm.send(b, pp_ranks[(stage + 1) % pp], h)?;
                }
                saved.insert((op.micro, op.chunk), out.saved);
            }
            if let Some((op, Some(d))) = input_grad {
                let stage = self.model.virtual_stage(op.chunk);
                ctx.comm.send(b, pp_ranks[(stage - 1) % pp], &d)?;
            }
        }
        let loads = loads
            .into_iter()
            .map(|l| {
                l.ok_or_else(|| {
                    EngineError::Invalid("pipeline: an MoE layer ran no forward".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.mtp_loss = Some(mtp_loss);
        // Parameters no backward reached get their zeros written now.
        try_each_param(|g| visit_all_mut(&mut self.model, g), |p| p.settle_grad(b))?;
        Ok((loss, aux, loads))
    }

    /// Mean loss of one batch without gradients (validation), equal on every
    /// rank: the batch passes the virtual stages in order, each sending its
    /// output to the next, and the last stage's loss is summed over pp.
    /// Waits for pending parameter all-gathers first.
    pub fn evaluate(
        &mut self,
        ctx: &Ctx<B>,
        batch: &impl MicroBatch,
        seq_len: usize,
    ) -> Result<f64> {
        let b = ctx.b;
        self.settle_params(b)?;
        let (pp, vpp) = (ctx.rank.pp.size(), self.model.chunk_count());
        let pp_ranks = ctx.rank.pp.ranks();
        let mut loss = b.zeros(&[1], self.model.embed.table.value.dtype().acc())?;
        for chunk in 0..vpp {
            let stage = self.model.virtual_stage(chunk);
            let input = if stage == 0 {
                None
            } else {
                Some(ctx.comm.recv(b, pp_ranks[(stage - 1) % pp])?)
            };
            let out =
                self.model
                    .forward_chunk(&ctx.exec(), chunk, input, Batch::of(batch), seq_len)?;
            if let Some(h) = &out.hidden {
                ctx.comm.send(b, pp_ranks[(stage + 1) % pp], h)?;
            }
            if let Some(l) = out.loss {
                loss = l;
            }
        }
        Ok(b.download(&ctx.sum_over(&ctx.rank.pp, &loss)?)?.to_f64()[0])
    }

    /// Steps 2–3: sums tp-replicated gradients over tp (one all-reduce), then
    /// reduce-scatters every bucket over its data-parallel group.
    pub fn reduce_gradients(&mut self, ctx: &Ctx<B>) -> Result<GradChunks<B>> {
        let b = ctx.b;
        if self.model.embed_shared_with_last()
            && ctx.rank.embedding.size() > 1
            && self.model.owns_embed()
        {
            // A shared table gets the embedding's gradient on the first stage
            // and the head's (tied) or the MTP modules' on the last: each
            // needs their sum.
            let g = &self.model.embed.table.grad;
            let summed = ctx.sum_over(&ctx.rank.embedding, g)?;
            self.model.embed.table.grad = summed;
        }
        if self.cfg.ddp.overlap_grad_reduce {
            // The buckets the backward did not start (parameters outside
            // blocks, or no backward ran through `accumulate`) start now.
            self.in_flight.resize_with(self.buckets.len(), || None);
            let (buckets, owners) = (&self.buckets, &self.owners);
            start_final_buckets(
                ctx,
                &self.model,
                buckets,
                owners,
                &mut self.in_flight,
                &|_| true,
            )?;
            let chunks = std::mem::take(&mut self.in_flight)
                .into_iter()
                .map(|p| match p {
                    Some(p) => Ok(p.wait()?),
                    None => Err(EngineError::Invalid(
                        "reduce_gradients: a bucket was never started (internal error)".into(),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(GradChunks { chunks });
        }
        let mut grads = Vec::new();
        visit_all_mut(&mut self.model, &mut |p| grads.push(p.grad.clone()));
        if ctx.rank.tp.size() > 1 {
            let replicated: Vec<usize> = (0..grads.len())
                .filter(|&i| self.kinds[i].tp_replicated)
                .collect();
            if !replicated.is_empty() {
                let parts: Vec<Tensor<B>> = replicated.iter().map(|&i| grads[i].clone()).collect();
                let len: usize = parts.iter().map(Tensor::numel).sum();
                let summed = ctx.sum_over(&ctx.rank.tp, &pack(b, &parts, len)?)?;
                let mut offset = 0;
                for &i in &replicated {
                    let n = grads[i].numel();
                    let shape = grads[i].shape().to_vec();
                    grads[i] = b.narrow(&summed, offset, n)?.reshape(&shape)?;
                    offset += n;
                }
            }
        }
        let mut chunks = Vec::with_capacity(self.buckets.len());
        for bk in &self.buckets {
            let group = self.group(bk.kind.expert);
            let parts: Vec<Tensor<B>> = bk
                .members
                .iter()
                .map(|&(i, _, _)| grads[i].clone())
                .collect();
            let flat = bucket_flat(b, bk, &parts, group)?;
            chunks.push(if group.size() > 1 {
                ctx.comm.reduce_scatter(b, group, &flat)?
            } else {
                flat
            });
        }
        Ok(GradChunks { chunks })
    }

    /// The global gradient norm of the reduced chunks (every element of the
    /// full model counted once), equal on every rank.
    pub fn grad_norm(&self, ctx: &Ctx<B>, grads: &GradChunks<B>) -> Result<f64> {
        let b = ctx.b;
        let dtype = self.model.embed.table.value.dtype();
        let mut total = b.zeros(&[1], dtype)?;
        for (g, bk) in grads.chunks.iter().zip(&self.buckets) {
            if (bk.kind.tp_replicated && ctx.rank.tp_index != 0) || bk.kind.pp_copy {
                continue;
            }
            total = b.add(&total, &b.sum_squares(g)?)?;
        }
        let total = ctx.sum_over(&ctx.rank.world, &total)?;
        Ok(b.download(&total)?.to_f64()[0].sqrt())
    }

    /// One optimizer step over this rank's micro-batches: the same update on
    /// every parameter as one rank training on all dp ranks' micro-batches.
    /// A non-finite loss or gradient norm (or a kernel meeting a NaN) is an
    /// error naming the step and leaves the parameters, the optimizer state
    /// and the expert biases unchanged (the parameters as the last update
    /// made them: its pending all-gathers have landed when the error
    /// returns).
    pub fn step(
        &mut self,
        ctx: &Ctx<B>,
        micro_batches: &[impl MicroBatch],
        seq_len: usize,
    ) -> Result<StepStats> {
        let outcome = self.try_step(ctx, micro_batches, seq_len);
        if outcome.is_err() {
            // Best effort: the step's own error is the one reported.
            let _ = self.settle_params(ctx.b);
        }
        outcome
    }

    /// [`Self::step`], maybe leaving parameter all-gathers pending on error.
    fn try_step(
        &mut self,
        ctx: &Ctx<B>,
        micro_batches: &[impl MicroBatch],
        seq_len: usize,
    ) -> Result<StepStats> {
        let b = ctx.b;
        let step = self.step + 1;
        // A kernel that meets a NaN or inf reports it; name the step as for a
        // non-finite loss below.
        let non_finite = |e: EngineError| match e {
            EngineError::Kernel(k @ KernelError::NonFinite { .. }) => {
                EngineError::Invalid(format!("step {step}: {k}; the update was not applied"))
            }
            other => other,
        };
        let accumulated = self.accumulate(ctx, micro_batches, seq_len);
        self.model.end_step();
        let (loss, aux, mut loads) = accumulated.map_err(non_finite)?;
        let rank = ctx.rank;
        // The last stage's loss, summed over dp, reaches every stage
        // (the others add zeros), so every rank reports it.
        let loss = ctx.sum_over(&rank.pp, &ctx.sum_over(&rank.dp, &loss)?)?;
        let aux = ctx.sum_over(&rank.world, &aux)?;
        let (loss, aux_loss) = (
            b.download(&loss)?.to_f64()[0],
            b.download(&aux)?.to_f64()[0],
        );
        let mtp_loss = match self.mtp_loss.take() {
            Some(l) if self.model.spec.mtp_layers > 0 => {
                let l = ctx.sum_over(&rank.pp, &ctx.sum_over(&rank.dp, &l)?)?;
                b.download(&l)?.to_f64()[0]
            }
            _ => 0.0,
        };
        if !loss.is_finite() || !aux_loss.is_finite() {
            return Err(EngineError::Invalid(format!(
                "step {step}: loss is {loss} (aux loss {aux_loss}); the update was not applied"
            )));
        }
        let grads = self.reduce_gradients(ctx)?;
        let grad_norm = self.grad_norm(ctx, &grads)?;
        if !grad_norm.is_finite() {
            return Err(EngineError::Invalid(format!(
                "step {step}: gradient norm is {grad_norm}; the update was not applied"
            )));
        }
        let grad_scale = clip_coefficient(grad_norm, self.cfg.grad_clip);
        let lr = self.cfg.schedule().lr_at(step);
        self.apply(ctx, &grads, lr, grad_scale)?;
        for load in &mut loads {
            *load = ctx.sum_over(&rank.stage, load)?;
        }
        self.model.update_expert_biases(b, &loads)?;
        self.loads = download_loads(b, &loads)?;
        let mut load_imbalance = load_imbalance(&self.loads);
        if rank.pp.size() > 1 {
            // Each stage saw its own MoE layers: the worst over the pipeline.
            let mine = upload_as(b, vec![load_imbalance], &[1], DType::F32)?;
            let worst = ctx.comm.all_reduce(b, &rank.pp, &mine, ReduceOp::Max)?;
            load_imbalance = b.download(&worst)?.to_f64()[0];
        }
        Ok(StepStats {
            loss,
            aux_loss,
            mtp_loss,
            grad_norm,
            lr,
            load_imbalance,
        })
    }

    /// The last step's tokens per expert of every MoE layer of the full
    /// model, in layer order (none before the first step, or without MoE
    /// layers): the counts [`Self::step`] already read to the host, so
    /// calling this costs no device synchronisation. Under pp > 1 each stage
    /// holds its own layers' counts and they are summed over the pipeline:
    /// then it is a collective that every rank calls.
    pub fn expert_loads(&self, ctx: &Ctx<B>) -> Result<Vec<LayerLoad>> {
        let count = |x: &f64| x.round().max(0.0) as u64;
        // MTP modules' MoE layers are numbered after the model's layers (as
        // Hugging Face numbers DeepSeek-V3's MTP layer 61).
        let layers = self.model.spec.layers();
        let mine: Vec<usize> = self
            .model
            .blocks()
            .zip(self.model.global_layers())
            .filter(|(bl, _)| bl.moe().is_some())
            .map(|(_, &layer)| layer)
            .chain(
                self.model
                    .mtp
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.block.moe().is_some())
                    .map(|(k, _)| layers + k),
            )
            .collect();
        if ctx.rank.pp.size() == 1 {
            return Ok(mine
                .iter()
                .zip(&self.loads)
                .map(|(&layer, l)| LayerLoad {
                    layer,
                    tokens: l.iter().map(count).collect(),
                })
                .collect());
        }
        // Every MoE layer of the full model and its place in one flat vector;
        // a stage fills its layers' places, the others add zeros.
        let mut places = Vec::new();
        let (mut layer, mut len) = (0, 0);
        for g in &self.model.spec.groups {
            for _ in 0..g.count {
                if let FfnSpec::Moe(m) = &g.ffn {
                    places.push((layer, len, m.experts));
                    len += m.experts;
                }
                layer += 1;
            }
        }
        if let Some(FfnSpec::Moe(m)) = self.model.spec.groups.last().map(|g| &g.ffn) {
            for k in 0..self.model.spec.mtp_layers {
                places.push((layers + k, len, m.experts));
                len += m.experts;
            }
        }
        let mut flat = vec![0.0; len];
        for (&layer, l) in mine.iter().zip(&self.loads) {
            match places.iter().find(|p| p.0 == layer) {
                Some(&(_, at, e)) if e == l.len() => flat[at..at + e].copy_from_slice(l),
                _ => {
                    return Err(EngineError::Invalid(format!(
                        "expert_loads: block {layer} holds {} experts' loads, which the \
                         model's declared groups do not give it",
                        l.len()
                    )))
                }
            }
        }
        let b = ctx.b;
        // f32 holds the sum exactly: each place has one stage's count.
        let summed = ctx.sum_over(&ctx.rank.pp, &upload_as(b, flat, &[len], DType::F32)?)?;
        let summed = b.download(&summed)?.to_f64();
        // Every rank has taken the same steps: none yet is none on all.
        if self.step == 0 {
            return Ok(Vec::new());
        }
        Ok(places
            .into_iter()
            .map(|(layer, at, e)| LayerLoad {
                layer,
                tokens: summed[at..at + e].iter().map(count).collect(),
            })
            .collect())
    }

    /// Step 5: AdamW on this rank's chunk of every bucket, then all-gathers
    /// the buckets back into the parameters: waited for here, or, with
    /// `overlap_param_gather`, started bucket after bucket and left pending
    /// for the next forward (see [`Self::settle_params`]).
    fn apply(
        &mut self,
        ctx: &Ctx<B>,
        grads: &GradChunks<B>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let b = ctx.b;
        // The update reads the values: the last update's gathers land first.
        self.settle_params(b)?;
        let base = AdamWConfig {
            lr,
            grad_scale,
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            step: self.step + 1,
        };
        let mut values = Vec::new();
        visit_all_mut(&mut self.model, &mut |p| values.push(p.value.clone()));
        let me = ctx.rank.rank;
        let overlap = self.cfg.ddp.overlap_param_gather;
        let mut landed = Vec::with_capacity(self.buckets.len());
        let mut gathers: Vec<Option<Pending<B>>> = (0..self.buckets.len()).map(|_| None).collect();
        for &k in &self.update_order {
            let (bk, g) = (&mut self.buckets[k], &grads.chunks[k]);
            let group = if bk.kind.expert {
                &ctx.rank.edp
            } else {
                &ctx.rank.dp_cp
            };
            let (parts, index) = (group.size(), group.index_of(me).unwrap_or(0));
            let members: Vec<Tensor<B>> = bk
                .members
                .iter()
                .map(|&(i, _, _)| values[i].clone())
                .collect();
            let mut chunk = own_chunk(b, &members, bk.chunk, parts, index)?;
            let cfg = AdamWConfig {
                weight_decay: if bk.kind.decay {
                    base.weight_decay
                } else {
                    0.0
                },
                ..base
            };
            match &mut bk.master {
                Some(w) => b.adamw_step_master(&mut chunk, g, w, &mut bk.m, &mut bk.v, &cfg)?,
                None => b.adamw_step(&mut chunk, g, &mut bk.m, &mut bk.v, &cfg)?,
            }
            if parts > 1 && overlap {
                // Gathers while the next buckets update and, past this
                // step, the next forward runs up to its first unit
                // reading the bucket.
                gathers[k] = Some(ctx.comm.all_gather_start(b, group, &chunk)?);
            } else {
                let full = if parts == 1 {
                    chunk
                } else {
                    ctx.comm.all_gather(b, group, &chunk)?
                };
                landed.push((k, full));
            }
        }
        self.gathers = gathers;
        write_buckets(b, &mut self.model, &self.buckets, landed)?;
        self.step += 1;
        Ok(())
    }

    /// Every full parameter `(name, full shape, values)` — or its reduced
    /// gradient, or an AdamW moment, as `what` says — assembled from all
    /// ranks' shards (a collective: every rank must call it; all get it).
    pub fn gather_full(&mut self, ctx: &Ctx<B>, what: Gather<'_, B>) -> Result<Vec<FullTensor>> {
        let b = ctx.b;
        self.settle_params(b)?;
        let mut params = Vec::new();
        visit_all_mut(&mut self.model, &mut |p| {
            params.push((p.name.clone(), p.value.clone(), p.shard.clone()))
        });
        // This rank's shard of every parameter, flat.
        let mut local: Vec<Option<Tensor<B>>> = vec![None; params.len()];
        for (bi, bk) in self.buckets.iter().enumerate() {
            let chunk = match &what {
                Gather::Values => None,
                Gather::Grads(g) => Some(&g.chunks[bi]),
                Gather::ExpAvg => Some(&bk.m),
                Gather::ExpAvgSq => Some(&bk.v),
                Gather::Master => bk.master.as_ref(),
            };
            let Some(chunk) = chunk else {
                continue;
            };
            let group = self.group(bk.kind.expert);
            let full = if group.size() > 1 {
                ctx.comm.all_gather(b, group, chunk)?
            } else {
                chunk.clone()
            };
            for &(i, offset, n) in &bk.members {
                local[i] = Some(b.narrow(&full, offset, n)?);
            }
        }
        let mut out = Vec::with_capacity(params.len());
        for ((name, value, shard), local) in params.into_iter().zip(local) {
            let numel = value.numel();
            let local = match local {
                Some(t) => t,
                None => value.clone().reshape(&[numel])?,
            };
            let full_shape = shard
                .as_ref()
                .map_or_else(|| value.shape().to_vec(), |s| s.full_shape.clone());
            let Some(spec) = shard else {
                out.push((name, full_shape, b.download(&local)?.to_f64()));
                continue;
            };
            let layout = &ctx.rank.layout;
            // Every stage rank's block (uneven for a vocabulary tp does not
            // divide): the gather is padded to the largest.
            let specs: Vec<ShardSpec> = ctx
                .rank
                .stage
                .ranks()
                .iter()
                .map(|&r| {
                    let (att, exp) = (layout.attention_coords(r), layout.expert_coords(r));
                    let splits = spec
                        .splits
                        .iter()
                        .map(|s| Split {
                            index: match s.axis {
                                SplitAxis::Tp => att.tp,
                                SplitAxis::Ep => exp.ep,
                                SplitAxis::Etp => exp.etp,
                            },
                            ..*s
                        })
                        .collect();
                    ShardSpec {
                        full_shape: full_shape.clone(),
                        splits,
                    }
                })
                .collect();
            let most = specs
                .iter()
                .map(|s| s.shape().iter().product::<usize>())
                .max()
                .unwrap_or(0);
            let local = if most > numel {
                pack(b, &[local], most)?
            } else {
                local
            };
            let all = b
                .download(&ctx.comm.all_gather(b, &ctx.rank.stage, &local)?)?
                .to_f64();
            let mut full = vec![0.0; full_shape.iter().product()];
            for (spec_r, block) in specs.iter().zip(all.chunks(most)) {
                let n: usize = spec_r.shape().iter().product();
                place_block(&mut full, spec_r, &block[..n]);
            }
            out.push((name, full_shape, full));
        }
        exchange_over_pp(ctx, out)
    }
}

/// Every pipeline stage's full tensors, on every rank: each rank sends its
/// stage's list to the other members of its pp group (names and shapes as
/// one i32 header, values as one tensor), and the lists are joined in stage
/// order, a tied embedding (held by the first and last stage) kept once.
pub fn exchange_over_pp<B: Backend>(
    ctx: &Ctx<B>,
    mine: Vec<FullTensor>,
) -> Result<Vec<FullTensor>> {
    let b = ctx.b;
    let pp = ctx.rank.pp.ranks();
    if pp.len() == 1 {
        return Ok(mine);
    }
    let mut header = vec![mine.len() as i32];
    let mut values = Vec::new();
    for (name, shape, vals) in &mine {
        header.push(name.len() as i32);
        header.extend(name.bytes().map(i32::from));
        header.push(shape.len() as i32);
        header.extend(shape.iter().map(|&d| d as i32));
        values.extend_from_slice(vals);
    }
    let n_header = header.len();
    let header_t = b.upload(HostData::I32(header), &[n_header])?;
    // f64 values where the backend keeps them, else f32 (parameters and
    // their state are f32 or narrower there).
    let n_values = values.len();
    let values_t = b
        .upload(HostData::F64(values.clone()), &[n_values])
        .or_else(|_| {
            b.upload(
                HostData::F32(values.iter().map(|&x| x as f32).collect()),
                &[n_values],
            )
        })?;
    for &peer in pp {
        if peer != ctx.rank.rank {
            ctx.comm.send(b, peer, &header_t)?;
            ctx.comm.send(b, peer, &values_t)?;
        }
    }
    let mut out: Vec<FullTensor> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for &peer in pp {
        let list = if peer == ctx.rank.rank {
            mine.clone()
        } else {
            let header = match b.download(&ctx.comm.recv(b, peer)?)? {
                HostData::I32(h) => h,
                _ => {
                    return Err(EngineError::Invalid(
                        "pipeline gather: header is not i32".into(),
                    ))
                }
            };
            let values = b.download(&ctx.comm.recv(b, peer)?)?.to_f64();
            let mut list = Vec::new();
            let (mut h, mut v) = (1, 0);
            for _ in 0..header[0] {
                let len = header[h] as usize;
                let name: String = header[h + 1..h + 1 + len]
                    .iter()
                    .map(|&c| c as u8 as char)
                    .collect();
                h += 1 + len;
                let dims = header[h] as usize;
                let shape: Vec<usize> = header[h + 1..h + 1 + dims]
                    .iter()
                    .map(|&d| d as usize)
                    .collect();
                h += 1 + dims;
                let n: usize = shape.iter().product();
                list.push((name, shape, values[v..v + n].to_vec()));
                v += n;
            }
            list
        };
        for t in list {
            if seen.insert(t.0.clone()) {
                out.push(t);
            }
        }
    }
    Ok(out)
}

/// The trainer at `world = 1` (through `run_local_layout`): what
/// every one-rank run is. The update from given gradients is
/// [`Trainer::apply`] on the chunks of
/// [`Trainer::reduce_gradients`] (at world = 1, each bucket's whole
/// buffer).
#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::{Backend, DType, Device, ElementwiseOps as _, HostData};

    use super::{
        gather_order, plan_buckets, settle_unit, visit_all_mut, Gather, GradChunks, Kind, Trainer,
    };
    use crate::engine::model::{Batch, Model};
    use crate::engine::optim::{clip_coefficient, MasterWeights};
    use crate::engine::parallel::shard::upload_as;
    use crate::engine::parallel::Ctx;
    use crate::engine::param::Param;
    use crate::engine::testutil::{one_rank, small_moe, small_spec, uniform, values};
    use crate::engine::trainer::TrainConfig;
    use crate::engine::{EngineError, Result};
    use crate::spec::{FfnSpec, LoadBalance, ModelSpec};

    fn visit<B: Backend>(m: &Model<B>, f: &mut dyn FnMut(&Param<B>)) {
        m.visit_dense(f);
        m.visit_experts(f);
    }

    fn all_values(m: &Model<Cpu>) -> Vec<Vec<f64>> {
        let mut v = Vec::new();
        visit(m, &mut |p| v.push(values(&p.value)));
        v
    }

    fn all_grads(m: &Model<Cpu>) -> Vec<Vec<f64>> {
        let mut v = Vec::new();
        visit(m, &mut |p| v.push(values(&p.grad)));
        v
    }

    /// Every bucket's moments and master, bit for bit.
    fn all_state(t: &Trainer<Cpu>) -> Vec<Vec<u64>> {
        t.buckets
            .iter()
            .flat_map(|bk| [&bk.m, &bk.v].into_iter().chain(bk.master.as_ref()))
            .map(|s| values(s).iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// `(tokens, targets)` rows `rows` of a fixed `[4, 4]` batch.
    fn rows(rows: std::ops::Range<usize>) -> (Vec<i32>, Vec<i32>) {
        let tokens = [3, 0, 6, 1, 7, 2, 5, 4, 1, 1, 0, 6, 2, 7, 7, 3];
        let targets = [0, 6, 1, 5, 2, 5, 4, 3, 1, 0, 6, 6, 7, 7, 3, 2];
        let r = rows.start * 4..rows.end * 4;
        (tokens[r.clone()].to_vec(), targets[r].to_vec())
    }

    /// A second trainer on the same rank.
    fn fresh<B: Backend>(
        ctx: &Ctx<B>,
        spec: &ModelSpec,
        seed: u64,
        dtype: DType,
        cfg: TrainConfig,
    ) -> Result<Trainer<B>> {
        let model = Model::new(ctx.b, spec, ctx.rank.clone(), seed, dtype)?;
        Trainer::new(ctx.b, model, cfg)
    }

    /// Sets every gradient to values uniform in `[-1, 1]` drawn from `seed`,
    /// in the parameter's dtype.
    fn set_grads<B: Backend>(b: &B, t: &mut Trainer<B>, seed: u64) -> Result<()> {
        let (mut s, mut outcome) = (seed * 1000, Ok(()));
        visit_all_mut(&mut t.model, &mut |p| {
            s += 1;
            let g = uniform(s, p.grad.numel(), 1.0);
            match upload_as(b, g, p.grad.shape(), p.grad.dtype()) {
                Ok(g) => p.grad = g,
                Err(e) => outcome = Err(e),
            }
        });
        outcome
    }

    /// One update at `lr`, unclipped, from the gradients the parameters hold.
    fn update<B: Backend>(ctx: &Ctx<B>, t: &mut Trainer<B>, lr: f64) -> Result<()> {
        let grads = t.reduce_gradients(ctx)?;
        t.apply(ctx, &grads, lr, 1.0)
    }

    #[test]
    fn grad_accumulation_matches_one_batch() {
        // A micro-batch load-balancing loss is not additive over micro-batches
        // (Megatron's neither), so it is off here; the z-loss, a token mean, stays.
        let mut moe = small_moe();
        if let FfnSpec::Moe(m) = &mut moe {
            m.router.load_balance = LoadBalance::None;
        }
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, moe], false);
        let cfg = TrainConfig {
            grad_clip: 0.0,
            ..TrainConfig::default()
        };
        one_rank(&Cpu, &spec, 5, DType::F64, cfg, |ctx, trainer| {
            // The same weights, the whole batch in one forward and backward.
            let mut big = Model::new(ctx.b, &spec, ctx.rank.clone(), 5, DType::F64)?;
            let (tokens, targets) = rows(0..4);
            let batch = Batch::Host {
                tokens: &tokens,
                targets: &targets,
                docs: None,
            };
            let out = big.forward(&ctx.exec(), batch, 4)?;
            let (big_loss, big_aux) = (values(&out.loss)[0], values(&out.aux_loss)[0]);
            big.backward(&ctx.exec(), out.saved, 1.0)?;

            let micro = [rows(0..1), rows(1..2), rows(2..3), rows(3..4)];
            let stats = trainer.step(ctx, &micro, 4)?;
            assert!(
                (stats.loss - big_loss).abs() < 1e-12,
                "{} vs {big_loss}",
                stats.loss
            );
            assert!((stats.aux_loss - big_aux).abs() < 1e-12);
            assert!(big_aux > 0.0, "the z-loss takes part");
            // The step leaves the accumulated gradients in the parameters.
            for (g_micro, g_big) in all_grads(&trainer.model).iter().zip(all_grads(&big)) {
                for (a, b) in g_micro.iter().zip(&g_big) {
                    assert!((a - b).abs() <= 1e-10 * b.abs().max(1e-3), "{a} vs {b}");
                }
            }
            assert_eq!(stats.lr, cfg.schedule().lr_at(1));
            assert!(stats.load_imbalance >= 1.0);
            assert_eq!(trainer.step_count(), 1);
            Ok(())
        });
    }

    #[test]
    fn nan_loss_stops_with_an_error_and_leaves_params_unchanged() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        one_rank(
            &Cpu,
            &spec,
            5,
            DType::F32,
            TrainConfig::default(),
            |ctx, trainer| {
                let batch = [rows(0..2)];
                trainer.step(ctx, &batch, 4)?;
                // Poison the head: every logit, and so the loss, becomes NaN.
                let head = trainer.model.head.weight.as_mut().unwrap();
                let n = head.value.numel();
                head.value = ctx
                    .b
                    .upload(HostData::F32(vec![f32::NAN; n]), head.value.shape())?;
                let (before, state) = (all_values(&trainer.model), all_state(trainer));
                let err = trainer.step(ctx, &batch, 4).unwrap_err();
                match &err {
                    EngineError::Invalid(msg) => {
                        assert!(msg.contains("step 2") && msg.contains("NaN"), "{msg}")
                    }
                    other => panic!("expected Invalid, got {other}"),
                }
                let after = all_values(&trainer.model);
                let same = |a: &f64, b: &f64| a.to_bits() == b.to_bits();
                assert!(before
                    .iter()
                    .flatten()
                    .zip(after.iter().flatten())
                    .all(|(a, b)| same(a, b)));
                assert_eq!(all_state(trainer), state, "the optimizer state moved");
                assert_eq!(trainer.step_count(), 1);
                Ok(())
            },
        );
    }

    #[test]
    fn inf_grad_norm_stops_with_an_error_and_leaves_params_unchanged() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        one_rank(
            &Cpu,
            &spec,
            5,
            DType::F32,
            TrainConfig::default(),
            |ctx, trainer| {
                // A huge final-norm scale keeps the loss finite in f32 but makes
                // the head's gradient overflow when squared.
                let norm = &mut trainer.model.final_norm.weight;
                norm.value = ctx
                    .b
                    .upload(HostData::F32(vec![1e30; spec.hidden]), &[spec.hidden])?;
                let (before, state) = (all_values(&trainer.model), all_state(trainer));
                let err = trainer.step(ctx, &[rows(0..2)], 4).unwrap_err();
                match &err {
                    EngineError::Invalid(msg) => {
                        assert!(
                            msg.contains("step 1") && msg.contains("gradient norm is inf"),
                            "{msg}"
                        )
                    }
                    other => panic!("expected Invalid, got {other}"),
                }
                assert_eq!(all_values(&trainer.model), before);
                assert_eq!(all_state(trainer), state, "the optimizer state moved");
                assert_eq!(trainer.step_count(), 0);
                Ok(())
            },
        );
    }

    #[test]
    fn empty_step_is_an_error() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        one_rank(
            &Cpu,
            &spec,
            5,
            DType::F32,
            TrainConfig::default(),
            |ctx, trainer| {
                assert!(matches!(
                    trainer.step(ctx, &[] as &[(Vec<i32>, Vec<i32>)], 4),
                    Err(EngineError::Invalid(_))
                ));
                // Five tokens are no whole sequence of 4; an id outside the vocabulary.
                let ragged = [(vec![1; 5], vec![1; 5])];
                let err = trainer.step(ctx, &ragged, 4).unwrap_err().to_string();
                assert!(err.contains("sequences of 4"), "{err}");
                let outside = [(vec![1, 2, 3, 99], vec![1; 4])];
                let err = trainer.step(ctx, &outside, 4).unwrap_err().to_string();
                assert!(err.contains("outside the vocabulary"), "{err}");
                assert_eq!(trainer.step_count(), 0);
                Ok(())
            },
        );
    }

    #[test]
    fn tiny_model_overfits_one_batch() {
        let mut spec = small_spec(&[FfnSpec::Dense { ffn: 64 }, small_moe()], false);
        spec.vocab = 16;
        spec.hidden = 32;
        spec.seq_len = 12;
        spec.init_std = 0.02;
        if let FfnSpec::Moe(m) = &mut spec.groups[1].ffn {
            m.expert_ffn = 32;
            m.shared_ffn = 32;
            m.router.aux_coef = 1e-2;
            m.router.z_loss_coef = 1e-3;
        }
        for g in &mut spec.groups {
            g.attention.head_dim = 8;
        }
        // Four sequences with distinct first tokens, so every context is unique.
        let (batch, seq) = (4, spec.seq_len);
        let mut rng = 12345u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((rng >> 33) % 16) as i32
        };
        let mut stream: Vec<i32> = Vec::new();
        for s in 0..batch {
            stream.push(s as i32 * 4);
            stream.extend((0..seq).map(|_| next()));
        }
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for s in 0..batch {
            let w = &stream[s * (seq + 1)..(s + 1) * (seq + 1)];
            tokens.extend_from_slice(&w[..seq]);
            targets.extend_from_slice(&w[1..]);
        }
        let data = [(tokens, targets)];
        let cfg = TrainConfig {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 10,
            total_steps: 200,
            weight_decay: 0.0,
            ..TrainConfig::default()
        };
        let (first, last) = one_rank(&Cpu, &spec, 0, DType::F32, cfg, |ctx, trainer| {
            let first = trainer.step(ctx, &data, seq)?.loss;
            let mut last = first;
            for _ in 1..cfg.total_steps {
                last = trainer.step(ctx, &data, seq)?.loss;
            }
            Ok((first, last))
        });
        assert!(first > 2.0, "starts near ln(16): {first}");
        assert!(last < 0.05, "did not overfit: {first} -> {last}");
    }

    #[test]
    fn clip_scales_to_the_max_norm() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let cfg = TrainConfig::default();
        one_rank(&Cpu, &spec, 1, DType::F64, cfg, |ctx, folded| {
            let b = ctx.b;
            set_grads(b, folded, 1)?;
            let host: f64 = all_grads(&folded.model)
                .iter()
                .flatten()
                .map(|g| g * g)
                .sum::<f64>()
                .sqrt();
            let grads = folded.reduce_gradients(ctx)?;
            let norm = folded.grad_norm(ctx, &grads)?;
            assert!((norm - host).abs() < 1e-9 * norm, "{norm} vs {host}");
            assert!(norm > 2.0);
            let coef = clip_coefficient(norm, 1.0);
            assert!((coef * host - 1.0).abs() < 1e-5, "{coef} · {norm} is not 1");
            // Below the limit, or with clipping off, no scaling.
            assert_eq!(clip_coefficient(1.0, 2.0), 1.0);
            assert_eq!(clip_coefficient(5.0, 0.0), 1.0);
            // The update with the coefficient folded in equals one on scaled
            // gradients, exactly (the same f64 products), for every parameter.
            let mut scaled = fresh(ctx, &spec, 1, DType::F64, cfg)?;
            set_grads(b, &mut scaled, 1)?;
            let chunks = scaled.reduce_gradients(ctx)?.chunks;
            let chunks = chunks
                .iter()
                .map(|c| b.scale(c, coef))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            folded.apply(ctx, &grads, 1e-2, coef)?;
            scaled.apply(ctx, &GradChunks { chunks }, 1e-2, 1.0)?;
            let want = scaled.gather_full(ctx, Gather::Values)?;
            assert_eq!(folded.gather_full(ctx, Gather::Values)?, want);
            Ok(())
        });
    }

    #[test]
    fn adamw_first_step_and_no_decay_on_vectors() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let cfg = TrainConfig::default();
        assert_eq!(
            (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay),
            (0.9, 0.95, 1e-8, 0.1)
        );
        one_rank(&Cpu, &spec, 1, DType::F64, cfg, |ctx, trainer| {
            set_grads(ctx.b, trainer, 1)?;
            let before = trainer.gather_full(ctx, Gather::Values)?;
            let grads = trainer.reduce_gradients(ctx)?;
            let g = trainer.gather_full(ctx, Gather::Grads(&grads))?;
            let lr = 1e-2;
            trainer.apply(ctx, &grads, lr, 1.0)?;
            assert_eq!(trainer.step_count(), 1);
            let after = trainer.gather_full(ctx, Gather::Values)?;
            let m = trainer.gather_full(ctx, Gather::ExpAvg)?;
            let v = trainer.gather_full(ctx, Gather::ExpAvgSq)?;
            let mut vectors = 0;
            for (i, (name, shape, p1)) in after.iter().enumerate() {
                assert_eq!((&before[i].0, &m[i].0, &v[i].0), (name, name, name));
                let wd = if shape.len() == 1 {
                    vectors += 1;
                    0.0
                } else {
                    0.1
                };
                for (j, p1) in p1.iter().enumerate() {
                    let (p0, g) = (before[i].2[j], g[i].2[j]);
                    // Bias-corrected first step: m̂ = g, v̂ = g², so the step
                    // is lr·g/(|g| + eps).
                    let want = p0 - lr * wd * p0 - lr * g / (g.abs() + 1e-8);
                    assert!((p1 - want).abs() < 1e-12, "{name}: {p1} vs {want}");
                    assert!((m[i].2[j] - 0.1 * g).abs() <= 1e-12 * g.abs(), "{name} m");
                    assert!(
                        (v[i].2[j] - 0.05 * g * g).abs() <= 1e-12 * g * g,
                        "{name} v"
                    );
                }
            }
            assert!(vectors > 0 && vectors < after.len(), "{vectors} vectors");
            trainer.set_step_count(7);
            assert_eq!(trainer.step_count(), 7);
            Ok(())
        });
    }

    #[test]
    fn master_weights_apply_to_bf16_and_optionally_f32() {
        assert!(MasterWeights::Bf16.applies_to(DType::BF16));
        assert!(!MasterWeights::Bf16.applies_to(DType::F32));
        assert!(MasterWeights::Bf16AndF32.applies_to(DType::F32));
        // f64 parameters are always their own master.
        assert!(!MasterWeights::Bf16AndF32.applies_to(DType::F64));
        assert_eq!(MasterWeights::default(), MasterWeights::Bf16);
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let cfg = TrainConfig {
            master_weights: MasterWeights::Bf16AndF32,
            ..TrainConfig::default()
        };
        one_rank(&Cpu, &spec, 1, DType::F64, cfg, |_, trainer| {
            assert!(!trainer.has_masters());
            Ok(())
        });
    }

    /// The master path on f32 parameters (bf16 ones: the tests below): f32
    /// master copies and moments, and updates bit-identical to the plain
    /// path's (one update per backend).
    #[test]
    fn master_copies_of_f32_params_change_only_the_path() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let mixed_cfg = TrainConfig {
            master_weights: MasterWeights::Bf16AndF32,
            ..TrainConfig::default()
        };
        one_rank(
            &Cpu,
            &spec,
            3,
            DType::F32,
            TrainConfig::default(),
            |ctx, plain| {
                let mut mixed = fresh(ctx, &spec, 3, DType::F32, mixed_cfg)?;
                assert!(!plain.has_masters() && mixed.has_masters());
                for step in 1..=3 {
                    for t in [&mut *plain, &mut mixed] {
                        set_grads(ctx.b, t, step)?;
                        update(ctx, t, 1e-2)?;
                    }
                }
                let params = plain.gather_full(ctx, Gather::Values)?;
                assert_eq!(mixed.gather_full(ctx, Gather::Values)?, params);
                assert_eq!(
                    mixed.gather_full(ctx, Gather::ExpAvg)?,
                    plain.gather_full(ctx, Gather::ExpAvg)?
                );
                assert_eq!(
                    mixed.gather_full(ctx, Gather::ExpAvgSq)?,
                    plain.gather_full(ctx, Gather::ExpAvgSq)?
                );
                assert_eq!(
                    mixed.gather_full(ctx, Gather::Master)?,
                    params,
                    "a master differs from its parameter"
                );
                for bk in &mixed.buckets {
                    let state = [&bk.m, &bk.v].into_iter().chain(bk.master.as_ref());
                    assert!(
                        bk.master.is_some() && state.into_iter().all(|t| t.dtype() == DType::F32)
                    );
                }
                assert!(plain.buckets.iter().all(|bk| bk.master.is_none()));
                Ok(())
            },
        );
    }

    /// bf16 parameters on the CPU (emulated bf16).
    #[test]
    fn bf16_params_on_cpu_keep_f32_masters() {
        bf16_params_keep_f32_masters(&Cpu);
    }

    /// bf16 parameters on CUDA (ignored unless built with
    /// `--cfg foldmoe_gpu_tests`).
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn bf16_params_on_cuda_keep_f32_masters() {
        bf16_params_keep_f32_masters(&foldmoe_kernels::cuda::require_test_device());
    }

    /// bf16 parameters get f32 masters and moments by default; with a
    /// constant gradient of 1 each step is `w ← w·(1 − lr·wd) − lr/(1 + eps)`,
    /// worked on the host from the initial weights, and every parameter is
    /// its master rounded to bf16.
    fn bf16_params_keep_f32_masters<B: Backend>(b: &B) {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        one_rank(
            b,
            &spec,
            3,
            DType::BF16,
            TrainConfig::default(),
            |ctx, trainer| {
                let b = ctx.b;
                assert!(trainer.has_masters());
                for bk in &trainer.buckets {
                    let state = [&bk.m, &bk.v].into_iter().chain(bk.master.as_ref());
                    assert!(
                        bk.master.is_some() && state.into_iter().all(|t| t.dtype() == DType::F32)
                    );
                }
                let mut want: Vec<(bool, Vec<f64>)> = trainer
                    .gather_full(ctx, Gather::Values)?
                    .into_iter()
                    .map(|(_, shape, w)| (shape.len() > 1, w))
                    .collect();
                let (lr, wd) = (1e-3, trainer.cfg.weight_decay);
                for _ in 0..5 {
                    let mut outcome: Result<()> = Ok(());
                    visit_all_mut(&mut trainer.model, &mut |p| {
                        let ones = b
                            .upload(HostData::F32(vec![1.0; p.grad.numel()]), p.grad.shape())
                            .and_then(|t| b.cast(&t, DType::BF16));
                        match ones {
                            Ok(g) => p.grad = g,
                            Err(e) => outcome = Err(e.into()),
                        }
                    });
                    outcome?;
                    update(ctx, trainer, lr)?;
                    for (matrix, w) in &mut want {
                        let decay = if *matrix { 1.0 - lr * wd } else { 1.0 };
                        w.iter_mut()
                            .for_each(|x| *x = *x * decay - lr / (1.0 + 1e-8));
                    }
                }
                let masters = trainer.gather_full(ctx, Gather::Master)?;
                let params = trainer.gather_full(ctx, Gather::Values)?;
                for (((name, _, master), (_, _, value)), (_, want)) in
                    masters.iter().zip(&params).zip(&want)
                {
                    let err = master
                        .iter()
                        .zip(want)
                        .fold(0.0f64, |e, (a, w)| e.max((a - w).abs()));
                    assert!(
                        err < 1e-6,
                        "{name}: master off the f64 reference by {err:e}"
                    );
                    let host = Cpu.upload(HostData::F64(master.clone()), &[master.len()])?;
                    let rounded = values(&Cpu.round_bf16(&host)?);
                    assert_eq!(value, &rounded, "{name}");
                }
                visit(&trainer.model, &mut |p| {
                    assert_eq!(p.value.dtype(), DType::BF16)
                });
                Ok(())
            },
        );
    }

    /// A bf16 trainer on the CPU keeps f32 master weights and moments, its
    /// parameters stay bf16, and a few AdamW steps on one batch lower the loss.
    #[test]
    fn bf16_trainer_on_cpu_lowers_the_loss() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let cfg = TrainConfig {
            lr: 1e-2,
            warmup_steps: 1,
            ..TrainConfig::default()
        };
        one_rank(&Cpu, &spec, 5, DType::BF16, cfg, |ctx, trainer| {
            assert!(trainer.has_masters());
            for bk in &trainer.buckets {
                let state = [&bk.m, &bk.v].into_iter().chain(bk.master.as_ref());
                assert!(state.into_iter().all(|t| t.dtype() == DType::F32));
            }
            let batch = [(vec![3, 0, 6, 1, 7, 2, 5, 4], vec![0, 6, 1, -1, 2, 5, 4, 3])];
            let losses = (0..6)
                .map(|_| Ok(trainer.step(ctx, &batch, 4)?.loss))
                .collect::<Result<Vec<f64>>>()?;
            println!("bf16 trainer losses: {losses:?}");
            assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
            assert!(
                losses[5] < losses[0] - 0.05,
                "the loss did not fall: {losses:?}"
            );
            visit(&trainer.model, &mut |p| {
                assert_eq!(p.value.dtype(), DType::BF16, "{}", p.name);
                // bf16 is the top half of an f32: the low 16 bits are zero.
                let v = values(&p.value);
                let odd = v.iter().find(|&&x| (x as f32).to_bits() & 0xffff != 0);
                assert!(odd.is_none(), "{} holds {odd:?}, not a bf16 value", p.name);
            });
            Ok(())
        });
    }

    /// A decayed matrix's kind, dense or expert, neither tp-replicated nor
    /// a pipeline copy.
    fn decayed_kind(expert: bool) -> Kind {
        Kind {
            expert,
            decay: true,
            tp_replicated: false,
            pp_copy: false,
        }
    }

    #[test]
    fn buckets_close_at_the_size_walking_backwards_and_keep_kinds_apart() {
        let (dense, expert) = (decayed_kind(false), decayed_kind(true));
        // Parameters 0..6 in optimizer order: dense 0, 1, 3, 4; experts 2, 5.
        let params = [
            (dense, 4),
            (dense, 3),
            (expert, 5),
            (dense, 2),
            (dense, 6),
            (expert, 1),
        ];
        // One bucket per kind in order of first appearance: today's buckets.
        assert_eq!(
            plan_buckets(&params, usize::MAX),
            vec![(dense, vec![0, 1, 3, 4]), (expert, vec![2, 5])]
        );
        // Size 6, from the back: dense {4} (6) closes, then {3, 1} (5)
        // stays open until 0 joins (9); experts {5, 2} (6) close.
        assert_eq!(
            plan_buckets(&params, 6),
            vec![
                (dense, vec![0, 1, 3]),
                (expert, vec![2, 5]),
                (dense, vec![4])
            ]
        );
        // Size 1: every parameter alone.
        assert_eq!(plan_buckets(&params, 1).len(), params.len());
    }

    /// The update takes the buckets by the first forward unit reading
    /// them, dense before expert at a tie: a block's expert bucket goes
    /// before the later blocks' and the head's dense ones.
    #[test]
    fn gathers_start_in_the_order_the_next_forward_needs_them() {
        use crate::engine::model::ForwardUnit::{Block, Embedding, Head};
        let (dense, expert) = (decayed_kind(false), decayed_kind(true));
        let kinds = [dense, dense, expert, dense, expert, dense];
        let units = [
            vec![Some(Embedding), Some(Block(0))],
            vec![Some(Block(1)), Some(Block(2))],
            vec![Some(Block(1))],
            vec![Some(Head)],
            vec![Some(Block(3))],
            vec![None],
        ];
        assert_eq!(gather_order(&kinds, &units, 4), [0, 5, 1, 2, 4, 3]);
    }

    #[test]
    fn a_zero_bucket_size_is_an_error_and_the_default_follows_megatron() {
        use crate::engine::optim::{default_bucket_size, DdpConfig};
        let zero = DdpConfig {
            bucket_size: Some(0),
            ..DdpConfig::default()
        };
        let err = zero.resolved_bucket_size(2).unwrap_err();
        assert!(
            err.starts_with("ddp bucket size 0") && !err.contains('\n'),
            "{err}"
        );
        assert_eq!(
            DdpConfig::default().resolved_bucket_size(64),
            Ok(usize::MAX)
        );
        let overlap = DdpConfig {
            overlap_grad_reduce: true,
            ..DdpConfig::default()
        };
        assert_eq!(overlap.resolved_bucket_size(8), Ok(40_000_000));
        assert_eq!(overlap.resolved_bucket_size(64), Ok(64_000_000));
        assert_eq!(default_bucket_size(40), 40_000_000);
    }

    #[test]
    fn overlapped_reduction_starts_the_block_buckets_in_the_backward() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let cfg = TrainConfig {
            ddp: crate::engine::optim::DdpConfig {
                overlap_grad_reduce: true,
                overlap_param_gather: false,
                bucket_size: Some(64),
            },
            ..TrainConfig::default()
        };
        one_rank(&Cpu, &spec, 5, DType::F32, cfg, |ctx, t| {
            t.accumulate(ctx, &[rows(0..2), rows(2..4)], 4)?;
            // The blocks' buckets were started by their backward; those
            // holding the embedding or the head wait for the step's end.
            let started = t.in_flight.iter().filter(|p| p.is_some()).count();
            let outside = (0..t.buckets.len())
                .filter(|&k| t.buckets[k].members.iter().any(|m| t.owners[m.0].is_none()))
                .count();
            assert!(
                outside > 0 && started > 0,
                "{started} started, {outside} outside"
            );
            assert_eq!(started + outside, t.buckets.len());
            let chunks = t.reduce_gradients(ctx)?;
            assert_eq!(chunks.chunks.len(), t.buckets.len());
            Ok(())
        });
    }

    /// With `overlap_param_gather` every bucket's all-gather (dp = 2: dense
    /// and expert buckets alike) is still pending after the step, and the
    /// next forward waits for each only at the first unit reading it:
    /// before each unit exactly the pending buckets it reads land, later
    /// units' buckets stay pending, and once all have landed the hook waits
    /// for nothing. The parameters are then those of the unoverlapped step.
    #[test]
    fn pending_gathers_land_unit_by_unit_in_the_next_forward() {
        use crate::engine::model::ForwardUnit;
        use crate::engine::optim::DdpConfig;
        use crate::engine::parallel::run_local_layout;
        use crate::layout::LayoutSpec;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let layout =
            crate::layout::check(&LayoutSpec::parse("world=2,dp=2").unwrap(), &spec).unwrap();
        let run = |overlap: bool| {
            let cfg = TrainConfig {
                ddp: DdpConfig {
                    overlap_grad_reduce: false,
                    overlap_param_gather: overlap,
                    bucket_size: Some(64),
                },
                ..TrainConfig::default()
            };
            let timeout = std::time::Duration::from_secs(60);
            let mut results = run_local_layout(&Cpu, &layout, timeout, |ctx| {
                let model = Model::new(ctx.b, &spec, ctx.rank.clone(), 5, DType::F32)?;
                let mut t = Trainer::new(ctx.b, model, cfg)?;
                let i = ctx.rank.dp_index;
                let micro = [rows(2 * i..2 * i + 2)];
                t.step(ctx, &micro, 4)?;
                let n = t.buckets.len();
                assert!(n > 3, "{n} buckets");
                assert_eq!(t.pending_param_gathers(), if overlap { n } else { 0 });
                let mut seen: Vec<(ForwardUnit, Vec<usize>, usize)> = Vec::new();
                let (buckets, units) = (&t.buckets, &t.bucket_units);
                let gathers = &mut t.gathers;
                t.model.forward_chunk_with(
                    &ctx.exec(),
                    0,
                    None,
                    Batch::of(&micro[0]),
                    4,
                    &mut |model, unit| {
                        let before: Vec<bool> = gathers.iter().map(Option::is_some).collect();
                        settle_unit(ctx.b, model, buckets, units, gathers, unit)?;
                        let landed = (0..before.len())
                            .filter(|&k| before[k] && gathers[k].is_none())
                            .collect();
                        let left = gathers.iter().filter(|g| g.is_some()).count();
                        seen.push((unit, landed, left));
                        Ok(())
                    },
                )?;
                let reads = |k: usize, unit| t.bucket_units[k].contains(&Some(unit));
                for (unit, landed, _) in &seen {
                    assert!(
                        landed.iter().all(|&k| reads(k, *unit)),
                        "{unit:?}: {landed:?}"
                    );
                    for (k, g) in t.gathers.iter().enumerate() {
                        assert!(g.is_none() || !reads(k, *unit), "{unit:?} left {k}");
                    }
                }
                let units: Vec<ForwardUnit> = seen.iter().map(|s| s.0).collect();
                assert_eq!(
                    units,
                    [
                        ForwardUnit::Embedding,
                        ForwardUnit::Block(0),
                        ForwardUnit::Block(1),
                        ForwardUnit::Head
                    ]
                );
                if overlap {
                    // The embedding's unit left the blocks' and the head's
                    // buckets pending; every unit found one of its own.
                    assert!(seen[0].2 > 0, "{seen:?}");
                    assert!(seen.iter().all(|s| !s.1.is_empty()), "{seen:?}");
                }
                assert_eq!(t.pending_param_gathers(), 0);
                t.gather_full(ctx, Gather::Values)
            });
            results.remove(0).unwrap()
        };
        assert_eq!(run(true), run(false));
    }
}
