//! Dispatch and combine (docs/ARCHITECTURE.md §4; Megatron-Core `moe/token_dispatcher.py`):
//! dispatch plans the token copies' expert-major rows (the rows themselves
//! are gathered by whoever reads them: the experts' products on one rank,
//! the all-to-all's send buffer under ep) and puts the routing weights in
//! the same order; the experts apply them in their activation (as
//! Megatron-Core's experts do with the permuted probs), so combine only sums
//! each token's expert outputs, and its backward is a gather of the output
//! gradient that the experts' products may read in place.
//!
//! Shapes: T tokens, D hidden, E experts, K top-k, N permuted rows.
//!
//! On one rank the all-to-all over the expert-parallel group is the identity;
//! the parallel runtime inserts it between permute and the experts.

use foldmoe_kernels::{Backend, DropPolicy, RoutingPlan, Tensor};

use super::experts::ExpertRows;
use crate::engine::activations::Slot;
use crate::engine::Result;
use crate::memory::Part;
use crate::spec::{CapacitySpec, DropPolicySpec, MoeSpec};

/// The token dispatcher of one MoE layer.
pub struct Dispatcher {
    experts: usize,
    top_k: usize,
    /// Capacity mode (`None`: dropless, every copy kept, `N = T·K`).
    capacity: Option<CapacitySpec>,
}

/// The routing plan of a batch: what combine and both backwards reuse.
pub struct DispatchSaved<B: Backend> {
    plan: RoutingPlan<B>,
    tokens: usize,
}

impl<B: Backend> DispatchSaved<B> {
    /// `[E]` i32: rows each expert holds (the grouped GEMM's group sizes).
    pub fn counts_e(&self) -> &Tensor<B> {
        &self.plan.counts
    }
}

impl<B: Backend> DispatchSaved<B> {
    /// Lists the routing plan's index tensors (routed experts, kept).
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let s = Slot::kept(Part::RoutedExperts);
        f(s, &mut self.plan.row_src);
        f(s, &mut self.plan.slot);
        f(s, &mut self.plan.counts);
    }
}

impl Dispatcher {
    /// The dispatcher of `moe` (dropless unless it has a capacity spec).
    pub fn new(moe: &MoeSpec) -> Self {
        Dispatcher {
            experts: moe.experts,
            top_k: moe.top_k,
            capacity: moe.capacity.clone(),
        }
    }

    /// Rows each expert may hold for `tokens` tokens (`None` when dropless).
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity
            .as_ref()
            .map(|c| c.capacity(tokens, self.top_k, self.experts))
    }

    /// Dispatch: plans the rows from `idx: [T, K]` (and the routing weights
    /// `weights: [T, K]`, which the probs drop policy ranks); `x: [T, D]` →
    /// the `[N, D]` rows, gathered, and the weights in their order `[N]`.
    #[allow(clippy::type_complexity)]
    pub fn dispatch<B: Backend>(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        idx_tk: &Tensor<B>,
        weights_tk: &Tensor<B>,
    ) -> Result<(ExpertRows<B>, Tensor<B>, DispatchSaved<B>)> {
        let (tokens, _) = x_td.dims2("Dispatcher::dispatch")?;
        let plan = match &self.capacity {
            None => b.routing_plan(idx_tk, self.experts)?,
            Some(c) => {
                let policy = match c.drop_policy {
                    DropPolicySpec::Probs => DropPolicy::Probs,
                    DropPolicySpec::Position => DropPolicy::Position,
                };
                let capacity = c.capacity(tokens, self.top_k, self.experts);
                b.capacity_plan(
                    idx_tk,
                    weights_tk,
                    self.experts,
                    capacity,
                    policy,
                    c.pad_to_capacity,
                )?
            }
        };
        self.dispatch_planned(b, x_td, weights_tk, plan)
    }

    /// Dispatch by a plan made elsewhere: the parallel runtime's capacity
    /// plan, decided over the whole micro-batch of every tp×cp rank.
    #[allow(clippy::type_complexity)]
    pub fn dispatch_planned<B: Backend>(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        weights_tk: &Tensor<B>,
        plan: RoutingPlan<B>,
    ) -> Result<(ExpertRows<B>, Tensor<B>, DispatchSaved<B>)> {
        let (tokens, _) = x_td.dims2("Dispatcher::dispatch_planned")?;
        let x_nd = ExpertRows::Gathered {
            source: x_td.clone(),
            row_src: plan.row_src.clone(),
            source_is_input: true,
        };
        let probs_n = b.permute_weights(weights_tk, &plan.slot, plan.row_src.numel())?;
        Ok((x_nd, probs_n, DispatchSaved { plan, tokens }))
    }

    /// Backward of dispatch: sums each token's copies, `[N, D] → [T, D]`.
    pub fn dispatch_backward<B: Backend>(
        &self,
        b: &B,
        dx_nd: &Tensor<B>,
        saved: DispatchSaved<B>,
    ) -> Result<Tensor<B>> {
        Ok(b.permute_backward(dx_nd, &saved.plan.row_src, saved.tokens)?)
    }

    /// Combine: `y_t = Σ_k y_nd[slot_tk]` over kept copies (the experts
    /// applied the routing weights), `→ [T, D]`.
    pub fn combine<B: Backend>(
        &self,
        b: &B,
        y_nd: &Tensor<B>,
        dispatch: &DispatchSaved<B>,
    ) -> Result<Tensor<B>> {
        Ok(b.unpermute(y_nd, &dispatch.plan.slot)?)
    }

    /// Backward of combine: `dy: [T, D]` → each row's token gradient
    /// `[N, D]` (zero on padding rows), gathered by whoever reads it.
    pub fn combine_backward<B: Backend>(
        &self,
        dy_td: &Tensor<B>,
        dispatch: &DispatchSaved<B>,
    ) -> ExpertRows<B> {
        ExpertRows::Gathered {
            source: dy_td.clone(),
            row_src: dispatch.plan.row_src.clone(),
            source_is_input: false,
        }
    }

    /// Backward of the weights' permutation in dispatch: `dprobs: [N]` →
    /// `dweights: [T, K]`, zero for dropped copies.
    pub fn weights_backward<B: Backend>(
        &self,
        b: &B,
        dprobs_n: &Tensor<B>,
        dispatch: &DispatchSaved<B>,
    ) -> Result<Tensor<B>> {
        Ok(b.permute_weights_backward(dprobs_n, &dispatch.plan.slot)?)
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::ElementwiseOps;

    use super::*;
    use crate::engine::moe::testutil::*;

    const T: usize = 6;
    const D: usize = 3;
    const E: usize = 4;
    const K: usize = 2;

    /// Experts 0 and 1 are popular (5 and 4 copies), expert 3 gets none.
    fn idx_tk() -> Tensor<Cpu> {
        ti32(vec![0, 1, 1, 0, 0, 2, 1, 0, 2, 0, 0, 1], &[T, K])
    }

    /// Dispatch, scale every row by a fixed `c_nd` and by its permuted
    /// routing weight (as the experts do), combine: `Σ y ⊙ R`, with
    /// gradients for `x` and the routing weights; checks that drops happen
    /// exactly when capacity mode is on.
    fn check_dispatch(what: &str, capacity: Option<CapacitySpec>) {
        let mut moe = moe_spec(E, K, 3, 0);
        let drops = capacity.is_some();
        moe.capacity = capacity;
        let disp = Dispatcher::new(&moe);
        let idx = idx_tk();
        let x = uniform(41, T * D, 1.0);
        // Distinct positive weights, far apart so the probs policy's ordering
        // survives the finite-difference perturbation.
        let w: Vec<f64> = (0..T * K)
            .map(|i| 0.1 + 0.07 * ((i * 5) % 12) as f64)
            .collect();
        let r = uniform(42, T * D, 1.0);
        let run = |x: &[f64], w: &[f64]| {
            let w_tk = t64(w.to_vec(), &[T, K]);
            let (x_nd, p_n, saved) = disp
                .dispatch(&Cpu, &t64(x.to_vec(), &[T, D]), &idx, &w_tk)
                .unwrap();
            let x_nd = x_nd.materialize(&Cpu).unwrap();
            let n = x_nd.shape()[0];
            let c_nd = t64(uniform(43, n * D, 1.0), &[n, D]);
            let xc_nd = Cpu.mul(&x_nd, &c_nd).unwrap();
            let y_nd = Cpu.mul_rows(&xc_nd, &p_n).unwrap();
            let y_td = disp.combine(&Cpu, &y_nd, &saved).unwrap();
            (y_td, saved, xc_nd, p_n, c_nd)
        };
        let (_, saved, xc_nd, p_n, c_nd) = run(&x, &w);
        let dropped = host_i32(&saved.plan.slot)
            .iter()
            .filter(|&&s| s < 0)
            .count();
        assert_eq!(dropped > 0, drops, "{what}: {dropped} copies dropped");
        let dy_nd = disp
            .combine_backward(&t64(r.clone(), &[T, D]), &saved)
            .materialize(&Cpu)
            .unwrap();
        let dp_n = Cpu.dot_rows(&dy_nd, &xc_nd).unwrap();
        let dw_tk = disp.weights_backward(&Cpu, &dp_n, &saved).unwrap();
        let dx_nd = Cpu
            .mul_rows(&Cpu.mul(&dy_nd, &c_nd).unwrap(), &p_n)
            .unwrap();
        let dx = disp.dispatch_backward(&Cpu, &dx_nd, saved).unwrap();
        assert_grad(&format!("{what}: x"), &x, &host(&dx), TOL, |xv| {
            dot(&run(xv, &w).0, &r)
        });
        assert_grad(&format!("{what}: weights"), &w, &host(&dw_tk), TOL, |wv| {
            dot(&run(&x, wv).0, &r)
        });
    }

    fn capacity(policy: DropPolicySpec, pad: bool) -> Option<CapacitySpec> {
        // capacity = ceil(6·2/4 · 0.75) = 3: experts 0 and 1 overflow.
        Some(CapacitySpec {
            factor: 0.75,
            drop_policy: policy,
            pad_to_capacity: pad,
        })
    }

    #[test]
    fn dispatcher_grad_dropless() {
        check_dispatch("dropless", None);
    }

    #[test]
    fn dispatcher_grad_capacity_probs() {
        check_dispatch("capacity probs", capacity(DropPolicySpec::Probs, false));
        check_dispatch(
            "capacity probs padded",
            capacity(DropPolicySpec::Probs, true),
        );
    }

    #[test]
    fn dispatcher_grad_capacity_position() {
        check_dispatch(
            "capacity position",
            capacity(DropPolicySpec::Position, false),
        );
        check_dispatch(
            "capacity position padded",
            capacity(DropPolicySpec::Position, true),
        );
    }

    #[test]
    fn dispatcher_capacity_comes_from_the_spec() {
        let mut moe = moe_spec(E, K, 3, 0);
        assert_eq!(Dispatcher::new(&moe).capacity(T), None);
        moe.capacity = capacity(DropPolicySpec::Probs, true);
        assert_eq!(Dispatcher::new(&moe).capacity(T), Some(3));
        let disp = Dispatcher::new(&moe);
        let w = t64(vec![0.5; T * K], &[T, K]);
        let x = t64(vec![1.0; T * D], &[T, D]);
        let (x_nd, _, saved) = disp.dispatch(&Cpu, &x, &idx_tk(), &w).unwrap();
        assert_eq!(x_nd.materialize(&Cpu).unwrap().shape(), &[E * 3, D]);
        assert_eq!(host_i32(saved.counts_e()), vec![3; E]);
    }
}
