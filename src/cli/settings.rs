//! Training settings: defaults, a TOML config file, and command-line flags
//! (a flag overrides the file, the file overrides the default).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use foldmoe::core::engine::optim::DdpConfig;
use foldmoe::core::spec::PolicyOverride;
use foldmoe::kernels::DType;

use crate::cli::error::CliError;

/// The options of `foldmoe train`, as flags or as keys of a `--config` file
/// (same names, with `-` written `_` in TOML). Unset means "use the default".
#[derive(clap::Args, Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct TrainOptions {
    /// Model to train, by name (`tiny`, `qwen3-30b-a3b-small`, …; an unknown
    /// name lists them all).
    #[arg(long)]
    pub model: Option<String>,
    /// Model config file (TOML, the macro's keys) to train instead of a
    /// named model; the model's name is the file's `name`.
    #[arg(long, conflicts_with = "model")]
    pub model_config: Option<PathBuf>,
    /// Keep only the model's first N blocks (in declaration order, without
    /// MTP modules), e.g. to fit a large model on one device.
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Optimizer steps to run in total.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seed of initialisation and data sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Tokens per optimizer step (a multiple of the model's sequence length).
    #[arg(long)]
    pub batch_tokens: Option<usize>,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Linear warmup steps.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Evaluate the validation loss every N steps.
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Write a checkpoint every N steps (and always at the end).
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Run directory (default `runs/<timestamp>`; with --resume, the resumed run's).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Device: `cpu` (default) or `cuda`.
    #[arg(long)]
    pub device: Option<String>,
    /// Bytes of text generated at the end of training.
    #[arg(long)]
    pub sample_tokens: Option<usize>,
    /// Ranks (threads on the CPU) to train with, under `--layout`.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Parallel layout over the ranks, e.g. `tp=2,ep=4` (absent sizes 1; dp
    /// and edp derived from --ranks). Default: data parallel over all ranks.
    #[arg(long)]
    pub layout: Option<String>,
    /// Start each gradient bucket's reduce-scatter in the backward as soon
    /// as its gradients are final (Megatron-Core's `--overlap-grad-reduce`);
    /// results are bit-identical to not overlapping.
    #[arg(long)]
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    /// Start each bucket's parameter all-gather once its shard is updated,
    /// while the next buckets update (`--overlap-param-gather`).
    #[arg(long)]
    #[serde(default)]
    pub overlap_param_gather: bool,
    /// Run each steady 1F1B forward together with the next backward, so
    /// one micro-batch's expert all-to-all travels while the other
    /// computes (Megatron-Core's flag of this name; needs ep > 1 and two or
    /// more micro-batches per dp rank; up to one
    /// more micro-batch of activations at the peak); results are
    /// bit-identical.
    #[arg(long)]
    #[serde(default)]
    pub overlap_moe_expert_parallel_comm: bool,
    /// Parameter elements per gradient bucket (Megatron-Core's
    /// `--ddp-bucket-size`; default: one bucket per kind of parameter, or
    /// max(40M, 1M·dp) with --overlap-grad-reduce).
    #[arg(long, value_name = "ELEMENTS")]
    pub ddp_bucket_size: Option<usize>,
    /// Switch every MoE layer to capacity mode with this capacity factor
    /// (tokens over capacity dropped by lowest probability).
    #[arg(long)]
    pub capacity_factor: Option<f64>,
    /// Recompute these parts in backward in every block group, replacing
    /// the model's policy: `norm,core_attn,mlp_act,moe_act,router,shared_experts,mla_up_proj`
    /// or `block`; `none` keeps everything.
    #[arg(long, value_name = "LIST")]
    pub recompute: Option<String>,
    /// Offload these saved tensors to host memory between forward and
    /// backward in every group: `attn_norm,qkv,core_attn,attn_proj,mlp_norm,expert_fc1,moe_act`; `none`.
    #[arg(long, value_name = "LIST")]
    pub offload: Option<String>,
    /// Store these saved tensors in fp8 (e4m3, one scale per 1×128 block) in
    /// every group; the same parts as --offload.
    #[arg(long, value_name = "LIST")]
    pub store_fp8: Option<String>,
    /// Run the routed experts' GEMMs in blockwise fp8 (DeepSeek-V3's
    /// recipe: e4m3, 1×128 activation and 128×128 weight scales, f32
    /// accumulation) in every MoE group whose dims allow it; the router,
    /// norms, embeddings and head stay in the model's dtype, and attention
    /// too unless the model declares `attention(precision = fp8_blockwise)`.
    /// Emulated on the CPU; needs fp8 tensor cores (sm_89+) on CUDA.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub fp8: Option<bool>,
    /// Parameter and activation dtype: `f32`, or `bf16` (Megatron's
    /// `--bf16`: bf16 weights and compute, f32 master weights and AdamW
    /// moments; emulated on the CPU).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Checkpoints kept in the run directory (the newest; older ones are
    /// removed once a new one is complete).
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Megatron indexed datasets to train on instead of the bundled text: a
    /// prefix (`PATH` of `PATH.bin`/`PATH.idx`), several, or weight prefix
    /// pairs (`0.3 A 0.7 B`), as Megatron's `--data-path`.
    #[arg(long, num_args = 1.., value_name = "PATH")]
    pub data_path: Option<Vec<String>>,
    /// Train/validation/test shares of each dataset's documents (with
    /// --data-path; default 969,30,1).
    #[arg(long, value_name = "T,V,T")]
    pub split: Option<String>,
    /// Tokenizer: a Hugging Face `tokenizer.json` (made by `foldmoe
    /// train-tokenizer`, or published), or `byte` (the default). Without
    /// --data-path the bundled text is tokenized with it.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Restart RoPE positions at 0 after every end-of-document token of a
    /// packed sample (Megatron's `--reset-position-ids`; needs a tokenizer
    /// with one).
    #[arg(long)]
    #[serde(default)]
    pub reset_position_ids: bool,
    /// Let no token attend across an end-of-document token of a packed
    /// sample (Megatron's `--reset-attention-mask`).
    #[arg(long)]
    #[serde(default)]
    pub reset_attention_mask: bool,
    /// Do not train on predicting the token after an end-of-document token
    /// (Megatron's `--eod-mask-loss`).
    #[arg(long)]
    #[serde(default)]
    pub eod_mask_loss: bool,
    /// Start even when the memory planner's estimate for a rank exceeds the
    /// memory the device or host has available.
    #[arg(long)]
    #[serde(default)]
    pub force: bool,
    /// Continue the run whose directory (or checkpoint directory) is given.
    #[arg(long)]
    #[serde(skip)]
    pub resume: Option<PathBuf>,
    /// TOML file with any of the keys above.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Stop after this many steps of this invocation, writing a checkpoint
    /// (Megatron's exit interval; the schedule still spans --steps).
    #[arg(long)]
    #[serde(skip)]
    pub exit_after: Option<u64>,
}

/// Fully resolved settings of a run (stored in its checkpoint).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TrainSettings {
    /// Model name.
    pub model: String,
    /// Blocks kept of the model (`None`: all of them).
    #[serde(default)]
    pub layers: Option<usize>,
    /// Total optimizer steps.
    pub steps: u64,
    /// Seed.
    pub seed: u64,
    /// Tokens per step.
    pub batch_tokens: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Warmup steps.
    pub warmup_steps: u64,
    /// Evaluation interval.
    pub eval_every: u64,
    /// Checkpoint interval.
    pub checkpoint_every: u64,
    /// Device name.
    pub device: String,
    /// Generated sample length.
    pub sample_tokens: usize,
    /// Ranks the run trains with.
    #[serde(default = "one")]
    pub ranks: usize,
    /// Layout text over the ranks (`None`: data parallel).
    #[serde(default)]
    pub layout: Option<String>,
    /// `--overlap-grad-reduce`.
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    /// `--overlap-param-gather`.
    #[serde(default)]
    pub overlap_param_gather: bool,
    /// `--overlap-moe-expert-parallel-comm`.
    #[serde(default)]
    pub overlap_moe_expert_parallel_comm: bool,
    /// `--ddp-bucket-size` (`None`: the default buckets).
    #[serde(default)]
    pub ddp_bucket_size: Option<usize>,
    /// Capacity factor of every MoE layer (`None`: the model's own setting).
    #[serde(default)]
    pub capacity_factor: Option<f64>,
    /// Recompute list of every group (`None`: the model's own policy).
    #[serde(default)]
    pub recompute: Option<String>,
    /// Offload list of every group (`None`: the model's own policy).
    #[serde(default)]
    pub offload: Option<String>,
    /// fp8-storage list of every group (`None`: the model's own policy).
    #[serde(default)]
    pub store_fp8: Option<String>,
    /// Blockwise fp8 expert GEMMs in every MoE group that allows them
    /// (`--fp8`), on top of the groups that declare them.
    #[serde(default)]
    pub fp8: bool,
    /// Model dtype, `f32` or `bf16`.
    #[serde(default = "f32_name")]
    pub dtype: String,
    /// Checkpoints kept.
    #[serde(default = "two")]
    pub keep_checkpoints: usize,
    /// Megatron `--data-path` list (`None`: the bundled text).
    #[serde(default)]
    pub data_path: Option<Vec<String>>,
    /// `--split` of the datasets (`None`: 969,30,1).
    #[serde(default)]
    pub split: Option<String>,
    /// Tokenizer file (`None`: bytes).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// `--reset-position-ids`.
    #[serde(default)]
    pub reset_position_ids: bool,
    /// `--reset-attention-mask`.
    #[serde(default)]
    pub reset_attention_mask: bool,
    /// `--eod-mask-loss`.
    #[serde(default)]
    pub eod_mask_loss: bool,
}

/// Serde default of [`TrainSettings::keep_checkpoints`].
fn two() -> usize {
    2
}

/// Serde default of [`TrainSettings::dtype`] (checkpoints written before it existed).
fn f32_name() -> String {
    "f32".into()
}

/// Serde default of [`TrainSettings::ranks`] (checkpoints written before it existed).
fn one() -> usize {
    1
}

impl Default for TrainSettings {
    fn default() -> Self {
        TrainSettings {
            model: super::registry().default_name().unwrap_or("tiny").into(),
            layers: None,
            steps: 500,
            seed: 1234,
            batch_tokens: 4096,
            micro_batches: 1,
            lr: 3e-3,
            warmup_steps: 30,
            eval_every: 25,
            checkpoint_every: 100,
            device: "cpu".into(),
            sample_tokens: 240,
            ranks: 1,
            layout: None,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            overlap_moe_expert_parallel_comm: false,
            ddp_bucket_size: None,
            capacity_factor: None,
            recompute: None,
            offload: None,
            store_fp8: None,
            fp8: false,
            dtype: f32_name(),
            keep_checkpoints: two(),
            data_path: None,
            split: None,
            tokenizer: None,
            reset_position_ids: false,
            reset_attention_mask: false,
            eod_mask_loss: false,
        }
    }
}

impl TrainOptions {
    /// Reads a TOML config file; unknown keys and wrong types are errors
    /// naming the file and the key.
    pub fn from_file(path: &Path) -> Result<Self, CliError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CliError::usage(format!("cannot read config file {}: {e}", path.display()))
        })?;
        toml::from_str(&text).map_err(|e| {
            let msg = e.message().replace('\n', " ");
            CliError::usage(format!("config file {}: {msg}", path.display()))
        })
    }

    /// `self` where set, else `file`.
    fn or(self, file: TrainOptions) -> TrainOptions {
        TrainOptions {
            model: self.model.or(file.model),
            model_config: self.model_config.or(file.model_config),
            layers: self.layers.or(file.layers),
            steps: self.steps.or(file.steps),
            seed: self.seed.or(file.seed),
            batch_tokens: self.batch_tokens.or(file.batch_tokens),
            micro_batches: self.micro_batches.or(file.micro_batches),
            lr: self.lr.or(file.lr),
            warmup_steps: self.warmup_steps.or(file.warmup_steps),
            eval_every: self.eval_every.or(file.eval_every),
            checkpoint_every: self.checkpoint_every.or(file.checkpoint_every),
            out: self.out.or(file.out),
            device: self.device.or(file.device),
            sample_tokens: self.sample_tokens.or(file.sample_tokens),
            ranks: self.ranks.or(file.ranks),
            layout: self.layout.or(file.layout),
            overlap_grad_reduce: self.overlap_grad_reduce || file.overlap_grad_reduce,
            overlap_param_gather: self.overlap_param_gather || file.overlap_param_gather,
            overlap_moe_expert_parallel_comm: self.overlap_moe_expert_parallel_comm
                || file.overlap_moe_expert_parallel_comm,
            ddp_bucket_size: self.ddp_bucket_size.or(file.ddp_bucket_size),
            capacity_factor: self.capacity_factor.or(file.capacity_factor),
            recompute: self.recompute.or(file.recompute),
            offload: self.offload.or(file.offload),
            store_fp8: self.store_fp8.or(file.store_fp8),
            fp8: self.fp8.or(file.fp8),
            dtype: self.dtype.or(file.dtype),
            keep_checkpoints: self.keep_checkpoints.or(file.keep_checkpoints),
            data_path: self.data_path.or(file.data_path),
            split: self.split.or(file.split),
            tokenizer: self.tokenizer.or(file.tokenizer),
            reset_position_ids: self.reset_position_ids || file.reset_position_ids,
            reset_attention_mask: self.reset_attention_mask || file.reset_attention_mask,
            eod_mask_loss: self.eod_mask_loss || file.eod_mask_loss,
            force: self.force || file.force,
            resume: self.resume,
            config: self.config,
            exit_after: self.exit_after,
        }
    }

    /// Merges flags over the config file over `base` (the defaults, or a
    /// resumed run's settings) and validates the result.
    pub fn resolve(self, base: TrainSettings) -> Result<(TrainSettings, TrainOptions), CliError> {
        let opts = match &self.config {
            Some(path) => {
                let file = TrainOptions::from_file(path)?;
                self.or(file)
            }
            None => self,
        };
        let s = TrainSettings {
            model: opts.model.clone().unwrap_or(base.model),
            layers: opts.layers.or(base.layers),
            steps: opts.steps.unwrap_or(base.steps),
            seed: opts.seed.unwrap_or(base.seed),
            batch_tokens: opts.batch_tokens.unwrap_or(base.batch_tokens),
            micro_batches: opts.micro_batches.unwrap_or(base.micro_batches),
            lr: opts.lr.unwrap_or(base.lr),
            warmup_steps: opts.warmup_steps.unwrap_or(base.warmup_steps),
            eval_every: opts.eval_every.unwrap_or(base.eval_every),
            checkpoint_every: opts.checkpoint_every.unwrap_or(base.checkpoint_every),
            device: opts.device.clone().unwrap_or(base.device),
            sample_tokens: opts.sample_tokens.unwrap_or(base.sample_tokens),
            ranks: opts.ranks.unwrap_or(base.ranks),
            layout: opts.layout.clone().or(base.layout),
            overlap_grad_reduce: opts.overlap_grad_reduce || base.overlap_grad_reduce,
            overlap_param_gather: opts.overlap_param_gather || base.overlap_param_gather,
            overlap_moe_expert_parallel_comm: opts.overlap_moe_expert_parallel_comm
                || base.overlap_moe_expert_parallel_comm,
            ddp_bucket_size: opts.ddp_bucket_size.or(base.ddp_bucket_size),
            capacity_factor: opts.capacity_factor.or(base.capacity_factor),
            recompute: opts.recompute.clone().or(base.recompute),
            offload: opts.offload.clone().or(base.offload),
            store_fp8: opts.store_fp8.clone().or(base.store_fp8),
            fp8: opts.fp8.unwrap_or(base.fp8),
            dtype: opts.dtype.clone().unwrap_or(base.dtype),
            keep_checkpoints: opts.keep_checkpoints.unwrap_or(base.keep_checkpoints),
            data_path: opts.data_path.clone().or(base.data_path),
            split: opts.split.clone().or(base.split),
            tokenizer: opts.tokenizer.clone().or(base.tokenizer),
            reset_position_ids: opts.reset_position_ids || base.reset_position_ids,
            reset_attention_mask: opts.reset_attention_mask || base.reset_attention_mask,
            eod_mask_loss: opts.eod_mask_loss || base.eod_mask_loss,
        };
        s.validate()?;
        Ok((s, opts))
    }
}

impl TrainSettings {
    /// Checks values that no type can: each error names the flag and value.
    pub fn validate(&self) -> Result<(), CliError> {
        let bad = |flag: &str, v: &dyn std::fmt::Display, need: &str| {
            Err(CliError::usage(format!("--{flag} {v}: {need}")))
        };
        if self.steps == 0 {
            return bad("steps", &self.steps, "must be at least 1");
        }
        if self.batch_tokens == 0 {
            return bad("batch-tokens", &self.batch_tokens, "must be at least 1");
        }
        if self.micro_batches == 0 {
            return bad("micro-batches", &self.micro_batches, "must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", &self.lr, "must be a positive finite number");
        }
        if self.eval_every == 0 {
            return bad("eval-every", &self.eval_every, "must be at least 1");
        }
        if self.checkpoint_every == 0 {
            return bad(
                "checkpoint-every",
                &self.checkpoint_every,
                "must be at least 1",
            );
        }
        if self.device != "cpu" && self.device != "cuda" {
            return bad("device", &self.device, "must be `cpu` or `cuda`");
        }
        if self.ranks == 0 {
            return bad("ranks", &self.ranks, "must be at least 1");
        }
        if let Err(why) = self.ddp().resolved_bucket_size(self.ranks) {
            return bad("ddp-bucket-size", &0, &why);
        }
        if self.keep_checkpoints == 0 {
            return bad(
                "keep-checkpoints",
                &self.keep_checkpoints,
                "must be at least 1",
            );
        }
        if let Some(f) = self.capacity_factor {
            if !(f.is_finite() && f > 0.0) {
                return bad("capacity-factor", &f, "must be a positive finite number");
            }
        }
        if let Some(split) = &self.split {
            if self.data_path.is_none() {
                return bad(
                    "split",
                    split,
                    "divides the documents of --data-path; give --data-path too",
                );
            }
            foldmoe::data::gpt::Split::parse(split)?;
        }
        if let Some(paths) = &self.data_path {
            foldmoe::data::blend::BlendSpec::parse(paths)?;
        }
        self.policy_override()?;
        self.model_dtype()?;
        Ok(())
    }

    /// Whether samples need the end-of-document token (any of
    /// `--reset-position-ids`, `--reset-attention-mask`, `--eod-mask-loss`):
    /// the flag named first, if so.
    pub fn eod_flag(&self) -> Option<&'static str> {
        [
            (self.reset_position_ids, "--reset-position-ids"),
            (self.reset_attention_mask, "--reset-attention-mask"),
            (self.eod_mask_loss, "--eod-mask-loss"),
        ]
        .into_iter()
        .find_map(|(on, flag)| on.then_some(flag))
    }

    /// The distributed optimizer's buckets and overlaps
    /// (`--overlap-grad-reduce`, `--overlap-param-gather`, `--ddp-bucket-size`).
    pub fn ddp(&self) -> DdpConfig {
        DdpConfig {
            overlap_grad_reduce: self.overlap_grad_reduce,
            overlap_param_gather: self.overlap_param_gather,
            bucket_size: self.ddp_bucket_size,
        }
    }

    /// The model's dtype from `--dtype`.
    pub fn model_dtype(&self) -> Result<DType, CliError> {
        match self.dtype.as_str() {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            other => Err(CliError::usage(format!(
                "--dtype {other}: must be `f32` or `bf16`"
            ))),
        }
    }

    /// The `--recompute`, `--offload` and `--store-fp8` lists, parsed by the
    /// policy keywords the macro, config files and `foldmoe plan` use.
    pub fn policy_override(&self) -> Result<PolicyOverride, CliError> {
        PolicyOverride::parse(
            self.recompute.as_deref(),
            self.offload.as_deref(),
            self.store_fp8.as_deref(),
        )
        .map_err(CliError::usage)
    }

    /// Sequences per micro-batch for a model of sequence length `seq_len`.
    pub fn sequences_per_micro_batch(&self, seq_len: usize) -> Result<usize, CliError> {
        let per_step = self.batch_tokens / seq_len;
        if !self.batch_tokens.is_multiple_of(seq_len)
            || !per_step.is_multiple_of(self.micro_batches)
            || per_step == 0
        {
            return Err(CliError::usage(format!(
                "--batch-tokens {}: must be a positive multiple of seq_len ({seq_len}) × micro-batches ({})",
                self.batch_tokens, self.micro_batches
            )));
        }
        Ok(per_step / self.micro_batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let p =
            std::env::temp_dir().join(format!("foldmoe-settings-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn flag_overrides_file_overrides_default() {
        let cfg = write("ok.toml", "steps = 7\nlr = 0.01\n");
        let opts = TrainOptions {
            lr: Some(0.5),
            config: Some(cfg),
            ..Default::default()
        };
        let (s, _) = opts.resolve(TrainSettings::default()).unwrap();
        assert_eq!(
            (s.steps, s.lr, s.seed),
            (7, 0.5, TrainSettings::default().seed)
        );
    }

    #[test]
    fn unknown_key_and_wrong_type_name_the_key() {
        let cfg = write("unknown.toml", "stepz = 7\n");
        let err = TrainOptions {
            config: Some(cfg),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("stepz") && err.contains("unknown.toml"),
            "{err}"
        );
        let cfg = write("type.toml", "steps = \"many\"\n");
        let err = TrainOptions {
            config: Some(cfg),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("type.toml") && err.contains("invalid type"),
            "{err}"
        );
        assert!(!err.contains('\n'));
    }

    #[test]
    fn data_keys_come_from_the_file_and_are_checked() {
        let cfg = write(
            "data.toml",
            "data_path = [\"0.3\", \"a/x\", \"0.7\", \"b/y\"]\nsplit = \"98,2,0\"\ntokenizer = \"t.json\"\n",
        );
        let (s, _) = TrainOptions {
            config: Some(cfg),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap();
        assert_eq!(s.data_path.as_ref().map(Vec::len), Some(4));
        assert_eq!(s.split.as_deref(), Some("98,2,0"));
        assert_eq!(s.tokenizer, Some(PathBuf::from("t.json")));
        let bad = |o: TrainOptions| o.resolve(TrainSettings::default()).unwrap_err().to_string();
        let err = bad(TrainOptions {
            split: Some("1,1".into()),
            ..Default::default()
        });
        assert!(
            err.starts_with("--split 1,1: divides the documents of --data-path"),
            "{err}"
        );
        let err = bad(TrainOptions {
            data_path: Some(vec!["0.5".into(), "a".into(), "x".into(), "b".into()]),
            ..Default::default()
        });
        assert!(err.contains("`x` is not a weight"), "{err}");
    }

    #[test]
    fn zero_steps_is_rejected() {
        let err = TrainOptions {
            steps: Some(0),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap_err()
        .to_string();
        assert_eq!(err, "--steps 0: must be at least 1");
    }

    #[test]
    fn batch_tokens_must_fit_sequences() {
        let s = TrainSettings {
            batch_tokens: 100,
            ..Default::default()
        };
        assert!(s
            .sequences_per_micro_batch(64)
            .unwrap_err()
            .to_string()
            .contains("--batch-tokens 100"));
        let s = TrainSettings {
            batch_tokens: 512,
            micro_batches: 2,
            ..Default::default()
        };
        assert_eq!(s.sequences_per_micro_batch(128).unwrap(), 2);
    }

    #[test]
    fn policy_lists_come_from_flags_or_the_file_and_bad_parts_are_named() {
        let cfg = write("policy.toml", "recompute = \"block\"\noffload = \"qkv\"\n");
        let opts = TrainOptions {
            offload: Some("expert_fc1".into()),
            store_fp8: Some("moe_act".into()),
            config: Some(cfg),
            ..Default::default()
        };
        let (s, _) = opts.resolve(TrainSettings::default()).unwrap();
        assert_eq!(
            (
                s.recompute.as_deref(),
                s.offload.as_deref(),
                s.store_fp8.as_deref()
            ),
            (Some("block"), Some("expert_fc1"), Some("moe_act"))
        );
        let err = TrainOptions {
            recompute: Some("moe_actt".into()),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("--recompute: unknown recompute part `moe_actt`; choose one of norm"),
            "{err}"
        );
    }

    #[test]
    fn overlap_keys_come_from_flags_or_the_file_and_a_zero_bucket_is_refused() {
        let cfg = write(
            "ddp.toml",
            "overlap_grad_reduce = true\nddp_bucket_size = 1000\n",
        );
        let (s, _) = TrainOptions {
            overlap_param_gather: true,
            config: Some(cfg),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap();
        assert_eq!(
            s.ddp(),
            DdpConfig {
                overlap_grad_reduce: true,
                overlap_param_gather: true,
                bucket_size: Some(1000),
            }
        );
        assert!(!s.overlap_moe_expert_parallel_comm);
        let cfg = write("moe.toml", "overlap_moe_expert_parallel_comm = true\n");
        let (s, _) = TrainOptions {
            config: Some(cfg),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap();
        assert!(s.overlap_moe_expert_parallel_comm);
        let err = TrainOptions {
            ddp_bucket_size: Some(0),
            ..Default::default()
        }
        .resolve(TrainSettings::default())
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("--ddp-bucket-size 0: ddp bucket size 0"),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }
}
