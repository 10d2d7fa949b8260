//! The Mixture-of-Experts layer (DESIGN §4; Megatron-Core `moe/moe_layer.py`):
//! route → dispatch → compute → combine, plus the shared experts.
//!
//! Shapes: T tokens (`batch·seq_len`, each sequence's tokens consecutive),
//! D hidden, E experts, K top-k, F expert ffn, N permuted rows.
//!
//! Each stage lives in its own file with its forward next to its backward:
//! [`router`] (scores, top-k, auxiliary losses in [`loss`]), [`dispatcher`]
//! (dispatch and combine), [`experts`] (grouped-GEMM SwiGLU), [`shared`].
//! Nothing here reads the device: data-dependent sizes (tokens per expert)
//! stay device tensors; T, D, E, K and the capacity come from shapes and spec.
//!
//! Parameter names under `prefix`: `router.weight [D, E]`,
//! `experts.{w1, w3} [E, D, F]`, `experts.w2 [E, F, D]`,
//! `shared_experts.{w1, w3} [D, Fs]`, `shared_experts.w2 [Fs, D]`,
//! `shared_experts.gate [D, 1]`. The expert bias (`router.expert_bias [E]`)
//! is a buffer, read and set through [`MoeLayer::expert_bias`].

pub mod dispatcher;
pub mod experts;
pub mod loss;
mod ops;
pub mod router;
pub mod shared;
#[cfg(test)]
mod testutil;

use foldmoe_kernels::{Backend, DType, Tensor};

use self::dispatcher::{CombineSaved, DispatchSaved, Dispatcher};
use self::experts::{Experts, ExpertsSaved};
use self::router::{Router, RouterSaved};
use self::shared::{SharedExperts, SharedSaved};
use crate::engine::{EngineError, Module, Param, Result};
use crate::spec::{LoadBalance, MoeSpec};

/// An MoE layer: router, dispatcher, routed experts, optional shared experts.
pub struct MoeLayer<B: Backend> {
    /// The router (weight `{prefix}.router.weight`).
    pub router: Router<B>,
    /// The token dispatcher (dropless or capacity mode).
    pub dispatcher: Dispatcher,
    /// The routed experts (`{prefix}.experts.*`).
    pub experts: Experts<B>,
    /// The shared experts (`{prefix}.shared_experts.*`), when `shared_ffn > 0`.
    pub shared: Option<SharedExperts<B>>,
    hidden: usize,
    dtype: DType,
    load_balance: LoadBalance,
}

/// What the layer's backward needs from its forward, stage by stage.
pub struct MoeSaved<B: Backend> {
    router: RouterSaved<B>,
    dispatch: DispatchSaved<B>,
    experts: ExpertsSaved<B>,
    combine: CombineSaved<B>,
    shared: Option<SharedSaved<B>>,
}

/// Router statistics of one forward, for the loss and for logging.
pub struct MoeStats<B: Backend> {
    /// `[1]`: load-balancing loss, coefficient applied (0 when off).
    pub aux_loss: Tensor<B>,
    /// `[1]`: z-loss, coefficient applied (0 when off).
    pub z_loss: Tensor<B>,
    /// `[E]` float: token copies routed to each expert (the router's choice,
    /// before any capacity drop).
    pub load: Tensor<B>,
}

impl<B: Backend> MoeLayer<B> {
    /// A layer for `spec` on hidden size `hidden`, weights normal(0, `init_std`)
    /// seeded by `(seed, name)`; the expert bias (if any) starts at zero.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        spec: &MoeSpec,
        init_std: f64,
        seed: u64,
        dtype: DType,
    ) -> Result<Self> {
        if hidden == 0 || spec.experts == 0 || spec.top_k == 0 || spec.top_k > spec.experts {
            return Err(EngineError::Invalid(format!(
                "MoeLayer::new({prefix}): hidden = {hidden}, experts = {}, top_k = {}; \
                 need hidden ≥ 1 and 1 ≤ top_k ≤ experts",
                spec.experts, spec.top_k
            )));
        }
        let shared = if spec.shared_ffn > 0 {
            let p = format!("{prefix}.shared_experts");
            Some(SharedExperts::new(
                b, &p, hidden, spec, init_std, seed, dtype,
            )?)
        } else {
            None
        };
        Ok(MoeLayer {
            router: Router::new(
                b,
                &format!("{prefix}.router"),
                hidden,
                spec,
                init_std,
                seed,
                dtype,
            )?,
            dispatcher: Dispatcher::new(spec),
            experts: Experts::new(
                b,
                &format!("{prefix}.experts"),
                hidden,
                spec,
                init_std,
                seed,
                dtype,
            )?,
            shared,
            hidden,
            dtype,
            load_balance: spec.router.load_balance,
        })
    }

    /// `x: [T, D] → [T, D]`, T = batch·seq_len tokens (each sequence's
    /// tokens consecutive; `seq_len` splits the batch for `seq_aux`).
    pub fn forward(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        seq_len: usize,
    ) -> Result<(Tensor<B>, MoeSaved<B>, MoeStats<B>)> {
        let n_seq = self.check_input(x_td, seq_len)?;
        let (routing, router) = self.router.forward(b, x_td, n_seq)?;
        let (x_nd, dispatch) =
            self.dispatcher
                .dispatch(b, x_td, &routing.idx_tk, &routing.weights_tk)?;
        let (y_nd, experts) = self.experts.forward(b, &x_nd, dispatch.counts_e())?;
        let (mut y_td, combine) =
            self.dispatcher
                .combine(b, y_nd, &dispatch, &routing.weights_tk)?;
        let shared = match &self.shared {
            Some(s) => {
                let (ys_td, saved) = s.forward(b, x_td)?;
                b.axpy(&mut y_td, 1.0, &ys_td)?;
                Some(saved)
            }
            None => None,
        };
        let saved = MoeSaved {
            router,
            dispatch,
            experts,
            combine,
            shared,
        };
        let stats = MoeStats {
            aux_loss: routing.aux_loss,
            z_loss: routing.z_loss,
            load: routing.load_e,
        };
        Ok((y_td, saved, stats))
    }

    /// Accumulates every parameter gradient from `dy: [T, D]`, plus
    /// `loss_scale` × the gradient of `aux_loss + z_loss`; returns `dx: [T, D]`.
    pub fn backward(
        &mut self,
        b: &B,
        dy_td: &Tensor<B>,
        saved: MoeSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let MoeSaved {
            router,
            dispatch,
            experts,
            combine,
            shared,
        } = saved;
        let dx_shared_td = match (shared, self.shared.as_mut()) {
            (Some(saved), Some(s)) => Some(s.backward(b, dy_td, saved)?),
            _ => None,
        };
        let (dy_nd, dweights_tk) = self
            .dispatcher
            .combine_backward(b, dy_td, combine, &dispatch)?;
        let dx_nd = self.experts.backward(b, &dy_nd, experts)?;
        let mut dx_td = self.dispatcher.dispatch_backward(b, &dx_nd, dispatch)?;
        let dx_router_td = self.router.backward(b, &dweights_tk, router, loss_scale)?;
        b.axpy(&mut dx_td, 1.0, &dx_router_td)?;
        if let Some(dx) = dx_shared_td {
            b.axpy(&mut dx_td, 1.0, &dx)?;
        }
        Ok(dx_td)
    }

    /// Aux-loss-free balancing after a global batch: `b_e += rate·sign(mean_load
    /// − load_e)` for `load_e: [E]` (float, or i32 counts). A no-op when the
    /// spec has no expert bias.
    pub fn update_expert_bias(&mut self, b: &B, load_e: &Tensor<B>) -> Result<()> {
        self.router.update_expert_bias(b, load_e)
    }

    /// The expert bias `[E]` (for checkpoints), if the spec has one.
    pub fn expert_bias(&self) -> Option<&Tensor<B>> {
        self.router.expert_bias()
    }

    /// Replaces the expert bias (checkpoint loading): `[E]` in the layer's dtype;
    /// an error when the spec has no expert bias.
    pub fn set_expert_bias(&mut self, bias_e: Tensor<B>) -> Result<()> {
        self.router.set_expert_bias(bias_e)
    }

    /// Validates `x` and returns the number of sequences in the batch.
    fn check_input(&self, x_td: &Tensor<B>, seq_len: usize) -> Result<usize> {
        let shape = x_td.shape();
        if shape.len() != 2 || shape[1] != self.hidden {
            return Err(EngineError::Invalid(format!(
                "MoeLayer::forward: x has shape {shape:?}, expected [T, {}] (tokens × hidden)",
                self.hidden
            )));
        }
        if x_td.dtype() != self.dtype {
            return Err(EngineError::Invalid(format!(
                "MoeLayer::forward: x has dtype {:?}, the layer's parameters are {:?}",
                x_td.dtype(),
                self.dtype
            )));
        }
        let t = shape[0];
        if t == 0 {
            return Err(EngineError::Invalid(format!(
                "MoeLayer::forward: x has no tokens (shape {shape:?}); pass at least one"
            )));
        }
        if self.load_balance == LoadBalance::SeqAux {
            if seq_len == 0 || !t.is_multiple_of(seq_len) {
                return Err(EngineError::Invalid(format!(
                    "MoeLayer::forward: seq_aux needs T = batch·seq_len, but T = {t} is not \
                     a multiple of seq_len = {seq_len}"
                )));
            }
            return Ok(t / seq_len);
        }
        Ok(1)
    }
}

impl<B: Backend> Module<B> for MoeLayer<B> {
    fn visit_params(&self, f: &mut dyn FnMut(&Param<B>)) {
        f(&self.router.weight);
        self.experts.visit_params(f);
        if let Some(s) = &self.shared {
            s.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        f(&mut self.router.weight);
        self.experts.visit_params_mut(f);
        if let Some(s) = &mut self.shared {
            s.visit_params_mut(f);
        }
    }
}
