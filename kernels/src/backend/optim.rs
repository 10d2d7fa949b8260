use super::Device;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

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
    /// Factor applied to every gradient before the update: the clipping
    /// coefficient, folded into the step so clipping costs no pass of its
    /// own (1 for none).
    pub grad_scale: f64,
}

/// Optimizer kernels.
pub trait OptimOps: Device {
    /// One fused AdamW update of `param` in place, with moments `m`, `v`:
    /// `p -= lr·wd·p; m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²;
    ///  p -= lr · m̂ / (sqrt(v̂) + eps)` with bias-corrected `m̂`, `v̂`.
    /// Every tensor has the dtype of `param`.
    fn adamw_step(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()>;

    /// The AdamW update of [`OptimOps::adamw_step`] on an f32 master copy
    /// (mixed precision, as Megatron-Core's fp32 main params): `master`, `m`
    /// and `v` are f32 and updated in f32 from `grad` (the dtype of
    /// `param`), then `param` is overwritten by `master` rounded to its dtype.
    /// `param` is bf16 or f32 (f64 parameters are their own master: an f32
    /// copy would be narrower than the weights it keeps).
    fn adamw_step_master(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        master: &mut Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        cfg: &AdamWConfig,
    ) -> Result<()>;
}

/// Rejects hyper-parameters that would silently corrupt the parameters.
fn check_adamw_cfg(op: &'static str, cfg: &AdamWConfig) -> Result<()> {
    if cfg.step == 0 {
        return Err(arg_err(
            op,
            "step = 0: steps are 1-based (bias correction divides by 1 - beta^step)",
        ));
    }
    for (name, x) in [("beta1", cfg.beta1), ("beta2", cfg.beta2)] {
        if !(0.0..1.0).contains(&x) {
            return Err(arg_err(op, format!("{name} = {x} must lie in [0, 1)")));
        }
    }
    for (name, x) in [
        ("lr", cfg.lr),
        ("eps", cfg.eps),
        ("weight_decay", cfg.weight_decay),
        ("grad_scale", cfg.grad_scale),
    ] {
        if !(x.is_finite() && x >= 0.0) {
            return Err(arg_err(op, format!("{name} = {x} must be finite and >= 0")));
        }
    }
    Ok(())
}

/// Every named operand must have the shape of `param`.
fn check_same_shapes<B: Device>(
    op: &'static str,
    param: &Tensor<B>,
    others: &[(&str, &Tensor<B>)],
) -> Result<()> {
    for (name, t) in others {
        if t.shape() != param.shape() {
            return Err(shape_err(
                op,
                format!(
                    "param has shape {:?} but {name} has shape {:?}; they must be equal",
                    param.shape(),
                    t.shape()
                ),
            ));
        }
    }
    Ok(())
}

/// Every operand must have dtype `want`.
fn check_dtypes<B: Device>(op: &'static str, want: DType, ts: &[&Tensor<B>]) -> Result<()> {
    match ts.iter().find(|t| t.dtype() != want) {
        Some(t) => Err(KernelError::DTypeMismatch {
            op,
            expected: want,
            got: t.dtype(),
        }),
        None => Ok(()),
    }
}

/// The checks of [`OptimOps::adamw_step`] every backend makes before
/// touching data: hyper-parameters, equal shapes, one float dtype.
pub(crate) fn check_adamw_args<B: Device>(
    op: &'static str,
    param: &Tensor<B>,
    grad: &Tensor<B>,
    m: &Tensor<B>,
    v: &Tensor<B>,
    cfg: &AdamWConfig,
) -> Result<()> {
    check_adamw_cfg(op, cfg)?;
    check_same_shapes(op, param, &[("grad", grad), ("m", m), ("v", v)])?;
    check_dtypes(op, param.dtype(), &[grad, m, v])
}

/// The checks of [`OptimOps::adamw_step_master`] every backend makes before
/// touching data: hyper-parameters, equal shapes, `param` bf16 or f32,
/// `grad` of the dtype of `param`, and f32 `master`, `m`, `v`.
pub(crate) fn check_adamw_master_args<B: Device>(
    op: &'static str,
    param: &Tensor<B>,
    grad: &Tensor<B>,
    master: &Tensor<B>,
    m: &Tensor<B>,
    v: &Tensor<B>,
    cfg: &AdamWConfig,
) -> Result<()> {
    check_adamw_cfg(op, cfg)?;
    check_same_shapes(
        op,
        param,
        &[("grad", grad), ("master", master), ("m", m), ("v", v)],
    )?;
    if !matches!(param.dtype(), DType::BF16 | DType::F32) {
        return Err(arg_err(
            op,
            format!(
                "param is {:?}; an f32 master copy is kept for bf16 or f32 parameters only \
                 (f64 parameters are their own master: use adamw_step)",
                param.dtype()
            ),
        ));
    }
    check_dtypes(op, param.dtype(), &[grad])?;
    check_dtypes(op, DType::F32, &[master, m, v])
}
