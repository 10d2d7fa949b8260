//! CPU AdamW: one fused, elementwise pass over parameter, gradient and
//! moments, in the parameter's dtype or on an f32 master copy. Both paths
//! share [`update`], the one statement of the AdamW arithmetic.

use rayon::prelude::*;

use super::elementwise::GRAIN;
use super::{Cpu, Float, FloatStorage};
use crate::backend::{check_adamw_args, check_adamw_master_args, AdamWConfig, OptimOps};
use crate::cpu_float_dispatch;
use crate::error::Result;
use crate::tensor::Tensor;

/// The scalars of one step in the compute type `A`: bias corrections and
/// step sizes are formed in f64, then rounded once (as the CUDA kernel does).
#[derive(Clone, Copy)]
struct Coeffs<A> {
    b1: A,
    b2: A,
    c1: A,
    c2: A,
    decay: A,
    step: A,
    inv_bc2: A,
    eps: A,
    grad_scale: A,
}

impl<A: Float> Coeffs<A> {
    fn new(cfg: &AdamWConfig) -> Self {
        let bc1 = 1.0 - cfg.beta1.powf(cfg.step as f64);
        let bc2 = 1.0 - cfg.beta2.powf(cfg.step as f64);
        Coeffs {
            b1: A::from_f64(cfg.beta1),
            b2: A::from_f64(cfg.beta2),
            c1: A::from_f64(1.0 - cfg.beta1),
            c2: A::from_f64(1.0 - cfg.beta2),
            decay: A::from_f64(1.0 - cfg.lr * cfg.weight_decay),
            step: A::from_f64(cfg.lr / bc1),
            inv_bc2: A::from_f64(1.0 / bc2),
            eps: A::from_f64(cfg.eps),
            grad_scale: A::from_f64(cfg.grad_scale),
        }
    }
}

/// One element's AdamW update: the moments in place; returns the new weight.
#[inline(always)]
fn update<A: Float>(k: &Coeffs<A>, p: A, g: A, m: &mut A, v: &mut A) -> A {
    let g = g * k.grad_scale;
    *m = k.b1 * *m + k.c1 * g;
    *v = k.b2 * *v + k.c2 * g * g;
    // Decoupled decay scales p by (1 - lr·wd) before the Adam step; the two
    // commute since the Adam step does not read p.
    p * k.decay - k.step * *m / ((*v * k.inv_bc2).sqrt() + k.eps)
}

fn adamw_t<T: FloatStorage>(
    param: &mut Tensor<Cpu>,
    grad: &Tensor<Cpu>,
    m: &mut Tensor<Cpu>,
    v: &mut Tensor<Cpu>,
    cfg: &AdamWConfig,
) -> Result<()> {
    const OP: &str = "adamw_step";
    check_adamw_args(OP, param, grad, m, v, cfg)?;
    let k = Coeffs::<T>::new(cfg);
    let gs = T::slice(grad, OP)?;
    let ms = T::slice_mut(m, OP)?;
    let vs = T::slice_mut(v, OP)?;
    let ps = T::slice_mut(param, OP)?;
    ps.par_iter_mut()
        .zip(gs.par_iter())
        .zip(ms.par_iter_mut().zip(vs.par_iter_mut()))
        .with_min_len(GRAIN)
        .for_each(|((p, &g), (m, v))| {
            // Computed in f32 for bf16, each stored value rounded once.
            *p = update(&k, *p, g, m, v).stored();
            *m = m.stored();
            *v = v.stored();
        });
    Ok(())
}

/// The master path, for f32 or bf16 parameters (`T`): the update runs in f32
/// on the master, which is then rounded to the parameter's dtype (exact for
/// f32, nearest even for bf16).
fn adamw_master_t<T: FloatStorage>(
    param: &mut Tensor<Cpu>,
    grad: &Tensor<Cpu>,
    master: &mut Tensor<Cpu>,
    m: &mut Tensor<Cpu>,
    v: &mut Tensor<Cpu>,
    cfg: &AdamWConfig,
) -> Result<()> {
    const OP: &str = "adamw_step_master";
    check_adamw_master_args(OP, param, grad, master, m, v, cfg)?;
    let k = Coeffs::<f32>::new(cfg);
    let gs = T::slice(grad, OP)?;
    let ws = f32::slice_mut(master, OP)?;
    let ms = f32::slice_mut(m, OP)?;
    let vs = f32::slice_mut(v, OP)?;
    let ps = T::slice_mut(param, OP)?;
    ps.par_iter_mut()
        .zip(ws.par_iter_mut())
        .zip(gs.par_iter().zip(ms.par_iter_mut().zip(vs.par_iter_mut())))
        .with_min_len(GRAIN)
        .for_each(|((p, w), (&g, (m, v)))| {
            // `as f32` is exact: `g` is an f32 or a bf16 value.
            *w = update(&k, *w, g.to_f64() as f32, m, v);
            *p = T::from_f64(*w as f64).stored();
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

    fn adamw_step_master(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        master: &mut Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()> {
        // f64 parameters were refused by the argument check.
        cpu_float_dispatch!(
            "adamw_step_master",
            param,
            adamw_master_t(param, grad, master, m, v, cfg)
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{AdamWConfig, OptimOps};
    use crate::cpu::test_util::*;
    use crate::cpu::Cpu;
    use crate::error::KernelError;
    use crate::tensor::{DType, Tensor};

    fn cfg(step: u64) -> AdamWConfig {
        AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.01,
            step,
            grad_scale: 1.0,
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
        // grad_scale multiplies the gradient first: 0.5 through a scale of
        // 0.5 is the step on 0.25, exactly.
        let run = |g: f64, grad_scale: f64| {
            let (mut p, mut m, mut v) = (
                d.t64(&[1.0], &[1]),
                d.t64(&[0.2], &[1]),
                d.t64(&[0.04], &[1]),
            );
            let c = AdamWConfig {
                grad_scale,
                ..cfg(2)
            };
            d.adamw_step(&mut p, &d.t64(&[g], &[1]), &mut m, &mut v, &c)
                .unwrap();
            (d.h64(&p), d.h64(&m), d.h64(&v))
        };
        assert_eq!(run(0.5, 0.5), run(0.25, 1.0));
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

    /// The dtype whose parameters need a master copy: bf16 (native on CUDA,
    /// emulated on the CPU); f32 on a device that stored no bf16, where the
    /// master path is still the one taken (and the rounding is exact).
    fn master_param_dtype<B: TestOps>(d: &B) -> DType {
        *Compare::precisions(d).last().expect("f32 at least")
    }

    /// `v` in `dtype` on `d` (bf16 rounded from f32 by the device's cast).
    fn upload_in<B: TestOps>(d: &B, v: &[f64], shape: &[usize], dtype: DType) -> Tensor<B> {
        let t = d.t32(&v.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape);
        if dtype == DType::F32 {
            t
        } else {
            d.cast(&t, dtype).unwrap()
        }
    }

    /// `x` rounded to `dtype` (f32 values stay as they are).
    fn round_to(x: f64, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 => half::bf16::from_f64(x).to_f64(),
            _ => x,
        }
    }

    /// Three master steps in every parameter precision the device stores,
    /// against AdamW worked in f64 on the host from the same starting state
    /// and the gradients as stored: master and moments within f32 rounding,
    /// and the parameter exactly the master rounded to its dtype.
    fn adamw_master_matches_f64_reference<B: TestOps>(d: &B) {
        let n = 4099;
        let mut g = rng(81);
        let f32s = |v: Vec<f64>| -> Vec<f64> { v.iter().map(|&x| x as f32 as f64).collect() };
        for dtype in Compare::precisions(d) {
            let mut w_ref = f32s(uniform(&mut g, n));
            let mut m_ref = f32s(uniform(&mut g, n).iter().map(|x| 0.1 * x).collect());
            let mut v_ref = f32s(uniform(&mut g, n).iter().map(|x| 0.01 * x * x).collect());
            let mut p = upload_in(d, &w_ref, &[n], dtype);
            let mut w = upload_in(d, &w_ref, &[n], DType::F32);
            let mut m = upload_in(d, &m_ref, &[n], DType::F32);
            let mut v = upload_in(d, &v_ref, &[n], DType::F32);
            for step in 1..=3 {
                let c = cfg(step);
                let grad = upload_in(d, &uniform(&mut g, n), &[n], dtype);
                d.adamw_step_master(&mut p, &grad, &mut w, &mut m, &mut v, &c)
                    .unwrap();
                let (bc1, bc2) = (
                    1.0 - 0.9f64.powi(step as i32),
                    1.0 - 0.99f64.powi(step as i32),
                );
                for (i, gi) in d.h64(&grad).into_iter().enumerate() {
                    m_ref[i] = 0.9 * m_ref[i] + 0.1 * gi;
                    v_ref[i] = 0.99 * v_ref[i] + 0.01 * gi * gi;
                    w_ref[i] = w_ref[i] * (1.0 - c.lr * c.weight_decay)
                        - c.lr * (m_ref[i] / bc1) / ((v_ref[i] / bc2).sqrt() + c.eps);
                }
                for (what, t, want) in
                    [("master", &w, &w_ref), ("m", &m, &m_ref), ("v", &v, &v_ref)]
                {
                    assert_eq!(t.dtype(), DType::F32, "{what}");
                    let e = rel_err(&d.h64(t), want);
                    assert!(
                        e < 1e-6,
                        "{what} ({dtype:?} params) step {step}: relative error {e:.2e}"
                    );
                }
                let want_p: Vec<f64> = d.h64(&w).iter().map(|&x| round_to(x, dtype)).collect();
                assert_eq!(p.dtype(), dtype);
                assert_eq!(
                    d.h64(&p),
                    want_p,
                    "{dtype:?} param is not the rounded master"
                );
            }
        }
    }

    /// On f32 parameters the master path is the plain step, bit for bit: the
    /// two share one statement of the update, per backend.
    fn adamw_master_on_f32_params_is_the_plain_step<B: TestOps>(d: &B) {
        let mut g = rng(82);
        let n = 3001;
        let p0 = uniform(&mut g, n);
        let m0: Vec<f64> = uniform(&mut g, n).iter().map(|x| 0.1 * x).collect();
        let v0: Vec<f64> = uniform(&mut g, n).iter().map(|x| 0.01 * x * x).collect();
        let up = |x: &[f64]| upload_in(d, x, &[n], DType::F32);
        let (mut p, mut m, mut v) = (up(&p0), up(&m0), up(&v0));
        let (mut q, mut w, mut mq, mut vq) = (up(&p0), up(&p0), up(&m0), up(&v0));
        for step in 1..=3 {
            let grad = up(&uniform(&mut g, n));
            d.adamw_step(&mut p, &grad, &mut m, &mut v, &cfg(step))
                .unwrap();
            d.adamw_step_master(&mut q, &grad, &mut w, &mut mq, &mut vq, &cfg(step))
                .unwrap();
        }
        assert_eq!(d.h64(&q), d.h64(&p));
        assert_eq!(d.h64(&w), d.h64(&p));
        assert_eq!(d.h64(&mq), d.h64(&m));
        assert_eq!(d.h64(&vq), d.h64(&v));
    }

    /// What the master copy is for: with a constant gradient each step moves
    /// the weight by about lr = 1e-3, a quarter of bf16's spacing just below
    /// 1 (2⁻⁸), so a bf16 weight updated in bf16 never moves, while the f32
    /// master accumulates ten steps to 0.99 and the bf16 parameter follows
    /// it (0.98828125, the nearest bf16).
    fn adamw_master_keeps_updates_below_bf16_resolution<B: TestOps>(d: &B) {
        let dtype = master_param_dtype(d);
        let c = |step| AdamWConfig {
            lr: 1e-3,
            weight_decay: 0.0,
            ..cfg(step)
        };
        let ones = [1.0; 4];
        let grad = upload_in(d, &ones, &[4], dtype);
        let mut p = upload_in(d, &ones, &[4], dtype);
        let mut w = d.t32(&[1.0; 4], &[4]);
        let (mut m, mut v) = (d.t32(&[0.0; 4], &[4]), d.t32(&[0.0; 4], &[4]));
        for step in 1..=10 {
            d.adamw_step_master(&mut p, &grad, &mut w, &mut m, &mut v, &c(step))
                .unwrap();
        }
        let master = d.h64(&w);
        assert!(max_diff(&master, &[0.99; 4]) < 1e-5, "master {master:?}");
        let want: Vec<f64> = master.iter().map(|&x| round_to(x, dtype)).collect();
        assert_eq!(d.h64(&p), want);
        assert!(
            d.h64(&p)[0] < 0.995,
            "the parameter did not follow: {:?}",
            d.h64(&p)
        );
        if dtype == DType::BF16 {
            // The same ten steps with bf16 state: every update rounds away.
            let mut p = upload_in(d, &ones, &[4], dtype);
            let zeros = upload_in(d, &[0.0; 4], &[4], dtype);
            let (mut m, mut v) = (zeros.clone(), zeros);
            for step in 1..=10 {
                d.adamw_step(&mut p, &grad, &mut m, &mut v, &c(step))
                    .unwrap();
            }
            assert_eq!(
                d.h64(&p),
                ones.to_vec(),
                "bf16 state was expected to lose the updates"
            );
        }
    }

    fn adamw_master_bad_inputs<B: TestOps>(d: &B) {
        const OP: &str = "adamw_step_master";
        let dtype = master_param_dtype(d);
        let mut p = upload_in(d, &[1.0; 4], &[4], dtype);
        let g = upload_in(d, &[1.0; 4], &[4], dtype);
        let mut w = d.t32(&[1.0; 4], &[4]);
        let (mut m, mut v) = (d.t32(&[0.0; 4], &[4]), d.t32(&[0.0; 4], &[4]));
        let err = d
            .adamw_step_master(&mut p, &g, &mut w, &mut m, &mut v, &cfg(0))
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: OP, detail } if detail.contains("step = 0")),
            "{err:?}"
        );
        let mut w3 = d.t32(&[1.0; 3], &[3]);
        let err = d
            .adamw_step_master(&mut p, &g, &mut w3, &mut m, &mut v, &cfg(1))
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { op: OP, detail }
                if detail.contains("param has shape [4] but master has shape [3]")),
            "{err:?}"
        );
        // Master and moments are f32 whatever the parameter's dtype.
        let mut w64 = d.t64(&[1.0; 4], &[4]);
        let mut v64 = d.t64(&[0.0; 4], &[4]);
        let f64_state = KernelError::DTypeMismatch {
            op: OP,
            expected: DType::F32,
            got: DType::F64,
        };
        assert_eq!(
            d.adamw_step_master(&mut p, &g, &mut w64, &mut m, &mut v, &cfg(1))
                .unwrap_err(),
            f64_state
        );
        assert_eq!(
            d.adamw_step_master(&mut p, &g, &mut w, &mut m, &mut v64, &cfg(1))
                .unwrap_err(),
            f64_state
        );
        // The gradient has the parameter's dtype.
        let g64 = d.t64(&[1.0; 4], &[4]);
        assert_eq!(
            d.adamw_step_master(&mut p, &g64, &mut w, &mut m, &mut v, &cfg(1))
                .unwrap_err(),
            KernelError::DTypeMismatch {
                op: OP,
                expected: dtype,
                got: DType::F64
            }
        );
        // f64 parameters are their own master.
        let mut p64 = d.t64(&[1.0; 4], &[4]);
        let err = d
            .adamw_step_master(&mut p64, &g64, &mut w, &mut m, &mut v, &cfg(1))
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: OP, detail }
                if detail.contains("param is F64") && detail.contains("adamw_step")),
            "{err:?}"
        );
        // Nothing was written by the failed calls.
        assert_eq!(d.h64(&p), vec![1.0; 4]);
        assert_eq!(d.h64(&w), vec![1.0; 4]);
        assert_eq!(d.h64(&m), vec![0.0; 4]);
        assert_eq!(d.h64(&p64), vec![1.0; 4]);
    }

    device_tests!(
        adamw_matches_cpu,
        adamw_one_step_matches_hand_computed,
        adamw_bad_inputs,
        adamw_master_matches_f64_reference,
        adamw_master_on_f32_params_is_the_plain_step,
        adamw_master_keeps_updates_below_bf16_resolution,
        adamw_master_bad_inputs,
    );
}
