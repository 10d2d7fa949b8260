//! The optimizer's settings that are not plain numbers: which parameters get
//! an f32 master copy ([`MasterWeights`]) and the clipping coefficient
//! ([`clip_coefficient`]). AdamW itself (decoupled weight decay, Loshchilov &
//! Hutter 2019; no decay on 1-d parameters) runs in the distributed optimizer
//! of [`super::parallel::trainer`], bucket chunk by bucket chunk, through the
//! backend's fused `adamw_step` and `adamw_step_master` kernels.
//!
//! Mixed precision follows Megatron-Core's fp32 main params: a bf16 parameter
//! gets an f32 master copy and f32 moments; each step updates those in f32
//! and writes the parameter as the rounded master, so updates smaller than
//! bf16's resolution accumulate instead of rounding away. f32 and f64
//! parameters are their own master.

use foldmoe_kernels::DType;

/// Which parameters the optimizer keeps an f32 master copy of (with f32
/// moments), fixed when the optimizer state is created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MasterWeights {
    /// bf16 parameters (Megatron-Core's mixed precision); f32 and f64
    /// parameters are updated in their own dtype.
    #[default]
    Bf16,
    /// bf16 and f32 parameters. On f32 the master equals the parameter after
    /// every step, bit for bit, so this only changes the path the update
    /// takes: it tests that path on f32 parameters.
    Bf16AndF32,
}

impl MasterWeights {
    /// Whether a parameter of `dtype` gets a master copy.
    pub fn applies_to(self, dtype: DType) -> bool {
        match self {
            MasterWeights::Bf16 => dtype == DType::BF16,
            MasterWeights::Bf16AndF32 => matches!(dtype, DType::BF16 | DType::F32),
        }
    }
}

/// Suffix of a master copy's name beside a parameter's moments
/// (`{param}.exp_avg`, `{param}.exp_avg_sq`, `{param}.fp32_param`:
/// Megatron-Core's distributed-optimizer key for the fp32 main param).
pub const MASTER_SUFFIX: &str = "fp32_param";

/// The factor that clips gradients of global norm `norm` to `max_norm`:
/// `max_norm / (norm + 1e-6)` when `norm > max_norm` (Megatron's
/// `clip_grad_norm`), else 1; `max_norm ≤ 0` turns clipping off. The
/// optimizer applies it inside its update (the `grad_scale` of
/// [`foldmoe_kernels::AdamWConfig`]).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 || norm <= max_norm {
        1.0
    } else {
        max_norm / (norm + 1e-6)
    }
}
