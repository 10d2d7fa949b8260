//! `foldmoe train`: trains a model on the bundled text (or resumes a run),
//! showing progress and writing metrics, a checkpoint, a loss plot and a
//! generated sample under the run directory.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use foldmoe::core::config::ModelConfig;
use foldmoe::core::engine::activations::Counts;
use foldmoe::core::engine::checkpoint::{self, Source};
use foldmoe::core::engine::documents::Documents;
use foldmoe::core::engine::model::{HostBatch, Model};
use foldmoe::core::engine::parallel::{Ctx, RankLayout, Trainer};
use foldmoe::core::engine::trainer::{LayerLoad, StepStats, TrainConfig};
use foldmoe::core::engine::EngineError;
use foldmoe::core::layout::{Layout, LayoutSpec};
use foldmoe::core::memory::{self, MemoryOptions};
use foldmoe::core::spec::{
    CapacitySpec, DropPolicySpec, FfnSpec, GemmPrecision, ModelSpec, PolicyOverride,
};
use foldmoe::data::blend::BlendSpec;
use foldmoe::data::gpt::Split;
use foldmoe::data::{BatchSampler, IndexedConfig, Loader, TextDataset, Tokenizer};
use foldmoe::kernels::comm::local::run_local;
use foldmoe::kernels::comm::rendezvous::DistEnv;
use foldmoe::kernels::comm::timed::TimedComm;
use foldmoe::kernels::{Backend, Communicator, Group, HostData, KernelError, ReduceOp};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::cli::dist::ProcessComm;
use crate::cli::error::CliError;
use crate::cli::settings::{TrainOptions, TrainSettings};
use crate::cli::tensorboard::EventWriter;

/// The bundled corpus (public domain; see data/NOTICE).
const TRAIN_TEXT: &str = include_str!("../../data/train.txt");
const VAL_TEXT: &str = include_str!("../../data/val.txt");
/// Windows in the fixed validation batch.
const VAL_WINDOWS: usize = 16;
/// How long a rank of a threads run waits for a silent peer before failing.
const RANK_TIMEOUT: std::time::Duration = crate::cli::launch::DEFAULT_TIMEOUT;
/// Test hook (hidden): `<rank>:<step>` makes that rank call
/// `std::process::abort` as it starts that step (1-based), as a crashed
/// process would; the launch tests use it to check that the other ranks and
/// `foldmoe launch` stop with an error instead of hanging. Under `--ranks`
/// the ranks are threads, so the whole process aborts.
const TEST_EXIT_VAR: &str = "FOLDMOE_TEST_EXIT_AT_STEP";

/// What a checkpoint stores besides tensors: enough to continue exactly.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct RunMeta {
    /// Resolved settings of the run.
    pub settings: TrainSettings,
    /// The model trained.
    pub spec: ModelSpec,
    /// Completed optimizer steps.
    pub step: u64,
    /// Data position.
    pub sampler: BatchSampler,
    /// Training loss of every completed step.
    pub losses: Vec<f64>,
    /// `(step, validation loss)` pairs so far.
    pub val_losses: Vec<(u64, f64)>,
    /// Seconds spent training before this checkpoint.
    pub train_seconds: f64,
    /// What the run's data was when it started ([`Loader::fingerprint`]): a
    /// resume refuses data that changed since.
    #[serde(default)]
    pub data_fingerprint: Option<String>,
    /// The Hugging Face model it was imported from (`foldmoe convert`).
    #[serde(default)]
    pub hf: Option<crate::cli::convert::HfOrigin>,
}

/// The run summary written at the end (`summary.json`).
#[derive(Serialize)]
struct Summary<'a> {
    model: &'a str,
    steps: u64,
    losses: &'a [f64],
    final_loss: f64,
    val_loss: f64,
    val_losses: &'a [(u64, f64)],
    tokens_per_s: f64,
    params_total: u64,
    params_active: u64,
    wall_s: f64,
    seed: u64,
    /// The most bytes of saved activations on the device at once (the
    /// engine's ledger; of rank 0 in a parallel run).
    peak_activation_bytes: Option<u64>,
    /// Those bytes by part, at that moment.
    peak_activation_bytes_by_part: Option<BTreeMap<&'static str, u64>>,
    /// The most bytes of saved activations offloaded to the host at once.
    peak_offloaded_bytes: Option<u64>,
    /// Bytes the backend allocated, at most, while rank 0 built its model
    /// shard and optimizer state.
    startup_peak_bytes: u64,
    /// Bytes rank 0 keeps of parameters, gradients and optimizer state.
    shard_bytes: u64,
    /// Seconds from the start of the run to the end of the first step.
    first_step_s: f64,
}

/// The checkpoint root of a run directory (`checkpoints/`, with `latest`).
pub fn checkpoint_root(out: &Path) -> PathBuf {
    out.join("checkpoints")
}

fn trainer_config(s: &TrainSettings) -> TrainConfig {
    TrainConfig {
        lr: s.lr,
        min_lr: s.lr / 10.0,
        warmup_steps: s.warmup_steps,
        total_steps: s.steps,
        ddp: s.ddp(),
        overlap_moe_comm: s.overlap_moe_expert_parallel_comm,
        ..TrainConfig::default()
    }
}

/// The whole model of a checkpoint on one rank (generation, the sample at
/// the end of training), read slice by slice from whatever layout wrote it:
/// the one engine at world = 1.
pub fn load_model<B: Backend>(b: &B, path: &Path) -> Result<(Model<B>, RunMeta), CliError> {
    let (source, meta): (Source, RunMeta) = Source::open(path)?;
    let one =
        foldmoe::core::layout::check(&LayoutSpec::default(), &meta.spec).map_err(|errors| {
            let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            CliError::usage(format!("model {}: {}", meta.spec.name, msgs.join("; ")))
        })?;
    let mut model = Model::new(
        b,
        &meta.spec,
        RankLayout::new(&one, 0)?,
        meta.settings.seed,
        meta.settings.model_dtype()?,
    )?;
    checkpoint::load_params(b, &source, &mut model, true)?;
    Ok((model, meta))
}

/// `runs/<UTC timestamp>`.
fn default_out_dir() -> PathBuf {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    PathBuf::from("runs").join(format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    ))
}

/// Files that make a directory a run's: a new run never writes over them.
const RUN_FILES: &[&str] = &[
    "summary.json",
    "metrics.jsonl",
    "checkpoints",
    "checkpoint",
    "checkpoint.old",
    "checkpoint.tmp",
    "tb",
];

/// Whether `a` and `b` name the same existing directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// Creates the run directory and proves it writable. A directory holding
/// another run's files is refused, unless the run resumes in place; a run
/// resumed into another directory (`--resume A --out B`) needs B empty or
/// absent and leaves A untouched. On resume, `metrics.jsonl` gets the
/// resumed run's lines up to the checkpoint's step only.
fn prepare_out(out: &Path, resume: Option<(&Path, u64)>) -> Result<(), CliError> {
    let in_place = resume.is_some_and(|(from, _)| same_dir(from, out));
    if !in_place {
        if let Some(held) = RUN_FILES.iter().find(|f| out.join(f).exists()) {
            let hint = match resume {
                Some((from, _)) => format!(
                    "with --resume {}, --out must be empty or absent",
                    from.display()
                ),
                None => "choose another directory or --resume it".into(),
            };
            return Err(CliError::usage(format!(
                "--out {}: already holds a run ({held}); {hint}",
                out.display()
            )));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| CliError::io("--out: cannot create", out, e))?;
    let probe = out.join(".write-test");
    std::fs::write(&probe, b"ok").map_err(|e| CliError::io("--out: cannot write in", out, e))?;
    std::fs::remove_file(&probe).map_err(|e| CliError::io("--out: cannot write in", out, e))?;
    if let Some((from, step)) = resume {
        carry_metrics(
            &from.join("metrics.jsonl"),
            &out.join("metrics.jsonl"),
            step,
        )?;
        crate::cli::tensorboard::carry_until(&from.join(TB_DIR), &out.join(TB_DIR), step)?;
    }
    Ok(())
}

/// Where a run's TensorBoard event files go, under its directory.
const TB_DIR: &str = "tb";

/// Writes to `to` (atomically) the lines of `from` whose `step` is at most
/// `step`: a resumed run continues the log where its checkpoint stands, with
/// no lines of steps it will run again.
fn carry_metrics(from: &Path, to: &Path, step: u64) -> Result<(), CliError> {
    let Ok(text) = std::fs::read_to_string(from) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    let tmp = to.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).map_err(|e| CliError::io("cannot write", &tmp, e))?;
    std::fs::rename(&tmp, to).map_err(|e| CliError::io("cannot write", to, e))
}

/// Prints a line above the progress bar, or plainly when the bar is hidden
/// (output not a terminal), so logs still show progress.
fn say(pb: &ProgressBar, line: impl AsRef<str>) {
    if pb.is_hidden() {
        println!("{}", line.as_ref());
    } else {
        pb.println(line);
    }
}

/// One rank of a run (a thread or a process; the only one at world = 1),
/// driven by the training loop: its calls are collectives, every rank makes
/// them.
struct ParallelRank<'a, 'c, B: Backend> {
    ctx: &'a Ctx<'c, B>,
    /// The communicator of `ctx`, measuring its time.
    timed: &'a TimedComm<'c, B>,
    trainer: Trainer<B>,
    seq_len: usize,
    /// Bytes allocated at most while the shard and optimizer were built.
    startup_peak_bytes: u64,
    /// Bytes of parameters, gradients and optimizer state the rank keeps.
    shard_bytes: u64,
    /// When the rank started building its shard.
    built_from: Instant,
    /// Seconds reading the resumed checkpoint's slices (none on a fresh run).
    load_s: Option<f64>,
}

impl<B: Backend> ParallelRank<'_, '_, B> {
    /// One optimizer step; `mine` is this dp rank's share of the global
    /// batch's micro-batches ([`Loader::rank_batches`]).
    fn step(&mut self, mine: &[HostBatch]) -> Result<StepStats, CliError> {
        Ok(self.trainer.step(self.ctx, mine, self.seq_len)?)
    }

    /// The last step's tokens per expert of every MoE layer (a collective
    /// under pp > 1; no device synchronisation: the step read them).
    fn expert_loads(&self) -> Result<Vec<LayerLoad>, CliError> {
        Ok(self.trainer.expert_loads(self.ctx)?)
    }

    /// `(dp, dp index)` of this rank: which share of a step's micro-batches it takes.
    fn dp(&self) -> (usize, usize) {
        (self.ctx.rank.dp.size(), self.ctx.rank.dp_index)
    }

    /// Mean loss of the validation batch.
    fn validation_loss(&mut self, batch: &HostBatch) -> Result<f64, CliError> {
        // An evaluation is not training's peak.
        let ledger = self.trainer.model.ledger.clone();
        let (ctx, seq_len) = (self.ctx, self.seq_len);
        Ok(ledger.outside_peak(|| self.trainer.evaluate(ctx, batch, seq_len))?)
    }

    /// This rank's counts: the main rank's, which writes the summary
    /// (pipeline stage 0, holding the most micro-batches in flight).
    fn activations(&self) -> Option<Counts> {
        Some(self.trainer.model.ledger.counts())
    }

    /// Writes this rank's part of a checkpoint of the run (every rank calls
    /// it); returns the checkpoint's directory.
    fn save(&mut self, out: &Path, meta: &RunMeta) -> Result<PathBuf, CliError> {
        Ok(checkpoint::save(
            self.ctx,
            &mut self.trainer,
            &checkpoint_root(out),
            meta,
            meta.settings.keep_checkpoints,
        )?)
    }

    /// [`Self::save`], telling on the main rank how long the save took.
    fn save_timed(
        &mut self,
        out: &Path,
        meta: &RunMeta,
        pb: &ProgressBar,
    ) -> Result<PathBuf, CliError> {
        let t0 = Instant::now();
        let dir = self.save(out, meta)?;
        if self.is_main() {
            say(
                pb,
                format!(
                    "checkpoint: step {} written in {:.2} s to {}",
                    meta.step,
                    t0.elapsed().as_secs_f64(),
                    dir.display()
                ),
            );
        }
        Ok(dir)
    }

    /// Whether to stop now: `local` is this rank's Ctrl-C flag; every rank
    /// gives the same answer.
    fn agree_stop(&mut self, local: bool) -> Result<bool, CliError> {
        let b = self.ctx.b;
        let flag = b.upload(HostData::F32(vec![f32::from(u8::from(local))]), &[1])?;
        let any = self
            .ctx
            .comm
            .all_reduce(b, &self.ctx.rank.world, &flag, ReduceOp::Max)?;
        Ok(b.download(&any)?.to_f64()[0] > 0.0)
    }

    /// Whether this rank writes files and prints.
    fn is_main(&self) -> bool {
        self.ctx.rank.rank == 0
    }

    /// This rank's global index.
    fn rank(&self) -> usize {
        self.ctx.rank.rank
    }

    /// Seconds this rank has spent in collectives so far (`None` at world =
    /// 1, which has nothing to exchange).
    fn comm_seconds(&self) -> Option<f64> {
        (self.ctx.rank.world.size() > 1).then(|| self.timed.elapsed().as_secs_f64())
    }
}

/// Everything a run needs before its first step, checked before the run
/// directory is touched.
struct Prepared {
    settings: TrainSettings,
    opts: TrainOptions,
    spec: ModelSpec,
    out: PathBuf,
    /// The resumed checkpoint.
    resumed: Option<Source>,
    meta: RunMeta,
    /// Sequences per micro-batch, and micro-batches per step.
    seqs: usize,
    micro_batches: usize,
    /// The checked layout (world = 1 for a one-rank run).
    layout: Layout,
    /// The run's tokenizer (`--tokenizer`, bytes by default).
    tokenizer: Tokenizer,
    /// The run's data: built once per process, shared by its ranks.
    loader: Loader,
    /// The tokenizer's end-of-document id, when the run resets positions
    /// or attention at documents or masks the loss after them.
    eod: Option<i32>,
}

/// The layout of `settings` over its ranks (dp over all ranks by default),
/// checked against `spec`.
fn resolve_layout(settings: &TrainSettings, spec: &ModelSpec) -> Result<Option<Layout>, CliError> {
    let declared = super::registry()
        .layouts(&spec.name)
        .map(|(_, layouts)| layouts)
        .unwrap_or_default();
    crate::cli::dist::resolve_layout(
        settings.layout.as_deref(),
        settings.ranks,
        "--ranks",
        spec,
        &declared,
    )
}

impl Prepared {
    /// A loader batch as the trainer takes it: with `--reset-position-ids`
    /// / `--reset-attention-mask` its documents (Megatron's: a document
    /// ends with each end-of-document token), with `--eod-mask-loss` no
    /// target after one.
    fn host_batch(&self, (tokens, mut targets): (Vec<i32>, Vec<i32>)) -> HostBatch {
        let s = &self.settings;
        let Some(eod) = self.eod else {
            return HostBatch {
                tokens,
                targets,
                docs: None,
            };
        };
        if s.eod_mask_loss {
            for (y, &t) in targets.iter_mut().zip(&tokens) {
                if t == eod {
                    *y = -1;
                }
            }
        }
        let docs = (s.reset_position_ids || s.reset_attention_mask).then(|| {
            Documents::after_eod(
                &tokens,
                self.spec.seq_len,
                eod,
                s.reset_position_ids,
                s.reset_attention_mask,
            )
        });
        HostBatch {
            tokens,
            targets,
            docs,
        }
    }

    /// The directory resumed from and its checkpoint's step, if resuming.
    fn resume_point(&self) -> Option<(&Path, u64)> {
        let dir = self.opts.resume.as_deref()?;
        Some((dir, self.resumed.as_ref()?.step()))
    }
}

/// Validates everything and prepares the run's state; the run directory is
/// left to [`prepare_out`] (only the main rank of a multi-process run
/// touches it).
fn prepare(opts: TrainOptions, backend: &str) -> Result<Prepared, CliError> {
    let resumed = match &opts.resume {
        Some(dir) => Some(Source::open::<RunMeta>(dir)?),
        None => None,
    };
    let base = resumed
        .as_ref()
        .map(|(_, m)| m.settings.clone())
        .unwrap_or_default();
    let (settings, opts) = opts.resolve(base)?;
    let mut spec = match &resumed {
        Some((_, meta)) => {
            if meta.settings.model != settings.model || meta.settings.seed != settings.seed {
                return Err(CliError::usage(format!(
                    "--resume: the checkpoint trains `{}` with seed {}; --model/--seed cannot change on resume",
                    meta.settings.model, meta.settings.seed
                )));
            }
            // What changes the model's math or the data is the checkpoint's;
            // layout, device, steps and schedule flags may change.
            let (was, now) = (&meta.settings, &settings);
            let changed: Vec<String> = [
                (
                    "--batch-tokens",
                    was.batch_tokens.to_string(),
                    now.batch_tokens.to_string(),
                ),
                ("--dtype", was.dtype.clone(), now.dtype.clone()),
                (
                    "--capacity-factor",
                    format!("{:?}", was.capacity_factor),
                    format!("{:?}", now.capacity_factor),
                ),
                (
                    "--data-path",
                    format!("{:?}", was.data_path),
                    format!("{:?}", now.data_path),
                ),
                (
                    "--split",
                    format!("{:?}", was.split),
                    format!("{:?}", now.split),
                ),
                (
                    "--tokenizer",
                    format!("{:?}", was.tokenizer),
                    format!("{:?}", now.tokenizer),
                ),
            ]
            .into_iter()
            .filter(|(_, a, b)| a != b)
            .map(|(flag, a, b)| format!("{flag} {b} (the checkpoint's run has {a})"))
            .collect();
            // A converted Hugging Face model (step 0, nothing trained yet)
            // starts a fine-tune: its run settings are only defaults.
            let converted = meta.step == 0 && meta.hf.is_some();
            if !changed.is_empty() && !converted {
                return Err(CliError::usage(format!(
                    "--resume: {} cannot change on resume; leave {} out",
                    changed.join(", "),
                    if changed.len() == 1 { "it" } else { "them" }
                )));
            }
            if meta.settings.layers != settings.layers {
                let kept = match meta.settings.layers {
                    Some(n) => format!("{n} blocks"),
                    None => "all its blocks".into(),
                };
                return Err(CliError::usage(format!(
                    "--layers {}: the checkpoint trains `{}` with {kept}; --layers cannot change on resume",
                    settings.layers.map_or("(all)".into(), |n| n.to_string()),
                    meta.settings.model
                )));
            }
            if let Some(path) = &opts.model_config {
                let config = ModelConfig::load(path)
                    .map_err(|e| CliError::usage(format!("--model-config {e}")))?;
                let mut given = config.spec;
                if let Some(n) = settings.layers {
                    given = given.first_layers(n).map_err(CliError::usage)?;
                }
                if given != meta.spec {
                    return Err(CliError::usage(format!(
                        "--model-config {}: describes model `{}`, which is not the checkpoint's \
                         `{}` (a resumed run trains the checkpoint's model; leave \
                         --model-config out)",
                        path.display(),
                        given.name,
                        meta.spec.name
                    )));
                }
            }
            // The stored spec is already cut to the run's --layers.
            meta.spec.clone()
        }
        None => match &opts.model_config {
            Some(path) => {
                let config = ModelConfig::load(path)
                    .map_err(|e| CliError::usage(format!("--model-config {e}")))?;
                config.spec
            }
            None => super::registry()
                .spec(&settings.model)
                .map_err(|e| CliError::usage(format!("--model {}: {e}", settings.model)))?,
        },
    };
    if let (Some(n), None) = (settings.layers, &resumed) {
        spec = spec
            .first_layers(n)
            .map_err(|e| CliError::usage(format!("--layers {n}: {e}")))?;
    }
    // A config file names its model; the run records that name.
    let settings = match &opts.model_config {
        Some(_) if resumed.is_none() => TrainSettings {
            model: spec.name.clone(),
            ..settings
        },
        _ => settings,
    };
    if let Some(factor) = settings.capacity_factor {
        for group in &mut spec.groups {
            if let FfnSpec::Moe(moe) = &mut group.ffn {
                moe.capacity = Some(CapacitySpec {
                    factor,
                    drop_policy: DropPolicySpec::Probs,
                    pad_to_capacity: false,
                });
            }
        }
        spec.check().map_err(|errors| {
            let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            CliError::usage(format!("--capacity-factor {factor}: {}", msgs.join("; ")))
        })?;
    }
    let policy = settings.policy_override()?;
    if !policy.is_empty() {
        policy.apply(&mut spec);
        spec.check().map_err(|errors| {
            let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            CliError::usage(format!(
                "--recompute / --offload / --store-fp8: {}",
                msgs.join("; ")
            ))
        })?;
    }
    if settings.fp8 {
        let left = spec.use_fp8_experts().map_err(CliError::usage)?;
        for (i, why) in left {
            eprintln!("--fp8: group {i} stays in {}: {why}", settings.dtype);
        }
    }
    if settings.device != backend {
        return Err(CliError::usage(format!(
            "device `{}` (from the config file or the resumed run) but this run was started on \
             the {backend} backend; pass --device {} on the command line",
            settings.device, settings.device
        )));
    }
    let layout = match resolve_layout(&settings, &spec)? {
        Some(l) => l,
        None => foldmoe::core::layout::check(&Default::default(), &spec).map_err(|errors| {
            let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            CliError::usage(format!("model {}: {}", spec.name, msgs.join("; ")))
        })?,
    };
    // A parallel run splits each step's micro-batches over dp; one
    // micro-batch (the default) becomes one per dp rank.
    let dp = layout.dp;
    let micro_batches = match settings.micro_batches {
        m if m.is_multiple_of(dp) => m,
        1 => dp,
        m => {
            return Err(CliError::usage(format!(
                "--micro-batches {m}: must be a multiple of dp = {dp} (each dp rank takes an equal share)"
            )))
        }
    };
    if let Some(e) = trainer_config(&settings).layout_error(layout.ep) {
        return Err(CliError::usage(e));
    }
    // The schedule's own checks, before the run directory is made.
    foldmoe::core::engine::parallel::pipeline::turns(
        layout.pp,
        layout.vpp,
        micro_batches / dp,
        0,
        settings.overlap_moe_expert_parallel_comm,
    )
    .map_err(|e| CliError::usage(format!("--micro-batches {micro_batches}: {e}")))?;
    let seqs = TrainSettings {
        micro_batches,
        ..settings.clone()
    }
    .sequences_per_micro_batch(spec.seq_len)?;
    if let (Some((source, _)), Some(dir)) = (&resumed, &opts.resume) {
        if source.step() >= settings.steps {
            return Err(CliError::usage(format!(
                "--resume {}: the run is already at step {} of --steps {}; nothing was changed \
                 (pass a larger --steps to continue it)",
                dir.display(),
                source.step(),
                settings.steps
            )));
        }
    }
    let tokenizer = Tokenizer::load(settings.tokenizer.as_deref())?;
    if tokenizer.vocab_size() > spec.vocab {
        return Err(CliError::usage(format!(
            "--tokenizer {}: its vocabulary has {} tokens, more than model `{}`'s vocab {}; \
             train a model whose vocab is at least {} (--model-config with vocab = {})",
            tokenizer.name(),
            tokenizer.vocab_size(),
            spec.name,
            spec.vocab,
            tokenizer.vocab_size(),
            tokenizer.vocab_size()
        )));
    }
    let eod = match settings.eod_flag() {
        None => None,
        Some(flag) => Some(tokenizer.eod().ok_or_else(|| {
            CliError::usage(format!(
                "{flag}: tokenizer {} has no end-of-document token (looked for <|endoftext|>, \
                 </s>, ...); give --tokenizer one that has",
                tokenizer.name()
            ))
        })? as i32),
    };
    let loader = build_loader(&settings, &spec, &tokenizer, (seqs * micro_batches) as u64)?;
    let out = opts
        .out
        .clone()
        .or_else(|| opts.resume.clone())
        .unwrap_or_else(default_out_dir);
    let (resumed, meta) = match resumed {
        Some((source, mut meta)) => {
            let now = loader.fingerprint();
            if let (Some(was), Some(now)) = (&meta.data_fingerprint, &now) {
                if was != now {
                    return Err(CliError::usage(format!(
                        "--resume: the data of --data-path changed since the checkpoint's run \
                         started (fingerprint {was}, now {now}); resume on the same files"
                    )));
                }
            }
            meta.settings = settings.clone();
            meta.spec = spec.clone();
            meta.data_fingerprint = now;
            (Some(source), meta)
        }
        None => (
            None,
            RunMeta {
                settings: settings.clone(),
                spec: spec.clone(),
                step: 0,
                sampler: BatchSampler::new(settings.seed),
                losses: Vec::new(),
                val_losses: Vec::new(),
                train_seconds: 0.0,
                data_fingerprint: loader.fingerprint(),
                hf: None,
            },
        ),
    };
    Ok(Prepared {
        settings,
        opts,
        spec,
        out,
        resumed,
        meta,
        seqs,
        micro_batches,
        layout,
        tokenizer,
        loader,
        eod,
    })
}

/// The run's data: the bundled text (tokenized by the run's tokenizer), or
/// the `--data-path` blend split by `--split`, with enough samples for
/// every step of the run.
fn build_loader(
    settings: &TrainSettings,
    spec: &ModelSpec,
    tokenizer: &Tokenizer,
    samples_per_step: u64,
) -> Result<Loader, CliError> {
    let Some(paths) = &settings.data_path else {
        let (train, val) = match tokenizer {
            Tokenizer::Byte => (
                TextDataset::from_text(TRAIN_TEXT),
                TextDataset::from_text(VAL_TEXT),
            ),
            t => (
                TextDataset::from_tokens(t.encode(TRAIN_TEXT)?),
                TextDataset::from_tokens(t.encode(VAL_TEXT)?),
            ),
        };
        return Ok(Loader::text(train, val, spec.seq_len, spec.vocab)?);
    };
    let cfg = IndexedConfig {
        blend: BlendSpec::parse(paths)?,
        split: Split::parse(settings.split.as_deref().unwrap_or(Split::DEFAULT))?,
        seq_len: spec.seq_len,
        seed: settings.seed,
        train_samples: settings.steps * samples_per_step,
        valid_samples: VAL_WINDOWS as u64,
    };
    Ok(Loader::indexed(&cfg, spec.vocab)?)
}

/// The memory planner's estimate for `ranks` of the run (weights,
/// gradients, optimizer state, activations under the run's policies,
/// communication buffers), summed: what this process will hold.
fn estimate(
    spec: &ModelSpec,
    layout: &Layout,
    prep: &Prepared,
    ranks: &[usize],
    act_bytes: f64,
) -> u64 {
    let per_dp = (prep.micro_batches / layout.dp.max(1)).max(1);
    ranks
        .iter()
        .map(|&r| {
            let mut opts = MemoryOptions::new(r, prep.seqs, per_dp);
            opts.activation_bytes = act_bytes;
            opts.overlap_moe_comm = prep.settings.overlap_moe_expert_parallel_comm;
            opts.weight_bytes = if prep.settings.dtype == "bf16" {
                2.0
            } else {
                4.0
            };
            memory::plan_memory(spec, layout, &opts).total
        })
        .sum()
}

/// `30.5 B`, `2.92 M`: a parameter count as a user reads it.
fn human_count(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.1} B", n as f64 / 1e9)
    } else {
        format!("{:.2} M", n as f64 / 1e6)
    }
}

/// Admission by memory: refuses a run whose estimate exceeds what the
/// device (or host) has available, naming both and what would fit;
/// `--force` skips the check, and so does a device that cannot say.
fn admit<B: Backend>(b: &B, prep: &Prepared, ranks: &[usize]) -> Result<(), CliError> {
    if prep.opts.force {
        return Ok(());
    }
    let Some(available) = b.memory_available() else {
        return Ok(());
    };
    // Saved activations are f32 on the CPU (bf16 is emulated in f32).
    let act_bytes = if B::NAME == "cuda" && prep.settings.dtype == "bf16" {
        2.0
    } else {
        4.0
    };
    let need = estimate(&prep.spec, &prep.layout, prep, ranks, act_bytes);
    if need <= available {
        return Ok(());
    }
    let gib = |x: u64| x as f64 / (1u64 << 30) as f64;
    let mut fits = Vec::new();
    let mut block = prep.spec.clone();
    PolicyOverride::parse(Some("block"), None, None)
        .map_err(CliError::usage)?
        .apply(&mut block);
    let with_block = estimate(&block, &prep.layout, prep, ranks, act_bytes);
    if with_block <= available {
        fits.push(format!("--recompute block ({:.1} GiB)", gib(with_block)));
    }
    // The most experts ep may split (every MoE group's count a multiple).
    let experts = prep
        .spec
        .groups
        .iter()
        .filter_map(|g| match &g.ffn {
            FfnSpec::Moe(m) => Some(m.experts),
            FfnSpec::Dense { .. } => None,
        })
        .min();
    // Spread over more processes (one rank each, as `foldmoe launch` runs
    // them): the smallest world, under ep = world for an MoE model, whose
    // rank 0 fits.
    let mut world = prep.layout.world.max(1) * 2;
    while world <= 4096 {
        let text = match experts {
            Some(e) => {
                let mut ep = world.min(e);
                while ep > 1 && !(e.is_multiple_of(ep) && world.is_multiple_of(ep)) {
                    ep -= 1;
                }
                format!("world={world},ep={ep}")
            }
            None => format!("world={world}"),
        };
        let parsed = LayoutSpec::parse(&text).map_err(|e| CliError::usage(e.to_string()))?;
        if let Ok(l) = foldmoe::core::layout::check(&parsed, &prep.spec) {
            let per_rank = estimate(&prep.spec, &l, prep, &[0], act_bytes);
            if per_rank <= available {
                fits.push(format!(
                    "{world} processes of --layout {text} ({:.1} GiB each, under foldmoe launch)",
                    gib(per_rank)
                ));
                break;
            }
        }
        world *= 2;
    }
    let fit = if fits.is_empty() {
        "neither --recompute block nor up to 4096 ranks would fit".to_string()
    } else {
        format!("would fit: {}", fits.join("; "))
    };
    Err(CliError::usage(format!(
        "model {}: the memory planner estimates {:.1} GiB for {} rank{} of layout {} on {} \
         ({} parameters), but {:.1} GiB is available; {fit}; --force starts anyway",
        prep.spec.name,
        gib(need),
        ranks.len(),
        if ranks.len() == 1 { "" } else { "s" },
        prep.layout.spec(),
        B::NAME,
        human_count(prep.spec.param_counts().0),
        gib(available)
    )))
}

/// Runs `foldmoe train` on backend `b`: one rank, or `--ranks N` ranks as
/// threads under `--layout`.
pub fn run<B: Backend>(b: &B, opts: TrainOptions, stop: Arc<AtomicBool>) -> Result<(), CliError> {
    let prep = prepare(opts, B::NAME)?;
    // The ranks are threads of this process: they share its memory.
    let ranks: Vec<usize> = (0..prep.layout.world).collect();
    admit(b, &prep, &ranks)?;
    prepare_out(&prep.out, prep.resume_point())?;
    let layout = prep.layout.clone();
    if layout.world == 1 {
        // One rank: this thread, collectives that return at once.
        let solo = foldmoe::kernels::comm::solo::SoloComm;
        return run_rank(b, &solo, &layout, &prep, &stop);
    }
    let results = run_local(layout.world, RANK_TIMEOUT, |comm| {
        Ok(run_rank(b, &comm, &layout, &prep, &stop))
    });
    // Report the cause: an error other than a peer's abort, else rank 0's.
    let is_peer = |e: &CliError| {
        matches!(
            e,
            CliError::Engine(EngineError::Kernel(KernelError::Comm { .. }))
                | CliError::Kernel(KernelError::Comm { .. })
        )
    };
    let mut first: Option<CliError> = None;
    for result in results {
        let err = match result {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(e) => CliError::Kernel(e),
        };
        match &first {
            None => first = Some(err),
            Some(f) if !is_peer(&err) && is_peer(f) => first = Some(err),
            _ => {}
        }
    }
    first.map_or(Ok(()), Err)
}

/// Runs `foldmoe train` as rank `env.rank` of a multi-process run of
/// `env.world` processes (`foldmoe launch`, or torchrun-style variables):
/// `--layout` spans the processes, `--ranks` may only repeat their number,
/// and rank 0 alone writes the run directory.
///
/// The communicator ([`crate::cli::dist::connect`], waiting up to `timeout` for a peer)
/// is made after the options are checked, so bad flags fail at once on
/// every rank, without waiting for the others.
pub fn run_process<B: ProcessComm>(
    b: &B,
    mut opts: TrainOptions,
    stop: Arc<AtomicBool>,
    env: &DistEnv,
    timeout: Duration,
) -> Result<(), CliError> {
    match opts.ranks {
        Some(r) if r != env.world => {
            return Err(CliError::usage(format!(
                "--ranks {r} but WORLD_SIZE = {}: in a multi-process run the ranks are the \
                 processes; leave --ranks out",
                env.world
            )))
        }
        _ => opts.ranks = Some(env.world),
    }
    let prep = prepare(opts, B::NAME)?;
    admit(b, &prep, &[env.rank])?;
    let comm = crate::cli::dist::connect(b, env, timeout, Some(&prep.layout))?;
    let world = Group::new((0..env.world).collect());
    // Rank 0 alone prepares the run directory; if it cannot, it aborts, so
    // the others stop at the barrier with its reason instead of waiting.
    if env.rank == 0 {
        if let Err(e) = prepare_out(&prep.out, prep.resume_point()) {
            comm.abort(&e.to_string());
            return Err(e);
        }
    }
    comm.barrier(&world)?;
    run_rank(b, comm.as_ref(), &prep.layout, &prep, &stop)
}

/// One rank of a parallel run on `comm`, whichever communicator it is (a
/// thread's local one, a process's TCP or NCCL one): threads and processes
/// share this path. A rank that stops with an error aborts `comm`, so its
/// peers stop too instead of waiting for it.
fn run_rank<B: Backend>(
    b: &B,
    comm: &dyn Communicator<B>,
    layout: &Layout,
    prep: &Prepared,
    stop: &AtomicBool,
) -> Result<(), CliError> {
    let timed = TimedComm::new(comm);
    let outcome = (|| {
        let rank = RankLayout::new(layout, comm.rank())?;
        let ctx = Ctx {
            b,
            comm: &timed,
            rank: &rank,
        };
        // Shard first: the rank draws only its blocks of the weights, and
        // a resumed run reads only its slices of the checkpoint.
        let built_from = Instant::now();
        b.reset_peak_memory();
        let (before, _) = b.memory_in_use();
        let meta = &prep.meta;
        let model = Model::new(
            b,
            &meta.spec,
            rank.clone(),
            meta.settings.seed,
            meta.settings.model_dtype()?,
        )?;
        let mut trainer = Trainer::new(b, model, trainer_config(&meta.settings))?;
        let mut load_s = None;
        if let Some(source) = &prep.resumed {
            let t0 = Instant::now();
            checkpoint::load(b, source, &mut trainer)?;
            trainer.set_step_count(meta.step);
            load_s = Some(t0.elapsed().as_secs_f64());
        }
        let (after, peak) = b.memory_in_use();
        let mut engine = ParallelRank {
            ctx: &ctx,
            timed: &timed,
            trainer,
            seq_len: prep.spec.seq_len,
            startup_peak_bytes: peak.saturating_sub(before) as u64,
            shard_bytes: after.saturating_sub(before) as u64,
            built_from,
            load_s,
        };
        train_loop(b, &mut engine, prep, stop)
    })();
    if let Err(e) = &outcome {
        if !matches!(e, CliError::Interrupted { .. }) {
            comm.abort(&e.to_string());
        }
    }
    outcome
}

/// The step at which [`TEST_EXIT_VAR`] makes rank `rank` abort, if any.
fn test_exit_step(rank: usize) -> Result<Option<u64>, CliError> {
    let Ok(text) = std::env::var(TEST_EXIT_VAR) else {
        return Ok(None);
    };
    let parsed = text.split_once(':').and_then(|(r, s)| {
        Some((
            r.trim().parse::<usize>().ok()?,
            s.trim().parse::<u64>().ok()?,
        ))
    });
    match parsed {
        Some((r, step)) => Ok((r == rank).then_some(step)),
        None => Err(CliError::usage(format!(
            "{TEST_EXIT_VAR} = {text:?}: expected <rank>:<step>"
        ))),
    }
}

/// The training loop of one rank (or the only one): the main rank shows
/// progress and writes the run's files; every rank takes part in the steps,
/// evaluations and checkpoint gathers.
fn train_loop<B: Backend>(
    b: &B,
    engine: &mut ParallelRank<'_, '_, B>,
    prep: &Prepared,
    stop: &AtomicBool,
) -> Result<(), CliError> {
    let (settings, spec, out) = (&prep.settings, &prep.spec, &prep.out);
    let main = engine.is_main();
    let mut meta = prep.meta.clone();
    let val_batch = prep
        .loader
        .validation_batch(VAL_WINDOWS)?
        .map(|b| prep.host_batch(b));
    let (params_total, params_active) = spec.param_counts();
    let has_mtp = spec.mtp_layers > 0;

    let mut metrics = if main {
        Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(out.join("metrics.jsonl"))
                .map_err(|e| CliError::io("cannot open", &out.join("metrics.jsonl"), e))?,
        )
    } else {
        None
    };
    // TensorBoard's copy of the log (rank 0's, like metrics.jsonl); a
    // resumed run's file starts a session at its first step.
    let mut tb = if main {
        let resumed = (meta.step > 0).then_some(meta.step + 1);
        Some(EventWriter::create(&out.join(TB_DIR), resumed)?)
    } else {
        None
    };
    let pb = if main {
        ProgressBar::new(settings.steps)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("static template"),
    );
    pb.set_position(meta.step);
    let l = &prep.layout;
    let mut layout_note = if l.world > 1 {
        format!(" on {} ranks ({})", l.world, l.spec())
    } else {
        String::new()
    };
    if settings.dtype != "f32" {
        layout_note += &format!(" in {} (f32 master weights)", settings.dtype);
    }
    let fp8_groups = spec
        .groups
        .iter()
        .filter(|g| g.policy.precision == GemmPrecision::Fp8Blockwise)
        .count();
    if fp8_groups > 0 {
        layout_note += &format!(
            ", routed experts of {fp8_groups} of {} groups in blockwise fp8",
            spec.groups.len()
        );
    }
    if main {
        say(&pb, format!(
            "foldmoe: training `{}` ({:.2} M parameters, {:.2} M active per token) on {}{layout_note}, {} tokens/step, run directory {}",
            spec.name,
            params_total as f64 / 1e6,
            params_active as f64 / 1e6,
            settings.device,
            settings.batch_tokens,
            out.display()
        ));
        for note in prep.loader.notes() {
            say(&pb, note);
        }
    }

    let started = Instant::now();
    let mut first_step_s = f64::NAN;
    let first_step = meta.step;
    // Time in steps, and in collectives within them (parallel runs).
    let (mut step_seconds, mut comm_in_steps) = (0.0f64, 0.0f64);
    let mut last_val = meta.val_losses.last().map(|&(_, v)| v).unwrap_or(f64::NAN);
    let exit_at = test_exit_step(engine.rank())?;
    // The step of the last periodic checkpoint and its directory: a run
    // ending on that step does not write it again.
    let mut saved_at: Option<(u64, PathBuf)> = None;
    while meta.step < settings.steps {
        if exit_at == Some(meta.step + 1) {
            eprintln!(
                "{TEST_EXIT_VAR}: rank {} aborts at step {}",
                engine.rank(),
                meta.step + 1
            );
            std::process::abort();
        }
        if engine.agree_stop(stop.load(Ordering::SeqCst))? {
            meta.train_seconds += started.elapsed().as_secs_f64();
            let dir = engine.save(out, &meta)?;
            if let Some(tb) = tb.as_mut() {
                tb.flush()?;
            }
            pb.abandon();
            return Err(CliError::Interrupted {
                step: meta.step,
                dir: dir.display().to_string(),
            });
        }
        if prep
            .opts
            .exit_after
            .is_some_and(|n| meta.step - first_step >= n)
        {
            break;
        }
        let step_start = Instant::now();
        let (dp, dp_index) = engine.dp();
        let micro = prep.loader.rank_batches(
            &mut meta.sampler,
            prep.seqs,
            prep.micro_batches,
            dp,
            dp_index,
        )?;
        let micro: Vec<HostBatch> = micro.into_iter().map(|b| prep.host_batch(b)).collect();
        let comm_before = engine.comm_seconds();
        let stepped = engine.step(&micro);
        step_seconds += step_start.elapsed().as_secs_f64();
        if let (Some(before), Some(after)) = (comm_before, engine.comm_seconds()) {
            comm_in_steps += after - before;
        }
        let stats = match stepped {
            Ok(stats) => stats,
            Err(e) => {
                pb.abandon();
                let kept = if checkpoint_root(out).join(checkpoint::LATEST_FILE).exists() {
                    format!(
                        "the last good checkpoint is kept in {}",
                        checkpoint_root(out).display()
                    )
                } else {
                    "no checkpoint was written".to_string()
                };
                return Err(CliError::usage(format!(
                    "training stopped at step {}: {e}; {kept}",
                    meta.step + 1
                )));
            }
        };
        meta.step += 1;
        meta.losses.push(stats.loss);
        if meta.step == first_step + 1 {
            first_step_s = engine.built_from.elapsed().as_secs_f64();
            if main {
                let read = engine
                    .load_s
                    .map_or(String::new(), |s| format!(" (checkpoint read in {s:.2} s)"));
                say(&pb, format!(
                    "startup: shard {:.1} MB (peak {:.1} MB while building it and its optimizer state), first step done {:.2} s after the build began{read}",
                    engine.shard_bytes as f64 / 1e6,
                    engine.startup_peak_bytes as f64 / 1e6,
                    first_step_s
                ));
            }
        }
        let tokens_per_s = settings.batch_tokens as f64 / step_start.elapsed().as_secs_f64();
        let eval_now = meta.step.is_multiple_of(settings.eval_every) || meta.step == settings.steps;
        let eval_now = eval_now && val_batch.is_some();
        if let (true, Some(batch)) = (eval_now, &val_batch) {
            last_val = engine.validation_loss(batch)?;
            meta.val_losses.push((meta.step, last_val));
        }
        // Every rank takes part (the pipeline's stages each hold some layers).
        let loads = engine.expert_loads()?;
        if let Some(tb) = tb.as_mut() {
            let mut scalars = vec![
                ("lm loss".to_string(), stats.loss),
                ("learning-rate".to_string(), stats.lr),
                ("grad-norm".to_string(), stats.grad_norm),
                ("throughput".to_string(), tokens_per_s),
                ("moe/aux-loss".to_string(), stats.aux_loss),
            ];
            if eval_now {
                scalars.push(("lm loss validation".to_string(), last_val));
            }
            if has_mtp {
                scalars.push(("mtp loss".to_string(), stats.mtp_loss));
            }
            for l in &loads {
                let s = crate::cli::report::load_stats(&l.tokens);
                scalars.push((format!("moe/imbalance/layer_{}", l.layer), s.max_over_mean));
                scalars.push((format!("moe/load-min/layer_{}", l.layer), s.min_over_mean));
                scalars.push((format!("moe/load-std/layer_{}", l.layer), s.cv));
                for (e, &t) in l.tokens.iter().enumerate() {
                    scalars.push((format!("moe/load/layer_{}/expert_{e}", l.layer), t as f64));
                }
            }
            tb.scalars(meta.step, &scalars)?;
            if eval_now {
                tb.flush()?;
            }
        }
        if let Some(metrics) = metrics.as_mut() {
            let expert_load: serde_json::Map<String, serde_json::Value> = loads
                .iter()
                .map(|l| (format!("layer_{}", l.layer), serde_json::json!(l.tokens)))
                .collect();
            let record = serde_json::json!({
                "step": meta.step,
                "loss": stats.loss,
                "aux_loss": stats.aux_loss,
                "mtp_loss": if has_mtp { Some(stats.mtp_loss) } else { None },
                "val_loss": if eval_now { Some(last_val) } else { None },
                "lr": stats.lr,
                "grad_norm": stats.grad_norm,
                "load_imbalance": stats.load_imbalance,
                "tokens_per_s": tokens_per_s,
                "expert_load": expert_load,
            });
            writeln!(metrics, "{record}")
                .map_err(|e| CliError::io("cannot write", &out.join("metrics.jsonl"), e))?;
        }
        let mtp = if has_mtp {
            format!(" | mtp {:.4}", stats.mtp_loss)
        } else {
            String::new()
        };
        let line = format!(
            "step {:>4} | loss {:.4}{mtp} | val {:.4} | {:>6.0} tok/s | lr {:.2e} | imbalance {:.2}",
            meta.step, stats.loss, last_val, tokens_per_s, stats.lr, stats.load_imbalance
        );
        pb.set_message(line.clone());
        pb.inc(1);
        if eval_now && main {
            say(&pb, line);
        }
        if meta.step.is_multiple_of(settings.checkpoint_every) {
            let mut snapshot = meta.clone();
            snapshot.train_seconds += started.elapsed().as_secs_f64();
            saved_at = Some((meta.step, engine.save_timed(out, &snapshot, &pb)?));
            if let Some(tb) = tb.as_mut() {
                tb.flush()?;
            }
        }
    }
    if let Some(tb) = tb.as_mut() {
        tb.flush()?;
    }
    let session_seconds = started.elapsed().as_secs_f64();
    meta.train_seconds += session_seconds;
    let saved = match saved_at {
        Some((step, dir)) if step == meta.step => dir,
        _ => engine.save_timed(out, &meta, &pb)?,
    };
    if !main {
        return Ok(());
    }
    pb.finish();
    let activations = engine.activations();
    let tokens_this_session = (meta.step - first_step) as f64 * settings.batch_tokens as f64;
    let summary = Summary {
        model: &spec.name,
        steps: meta.step,
        losses: &meta.losses,
        final_loss: meta.losses.last().copied().unwrap_or(f64::NAN),
        val_loss: last_val,
        val_losses: &meta.val_losses,
        tokens_per_s: tokens_this_session / session_seconds.max(1e-9),
        params_total,
        params_active,
        wall_s: meta.train_seconds,
        seed: settings.seed,
        peak_activation_bytes: activations.as_ref().map(|c| c.peak_device),
        peak_activation_bytes_by_part: activations.as_ref().map(Counts::peak_parts),
        peak_offloaded_bytes: activations.as_ref().map(|c| c.peak_host),
        startup_peak_bytes: engine.startup_peak_bytes,
        shard_bytes: engine.shard_bytes,
        first_step_s,
    };
    let summary_path = out.join("summary.json");
    let json = serde_json::to_string_pretty(&summary)
        .map_err(|e| CliError::io("cannot encode", &summary_path, e))?;
    std::fs::write(&summary_path, json)
        .map_err(|e| CliError::io("cannot write", &summary_path, e))?;
    if let Some(metrics) = metrics.as_mut() {
        metrics
            .flush()
            .map_err(|e| CliError::io("cannot write", &out.join("metrics.jsonl"), e))?;
    }
    // The plots come from the log, as `foldmoe report` draws them.
    crate::cli::report::write_plots(out, &crate::cli::report::RunLog::read(out)?)?;
    if settings.sample_tokens > 0 && meta.step == settings.steps {
        // The sample comes from the full model, rebuilt from the checkpoint's
        // tensors whatever the layout.
        let (model, _) = load_model(b, &saved)?;
        let prompt = "And God said";
        let tok = &prep.tokenizer;
        let prompt_ids: Vec<i32> = tok
            .encode(prompt)?
            .into_iter()
            .map(|id| id as i32)
            .collect();
        let ids = crate::cli::generate::sample(
            b,
            &model,
            &prompt_ids,
            settings.sample_tokens,
            0.8,
            settings.seed,
            &mut |_| Ok(true),
        )?;
        let made: Vec<u8> = match tok {
            Tokenizer::Byte => ids.iter().map(|&id| id as u8).collect(),
            t => {
                let ids: Vec<u32> = ids.iter().map(|&id| id as u32).collect();
                t.decode(&ids)?.into_bytes()
            }
        };
        // Control bytes the model makes are escaped on a terminal, as
        // `generate` does.
        let escape = std::io::IsTerminal::is_terminal(&std::io::stdout());
        let bytes: Vec<u8> = made
            .iter()
            .flat_map(|&byte| {
                if escape {
                    crate::cli::generate::escaped(byte)
                } else {
                    vec![byte]
                }
            })
            .collect();
        println!("\nsample: {prompt}{}\n", String::from_utf8_lossy(&bytes));
    }
    if engine.comm_seconds().is_some() && step_seconds > 0.0 {
        println!(
            "communicator: {:.1}% of step time on rank 0 ({comm_in_steps:.2} s of {step_seconds:.2} s)",
            100.0 * comm_in_steps / step_seconds
        );
    }
    println!(
        "done: {} steps, loss {:.4}, validation loss {:.4}, {:.0} tokens/s; results in {}",
        meta.step,
        summary.final_loss,
        last_val,
        summary.tokens_per_s,
        out.display()
    );
    Ok(())
}
