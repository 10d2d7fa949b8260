//! Helpers shared by the MoE stages' tests: f64 tensors on the CPU, seeded
//! inputs, specs, and a gradient check over an input and every parameter.

use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::gradcheck::assert_grad;
use foldmoe_kernels::{Device, HostData, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::engine::{Module, Param};
use crate::spec::{MoeSpec, RouterSpec};

/// Relative error allowed against central differences in f64.
pub const TOL: f64 = 1e-6;

/// An f64 tensor on the CPU.
pub fn t64(v: Vec<f64>, shape: &[usize]) -> Tensor<Cpu> {
    Cpu.upload(HostData::F64(v), shape).unwrap()
}

/// An i32 tensor on the CPU.
pub fn ti32(v: Vec<i32>, shape: &[usize]) -> Tensor<Cpu> {
    Cpu.upload(HostData::I32(v), shape).unwrap()
}

/// The values of a tensor as f64.
pub fn host(t: &Tensor<Cpu>) -> Vec<f64> {
    Cpu.download(t).unwrap().to_f64()
}

/// The values of an index tensor.
pub fn host_i32(t: &Tensor<Cpu>) -> Vec<i32> {
    Cpu.download(t).unwrap().to_i32().unwrap()
}

/// `n` seeded values uniform in `[-scale, scale]`.
pub fn uniform(seed: u64, n: usize, scale: f64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| scale * rng.gen_range(-1.0..1.0)).collect()
}

/// `Σ a ⊙ r` on the host.
pub fn dot(a: &Tensor<Cpu>, r: &[f64]) -> f64 {
    host(a).iter().zip(r).map(|(a, r)| a * r).sum()
}

/// A small MoE spec with default router settings.
pub fn moe_spec(experts: usize, top_k: usize, expert_ffn: usize, shared_ffn: usize) -> MoeSpec {
    MoeSpec {
        experts,
        top_k,
        expert_ffn,
        shared_ffn,
        shared_gate: false,
        router: RouterSpec::default(),
        capacity: None,
    }
}

/// Every parameter's `(name, value, grad)`.
pub fn params<M: Module<Cpu>>(m: &M) -> Vec<(String, Vec<f64>, Vec<f64>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p: &Param<Cpu>| out.push((p.name.clone(), host(&p.value), host(&p.grad))));
    out
}

/// Overwrites the value of parameter `name`.
pub fn set_param<M: Module<Cpu>>(m: &mut M, name: &str, v: &[f64]) {
    m.visit_params_mut(&mut |p: &mut Param<Cpu>| {
        if p.name == name {
            p.value = t64(v.to_vec(), p.value.shape());
        }
    });
}

/// Checks `dx` against central differences of `f(m, x)` at `x`, then every
/// parameter's accumulated gradient (from one backward with zero-started
/// gradients) against central differences in that parameter.
pub fn check_grads<M: Module<Cpu>>(
    what: &str,
    m: &mut M,
    x: &[f64],
    x_shape: &[usize],
    dx: &[f64],
    f: impl Fn(&M, &Tensor<Cpu>) -> f64,
) {
    assert_grad(&format!("{what}: x"), x, dx, TOL, |xv| {
        f(m, &t64(xv.to_vec(), x_shape))
    });
    let x_t = t64(x.to_vec(), x_shape);
    for (name, value, grad) in params(m) {
        assert_grad(&format!("{what}: {name}"), &value, &grad, TOL, |pv| {
            set_param(m, &name, pv);
            f(m, &x_t)
        });
        set_param(m, &name, &value);
    }
}
