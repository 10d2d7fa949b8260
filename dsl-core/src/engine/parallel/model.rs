//! One rank's shard of the model and its forward/backward under a layout
//! (Megatron-Core's `GPTModel` with tensor, sequence, data and expert
//! parallelism).
//!
//! ```text
//! x_l   = reduce_scatter_tp(embed_vocab_shard(tokens))          // [T/tp, D]
//! block: x_l += reduce_scatter_tp(attn_heads_shard(all_gather_tp(norm(x_l))))
//!        x_l += reduce_scatter_tp(mlp_ffn_shard(all_gather_tp(norm(x_l))))   (dense)
//!        x_l += moe(norm(x_l))                                  (MoE, see `moe`)
//! logits_l = all_gather_tp(norm(x_l)) · W_vocab_shardᵀ           // [T, V/tp]
//! loss  = mean_t (lse_t − z_t), lse and the target logit z combined over tp
//! ```
//!
//! T is the micro-batch's tokens (all tp and cp ranks of a dp rank are given
//! the same micro-batch); with cp each rank first keeps its two chunks of
//! every sequence ([`context`]: T/cp tokens, attention exchanging keys and
//! values over cp, the loss a sum over cp of each rank's share of the mean);
//! a rank's sequence-parallel shard is rows `tp_index·T/(tp·cp) ..
//! (tp_index+1)·T/(tp·cp)` of those tokens.

use std::ops::Range;

use foldmoe_kernels::{Backend, DType, HostData, Tensor};

use super::context::{self, split_sequences, CpAttentionSaved};
use super::moe::{ParallelMoe, ParallelMoeSaved};
use super::shard::upload_as;
use super::{Ctx, RankLayout, ShardPlan};
use crate::engine::activations::{Held, Ledger, Slot, Stash};
use crate::engine::block::{
    rerun_dropped_layers, take, Attn, AttnSaved, BlockLayers, Ffn, ATTN_NORM_IN, MLP_NORM_IN,
};
use crate::engine::embedding::{Embedding, EmbeddingSaved, HeadSaved, LmHead};
use crate::engine::mlp::{MlpSaved, SwiGluMlp};
use crate::engine::model::Model;
use crate::engine::moe::MoeStats;
use crate::engine::norm::{NormSaved, RmsNorm};
use crate::engine::param::{Init, Module, Param};
use crate::engine::{EngineError, Result};
use crate::spec::{FfnSpec, ModelSpec, Policy, RecomputePart};

/// The feed-forward part of a parallel block.
pub enum ParallelFfn<B: Backend> {
    /// Dense SwiGLU MLP, its ffn split over tp.
    Dense(Box<SwiGluMlp<B>>),
    /// MoE layer over the expert mesh.
    Moe(Box<ParallelMoe<B>>),
}

enum FfnSaved<B: Backend> {
    Dense(MlpSaved<B>),
    Moe(Box<ParallelMoeSaved<B>>),
}

/// A pre-norm block of one rank.
pub struct ParallelBlock<B: Backend> {
    /// Norm before attention (replicated over tp).
    pub attn_norm: RmsNorm<B>,
    /// Attention with this rank's heads.
    pub attn: Attn<B>,
    /// Norm before the feed-forward (replicated over tp).
    pub ffn_norm: RmsNorm<B>,
    /// Dense MLP shard or MoE layer.
    pub ffn: ParallelFfn<B>,
    /// What the block recomputes, offloads and stores in fp8 (its group's).
    pub policy: Policy,
    /// Where the block counts its saved activations (the model's ledger).
    pub ledger: Ledger,
    /// The block's parameter prefix (`blocks.3`), its name in the ledger.
    name: String,
}

/// A parallel block's output, saved state and MoE statistics (if any).
type ParallelBlockOut<B> = (Tensor<B>, BlockSaved<B>, Option<MoeStats<B>>);

struct BlockSaved<B: Backend> {
    attn_norm: NormSaved<B>,
    attn: BlockAttnSaved<B>,
    ffn_norm: NormSaved<B>,
    ffn: FfnSaved<B>,
    /// What the policy did (none for a rerun's state).
    stash: Option<Stash>,
    /// Sequence length and micro-batch tokens of the forward, for a rerun.
    seq_len: usize,
    tokens: usize,
}

impl<B: Backend> BlockSaved<B> {
    /// Starts bringing this block's offloaded tensors back, one block ahead
    /// of its backward.
    fn prefetch(&mut self, b: &B) -> Result<()> {
        self.stash.as_mut().map_or(Ok(()), |s| s.prefetch(b))
    }
}

/// The single-rank block's list, with the context-parallel attention's and
/// the expert-parallel MoE layer's own state.
impl<B: Backend> BlockLayers<B> for BlockSaved<B> {
    fn visit_layer(&mut self, layer: usize, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match layer {
            0 => self.attn_norm.visit_saved(ATTN_NORM_IN, f),
            1 => self.attn.visit_saved(f),
            2 => self.ffn_norm.visit_saved(MLP_NORM_IN, f),
            _ => self.ffn.visit_saved(f),
        }
    }
}

impl<B: Backend> BlockAttnSaved<B> {
    fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            BlockAttnSaved::Local(s) => s.visit_saved(f),
            BlockAttnSaved::Cp(s) => s.visit_saved(f),
        }
    }
}

impl<B: Backend> FfnSaved<B> {
    fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            FfnSaved::Dense(s) => s.visit_saved_as_block_ffn(f),
            FfnSaved::Moe(s) => s.visit_saved(f),
        }
    }
}

/// The attention's saved state: the plain layer's, or context-parallel.
enum BlockAttnSaved<B: Backend> {
    Local(AttnSaved<B>),
    Cp(Box<CpAttentionSaved<B>>),
}

/// One rank's shard of a decoder-only MoE language model.
pub struct ParallelModel<B: Backend> {
    /// The full model's spec.
    pub spec: ModelSpec,
    /// This rank's place in the layout.
    pub rank: RankLayout,
    /// Rows `vocab_start..vocab_start + V/tp` of the embedding table.
    pub embed: Embedding<B>,
    /// The blocks, first to last.
    pub blocks: Vec<ParallelBlock<B>>,
    /// Norm before the head (replicated over tp).
    pub final_norm: RmsNorm<B>,
    /// The head's vocabulary shard (or tied to `embed`).
    pub head: LmHead<B>,
    /// Counts of this rank's saved activations (its blocks'), shared with them.
    pub ledger: Ledger,
    vocab_start: usize,
    /// Indices into `blocks` of each model chunk (virtual stage) of this rank.
    chunks: Vec<Range<usize>>,
    /// The full model's layer index of each of `blocks`.
    layers: Vec<usize>,
}

/// What [`ParallelModel::backward`] needs from the forward.
pub struct ParallelSaved<B: Backend>(ChunkSaved<B>);

/// The embedding's saved state and, with tp > 1, the `[T]` mask of tokens
/// whose id is in this rank's vocabulary shard.
type EmbedSaved<B> = (EmbeddingSaved<B>, Option<Tensor<B>>);

/// What [`ParallelModel::backward_chunk`] needs from a chunk's forward.
pub struct ChunkSaved<B: Backend> {
    chunk: usize,
    /// The first virtual stage's embedding.
    embed: Option<EmbedSaved<B>>,
    blocks: Vec<BlockSaved<B>>,
    /// The last virtual stage's head and loss.
    head: Option<LossSaved<B>>,
}

/// What the loss's backward needs.
struct LossSaved<B: Backend> {
    final_norm: NormSaved<B>,
    head: HeadSaved<B>,
    logits_tv: Tensor<B>,
    ce: CeSaved<B>,
    /// `[T]`: valid / count, the gradient of the mean loss per token (in
    /// the accumulation type, as the cross-entropy's backward takes it).
    dloss_t: Tensor<B>,
}

/// A model chunk's forward.
pub struct ChunkOut<B: Backend> {
    /// The output for the next virtual stage (none on the last).
    pub hidden: Option<Tensor<B>>,
    /// Mean cross-entropy of the micro-batch, `[1]`, on the last virtual
    /// stage; in the model dtype's accumulation type ([`DType::acc`]: F32
    /// for a BF16 model), the aux loss in the model's dtype.
    pub loss: Option<Tensor<B>>,
    /// This rank's part of the chunk's MoE losses, `[1]`.
    pub aux_loss: Tensor<B>,
    /// This rank's tokens routed to each expert, `[E]` per MoE layer of the chunk.
    pub moe_load: Vec<Tensor<B>>,
    /// Input of [`ParallelModel::backward_chunk`].
    pub saved: ChunkSaved<B>,
}

/// What the cross-entropy's backward needs.
enum CeSaved<B: Backend> {
    /// One tp rank: the plain kernel.
    Whole {
        targets_t: Tensor<B>,
        lse_t: Tensor<B>,
    },
    /// Vocabulary-parallel: local targets (`-1` outside the shard), the
    /// global log-sum-exp, and `outside_share_t = (1 − in_shard)·Σ_{v in
    /// shard} softmax`, which scales the local softmax for rows whose target
    /// lives on another rank (both in the accumulation type).
    Vocab {
        local_targets_t: Tensor<B>,
        lse_t: Tensor<B>,
        outside_share_t: Tensor<B>,
    },
}

/// A forward's losses (this rank's parts) and routing loads.
pub struct ParallelOut<B: Backend> {
    /// Mean cross-entropy of the micro-batch, `[1]` (equal on the tp ranks),
    /// in the accumulation type of the model's dtype ([`DType::acc`]).
    pub loss: Tensor<B>,
    /// This rank's part of the MoE losses, `[1]`: their sum over tp is the
    /// micro-batch's aux + z loss.
    pub aux_loss: Tensor<B>,
    /// This rank's tokens routed to each expert, `[E]` per MoE layer.
    pub moe_load: Vec<Tensor<B>>,
    /// Input of [`ParallelModel::backward`].
    pub saved: ParallelSaved<B>,
}

impl<B: Backend> ParallelModel<B> {
    /// Builds `rank`'s shard of the model `spec` describes, shard first:
    /// only the stage's layers, each parameter drawn as the block the
    /// [`ShardPlan`] gives the rank (the same values as those of one rank's
    /// whole model of `seed`), the embedding and head only where the stage
    /// trains them.
    pub fn new(b: &B, spec: &ModelSpec, rank: RankLayout, seed: u64, dtype: DType) -> Result<Self> {
        let plan = ShardPlan::new(spec, &rank);
        let last = rank.pp_index + 1 == rank.pp.size();
        let embed_and_head = rank.pp_index == 0 || last;
        let model = Model::build(
            b,
            spec,
            Init::sharded(seed, &plan),
            plan.layers(),
            embed_and_head,
            dtype,
        )?;
        Self::from_plan(b, model, plan)
    }

    /// The parallel form of `model`, whose parameters are already the
    /// blocks `plan` gives (built by [`Model::build`] under it).
    fn from_plan(b: &B, model: Model<B>, plan: ShardPlan) -> Result<Self> {
        let Model {
            spec,
            embed,
            blocks,
            final_norm,
            head,
            ledger,
        } = model;
        let rank = plan.rank().clone();
        let (tp, cp) = (rank.tp.size(), rank.cp.size());
        let mut out_blocks = Vec::with_capacity(blocks.len());
        for (block, &layer) in blocks.into_iter().zip(plan.layers()) {
            let mut attn = block.attn;
            match &mut attn {
                Attn::Gqa(a) => a.take_heads(tp)?,
                Attn::Mla(_) if tp > 1 || cp > 1 => {
                    return Err(EngineError::Invalid(format!(
                        "model {}: MLA attention under tp = {tp}, cp = {cp} is not supported \
                         by the parallel runtime yet; use tp = cp = 1 (ep, etp, dp work)",
                        spec.name
                    )));
                }
                Attn::Mla(_) => {}
            }
            let ffn = match block.ffn {
                Ffn::Dense(mlp) => ParallelFfn::Dense(mlp),
                Ffn::Moe(moe) => {
                    let Some(FfnSpec::Moe(moe_spec)) = spec.group_of_layer(layer).map(|g| &g.ffn)
                    else {
                        return Err(EngineError::Invalid(format!(
                            "model {}: an MoE block where the spec declares a dense one",
                            spec.name
                        )));
                    };
                    ParallelFfn::Moe(Box::new(ParallelMoe::from_layer(*moe, moe_spec)))
                }
            };
            out_blocks.push(ParallelBlock {
                attn_norm: block.attn_norm,
                attn,
                ffn_norm: block.ffn_norm,
                ffn,
                policy: block.policy,
                name: block.name,
                ledger: ledger.clone(),
            });
        }
        let _ = b;
        Ok(ParallelModel {
            vocab_start: plan.vocab_rows().0,
            ledger,
            spec,
            rank,
            embed,
            blocks: out_blocks,
            final_norm,
            head,
            chunks: plan.chunks().to_vec(),
            layers: plan.layers().to_vec(),
        })
    }

    /// Loss of this dp rank's micro-batch `tokens, targets: [batch·seq_len]`
    /// (host ids, as the data loader gives them; a target of `-1` is ignored).
    /// The whole model: only without a pipeline (see [`Self::forward_chunk`]).
    pub fn forward(
        &self,
        ctx: &Ctx<B>,
        tokens: &[i32],
        targets: &[i32],
        seq_len: usize,
    ) -> Result<ParallelOut<B>> {
        if self.rank.pp.size() > 1 {
            return Err(EngineError::Invalid(format!(
                "parallel forward of the whole model on rank {} of a pipeline of {} stages; \
                 run the stages' chunks with forward_chunk (ParallelTrainer::accumulate does)",
                self.rank.rank,
                self.rank.pp.size()
            )));
        }
        let out = self.forward_chunk(ctx, 0, None, tokens, targets, seq_len)?;
        let loss = out.loss.ok_or_else(|| {
            EngineError::Invalid("parallel forward: the only stage computed no loss".into())
        })?;
        Ok(ParallelOut {
            loss,
            aux_loss: out.aux_loss,
            moe_load: out.moe_load,
            saved: ParallelSaved(out.saved),
        })
    }

    /// Inference logits `[T, V]` of `tokens` (sequences of `seq_len`, host
    /// ids) on a rank that holds the whole model (no tp, cp or pp: one rank,
    /// or data parallel only); nothing is kept for a backward.
    pub fn logits(&self, ctx: &Ctx<B>, tokens: &[i32], seq_len: usize) -> Result<Tensor<B>> {
        let r = &self.rank;
        if r.tp.size() > 1 || r.cp.size() > 1 || r.pp.size() > 1 {
            return Err(EngineError::Invalid(format!(
                "logits on rank {} of layout {}: generation needs the whole model on a rank \
                 (tp = cp = pp = 1)",
                r.rank, r.layout.name
            )));
        }
        if seq_len == 0 || !tokens.len().is_multiple_of(seq_len) {
            return Err(EngineError::Invalid(format!(
                "logits: {} tokens do not form sequences of {seq_len}",
                tokens.len()
            )));
        }
        let b = ctx.b;
        let (mut x_td, _) = self.embed_tokens(ctx, tokens)?;
        for block in &self.blocks {
            x_td = block.forward_raw(ctx, &x_td, seq_len, tokens.len())?.0;
        }
        let (h_td, _) = self.final_norm.forward(b, &x_td)?;
        Ok(self.head.forward(b, &self.embed, &h_td)?.0)
    }

    /// Model chunks this rank holds (`vpp`).
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The virtual pipeline stage of this rank's model chunk `chunk`.
    pub fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.rank.pp.size() + self.rank.pp_index
    }

    fn is_first(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) == 0
    }

    fn is_last(&self, chunk: usize) -> bool {
        self.virtual_stage(chunk) + 1 == self.rank.pp.size() * self.chunks.len()
    }

    /// Whether this rank trains the embedding table: the first stage, and
    /// the last when the head is tied to it.
    pub fn owns_embed(&self) -> bool {
        self.rank.pp_index == 0 || (self.owns_head() && self.head.weight.is_none())
    }

    /// Whether this rank trains the final norm and the head (the last stage).
    pub fn owns_head(&self) -> bool {
        self.rank.pp_index + 1 == self.rank.pp.size()
    }

    /// Whether this rank's embedding table is the last stage's copy of a tied
    /// table: its gradient is summed with the first stage's over the
    /// embedding group, and it is counted once (on the first stage).
    pub fn embed_is_copy(&self) -> bool {
        self.rank.pp_index > 0 && self.owns_embed()
    }

    /// Indices into `blocks` of each of this rank's model chunks.
    pub fn chunk_ranges(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// The full model's layer index of each of this rank's blocks.
    pub fn global_layers(&self) -> &[usize] {
        &self.layers
    }

    /// Forward of model chunk `chunk` on micro-batch `tokens, targets`: the
    /// first virtual stage embeds `tokens`, the others take `input` (the
    /// previous virtual stage's output, this rank's sequence-parallel shard);
    /// the last virtual stage computes the loss, the others return their
    /// output for the next.
    pub fn forward_chunk(
        &self,
        ctx: &Ctx<B>,
        chunk: usize,
        input: Option<Tensor<B>>,
        tokens: &[i32],
        targets: &[i32],
        seq_len: usize,
    ) -> Result<ChunkOut<B>> {
        let b = ctx.b;
        let tp = self.rank.tp.size();
        let (cp, cp_i) = (self.rank.cp.size(), self.rank.cp_index);
        let micro_tokens = tokens.len();
        if targets.len() != micro_tokens || seq_len == 0 || !micro_tokens.is_multiple_of(seq_len) {
            return Err(EngineError::Invalid(format!(
                "parallel forward: {micro_tokens} tokens and {} targets do not form sequences of \
                 {seq_len}",
                targets.len()
            )));
        }
        // The mean is over the whole micro-batch, whichever cp rank holds a token.
        let count = targets.iter().filter(|&&y| y >= 0).count();
        let tokens = &split_sequences(tokens, seq_len, cp, cp_i)?;
        let targets = &split_sequences(targets, seq_len, cp, cp_i)?;
        let t = tokens.len();
        if !t.is_multiple_of(tp) {
            return Err(EngineError::Invalid(format!(
                "parallel forward: {t} tokens of the micro-batch do not split over tp = {tp} \
                 (sequence parallelism)"
            )));
        }
        if chunk >= self.chunks.len() {
            return Err(EngineError::Invalid(format!(
                "parallel forward: chunk {chunk} of a rank holding {}",
                self.chunks.len()
            )));
        }
        let dtype = self.embed.table.value.dtype();
        let (x_td, embed) = match (self.is_first(chunk), input) {
            (true, None) => {
                let (x, saved) = self.embed_tokens(ctx, tokens)?;
                (x, Some(saved))
            }
            (false, Some(x)) => (x, None),
            (first, _) => {
                return Err(EngineError::Invalid(format!(
                    "parallel forward: virtual stage {} {} an input from the previous stage",
                    self.virtual_stage(chunk),
                    if first { "takes no" } else { "needs" }
                )))
            }
        };

        let mut x_td = x_td;
        let mut blocks = Vec::new();
        let mut aux_loss = b.zeros(&[1], dtype)?;
        let mut moe_load = Vec::new();
        for block in &self.blocks[self.chunks[chunk].clone()] {
            let (y, saved, stats) = block.forward(ctx, &x_td, seq_len, micro_tokens)?;
            if let Some(stats) = stats {
                aux_loss = b.add(&b.add(&aux_loss, &stats.aux_loss)?, &stats.z_loss)?;
                moe_load.push(stats.load);
            }
            blocks.push(saved);
            x_td = y;
        }
        let (hidden, loss, head) = if self.is_last(chunk) {
            let (loss, saved) = self.loss(ctx, &x_td, targets, count, dtype)?;
            (None, Some(loss), Some(saved))
        } else {
            (Some(x_td), None, None)
        };
        Ok(ChunkOut {
            hidden,
            loss,
            aux_loss,
            moe_load,
            saved: ChunkSaved {
                chunk,
                embed,
                blocks,
                head,
            },
        })
    }

    /// Embedding: this rank's vocabulary rows, zero elsewhere, summed over tp.
    fn embed_tokens(&self, ctx: &Ctx<B>, tokens: &[i32]) -> Result<(Tensor<B>, EmbedSaved<B>)> {
        let b = ctx.b;
        let t = tokens.len();
        let tp = self.rank.tp.size();
        let dtype = self.embed.table.value.dtype();
        let vocab_local = self.embed.table.value.shape()[0];
        let (v0, v1) = (self.vocab_start, self.vocab_start + vocab_local);
        for &id in tokens {
            if id < 0 || id as usize >= self.spec.vocab {
                return Err(EngineError::Invalid(format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.spec.vocab
                )));
            }
        }
        let in_shard = |id: i32| id >= 0 && (id as usize) >= v0 && (id as usize) < v1;
        let local_ids: Vec<i32> = tokens
            .iter()
            .map(|&id| if in_shard(id) { id - v0 as i32 } else { 0 })
            .collect();
        let ids_t = b.upload(HostData::I32(local_ids), &[t])?;
        let (emb_td, embed) = self.embed.forward(b, &ids_t)?;
        if tp == 1 {
            return Ok((emb_td, (embed, None)));
        }
        let mask: Vec<f64> = tokens
            .iter()
            .map(|&id| if in_shard(id) { 1.0 } else { 0.0 })
            .collect();
        let mask_t = upload_as(b, mask, &[t], dtype)?;
        let x = ctx.scatter_tp(&b.mul_rows(&emb_td, &mask_t)?)?;
        Ok((x, (embed, Some(mask_t))))
    }

    /// Final norm, head and the mean cross-entropy of the micro-batch, whose
    /// `count` valid targets are spread over the cp ranks (`targets` this
    /// rank's).
    fn loss(
        &self,
        ctx: &Ctx<B>,
        x_td: &Tensor<B>,
        targets: &[i32],
        count: usize,
        dtype: DType,
    ) -> Result<(Tensor<B>, LossSaved<B>)> {
        let b = ctx.b;
        let t = targets.len();
        for &y in targets {
            if y < -1 || y >= self.spec.vocab as i32 {
                return Err(EngineError::Invalid(format!(
                    "target {y} is outside the vocabulary of {} (and not -1, ignored)",
                    self.spec.vocab
                )));
            }
        }
        let (h_td, final_norm) = self.final_norm.forward(b, x_td)?;
        let h_full = ctx.gather_tp(&h_td)?;
        let (logits_tv, head) = self.head.forward(b, &self.embed, &h_full)?;
        let valid: Vec<f64> = targets.iter().map(|&y| f64::from(y >= 0)).collect();
        let inv = if count > 0 { 1.0 / count as f64 } else { 0.0 };
        // The per-token loss comes in the accumulation type (f32 for bf16,
        // as Megatron-Core's fp32 cross-entropy), and so does the mean.
        let acc = dtype.acc();
        let dloss_t = upload_as(b, valid.iter().map(|v| v * inv).collect(), &[t], acc)?;
        let (loss_t, ce) = if self.rank.tp.size() == 1 {
            let targets_t = b.upload(HostData::I32(targets.to_vec()), &[t])?;
            let (loss_t, lse_t) = b.cross_entropy(&logits_tv, &targets_t)?;
            (loss_t, CeSaved::Whole { targets_t, lse_t })
        } else {
            self.vocab_parallel_ce(ctx, &logits_tv, targets, dtype)?
        };
        // Each cp rank's sum is part of the mean; the sum makes it equal on all.
        let loss = ctx.sum_over(&self.rank.cp, &b.sum(&b.mul(&loss_t, &dloss_t)?)?)?;
        Ok((
            loss,
            LossSaved {
                final_norm,
                head,
                logits_tv,
                ce,
                dloss_t,
            },
        ))
    }

    /// Per-token cross-entropy with the vocabulary split over tp:
    /// `lse = log Σ_r exp(lse_r)` and the target logit summed from the rank
    /// that holds it. Returns the loss per token (`0` for ignored targets).
    /// Everything after the local logits is in the accumulation type of
    /// `dtype` (f32 for bf16), as the single-rank kernel's loss and lse; for
    /// f32 and f64 that is `dtype` itself and no cast is made.
    fn vocab_parallel_ce(
        &self,
        ctx: &Ctx<B>,
        logits_tv: &Tensor<B>,
        targets: &[i32],
        dtype: DType,
    ) -> Result<(Tensor<B>, CeSaved<B>)> {
        let b = ctx.b;
        let (t, vocab_local) = logits_tv.dims2("vocab_parallel_ce")?;
        let (tp, tp_i) = (self.rank.tp.size(), self.rank.tp_index);
        let v0 = self.vocab_start as i32;
        let in_shard: Vec<bool> = targets
            .iter()
            .map(|&y| y >= v0 && y < v0 + vocab_local as i32)
            .collect();
        let local_targets: Vec<i32> = targets
            .iter()
            .zip(&in_shard)
            .map(|(&y, &inside)| if inside { y - v0 } else { -1 })
            .collect();
        let clamped: Vec<i32> = local_targets.iter().map(|&y| y.max(0)).collect();
        let local_targets_t = b.upload(HostData::I32(local_targets), &[t])?;
        let acc = dtype.acc();
        let inside_t = upload_as(
            b,
            in_shard.iter().map(|&i| f64::from(i)).collect(),
            &[t],
            acc,
        )?;
        let outside_t = upload_as(
            b,
            in_shard
                .iter()
                .zip(targets)
                .map(|(&i, &y)| f64::from(!i && y >= 0))
                .collect(),
            &[t],
            acc,
        )?;

        // This rank's lse in the accumulation type: `logsumexp` returns the
        // logits' dtype, which would round a bf16 lse, so bf16 logits take
        // the cross-entropy kernel's f32 lse (its loss is not used).
        let lse_local_t = if dtype == acc {
            b.logsumexp(logits_tv)?
        } else {
            b.cross_entropy(logits_tv, &local_targets_t)?.1
        };
        // Every rank's lse, as columns [T, tp]: the transpose is a product
        // with the identity, which is exact.
        let lse_local_1t = lse_local_t.reshape(&[1, t])?;
        let lse_all_rt = ctx.comm.all_gather(b, &self.rank.tp, &lse_local_1t)?;
        let mut eye = vec![0.0; tp * tp];
        for i in 0..tp {
            eye[i * tp + i] = 1.0;
        }
        let eye = upload_as(b, eye, &[tp, tp], acc)?;
        let lse_tr = b.matmul(&lse_all_rt, &eye, true, false)?;
        let lse_t = b.logsumexp(&lse_tr)?;
        // Σ_{v in this shard} softmax(logits_t)_v = softmax over ranks' lse.
        let rank_col = b.upload(HostData::I32(vec![tp_i as i32; t]), &[t, 1])?;
        let share_t = b
            .gather_cols(&b.softmax(&lse_tr)?, &rank_col)?
            .reshape(&[t])?;
        let outside_share_t = b.mul(&share_t, &outside_t)?;

        let clamped_t1 = b.upload(HostData::I32(clamped), &[t, 1])?;
        // The target logit, widened exactly to the accumulation type.
        let z_sel_t = b.gather_cols(logits_tv, &clamped_t1)?.reshape(&[t])?;
        let z_local_t = b.mul(&in_dtype(b, z_sel_t, acc)?, &inside_t)?;
        let z_t = ctx.sum_over(&self.rank.tp, &z_local_t)?;
        let valid_t = upload_as(
            b,
            targets.iter().map(|&y| f64::from(y >= 0)).collect(),
            &[t],
            acc,
        )?;
        let loss_t = b.mul(&b.sub(&lse_t, &z_t)?, &valid_t)?;
        Ok((
            loss_t,
            CeSaved::Vocab {
                local_targets_t,
                lse_t,
                outside_share_t,
            },
        ))
    }

    /// Accumulates into this rank's parameters the gradients of
    /// `loss_scale · (loss + aux_loss)` (before any reduction over ranks).
    pub fn backward(
        &mut self,
        ctx: &Ctx<B>,
        saved: ParallelSaved<B>,
        loss_scale: f64,
    ) -> Result<()> {
        self.backward_chunk(ctx, saved.0, None, loss_scale)?;
        Ok(())
    }

    /// Backward of a model chunk's forward: `output_grad` is the gradient of
    /// its output from the next virtual stage (none on the last, which starts
    /// from the loss). Returns the gradient of its input for the previous
    /// virtual stage (none on the first, which ends in the embedding).
    pub fn backward_chunk(
        &mut self,
        ctx: &Ctx<B>,
        saved: ChunkSaved<B>,
        output_grad: Option<Tensor<B>>,
        loss_scale: f64,
    ) -> Result<Option<Tensor<B>>> {
        let b = ctx.b;
        let ChunkSaved {
            chunk,
            embed,
            blocks,
            head,
        } = saved;
        let mut dx_td = match (head, output_grad) {
            (Some(head), None) => self.loss_backward(ctx, head, loss_scale)?,
            (None, Some(d)) => d,
            _ => {
                return Err(EngineError::Invalid(
                    "parallel backward: a chunk needs either the loss or its output's gradient"
                        .into(),
                ))
            }
        };
        let range = self.chunks[chunk].clone();
        let mut blocks = blocks;
        if blocks.len() != range.len() {
            return Err(EngineError::Invalid(format!(
                "parallel backward: saved state of {} blocks for a chunk of {}",
                blocks.len(),
                range.len()
            )));
        }
        while let Some(saved) = blocks.pop() {
            // The next block's offloaded tensors come back while this one's
            // backward runs.
            if let Some(next) = blocks.last_mut() {
                next.prefetch(ctx.b)?;
            }
            dx_td =
                self.blocks[range.start + blocks.len()].backward(ctx, &dx_td, saved, loss_scale)?;
        }
        let Some((embed, embed_mask_t)) = embed else {
            return Ok(Some(dx_td));
        };
        let demb_td = match &embed_mask_t {
            Some(mask_t) => b.mul_rows(&ctx.gather_tp(&dx_td)?, mask_t)?,
            None => dx_td,
        };
        self.embed.backward(b, &demb_td, embed)?;
        Ok(None)
    }

    /// The cross-entropy, head and final norm backward: the gradient of the
    /// last block's output.
    fn loss_backward(
        &mut self,
        ctx: &Ctx<B>,
        saved: LossSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let LossSaved {
            final_norm,
            head,
            logits_tv,
            ce,
            dloss_t,
        } = saved;
        let dloss_t = b.scale(&dloss_t, loss_scale)?;
        let dlogits_tv = match ce {
            CeSaved::Whole { targets_t, lse_t } => {
                b.cross_entropy_backward(&logits_tv, &targets_t, &lse_t, &dloss_t)?
            }
            CeSaved::Vocab {
                local_targets_t,
                lse_t,
                outside_share_t,
            } => {
                // Rows whose target is here: the kernel, with the global lse.
                let mut d =
                    b.cross_entropy_backward(&logits_tv, &local_targets_t, &lse_t, &dloss_t)?;
                // Rows whose target is elsewhere: dloss · exp(logits − lse),
                // as the local softmax times the shard's share (in the
                // logits' dtype: for bf16 a few roundings of the gradient,
                // which is stored in bf16 anyway).
                let scale_t = b.mul(&dloss_t, &outside_share_t)?;
                let scale_t = in_dtype(b, scale_t, logits_tv.dtype())?;
                b.axpy(&mut d, 1.0, &b.mul_rows(&b.softmax(&logits_tv)?, &scale_t)?)?;
                d
            }
        };
        let dh_full = self.head.backward(b, &mut self.embed, &dlogits_tv, head)?;
        let dh_td = ctx.scatter_tp(&dh_full)?;
        self.final_norm.backward(b, &dh_td, final_norm)
    }

    /// Aux-loss-free balancing after a step, from the loads summed over every
    /// rank of the stage (one `[E]` per MoE layer).
    pub fn update_expert_biases(&mut self, b: &B, loads: &[Tensor<B>]) -> Result<()> {
        let mut loads = loads.iter();
        for block in &mut self.blocks {
            if let ParallelFfn::Moe(moe) = &mut block.ffn {
                let load = loads.next().ok_or_else(|| {
                    EngineError::Invalid("update_expert_biases: fewer loads than MoE layers".into())
                })?;
                moe.router.update_expert_bias(b, load)?;
            }
        }
        Ok(())
    }

    /// Calls `f` on the dense parameters (attention mesh: reduced over dp),
    /// in the full model's visit order.
    /// Only the parameters this rank trains: the embedding on the first
    /// stage (and the last when tied), the final norm and head on the last.
    pub fn visit_dense(&self, f: &mut dyn FnMut(&Param<B>)) {
        if self.owns_embed() {
            f(&self.embed.table);
        }
        for block in &self.blocks {
            block.attn_norm.visit_params(f);
            block.attn.visit_params(f);
            block.ffn_norm.visit_params(f);
            match &block.ffn {
                ParallelFfn::Dense(mlp) => mlp.visit_params(f),
                ParallelFfn::Moe(moe) => moe.visit_dense(f),
            }
        }
        if self.owns_head() {
            self.final_norm.visit_params(f);
            self.head.visit_params(f);
        }
    }

    /// Mutable [`Self::visit_dense`].
    pub fn visit_dense_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        if self.owns_embed() {
            f(&mut self.embed.table);
        }
        for block in &mut self.blocks {
            block.attn_norm.visit_params_mut(f);
            block.attn.visit_params_mut(f);
            block.ffn_norm.visit_params_mut(f);
            match &mut block.ffn {
                ParallelFfn::Dense(mlp) => mlp.visit_params_mut(f),
                ParallelFfn::Moe(moe) => moe.visit_dense_mut(f),
            }
        }
        if self.owns_head() {
            self.final_norm.visit_params_mut(f);
            self.head.visit_params_mut(f);
        }
    }

    /// Calls `f` on the routed experts' parameters (expert mesh: reduced over edp).
    pub fn visit_experts(&self, f: &mut dyn FnMut(&Param<B>)) {
        for block in &self.blocks {
            if let ParallelFfn::Moe(moe) = &block.ffn {
                moe.experts.visit_params(f);
            }
        }
    }

    /// Mutable [`Self::visit_experts`].
    pub fn visit_experts_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        for block in &mut self.blocks {
            if let ParallelFfn::Moe(moe) = &mut block.ffn {
                moe.experts.visit_params_mut(f);
            }
        }
    }
}

/// `x` in `dtype`: itself when it already is (no op, so f32 and f64 models
/// run the ops they always did), else cast.
fn in_dtype<B: Backend>(b: &B, x: Tensor<B>, dtype: DType) -> Result<Tensor<B>> {
    Ok(if x.dtype() == dtype {
        x
    } else {
        b.cast(&x, dtype)?
    })
}

impl<B: Backend> ParallelBlock<B> {
    /// The block's forward, its saved state under its policy and counted in
    /// its ledger (as [`super::super::block::Block::forward`]).
    fn forward(
        &self,
        ctx: &Ctx<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<ParallelBlockOut<B>> {
        let (y, mut saved, stats) = self.forward_raw(ctx, x_td, seq_len, tokens)?;
        let stash = Stash::apply(ctx.b, &self.policy, &self.ledger, &self.name, |f| {
            saved.visit_saved(f)
        })?;
        saved.stash = Some(stash);
        Ok((y, saved, stats))
    }

    /// Undoes the policy before backward: fetches stashed tensors and, if
    /// any were dropped, reruns what dropped them, as the single-rank
    /// block does (`block`: the whole forward from the kept block input; a
    /// selective part: only its layer, from the layer's kept input). The
    /// rerun's collectives (tp gathers, cp's key/value gather, the ep
    /// exchange) pair up because every rank of a group has the same policy
    /// and runs the same block's backward at the same point of the schedule.
    fn restore(&self, ctx: &Ctx<B>, saved: &mut BlockSaved<B>) -> Result<Option<Held>> {
        let b = ctx.b;
        let Some(mut stash) = saved.stash.take() else {
            return Ok(None);
        };
        stash.restore(b, None, |f| saved.visit_saved(f))?;
        if !stash.needs_recompute() {
            return Ok(None);
        }
        let (seq_len, tokens) = (saved.seq_len, saved.tokens);
        let ranges = saved.ranges();
        let mut fresh: Vec<Option<Tensor<B>>> = vec![None; ranges[3].end];
        if self.policy.recompute.contains(&RecomputePart::Block) {
            let (_, mut all, _) =
                self.forward_raw(ctx, saved.attn_norm.input(), seq_len, tokens)?;
            all.visit_saved(&mut take(&mut fresh, 0));
        } else {
            let norms = [
                (&self.attn_norm, saved.attn_norm.input(), ATTN_NORM_IN),
                (&self.ffn_norm, saved.ffn_norm.input(), MLP_NORM_IN),
            ];
            rerun_dropped_layers(b, &stash, &ranges, norms, &mut fresh, |layer, h, f| {
                if layer == 0 {
                    self.attn_forward(ctx, h, seq_len)?.1.visit_saved(f);
                } else {
                    // Only the saved state is wanted: the dense MLP's output
                    // need not be scattered over tp.
                    let mut ffn = match &self.ffn {
                        ParallelFfn::Dense(mlp) => {
                            FfnSaved::Dense(mlp.forward(b, &ctx.gather_tp(h)?)?.1)
                        }
                        ParallelFfn::Moe(moe) => {
                            FfnSaved::Moe(Box::new(moe.forward(ctx, h, seq_len, tokens)?.1))
                        }
                    };
                    ffn.visit_saved(f);
                }
                Ok(())
            })?;
        }
        let refilled = stash.restore(b, Some(fresh), |f| saved.visit_saved(f))?;
        Ok(Some(self.ledger.hold(&self.name, refilled, 0)))
    }

    /// Attention from this rank's sequence shard `h` of the normed input:
    /// gathered over tp, then the local layer or, under cp, its
    /// context-parallel form. Returns the tp-full output and the state.
    fn attn_forward(
        &self,
        ctx: &Ctx<B>,
        h: &Tensor<B>,
        seq_len: usize,
    ) -> Result<(Tensor<B>, BlockAttnSaved<B>)> {
        let h_full = ctx.gather_tp(h)?;
        Ok(match &self.attn {
            Attn::Gqa(a) if ctx.rank.cp.size() > 1 => {
                let (y, saved) = context::forward(ctx, a, &h_full, seq_len)?;
                (y, BlockAttnSaved::Cp(Box::new(saved)))
            }
            _ => {
                let (y, saved) = self.attn.forward(ctx.b, &h_full, seq_len)?;
                (y, BlockAttnSaved::Local(saved))
            }
        })
    }

    /// The forward with every saved tensor kept and nothing counted.
    fn forward_raw(
        &self,
        ctx: &Ctx<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<ParallelBlockOut<B>> {
        let b = ctx.b;
        let (h, attn_norm) = self.attn_norm.forward(b, x_td)?;
        let (a_full, attn) = self.attn_forward(ctx, &h, seq_len)?;
        let x1 = b.add(x_td, &ctx.scatter_tp(&a_full)?)?;
        let (h2, ffn_norm) = self.ffn_norm.forward(b, &x1)?;
        let (y, ffn, stats) = match &self.ffn {
            ParallelFfn::Dense(mlp) => {
                let (m_full, saved) = mlp.forward(b, &ctx.gather_tp(&h2)?)?;
                (ctx.scatter_tp(&m_full)?, FfnSaved::Dense(saved), None)
            }
            ParallelFfn::Moe(moe) => {
                let (y, saved, stats) = moe.forward(ctx, &h2, seq_len, tokens)?;
                (y, FfnSaved::Moe(Box::new(saved)), Some(stats))
            }
        };
        let out = b.add(&x1, &y)?;
        let saved = BlockSaved {
            attn_norm,
            attn,
            ffn_norm,
            ffn,
            stash: None,
            seq_len,
            tokens,
        };
        Ok((out, saved, stats))
    }

    fn backward(
        &mut self,
        ctx: &Ctx<B>,
        dy_td: &Tensor<B>,
        mut saved: BlockSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        // Rematerialised tensors count until this backward returns.
        let _rematerialised = self.restore(ctx, &mut saved)?;
        let BlockSaved {
            attn_norm,
            attn,
            ffn_norm,
            ffn,
            ..
        } = saved;
        let dh2 = match (&mut self.ffn, ffn) {
            (ParallelFfn::Dense(mlp), FfnSaved::Dense(s)) => {
                let d_full = mlp.backward(b, &ctx.gather_tp(dy_td)?, s)?;
                ctx.scatter_tp(&d_full)?
            }
            (ParallelFfn::Moe(moe), FfnSaved::Moe(s)) => {
                moe.backward(ctx, dy_td, *s, loss_scale)?
            }
            _ => {
                return Err(EngineError::Invalid(
                    "parallel block backward: saved state of another feed-forward kind".into(),
                ))
            }
        };
        let mut dx1 = self.ffn_norm.backward(b, &dh2, ffn_norm)?;
        b.axpy(&mut dx1, 1.0, dy_td)?;
        let dx1_full = ctx.gather_tp(&dx1)?;
        let da_full = match (&mut self.attn, attn) {
            (Attn::Gqa(a), BlockAttnSaved::Cp(s)) => context::backward(ctx, a, &dx1_full, *s)?,
            (_, BlockAttnSaved::Local(s)) => self.attn.backward(b, &dx1_full, s)?,
            _ => {
                return Err(EngineError::Invalid(
                    "parallel block backward: context-parallel state of another attention".into(),
                ))
            }
        };
        let dh = ctx.scatter_tp(&da_full)?;
        let mut dx = self.attn_norm.backward(b, &dh, attn_norm)?;
        b.axpy(&mut dx, 1.0, &dx1)?;
        Ok(dx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::DType;

    use super::ParallelModel;
    use crate::engine::model::Model;
    use crate::engine::parallel::{run_local_layout, RankLayout};
    use crate::engine::testutil::{i32_tensor, small_moe, small_spec, values};
    use crate::layout::{check, LayoutSpec};
    use crate::spec::FfnSpec;

    /// Relative L2 error `‖got − want‖ / ‖want‖`.
    fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
        let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den).sqrt()
    }

    /// The vocabulary-parallel cross-entropy of a BF16 model at tp = 2 on the
    /// CPU: the loss is F32 (lse combined over tp in f32), close to the F32
    /// model's, and the head's gradient (both vocabulary shards, rows whose
    /// target is on the other rank included) matches the one-rank BF16
    /// model's to bf16 accuracy; a wrong share would be O(1) off.
    #[test]
    fn bf16_vocab_parallel_loss_is_f32_at_tp2() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let tokens = [3, 0, 6, 1, 7, 2, 5, 4];
        let targets = [0, 6, 1, -1, 2, 5, 4, 3];
        // One rank: the loss and the head's gradient.
        let one = |dtype| {
            let mut m = Model::new(&b, &spec, 11, dtype).unwrap();
            let (tk, tg) = (
                i32_tensor(tokens.to_vec(), &[2, 4]),
                i32_tensor(targets.to_vec(), &[2, 4]),
            );
            let out = m.forward(&b, &tk, &tg).unwrap();
            let loss = values(&out.loss)[0];
            m.backward(&b, out.saved, 1.0).unwrap();
            let head = m.head.weight.as_ref().unwrap();
            (loss, values(&head.grad))
        };
        let (loss32, _) = one(DType::F32);
        let (loss16, head16) = one(DType::BF16);
        let l = check(&LayoutSpec::parse("world=2,tp=2").unwrap(), &spec).unwrap();
        let results = run_local_layout(&b, &l, Duration::from_secs(30), |ctx| {
            let rank = RankLayout::new(&l, ctx.rank.rank)?;
            let mut m = ParallelModel::new(&b, &spec, rank, 11, DType::BF16)?;
            let out = m.forward(ctx, &tokens, &targets, 4)?;
            assert_eq!(out.loss.dtype(), DType::F32);
            let loss = values(&out.loss)[0];
            m.backward(ctx, out.saved, 1.0)?;
            let head = m.head.weight.as_ref().unwrap();
            assert_eq!(head.grad.dtype(), DType::BF16);
            Ok((loss, values(&head.grad)))
        });
        let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        let loss_tp = results[0].0;
        assert_eq!(loss_tp, results[1].0, "the tp ranks report one loss");
        // Rank r holds vocabulary rows r·V/2 .. (r+1)·V/2: concatenated in
        // rank order they are the whole head.
        let head_tp: Vec<f64> = results.iter().flat_map(|r| r.1.clone()).collect();
        let rel = (loss_tp - loss32).abs() / loss32;
        let grad = rel_l2(&head_tp, &head16);
        println!(
            "tp=2 bf16 loss {loss_tp} (one rank bf16 {loss16}, f32 {loss32}; relative to f32 \
             {rel:.2e}); head gradient relative L2 to one rank bf16 {grad:.2e}"
        );
        assert!(rel < 1e-2, "{loss_tp} vs {loss32}");
        assert!(grad < 5e-2, "head gradient off by {grad:.2e}");
    }
}
