//! The Mixture-of-Experts layer (docs/ARCHITECTURE.md §4; Megatron-Core `moe/moe_layer.py`
//! with its `MoEAlltoAllTokenDispatcher`): route → dispatch → compute →
//! combine, plus the shared experts, over the folded expert mesh. One rank
//! is the mesh of one (every group `[0]`, every collective the identity).
//!
//! ```text
//! route   this rank's sequence-parallel rows (router replicated over tp;
//!         balancing statistics summed over tp×cp, so the loss is the micro-batch's)
//! permute copies into expert-major order over all E experts, and their
//!         routing weights with them
//! a2a-v   over ep: rows for experts [j·E/ep, (j+1)·E/ep) go to ep rank j
//!         (the weights alongside)
//! gather  within etp (the etp ranks hold the same experts, ffn split)
//! sort    received (source, expert) blocks into expert-major order
//! compute grouped GEMM over the E/ep local experts (ffn/etp each), the
//!         routing weights applied in the SwiGLU
//! back    the same steps reversed: unsort, sum over etp and keep own rows,
//!         a2a-v back, un-permute (a sum of each token's copies)
//! shared  experts: tensor-parallel like the dense MLP
//! ```
//!
//! Shapes: T tokens (`batch·seq_len`, each sequence's tokens consecutive),
//! D hidden, E experts, K top-k, F expert ffn, N permuted rows.
//!
//! Each stage lives in its own file with its forward next to its backward:
//! [`router`] (scores, top-k, auxiliary losses in [`loss`]), [`dispatcher`]
//! (dispatch and combine), [`experts`] (grouped-GEMM SwiGLU), [`shared`].
//! On one rank nothing here reads the device: data-dependent sizes (tokens
//! per expert) stay device tensors. With ep or etp > 1 the token counts of
//! the all-to-all are read on the host, as Megatron-Core does before its
//! all-to-all-v: the buffer sizes depend on them.
//!
//! Capacity mode keeps, for every micro-batch, exactly the copies one rank
//! would keep: the router decisions are gathered over tp×cp and the plan is
//! made over the whole micro-batch (Megatron-Core plans per
//! sequence-parallel shard, so its drops change with tp; ours do not).
//! Padding to capacity is not applied across ranks: padding rows are zeros
//! and change no output or gradient.
//!
//! Parameter names under `prefix`: `router.weight [D, E]`,
//! `experts.{w1, w3} [E, D, F]`, `experts.w2 [E, F, D]`,
//! `shared_experts.{w1, w3} [D, Fs]`, `shared_experts.w2 [Fs, D]`,
//! `shared_experts.gate [D, 1]` (global shapes; a rank holds its shard
//! plan's blocks). The expert bias (`router.expert_bias [E]`) is a buffer,
//! read and set through [`MoeLayer::expert_bias`].
//!
//! `MoeStats::load` counts the router's choices before any capacity drop,
//! which is what both the balancing loss and the expert-bias update balance.

pub mod dispatcher;
pub mod experts;
pub mod loss;
mod ops;
pub mod router;
pub mod shared;
#[cfg(test)]
mod testutil;

use std::sync::Mutex;

use foldmoe_kernels::comm::Pending;
use foldmoe_kernels::{Backend, DType, DropPolicy, HostData, RoutingPlan, Tensor};

use self::dispatcher::{DispatchSaved, Dispatcher};
use self::experts::{ExpertRows, Experts, ExpertsSaved};
use self::loss::TokenShard;
use self::router::{Router, RouterSaved};
use self::shared::{SharedExperts, SharedSaved};
use crate::engine::activations::Slot;
use crate::engine::parallel::shard::upload_as;
use crate::engine::parallel::{Exec, LayerGroups};
use crate::engine::{drive, EngineError, Init, Module, Param, Result, Step};
use crate::layout::cp_positions;
use crate::spec::{DropPolicySpec, LoadBalance, ModelSpec, MoeSpec};

/// One rank's part of an MoE layer: the router, the dispatcher, its routed
/// experts and its shard of the shared experts.
pub struct MoeLayer<B: Backend> {
    /// The router over all E experts (replicated; `{prefix}.router.weight`).
    pub router: Router<B>,
    /// This rank's experts `[E/ep, …]`, their ffn split over etp (`{prefix}.experts.*`).
    pub experts: Experts<B>,
    /// The shared experts, ffn split over tp (`{prefix}.shared_experts.*`),
    /// when `shared_ffn > 0`.
    pub shared: Option<SharedExperts<B>>,
    /// The token dispatcher (dropless or capacity mode).
    pub dispatcher: Dispatcher,
    spec: MoeSpec,
    groups: LayerGroups,
    hidden: usize,
    dtype: DType,
    /// `global_aux`: the stage-summed loads `[1, E]` of each micro-batch of
    /// the current step, by micro-batch index (see [`MoeLayer::begin_step`]).
    step_loads: Mutex<Vec<Option<Tensor<B>>>>,
}

/// The token exchange of one forward: sizes and the sort order.
struct Exchange<B: Backend> {
    /// Rows sent to each ep rank.
    send_rows: Vec<usize>,
    /// Rows received from each ep rank.
    recv_rows: Vec<usize>,
    /// Rows of every etp member's received block, in etp order.
    etp_rows: Vec<usize>,
    /// `[M]` i32: the expert-major order as rows of the etp-gathered block.
    order: Tensor<B>,
}

/// A layer's output, saved state and router statistics.
pub type MoeOut<B> = (Tensor<B>, MoeSaved<B>, MoeStats<B>);

/// A forward of the layer paused at an exchange ([`MoeLayer::forward_start`]):
/// what it has computed so far and the collectives in flight.
pub struct MoeForward<B: Backend> {
    /// Where the forward stands; `None` once it has finished.
    stage: Option<ForwardStage<B>>,
    router: RouterSaved<B>,
    dispatch: DispatchSaved<B>,
    stats: MoeStats<B>,
    /// The shared experts' output (this rank's rows) and state.
    shared: Option<(Tensor<B>, SharedSaved<B>)>,
}

/// The exchange a paused forward waits for.
enum ForwardStage<B: Backend> {
    /// The rows and their routing weights are on their way to the experts'
    /// ranks; every ep rank's counts `[ep, E]` (device and host) came first.
    Dispatching {
        x_recv: Pending<B>,
        p_recv: Pending<B>,
        send_rows: Vec<usize>,
        recv_rows: Vec<usize>,
        ep_counts: (Tensor<B>, Vec<i32>),
    },
    /// With etp > 1: the arrived rows, their weights and the counts are
    /// being gathered from the other etp members.
    Gathering {
        counts: Pending<B>,
        x_block: Pending<B>,
        p_block: Pending<B>,
        send_rows: Vec<usize>,
        recv_rows: Vec<usize>,
    },
    /// The experts' outputs are on their way back.
    Combining {
        y_nd: Pending<B>,
        exchange: Exchange<B>,
        experts: ExpertsSaved<B>,
    },
}

/// The dispatch exchange once it has arrived (and been gathered over etp).
struct Arrived<B: Backend> {
    /// Every etp member's received rows, in etp order.
    x_block: Tensor<B>,
    /// Their routing weights `[M, 1]`.
    p_block: Tensor<B>,
    send_rows: Vec<usize>,
    recv_rows: Vec<usize>,
    /// Every etp member's `[ep, E]` counts, `[etp·ep, E]`.
    all_counts: Vec<i32>,
}

/// A backward of the layer paused at an exchange ([`MoeLayer::backward_start`]).
pub struct MoeBackward<B: Backend> {
    /// Where the backward stands; `None` once it has finished.
    stage: Option<BackwardStage<B>>,
    router: RouterSaved<B>,
    dispatch: DispatchSaved<B>,
    /// The shared experts' part of the input gradient.
    dx_shared: Option<Tensor<B>>,
    loss_scale: f64,
}

/// The exchange a paused backward waits for.
enum BackwardStage<B: Backend> {
    /// The output gradient is on its way to the experts' ranks.
    Dispatching {
        dy_recv: Pending<B>,
        exchange: Exchange<B>,
        experts: Box<ExpertsSaved<B>>,
    },
    /// With etp > 1: the arrived output gradient is being gathered from the
    /// other etp members.
    Gathering {
        dy_block: Pending<B>,
        exchange: Exchange<B>,
        experts: Box<ExpertsSaved<B>>,
    },
    /// The rows' and routing weights' gradients are on their way back.
    Combining {
        dx_nd: Pending<B>,
        dp_nd: Pending<B>,
    },
}

/// What the layer's backward needs from its forward, stage by stage.
pub struct MoeSaved<B: Backend> {
    router: RouterSaved<B>,
    dispatch: DispatchSaved<B>,
    exchange: Option<Exchange<B>>,
    experts: ExpertsSaved<B>,
    shared: Option<SharedSaved<B>>,
}

/// Router statistics of one forward, for the loss and for logging.
pub struct MoeStats<B: Backend> {
    /// `[1]`: load-balancing loss, coefficient applied (0 when off); this
    /// rank's part (their sum over tp×cp is the micro-batch's).
    pub aux_loss: Tensor<B>,
    /// `[1]`: z-loss, coefficient applied (0 when off); this rank's part.
    pub z_loss: Tensor<B>,
    /// `[E]` float: this rank's token copies routed to each expert (the
    /// router's choice, before any capacity drop).
    pub load: Tensor<B>,
}

impl<B: Backend> MoeSaved<B> {
    /// Lists the saved tensors with their slots, in forward order: router,
    /// routing plan, exchange order, experts (with the rows' routing
    /// weights), shared experts.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        use crate::memory::Part;
        self.router.visit_saved(f);
        self.dispatch.visit_saved(f);
        if let Some(x) = &mut self.exchange {
            f(Slot::kept(Part::RoutedExperts), &mut x.order);
        }
        self.experts.visit_saved(f);
        if let Some(s) = &mut self.shared {
            s.visit_saved(f);
        }
    }

    /// The routed copies kept per expert `[E]` (i32) of the forward.
    pub fn kept_per_expert(&self) -> &Tensor<B> {
        self.dispatch.counts_e()
    }
}

impl<B: Backend> MoeLayer<B> {
    /// The layer `spec` of `model` (hidden size, init std) under `prefix`,
    /// its parameters drawn by `init` (this rank's blocks under its shard
    /// plan, or whole tensors), communicating over `groups`; the expert bias
    /// (if any) starts at zero.
    pub fn new(
        b: &B,
        prefix: &str,
        model: &ModelSpec,
        spec: &MoeSpec,
        init: Init<'_>,
        dtype: DType,
        groups: LayerGroups,
    ) -> Result<Self> {
        let (hidden, init_std) = (model.hidden, model.init_std);
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
                b, &p, hidden, spec, init_std, init, dtype,
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
                init,
                dtype,
            )?,
            dispatcher: Dispatcher::new(spec),
            experts: Experts::new(
                b,
                &format!("{prefix}.experts"),
                hidden,
                spec,
                init_std,
                init,
                dtype,
            )?,
            shared,
            spec: spec.clone(),
            groups,
            hidden,
            dtype,
            step_loads: Mutex::new(Vec::new()),
        })
    }

    /// Forgets the loads `global_aux` kept from the previous step's
    /// micro-batches, and starts the experts' step of `micro_batches`; the
    /// trainer calls it before a step's first forward.
    pub fn begin_step(&self, micro_batches: usize) {
        if let Ok(mut loads) = self.step_loads.lock() {
            loads.clear();
        }
        self.experts.begin_step(micro_batches);
    }

    /// Ends a step's backward passes: what the experts kept for the step
    /// (their fp8 weights) goes before the update.
    pub fn end_step(&self) {
        self.experts.end_step();
    }

    /// `global_aux`'s routed-copy counts `[1, E]` for micro-batch `micro`
    /// from this rank's `counts_1e`: summed over the stage (every tp, cp and
    /// dp rank routing tokens of this layer), then averaged over the step's
    /// micro-batches so far (Megatron-Core's running `global_tokens_per_expert
    /// / ga_steps`), and divided by dp so that `f_e = counts / (T·K)` with T
    /// this dp rank's micro-batch tokens is the share over the global
    /// micro-batch of dp·T tokens. Keyed by micro-batch, so the rerun of
    /// recompute sees what its forward saw; outside a step (`micro` None)
    /// only this micro-batch counts.
    fn global_counts(&self, ctx: &Exec<B>, counts_1e: &Tensor<B>) -> Result<Tensor<B>> {
        let b = ctx.b;
        let g = &self.groups;
        let dp = g.stage.size() / g.tp_cp.size().max(1);
        let summed = ctx.sum_over(&g.stage, counts_1e)?;
        let Some(micro) = ctx.micro else {
            return Ok(b.scale(&summed, 1.0 / dp as f64)?);
        };
        let mut loads = self.step_loads.lock().map_err(|_| {
            EngineError::Invalid(
                "global_aux: the step's loads were poisoned by a failed forward".into(),
            )
        })?;
        if loads.len() <= micro {
            loads.resize(micro + 1, None);
        }
        loads[micro] = Some(summed);
        let mut total: Option<Tensor<B>> = None;
        for (m, l) in loads[..=micro].iter().enumerate() {
            let l = l.as_ref().ok_or_else(|| {
                EngineError::Invalid(format!(
                    "global_aux: micro-batch {micro} ran before micro-batch {m} of the same step"
                ))
            })?;
            match &mut total {
                Some(t) => b.axpy(t, 1.0, l)?,
                None => total = Some(l.clone()),
            }
        }
        let total = total.ok_or_else(|| EngineError::Invalid("global_aux: no loads".into()))?;
        Ok(b.scale(&total, 1.0 / ((micro + 1) * dp) as f64)?)
    }

    /// `x: [T/(tp·cp), D]` (this rank's rows of a micro-batch of `tokens`) →
    /// `[T/(tp·cp), D]`: [`Self::forward_start`] and its resumptions run
    /// back to back.
    pub fn forward(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<MoeOut<B>> {
        let first = self.forward_start(ctx, x_td, seq_len, tokens)?;
        drive(first, |f| self.forward_resume(ctx, f))
    }

    /// The forward up to its first exchange: route, plan the rows, and
    /// under ep / etp start sending them (and their routing weights) to the
    /// experts' ranks, then run the shared experts while they travel
    /// (Megatron-Core's shared-expert overlap). On one expert rank there is
    /// nothing to wait for and the forward finishes here.
    pub fn forward_start(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<Step<MoeForward<B>, MoeOut<B>>> {
        let b = ctx.b;
        let g = &self.groups;
        let t_local = self.check_input(x_td, seq_len, tokens)?;
        // Rows numbered within this cp rank's tokens: B sequences of S/cp each.
        let shard = TokenShard {
            offset: g.tp_index * t_local,
            total: tokens,
            segment: if self.spec.router.load_balance == LoadBalance::SeqAux {
                seq_len
            } else {
                tokens
            },
            cp: g.cp.size(),
        };
        let local = |x: &Tensor<B>| ctx.sum_over(&g.tp_cp, x);
        let global = |x: &Tensor<B>| self.global_counts(ctx, x);
        let reduce: &dyn Fn(&Tensor<B>) -> Result<Tensor<B>> =
            if self.spec.router.load_balance == LoadBalance::GlobalAux {
                &global
            } else {
                &local
            };
        let (routing, router) = self.router.forward_shard(b, x_td, shard, reduce)?;
        let (idx, weights) = (&routing.idx_tk, &routing.weights_tk);
        let (x_nd, probs_n, dispatch) = match &self.spec.capacity {
            None => self.dispatcher.dispatch(b, x_td, idx, weights)?,
            Some(_) => {
                let plan = self.capacity_plan(ctx, idx, weights, shard, seq_len)?;
                self.dispatcher.dispatch_planned(b, x_td, weights, plan)?
            }
        };
        let stats = MoeStats {
            aux_loss: routing.aux_loss,
            z_loss: routing.z_loss,
            load: routing.load_e,
        };
        let mut fwd = MoeForward {
            stage: None,
            router,
            dispatch,
            stats,
            shared: None,
        };
        if g.ep.size() == 1 && g.etp.size() == 1 {
            let (y_nd, experts) = self.experts.forward(
                b,
                x_nd,
                &probs_n,
                fwd.dispatch.counts_e(),
                ctx.micro.is_some(),
            )?;
            // After the routed experts: nothing to overlap, and their
            // output is not held through the experts' peak.
            fwd.shared = self.shared_forward(ctx, x_td)?;
            return Ok(Step::Done(
                self.forward_finish(ctx, fwd, y_nd, None, experts)?,
            ));
        }
        fwd.stage = Some(self.dispatch_start(ctx, x_nd, &probs_n, fwd.dispatch.counts_e())?);
        fwd.shared = self.shared_forward(ctx, x_td)?;
        Ok(Step::Pending(fwd))
    }

    /// The forward from its last exchange: once the rows have arrived (with
    /// etp > 1, their gathers over etp start and the forward pauses again),
    /// the experts run and their outputs start back; once those have
    /// arrived, combine finishes the layer.
    pub fn forward_resume(
        &self,
        ctx: &Exec<B>,
        mut fwd: MoeForward<B>,
    ) -> Result<Step<MoeForward<B>, MoeOut<B>>> {
        match fwd.stage.take() {
            Some(ForwardStage::Dispatching {
                x_recv,
                p_recv,
                send_rows,
                recv_rows,
                ep_counts,
            }) => {
                let (x_recv, p_recv) = (x_recv.wait()?, p_recv.wait()?);
                let g = &self.groups;
                fwd.stage = Some(if g.etp.size() > 1 {
                    // The etp members hold the same experts, ffn split:
                    // each needs every member's rows.
                    let (b, comm) = (ctx.b, ctx.comm);
                    ForwardStage::Gathering {
                        counts: comm.all_gather_start(b, &g.etp, &ep_counts.0)?,
                        x_block: comm.all_gather_start(b, &g.etp, &x_recv)?,
                        p_block: comm.all_gather_start(b, &g.etp, &p_recv)?,
                        send_rows,
                        recv_rows,
                    }
                } else {
                    let arrived = Arrived {
                        x_block: x_recv,
                        p_block: p_recv,
                        send_rows,
                        recv_rows,
                        all_counts: ep_counts.1,
                    };
                    self.experts_forward(ctx, arrived)?
                });
                Ok(Step::Pending(fwd))
            }
            Some(ForwardStage::Gathering {
                counts,
                x_block,
                p_block,
                send_rows,
                recv_rows,
            }) => {
                let arrived = Arrived {
                    all_counts: ctx.b.download(&counts.wait()?)?.to_i32()?,
                    x_block: x_block.wait()?,
                    p_block: p_block.wait()?,
                    send_rows,
                    recv_rows,
                };
                fwd.stage = Some(self.experts_forward(ctx, arrived)?);
                Ok(Step::Pending(fwd))
            }
            Some(ForwardStage::Combining {
                y_nd,
                exchange,
                experts,
            }) => {
                let y_nd = y_nd.wait()?;
                let out = self.forward_finish(ctx, fwd, y_nd, Some(exchange), experts)?;
                Ok(Step::Done(out))
            }
            None => Err(EngineError::Invalid(
                "MoE forward resumed after it had finished".into(),
            )),
        }
    }

    /// The shared experts' output (this rank's rows) and state, if any.
    /// Their input is gathered over tp; the state keeps this rank's shard
    /// `x` instead (the layer input, which the router keeps already) and
    /// the backward gathers it again.
    fn shared_forward(
        &self,
        ctx: &Exec<B>,
        x_td: &Tensor<B>,
    ) -> Result<Option<(Tensor<B>, SharedSaved<B>)>> {
        let g = &self.groups;
        let Some(s) = &self.shared else {
            return Ok(None);
        };
        let (ys_full, mut saved) = s.forward(ctx.b, &ctx.gather(&g.tp, x_td)?)?;
        if g.tp.size() > 1 {
            for input in saved.inputs_mut() {
                input.keep_shard(x_td);
            }
        }
        Ok(Some((ctx.scatter(&g.tp, &ys_full)?, saved)))
    }

    /// Combine (a sum of each token's copies) plus the shared experts.
    fn forward_finish(
        &self,
        ctx: &Exec<B>,
        fwd: MoeForward<B>,
        y_nd: Tensor<B>,
        exchange: Option<Exchange<B>>,
        experts: ExpertsSaved<B>,
    ) -> Result<MoeOut<B>> {
        let b = ctx.b;
        let MoeForward {
            router,
            dispatch,
            stats,
            shared,
            ..
        } = fwd;
        let mut y_td = self.dispatcher.combine(b, &y_nd, &dispatch)?;
        let shared = match shared {
            Some((ys_td, saved)) => {
                b.axpy(&mut y_td, 1.0, &ys_td)?;
                Some(saved)
            }
            None => None,
        };
        let saved = MoeSaved {
            router,
            dispatch,
            exchange,
            experts,
            shared,
        };
        Ok((y_td, saved, stats))
    }

    /// Accumulates the gradients and returns `dx: [T/tp, D]`:
    /// [`Self::backward_start`] and its resumptions run back to back.
    pub fn backward(
        &mut self,
        ctx: &Exec<B>,
        dy_td: &Tensor<B>,
        saved: MoeSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let first = self.backward_start(ctx, dy_td, saved, loss_scale)?;
        drive(first, |bw| self.backward_resume(ctx, bw))
    }

    /// The backward up to its first exchange: the shared experts, then
    /// under ep / etp the output gradient starts to the experts' ranks (on
    /// one expert rank the backward finishes here).
    pub fn backward_start(
        &mut self,
        ctx: &Exec<B>,
        dy_td: &Tensor<B>,
        saved: MoeSaved<B>,
        loss_scale: f64,
    ) -> Result<Step<MoeBackward<B>, Tensor<B>>> {
        let b = ctx.b;
        let g = &self.groups;
        let MoeSaved {
            router,
            dispatch,
            exchange,
            experts,
            shared,
        } = saved;
        let dx_shared = match (shared, self.shared.as_mut()) {
            (Some(mut saved), Some(s)) => {
                // The MLP and the gate kept the same shard: one gather.
                let mut x_full = None;
                for input in saved.inputs_mut() {
                    input.gather_shard(|x| match &x_full {
                        Some(full) => Ok(Tensor::clone(full)),
                        None => Ok(x_full.insert(ctx.gather(&g.tp, x)?).clone()),
                    })?;
                }
                let d_full = s.backward(b, &ctx.gather(&g.tp, dy_td)?, saved)?;
                Some(ctx.scatter(&g.tp, &d_full)?)
            }
            _ => None,
        };
        let dy_nd = self.dispatcher.combine_backward(dy_td, &dispatch);
        let bw = MoeBackward {
            stage: None,
            router,
            dispatch,
            dx_shared,
            loss_scale,
        };
        let Some(exchange) = exchange else {
            let (dx_nd, dprobs_n) =
                self.experts
                    .backward(b, dy_nd, experts, ctx.micro.is_some())?;
            return Ok(Step::Done(self.backward_finish(ctx, bw, dx_nd, dprobs_n)?));
        };
        let dy_nd = dy_nd.materialize(b)?;
        let dy_recv = ctx.comm.all_to_all_v_start(
            b,
            &g.ep,
            &dy_nd,
            &exchange.send_rows,
            &exchange.recv_rows,
        )?;
        Ok(Step::Pending(MoeBackward {
            stage: Some(BackwardStage::Dispatching {
                dy_recv,
                exchange,
                experts: Box::new(experts),
            }),
            ..bw
        }))
    }

    /// The backward from its last exchange: once the output gradient has
    /// arrived (with etp > 1, gathered over etp first, another pause), the
    /// experts' backward runs and the rows' and weights' gradients start
    /// back; once those have arrived, the router's and
    /// dispatch's backward finish the layer.
    pub fn backward_resume(
        &mut self,
        ctx: &Exec<B>,
        mut bw: MoeBackward<B>,
    ) -> Result<Step<MoeBackward<B>, Tensor<B>>> {
        match bw.stage.take() {
            Some(BackwardStage::Dispatching {
                dy_recv,
                exchange,
                experts,
            }) => {
                let dy_recv = dy_recv.wait()?;
                let g = &self.groups;
                bw.stage = Some(if g.etp.size() > 1 {
                    BackwardStage::Gathering {
                        dy_block: ctx.comm.all_gather_start(ctx.b, &g.etp, &dy_recv)?,
                        exchange,
                        experts,
                    }
                } else {
                    self.experts_backward(ctx, dy_recv, exchange, *experts)?
                });
                Ok(Step::Pending(bw))
            }
            Some(BackwardStage::Gathering {
                dy_block,
                exchange,
                experts,
            }) => {
                bw.stage =
                    Some(self.experts_backward(ctx, dy_block.wait()?, exchange, *experts)?);
                Ok(Step::Pending(bw))
            }
            Some(BackwardStage::Combining { dx_nd, dp_nd }) => {
                let dx_nd = dx_nd.wait()?;
                let dp_nd = dp_nd.wait()?;
                let n = dp_nd.numel();
                let dprobs_n = dp_nd.reshape(&[n])?;
                Ok(Step::Done(self.backward_finish(ctx, bw, dx_nd, dprobs_n)?))
            }
            None => Err(EngineError::Invalid(
                "MoE backward resumed after it had finished".into(),
            )),
        }
    }

    /// The weights' and dispatch's backward, the router's, and the sum of
    /// the input's gradients.
    fn backward_finish(
        &mut self,
        ctx: &Exec<B>,
        bw: MoeBackward<B>,
        dx_nd: Tensor<B>,
        dprobs_n: Tensor<B>,
    ) -> Result<Tensor<B>> {
        let b = ctx.b;
        let MoeBackward {
            router,
            dispatch,
            dx_shared,
            loss_scale,
            ..
        } = bw;
        let dweights_tk = self.dispatcher.weights_backward(b, &dprobs_n, &dispatch)?;
        let mut dx_td = self.dispatcher.dispatch_backward(b, &dx_nd, dispatch)?;
        let dx_router = self.router.backward(b, &dweights_tk, router, loss_scale)?;
        b.axpy(&mut dx_td, 1.0, &dx_router)?;
        if let Some(d) = dx_shared {
            b.axpy(&mut dx_td, 1.0, &d)?;
        }
        Ok(dx_td)
    }

    /// Capacity plan of this rank's rows, made over the whole micro-batch in
    /// its token order (under cp the decisions of every tp×cp rank are put
    /// back in that order first, so drops by position match one rank's).
    fn capacity_plan(
        &self,
        ctx: &Exec<B>,
        idx_tk: &Tensor<B>,
        weights_tk: &Tensor<B>,
        shard: TokenShard,
        seq_len: usize,
    ) -> Result<RoutingPlan<B>> {
        let b = ctx.b;
        let (t_local, k) = idx_tk.dims2("capacity_plan")?;
        let cap = self.spec.capacity.as_ref().ok_or_else(|| {
            EngineError::Invalid("capacity plan asked of a dropless layer".into())
        })?;
        let policy = match cap.drop_policy {
            DropPolicySpec::Probs => DropPolicy::Probs,
            DropPolicySpec::Position => DropPolicy::Position,
        };
        let e = self.spec.experts;
        let g = &self.groups;
        let cp = g.cp.size();
        // The micro-batch token of row `row` of cp rank `cp_i`'s tokens.
        let token = |cp_i: usize, row: usize| -> usize {
            let held = seq_len / cp;
            let positions = cp_positions(seq_len, cp, cp_i);
            (row / held) * seq_len + positions[row % held]
        };
        let (idx_all, probs_all, rows) = if cp == 1 {
            let rows: Vec<usize> = (0..t_local).map(|t| shard.offset + t).collect();
            (
                ctx.gather(&g.tp, idx_tk)?,
                ctx.gather(&g.tp, weights_tk)?,
                rows,
            )
        } else {
            let idx_g = b
                .download(&ctx.comm.all_gather(b, &g.tp_cp, idx_tk)?)?
                .to_i32()?;
            let probs_g = b
                .download(&ctx.comm.all_gather(b, &g.tp_cp, weights_tk)?)?
                .to_f64();
            let (mut idx_n, mut probs_n) = (vec![0i32; idx_g.len()], vec![0.0; probs_g.len()]);
            for (m, &(c_tp, c_cp)) in g.tp_cp_coords.iter().enumerate() {
                for t in 0..t_local {
                    let (from, to) = ((m * t_local + t) * k, token(c_cp, c_tp * t_local + t) * k);
                    idx_n[to..to + k].copy_from_slice(&idx_g[from..from + k]);
                    probs_n[to..to + k].copy_from_slice(&probs_g[from..from + k]);
                }
            }
            let n = idx_n.len() / k;
            let rows: Vec<usize> = (0..t_local)
                .map(|t| token(g.cp_index, g.tp_index * t_local + t))
                .collect();
            (
                b.upload(HostData::I32(idx_n), &[n, k])?,
                upload_as(b, probs_n, &[n, k], weights_tk.dtype())?,
                rows,
            )
        };
        let capacity = self
            .dispatcher
            .capacity(shard.total)
            .unwrap_or(shard.total * k);
        let global = b.capacity_plan(&idx_all, &probs_all, e, capacity, policy, false)?;
        let slot = b.download(&global.slot)?.to_i32()?;
        let idx = b.download(&idx_all)?.to_i32()?;
        // Kept copies of this rank's rows, sorted by expert, stable in
        // (token, choice) order as the single-rank plan is.
        let mut kept: Vec<(i32, usize, usize)> = Vec::new();
        for (t, &row) in rows.iter().enumerate() {
            for j in 0..k {
                let g = row * k + j;
                if slot[g] >= 0 {
                    kept.push((idx[g], t, j));
                }
            }
        }
        kept.sort_by_key(|&(e, t, j)| (e, t, j));
        let mut row_src = Vec::with_capacity(kept.len());
        let mut local_slot = vec![-1i32; t_local * k];
        let mut counts = vec![0i32; e];
        for (n, &(expert, t, j)) in kept.iter().enumerate() {
            row_src.push(t as i32);
            local_slot[t * k + j] = n as i32;
            counts[expert as usize] += 1;
        }
        let n = row_src.len();
        Ok(RoutingPlan {
            row_src: b.upload(HostData::I32(row_src), &[n])?,
            slot: b.upload(HostData::I32(local_slot), &[t_local, k])?,
            counts: b.upload(HostData::I32(counts), &[e])?,
        })
    }

    /// Starts the permuted rows `x: [N, D]` (expert-major over all E,
    /// `counts: [E]`) and their routing weights `probs: [N]` towards the ep
    /// ranks holding their experts. The counts go first (every ep rank's
    /// `[ep, E]`, gathered on the device and read on the host once: they
    /// size the exchange, as Megatron-Core's dispatcher reads them before
    /// its all-to-all), so the rows' exchange starts knowing what it will
    /// receive.
    fn dispatch_start(
        &self,
        ctx: &Exec<B>,
        x_nd: ExpertRows<B>,
        probs_n: &Tensor<B>,
        counts_e: &Tensor<B>,
    ) -> Result<ForwardStage<B>> {
        let b = ctx.b;
        let g = &self.groups;
        let ep = g.ep.size();
        let x_nd = x_nd.materialize(b)?;
        let e = self.spec.experts;
        let local = e / ep;
        // Gathered on the device, read once: this rank's own row among them.
        let counts_1e = counts_e.clone().reshape(&[1, e])?;
        let ep_counts = ctx.comm.all_gather(b, &g.ep, &counts_1e)?;
        let ep_host = b.download(&ep_counts)?.to_i32()?;
        let counts = &ep_host[g.ep_index * e..(g.ep_index + 1) * e];
        let send_rows: Vec<usize> = (0..ep)
            .map(|j| {
                counts[j * local..(j + 1) * local]
                    .iter()
                    .map(|&c| c as usize)
                    .sum()
            })
            .collect();
        let first = g.ep_index * local;
        let recv_rows: Vec<usize> = (0..ep)
            .map(|s| {
                (0..local)
                    .map(|l| ep_host[s * e + first + l] as usize)
                    .sum()
            })
            .collect();
        let comm = ctx.comm;
        let x_recv = comm.all_to_all_v_start(b, &g.ep, &x_nd, &send_rows, &recv_rows)?;
        let n = probs_n.numel();
        let p_nd = probs_n.clone().reshape(&[n, 1])?;
        let p_recv = comm.all_to_all_v_start(b, &g.ep, &p_nd, &send_rows, &recv_rows)?;
        Ok(ForwardStage::Dispatching {
            x_recv,
            p_recv,
            send_rows,
            recv_rows,
            ep_counts: (ep_counts, ep_host),
        })
    }

    /// The experts on the rows that arrived (and were gathered over etp):
    /// sorted into expert-major order, through the grouped GEMMs; their
    /// outputs summed over etp and started back to the ranks the rows came
    /// from.
    fn experts_forward(&self, ctx: &Exec<B>, arrived: Arrived<B>) -> Result<ForwardStage<B>> {
        let b = ctx.b;
        let g = &self.groups;
        let (ep, etp) = (g.ep.size(), g.etp.size());
        let e = self.spec.experts;
        let local = e / ep;
        let Arrived {
            x_block,
            p_block,
            send_rows,
            recv_rows,
            all_counts,
        } = arrived;
        // Block (m, s) holds, for each local expert l in order, the rows that
        // ep rank s of etp member m sent to this ep rank.
        let first = g.ep_index * local;
        let rows_of =
            |m: usize, s: usize, l: usize| all_counts[(m * ep + s) * e + first + l] as usize;
        let mut block_start = vec![0usize; etp * ep];
        let mut etp_rows = vec![0usize; etp];
        let mut offset = 0;
        for m in 0..etp {
            for s in 0..ep {
                block_start[m * ep + s] = offset;
                let n: usize = (0..local).map(|l| rows_of(m, s, l)).sum();
                offset += n;
                etp_rows[m] += n;
            }
        }
        if offset != x_block.shape()[0] {
            return Err(EngineError::Invalid(format!(
                "expert exchange: received {} rows but the exchanged counts add up to {offset}",
                x_block.shape()[0]
            )));
        }
        let mut order = Vec::with_capacity(offset);
        let mut group_sizes = vec![0i32; local];
        for (l, size) in group_sizes.iter_mut().enumerate() {
            for m in 0..etp {
                for s in 0..ep {
                    let start =
                        block_start[m * ep + s] + (0..l).map(|i| rows_of(m, s, i)).sum::<usize>();
                    let n = rows_of(m, s, l);
                    order.extend((start..start + n).map(|r| r as i32));
                    *size += n as i32;
                }
            }
        }
        let order = b.upload(HostData::I32(order), &[offset])?;
        let groups = b.upload(HostData::I32(group_sizes), &[local])?;
        let x_sorted = ExpertRows::Gathered {
            source: x_block,
            row_src: order.clone(),
            source_is_input: false,
        };
        let p_sorted = b.embedding(&p_block, &order)?.reshape(&[offset])?;
        let (y_sorted, experts) =
            self.experts
                .forward(b, x_sorted, &p_sorted, &groups, ctx.micro.is_some())?;
        let mut y_block = b.embedding_backward(&y_sorted, &order, offset)?;
        let exchange = Exchange {
            send_rows,
            recv_rows,
            etp_rows,
            order,
        };
        if etp > 1 {
            y_block = ctx.sum_over(&g.etp, &y_block)?;
            y_block = own_rows(b, &y_block, &exchange.etp_rows, g.etp_index)?;
        }
        let y_nd = ctx.comm.all_to_all_v_start(
            b,
            &g.ep,
            &y_block,
            &exchange.recv_rows,
            &exchange.send_rows,
        )?;
        Ok(ForwardStage::Combining {
            y_nd,
            exchange,
            experts,
        })
    }

    /// The experts' backward on the output gradient that arrived (and was
    /// gathered over etp), through the grouped GEMMs in the forward's
    /// order; the rows' and weights' gradients summed over etp and started
    /// back, then the experts' weight gradients computed while they travel.
    fn experts_backward(
        &mut self,
        ctx: &Exec<B>,
        dy_block: Tensor<B>,
        ex: Exchange<B>,
        saved: ExpertsSaved<B>,
    ) -> Result<BackwardStage<B>> {
        let b = ctx.b;
        let g = &self.groups;
        let rows = dy_block.shape()[0];
        let dy_sorted = ExpertRows::Gathered {
            source: dy_block,
            row_src: ex.order.clone(),
            source_is_input: false,
        };
        let (dx_sorted, dp_sorted, weights) =
            self.experts
                .backward_data(b, dy_sorted, saved, ctx.micro.is_some())?;
        let sorted = dp_sorted.numel();
        let mut dx_block = b.embedding_backward(&dx_sorted, &ex.order, rows)?;
        let mut dp_block =
            b.embedding_backward(&dp_sorted.reshape(&[sorted, 1])?, &ex.order, rows)?;
        if g.etp.size() > 1 {
            // Each etp member's products cover its share of F: their sums
            // are the rows' gradients.
            dx_block = ctx.sum_over(&g.etp, &dx_block)?;
            dx_block = own_rows(b, &dx_block, &ex.etp_rows, g.etp_index)?;
            dp_block = ctx.sum_over(&g.etp, &dp_block)?;
            dp_block = own_rows(b, &dp_block, &ex.etp_rows, g.etp_index)?;
        }
        let comm = ctx.comm;
        let dx_nd = comm.all_to_all_v_start(b, &g.ep, &dx_block, &ex.recv_rows, &ex.send_rows)?;
        let dp_nd = comm.all_to_all_v_start(b, &g.ep, &dp_block, &ex.recv_rows, &ex.send_rows)?;
        // The weight gradients while the data gradients travel
        // (Megatron-Core's `--delay-wgrad-compute`).
        self.experts.backward_weights(b, weights)?;
        Ok(BackwardStage::Combining { dx_nd, dp_nd })
    }

    /// Validates `x` (this rank's rows of a micro-batch of `tokens` in
    /// sequences of `seq_len`) and returns its row count.
    fn check_input(&self, x_td: &Tensor<B>, seq_len: usize, tokens: usize) -> Result<usize> {
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
        if shape[0] == 0 || tokens == 0 {
            return Err(EngineError::Invalid(format!(
                "MoeLayer::forward: x has no tokens (shape {shape:?}, micro-batch of {tokens}); \
                 pass at least one"
            )));
        }
        if self.spec.router.load_balance == LoadBalance::SeqAux
            && (seq_len == 0 || !tokens.is_multiple_of(seq_len))
        {
            return Err(EngineError::Invalid(format!(
                "MoeLayer::forward: seq_aux needs T = batch·seq_len, but T = {tokens} is not \
                 a multiple of seq_len = {seq_len}"
            )));
        }
        Ok(shape[0])
    }

    /// Aux-loss-free balancing after a global batch: `b_e += rate·sign(mean_load
    /// − load_e)` for `load_e: [E]` (float, or i32 counts; summed over the
    /// stage's ranks). A no-op when the spec has no expert bias.
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

    /// Parameters replicated over the expert mesh's data dimension: router
    /// and shared experts (dense: reduced like attention).
    pub fn visit_dense<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.router.visit_params(f);
        if let Some(s) = &self.shared {
            s.visit_params(f);
        }
    }

    /// Mutable [`Self::visit_dense`].
    pub fn visit_dense_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.router.visit_params_mut(f);
        if let Some(s) = &mut self.shared {
            s.visit_params_mut(f);
        }
    }
}

/// Member `index`'s rows of a block made of consecutive per-member row counts.
fn own_rows<B: Backend>(b: &B, x: &Tensor<B>, rows: &[usize], index: usize) -> Result<Tensor<B>> {
    let start: usize = rows[..index].iter().sum();
    Ok(b.narrow(x, start, rows[index])?)
}

/// Every parameter: router, routed experts, shared experts.
impl<B: Backend> Module<B> for MoeLayer<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
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

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::Device;

    use super::testutil::*;
    use super::*;
    use crate::spec::{CapacitySpec, DropPolicySpec, ScoreFunction};

    const T: usize = 8;
    const D: usize = 4;
    const E: usize = 4;
    const K: usize = 2;

    /// A small layer spec: 4 experts, top-2, shared experts with a gate,
    /// aux-loss and z-loss on with coefficients large enough to matter.
    fn spec() -> MoeSpec {
        let mut moe = moe_spec(E, K, 3, 5);
        moe.shared_gate = true;
        moe.router.aux_coef = 0.2;
        moe.router.z_loss_coef = 0.05;
        moe
    }

    fn layer(moe: &MoeSpec, dtype: DType) -> MoeLayer<Cpu> {
        let mut model = crate::engine::testutil::small_spec(&[], false);
        (model.hidden, model.init_std) = (D, 0.6);
        let init = crate::engine::Init::full(7);
        MoeLayer::new(&Cpu, "moe", &model, moe, init, dtype, LayerGroups::single()).unwrap()
    }

    type Out = (Tensor<Cpu>, MoeSaved<Cpu>, MoeStats<Cpu>);

    /// The layer's forward on one rank: `x` is the whole micro-batch.
    fn forward(m: &MoeLayer<Cpu>, x: &Tensor<Cpu>, seq_len: usize) -> Result<Out> {
        m.forward(&Exec::solo(&Cpu), x, seq_len, x.shape()[0])
    }

    fn backward(m: &mut MoeLayer<Cpu>, dy: &Tensor<Cpu>, saved: MoeSaved<Cpu>) -> Tensor<Cpu> {
        m.backward(&Exec::solo(&Cpu), dy, saved, 1.0).unwrap()
    }

    /// `Σ y ⊙ R + aux + z`.
    fn objective(m: &MoeLayer<Cpu>, x: &Tensor<Cpu>, seq_len: usize, r: &[f64]) -> f64 {
        let (y, _, stats) = forward(m, x, seq_len).unwrap();
        dot(&y, r) + host(&stats.aux_loss)[0] + host(&stats.z_loss)[0]
    }

    fn check_layer(what: &str, moe: &MoeSpec, seq_len: usize) {
        let mut m = layer(moe, DType::F64);
        let x = uniform(51, T * D, 1.0);
        let r = uniform(52, T * D, 1.0);
        let (_, saved, _) = forward(&m, &t64(x.clone(), &[T, D]), seq_len).unwrap();
        let dx = backward(&mut m, &t64(r.clone(), &[T, D]), saved);
        check_grads(what, &mut m, &x, &[T, D], &host(&dx), |m, x| {
            objective(m, x, seq_len, &r)
        });
    }

    fn with_capacity(policy: DropPolicySpec, pad: bool) -> MoeSpec {
        // capacity = ceil(8·2/4 · 0.75) = 3 < the 4 copies an expert gets on average.
        let mut moe = spec();
        moe.capacity = Some(CapacitySpec {
            factor: 0.75,
            drop_policy: policy,
            pad_to_capacity: pad,
        });
        moe
    }

    #[test]
    fn moe_layer_grad_dropless() {
        check_layer("dropless", &spec(), T);
    }

    #[test]
    fn moe_layer_grad_dropless_ungated_shared_seq_aux() {
        let mut moe = spec();
        moe.shared_gate = false;
        moe.router.load_balance = LoadBalance::SeqAux;
        check_layer("dropless seq_aux", &moe, 4);
    }

    #[test]
    fn moe_layer_grad_dropless_without_shared() {
        let mut moe = spec();
        moe.shared_ffn = 0;
        check_layer("dropless, no shared experts", &moe, T);
    }

    #[test]
    fn moe_layer_grad_sigmoid_group_limited_with_bias() {
        // DeepSeek-V3 style: sigmoid scores, expert bias, group-limited, scaled.
        let mut moe = spec();
        moe.experts = 8;
        moe.top_k = 4;
        moe.router.score = ScoreFunction::Sigmoid;
        moe.router.groups = 4;
        moe.router.group_top_k = 2;
        moe.router.expert_bias_rate = Some(1e-3);
        moe.router.scaling_factor = 2.5;
        moe.router.load_balance = LoadBalance::SeqAux;
        let mut m = layer(&moe, DType::F64);
        let bias = vec![0.1, -0.1, 0.2, 0.0, -0.2, 0.15, 0.05, -0.05];
        m.set_expert_bias(t64(bias.clone(), &[8])).unwrap();
        let x = uniform(51, T * D, 1.0);
        let r = uniform(52, T * D, 1.0);
        let (_, saved, _) = forward(&m, &t64(x.clone(), &[T, D]), 2).unwrap();
        let dx = backward(&mut m, &t64(r.clone(), &[T, D]), saved);
        check_grads(
            "sigmoid group-limited",
            &mut m,
            &x,
            &[T, D],
            &host(&dx),
            |m, x| objective(m, x, 2, &r),
        );
    }

    #[test]
    fn moe_layer_grad_capacity_probs() {
        check_layer(
            "capacity probs",
            &with_capacity(DropPolicySpec::Probs, false),
            T,
        );
    }

    #[test]
    fn moe_layer_grad_capacity_probs_padded() {
        check_layer(
            "capacity probs padded",
            &with_capacity(DropPolicySpec::Probs, true),
            T,
        );
    }

    #[test]
    fn moe_layer_grad_capacity_position() {
        check_layer(
            "capacity position",
            &with_capacity(DropPolicySpec::Position, false),
            T,
        );
    }

    #[test]
    fn moe_layer_grad_capacity_position_padded() {
        check_layer(
            "capacity position padded",
            &with_capacity(DropPolicySpec::Position, true),
            T,
        );
    }

    #[test]
    fn moe_layer_capacity_drops_copies() {
        let m = layer(&with_capacity(DropPolicySpec::Probs, false), DType::F64);
        let x = t64(uniform(51, T * D, 1.0), &[T, D]);
        let (_, saved, stats) = forward(&m, &x, T).unwrap();
        let kept: i32 = host_i32(saved.dispatch.counts_e()).iter().sum();
        let routed: f64 = host(&stats.load).iter().sum();
        assert_eq!(routed, (T * K) as f64);
        assert!(kept < (T * K) as i32, "capacity 3 kept all {kept} copies");
    }

    #[test]
    fn moe_layer_params_have_stable_names() {
        let m = layer(&spec(), DType::F32);
        let names: Vec<(String, Vec<usize>)> = {
            let mut v = Vec::new();
            m.visit_params(&mut |p: &Param<Cpu>| {
                v.push((p.name.clone(), p.value.shape().to_vec()))
            });
            v
        };
        let want: Vec<(&str, Vec<usize>)> = vec![
            ("moe.router.weight", vec![D, E]),
            ("moe.experts.w1", vec![E, D, 3]),
            ("moe.experts.w3", vec![E, D, 3]),
            ("moe.experts.w2", vec![E, 3, D]),
            ("moe.shared_experts.w1", vec![D, 5]),
            ("moe.shared_experts.w3", vec![D, 5]),
            ("moe.shared_experts.w2", vec![5, D]),
            ("moe.shared_experts.gate", vec![D, 1]),
        ];
        let want: Vec<(String, Vec<usize>)> =
            want.into_iter().map(|(n, s)| (n.to_string(), s)).collect();
        assert_eq!(names, want);
    }

    #[test]
    fn moe_layer_runs_in_f32() {
        let mut m = layer(&spec(), DType::F32);
        let x = Cpu
            .upload(
                foldmoe_kernels::HostData::F32(
                    uniform(51, T * D, 1.0).iter().map(|&v| v as f32).collect(),
                ),
                &[T, D],
            )
            .unwrap();
        let (y, saved, stats) = forward(&m, &x, T).unwrap();
        assert_eq!(y.shape(), &[T, D]);
        assert_eq!(stats.load.shape(), &[E]);
        let dx = backward(&mut m, &y, saved);
        assert!(host(&dx).iter().all(|v| v.is_finite()));
    }

    #[test]
    fn moe_layer_expert_bias_update_balances_load() {
        // Sigmoid router with a bias; feature 0 is a constant 1 whose router
        // row pushes every token toward expert 0, so expert 0 starts overloaded.
        let (t, e) = (64, 4);
        let mut moe = moe_spec(e, 2, 3, 0);
        moe.router.score = ScoreFunction::Sigmoid;
        moe.router.expert_bias_rate = Some(0.02);
        let mut m = layer(&moe, DType::F64);
        let mut w = host(&m.router.weight.value);
        w[..e].copy_from_slice(&[3.0, 0.0, 0.0, 0.0]);
        m.router.weight.value = t64(w, &[D, e]);
        let mut x = uniform(61, t * D, 1.0);
        for tok in 0..t {
            x[tok * D] = 1.0;
        }
        let x = t64(x, &[t, D]);
        let imbalance = |m: &MoeLayer<Cpu>| {
            let (_, _, stats) = forward(m, &x, t).unwrap();
            let load = host(&stats.load);
            let mean = load.iter().sum::<f64>() / e as f64;
            (
                load.iter().fold(0.0f64, |a, &b| a.max(b)) / mean,
                stats.load,
            )
        };
        // Imbalance every 10 updates. Fixed-size sign steps end in a small
        // limit cycle (experts trading a few tokens back and forth), so the
        // imbalance falls strictly until it enters that band, then stays there.
        const BAND: f64 = 1.25;
        let mut history = Vec::new();
        for _ in 0..6 {
            history.push(imbalance(&m).0);
            for _ in 0..10 {
                let (_, load) = imbalance(&m);
                m.update_expert_bias(&Cpu, &load).unwrap();
            }
        }
        assert!(history[0] >= 2.0, "input not skewed: {history:?}");
        for pair in history.windows(2) {
            assert!(pair[1] < pair[0] || pair[1] < BAND, "{history:?}");
        }
        assert!(*history.last().unwrap() < BAND, "{history:?}");
        let bias = host(m.expert_bias().unwrap());
        assert!(
            bias[0] < 0.0 && bias[1..].iter().all(|&b| b > 0.0),
            "{bias:?}"
        );
    }

    #[test]
    fn moe_layer_bias_update_is_a_no_op_without_bias() {
        let mut m = layer(&spec(), DType::F64);
        let load = t64(vec![9.0, 1.0, 3.0, 3.0], &[E]);
        m.update_expert_bias(&Cpu, &load).unwrap();
        assert!(m.expert_bias().is_none());
    }

    #[test]
    fn moe_layer_rejects_bad_input_naming_the_values() {
        let mut moe = spec();
        moe.router.load_balance = LoadBalance::SeqAux;
        let m = layer(&moe, DType::F64);
        let err = |x: &Tensor<Cpu>, seq_len: usize| match forward(&m, x, seq_len) {
            Err(e @ EngineError::Invalid(_)) => e.to_string(),
            Err(other) => panic!("expected EngineError::Invalid, got {other:?}"),
            Ok(_) => panic!("accepted bad input {x:?}, seq_len {seq_len}"),
        };
        let msg = err(&t64(vec![0.5; T * 5], &[T, 5]), T);
        assert!(msg.contains("[8, 5]") && msg.contains("[T, 4]"), "{msg}");
        let msg = err(&t64(vec![0.5; T * D], &[2, T / 2, D]), T);
        assert!(msg.contains("[2, 4, 4]"), "{msg}");
        let x32 = Cpu
            .upload(foldmoe_kernels::HostData::F32(vec![0.5; T * D]), &[T, D])
            .unwrap();
        let msg = err(&x32, T);
        assert!(msg.contains("F32") && msg.contains("F64"), "{msg}");
        let msg = err(&t64(vec![], &[0, D]), T);
        assert!(msg.contains("no tokens") && msg.contains("[0, 4]"), "{msg}");
        let msg = err(&t64(vec![0.5; T * D], &[T, D]), 3);
        assert!(
            msg.contains("T = 8") && msg.contains("seq_len = 3"),
            "{msg}"
        );
        let msg = err(&t64(vec![0.5; T * D], &[T, D]), 0);
        assert!(msg.contains("seq_len = 0"), "{msg}");
    }
}
