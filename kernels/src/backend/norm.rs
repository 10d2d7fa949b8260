use super::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Normalisation and positional encoding.
pub trait NormOps: Device {
    /// RMSNorm over the last dim: `y = x / rms(x) * w`, `x: [R, D]`, `w: [D]`.
    /// Returns `(y, rstd: [R])`, `rstd = 1 / sqrt(mean(x²) + eps)`.
    fn rms_norm(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f64,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// Gradients `(dx, dw)` of RMSNorm.
    fn rms_norm_backward(
        &self,
        dy: &Tensor<Self>,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        rstd: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// Rotary embedding (rotate-half form) of `x: [B, S, H, Hd]` at positions
    /// `0..S` with base `theta`; `inverse` rotates by the negative angle, which is
    /// the backward (the rotation is orthogonal).
    fn rope(&self, x: &Tensor<Self>, theta: f64, inverse: bool) -> Result<Tensor<Self>>;
}

/// `(R, D)` of `x` after checking `w: [D]` and `D > 0`: the checks every
/// backend's RMSNorm makes before touching data.
pub(crate) fn check_norm_args<B: Device>(
    op: &'static str,
    x: &Tensor<B>,
    w: &Tensor<B>,
) -> Result<(usize, usize)> {
    let (r, d, _) = super::rows_cols(op, x)?;
    if w.shape() != [d] {
        return Err(crate::error::shape_err(
            op,
            format!(
                "x has shape {:?}, so the weight must have shape [{d}], got {:?}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if d == 0 {
        return Err(crate::error::KernelError::Empty {
            op,
            what: "normalised (last) dimension",
        });
    }
    Ok((r, d))
}
