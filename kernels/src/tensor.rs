//! Device tensors: a backend's storage plus a row-major shape.
//!
//! A tensor never leaves its device implicitly; [`crate::Device::download`]
//! is the one explicit read to the host.

use crate::error::{shape_err, KernelError, Result};
use crate::Device;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float: the compute type of the CPU reference.
    F32,
    /// 64-bit float: used by gradient checks against finite differences.
    F64,
    /// bfloat16: native on CUDA; emulated on the CPU as bf16-representable
    /// f32 values, computed in f32 and rounded once per output
    /// ([`crate::cpu::Bf16`]).
    BF16,
    /// 32-bit signed integer: token ids, expert indices, counts.
    I32,
}

impl DType {
    /// Whether the dtype holds floating-point values.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// The accumulation type of a float dtype: F64 for F64, else F32. Kernels
    /// compute bf16 in f32, and row statistics that a backward reads again
    /// (attention's and cross-entropy's log-sum-exp, the per-token loss) are
    /// kept in it rather than rounded back to bf16.
    pub fn acc(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }

    /// Bytes of one element in a host buffer (the CPU's emulated bf16 is an f32).
    pub fn host_size(self) -> usize {
        match self {
            DType::F64 => 8,
            _ => 4,
        }
    }
}

/// What a backend's storage reports about itself.
pub trait StorageInfo {
    /// Element type of the stored values.
    fn dtype(&self) -> DType;
    /// Number of stored elements.
    fn len(&self) -> usize;
    /// Whether no elements are stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Values read back to (or prepared on) the host.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// f32 values.
    F32(Vec<f32>),
    /// f64 values.
    F64(Vec<f64>),
    /// i32 values.
    I32(Vec<i32>),
}

impl HostData {
    /// Element type of the values.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F64(_) => DType::F64,
            HostData::I32(_) => DType::I32,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F64(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f64 (integers converted exactly).
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            HostData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::F64(v) => v.clone(),
            HostData::I32(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// The values as f32 (f64 rounded to nearest).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostData::F32(v) => v.clone(),
            HostData::F64(v) => v.iter().map(|&x| x as f32).collect(),
            HostData::I32(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// The values as i32; an error for float data.
    pub fn to_i32(&self) -> Result<Vec<i32>> {
        match self {
            HostData::I32(v) => Ok(v.clone()),
            other => Err(KernelError::DTypeMismatch {
                op: "HostData::to_i32",
                expected: DType::I32,
                got: other.dtype(),
            }),
        }
    }
}

/// A tensor on device `B`: storage and a row-major shape.
pub struct Tensor<B: Device> {
    storage: B::Storage,
    shape: Vec<usize>,
}

impl<B: Device> Clone for Tensor<B> {
    /// A second handle on the same values where the device's storage is
    /// shared (the CPU's), a copy where its storage's clone copies.
    fn clone(&self) -> Self {
        Tensor {
            storage: self.storage.clone(),
            shape: self.shape.clone(),
        }
    }
}

/// Host memory held by the CPU backend's buffers ([`crate::cpu::HostBuf`]:
/// counted when one is made or copied, not when a tensor is cloned, since
/// clones share it), counted per thread: each rank of a local run is one
/// thread, so a rank's allocation peak is its own.
pub mod meter {
    use std::cell::Cell;

    thread_local! {
        static IN_USE: Cell<i64> = const { Cell::new(0) };
        static PEAK: Cell<i64> = const { Cell::new(0) };
    }

    pub(crate) fn add(bytes: usize) {
        if bytes == 0 {
            return;
        }
        IN_USE.with(|u| {
            let now = u.get() + bytes as i64;
            u.set(now);
            PEAK.with(|p| p.set(p.get().max(now)));
        });
    }

    pub(crate) fn sub(bytes: usize) {
        if bytes > 0 {
            IN_USE.with(|u| u.set(u.get() - bytes as i64));
        }
    }

    /// `(in use, peak)` bytes of this thread's buffers (a buffer freed on
    /// another thread than the one that made it moves bytes between
    /// threads; both figures are clamped at zero).
    pub fn usage() -> (usize, usize) {
        let now = IN_USE.with(Cell::get).max(0) as usize;
        (now, PEAK.with(Cell::get).max(0) as usize)
    }

    /// Starts a new peak measurement from the current use.
    pub fn reset_peak() {
        let now = IN_USE.with(Cell::get);
        PEAK.with(|p| p.set(now));
    }
}

impl<B: Device> std::fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor<{}>{:?}{:?}", B::NAME, self.dtype(), self.shape)
    }
}

impl<B: Device> Tensor<B> {
    /// Wraps backend storage; the shape's product must equal the storage length.
    /// Backends call this; users build tensors with [`Device::upload`].
    pub fn from_storage(storage: B::Storage, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != storage.len() {
            return Err(shape_err(
                "Tensor::from_storage",
                format!(
                    "shape {shape:?} holds {n} elements, storage holds {}",
                    storage.len()
                ),
            ));
        }
        Ok(Tensor {
            storage,
            shape: shape.to_vec(),
        })
    }

    /// The backend storage.
    pub fn storage(&self) -> &B::Storage {
        &self.storage
    }

    /// The backend storage, mutably (in-place ops).
    pub fn storage_mut(&mut self) -> &mut B::Storage {
        &mut self.storage
    }

    /// The dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// The same data under a new shape with the same element count.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != self.numel() {
            return Err(shape_err(
                "reshape",
                format!(
                    "cannot view {:?} ({} elements) as {shape:?} ({n} elements)",
                    self.shape,
                    self.numel()
                ),
            ));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The two dimensions of a matrix, or an error naming `op` and the shape.
    pub fn dims2(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            _ => Err(shape_err(
                op,
                format!("expected a 2-d tensor, got shape {:?}", self.shape),
            )),
        }
    }

    /// The three dimensions, or an error naming `op` and the shape.
    pub fn dims3(&self, op: &'static str) -> Result<(usize, usize, usize)> {
        match self.shape[..] {
            [a, b, c] => Ok((a, b, c)),
            _ => Err(shape_err(
                op,
                format!("expected a 3-d tensor, got shape {:?}", self.shape),
            )),
        }
    }

    /// The four dimensions, or an error naming `op` and the shape.
    pub fn dims4(&self, op: &'static str) -> Result<(usize, usize, usize, usize)> {
        match self.shape[..] {
            [a, b, c, d] => Ok((a, b, c, d)),
            _ => Err(shape_err(
                op,
                format!("expected a 4-d tensor, got shape {:?}", self.shape),
            )),
        }
    }

    /// Errors unless the tensor has dtype `want`.
    pub fn expect_dtype(&self, op: &'static str, want: DType) -> Result<()> {
        if self.dtype() != want {
            return Err(KernelError::DTypeMismatch {
                op,
                expected: want,
                got: self.dtype(),
            });
        }
        Ok(())
    }

    /// Errors unless the tensor has exactly `shape`.
    pub fn expect_shape(&self, op: &'static str, what: &str, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            return Err(shape_err(
                op,
                format!("{what} has shape {:?}, expected {shape:?}", self.shape),
            ));
        }
        Ok(())
    }
}
