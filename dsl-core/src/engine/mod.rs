//! The training engine: layers with explicit forward/backward pairs
//! (docs/ARCHITECTURE.md §5), the model built from a [`crate::spec::ModelSpec`], and
//! [`parallel`], the one trainer (a rank's shard under a layout, `world = 1`
//! included) with its distributed optimizer.
//!
//! Convention for every layer: `forward(&self, b, x) -> (y, Saved)` and
//! `backward(&mut self, b, dy, saved) -> dx`, next to each other in the same
//! file; `backward` accumulates into the layer's parameter gradients.

pub mod activations;
pub mod attention;
pub mod block;
pub mod checkpoint;
pub mod declared;
pub mod documents;
pub mod embedding;
pub mod group;
pub mod hf;
pub(crate) mod linear;
pub mod mla;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod mtp;
pub mod norm;
pub mod optim;
pub mod parallel;
pub mod param;
pub mod schedule;
pub mod trainer;

pub use param::{init_normal, Init, Module, Param};

/// Errors of the engine: kernel failures and invalid configurations.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A kernel rejected its inputs or the device failed.
    #[error(transparent)]
    Kernel(#[from] foldmoe_kernels::KernelError),
    /// The model spec breaks a rule.
    #[error("invalid model spec: {}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Spec(Vec<crate::spec::SpecError>),
    /// A run-time argument is invalid (names the value).
    #[error("{0}")]
    Invalid(String),
}

/// Result of an engine call.
pub type Result<T> = std::result::Result<T, EngineError>;

/// A computation run in phases around the collectives it starts (the MoE
/// layer's all-to-alls): still waiting for one, with the state to resume
/// from once the caller has done other work, or finished with its result.
/// Driving it to the end without other work between phases is the
/// unoverlapped computation, bit for bit.
pub enum Step<S, T> {
    /// A collective is in flight; resume from this state.
    Pending(S),
    /// Finished.
    Done(T),
}

/// Runs a phased computation from `first` to its end, resuming each pending
/// phase at once: the unoverlapped computation.
pub fn drive<S, T>(
    first: Step<S, T>,
    mut resume: impl FnMut(S) -> Result<Step<S, T>>,
) -> Result<T> {
    let mut step = first;
    loop {
        match step {
            Step::Done(out) => return Ok(out),
            Step::Pending(state) => step = resume(state)?,
        }
    }
}

/// Helpers shared by the engine's tests: f64 tensors on the CPU, a
/// finite-difference check of every parameter of a module, and a trainer on
/// the one rank of the `world = 1` layout.
#[cfg(test)]
pub(crate) mod testutil {
    use std::time::Duration;

    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::{Backend, DType, Device, HostData, Tensor};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::model::Model;
    use super::parallel::{run_local_layout, Ctx, Trainer};
    use super::trainer::TrainConfig;
    use super::{Module, Param, Result};
    use crate::layout::LayoutSpec;
    use crate::spec::{AttentionSpec, BlockGroup, FfnSpec, ModelSpec, MoeSpec, RouterSpec};

    /// A small model spec: vocab 8, hidden 8, heads 4 / kv 2 of dim 4, one
    /// group per `ffn`, init std 0.4 (large, so attention is far from uniform
    /// and every gradient is well above rounding).
    pub fn small_spec(ffns: &[FfnSpec], tied: bool) -> ModelSpec {
        let attention = AttentionSpec::gqa(4, 2, 4);
        ModelSpec {
            name: "test".into(),
            vocab: 8,
            hidden: 8,
            seq_len: 4,
            norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            tied_embeddings: tied,
            init_std: 0.4,
            groups: ffns
                .iter()
                .map(|ffn| BlockGroup::new(1, attention.clone(), ffn.clone()))
                .collect(),
            mtp_layers: 0,
            mtp_loss_coef: 0.1,
        }
    }

    /// A small MoE feed-forward: 4 experts, top-2, a shared expert, softmax
    /// routing with load-balancing and z-losses.
    pub fn small_moe() -> FfnSpec {
        FfnSpec::Moe(MoeSpec {
            experts: 4,
            top_k: 2,
            expert_ffn: 6,
            shared_ffn: 4,
            shared_gate: false,
            router: RouterSpec {
                aux_coef: 1e-1,
                z_loss_coef: 1e-2,
                ..RouterSpec::default()
            },
            capacity: None,
        })
    }

    /// `n` values uniform in `[-scale, scale]`, fixed by `seed`.
    pub fn uniform(seed: u64, n: usize, scale: f64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    /// An f64 tensor on the CPU.
    pub fn f64_tensor(vals: Vec<f64>, shape: &[usize]) -> Tensor<Cpu> {
        Cpu.upload(HostData::F64(vals), shape).unwrap()
    }

    /// An i32 tensor on the CPU.
    pub fn i32_tensor(vals: Vec<i32>, shape: &[usize]) -> Tensor<Cpu> {
        Cpu.upload(HostData::I32(vals), shape).unwrap()
    }

    /// The values of a tensor as f64.
    pub fn values(t: &Tensor<Cpu>) -> Vec<f64> {
        Cpu.download(t).unwrap().to_f64()
    }

    /// `Σ t ⊙ r`: a scalar loss whose gradient with respect to `t` is `r`.
    pub fn dot(t: &Tensor<Cpu>, r: &[f64]) -> f64 {
        values(t).iter().zip(r).map(|(a, b)| a * b).sum()
    }

    fn with_param<M: Module<Cpu>>(m: &mut M, index: usize, f: &mut dyn FnMut(&mut Param<Cpu>)) {
        let mut i = 0;
        m.visit_params_mut(&mut |p| {
            if i == index {
                f(p);
            }
            i += 1;
        });
    }

    /// Runs `f` on the one rank of the `world = 1` layout (through
    /// [`run_local_layout`]) with a fresh [`Trainer`] of `spec`,
    /// weights from `seed`, and returns what it returns.
    pub fn one_rank<B: Backend, T: Send>(
        b: &B,
        spec: &ModelSpec,
        seed: u64,
        dtype: DType,
        cfg: TrainConfig,
        f: impl Fn(&Ctx<B>, &mut Trainer<B>) -> Result<T> + Sync,
    ) -> T {
        let layout = crate::layout::check(&LayoutSpec::default(), spec).unwrap();
        let mut results = run_local_layout(b, &layout, Duration::from_secs(60), |ctx| {
            let model = Model::new(ctx.b, spec, ctx.rank.clone(), seed, dtype)?;
            let mut trainer = Trainer::new(ctx.b, model, cfg)?;
            f(ctx, &mut trainer)
        });
        results.pop().expect("one rank").unwrap()
    }

    /// Checks the accumulated gradient of every parameter of `m` (at most
    /// `per_param` evenly spaced entries of each) against central differences
    /// of `loss`, within relative error `tol`.
    pub fn check_param_grads<M: Module<Cpu>>(
        what: &str,
        m: &mut M,
        per_param: usize,
        tol: f64,
        mut loss: impl FnMut(&M) -> f64,
    ) {
        let mut params = Vec::new();
        m.visit_params(&mut |p| params.push((p.name.clone(), values(&p.value), values(&p.grad))));
        assert!(!params.is_empty(), "{what}: no parameters to check");
        for (index, (name, value, grad)) in params.into_iter().enumerate() {
            let stride = value.len().div_ceil(per_param).max(1);
            let picks: Vec<usize> = (0..value.len()).step_by(stride).collect();
            let x: Vec<f64> = picks.iter().map(|&i| value[i]).collect();
            let analytic: Vec<f64> = picks.iter().map(|&i| grad[i]).collect();
            let m = &mut *m;
            assert_grad(&format!("{what}: {name}"), &x, &analytic, tol, |xs| {
                let mut v = value.clone();
                for (&i, &xi) in picks.iter().zip(xs) {
                    v[i] = xi;
                }
                with_param(m, index, &mut |p| {
                    let shape = p.value.shape().to_vec();
                    p.value = f64_tensor(v.clone(), &shape);
                });
                let l = loss(m);
                with_param(m, index, &mut |p| {
                    let shape = p.value.shape().to_vec();
                    p.value = f64_tensor(value.clone(), &shape);
                });
                l
            });
        }
    }

    /// Asserts that an fp8 layer tracks its exact twin: `run(fp8)` returns
    /// the layer's named outputs (its output, dx, every parameter's
    /// gradient); each fp8 one lies within what e4m3's 3 mantissa bits allow
    /// of the exact one and is not equal to it (relative Frobenius distance
    /// above 1e-4: the fp8 products ran). One product of quantised operands
    /// is off by about 3.6 % (`linear.rs`'s test); an attention output
    /// passes through up to four of them (and a softmax), so the bound is
    /// 0.15, where a wrongly wired operand (transposed, unscaled) lands near
    /// 1.
    pub fn assert_fp8_tracks(what: &str, run: impl Fn(bool) -> Vec<(String, Vec<f64>)>) {
        let (exact, fp8) = (run(false), run(true));
        assert_eq!(
            exact.len(),
            fp8.len(),
            "{what}: the runs list different outputs"
        );
        for ((name, e), (_, q)) in exact.iter().zip(&fp8) {
            let d = relative_distance(q, e);
            assert!(
                d < 0.15 && d > 1e-4,
                "{what}: {name} at relative distance {d:e} from the exact one"
            );
        }
    }

    /// Relative Frobenius distance `‖a − b‖ / ‖b‖`.
    pub fn relative_distance(a: &[f64], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    }

    /// A layer's outputs for [`assert_fp8_tracks`]: its output `y`, the
    /// input gradient `dx` and every parameter's gradient (visit order).
    pub fn layer_outputs<M: Module<Cpu>>(
        y: &Tensor<Cpu>,
        dx: &Tensor<Cpu>,
        m: &M,
    ) -> Vec<(String, Vec<f64>)> {
        let mut out = vec![("y".to_string(), values(y)), ("dx".to_string(), values(dx))];
        m.visit_params(&mut |p| out.push((p.name.clone(), values(&p.grad))));
        out
    }
}
