//! The CPU backend: the numerical reference and the default device.
//!
//! Storage is one shared buffer per dtype ([`HostBuf`] behind an `Arc`: a
//! tensor's clone is a second handle, and a write through a shared handle
//! copies first); every op is written once, generic over [`Float`] (f32, f64
//! and the bf16 emulation [`Bf16`]), and dispatched on the dtype here. Large
//! loops run on rayon's pool.

mod attention;
mod bf16;
mod elementwise;
mod fp8;
mod linalg;
mod loss;
mod norm;
mod offload;
mod optim;
mod pool;
mod routing;
#[cfg(test)]
pub(crate) mod test_util;

use std::sync::Arc;

use rayon::prelude::*;

pub use bf16::Bf16;

use crate::backend::Device;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, HostData, StorageInfo, Tensor};

/// The CPU device.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Cpu {
    /// Threads the CPU backend's parallel loops and GEMMs use (rayon's pool:
    /// `RAYON_NUM_THREADS`, else one per core).
    pub fn threads(&self) -> usize {
        rayon::current_num_threads()
    }
}

/// The values behind CPU tensors: one host allocation, metered
/// ([`crate::tensor::meter`]) from when it is made or copied until it is
/// freed. Tensors hold it through an `Arc`, so that cloning a tensor (saving
/// an activation, packing gradients) shares it; a kernel writing in place
/// gets it through [`Arc::make_mut`], which copies it first when another
/// tensor still shares it, so no write is ever seen through a clone.
#[derive(Debug, PartialEq)]
pub struct HostBuf<T: pool::Pooled>(Vec<T>);

impl<T: pool::Pooled> HostBuf<T> {
    /// Takes ownership of `v` and meters its bytes.
    fn new(v: Vec<T>) -> Arc<Self> {
        crate::tensor::meter::add(v.len() * std::mem::size_of::<T>());
        Arc::new(HostBuf(v))
    }

    /// The values.
    pub fn as_slice(&self) -> &[T] {
        &self.0
    }
}

impl<T: pool::Pooled> Clone for HostBuf<T> {
    /// A copy of the values (what [`Arc::make_mut`] makes of a shared
    /// buffer): a second allocation, metered as such.
    fn clone(&self) -> Self {
        crate::tensor::meter::add(self.0.len() * std::mem::size_of::<T>());
        HostBuf(pool::copied(&self.0))
    }
}

impl<T: pool::Pooled> Drop for HostBuf<T> {
    /// Unmeters the buffer and gives it to [`pool`] for the next op's output.
    fn drop(&mut self) {
        crate::tensor::meter::sub(self.0.len() * std::mem::size_of::<T>());
        pool::recycle(std::mem::take(&mut self.0));
    }
}

/// Values of a CPU tensor, shared by its clones ([`HostBuf`]).
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    /// f32 values.
    F32(Arc<HostBuf<f32>>),
    /// f64 values.
    F64(Arc<HostBuf<f64>>),
    /// bf16 values, emulated: f32s that are exactly representable in bf16.
    BF16(Arc<HostBuf<Bf16>>),
    /// i32 values.
    I32(Arc<HostBuf<i32>>),
}

impl CpuStorage {
    /// Wraps f32 values.
    pub fn f32(v: Vec<f32>) -> Self {
        CpuStorage::F32(HostBuf::new(v))
    }
    /// Wraps f64 values.
    pub fn f64(v: Vec<f64>) -> Self {
        CpuStorage::F64(HostBuf::new(v))
    }
    /// Wraps bf16 values (already rounded to bf16).
    pub fn bf16(v: Vec<Bf16>) -> Self {
        CpuStorage::BF16(HostBuf::new(v))
    }
    /// Wraps i32 values.
    pub fn i32(v: Vec<i32>) -> Self {
        CpuStorage::I32(HostBuf::new(v))
    }
}

impl StorageInfo for CpuStorage {
    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I32(_) => DType::I32,
        }
    }
    fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.0.len(),
            CpuStorage::F64(v) => v.0.len(),
            CpuStorage::BF16(v) => v.0.len(),
            CpuStorage::I32(v) => v.0.len(),
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
    ($t:ty, $exp:path) => {
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
                $exp(self)
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
impl_float!(f32, exp_f32);
impl_float!(f64, f64::exp);

/// Runs `f` compiled for AVX2 and FMA (x86-64-v3) when the CPU has them,
/// else as the crate is built (x86-64's baseline is SSE2: 4 lanes). The
/// kernels' loops are written to vectorise; inlined here they use 8 lanes.
/// Only the register width changes: Rust never contracts `a·b + c` into a
/// fused multiply-add, and every reduction fixes its own order, so results
/// are bit-identical on either path. `f` must be inlined to get the
/// features: callers mark their closure `#[inline(always)]`.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn v3<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features `v3` is compiled for.
            return unsafe { v3(f) };
        }
    }
    f()
}

/// `e^x` in f32 without a libm call, so that loops over it vectorise (the
/// CPU's softmaxes, SiLU and cross-entropy spend most of their time here):
/// `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (ln 2 split in two parts, Cody and
/// Waite), `e^r` by a degree-7 polynomial (Cephes' `expf` coefficients),
/// then scaled by `2^n` built from its bits. Within 2 ulp of the true value
/// on `[−86.6, 88.7]` (the test checks every 1e-3 step against f64); below
/// that range it returns 0 (the exact value is under 2e-38), above it
/// infinity, and NaN for NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // ln(f32::MAX); and the least x whose 2^(n−1) below is a normal float.
    const MAX: f32 = 88.722_83;
    const MIN: f32 = -86.643_4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(MIN, MAX);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    // 2^n as 2 · 2^(n−1): n reaches 128 at MAX, whose 2^n is not a float.
    let half_scale = f32::from_bits(((n as i32 + 126) as u32) << 23);
    let e = (e_r * 2.0) * half_scale;
    if x > MAX {
        f32::INFINITY
    } else if x < MIN {
        0.0
    } else {
        e
    }
}

/// Float-typed views of CPU storage, so generic kernels can borrow their inputs.
pub trait FloatStorage: Float + pool::Pooled {
    /// The accumulation type: statistics a GPU keeps in it for this dtype
    /// (attention's log-sum-exp) are stored in it. f32 for bf16, else `Self`.
    type Acc: FloatStorage;
    /// The element type the `gemm` crate sees: `Self`, or f32 for [`Bf16`]
    /// (same layout), which the crate does not know.
    type Gemm: Copy + 'static;
    /// The value as the `gemm` crate's element type (exact).
    fn to_gemm(self) -> Self::Gemm;
    /// The values of `t` if it holds this float type.
    fn slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [Self]>;
    /// The values of `t`, mutably, if it holds this float type. A kernel
    /// writing through it stores [`FloatStorage::stored`] values.
    fn slice_mut<'a>(t: &'a mut Tensor<Cpu>, op: &'static str) -> Result<&'a mut [Self]>;
    /// Wraps values into a tensor of `shape`, each rounded to the dtype
    /// ([`FloatStorage::stored`]): a kernel's one rounding of its outputs.
    fn tensor(v: Vec<Self>, shape: &[usize]) -> Result<Tensor<Cpu>>;
    /// The value as the dtype stores it: itself, or rounded to nearest even
    /// for bf16.
    fn stored(self) -> Self {
        self
    }
    /// Widens to the accumulation type (exact).
    fn to_acc(self) -> Self::Acc;
    /// A value of the accumulation type as a kernel intermediate (exact).
    fn from_acc(a: Self::Acc) -> Self;
}

macro_rules! impl_float_storage {
    ($t:ty, $variant:ident, $dtype:ident) => {
        impl FloatStorage for $t {
            type Acc = $t;
            type Gemm = $t;
            fn to_gemm(self) -> Self {
                self
            }
            fn to_acc(self) -> Self {
                self
            }
            fn from_acc(a: Self) -> Self {
                a
            }
            fn slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [Self]> {
                match t.storage() {
                    CpuStorage::$variant(v) => Ok(v.as_slice()),
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
                    CpuStorage::$variant(v) => Ok(&mut Arc::make_mut(v).0),
                    _ => Err(KernelError::DTypeMismatch {
                        op,
                        expected: DType::$dtype,
                        got,
                    }),
                }
            }
            fn tensor(v: Vec<Self>, shape: &[usize]) -> Result<Tensor<Cpu>> {
                Tensor::from_storage(CpuStorage::$variant(HostBuf::new(v)), shape)
            }
        }
    };
}
impl_float_storage!(f32, F32, F32);
impl_float_storage!(f64, F64, F64);

impl FloatStorage for Bf16 {
    type Acc = f32;
    type Gemm = f32;
    fn to_gemm(self) -> f32 {
        self.to_f32()
    }
    fn slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [Self]> {
        match t.storage() {
            CpuStorage::BF16(v) => Ok(v.as_slice()),
            other => Err(KernelError::DTypeMismatch {
                op,
                expected: DType::BF16,
                got: other.dtype(),
            }),
        }
    }
    fn slice_mut<'a>(t: &'a mut Tensor<Cpu>, op: &'static str) -> Result<&'a mut [Self]> {
        let got = t.dtype();
        match t.storage_mut() {
            CpuStorage::BF16(v) => Ok(&mut Arc::make_mut(v).0),
            _ => Err(KernelError::DTypeMismatch {
                op,
                expected: DType::BF16,
                got,
            }),
        }
    }
    fn tensor(mut v: Vec<Self>, shape: &[usize]) -> Result<Tensor<Cpu>> {
        v.par_iter_mut()
            .with_min_len(elementwise::GRAIN)
            .for_each(|x| *x = x.stored());
        Tensor::from_storage(CpuStorage::bf16(v), shape)
    }
    fn stored(self) -> Self {
        Bf16::round(self.to_f32())
    }
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(a: f32) -> Self {
        Bf16::raw(a)
    }
}

/// The i32 values of an index tensor, or a dtype error naming `op`.
pub fn index_slice<'a>(t: &'a Tensor<Cpu>, op: &'static str) -> Result<&'a [i32]> {
    match t.storage() {
        CpuStorage::I32(v) => Ok(v.as_slice()),
        other => Err(KernelError::DTypeMismatch {
            op,
            expected: DType::I32,
            got: other.dtype(),
        }),
    }
}

/// Wraps i32 values into a tensor of `shape`.
pub fn index_tensor(v: Vec<i32>, shape: &[usize]) -> Result<Tensor<Cpu>> {
    Tensor::from_storage(CpuStorage::i32(v), shape)
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
            $crate::tensor::DType::BF16 => $f::<$crate::cpu::Bf16>($($arg),*),
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

    /// Copies only the rows taken (the provided version would copy the whole
    /// tensor to the host first).
    fn narrow(&self, t: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        let out_shape = crate::backend::narrow_shape(t.shape(), start, len)?;
        let row: usize = out_shape[1..].iter().product();
        let (a, b) = (start * row, (start + len) * row);
        let storage = match t.storage() {
            CpuStorage::F32(v) => CpuStorage::f32(pool::copied(&v.0[a..b])),
            CpuStorage::F64(v) => CpuStorage::f64(pool::copied(&v.0[a..b])),
            CpuStorage::BF16(v) => CpuStorage::bf16(pool::copied(&v.0[a..b])),
            CpuStorage::I32(v) => CpuStorage::i32(pool::copied(&v.0[a..b])),
        };
        Tensor::from_storage(storage, &out_shape)
    }

    /// One copy of each part into the joined buffer (the provided version
    /// reads every part to the host and extends a vector with it).
    fn concat(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let (shape, _) = crate::backend::concat_shape(parts)?;
        let n: usize = shape.iter().product();
        macro_rules! join {
            ($variant:ident, $make:ident) => {{
                let mut out = pool::take(n);
                let mut at = 0;
                for p in parts {
                    match p.storage() {
                        CpuStorage::$variant(v) => {
                            out[at..at + v.0.len()].copy_from_slice(v.as_slice());
                            at += v.0.len();
                        }
                        other => {
                            return Err(KernelError::DTypeMismatch {
                                op: "concat",
                                expected: parts[0].dtype(),
                                got: other.dtype(),
                            })
                        }
                    }
                }
                CpuStorage::$make(out)
            }};
        }
        let storage = match parts[0].storage() {
            CpuStorage::F32(_) => join!(F32, f32),
            CpuStorage::F64(_) => join!(F64, f64),
            CpuStorage::BF16(_) => join!(BF16, bf16),
            CpuStorage::I32(_) => join!(I32, i32),
        };
        Tensor::from_storage(storage, &shape)
    }

    fn upload(&self, data: HostData, shape: &[usize]) -> Result<Tensor<Self>> {
        let storage = match data {
            HostData::F32(v) => CpuStorage::f32(v),
            HostData::F64(v) => CpuStorage::f64(v),
            HostData::I32(v) => CpuStorage::i32(v),
        };
        Tensor::from_storage(storage, shape)
    }

    fn download(&self, t: &Tensor<Self>) -> Result<HostData> {
        Ok(match t.storage() {
            CpuStorage::F32(v) => HostData::F32(v.0.clone()),
            CpuStorage::F64(v) => HostData::F64(v.0.clone()),
            // Exact, as on CUDA: the host side has no bf16 type.
            CpuStorage::BF16(v) => HostData::F32(v.0.iter().map(|x| x.to_f32()).collect()),
            CpuStorage::I32(v) => HostData::I32(v.0.clone()),
        })
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor<Self>> {
        let n = shape.iter().product();
        let storage = match dtype {
            DType::F32 => CpuStorage::f32(pool::zeroed(n)),
            DType::F64 => CpuStorage::f64(pool::zeroed(n)),
            DType::I32 => CpuStorage::i32(pool::zeroed(n)),
            DType::BF16 => CpuStorage::bf16(pool::zeroed(n)),
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
                // One rounding from the source's own values (f64 included).
                let v: Vec<Bf16> = match host {
                    HostData::F32(v) => v.into_iter().map(Bf16::round).collect(),
                    other => (other.to_f64().into_iter())
                        .map(|x| Bf16::raw(bf16::round_f64(x)))
                        .collect(),
                };
                return Tensor::from_storage(CpuStorage::bf16(v), t.shape());
            }
        };
        self.upload(data, t.shape())
    }
}

#[cfg(test)]
mod tests {
    use super::{exp_f32, simd};

    /// The widened path computes the same bits as the baseline build: a
    /// vectorised map through [`exp_f32`] and a fixed-order lane sum, on
    /// values across the whole range of `exp`.
    #[test]
    fn simd_path_gives_the_baseline_bits() {
        let xs: Vec<f32> = (0..4099).map(|i| -90.0 + 0.0439 * i as f32).collect();
        let run = |out: &mut [f32]| {
            for (o, &x) in out.iter_mut().zip(&xs) {
                *o = exp_f32(x) * x + 0.5 * x;
            }
            super::elementwise::lane_sum(out)
        };
        let (mut plain, mut wide) = (vec![0.0f32; xs.len()], vec![0.0f32; xs.len()]);
        let s_plain = run(&mut plain);
        let s_wide = simd(
            #[inline(always)]
            || run(&mut wide),
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain), bits(&wide));
        assert_eq!(s_plain.to_bits(), s_wide.to_bits());
    }

    /// Every 1e-3 step of the range, and its ends, against f64's `exp`
    /// rounded to f32: within 2 ulp; outside the range 0 and infinity.
    #[test]
    fn exp_f32_is_within_two_ulp_of_the_f64_exp() {
        let mut worst = 0.0f64;
        let mut x = -86.6f64;
        while x <= 88.72 {
            let xf = x as f32;
            let want = (xf as f64).exp();
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            let err = (exp_f32(xf) as f64 - want).abs() / ulp;
            worst = worst.max(err);
            x += 1e-3;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.7).is_finite());
    }
}
