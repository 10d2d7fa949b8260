use super::Device;
use crate::error::Result;
use crate::fp8::{compress_via_host, expand_via_host, Fp8Tensor};
use crate::tensor::Tensor;

/// Activation offload: saved tensors moved to host memory after the
/// forward and brought back for the backward that needs them.
pub trait OffloadOps: Device {
    /// A tensor's contents in host memory (pinned, on CUDA) until it comes
    /// back, with its shape and dtype.
    type Offloaded: Send + Sync + std::fmt::Debug + 'static;
    /// Starts copying `t` to host memory and returns without waiting for
    /// the copy (on CUDA it runs on a copy stream, ordered after the work
    /// already queued; `t`'s device memory goes back to the pool once the
    /// copy is done, even if the caller drops `t` at once).
    fn offload(&self, t: &Tensor<Self>) -> Result<Self::Offloaded>;
    /// Starts bringing `h` back to the device ahead of its use (on CUDA on
    /// the copy stream, overlapping the work queued meanwhile); idempotent.
    fn prefetch(&self, h: &mut Self::Offloaded) -> Result<()>;
    /// The tensor again, on the device and complete for the ops queued
    /// after this call (prefetching first if that was not done).
    fn reload(&self, h: Self::Offloaded) -> Result<Tensor<Self>>;

    /// Compresses a saved float tensor to e4m3 with one f32 scale per 1×128
    /// block of a row (docs/ARCHITECTURE.md §5; the rules are in [`crate::fp8`]), to keep
    /// it at a quarter of f32's bytes until its backward. Provided through
    /// the host (the CPU's own); CUDA overrides it with a kernel that gives
    /// the same codes and scales without leaving the device.
    fn compress_fp8(&self, t: &Tensor<Self>) -> Result<Fp8Tensor<Self>> {
        compress_via_host(self, t)
    }

    /// The compressed tensor expanded again, in its dtype and shape.
    fn expand_fp8(&self, f: &Fp8Tensor<Self>) -> Result<Tensor<Self>> {
        expand_via_host(self, f)
    }
}
