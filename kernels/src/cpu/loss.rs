//! CPU cross-entropy over the vocabulary.
//!
//! Shape letters: T tokens, V vocabulary. Target `-1` marks an ignored token
//! (padding, or the last position of a document).

use rayon::prelude::*;

use super::elementwise::{row_logsumexp, rows_per_task};
use super::{index_slice, Cpu, FloatStorage};
use crate::backend::LossOps;
use crate::cpu_float_dispatch;
use crate::error::{shape_err, KernelError, Result};
use crate::tensor::Tensor;

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
    if let Some(i) = xs.par_iter().position_first(|x| !x.is_finite()) {
        return Err(KernelError::NonFinite {
            op: OP,
            what: "logits",
            value: xs[i].to_f64(),
        });
    }
    let mut loss = vec![T::ZERO; t];
    let mut lse = vec![T::ZERO; t];
    if t > 0 {
        loss.par_iter_mut()
            .zip(lse.par_iter_mut())
            .zip(xs.par_chunks(v).zip(tg.par_iter()))
            .with_min_len(rows_per_task(v))
            .for_each(|((l, z), (row, &c))| {
                *z = row_logsumexp(row);
                *l = if c == IGNORE {
                    T::ZERO
                } else {
                    *z - row[c as usize]
                };
            });
    }
    Ok((T::tensor(loss, &[t])?, T::tensor(lse, &[t])?))
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
    let zs = T::slice(lse, OP)?;
    let ds = T::slice(dloss, OP)?;
    let mut dx = vec![T::ZERO; xs.len()];
    if t > 0 {
        dx.par_chunks_mut(v)
            .zip(xs.par_chunks(v))
            .zip(tg.par_iter().zip(zs.par_iter().zip(ds.par_iter())))
            .with_min_len(rows_per_task(v))
            .for_each(|((o, row), (&c, (&z, &d)))| {
                if c == IGNORE {
                    return;
                }
                for (o, &x) in o.iter_mut().zip(row) {
                    *o = d * (x - z).exp();
                }
                o[c as usize] -= d;
            });
    }
    T::tensor(dx, logits.shape())
}

impl LossOps for Cpu {
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
