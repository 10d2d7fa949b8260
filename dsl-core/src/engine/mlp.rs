//! The dense SwiGLU MLP: `y = (silu(x·W1) ⊙ (x·W3))·W2`. Used as the dense
//! feed-forward of a block and as the shared experts of an MoE layer.
//!
//! Shapes: T tokens, D hidden, F intermediate.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::activations::Slot;
use super::linear::LinearSaved;
use super::param::{Init, Module, Param};
use super::Result;
use crate::memory::Part;
use crate::spec::RecomputePart;

/// A SwiGLU MLP with weights `w1, w3: [D, F]`, `w2: [F, D]`.
pub struct SwiGluMlp<B: Backend> {
    /// Gate projection `[D, F]`.
    pub w1: Param<B>,
    /// Up projection `[D, F]`.
    pub w3: Param<B>,
    /// Down projection `[F, D]`.
    pub w2: Param<B>,
}

/// What the MLP's backward needs from its forward.
pub struct MlpSaved<B: Backend> {
    /// The input's rows (under tp the rank's shard, which the caller kept
    /// and gathers again before the backward).
    x: LinearSaved<B>,
    gate_tf: Tensor<B>,
    up_tf: Tensor<B>,
    act_tf: Tensor<B>,
}

impl<B: Backend> MlpSaved<B> {
    /// Lists the saved tensors: the input under `input`, the gate and up
    /// projections and the activation under `part`, the activation dropped
    /// by `act` recompute (`mlp_act`) or all of them by `all` (the shared
    /// experts, recomputed whole).
    pub(crate) fn visit_saved(
        &mut self,
        input: Slot,
        inner: Slot,
        act: Slot,
        f: &mut dyn FnMut(Slot, &mut Tensor<B>),
    ) {
        self.x.visit(input, f);
        f(inner, &mut self.gate_tf);
        f(inner, &mut self.up_tf);
        f(act, &mut self.act_tf);
    }

    /// [`MlpSaved::visit_saved`] for a block's dense feed-forward: the input
    /// is the norm's output, the rest counted under `dense_mlp`, the
    /// activation dropped by `mlp_act` recompute.
    pub(crate) fn visit_saved_as_block_ffn(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let inner = Slot::kept(Part::DenseMlp);
        self.visit_saved(
            Slot::NORM_OUT,
            inner,
            inner.recompute(RecomputePart::MlpAct),
            f,
        )
    }

    /// The kept input (a caller that gathered it over tp swaps in the
    /// rank's sequence shard).
    pub(crate) fn input_mut(&mut self) -> &mut LinearSaved<B> {
        &mut self.x
    }
}

impl<B: Backend> SwiGluMlp<B> {
    /// A new MLP with normal(0, std) weights seeded by `(seed, name)`.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        ffn: usize,
        std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let mk = |name: &str, shape: &[usize]| {
            init.normal(b, format!("{prefix}.{name}"), shape, std, dtype)
        };
        Ok(SwiGluMlp {
            w1: mk("w1", &[hidden, ffn])?,
            w3: mk("w3", &[hidden, ffn])?,
            w2: mk("w2", &[ffn, hidden])?,
        })
    }

    /// `x: [T, D] -> [T, D]`.
    pub fn forward(&self, b: &B, x_td: &Tensor<B>) -> Result<(Tensor<B>, MlpSaved<B>)> {
        let gate_tf = b.matmul(x_td, &self.w1.value, false, false)?;
        let up_tf = b.matmul(x_td, &self.w3.value, false, false)?;
        let act_tf = b.swiglu(&gate_tf, &up_tf)?;
        let y_td = b.matmul(&act_tf, &self.w2.value, false, false)?;
        let saved = MlpSaved {
            x: LinearSaved::Rows(x_td.clone()),
            gate_tf,
            up_tf,
            act_tf,
        };
        Ok((y_td, saved))
    }

    /// Accumulates weight gradients and returns `dx: [T, D]`.
    pub fn backward(&mut self, b: &B, dy_td: &Tensor<B>, saved: MlpSaved<B>) -> Result<Tensor<B>> {
        let MlpSaved {
            x,
            gate_tf,
            up_tf,
            act_tf,
        } = saved;
        let x_td = x.into_rows("mlp backward")?;
        self.w2
            .accumulate(b, &b.matmul(&act_tf, dy_td, true, false)?)?;
        let dact_tf = b.matmul(dy_td, &self.w2.value, false, true)?;
        let (dgate_tf, dup_tf) = b.swiglu_backward(&gate_tf, &up_tf, &dact_tf)?;
        self.w1
            .accumulate(b, &b.matmul(&x_td, &dgate_tf, true, false)?)?;
        self.w3
            .accumulate(b, &b.matmul(&x_td, &dup_tf, true, false)?)?;
        let mut dx_td = b.matmul(&dgate_tf, &self.w1.value, false, true)?;
        b.axpy(
            &mut dx_td,
            1.0,
            &b.matmul(&dup_tf, &self.w3.value, false, true)?,
        )?;
        Ok(dx_td)
    }
}

impl<B: Backend> Module<B> for SwiGluMlp<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        f(&self.w1);
        f(&self.w3);
        f(&self.w2);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        f(&mut self.w1);
        f(&mut self.w3);
        f(&mut self.w2);
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::DType;

    use super::SwiGluMlp;
    use crate::engine::testutil::{check_param_grads, dot, f64_tensor, uniform, values};

    #[test]
    fn swiglu_mlp_grad() {
        let b = Cpu;
        let (t, d, f) = (4, 5, 6);
        let mut mlp = SwiGluMlp::new(
            &b,
            "mlp",
            d,
            f,
            0.5,
            crate::engine::Init::full(3),
            DType::F64,
        )
        .unwrap();
        let x = uniform(1, t * d, 1.0);
        let r = uniform(2, t * d, 1.0);
        let x_td = f64_tensor(x.clone(), &[t, d]);
        let (_, saved) = mlp.forward(&b, &x_td).unwrap();
        let dx = mlp
            .backward(&b, &f64_tensor(r.clone(), &[t, d]), saved)
            .unwrap();
        assert_grad("swiglu_mlp dx", &x, &values(&dx), 1e-6, |xs| {
            let (y, _) = mlp.forward(&b, &f64_tensor(xs.to_vec(), &[t, d])).unwrap();
            dot(&y, &r)
        });
        check_param_grads("swiglu_mlp", &mut mlp, 64, 1e-6, |m| {
            dot(&m.forward(&b, &x_td).unwrap().0, &r)
        });
    }
}
