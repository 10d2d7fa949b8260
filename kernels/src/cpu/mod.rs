//! The CPU backend: the numerical reference and the default device.
//!
//! Storage is a plain `Vec` per dtype; every op is written once, generic over
//! [`Float`] (f32 and f64), and dispatched on the dtype here. Large loops run
//! on rayon's pool.

mod attention;
mod elementwise;
mod linalg;
mod loss;
mod norm;
mod offload;
mod optim;
mod routing;
#[cfg(test)]
pub(crate) mod test_util;

use crate::backend::Device;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, HostData, StorageInfo, Tensor};

/// The CPU device.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// Values of a CPU tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    /// f32 values.
    F32(Vec<f32>),
    /// f64 values.
    F64(Vec<f64>),
    /// i32 values.
    I32(Vec<i32>),
}

impl StorageInfo for CpuStorage {
    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I32(_) => DType::I32,
        }
    }
    fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::I32(v) => v.len(),
        }
    }
}

/// The float types the CPU kernels are generic over.
pub trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + std::iter::Sum
    + 'static
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
    /// Negative infinity (masked scores).
    const NEG_INF: Self;
    /// Converts from f64 (rounding for f32).
    fn from_f64(x: f64) -> Self;
    /// Widens to f64.
    fn to_f64(self) -> f64;
    /// `e^self`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Larger of two values.
    fn max(self, other: Self) -> Self;
    /// Whether the value is neither NaN nor infinite.
    fn is_finite(self) -> bool;
}

macro_rules! impl_float {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}
impl_float!(f32);
impl_float!(f64);

/// Float-typed views of CPU storage, so generic kernels can borrow their inputs.
pub trait FloatStorage: Float {
    /// The values of `t` if it holds this float type.
    fn slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [Self]>;
    /// The values of `t`, mutably, if it holds this float type.
    fn slice_mut<'a>(t: &'a mut Tensor<Cpu>, op: &'static str) -> Result<&'a mut [Self]>;
    /// Wraps values into a tensor of `shape`.
    fn tensor(v: Vec<Self>, shape: &[usize]) -> Result<Tensor<Cpu>>;
}

macro_rules! impl_float_storage {
    ($t:ty, $variant:ident, $dtype:ident) => {
        impl FloatStorage for $t {
            fn slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [Self]> {
                match t.storage() {
                    CpuStorage::$variant(v) => Ok(v),
                    other => Err(KernelError::DTypeMismatch {
                        op,
                        expected: DType::$dtype,
                        got: other.dtype(),
                    }),
                }
            }
            fn slice_mut<'a>(t: &'a mut Tensor<Cpu>, op: &'static str) -> Result<&'a mut [Self]> {
                let got = t.dtype();
                match t.storage_mut() {
                    CpuStorage::$variant(v) => Ok(v),
                    _ => Err(KernelError::DTypeMismatch {
                        op,
                        expected: DType::$dtype,
                        got,
                    }),
                }
            }
            fn tensor(v: Vec<Self>, shape: &[usize]) -> Result<Tensor<Cpu>> {
                Tensor::from_storage(CpuStorage::$variant(v), shape)
            }
        }
    };
}
impl_float_storage!(f32, F32, F32);
impl_float_storage!(f64, F64, F64);

/// The i32 values of an index tensor, or a dtype error naming `op`.
pub fn index_slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [i32]> {
    match t.storage() {
        CpuStorage::I32(v) => Ok(v),
        other => Err(KernelError::DTypeMismatch {
            op,
            expected: DType::I32,
            got: other.dtype(),
        }),
    }
}

/// Wraps i32 values into a tensor of `shape`.
pub fn index_tensor(v: Vec<i32>, shape: &[usize]) -> Result<Tensor<Cpu>> {
    Tensor::from_storage(CpuStorage::I32(v), shape)
}

/// Runs the generic body `$f::<T>(...)` for the float dtype of `$t`, or returns
/// an unsupported-dtype error naming `$op`.
#[macro_export]
#[doc(hidden)]
macro_rules! cpu_float_dispatch {
    ($op:expr, $t:expr, $f:ident ( $($arg:expr),* $(,)? )) => {
        match $t.dtype() {
            $crate::tensor::DType::F32 => $f::<f32>($($arg),*),
            $crate::tensor::DType::F64 => $f::<f64>($($arg),*),
            other => Err($crate::error::KernelError::UnsupportedDType {
                op: $op,
                dtype: other,
                backend: "cpu",
            }),
        }
    };
}

impl Device for Cpu {
    const NAME: &'static str = "cpu";
    type Storage = CpuStorage;

    fn upload(&self, data: HostData, shape: &[usize]) -> Result<Tensor<Self>> {
        let storage = match data {
            HostData::F32(v) => CpuStorage::F32(v),
            HostData::F64(v) => CpuStorage::F64(v),
            HostData::I32(v) => CpuStorage::I32(v),
        };
        Tensor::from_storage(storage, shape)
    }

    fn download(&self, t: &Tensor<Self>) -> Result<HostData> {
        Ok(match t.storage() {
            CpuStorage::F32(v) => HostData::F32(v.clone()),
            CpuStorage::F64(v) => HostData::F64(v.clone()),
            CpuStorage::I32(v) => HostData::I32(v.clone()),
        })
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor<Self>> {
        let n = shape.iter().product();
        let storage = match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::I32 => CpuStorage::I32(vec![0; n]),
            DType::BF16 => {
                return Err(KernelError::UnsupportedDType {
                    op: "zeros",
                    dtype,
                    backend: "cpu",
                })
            }
        };
        Tensor::from_storage(storage, shape)
    }

    fn cast(&self, t: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>> {
        let host = self.download(t)?;
        let data = match dtype {
            DType::F32 => HostData::F32(host.to_f32()),
            DType::F64 => HostData::F64(host.to_f64()),
            DType::I32 => HostData::I32(host.to_f64().iter().map(|&x| x as i32).collect()),
            DType::BF16 => {
                return Err(KernelError::UnsupportedDType {
                    op: "cast",
                    dtype,
                    backend: "cpu",
                })
            }
        };
        self.upload(data, t.shape())
    }
}
