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
        let (names, m, v) = (&self.names, &mut self.m, &mut self.v);
        let mut index = 0;
        let mut failure: Option<EngineError> = None;
        model.visit_params_mut(&mut |p: &mut Param<B>| {
            if failure.is_some() {
                return;
            }
            let i = index;
            index += 1;
            if names.get(i) != Some(&p.name) {
                failure = Some(EngineError::Invalid(format!(
                    "AdamW: parameter {i} is `{}`, but the optimizer state was built for `{}`",
                    p.name,
                    names.get(i).map_or("<none>", |s| s.as_str())
                )));
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
        if index != names.len() {
            return Err(EngineError::Invalid(format!(
                "AdamW: the model has {index} parameters, the optimizer state {}",
                names.len()
            )));
        }
        self.step += 1;
        Ok(())
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
