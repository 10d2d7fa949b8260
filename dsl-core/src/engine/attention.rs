//! Causal self-attention with grouped-query heads and rotary positions
//! (Megatron-Core's `SelfAttention` with `num_query_groups`, no biases):
//! `q, k, v = x·Wq, x·Wk, x·Wv; q, k = rope(q), rope(k); o = attn(q, k, v); y = o·Wo`.
//!
//! With `qk_norm` (Qwen3's `q_norm`/`k_norm`), every query and key head is
//! RMS-normalised over its head dim before the rotation,
//! `q_h = rope(rms_norm(x·Wq_h) · w_q)`, one scale `w_q: [Hd]` (and `w_k`)
//! shared by all heads: a norm per head, so tp (which splits whole heads)
//! leaves it replicated, its gradient summed over tp like the block norms'.
//!
//! Shapes: B batch, S sequence, T = B·S tokens, D hidden, Hq query heads,
//! Hkv key/value heads, Hd head dim.

use foldmoe_kernels::{Backend, DType, Rope, Tensor, Yarn};

use super::activations::Slot;
use super::documents::DocTensors;
use super::linear::{LinearInput, LinearSaved};
use super::norm::{NormSaved, RmsNorm};
use super::param::{Init, Module, Param};
use super::{EngineError, Result};
use crate::memory::Part;
use crate::spec::{
    AttentionSpec, GemmPrecision, ModelSpec, OffloadPart, RecomputePart, RopeScalingType,
};

/// The attention projections `wq: [D, Hq·Hd]`, `wk, wv: [D, Hkv·Hd]`,
/// `wo: [Hq·Hd, D]` and the head layout.
pub struct Attention<B: Backend> {
    /// Query projection `[D, Hq·Hd]`.
    pub wq: Param<B>,
    /// Key projection `[D, Hkv·Hd]`.
    pub wk: Param<B>,
    /// Value projection `[D, Hkv·Hd]`.
    pub wv: Param<B>,
    /// Output projection `[Hq·Hd, D]`.
    pub wo: Param<B>,
    /// Per-head query and key norms `[Hd]` (`qk_norm`), named
    /// `{prefix}.q_norm.weight`, `{prefix}.k_norm.weight`.
    pub qk_norm: Option<[RmsNorm<B>; 2]>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope: Rope,
    /// Whether the projections run as blockwise fp8 GEMMs
    /// (`attention(precision = fp8_blockwise)`).
    fp8: bool,
    /// Whether the input is gathered over tp from sequence shards (set by
    /// [`Self::take_heads`]): the block then keeps the rank's shard for the
    /// backward ([`AttentionSaved::input_mut`]), so the layer makes no fp8
    /// column tiles of it.
    input_gathered: bool,
}

/// What the attention's backward needs: the input (under fp8 its column
/// tiles), the rotated q and k, v, the attention output and its log-sum-exp.
pub struct AttentionSaved<B: Backend> {
    x: LinearSaved<B>,
    q_bshd: Tensor<B>,
    k_bshd: Tensor<B>,
    v_bshd: Tensor<B>,
    o_td: Tensor<B>,
    lse_bhs: Tensor<B>,
    /// The q and k norms' inputs `[T·H, Hd]` and rstd (`qk_norm`).
    qk_norm: Option<Box<[NormSaved<B>; 2]>>,
    /// The micro-batch's positions and documents, if any (a few ints per
    /// token: not counted).
    docs: Option<DocTensors<B>>,
}

impl<B: Backend> AttentionSaved<B> {
    /// Lists the saved tensors with their slots: the input (the norm's
    /// output, under fp8 its column tiles), q, k, v (`qkv`), the output (the projection's input,
    /// `attn_proj`) and the log-sum-exp (`core_attn`: flash attention keeps
    /// it rather than the S×S probabilities).
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let qkv = Slot::kept(Part::Attention).offload(OffloadPart::Qkv);
        self.x.visit(Slot::NORM_OUT, f);
        f(qkv, &mut self.q_bshd);
        f(qkv, &mut self.k_bshd);
        f(qkv, &mut self.v_bshd);
        // The per-head norms' inputs and rstd, as MLA's latent norms: kept
        // with the attention (a dropped rstd reruns the attention layer).
        for norm in self.qk_norm.iter_mut().flat_map(|n| n.iter_mut()) {
            norm.visit_saved(Slot::kept(Part::Attention), f);
        }
        f(
            Slot::kept(Part::Attention).offload(OffloadPart::AttnProj),
            &mut self.o_td,
        );
        f(
            Slot::kept(Part::Attention)
                .recompute(RecomputePart::CoreAttn)
                .offload(OffloadPart::CoreAttn),
            &mut self.lse_bhs,
        );
    }

    /// The kept input (the block swaps in the rank's sequence shard).
    pub(crate) fn input_mut(&mut self) -> &mut LinearSaved<B> {
        &mut self.x
    }
}

impl<B: Backend> Attention<B> {
    /// Projections named `{prefix}.wq` … `{prefix}.wo`, normal(0, `model.init_std`),
    /// over the model's hidden size and RoPE base; with `qk_norm`, the
    /// per-head norms (scales 1, the model's `norm_eps`).
    pub fn new(
        b: &B,
        prefix: &str,
        model: &ModelSpec,
        spec: &AttentionSpec,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let (hidden, std) = (model.hidden, model.init_std);
        let q_dim = spec.heads * spec.head_dim;
        let kv_dim = spec.kv_heads * spec.head_dim;
        let mk = |name: &str, shape: &[usize]| {
            init.normal(b, format!("{prefix}.{name}"), shape, std, dtype)
        };
        let qk_norm = if spec.qk_norm {
            let norm = |name: &str| {
                RmsNorm::new(
                    b,
                    &format!("{prefix}.{name}"),
                    spec.head_dim,
                    model.norm_eps,
                    dtype,
                )
            };
            Some([norm("q_norm")?, norm("k_norm")?])
        } else {
            None
        };
        Ok(Attention {
            wq: mk("wq", &[hidden, q_dim])?,
            wk: mk("wk", &[hidden, kv_dim])?,
            wv: mk("wv", &[hidden, kv_dim])?,
            wo: mk("wo", &[q_dim, hidden])?,
            qk_norm,
            heads: spec.heads,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            rope: rope_of(model, spec.head_dim),
            fp8: spec.precision == GemmPrecision::Fp8Blockwise,
            input_gathered: false,
        })
    }

    /// Makes the layer one rank's of `parts` tensor-parallel ranks: its
    /// projections are already that rank's columns / rows of heads (drawn by
    /// the shard plan), so only the head counts it computes with change.
    pub fn take_heads(&mut self, parts: usize) -> Result<()> {
        if parts == 1 {
            return Ok(());
        }
        if !self.heads.is_multiple_of(parts) || !self.kv_heads.is_multiple_of(parts) {
            return Err(EngineError::Invalid(format!(
                "attention {}: {} query and {} key/value heads do not split over tp = {parts}; \
                 the runtime needs both divisible by tp (key/value replication for \
                 tp > kv_heads is not supported yet)",
                self.wq.name, self.heads, self.kv_heads
            )));
        }
        let q_cols = self.heads / parts * self.head_dim;
        if self.wq.value.shape()[1] != q_cols {
            return Err(EngineError::Invalid(format!(
                "attention {}: holds {} query columns, a tp = {parts} shard has {q_cols}; build \
                 the layer under the rank's shard plan",
                self.wq.name,
                self.wq.value.shape()[1]
            )));
        }
        self.heads /= parts;
        self.kv_heads /= parts;
        self.input_gathered = true;
        Ok(())
    }

    /// Query heads held (this rank's under tp).
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Key/value heads held (this rank's under tp).
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Dimension of a head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The rotary frequencies.
    pub fn rope(&self) -> Rope {
        self.rope
    }

    /// Whether the projections run as blockwise fp8 GEMMs.
    pub fn fp8(&self) -> bool {
        self.fp8
    }

    /// The projections' input `x`, to be kept by [`LinearInput::into_saved`]:
    /// its fp8 column tiles made in the forward unless the block keeps the
    /// rank's shard of it (a tp-gathered input).
    pub(crate) fn input(&self, x_td: &Tensor<B>) -> LinearInput<B> {
        LinearInput::layer_input(x_td, self.fp8, self.input_gathered)
    }

    /// `x: [T, D] -> [T, D]`, the T tokens being `T / seq_len` sequences of
    /// `seq_len`; `docs` restarts positions and masks attention at
    /// documents.
    pub fn forward(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        seq_len: usize,
        docs: Option<&DocTensors<B>>,
    ) -> Result<(Tensor<B>, AttentionSaved<B>)> {
        let (tokens, _) = x_td.dims2("attention")?;
        if seq_len == 0 || !tokens.is_multiple_of(seq_len) {
            return Err(EngineError::Invalid(format!(
                "attention: {tokens} tokens do not split into sequences of length {seq_len}"
            )));
        }
        let batch = tokens / seq_len;
        let (hq, hkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        // One quantisation of x serves q, k and v in fp8, and the backward
        // keeps its column tiles.
        let input = self.input(x_td);
        let project = |w: &Param<B>, heads: usize| -> Result<Tensor<B>> {
            Ok(input
                .project(b, &w.value)?
                .reshape(&[batch, seq_len, heads, hd])?)
        };
        let (q_bshd, k_bshd) = (project(&self.wq, hq)?, project(&self.wk, hkv)?);
        let (q_bshd, k_bshd, qk_norm) = match &self.qk_norm {
            None => (q_bshd, k_bshd, None),
            Some([q_norm, k_norm]) => {
                // One row per token-head: the norm runs over the head dim.
                let per_head = |norm: &RmsNorm<B>, t: Tensor<B>, heads: usize| {
                    let (y, saved) = norm.forward(b, &t.reshape(&[tokens * heads, hd])?)?;
                    Ok::<_, EngineError>((y.reshape(&[batch, seq_len, heads, hd])?, saved))
                };
                let (q, qs) = per_head(q_norm, q_bshd, hq)?;
                let (k, ks) = per_head(k_norm, k_bshd, hkv)?;
                (q, k, Some(Box::new([qs, ks])))
            }
        };
        let positions = docs.and_then(|d| d.positions.as_ref());
        let q_bshd = b.rope(&q_bshd, self.rope, false, positions)?;
        let k_bshd = b.rope(&k_bshd, self.rope, false, positions)?;
        let v_bshd = project(&self.wv, hkv)?;
        let mask = docs.and_then(|d| d.docs.as_ref());
        let (o_bshd, lse_bhs) = b.attention(&q_bshd, &k_bshd, &v_bshd, mask)?;
        // Reshapes move the buffer: no copy of the attention output.
        let o_td = o_bshd.reshape(&[tokens, hq * hd])?;
        let y_td = LinearInput::new(&o_td, self.fp8).project(b, &self.wo.value)?;
        let saved = AttentionSaved {
            x: input.into_saved(b)?,
            q_bshd,
            k_bshd,
            v_bshd,
            o_td,
            lse_bhs,
            qk_norm,
            docs: docs.cloned(),
        };
        Ok((y_td, saved))
    }

    /// Accumulates the projections' gradients and returns `dx: [T, D]`.
    pub fn backward(
        &mut self,
        b: &B,
        dy_td: &Tensor<B>,
        saved: AttentionSaved<B>,
    ) -> Result<Tensor<B>> {
        let AttentionSaved {
            x,
            q_bshd,
            k_bshd,
            v_bshd,
            o_td,
            lse_bhs,
            qk_norm,
            docs,
        } = saved;
        let (batch, seq_len, hq, hd) = q_bshd.dims4("attention backward")?;
        let do_bshd = LinearInput::new(&o_td, self.fp8)
            .backward(b, &mut self.wo, dy_td)?
            .reshape(&[batch, seq_len, hq, hd])?;
        let o_bshd = o_td.reshape(&[batch, seq_len, hq, hd])?;
        let mask = docs.as_ref().and_then(|d| d.docs.as_ref());
        let (dq_bshd, dk_bshd, dv_bshd) =
            b.attention_backward(&do_bshd, &q_bshd, &k_bshd, &v_bshd, &o_bshd, &lse_bhs, mask)?;
        // The rotation's backward is its transpose: it rotates back.
        let positions = docs.as_ref().and_then(|d| d.positions.as_ref());
        let dq_bshd = b.rope(&dq_bshd, self.rope, true, positions)?;
        let dk_bshd = b.rope(&dk_bshd, self.rope, true, positions)?;
        let (dq_bshd, dk_bshd) = match (&mut self.qk_norm, qk_norm) {
            (Some([q_norm, k_norm]), Some(saved)) => {
                let [qs, ks] = *saved;
                let tokens = batch * seq_len;
                let per_head = |norm: &mut RmsNorm<B>, d: Tensor<B>, s, heads: usize| {
                    let d = norm.backward(b, &d.reshape(&[tokens * heads, hd])?, s)?;
                    d.reshape(&[batch, seq_len, heads, hd])
                        .map_err(EngineError::from)
                };
                let hkv = dk_bshd.dims4("attention backward")?.2;
                (
                    per_head(q_norm, dq_bshd, qs, hq)?,
                    per_head(k_norm, dk_bshd, ks, hkv)?,
                )
            }
            (None, None) => (dq_bshd, dk_bshd),
            _ => {
                return Err(EngineError::Invalid(
                    "attention backward: saved state and layer disagree on qk_norm".into(),
                ))
            }
        };
        let input = LinearInput::from_saved(x, self.fp8)?;
        let mut dx_td = project_backward(b, &mut self.wq, &input, dq_bshd)?;
        b.axpy(
            &mut dx_td,
            1.0,
            &project_backward(b, &mut self.wk, &input, dk_bshd)?,
        )?;
        b.axpy(
            &mut dx_td,
            1.0,
            &project_backward(b, &mut self.wv, &input, dv_bshd)?,
        )?;
        Ok(dx_td)
    }
}

/// The rotary frequencies of `model` over a rotary dim of `dim` (GQA's
/// head dim, MLA's `qk_rope_head_dim`): its base `rope_theta`, with YaRN's
/// ramp and attention factor when it has a `rope_scaling`.
pub(crate) fn rope_of(model: &ModelSpec, dim: usize) -> Rope {
    let yarn = model.rope_scaling.as_ref().map(|r| match r.kind {
        RopeScalingType::Yarn => Yarn::new(
            model.rope_theta,
            dim,
            r.factor,
            r.original_max_position_embeddings as f64,
            r.beta_fast,
            r.beta_slow,
            r.mscale,
            r.mscale_all_dim,
        ),
    });
    Rope {
        theta: model.rope_theta,
        yarn,
    }
}

/// Backward of `d = x·w` seen as heads (any shape of T rows): accumulates
/// `xᵀ·d` into `w` and returns this projection's share of `dx`.
pub(crate) fn project_backward<B: Backend>(
    b: &B,
    w: &mut Param<B>,
    x: &LinearInput<B>,
    d_heads: Tensor<B>,
) -> Result<Tensor<B>> {
    let tokens = x.tokens()?;
    let width = d_heads.numel() / tokens;
    x.backward(b, w, &d_heads.reshape(&[tokens, width])?)
}

impl<B: Backend> Module<B> for Attention<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        f(&self.wq);
        f(&self.wk);
        f(&self.wv);
        f(&self.wo);
        for norm in self.qk_norm.iter().flatten() {
            norm.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        f(&mut self.wq);
        f(&mut self.wk);
        f(&mut self.wv);
        f(&mut self.wo);
        for norm in self.qk_norm.iter_mut().flatten() {
            norm.visit_params_mut(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::DType;

    use super::Attention;
    use crate::engine::testutil::{
        assert_fp8_tracks, check_param_grads, dot, f64_tensor, layer_outputs, small_spec, uniform,
        values,
    };
    use crate::spec::{FfnSpec, GemmPrecision, RopeScaling};

    #[test]
    fn attention_block_grad() {
        check_attention_grad(false, None);
    }

    /// YaRN (Qwen3-MoE's `rope_scaling`): the rotation and its attention
    /// factor in forward and backward, against finite differences.
    #[test]
    fn attention_with_yarn_grad() {
        let mut yarn = RopeScaling::yarn(4.0, 2);
        (yarn.beta_fast, yarn.beta_slow) = (0.5, 0.05);
        check_attention_grad(true, Some(yarn));
    }

    /// Qwen3's per-head q/k norms: their scales and the input checked
    /// against finite differences like every other parameter.
    #[test]
    fn attention_with_qk_norm_grad() {
        check_attention_grad(true, None);
    }

    fn check_attention_grad(qk_norm: bool, scaling: Option<RopeScaling>) {
        let b = Cpu;
        let mut spec = small_spec(&[FfnSpec::Dense { ffn: 4 }], false);
        spec.groups[0].attention.qk_norm = qk_norm;
        if scaling.is_some() {
            spec.rope_theta = 100.0;
        }
        spec.rope_scaling = scaling;
        let attn_spec = &spec.groups[0].attention;
        assert!(attn_spec.kv_heads < attn_spec.heads, "the check covers GQA");
        let mut attn = Attention::new(
            &b,
            "attn",
            &spec,
            attn_spec,
            crate::engine::Init::full(7),
            DType::F64,
        )
        .unwrap();
        assert_eq!(attn.rope().yarn.is_some(), spec.rope_scaling.is_some());
        if let Some(norms) = &mut attn.qk_norm {
            // Scales away from 1, so their gradients are not symmetric.
            for (i, n) in norms.iter_mut().enumerate() {
                let hd = attn_spec.head_dim;
                let w: Vec<f64> = uniform(30 + i as u64, hd, 0.5)
                    .iter()
                    .map(|v| 1.0 + v)
                    .collect();
                n.weight.value = f64_tensor(w, &[hd]);
            }
        }
        let (batch, seq, d) = (2, 3, spec.hidden);
        let t = batch * seq;
        let x = uniform(1, t * d, 1.0);
        let r = uniform(2, t * d, 1.0);
        let x_td = f64_tensor(x.clone(), &[t, d]);
        let (_, saved) = attn.forward(&b, &x_td, seq, None).unwrap();
        let dx = attn
            .backward(&b, &f64_tensor(r.clone(), &[t, d]), saved)
            .unwrap();
        assert_grad("attention dx", &x, &values(&dx), 1e-6, |xs| {
            let (y, _) = attn
                .forward(&b, &f64_tensor(xs.to_vec(), &[t, d]), seq, None)
                .unwrap();
            dot(&y, &r)
        });
        let n_params = if qk_norm { 6 } else { 4 };
        let mut seen = 0;
        crate::engine::Module::visit_params(&attn, &mut |_| seen += 1);
        assert_eq!(seen, n_params);
        check_param_grads("attention", &mut attn, 24, 1e-6, |a| {
            dot(&a.forward(&b, &x_td, seq, None).unwrap().0, &r)
        });
    }

    /// `attention(precision = fp8_blockwise)`: the output, dx and every
    /// projection's gradient track the exact layer's, and differ from them.
    #[test]
    fn fp8_projections_track_the_exact_ones() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 4 }], false);
        let (seq, d) = (5, spec.hidden);
        let t = 2 * seq;
        let x_td = f64_tensor(uniform(1, t * d, 1.0), &[t, d]);
        let dy_td = f64_tensor(uniform(2, t * d, 1.0), &[t, d]);
        assert_fp8_tracks("attention", |fp8| {
            let mut attn_spec = spec.groups[0].attention.clone();
            if fp8 {
                attn_spec.precision = GemmPrecision::Fp8Blockwise;
            }
            let init = crate::engine::Init::full(7);
            let mut attn = Attention::new(&b, "attn", &spec, &attn_spec, init, DType::F64).unwrap();
            assert_eq!(attn.fp8(), fp8);
            let (y, saved) = attn.forward(&b, &x_td, seq, None).unwrap();
            let dx = attn.backward(&b, &dy_td, saved).unwrap();
            layer_outputs(&y, &dx, &attn)
        });
    }

    #[test]
    fn attention_is_causal() {
        // Changing the last token must not change any earlier output.
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 4 }], false);
        let attn = Attention::new(
            &b,
            "attn",
            &spec,
            &spec.groups[0].attention,
            crate::engine::Init::full(7),
            DType::F64,
        )
        .unwrap();
        let (seq, d) = (4, spec.hidden);
        let mut x = uniform(1, seq * d, 1.0);
        let y1 = values(
            &attn
                .forward(&b, &f64_tensor(x.clone(), &[seq, d]), seq, None)
                .unwrap()
                .0,
        );
        for v in &mut x[(seq - 1) * d..] {
            *v += 0.5;
        }
        let y2 = values(
            &attn
                .forward(&b, &f64_tensor(x, &[seq, d]), seq, None)
                .unwrap()
                .0,
        );
        assert_eq!(y1[..(seq - 1) * d], y2[..(seq - 1) * d]);
        assert_ne!(y1[(seq - 1) * d..], y2[(seq - 1) * d..]);
    }

    #[test]
    fn attention_rejects_ragged_sequences() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 4 }], false);
        let attn = Attention::new(
            &b,
            "attn",
            &spec,
            &spec.groups[0].attention,
            crate::engine::Init::full(7),
            DType::F64,
        )
        .unwrap();
        let x = f64_tensor(vec![0.0; 5 * spec.hidden], &[5, spec.hidden]);
        let err = attn
            .forward(&b, &x, 2, None)
            .err()
            .expect("5 tokens in sequences of 2");
        assert!(err.to_string().contains("5 tokens"), "{err}");
    }
}
