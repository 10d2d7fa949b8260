//! Compositions of backend ops the MoE layer needs but the `Backend` trait
//! does not offer as one op: log-sigmoid, sign, and host-built constants.
//! Each stays on the device (uploads only, never a read back).

use foldmoe_kernels::{Backend, DType, HostData, Tensor};

use crate::engine::Result;

/// Scale of the saturated sigmoid that stands in for `sign`: any |x| above
/// ~1e-10 (f64) or ~1e-11 (f32) maps to exactly ±1.
const SIGN_SHARPNESS: f64 = (1u64 << 40) as f64;

/// Uploads host values as a tensor of `dtype` (through f32 for any float
/// dtype other than f64, cast afterwards).
pub(crate) fn constant<B: Backend>(
    b: &B,
    vals: Vec<f64>,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor<B>> {
    let t = match dtype {
        DType::F64 => b.upload(HostData::F64(vals), shape)?,
        _ => b.upload(
            HostData::F32(vals.into_iter().map(|v| v as f32).collect()),
            shape,
        )?,
    };
    if matches!(dtype, DType::F32 | DType::F64) {
        Ok(t)
    } else {
        Ok(b.cast(&t, dtype)?)
    }
}

/// A tensor of `shape` with every element `value`.
pub(crate) fn filled<B: Backend>(
    b: &B,
    shape: &[usize],
    value: f64,
    dtype: DType,
) -> Result<Tensor<B>> {
    constant(b, vec![value; shape.iter().product()], shape, dtype)
}

/// `log(sigmoid(l)) = l - softplus(l)`. The backend has no log op; softplus
/// is `logsumexp([0, l])`, whose `[0, l]` pairs a rank-1 product builds, and
/// this form stays finite for large |l| where `log(sigmoid)` would not.
pub(crate) fn log_sigmoid<B: Backend>(b: &B, l: &Tensor<B>) -> Result<Tensor<B>> {
    let n = l.numel();
    let l_n1 = l.clone().reshape(&[n, 1])?;
    let pick = constant(b, vec![0.0, 1.0], &[1, 2], l.dtype())?;
    let zero_l_n2 = b.matmul(&l_n1, &pick, false, false)?;
    let softplus = b.logsumexp(&zero_l_n2)?.reshape(l.shape())?;
    Ok(b.sub(l, &softplus)?)
}

/// Backward of [`log_sigmoid`] from `s = sigmoid(l)`: `dl = dy · (1 - s)`.
pub(crate) fn log_sigmoid_backward<B: Backend>(
    b: &B,
    s: &Tensor<B>,
    dy: &Tensor<B>,
) -> Result<Tensor<B>> {
    Ok(b.sub(dy, &b.mul(dy, s)?)?)
}

/// `sign(x)` as `2·sigmoid(c·x) - 1` with a huge `c` (the backend has no sign
/// op): exact ±1 and 0 for loads, whose differences are multiples of 1/E.
pub(crate) fn sign<B: Backend>(b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
    let s = b.sigmoid(&b.scale(x, SIGN_SHARPNESS)?)?;
    let ones = filled(b, x.shape(), 1.0, x.dtype())?;
    Ok(b.sub(&b.scale(&s, 2.0)?, &ones)?)
}
