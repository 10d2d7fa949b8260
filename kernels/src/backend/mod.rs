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
mod linalg;
mod loss;
mod norm;
mod optim;
mod routing;

pub use attention::AttentionOps;
pub use elementwise::ElementwiseOps;
pub use linalg::LinalgOps;
pub use loss::LossOps;
pub use norm::NormOps;
pub use optim::{AdamWConfig, OptimOps};
pub use routing::{DropPolicy, RoutingOps, RoutingPlan};

use crate::error::Result;
use crate::tensor::{DType, HostData, StorageInfo, Tensor};

/// Allocation and transfers: what every device provides.
pub trait Device: Clone + Send + Sync + 'static {
    /// Short name used in messages (`"cpu"`, `"cuda"`).
    const NAME: &'static str;
    /// The device buffer behind a tensor.
    type Storage: StorageInfo + Clone + Send + Sync;

    /// Copies host values onto the device as a tensor of `shape`.
    fn upload(&self, data: HostData, shape: &[usize]) -> Result<Tensor<Self>>;
    /// Reads a tensor back to the host: the one explicit device→host read.
    fn download(&self, t: &Tensor<Self>) -> Result<HostData>;
    /// A tensor of zeros.
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor<Self>>;
    /// Converts to another dtype (floats round to nearest; float→i32 truncates).
    fn cast(&self, t: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>>;
}

/// The whole kernel backend: every area of operations on one device.
/// Implemented automatically for any type that implements all areas.
pub trait Backend:
    Device + ElementwiseOps + LinalgOps + NormOps + AttentionOps + RoutingOps + LossOps + OptimOps
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
{
}
