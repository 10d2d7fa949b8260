//! The `Backend` trait, split by area of operations (one file per area), so
//! the CPU and CUDA implementations mirror each other file for file.
//!
//! Rules every implementation follows:
//! - tensors live on their device; data-dependent sizes (tokens per expert,
//!   routing maps) are device tensors, never host vectors;
//! - the only read to the host is [`Device::download`], and no layer calls it;
//! - every op validates shapes and dtypes and returns a [`crate::KernelError`]
//!   naming the values, never panics on user input;
//! - float ops accept f32 and f64 (f64 for gradient checks); index tensors are i32.
//!
//! Shape letters: T tokens, D hidden, E experts, K top-k, N permuted rows,
//! V vocabulary, B batch, S sequence, H heads, Hd head dim, G groups.

mod attention;
mod elementwise;
pub(crate) mod fp8;
mod gather;
pub(crate) mod linalg;
mod loss;
mod norm;
mod offload;
mod optim;
mod routing;

pub use attention::AttentionOps;
pub(crate) use attention::{check_docs, check_qkv};
pub use elementwise::ElementwiseOps;
pub(crate) use elementwise::{rows_cols, swiglu_weighted_args};
pub use fp8::Fp8Ops;
pub use gather::GatheredGemmOps;
pub(crate) use linalg::matmul_dims;
pub use linalg::LinalgOps;
pub use loss::LossOps;
pub(crate) use norm::{check_norm_args, check_positions};
pub use norm::{yarn_mscale, NormOps, Rope, Yarn};
pub use offload::OffloadOps;
pub(crate) use optim::{check_adamw_args, check_adamw_master_args};
pub use optim::{AdamWConfig, OptimOps};
pub(crate) use routing::{
    check_topk_args, permute_weights_args, permute_weights_backward_args, unpermute_args,
    GroupLimit,
};
pub use routing::{DropPolicy, RoutingOps, RoutingPlan};

use crate::error::Result;
use crate::tensor::{DType, HostData, StorageInfo, Tensor};

/// `MemAvailable` of `/proc/meminfo` in bytes (Linux), else `None`.
pub fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Allocation and transfers: what every device provides.
pub trait Device: Clone + Send + Sync + 'static {
    /// Short name used in messages (`"cpu"`, `"cuda"`).
    const NAME: &'static str;
    /// The device buffer behind a tensor.
    type Storage: StorageInfo + Clone + Send + Sync;
    /// `(in use, peak)` bytes held by this device's tensors (on the CPU:
    /// this thread's), peak since the last [`Device::reset_peak_memory`].
    fn memory_in_use(&self) -> (usize, usize) {
        crate::tensor::meter::usage()
    }

    /// Starts a new peak-memory measurement from the current use.
    fn reset_peak_memory(&self) {
        crate::tensor::meter::reset_peak()
    }

    /// Bytes a run could still allocate: the host's available memory (the
    /// CPU), or the device's free memory plus what its pool caches (CUDA);
    /// `None` when it cannot be read.
    fn memory_available(&self) -> Option<u64> {
        host_memory_available()
    }

    /// Copies host values onto the device as a tensor of `shape`.
    fn upload(&self, data: HostData, shape: &[usize]) -> Result<Tensor<Self>>;
    /// Reads a tensor back to the host: the one explicit device→host read.
    fn download(&self, t: &Tensor<Self>) -> Result<HostData>;
    /// A tensor of zeros.
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor<Self>>;
    /// Converts to another dtype (floats round to nearest; float→i32 truncates).
    fn cast(&self, t: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>>;

    /// Rows `start..start + len` of dimension 0, as a new tensor.
    ///
    /// Provided through the host (download, slice, upload), which is exact;
    /// the parallel runtime uses it to cut optimizer shards and received
    /// blocks. CUDA overrides it with an on-device copy.
    fn narrow(&self, t: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        let out_shape = narrow_shape(t.shape(), start, len)?;
        let row: usize = out_shape[1..].iter().product();
        let (a, b) = (start * row, (start + len) * row);
        let data = match self.download(t)? {
            HostData::F32(v) => HostData::F32(v[a..b].to_vec()),
            HostData::F64(v) => HostData::F64(v[a..b].to_vec()),
            HostData::I32(v) => HostData::I32(v[a..b].to_vec()),
        };
        let out = self.upload(data, &out_shape)?;
        if out.dtype() == t.dtype() {
            Ok(out)
        } else {
            self.cast(&out, t.dtype())
        }
    }

    /// Concatenation along dimension 0 of tensors of one dtype whose other
    /// dimensions agree.
    ///
    /// Provided through the host, exact; CUDA overrides it with on-device
    /// copies.
    fn concat(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let (shape, dtype) = concat_shape(parts)?;
        let mut data: Option<HostData> = None;
        for p in parts {
            let host = self.download(p)?;
            data = Some(match (data, host) {
                (None, h) => h,
                (Some(HostData::F32(mut a)), HostData::F32(b)) => {
                    a.extend(b);
                    HostData::F32(a)
                }
                (Some(HostData::F64(mut a)), HostData::F64(b)) => {
                    a.extend(b);
                    HostData::F64(a)
                }
                (Some(HostData::I32(mut a)), HostData::I32(b)) => {
                    a.extend(b);
                    HostData::I32(a)
                }
                (Some(a), b) => {
                    return Err(crate::error::KernelError::DTypeMismatch {
                        op: "concat",
                        expected: a.dtype(),
                        got: b.dtype(),
                    })
                }
            });
        }
        let out = self.upload(data.unwrap_or(HostData::F32(Vec::new())), &shape)?;
        if out.dtype() == dtype {
            Ok(out)
        } else {
            self.cast(&out, dtype)
        }
    }
}

/// The shape of rows `start..start + len` of a tensor of `shape`, or the
/// error every backend's [`Device::narrow`] gives.
pub(crate) fn narrow_shape(shape: &[usize], start: usize, len: usize) -> Result<Vec<usize>> {
    let rows = shape.first().copied().ok_or_else(|| {
        crate::error::shape_err("narrow", "a 0-d tensor has no rows to take".to_string())
    })?;
    if start + len > rows {
        return Err(crate::error::shape_err(
            "narrow",
            format!(
                "rows {start}..{} of a tensor of shape {shape:?}",
                start + len
            ),
        ));
    }
    let mut out = shape.to_vec();
    out[0] = len;
    Ok(out)
}

/// The shape and dtype of the concatenation of `parts` along dimension 0,
/// or the error every backend's [`Device::concat`] gives.
pub(crate) fn concat_shape<D: Device>(parts: &[&Tensor<D>]) -> Result<(Vec<usize>, DType)> {
    let first = parts.first().ok_or(crate::error::KernelError::Empty {
        op: "concat",
        what: "parts",
    })?;
    if first.shape().is_empty() {
        return Err(crate::error::shape_err(
            "concat",
            "0-d tensors have no rows to join".to_string(),
        ));
    }
    let (dtype, tail) = (first.dtype(), &first.shape()[1..]);
    let mut rows = 0;
    for p in parts {
        if p.dtype() != dtype || p.shape().len() != tail.len() + 1 || p.shape()[1..] != *tail {
            return Err(crate::error::shape_err(
                "concat",
                format!(
                    "part of shape {:?} ({:?}) after parts of shape [_, {tail:?}] ({dtype:?})",
                    p.shape(),
                    p.dtype()
                ),
            ));
        }
        rows += p.shape()[0];
    }
    let mut shape = vec![rows];
    shape.extend_from_slice(tail);
    Ok((shape, dtype))
}

/// The whole kernel backend: every area of operations on one device.
/// Implemented automatically for any type that implements all areas.
pub trait Backend:
    Device
    + ElementwiseOps
    + LinalgOps
    + NormOps
    + AttentionOps
    + RoutingOps
    + LossOps
    + OptimOps
    + OffloadOps
    + Fp8Ops
    + GatheredGemmOps
{
}

impl<T> Backend for T where
    T: Device
        + ElementwiseOps
        + LinalgOps
        + NormOps
        + AttentionOps
        + RoutingOps
        + LossOps
        + OptimOps
        + OffloadOps
        + Fp8Ops
        + GatheredGemmOps
{
}

#[cfg(test)]
mod tests {
    use crate::cpu::test_util::*;
    use crate::error::KernelError;
    use crate::tensor::DType;

    /// Rows cut and joined in every dtype match the host slices, including
    /// empty ranges, and bad requests are shape errors.
    fn narrow_and_concat_copy_rows<B: TestOps>(d: &B) {
        let v: Vec<f64> = (0..24).map(f64::from).collect();
        for dtype in [DType::F32, DType::F64, DType::I32, DType::BF16] {
            let t = d.cast(&d.t64(&v, &[4, 2, 3]), dtype).unwrap();
            let mid = d.narrow(&t, 1, 2).unwrap();
            assert_eq!(mid.shape(), &[2, 2, 3]);
            assert_eq!(mid.dtype(), dtype);
            assert_eq!(d.h64(&d.cast(&mid, DType::F64).unwrap()), v[6..18].to_vec());
            let none = d.narrow(&t, 4, 0).unwrap();
            assert_eq!(none.shape(), &[0, 2, 3]);
            let head = d.narrow(&t, 0, 1).unwrap();
            let tail = d.narrow(&t, 1, 3).unwrap();
            let joined = d.concat(&[&head, &none, &tail]).unwrap();
            assert_eq!(joined.shape(), &[4, 2, 3]);
            assert_eq!(d.h64(&d.cast(&joined, DType::F64).unwrap()), v);
        }
        let t = d.t64(&v, &[4, 6]);
        assert!(matches!(
            d.narrow(&t, 3, 2),
            Err(KernelError::ShapeMismatch { .. })
        ));
        let other = d.t64(&v[..8], &[2, 4]);
        assert!(matches!(
            d.concat(&[&t, &other]),
            Err(KernelError::ShapeMismatch { .. })
        ));
        let f32s = d.cast(&t, DType::F32).unwrap();
        assert!(matches!(
            d.concat(&[&t, &f32s]),
            Err(KernelError::ShapeMismatch { .. })
        ));
        assert!(d.concat(&[] as &[&crate::tensor::Tensor<B>]).is_err());
    }

    device_tests!(narrow_and_concat_copy_rows);
}
