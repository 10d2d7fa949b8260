//! Shared experts: a dense SwiGLU MLP every token passes through, its output
//! optionally scaled by a per-token gate `sigmoid(x·w_gate)` (docs/ARCHITECTURE.md §4;
//! Megatron-Core `moe/shared_experts.py`).
//!
//! Shapes: T tokens, D hidden.

use foldmoe_kernels::{Backend, DType, Tensor};

use crate::engine::activations::Slot;
use crate::engine::linear::LinearSaved;
use crate::engine::mlp::{MlpSaved, SwiGluMlp};
use crate::engine::{Init, Module, Param, Result};
use crate::memory::Part;
use crate::spec::{MoeSpec, RecomputePart};

/// The shared experts of an MoE layer.
pub struct SharedExperts<B: Backend> {
    /// The MLP, its weights named `{prefix}.w1`, `.w3`, `.w2`.
    pub mlp: SwiGluMlp<B>,
    /// Gate weight `[D, 1]`, named `{prefix}.gate`, when the output is gated.
    pub gate: Option<Param<B>>,
}

/// The gate's forward values, kept for its backward.
struct GateSaved<B: Backend> {
    /// The input's rows (under tp the rank's shard until gathered again).
    x: LinearSaved<B>,
    /// `sigmoid(x·w_gate)`: `[T]`.
    g_t: Tensor<B>,
    /// The MLP output before gating.
    mlp_td: Tensor<B>,
}

/// What the shared experts' backward needs from their forward.
pub struct SharedSaved<B: Backend> {
    mlp: MlpSaved<B>,
    gate: Option<GateSaved<B>>,
}

impl<B: Backend> SharedSaved<B> {
    /// Lists the saved tensors: the input (an alias of the norm's output)
    /// and everything else, which `shared_experts` recompute drops.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let s = Slot::kept(Part::SharedExperts).recompute(RecomputePart::SharedExperts);
        self.mlp.visit_saved(Slot::NORM_OUT_ALIAS, s, s, f);
        if let Some(g) = &mut self.gate {
            g.x.visit(Slot::NORM_OUT_ALIAS, f);
            f(s, &mut g.g_t);
            f(s, &mut g.mlp_td);
        }
    }

    /// The kept inputs, the MLP's and the gate's (the MoE layer, which
    /// gathered them over tp, swaps in the rank's sequence shard).
    pub(crate) fn inputs_mut(&mut self) -> impl Iterator<Item = &mut LinearSaved<B>> {
        std::iter::once(self.mlp.input_mut()).chain(self.gate.as_mut().map(|g| &mut g.x))
    }
}

impl<B: Backend> SharedExperts<B> {
    /// Shared experts of intermediate size `moe.shared_ffn`, gated when
    /// `moe.shared_gate`.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        moe: &MoeSpec,
        std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let (ffn, gated) = (moe.shared_ffn, moe.shared_gate);
        let mlp = SwiGluMlp::new(b, prefix, hidden, ffn, std, init, dtype)?;
        let gate = if gated {
            let name = format!("{prefix}.gate");
            Some(init.normal(b, name, &[hidden, 1], std, dtype)?)
        } else {
            None
        };
        Ok(SharedExperts { mlp, gate })
    }

    /// `x: [T, D] → [T, D]`.
    pub fn forward(&self, b: &B, x_td: &Tensor<B>) -> Result<(Tensor<B>, SharedSaved<B>)> {
        let (mlp_td, mlp) = self.mlp.forward(b, x_td)?;
        let Some(w_gate) = &self.gate else {
            return Ok((mlp_td, SharedSaved { mlp, gate: None }));
        };
        let (t, _) = x_td.dims2("SharedExperts::forward")?;
        let z_t = b.matmul(x_td, &w_gate.value, false, false)?.reshape(&[t])?;
        let g_t = b.sigmoid(&z_t)?;
        let y_td = b.mul_rows(&mlp_td, &g_t)?;
        let gate = GateSaved {
            x: LinearSaved::Rows(x_td.clone()),
            g_t,
            mlp_td,
        };
        Ok((
            y_td,
            SharedSaved {
                mlp,
                gate: Some(gate),
            },
        ))
    }

    /// Accumulates the weight gradients and returns `dx: [T, D]`.
    pub fn backward(
        &mut self,
        b: &B,
        dy_td: &Tensor<B>,
        saved: SharedSaved<B>,
    ) -> Result<Tensor<B>> {
        let SharedSaved { mlp, gate } = saved;
        let (Some(gs), Some(w_gate)) = (gate, self.gate.as_mut()) else {
            return self.mlp.backward(b, dy_td, mlp);
        };
        let (t, _) = dy_td.dims2("SharedExperts::backward")?;
        let dg_t = b.dot_rows(dy_td, &gs.mlp_td)?;
        let dz_t1 = b.sigmoid_backward(&gs.g_t, &dg_t)?.reshape(&[t, 1])?;
        let x_td = gs.x.into_rows("shared experts' gate backward")?;
        w_gate.accumulate(b, &b.matmul(&x_td, &dz_t1, true, false)?)?;
        let dx_gate_td = b.matmul(&dz_t1, &w_gate.value, false, true)?;
        let dmlp_td = b.mul_rows(dy_td, &gs.g_t)?;
        let mut dx_td = self.mlp.backward(b, &dmlp_td, mlp)?;
        b.axpy(&mut dx_td, 1.0, &dx_gate_td)?;
        Ok(dx_td)
    }
}

impl<B: Backend> Module<B> for SharedExperts<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.mlp.visit_params(f);
        if let Some(g) = &self.gate {
            f(g);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.mlp.visit_params_mut(f);
        if let Some(g) = &mut self.gate {
            f(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;

    use super::*;
    use crate::engine::moe::testutil::*;

    const T: usize = 6;
    const D: usize = 4;

    fn check_shared(what: &str, gated: bool) {
        let mut moe = moe_spec(4, 2, 3, 5);
        moe.shared_gate = gated;
        let mut m = SharedExperts::new(
            &Cpu,
            "s",
            D,
            &moe,
            0.6,
            crate::engine::Init::full(4),
            DType::F64,
        )
        .unwrap();
        assert_eq!(m.gate.is_some(), gated);
        let x = uniform(31, T * D, 1.0);
        let r = uniform(32, T * D, 1.0);
        let (_, saved) = m.forward(&Cpu, &t64(x.clone(), &[T, D])).unwrap();
        let dx = m.backward(&Cpu, &t64(r.clone(), &[T, D]), saved).unwrap();
        check_grads(what, &mut m, &x, &[T, D], &host(&dx), |m, x| {
            dot(&m.forward(&Cpu, x).unwrap().0, &r)
        });
    }

    #[test]
    fn shared_grad_ungated() {
        check_shared("shared experts", false);
    }

    #[test]
    fn shared_grad_gated() {
        check_shared("gated shared experts", true);
    }
}
