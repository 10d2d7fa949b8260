//! AdamW with decoupled weight decay (Loshchilov & Hutter 2019) and clipping by
//! the global gradient norm, as Megatron-Core's optimizer applies them on one
//! rank: moments per parameter in visit order, no decay on 1-d parameters (norm
//! scales, biases), gradients scaled by `max_norm / (norm + 1e-6)` when the
//! norm exceeds `max_norm`.
//!
//! Mixed precision follows Megatron-Core's fp32 main params: a bf16 parameter
//! gets an f32 master copy and f32 moments; each step updates those in f32
//! and writes the parameter as the rounded master, so updates smaller than
//! bf16's resolution accumulate instead of rounding away. f32 and f64
//! parameters are their own master.

use foldmoe_kernels::{AdamWConfig, Backend, DType, Device, Tensor};

use super::param::{Module, Param};
use super::{EngineError, Result};

/// Hyper-parameters of AdamW that stay fixed during a run (the learning rate
/// comes with each step, from the schedule).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay of matrices (1-d parameters get none).
    pub weight_decay: f64,
}

/// Which parameters the optimizer keeps an f32 master copy of (with f32
/// moments), fixed when the optimizer state is created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MasterWeights {
    /// bf16 parameters (Megatron-Core's mixed precision); f32 and f64
    /// parameters are updated in their own dtype.
    #[default]
    Bf16,
    /// bf16 and f32 parameters. On f32 the master equals the parameter after
    /// every step, bit for bit, so this only changes the path the update
    /// takes: it tests that path on f32 parameters.
    Bf16AndF32,
}

impl MasterWeights {
    /// Whether a parameter of `dtype` gets a master copy.
    pub fn applies_to(self, dtype: DType) -> bool {
        match self {
            MasterWeights::Bf16 => dtype == DType::BF16,
            MasterWeights::Bf16AndF32 => matches!(dtype, DType::BF16 | DType::F32),
        }
    }
}

/// Suffix of a master copy's name in [`AdamW::visit_state`] (Megatron-Core's
/// distributed-optimizer key for the fp32 main param).
pub const MASTER_SUFFIX: &str = "fp32_param";

/// AdamW state: the moments (and, for parameters with one, the f32 master
/// copy) of every parameter, in the model's visit order, and the number of
/// updates applied.
pub struct AdamW<B: Device> {
    /// Fixed hyper-parameters.
    pub hyper: AdamWParams,
    names: Vec<String>,
    m: Vec<Tensor<B>>,
    v: Vec<Tensor<B>>,
    master: Vec<Option<Tensor<B>>>,
    step: u64,
}

impl<B: Backend> AdamW<B> {
    /// Zero moments for every parameter of `model`, and master copies of its
    /// bf16 parameters ([`MasterWeights::Bf16`]).
    pub fn new(b: &B, model: &impl Module<B>, hyper: AdamWParams) -> Result<Self> {
        Self::with_master_weights(b, model, hyper, MasterWeights::Bf16)
    }

    /// Zero moments for every parameter of `model`; parameters `masters`
    /// applies to get an f32 master copy of their current values and f32
    /// moments, the others moments of their own dtype.
    pub fn with_master_weights(
        b: &B,
        model: &impl Module<B>,
        hyper: AdamWParams,
        masters: MasterWeights,
    ) -> Result<Self> {
        let mut params = Vec::new();
        model.visit_params(&mut |p| params.push((p.name.clone(), p.value.clone())));
        let mut names = Vec::with_capacity(params.len());
        let (mut m, mut v, mut master) = (Vec::new(), Vec::new(), Vec::new());
        for (name, value) in params {
            let copy = if masters.applies_to(value.dtype()) {
                Some(b.cast(&value, DType::F32)?)
            } else {
                None
            };
            let state = if copy.is_some() {
                DType::F32
            } else {
                value.dtype()
            };
            m.push(b.zeros(value.shape(), state)?);
            v.push(b.zeros(value.shape(), state)?);
            master.push(copy);
            names.push(name);
        }
        Ok(AdamW {
            hyper,
            names,
            m,
            v,
            master,
            step: 0,
        })
    }

    /// Applies one update at learning rate `lr` to every parameter of `model`
    /// from its accumulated gradient (through its master copy where it has one).
    pub fn step(&mut self, b: &B, model: &mut impl Module<B>, lr: f64) -> Result<()> {
        self.step_scaled(b, model, lr, 1.0)
    }

    /// [`AdamW::step`] on gradients multiplied by `grad_scale` (the clipping
    /// coefficient of [`clip_coefficient`]), applied inside the update.
    pub fn step_scaled(
        &mut self,
        b: &B,
        model: &mut impl Module<B>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let cfg = AdamWConfig {
            lr,
            grad_scale,
            beta1: self.hyper.beta1,
            beta2: self.hyper.beta2,
            eps: self.hyper.eps,
            weight_decay: self.hyper.weight_decay,
            step: self.step + 1,
        };
        self.check_params(model)?;
        let (m, v, master) = (&mut self.m, &mut self.v, &mut self.master);
        let mut index = 0;
        let mut failure: Option<EngineError> = None;
        model.visit_params_mut(&mut |p: &mut Param<B>| {
            let i = index;
            index += 1;
            if failure.is_some() {
                return;
            }
            let cfg = AdamWConfig {
                weight_decay: if p.value.shape().len() <= 1 {
                    0.0
                } else {
                    cfg.weight_decay
                },
                ..cfg
            };
            let r = match &mut master[i] {
                Some(w) => {
                    b.adamw_step_master(&mut p.value, &p.grad, w, &mut m[i], &mut v[i], &cfg)
                }
                None => b.adamw_step(&mut p.value, &p.grad, &mut m[i], &mut v[i], &cfg),
            };
            if let Err(e) = r {
                failure = Some(e.into());
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        self.step += 1;
        Ok(())
    }

    /// Errors unless `model` has exactly the parameters (names, shapes, in
    /// order) this state was built for; checked before any update so a
    /// mismatch changes nothing.
    fn check_params(&self, model: &impl Module<B>) -> Result<()> {
        let mut index = 0;
        let mut failure: Option<String> = None;
        model.visit_params(&mut |p| {
            let i = index;
            index += 1;
            if failure.is_some() {
                return;
            }
            match (self.names.get(i), self.m.get(i)) {
                (Some(name), Some(m)) if *name == p.name && m.shape() == p.value.shape() => {}
                (Some(name), Some(m)) => {
                    failure = Some(format!(
                        "AdamW: parameter {i} is `{}` {:?}, but the optimizer state was built for `{name}` {:?}",
                        p.name,
                        p.value.shape(),
                        m.shape()
                    ))
                }
                _ => {
                    failure = Some(format!(
                        "AdamW: parameter {i} (`{}`) has no optimizer state",
                        p.name
                    ))
                }
            }
        });
        if failure.is_none() && index != self.names.len() {
            failure = Some(format!(
                "AdamW: the model has {index} parameters, the optimizer state {}",
                self.names.len()
            ));
        }
        failure.map_or(Ok(()), |msg| Err(EngineError::Invalid(msg)))
    }

    /// Updates applied so far (the bias-correction step of the last one).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Sets the update count (when restoring a checkpoint).
    pub fn set_step_count(&mut self, n: u64) {
        self.step = n;
    }

    /// Whether any parameter has an f32 master copy.
    pub fn has_masters(&self) -> bool {
        self.master.iter().any(Option::is_some)
    }

    /// Calls `f` on every state tensor, in parameter order: `{param}.exp_avg`
    /// (first moment), `{param}.exp_avg_sq` (second moment) and, for a
    /// parameter with a master copy, `{param}.fp32_param` ([`MASTER_SUFFIX`]).
    pub fn visit_state(&self, f: &mut dyn FnMut(&str, &Tensor<B>)) {
        for (i, name) in self.names.iter().enumerate() {
            f(&format!("{name}.exp_avg"), &self.m[i]);
            f(&format!("{name}.exp_avg_sq"), &self.v[i]);
            if let Some(w) = &self.master[i] {
                f(&format!("{name}.{MASTER_SUFFIX}"), w);
            }
        }
    }

    /// Like [`AdamW::visit_state`], mutably (loading a checkpoint).
    pub fn visit_state_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor<B>)) {
        for (i, name) in self.names.iter().enumerate() {
            f(&format!("{name}.exp_avg"), &mut self.m[i]);
            f(&format!("{name}.exp_avg_sq"), &mut self.v[i]);
            if let Some(w) = &mut self.master[i] {
                f(&format!("{name}.{MASTER_SUFFIX}"), w);
            }
        }
    }
}

/// `Σ g²` over every parameter's gradient, as a `[1]` device tensor.
pub fn grad_sum_squares<B: Backend>(b: &B, model: &impl Module<B>) -> Result<Tensor<B>> {
    let mut total: Option<Result<Tensor<B>>> = None;
    model.visit_params(&mut |p| {
        total = Some(match total.take() {
            None => b.sum_squares(&p.grad).map_err(Into::into),
            Some(Ok(acc)) => b
                .sum_squares(&p.grad)
                .and_then(|s| b.add(&acc, &s))
                .map_err(Into::into),
            Some(Err(e)) => Err(e),
        });
    });
    total.unwrap_or_else(|| Err(EngineError::Invalid("the model has no parameters".into())))
}

/// The global gradient norm `sqrt(Σ g²)` over all parameters, read to the host
/// (the caller decides whether to clip or stop on it).
pub fn global_grad_norm<B: Backend>(b: &B, model: &impl Module<B>) -> Result<f64> {
    let sum = b.download(&grad_sum_squares(b, model)?)?.to_f64();
    Ok(sum.first().copied().unwrap_or(0.0).sqrt())
}

/// The factor that clips gradients of global norm `norm` to `max_norm`:
/// `max_norm / (norm + 1e-6)` when `norm > max_norm` (Megatron's
/// `clip_grad_norm`), else 1; `max_norm ≤ 0` turns clipping off. The
/// optimizer applies it inside its update ([`AdamW::step_scaled`]).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 || norm <= max_norm {
        1.0
    } else {
        max_norm / (norm + 1e-6)
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::DType;

    use super::{clip_coefficient, global_grad_norm, AdamW, AdamWParams, MasterWeights};
    use crate::engine::model::Model;
    use crate::engine::param::Module;
    use crate::engine::testutil::{f64_tensor, small_spec, uniform, values};
    use crate::spec::FfnSpec;
    use foldmoe_kernels::{Device, ElementwiseOps as _, HostData};

    /// A small f64 model whose gradients are set to known values.
    fn model_with_grads() -> Model<Cpu> {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let mut model = Model::new(&Cpu, &spec, 1, DType::F64).unwrap();
        let mut seed = 0;
        model.visit_params_mut(&mut |p| {
            seed += 1;
            p.grad = f64_tensor(uniform(seed, p.grad.numel(), 1.0), p.grad.shape());
        });
        model
    }

    fn host_norm(model: &Model<Cpu>) -> f64 {
        let mut s = 0.0;
        model.visit_params(&mut |p| s += values(&p.grad).iter().map(|g| g * g).sum::<f64>());
        s.sqrt()
    }

    #[test]
    fn clip_scales_to_the_max_norm() {
        let b = Cpu;
        let model = model_with_grads();
        let norm = global_grad_norm(&b, &model).unwrap();
        assert!((norm - host_norm(&model)).abs() < 1e-9 * norm);
        assert!(norm > 2.0);
        let coef = clip_coefficient(norm, 1.0);
        assert!(
            (coef * host_norm(&model) - 1.0).abs() < 1e-5,
            "{coef} · {norm} is not 1"
        );
        // Below the limit, or with clipping off, no scaling.
        assert_eq!(clip_coefficient(1.0, 2.0), 1.0);
        assert_eq!(clip_coefficient(5.0, 0.0), 1.0);
        // The optimizer's scaled step equals a step on scaled gradients,
        // exactly (the same f64 products), for every parameter.
        let hyper = AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut folded = model_with_grads();
        let mut opt = AdamW::new(&b, &folded, hyper).unwrap();
        opt.step_scaled(&b, &mut folded, 1e-2, coef).unwrap();
        let mut scaled = model_with_grads();
        scaled.visit_params_mut(&mut |p| p.grad = b.scale(&p.grad, coef).unwrap());
        let mut opt = AdamW::new(&b, &scaled, hyper).unwrap();
        opt.step(&b, &mut scaled, 1e-2).unwrap();
        let (mut got, mut want) = (Vec::new(), Vec::new());
        folded.visit_params(&mut |p| got.push(values(&p.value)));
        scaled.visit_params(&mut |p| want.push(values(&p.value)));
        assert_eq!(got, want);
    }

    #[test]
    fn adamw_first_step_and_no_decay_on_vectors() {
        let b = Cpu;
        let mut model = model_with_grads();
        let hyper = AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(&b, &model, hyper).unwrap();
        let mut before = Vec::new();
        model.visit_params(&mut |p| {
            before.push((p.value.shape().len(), values(&p.value), values(&p.grad)))
        });
        let lr = 1e-2;
        opt.step(&b, &mut model, lr).unwrap();
        assert_eq!(opt.step_count(), 1);
        let mut i = 0;
        model.visit_params(&mut |p| {
            let (rank, p0, g) = &before[i];
            i += 1;
            let wd = if *rank == 1 { 0.0 } else { 0.1 };
            // Bias-corrected first step: m̂ = g, v̂ = g², so the step is lr·g/(|g| + eps).
            for ((p1, p0), g) in values(&p.value).iter().zip(p0).zip(g) {
                let want = p0 - lr * wd * p0 - lr * g / (g.abs() + 1e-8);
                assert!((p1 - want).abs() < 1e-12, "{}: {p1} vs {want}", p.name);
            }
        });
        let mut names = Vec::new();
        opt.visit_state(&mut |n, _| names.push(n.to_string()));
        assert_eq!(
            names[..2],
            ["embed.weight.exp_avg", "embed.weight.exp_avg_sq"]
        );
        assert_eq!(names.len(), 2 * i);
        opt.set_step_count(7);
        assert_eq!(opt.step_count(), 7);
    }

    #[test]
    fn adamw_rejects_another_models_params() {
        let b = Cpu;
        let model = model_with_grads();
        let mut opt = AdamW::new(
            &b,
            &model,
            AdamWParams {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        )
        .unwrap();
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], true);
        let mut other = Model::new(&b, &spec, 1, DType::F64).unwrap();
        let err = opt.step(&b, &mut other, 1e-3).unwrap_err().to_string();
        assert!(
            err.contains("head.weight") || err.contains("parameters"),
            "{err}"
        );
        assert_eq!(opt.step_count(), 0);
    }

    const HYPER: AdamWParams = AdamWParams {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };

    /// A small f32 model (seed 3) with gradients drawn from `seed`.
    fn f32_model(seed: u64) -> Model<Cpu> {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let mut model = Model::new(&Cpu, &spec, 3, DType::F32).unwrap();
        set_grads(&mut model, seed);
        model
    }

    fn set_grads(model: &mut Model<Cpu>, seed: u64) {
        let mut s = seed * 1000;
        model.visit_params_mut(&mut |p| {
            s += 1;
            let g: Vec<f32> = uniform(s, p.grad.numel(), 1.0)
                .iter()
                .map(|&x| x as f32)
                .collect();
            p.grad = Cpu.upload(HostData::F32(g), p.grad.shape()).unwrap();
        });
    }

    #[test]
    fn master_weights_apply_to_bf16_and_optionally_f32() {
        assert!(MasterWeights::Bf16.applies_to(DType::BF16));
        assert!(!MasterWeights::Bf16.applies_to(DType::F32));
        assert!(MasterWeights::Bf16AndF32.applies_to(DType::F32));
        // f64 parameters are always their own master.
        assert!(!MasterWeights::Bf16AndF32.applies_to(DType::F64));
        let opt =
            AdamW::with_master_weights(&Cpu, &model_with_grads(), HYPER, MasterWeights::Bf16AndF32)
                .unwrap();
        assert!(!opt.has_masters());
        assert_eq!(MasterWeights::default(), MasterWeights::Bf16);
    }

    /// The master path on f32 parameters (bf16 ones: the tests below):
    /// f32 master copies and moments, named `.fp32_param`, and
    /// updates bit-identical to the plain path's (one update per backend).
    #[test]
    fn master_copies_of_f32_params_change_only_the_path() {
        let (mut plain_model, mut master_model) = (f32_model(1), f32_model(1));
        let mut plain = AdamW::new(&Cpu, &plain_model, HYPER).unwrap();
        let mut mixed =
            AdamW::with_master_weights(&Cpu, &master_model, HYPER, MasterWeights::Bf16AndF32)
                .unwrap();
        assert!(!plain.has_masters() && mixed.has_masters());
        for step in 1..=3 {
            set_grads(&mut plain_model, step);
            set_grads(&mut master_model, step);
            plain.step(&Cpu, &mut plain_model, 1e-2).unwrap();
            mixed.step(&Cpu, &mut master_model, 1e-2).unwrap();
        }
        let mut params = Vec::new();
        plain_model.visit_params(&mut |p| params.push((p.name.clone(), values(&p.value))));
        let mut i = 0;
        master_model.visit_params(&mut |p| {
            assert_eq!(p.name, params[i].0);
            assert_eq!(values(&p.value), params[i].1, "{}", p.name);
            i += 1;
        });
        let mut state = Vec::new();
        mixed.visit_state(&mut |n, t| state.push((n.to_string(), t.dtype(), values(t))));
        assert_eq!(state.len(), 3 * params.len());
        let mut plain_state = Vec::new();
        plain.visit_state(&mut |n, t| plain_state.push((n.to_string(), values(t))));
        for (j, (name, p)) in params.iter().enumerate() {
            let names: Vec<&str> = state[3 * j..3 * j + 3]
                .iter()
                .map(|s| s.0.as_str())
                .collect();
            assert_eq!(
                names,
                [
                    format!("{name}.exp_avg"),
                    format!("{name}.exp_avg_sq"),
                    format!("{name}.fp32_param")
                ]
            );
            assert!(state[3 * j..3 * j + 3].iter().all(|s| s.1 == DType::F32));
            assert_eq!(state[3 * j].2, plain_state[2 * j].1, "{name} exp_avg");
            assert_eq!(
                state[3 * j + 1].2,
                plain_state[2 * j + 1].1,
                "{name} exp_avg_sq"
            );
            assert_eq!(
                &state[3 * j + 2].2,
                p,
                "{name}: master differs from the parameter"
            );
        }
    }

    /// bf16 parameters on the CPU (emulated bf16).
    #[test]
    fn bf16_params_on_cpu_keep_f32_masters() {
        bf16_params_keep_f32_masters(&Cpu);
    }

    /// bf16 parameters on CUDA (ignored unless built with
    /// `--cfg foldmoe_gpu_tests`).
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn bf16_params_on_cuda_keep_f32_masters() {
        bf16_params_keep_f32_masters(&foldmoe_kernels::cuda::require_test_device());
    }

    /// bf16 parameters get f32 masters and moments by default; with a
    /// constant gradient of 1 each step is `w ← w·(1 − lr·wd) − lr/(1 + eps)`,
    /// worked on the host from the initial weights, and every parameter is
    /// its master rounded to bf16.
    fn bf16_params_keep_f32_masters<B: foldmoe_kernels::Backend>(b: &B) {
        use crate::engine::trainer::{TrainConfig, Trainer};
        use foldmoe_kernels::ElementwiseOps;
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }], false);
        let new = |seed| {
            let model = Model::new(b, &spec, seed, DType::BF16).unwrap();
            Trainer::new(b, model, TrainConfig::default()).unwrap()
        };
        let mut trainer = new(3);
        assert!(trainer.opt.has_masters());
        trainer
            .opt
            .visit_state(&mut |n, t| assert_eq!(t.dtype(), DType::F32, "{n}"));
        let mut want = Vec::new();
        trainer.model.visit_params(&mut |p| {
            let w = b.download(&p.value).unwrap().to_f64();
            want.push((p.value.shape().len() > 1, w));
        });
        let (lr, wd) = (1e-3, trainer.cfg.weight_decay);
        for _ in 0..5 {
            trainer.model.visit_params_mut(&mut |p| {
                let ones = b.upload(HostData::F32(vec![1.0; p.grad.numel()]), p.grad.shape());
                p.grad = b.cast(&ones.unwrap(), DType::BF16).unwrap();
            });
            trainer.opt.step(b, &mut trainer.model, lr).unwrap();
            for (matrix, w) in &mut want {
                let decay = if *matrix { 1.0 - lr * wd } else { 1.0 };
                w.iter_mut()
                    .for_each(|x| *x = *x * decay - lr / (1.0 + 1e-8));
            }
        }
        let mut masters = Vec::new();
        trainer.opt.visit_state(&mut |n, t| {
            if n.ends_with(".fp32_param") {
                masters.push(b.download(t).unwrap().to_f64());
            }
        });
        let mut i = 0;
        trainer.model.visit_params(&mut |p| {
            let master = &masters[i];
            let err = master
                .iter()
                .zip(&want[i].1)
                .fold(0.0f64, |e, (a, w)| e.max((a - w).abs()));
            assert!(
                err < 1e-6,
                "{}: master off the f64 reference by {err:e}",
                p.name
            );
            let host = Cpu.upload(HostData::F64(master.clone()), &[master.len()]);
            let rounded = values(&Cpu.round_bf16(&host.unwrap()).unwrap());
            assert_eq!(p.value.dtype(), DType::BF16);
            assert_eq!(
                b.download(&p.value).unwrap().to_f64(),
                rounded,
                "{}",
                p.name
            );
            i += 1;
        });
    }
}
