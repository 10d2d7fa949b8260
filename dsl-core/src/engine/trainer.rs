//! What a training step is configured by and reports: the run's optimizer
//! and schedule settings ([`TrainConfig`]) and the step's measurements read
//! to the host ([`StepStats`]). The step itself, on every world size one rank
//! included, is [`super::parallel::Trainer::step`] (Megatron-LM's
//! `train_step`: gradient accumulation, clipping by global norm, AdamW at the
//! scheduled learning rate, the aux-loss-free expert-bias update).

use foldmoe_kernels::{Backend, Tensor};

use super::optim::{DdpConfig, MasterWeights};
use super::schedule::WarmupCosine;
use super::Result;

/// Optimizer and schedule settings of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Steps until the decay reaches `min_lr`.
    pub total_steps: u64,
    /// Decoupled weight decay of matrices.
    pub weight_decay: f64,
    /// AdamW first-moment decay.
    pub beta1: f64,
    /// AdamW second-moment decay.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Maximum global gradient norm (≤ 0: no clipping).
    pub grad_clip: f64,
    /// Which parameters AdamW updates through an f32 master copy (bf16 ones
    /// by default), chosen when the optimizer state is created.
    pub master_weights: MasterWeights,
    /// Gradient buckets and their overlap with compute.
    pub ddp: DdpConfig,
    /// Run each steady-state forward together with the backward after it,
    /// interleaved at the MoE layers' expert all-to-alls, so that one
    /// micro-batch's exchange travels while the other computes
    /// (Megatron-Core's `--overlap-moe-expert-parallel-comm`). The results
    /// are bit-identical; a pair's forward saves its tensors beside its
    /// paused backward's, so the activation peak rises by up to one model
    /// chunk (the memory planner's bound).
    pub overlap_moe_comm: bool,
}

impl TrainConfig {
    /// Why this configuration cannot train under a layout of expert
    /// parallelism `ep`, if it cannot: overlapping the expert all-to-all
    /// needs one (Megatron-Core asserts ep > 1 too). The trainer checks it;
    /// `train` asks before it makes the run directory.
    pub fn layout_error(&self, ep: usize) -> Option<String> {
        (self.overlap_moe_comm && ep == 1).then(|| {
            format!(
                "--overlap-moe-expert-parallel-comm overlaps the expert all-to-all, which this \
                 layout does not have (ep = {ep}); it needs ep > 1"
            )
        })
    }
}

impl Default for TrainConfig {
    /// Megatron-style pre-training defaults for a small model.
    fn default() -> Self {
        TrainConfig {
            lr: 3e-4,
            min_lr: 3e-5,
            warmup_steps: 100,
            total_steps: 2000,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            master_weights: MasterWeights::Bf16,
            ddp: DdpConfig::default(),
            overlap_moe_comm: false,
        }
    }
}

impl TrainConfig {
    /// The learning-rate schedule these settings describe.
    pub fn schedule(&self) -> WarmupCosine {
        WarmupCosine {
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            total_steps: self.total_steps,
        }
    }
}

/// What one step measured, read to the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean cross-entropy over the micro-batches.
    pub loss: f64,
    /// Mean of the MoE layers' summed aux and z-losses over the micro-batches.
    pub aux_loss: f64,
    /// Mean over the micro-batches of the MTP modules' mean cross-entropy
    /// (unweighted; 0 without MTP).
    pub mtp_loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the update.
    pub lr: f64,
    /// max/mean expert load of the worst MoE layer (1: perfectly balanced;
    /// 1 for a model without MoE layers).
    pub load_imbalance: f64,
}

/// Tokens routed to each expert of one MoE layer in one step
/// ([`super::parallel::Trainer::expert_loads`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerLoad {
    /// The layer's index among the full model's blocks (0: the first).
    pub layer: usize,
    /// Token copies the router sent to each expert (its top-k choices,
    /// before any capacity drop), summed over the step's micro-batches and
    /// over every rank that routes other tokens of the layer (dp, cp and
    /// tp's sequence shards): what one rank routing the whole global batch
    /// counts. Exact while a layer's count per step stays below 2^24 in f32
    /// models; bf16 models count in bf16 (exact to 256 per micro-batch).
    pub tokens: Vec<u64>,
}

/// Each MoE layer's loads `[E]`, read to the host (once per step: the
/// imbalance and [`LayerLoad`]s are computed from the same copy).
pub(crate) fn download_loads<B: Backend>(b: &B, loads: &[Tensor<B>]) -> Result<Vec<Vec<f64>>> {
    loads.iter().map(|l| Ok(b.download(l)?.to_f64())).collect()
}

/// max/mean expert load of the worst MoE layer (1 when balanced or without
/// MoE layers), for logging.
pub(crate) fn load_imbalance(loads: &[Vec<f64>]) -> f64 {
    let mut worst: f64 = 1.0;
    for l in loads {
        let mean = l.iter().sum::<f64>() / l.len().max(1) as f64;
        let max = l.iter().cloned().fold(0.0, f64::max);
        if mean > 0.0 {
            worst = worst.max(max / mean);
        }
    }
    worst
}
