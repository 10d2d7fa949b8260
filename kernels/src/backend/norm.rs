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
