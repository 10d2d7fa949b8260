//! RMSNorm (Zhang & Sennrich 2019), as in Megatron-Core's `TENorm`/`FusedRMSNorm`:
//! `y = x / sqrt(mean(x²) + eps) · w`, with `w` starting at 1.
//!
//! Shapes: T tokens, D hidden.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::activations::Slot;
use super::param::{init_const, Module, Param};
use super::Result;
use crate::spec::RecomputePart;

/// An RMSNorm over the last dim with a learned scale `w: [D]`.
pub struct RmsNorm<B: Backend> {
    /// Scale `[D]`; 1-d, so the optimizer does not decay it.
    pub weight: Param<B>,
    /// Added to the mean square before the square root.
    pub eps: f64,
}

/// What the norm's backward needs: its input and the reciprocal rms per row.
pub struct NormSaved<B: Backend> {
    x_td: Tensor<B>,
    rstd_t: Tensor<B>,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm named `{prefix}.weight` with its scale at 1.
    pub fn new(b: &B, prefix: &str, hidden: usize, eps: f64, dtype: DType) -> Result<Self> {
        let value = init_const(b, &[hidden], 1.0, dtype)?;
        Ok(RmsNorm {
            weight: Param::new(b, format!("{prefix}.weight"), value)?,
            eps,
        })
    }

    /// `x: [T, D] -> [T, D]`.
    pub fn forward(&self, b: &B, x_td: &Tensor<B>) -> Result<(Tensor<B>, NormSaved<B>)> {
        let (y_td, rstd_t) = b.rms_norm(x_td, &self.weight.value, self.eps)?;
        let saved = NormSaved {
            x_td: x_td.clone(),
            rstd_t,
        };
        Ok((y_td, saved))
    }

    /// Accumulates the scale's gradient and returns `dx: [T, D]`.
    pub fn backward(&mut self, b: &B, dy_td: &Tensor<B>, saved: NormSaved<B>) -> Result<Tensor<B>> {
        let (dx_td, dw_d) =
            b.rms_norm_backward(dy_td, &saved.x_td, &self.weight.value, &saved.rstd_t)?;
        self.weight.accumulate(b, &dw_d)?;
        Ok(dx_td)
    }
}

impl<B: Backend> NormSaved<B> {
    /// The norm's input (kept or restored).
    pub(crate) fn input(&self) -> &Tensor<B> {
        &self.x_td
    }

    /// Lists the saved tensors: the input under `input`, and `rstd` with it
    /// (moved with it), which `norm` recompute drops since a rerun of the
    /// norm gives it back.
    pub(crate) fn visit_saved(&mut self, input: Slot, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        f(input, &mut self.x_td);
        f(input.recompute(RecomputePart::Norm), &mut self.rstd_t);
    }
}

impl<B: Backend> Module<B> for RmsNorm<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        f(&self.weight);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        f(&mut self.weight);
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::DType;

    use super::RmsNorm;
    use crate::engine::testutil::{check_param_grads, dot, f64_tensor, uniform, values};

    #[test]
    fn rms_norm_layer_grad() {
        let b = Cpu;
        let (t, d) = (3, 5);
        let mut norm = RmsNorm::new(&b, "norm", d, 1e-6, DType::F64).unwrap();
        // A scale away from 1, so dx depends on it.
        let w: Vec<f64> = uniform(1, d, 0.5).iter().map(|v| 1.0 + v).collect();
        norm.weight.value = f64_tensor(w, &[d]);
        let x = uniform(2, t * d, 2.0);
        let r = uniform(3, t * d, 1.0);
        let x_td = f64_tensor(x.clone(), &[t, d]);
        let (_, saved) = norm.forward(&b, &x_td).unwrap();
        let dx = norm
            .backward(&b, &f64_tensor(r.clone(), &[t, d]), saved)
            .unwrap();
        assert_grad("rms_norm dx", &x, &values(&dx), 1e-6, |xs| {
            let (y, _) = norm.forward(&b, &f64_tensor(xs.to_vec(), &[t, d])).unwrap();
            dot(&y, &r)
        });
        check_param_grads("rms_norm", &mut norm, 16, 1e-6, |n| {
            dot(&n.forward(&b, &x_td).unwrap().0, &r)
        });
    }
}
