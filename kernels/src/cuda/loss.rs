//! CUDA cross-entropy over the vocabulary (kernels in `loss.cu`), with the
//! checks of `cpu/loss.rs`; the data checks (targets in range, finite
//! logits) run on the device and surface at the next read.
//!
//! Shape letters: T tokens, V vocabulary.

use super::compile::LOSS;
use super::{float_sfx, grid_for, launch, rows_cfg, Cuda};
use crate::backend::LossOps;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

/// The target value that ignores a token.
const IGNORE: i32 = -1;

/// `(T, V)` after checking shapes and dtypes, and the device check code for
/// targets outside `[-1, V)`.
fn check_ce(
    dev: &Cuda,
    op: &'static str,
    logits: &Tensor<Cuda>,
    targets: &Tensor<Cuda>,
) -> Result<(usize, usize, u32)> {
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
    targets.expect_dtype(op, DType::I32)?;
    let code = dev.check(move |_, bad| KernelError::IndexOutOfRange {
        op,
        index: bad as i64,
        lo: IGNORE as i64,
        hi: v as i64,
    })?;
    Ok((t, v, code))
}

impl LossOps for Cuda {
    fn valid_mask(&self, targets: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>> {
        const OP: &str = "valid_mask";
        let sfx = float_sfx(OP, dtype)?;
        targets.expect_dtype(OP, DType::I32)?;
        let code = self.check(|i, c| {
            arg_err(
                OP,
                format!("targets[{i}] = {c}; a target is a class index ≥ 0, or {IGNORE} to ignore the token"),
            )
        })?;
        let out = self.alloc(OP, targets.shape(), dtype)?;
        let n = targets.numel();
        if n > 0 {
            let f = self.func(LOSS, &format!("valid_mask_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(n),
                targets.storage().ptr(),
                out.storage().ptr(),
                n as i64,
                self.err_ptr(),
                code
            )?;
        }
        Ok(out)
    }

    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "cross_entropy";
        let sfx = float_sfx(OP, logits.dtype())?;
        let (t, v, code_target) = check_ce(self, OP, logits, targets)?;
        let code_nonfinite = self.check(|_, value| KernelError::NonFinite {
            op: OP,
            what: "logits",
            value,
        })?;
        // Loss and lse in the accumulation type (f32 for bf16), unrounded.
        let acc = logits.dtype().acc();
        let loss = self.alloc(OP, &[t], acc)?;
        let lse = self.alloc(OP, &[t], acc)?;
        if t > 0 {
            let f = self.func(LOSS, &format!("ce_fwd_{sfx}"))?;
            launch!(
                self,
                f,
                rows_cfg(t, 256),
                logits.storage().ptr(),
                targets.storage().ptr(),
                loss.storage().ptr(),
                lse.storage().ptr(),
                t as i64,
                v as i64,
                self.err_ptr(),
                code_target,
                code_nonfinite
            )?;
        }
        Ok((loss, lse))
    }

    fn cross_entropy_backward(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
        lse: &Tensor<Self>,
        dloss: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "cross_entropy_backward";
        let sfx = float_sfx(OP, logits.dtype())?;
        let (t, v, code_target) = check_ce(self, OP, logits, targets)?;
        lse.expect_shape(OP, "lse", &[t])?;
        dloss.expect_shape(OP, "dloss", &[t])?;
        // `cross_entropy`'s outputs: the accumulation type, not the logits'.
        lse.expect_dtype(OP, logits.dtype().acc())?;
        dloss.expect_dtype(OP, logits.dtype().acc())?;
        let dx = self.alloc(OP, logits.shape(), logits.dtype())?;
        if t > 0 {
            let f = self.func(LOSS, &format!("ce_bwd_{sfx}"))?;
            launch!(
                self,
                f,
                rows_cfg(t, 256),
                logits.storage().ptr(),
                targets.storage().ptr(),
                lse.storage().ptr(),
                dloss.storage().ptr(),
                dx.storage().ptr(),
                t as i64,
                v as i64,
                self.err_ptr(),
                code_target
            )?;
        }
        Ok(dx)
    }
}
