//! Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1), as in
//! Megatron-Core's `MLASelfAttention` (`multi_latent_attention.py`): queries
//! and keys/values pass through low-rank latents, and each head's query/key
//! is a position-free part plus a rotary part; on the key side the rotary part
//! is a single head shared by all heads.
//!
//! ```text
//! q           = rms_norm(x·Wq_a)·Wq_b        (x·Wq when q_lora_rank = 0)
//! q_h         = [q_nope_h | rope(q_rope_h)]
//! [c | k_r]   = x·Wkv_a                      c the kv latent, k_r the shared rotary key
//! [k_nope_h | v_h] = rms_norm(c)·Wkv_b
//! k_h         = [k_nope_h | rope(k_r)]
//! o_h         = causal_softmax(q_h·k_hᵀ / sqrt(P + R))·v_h
//! y           = [o_1 … o_H]·Wo
//! ```
//!
//! Shapes: B batch, S sequence, T = B·S tokens, H heads, N = T·H token-heads,
//! D hidden, C query latent (`q_lora_rank`), L kv latent (`kv_lora_rank`),
//! P position-free query/key dims, R rotary dims, Q = P + R query/key head
//! dim, V value head dim, K = P + V per-head width of `Wkv_b`, A = L + R width
//! of `Wkv_a`, Hd = max(Q, V) the head dim given to the attention kernel.
//!
//! # Head layout
//! The backend's `attention` takes q, k and v with one head dim, and the
//! backend has no column slice or concat. Every split, concatenation, padding
//! and broadcast along the last dim is therefore a fixed linear map between
//! column layouts (a `ColMap`, a 0/1 matrix built once at construction and
//! applied with `matmul`), whose backward is the transposed product. The maps
//! act on per-head rows (`[N, ·]`) or on the narrow latent (`[T, A]`), so their
//! cost is a few `Hd²` per token-head, small next to the projections and the
//! attention itself; products with 0/1 entries are exact, so nothing is
//! rounded. A backend `slice_cols`/`concat_cols` would replace them one for one.
//!
//! v is padded with zeros to Hd and the output sliced back, rather than running
//! two kernels: the zero dims cost `Hd − V` extra multiply-adds per score and
//! give exactly zero outputs. When V > Q (unusual), q and k are padded instead,
//! and q is scaled by `sqrt(Hd / Q)` (folded into its maps) so the kernel's
//! `1/sqrt(Hd)` becomes the paper's `1/sqrt(Q)`.

use foldmoe_kernels::{Backend, DType, Group, HostData, Rope, Tensor};

use super::activations::Slot;
use super::attention::rope_of;
use super::documents::DocTensors;
use super::linear::{LinearInput, LinearSaved};
use super::norm::{NormSaved, RmsNorm};
use super::parallel::context::CpExchange;
use super::parallel::{Exec, LayerGroups};
use super::param::{Init, Module, Param};
use super::{EngineError, Result};
use crate::memory::Part;
use crate::spec::{MlaSpec, ModelSpec, OffloadPart, RecomputePart};

/// The query projection: through a normed low-rank latent, or full rank.
pub enum QueryProj<B: Backend> {
    /// `q = rms_norm(x·wq_a)·wq_b` (`q_lora_rank > 0`).
    LowRank {
        /// Down projection `[D, C]`.
        wq_a: Param<B>,
        /// Norm of the query latent.
        q_norm: RmsNorm<B>,
        /// Up projection `[C, H·Q]`, each head `[nope | rope]`.
        wq_b: Param<B>,
    },
    /// `q = x·wq` (`q_lora_rank = 0`).
    Full {
        /// Projection `[D, H·Q]`, each head `[nope | rope]`.
        wq: Param<B>,
    },
}

/// What the keys' and values' backward needs: the latent norm's state and
/// its output (`wkv_b`'s input, under fp8 its column tiles).
struct KvSaved<B: Backend> {
    norm: NormSaved<B>,
    ckv: LinearSaved<B>,
}

impl<B: Backend> KvSaved<B> {
    /// Lists the norm's input and rstd, then the normed latent, under `slot`.
    fn visit_saved(&mut self, slot: Slot, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        self.norm.visit_saved(slot, f);
        self.ckv.visit(slot, f);
    }
}

/// What the query projection's backward needs besides the layer input.
enum QuerySaved<B: Backend> {
    LowRank {
        norm: NormSaved<B>,
        /// The normed latent, `wq_b`'s input (under fp8 its column tiles).
        cq: LinearSaved<B>,
    },
    Full,
}

impl<B: Backend> QueryProj<B> {
    /// `x: [T/tp, D]`, this rank's tokens (its sequence shard under tp), to
    /// `q: [T, H·Q]` over the tp-gathered sequence (this rank's heads): the
    /// down projection and the latent's norm run on the shard and the normed
    /// latent is gathered; a full-rank projection reads the gathered input
    /// instead. Under fp8 the down projection shares `x`'s quantisation with
    /// the key/value one.
    fn forward(
        &self,
        b: &B,
        x: &LinearInput<B>,
        tp: &SeqShards<'_, B>,
        fp8: bool,
    ) -> Result<(Tensor<B>, QuerySaved<B>)> {
        match self {
            QueryProj::LowRank { wq_a, q_norm, wq_b } => {
                let (cq_tc, norm) = q_norm.forward(b, &x.project(b, &wq_a.value)?)?;
                let (q_thq, cq) = tp.project_gathered(b, &cq_tc, &wq_b.value, fp8)?;
                Ok((q_thq, QuerySaved::LowRank { norm, cq }))
            }
            QueryProj::Full { wq } if tp.sharded() => {
                let x_full = LinearInput::new(&tp.gather(x.rows_for("mla query")?)?, fp8);
                Ok((x_full.project(b, &wq.value)?, QuerySaved::Full))
            }
            QueryProj::Full { wq } => Ok((x.project(b, &wq.value)?, QuerySaved::Full)),
        }
    }

    /// Accumulates the query weights' gradients and returns this path's `dx`
    /// for this rank's tokens: `dq` covers the gathered sequence, and the
    /// gradient of what was gathered is reduce-scattered back over tp.
    fn backward(
        &mut self,
        b: &B,
        x: &LinearInput<B>,
        tp: &SeqShards<'_, B>,
        dq_thq: &Tensor<B>,
        saved: QuerySaved<B>,
        fp8: bool,
    ) -> Result<Tensor<B>> {
        match (self, saved) {
            (QueryProj::LowRank { wq_a, q_norm, wq_b }, QuerySaved::LowRank { norm, cq }) => {
                let dcq_tc = tp.input_of(cq, fp8)?.backward(b, wq_b, dq_thq)?;
                let dcq_tc = q_norm.backward(b, &tp.scatter(&dcq_tc)?, norm)?;
                x.backward(b, wq_a, &dcq_tc)
            }
            (QueryProj::Full { wq }, QuerySaved::Full) if tp.sharded() => {
                let x_full = LinearInput::new(&tp.gather(x.rows_for("mla query backward")?)?, fp8);
                tp.scatter(&x_full.backward(b, wq, dq_thq)?)
            }
            (QueryProj::Full { wq }, QuerySaved::Full) => x.backward(b, wq, dq_thq),
            _ => Err(EngineError::Invalid(
                "mla backward: saved query state comes from a projection of another kind".into(),
            )),
        }
    }
}

/// The tensor-parallel group MLA's input is sharded over by sequence, as
/// Megatron-Core's sequence-parallel MLA runs it: the down projections read
/// this rank's shard and their latents (`C + L + R` a token, a fraction of
/// the hidden size) are all-gathered, their gradients reduce-scattered.
/// Without tp both are identities.
struct SeqShards<'a, B: Backend> {
    ctx: &'a Exec<'a, B>,
    tp: &'a Group,
}

impl<B: Backend> SeqShards<'_, B> {
    fn sharded(&self) -> bool {
        self.tp.size() > 1
    }

    fn gather(&self, x: &Tensor<B>) -> Result<Tensor<B>> {
        self.ctx.gather(self.tp, x)
    }

    fn scatter(&self, x: &Tensor<B>) -> Result<Tensor<B>> {
        self.ctx.scatter(self.tp, x)
    }

    /// `l: [T/tp, K]` of this rank's tokens gathered over tp, times `w: [K,
    /// N]`, and what the projection's backward keeps of its input: this
    /// rank's shard under tp (gathered again, as Megatron-Core's
    /// sequence-parallel column-parallel linears do), else the input's own
    /// saved form (under fp8 its column tiles).
    fn project_gathered(
        &self,
        b: &B,
        l_tk: &Tensor<B>,
        w_kn: &Tensor<B>,
        fp8: bool,
    ) -> Result<(Tensor<B>, LinearSaved<B>)> {
        let input = LinearInput::layer_input(&self.gather(l_tk)?, fp8, self.sharded());
        let y = input.project(b, w_kn)?;
        let kept = if self.sharded() {
            LinearSaved::Shard(l_tk.clone())
        } else {
            input.into_saved(b)?
        };
        Ok((y, kept))
    }

    /// The projection's input for its backward from what
    /// [`Self::project_gathered`] kept.
    fn input_of(&self, mut kept: LinearSaved<B>, fp8: bool) -> Result<LinearInput<B>> {
        kept.gather_shard(|l| self.gather(l))?;
        LinearInput::from_saved(kept, fp8)
    }
}

impl<B: Backend> Module<B> for QueryProj<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        match self {
            QueryProj::LowRank { wq_a, q_norm, wq_b } => {
                f(wq_a);
                q_norm.visit_params(f);
                f(wq_b);
            }
            QueryProj::Full { wq } => f(wq),
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        match self {
            QueryProj::LowRank { wq_a, q_norm, wq_b } => {
                f(wq_a);
                q_norm.visit_params_mut(f);
                f(wq_b);
            }
            QueryProj::Full { wq } => f(wq),
        }
    }
}

/// A fixed linear map between two column layouts, `x: [rows, in] ↦ x·m`,
/// `m: [in, out]` holding `value` at the listed `(in, out)` pairs and zero
/// elsewhere. Not a parameter: it never changes and is not visited.
struct ColMap<B: Backend> {
    m: Tensor<B>,
}

impl<B: Backend> ColMap<B> {
    fn new(
        b: &B,
        cols_in: usize,
        cols_out: usize,
        pairs: impl IntoIterator<Item = (usize, usize)>,
        value: f64,
        dtype: DType,
    ) -> Result<Self> {
        let mut m = vec![0.0; cols_in * cols_out];
        for (i, j) in pairs {
            m[i * cols_out + j] = value;
        }
        // Built like `init_normal`: f64 or f32 on the host, cast for bf16.
        let data = match dtype {
            DType::F64 => HostData::F64(m),
            _ => HostData::F32(m.iter().map(|&v| v as f32).collect()),
        };
        let mut m = b.upload(data, &[cols_in, cols_out])?;
        if dtype != DType::F32 && dtype != DType::F64 {
            m = b.cast(&m, dtype)?;
        }
        Ok(ColMap { m })
    }

    /// `x: [rows, in] -> [rows, out]`.
    fn apply(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
        Ok(b.matmul(x, &self.m, false, false)?)
    }

    /// The backward of [`ColMap::apply`]: `d: [rows, out] -> [rows, in]`.
    fn adjoint(&self, b: &B, d: &Tensor<B>) -> Result<Tensor<B>> {
        Ok(b.matmul(d, &self.m, false, true)?)
    }
}

/// The column maps between MLA's projection layouts and the kernel's heads.
struct HeadMaps<B: Backend> {
    /// `[Q -> Hd]`: a query head's position-free dims, in place (times the q scale).
    q_nope: ColMap<B>,
    /// `[Q -> R]`: a query head's rotary dims.
    q_rope_in: ColMap<B>,
    /// `[R -> Hd]`: rotated query dims back after the position-free ones (times the q scale).
    q_rope_out: ColMap<B>,
    /// `[A -> L]`: the kv latent out of `x·Wkv_a`.
    kv_latent: ColMap<B>,
    /// `[A -> R]`: the shared rotary key out of `x·Wkv_a`.
    k_rope_in: ColMap<B>,
    /// `[R -> H·Hd]`: the rotated shared key copied after every head's position-free dims.
    k_rope_out: ColMap<B>,
    /// `[K -> Hd]`: a key head's position-free dims out of `Wkv_b`'s head.
    k_nope: ColMap<B>,
    /// `[K -> Hd]`: a value head out of `Wkv_b`'s head, zero-padded to Hd.
    v_pad: ColMap<B>,
    /// `[Hd -> V]`: the value dims of an output head.
    o_slice: ColMap<B>,
}

impl<B: Backend> HeadMaps<B> {
    /// The maps of `h` heads of `mla`'s dims, queries scaled by `q_scale`.
    fn new(b: &B, h: usize, mla: &MlaSpec, q_scale: f64, dtype: DType) -> Result<Self> {
        let (l, p, r, v) = (
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        );
        let (q, hd) = (p + r, (p + r).max(v));
        let map = |cols_in, cols_out, pairs: Vec<(usize, usize)>, value| {
            ColMap::new(b, cols_in, cols_out, pairs, value, dtype)
        };
        Ok(HeadMaps {
            q_nope: map(q, hd, (0..p).map(|i| (i, i)).collect(), q_scale)?,
            q_rope_in: map(q, r, (0..r).map(|i| (p + i, i)).collect(), 1.0)?,
            q_rope_out: map(r, hd, (0..r).map(|i| (i, p + i)).collect(), q_scale)?,
            kv_latent: map(l + r, l, (0..l).map(|i| (i, i)).collect(), 1.0)?,
            k_rope_in: map(l + r, r, (0..r).map(|i| (l + i, i)).collect(), 1.0)?,
            k_rope_out: map(
                r,
                h * hd,
                (0..h)
                    .flat_map(|head| (0..r).map(move |i| (i, head * hd + p + i)))
                    .collect(),
                1.0,
            )?,
            k_nope: map(p + v, hd, (0..p).map(|i| (i, i)).collect(), 1.0)?,
            v_pad: map(p + v, hd, (0..v).map(|i| (p + i, i)).collect(), 1.0)?,
            o_slice: map(hd, v, (0..v).map(|i| (i, i)).collect(), 1.0)?,
        })
    }
}

/// Multi-head latent attention with its projections and norms.
pub struct Mla<B: Backend> {
    /// Query projection (low-rank with its norm, or full rank).
    pub query: QueryProj<B>,
    /// Key/value down projection `[D, L + R]`: the kv latent, then the shared rotary key.
    pub wkv_a: Param<B>,
    /// Norm of the kv latent.
    pub kv_norm: RmsNorm<B>,
    /// Key/value up projection `[L, H·(P + V)]`, each head `[k_nope | v]`.
    pub wkv_b: Param<B>,
    /// Output projection `[H·V, D]`.
    pub wo: Param<B>,
    /// Whether the projections run as blockwise fp8 GEMMs (set by the block
    /// from its `attention(precision = fp8_blockwise)`).
    pub fp8: bool,
    maps: HeadMaps<B>,
    heads: usize,
    dims: MlaSpec,
    rope: Rope,
    /// The queries' scale in the kernel's dims (`q_nope`, `q_rope_out`).
    q_scale: f64,
}

/// What MLA's context-parallel backward needs ([`Mla::forward_cp`]): the
/// input, the query state, this cp rank's query rows, and this rank's
/// key/value latent norm's state, normed latent and rotary key (the backward
/// pads the queries and gathers the latents again, so the whole sequence's
/// keys and values are never kept), each held chunk's log-sum-exp and the
/// output without its padding.
pub struct MlaCpSaved<B: Backend> {
    x: LinearSaved<B>,
    query: QuerySaved<B>,
    /// `[T, H·Q]`, this cp rank's rows.
    q_thq: Tensor<B>,
    /// The key/value latent norm's state, this rank's tokens.
    kv_norm: NormSaved<B>,
    /// `[T/tp, L]`: the normed latent of this rank's tokens.
    ckv_tl: Tensor<B>,
    /// `[T/tp, R]`: the rotary key of this rank's tokens, unrotated.
    kr_tr: Tensor<B>,
    lse: Vec<Tensor<B>>,
    /// `[T, H·V]`.
    o_thv: Tensor<B>,
    exchange: CpExchange<B>,
}

impl<B: Backend> MlaCpSaved<B> {
    /// Lists the saved tensors with the slots of [`MlaSaved`]'s: the input,
    /// the query latents (kept), the query rows (`qkv`, dropped by
    /// `mla_up_proj`), the key/value latents (kept), the log-sum-exps
    /// (`core_attn`), the output (`attn_proj`) and the int32 row maps.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let latent = Slot::kept(Part::Attention);
        self.x.visit(Slot::NORM_OUT, f);
        if let QuerySaved::LowRank { norm, cq } = &mut self.query {
            norm.visit_saved(latent, f);
            cq.visit(latent, f);
        }
        f(
            latent
                .recompute(RecomputePart::MlaUpProj)
                .offload(OffloadPart::Qkv),
            &mut self.q_thq,
        );
        self.kv_norm.visit_saved(latent, f);
        f(latent, &mut self.ckv_tl);
        f(latent, &mut self.kr_tr);
        for lse in &mut self.lse {
            f(
                latent
                    .recompute(RecomputePart::CoreAttn)
                    .offload(OffloadPart::CoreAttn),
                lse,
            );
        }
        f(latent.offload(OffloadPart::AttnProj), &mut self.o_thv);
        self.exchange.visit_saved(latent, f);
    }
}

/// What MLA's backward needs: the input and the latents after their norms
/// (the projections' inputs: under fp8 their column tiles), the kernel's q,
/// k, v, its output and log-sum-exp.
pub struct MlaSaved<B: Backend> {
    x: LinearSaved<B>,
    query: QuerySaved<B>,
    kv: KvSaved<B>,
    q_bshd: Tensor<B>,
    k_bshd: Tensor<B>,
    v_bshd: Tensor<B>,
    /// The kernel's output without its padding `[T, H·V]` (the output
    /// projection's input; padded again for the kernel's backward).
    o_thv: Tensor<B>,
    lse_bhs: Tensor<B>,
    /// The micro-batch's positions and documents, if any (not counted).
    docs: Option<DocTensors<B>>,
}

impl<B: Backend> MlaSaved<B> {
    /// Lists the saved tensors with their slots: the input (the norm's
    /// output); the latents before and after their norms (kept: the
    /// up-projections' inputs); the kernel's q, k, v (`qkv`, dropped by
    /// `mla_up_proj`); the output (`attn_proj`) and log-sum-exp (`core_attn`).
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let latent = Slot::kept(Part::Attention);
        let qkv = Slot::kept(Part::Attention)
            .recompute(RecomputePart::MlaUpProj)
            .offload(OffloadPart::Qkv);
        self.x.visit(Slot::NORM_OUT, f);
        if let QuerySaved::LowRank { norm, cq } = &mut self.query {
            norm.visit_saved(latent, f);
            cq.visit(latent, f);
        }
        self.kv.visit_saved(latent, f);
        f(qkv, &mut self.q_bshd);
        f(qkv, &mut self.k_bshd);
        f(qkv, &mut self.v_bshd);
        f(latent.offload(OffloadPart::AttnProj), &mut self.o_thv);
        f(
            latent
                .recompute(RecomputePart::CoreAttn)
                .offload(OffloadPart::CoreAttn),
            &mut self.lse_bhs,
        );
    }
}

impl<B: Backend> Mla<B> {
    /// Projections named `{prefix}.wq_a`, `{prefix}.q_norm.weight`,
    /// `{prefix}.wq_b` (or `{prefix}.wq` when `q_lora_rank = 0`),
    /// `{prefix}.wkv_a`, `{prefix}.kv_norm.weight`, `{prefix}.wkv_b`,
    /// `{prefix}.wo`; matrices normal(0, `model.init_std`), norm scales 1.
    pub fn new(
        b: &B,
        prefix: &str,
        model: &ModelSpec,
        heads: usize,
        mla: &MlaSpec,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let (d, std, eps) = (model.hidden, model.init_std, model.norm_eps);
        let (h, c, l) = (heads, mla.q_lora_rank, mla.kv_lora_rank);
        let (p, r, v) = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim);
        let (q, hd) = (p + r, (p + r).max(v));
        let mk = |name: &str, shape: &[usize]| {
            init.normal(b, format!("{prefix}.{name}"), shape, std, dtype)
        };
        let query = if c > 0 {
            QueryProj::LowRank {
                wq_a: mk("wq_a", &[d, c])?,
                q_norm: RmsNorm::new(b, &format!("{prefix}.q_norm"), c, eps, dtype)?,
                wq_b: mk("wq_b", &[c, h * q])?,
            }
        } else {
            QueryProj::Full {
                wq: mk("wq", &[d, h * q])?,
            }
        };
        // The kernel scales scores by 1/√Hd; MLA's are 1/√(P + R), times
        // YaRN's m(factor, mscale_all_dim)² (DeepSeek-V3's softmax scale).
        let yarn_softmax = model
            .rope_scaling
            .as_ref()
            .map_or(1.0, |s| s.softmax_scale_factor());
        let q_scale = (hd as f64 / q as f64).sqrt() * yarn_softmax;
        let maps = HeadMaps::new(b, h, mla, q_scale, dtype)?;
        Ok(Mla {
            query,
            wkv_a: mk("wkv_a", &[d, l + r])?,
            kv_norm: RmsNorm::new(b, &format!("{prefix}.kv_norm"), l, eps, dtype)?,
            wkv_b: mk("wkv_b", &[l, h * (p + v)])?,
            wo: mk("wo", &[h * v, d])?,
            fp8: false,
            maps,
            heads,
            dims: mla.clone(),
            rope: rope_of(model, r),
            q_scale,
        })
    }

    /// Makes the layer one rank's of `parts` tensor-parallel ranks: its up
    /// projections are already that rank's columns of heads and its output
    /// projection its rows (drawn by the shard plan); the down projections
    /// and latent norms stay whole (replicated, their gradients summed over
    /// tp: they run on the rank's sequence shard), so only the heads it
    /// computes with change.
    pub fn take_heads(&mut self, b: &B, parts: usize) -> Result<()> {
        if parts == 1 {
            return Ok(());
        }
        if !self.heads.is_multiple_of(parts) {
            return Err(EngineError::Invalid(format!(
                "mla {}: {} heads do not split over tp = {parts}",
                self.wo.name, self.heads
            )));
        }
        let m = &self.dims;
        let rows = self.heads / parts * m.v_head_dim;
        if self.wo.value.shape()[0] != rows {
            return Err(EngineError::Invalid(format!(
                "mla {}: holds {} output rows, a tp = {parts} shard has {rows}; build the \
                 layer under the rank's shard plan",
                self.wo.name,
                self.wo.value.shape()[0]
            )));
        }
        self.heads /= parts;
        self.maps = HeadMaps::new(b, self.heads, m, self.q_scale, self.wo.value.dtype())?;
        Ok(())
    }

    /// The head dim given to the attention kernel: `max(P + R, V)`.
    fn kernel_head_dim(&self) -> usize {
        let m = &self.dims;
        (m.qk_nope_head_dim + m.qk_rope_head_dim).max(m.v_head_dim)
    }

    /// RoPE (or its inverse) over the last dim of `x: [B·S·heads, R]`, rows in
    /// (batch, position, head) order.
    fn rotate(
        &self,
        b: &B,
        x: Tensor<B>,
        (batch, seq_len, heads): (usize, usize, usize),
        inverse: bool,
        docs: Option<&DocTensors<B>>,
    ) -> Result<Tensor<B>> {
        let r = self.dims.qk_rope_head_dim;
        let x_bshr = x.reshape(&[batch, seq_len, heads, r])?;
        let positions = docs.and_then(|d| d.positions.as_ref());
        Ok(b.rope(&x_bshr, self.rope, inverse, positions)?
            .reshape(&[batch * seq_len * heads, r])?)
    }

    /// The layer's input `x` as its projections read it: kept by the layer
    /// (under fp8 as column tiles, made with the first projection's row
    /// tiles), except for a full-rank query under tp, whose backward gathers
    /// the rows again.
    fn layer_input(&self, x_td: &Tensor<B>, tp: &SeqShards<'_, B>) -> LinearInput<B> {
        let full_query = matches!(self.query, QueryProj::Full { .. });
        LinearInput::layer_input(x_td, self.fp8, full_query && tp.sharded())
    }

    /// `x: [T/tp, D]`, this rank's sequence shard under `tp` (all T tokens
    /// without tp), to the output projection's `[T, D]` over the gathered
    /// sequence (under tp this rank's heads' partial sum, which the block
    /// reduce-scatters); the T tokens are `T / seq_len` sequences of
    /// `seq_len`, and `ctx.docs` restarts positions and masks attention at
    /// documents.
    pub(crate) fn forward(
        &self,
        ctx: &Exec<B>,
        tp: &Group,
        x_td: &Tensor<B>,
        seq_len: usize,
    ) -> Result<(Tensor<B>, MlaSaved<B>)> {
        let (b, docs) = (ctx.b, ctx.docs);
        let tp = SeqShards { ctx, tp };
        let tokens = x_td.dims2("mla")?.0 * tp.tp.size();
        if seq_len == 0 || !tokens.is_multiple_of(seq_len) {
            return Err(EngineError::Invalid(format!(
                "mla: {tokens} tokens do not split into sequences of length {seq_len}"
            )));
        }
        let (batch, h, hd) = (tokens / seq_len, self.heads, self.kernel_head_dim());
        let input = self.layer_input(x_td, &tp);
        let (q_thq, query) = self.query.forward(b, &input, &tp, self.fp8)?;
        let q_nd = self.kernel_queries(b, &q_thq, (batch, seq_len), docs)?;
        let (ckv_tl, kr_tr, norm) = self.kv_latents(b, &input.project(b, &self.wkv_a.value)?)?;
        let (kv_thk, ckv) = tp.project_gathered(b, &ckv_tl, &self.wkv_b.value, self.fp8)?;
        let kr_tr = tp.gather(&kr_tr)?;
        let (k_nd, v_nd) = self.kernel_keys_values(b, &kv_thk, &kr_tr, (batch, seq_len), docs)?;
        let kv = KvSaved { norm, ckv };

        let bshd = [batch, seq_len, h, hd];
        let (q_bshd, k_bshd, v_bshd) = (
            q_nd.reshape(&bshd)?,
            k_nd.reshape(&bshd)?,
            v_nd.reshape(&bshd)?,
        );
        let mask = docs.and_then(|d| d.docs.as_ref());
        let (o_bshd, lse_bhs) = b.attention(&q_bshd, &k_bshd, &v_bshd, mask)?;
        let o_thv = self.unpadded_values(b, o_bshd, tokens)?;
        let y_td = LinearInput::new(&o_thv, self.fp8).project(b, &self.wo.value)?;
        let saved = MlaSaved {
            x: input.into_saved(b)?,
            query,
            kv,
            q_bshd,
            k_bshd,
            v_bshd,
            o_thv,
            lse_bhs,
            docs: docs.cloned(),
        };
        Ok((y_td, saved))
    }

    /// Accumulates every projection's and norm's gradient and returns `dx:
    /// [T/tp, D]` of this rank's tokens (complete: the latents' gradients are
    /// reduce-scattered over tp before the down projections), from `dy` of
    /// the gathered sequence.
    pub(crate) fn backward(
        &mut self,
        ctx: &Exec<B>,
        tp: &Group,
        dy_td: &Tensor<B>,
        saved: MlaSaved<B>,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let tp = SeqShards { ctx, tp };
        let MlaSaved {
            x,
            query,
            kv,
            q_bshd,
            k_bshd,
            v_bshd,
            o_thv,
            lse_bhs,
            docs,
        } = saved;
        let docs = docs.as_ref();
        let (batch, seq_len, h, hd) = q_bshd.dims4("mla backward")?;
        let n = batch * seq_len * h;
        let v = self.dims.v_head_dim;

        // Output projection; the kernel's padded o is rebuilt from the kept
        // one (its padding is zero).
        let do_thv = LinearInput::new(&o_thv, self.fp8).backward(b, &mut self.wo, dy_td)?;
        let bshd = [batch, seq_len, h, hd];
        let do_bshd = self.padded_values(b, &do_thv)?.reshape(&bshd)?;
        let o_bshd = self.padded_values(b, &o_thv)?.reshape(&bshd)?;
        let mask = docs.and_then(|d| d.docs.as_ref());
        // v and dO are zero past the value width `v`: MLA's backward may
        // read only those columns.
        let (dq_bshd, dk_bshd, dv_bshd) = b.attention_backward_padded_values(
            &do_bshd, &q_bshd, &k_bshd, &v_bshd, &o_bshd, &lse_bhs, mask, v,
        )?;

        let (dkv_thk, dkr_tr) = self.kernel_keys_values_backward(
            b,
            (&dk_bshd.reshape(&[n, hd])?, &dv_bshd.reshape(&[n, hd])?),
            (batch, seq_len),
            docs,
        )?;
        let dckv_tl = tp
            .input_of(kv.ckv, self.fp8)?
            .backward(b, &mut self.wkv_b, &dkv_thk)?;
        let dkva_ta =
            self.kv_latents_backward(b, &tp.scatter(&dckv_tl)?, &tp.scatter(&dkr_tr)?, kv.norm)?;
        let dq_thq =
            self.kernel_queries_backward(b, &dq_bshd.reshape(&[n, hd])?, (batch, seq_len), docs)?;
        self.down_backward(b, &tp, x, &dkva_ta, &dq_thq, query)
    }

    /// The down projections' backward from this rank's tokens' gradient of
    /// the key/value down projection `dkva: [T/tp, L + R]` and the gathered
    /// sequence's of the queries `dq: [T, H·Q]`: accumulates the query
    /// path's and `wkv_a`'s gradients and returns `dx` of this rank's
    /// tokens `x`.
    fn down_backward(
        &mut self,
        b: &B,
        tp: &SeqShards<'_, B>,
        x: LinearSaved<B>,
        dkva_ta: &Tensor<B>,
        dq_thq: &Tensor<B>,
        query: QuerySaved<B>,
    ) -> Result<Tensor<B>> {
        let input = LinearInput::from_saved(x, self.fp8)?;
        let mut dx_td = input.backward(b, &mut self.wkv_a, dkva_ta)?;
        let dxq_td = self
            .query
            .backward(b, &input, tp, dq_thq, query, self.fp8)?;
        b.axpy(&mut dx_td, 1.0, &dxq_td)?;
        Ok(dx_td)
    }

    /// The kernel's output `o: [T, H, Hd]` (any shape of `T·H·Hd`) without
    /// its value padding, which is exactly zero: `[T, H·V]`, what the output
    /// projection reads and the backward keeps.
    fn unpadded_values(&self, b: &B, o: Tensor<B>, tokens: usize) -> Result<Tensor<B>> {
        let (h, hd, v) = (self.heads, self.kernel_head_dim(), self.dims.v_head_dim);
        Ok(self
            .maps
            .o_slice
            .apply(b, &o.reshape(&[tokens * h, hd])?)?
            .reshape(&[tokens, h * v])?)
    }

    /// `x: [T, H·V]` (an output or its gradient) at the kernel's head width
    /// again: `[T·H, Hd]`, zero past V.
    fn padded_values(&self, b: &B, x_thv: &Tensor<B>) -> Result<Tensor<B>> {
        let (t, _) = x_thv.dims2("mla values")?;
        let (h, v) = (self.heads, self.dims.v_head_dim);
        self.maps
            .o_slice
            .adjoint(b, &x_thv.clone().reshape(&[t * h, v])?)
    }

    /// The kernel's queries `[B·S·H, Hd]` from the query projection's
    /// `q: [B·S, H·Q]` (rows in (sequence, position) order): each head's
    /// rotary tail rotated at `docs`' positions, the head rebuilt at width
    /// Hd (times the query scale). Zero rows give zero queries.
    fn kernel_queries(
        &self,
        b: &B,
        q_thq: &Tensor<B>,
        (batch, seq_len): (usize, usize),
        docs: Option<&DocTensors<B>>,
    ) -> Result<Tensor<B>> {
        let (m, h) = (&self.maps, self.heads);
        let q = self.dims.qk_nope_head_dim + self.dims.qk_rope_head_dim;
        let q_nq = q_thq.clone().reshape(&[batch * seq_len * h, q])?;
        let qr_nr = self.rotate(
            b,
            m.q_rope_in.apply(b, &q_nq)?,
            (batch, seq_len, h),
            false,
            docs,
        )?;
        Ok(b.add(&m.q_nope.apply(b, &q_nq)?, &m.q_rope_out.apply(b, &qr_nr)?)?)
    }

    /// The backward of [`Self::kernel_queries`]: `dq: [B·S·H, Hd]` to the
    /// projection's `[B·S, H·Q]` (the rotary tail rotates back).
    fn kernel_queries_backward(
        &self,
        b: &B,
        dq_nd: &Tensor<B>,
        (batch, seq_len): (usize, usize),
        docs: Option<&DocTensors<B>>,
    ) -> Result<Tensor<B>> {
        let (m, h) = (&self.maps, self.heads);
        let q = self.dims.qk_nope_head_dim + self.dims.qk_rope_head_dim;
        let dqr_nr = m.q_rope_out.adjoint(b, dq_nd)?;
        let dqr_nr = self.rotate(b, dqr_nr, (batch, seq_len, h), true, docs)?;
        let mut dq_nq = m.q_nope.adjoint(b, dq_nd)?;
        b.axpy(&mut dq_nq, 1.0, &m.q_rope_in.adjoint(b, &dqr_nr)?)?;
        Ok(dq_nq.reshape(&[batch * seq_len, h * q])?)
    }

    /// This rank's tokens' key/value latent after its norm (`[T, L]`, `wkv_b`'s
    /// input) and shared rotary key before its rotation (`[T, R]`), from the
    /// down projection's `kva: [T, L + R]`, with the norm's state.
    fn kv_latents(
        &self,
        b: &B,
        kva_ta: &Tensor<B>,
    ) -> Result<(Tensor<B>, Tensor<B>, NormSaved<B>)> {
        let m = &self.maps;
        let (ckv_tl, norm) = self.kv_norm.forward(b, &m.kv_latent.apply(b, kva_ta)?)?;
        Ok((ckv_tl, m.k_rope_in.apply(b, kva_ta)?, norm))
    }

    /// The backward of [`Self::kv_latents`] from this rank's tokens'
    /// gradients of the normed latent and the rotary key: accumulates the
    /// norm's gradient and returns `dkva: [T, L + R]`.
    fn kv_latents_backward(
        &mut self,
        b: &B,
        dckv_tl: &Tensor<B>,
        dkr_tr: &Tensor<B>,
        norm: NormSaved<B>,
    ) -> Result<Tensor<B>> {
        let dlat_tl = self.kv_norm.backward(b, dckv_tl, norm)?;
        let m = &self.maps;
        let mut dkva_ta = m.kv_latent.adjoint(b, &dlat_tl)?;
        b.axpy(&mut dkva_ta, 1.0, &m.k_rope_in.adjoint(b, dkr_tr)?)?;
        Ok(dkva_ta)
    }

    /// The kernel's keys and values `[B·S·H, Hd]` from the up projection of
    /// the normed latent, `kv: [B·S, H·(P + V)]` (each head's position-free
    /// key and value), and the unrotated rotary key `kr: [B·S, R]`, rotated
    /// at `docs`' positions and copied to every head.
    fn kernel_keys_values(
        &self,
        b: &B,
        kv_thk: &Tensor<B>,
        kr_tr: &Tensor<B>,
        (batch, seq_len): (usize, usize),
        docs: Option<&DocTensors<B>>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let (m, h, hd) = (&self.maps, self.heads, self.kernel_head_dim());
        let (p, v) = (self.dims.qk_nope_head_dim, self.dims.v_head_dim);
        let n = batch * seq_len * h;
        let kr_tr = self.rotate(b, kr_tr.clone(), (batch, seq_len, 1), false, docs)?;
        let kv_nk = kv_thk.clone().reshape(&[n, p + v])?;
        let kr_nd = m.k_rope_out.apply(b, &kr_tr)?.reshape(&[n, hd])?;
        let k_nd = b.add(&m.k_nope.apply(b, &kv_nk)?, &kr_nd)?;
        let v_nd = m.v_pad.apply(b, &kv_nk)?;
        Ok((k_nd, v_nd))
    }

    /// The backward of [`Self::kernel_keys_values`] from `dk, dv: [B·S·H,
    /// Hd]`: `dkv: [B·S, H·(P + V)]` and the rotary key's `dkr: [B·S, R]`
    /// (rotated back; the shared key sums its heads').
    fn kernel_keys_values_backward(
        &self,
        b: &B,
        (dk_nd, dv_nd): (&Tensor<B>, &Tensor<B>),
        (batch, seq_len): (usize, usize),
        docs: Option<&DocTensors<B>>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let (h, hd) = (self.heads, self.kernel_head_dim());
        let (p, v) = (self.dims.qk_nope_head_dim, self.dims.v_head_dim);
        let tokens = batch * seq_len;
        let m = &self.maps;
        let mut dkv_nk = m.k_nope.adjoint(b, dk_nd)?;
        b.axpy(&mut dkv_nk, 1.0, &m.v_pad.adjoint(b, dv_nd)?)?;
        let dkr_tr = m
            .k_rope_out
            .adjoint(b, &dk_nd.clone().reshape(&[tokens, h * hd])?)?;
        let dkr_tr = self.rotate(b, dkr_tr, (batch, seq_len, 1), true, docs)?;
        Ok((dkv_nk.reshape(&[tokens, h * (p + v)])?, dkr_tr))
    }

    /// Context parallelism: `x: [T/tp, D]`, this rank's sequence shard (under
    /// tp, as in [`Self::forward`]) of the cp rank's T tokens of `T / (S/cp)`
    /// sequences of `seq_len` S → `[T, D]`. The queries are this cp rank's;
    /// the down projection's latent and rotary key (`L + R` a token, far
    /// fewer than the heads' keys and values) are all-gathered over tp and
    /// cp, and every rank expands the whole sequence's keys and values from
    /// them (the latent norm's and `wkv_b`'s gradients then sum over dp × cp
    /// like any dense parameter's).
    pub(crate) fn forward_cp(
        &self,
        ctx: &Exec<B>,
        groups: &LayerGroups,
        x_td: &Tensor<B>,
        seq_len: usize,
    ) -> Result<(Tensor<B>, MlaCpSaved<B>)> {
        let b = ctx.b;
        let tp = SeqShards {
            ctx,
            tp: &groups.tp,
        };
        let t = x_td.dims2("mla cp")?.0 * groups.tp.size();
        let exchange = CpExchange::new(ctx, groups, t, seq_len)?;
        let (batch, seq, h, hd) = (
            exchange.batch(),
            exchange.seq(),
            self.heads,
            self.kernel_head_dim(),
        );
        let input = self.layer_input(x_td, &tp);
        let (q_thq, query) = self.query.forward(b, &input, &tp, self.fp8)?;
        let (ckv_tl, kr_tr, kv_norm) = self.kv_latents(b, &input.project(b, &self.wkv_a.value)?)?;
        // The whole sequence's latents expand to its keys and values; only
        // this rank's are kept (the backward gathers and expands them again).
        let (ckv_nat, kr_nat) = self.whole_kv_latents(ctx, groups, &exchange, &ckv_tl, &kr_tr)?;
        let kv_thk = LinearInput::new(&ckv_nat, self.fp8).project(b, &self.wkv_b.value)?;
        let (k_nd, v_nd) =
            self.kernel_keys_values(b, &kv_thk, &kr_nat, (batch, seq), exchange.whole_docs())?;
        let whole = [batch * seq, h * hd];
        let (o_td, lse) = {
            let queries = self.cp_queries(b, &exchange);
            exchange.attend(
                b,
                &q_thq,
                &queries,
                &k_nd.reshape(&whole)?,
                &v_nd.reshape(&whole)?,
                h,
            )?
        };
        let o_thv = self.unpadded_values(b, o_td, t)?;
        let y_td = LinearInput::new(&o_thv, self.fp8).project(b, &self.wo.value)?;
        let saved = MlaCpSaved {
            x: input.into_saved(b)?,
            query,
            q_thq,
            kv_norm,
            ckv_tl,
            kr_tr,
            lse,
            o_thv,
            exchange,
        };
        Ok((y_td, saved))
    }

    /// The backward of [`Self::forward_cp`]: accumulates every projection's
    /// and norm's gradient and returns `dx: [T/tp, D]` of this rank's
    /// tokens; the latents' gradients of every rank's queries are
    /// reduce-scattered back to their tokens' ranks (over cp, then tp).
    pub(crate) fn backward_cp(
        &mut self,
        ctx: &Exec<B>,
        groups: &LayerGroups,
        dy_td: &Tensor<B>,
        saved: MlaCpSaved<B>,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let MlaCpSaved {
            x,
            query,
            q_thq,
            kv_norm,
            ckv_tl,
            kr_tr,
            lse,
            o_thv,
            exchange,
        } = saved;
        let (batch, seq, h, hd) = (
            exchange.batch(),
            exchange.seq(),
            self.heads,
            self.kernel_head_dim(),
        );
        let v = self.dims.v_head_dim;
        let (t, _) = o_thv.dims2("mla cp backward")?;
        let do_thv = LinearInput::new(&o_thv, self.fp8).backward(b, &mut self.wo, dy_td)?;
        // The kernel's padded o and dO (zero past the value width).
        let pad = |d: &Tensor<B>| -> Result<Tensor<B>> {
            Ok(self.padded_values(b, d)?.reshape(&[t, h * hd])?)
        };
        let (o_td, do_td) = (pad(&o_thv)?, pad(&do_thv)?);
        // The forward's keys and values again, from the gathered latents.
        let whole_docs = exchange.whole_docs();
        let (ckv_nat, kr_nat) = self.whole_kv_latents(ctx, groups, &exchange, &ckv_tl, &kr_tr)?;
        let ckv = LinearInput::kept(&ckv_nat, self.fp8);
        let kv_thk = ckv.project(b, &self.wkv_b.value)?;
        let (k_nd, v_nd) =
            self.kernel_keys_values(b, &kv_thk, &kr_nat, (batch, seq), whole_docs)?;
        let whole = [batch * seq, h * hd];
        let (dq_thq, dk_nat, dv_nat) = {
            let queries = self.cp_queries(b, &exchange);
            let queries_backward = |i: usize, dq_pad: Tensor<B>| -> Result<Tensor<B>> {
                let p = dq_pad.shape()[1];
                self.kernel_queries_backward(
                    b,
                    &dq_pad.reshape(&[batch * p * h, hd])?,
                    (batch, p),
                    exchange.chunk_docs(i),
                )
            };
            exchange.attend_backward(
                b,
                (&q_thq, &o_td, &do_td),
                lse,
                &queries,
                &queries_backward,
                (&k_nd.reshape(&whole)?, &v_nd.reshape(&whole)?),
                h,
                Some(v),
            )?
        };
        let n = batch * seq * h;
        let (dkv_thk, dkr_nat) = self.kernel_keys_values_backward(
            b,
            (&dk_nat.reshape(&[n, hd])?, &dv_nat.reshape(&[n, hd])?),
            (batch, seq),
            whole_docs,
        )?;
        let dckv_nat = ckv.backward(b, &mut self.wkv_b, &dkv_thk)?;
        let tp = SeqShards {
            ctx,
            tp: &groups.tp,
        };
        // Every rank's gradients of this rank's latents, summed over cp, then tp.
        let own = |d: &Tensor<B>| tp.scatter(&exchange.owned(ctx, groups, d)?);
        let dkva_ta = self.kv_latents_backward(b, &own(&dckv_nat)?, &own(&dkr_nat)?, kv_norm)?;
        self.down_backward(b, &tp, x, &dkva_ta, &dq_thq, query)
    }

    /// The whole sequence's normed key/value latent `[B·S, L]` and unrotated
    /// rotary key `[B·S, R]` in natural order, from this rank's tokens'
    /// (gathered over tp, then over cp).
    fn whole_kv_latents(
        &self,
        ctx: &Exec<B>,
        groups: &LayerGroups,
        exchange: &CpExchange<B>,
        ckv_tl: &Tensor<B>,
        kr_tr: &Tensor<B>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let whole = |x: &Tensor<B>| exchange.natural(ctx, groups, &ctx.gather(&groups.tp, x)?);
        Ok((whole(ckv_tl)?, whole(kr_tr)?))
    }

    /// The kernel's queries of a held chunk from its padded query rows
    /// `[B·P, H·Q]`, rotated at the prefix's positions: `[B, P, H, Hd]`.
    fn cp_queries<'a>(
        &'a self,
        b: &'a B,
        exchange: &'a CpExchange<B>,
    ) -> impl Fn(usize, Tensor<B>) -> Result<Tensor<B>> + 'a {
        move |i, rows: Tensor<B>| {
            let batch = exchange.batch();
            let p = rows.shape()[0] / batch;
            let q_nd = self.kernel_queries(b, &rows, (batch, p), exchange.chunk_docs(i))?;
            Ok(q_nd.reshape(&[batch, p, self.heads, self.kernel_head_dim()])?)
        }
    }
}

impl<B: Backend> Module<B> for Mla<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.query.visit_params(f);
        f(&self.wkv_a);
        self.kv_norm.visit_params(f);
        f(&self.wkv_b);
        f(&self.wo);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.query.visit_params_mut(f);
        f(&mut self.wkv_a);
        self.kv_norm.visit_params_mut(f);
        f(&mut self.wkv_b);
        f(&mut self.wo);
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::DType;

    use super::{Mla, QueryProj};
    use crate::engine::parallel::Exec;
    use crate::engine::param::Module;
    use crate::engine::testutil::{
        assert_fp8_tracks, check_param_grads, dot, f64_tensor, layer_outputs, one_rank, small_moe,
        small_spec, uniform, values,
    };
    use crate::engine::trainer::TrainConfig;
    use crate::spec::{FfnSpec, MlaSpec, ModelSpec, RopeScaling};
    use foldmoe_kernels::Group;

    /// The tp group of one rank (the layer sees all tokens).
    fn one() -> Group {
        Group::new(vec![0])
    }

    /// YaRN over the test model (base 100, an original context of 2 below
    /// the tests' sequences of 3 and 4): with LOW_RANK's rotary dim 4 the
    /// ramp leaves pair 0 at its frequency and interpolates pair 1; the
    /// mscales differ, so both cos/sin and the softmax scale change.
    fn yarn() -> RopeScaling {
        RopeScaling {
            beta_fast: 0.5,
            beta_slow: 0.05,
            mscale: Some(1.0),
            mscale_all_dim: Some(0.5),
            ..RopeScaling::yarn(4.0, 2)
        }
    }

    /// Low-rank query; V = 3 below Q = 6, so v is padded.
    const LOW_RANK: MlaSpec = MlaSpec {
        q_lora_rank: 6,
        kv_lora_rank: 5,
        qk_nope_head_dim: 2,
        qk_rope_head_dim: 4,
        v_head_dim: 3,
    };
    /// Full-rank query; V = 7 above Q = 4, so q and k are padded and q rescaled.
    const FULL_RANK: MlaSpec = MlaSpec {
        q_lora_rank: 0,
        kv_lora_rank: 4,
        qk_nope_head_dim: 2,
        qk_rope_head_dim: 2,
        v_head_dim: 7,
    };

    /// The small test model (hidden 8, 4 heads) with MLA attention.
    fn mla_spec(mla: MlaSpec, ffn: FfnSpec) -> ModelSpec {
        let mut spec = small_spec(&[ffn], false);
        spec.groups[0].attention.mla = Some(mla);
        spec
    }

    fn new_mla(mla: &MlaSpec) -> (Mla<Cpu>, ModelSpec) {
        new_mla_scaled(mla, None)
    }

    /// [`new_mla`] with the model's `rope_scaling` (and base 100 when set).
    fn new_mla_scaled(mla: &MlaSpec, scaling: Option<RopeScaling>) -> (Mla<Cpu>, ModelSpec) {
        let mut spec = mla_spec(mla.clone(), FfnSpec::Dense { ffn: 4 });
        if scaling.is_some() {
            spec.rope_theta = 100.0;
        }
        spec.rope_scaling = scaling;
        let heads = spec.groups[0].attention.heads;
        let layer = Mla::new(
            &Cpu,
            "attn",
            &spec,
            heads,
            mla,
            crate::engine::Init::full(7),
            DType::F64,
        )
        .unwrap();
        (layer, spec)
    }

    fn check_grad(mla: &MlaSpec, scaling: Option<RopeScaling>, what: &str) {
        let b = Cpu;
        let (mut layer, spec) = new_mla_scaled(mla, scaling);
        let (seq, d) = (3, spec.hidden);
        let t = 2 * seq;
        let x = uniform(1, t * d, 1.0);
        let r = uniform(2, t * d, 1.0);
        let x_td = f64_tensor(x.clone(), &[t, d]);
        let (_, saved) = layer.forward(&Exec::solo(&b), &one(), &x_td, seq).unwrap();
        let dx = layer
            .backward(
                &Exec::solo(&b),
                &one(),
                &f64_tensor(r.clone(), &[t, d]),
                saved,
            )
            .unwrap();
        assert_grad(&format!("{what} dx"), &x, &values(&dx), 1e-6, |xs| {
            let (y, _) = layer
                .forward(
                    &Exec::solo(&b),
                    &one(),
                    &f64_tensor(xs.to_vec(), &[t, d]),
                    seq,
                )
                .unwrap();
            dot(&y, &r)
        });
        check_param_grads(what, &mut layer, 24, 1e-6, |l| {
            dot(
                &l.forward(&Exec::solo(&b), &one(), &x_td, seq).unwrap().0,
                &r,
            )
        });
    }

    #[test]
    fn mla_grad_low_rank_query() {
        check_grad(&LOW_RANK, None, "mla low-rank query");
    }

    #[test]
    fn mla_grad_with_yarn() {
        check_grad(&LOW_RANK, Some(yarn()), "mla with YaRN");
    }

    #[test]
    fn mla_grad_full_rank_query() {
        check_grad(&FULL_RANK, None, "mla full-rank query");
    }

    /// `attention(precision = fp8_blockwise)` on MLA: the output, dx and
    /// every projection's and norm's gradient track the exact layer's
    /// (low- and full-rank queries), and differ from them.
    #[test]
    fn fp8_projections_track_the_exact_ones() {
        let b = Cpu;
        for (mla, what) in [(&LOW_RANK, "mla low-rank"), (&FULL_RANK, "mla full-rank")] {
            let d = mla_spec(mla.clone(), FfnSpec::Dense { ffn: 4 }).hidden;
            let (seq, t) = (5, 10);
            let x_td = f64_tensor(uniform(1, t * d, 1.0), &[t, d]);
            let dy_td = f64_tensor(uniform(2, t * d, 1.0), &[t, d]);
            assert_fp8_tracks(what, |fp8| {
                let (mut layer, _) = new_mla(mla);
                layer.fp8 = fp8;
                let (y, saved) = layer.forward(&Exec::solo(&b), &one(), &x_td, seq).unwrap();
                let dx = layer
                    .backward(&Exec::solo(&b), &one(), &dy_td, saved)
                    .unwrap();
                layer_outputs(&y, &dx, &layer)
            });
        }
    }

    #[test]
    fn mla_params_have_stable_names() {
        let names = |mla: &MlaSpec| {
            let mut names = Vec::new();
            new_mla(mla)
                .0
                .visit_params(&mut |p| names.push(p.name.clone()));
            names
        };
        assert_eq!(
            names(&LOW_RANK),
            [
                "attn.wq_a",
                "attn.q_norm.weight",
                "attn.wq_b",
                "attn.wkv_a",
                "attn.kv_norm.weight",
                "attn.wkv_b",
                "attn.wo"
            ]
        );
        assert_eq!(
            names(&FULL_RANK),
            [
                "attn.wq",
                "attn.wkv_a",
                "attn.kv_norm.weight",
                "attn.wkv_b",
                "attn.wo"
            ]
        );
    }

    /// `x: [M, K] · w: [K, N]`.
    fn mm(x: &[f64], w: &[f64], k: usize, n: usize) -> Vec<f64> {
        x.chunks(k)
            .flat_map(|row| (0..n).map(move |j| (0..k).map(|i| row[i] * w[i * n + j]).sum()))
            .collect()
    }

    /// RMSNorm of each row of `x` (rows as long as `w`).
    fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        x.chunks(w.len())
            .flat_map(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                row.iter().zip(w).map(move |(v, g)| v * inv * g)
            })
            .collect()
    }

    /// The rotary frequencies of a dim `r` and their amplitude, written out
    /// from YaRN's definition (Peng et al. 2023, as transformers computes
    /// it) when `scaling` is given.
    fn frequencies(r: usize, theta: f64, scaling: Option<&RopeScaling>) -> (Vec<f64>, f64) {
        let plain = |i: usize| 1.0 / theta.powf(2.0 * i as f64 / r as f64);
        let Some(y) = scaling else {
            return ((0..r / 2).map(plain).collect(), 1.0);
        };
        let m = |k: f64| 0.1 * k * y.factor.ln() + 1.0;
        // The dim whose wavelength turns `turns` times over the original context.
        let dim_of = |turns: f64| {
            r as f64
                * (y.original_max_position_embeddings as f64 / (turns * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * theta.ln())
        };
        let low = dim_of(y.beta_fast).floor().max(0.0);
        let mut high = dim_of(y.beta_slow).ceil().min(r as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        let freqs = (0..r / 2)
            .map(|i| {
                let interpolated = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                plain(i) * (1.0 - interpolated) + plain(i) / y.factor * interpolated
            })
            .collect();
        (freqs, m(y.mscale.unwrap()) / m(y.mscale_all_dim.unwrap()))
    }

    /// Rotate-half RoPE of one head vector at position `pos`, cos and sin
    /// times `amp`.
    fn rope(x: &[f64], pos: usize, (freqs, amp): &(Vec<f64>, f64)) -> Vec<f64> {
        let half = x.len() / 2;
        let mut out = x.to_vec();
        for i in 0..half {
            let a = pos as f64 * freqs[i];
            let (c, s) = (amp * a.cos(), amp * a.sin());
            out[i] = x[i] * c - x[half + i] * s;
            out[half + i] = x[half + i] * c + x[i] * s;
        }
        out
    }

    /// MLA written out per token and head, with a materialised causal
    /// softmax of scale `1/√(P + R)`, times `m(factor, mscale_all_dim)²`
    /// under YaRN (DeepSeek-V3's).
    fn reference(layer: &Mla<Cpu>, spec: &ModelSpec, x: &[f64], seq: usize) -> Vec<f64> {
        let m = &layer.dims;
        let (d, h, eps) = (spec.hidden, layer.heads, spec.norm_eps);
        let scaling = spec.rope_scaling.as_ref();
        let theta = frequencies(m.qk_rope_head_dim, spec.rope_theta, scaling);
        let softmax = scaling.map_or(1.0, |y| {
            let mscale = 0.1 * y.mscale_all_dim.unwrap() * y.factor.ln() + 1.0;
            mscale * mscale
        });
        let (l, p, r, v) = (
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        );
        let q_dim = p + r;
        let t = x.len() / d;
        let q = match &layer.query {
            QueryProj::LowRank { wq_a, q_norm, wq_b } => {
                let c = m.q_lora_rank;
                let cq = rms(
                    &mm(x, &values(&wq_a.value), d, c),
                    &values(&q_norm.weight.value),
                    eps,
                );
                mm(&cq, &values(&wq_b.value), c, h * q_dim)
            }
            QueryProj::Full { wq } => mm(x, &values(&wq.value), d, h * q_dim),
        };
        let kva = mm(x, &values(&layer.wkv_a.value), d, l + r);
        let latent: Vec<f64> = kva
            .chunks(l + r)
            .flat_map(|row| row[..l].to_vec())
            .collect();
        let ckv = rms(&latent, &values(&layer.kv_norm.weight.value), eps);
        let kv = mm(&ckv, &values(&layer.wkv_b.value), l, h * (p + v));
        let k_rope: Vec<Vec<f64>> = (0..t)
            .map(|i| rope(&kva[i * (l + r) + l..][..r], i % seq, &theta))
            .collect();
        let mut o = vec![0.0; t * h * v];
        for i in 0..t {
            let start = i - i % seq;
            for head in 0..h {
                let qh = &q[(i * h + head) * q_dim..][..q_dim];
                let q_rope = rope(&qh[p..], i % seq, &theta);
                let scores: Vec<f64> = (start..=i)
                    .map(|j| {
                        let kh = &kv[(j * h + head) * (p + v)..][..p];
                        let nope: f64 = qh[..p].iter().zip(kh).map(|(a, b)| a * b).sum();
                        let rot: f64 = q_rope.iter().zip(&k_rope[j]).map(|(a, b)| a * b).sum();
                        (nope + rot) * softmax / (q_dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in (start..=i).zip(&scores) {
                    let prob = (s - max).exp() / z;
                    let vh = &kv[(j * h + head) * (p + v) + p..][..v];
                    for (oe, ve) in o[(i * h + head) * v..][..v].iter_mut().zip(vh) {
                        *oe += prob * ve;
                    }
                }
            }
        }
        mm(&o, &values(&layer.wo.value), h * v, d)
    }

    #[test]
    fn mla_matches_reference() {
        for (mla, scaling) in [
            (LOW_RANK, None),
            (FULL_RANK, None),
            (LOW_RANK, Some(yarn())),
        ] {
            let (layer, spec) = new_mla_scaled(&mla, scaling);
            let (seq, d) = (4, spec.hidden);
            let t = 2 * seq;
            let x = uniform(3, t * d, 1.0);
            let (y, _) = layer
                .forward(
                    &Exec::solo(&Cpu),
                    &one(),
                    &f64_tensor(x.clone(), &[t, d]),
                    seq,
                )
                .unwrap();
            let got = values(&y);
            let want = reference(&layer, &spec, &x, seq);
            let scale = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            assert!(scale > 1e-3, "{mla:?}: output too small to compare");
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-12 * scale, "{mla:?}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn mla_is_causal() {
        // Changing the last token must not change any earlier output.
        let (layer, spec) = new_mla(&LOW_RANK);
        let (seq, d) = (4, spec.hidden);
        let mut x = uniform(1, seq * d, 1.0);
        let run = |x: &[f64]| {
            let x_td = f64_tensor(x.to_vec(), &[seq, d]);
            values(
                &layer
                    .forward(&Exec::solo(&Cpu), &one(), &x_td, seq)
                    .unwrap()
                    .0,
            )
        };
        let y1 = run(&x);
        for v in &mut x[(seq - 1) * d..] {
            *v += 0.5;
        }
        let y2 = run(&x);
        assert_eq!(y1[..(seq - 1) * d], y2[..(seq - 1) * d]);
        assert_ne!(y1[(seq - 1) * d..], y2[(seq - 1) * d..]);
    }

    #[test]
    fn mla_rejects_ragged_sequences() {
        let (layer, spec) = new_mla(&FULL_RANK);
        let x = f64_tensor(vec![0.0; 5 * spec.hidden], &[5, spec.hidden]);
        let err = layer
            .forward(&Exec::solo(&Cpu), &one(), &x, 2)
            .err()
            .expect("5 in sequences of 2");
        assert!(err.to_string().contains("5 tokens"), "{err}");
    }

    #[test]
    fn mla_moe_model_trains() {
        // A fixed batch memorised by a small MLA + MoE model: the loss falls.
        let mut spec = mla_spec(LOW_RANK, small_moe());
        spec.init_std = 0.1;
        // Plain AdamW steps: a constant learning rate, no clipping, no decay.
        let cfg = TrainConfig {
            lr: 1e-2,
            min_lr: 1e-2,
            warmup_steps: 0,
            weight_decay: 0.0,
            grad_clip: 0.0,
            ..TrainConfig::default()
        };
        let batch = [(vec![3, 0, 6, 1, 7, 2, 5, 4], vec![0, 6, 1, 7, 2, 5, 4, 3])];
        let losses = one_rank(&Cpu, &spec, 3, DType::F32, cfg, |ctx, trainer| {
            (0..30)
                .map(|_| Ok(trainer.step(ctx, &batch, 4)?.loss))
                .collect::<crate::engine::Result<Vec<f64>>>()
        });
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(
            last < 0.5 * first,
            "loss {first} -> {last} did not halve: {losses:?}"
        );
    }
}
