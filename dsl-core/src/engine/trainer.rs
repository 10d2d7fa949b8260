//! One training step on one rank: gradient accumulation over micro-batches,
//! clipping by global norm, AdamW at the scheduled learning rate, and the
//! aux-loss-free expert-bias update (Megatron-LM's `train_step`).
//!
//! This is where scalars are read to the host: the losses, the gradient norm
//! (to clip and to refuse a non-finite step) and the expert loads (for logging).

use foldmoe_kernels::{Backend, Tensor};

use super::model::Model;
use super::optim::{clip_grad_norm, global_grad_norm, AdamW, AdamWParams};
use super::param::Module;
use super::schedule::WarmupCosine;
use super::{EngineError, Result};

/// Optimizer and schedule settings of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Steps until the decay reaches `min_lr`.
    pub total_steps: u64,
    /// Decoupled weight decay of matrices.
    pub weight_decay: f64,
    /// AdamW first-moment decay.
    pub beta1: f64,
    /// AdamW second-moment decay.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Maximum global gradient norm (≤ 0: no clipping).
    pub grad_clip: f64,
}

impl Default for TrainConfig {
    /// Megatron-style pre-training defaults for a small model.
    fn default() -> Self {
        TrainConfig {
            lr: 3e-4,
            min_lr: 3e-5,
            warmup_steps: 100,
            total_steps: 2000,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

impl TrainConfig {
    /// The learning-rate schedule these settings describe.
    pub fn schedule(&self) -> WarmupCosine {
        WarmupCosine {
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            total_steps: self.total_steps,
        }
    }

    fn adamw(&self) -> AdamWParams {
        AdamWParams {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }
}

/// What one step measured, read to the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean cross-entropy over the micro-batches.
    pub loss: f64,
    /// Mean of the MoE layers' summed aux and z-losses over the micro-batches.
    pub aux_loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the update.
    pub lr: f64,
    /// max/mean expert load of the worst MoE layer (1: perfectly balanced;
    /// 1 for a model without MoE layers).
    pub load_imbalance: f64,
}

/// A model, its optimizer and the run's settings.
pub struct Trainer<B: Backend> {
    /// The model being trained.
    pub model: Model<B>,
    /// AdamW state for every parameter of `model`.
    pub opt: AdamW<B>,
    /// Optimizer and schedule settings.
    pub cfg: TrainConfig,
}

impl<B: Backend> Trainer<B> {
    /// A trainer with fresh optimizer state.
    pub fn new(b: &B, model: Model<B>, cfg: TrainConfig) -> Result<Self> {
        let opt = AdamW::new(b, &model, cfg.adamw())?;
        Ok(Trainer { model, opt, cfg })
    }

    /// One optimizer step over a global batch given as `(tokens, targets)`
    /// micro-batches of equal size. A non-finite loss or gradient norm is an
    /// error and leaves the parameters, optimizer and expert biases unchanged.
    pub fn step(&mut self, b: &B, micro_batches: &[(Tensor<B>, Tensor<B>)]) -> Result<StepStats> {
        let step = self.opt.step_count() + 1;
        if micro_batches.is_empty() {
            return Err(EngineError::Invalid(format!(
                "step {step}: no micro-batches given"
            )));
        }
        let scale = 1.0 / micro_batches.len() as f64;
        let mut failure = None;
        self.model.visit_params_mut(&mut |p| {
            if let Err(e) = p.zero_grad(b) {
                failure.get_or_insert(e);
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }

        let mut loss_sum: Option<Tensor<B>> = None;
        let mut aux_sum: Option<Tensor<B>> = None;
        let mut loads: Vec<Tensor<B>> = Vec::new();
        for (tokens, targets) in micro_batches {
            let out = self.model.forward(b, tokens, targets)?;
            loss_sum = Some(accumulate(b, loss_sum, &out.loss)?);
            aux_sum = Some(accumulate(b, aux_sum, &out.aux_loss)?);
            if loads.is_empty() {
                loads = out.moe_load;
            } else {
                for (acc, load) in loads.iter_mut().zip(&out.moe_load) {
                    b.axpy(acc, 1.0, load)?;
                }
            }
            self.model.backward(b, out.saved, scale)?;
        }
        let read = |t: Option<Tensor<B>>| -> Result<f64> {
            let t = t.ok_or_else(|| EngineError::Invalid("no micro-batch ran".into()))?;
            let v = b.download(&t)?.to_f64();
            Ok(v.first().copied().unwrap_or(f64::NAN) * scale)
        };
        let loss = read(loss_sum)?;
        let aux_loss = read(aux_sum)?;
        if !loss.is_finite() || !aux_loss.is_finite() {
            return Err(EngineError::Invalid(format!(
                "step {step}: loss is {loss} (aux loss {aux_loss}); the update was not applied"
            )));
        }
        let grad_norm = global_grad_norm(b, &self.model)?;
        if !grad_norm.is_finite() {
            return Err(EngineError::Invalid(format!(
                "step {step}: gradient norm is {grad_norm}; the update was not applied"
            )));
        }
        clip_grad_norm(b, &mut self.model, grad_norm, self.cfg.grad_clip)?;
        let lr = self.cfg.schedule().lr_at(step);
        self.opt.step(b, &mut self.model, lr)?;
        self.model.update_expert_biases(b, &loads)?;

        let mut load_imbalance: f64 = 1.0;
        for load in &loads {
            let l = b.download(load)?.to_f64();
            let mean = l.iter().sum::<f64>() / l.len().max(1) as f64;
            let max = l.iter().cloned().fold(0.0, f64::max);
            if mean > 0.0 {
                load_imbalance = load_imbalance.max(max / mean);
            }
        }
        Ok(StepStats {
            loss,
            aux_loss,
            grad_norm,
            lr,
            load_imbalance,
        })
    }
}

/// `acc + x`, or `x` when nothing has been accumulated yet.
fn accumulate<B: Backend>(b: &B, acc: Option<Tensor<B>>, x: &Tensor<B>) -> Result<Tensor<B>> {
    Ok(match acc {
        None => x.clone(),
        Some(acc) => b.add(&acc, x)?,
    })
}
