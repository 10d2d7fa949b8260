//! CPU RMSNorm and rotary position embedding.
//!
//! Shape letters: R rows (leading dims flattened), D normalised dim,
//! B batch, S sequence, H heads, Hd head dim.

use rayon::prelude::*;

use super::elementwise::{rows_per_task, MAX_PARTIALS};
use super::{index_slice, pool, simd, Cpu, FloatStorage};
use crate::backend::{check_positions, NormOps, Rope};
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
    let mut y = pool::take::<T>(xs.len());
    let mut rstd = pool::take::<T>(r);
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
    let mut dx = pool::take::<T>(xs.len());
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
/// `pos · f_i` ([`Rope::frequency`]), at `positions[b, s]` when given, else
/// `s`. Angles are computed in f64 once per (position, pair), so f32 and f64
/// see the same rotation up to their own rounding.
fn rope_t<T: FloatStorage>(
    x: &Tensor<Cpu>,
    rope: Rope,
    inverse: bool,
    positions: Option<&Tensor<Cpu>>,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "rope";
    let (_b, s, h, hd) = x.dims4(OP)?;
    rope.check(OP, hd)?;
    check_positions(OP, x, positions)?;
    let xs = T::slice(x, OP)?;
    let mut out = pool::take::<T>(xs.len());
    if xs.is_empty() {
        return T::tensor(out, x.shape());
    }
    // The angles' table: one row per position `0..=max` (positions repeat
    // across sequences and heads, so each angle is computed once), or one
    // per (batch, sequence) row when the positions are sparser than that.
    // `at[bs]` is row `bs`'s table row.
    let (table, at): (Vec<usize>, Vec<usize>) = match positions {
        None => (
            (0..s).collect(),
            (0..xs.len() / (h * hd)).map(|bs| bs % s).collect(),
        ),
        Some(p) => {
            let p = index_slice(p, OP)?;
            if let Some(bad) = p.iter().find(|&&v| v < 0) {
                return Err(arg_err(OP, format!("position {bad} is negative")));
            }
            let max = p.iter().map(|&v| v as usize).max().unwrap_or(0);
            if max < p.len() {
                ((0..=max).collect(), p.iter().map(|&v| v as usize).collect())
            } else {
                (
                    p.iter().map(|&v| v as usize).collect(),
                    (0..p.len()).collect(),
                )
            }
        }
    };
    let half = hd / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let amp = rope.amplitude();
    let freqs: Vec<f64> = (0..half).map(|i| rope.frequency(i, hd)).collect();
    let mut cos = Vec::with_capacity(table.len() * half);
    let mut sin = Vec::with_capacity(table.len() * half);
    for &p in &table {
        for f in &freqs {
            let a = p as f64 * f;
            cos.push(T::from_f64(amp * a.cos()));
            sin.push(T::from_f64(amp * sign * a.sin()));
        }
    }
    // One chunk is one (batch, position): all its heads share the angles.
    let row = h * hd;
    out.par_chunks_mut(row)
        .zip(xs.par_chunks(row))
        .enumerate()
        .with_min_len(rows_per_task(row))
        .for_each(|(bs, (o, xr))| {
            let p = at[bs];
            let (c, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
            simd(
                #[inline(always)]
                || {
                    for (oh, xh) in o.chunks_mut(hd).zip(xr.chunks(hd)) {
                        let (x1, x2) = xh.split_at(half);
                        let (o1, o2) = oh.split_at_mut(half);
                        for i in 0..half {
                            o1[i] = x1[i] * c[i] - x2[i] * sn[i];
                            o2[i] = x2[i] * c[i] + x1[i] * sn[i];
                        }
                    }
                },
            )
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

    fn rope(
        &self,
        x: &Tensor<Self>,
        rope: Rope,
        inverse: bool,
        positions: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("rope", x, rope_t(x, rope, inverse, positions))
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{NormOps, Rope, Yarn};
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

    /// A YaRN of factor 4 whose ramp covers pairs 1..3 of a head dim of 8:
    /// the pairs before, inside and after the ramp all occur.
    fn yarn() -> Rope {
        Rope {
            theta: 10_000.0,
            yarn: Some(Yarn {
                factor: 4.0,
                low: 1.0,
                high: 3.0,
                attention_factor: 1.2,
            }),
        }
    }

    /// Positions that restart: documents of 2 and 3 tokens in the first
    /// sequence of 5, one of 5 in the second.
    const POSITIONS: [i32; 10] = [0, 1, 0, 1, 2, 0, 1, 2, 3, 4];

    /// RoPE is linear, so the gradient of `Σ rope(x) ⊙ w` is its transpose
    /// applied to `w`, the documented backward (`inverse`) — plain, with
    /// restarting positions, and YaRN-scaled (not orthogonal: the
    /// attention factor).
    fn rope_grad<B: TestOps>(d: &B) {
        let shape = [2, 5, 3, 8];
        let n: usize = shape.iter().product();
        let mut g = rng(23);
        let (x, w) = (uniform(&mut g, n), uniform(&mut g, n));
        let pos = d.ti32(&POSITIONS, &[2, 5]);
        for (rope, positions) in [
            (Rope::plain(10_000.0), None),
            (Rope::plain(10_000.0), Some(&pos)),
            (yarn(), Some(&pos)),
        ] {
            let dx = d.h64(&d.rope(&d.t64(&w, &shape), rope, true, positions).unwrap());
            check("rope", &x, &dx, |v| {
                dotv(
                    &d.h64(&d.rope(&d.t64(v, &shape), rope, false, positions).unwrap()),
                    &w,
                )
            });
        }
    }

    /// RoPE at given positions equals RoPE of each document on its own
    /// (positions from 0), and the YaRN frequencies are the documented
    /// blend.
    fn rope_positions_and_yarn<B: TestOps>(d: &B) {
        let (h, hd) = (2, 8);
        let mut g = rng(25);
        let x = uniform(&mut g, 10 * h * hd);
        let rope = yarn();
        let all = d.h64(
            &d.rope(
                &d.t64(&x, &[2, 5, h, hd]),
                rope,
                false,
                Some(&d.ti32(&POSITIONS, &[2, 5])),
            )
            .unwrap(),
        );
        let row = h * hd;
        for (start, len) in [(0, 2), (2, 3), (5, 5)] {
            let part = &x[start * row..(start + len) * row];
            let alone = d.h64(
                &d.rope(&d.t64(part, &[1, len, h, hd]), rope, false, None)
                    .unwrap(),
            );
            assert!(max_diff(&all[start * row..(start + len) * row], &alone) < 1e-12);
        }
        // Pair 0 keeps θ^0 = 1, pair 2 is half interpolated, pair 3 all.
        let f = |i: usize| 10_000f64.powf(-2.0 * i as f64 / hd as f64);
        assert_eq!(rope.frequency(0, hd), 1.0);
        assert!((rope.frequency(2, hd) - (f(2) / 4.0 * 0.5 + f(2) * 0.5)).abs() < 1e-15);
        assert!((rope.frequency(3, hd) - f(3) / 4.0).abs() < 1e-15);
        // Position 1, pair 0: angle 1, times the attention factor 1.2.
        let y = d.h64(
            &d.rope(&d.t64(&x[..2 * row], &[1, 2, h, hd]), rope, false, None)
                .unwrap(),
        );
        let (x1, x2) = (x[row], x[row + hd / 2]);
        assert!((y[row] - 1.2 * (x1 * 1f64.cos() - x2 * 1f64.sin())).abs() < 1e-12);
        // Positions past the row count (a table per row): rows at position
        // 9 equal row 9 of a ten-row run.
        let ten = d.h64(
            &d.rope(&d.t64(&x, &[1, 10, h, hd]), rope, false, None)
                .unwrap(),
        );
        let last = &x[9 * row..10 * row];
        let twice: Vec<f64> = last.iter().chain(last).copied().collect();
        let at9 = d.h64(
            &d.rope(
                &d.t64(&twice, &[1, 2, h, hd]),
                rope,
                false,
                Some(&d.ti32(&[9, 9], &[1, 2])),
            )
            .unwrap(),
        );
        assert!(max_diff(&at9[..row], &ten[9 * row..]) < 1e-12);
        assert!(max_diff(&at9[row..], &ten[9 * row..]) < 1e-12);
    }

    fn rope_forward_matches_naive_and_inverts<B: TestOps>(d: &B) {
        let (b, s, h, hd, theta) = (1, 4, 2, 6, 100.0f64);
        let n = b * s * h * hd;
        let mut g = rng(24);
        let x = uniform(&mut g, n);
        let y = d.h64(
            &d.rope(&d.t64(&x, &[b, s, h, hd]), Rope::plain(theta), false, None)
                .unwrap(),
        );
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
        let back = d
            .rope(&d.t64(&y, &[b, s, h, hd]), Rope::plain(theta), true, None)
            .unwrap();
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
            .rope(
                &d.t64(&[0.0; 10], &[1, 2, 1, 5]),
                Rope::plain(1e4),
                false,
                None,
            )
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "rope", detail } if detail.contains("Hd = 5")),
            "{err:?}"
        );
        let err = d.rope(&x, Rope::plain(1e4), false, None).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { op: "rope", .. }));
        let x4 = d.t64(&[0.0; 8], &[1, 2, 1, 4]);
        let err = d
            .rope(
                &x4,
                Rope::plain(1e4),
                false,
                Some(&d.ti32(&[0; 3], &[1, 3])),
            )
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { op: "rope", detail } if detail.contains("positions")),
            "{err:?}"
        );
        let bad_yarn = Rope {
            theta: 1e4,
            yarn: Some(Yarn {
                factor: 0.5,
                low: 0.0,
                high: 1.0,
                attention_factor: 1.0,
            }),
        };
        let err = d.rope(&x4, bad_yarn, false, None).unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "rope", detail } if detail.contains("YaRN factor = 0.5")),
            "{err:?}"
        );
        let err = d
            .rope(
                &d.ti32(&[0; 4], &[1, 1, 1, 4]),
                Rope::plain(1e4),
                false,
                None,
            )
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
            // bf16 rows of a multiple of 8 take the device's warp-per-row
            // kernels (3000, 128: q / k norm rows, 2048), the others its
            // block-per-row ones.
            for (r, n) in [
                (67usize, 300usize),
                (3, 3000),
                (1000, 5),
                (4099, 128),
                (5, 2048),
            ] {
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
            // Heads fewer than, equal to and more than a block's groups of
            // pairs; half-widths below and above the block (rope_impl).
            for shape in [[2, 17, 3, 64], [1, 9, 32, 128], [2, 3, 2, 512]] {
                let (bs, ss) = (shape[0], shape[1]);
                let (x, xc) = c.rand(&shape, 1.0);
                // Positions restarting every 5 tokens.
                let pos: Vec<i32> = (0..bs * ss).map(|i| (i % ss % 5) as i32).collect();
                let (pos_d, pos_c) = (d.ti32(&pos, &[bs, ss]), ti32(&pos, &[bs, ss]));
                let scaled = Rope {
                    theta: 10_000.0,
                    yarn: Some(Yarn::new(
                        10_000.0,
                        64,
                        40.0,
                        4096.0,
                        32.0,
                        1.0,
                        Some(1.0),
                        Some(0.707),
                    )),
                };
                for inverse in [false, true] {
                    for (rope, with_pos) in [
                        (Rope::plain(10_000.0), false),
                        (Rope::plain(10_000.0), true),
                        (scaled, true),
                    ] {
                        c.check(
                            &format!(
                                "rope inverse={inverse} positions={with_pos} yarn={}",
                                rope.yarn.is_some()
                            ),
                            &d.rope(&x, rope, inverse, with_pos.then_some(&pos_d))
                                .unwrap(),
                            &Cpu.rope(&xc, rope, inverse, with_pos.then_some(&pos_c))
                                .unwrap(),
                        );
                    }
                }
            }
            c.report("norm");
        }
    }

    device_tests!(
        norm_matches_cpu,
        rms_norm_grad,
        rms_norm_forward_matches_naive,
        rope_grad,
        rope_positions_and_yarn,
        rope_forward_matches_naive_and_inverts,
        norm_bad_inputs,
    );
}
