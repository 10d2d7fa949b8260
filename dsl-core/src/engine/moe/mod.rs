//! The Mixture-of-Experts layer (docs/ARCHITECTURE.md §4; Megatron-Core `moe/moe_layer.py`):
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
//!
//! On one rank: `global_aux` equals `aux` over the micro-batch (the sum of
//! loads over the data-parallel group and accumulation steps, and the
//! all-to-all between dispatch and the experts, come with parallel runs);
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

use foldmoe_kernels::{Backend, DType, Tensor};

use self::dispatcher::{CombineSaved, DispatchSaved, Dispatcher};
use self::experts::{Experts, ExpertsSaved};
use self::router::{Router, RouterSaved};
use self::shared::{SharedExperts, SharedSaved};
use crate::engine::activations::Slot;
use crate::engine::{EngineError, Init, Module, Param, Result};
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

impl<B: Backend> MoeSaved<B> {
    /// Lists the saved tensors of the router, dispatcher, experts and shared
    /// experts, in forward order.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        self.router.visit_saved(f);
        self.dispatch.visit_saved(f);
        self.experts.visit_saved(f);
        self.combine.visit_saved(f);
        if let Some(s) = &mut self.shared {
            s.visit_saved(f);
        }
    }
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
        init: Init<'_>,
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
        MoeLayer::new(
            &Cpu,
            "moe",
            D,
            moe,
            0.6,
            crate::engine::Init::full(7),
            dtype,
        )
        .unwrap()
    }

    /// `Σ y ⊙ R + aux + z`.
    fn objective(m: &MoeLayer<Cpu>, x: &Tensor<Cpu>, seq_len: usize, r: &[f64]) -> f64 {
        let (y, _, stats) = m.forward(&Cpu, x, seq_len).unwrap();
        dot(&y, r) + host(&stats.aux_loss)[0] + host(&stats.z_loss)[0]
    }

    fn check_layer(what: &str, moe: &MoeSpec, seq_len: usize) {
        let mut m = layer(moe, DType::F64);
        let x = uniform(51, T * D, 1.0);
        let r = uniform(52, T * D, 1.0);
        let (_, saved, _) = m.forward(&Cpu, &t64(x.clone(), &[T, D]), seq_len).unwrap();
        let dx = m
            .backward(&Cpu, &t64(r.clone(), &[T, D]), saved, 1.0)
            .unwrap();
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
        let (_, saved, _) = m.forward(&Cpu, &t64(x.clone(), &[T, D]), 2).unwrap();
        let dx = m
            .backward(&Cpu, &t64(r.clone(), &[T, D]), saved, 1.0)
            .unwrap();
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
        let (_, saved, stats) = m.forward(&Cpu, &x, T).unwrap();
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
        let (y, saved, stats) = m.forward(&Cpu, &x, T).unwrap();
        assert_eq!(y.shape(), &[T, D]);
        assert_eq!(stats.load.shape(), &[E]);
        let dx = m.backward(&Cpu, &y, saved, 1.0).unwrap();
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
            let (_, _, stats) = m.forward(&Cpu, &x, t).unwrap();
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
        let err = |x: &Tensor<Cpu>, seq_len: usize| match m.forward(&Cpu, x, seq_len) {
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
