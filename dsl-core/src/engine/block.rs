//! One transformer block (Megatron-Core's `TransformerLayer`, pre-norm):
//! `x = x + attn(norm1(x)); x = x + ffn(norm2(x))`, the attention being
//! grouped-query or multi-head latent attention (MLA), the feed-forward the
//! dense SwiGLU MLP or the MoE layer, on one rank's shard under a layout:
//!
//! ```text
//! x_l += reduce_scatter_tp(attn_heads_shard(all_gather_tp(norm(x_l))))
//! x_l += reduce_scatter_tp(mlp_ffn_shard(all_gather_tp(norm(x_l))))   (dense)
//! x_l += moe(norm(x_l))                                               (MoE)
//! ```
//!
//! `x_l` is the rank's sequence-parallel rows; with cp the attention is its
//! context-parallel form ([`crate::engine::parallel::context`]). One rank is
//! the layout whose groups are `[0]`: every gather and scatter is the identity.
//!
//! Shapes: T tokens, D hidden, E experts.

use foldmoe_kernels::{Backend, DType, Group, Tensor};

use super::activations::{Held, Ledger, Slot, Stash};
use super::attention::{Attention, AttentionSaved};
use super::documents::DocTensors;
use super::mla::{Mla, MlaCpSaved, MlaSaved};
use super::mlp::{MlpSaved, SwiGluMlp};
use super::moe::{MoeBackward, MoeForward, MoeLayer, MoeOut, MoeSaved, MoeStats};
use super::norm::{NormSaved, RmsNorm};
use super::parallel::context::{self, CpAttentionSaved};
use super::parallel::{Exec, LayerGroups};
use super::param::{Init, Module, Param};
use super::{drive, EngineError, Result, Step};
use crate::memory::Part;
use crate::spec::{
    BlockGroup, FfnSpec, GemmPrecision, ModelSpec, OffloadPart, Policy, RecomputePart,
};

/// The attention part of a block.
pub enum Attn<B: Backend> {
    /// Grouped-query attention.
    Gqa(Box<Attention<B>>),
    /// Multi-head latent attention.
    Mla(Box<Mla<B>>),
}

/// What the attention's backward needs.
pub(crate) enum AttnSaved<B: Backend> {
    Gqa(Box<AttentionSaved<B>>),
    Mla(Box<MlaSaved<B>>),
}

impl<B: Backend> AttnSaved<B> {
    /// Lists the saved tensors with their slots.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            AttnSaved::Gqa(s) => s.visit_saved(f),
            AttnSaved::Mla(s) => s.visit_saved(f),
        }
    }
}

impl<B: Backend> Attn<B> {
    /// This rank's sequence shard `h: [T/tp, D]` of the normed input (all T
    /// tokens without tp) → the output projection's `[T, D]` over the
    /// tp-gathered sequence (under tp this rank's heads' partial sum), over
    /// sequences of `seq_len`, with `ctx`'s documents. GQA reads the gathered
    /// input and keeps only `h` (gathered again in the backward, as
    /// Megatron-Core's sequence-parallel linears do); MLA runs its down
    /// projections on `h` and gathers their latents ([`Mla::forward`]).
    pub(crate) fn forward(
        &self,
        ctx: &Exec<B>,
        tp: &Group,
        h: &Tensor<B>,
        seq_len: usize,
    ) -> Result<(Tensor<B>, AttnSaved<B>)> {
        Ok(match self {
            Attn::Gqa(a) => {
                let h_full = ctx.gather(tp, h)?;
                let (y_td, mut saved) = a.forward(ctx.b, &h_full, seq_len, ctx.docs)?;
                if tp.size() > 1 {
                    saved.input_mut().keep_shard(h);
                }
                (y_td, AttnSaved::Gqa(Box::new(saved)))
            }
            Attn::Mla(a) => {
                let (y_td, saved) = a.forward(ctx, tp, h, seq_len)?;
                (y_td, AttnSaved::Mla(Box::new(saved)))
            }
        })
    }

    /// Accumulates the attention's parameter gradients and returns `dh` of
    /// this rank's shard from `dy` of the gathered sequence (GQA's gradient
    /// of the gathered input is reduce-scattered over tp).
    pub(crate) fn backward(
        &mut self,
        ctx: &Exec<B>,
        tp: &Group,
        dy_td: &Tensor<B>,
        saved: AttnSaved<B>,
    ) -> Result<Tensor<B>> {
        match (self, saved) {
            (Attn::Gqa(a), AttnSaved::Gqa(mut s)) => {
                s.input_mut().gather_shard(|h| ctx.gather(tp, h))?;
                ctx.scatter(tp, &a.backward(ctx.b, dy_td, *s)?)
            }
            (Attn::Mla(a), AttnSaved::Mla(s)) => a.backward(ctx, tp, dy_td, *s),
            _ => Err(EngineError::Invalid(
                "block backward: saved attention state comes from attention of another kind".into(),
            )),
        }
    }
}

impl<B: Backend> Module<B> for Attn<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        match self {
            Attn::Gqa(a) => a.visit_params(f),
            Attn::Mla(a) => a.visit_params(f),
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        match self {
            Attn::Gqa(a) => a.visit_params_mut(f),
            Attn::Mla(a) => a.visit_params_mut(f),
        }
    }
}

/// A block's output, saved state, and its MoE layer's losses and loads (if any).
pub type BlockOut<B> = (Tensor<B>, BlockSaved<B>, Option<MoeStats<B>>);

/// The feed-forward part of a block.
pub enum Ffn<B: Backend> {
    /// A dense SwiGLU MLP, its ffn split over tp.
    Dense(Box<SwiGluMlp<B>>),
    /// A Mixture-of-Experts layer over the expert mesh.
    Moe(Box<MoeLayer<B>>),
}

/// What the feed-forward's backward needs.
enum FfnSaved<B: Backend> {
    Dense(MlpSaved<B>),
    Moe(Box<MoeSaved<B>>),
}

/// The attention's saved state: the plain layer's, or context-parallel.
enum BlockAttnSaved<B: Backend> {
    Local(AttnSaved<B>),
    Cp(Box<CpAttentionSaved<B>>),
    MlaCp(Box<MlaCpSaved<B>>),
}

/// A pre-norm transformer block of one rank.
pub struct Block<B: Backend> {
    /// Norm before attention (replicated over tp).
    pub attn_norm: RmsNorm<B>,
    /// Self-attention, GQA (this rank's heads) or MLA.
    pub attn: Attn<B>,
    /// Norm before the feed-forward (replicated over tp).
    pub ffn_norm: RmsNorm<B>,
    /// Dense MLP shard or MoE layer.
    pub ffn: Ffn<B>,
    /// What the block recomputes, offloads and stores in fp8 (its group's).
    pub policy: Policy,
    /// Where the block counts its saved activations (the model's ledger).
    pub ledger: Ledger,
    /// The block's parameter prefix (`blocks.3`), its name in the ledger.
    pub(crate) name: String,
    /// The groups its layers communicate over.
    groups: LayerGroups,
}

/// What the block's backward needs from its forward: the layers' saved
/// state, and what the block's policy did to it.
pub struct BlockSaved<B: Backend> {
    attn_norm: NormSaved<B>,
    attn: BlockAttnSaved<B>,
    ffn_norm: NormSaved<B>,
    ffn: FfnSaved<B>,
    /// Dropped, moved or compressed tensors and the ledger bytes held
    /// (none for a rerun's state, which lives only inside backward).
    stash: Option<Stash>,
    /// Sequence length, micro-batch tokens and documents of the forward,
    /// for a rerun.
    seq_len: usize,
    tokens: usize,
    docs: Option<DocTensors<B>>,
}

/// What a block's forward computed before its feed-forward, kept while the
/// MoE layer waits for an exchange.
struct ForwardHead<B: Backend> {
    /// The residual stream after attention.
    x1: Tensor<B>,
    attn_norm: NormSaved<B>,
    attn: BlockAttnSaved<B>,
    ffn_norm: NormSaved<B>,
    seq_len: usize,
    tokens: usize,
    docs: Option<DocTensors<B>>,
    /// Whether the block's policy applies to the saved state at the end.
    policy: bool,
}

/// A block's forward paused at its MoE layer's exchange
/// (`Block::forward_start`).
pub struct BlockForward<B: Backend> {
    head: ForwardHead<B>,
    moe: MoeForward<B>,
}

/// What a block's backward needs after its feed-forward, kept while the
/// MoE layer waits for an exchange.
struct BackwardTail<B: Backend> {
    /// The block's output gradient (the residual's part of `dx1`).
    dy_td: Tensor<B>,
    attn_norm: NormSaved<B>,
    attn: BlockAttnSaved<B>,
    ffn_norm: NormSaved<B>,
    /// The ledger bytes of the forward's saved state and of what a
    /// recompute brought back, counted until the backward finishes (a
    /// paused one still holds them while another forward saves its own).
    _held: Vec<Held>,
}

/// A block's backward paused at its MoE layer's exchange
/// (`Block::backward_start`).
pub struct BlockBackward<B: Backend> {
    tail: BackwardTail<B>,
    moe: MoeBackward<B>,
}

/// The input slots of the attention norm (the block's input) and of the
/// feed-forward's norm.
pub(crate) const ATTN_NORM_IN: Slot = Slot::kept(Part::Norms).offload(OffloadPart::AttnNorm);
pub(crate) const MLP_NORM_IN: Slot = Slot::kept(Part::Norms).offload(OffloadPart::MlpNorm);

impl<B: Backend> BlockAttnSaved<B> {
    fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            BlockAttnSaved::Local(s) => s.visit_saved(f),
            BlockAttnSaved::Cp(s) => s.visit_saved(f),
            BlockAttnSaved::MlaCp(s) => s.visit_saved(f),
        }
    }
}

impl<B: Backend> FfnSaved<B> {
    /// Lists the feed-forward's saved tensors with their slots.
    fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            FfnSaved::Dense(s) => s.visit_saved_as_block_ffn(f),
            FfnSaved::Moe(s) => s.visit_saved(f),
        }
    }
}

/// A block's saved state as its four layers' lists (attention norm,
/// attention, feed-forward norm, feed-forward), in forward order, which
/// recompute and the stash rely on.
impl<B: Backend> BlockSaved<B> {
    /// Lists layer `layer`'s (0..4) saved tensors with their slots.
    fn visit_layer(&mut self, layer: usize, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match layer {
            0 => self.attn_norm.visit_saved(ATTN_NORM_IN, f),
            1 => self.attn.visit_saved(f),
            2 => self.ffn_norm.visit_saved(MLP_NORM_IN, f),
            _ => self.ffn.visit_saved(f),
        }
    }

    /// Lists every saved tensor with its slot, in forward order.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        for layer in 0..4 {
            self.visit_layer(layer, f);
        }
    }

    /// Where each layer's tensors sit in [`BlockSaved::visit_saved`]'s list.
    fn ranges(&mut self) -> [std::ops::Range<usize>; 4] {
        let mut n = [0usize; 4];
        for (layer, count) in n.iter_mut().enumerate() {
            self.visit_layer(layer, &mut |_, _| *count += 1);
        }
        layer_ranges(n)
    }

    /// Starts bringing this block's offloaded tensors back (see
    /// [`Stash::prefetch`]), one block ahead of its backward.
    pub fn prefetch(&mut self, b: &B) -> Result<()> {
        self.stash.as_mut().map_or(Ok(()), |s| s.prefetch(b))
    }

    /// Device bytes this state holds in the ledger.
    pub fn device_bytes(&self) -> u64 {
        self.stash.as_ref().map_or(0, |s| s.held().device_bytes())
    }
}

impl<B: Backend> Block<B> {
    /// A block of `group` with parameters under `prefix` (`blocks.3`), drawn
    /// by `init` (this rank's blocks under its shard plan, or whole
    /// tensors), communicating over `groups`.
    pub fn new(
        b: &B,
        prefix: &str,
        model: &ModelSpec,
        group: &BlockGroup,
        init: Init<'_>,
        dtype: DType,
        groups: LayerGroups,
    ) -> Result<Self> {
        let d = model.hidden;
        let tp = groups.tp.size();
        let ffn = match &group.ffn {
            FfnSpec::Dense { ffn } => Ffn::Dense(Box::new(SwiGluMlp::new(
                b,
                &format!("{prefix}.mlp"),
                d,
                *ffn,
                model.init_std,
                init,
                dtype,
            )?)),
            FfnSpec::Moe(moe) => {
                let mut layer = MoeLayer::new(
                    b,
                    &format!("{prefix}.moe"),
                    model,
                    moe,
                    init,
                    dtype,
                    groups.clone(),
                )?;
                // The group's GEMM precision covers its routed experts
                // (docs/ARCHITECTURE.md §6); the rest stays in `dtype`.
                layer.experts.fp8 = group.policy.precision == GemmPrecision::Fp8Blockwise;
                Ffn::Moe(Box::new(layer))
            }
        };
        let attn_prefix = format!("{prefix}.attn");
        let spec = &group.attention;
        let attn = match &spec.mla {
            None => {
                let mut a = Attention::new(b, &attn_prefix, model, spec, init, dtype)?;
                a.take_heads(tp)?;
                Attn::Gqa(Box::new(a))
            }
            Some(mla) => {
                let mut m = Mla::new(b, &attn_prefix, model, spec.heads, mla, init, dtype)?;
                m.take_heads(b, tp)?;
                m.fp8 = spec.precision == GemmPrecision::Fp8Blockwise;
                Attn::Mla(Box::new(m))
            }
        };
        Ok(Block {
            attn_norm: RmsNorm::new(b, &format!("{prefix}.attn_norm"), d, model.norm_eps, dtype)?,
            attn,
            ffn_norm: RmsNorm::new(b, &format!("{prefix}.ffn_norm"), d, model.norm_eps, dtype)?,
            ffn,
            policy: group.policy.clone(),
            ledger: Ledger::default(),
            name: prefix.to_string(),
            groups,
        })
    }

    /// The block's dense parameters (attention mesh: all but the routed
    /// experts), in the model's visit order.
    pub fn visit_dense<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.attn_norm.visit_params(f);
        self.attn.visit_params(f);
        self.ffn_norm.visit_params(f);
        match &self.ffn {
            Ffn::Dense(mlp) => mlp.visit_params(f),
            Ffn::Moe(moe) => moe.visit_dense(f),
        }
    }

    /// Mutable [`Self::visit_dense`].
    pub fn visit_dense_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.attn_norm.visit_params_mut(f);
        self.attn.visit_params_mut(f);
        self.ffn_norm.visit_params_mut(f);
        match &mut self.ffn {
            Ffn::Dense(mlp) => mlp.visit_params_mut(f),
            Ffn::Moe(moe) => moe.visit_dense_mut(f),
        }
    }

    /// The MoE layer, if the feed-forward is one.
    pub fn moe(&self) -> Option<&MoeLayer<B>> {
        match &self.ffn {
            Ffn::Moe(m) => Some(&**m),
            Ffn::Dense(_) => None,
        }
    }

    /// The MoE layer, mutably, if the feed-forward is one.
    pub fn moe_mut(&mut self) -> Option<&mut MoeLayer<B>> {
        match &mut self.ffn {
            Ffn::Moe(m) => Some(&mut **m),
            Ffn::Dense(_) => None,
        }
    }
}

impl<B: Backend> Block<B> {
    /// `x: [T/(tp·cp), D]` (this rank's rows of a micro-batch of `tokens` in
    /// sequences of `seq_len`) → the same rows of the block's output; also
    /// the MoE layer's losses and loads when the feed-forward is one. The
    /// saved state is under the block's policy and counted in its ledger.
    pub fn forward(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<BlockOut<B>> {
        let first = self.forward_start(ctx, x_td, seq_len, tokens)?;
        drive(first, |f| self.forward_resume(ctx, f))
    }

    /// Undoes the policy before backward: fetches offloaded and fp8 tensors
    /// and, if any were dropped for recompute, reruns what dropped them
    /// (`block`: the whole forward from the kept block input; a selective
    /// part: only the layers that dropped something, each from its kept
    /// input: the memory saved is the part's, what Megatron-Core drops for
    /// it, the extra compute its layer's forward). The forward is
    /// deterministic, so the rerun's tensors are bit-identical to those
    /// dropped. Returns the ledger bytes of the forward's state and of what
    /// the rerun brought back, held until the caller drops them. The
    /// rerun's collectives (tp gathers, cp's key/value gather, the ep
    /// exchange) pair up because every rank of a group has the same policy
    /// and runs the same block's backward at the same point of the schedule.
    fn restore(&self, ctx: &Exec<B>, saved: &mut BlockSaved<B>) -> Result<Vec<Held>> {
        let b = ctx.b;
        let Some(mut stash) = saved.stash.take() else {
            return Ok(Vec::new());
        };
        stash.restore(b, None, |f| saved.visit_saved(f))?;
        if !stash.needs_recompute() {
            return Ok(vec![stash.into_held()]);
        }
        let (seq_len, tokens) = (saved.seq_len, saved.tokens);
        // The rerun sees the forward's documents (the backward's context
        // carries none).
        let docs = saved.docs.clone();
        let ctx = &Exec {
            docs: docs.as_ref(),
            ..*ctx
        };
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
                        Ffn::Dense(mlp) => FfnSaved::Dense(self.dense_forward(ctx, mlp, h)?.1),
                        Ffn::Moe(moe) => {
                            FfnSaved::Moe(Box::new(moe.forward(ctx, h, seq_len, tokens)?.1))
                        }
                    };
                    ffn.visit_saved(f);
                }
                Ok(())
            })?;
        }
        let refilled = stash.restore(b, Some(fresh), |f| saved.visit_saved(f))?;
        let rematerialised = self.ledger.hold(&self.name, refilled, 0);
        Ok(vec![stash.into_held(), rematerialised])
    }

    /// Attention from this rank's sequence shard `h` of the normed input:
    /// the local layer ([`Attn::forward`]) or, under cp, its
    /// context-parallel form. Returns the tp-full output and the state,
    /// which keeps `h` rather than the tp-gathered input.
    fn attn_forward(
        &self,
        ctx: &Exec<B>,
        h: &Tensor<B>,
        seq_len: usize,
    ) -> Result<(Tensor<B>, BlockAttnSaved<B>)> {
        let tp = &self.groups.tp;
        if self.groups.cp.size() == 1 {
            let (y, saved) = self.attn.forward(ctx, tp, h, seq_len)?;
            return Ok((y, BlockAttnSaved::Local(saved)));
        }
        Ok(match &self.attn {
            Attn::Gqa(a) => {
                let h_full = ctx.gather(tp, h)?;
                let (y, mut saved) = context::forward(ctx, &self.groups, a, &h_full, seq_len)?;
                if tp.size() > 1 {
                    saved.input_mut().keep_shard(h);
                }
                (y, BlockAttnSaved::Cp(Box::new(saved)))
            }
            Attn::Mla(m) => {
                let (y, saved) = m.forward_cp(ctx, &self.groups, h, seq_len)?;
                (y, BlockAttnSaved::MlaCp(Box::new(saved)))
            }
        })
    }

    /// The dense feed-forward of this rank's sequence shard `h` of the
    /// normed input, gathered over tp: the tp-full output (partial sums
    /// over tp) and the state, which keeps `h` rather than the gathered
    /// input, as [`Self::attn_forward`] does.
    fn dense_forward(
        &self,
        ctx: &Exec<B>,
        mlp: &SwiGluMlp<B>,
        h: &Tensor<B>,
    ) -> Result<(Tensor<B>, MlpSaved<B>)> {
        let (y_full, mut saved) = mlp.forward(ctx.b, &ctx.gather(&self.groups.tp, h)?)?;
        if self.groups.tp.size() > 1 {
            saved.input_mut().keep_shard(h);
        }
        Ok((y_full, saved))
    }

    /// The forward with every saved tensor kept and nothing counted: the
    /// first half of [`Block::forward`], the rerun of recompute, and
    /// inference.
    pub(crate) fn forward_raw(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<BlockOut<B>> {
        let first = self.forward_phase(ctx, x_td, seq_len, tokens, false)?;
        drive(first, |f| self.forward_resume(ctx, f))
    }

    /// [`Block::forward`] up to its MoE layer's first exchange (see
    /// [`MoeLayer::forward_start`]); a dense block, or an MoE layer with
    /// nothing to wait for, finishes here.
    pub(crate) fn forward_start(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<Step<BlockForward<B>, BlockOut<B>>> {
        self.forward_phase(ctx, x_td, seq_len, tokens, true)
    }

    /// The forward's first phase; `policy`: whether the block's policy
    /// applies to the saved state at the end (not for a rerun).
    fn forward_phase(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
        policy: bool,
    ) -> Result<Step<BlockForward<B>, BlockOut<B>>> {
        let b = ctx.b;
        let (h, attn_norm) = self.attn_norm.forward(b, x_td)?;
        let (a_full, attn) = self.attn_forward(ctx, &h, seq_len)?;
        let x1 = b.add(x_td, &ctx.scatter(&self.groups.tp, &a_full)?)?;
        let (h2, ffn_norm) = self.ffn_norm.forward(b, &x1)?;
        let head = ForwardHead {
            x1,
            attn_norm,
            attn,
            ffn_norm,
            seq_len,
            tokens,
            docs: ctx.docs.cloned(),
            policy,
        };
        match &self.ffn {
            Ffn::Dense(mlp) => {
                let (m_full, saved) = self.dense_forward(ctx, mlp, &h2)?;
                let y = ctx.scatter(&self.groups.tp, &m_full)?;
                let out = self.forward_finish(ctx, head, y, FfnSaved::Dense(saved), None)?;
                Ok(Step::Done(out))
            }
            Ffn::Moe(moe) => {
                let step = moe.forward_start(ctx, &h2, seq_len, tokens)?;
                self.forward_moe_step(ctx, head, step)
            }
        }
    }

    /// The forward from its MoE layer's pending exchange.
    pub(crate) fn forward_resume(
        &self,
        ctx: &Exec<B>,
        f: BlockForward<B>,
    ) -> Result<Step<BlockForward<B>, BlockOut<B>>> {
        let Ffn::Moe(moe) = &self.ffn else {
            return Err(EngineError::Invalid(
                "block forward: a dense block has no exchange to resume from".into(),
            ));
        };
        let step = moe.forward_resume(ctx, f.moe)?;
        self.forward_moe_step(ctx, f.head, step)
    }

    /// Pauses again at the MoE layer's next exchange, or finishes.
    fn forward_moe_step(
        &self,
        ctx: &Exec<B>,
        head: ForwardHead<B>,
        step: Step<MoeForward<B>, MoeOut<B>>,
    ) -> Result<Step<BlockForward<B>, BlockOut<B>>> {
        Ok(match step {
            Step::Pending(moe) => Step::Pending(BlockForward { head, moe }),
            Step::Done((y, saved, stats)) => Step::Done(self.forward_finish(
                ctx,
                head,
                y,
                FfnSaved::Moe(Box::new(saved)),
                Some(stats),
            )?),
        })
    }

    /// The second residual, and the block's policy on the saved state.
    fn forward_finish(
        &self,
        ctx: &Exec<B>,
        head: ForwardHead<B>,
        y: Tensor<B>,
        ffn: FfnSaved<B>,
        stats: Option<MoeStats<B>>,
    ) -> Result<BlockOut<B>> {
        let b = ctx.b;
        let out = b.add(&head.x1, &y)?;
        let mut saved = BlockSaved {
            attn_norm: head.attn_norm,
            attn: head.attn,
            ffn_norm: head.ffn_norm,
            ffn,
            stash: None,
            seq_len: head.seq_len,
            tokens: head.tokens,
            docs: head.docs,
        };
        if head.policy {
            let stash = Stash::apply(b, &self.policy, &self.ledger, &self.name, |f| {
                saved.visit_saved(f)
            })?;
            saved.stash = Some(stash);
        }
        Ok((out, saved, stats))
    }

    /// Accumulates every parameter's gradient from `dy` (this rank's rows)
    /// and returns `dx`; `loss_scale` weights the MoE layer's own losses.
    pub fn backward(
        &mut self,
        ctx: &Exec<B>,
        dy_td: &Tensor<B>,
        saved: BlockSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let first = self.backward_start(ctx, dy_td, saved, loss_scale)?;
        drive(first, |bw| self.backward_resume(ctx, bw))
    }

    /// [`Block::backward`] up to its MoE layer's first exchange (see
    /// [`MoeLayer::backward_start`]), after undoing the policy; a dense
    /// block, or an MoE layer with nothing to wait for, finishes here.
    pub(crate) fn backward_start(
        &mut self,
        ctx: &Exec<B>,
        dy_td: &Tensor<B>,
        mut saved: BlockSaved<B>,
        loss_scale: f64,
    ) -> Result<Step<BlockBackward<B>, Tensor<B>>> {
        let b = ctx.b;
        // The saved and rematerialised tensors count until this backward
        // finishes.
        let held = self.restore(ctx, &mut saved)?;
        let BlockSaved {
            attn_norm,
            attn,
            ffn_norm,
            ffn,
            ..
        } = saved;
        let tail = BackwardTail {
            dy_td: dy_td.clone(),
            attn_norm,
            attn,
            ffn_norm,
            _held: held,
        };
        match (&mut self.ffn, ffn) {
            (Ffn::Dense(mlp), FfnSaved::Dense(mut s)) => {
                let tp = &self.groups.tp;
                s.input_mut().gather_shard(|h| ctx.gather(tp, h))?;
                let d_full = mlp.backward(b, &ctx.gather(tp, dy_td)?, s)?;
                let dh2 = ctx.scatter(&self.groups.tp, &d_full)?;
                Ok(Step::Done(self.backward_finish(ctx, tail, dh2)?))
            }
            (Ffn::Moe(moe), FfnSaved::Moe(s)) => {
                let step = moe.backward_start(ctx, dy_td, *s, loss_scale)?;
                self.backward_moe_step(ctx, tail, step)
            }
            _ => Err(EngineError::Invalid(
                "parallel block backward: saved state of another feed-forward kind".into(),
            )),
        }
    }

    /// The backward from its MoE layer's pending exchange.
    pub(crate) fn backward_resume(
        &mut self,
        ctx: &Exec<B>,
        bw: BlockBackward<B>,
    ) -> Result<Step<BlockBackward<B>, Tensor<B>>> {
        let Ffn::Moe(moe) = &mut self.ffn else {
            return Err(EngineError::Invalid(
                "block backward: a dense block has no exchange to resume from".into(),
            ));
        };
        let step = moe.backward_resume(ctx, bw.moe)?;
        self.backward_moe_step(ctx, bw.tail, step)
    }

    /// Pauses again at the MoE layer's next exchange, or finishes.
    fn backward_moe_step(
        &mut self,
        ctx: &Exec<B>,
        tail: BackwardTail<B>,
        step: Step<MoeBackward<B>, Tensor<B>>,
    ) -> Result<Step<BlockBackward<B>, Tensor<B>>> {
        Ok(match step {
            Step::Pending(moe) => Step::Pending(BlockBackward { tail, moe }),
            Step::Done(dh2) => Step::Done(self.backward_finish(ctx, tail, dh2)?),
        })
    }

    /// The feed-forward norm's and the attention's backward, from the
    /// gradient `dh2` of the feed-forward's input.
    fn backward_finish(
        &mut self,
        ctx: &Exec<B>,
        tail: BackwardTail<B>,
        dh2: Tensor<B>,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let BackwardTail {
            dy_td,
            attn_norm,
            attn,
            ffn_norm,
            ..
        } = tail;
        let tp = &self.groups.tp;
        let mut dx1 = self.ffn_norm.backward(b, &dh2, ffn_norm)?;
        b.axpy(&mut dx1, 1.0, &dy_td)?;
        let dx1_full = ctx.gather(tp, &dx1)?;
        let dh = match (&mut self.attn, attn) {
            (Attn::Gqa(a), BlockAttnSaved::Cp(mut s)) => {
                s.input_mut().gather_shard(|h| ctx.gather(tp, h))?;
                ctx.scatter(tp, &context::backward(ctx, &self.groups, a, &dx1_full, *s)?)?
            }
            (Attn::Mla(m), BlockAttnSaved::MlaCp(s)) => {
                m.backward_cp(ctx, &self.groups, &dx1_full, *s)?
            }
            (attn, BlockAttnSaved::Local(s)) => attn.backward(ctx, tp, &dx1_full, s)?,
            _ => {
                return Err(EngineError::Invalid(
                    "parallel block backward: context-parallel state of another attention".into(),
                ))
            }
        };
        let mut dx = self.attn_norm.backward(b, &dh, attn_norm)?;
        b.axpy(&mut dx, 1.0, &dx1)?;
        Ok(dx)
    }
}

/// Selective recompute of a pre-norm block: for each half (attention, then feed-forward) that
/// dropped something, reruns its norm from the norm's kept input, and, if
/// the half's layer dropped something, `layer(0 | 1, normed, visit)`,
/// which reruns the attention or the feed-forward and lists its saved
/// tensors. What the reruns list lands in `fresh` at the dropped tensors'
/// positions (`ranges`, as [`layer_ranges`] gives them).
fn rerun_dropped_layers<B: Backend>(
    b: &B,
    stash: &Stash,
    ranges: &[std::ops::Range<usize>; 4],
    norms: [(&RmsNorm<B>, &Tensor<B>, Slot); 2],
    fresh: &mut [Option<Tensor<B>>],
    mut layer: impl FnMut(usize, &Tensor<B>, &mut dyn FnMut(Slot, &mut Tensor<B>)) -> Result<()>,
) -> Result<()> {
    for (half, (norm, input, slot)) in norms.into_iter().enumerate() {
        let (norm_dropped, layer_dropped) = (
            stash.dropped_in(ranges[2 * half].clone()),
            stash.dropped_in(ranges[2 * half + 1].clone()),
        );
        if !(norm_dropped || layer_dropped) {
            continue;
        }
        let (h_td, mut state) = norm.forward(b, input)?;
        if norm_dropped {
            state.visit_saved(slot, &mut take(fresh, ranges[2 * half].start));
        }
        if layer_dropped {
            layer(half, &h_td, &mut take(fresh, ranges[2 * half + 1].start))?;
        }
    }
    Ok(())
}

/// Consecutive ranges of a block's saved-tensor list from the counts of
/// its four layers (attention norm, attention, feed-forward norm,
/// feed-forward).
fn layer_ranges(counts: [usize; 4]) -> [std::ops::Range<usize>; 4] {
    let mut start = 0;
    counts.map(|len| {
        let r = start..start + len;
        start += len;
        r
    })
}

/// A visitor that stores the tensors it is shown into `fresh`, from
/// position `start` on.
fn take<B: Backend>(
    fresh: &mut [Option<Tensor<B>>],
    start: usize,
) -> impl FnMut(Slot, &mut Tensor<B>) + '_ {
    let mut i = start;
    move |_, t| {
        if let Some(f) = fresh.get_mut(i) {
            *f = Some(t.clone());
        }
        i += 1;
    }
}

impl<B: Backend> Module<B> for Block<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.attn_norm.visit_params(f);
        self.attn.visit_params(f);
        self.ffn_norm.visit_params(f);
        match &self.ffn {
            Ffn::Dense(m) => m.visit_params(f),
            Ffn::Moe(m) => m.visit_params(f),
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.attn_norm.visit_params_mut(f);
        self.attn.visit_params_mut(f);
        self.ffn_norm.visit_params_mut(f);
        match &mut self.ffn {
            Ffn::Dense(m) => m.visit_params_mut(f),
            Ffn::Moe(m) => m.visit_params_mut(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::{DType, Tensor};

    use super::{Attn, Block};
    use crate::engine::parallel::{Exec, LayerGroups};
    use crate::engine::testutil::{
        check_param_grads, dot, f64_tensor, small_moe, small_spec, uniform, values,
    };
    use crate::spec::{FfnSpec, MlaSpec, ModelSpec};

    /// The first group's block on one rank, in f64.
    fn one_rank_block(spec: &ModelSpec) -> Block<Cpu> {
        let init = crate::engine::Init::full(5);
        let groups = LayerGroups::single();
        Block::new(
            &Cpu,
            "blocks.0",
            spec,
            &spec.groups[0],
            init,
            DType::F64,
            groups,
        )
        .unwrap()
    }

    /// `Σ r ⊙ block(x)` plus the MoE losses, whose gradients backward adds.
    fn check_block(ffn: FfnSpec, what: &str) {
        check_block_spec(small_spec(&[ffn], false), what);
    }

    /// As [`check_block`], for the first group of any spec.
    fn check_block_spec(spec: ModelSpec, what: &str) {
        let b = Cpu;
        let exec = Exec::solo(&b);
        let mut block = one_rank_block(&spec);
        let (seq, d) = (3, spec.hidden);
        let t = 2 * seq;
        let x = uniform(1, t * d, 1.0);
        let r = uniform(2, t * d, 1.0);
        let loss = |blk: &Block<Cpu>, x_td: &Tensor<Cpu>| {
            let (y, _, stats) = blk.forward(&exec, x_td, seq, t).unwrap();
            let aux = stats.map_or(0.0, |s| values(&s.aux_loss)[0] + values(&s.z_loss)[0]);
            dot(&y, &r) + aux
        };
        let x_td = f64_tensor(x.clone(), &[t, d]);
        let (_, saved, _) = block.forward(&exec, &x_td, seq, t).unwrap();
        let dx = block
            .backward(&exec, &f64_tensor(r.clone(), &[t, d]), saved, 1.0)
            .unwrap();
        assert_grad(&format!("{what} dx"), &x, &values(&dx), 1e-6, |xs| {
            loss(&block, &f64_tensor(xs.to_vec(), &[t, d]))
        });
        check_param_grads(what, &mut block, 12, 1e-6, |blk| loss(blk, &x_td));
    }

    #[test]
    fn dense_block_grad() {
        check_block(FfnSpec::Dense { ffn: 6 }, "dense block");
    }

    #[test]
    fn moe_block_grad() {
        check_block(small_moe(), "moe block");
    }

    #[test]
    fn mla_block_grad() {
        let mut spec = small_spec(&[small_moe()], false);
        spec.groups[0].attention.mla = Some(MlaSpec {
            q_lora_rank: 6,
            kv_lora_rank: 5,
            qk_nope_head_dim: 2,
            qk_rope_head_dim: 4,
            v_head_dim: 3,
        });
        let block = one_rank_block(&spec);
        assert!(matches!(block.attn, Attn::Mla(_)), "the spec asks for MLA");
        check_block_spec(spec, "mla block");
    }
}
