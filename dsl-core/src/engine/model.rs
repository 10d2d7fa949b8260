//! The language model on one rank of a layout (Megatron-Core's `GPTModel`
//! with tensor, sequence, context, data, pipeline and expert parallelism):
//! embedding, the rank's blocks, final norm, LM head and the cross-entropy
//! loss. One rank holding the whole model is the layout `world = 1`.
//!
//! ```text
//! x_l   = reduce_scatter_tp(embed_vocab_shard(tokens))          // [T/tp, D]
//! for block in the stage's blocks: x_l = block(x_l)              // see `block`
//! logits_l = all_gather_tp(norm(x_l)) · W_vocab_shardᵀ           // [T, V/tp]
//! loss  = mean_{t: target_t ≥ 0} (lse_t − z_t), lse and the target logit z combined over tp
//! ```
//!
//! T is the micro-batch's tokens (all tp and cp ranks of a dp rank are given
//! the same micro-batch); with cp each rank first keeps its two chunks of
//! every sequence ([`crate::engine::parallel::context`]: T/cp tokens,
//! attention exchanging keys and values over cp, the loss a sum over cp of
//! each rank's share of the mean); a rank's sequence-parallel shard is rows
//! `tp_index·T/(tp·cp) .. (tp_index+1)·T/(tp·cp)` of those tokens.
//!
//! Parameters are visited in the order `embed.weight`, `blocks.{l}.*` (the
//! rank's layers, ascending), `final_norm.weight`, `head.weight` (absent
//! when tied); these dotted names and the global shapes are what
//! checkpoints store, each rank its [`ShardPlan`] blocks.
//!
//! A chunk's forward and backward run block by block, and a block with an
//! MoE layer under ep pauses at its all-to-alls ([`crate::engine::Step`]):
//! [`Model::forward_chunk`] and [`Model::backward_chunk`] resume each pause
//! at once, [`Model::forward_backward_chunks`] gives the other pass a turn
//! there, so one micro-batch's exchange overlaps the other's compute.
//!
//! Shapes: B batch, S sequence, T = B·S tokens, D hidden, V vocabulary, E experts.

use std::ops::Range;

use foldmoe_kernels::{Backend, DType, HostData, Tensor};

use super::activations::{hold_all, Held, Ledger, Slot};
use super::block::{Block, BlockBackward, BlockForward, BlockSaved};
use super::documents::{DocTensors, Documents};
use super::embedding::{Embedding, EmbeddingSaved, HeadSaved, LmHead};
use super::group::Group;
use super::moe::MoeLayer;
use super::mtp::{self, MtpModule, MtpSaved};
use super::norm::{NormSaved, RmsNorm};
use super::parallel::context::split_sequences;
use super::parallel::shard::upload_as;
use super::parallel::{Exec, RankLayout, ShardPlan};
use super::param::{Init, Module, Param};
use super::{EngineError, Result, Step};
use crate::layout::LayoutSpec;
use crate::memory::Part;
use crate::spec::{FfnSpec, ModelSpec};

/// Added to the valid-token count before its reciprocal, so a batch whose
/// targets are all ignored gives `0 · 1e20 = 0` (loss 0, no gradient) rather
/// than `0 · ∞ = NaN`. It is below half an ulp of 1 in f32 and f64 alike, so
/// `count + ε = count` exactly for every count ≥ 1, and `1/ε` is finite in f32.
const COUNT_EPS: f64 = 1e-20;

/// What [`Model::replace_buffers`] calls: `(name, current value) → new value`.
pub type BufferFn<'a, B> = dyn FnMut(&str, &Tensor<B>) -> Result<Tensor<B>> + 'a;

/// What a chunk's forward reads the parameters of next (see
/// [`Model::forward_chunk_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ForwardUnit {
    /// The embedding table (the first virtual stage; a tied head and the
    /// MTP modules on the last).
    Embedding,
    /// Block `i` of [`Model::blocks`].
    Block(usize),
    /// The final norm and the head.
    Head,
    /// MTP module `k` (its norms, projection and block).
    Mtp(usize),
}

/// One rank's shard of a decoder-only MoE language model.
pub struct Model<B: Backend> {
    /// The full model's spec.
    pub spec: ModelSpec,
    /// This rank's place in the layout.
    pub rank: RankLayout,
    /// Rows `vocab_start..vocab_start + V/tp` of the embedding table.
    pub embed: Embedding<B>,
    /// The rank's blocks, first to last, one [`Group`] per declared group
    /// (empty where the rank holds none of it); see [`Self::blocks`].
    groups: Vec<Group<B>>,
    /// Norm before the head (replicated over tp).
    pub final_norm: RmsNorm<B>,
    /// The head's vocabulary shard (or tied to `embed`).
    pub head: LmHead<B>,
    /// The multi-token-prediction modules, on the last pipeline stage
    /// (empty elsewhere and when the spec has none).
    pub mtp: Vec<MtpModule<B>>,
    /// Counts of this rank's saved activations, shared with its blocks.
    pub ledger: Ledger,
    vocab_start: usize,
    /// Indices into `blocks` of each model chunk (virtual stage) of this rank.
    chunks: Vec<Range<usize>>,
    /// The full model's layer index of each of the rank's blocks.
    layers: Vec<usize>,
}

/// A micro-batch: token ids and next-token targets (`-1`: ignored), as
/// host ids (what the data loader gives) or as device tensors `[B, S]` or
/// `[T]` of i32 (nothing read back when the rank needs no host view, that
/// is without tp and cp).
#[derive(Clone, Copy)]
pub enum Batch<'a, B: Backend> {
    /// Host ids, `[B·S]` each.
    Host {
        /// Token ids.
        tokens: &'a [i32],
        /// Next-token targets.
        targets: &'a [i32],
        /// Each token's document, when positions or attention reset at
        /// document boundaries.
        docs: Option<&'a Documents>,
    },
    /// Device tensors of i32.
    Device {
        /// Token ids.
        tokens: &'a Tensor<B>,
        /// Next-token targets.
        targets: &'a Tensor<B>,
    },
}

/// A micro-batch of host ids as the trainer takes it: `(tokens, targets)`
/// pairs, or [`HostBatch`] with documents.
pub trait MicroBatch {
    /// The micro-batch as the model reads it.
    fn host(&self) -> (&[i32], &[i32], Option<&Documents>);
}

impl MicroBatch for (Vec<i32>, Vec<i32>) {
    fn host(&self) -> (&[i32], &[i32], Option<&Documents>) {
        (&self.0, &self.1, None)
    }
}

/// Token ids, next-token targets (`[B·S]` each) and, optionally, each
/// token's document.
#[derive(Clone, Debug, PartialEq)]
pub struct HostBatch {
    /// Token ids.
    pub tokens: Vec<i32>,
    /// Next-token targets (`-1`: ignored).
    pub targets: Vec<i32>,
    /// Documents, when positions or attention reset at their boundaries.
    pub docs: Option<Documents>,
}

impl MicroBatch for HostBatch {
    fn host(&self) -> (&[i32], &[i32], Option<&Documents>) {
        (&self.tokens, &self.targets, self.docs.as_ref())
    }
}

impl<'a, B: Backend> Batch<'a, B> {
    /// The host batch of `m`.
    pub fn of(m: &'a impl MicroBatch) -> Self {
        let (tokens, targets, docs) = m.host();
        Batch::Host {
            tokens,
            targets,
            docs,
        }
    }
}

/// This rank's view of a micro-batch: its tokens (the cp chunks of each
/// sequence) as ids to embed and as targets.
struct RankBatch<B: Backend> {
    /// Rows of this rank's tokens (before the tp split).
    rows: usize,
    /// Host ids of the tokens, or the device tensor of them.
    ids: Ids<B>,
    /// `[rows]` i32 global targets on the device.
    targets_t: Tensor<B>,
    /// The micro-batch's documents (whole sequences, natural order).
    docs: Option<DocTensors<B>>,
    /// The same targets on the host (for the vocabulary-parallel loss).
    host_targets: Option<Vec<i32>>,
    /// The batch moved k = 1..=D places ahead, for MTP module k (only on
    /// the last virtual stage of a model with MTP).
    mtp: Vec<RankBatch<B>>,
}

enum Ids<B: Backend> {
    Host(Vec<i32>),
    Device(Tensor<B>),
}

/// What [`Model::backward`] needs from the forward.
pub struct ModelSaved<B: Backend>(ChunkSaved<B>);

/// The embedding's saved state and, with tp > 1, the `[T]` mask of tokens
/// whose id is in this rank's vocabulary shard.
type EmbedSaved<B> = (EmbeddingSaved<B>, Option<Tensor<B>>);

/// A chunk's forward in progress: what the blocks before the running one
/// produced, and the running block if it is paused at an exchange.
struct ChunkForward<B: Backend> {
    chunk: usize,
    rb: RankBatch<B>,
    seq_len: usize,
    micro_tokens: usize,
    dtype: DType,
    /// The next block's input (none while a block runs or is paused).
    x_td: Option<Tensor<B>>,
    /// The next block to start (of [`Model::blocks`]).
    next: usize,
    paused: Option<BlockForward<B>>,
    blocks: Vec<BlockSaved<B>>,
    aux_loss: Tensor<B>,
    moe_load: Vec<Tensor<B>>,
    embed: Option<EmbedSaved<B>>,
}

/// A chunk's backward in progress: the saved states of the blocks still to
/// run, and the running block if it is paused at an exchange.
struct ChunkBackward<B: Backend> {
    /// The chunk's first block (of [`Model::blocks`]).
    first_block: usize,
    /// The next block's output gradient (none while a block runs or is paused).
    dx_td: Option<Tensor<B>>,
    blocks: Vec<BlockSaved<B>>,
    paused: Option<BlockBackward<B>>,
    embed: Option<EmbedSaved<B>>,
    loss_scale: f64,
}

/// The forward half of [`Model::forward_backward_chunks`]: the arguments of
/// [`Model::forward_chunk_with`].
pub struct ForwardCall<'a, B: Backend> {
    /// The forward's context (its micro-batch).
    pub ctx: Exec<'a, B>,
    /// Model chunk of this rank.
    pub chunk: usize,
    /// The previous virtual stage's output (none on the first).
    pub input: Option<Tensor<B>>,
    /// The micro-batch.
    pub batch: Batch<'a, B>,
    /// Sequence length.
    pub seq_len: usize,
}

/// The backward half of [`Model::forward_backward_chunks`]: the arguments
/// of [`Model::backward_chunk_with`].
pub struct BackwardCall<'a, B: Backend> {
    /// The backward's context (its micro-batch).
    pub ctx: Exec<'a, B>,
    /// The chunk's forward state.
    pub saved: ChunkSaved<B>,
    /// The gradient of its output (none on the last virtual stage).
    pub output_grad: Option<Tensor<B>>,
    /// Weight of the losses' gradients.
    pub loss_scale: f64,
}

/// What [`Model::backward_chunk`] needs from a chunk's forward.
pub struct ChunkSaved<B: Backend> {
    chunk: usize,
    /// The first virtual stage's embedding.
    embed: Option<EmbedSaved<B>>,
    blocks: Vec<BlockSaved<B>>,
    /// The last virtual stage's head and loss.
    head: Option<LossSaved<B>>,
    /// The last virtual stage's MTP modules, first to last.
    mtp: Vec<MtpChunkSaved<B>>,
}

/// One MTP module's state: its embedding lookup, the module, its loss.
struct MtpChunkSaved<B: Backend> {
    embed: EmbedSaved<B>,
    module: MtpSaved<B>,
    loss: LossSaved<B>,
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
    /// Ledger bytes of the final norm's, head's and loss's saved state.
    _held: Held,
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
    /// Mean over the MTP modules of their cross-entropies, `[1]`, on the
    /// last virtual stage of a model with MTP (unweighted; the gradient
    /// carries `mtp_loss_coef`).
    pub mtp_loss: Option<Tensor<B>>,
    /// This rank's tokens routed to each expert, `[E]` per MoE layer of the
    /// chunk (the MTP modules' last).
    pub moe_load: Vec<Tensor<B>>,
    /// Input of [`Model::backward_chunk`].
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
pub struct ForwardOut<B: Backend> {
    /// Mean cross-entropy of the micro-batch, `[1]` (equal on the tp ranks),
    /// in the accumulation type of the model's dtype ([`DType::acc`]).
    pub loss: Tensor<B>,
    /// This rank's part of the MoE losses, `[1]`: their sum over tp is the
    /// micro-batch's aux + z loss.
    pub aux_loss: Tensor<B>,
    /// Mean cross-entropy of the MTP modules, `[1]`, when the model has them.
    pub mtp_loss: Option<Tensor<B>>,
    /// This rank's tokens routed to each expert, `[E]` per MoE layer.
    pub moe_load: Vec<Tensor<B>>,
    /// Input of [`Model::backward`].
    pub saved: ModelSaved<B>,
}

impl<B: Backend> Model<B> {
    /// Builds `rank`'s shard of the model `spec` describes, shard first:
    /// only the stage's layers, each parameter drawn as the block the
    /// [`ShardPlan`] gives the rank (the same values as those of one rank's
    /// whole model of `seed`), the embedding and head only where the stage
    /// trains them (elsewhere `[0, D]`). Every violated rule of the spec is
    /// returned as [`EngineError::Spec`].
    pub fn new(b: &B, spec: &ModelSpec, rank: RankLayout, seed: u64, dtype: DType) -> Result<Self> {
        spec.check().map_err(EngineError::Spec)?;
        if !dtype.is_float() {
            return Err(EngineError::Invalid(format!(
                "model dtype {dtype:?} is not a float type; use F32 (or F64 for gradient checks)"
            )));
        }
        let plan = ShardPlan::new(spec, &rank);
        let init = Init::sharded(seed, &plan);
        let last = rank.pp_index + 1 == rank.pp.size();
        let embed_and_head = rank.pp_index == 0 || last;
        let (v, d) = (spec.vocab, spec.hidden);
        let absent =
            |name: &str| -> Result<Param<B>> { Param::new(b, name, b.zeros(&[0, d], dtype)?) };
        let embed = if embed_and_head {
            Embedding::new(b, "embed", v, d, spec.init_std, init, dtype)?
        } else {
            Embedding {
                table: absent("embed.weight")?,
            }
        };
        let ledger = Ledger::default();
        let layer_groups = rank.layer_groups();
        let mut groups = Vec::with_capacity(spec.groups.len());
        let mut first = 0;
        for group in &spec.groups {
            let declared = first..first + group.count;
            first = declared.end;
            let layers: Vec<usize> = plan
                .layers()
                .iter()
                .copied()
                .filter(|l| declared.contains(l))
                .collect();
            let mut blocks = Vec::with_capacity(layers.len());
            for &layer in &layers {
                let prefix = format!("blocks.{layer}");
                let mut block =
                    Block::new(b, &prefix, spec, group, init, dtype, layer_groups.clone())?;
                block.ledger = ledger.clone();
                blocks.push(block);
            }
            let moe = matches!(group.ffn, FfnSpec::Moe(_));
            groups.push(Group::new(moe, blocks, layers, declared));
        }
        if let Some(&layer) = plan.layers().iter().find(|&&l| l >= first) {
            return Err(EngineError::Invalid(format!(
                "layer {layer} is outside model {} of {} layers",
                spec.name, first
            )));
        }
        let final_norm = RmsNorm::new(b, "final_norm", d, spec.norm_eps, dtype)?;
        let mut mtp = Vec::new();
        if last {
            for k in 0..spec.mtp_layers {
                let mut module = MtpModule::new(b, spec, k, init, dtype, layer_groups.clone())?;
                module.block.ledger = ledger.clone();
                mtp.push(module);
            }
        }
        let head = match (spec.tied_embeddings, embed_and_head) {
            (true, _) => LmHead::tied(),
            (false, true) => LmHead::untied(b, "head", v, d, spec.init_std, init, dtype)?,
            (false, false) => LmHead {
                weight: Some(absent("head.weight")?),
            },
        };
        Ok(Model {
            vocab_start: plan.vocab_rows().0,
            spec: spec.clone(),
            rank,
            embed,
            groups,
            final_norm,
            head,
            mtp,
            ledger,
            chunks: plan.chunks().to_vec(),
            layers: plan.layers().to_vec(),
        })
    }

    /// The whole model on one rank (the layout `world = 1`), run with
    /// [`Exec::solo`].
    pub fn single(b: &B, spec: &ModelSpec, seed: u64, dtype: DType) -> Result<Self> {
        spec.check().map_err(EngineError::Spec)?;
        let layout = crate::layout::check(&LayoutSpec::default(), spec).map_err(|errs| {
            EngineError::Invalid(format!(
                "model {}: the one-rank layout does not apply: {}",
                spec.name,
                errs.iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        })?;
        Self::new(b, spec, RankLayout::new(&layout, 0)?, seed, dtype)
    }

    /// Loss of this dp rank's micro-batch (sequences of `seq_len`). The
    /// whole model: only without a pipeline (see [`Self::forward_chunk`]).
    pub fn forward(
        &self,
        ctx: &Exec<B>,
        batch: Batch<'_, B>,
        seq_len: usize,
    ) -> Result<ForwardOut<B>> {
        if self.rank.pp.size() > 1 {
            return Err(EngineError::Invalid(format!(
                "forward of the whole model on rank {} of a pipeline of {} stages; \
                 run the stages' chunks with forward_chunk (Trainer::accumulate does)",
                self.rank.rank,
                self.rank.pp.size()
            )));
        }
        let out = self.forward_chunk(ctx, 0, None, batch, seq_len)?;
        let loss = out.loss.ok_or_else(|| {
            EngineError::Invalid("forward: the only stage computed no loss".into())
        })?;
        Ok(ForwardOut {
            loss,
            aux_loss: out.aux_loss,
            mtp_loss: out.mtp_loss,
            moe_load: out.moe_load,
            saved: ModelSaved(out.saved),
        })
    }

    /// Inference logits `[T, V]` of `tokens` (sequences of `seq_len`, host
    /// ids) on a rank that holds the whole model (no tp, cp or pp: one rank,
    /// or data parallel only); nothing is kept for a backward.
    pub fn logits(&self, ctx: &Exec<B>, tokens: &[i32], seq_len: usize) -> Result<Tensor<B>> {
        let r = &self.rank;
        if r.tp.size() > 1 || r.cp.size() > 1 || r.pp.size() > 1 {
            return Err(EngineError::Invalid(format!(
                "logits on rank {} of layout {}: generation needs the whole model on a rank \
                 (tp = cp = pp = 1)",
                r.rank, r.layout.name
            )));
        }
        if seq_len == 0 || tokens.is_empty() || !tokens.len().is_multiple_of(seq_len) {
            return Err(EngineError::Invalid(format!(
                "logits: {} tokens do not form sequences of {seq_len}",
                tokens.len()
            )));
        }
        self.check_ids(tokens)?;
        let b = ctx.b;
        let (mut x_td, _) = self.embed_tokens(ctx, &Ids::Host(tokens.to_vec()))?;
        for block in self.blocks() {
            x_td = block.forward_raw(ctx, &x_td, seq_len, tokens.len())?.0;
        }
        let (h_td, _) = self.final_norm.forward(b, &x_td)?;
        Ok(self.head.forward(b, &self.embed, &h_td)?.0)
    }

    /// Every buffer of this rank (state that is not a parameter: the MoE
    /// routers' expert biases), with its global name, in block order.
    pub fn visit_buffers<'a>(&'a self, f: &mut dyn FnMut(&'a str, &'a Tensor<B>)) {
        for moe in self.moe_iter() {
            if let Some((name, bias)) = moe.router.named_expert_bias() {
                f(name, bias);
            }
        }
    }

    /// Replaces each buffer by what `f` returns for its name and current
    /// value (same shape and dtype, checked by the owner), in the order of
    /// [`Model::visit_buffers`]; the first error stops the visit.
    pub fn replace_buffers(&mut self, f: &mut BufferFn<'_, B>) -> Result<()> {
        for moe in self.moe_iter_mut() {
            let fresh = match moe.router.named_expert_bias() {
                Some((name, bias)) => f(name, bias)?,
                None => continue,
            };
            moe.router.set_expert_bias(fresh)?;
        }
        Ok(())
    }

    /// Starts an optimizer step of `micro_batches` on this rank: state the
    /// layers keep across a step's micro-batches (`global_aux`'s running
    /// loads; with several micro-batches, the fp8 experts' weights) starts
    /// empty.
    pub fn begin_step(&self, micro_batches: usize) {
        for moe in self.moe_iter() {
            moe.begin_step(micro_batches);
        }
    }

    /// Ends the step's forward and backward passes: what the layers kept
    /// for the step only (the fp8 experts' weights) is freed, before the
    /// update changes the weights.
    pub fn end_step(&self) {
        for moe in self.moe_iter() {
            moe.end_step();
        }
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
    /// the last when the head is tied to it or MTP modules embed there.
    pub fn owns_embed(&self) -> bool {
        self.rank.pp_index == 0 || (self.owns_head() && self.embed_shared_with_last())
    }

    /// Whether the last stage uses the embedding table too (a tied head, or
    /// MTP modules embedding the tokens ahead): its copy's gradient is then
    /// summed with the first stage's.
    pub fn embed_shared_with_last(&self) -> bool {
        self.head.weight.is_none() || self.spec.mtp_layers > 0
    }

    /// Whether this rank trains the final norm and the head (the last stage).
    pub fn owns_head(&self) -> bool {
        self.rank.pp_index + 1 == self.rank.pp.size()
    }

    /// Whether this rank's embedding table is the last stage's copy of a
    /// shared table (see [`Self::embed_shared_with_last`]): its gradient is
    /// summed with the first stage's over the
    /// embedding group, and it is counted once (on the first stage).
    pub fn embed_is_copy(&self) -> bool {
        self.rank.pp_index > 0 && self.owns_embed()
    }

    /// Indices into `blocks` of each of this rank's model chunks.
    pub fn chunk_ranges(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// This rank's blocks, first to last: its groups' blocks in order (a
    /// rank's layers ascend chunk after chunk, so each group's are a
    /// contiguous run). Indices into this sequence are those of
    /// [`Self::chunk_ranges`].
    pub fn blocks(&self) -> impl Iterator<Item = &Block<B>> {
        self.groups.iter().flat_map(|g| g.blocks().blocks().iter())
    }

    /// Mutable [`Self::blocks`].
    pub fn blocks_mut(&mut self) -> impl Iterator<Item = &mut Block<B>> {
        self.groups
            .iter_mut()
            .flat_map(|g| g.blocks_mut().blocks_mut().iter_mut())
    }

    /// Number of blocks this rank holds.
    pub fn block_count(&self) -> usize {
        self.layers.len()
    }

    /// Block `i` of [`Self::blocks`].
    fn block(&self, i: usize) -> Result<&Block<B>> {
        let (g, j) = self.locate(i)?;
        Ok(&self.groups[g].blocks().blocks()[j])
    }

    /// Mutable [`Self::block`].
    fn block_mut(&mut self, i: usize) -> Result<&mut Block<B>> {
        let (g, j) = self.locate(i)?;
        Ok(&mut self.groups[g].blocks_mut().blocks_mut()[j])
    }

    /// `(group, index in the group)` of block `i`.
    fn locate(&self, i: usize) -> Result<(usize, usize)> {
        let mut rest = i;
        for (g, group) in self.groups.iter().enumerate() {
            let n = group.blocks().len();
            if rest < n {
                return Ok((g, rest));
            }
            rest -= n;
        }
        Err(EngineError::Invalid(format!(
            "block {i} of rank {}, which holds {} blocks",
            self.rank.rank,
            self.block_count()
        )))
    }

    /// This rank's part of each declared group, in declaration order.
    pub fn groups(&self) -> &[Group<B>] {
        &self.groups
    }

    /// Takes the groups out (the model holds none until
    /// [`Self::put_groups`]): how a `#[moe_model]` struct owns them as its
    /// fields.
    #[doc(hidden)]
    pub fn take_groups(&mut self) -> Vec<Group<B>> {
        std::mem::take(&mut self.groups)
    }

    /// Gives back what [`Self::take_groups`] took, in the same order.
    #[doc(hidden)]
    pub fn put_groups(&mut self, groups: Vec<Group<B>>) {
        self.groups = groups;
    }

    /// The full model's layer index of each of this rank's blocks.
    pub fn global_layers(&self) -> &[usize] {
        &self.layers
    }

    /// Forward of model chunk `chunk` on micro-batch `batch` (sequences of
    /// `seq_len`): the first virtual stage embeds the tokens, the others
    /// take `input` (the previous virtual stage's output, this rank's
    /// sequence-parallel shard); the last virtual stage computes the loss,
    /// the others return their output for the next.
    pub fn forward_chunk(
        &self,
        ctx: &Exec<B>,
        chunk: usize,
        input: Option<Tensor<B>>,
        batch: Batch<'_, B>,
        seq_len: usize,
    ) -> Result<ChunkOut<B>> {
        Self::forward_chunk_impl(self, ctx, chunk, input, batch, seq_len, &mut |_, _| Ok(()))
    }

    /// [`Self::forward_chunk`], calling `before(model, unit)` right before
    /// each [`ForwardUnit`] of the chunk first reads its parameters (the
    /// embedding, each block, the final norm and head, each MTP module):
    /// where the trainer waits for the parameter all-gathers of the last
    /// update that the unit needs (`overlap_param_gather`). A unit may be
    /// announced more than once (a tied head and the MTP modules read the
    /// embedding table); the same forward runs either way.
    pub fn forward_chunk_with(
        &mut self,
        ctx: &Exec<B>,
        chunk: usize,
        input: Option<Tensor<B>>,
        batch: Batch<'_, B>,
        seq_len: usize,
        before: &mut dyn FnMut(&mut Self, ForwardUnit) -> Result<()>,
    ) -> Result<ChunkOut<B>> {
        Self::forward_chunk_impl(self, ctx, chunk, input, batch, seq_len, &mut |m, unit| {
            before(m, unit)
        })
    }

    /// The one forward of a chunk, over a shared or an exclusive reference
    /// to the model (`M`): only `before` can change it, between units.
    fn forward_chunk_impl<M: std::ops::Deref<Target = Self>>(
        mut m: M,
        ctx: &Exec<B>,
        chunk: usize,
        input: Option<Tensor<B>>,
        batch: Batch<'_, B>,
        seq_len: usize,
        before: &mut dyn FnMut(&mut M, ForwardUnit) -> Result<()>,
    ) -> Result<ChunkOut<B>> {
        let mut run = Self::forward_begin(&mut m, ctx, chunk, input, batch, seq_len, before)?;
        while !Self::forward_blocks(&mut m, ctx, &mut run, before)? {}
        Self::forward_end(&mut m, ctx, run, before)
    }

    /// A chunk's forward up to its first block: the checks, this rank's
    /// view of the batch, and the embedding on the first virtual stage.
    fn forward_begin<M: std::ops::Deref<Target = Self>>(
        m: &mut M,
        ctx: &Exec<B>,
        chunk: usize,
        input: Option<Tensor<B>>,
        batch: Batch<'_, B>,
        seq_len: usize,
        before: &mut dyn FnMut(&mut M, ForwardUnit) -> Result<()>,
    ) -> Result<ChunkForward<B>> {
        let b = ctx.b;
        let (tp, cp) = (m.rank.tp.size(), m.rank.cp.size());
        if chunk >= m.chunks.len() {
            return Err(EngineError::Invalid(format!(
                "forward: chunk {chunk} of a rank holding {}",
                m.chunks.len()
            )));
        }
        let rb = m.rank_batch(b, batch, seq_len, m.is_last(chunk))?;
        // The blocks (and MTP modules) see the micro-batch's documents.
        let ctx = &Exec {
            docs: rb.docs.as_ref(),
            ..*ctx
        };
        if !rb.rows.is_multiple_of(tp) {
            return Err(EngineError::Invalid(format!(
                "forward: {} tokens of the micro-batch do not split over tp = {tp} \
                 (sequence parallelism)",
                rb.rows
            )));
        }
        let micro_tokens = rb.rows * cp;
        let dtype = m.embed.table.value.dtype();
        let (x_td, embed) = match (m.is_first(chunk), input) {
            (true, None) => {
                before(m, ForwardUnit::Embedding)?;
                let (x, saved) = m.embed_tokens(ctx, &rb.ids)?;
                (x, Some(saved))
            }
            (false, Some(x)) => (x, None),
            (first, _) => {
                return Err(EngineError::Invalid(format!(
                    "forward: virtual stage {} {} an input from the previous stage",
                    m.virtual_stage(chunk),
                    if first { "takes no" } else { "needs" }
                )))
            }
        };
        Ok(ChunkForward {
            chunk,
            seq_len,
            micro_tokens,
            dtype,
            x_td: Some(x_td),
            next: m.chunks[chunk].start,
            paused: None,
            blocks: Vec::new(),
            aux_loss: b.zeros(&[1], dtype)?,
            moe_load: Vec::new(),
            embed,
            rb,
        })
    }

    /// Runs the chunk's blocks, resuming a paused one, until a block pauses
    /// at an exchange (`false`) or every block is done (`true`).
    fn forward_blocks<M: std::ops::Deref<Target = Self>>(
        m: &mut M,
        ctx: &Exec<B>,
        run: &mut ChunkForward<B>,
        before: &mut dyn FnMut(&mut M, ForwardUnit) -> Result<()>,
    ) -> Result<bool> {
        let b = ctx.b;
        let ctx = &Exec {
            docs: run.rb.docs.as_ref(),
            ..*ctx
        };
        let end = m.chunks[run.chunk].end;
        loop {
            let step = match run.paused.take() {
                Some(paused) => m.block(run.next - 1)?.forward_resume(ctx, paused)?,
                None if run.next == end => return Ok(true),
                None => {
                    let i = run.next;
                    before(m, ForwardUnit::Block(i))?;
                    run.next += 1;
                    let x_td = run.x_td.take().ok_or_else(|| {
                        EngineError::Invalid("forward: a block ran without its input".into())
                    })?;
                    m.block(i)?
                        .forward_start(ctx, &x_td, run.seq_len, run.micro_tokens)?
                }
            };
            match step {
                Step::Pending(paused) => {
                    run.paused = Some(paused);
                    return Ok(false);
                }
                Step::Done((y, saved, stats)) => {
                    if let Some(stats) = stats {
                        let aux = b.add(&run.aux_loss, &stats.aux_loss)?;
                        run.aux_loss = b.add(&aux, &stats.z_loss)?;
                        run.moe_load.push(stats.load);
                    }
                    run.blocks.push(saved);
                    run.x_td = Some(y);
                }
            }
        }
    }

    /// A chunk's forward after its blocks: on the last virtual stage the
    /// final norm, head and loss, and the MTP modules.
    fn forward_end<M: std::ops::Deref<Target = Self>>(
        m: &mut M,
        ctx: &Exec<B>,
        run: ChunkForward<B>,
        before: &mut dyn FnMut(&mut M, ForwardUnit) -> Result<()>,
    ) -> Result<ChunkOut<B>> {
        let b = ctx.b;
        let ChunkForward {
            chunk,
            rb,
            seq_len,
            micro_tokens,
            dtype,
            x_td,
            blocks,
            mut aux_loss,
            mut moe_load,
            embed,
            ..
        } = run;
        let ctx = &Exec {
            docs: rb.docs.as_ref(),
            ..*ctx
        };
        let x_td = x_td.ok_or_else(|| {
            EngineError::Invalid("forward: the chunk ended with a block still paused".into())
        })?;
        let (hidden, loss, head) = if m.is_last(chunk) {
            before(m, ForwardUnit::Head)?;
            if m.head.weight.is_none() {
                // A tied head reads the embedding table.
                before(m, ForwardUnit::Embedding)?;
            }
            let (loss, saved) = m.loss(ctx, &m.final_norm, &x_td, &rb, dtype, 1.0)?;
            (None, Some(loss), Some(saved))
        } else {
            (Some(x_td.clone()), None, None)
        };
        // MTP: module k on the main output (k = 1) or module k − 1's.
        let mut mtp = Vec::new();
        let mut mtp_loss: Option<Tensor<B>> = None;
        if m.is_last(chunk) && !m.mtp.is_empty() {
            let depth = m.mtp.len();
            let weight = m.spec.mtp_loss_coef / depth as f64;
            let mut h_td = x_td;
            for (k, mb) in rb.mtp.iter().enumerate().take(depth) {
                // Module k embeds the tokens ahead, then runs its block,
                // norm and the (already settled) head.
                before(m, ForwardUnit::Embedding)?;
                before(m, ForwardUnit::Mtp(k))?;
                let module = &m.mtp[k];
                let (e_td, embed) = m.embed_tokens(ctx, &mb.ids)?;
                let (y_td, saved, stats) =
                    module.forward(ctx, &e_td, &h_td, seq_len, micro_tokens)?;
                if let Some(stats) = stats {
                    aux_loss = b.add(&b.add(&aux_loss, &stats.aux_loss)?, &stats.z_loss)?;
                    moe_load.push(stats.load);
                }
                let (l, loss_saved) = m.loss(ctx, &module.norm, &y_td, mb, dtype, weight)?;
                let l = b.scale(&l, 1.0 / depth as f64)?;
                mtp_loss = Some(match mtp_loss {
                    Some(sum) => b.add(&sum, &l)?,
                    None => l,
                });
                mtp.push(MtpChunkSaved {
                    embed,
                    module: saved,
                    loss: loss_saved,
                });
                h_td = y_td;
            }
        }
        Ok(ChunkOut {
            hidden,
            loss,
            aux_loss,
            mtp_loss,
            moe_load,
            saved: ChunkSaved {
                chunk,
                embed,
                blocks,
                head,
                mtp,
            },
        })
    }

    /// This rank's view of `batch`: its cp chunks of every sequence, checked.
    /// Device tensors stay on the device without tp and cp; otherwise they
    /// are read back once (the split and the vocabulary masks are made on
    /// the host).
    fn rank_batch(
        &self,
        b: &B,
        batch: Batch<'_, B>,
        seq_len: usize,
        last: bool,
    ) -> Result<RankBatch<B>> {
        let (tp, cp) = (self.rank.tp.size(), self.rank.cp.size());
        // MTP shifts the ids on the host, before the cp split.
        let with_mtp = last && !self.mtp.is_empty();
        let (tokens, targets, docs) = match batch {
            Batch::Host {
                tokens,
                targets,
                docs,
            } => (tokens.to_vec(), targets.to_vec(), docs),
            Batch::Device { tokens, targets } => {
                check_device_batch(tokens, targets, seq_len)?;
                let n = tokens.numel();
                if tp == 1 && cp == 1 && !with_mtp {
                    return Ok(RankBatch {
                        rows: n,
                        ids: Ids::Device(tokens.clone().reshape(&[n])?),
                        targets_t: targets.clone().reshape(&[n])?,
                        host_targets: None,
                        docs: None,
                        mtp: Vec::new(),
                    });
                }
                (
                    b.download(tokens)?.to_i32()?,
                    b.download(targets)?.to_i32()?,
                    None,
                )
            }
        };
        let n = tokens.len();
        if targets.len() != n || seq_len == 0 || n == 0 || !n.is_multiple_of(seq_len) {
            return Err(EngineError::Invalid(format!(
                "forward: {n} tokens and {} targets do not form sequences of {seq_len}",
                targets.len()
            )));
        }
        self.check_ids(&tokens)?;
        let docs = match docs {
            Some(d) => {
                d.check(n, seq_len)?;
                DocTensors::new(b, d, seq_len)?
            }
            None => None,
        };
        if let Some(&y) = targets
            .iter()
            .find(|&&y| y < -1 || y >= self.spec.vocab as i32)
        {
            return Err(EngineError::Invalid(format!(
                "target {y} is outside the vocabulary of {} (and not -1, ignored)",
                self.spec.vocab
            )));
        }
        let mut ahead = Vec::new();
        if with_mtp {
            for k in 1..=self.mtp.len() {
                let (ids_k, targets_k) = mtp::shifted(&tokens, &targets, seq_len, k);
                ahead.push(self.split_batch(b, &ids_k, &targets_k, seq_len, Vec::new())?);
            }
        }
        let mut rb = self.split_batch(b, &tokens, &targets, seq_len, ahead)?;
        rb.docs = docs;
        Ok(rb)
    }

    /// This rank's cp chunks of checked host `tokens` and `targets`.
    fn split_batch(
        &self,
        b: &B,
        tokens: &[i32],
        targets: &[i32],
        seq_len: usize,
        mtp: Vec<RankBatch<B>>,
    ) -> Result<RankBatch<B>> {
        let (tp, cp, cp_i) = (self.rank.tp.size(), self.rank.cp.size(), self.rank.cp_index);
        let tokens = split_sequences(tokens, seq_len, cp, cp_i)?;
        let targets = split_sequences(targets, seq_len, cp, cp_i)?;
        let rows = tokens.len();
        Ok(RankBatch {
            rows,
            ids: Ids::Host(tokens),
            targets_t: b.upload(HostData::I32(targets.clone()), &[rows])?,
            host_targets: (tp > 1).then_some(targets),
            docs: None,
            mtp,
        })
    }

    /// Errors naming the first token id outside the vocabulary.
    fn check_ids(&self, tokens: &[i32]) -> Result<()> {
        match tokens
            .iter()
            .find(|&&id| id < 0 || id as usize >= self.spec.vocab)
        {
            Some(id) => Err(EngineError::Invalid(format!(
                "token id {id} is outside the vocabulary of {}",
                self.spec.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Embedding: this rank's vocabulary rows, zero elsewhere, summed over tp.
    fn embed_tokens(&self, ctx: &Exec<B>, ids: &Ids<B>) -> Result<(Tensor<B>, EmbedSaved<B>)> {
        let b = ctx.b;
        let tokens = match ids {
            Ids::Device(ids_t) => {
                let (emb_td, embed) = self.embed.forward(b, ids_t)?;
                return Ok((emb_td, (embed, None)));
            }
            Ids::Host(tokens) => tokens,
        };
        let t = tokens.len();
        let tp = self.rank.tp.size();
        let dtype = self.embed.table.value.dtype();
        let vocab_local = self.embed.table.value.shape()[0];
        let (v0, v1) = (self.vocab_start, self.vocab_start + vocab_local);
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
        let x = ctx.scatter(&self.rank.tp, &b.mul_rows(&emb_td, &mask_t)?)?;
        Ok((x, (embed, Some(mask_t))))
    }

    /// `norm` (the final norm, or an MTP module's), head and the mean
    /// cross-entropy of the micro-batch over its valid targets, counted on
    /// the device and summed over cp (each cp rank holds part of every
    /// sequence); the gradient kept for the backward is `weight` times the
    /// mean's.
    fn loss(
        &self,
        ctx: &Exec<B>,
        norm: &RmsNorm<B>,
        x_td: &Tensor<B>,
        rb: &RankBatch<B>,
        dtype: DType,
        weight: f64,
    ) -> Result<(Tensor<B>, LossSaved<B>)> {
        let b = ctx.b;
        let t = rb.rows;
        let (h_td, mut final_norm) = norm.forward(b, x_td)?;
        let h_full = ctx.gather(&self.rank.tp, &h_td)?;
        let (logits_tv, mut head) = self.head.forward(b, &self.embed, &h_full)?;
        if self.rank.tp.size() > 1 {
            // Keep the rank's rows of the head's input; the backward
            // gathers them again.
            head.input_mut().keep_shard(&h_td);
        }
        // The per-token loss comes in the accumulation type (f32 for bf16,
        // as Megatron-Core's fp32 cross-entropy), and so do the mean and its
        // gradient.
        let acc = dtype.acc();
        let valid_t = b.valid_mask(&rb.targets_t, acc)?;
        let count_1 = ctx.sum_over(&self.rank.cp, &b.sum(&valid_t)?)?;
        let count_1 = b.add(&count_1, &b.fill(&[1], COUNT_EPS, acc)?)?;
        let inv_count_1 = b.recip(&count_1)?;
        let dloss_t = b
            .mul_cols(&valid_t.clone().reshape(&[t, 1])?, &inv_count_1)?
            .reshape(&[t])?;
        let (loss_t, ce) = match &rb.host_targets {
            None => {
                let targets_t = rb.targets_t.clone();
                let (loss_t, lse_t) = b.cross_entropy(&logits_tv, &targets_t)?;
                (loss_t, CeSaved::Whole { targets_t, lse_t })
            }
            Some(targets) => self.vocab_parallel_ce(ctx, &logits_tv, targets, &valid_t, dtype)?,
        };
        // Each cp rank's sum is part of the mean; the sum makes it equal on all.
        let loss = ctx.sum_over(&self.rank.cp, &b.sum(&b.mul(&loss_t, &dloss_t)?)?)?;
        let dloss_t = if weight == 1.0 {
            dloss_t
        } else {
            b.scale(&dloss_t, weight)?
        };
        // The final norm's input and output (the head's input), the logits
        // and the log-sum-exp, counted until the backward.
        let held = {
            let mut logits = logits_tv.clone();
            let mut lse = match &ce {
                CeSaved::Whole { lse_t, .. } | CeSaved::Vocab { lse_t, .. } => lse_t.clone(),
            };
            let slot = Slot::kept(Part::EmbeddingHead);
            hold_all(&self.ledger, "head", |f| {
                final_norm.visit_saved(slot, f);
                head.visit_saved(slot, f);
                f(slot, &mut logits);
                f(slot, &mut lse);
            })
        };
        Ok((
            loss,
            LossSaved {
                final_norm,
                head,
                logits_tv,
                ce,
                dloss_t,
                _held: held,
            },
        ))
    }

    /// Per-token cross-entropy with the vocabulary split over tp:
    /// `lse = log Σ_r exp(lse_r)` and the target logit summed from the rank
    /// that holds it; `valid_t` marks the targets that count. Returns the loss per token (`0` for ignored targets).
    /// Everything after the local logits is in the accumulation type of
    /// `dtype` (f32 for bf16), as the single-rank kernel's loss and lse; for
    /// f32 and f64 that is `dtype` itself and no cast is made.
    fn vocab_parallel_ce(
        &self,
        ctx: &Exec<B>,
        logits_tv: &Tensor<B>,
        targets: &[i32],
        valid_t: &Tensor<B>,
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
        let loss_t = b.mul(&b.sub(&lse_t, &z_t)?, valid_t)?;
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
    pub fn backward(&mut self, ctx: &Exec<B>, saved: ModelSaved<B>, loss_scale: f64) -> Result<()> {
        self.backward_chunk(ctx, saved.0, None, loss_scale)?;
        Ok(())
    }

    /// Backward of a model chunk's forward: `output_grad` is the gradient of
    /// its output from the next virtual stage (none on the last, which starts
    /// from the loss). Returns the gradient of its input for the previous
    /// virtual stage (none on the first, which ends in the embedding).
    pub fn backward_chunk(
        &mut self,
        ctx: &Exec<B>,
        saved: ChunkSaved<B>,
        output_grad: Option<Tensor<B>>,
        loss_scale: f64,
    ) -> Result<Option<Tensor<B>>> {
        self.backward_chunk_with(ctx, saved, output_grad, loss_scale, &mut |_, _| Ok(()))
    }

    /// [`Self::backward_chunk`], calling `after_block(model, i)` once block
    /// `i` (of [`Self::blocks`]) has added its gradients: where the trainer
    /// starts reducing the gradients that are final.
    pub fn backward_chunk_with(
        &mut self,
        ctx: &Exec<B>,
        saved: ChunkSaved<B>,
        output_grad: Option<Tensor<B>>,
        loss_scale: f64,
        after_block: &mut dyn FnMut(&Self, usize) -> Result<()>,
    ) -> Result<Option<Tensor<B>>> {
        let mut run = self.backward_begin(ctx, saved, output_grad, loss_scale)?;
        while !self.backward_blocks(ctx, &mut run, after_block)? {}
        self.backward_end(ctx, run)
    }

    /// A chunk's backward up to its last block: on the last virtual stage
    /// the loss's, head's and MTP modules' backward.
    fn backward_begin(
        &mut self,
        ctx: &Exec<B>,
        saved: ChunkSaved<B>,
        output_grad: Option<Tensor<B>>,
        loss_scale: f64,
    ) -> Result<ChunkBackward<B>> {
        let b = ctx.b;
        let ChunkSaved {
            chunk,
            embed,
            blocks,
            head,
            mtp,
        } = saved;
        let dx_td = match (head, output_grad) {
            (Some(head), None) => {
                let mut dx_td = self.loss_backward(ctx, head, None, loss_scale)?;
                // MTP modules, last first: each one's output gradient is its
                // loss's plus the next module's through its hidden input.
                let mut d_next: Option<Tensor<B>> = None;
                for (k, saved) in mtp.into_iter().enumerate().rev() {
                    let mut dy_td = self.loss_backward(ctx, saved.loss, Some(k), loss_scale)?;
                    if let Some(d) = d_next.take() {
                        b.axpy(&mut dy_td, 1.0, &d)?;
                    }
                    let (de_td, dh_td) =
                        self.mtp[k].backward(ctx, &dy_td, saved.module, loss_scale)?;
                    self.embed_backward(ctx, de_td, saved.embed)?;
                    d_next = Some(dh_td);
                }
                if let Some(d) = d_next {
                    b.axpy(&mut dx_td, 1.0, &d)?;
                }
                dx_td
            }
            (None, Some(d)) => d,
            _ => {
                return Err(EngineError::Invalid(
                    "backward: a chunk needs either the loss or its output's gradient".into(),
                ))
            }
        };
        let range = self.chunks[chunk].clone();
        if blocks.len() != range.len() {
            return Err(EngineError::Invalid(format!(
                "backward: saved state of {} blocks for a chunk of {}",
                blocks.len(),
                range.len()
            )));
        }
        Ok(ChunkBackward {
            first_block: range.start,
            dx_td: Some(dx_td),
            blocks,
            paused: None,
            embed,
            loss_scale,
        })
    }

    /// Runs the chunk's blocks backward, resuming a paused one, until a
    /// block pauses at an exchange (`false`) or every block is done
    /// (`true`); `after_block` as in [`Self::backward_chunk_with`].
    fn backward_blocks(
        &mut self,
        ctx: &Exec<B>,
        run: &mut ChunkBackward<B>,
        after_block: &mut dyn FnMut(&Self, usize) -> Result<()>,
    ) -> Result<bool> {
        loop {
            // The block running is the one after the saved states left.
            let i = run.first_block + run.blocks.len();
            let step = match run.paused.take() {
                Some(paused) => self.block_mut(i)?.backward_resume(ctx, paused)?,
                None => {
                    let Some(saved) = run.blocks.pop() else {
                        return Ok(true);
                    };
                    // The next block's offloaded tensors come back while
                    // this one's backward runs.
                    if let Some(next) = run.blocks.last_mut() {
                        next.prefetch(ctx.b)?;
                    }
                    let dx_td = run.dx_td.take().ok_or_else(|| {
                        EngineError::Invalid("backward: a block ran without its gradient".into())
                    })?;
                    let i = run.first_block + run.blocks.len();
                    self.block_mut(i)?
                        .backward_start(ctx, &dx_td, saved, run.loss_scale)?
                }
            };
            let i = run.first_block + run.blocks.len();
            match step {
                Step::Pending(paused) => {
                    run.paused = Some(paused);
                    return Ok(false);
                }
                Step::Done(dx_td) => {
                    run.dx_td = Some(dx_td);
                    after_block(self, i)?;
                }
            }
        }
    }

    /// A chunk's backward after its blocks: the embedding's on the first
    /// virtual stage, or the input gradient for the previous one.
    fn backward_end(&mut self, ctx: &Exec<B>, run: ChunkBackward<B>) -> Result<Option<Tensor<B>>> {
        let dx_td = run.dx_td.ok_or_else(|| {
            EngineError::Invalid("backward: the chunk ended with a block still paused".into())
        })?;
        let Some(embed) = run.embed else {
            return Ok(Some(dx_td));
        };
        self.embed_backward(ctx, dx_td, embed)?;
        Ok(None)
    }

    /// The forward of one micro-batch's chunk and the backward of
    /// another's, interleaved at the MoE layers' exchanges (Megatron-Core's
    /// `--overlap-moe-expert-parallel-comm` for 1F1B): each side runs until
    /// it has started an all-to-all, then the other side computes while it
    /// travels, so a dispatch or combine of one micro-batch overlaps the
    /// attention or experts of the other. The backward goes first (its
    /// loss), then the forward (its embedding), then the blocks take turns.
    /// Results are those of [`Self::forward_chunk_with`] then
    /// [`Self::backward_chunk_with`], bit for bit: the same kernels on the
    /// same inputs, the parameters are not changed by either, and the
    /// gradients accumulate in the backward's own order.
    pub fn forward_backward_chunks(
        &mut self,
        fwd: ForwardCall<'_, B>,
        before: &mut dyn FnMut(&mut Self, ForwardUnit) -> Result<()>,
        bwd: BackwardCall<'_, B>,
        after_block: &mut dyn FnMut(&Self, usize) -> Result<()>,
    ) -> Result<(ChunkOut<B>, Option<Tensor<B>>)> {
        let mut me = self;
        let before = &mut |m: &mut &mut Self, unit| before(m, unit);
        let mut bw = me.backward_begin(&bwd.ctx, bwd.saved, bwd.output_grad, bwd.loss_scale)?;
        let mut fw = Self::forward_begin(
            &mut me,
            &fwd.ctx,
            fwd.chunk,
            fwd.input,
            fwd.batch,
            fwd.seq_len,
            before,
        )?;
        let (mut f_done, mut b_done) = (false, false);
        while !(f_done && b_done) {
            if !b_done {
                b_done = me.backward_blocks(&bwd.ctx, &mut bw, after_block)?;
            }
            if !f_done {
                f_done = Self::forward_blocks(&mut me, &fwd.ctx, &mut fw, before)?;
            }
        }
        let out = Self::forward_end(&mut me, &fwd.ctx, fw, before)?;
        let input_grad = me.backward_end(&bwd.ctx, bw)?;
        Ok((out, input_grad))
    }

    /// The embedding's backward from the gradient of its (sequence-parallel)
    /// output: gathered over tp and masked to this rank's vocabulary rows.
    fn embed_backward(
        &mut self,
        ctx: &Exec<B>,
        dx_td: Tensor<B>,
        saved: EmbedSaved<B>,
    ) -> Result<()> {
        let b = ctx.b;
        let (embed, embed_mask_t) = saved;
        let demb_td = match &embed_mask_t {
            Some(mask_t) => b.mul_rows(&ctx.gather(&self.rank.tp, &dx_td)?, mask_t)?,
            None => dx_td,
        };
        self.embed.backward(b, &demb_td, embed)?;
        Ok(())
    }

    /// The cross-entropy, head and norm backward (the final norm, or MTP
    /// module `mtp`'s): the gradient of the norm's input.
    fn loss_backward(
        &mut self,
        ctx: &Exec<B>,
        saved: LossSaved<B>,
        mtp: Option<usize>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let LossSaved {
            final_norm,
            mut head,
            logits_tv,
            ce,
            dloss_t,
            _held,
        } = saved;
        head.input_mut()
            .gather_shard(|h| ctx.gather(&self.rank.tp, h))?;
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
        let dh_td = ctx.scatter(&self.rank.tp, &dh_full)?;
        let norm = match mtp {
            None => &mut self.final_norm,
            Some(k) => &mut self.mtp[k].norm,
        };
        norm.backward(b, &dh_td, final_norm)
    }

    /// Aux-loss-free balancing after a step, from the loads summed over every
    /// rank of the stage (one `[E]` per MoE layer).
    pub fn update_expert_biases(&mut self, b: &B, loads: &[Tensor<B>]) -> Result<()> {
        let mut loads = loads.iter();
        for moe in self.moe_iter_mut() {
            let load = loads.next().ok_or_else(|| {
                EngineError::Invalid("update_expert_biases: fewer loads than MoE layers".into())
            })?;
            moe.router.update_expert_bias(b, load)?;
        }
        Ok(())
    }

    /// Calls `f` on the dense parameters (attention mesh: reduced over dp),
    /// in the full model's visit order.
    /// Only the parameters this rank trains: the embedding on the first
    /// stage (and the last when tied), the final norm and head on the last.
    pub fn visit_dense<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        if self.owns_embed() {
            f(&self.embed.table);
        }
        for block in self.blocks() {
            block.visit_dense(f);
        }
        if self.owns_head() {
            self.final_norm.visit_params(f);
            self.head.visit_params(f);
        }
        for m in &self.mtp {
            m.visit_dense(f);
        }
    }

    /// Mutable [`Self::visit_dense`].
    pub fn visit_dense_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        if self.owns_embed() {
            f(&mut self.embed.table);
        }
        for block in self.blocks_mut() {
            block.visit_dense_mut(f);
        }
        if self.owns_head() {
            self.final_norm.visit_params_mut(f);
            self.head.visit_params_mut(f);
        }
        for m in &mut self.mtp {
            m.visit_dense_mut(f);
        }
    }

    /// Calls `f` on the routed experts' parameters (expert mesh: reduced over edp).
    pub fn visit_experts<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        for moe in self.moe_iter() {
            moe.experts.visit_params(f);
        }
    }

    /// Mutable [`Self::visit_experts`].
    pub fn visit_experts_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        for moe in self.moe_iter_mut() {
            moe.experts.visit_params_mut(f);
        }
    }

    /// This rank's MoE layers in order: its blocks', then the MTP modules'
    /// (the order of [`ForwardOut::moe_load`]).
    pub fn moe_iter(&self) -> impl Iterator<Item = &MoeLayer<B>> {
        self.blocks()
            .chain(self.mtp.iter().map(|m| &m.block))
            .filter_map(|blk| blk.moe())
    }

    /// Mutable [`Self::moe_iter`].
    pub fn moe_iter_mut(&mut self) -> impl Iterator<Item = &mut MoeLayer<B>> {
        let mtp = self.mtp.iter_mut().map(|m| &mut m.block);
        self.groups
            .iter_mut()
            .flat_map(|g| g.blocks_mut().blocks_mut().iter_mut())
            .chain(mtp)
            .filter_map(|blk| blk.moe_mut())
    }

    /// Number of MoE layers this rank holds (the length of [`ForwardOut::moe_load`]).
    pub fn moe_layers(&self) -> usize {
        self.moe_iter().count()
    }

    /// MoE layers of model chunk `chunk` (its blocks', and the MTP modules'
    /// on the last virtual stage): its share of [`ChunkOut::moe_load`].
    pub fn chunk_moe_layers(&self, chunk: usize) -> usize {
        let blocks = self.chunks.get(chunk).map_or(0, |r| {
            self.blocks()
                .skip(r.start)
                .take(r.len())
                .filter(|blk| blk.moe().is_some())
                .count()
        });
        let mtp = if self.is_last(chunk) {
            self.mtp.iter().filter(|m| m.block.moe().is_some()).count()
        } else {
            0
        };
        blocks + mtp
    }

    /// `(total, active per token)` counts of the parameters this rank holds
    /// (the whole model's on one rank); a token passes through `top_k` of
    /// the `E` routed experts of each MoE layer, so only that share of their
    /// weights is active.
    pub fn param_counts(&self) -> (usize, usize) {
        let mut total = 0;
        self.visit_params(&mut |p| total += p.value.numel());
        let mut inactive = 0;
        for (block, &layer) in self.blocks().zip(&self.layers) {
            let group = self.spec.group_of_layer(layer).map(|g| &g.ffn);
            let (Some(moe), Some(FfnSpec::Moe(m))) = (block.moe(), group) else {
                continue;
            };
            let mut held = 0;
            moe.experts.visit_params(&mut |p| held += p.value.numel());
            inactive += held * (m.experts - m.top_k) / m.experts;
        }
        if let Some(FfnSpec::Moe(m)) = self.spec.groups.last().map(|g| &g.ffn) {
            for moe in self.mtp.iter().filter_map(|mtp| mtp.block.moe()) {
                let mut held = 0;
                moe.experts.visit_params(&mut |p| held += p.value.numel());
                inactive += held * (m.experts - m.top_k) / m.experts;
            }
        }
        (total, total - inactive)
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

/// Checks a device batch: i32 tensors of one shape, `[B, S]` with `S =
/// seq_len` or `[T]` with `T` a multiple of it, not empty.
fn check_device_batch<B: Backend>(
    tokens: &Tensor<B>,
    targets: &Tensor<B>,
    seq_len: usize,
) -> Result<()> {
    for (t, what) in [(tokens, "tokens"), (targets, "targets")] {
        if t.dtype() != DType::I32 {
            return Err(EngineError::Invalid(format!(
                "{what} have dtype {:?}; token ids must be I32",
                t.dtype()
            )));
        }
        let fits = match *t.shape() {
            [n] => seq_len > 0 && n.is_multiple_of(seq_len),
            [_, s] => s == seq_len,
            _ => false,
        };
        if !fits {
            return Err(EngineError::Invalid(format!(
                "{what} have shape {:?}; expected [batch, seq] with seq = {seq_len} \
                 (or [tokens], a multiple of it)",
                t.shape()
            )));
        }
        if t.numel() == 0 {
            return Err(EngineError::Invalid(format!(
                "{what} have shape {:?}; the batch is empty",
                t.shape()
            )));
        }
    }
    if targets.shape() != tokens.shape() {
        return Err(EngineError::Invalid(format!(
            "targets have shape {:?} but tokens have shape {:?}; they must match",
            targets.shape(),
            tokens.shape()
        )));
    }
    Ok(())
}

/// Every parameter this rank holds, in the visit order of the module doc.
impl<B: Backend> Module<B> for Model<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.visit_params_before_groups(f);
        for group in &self.groups {
            group.blocks().visit_params(f);
        }
        self.visit_params_after_groups(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.visit_params_before_groups_mut(f);
        for group in &mut self.groups {
            group.blocks_mut().visit_params_mut(f);
        }
        self.visit_params_after_groups_mut(f);
    }
}

/// The visit of [`Module`] around the groups, so that a `#[moe_model]`
/// struct, which owns its groups, visits in the model's order.
impl<B: Backend> Model<B> {
    /// The parameters visited before the blocks: the embedding.
    #[doc(hidden)]
    pub fn visit_params_before_groups<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.embed.visit_params(f);
    }

    /// The parameters visited after the blocks: final norm, head, MTP modules.
    #[doc(hidden)]
    pub fn visit_params_after_groups<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.final_norm.visit_params(f);
        self.head.visit_params(f);
        for m in &self.mtp {
            m.visit_dense(f);
            if let Some(moe) = m.block.moe() {
                moe.experts.visit_params(f);
            }
        }
    }

    /// Mutable [`Self::visit_params_before_groups`].
    #[doc(hidden)]
    pub fn visit_params_before_groups_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.embed.visit_params_mut(f);
    }

    /// Mutable [`Self::visit_params_after_groups`].
    #[doc(hidden)]
    pub fn visit_params_after_groups_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.final_norm.visit_params_mut(f);
        self.head.visit_params_mut(f);
        for m in &mut self.mtp {
            m.visit_dense_mut(f);
            if let Some(moe) = m.block.moe_mut() {
                moe.experts.visit_params_mut(f);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::{DType, Device, HostData, Tensor};

    use super::{Batch, ForwardOut, Model};
    use crate::engine::parallel::{run_local_layout, Exec, RankLayout};
    use crate::engine::param::Module;
    use crate::engine::testutil::{check_param_grads, i32_tensor, small_moe, small_spec, values};
    use crate::engine::EngineError;
    use crate::layout::{check, LayoutSpec};
    use crate::spec::FfnSpec;
    use std::time::Duration;

    /// Tokens covering the whole vocabulary (so every embedding row has a
    /// gradient) and targets with one ignored position.
    fn batch() -> (Vec<i32>, Vec<i32>) {
        let tokens = vec![3, 0, 6, 1, 7, 2, 5, 4];
        let targets = vec![0, 6, 1, -1, 2, 5, 4, 3];
        (tokens, targets)
    }

    /// The one-rank forward of a device batch `[B, S]`.
    fn fwd(
        m: &Model<Cpu>,
        tokens: &Tensor<Cpu>,
        targets: &Tensor<Cpu>,
    ) -> Result<ForwardOut<Cpu>, EngineError> {
        let seq = *tokens.shape().last().unwrap_or(&0);
        m.forward(
            &Exec::solo(&Cpu),
            Batch::Device { tokens, targets },
            seq.max(1),
        )
    }

    /// Loss and every parameter's gradient of a packed sequence whose
    /// positions and attention reset at its documents equal the runs of
    /// each document alone, weighted by its share of the tokens (the loss is
    /// the mean over tokens) — dense and MoE blocks (no aux losses: they
    /// are statistics of the whole micro-batch).
    #[test]
    fn documents_equal_each_document_alone() {
        use crate::engine::documents::Documents;
        let b = Cpu;
        let mut moe = small_moe();
        if let FfnSpec::Moe(m) = &mut moe {
            m.router.aux_coef = 0.0;
            m.router.z_loss_coef = 0.0;
        }
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, moe], false);
        let lens = [3usize, 5, 4];
        let tokens: Vec<i32> = (0..12).map(|i| i * 5 % 8).collect();
        let targets: Vec<i32> = (0..12).map(|i| (i * 3 + 1) % 8).collect();
        let ids: Vec<i32> = lens
            .iter()
            .enumerate()
            .flat_map(|(d, &l)| std::iter::repeat_n(d as i32, l))
            .collect();
        let grads = |m: &Model<Cpu>| {
            let mut g = Vec::new();
            m.visit_params(&mut |p| g.push(values(&p.grad)));
            g
        };
        let run = |tokens: &[i32], targets: &[i32], docs: Option<&Documents>| {
            let mut m = Model::single(&b, &spec, 11, DType::F64).unwrap();
            let batch = Batch::Host {
                tokens,
                targets,
                docs,
            };
            let out = m.forward(&Exec::solo(&b), batch, tokens.len()).unwrap();
            let loss = values(&out.loss)[0];
            m.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
            (loss, grads(&m))
        };
        let docs = Documents {
            ids,
            reset_positions: true,
            mask_attention: true,
        };
        let (packed_loss, packed_grads) = run(&tokens, &targets, Some(&docs));
        let (mut loss, mut sum) = (0.0, None::<Vec<Vec<f64>>>);
        let mut start = 0;
        for &l in &lens {
            let (dl, dg) = run(&tokens[start..start + l], &targets[start..start + l], None);
            let w = l as f64 / 12.0;
            loss += w * dl;
            let acc = sum.get_or_insert_with(|| dg.iter().map(|g| vec![0.0; g.len()]).collect());
            for (a, g) in acc.iter_mut().zip(&dg) {
                a.iter_mut().zip(g).for_each(|(a, g)| *a += w * g);
            }
            start += l;
        }
        assert!(
            (packed_loss - loss).abs() < 1e-12,
            "{packed_loss} vs {loss}"
        );
        for (i, (a, b)) in packed_grads.iter().zip(&sum.unwrap()).enumerate() {
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(d < 1e-12, "parameter {i}: gradients differ by {d:e}");
        }
        // Without the documents the packed run differs (the test can fail).
        let (plain_loss, _) = run(&tokens, &targets, None);
        assert!((plain_loss - loss).abs() > 1e-6);
    }

    fn check_model_grad(ffns: &[FfnSpec], tied: bool, what: &str) {
        let b = Cpu;
        let spec = small_spec(ffns, tied);
        let mut model = Model::single(&b, &spec, 11, DType::F64).unwrap();
        let (tokens, targets) = batch();
        let tokens = i32_tensor(tokens, &[2, 4]);
        let targets = i32_tensor(targets, &[2, 4]);
        let out = fwd(&model, &tokens, &targets).unwrap();
        model.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
        check_param_grads(what, &mut model, 6, 1e-6, |m| {
            let out = fwd(m, &tokens, &targets).unwrap();
            values(&out.loss)[0] + values(&out.aux_loss)[0]
        });
    }

    #[test]
    fn model_grad_dense_and_moe() {
        check_model_grad(
            &[FfnSpec::Dense { ffn: 6 }, small_moe()],
            false,
            "model (dense + moe)",
        );
    }

    #[test]
    fn model_grad_tied_dense() {
        check_model_grad(&[FfnSpec::Dense { ffn: 6 }], true, "model (tied)");
    }

    /// `mtp` MTP modules (blocks of the last of `ffns`): the loss the
    /// gradient is of is `CE + λ/D·Σ_k CE_k + aux`, every parameter's
    /// gradient (the modules', the shared embedding's and head's) against
    /// finite differences.
    fn check_mtp_grad(ffns: &[FfnSpec], mtp: usize, what: &str) {
        let b = Cpu;
        let mut spec = small_spec(ffns, false);
        spec.mtp_layers = mtp;
        spec.mtp_loss_coef = 0.3;
        let mut model = Model::single(&b, &spec, 11, DType::F64).unwrap();
        assert_eq!(model.mtp.len(), mtp);
        let (tokens, targets) = batch();
        let tokens = i32_tensor(tokens, &[2, 4]);
        let targets = i32_tensor(targets, &[2, 4]);
        let out = fwd(&model, &tokens, &targets).unwrap();
        let mtp_loss = values(out.mtp_loss.as_ref().unwrap())[0];
        assert!(
            mtp_loss > 0.0 && mtp_loss.is_finite(),
            "mtp loss {mtp_loss}"
        );
        model.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
        let coef = spec.mtp_loss_coef;
        check_param_grads(what, &mut model, 6, 1e-6, |m| {
            let out = fwd(m, &tokens, &targets).unwrap();
            values(&out.loss)[0]
                + coef * values(out.mtp_loss.as_ref().unwrap())[0]
                + values(&out.aux_loss)[0]
        });
    }

    /// Two modules chained (module 2 reads module 1's output), dense blocks.
    #[test]
    fn model_grad_with_two_mtp_modules() {
        check_mtp_grad(
            &[small_moe(), FfnSpec::Dense { ffn: 6 }],
            2,
            "model (2 dense mtp)",
        );
    }

    /// DeepSeek-V3's shape: one module whose block is an MoE block (its
    /// router's aux and z losses included).
    #[test]
    fn model_grad_with_an_moe_mtp_module() {
        check_mtp_grad(
            &[FfnSpec::Dense { ffn: 6 }, small_moe()],
            1,
            "model (moe mtp)",
        );
    }

    /// MTP changes nothing of the main model but through its loss: the main
    /// parameters are drawn the same (by name), the main loss is the same,
    /// and with `mtp_loss_coef = 0` every main gradient is that of the model
    /// without MTP.
    #[test]
    fn mtp_with_zero_weight_leaves_the_main_gradients() {
        let b = Cpu;
        let base = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let mut spec = base.clone();
        spec.mtp_layers = 1;
        spec.mtp_loss_coef = 0.0;
        let (tokens, targets) = batch();
        let tokens = i32_tensor(tokens, &[2, 4]);
        let targets = i32_tensor(targets, &[2, 4]);
        let grads = |spec: &crate::spec::ModelSpec| {
            let mut model = Model::single(&b, spec, 11, DType::F64).unwrap();
            let out = fwd(&model, &tokens, &targets).unwrap();
            let loss = values(&out.loss)[0];
            model.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
            let mut g = Vec::new();
            model.visit_dense(&mut |p| {
                if !p.name.starts_with("mtp.") {
                    g.push((p.name.clone(), values(&p.grad)));
                }
            });
            (loss, g)
        };
        let (loss_a, a) = grads(&base);
        let (loss_b, g) = grads(&spec);
        assert_eq!(loss_a, loss_b);
        assert_eq!(a.len(), g.len());
        for ((n, x), (_, y)) in a.iter().zip(&g) {
            for (p, q) in x.iter().zip(y) {
                assert!((p - q).abs() <= 1e-12 * (1.0 + p.abs()), "{n}: {p} vs {q}");
            }
        }
    }

    #[test]
    fn loss_is_mean_over_non_ignored_tokens_of_logits() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let model = Model::single(&b, &spec, 3, DType::F64).unwrap();
        let (tokens, targets) = batch();
        let tokens_bs = i32_tensor(tokens.clone(), &[2, 4]);
        let out = fwd(&model, &tokens_bs, &i32_tensor(targets.clone(), &[2, 4])).unwrap();
        let logits = values(&model.logits(&Exec::solo(&b), &tokens, 4).unwrap());
        let v = spec.vocab;
        let (mut sum, mut n) = (0.0, 0);
        for (t, &target) in targets.iter().enumerate() {
            if target < 0 {
                continue;
            }
            let row = &logits[t * v..(t + 1) * v];
            let max = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            sum += lse - row[target as usize];
            n += 1;
        }
        let loss = values(&out.loss)[0];
        assert!(
            (loss - sum / n as f64).abs() < 1e-12,
            "{loss} vs {}",
            sum / n as f64
        );
        assert_eq!(out.moe_load.len(), 1);
        // Every token sends top_k copies.
        assert_eq!(values(&out.moe_load[0]).iter().sum::<f64>(), 16.0);
        assert!(values(&out.aux_loss)[0] > 0.0);
    }

    #[test]
    fn all_ignored_targets_give_zero_loss_and_no_nan() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let mut model = Model::single(&b, &spec, 3, DType::F32).unwrap();
        let tokens = i32_tensor(vec![1, 2, 3, 4], &[1, 4]);
        let out = fwd(&model, &tokens, &i32_tensor(vec![-1; 4], &[1, 4])).unwrap();
        assert_eq!(values(&out.loss), vec![0.0]);
        model.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
        model.visit_params(&mut |p| assert!(values(&p.grad).iter().all(|g| *g == 0.0)));
    }

    #[test]
    fn model_params_have_stable_names_and_counts() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let model = Model::single(&b, &spec, 3, DType::F32).unwrap();
        let mut names = Vec::new();
        model.visit_params(&mut |p| names.push(p.name.clone()));
        assert_eq!(names[0], "embed.weight");
        assert_eq!(
            names[1..8],
            [
                "blocks.0.attn_norm.weight",
                "blocks.0.attn.wq",
                "blocks.0.attn.wk",
                "blocks.0.attn.wv",
                "blocks.0.attn.wo",
                "blocks.0.ffn_norm.weight",
                "blocks.0.mlp.w1",
            ]
        );
        assert!(names.iter().any(|n| n.starts_with("blocks.1.moe.")));
        assert_eq!(
            names[names.len() - 2..],
            ["final_norm.weight", "head.weight"]
        );

        let (v, d) = (8, 8);
        let attn = d * 16 + 2 * d * 8 + 16 * d;
        let dense = attn + 3 * d * 6 + 2 * d;
        // router, 4 experts of ffn 6, a shared expert of ffn 4.
        let moe = attn + d * 4 + 4 * 3 * d * 6 + 3 * d * 4 + 2 * d;
        let total = 2 * v * d + dense + moe + d;
        let active = total - 2 * 3 * d * 6; // 2 of 4 experts idle per token
        assert_eq!(model.param_counts(), (total, active));

        let tied = Model::single(
            &b,
            &small_spec(&[FfnSpec::Dense { ffn: 6 }], true),
            3,
            DType::F32,
        )
        .unwrap();
        let mut last = String::new();
        tied.visit_params(&mut |p| last = p.name.clone());
        assert_eq!(last, "final_norm.weight");
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let model = Model::single(&b, &spec, 3, DType::F32).unwrap();
        let ok = i32_tensor(vec![1, 2, 3, 4], &[1, 4]);
        let invalid = |r: Result<_, EngineError>, want: &str| match r {
            Err(EngineError::Invalid(msg)) => assert!(msg.contains(want), "{msg}"),
            Err(e) => panic!("expected Invalid containing {want:?}, got {e}"),
            Ok(_) => panic!("expected an error containing {want:?}"),
        };
        let floats = b.upload(HostData::F32(vec![1.0; 4]), &[1, 4]).unwrap();
        invalid(fwd(&model, &floats, &ok).map(|_| ()), "I32");
        invalid(fwd(&model, &ok, &floats).map(|_| ()), "I32");
        invalid(
            fwd(&model, &i32_tensor(vec![1, 2, 3], &[1, 3]), &ok).map(|_| ()),
            "expected [batch, seq]",
        );
        invalid(
            fwd(&model, &ok, &i32_tensor(vec![1, 2, 3, 4], &[4])).map(|_| ()),
            "must match",
        );
        let empty = i32_tensor(vec![], &[0, 4]);
        invalid(fwd(&model, &empty, &empty).map(|_| ()), "empty");
        invalid(
            model.logits(&Exec::solo(&b), &[], 4).map(|_| ()),
            "do not form sequences",
        );
        // Ids and targets past the vocabulary: the kernels' index errors.
        let big = i32_tensor(vec![1, 2, 8, 4], &[1, 4]);
        assert!(matches!(
            fwd(&model, &big, &ok),
            Err(EngineError::Kernel(_))
        ));
        assert!(matches!(
            fwd(&model, &ok, &big),
            Err(EngineError::Kernel(_))
        ));
        let neg = i32_tensor(vec![1, -1, 2, 3], &[1, 4]);
        assert!(matches!(
            fwd(&model, &neg, &ok),
            Err(EngineError::Kernel(_))
        ));
    }

    /// Relative L2 error `‖got − want‖ / ‖want‖`.
    fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
        let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den).sqrt()
    }

    /// The CPU's bf16 emulation (docs/ARCHITECTURE.md §6) runs the engine unchanged: the
    /// dense + MoE model built in BF16 gives the loss of the F32 model of
    /// the same seed within bf16 rounding, and gradients close to its.
    #[test]
    fn bf16_model_on_cpu_tracks_f32() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let (tokens, targets) = batch();
        let (tokens, targets) = (i32_tensor(tokens, &[2, 4]), i32_tensor(targets, &[2, 4]));
        let run = |dtype| {
            let mut model = Model::single(&b, &spec, 11, dtype).unwrap();
            let out = fwd(&model, &tokens, &targets).unwrap();
            assert_eq!(out.loss.dtype(), dtype.acc());
            let losses = (values(&out.loss)[0], values(&out.aux_loss)[0]);
            model.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
            let mut grads = Vec::new();
            model.visit_params(&mut |p| {
                assert_eq!(
                    (p.value.dtype(), p.grad.dtype()),
                    (dtype, dtype),
                    "{}",
                    p.name
                );
                grads.push((p.name.clone(), values(&p.grad)));
            });
            (losses, grads)
        };
        let ((loss32, aux32), g32) = run(DType::F32);
        let ((loss16, aux16), g16) = run(DType::BF16);
        // A bf16 value is within 2^-9 relative of its f32 origin; a dozen
        // roundings along the forward, partly cancelling, stay under 1%
        // (measured 1.4e-3 with the loss in f32; 4.8e-3 when the
        // cross-entropy rounded it to bf16).
        let rel = (loss16 - loss32).abs() / loss32;
        println!(
            "bf16 vs f32 loss: {loss16} vs {loss32} (relative {rel:.2e}), aux {aux16} vs {aux32}"
        );
        assert!(rel < 1e-2, "loss {loss16} vs {loss32}");
        assert!(
            (aux16 - aux32).abs() < 2e-2 * aux32,
            "aux {aux16} vs {aux32}"
        );
        let (mut all16, mut all32) = (Vec::new(), Vec::new());
        let mut worst = (0.0f64, String::new());
        for ((name, a), (_, w)) in g16.iter().zip(&g32) {
            let e = rel_l2(a, w);
            if e > worst.0 {
                worst = (e, name.clone());
            }
            all16.extend_from_slice(a);
            all32.extend_from_slice(w);
        }
        let total = rel_l2(&all16, &all32);
        println!(
            "bf16 vs f32 gradients: relative L2 {total:.2e} over all parameters, worst parameter {:.2e} ({})",
            worst.0, worst.1
        );
        // bf16 activations and weights (8 significant bits) through two blocks
        // and back: measured 1.1e-2 over all and 2.7e-2 for the worst
        // parameter (a norm weight, whose gradient sums many rounded
        // products); a wrong gradient would be O(1).
        assert!(total < 5e-2, "gradients off by {total:.2e}");
        assert!(worst.0 < 0.1, "{} off by {:.2e}", worst.1, worst.0);
    }

    /// A BF16 model's loss is F32, as Megatron-Core's fp32 cross-entropy:
    /// it is the f32 mean of the cross-entropy of the model's own bf16
    /// logits, not rounded to bf16, so it tracks the F32 model's loss more
    /// closely than one bf16 ulp of it; the backward takes the f32 lse.
    #[test]
    fn bf16_model_loss_is_f32_not_bf16_quantised() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let (tokens, targets) = batch();
        let tokens_bs = i32_tensor(tokens.clone(), &[2, 4]);
        let targets_bs = i32_tensor(targets.clone(), &[2, 4]);
        let loss_of = |dtype| {
            let mut model = Model::single(&b, &spec, 11, dtype).unwrap();
            let out = fwd(&model, &tokens_bs, &targets_bs).unwrap();
            assert_eq!(out.loss.dtype(), dtype.acc(), "{dtype:?}");
            let loss = values(&out.loss)[0];
            let logits = model.logits(&Exec::solo(&b), &tokens, 4).unwrap();
            assert_eq!(logits.dtype(), dtype);
            model.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
            (loss, values(&logits))
        };
        let (loss32, _) = loss_of(DType::F32);
        let (loss16, logits16) = loss_of(DType::BF16);
        // The mean cross-entropy of the bf16 logits, in f64 on the host.
        let v = spec.vocab;
        let (mut sum, mut n) = (0.0, 0);
        for (t, &target) in targets.iter().enumerate() {
            if target >= 0 {
                let row = &logits16[t * v..(t + 1) * v];
                let max = row.iter().cloned().fold(f64::MIN, f64::max);
                let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                sum += lse - row[target as usize];
                n += 1;
            }
        }
        let exact = sum / n as f64;
        // One bf16 ulp of the loss: 8 significant bits.
        let ulp = 2f64.powi(loss32.log2().floor() as i32 - 7);
        println!(
            "bf16 model loss {loss16} (f32 model {loss32}, |diff| {:.2e}; f64 CE of the bf16 \
             logits {exact}, |diff| {:.2e}; one bf16 ulp {ulp:.2e})",
            (loss16 - loss32).abs(),
            (loss16 - exact).abs()
        );
        assert!((loss16 - exact).abs() < 1e-5 * exact, "{loss16} vs {exact}");
        assert!((loss16 - loss32).abs() < ulp, "{loss16} vs {loss32}");
    }

    #[test]
    fn invalid_spec_is_a_spec_error() {
        let mut spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        spec.groups[0].attention.kv_heads = 3;
        spec.vocab = 0;
        match Model::single(&Cpu, &spec, 0, DType::F32) {
            Err(EngineError::Spec(errs)) => assert_eq!(errs.len(), 2, "{errs:?}"),
            Err(e) => panic!("expected a spec error, got {e}"),
            Ok(_) => panic!("expected a spec error"),
        }
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        assert!(matches!(
            Model::single(&Cpu, &spec, 0, DType::I32),
            Err(EngineError::Invalid(_))
        ));
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
            let mut m = Model::single(&b, &spec, 11, dtype).unwrap();
            let (tk, tg) = (
                i32_tensor(tokens.to_vec(), &[2, 4]),
                i32_tensor(targets.to_vec(), &[2, 4]),
            );
            let out = fwd(&m, &tk, &tg).unwrap();
            let loss = values(&out.loss)[0];
            m.backward(&Exec::solo(&b), out.saved, 1.0).unwrap();
            let head = m.head.weight.as_ref().unwrap();
            (loss, values(&head.grad))
        };
        let (loss32, _) = one(DType::F32);
        let (loss16, head16) = one(DType::BF16);
        let l = check(&LayoutSpec::parse("world=2,tp=2").unwrap(), &spec).unwrap();
        let results = run_local_layout(&b, &l, Duration::from_secs(30), |ctx| {
            let rank = RankLayout::new(&l, ctx.rank.rank)?;
            let mut m = Model::new(&b, &spec, rank, 11, DType::BF16)?;
            let batch = Batch::Host {
                tokens: &tokens,
                targets: &targets,
                docs: None,
            };
            let out = m.forward(&ctx.exec(), batch, 4)?;
            assert_eq!(out.loss.dtype(), DType::F32);
            let loss = values(&out.loss)[0];
            m.backward(&ctx.exec(), out.saved, 1.0)?;
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
