//! Helpers shared by the CPU op tests (compiled for tests only).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::Device;
use crate::cpu::Cpu;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, HostData, Tensor};

/// Relative tolerance of every f64 finite-difference check.
pub(crate) const TOL: f64 = 1e-6;

/// A seeded generator, so failures reproduce.
pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in `[-1, 1)`.
pub(crate) fn uniform(rng: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

/// An f64 tensor.
pub(crate) fn t64(v: &[f64], shape: &[usize]) -> Tensor<Cpu> {
    Cpu.upload(HostData::F64(v.to_vec()), shape).unwrap()
}

/// An f32 tensor.
pub(crate) fn t32(v: &[f32], shape: &[usize]) -> Tensor<Cpu> {
    Cpu.upload(HostData::F32(v.to_vec()), shape).unwrap()
}

/// An i32 tensor.
pub(crate) fn ti32(v: &[i32], shape: &[usize]) -> Tensor<Cpu> {
    Cpu.upload(HostData::I32(v.to_vec()), shape).unwrap()
}

/// A tensor's values as f64.
pub(crate) fn h64(t: &Tensor<Cpu>) -> Vec<f64> {
    Cpu.download(t).unwrap().to_f64()
}

/// `Σ a ⊙ b`: the scalar objective of the gradient checks.
pub(crate) fn dotv(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Largest absolute difference.
pub(crate) fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// Finite-difference check of `analytic` against `f` at `x`, tolerance [`TOL`].
pub(crate) fn check(what: &str, x: &[f64], analytic: &[f64], f: impl FnMut(&[f64]) -> f64) {
    crate::gradcheck::assert_grad(what, x, analytic, TOL, f);
}

// ---- one test body for every device ------------------------------------------

/// The op areas the shared test bodies call: the whole backend.
pub(crate) trait TestOps: crate::backend::Backend {}
impl<T: crate::backend::Backend> TestOps for T {}

/// Tensor builders and readers on any device, so a test body written once
/// runs on the CPU and on CUDA (`d.t64(..)` instead of `t64(..)`).
pub(crate) trait TestDevice: Device {
    /// An f64 tensor.
    fn t64(&self, v: &[f64], shape: &[usize]) -> Tensor<Self> {
        self.upload(HostData::F64(v.to_vec()), shape).unwrap()
    }
    /// An f32 tensor.
    fn t32(&self, v: &[f32], shape: &[usize]) -> Tensor<Self> {
        self.upload(HostData::F32(v.to_vec()), shape).unwrap()
    }
    /// An i32 tensor.
    fn ti32(&self, v: &[i32], shape: &[usize]) -> Tensor<Self> {
        self.upload(HostData::I32(v.to_vec()), shape).unwrap()
    }
    /// A tensor's values as f64.
    fn h64(&self, t: &Tensor<Self>) -> Vec<f64> {
        self.download(t).unwrap().to_f64()
    }
    /// A tensor's values as i32.
    fn hi32(&self, t: &Tensor<Self>) -> Vec<i32> {
        self.download(t).unwrap().to_i32().unwrap()
    }
    /// The error of `r`: returned by the op itself (CPU, and shape or dtype
    /// errors anywhere), or, for a data-dependent error that a GPU kernel
    /// found, by the next read. Panics if there is none.
    fn err_of(&self, r: Result<Tensor<Self>>) -> KernelError {
        match r {
            Err(e) => e,
            Ok(t) => match self.download(&t) {
                Err(e) => e,
                Ok(v) => panic!("expected an error, got a tensor {:?} = {v:?}", t),
            },
        }
    }
}
impl<B: Device> TestDevice for B {}

/// Norm-wise relative error `‖got − want‖₂ / ‖want‖₂` (absolute where
/// `want` is all zeros); NaN in either never passes, matched NaNs and
/// infinities excepted.
pub(crate) fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if w.is_finite() {
            den += w * w;
        }
        if g == w || (g.is_nan() && w.is_nan()) {
            continue;
        }
        if !(g - w).is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
    }
    if num == 0.0 {
        0.0
    } else if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

/// Runs each op on a device and on the CPU reference with the same inputs
/// and compares: f32 within 1e-5, bf16 within 1e-2 (relative, norm-wise). For
/// bf16 the device gets bf16 tensors and the CPU the same values, rounded to
/// bf16, in f32. The CPU compared with itself in f32 passes trivially; in
/// bf16 it tests the CPU's bf16 emulation.
pub(crate) struct Compare<'a, B: Device> {
    /// The device under test.
    pub(crate) d: &'a B,
    /// The dtype the device computes in (F32 or BF16).
    pub(crate) dtype: DType,
    /// The generator of every input of this comparison.
    pub(crate) g: ChaCha8Rng,
    /// The worst relative error seen, and where.
    pub(crate) worst: (f64, String),
}

impl<'a, B: Device> Compare<'a, B> {
    /// The precisions `d` can be compared in: F32 always, BF16 where `d`
    /// stores it (natively on CUDA, emulated on the CPU, where the
    /// comparison checks the emulation against the f32 reference).
    pub(crate) fn precisions(d: &B) -> Vec<DType> {
        let probe = d.upload(HostData::F32(vec![1.0]), &[1]).unwrap();
        match d.cast(&probe, DType::BF16) {
            Ok(_) => vec![DType::F32, DType::BF16],
            Err(_) => vec![DType::F32],
        }
    }

    /// A comparison on `d` in `dtype`, inputs drawn from `seed`.
    pub(crate) fn new(d: &'a B, dtype: DType, seed: u64) -> Self {
        Compare {
            d,
            dtype,
            g: rng(seed),
            worst: (0.0, String::new()),
        }
    }

    /// The tolerance of this precision.
    pub(crate) fn tol(&self) -> f64 {
        if self.dtype == DType::BF16 {
            1e-2
        } else {
            1e-5
        }
    }

    /// The same values on the device (in the compared dtype) and on the CPU
    /// (f32, rounded to bf16 when that is the compared dtype).
    pub(crate) fn pair(&self, v: &[f64], shape: &[usize]) -> (Tensor<B>, Tensor<Cpu>) {
        let v32: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        let on_d = self.d.upload(HostData::F32(v32.clone()), shape).unwrap();
        if self.dtype == DType::BF16 {
            let rounded: Vec<f32> = v32
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            (
                self.d.cast(&on_d, DType::BF16).unwrap(),
                t32(&rounded, shape),
            )
        } else {
            (on_d, t32(&v32, shape))
        }
    }

    /// Random values uniform in `[-scale, scale)` of `shape`, on both sides.
    pub(crate) fn rand(&mut self, shape: &[usize], scale: f64) -> (Tensor<B>, Tensor<Cpu>) {
        let n = shape.iter().product();
        let v: Vec<f64> = uniform(&mut self.g, n).iter().map(|x| x * scale).collect();
        self.pair(&v, shape)
    }

    /// [`Self::rand`] with the last dimension's columns from `keep` on set
    /// to zero (MLA's values, zero-padded to the query/key width).
    pub(crate) fn rand_padded(
        &mut self,
        shape: &[usize],
        scale: f64,
        keep: usize,
    ) -> (Tensor<B>, Tensor<Cpu>) {
        let n = shape.iter().product();
        let w = shape.last().copied().unwrap_or(1).max(1);
        let v: Vec<f64> = uniform(&mut self.g, n)
            .iter()
            .enumerate()
            .map(|(i, x)| if i % w < keep { x * scale } else { 0.0 })
            .collect();
        self.pair(&v, shape)
    }

    /// Index values, identical on both sides.
    pub(crate) fn idx(&self, v: &[i32], shape: &[usize]) -> (Tensor<B>, Tensor<Cpu>) {
        (self.d.ti32(v, shape), ti32(v, shape))
    }

    /// Asserts the device's `got` matches the CPU's `want` (same shape, error
    /// within the tolerance), naming `what`.
    pub(crate) fn check(&mut self, what: &str, got: &Tensor<B>, want: &Tensor<Cpu>) {
        assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
        let (g, w) = (self.d.h64(got), h64(want));
        let e = rel_err(&g, &w);
        assert!(
            e <= self.tol(),
            "{what} ({:?} on {}): relative error {e:.3e} > {:.0e}\n got  {:?}\n want {:?}",
            self.dtype,
            B::NAME,
            self.tol(),
            &g[..g.len().min(16)],
            &w[..w.len().min(16)]
        );
        if e > self.worst.0 {
            self.worst = (e, what.to_string());
        }
    }

    /// Prints the worst error of this comparison (visible with --nocapture:
    /// the figures the GPU runs report).
    pub(crate) fn report(&self, area: &str) {
        println!(
            "{area} on {} in {:?}: worst relative error {:.2e} ({})",
            B::NAME,
            self.dtype,
            self.worst.0,
            self.worst.1
        );
    }
}

/// Declares, for each named generic body `fn name<B: TestOps>(d: &B)`, a
/// `#[test]` on the CPU (`on_cpu::name`) and one on CUDA (`on_cuda::name`);
/// the CUDA tests are ignored unless built with `--cfg foldmoe_gpu_tests`
/// (or run with `--ignored`), and then fail where no GPU is found
/// ([`crate::cuda::require_test_device`]).
macro_rules! device_tests {
    ($($name:ident),* $(,)?) => {
        mod on_cpu {
            $(
                #[test]
                fn $name() {
                    super::$name(&$crate::cpu::Cpu)
                }
            )*
        }
        mod on_cuda {
            $(
                #[test]
                #[cfg_attr(
                    not(foldmoe_gpu_tests),
                    ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
                )]
                fn $name() {
                    super::$name(&$crate::cuda::require_test_device())
                }
            )*
        }
    };
}
pub(crate) use device_tests;
