//! Dispatch and combine (DESIGN §4; Megatron-Core `moe/token_dispatcher.py`):
//! dispatch permutes the token copies into expert-major rows, combine brings
//! the expert outputs back and sums them weighted by the routing weights.
//!
//! Shapes: T tokens, D hidden, E experts, K top-k, N permuted rows.
//!
//! On one rank the all-to-all over the expert-parallel group is the identity;
//! the parallel runtime inserts it between permute and the experts.

use foldmoe_kernels::{Backend, DropPolicy, RoutingPlan, Tensor};

use crate::engine::Result;
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

/// What combine's backward needs.
pub struct CombineSaved<B: Backend> {
    y_nd: Tensor<B>,
    weights_tk: Tensor<B>,
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

    /// Dispatch: plans the rows from `idx: [T, K]` (and `probs: [T, K]` for
    /// the probs drop policy) and gathers `x: [T, D]` into `[N, D]`.
    pub fn dispatch<B: Backend>(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        idx_tk: &Tensor<B>,
        probs_tk: &Tensor<B>,
    ) -> Result<(Tensor<B>, DispatchSaved<B>)> {
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
                    probs_tk,
                    self.experts,
                    capacity,
                    policy,
                    c.pad_to_capacity,
                )?
            }
        };
        let x_nd = b.permute(x_td, &plan.row_src)?;
        Ok((x_nd, DispatchSaved { plan, tokens }))
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

    /// Combine: `y_t = Σ_k w_tk · y_nd[slot_tk]` over kept copies, `→ [T, D]`.
    pub fn combine<B: Backend>(
        &self,
        b: &B,
        y_nd: Tensor<B>,
        dispatch: &DispatchSaved<B>,
        weights_tk: &Tensor<B>,
    ) -> Result<(Tensor<B>, CombineSaved<B>)> {
        let y_td = b.unpermute(&y_nd, &dispatch.plan.slot, weights_tk)?;
        let saved = CombineSaved {
            y_nd,
            weights_tk: weights_tk.clone(),
        };
        Ok((y_td, saved))
    }

    /// Backward of combine: `(dy: [N, D], dweights: [T, K])`; dropped copies
    /// get zero weight gradient.
    pub fn combine_backward<B: Backend>(
        &self,
        b: &B,
        dy_td: &Tensor<B>,
        saved: CombineSaved<B>,
        dispatch: &DispatchSaved<B>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        Ok(b.unpermute_backward(dy_td, &saved.y_nd, &dispatch.plan.slot, &saved.weights_tk)?)
    }
}
