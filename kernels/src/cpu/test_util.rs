//! Helpers shared by the CPU op tests (compiled for tests only).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::Device;
use crate::cpu::Cpu;
use crate::tensor::{HostData, Tensor};

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

/// A tensor's values as i32.
pub(crate) fn hi32(t: &Tensor<Cpu>) -> Vec<i32> {
    Cpu.download(t).unwrap().to_i32().unwrap()
}
