//! CPU RMSNorm and rotary position embedding.
//!
//! Shape letters: R rows (leading dims flattened), D normalised dim,
//! B batch, S sequence, H heads, Hd head dim.

use rayon::prelude::*;

use super::elementwise::{rows_cols, rows_per_task, MAX_PARTIALS};
use super::{Cpu, FloatStorage};
use crate::backend::NormOps;
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::Tensor;

/// Rows per task for the RMSNorm backward: small enough to spread over the
/// pool, large enough that the per-block `dw` partials stay few.
fn norm_block_rows(r: usize, d: usize) -> usize {
    rows_per_task(d).max(r.div_ceil(MAX_PARTIALS))
}

/// `(R, D)` of `x` after checking `w: [D]`, `D > 0`.
fn check_norm_args(op: &'static str, x: &Tensor<Cpu>, w: &Tensor<Cpu>) -> Result<(usize, usize)> {
    let (r, d, _) = rows_cols(op, x)?;
    if w.shape() != [d] {
        return Err(shape_err(
            op,
            format!(
                "x has shape {:?}, so the weight must have shape [{d}], got {:?}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if d == 0 {
        return Err(KernelError::Empty {
            op,
            what: "normalised (last) dimension",
        });
    }
    Ok((r, d))
}

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

    #[test]
    fn rms_norm_grad() {
        let (r, d, eps) = (6, 9, 1e-5);
        let mut g = rng(21);
        let x = uniform(&mut g, r * d);
        let w: Vec<f64> = uniform(&mut g, d).iter().map(|v| 1.0 + 0.5 * v).collect();
        let dy = uniform(&mut g, r * d);
        let (xt, wt) = (t64(&x, &[r, d]), t64(&w, &[d]));
        let (_, rstd) = Cpu.rms_norm(&xt, &wt, eps).unwrap();
        let (dx, dw) = Cpu
            .rms_norm_backward(&t64(&dy, &[r, d]), &xt, &wt, &rstd)
            .unwrap();
        let f = |x: &[f64], w: &[f64]| {
            let (y, _) = Cpu.rms_norm(&t64(x, &[r, d]), &t64(w, &[d]), eps).unwrap();
            dotv(&h64(&y), &dy)
        };
        check("rms_norm dx", &x, &h64(&dx), |v| f(v, &w));
        check("rms_norm dw", &w, &h64(&dw), |v| f(&x, v));
    }

    #[test]
    fn rms_norm_forward_matches_naive() {
        let (r, d, eps) = (3, 5, 1e-6);
        let mut g = rng(22);
        let x = uniform(&mut g, r * d);
        let w = uniform(&mut g, d);
        let (y, rstd) = Cpu
            .rms_norm(&t64(&x, &[r, d]), &t64(&w, &[d]), eps)
            .unwrap();
        assert_eq!(rstd.shape(), &[r]);
        for (i, row) in x.chunks(d).enumerate() {
            let k = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            assert!((h64(&rstd)[i] - k).abs() < 1e-12);
            for j in 0..d {
                assert!((h64(&y)[i * d + j] - row[j] * k * w[j]).abs() < 1e-12);
            }
        }
    }

    /// RoPE is linear and orthogonal, so the gradient of `Σ rope(x) ⊙ w` is
    /// `rope⁻¹(w)`, the documented backward.
    #[test]
    fn rope_grad() {
        let shape = [2, 5, 3, 8];
        let n: usize = shape.iter().product();
        let mut g = rng(23);
        let (x, w) = (uniform(&mut g, n), uniform(&mut g, n));
        let dx = h64(&Cpu.rope(&t64(&w, &shape), 10_000.0, true).unwrap());
        check("rope", &x, &dx, |v| {
            dotv(
                &h64(&Cpu.rope(&t64(v, &shape), 10_000.0, false).unwrap()),
                &w,
            )
        });
    }

    #[test]
    fn rope_forward_matches_naive_and_inverts() {
        let (b, s, h, hd, theta) = (1, 4, 2, 6, 100.0f64);
        let n = b * s * h * hd;
        let mut g = rng(24);
        let x = uniform(&mut g, n);
        let y = h64(&Cpu.rope(&t64(&x, &[b, s, h, hd]), theta, false).unwrap());
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
        let back = Cpu.rope(&t64(&y, &[b, s, h, hd]), theta, true).unwrap();
        assert!(max_diff(&h64(&back), &x) < 1e-12);
    }

    #[test]
    fn norm_bad_inputs() {
        let x = t64(&[1.0; 6], &[2, 3]);
        let err = Cpu.rms_norm(&x, &t64(&[1.0; 2], &[2]), 1e-5).unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { op: "rms_norm", detail } if detail.contains("[3]") && detail.contains("[2]")),
            "{err:?}"
        );
        let err = Cpu.rms_norm(&x, &t64(&[1.0; 3], &[3]), -1.0).unwrap_err();
        assert!(matches!(
            err,
            KernelError::InvalidArgument { op: "rms_norm", .. }
        ));
        let err = Cpu.rms_norm(&x, &t32(&[1.0; 3], &[3]), 1e-5).unwrap_err();
        assert!(matches!(
            err,
            KernelError::DTypeMismatch { op: "rms_norm", .. }
        ));
        let err = Cpu
            .rope(&t64(&[0.0; 10], &[1, 2, 1, 5]), 1e4, false)
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "rope", detail } if detail.contains("Hd = 5")),
            "{err:?}"
        );
        let err = Cpu.rope(&x, 1e4, false).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { op: "rope", .. }));
        let err = Cpu
            .rope(&ti32(&[0; 4], &[1, 1, 1, 4]), 1e4, false)
            .unwrap_err();
        assert!(matches!(
            err,
            KernelError::UnsupportedDType { op: "rope", .. }
        ));
    }
}
