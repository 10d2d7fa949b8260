//! Compositions of backend ops the MoE layer needs but the `Backend` trait
//! does not offer as one op: a host-built constant (the balancing loss's
//! segment matrix, whose pattern no single fill gives) and the backward of
//! `log_sigmoid` from saved sigmoid scores. Both stay on the device (an
//! upload, never a read back).

use foldmoe_kernels::{Backend, DType, HostData, Tensor};

use crate::engine::Result;

/// Uploads host values as a tensor of `dtype` (through f32 for any float
/// dtype other than f64, cast afterwards). For a single repeated value use
/// the backend's `fill`, which writes on the device instead.
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

/// Backward of the backend's `log_sigmoid` from `s = sigmoid(l)`, which the
/// router already holds: `dl = dy · (1 - s)`, as `dy - dy·s` so no ones
/// tensor is needed.
pub(crate) fn log_sigmoid_backward<B: Backend>(
    b: &B,
    s: &Tensor<B>,
    dy: &Tensor<B>,
) -> Result<Tensor<B>> {
    Ok(b.sub(dy, &b.mul(dy, s)?)?)
}
