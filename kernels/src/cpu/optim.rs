//! CPU AdamW: one fused, elementwise pass over parameter, gradient and moments.

use rayon::prelude::*;

use super::elementwise::GRAIN;
use super::{Cpu, FloatStorage};
use crate::backend::{AdamWConfig, OptimOps};
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::Tensor;

/// Rejects hyper-parameters that would silently corrupt the parameters.
fn check_cfg(op: &'static str, cfg: &AdamWConfig) -> Result<()> {
    if cfg.step == 0 {
        return Err(arg_err(
            op,
            "step = 0: steps are 1-based (bias correction divides by 1 - beta^step)",
        ));
    }
    for (name, x) in [("beta1", cfg.beta1), ("beta2", cfg.beta2)] {
        if !(0.0..1.0).contains(&x) {
            return Err(arg_err(op, format!("{name} = {x} must lie in [0, 1)")));
        }
    }
    for (name, x) in [
        ("lr", cfg.lr),
        ("eps", cfg.eps),
        ("weight_decay", cfg.weight_decay),
    ] {
        if !(x.is_finite() && x >= 0.0) {
            return Err(arg_err(op, format!("{name} = {x} must be finite and >= 0")));
        }
    }
    Ok(())
}

fn adamw_t<T: FloatStorage>(
    param: &mut Tensor<Cpu>,
    grad: &Tensor<Cpu>,
    m: &mut Tensor<Cpu>,
    v: &mut Tensor<Cpu>,
    cfg: &AdamWConfig,
) -> Result<()> {
    const OP: &str = "adamw_step";
    check_cfg(OP, cfg)?;
    for (name, t) in [("grad", grad.shape()), ("m", m.shape()), ("v", v.shape())] {
        if t != param.shape() {
            return Err(shape_err(
                OP,
                format!(
                    "param has shape {:?} but {name} has shape {t:?}; they must be equal",
                    param.shape()
                ),
            ));
        }
    }
    for t in [grad, &*m, &*v] {
        if t.dtype() != param.dtype() {
            return Err(KernelError::DTypeMismatch {
                op: OP,
                expected: param.dtype(),
                got: t.dtype(),
            });
        }
    }
    // Bias corrections and step sizes are formed in f64, then rounded once.
    let bc1 = 1.0 - cfg.beta1.powf(cfg.step as f64);
    let bc2 = 1.0 - cfg.beta2.powf(cfg.step as f64);
    let b1 = T::from_f64(cfg.beta1);
    let b2 = T::from_f64(cfg.beta2);
    let c1 = T::from_f64(1.0 - cfg.beta1);
    let c2 = T::from_f64(1.0 - cfg.beta2);
    let decay = T::from_f64(1.0 - cfg.lr * cfg.weight_decay);
    let step = T::from_f64(cfg.lr / bc1);
    let inv_bc2 = T::from_f64(1.0 / bc2);
    let eps = T::from_f64(cfg.eps);
    let gs = T::slice(grad, OP)?;
    let ms = T::slice_mut(m, OP)?;
    let vs = T::slice_mut(v, OP)?;
    let ps = T::slice_mut(param, OP)?;
    ps.par_iter_mut()
        .zip(gs.par_iter())
        .zip(ms.par_iter_mut().zip(vs.par_iter_mut()))
        .with_min_len(GRAIN)
        .for_each(|((p, &g), (m, v))| {
            *m = b1 * *m + c1 * g;
            *v = b2 * *v + c2 * g * g;
            // Decoupled decay scales p by (1 - lr·wd) before the Adam step;
            // the two commute since the Adam step does not read p.
            *p = *p * decay - step * *m / ((*v * inv_bc2).sqrt() + eps);
        });
    Ok(())
}

impl OptimOps for Cpu {
    fn adamw_step(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()> {
        cpu_float_dispatch!("adamw_step", param, adamw_t(param, grad, m, v, cfg))
    }
}
