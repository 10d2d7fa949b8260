//! One training step of one rank under a layout, with the distributed
//! optimizer (Megatron-Core's `DistributedOptimizer`):
//!
//! 1. forward/backward of this dp rank's micro-batches;
//! 2. parameters replicated over tp are summed over tp (sequence parallelism
//!    gave each tp rank a part of their gradient);
//! 3. each gradient, flattened and padded to a multiple of its data-parallel
//!    group (dp for dense parameters, edp for experts), is reduce-scattered:
//!    a rank keeps the sum of one chunk;
//! 4. the global norm adds every chunk once (tp-replicated chunks counted on
//!    tp rank 0 only), clipping scales the chunks;
//! 5. AdamW updates the chunk with the rank's moments (the optimizer state is
//!    sharded: 1/dp of the dense moments, 1/edp of the experts'), and the
//!    updated chunks are all-gathered back into the parameter.
//!
//! A non-finite loss or norm is seen by every rank (they are reduced first),
//! so all ranks refuse the step together.

use foldmoe_kernels::{AdamWConfig, Backend, Group, Tensor};

use super::model::ParallelModel;
use std::collections::HashMap;

use super::shard::{cut_block, place_block, upload_as, ShardSpec, Split, SplitAxis};
use super::{Ctx, RankLayout};
use crate::engine::param::Param;
use crate::engine::trainer::{StepStats, TrainConfig, Trainer};
use crate::engine::{EngineError, Result};

/// The optimizer state of one parameter's chunk.
struct ChunkState<B: Backend> {
    m: Tensor<B>,
    v: Tensor<B>,
    /// Elements of this rank's (tp/ep/etp) shard of the parameter.
    numel: usize,
    /// Elements per data-parallel chunk (the shard padded to a multiple of the group).
    chunk: usize,
    /// Whether the parameter is a matrix (1-d parameters get no weight decay).
    decay: bool,
    /// Whether the parameter is replicated over tp (its gradient summed there).
    tp_replicated: bool,
    /// Whether it is a routed expert's (reduced over edp rather than dp).
    expert: bool,
}

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
}

/// This rank's reduced gradient chunks, in parameter order (dense, then experts).
pub struct GradChunks<B: Backend> {
    /// One `[chunk]` tensor per parameter.
    pub chunks: Vec<Tensor<B>>,
}

/// A rank's model shard, its optimizer chunks and the run's settings.
pub struct ParallelTrainer<B: Backend> {
    /// The model shard being trained.
    pub model: ParallelModel<B>,
    /// Optimizer and schedule settings.
    pub cfg: TrainConfig,
    state: Vec<ChunkState<B>>,
    step: u64,
}

/// The parameters of a model shard in optimizer order, with whether each is a
/// routed expert's.
fn params_of<B: Backend>(model: &ParallelModel<B>) -> Vec<(bool, Vec<usize>, Option<ShardSpec>)> {
    let mut out = Vec::new();
    model.visit_dense(&mut |p| out.push((false, p.value.shape().to_vec(), p.shard.clone())));
    model.visit_experts(&mut |p| out.push((true, p.value.shape().to_vec(), p.shard.clone())));
    out
}

fn visit_all_mut<B: Backend>(model: &mut ParallelModel<B>, f: &mut dyn FnMut(&mut Param<B>)) {
    model.visit_dense_mut(f);
    model.visit_experts_mut(f);
}

impl<B: Backend> ParallelTrainer<B> {
    /// A trainer with zero moments for this rank's chunks.
    pub fn new(b: &B, model: ParallelModel<B>, cfg: TrainConfig) -> Result<Self> {
        let rank = &model.rank;
        let (dp, edp) = (rank.dp.size(), rank.edp.size());
        let mut state = Vec::new();
        for (expert, shape, shard) in params_of(&model) {
            let numel: usize = shape.iter().product();
            let parts = if expert { edp } else { dp };
            let chunk = numel.div_ceil(parts);
            let full_rank = shard.as_ref().map_or(shape.len(), |s| s.full_shape.len());
            let dtype = model.embed.table.value.dtype();
            state.push(ChunkState {
                m: b.zeros(&[chunk], dtype)?,
                v: b.zeros(&[chunk], dtype)?,
                numel,
                chunk,
                decay: full_rank > 1,
                tp_replicated: !expert
                    && !shard.as_ref().is_some_and(|s| s.split_over(SplitAxis::Tp)),
                expert,
            });
        }
        Ok(ParallelTrainer {
            model,
            cfg,
            state,
            step: 0,
        })
    }

    /// Shards a one-rank trainer (model, AdamW moments, step count) for
    /// `rank`: how a run starts from a seed or resumes from any checkpoint,
    /// whatever layout wrote it.
    pub fn from_trainer(b: &B, trainer: Trainer<B>, rank: RankLayout) -> Result<Self> {
        let Trainer { model, opt, cfg } = trainer;
        let step = opt.step_count();
        let mut moments: HashMap<String, Tensor<B>> = HashMap::new();
        opt.visit_state(&mut |name, t| {
            moments.insert(name.to_string(), t.clone());
        });
        let model = ParallelModel::from_model(b, model, rank)?;
        let mut sharded = ParallelTrainer::new(b, model, cfg)?;
        sharded.step = step;
        let mut params = Vec::new();
        sharded
            .model
            .visit_dense(&mut |p| params.push((p.name.clone(), p.shard.clone(), false)));
        sharded
            .model
            .visit_experts(&mut |p| params.push((p.name.clone(), p.shard.clone(), true)));
        let (dp, edp) = (&sharded.model.rank.dp, &sharded.model.rank.edp);
        let me = sharded.model.rank.rank;
        for ((name, shard, expert), st) in params.into_iter().zip(&mut sharded.state) {
            let group = if expert { edp } else { dp };
            let index = group.index_of(me).unwrap_or(0);
            for (suffix, into) in [("exp_avg", &mut st.m), ("exp_avg_sq", &mut st.v)] {
                let key = format!("{name}.{suffix}");
                let full = moments.get(&key).ok_or_else(|| {
                    EngineError::Invalid(format!("optimizer state has no tensor {key}"))
                })?;
                let dtype = full.dtype();
                let mut vals = b.download(full)?.to_f64();
                if let Some(spec) = &shard {
                    vals = cut_block(&vals, spec);
                }
                vals.resize(st.chunk * group.size(), 0.0);
                let chunk = vals[index * st.chunk..(index + 1) * st.chunk].to_vec();
                *into = upload_as(b, chunk, &[st.chunk], dtype)?;
            }
        }
        Ok(sharded)
    }

    /// Updates applied so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    fn group_of<'g>(ctx: &'g Ctx<B>, expert: bool) -> &'g Group {
        if expert {
            &ctx.rank.edp
        } else {
            &ctx.rank.dp
        }
    }

    /// Forward and backward of this dp rank's micro-batches (`(tokens,
    /// targets)` of `batch·seq_len` each); gradients are this rank's, not yet
    /// reduced. Returns `(loss, aux, loads)` summed over the micro-batches
    /// (loss and aux scaled by `1 / (dp · micro-batches)`), still local.
    pub fn accumulate(
        &mut self,
        ctx: &Ctx<B>,
        micro_batches: &[(Vec<i32>, Vec<i32>)],
        seq_len: usize,
    ) -> Result<(Tensor<B>, Tensor<B>, Vec<Tensor<B>>)> {
        let b = ctx.b;
        if micro_batches.is_empty() {
            return Err(EngineError::Invalid(format!(
                "rank {}: step {}: no micro-batches given",
                ctx.rank.rank,
                self.step + 1
            )));
        }
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
        let mut loss = b.zeros(&[1], dtype)?;
        let mut aux = b.zeros(&[1], dtype)?;
        let mut loads: Vec<Tensor<B>> = Vec::new();
        for (tokens, targets) in micro_batches {
            let out = self.model.forward(ctx, tokens, targets, seq_len)?;
            b.axpy(&mut loss, scale, &out.loss)?;
            b.axpy(&mut aux, scale, &out.aux_loss)?;
            if loads.is_empty() {
                loads = out.moe_load;
            } else {
                for (acc, l) in loads.iter_mut().zip(&out.moe_load) {
                    b.axpy(acc, 1.0, l)?;
                }
            }
            self.model.backward(ctx, out.saved, scale)?;
        }
        Ok((loss, aux, loads))
    }

    /// Steps 2–3: sums tp-replicated gradients over tp, then reduce-scatters
    /// every gradient over its data-parallel group.
    pub fn reduce_gradients(&mut self, ctx: &Ctx<B>) -> Result<GradChunks<B>> {
        let b = ctx.b;
        let mut grads = Vec::new();
        let mut collect = |p: &mut Param<B>| grads.push(p.grad.clone());
        visit_all_mut(&mut self.model, &mut collect);
        let mut chunks = Vec::with_capacity(grads.len());
        for (g, st) in grads.into_iter().zip(&self.state) {
            let g = if st.tp_replicated {
                ctx.sum_over(&ctx.rank.tp, &g)?
            } else {
                g
            };
            let group = Self::group_of(ctx, st.expert);
            let flat = padded_flat(b, g, st.numel, st.chunk * group.size())?;
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
        for (g, st) in grads.chunks.iter().zip(&self.state) {
            if st.tp_replicated && ctx.rank.tp_index != 0 {
                continue;
            }
            total = b.add(&total, &b.sum_squares(g)?)?;
        }
        let total = ctx.sum_over(&ctx.rank.stage, &total)?;
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
        let loss = ctx.sum_over(&rank.dp, &loss)?;
        let aux = ctx.sum_over(&rank.stage, &aux)?;
        let (loss, aux_loss) = (
            b.download(&loss)?.to_f64()[0],
            b.download(&aux)?.to_f64()[0],
        );
        if !loss.is_finite() || !aux_loss.is_finite() {
            return Err(EngineError::Invalid(format!(
                "step {step}: loss is {loss} (aux loss {aux_loss}); the update was not applied"
            )));
        }
        let mut grads = self.reduce_gradients(ctx)?;
        let grad_norm = self.grad_norm(ctx, &grads)?;
        if !grad_norm.is_finite() {
            return Err(EngineError::Invalid(format!(
                "step {step}: gradient norm is {grad_norm}; the update was not applied"
            )));
        }
        if self.cfg.grad_clip > 0.0 && grad_norm > self.cfg.grad_clip {
            let coef = self.cfg.grad_clip / (grad_norm + 1e-6);
            for g in &mut grads.chunks {
                *g = b.scale(g, coef)?;
            }
        }
        let lr = self.cfg.schedule().lr_at(step);
        self.apply(ctx, &grads, lr)?;
        for load in &mut loads {
            *load = ctx.sum_over(&rank.stage, load)?;
        }
        self.model.update_expert_biases(b, &loads)?;
        let mut load_imbalance: f64 = 1.0;
        for load in &loads {
            let l = b.download(load)?.to_f64();
            let mean = l.iter().sum::<f64>() / l.len().max(1) as f64;
            let max = l.iter().cloned().fold(0.0, f64::max);
            if mean > 0.0 {
                load_imbalance = load_imbalance.max(max / mean);
            }
        }
        Ok(StepStats {
            loss,
            aux_loss,
            grad_norm,
            lr,
            load_imbalance,
        })
    }

    /// Step 5: AdamW on this rank's chunks, then all-gathers the parameters.
    fn apply(&mut self, ctx: &Ctx<B>, grads: &GradChunks<B>, lr: f64) -> Result<()> {
        let b = ctx.b;
        let base = AdamWConfig {
            lr,
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            step: self.step + 1,
        };
        let mut values = Vec::new();
        visit_all_mut(&mut self.model, &mut |p| values.push(p.value.clone()));
        let mut updated = Vec::with_capacity(values.len());
        for ((value, g), st) in values.into_iter().zip(&grads.chunks).zip(&mut self.state) {
            let shape = value.shape().to_vec();
            let group = if st.expert {
                &ctx.rank.edp
            } else {
                &ctx.rank.dp
            };
            let (parts, index) = (group.size(), group.index_of(ctx.rank.rank).unwrap_or(0));
            let flat = padded_flat(b, value, st.numel, st.chunk * parts)?;
            let mut chunk = if parts > 1 {
                b.narrow(&flat, index * st.chunk, st.chunk)?
            } else {
                flat
            };
            let cfg = AdamWConfig {
                weight_decay: if st.decay { base.weight_decay } else { 0.0 },
                ..base
            };
            b.adamw_step(&mut chunk, g, &mut st.m, &mut st.v, &cfg)?;
            let full = if parts > 1 {
                ctx.comm.all_gather(b, group, &chunk)?
            } else {
                chunk
            };
            let full = if full.numel() == st.numel {
                full
            } else {
                b.narrow(&full, 0, st.numel)?
            };
            updated.push(full.reshape(&shape)?);
        }
        let mut it = updated.into_iter();
        visit_all_mut(&mut self.model, &mut |p| {
            if let Some(v) = it.next() {
                p.value = v;
            }
        });
        self.step += 1;
        Ok(())
    }

    /// Every full parameter `(name, full shape, values)` — or its reduced
    /// gradient, or an AdamW moment, as `what` says — assembled from all
    /// ranks' shards (a collective: every rank must call it; all get it).
    pub fn gather_full(
        &mut self,
        ctx: &Ctx<B>,
        what: Gather<'_, B>,
    ) -> Result<Vec<(String, Vec<usize>, Vec<f64>)>> {
        let b = ctx.b;
        let mut params = Vec::new();
        visit_all_mut(&mut self.model, &mut |p| {
            params.push((p.name.clone(), p.value.clone(), p.shard.clone()))
        });
        let mut out = Vec::with_capacity(params.len());
        for (i, (name, value, shard)) in params.into_iter().enumerate() {
            let st = &self.state[i];
            let chunk = match what {
                Gather::Values => None,
                Gather::Grads(g) => Some(&g.chunks[i]),
                Gather::ExpAvg => Some(&st.m),
                Gather::ExpAvgSq => Some(&st.v),
            };
            let local = match chunk {
                None => value.clone().reshape(&[st.numel])?,
                Some(chunk) => {
                    let group = Self::group_of(ctx, st.expert);
                    let full = if group.size() > 1 {
                        ctx.comm.all_gather(b, group, chunk)?
                    } else {
                        chunk.clone()
                    };
                    b.narrow(&full, 0, st.numel)?
                }
            };
            let full_shape = shard
                .as_ref()
                .map_or_else(|| value.shape().to_vec(), |s| s.full_shape.clone());
            let Some(spec) = shard else {
                out.push((name, full_shape, b.download(&local)?.to_f64()));
                continue;
            };
            let all = b
                .download(&ctx.comm.all_gather(b, &ctx.rank.stage, &local)?)?
                .to_f64();
            let mut full = vec![0.0; full_shape.iter().product()];
            let layout = &ctx.rank.layout;
            for (r, block) in all.chunks(st.numel).enumerate() {
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
                let spec_r = ShardSpec {
                    full_shape: full_shape.clone(),
                    splits,
                };
                place_block(&mut full, &spec_r, block);
            }
            out.push((name, full_shape, full));
        }
        Ok(out)
    }
}

/// `t` flattened to `[numel]` and zero-padded to `[padded]`.
fn padded_flat<B: Backend>(b: &B, t: Tensor<B>, numel: usize, padded: usize) -> Result<Tensor<B>> {
    let flat = t.reshape(&[numel])?;
    if padded == numel {
        return Ok(flat);
    }
    let pad = b.zeros(&[padded - numel], flat.dtype())?;
    Ok(b.concat(&[&flat, &pad])?)
}
