//! One training step on one rank: gradient accumulation over micro-batches,
//! clipping by global norm, AdamW at the scheduled learning rate, and the
//! aux-loss-free expert-bias update (Megatron-LM's `train_step`).
//!
//! This is where scalars are read to the host: the losses, the gradient norm
//! (to clip and to refuse a non-finite step) and the expert loads (for logging).

use foldmoe_kernels::{Backend, KernelError, Tensor};

use super::model::Model;
use super::optim::{clip_coefficient, global_grad_norm, AdamW, AdamWParams, MasterWeights};
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
    /// Which parameters AdamW updates through an f32 master copy (bf16 ones
    /// by default), chosen when the optimizer state is created.
    pub master_weights: MasterWeights,
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
            master_weights: MasterWeights::Bf16,
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
        let opt = AdamW::with_master_weights(b, &model, cfg.adamw(), cfg.master_weights)?;
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
        // A kernel that meets a NaN or inf reports it; name the step as for a
        // non-finite loss below.
        let non_finite = |e: EngineError| match e {
            EngineError::Kernel(k @ KernelError::NonFinite { .. }) => {
                EngineError::Invalid(format!("step {step}: {k}; the update was not applied"))
            }
            other => other,
        };
        for (tokens, targets) in micro_batches {
            let out = self.model.forward(b, tokens, targets).map_err(non_finite)?;
            loss_sum = Some(accumulate(b, loss_sum, &out.loss)?);
            aux_sum = Some(accumulate(b, aux_sum, &out.aux_loss)?);
            if loads.is_empty() {
                loads = out.moe_load;
            } else {
                for (acc, load) in loads.iter_mut().zip(&out.moe_load) {
                    b.axpy(acc, 1.0, load)?;
                }
            }
            self.model
                .backward(b, out.saved, scale)
                .map_err(non_finite)?;
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
        let grad_scale = clip_coefficient(grad_norm, self.cfg.grad_clip);
        let lr = self.cfg.schedule().lr_at(step);
        // cfg is public: pick up any change to the AdamW settings since the last step.
        self.opt.hyper = self.cfg.adamw();
        self.opt.step_scaled(b, &mut self.model, lr, grad_scale)?;
        self.model.update_expert_biases(b, &loads)?;
        let load_imbalance = load_imbalance(b, &loads)?;
        Ok(StepStats {
            loss,
            aux_loss,
            grad_norm,
            lr,
            load_imbalance,
        })
    }
}

/// max/mean expert load of the worst MoE layer (1 when balanced or without
/// MoE layers), read to the host for logging.
pub(crate) fn load_imbalance<B: Backend>(b: &B, loads: &[Tensor<B>]) -> Result<f64> {
    let mut worst: f64 = 1.0;
    for load in loads {
        let l = b.download(load)?.to_f64();
        let mean = l.iter().sum::<f64>() / l.len().max(1) as f64;
        let max = l.iter().cloned().fold(0.0, f64::max);
        if mean > 0.0 {
            worst = worst.max(max / mean);
        }
    }
    Ok(worst)
}

/// `acc + x`, or `x` when nothing has been accumulated yet.
fn accumulate<B: Backend>(b: &B, acc: Option<Tensor<B>>, x: &Tensor<B>) -> Result<Tensor<B>> {
    Ok(match acc {
        None => x.clone(),
        Some(acc) => b.add(&acc, x)?,
    })
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::{DType, Device, HostData, Tensor};

    use super::{TrainConfig, Trainer};
    use crate::engine::model::Model;
    use crate::engine::param::Module;
    use crate::engine::testutil::{f64_tensor, i32_tensor, small_moe, small_spec, values};
    use crate::engine::EngineError;
    use crate::spec::{FfnSpec, LoadBalance};

    fn all_values(model: &Model<Cpu>) -> Vec<Vec<f64>> {
        let mut v = Vec::new();
        model.visit_params(&mut |p| v.push(values(&p.value)));
        v
    }

    fn all_grads(model: &Model<Cpu>) -> Vec<Vec<f64>> {
        let mut v = Vec::new();
        model.visit_params(&mut |p| v.push(values(&p.grad)));
        v
    }

    /// `(tokens, targets)` rows `rows` of a fixed `[4, 4]` batch.
    fn rows(rows: std::ops::Range<usize>) -> (Tensor<Cpu>, Tensor<Cpu>) {
        let tokens = [3, 0, 6, 1, 7, 2, 5, 4, 1, 1, 0, 6, 2, 7, 7, 3];
        let targets = [0, 6, 1, 5, 2, 5, 4, 3, 1, 0, 6, 6, 7, 7, 3, 2];
        let n = rows.len();
        let r = rows.start * 4..rows.end * 4;
        (
            i32_tensor(tokens[r.clone()].to_vec(), &[n, 4]),
            i32_tensor(targets[r].to_vec(), &[n, 4]),
        )
    }

    #[test]
    fn grad_accumulation_matches_one_batch() {
        let b = Cpu;
        // A micro-batch load-balancing loss is not additive over micro-batches
        // (Megatron's neither), so it is off here; the z-loss, a token mean, stays.
        let mut moe = small_moe();
        if let FfnSpec::Moe(m) = &mut moe {
            m.router.load_balance = LoadBalance::None;
        }
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, moe], false);

        let mut big = Model::new(&b, &spec, 5, DType::F64).unwrap();
        let (tokens, targets) = rows(0..4);
        let out = big.forward(&b, &tokens, &targets).unwrap();
        let big_loss = values(&out.loss)[0];
        let big_aux = values(&out.aux_loss)[0];
        big.backward(&b, out.saved, 1.0).unwrap();

        let cfg = TrainConfig {
            grad_clip: 0.0,
            ..TrainConfig::default()
        };
        let model = Model::new(&b, &spec, 5, DType::F64).unwrap();
        let mut trainer = Trainer::new(&b, model, cfg).unwrap();
        let micro = [rows(0..1), rows(1..2), rows(2..3), rows(3..4)];
        let stats = trainer.step(&b, &micro).unwrap();
        assert!(
            (stats.loss - big_loss).abs() < 1e-12,
            "{} vs {big_loss}",
            stats.loss
        );
        assert!((stats.aux_loss - big_aux).abs() < 1e-12);
        assert!(big_aux > 0.0, "the z-loss takes part");
        for (g_micro, g_big) in all_grads(&trainer.model).iter().zip(all_grads(&big)) {
            for (a, b) in g_micro.iter().zip(&g_big) {
                assert!((a - b).abs() <= 1e-10 * b.abs().max(1e-3), "{a} vs {b}");
            }
        }
        assert_eq!(stats.lr, cfg.schedule().lr_at(1));
        assert!(stats.load_imbalance >= 1.0);
        assert_eq!(trainer.opt.step_count(), 1);
    }

    #[test]
    fn nan_loss_stops_with_an_error_and_leaves_params_unchanged() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let model = Model::new(&b, &spec, 5, DType::F32).unwrap();
        let mut trainer = Trainer::new(&b, model, TrainConfig::default()).unwrap();
        let batch = [rows(0..2)];
        trainer.step(&b, &batch).unwrap();
        // Poison the head: every logit, and so the loss, becomes NaN.
        let head = trainer.model.head.weight.as_mut().unwrap();
        let n = head.value.numel();
        head.value = b
            .upload(HostData::F32(vec![f32::NAN; n]), head.value.shape())
            .unwrap();
        let before = all_values(&trainer.model);
        let err = trainer.step(&b, &batch).unwrap_err();
        match &err {
            EngineError::Invalid(msg) => {
                assert!(msg.contains("step 2") && msg.contains("NaN"), "{msg}")
            }
            other => panic!("expected Invalid, got {other}"),
        }
        let after = all_values(&trainer.model);
        let same = |a: &f64, b: &f64| a.to_bits() == b.to_bits();
        assert!(before
            .iter()
            .flatten()
            .zip(after.iter().flatten())
            .all(|(a, b)| same(a, b)));
        assert_eq!(trainer.opt.step_count(), 1);
    }

    #[test]
    fn inf_grad_norm_stops_with_an_error_and_leaves_params_unchanged() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let model = Model::new(&b, &spec, 5, DType::F32).unwrap();
        let mut trainer = Trainer::new(&b, model, TrainConfig::default()).unwrap();
        // A huge final-norm scale keeps the loss finite in f32 but makes the
        // head's gradient overflow when squared.
        let norm = &mut trainer.model.final_norm.weight;
        norm.value = b
            .upload(HostData::F32(vec![1e30; spec.hidden]), &[spec.hidden])
            .unwrap();
        let before = all_values(&trainer.model);
        let err = trainer.step(&b, &[rows(0..2)]).unwrap_err();
        match &err {
            EngineError::Invalid(msg) => {
                assert!(
                    msg.contains("step 1") && msg.contains("gradient norm is inf"),
                    "{msg}"
                )
            }
            other => panic!("expected Invalid, got {other}"),
        }
        assert_eq!(all_values(&trainer.model), before);
        assert_eq!(trainer.opt.step_count(), 0);
    }

    #[test]
    fn empty_step_is_an_error() {
        let b = Cpu;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let model = Model::new(&b, &spec, 5, DType::F32).unwrap();
        let mut trainer = Trainer::new(&b, model, TrainConfig::default()).unwrap();
        assert!(matches!(
            trainer.step(&b, &[]),
            Err(EngineError::Invalid(_))
        ));
        let bad = [(f64_tensor(vec![1.0; 4], &[1, 4]), rows(0..1).1)];
        assert!(trainer.step(&b, &bad).is_err());
        assert_eq!(trainer.opt.step_count(), 0);
    }

    #[test]
    fn tiny_model_overfits_one_batch() {
        let b = Cpu;
        let mut spec = small_spec(&[FfnSpec::Dense { ffn: 64 }, small_moe()], false);
        spec.vocab = 16;
        spec.hidden = 32;
        spec.seq_len = 12;
        spec.init_std = 0.02;
        if let FfnSpec::Moe(m) = &mut spec.groups[1].ffn {
            m.expert_ffn = 32;
            m.shared_ffn = 32;
            m.router.aux_coef = 1e-2;
            m.router.z_loss_coef = 1e-3;
        }
        for g in &mut spec.groups {
            g.attention.head_dim = 8;
        }
        // Four sequences with distinct first tokens, so every context is unique.
        let (batch, seq) = (4, spec.seq_len);
        let mut rng = 12345u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((rng >> 33) % 16) as i32
        };
        let mut stream: Vec<i32> = Vec::new();
        for s in 0..batch {
            stream.push(s as i32 * 4);
            stream.extend((0..seq).map(|_| next()));
        }
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for s in 0..batch {
            let w = &stream[s * (seq + 1)..(s + 1) * (seq + 1)];
            tokens.extend_from_slice(&w[..seq]);
            targets.extend_from_slice(&w[1..]);
        }
        let data = [(
            i32_tensor(tokens, &[batch, seq]),
            i32_tensor(targets, &[batch, seq]),
        )];
        let cfg = TrainConfig {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 10,
            total_steps: 200,
            weight_decay: 0.0,
            ..TrainConfig::default()
        };
        let model = Model::new(&b, &spec, 0, DType::F32).unwrap();
        let mut trainer = Trainer::new(&b, model, cfg).unwrap();
        let first = trainer.step(&b, &data).unwrap().loss;
        let mut last = first;
        for _ in 1..cfg.total_steps {
            last = trainer.step(&b, &data).unwrap().loss;
        }
        assert!(first > 2.0, "starts near ln(16): {first}");
        assert!(last < 0.05, "did not overfit: {first} -> {last}");
    }
}
