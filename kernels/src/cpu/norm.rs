//! CPU RMSNorm and rotary position embedding.
//!
//! Shape letters: R rows (leading dims flattened), D normalised dim,
//! B batch, S sequence, H heads, Hd head dim.

use rayon::prelude::*;

use super::elementwise::{rows_per_task, MAX_PARTIALS};
use super::{Cpu, FloatStorage};
use crate::backend::NormOps;
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, Result};
use crate::tensor::Tensor;

/// Rows per task for the RMSNorm backward: small enough to spread over the
/// pool, large enough that the per-block `dw` partials stay few.
fn norm_block_rows(r: usize, d: usize) -> usize {
    rows_per_task(d).max(r.div_ceil(MAX_PARTIALS))
}

use crate::backend::check_norm_args;

fn rms_norm_t<T: FloatStorage>(
    x: &Tensor<Cpu>,
    w: &Tensor<Cpu>,
    eps: f64,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    const OP: &str = "rms_norm";
    let (r, d) = check_norm_args(OP, x, w)?;
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(arg_err(OP, format!("eps = {eps} must be finite and >= 0")));
    }
    let xs = T::slice(x, OP)?;
    let ws = T::slice(w, OP)?;
    let mut y = vec![T::ZERO; xs.len()];
    let mut rstd = vec![T::ZERO; r];
    y.par_chunks_mut(d)
        .zip(rstd.par_iter_mut())
        .zip(xs.par_chunks(d))
        .with_min_len(rows_per_task(d))
        .for_each(|((yr, rs), xr)| {
            // The mean of squares is accumulated in f64: it is the one place
            // where a long f32 sum would lose digits that the output keeps.
            let ms = xr.iter().fold(0.0f64, |s, &v| s + v.to_f64() * v.to_f64()) / d as f64;
            let k = T::from_f64(1.0 / (ms + eps).sqrt());
            *rs = k;
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(ws) {
                *o = v * k * g;
            }
        });
    let lead = &x.shape()[..x.shape().len() - 1];
    Ok((T::tensor(y, x.shape())?, T::tensor(rstd, lead)?))
}

/// `dx = r·w⊙dy − x·r³/D·Σ(dy⊙w⊙x)` per row; `dw = Σ_rows dy⊙x·r`, summed per
/// row block and then over blocks in order so the result is deterministic.
fn rms_norm_backward_t<T: FloatStorage>(
    dy: &Tensor<Cpu>,
    x: &Tensor<Cpu>,
    w: &Tensor<Cpu>,
    rstd: &Tensor<Cpu>,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    const OP: &str = "rms_norm_backward";
    let (r, d) = check_norm_args(OP, x, w)?;
    dy.expect_shape(OP, "dy", x.shape())?;
    let lead = &x.shape()[..x.shape().len() - 1];
    if rstd.shape() != lead && rstd.shape() != [r] {
        return Err(shape_err(
            OP,
            format!(
                "x has shape {:?}, so rstd must have shape {lead:?} or [{r}], got {:?}",
                x.shape(),
                rstd.shape()
            ),
        ));
    }
    let xs = T::slice(x, OP)?;
    let ws = T::slice(w, OP)?;
    let dys = T::slice(dy, OP)?;
    let rs = T::slice(rstd, OP)?;
    let mut dx = vec![T::ZERO; xs.len()];
    let mut dw = vec![T::ZERO; d];
    if r > 0 {
        let br = norm_block_rows(r, d);
        let inv_d = T::from_f64(1.0 / d as f64);
        let partials: Vec<Vec<T>> = dx
            .par_chunks_mut(br * d)
            .zip(xs.par_chunks(br * d))
            .zip(dys.par_chunks(br * d))
            .zip(rs.par_chunks(br))
            .map(|(((dxb, xb), dyb), rb)| {
                let mut dwp = vec![T::ZERO; d];
                for (((dxr, xr), dyr), &k) in dxb
                    .chunks_mut(d)
                    .zip(xb.chunks(d))
                    .zip(dyb.chunks(d))
                    .zip(rb)
                {
                    let mut s = T::ZERO;
                    for ((&g, &v), &dv) in ws.iter().zip(xr).zip(dyr) {
                        s += dv * g * v;
                    }
                    let c = s * k * k * k * inv_d;
                    for (i, o) in dxr.iter_mut().enumerate() {
                        *o = k * ws[i] * dyr[i] - xr[i] * c;
                        dwp[i] += dyr[i] * xr[i] * k;
                    }
                }
                dwp
            })
            .collect();
        for p in &partials {
            dw.iter_mut().zip(p).for_each(|(a, &v)| *a += v);
        }
    }
    Ok((T::tensor(dx, x.shape())?, T::tensor(dw, &[d])?))
}

/// Rotate-half RoPE: channel `i < Hd/2` pairs with `i + Hd/2` and both turn by
/// `pos · θ^(−2i/Hd)`. Angles are computed in f64 once per (position, pair),
/// so f32 and f64 see the same rotation up to their own rounding.
fn rope_t<T: FloatStorage>(x: &Tensor<Cpu>, theta: f64, inverse: bool) -> Result<Tensor<Cpu>> {
    const OP: &str = "rope";
    let (_b, s, h, hd) = x.dims4(OP)?;
    if !hd.is_multiple_of(2) {
        return Err(arg_err(
            OP,
            format!("head dim Hd = {hd} must be even to pair its halves"),
        ));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(arg_err(
            OP,
            format!("theta = {theta} must be finite and > 0"),
        ));
    }
    let xs = T::slice(x, OP)?;
    let mut out = vec![T::ZERO; xs.len()];
    if xs.is_empty() {
        return T::tensor(out, x.shape());
    }
    let half = hd / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut cos = Vec::with_capacity(s * half);
    let mut sin = Vec::with_capacity(s * half);
    for pos in 0..s {
        for i in 0..half {
            let a = pos as f64 * theta.powf(-2.0 * i as f64 / hd as f64);
            cos.push(T::from_f64(a.cos()));
            sin.push(T::from_f64(sign * a.sin()));
        }
    }
    // One chunk is one (batch, position): all its heads share the angles.
    let row = h * hd;
    out.par_chunks_mut(row)
        .zip(xs.par_chunks(row))
        .enumerate()
        .with_min_len(rows_per_task(row))
        .for_each(|(bs, (o, xr))| {
            let pos = bs % s;
            let (c, sn) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            for (oh, xh) in o.chunks_mut(hd).zip(xr.chunks(hd)) {
                let (x1, x2) = xh.split_at(half);
                let (o1, o2) = oh.split_at_mut(half);
                for i in 0..half {
                    o1[i] = x1[i] * c[i] - x2[i] * sn[i];
                    o2[i] = x2[i] * c[i] + x1[i] * sn[i];
                }
            }
        });
    T::tensor(out, x.shape())
}

impl NormOps for Cpu {
    fn rms_norm(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f64,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        cpu_float_dispatch!("rms_norm", x, rms_norm_t(x, w, eps))
    }

    fn rms_norm_backward(
        &self,
        dy: &Tensor<Self>,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        rstd: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        cpu_float_dispatch!("rms_norm_backward", x, rms_norm_backward_t(dy, x, w, rstd))
    }

    fn rope(&self, x: &Tensor<Self>, theta: f64, inverse: bool) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("rope", x, rope_t(x, theta, inverse))
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::NormOps;
    use crate::cpu::test_util::*;
    use crate::cpu::Cpu;
    use crate::error::KernelError;

    fn rms_norm_grad<B: TestOps>(d: &B) {
        let (r, n, eps) = (6, 9, 1e-5);
        let mut g = rng(21);
        let x = uniform(&mut g, r * n);
        let w: Vec<f64> = uniform(&mut g, n).iter().map(|v| 1.0 + 0.5 * v).collect();
        let dy = uniform(&mut g, r * n);
        let (xt, wt) = (d.t64(&x, &[r, n]), d.t64(&w, &[n]));
        let (_, rstd) = d.rms_norm(&xt, &wt, eps).unwrap();
        let (dx, dw) = d
            .rms_norm_backward(&d.t64(&dy, &[r, n]), &xt, &wt, &rstd)
            .unwrap();
        let f = |x: &[f64], w: &[f64]| {
            let (y, _) = d
                .rms_norm(&d.t64(x, &[r, n]), &d.t64(w, &[n]), eps)
                .unwrap();
            dotv(&d.h64(&y), &dy)
        };
        check("rms_norm dx", &x, &d.h64(&dx), |v| f(v, &w));
        check("rms_norm dw", &w, &d.h64(&dw), |v| f(&x, v));
    }

    fn rms_norm_forward_matches_naive<B: TestOps>(d: &B) {
        let (r, n, eps) = (3, 5, 1e-6);
        let mut g = rng(22);
        let x = uniform(&mut g, r * n);
        let w = uniform(&mut g, n);
        let (y, rstd) = d
            .rms_norm(&d.t64(&x, &[r, n]), &d.t64(&w, &[n]), eps)
            .unwrap();
        assert_eq!(rstd.shape(), &[r]);
        for (i, row) in x.chunks(n).enumerate() {
            let k = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt();
            assert!((d.h64(&rstd)[i] - k).abs() < 1e-12);
            for j in 0..n {
                assert!((d.h64(&y)[i * n + j] - row[j] * k * w[j]).abs() < 1e-12);
            }
        }
    }

    /// RoPE is linear and orthogonal, so the gradient of `Σ rope(x) ⊙ w` is
    /// `rope⁻¹(w)`, the documented backward.
    fn rope_grad<B: TestOps>(d: &B) {
        let shape = [2, 5, 3, 8];
        let n: usize = shape.iter().product();
        let mut g = rng(23);
        let (x, w) = (uniform(&mut g, n), uniform(&mut g, n));
        let dx = d.h64(&d.rope(&d.t64(&w, &shape), 10_000.0, true).unwrap());
        check("rope", &x, &dx, |v| {
            dotv(
                &d.h64(&d.rope(&d.t64(v, &shape), 10_000.0, false).unwrap()),
                &w,
            )
        });
    }

    fn rope_forward_matches_naive_and_inverts<B: TestOps>(d: &B) {
        let (b, s, h, hd, theta) = (1, 4, 2, 6, 100.0f64);
        let n = b * s * h * hd;
        let mut g = rng(24);
        let x = uniform(&mut g, n);
        let y = d.h64(&d.rope(&d.t64(&x, &[b, s, h, hd]), theta, false).unwrap());
        for pos in 0..s {
            for hi in 0..h {
                let at = (pos * h + hi) * hd;
                for i in 0..hd / 2 {
                    let a = pos as f64 / theta.powf(2.0 * i as f64 / hd as f64);
                    let (x1, x2) = (x[at + i], x[at + i + hd / 2]);
                    assert!((y[at + i] - (x1 * a.cos() - x2 * a.sin())).abs() < 1e-12);
                    assert!((y[at + i + hd / 2] - (x2 * a.cos() + x1 * a.sin())).abs() < 1e-12);
                }
            }
        }
        let back = d.rope(&d.t64(&y, &[b, s, h, hd]), theta, true).unwrap();
        assert!(max_diff(&d.h64(&back), &x) < 1e-12);
    }

    fn norm_bad_inputs<B: TestOps>(d: &B) {
        let x = d.t64(&[1.0; 6], &[2, 3]);
        let err = d.rms_norm(&x, &d.t64(&[1.0; 2], &[2]), 1e-5).unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { op: "rms_norm", detail } if detail.contains("[3]") && detail.contains("[2]")),
            "{err:?}"
        );
        let err = d.rms_norm(&x, &d.t64(&[1.0; 3], &[3]), -1.0).unwrap_err();
        assert!(matches!(
            err,
            KernelError::InvalidArgument { op: "rms_norm", .. }
        ));
        let err = d.rms_norm(&x, &d.t32(&[1.0; 3], &[3]), 1e-5).unwrap_err();
        assert!(matches!(
            err,
            KernelError::DTypeMismatch { op: "rms_norm", .. }
        ));
        let err = d
            .rope(&d.t64(&[0.0; 10], &[1, 2, 1, 5]), 1e4, false)
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "rope", detail } if detail.contains("Hd = 5")),
            "{err:?}"
        );
        let err = d.rope(&x, 1e4, false).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { op: "rope", .. }));
        let err = d
            .rope(&d.ti32(&[0; 4], &[1, 1, 1, 4]), 1e4, false)
            .unwrap_err();
        assert!(matches!(
            err,
            KernelError::UnsupportedDType { op: "rope", .. }
        ));
    }

    /// RMSNorm forward and backward and RoPE both ways on random f32 (and
    /// bf16 where the device stores it) against the CPU. The backward gets
    /// the device's own `rstd` on both sides, so a bf16 `rstd` is compared
    /// as the input it is rather than re-derived.
    fn norm_matches_cpu<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            let mut c = Compare::new(d, dtype, 60);
            for (r, n) in [(67usize, 300usize), (3, 3000), (1000, 5)] {
                let (x, xc) = c.rand(&[r, n], 2.0);
                let (w, wc) = c.rand(&[n], 1.0);
                let (dy, dyc) = c.rand(&[r, n], 1.0);
                let (y, rstd) = d.rms_norm(&x, &w, 1e-5).unwrap();
                let (yc, rstdc) = Cpu.rms_norm(&xc, &wc, 1e-5).unwrap();
                c.check("rms_norm y", &y, &yc);
                c.check("rms_norm rstd", &rstd, &rstdc);
                let same: Vec<f32> = d.h64(&rstd).iter().map(|&v| v as f32).collect();
                let rstdc = t32(&same, &[r]);
                let (dx, dw) = d.rms_norm_backward(&dy, &x, &w, &rstd).unwrap();
                let (dxc, dwc) = Cpu.rms_norm_backward(&dyc, &xc, &wc, &rstdc).unwrap();
                c.check("rms_norm_backward dx", &dx, &dxc);
                c.check("rms_norm_backward dw", &dw, &dwc);
            }
            let shape = [2, 17, 3, 64];
            let (x, xc) = c.rand(&shape, 1.0);
            for inverse in [false, true] {
                c.check(
                    &format!("rope inverse={inverse}"),
                    &d.rope(&x, 10_000.0, inverse).unwrap(),
                    &Cpu.rope(&xc, 10_000.0, inverse).unwrap(),
                );
            }
            c.report("norm");
        }
    }

    device_tests!(
        norm_matches_cpu,
        rms_norm_grad,
        rms_norm_forward_matches_naive,
        rope_grad,
        rope_forward_matches_naive_and_inverts,
        norm_bad_inputs,
    );
}
