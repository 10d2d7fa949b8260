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
//!
//! How the distributed optimizer's gradient buckets are cut and reduced
//! ([`DdpConfig`]) follows Megatron-Core's `DistributedDataParallelConfig`.

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

/// Megatron-Core's default bucket size, in parameter elements: 40M, or 1M
/// per data-parallel rank where that is more (`max(40M, 1M·dp)`).
pub fn default_bucket_size(dp: usize) -> usize {
    40_000_000usize.max(1_000_000 * dp)
}

/// How the distributed optimizer cuts its gradient buckets and overlaps
/// their collectives with compute (Megatron-Core's
/// `DistributedDataParallelConfig`). None of it changes a result: losses,
/// gradients and parameters are bit-identical with the overlaps on or off
/// for the same buckets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DdpConfig {
    /// Start a bucket's reduce-scatter in the backward of the step's last
    /// micro-batch as soon as its parameters' gradients are final, and wait
    /// for it before the optimizer step (`--overlap-grad-reduce`).
    pub overlap_grad_reduce: bool,
    /// Start each bucket's parameter all-gather as soon as its chunk is
    /// updated, while the next buckets' updates run, and wait for them at
    /// the end of the step (`--overlap-param-gather`; Megatron-Core waits
    /// later, before each layer's first use in the next forward).
    pub overlap_param_gather: bool,
    /// Parameter elements per bucket (`--ddp-bucket-size`): a bucket is
    /// closed once it holds at least this many (parameters are not split),
    /// walking the parameters in backward order. `None`: one bucket per
    /// kind of parameter without `overlap_grad_reduce` (a single bucket, as
    /// Megatron-Core), [`default_bucket_size`] with it.
    pub bucket_size: Option<usize>,
}

impl DdpConfig {
    /// The bucket size in elements for `dp` data-parallel ranks
    /// (`usize::MAX`: one bucket per kind); an error for a size of 0.
    pub fn resolved_bucket_size(&self, dp: usize) -> Result<usize, String> {
        match self.bucket_size {
            Some(0) => Err(
                "ddp bucket size 0: a bucket needs at least 1 parameter element; give a \
                 positive size (Megatron-Core's default is 40000000)"
                    .into(),
            ),
            Some(n) => Ok(n),
            None if self.overlap_grad_reduce => Ok(default_bucket_size(dp)),
            None => Ok(usize::MAX),
        }
    }
}
