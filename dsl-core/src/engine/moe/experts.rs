//! Compute: the routed experts, each a SwiGLU FFN `(silu(x·W1) ⊙ (x·W3))·W2`,
//! all run at once as grouped GEMMs over the expert-major rows (docs/ARCHITECTURE.md §4;
//! Megatron-Core `moe/experts.py`, `GroupedMLP`).
//!
//! Shapes: E experts, D hidden, F expert ffn, N permuted rows; group `e` is
//! the next `counts_e[e]` rows (empty groups allowed; rows past the total
//! are padding and come out zero).

use foldmoe_kernels::{Backend, DType, Tensor};

use crate::engine::activations::Slot;
use crate::engine::{Init, Module, Param, Result};
use crate::memory::Part;
use crate::spec::{MoeSpec, OffloadPart, RecomputePart};

/// The routed experts' weights, stacked over experts.
pub struct Experts<B: Backend> {
    /// Gate projections `[E, D, F]`, named `{prefix}.w1`.
    pub w1: Param<B>,
    /// Up projections `[E, D, F]`, named `{prefix}.w3`.
    pub w3: Param<B>,
    /// Down projections `[E, F, D]`, named `{prefix}.w2`.
    pub w2: Param<B>,
}

/// What the experts' backward needs from their forward.
pub struct ExpertsSaved<B: Backend> {
    x_nd: Tensor<B>,
    counts_e: Tensor<B>,
    gate_nf: Tensor<B>,
    up_nf: Tensor<B>,
    act_nf: Tensor<B>,
}

impl<B: Backend> ExpertsSaved<B> {
    /// Lists the saved tensors: the dispatched rows, the group sizes, the
    /// first projections (`expert_fc1`) and the activation (`moe_act`,
    /// which recompute drops and offload or fp8 may move).
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let e = Slot::kept(Part::RoutedExperts);
        f(e, &mut self.x_nd);
        f(e, &mut self.counts_e);
        f(e.offload(OffloadPart::ExpertFc1), &mut self.gate_nf);
        f(e.offload(OffloadPart::ExpertFc1), &mut self.up_nf);
        f(
            e.recompute(RecomputePart::MoeAct)
                .offload(OffloadPart::MoeAct),
            &mut self.act_nf,
        );
    }
}

impl<B: Backend> Experts<B> {
    /// The `moe.experts` SwiGLU experts of size `hidden → moe.expert_ffn →
    /// hidden`, normal(0, std) weights seeded by `(seed, name)`.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        moe: &MoeSpec,
        std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let (experts, ffn) = (moe.experts, moe.expert_ffn);
        let mk = |name: &str, shape: &[usize]| {
            init.normal(b, format!("{prefix}.{name}"), shape, std, dtype)
        };
        Ok(Experts {
            w1: mk("w1", &[experts, hidden, ffn])?,
            w3: mk("w3", &[experts, hidden, ffn])?,
            w2: mk("w2", &[experts, ffn, hidden])?,
        })
    }

    /// `x: [N, D]` grouped by `counts: [E]` (i32) → `[N, D]`.
    pub fn forward(
        &self,
        b: &B,
        x_nd: &Tensor<B>,
        counts_e: &Tensor<B>,
    ) -> Result<(Tensor<B>, ExpertsSaved<B>)> {
        let gate_nf = b.grouped_matmul(x_nd, &self.w1.value, counts_e, false)?;
        // The up projection stores SwiGLU's output beside its own.
        let (up_nf, act_nf) = b.grouped_matmul_swiglu(x_nd, &self.w3.value, &gate_nf, counts_e)?;
        let y_nd = b.grouped_matmul(&act_nf, &self.w2.value, counts_e, false)?;
        let saved = ExpertsSaved {
            x_nd: x_nd.clone(),
            counts_e: counts_e.clone(),
            gate_nf,
            up_nf,
            act_nf,
        };
        Ok((y_nd, saved))
    }

    /// Accumulates the weight gradients and returns `dx: [N, D]`.
    pub fn backward(
        &mut self,
        b: &B,
        dy_nd: &Tensor<B>,
        saved: ExpertsSaved<B>,
    ) -> Result<Tensor<B>> {
        let ExpertsSaved {
            x_nd,
            counts_e,
            gate_nf,
            up_nf,
            act_nf,
        } = saved;
        self.w2
            .accumulate(b, &b.grouped_matmul_weight_grad(&act_nf, dy_nd, &counts_e)?)?;
        // dact = dy · w2ᵀ goes straight into SwiGLU's backward (never stored).
        let (dgate_nf, dup_nf) =
            b.grouped_matmul_swiglu_backward(dy_nd, &self.w2.value, &gate_nf, &up_nf, &counts_e)?;
        self.w1.accumulate(
            b,
            &b.grouped_matmul_weight_grad(&x_nd, &dgate_nf, &counts_e)?,
        )?;
        self.w3
            .accumulate(b, &b.grouped_matmul_weight_grad(&x_nd, &dup_nf, &counts_e)?)?;
        // dx = dgate · w1ᵀ + dup · w3ᵀ as one product over both.
        Ok(b.grouped_matmul_sum2(
            &dgate_nf,
            &self.w1.value,
            &dup_nf,
            &self.w3.value,
            &counts_e,
            true,
        )?)
    }
}

impl<B: Backend> Module<B> for Experts<B> {
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

    use super::*;
    use crate::engine::moe::testutil::*;

    const D: usize = 3;

    fn check_experts(what: &str, counts: Vec<i32>, rows: usize) {
        let e = counts.len();
        let mut m = Experts::new(
            &Cpu,
            "x",
            D,
            &moe_spec(e, 1, 5, 0),
            0.6,
            crate::engine::Init::full(9),
            DType::F64,
        )
        .unwrap();
        let counts_e = ti32(counts, &[e]);
        let x = uniform(21, rows * D, 1.0);
        let r = uniform(22, rows * D, 1.0);
        let (y, saved) = m
            .forward(&Cpu, &t64(x.clone(), &[rows, D]), &counts_e)
            .unwrap();
        let dx = m
            .backward(&Cpu, &t64(r.clone(), &[rows, D]), saved)
            .unwrap();
        let total: i32 = counts_e_sum(&counts_e);
        // Padding rows past the groups come out zero and pass no gradient.
        let (yv, dxv) = (host(&y), host(&dx));
        for i in total as usize * D..rows * D {
            assert_eq!((yv[i], dxv[i]), (0.0, 0.0), "{what}: padding row value {i}");
        }
        check_grads(what, &mut m, &x, &[rows, D], &dxv, |m, x| {
            dot(&m.forward(&Cpu, x, &counts_e).unwrap().0, &r)
        });
    }

    fn counts_e_sum(c: &Tensor<Cpu>) -> i32 {
        host_i32(c).iter().sum()
    }

    #[test]
    fn experts_grad_ragged_with_empty_group_and_padding() {
        check_experts("ragged [3, 0, 2, 1] + 1 padding row", vec![3, 0, 2, 1], 7);
    }

    #[test]
    fn experts_grad_trailing_empty_groups() {
        check_experts("ragged [2, 3, 0, 0]", vec![2, 3, 0, 0], 5);
        check_experts("one group [0, 0, 4]", vec![0, 0, 4], 4);
    }
}
