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

use std::collections::HashMap;

use foldmoe_kernels::{AdamWConfig, Backend, DType, Group, HostData, ReduceOp, Tensor};

use super::model::{ParallelFfn, ParallelModel};
use super::pipeline::{schedule, Mailbox, Pass, Tag};
use super::shard::{place_block, upload_as, ShardSpec, Split, SplitAxis};
use super::Ctx;
use crate::engine::optim::clip_coefficient;
use crate::engine::param::Param;
use crate::engine::trainer::{load_imbalance, StepStats, TrainConfig};
use crate::engine::{EngineError, Result};

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

/// `(loss, aux loss, loads per MoE layer)` of [`ParallelTrainer::accumulate`].
pub type Accumulated<B> = (Tensor<B>, Tensor<B>, Vec<Tensor<B>>);

/// A full tensor assembled from every rank: `(name, shape, values)`.
pub type FullTensor = (String, Vec<usize>, Vec<f64>);

/// What [`ParallelTrainer::gather_full`] assembles.
pub enum Gather<'a, B: Backend> {
    /// The parameters.
    Values,
    /// Reduced gradients (from [`ParallelTrainer::reduce_gradients`]).
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
pub struct ParallelTrainer<B: Backend> {
    /// The model shard being trained.
    pub model: ParallelModel<B>,
    /// Optimizer and schedule settings.
    pub cfg: TrainConfig,
    buckets: Vec<Bucket<B>>,
    /// Every parameter's kind, in optimizer order.
    kinds: Vec<Kind>,
    step: u64,
    /// Time the last [`Self::accumulate`] waited for other stages'
    /// activations and gradients (the pipeline bubble, with transfer time).
    pub pipeline_wait: std::time::Duration,
}

/// Every parameter in optimizer order (dense, then experts): its kind and shard.
fn params_of<B: Backend>(model: &ParallelModel<B>) -> Vec<(Kind, usize, Option<Box<ShardSpec>>)> {
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

fn visit_all_mut<B: Backend>(model: &mut ParallelModel<B>, f: &mut dyn FnMut(&mut Param<B>)) {
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

impl<B: Backend> ParallelTrainer<B> {
    /// A trainer with zero moments for this rank's chunks, and master
    /// copies of them taken from the parameters where `cfg.master_weights`
    /// applies to the model's dtype.
    pub fn new(b: &B, model: ParallelModel<B>, cfg: TrainConfig) -> Result<Self> {
        let (dp_cp, edp) = (model.rank.dp_cp.size(), model.rank.edp.size());
        let dtype = model.embed.table.value.dtype();
        let masters = cfg.master_weights.applies_to(dtype);
        let state = if masters { DType::F32 } else { dtype };
        let params = params_of(&model);
        let mut buckets: Vec<Bucket<B>> = Vec::new();
        for (i, (kind, numel, _)) in params.iter().enumerate() {
            let bucket = match buckets.iter_mut().position(|bk| bk.kind == *kind) {
                Some(j) => &mut buckets[j],
                None => {
                    buckets.push(Bucket {
                        kind: *kind,
                        members: Vec::new(),
                        len: 0,
                        chunk: 0,
                        m: b.zeros(&[1], state)?,
                        v: b.zeros(&[1], state)?,
                        master: None,
                    });
                    buckets.last_mut().expect("just pushed")
                }
            };
            bucket.members.push((i, bucket.len, *numel));
            bucket.len += numel;
        }
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
        Ok(ParallelTrainer {
            model,
            cfg,
            buckets,
            kinds: params.into_iter().map(|(k, _, _)| k).collect(),
            step: 0,
            pipeline_wait: std::time::Duration::ZERO,
        })
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
    pub(crate) fn try_visit_params(
        &self,
        f: &mut dyn FnMut(usize, &Param<B>) -> Result<()>,
    ) -> Result<()> {
        let mut i = 0;
        let mut outcome = Ok(());
        let mut visit = |p: &Param<B>| {
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
        micro_batches: &[(Vec<i32>, Vec<i32>)],
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
        let mut failure = None;
        visit_all_mut(&mut self.model, &mut |p| {
            if let Err(e) = p.zero_grad(b) {
                failure.get_or_insert(e);
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        let dtype = self.model.embed.table.value.dtype();
        let mut loss = b.zeros(&[1], dtype.acc())?;
        let mut aux = b.zeros(&[1], dtype)?;
        let mut loads: Vec<Option<Tensor<B>>> = Vec::new();
        let (pp, vpp) = (ctx.rank.pp.size(), self.model.chunk_count());
        let pp_ranks = ctx.rank.pp.ranks().to_vec();
        let last = pp * vpp - 1;
        let ops = schedule(pp, vpp, micro_batches.len(), ctx.rank.pp_index)?;
        let mut mailbox = Mailbox::new(&pp_ranks, ctx.rank.pp_index, vpp, micro_batches.len())?;
        let mut saved = HashMap::new();
        self.pipeline_wait = std::time::Duration::ZERO;
        // MoE layers of the chunks before each chunk: where its loads go.
        let mut moe_before = vec![0; vpp + 1];
        for (v, range) in self.model.chunk_ranges().iter().enumerate() {
            let moe = self.model.blocks[range.clone()]
                .iter()
                .filter(|bl| matches!(bl.ffn, ParallelFfn::Moe(_)))
                .count();
            moe_before[v + 1] = moe_before[v] + moe;
        }
        loads.resize(moe_before[vpp], None);
        for op in ops {
            let (tokens, targets) = &micro_batches[op.micro];
            let stage = self.model.virtual_stage(op.chunk);
            match op.pass {
                Pass::F => {
                    let input = if stage == 0 {
                        None
                    } else {
                        let tag = Tag {
                            pass: Pass::F,
                            micro: op.micro,
                            stage,
                        };
                        let waited = std::time::Instant::now();
                        let x = mailbox.take(ctx, &pp_ranks, tag)?;
                        self.pipeline_wait += waited.elapsed();
                        Some(x)
                    };
                    let out = self
                        .model
                        .forward_chunk(ctx, op.chunk, input, tokens, targets, seq_len)?;
                    if let Some(l) = &out.loss {
                        b.axpy(&mut loss, scale, l)?;
                    }
                    b.axpy(&mut aux, scale, &out.aux_loss)?;
                    for (acc, l) in loads[moe_before[op.chunk]..].iter_mut().zip(out.moe_load) {
                        match acc {
                            Some(acc) => b.axpy(acc, 1.0, &l)?,
                            None => *acc = Some(l),
                        }
                    }
                    if let Some(h) = &out.hidden {
                        ctx.comm.send(b, pp_ranks[(stage + 1) % pp], h)?;
                    }
                    saved.insert((op.micro, op.chunk), out.saved);
                }
                Pass::B => {
                    let chunk_saved = saved.remove(&(op.micro, op.chunk)).ok_or_else(|| {
                        EngineError::Invalid(format!(
                            "pipeline: backward of micro-batch {} chunk {} before its forward",
                            op.micro, op.chunk
                        ))
                    })?;
                    let output_grad = if stage == last {
                        None
                    } else {
                        let tag = Tag {
                            pass: Pass::B,
                            micro: op.micro,
                            stage,
                        };
                        let waited = std::time::Instant::now();
                        let d = mailbox.take(ctx, &pp_ranks, tag)?;
                        self.pipeline_wait += waited.elapsed();
                        Some(d)
                    };
                    let input_grad =
                        self.model
                            .backward_chunk(ctx, chunk_saved, output_grad, scale)?;
                    if let Some(d) = &input_grad {
                        ctx.comm.send(b, pp_ranks[(stage - 1) % pp], d)?;
                    }
                }
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
        Ok((loss, aux, loads))
    }

    /// Mean loss of one batch without gradients (validation), equal on every
    /// rank: the batch passes the virtual stages in order, each sending its
    /// output to the next, and the last stage's loss is summed over pp.
    pub fn evaluate(
        &self,
        ctx: &Ctx<B>,
        tokens: &[i32],
        targets: &[i32],
        seq_len: usize,
    ) -> Result<f64> {
        let b = ctx.b;
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
            let out = self
                .model
                .forward_chunk(ctx, chunk, input, tokens, targets, seq_len)?;
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
        let tied = self.model.head.weight.is_none();
        if tied && ctx.rank.embedding.size() > 1 && self.model.owns_embed() {
            // A tied table gets the embedding's gradient on the first stage
            // and the head's on the last: each needs their sum.
            let g = &self.model.embed.table.grad;
            let summed = ctx.sum_over(&ctx.rank.embedding, g)?;
            self.model.embed.table.grad = summed;
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
            let flat = pack(b, &parts, bk.chunk * group.size())?;
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
    pub fn step(
        &mut self,
        ctx: &Ctx<B>,
        micro_batches: &[(Vec<i32>, Vec<i32>)],
        seq_len: usize,
    ) -> Result<StepStats> {
        let b = ctx.b;
        let step = self.step + 1;
        let (loss, aux, mut loads) = self.accumulate(ctx, micro_batches, seq_len)?;
        let rank = ctx.rank;
        // The last stage's loss, summed over dp, reaches every stage
        // (the others add zeros), so every rank reports it.
        let loss = ctx.sum_over(&rank.pp, &ctx.sum_over(&rank.dp, &loss)?)?;
        let aux = ctx.sum_over(&rank.world, &aux)?;
        let (loss, aux_loss) = (
            b.download(&loss)?.to_f64()[0],
            b.download(&aux)?.to_f64()[0],
        );
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
        let mut load_imbalance = load_imbalance(b, &loads)?;
        if rank.pp.size() > 1 {
            // Each stage saw its own MoE layers: the worst over the pipeline.
            let mine = upload_as(b, vec![load_imbalance], &[1], DType::F32)?;
            let worst = ctx.comm.all_reduce(b, &rank.pp, &mine, ReduceOp::Max)?;
            load_imbalance = b.download(&worst)?.to_f64()[0];
        }
        Ok(StepStats {
            loss,
            aux_loss,
            grad_norm,
            lr,
            load_imbalance,
        })
    }

    /// Step 5: AdamW on this rank's chunk of every bucket, then all-gathers
    /// the buckets back into the parameters.
    fn apply(
        &mut self,
        ctx: &Ctx<B>,
        grads: &GradChunks<B>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let b = ctx.b;
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
        let mut updated: Vec<Option<Tensor<B>>> = vec![None; values.len()];
        let me = ctx.rank.rank;
        for (bk, g) in self.buckets.iter_mut().zip(&grads.chunks) {
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
            let full = if parts > 1 {
                ctx.comm.all_gather(b, group, &chunk)?
            } else {
                chunk
            };
            for &(i, offset, n) in &bk.members {
                let shape = values[i].shape().to_vec();
                updated[i] = Some(b.narrow(&full, offset, n)?.reshape(&shape)?);
            }
        }
        let mut it = updated.into_iter();
        visit_all_mut(&mut self.model, &mut |p| {
            if let Some(Some(v)) = it.next() {
                p.value = v;
            }
        });
        self.step += 1;
        Ok(())
    }

    /// Every full parameter `(name, full shape, values)` — or its reduced
    /// gradient, or an AdamW moment, as `what` says — assembled from all
    /// ranks' shards (a collective: every rank must call it; all get it).
    pub fn gather_full(&mut self, ctx: &Ctx<B>, what: Gather<'_, B>) -> Result<Vec<FullTensor>> {
        let b = ctx.b;
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
