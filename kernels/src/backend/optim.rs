use super::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Hyper-parameters of one AdamW step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate of this step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay (multiplied by `lr`).
    pub weight_decay: f64,
    /// 1-based step number, for bias correction.
    pub step: u64,
}

/// Optimizer kernels.
pub trait OptimOps: Device {
    /// One fused AdamW update of `param` in place, with moments `m`, `v`:
    /// `p -= lr·wd·p; m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²;
    ///  p -= lr · m̂ / (sqrt(v̂) + eps)` with bias-corrected `m̂`, `v̂`.
    fn adamw_step(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()>;
}
