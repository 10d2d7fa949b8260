//! Route: score every token against every expert, choose its top-k experts
//! and their weights, and compute the router's auxiliary losses (DESIGN §4;
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
//! `softmax(log sigmoid(l))` over the chosen, which needs no division.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::loss::{self, BalanceSaved, ZSaved};
use super::ops::{filled, log_sigmoid, log_sigmoid_backward};
use crate::engine::{init_normal, EngineError, Param, Result};
use crate::spec::{LoadBalance, MoeSpec, RouterSpec, ScoreFunction};

/// The router: a linear map `Wr: [D, E]` to logits, plus the optional
/// aux-loss-free expert bias (a buffer, not trained by gradients).
pub struct Router<B: Backend> {
    /// Router weight `Wr: [D, E]`, named `{prefix}.weight`.
    pub weight: Param<B>,
    expert_bias_e: Option<Tensor<B>>,
    spec: RouterSpec,
    experts: usize,
    top_k: usize,
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

impl<B: Backend> Router<B> {
    /// The router of `moe` with normal(0, std) weights seeded by
    /// `(seed, "{prefix}.weight")`; the expert bias starts at zero.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        moe: &MoeSpec,
        init_std: f64,
        seed: u64,
        dtype: DType,
    ) -> Result<Self> {
        let (spec, experts, top_k) = (&moe.router, moe.experts, moe.top_k);
        let name = format!("{prefix}.weight");
        let value = init_normal(b, &[hidden, experts], init_std, seed, &name, dtype)?;
        let expert_bias_e = match spec.expert_bias_rate {
            Some(_) => Some(filled(b, &[experts], 0.0, dtype)?),
            None => None,
        };
        Ok(Router {
            weight: Param::new(b, name, value)?,
            expert_bias_e,
            spec: spec.clone(),
            experts,
            top_k,
        })
    }

    /// The expert bias `[E]`, if the spec has one.
    pub fn expert_bias(&self) -> Option<&Tensor<B>> {
        self.expert_bias_e.as_ref()
    }

    /// Replaces the expert bias (checkpoint loading); `[E]` in the router's dtype.
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
        let dtype = self.weight.value.dtype();
        let load_e = if load_e.dtype() == DType::I32 {
            b.cast(load_e, dtype)?
        } else {
            load_e.clone()
        };
        self.check_e_vector("update_expert_bias", "load", &load_e)?;
        let e = self.experts;
        // Broadcast the mean of the loads to [E] with a rank-1 product.
        let total_11 = b.sum(&load_e)?.reshape(&[1, 1])?;
        let ones_e1 = filled(b, &[e, 1], 1.0 / e as f64, dtype)?;
        let mean_e = b.matmul(&ones_e1, &total_11, false, false)?.reshape(&[e])?;
        let step_e = super::ops::sign(b, &b.sub(&mean_e, &load_e)?)?;
        if let Some(bias_e) = self.expert_bias_e.as_mut() {
            b.axpy(bias_e, rate, &step_e)?;
        }
        Ok(())
    }

    fn check_e_vector(&self, op: &str, what: &str, t: &Tensor<B>) -> Result<()> {
        let dtype = self.weight.value.dtype();
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
        let (e, k) = (self.experts, self.top_k);
        let dtype = x_td.dtype();
        let logits_te = b.matmul(x_td, &self.weight.value, false, false)?;

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
                    Some(bias_e) => self.select(b, &b.add_cols(&scores_te, bias_e)?)?,
                    None => self.select(b, &scores_te)?,
                };
                if k > 1 {
                    let chosen_tk = b.gather_cols(&logits_te, &idx_tk)?;
                    let probs_tk = b.softmax(&log_sigmoid(b, &chosen_tk)?)?;
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

        let ones_tk = filled(b, &[t, k], 1.0, dtype)?;
        let mask_te = b.scatter_cols(&ones_tk, &idx_tk, e)?;
        let load_e = b.sum_cols(&mask_te)?;

        let segments = match self.spec.load_balance {
            LoadBalance::None => None,
            // One rank sees one micro-batch: global_aux reduces to aux here; the
            // sum of loads over the dp group and accumulation steps comes with
            // the parallel runtime.
            LoadBalance::Aux | LoadBalance::GlobalAux => Some(1),
            LoadBalance::SeqAux => Some(n_seq),
        };
        let (aux_loss, aux) = match segments {
            Some(n) if self.spec.aux_coef != 0.0 => {
                let (probs_te, sigmoid_te) = match &score {
                    ScoreSaved::PreSoftmax { probs_te } => (probs_te.clone(), None),
                    ScoreSaved::PostSoftmax { .. } => (b.softmax(&logits_te)?, None),
                    ScoreSaved::Sigmoid { scores_te, .. } => (
                        b.softmax(&log_sigmoid(b, &logits_te)?)?,
                        Some(scores_te.clone()),
                    ),
                };
                let (loss, balance) =
                    loss::balance_forward(b, &probs_te, &mask_te, n, k, self.spec.aux_coef)?;
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
            let (loss, saved) = loss::z_forward(b, &logits_te, self.spec.z_loss_coef)?;
            (loss, Some(saved))
        } else {
            (b.zeros(&[1], dtype)?, None)
        };

        let routing = Routing {
            idx_tk: idx_tk.clone(),
            weights_tk,
            aux_loss,
            z_loss,
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
        let dprobs_tk = b.scale(dweights_tk, self.spec.scaling_factor)?;
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
        self.weight
            .accumulate(b, &b.matmul(&x_td, &dlogits_te, true, false)?)?;
        Ok(b.matmul(&dlogits_te, &self.weight.value, false, true)?)
    }
}
