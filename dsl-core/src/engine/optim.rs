//! AdamW with decoupled weight decay (Loshchilov & Hutter 2019) and clipping by
//! the global gradient norm, as Megatron-Core's optimizer applies them on one
//! rank: moments per parameter in visit order, no decay on 1-d parameters (norm
//! scales, biases), gradients scaled by `max_norm / (norm + 1e-6)` when the
//! norm exceeds `max_norm`.

use foldmoe_kernels::{AdamWConfig, Backend, Device, Tensor};

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

/// AdamW state: the moments of every parameter, in the model's visit order,
/// and the number of updates applied.
pub struct AdamW<B: Device> {
    /// Fixed hyper-parameters.
    pub hyper: AdamWParams,
    names: Vec<String>,
    m: Vec<Tensor<B>>,
    v: Vec<Tensor<B>>,
    step: u64,
}

impl<B: Backend> AdamW<B> {
    /// Zero moments for every parameter of `model`.
    pub fn new(b: &B, model: &impl Module<B>, hyper: AdamWParams) -> Result<Self> {
        let mut shapes = Vec::new();
        model.visit_params(&mut |p| {
            shapes.push((p.name.clone(), p.value.shape().to_vec(), p.value.dtype()))
        });
        let mut names = Vec::with_capacity(shapes.len());
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for (name, shape, dtype) in shapes {
            m.push(b.zeros(&shape, dtype)?);
            v.push(b.zeros(&shape, dtype)?);
            names.push(name);
        }
        Ok(AdamW {
            hyper,
            names,
            m,
            v,
            step: 0,
        })
    }

    /// Applies one update at learning rate `lr` to every parameter of `model`
    /// from its accumulated gradient.
    pub fn step(&mut self, b: &B, model: &mut impl Module<B>, lr: f64) -> Result<()> {
        let cfg = AdamWConfig {
            lr,
            beta1: self.hyper.beta1,
            beta2: self.hyper.beta2,
            eps: self.hyper.eps,
            weight_decay: self.hyper.weight_decay,
            step: self.step + 1,
        };
        self.check_params(model)?;
        let (m, v) = (&mut self.m, &mut self.v);
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
            if let Err(e) = b.adamw_step(&mut p.value, &p.grad, &mut m[i], &mut v[i], &cfg) {
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

    /// Calls `f` on every state tensor, named `{param}.exp_avg` (first moment)
    /// and `{param}.exp_avg_sq` (second moment), in parameter order.
    pub fn visit_state(&self, f: &mut dyn FnMut(&str, &Tensor<B>)) {
        for ((name, m), v) in self.names.iter().zip(&self.m).zip(&self.v) {
            f(&format!("{name}.exp_avg"), m);
            f(&format!("{name}.exp_avg_sq"), v);
        }
    }

    /// Like [`AdamW::visit_state`], mutably (loading a checkpoint).
    pub fn visit_state_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor<B>)) {
        for ((name, m), v) in self.names.iter().zip(&mut self.m).zip(&mut self.v) {
            f(&format!("{name}.exp_avg"), m);
            f(&format!("{name}.exp_avg_sq"), v);
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

/// Scales every gradient by `max_norm / (norm + 1e-6)` when `norm > max_norm`
/// (Megatron's `clip_grad_norm`); returns the factor applied (1 if none).
/// `max_norm ≤ 0` turns clipping off.
pub fn clip_grad_norm<B: Backend>(
    b: &B,
    model: &mut impl Module<B>,
    norm: f64,
    max_norm: f64,
) -> Result<f64> {
    if max_norm <= 0.0 || norm <= max_norm {
        return Ok(1.0);
    }
    let coef = max_norm / (norm + 1e-6);
    let mut failure = None;
    model.visit_params_mut(&mut |p| {
        if failure.is_none() {
            match b.scale(&p.grad, coef) {
                Ok(g) => p.grad = g,
                Err(e) => failure = Some(e),
            }
        }
    });
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(coef),
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::DType;

    use super::{clip_grad_norm, global_grad_norm, AdamW, AdamWParams};
    use crate::engine::model::Model;
    use crate::engine::param::Module;
    use crate::engine::testutil::{f64_tensor, small_spec, uniform, values};
    use crate::spec::FfnSpec;

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
        let mut model = model_with_grads();
        let norm = global_grad_norm(&b, &model).unwrap();
        assert!((norm - host_norm(&model)).abs() < 1e-9 * norm);
        assert!(norm > 2.0);
        let before: Vec<f64> = values(&model.embed.table.grad);
        let coef = clip_grad_norm(&b, &mut model, norm, 1.0).unwrap();
        assert!(
            (host_norm(&model) - 1.0).abs() < 1e-5,
            "{}",
            host_norm(&model)
        );
        // Every gradient scaled by the same factor: the direction is kept.
        let after = values(&model.embed.table.grad);
        for (a, b) in after.iter().zip(&before) {
            assert!((a - coef * b).abs() < 1e-12);
        }
        // Below the limit, or with clipping off, nothing changes.
        assert_eq!(clip_grad_norm(&b, &mut model, 1.0, 2.0).unwrap(), 1.0);
        assert_eq!(clip_grad_norm(&b, &mut model, 5.0, 0.0).unwrap(), 1.0);
        assert_eq!(values(&model.embed.table.grad), after);
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
}
