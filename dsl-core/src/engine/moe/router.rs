//! Route: score every token against every expert, choose its top-k experts
//! and their weights, and compute the router's auxiliary losses (docs/ARCHITECTURE.md §4;
//! Megatron-Core `moe/router.py`, `topk_softmax_with_capacity`).
//!
//! Shapes: T tokens, D hidden, E experts, K top-k.
//!
//! Score functions:
//! - softmax after top-k (default): top-k of the logits, softmax over the k
//!   chosen (equal to renormalising the full softmax over the chosen);
//! - `pre_softmax`: softmax over E, top-k of the probabilities, no renormalising;
//! - sigmoid: top-k of `sigmoid(logits) + bias` (the bias only selects), the
//!   chosen scores renormalised to sum to 1 when `K > 1` (with `K = 1` the raw
//!   score, as Megatron does, so the router still gets a gradient).
//!
//! The renormalised sigmoid `s_k / Σ_j s_j` is computed as
//! `softmax(log_sigmoid(l))` over the chosen: no division, and finite for any
//! logit.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::loss::{self, BalanceSaved, TokenShard, ZSaved};
use super::ops::log_sigmoid_backward;
use crate::engine::activations::Slot;
use crate::engine::{EngineError, Init, Module, Param, Result};
use crate::memory::Part;
use crate::spec::{LoadBalance, MoeSpec, RecomputePart, RouterDtype, RouterSpec, ScoreFunction};

/// The router: a linear map `Wr: [D, E]` to logits, plus the optional
/// aux-loss-free expert bias (a buffer, not trained by gradients).
pub struct Router<B: Backend> {
    /// Router weight `Wr: [D, E]`, named `{prefix}.weight`.
    pub weight: Param<B>,
    /// The aux-loss-free expert bias `[E]`, in the accumulation type (f32
    /// for a bf16 model, as Megatron-Core keeps it): bf16's spacing passes
    /// 2·rate = 2e-3 at |bias| = 0.5, past which a ±rate step would round
    /// away and the bias stop moving.
    expert_bias_e: Option<Tensor<B>>,
    /// The expert bias's global name, `{prefix}.expert_bias` (a buffer: state
    /// the checkpoint keeps, not a parameter).
    bias_name: String,
    spec: RouterSpec,
    experts: usize,
    top_k: usize,
    /// The dtype it computes in when not the model's (`router_dtype =
    /// fp32` in a bf16 model): input and weight are cast for the logits'
    /// product, scores, top-k and losses run in it, and the routing weights,
    /// losses and gradients go back in the model's dtype.
    compute: Option<DType>,
}

/// What the router decided for a batch of tokens.
pub struct Routing<B: Backend> {
    /// `[T, K]` i32: chosen experts, best first.
    pub idx_tk: Tensor<B>,
    /// `[T, K]`: routing weights of the chosen experts (scaling factor applied).
    pub weights_tk: Tensor<B>,
    /// `[1]`: load-balancing loss, coefficient applied (0 when off).
    pub aux_loss: Tensor<B>,
    /// `[1]`: z-loss, coefficient applied (0 when off).
    pub z_loss: Tensor<B>,
    /// `[E]` float: token copies each expert was chosen for.
    pub load_e: Tensor<B>,
}

/// How the chosen probabilities were formed (what their backward needs).
enum ScoreSaved<B: Backend> {
    /// Softmax over the k chosen logits.
    PostSoftmax { probs_tk: Tensor<B> },
    /// Full softmax, gathered at the chosen.
    PreSoftmax { probs_te: Tensor<B> },
    /// Sigmoid scores; `probs_tk` the renormalised chosen when `K > 1`.
    Sigmoid {
        scores_te: Tensor<B>,
        probs_tk: Option<Tensor<B>>,
    },
}

/// The load-balancing loss's probabilities and its gradient for them.
struct AuxSaved<B: Backend> {
    probs_te: Tensor<B>,
    /// `sigmoid(logits)` for sigmoid scores (their probabilities are
    /// `softmax(log sigmoid(logits))`), `None` for softmax.
    sigmoid_te: Option<Tensor<B>>,
    balance: BalanceSaved<B>,
}

/// What the router's backward needs from its forward.
pub struct RouterSaved<B: Backend> {
    x_td: Tensor<B>,
    idx_tk: Tensor<B>,
    score: ScoreSaved<B>,
    aux: Option<AuxSaved<B>>,
    z: Option<ZSaved<B>>,
}

impl<B: Backend> RouterSaved<B> {
    /// Lists the saved tensors: the input (the norm's output, counted here
    /// for the MoE layer), then the chosen experts, probabilities and the
    /// losses' state, all dropped by `router` recompute.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let r = Slot::kept(Part::Router).recompute(RecomputePart::Router);
        f(Slot::NORM_OUT, &mut self.x_td);
        f(r, &mut self.idx_tk);
        match &mut self.score {
            ScoreSaved::PostSoftmax { probs_tk } => f(r, probs_tk),
            ScoreSaved::PreSoftmax { probs_te } => f(r, probs_te),
            ScoreSaved::Sigmoid {
                scores_te,
                probs_tk,
            } => {
                f(r, scores_te);
                if let Some(p) = probs_tk {
                    f(r, p);
                }
            }
        }
        if let Some(aux) = &mut self.aux {
            f(r, &mut aux.probs_te);
            if let Some(s) = &mut aux.sigmoid_te {
                f(r, s);
            }
            f(r, &mut aux.balance.dprobs_te);
        }
        if let Some(z) = &mut self.z {
            z.visit_saved(r, f);
        }
    }
}

impl<B: Backend> Router<B> {
    /// The router of `moe` with normal(0, std) weights seeded by
    /// `(seed, "{prefix}.weight")`; the expert bias starts at zero.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        moe: &MoeSpec,
        init_std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let (spec, experts, top_k) = (&moe.router, moe.experts, moe.top_k);
        let name = format!("{prefix}.weight");
        let weight = init.normal(b, name, &[hidden, experts], init_std, dtype)?;
        let expert_bias_e = match spec.expert_bias_rate {
            Some(_) => Some(b.zeros(&[experts], dtype.acc())?),
            None => None,
        };
        let compute =
            (spec.dtype == RouterDtype::Fp32 && dtype == DType::BF16).then_some(DType::F32);
        Ok(Router {
            weight,
            expert_bias_e,
            bias_name: format!("{prefix}.expert_bias"),
            spec: spec.clone(),
            experts,
            top_k,
            compute,
        })
    }

    /// The expert bias `[E]`, if the spec has one.
    pub fn expert_bias(&self) -> Option<&Tensor<B>> {
        self.expert_bias_e.as_ref()
    }

    /// The expert bias with its global name (`blocks.N.moe.router.expert_bias`),
    /// if the spec has one: what checkpoints and conversions address it by.
    pub fn named_expert_bias(&self) -> Option<(&str, &Tensor<B>)> {
        self.expert_bias_e
            .as_ref()
            .map(|t| (self.bias_name.as_str(), t))
    }

    /// Replaces the expert bias (checkpoint loading); `[E]` in the router
    /// dtype's accumulation type.
    pub fn set_expert_bias(&mut self, bias_e: Tensor<B>) -> Result<()> {
        if self.expert_bias_e.is_none() {
            return Err(EngineError::Invalid(
                "set_expert_bias: this router has no expert bias (spec expert_bias_rate = None)"
                    .into(),
            ));
        }
        self.check_e_vector("set_expert_bias", "bias", &bias_e)?;
        self.expert_bias_e = Some(bias_e);
        Ok(())
    }

    /// Aux-loss-free balancing: `b_e += rate·sign(mean_load − load_e)`, so
    /// under-loaded experts become more likely to be selected. A no-op without
    /// an expert bias. `load_e: [E]`, float or i32 counts.
    pub fn update_expert_bias(&mut self, b: &B, load_e: &Tensor<B>) -> Result<()> {
        let (Some(rate), Some(_)) = (self.spec.expert_bias_rate, &self.expert_bias_e) else {
            return Ok(());
        };
        let dtype = self.weight.value.dtype().acc();
        // The comparison runs on the counts as they come (f32 counts of a
        // bf16 model stay exact); the ±1 step takes the bias's dtype.
        let load_e = if load_e.dtype() == DType::I32 {
            b.cast(load_e, dtype.acc())?
        } else {
            load_e.clone()
        };
        let count_dtype = load_e.dtype();
        if load_e.shape() != [self.experts] || !count_dtype.is_float() {
            return Err(EngineError::Invalid(format!(
                "update_expert_bias: load is {count_dtype:?} {:?}, expected [{}] counts (one per expert)",
                load_e.shape(),
                self.experts
            )));
        }
        let e = self.experts;
        // Broadcast the mean of the loads to [E] with a rank-1 product.
        let total_11 = b.sum(&load_e)?.reshape(&[1, 1])?;
        let inv_e_e1 = b.fill(&[e, 1], 1.0 / e as f64, count_dtype)?;
        let mean_e = b
            .matmul(&inv_e_e1, &total_11, false, false)?
            .reshape(&[e])?;
        let step_e = b.sign(&b.sub(&mean_e, &load_e)?)?;
        let step_e = if count_dtype == dtype {
            step_e
        } else {
            b.cast(&step_e, dtype)?
        };
        if let Some(bias_e) = self.expert_bias_e.as_mut() {
            b.axpy(bias_e, rate, &step_e)?;
        }
        Ok(())
    }

    fn check_e_vector(&self, op: &str, what: &str, t: &Tensor<B>) -> Result<()> {
        let dtype = self.weight.value.dtype().acc();
        if t.shape() != [self.experts] || t.dtype() != dtype {
            return Err(EngineError::Invalid(format!(
                "{op}: {what} is {:?} {:?}, expected [{}] (one per expert) {dtype:?}",
                t.dtype(),
                t.shape(),
                self.experts
            )));
        }
        Ok(())
    }

    /// `t` in the router's compute dtype.
    fn computing(&self, b: &B, t: &Tensor<B>) -> Result<Tensor<B>> {
        match self.compute {
            Some(d) if t.dtype() != d => Ok(b.cast(t, d)?),
            _ => Ok(t.clone()),
        }
    }

    /// `t` (computed in the router's dtype) in `dtype`.
    fn returned(&self, b: &B, t: Tensor<B>, dtype: DType) -> Result<Tensor<B>> {
        if t.dtype() == dtype {
            Ok(t)
        } else {
            Ok(b.cast(&t, dtype)?)
        }
    }

    /// Top-k, group-limited when the spec has groups.
    fn select(&self, b: &B, scores_te: &Tensor<B>) -> Result<Tensor<B>> {
        let (groups, group_top_k) = if self.spec.groups > 1 {
            (self.spec.groups, self.spec.group_top_k)
        } else {
            (1, 1)
        };
        Ok(b.topk(scores_te, self.top_k, groups, group_top_k)?)
    }

    /// Routes `x: [T, D]`; `n_seq` is the number of sequences in the batch
    /// (the segments of `seq_aux`; T must be a multiple of it).
    pub fn forward(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        n_seq: usize,
    ) -> Result<(Routing<B>, RouterSaved<B>)> {
        let (t, _) = x_td.dims2("Router::forward")?;
        if n_seq == 0 || !t.is_multiple_of(n_seq) {
            return Err(EngineError::Invalid(format!(
                "Router::forward: T = {t} tokens do not split into n_seq = {n_seq} equal sequences"
            )));
        }
        let identity = |x: &Tensor<B>| -> Result<Tensor<B>> { Ok(x.clone()) };
        self.forward_shard(b, x_td, TokenShard::whole(t, n_seq), &identity)
    }

    /// Routes the `x: [T, D]` rows of `shard` (sequence parallelism: a slice
    /// of the micro-batch). `reduce` sums over the ranks that share the
    /// micro-batch; the returned losses are this shard's parts.
    pub fn forward_shard(
        &self,
        b: &B,
        x_td: &Tensor<B>,
        shard: TokenShard,
        reduce: &dyn Fn(&Tensor<B>) -> Result<Tensor<B>>,
    ) -> Result<(Routing<B>, RouterSaved<B>)> {
        let (t, _) = x_td.dims2("Router::forward")?;
        let segments_ok = shard.segment > 0
            && shard.cp > 0
            && shard.total.is_multiple_of(shard.segment)
            && shard.segment.is_multiple_of(shard.cp)
            && shard.offset + t <= shard.total / shard.cp;
        if !segments_ok {
            return Err(EngineError::Invalid(format!(
                "Router::forward: rows {}..{} of a micro-batch of {} do not fit segments of {} \
                 (held over cp = {})",
                shard.offset,
                shard.offset + t,
                shard.total,
                shard.segment,
                shard.cp
            )));
        }
        let (e, k) = (self.experts, self.top_k);
        let model_dtype = x_td.dtype();
        let logits_te = b.matmul(
            &self.computing(b, x_td)?,
            &self.computing(b, &self.weight.value)?,
            false,
            false,
        )?;
        let dtype = logits_te.dtype();

        let (idx_tk, probs_tk, score) = match (self.spec.score, self.spec.pre_softmax) {
            (ScoreFunction::Softmax, false) => {
                let idx_tk = self.select(b, &logits_te)?;
                let probs_tk = b.softmax(&b.gather_cols(&logits_te, &idx_tk)?)?;
                let score = ScoreSaved::PostSoftmax {
                    probs_tk: probs_tk.clone(),
                };
                (idx_tk, probs_tk, score)
            }
            (ScoreFunction::Softmax, true) => {
                let probs_te = b.softmax(&logits_te)?;
                let idx_tk = self.select(b, &probs_te)?;
                let probs_tk = b.gather_cols(&probs_te, &idx_tk)?;
                (idx_tk, probs_tk, ScoreSaved::PreSoftmax { probs_te })
            }
            (ScoreFunction::Sigmoid, _) => {
                let scores_te = b.sigmoid(&logits_te)?;
                let idx_tk = match &self.expert_bias_e {
                    // Selection scores in the bias's (accumulation) type.
                    Some(bias_e) => {
                        let scores = if scores_te.dtype() == bias_e.dtype() {
                            scores_te.clone()
                        } else {
                            b.cast(&scores_te, bias_e.dtype())?
                        };
                        self.select(b, &b.add_cols(&scores, bias_e)?)?
                    }
                    None => self.select(b, &scores_te)?,
                };
                if k > 1 {
                    let chosen_tk = b.gather_cols(&logits_te, &idx_tk)?;
                    let probs_tk = b.softmax(&b.log_sigmoid(&chosen_tk)?)?;
                    let score = ScoreSaved::Sigmoid {
                        scores_te,
                        probs_tk: Some(probs_tk.clone()),
                    };
                    (idx_tk, probs_tk, score)
                } else {
                    let probs_tk = b.gather_cols(&scores_te, &idx_tk)?;
                    let score = ScoreSaved::Sigmoid {
                        scores_te,
                        probs_tk: None,
                    };
                    (idx_tk, probs_tk, score)
                }
            }
        };
        let weights_tk = b.scale(&probs_tk, self.spec.scaling_factor)?;
        let weights_tk = self.returned(b, weights_tk, model_dtype)?;

        // Counts in the accumulation type: in bf16 a count past 256 would
        // round (loads, the balancing shares and the expert-bias update all
        // read them).
        let ones_tk = b.fill(&[t, k], 1.0, dtype.acc())?;
        let mask_te = b.scatter_cols(&ones_tk, &idx_tk, e)?;
        let load_e = b.sum_cols(&mask_te)?;

        let segments = match self.spec.load_balance {
            LoadBalance::None => None,
            // global_aux: `reduce` gives the stage-wide running loads (`MoeLayer::global_counts`).
            LoadBalance::Aux | LoadBalance::GlobalAux => Some(TokenShard {
                segment: shard.total,
                ..shard
            }),
            LoadBalance::SeqAux => Some(shard),
        };
        let (aux_loss, aux) = match segments {
            Some(n) if self.spec.aux_coef != 0.0 => {
                let (probs_te, sigmoid_te) = match &score {
                    ScoreSaved::PreSoftmax { probs_te } => (probs_te.clone(), None),
                    ScoreSaved::PostSoftmax { .. } => (b.softmax(&logits_te)?, None),
                    ScoreSaved::Sigmoid { scores_te, .. } => (
                        b.softmax(&b.log_sigmoid(&logits_te)?)?,
                        Some(scores_te.clone()),
                    ),
                };
                let (loss, balance) = loss::balance_forward(
                    b,
                    &probs_te,
                    &mask_te,
                    n,
                    k,
                    self.spec.aux_coef,
                    reduce,
                )?;
                let saved = AuxSaved {
                    probs_te,
                    sigmoid_te,
                    balance,
                };
                (loss, Some(saved))
            }
            _ => (b.zeros(&[1], dtype)?, None),
        };
        let (z_loss, z) = if self.spec.z_loss_coef != 0.0 {
            let (loss, saved) = loss::z_forward(b, &logits_te, self.spec.z_loss_coef, shard.total)?;
            (loss, Some(saved))
        } else {
            (b.zeros(&[1], dtype)?, None)
        };

        let routing = Routing {
            idx_tk: idx_tk.clone(),
            weights_tk,
            aux_loss: self.returned(b, aux_loss, model_dtype)?,
            z_loss: self.returned(b, z_loss, model_dtype)?,
            load_e,
        };
        let saved = RouterSaved {
            x_td: x_td.clone(),
            idx_tk,
            score,
            aux,
            z,
        };
        Ok((routing, saved))
    }

    /// Backward from `dweights: [T, K]`, plus `loss_scale` × the gradient of
    /// the auxiliary losses; accumulates `dWr` and returns `dx: [T, D]`.
    pub fn backward(
        &mut self,
        b: &B,
        dweights_tk: &Tensor<B>,
        saved: RouterSaved<B>,
        loss_scale: f64,
    ) -> Result<Tensor<B>> {
        let RouterSaved {
            x_td,
            idx_tk,
            score,
            aux,
            z,
        } = saved;
        let e = self.experts;
        let dprobs_tk = b.scale(&self.computing(b, dweights_tk)?, self.spec.scaling_factor)?;
        let mut dlogits_te = match score {
            ScoreSaved::PostSoftmax { probs_tk } => {
                b.scatter_cols(&b.softmax_backward(&probs_tk, &dprobs_tk)?, &idx_tk, e)?
            }
            ScoreSaved::PreSoftmax { probs_te } => {
                b.softmax_backward(&probs_te, &b.scatter_cols(&dprobs_tk, &idx_tk, e)?)?
            }
            ScoreSaved::Sigmoid {
                scores_te,
                probs_tk: Some(probs_tk),
            } => {
                let dlogsig_tk = b.softmax_backward(&probs_tk, &dprobs_tk)?;
                let chosen_tk = b.gather_cols(&scores_te, &idx_tk)?;
                let dchosen_tk = log_sigmoid_backward(b, &chosen_tk, &dlogsig_tk)?;
                b.scatter_cols(&dchosen_tk, &idx_tk, e)?
            }
            ScoreSaved::Sigmoid {
                scores_te,
                probs_tk: None,
            } => b.sigmoid_backward(&scores_te, &b.scatter_cols(&dprobs_tk, &idx_tk, e)?)?,
        };
        if let (Some(aux), true) = (aux, loss_scale != 0.0) {
            let dprobs_te = loss::balance_backward(aux.balance);
            let mut d_te = b.softmax_backward(&aux.probs_te, &dprobs_te)?;
            if let Some(sigmoid_te) = &aux.sigmoid_te {
                d_te = log_sigmoid_backward(b, sigmoid_te, &d_te)?;
            }
            b.axpy(&mut dlogits_te, loss_scale, &d_te)?;
        }
        if let (Some(z), true) = (z, loss_scale != 0.0) {
            b.axpy(&mut dlogits_te, 1.0, &loss::z_backward(b, z, loss_scale)?)?;
        }
        let dw = b.matmul(&self.computing(b, &x_td)?, &dlogits_te, true, false)?;
        let dw = self.returned(b, dw, self.weight.value.dtype())?;
        self.weight.accumulate(b, &dw)?;
        let dx = b.matmul(
            &dlogits_te,
            &self.computing(b, &self.weight.value)?,
            false,
            true,
        )?;
        self.returned(b, dx, x_td.dtype())
    }
}

impl<B: Backend> Module<B> for Router<B> {
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

    use super::*;
    use crate::engine::moe::testutil::*;

    const T: usize = 8;
    const D: usize = 5;

    fn router(moe: &MoeSpec, d: usize) -> Router<Cpu> {
        Router::new(
            &Cpu,
            "r",
            d,
            moe,
            0.8,
            crate::engine::Init::full(3),
            DType::F64,
        )
        .unwrap()
    }

    /// `Σ weights ⊙ R + aux + z`: the objective of every router gradient check.
    fn objective(r: &Router<Cpu>, x: &Tensor<Cpu>, n_seq: usize, rw: &[f64]) -> f64 {
        let (out, _) = r.forward(&Cpu, x, n_seq).unwrap();
        dot(&out.weights_tk, rw) + host(&out.aux_loss)[0] + host(&out.z_loss)[0]
    }

    fn spec(experts: usize, top_k: usize, edit: impl FnOnce(&mut RouterSpec)) -> MoeSpec {
        let mut moe = moe_spec(experts, top_k, 3, 0);
        moe.router.aux_coef = 0.3;
        moe.router.z_loss_coef = 0.05;
        edit(&mut moe.router);
        moe
    }

    fn check_router(what: &str, moe: MoeSpec, n_seq: usize, bias: Option<Vec<f64>>) {
        let (e, k) = (moe.experts, moe.top_k);
        let mut r = router(&moe, D);
        if let Some(bias) = bias {
            r.set_expert_bias(t64(bias, &[e])).unwrap();
        }
        let x = uniform(11, T * D, 1.0);
        let rw = uniform(12, T * k, 1.0);
        let (_, saved) = r.forward(&Cpu, &t64(x.clone(), &[T, D]), n_seq).unwrap();
        let dx = r
            .backward(&Cpu, &t64(rw.clone(), &[T, k]), saved, 1.0)
            .unwrap();
        check_grads(what, &mut r, &x, &[T, D], &host(&dx), |r, x| {
            objective(r, x, n_seq, &rw)
        });
    }

    #[test]
    fn router_grad_softmax() {
        check_router("softmax", spec(6, 2, |_| {}), 1, None);
    }

    #[test]
    fn router_grad_pre_softmax() {
        let moe = spec(6, 2, |r| r.pre_softmax = true);
        check_router("pre_softmax", moe, 1, None);
    }

    #[test]
    fn router_grad_pre_softmax_top1() {
        let moe = spec(6, 1, |r| r.pre_softmax = true);
        check_router("pre_softmax top1", moe, 1, None);
    }

    #[test]
    fn router_grad_sigmoid() {
        let moe = spec(6, 3, |r| r.score = ScoreFunction::Sigmoid);
        check_router("sigmoid", moe, 1, None);
    }

    #[test]
    fn router_grad_sigmoid_top1() {
        let moe = spec(6, 1, |r| r.score = ScoreFunction::Sigmoid);
        check_router("sigmoid top1", moe, 1, None);
    }

    #[test]
    fn router_grad_sigmoid_with_bias() {
        let moe = spec(6, 2, |r| {
            r.score = ScoreFunction::Sigmoid;
            r.expert_bias_rate = Some(1e-3);
            r.scaling_factor = 2.5;
        });
        let bias = vec![0.3, -0.2, 0.1, 0.25, -0.35, 0.05];
        check_router("sigmoid with bias", moe, 1, Some(bias));
    }

    #[test]
    fn router_grad_group_limited() {
        let moe = spec(8, 4, |r| {
            r.groups = 4;
            r.group_top_k = 2;
        });
        check_router("group-limited softmax", moe, 1, None);
        let moe = spec(8, 4, |r| {
            r.score = ScoreFunction::Sigmoid;
            r.groups = 4;
            r.group_top_k = 2;
            r.expert_bias_rate = Some(1e-3);
        });
        let bias = vec![0.1, -0.1, 0.2, 0.0, -0.2, 0.15, 0.05, -0.05];
        check_router("group-limited sigmoid with bias", moe, 1, Some(bias));
    }

    #[test]
    fn router_grad_seq_aux() {
        let moe = spec(6, 2, |r| r.load_balance = LoadBalance::SeqAux);
        check_router("seq_aux softmax", moe, 4, None);
        let moe = spec(6, 2, |r| {
            r.load_balance = LoadBalance::SeqAux;
            r.score = ScoreFunction::Sigmoid;
        });
        check_router("seq_aux sigmoid", moe, 2, None);
    }

    #[test]
    fn router_grad_loss_scale_scales_only_the_losses() {
        // With zero upstream gradient only the losses drive the router, so the
        // gradient must scale exactly with loss_scale.
        let moe = spec(6, 2, |_| {});
        let grad = |scale: f64| {
            let mut r = router(&moe, D);
            let x = t64(uniform(11, T * D, 1.0), &[T, D]);
            let (_, saved) = r.forward(&Cpu, &x, 1).unwrap();
            let dw = t64(vec![0.0; T * 2], &[T, 2]);
            host(&r.backward(&Cpu, &dw, saved, scale).unwrap())
        };
        let (g1, g3) = (grad(1.0), grad(3.0));
        assert!(g1.iter().any(|v| v.abs() > 1e-6));
        for (a, b) in g1.iter().zip(&g3) {
            assert!((3.0 * a - b).abs() < 1e-12, "{a} {b}");
        }
    }

    /// Top-k of `scores` by trying every set of `gk` groups (group score: sum
    /// of its best `k / gk` scores) and ranking the experts they hold.
    fn brute_force_topk(scores: &[f64], k: usize, groups: usize, gk: usize) -> Vec<i32> {
        let per = scores.len() / groups;
        let group_score = |g: usize| {
            let mut v = scores[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.partial_cmp(a).unwrap());
            v[..k / gk].iter().sum::<f64>()
        };
        let mut best: Option<(f64, Vec<usize>)> = None;
        for mask in 0u32..(1 << groups) {
            if mask.count_ones() as usize != gk {
                continue;
            }
            let chosen: Vec<usize> = (0..groups).filter(|g| mask & (1 << g) != 0).collect();
            let total: f64 = chosen.iter().map(|&g| group_score(g)).sum();
            if best.as_ref().is_none_or(|(b, _)| total > *b) {
                best = Some((total, chosen));
            }
        }
        let chosen = best.unwrap().1;
        let mut eligible: Vec<usize> = (0..scores.len())
            .filter(|e| chosen.contains(&(e / per)))
            .collect();
        eligible.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap());
        eligible[..k].iter().map(|&e| e as i32).collect()
    }

    #[test]
    fn router_group_limited_matches_brute_force() {
        let (t, d, e, k, groups, gk) = (32, 6, 8, 4, 4, 2);
        for sigmoid in [false, true] {
            let moe = spec(e, k, |r| {
                r.groups = groups;
                r.group_top_k = gk;
                if sigmoid {
                    r.score = ScoreFunction::Sigmoid;
                    r.expert_bias_rate = Some(1e-3);
                }
            });
            let mut r = router(&moe, d);
            let bias = uniform(5, e, 0.2);
            if sigmoid {
                r.set_expert_bias(t64(bias.clone(), &[e])).unwrap();
            }
            let x = uniform(6, t * d, 1.0);
            let (out, _) = r.forward(&Cpu, &t64(x.clone(), &[t, d]), 1).unwrap();
            let idx = host_i32(&out.idx_tk);
            let w = host(&r.weight.value);
            for tok in 0..t {
                let scores: Vec<f64> = (0..e)
                    .map(|j| {
                        let l: f64 = (0..d).map(|i| x[tok * d + i] * w[i * e + j]).sum();
                        if sigmoid {
                            1.0 / (1.0 + (-l).exp()) + bias[j]
                        } else {
                            l
                        }
                    })
                    .collect();
                let want = brute_force_topk(&scores, k, groups, gk);
                assert_eq!(
                    &idx[tok * k..(tok + 1) * k],
                    &want[..],
                    "token {tok}, sigmoid = {sigmoid}, scores {scores:?}"
                );
            }
        }
    }

    const LN3: f64 = 1.0986122886681098;

    /// A 2-expert router with `Wr = I`, so the logits are the inputs: tokens
    /// with logits `[ln 3, 0], [0, ln 3], [ln 3, 0], [ln 3, 0]`.
    fn hand_router(top_k: usize, edit: impl FnOnce(&mut RouterSpec)) -> (Router<Cpu>, Tensor<Cpu>) {
        let mut moe = moe_spec(2, top_k, 3, 0);
        moe.router.aux_coef = 0.1;
        moe.router.z_loss_coef = 0.0;
        edit(&mut moe.router);
        let mut r = router(&moe, 2);
        r.weight.value = t64(vec![1.0, 0.0, 0.0, 1.0], &[2, 2]);
        let x = t64(vec![LN3, 0.0, 0.0, LN3, LN3, 0.0, LN3, 0.0], &[4, 2]);
        (r, x)
    }

    fn close(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
    }

    /// A bf16 router counts its routed copies exactly: 1000 tokens, all
    /// choosing expert 0 (bf16 holds integers only up to 256 exactly, so a
    /// bf16 count would read 1000 only by luck of rounding; 1001 cannot be).
    #[test]
    fn bf16_router_counts_are_exact() {
        use foldmoe_kernels::Device as _;
        let (mut r, _) = hand_router(1, |r| r.pre_softmax = true);
        let bf = |v: Vec<f64>, shape: &[usize]| Cpu.cast(&t64(v, shape), DType::BF16).unwrap();
        r.weight.value = bf(vec![1.0, 0.0, 0.0, 1.0], &[2, 2]);
        let t = 1001;
        let x = bf([LN3, 0.0].repeat(t), &[t, 2]);
        let (out, _) = r.forward(&Cpu, &x, 1).unwrap();
        assert_eq!(out.load_e.dtype(), DType::F32);
        assert_eq!(host(&out.load_e), vec![1001.0, 0.0]);
        // The bias update compares exact counts and steps the (f32) bias.
        r.spec.expert_bias_rate = Some(0.5);
        r.expert_bias_e = Some(Cpu.zeros(&[2], DType::F32).unwrap());
        r.update_expert_bias(&Cpu, &out.load_e).unwrap();
        assert_eq!(host(r.expert_bias().unwrap()), vec![-0.5, 0.5]);
    }

    /// A bf16 model's expert bias keeps moving by the rate where bf16 could
    /// not hold the step (spacing 2^-8 = 3.9e-3 in [0.5, 1): a 1e-3 step
    /// would round away): it is kept in f32, a bf16 bias is refused, and
    /// sigmoid scores select against it.
    #[test]
    fn bf16_router_expert_bias_is_f32_and_keeps_moving() {
        use foldmoe_kernels::Device as _;
        let mut spec = MoeSpec {
            experts: 2,
            top_k: 1,
            expert_ffn: 4,
            shared_ffn: 0,
            shared_gate: false,
            router: RouterSpec {
                score: ScoreFunction::Sigmoid,
                expert_bias_rate: Some(1e-3),
                ..RouterSpec::default()
            },
            capacity: None,
        };
        spec.router.load_balance = LoadBalance::None;
        let mut r = Router::new(
            &Cpu,
            "r",
            2,
            &spec,
            0.1,
            crate::engine::Init::full(3),
            DType::BF16,
        )
        .unwrap();
        assert_eq!(r.expert_bias().unwrap().dtype(), DType::F32);
        let bf16_bias = Cpu.zeros(&[2], DType::BF16).unwrap();
        assert!(r.set_expert_bias(bf16_bias).is_err());
        let f32_of = |v: Vec<f64>| Cpu.cast(&t64(v, &[2]), DType::F32).unwrap();
        r.set_expert_bias(f32_of(vec![0.75, -0.75])).unwrap();
        // Expert 1 under-loaded: +1e-3 to it, -1e-3 to expert 0.
        r.update_expert_bias(&Cpu, &f32_of(vec![3.0, 1.0])).unwrap();
        let got = host(r.expert_bias().unwrap());
        close_f32(got[0], 0.749);
        close_f32(got[1], -0.749);
        // bf16 scores against the f32 bias: expert 0 wins by its bias.
        let x = Cpu
            .cast(&t64(vec![0.0, 0.0], &[1, 2]), DType::BF16)
            .unwrap();
        let (out, _) = r.forward(&Cpu, &x, 1).unwrap();
        assert_eq!(host_i32(&out.idx_tk), vec![0]);
    }

    /// `router_dtype = fp32` in a bf16 model (DeepSeek-V3's gating): the
    /// routing, losses and gradients are the f32 router's on the same
    /// (bf16-valued) input and weight, each cast to bf16 once at the end;
    /// the model-dtype router rounds its logits and scores and differs.
    #[test]
    fn fp32_router_in_a_bf16_model_is_the_f32_router_cast_once() {
        use foldmoe_kernels::Device as _;
        let (t, d, e) = (24, 8, 6);
        let bf = |t: &Tensor<Cpu>| Cpu.cast(t, DType::BF16).unwrap();
        let f32_of = |t: &Tensor<Cpu>| Cpu.cast(t, DType::F32).unwrap();
        let noise = |seed: u64, n: usize| -> Vec<f64> {
            (0..n)
                .map(|i| (i as f64 * 0.7 + seed as f64).sin() * 1.3)
                .collect()
        };
        let x_bf = bf(&t64(noise(1, t * d), &[t, d]));
        let w_bf = bf(&t64(noise(2, d * e), &[d, e]));
        let dw_bf = bf(&t64(noise(3, t * 2), &[t, 2]));
        let mut moe = moe_spec(e, 2, 4, 0);
        moe.router.score = ScoreFunction::Sigmoid;
        moe.router.expert_bias_rate = Some(1e-3);
        moe.router.load_balance = LoadBalance::SeqAux;
        moe.router.aux_coef = 0.1;
        moe.router.z_loss_coef = 0.01;
        let run = |dtype: DType, router_dtype: RouterDtype| {
            let mut spec = moe.clone();
            spec.router.dtype = router_dtype;
            let init = crate::engine::Init::full(5);
            let mut r = Router::new(&Cpu, "r", d, &spec, 0.1, init, dtype).unwrap();
            let (x, w, dw) = if dtype == DType::F32 {
                (f32_of(&x_bf), f32_of(&w_bf), f32_of(&dw_bf))
            } else {
                (x_bf.clone(), w_bf.clone(), dw_bf.clone())
            };
            r.weight.value = w;
            let (out, saved) = r.forward(&Cpu, &x, 2).unwrap();
            let dx = r.backward(&Cpu, &dw, saved, 1.0).unwrap();
            let as_bf = |t: &Tensor<Cpu>| host(&bf(t));
            (
                host_i32(&out.idx_tk),
                [
                    as_bf(&out.weights_tk),
                    as_bf(&out.aux_loss),
                    as_bf(&out.z_loss),
                    as_bf(&dx),
                    as_bf(&r.weight.grad),
                ],
                out.weights_tk.dtype(),
            )
        };
        let reference = run(DType::F32, RouterDtype::Model);
        let fp32 = run(DType::BF16, RouterDtype::Fp32);
        let model = run(DType::BF16, RouterDtype::Model);
        assert_eq!(fp32.2, DType::BF16, "routing weights in the model's dtype");
        assert_eq!(fp32.0, reference.0, "chosen experts");
        for (what, (got, want)) in ["weights", "aux loss", "z loss", "dx", "dW"]
            .iter()
            .zip(fp32.1.iter().zip(&reference.1))
        {
            assert_eq!(got, want, "{what}");
        }
        assert_ne!(model.1, reference.1, "the bf16 router rounds differently");
    }

    fn close_f32(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-6, "got {got}, want {want}");
    }

    #[test]
    fn router_aux_loss_matches_hand_computed() {
        // Softmax probabilities [.75, .25], [.25, .75], [.75, .25], [.75, .25];
        // choices e0, e1, e0, e0: f = [3/4, 1/4], P = [2.5/4, 1.5/4] = [.625, .375];
        // aux = 0.1 · 2 · (.75·.625 + .25·.375) = 0.1 · 2 · .5625 = 0.1125.
        let (r, x) = hand_router(1, |r| r.pre_softmax = true);
        let (out, _) = r.forward(&Cpu, &x, 1).unwrap();
        close(host(&out.aux_loss)[0], 0.1125);
        assert_eq!(host(&out.load_e), vec![3.0, 1.0]);
        assert_eq!(host_i32(&out.idx_tk), vec![0, 1, 0, 0]);
        for w in host(&out.weights_tk) {
            close(w, 0.75);
        }
    }

    #[test]
    fn router_seq_aux_matches_hand_computed() {
        // Sequence 1 (tokens 0, 1): f = [.5, .5], P = [.5, .5] → Σ f·P = .5.
        // Sequence 2 (tokens 2, 3): f = [1, 0], P = [.75, .25] → Σ f·P = .75.
        // seq_aux = 0.1 · 2 · mean(.5, .75) = 0.125.
        let (r, x) = hand_router(1, |r| {
            r.pre_softmax = true;
            r.load_balance = LoadBalance::SeqAux;
        });
        let (out, _) = r.forward(&Cpu, &x, 2).unwrap();
        close(host(&out.aux_loss)[0], 0.125);
    }

    #[test]
    fn router_global_aux_is_aux_on_one_rank() {
        let (r, x) = hand_router(1, |r| {
            r.pre_softmax = true;
            r.load_balance = LoadBalance::GlobalAux;
        });
        let (out, _) = r.forward(&Cpu, &x, 2).unwrap();
        close(host(&out.aux_loss)[0], 0.1125);
    }

    #[test]
    fn router_aux_loss_sigmoid_matches_hand_computed() {
        // sigmoid(ln 3) = .75, sigmoid(0) = .5; normalised over E: [.6, .4].
        // Top-1 choices e0, e1, e0, e0: f = [3/4, 1/4];
        // P = [(.6 + .4 + .6 + .6)/4, (.4 + .6 + .4 + .4)/4] = [.55, .45];
        // aux = 0.1 · 2 · (.75·.55 + .25·.45) = 0.1 · 2 · .525 = 0.105.
        // Top-1 sigmoid weights are the raw scores (.75).
        let (r, x) = hand_router(1, |r| r.score = ScoreFunction::Sigmoid);
        let (out, _) = r.forward(&Cpu, &x, 1).unwrap();
        close(host(&out.aux_loss)[0], 0.105);
        for w in host(&out.weights_tk) {
            close(w, 0.75);
        }
        // Top-2: the two chosen renormalised: [.6, .4] in descending order.
        let (r, x) = hand_router(2, |r| r.score = ScoreFunction::Sigmoid);
        let (out, _) = r.forward(&Cpu, &x, 1).unwrap();
        let w = host(&out.weights_tk);
        for t in 0..4 {
            close(w[2 * t], 0.6);
            close(w[2 * t + 1], 0.4);
        }
    }

    #[test]
    fn router_z_loss_matches_hand_computed() {
        // logsumexp([ln 3, 0]) = ln 4 for every token: z = 0.01 · (ln 4)².
        let (r, x) = hand_router(2, |r| {
            r.z_loss_coef = 0.01;
            r.load_balance = LoadBalance::None;
        });
        let (out, _) = r.forward(&Cpu, &x, 1).unwrap();
        close(host(&out.z_loss)[0], 0.019218120556728054);
        assert_eq!(host(&out.aux_loss), vec![0.0]);
        // Post-softmax top-2 of two experts: the full softmax, [.75, .25].
        let w = host(&out.weights_tk);
        close(w[0], 0.75);
        close(w[1], 0.25);
    }

    #[test]
    fn router_rejects_uneven_sequences() {
        let r = router(&spec(6, 2, |_| {}), D);
        let x = t64(uniform(11, T * D, 1.0), &[T, D]);
        let err = r.forward(&Cpu, &x, 3).err().unwrap().to_string();
        assert!(err.contains("T = 8") && err.contains("n_seq = 3"), "{err}");
    }

    #[test]
    fn router_expert_bias_checks_its_shape() {
        let moe = spec(6, 2, |r| {
            r.score = ScoreFunction::Sigmoid;
            r.expert_bias_rate = Some(1e-3);
        });
        let mut r = router(&moe, D);
        let err = r.set_expert_bias(t64(vec![0.0; 5], &[5])).unwrap_err();
        assert!(err.to_string().contains("[5]"), "{err}");
        let err = r
            .update_expert_bias(&Cpu, &t64(vec![1.0; 4], &[4]))
            .unwrap_err();
        assert!(err.to_string().contains("expected [6]"), "{err}");
        let mut plain = router(&spec(6, 2, |_| {}), D);
        assert!(plain.set_expert_bias(t64(vec![0.0; 6], &[6])).is_err());
        plain
            .update_expert_bias(&Cpu, &t64(vec![1.0; 6], &[6]))
            .unwrap();
        assert!(plain.expert_bias().is_none());
    }
}
