//! CPU AdamW: one fused, elementwise pass over parameter, gradient and moments.

use rayon::prelude::*;

use super::elementwise::GRAIN;
use super::{Cpu, FloatStorage};
use crate::backend::{AdamWConfig, OptimOps};
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::Tensor;

/// Rejects hyper-parameters that would silently corrupt the parameters
/// (shared with the CUDA backend, so both refuse the same configurations).
pub(crate) fn check_adamw_cfg(op: &'static str, cfg: &AdamWConfig) -> Result<()> {
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
    check_adamw_cfg(OP, cfg)?;
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

#[cfg(test)]
mod tests {
    use crate::backend::{AdamWConfig, OptimOps};
    use crate::cpu::test_util::*;
    use crate::cpu::Cpu;
    use crate::error::KernelError;
    use crate::tensor::DType;

    fn cfg(step: u64) -> AdamWConfig {
        AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.01,
            step,
        }
    }

    /// Step 2 from non-zero moments, worked by hand for p = 1, g = 0.5,
    /// m = 0.2, v = 0.04:
    /// m' = 0.9·0.2 + 0.1·0.5 = 0.23, v' = 0.99·0.04 + 0.01·0.25 = 0.0421,
    /// m̂ = 0.23 / 0.19, v̂ = 0.0421 / 0.0199,
    /// p' = 1 − 0.1·0.01·1 − 0.1·m̂ / (sqrt(v̂) + 1e-8).
    fn adamw_one_step_matches_hand_computed<B: TestOps>(d: &B) {
        let mut p = d.t64(&[1.0], &[1]);
        let mut m = d.t64(&[0.2], &[1]);
        let mut v = d.t64(&[0.04], &[1]);
        d.adamw_step(&mut p, &d.t64(&[0.5], &[1]), &mut m, &mut v, &cfg(2))
            .unwrap();
        let want = 1.0 - 0.001 - 0.1 * (0.23 / 0.19) / ((0.0421f64 / 0.0199).sqrt() + 1e-8);
        assert!((d.h64(&m)[0] - 0.23).abs() < 1e-15);
        assert!((d.h64(&v)[0] - 0.0421).abs() < 1e-15);
        assert!(
            (d.h64(&p)[0] - want).abs() < 1e-14,
            "{} vs {want}",
            d.h64(&p)[0]
        );
        // The first step from zero moments moves each weight by about lr.
        let mut p = d.t32(&[1.0, -1.0], &[2]);
        let (mut m, mut v) = (d.t32(&[0.0; 2], &[2]), d.t32(&[0.0; 2], &[2]));
        let c = AdamWConfig {
            weight_decay: 0.0,
            ..cfg(1)
        };
        d.adamw_step(&mut p, &d.t32(&[3.0, -0.001], &[2]), &mut m, &mut v, &c)
            .unwrap();
        assert!(max_diff(&d.h64(&p), &[0.9, -0.9]) < 1e-5, "{:?}", d.h64(&p));
    }

    fn adamw_bad_inputs<B: TestOps>(d: &B) {
        let mut p = d.t64(&[1.0; 4], &[4]);
        let g = d.t64(&[1.0; 4], &[4]);
        let mut m = d.t64(&[0.0; 4], &[4]);
        let mut v = d.t64(&[0.0; 4], &[4]);
        let err = d
            .adamw_step(&mut p, &g, &mut m, &mut v, &cfg(0))
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "adamw_step", detail } if detail.contains("step = 0")),
            "{err:?}"
        );
        let bad = AdamWConfig {
            beta2: 1.0,
            ..cfg(1)
        };
        let err = d.adamw_step(&mut p, &g, &mut m, &mut v, &bad).unwrap_err();
        assert!(err.to_string().contains("beta2 = 1"), "{err}");
        let mut v3 = d.t64(&[0.0; 3], &[3]);
        let err = d
            .adamw_step(&mut p, &g, &mut m, &mut v3, &cfg(1))
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { detail, .. } if detail.contains("v has shape [3]")),
            "{err:?}"
        );
        let mut m32 = d.t32(&[0.0; 4], &[4]);
        assert_eq!(
            d.adamw_step(&mut p, &g, &mut m32, &mut v, &cfg(1))
                .unwrap_err(),
            KernelError::DTypeMismatch {
                op: "adamw_step",
                expected: DType::F64,
                got: DType::F32
            }
        );
        // Nothing was written by the failed calls.
        assert_eq!(d.h64(&p), vec![1.0; 4]);
    }

    /// Three AdamW steps on random f32 (and bf16 where the device stores
    /// it) state against the CPU: parameters and both moments.
    fn adamw_matches_cpu<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            let mut c = Compare::new(d, dtype, 80);
            let shape = [1000, 37];
            let (mut p, mut pc) = c.rand(&shape, 1.0);
            let (mut m, mut mc) = c.rand(&shape, 0.1);
            let vs: Vec<f64> = uniform(&mut c.g, 37_000)
                .iter()
                .map(|x| 0.01 * x * x)
                .collect();
            let (mut v, mut vc) = c.pair(&vs, &shape);
            for step in 1..=3 {
                let (g, gc) = c.rand(&shape, 1.0);
                d.adamw_step(&mut p, &g, &mut m, &mut v, &cfg(step))
                    .unwrap();
                Cpu.adamw_step(&mut pc, &gc, &mut mc, &mut vc, &cfg(step))
                    .unwrap();
                // bf16 state is rounded on the device after every step; the
                // CPU's f32 state is not, so each step starts from the same
                // (device) values on both sides.
                c.check(&format!("adamw p step {step}"), &p, &pc);
                c.check(&format!("adamw m step {step}"), &m, &mc);
                c.check(&format!("adamw v step {step}"), &v, &vc);
                let same = |t: &crate::tensor::Tensor<B>| {
                    let h: Vec<f32> = d.h64(t).iter().map(|&x| x as f32).collect();
                    t32(&h, &shape)
                };
                (pc, mc, vc) = (same(&p), same(&m), same(&v));
            }
            c.report("optim");
        }
    }

    device_tests!(
        adamw_matches_cpu,
        adamw_one_step_matches_hand_computed,
        adamw_bad_inputs,
    );
}
