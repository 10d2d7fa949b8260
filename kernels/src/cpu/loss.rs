//! CPU cross-entropy over the vocabulary.
//!
//! Shape letters: T tokens, V vocabulary. Target `-1` marks an ignored token
//! (padding, or the last position of a document).

use rayon::prelude::*;

use super::elementwise::{row_logsumexp, rows_per_task, GRAIN};
use super::{index_slice, pool, simd, Cpu, Float, FloatStorage};
use crate::backend::LossOps;
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

/// The target value that ignores a token.
const IGNORE: i32 = -1;

/// `(T, V)` and the targets, after checking shapes and that every target is
/// `-1` or a valid class (the first bad one is reported).
fn check_ce<'a>(
    op: &'static str,
    logits: &Tensor<Cpu>,
    targets: &'a Tensor<Cpu>,
) -> Result<(usize, usize, &'a [i32])> {
    let (t, v) = logits.dims2(op)?;
    if targets.shape() != [t] {
        return Err(shape_err(
            op,
            format!(
                "logits have shape {:?} [T, V], so targets must have shape [{t}], got {:?}",
                logits.shape(),
                targets.shape()
            ),
        ));
    }
    if v == 0 && t > 0 {
        return Err(KernelError::Empty {
            op,
            what: "vocabulary (last dimension of logits)",
        });
    }
    let tg = index_slice(targets, op)?;
    if let Some(&bad) = tg.iter().find(|&&c| c < IGNORE || c as i64 >= v as i64) {
        return Err(KernelError::IndexOutOfRange {
            op,
            index: bad as i64,
            lo: IGNORE as i64,
            hi: v as i64,
        });
    }
    Ok((t, v, tg))
}

fn cross_entropy_t<T: FloatStorage>(
    logits: &Tensor<Cpu>,
    targets: &Tensor<Cpu>,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    const OP: &str = "cross_entropy";
    let (t, v, tg) = check_ce(OP, logits, targets)?;
    let xs = T::slice(logits, OP)?;
    // A NaN or infinite logit poisons the loss silently; report where it is
    // (the first in memory order, found deterministically).
    // Chunk by chunk, each scanned without an early exit (a loop that
    // vectorises; rayon's per-element `position_first` costs more than the
    // whole loss); only a chunk that has one is searched for the first.
    let bad_chunk = xs
        .par_chunks(GRAIN)
        .position_first(|c| c.iter().fold(false, |bad, x| bad | !x.is_finite()));
    if let Some(ci) = bad_chunk {
        let chunk = &xs[ci * GRAIN..];
        let i = chunk.iter().position(|x| !x.is_finite()).unwrap_or(0);
        return Err(KernelError::NonFinite {
            op: OP,
            what: "logits",
            value: chunk[i].to_f64(),
        });
    }
    // Both outputs stay in the accumulation type (f32 for bf16, unrounded),
    // as on CUDA: a bf16 loss would quantise the reported loss, and a bf16
    // lse the backward's softmax.
    let mut loss = vec![<T::Acc as Float>::ZERO; t];
    let mut lse = vec![<T::Acc as Float>::ZERO; t];
    if t > 0 {
        loss.par_iter_mut()
            .zip(lse.par_iter_mut())
            .zip(xs.par_chunks(v).zip(tg.par_iter()))
            .with_min_len(rows_per_task(v))
            .for_each(|((l, z), (row, &c))| {
                let zr = simd(
                    #[inline(always)]
                    || row_logsumexp(row),
                );
                *z = zr.to_acc();
                *l = if c == IGNORE {
                    <T::Acc as Float>::ZERO
                } else {
                    (zr - row[c as usize]).to_acc()
                };
            });
    }
    Ok((T::Acc::tensor(loss, &[t])?, T::Acc::tensor(lse, &[t])?))
}

fn cross_entropy_backward_t<T: FloatStorage>(
    logits: &Tensor<Cpu>,
    targets: &Tensor<Cpu>,
    lse: &Tensor<Cpu>,
    dloss: &Tensor<Cpu>,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "cross_entropy_backward";
    let (t, v, tg) = check_ce(OP, logits, targets)?;
    lse.expect_shape(OP, "lse", &[t])?;
    dloss.expect_shape(OP, "dloss", &[t])?;
    let xs = T::slice(logits, OP)?;
    // `lse` and `dloss` come in the accumulation type (what `cross_entropy`
    // returns); only `dlogits` is rounded, once, to the logits' dtype.
    let zs = T::Acc::slice(lse, OP)?;
    let ds = T::Acc::slice(dloss, OP)?;
    // Zeros: the rows of ignored tokens are left as they are.
    let mut dx = pool::zeroed::<T>(xs.len());
    if t > 0 {
        dx.par_chunks_mut(v)
            .zip(xs.par_chunks(v))
            .zip(tg.par_iter().zip(zs.par_iter().zip(ds.par_iter())))
            .with_min_len(rows_per_task(v))
            .for_each(|((o, row), (&c, (&z, &d)))| {
                if c == IGNORE {
                    return;
                }
                let (z, d) = (T::from_acc(z), T::from_acc(d));
                simd(
                    #[inline(always)]
                    || {
                        for (o, &x) in o.iter_mut().zip(row) {
                            *o = d * (x - z).exp();
                        }
                    },
                );
                o[c as usize] -= d;
            });
    }
    T::tensor(dx, logits.shape())
}

fn valid_mask_t<T: FloatStorage>(targets: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "valid_mask";
    let tg = index_slice(targets, OP)?;
    // Without the vocabulary only the lower bound can be checked here;
    // `cross_entropy` checks the upper one.
    if let Some(i) = tg.iter().position(|&c| c < IGNORE) {
        return Err(arg_err(
            OP,
            format!(
                "targets[{i}] = {}; a target is a class index ≥ 0, or {IGNORE} to ignore the token",
                tg[i]
            ),
        ));
    }
    let mask: Vec<T> = tg
        .par_iter()
        .with_min_len(GRAIN)
        .map(|&c| if c == IGNORE { T::ZERO } else { T::ONE })
        .collect();
    T::tensor(mask, targets.shape())
}

impl LossOps for Cpu {
    fn valid_mask(&self, targets: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>> {
        match dtype {
            DType::F32 => valid_mask_t::<f32>(targets),
            DType::F64 => valid_mask_t::<f64>(targets),
            DType::BF16 => valid_mask_t::<super::Bf16>(targets),
            other => Err(KernelError::UnsupportedDType {
                op: "valid_mask",
                dtype: other,
                backend: "cpu",
            }),
        }
    }

    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        cpu_float_dispatch!("cross_entropy", logits, cross_entropy_t(logits, targets))
    }

    fn cross_entropy_backward(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
        lse: &Tensor<Self>,
        dloss: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "cross_entropy_backward",
            logits,
            cross_entropy_backward_t(logits, targets, lse, dloss)
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::LossOps;
    use crate::cpu::test_util::*;
    use crate::cpu::Cpu;
    use crate::error::KernelError;
    use crate::tensor::DType;

    const T: usize = 5;
    const V: usize = 7;

    fn cross_entropy_grad_with_ignored_token<B: TestOps>(d: &B) {
        let mut g = rng(31);
        let x: Vec<f64> = uniform(&mut g, T * V).iter().map(|v| 3.0 * v).collect();
        let targets = [3, -1, 0, 6, 2];
        let w = uniform(&mut g, T);
        let tg = d.ti32(&targets, &[T]);
        let xt = d.t64(&x, &[T, V]);
        let (loss, lse) = d.cross_entropy(&xt, &tg).unwrap();
        assert_eq!((loss.dtype(), lse.dtype()), (DType::F64, DType::F64));
        assert_eq!(d.h64(&loss)[1], 0.0);
        let dx = d
            .cross_entropy_backward(&xt, &tg, &lse, &d.t64(&w, &[T]))
            .unwrap();
        assert_eq!(dx.dtype(), DType::F64);
        let dx = d.h64(&dx);
        assert!(dx[V..2 * V].iter().all(|&v| v == 0.0));
        check("cross_entropy", &x, &dx, |v| {
            let (l, _) = d.cross_entropy(&d.t64(v, &[T, V]), &tg).unwrap();
            dotv(&d.h64(&l), &w)
        });
    }

    fn cross_entropy_matches_naive_and_is_stable<B: TestOps>(d: &B) {
        let mut g = rng(32);
        let x: Vec<f64> = uniform(&mut g, T * V);
        let targets = [0, 1, 2, 3, 4];
        let (loss, lse) = d
            .cross_entropy(&d.t64(&x, &[T, V]), &d.ti32(&targets, &[T]))
            .unwrap();
        for t in 0..T {
            let row = &x[t * V..][..V];
            let z = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            assert!((d.h64(&lse)[t] - z).abs() < 1e-12);
            assert!((d.h64(&loss)[t] - (z - row[targets[t] as usize])).abs() < 1e-12);
        }
        // Shifting the logits by 1e4 must not change the f32 loss.
        let shifted: Vec<f32> = x.iter().map(|&v| (v + 1e4) as f32).collect();
        let base: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let tg = d.ti32(&targets, &[T]);
        let (ls, _) = d.cross_entropy(&d.t32(&shifted, &[T, V]), &tg).unwrap();
        let (lb, lse) = d.cross_entropy(&d.t32(&base, &[T, V]), &tg).unwrap();
        assert_eq!((lb.dtype(), lse.dtype()), (DType::F32, DType::F32));
        assert!(max_diff(&d.h64(&ls), &d.h64(&lb)) < 5e-3);
        assert!(d.h64(&ls).iter().all(|v| v.is_finite()));
    }

    fn valid_mask_matches_targets_and_counts_them<B: TestOps>(d: &B) {
        let targets = [3, -1, 0, -1, 6, 0];
        let want: Vec<f64> = targets
            .iter()
            .map(|&c| if c >= 0 { 1.0 } else { 0.0 })
            .collect();
        for dtype in [DType::F32, DType::F64] {
            let m = d.valid_mask(&d.ti32(&targets, &[2, 3]), dtype).unwrap();
            assert_eq!((m.shape(), m.dtype()), (&[2, 3][..], dtype));
            assert_eq!(d.h64(&m), want);
            assert_eq!(d.h64(&d.sum(&m).unwrap()), vec![4.0]);
        }
        let none = d.valid_mask(&d.ti32(&[-1; T], &[T]), DType::F32).unwrap();
        assert_eq!(d.h64(&none), vec![0.0; T]);
    }

    fn valid_mask_bad_inputs<B: TestOps>(d: &B) {
        let err = d.err_of(d.valid_mask(&d.ti32(&[0, -1, -2], &[3]), DType::F32));
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "valid_mask", detail } if detail.contains("targets[2] = -2")),
            "{err:?}"
        );
        assert_eq!(
            d.valid_mask(&d.t64(&[0.0], &[1]), DType::F32).unwrap_err(),
            KernelError::DTypeMismatch {
                op: "valid_mask",
                expected: DType::I32,
                got: DType::F64
            }
        );
        assert_eq!(
            d.valid_mask(&d.ti32(&[0], &[1]), DType::I32).unwrap_err(),
            KernelError::UnsupportedDType {
                op: "valid_mask",
                dtype: DType::I32,
                backend: B::NAME
            }
        );
    }

    fn cross_entropy_bad_inputs<B: TestOps>(d: &B) {
        let x = d.t64(&[0.0; T * V], &[T, V]);
        for bad in [V as i32, -2] {
            let tg = d.ti32(&[0, 1, bad, 2, 3], &[T]);
            assert_eq!(
                d.err_of(d.cross_entropy(&x, &tg).map(|(loss, _)| loss)),
                KernelError::IndexOutOfRange {
                    op: "cross_entropy",
                    index: bad as i64,
                    lo: -1,
                    hi: V as i64
                }
            );
        }
        let mut xv = vec![0.0; T * V];
        xv[9] = f64::NAN;
        let err = d.err_of(
            d.cross_entropy(&d.t64(&xv, &[T, V]), &d.ti32(&[0; T], &[T]))
                .map(|(loss, _)| loss),
        );
        assert!(
            matches!(err, KernelError::NonFinite { op: "cross_entropy", what: "logits", value } if value.is_nan()),
            "{err:?}"
        );
        // bf16 rows of a multiple of 8 (the CUDA kernel's vector path): a
        // NaN or an infinity in any of the 8-logit groups is reported.
        for (at, bad) in [(3, f64::NAN), (21, f64::INFINITY), (46, f64::NEG_INFINITY)] {
            let mut xv = vec![0.5; 3 * 16];
            xv[at] = bad;
            let x16 = d.cast(&d.t64(&xv, &[3, 16]), DType::BF16).unwrap();
            let err = d.err_of(
                d.cross_entropy(&x16, &d.ti32(&[0; 3], &[3]))
                    .map(|(loss, _)| loss),
            );
            assert!(
                matches!(err, KernelError::NonFinite { op: "cross_entropy", what: "logits", value }
                    if value.is_nan() == bad.is_nan() && (bad.is_nan() || value == bad)),
                "{bad}: {err:?}"
            );
        }
        assert_eq!(
            d.cross_entropy(&x, &d.t64(&[0.0; T], &[T])).unwrap_err(),
            KernelError::DTypeMismatch {
                op: "cross_entropy",
                expected: DType::I32,
                got: DType::F64
            }
        );
        let err = d.cross_entropy(&x, &d.ti32(&[0; 4], &[4])).unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { detail, .. } if detail.contains("[5]") && detail.contains("[4]")),
            "{err:?}"
        );
        let (_, lse) = d.cross_entropy(&x, &d.ti32(&[0; T], &[T])).unwrap();
        let err = d
            .cross_entropy_backward(&x, &d.ti32(&[0; T], &[T]), &lse, &d.t64(&[1.0; 3], &[3]))
            .unwrap_err();
        assert!(matches!(
            err,
            KernelError::ShapeMismatch {
                op: "cross_entropy_backward",
                ..
            }
        ));
        // lse and dloss must be in the logits' accumulation type: F32 for
        // F32 and BF16 logits (where the device stores bf16).
        let tg = d.ti32(&[0; T], &[T]);
        let x32 = d.t32(&[0.0; T * V], &[T, V]);
        let (_, lse32) = d.cross_entropy(&x32, &tg).unwrap();
        let ones64 = d.t64(&[1.0; T], &[T]);
        let ones32 = d.t32(&[1.0; T], &[T]);
        let want = |got| KernelError::DTypeMismatch {
            op: "cross_entropy_backward",
            expected: DType::F32,
            got,
        };
        assert_eq!(
            d.cross_entropy_backward(&x32, &tg, &lse32, &ones64)
                .unwrap_err(),
            want(DType::F64)
        );
        assert_eq!(
            d.cross_entropy_backward(&x32, &tg, &ones64, &ones32)
                .unwrap_err(),
            want(DType::F64)
        );
        if let Ok(x16) = d.cast(&x32, DType::BF16) {
            let (loss16, lse16) = d.cross_entropy(&x16, &tg).unwrap();
            assert_eq!((loss16.dtype(), lse16.dtype()), (DType::F32, DType::F32));
            let as16 = |t| d.cast(t, DType::BF16).unwrap();
            assert_eq!(
                d.cross_entropy_backward(&x16, &tg, &as16(&lse16), &ones32)
                    .unwrap_err(),
                want(DType::BF16)
            );
            assert_eq!(
                d.cross_entropy_backward(&x16, &tg, &lse16, &as16(&ones32))
                    .unwrap_err(),
                want(DType::BF16)
            );
            let dx = d
                .cross_entropy_backward(&x16, &tg, &lse16, &ones32)
                .unwrap();
            assert_eq!(dx.dtype(), DType::BF16);
        }
    }

    /// Cross-entropy forward and backward over a vocabulary longer than a
    /// block, with ignored tokens, on random f32 (and bf16 where the device
    /// stores it) against the CPU; the backward gets the device's own `lse`
    /// on both sides. Loss and lse are f32 for both (the accumulation type),
    /// so they match the f32 reference on the same (bf16-representable)
    /// logits to f32 summation error, not to bf16's 1e-2.
    fn loss_matches_cpu<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            let mut c = Compare::new(d, dtype, 70);
            // A vocabulary of a multiple of 8 (the vector path of the CUDA
            // kernels) and one that is not.
            for (t, v) in [(67, 3000), (9, 3001)] {
                let (x, xc) = c.rand(&[t, v], 4.0);
                let tg: Vec<i32> = (0..t)
                    .map(|i| if i % 7 == 3 { -1 } else { (i * 131 % v) as i32 })
                    .collect();
                let (tg, tgc) = c.idx(&tg, &[t]);
                let (loss, lse) = d.cross_entropy(&x, &tg).unwrap();
                let (lossc, lsec) = Cpu.cross_entropy(&xc, &tgc).unwrap();
                assert_eq!((loss.dtype(), lse.dtype()), (DType::F32, DType::F32));
                c.check("cross_entropy loss", &loss, &lossc);
                c.check("cross_entropy lse", &lse, &lsec);
                for (what, got, want) in [("loss", &loss, &lossc), ("lse", &lse, &lsec)] {
                    let e = rel_err(&d.h64(got), &h64(want));
                    assert!(
                        e < 1e-5,
                        "cross_entropy {what} in {dtype:?}: {e:.2e} from f32"
                    );
                }
                // dloss in f32 on both sides, whatever the logits' dtype.
                let dl: Vec<f32> = uniform(&mut c.g, t).iter().map(|&u| u as f32).collect();
                let same: Vec<f32> = d.h64(&lse).iter().map(|&z| z as f32).collect();
                let dx = d
                    .cross_entropy_backward(&x, &tg, &lse, &d.t32(&dl, &[t]))
                    .unwrap();
                assert_eq!(dx.dtype(), dtype);
                c.check(
                    "cross_entropy_backward",
                    &dx,
                    &Cpu.cross_entropy_backward(&xc, &tgc, &t32(&same, &[t]), &t32(&dl, &[t]))
                        .unwrap(),
                );
                c.check(
                    "valid_mask",
                    &d.valid_mask(&tg, dtype).unwrap(),
                    &Cpu.valid_mask(&tgc, DType::F32).unwrap(),
                );
            }
            c.report("loss");
        }
    }

    device_tests!(
        loss_matches_cpu,
        cross_entropy_grad_with_ignored_token,
        cross_entropy_matches_naive_and_is_stable,
        valid_mask_matches_targets_and_counts_them,
        valid_mask_bad_inputs,
        cross_entropy_bad_inputs,
    );
}
