//! `foldmoe train`: trains a model on the bundled text (or resumes a run),
//! showing progress and writing metrics, a checkpoint, a loss plot and a
//! generated sample under the run directory.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use foldmoe::core::engine::checkpoint::{self, NamedTensor};
use foldmoe::core::engine::data::{BatchSampler, ByteTokenizer, TextDataset};
use foldmoe::core::engine::model::Model;
use foldmoe::core::engine::trainer::{TrainConfig, Trainer};
use foldmoe::core::spec::ModelSpec;
use foldmoe::kernels::{Backend, DType, HostData, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::error::CliError;
use crate::settings::{TrainOptions, TrainSettings};

/// The bundled corpus (public domain; see data/NOTICE).
const TRAIN_TEXT: &str = include_str!("../data/train.txt");
const VAL_TEXT: &str = include_str!("../data/val.txt");
/// Largest model (parameters) a CPU run accepts: full-size published models
/// are declared for planning and GPU clusters, not for this backend.
const CPU_PARAM_LIMIT: u64 = 500_000_000;
/// Windows in the fixed validation batch.
const VAL_WINDOWS: usize = 16;

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
    params_total: usize,
    params_active: usize,
    wall_s: f64,
    seed: u64,
}

/// The checkpoint directory inside a run directory, or `path` itself if it is one.
pub fn checkpoint_dir(path: &Path) -> PathBuf {
    if path.join(checkpoint::CONFIG_FILE).exists() {
        path.to_path_buf()
    } else {
        path.join("checkpoint")
    }
}

fn trainer_config(s: &TrainSettings) -> TrainConfig {
    TrainConfig {
        lr: s.lr,
        min_lr: s.lr / 10.0,
        warmup_steps: s.warmup_steps,
        total_steps: s.steps,
        ..TrainConfig::default()
    }
}

/// Rebuilds a trainer from a checkpoint's meta and tensors.
pub fn load_trainer<B: Backend>(
    b: &B,
    meta: &RunMeta,
    tensors: Vec<NamedTensor>,
) -> Result<Trainer<B>, CliError> {
    let model = Model::new(b, &meta.spec, meta.settings.seed, DType::F32)?;
    let mut trainer = Trainer::new(b, model, trainer_config(&meta.settings))?;
    checkpoint::restore_trainer(b, &mut trainer, tensors)?;
    trainer.opt.set_step_count(meta.step);
    Ok(trainer)
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

/// Creates the run directory and proves it writable, refusing to overwrite
/// another run's results.
fn prepare_out(out: &Path, resuming: bool) -> Result<(), CliError> {
    if !resuming && (out.join("summary.json").exists() || checkpoint_dir(out).exists()) {
        return Err(CliError::usage(format!(
            "--out {}: already holds a run; choose another directory or --resume it",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| CliError::io("--out: cannot create", out, e))?;
    let probe = out.join(".write-test");
    std::fs::write(&probe, b"ok").map_err(|e| CliError::io("--out: cannot write in", out, e))?;
    std::fs::remove_file(&probe).map_err(|e| CliError::io("--out: cannot write in", out, e))?;
    Ok(())
}

fn upload_batch<B: Backend>(
    b: &B,
    (x, y): (Vec<i32>, Vec<i32>),
    seqs: usize,
    seq: usize,
) -> Result<(Tensor<B>, Tensor<B>), CliError> {
    Ok((
        b.upload(HostData::I32(x), &[seqs, seq])?,
        b.upload(HostData::I32(y), &[seqs, seq])?,
    ))
}

/// Mean validation loss on the fixed validation batch.
fn validation_loss<B: Backend>(
    b: &B,
    model: &Model<B>,
    batch: &(Tensor<B>, Tensor<B>),
) -> Result<f64, CliError> {
    let out = model.forward(b, &batch.0, &batch.1)?;
    Ok(b.download(&out.loss)?.to_f64()[0])
}

fn save_checkpoint<B: Backend>(
    b: &B,
    out: &Path,
    trainer: &Trainer<B>,
    meta: &RunMeta,
) -> Result<(), CliError> {
    let tensors = checkpoint::trainer_tensors(b, trainer)?;
    checkpoint::save(&checkpoint_dir(out), &tensors, meta)?;
    Ok(())
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

/// Runs `foldmoe train` on backend `b`.
pub fn run<B: Backend>(b: &B, opts: TrainOptions, stop: Arc<AtomicBool>) -> Result<(), CliError> {
    // Everything that can be rejected is checked before the run directory is touched.
    let resumed = match &opts.resume {
        Some(dir) => Some(checkpoint::load::<RunMeta>(&checkpoint_dir(dir))?),
        None => None,
    };
    let base = resumed
        .as_ref()
        .map(|(_, m)| m.settings.clone())
        .unwrap_or_default();
    let (settings, opts) = opts.resolve(base)?;
    let spec = match &resumed {
        Some((_, meta)) => {
            if meta.settings.model != settings.model || meta.settings.seed != settings.seed {
                return Err(CliError::usage(format!(
                    "--resume: the checkpoint trains `{}` with seed {}; --model/--seed cannot change on resume",
                    meta.settings.model, meta.settings.seed
                )));
            }
            meta.spec.clone()
        }
        None => foldmoe::models::by_name(&settings.model)
            .map_err(|e| CliError::usage(format!("--model {}: {e}", settings.model)))?,
    };
    let (params_total, _) = spec.param_counts();
    if params_total > CPU_PARAM_LIMIT {
        return Err(CliError::usage(format!(
            "--model {}: {:.1} B parameters is too large to train on the CPU (limit {:.1} B); train `{}-small` instead",
            settings.model,
            params_total as f64 / 1e9,
            CPU_PARAM_LIMIT as f64 / 1e9,
            settings.model
        )));
    }
    let seqs = settings.sequences_per_micro_batch(spec.seq_len)?;
    let out = opts
        .out
        .clone()
        .or_else(|| opts.resume.clone())
        .unwrap_or_else(default_out_dir);
    prepare_out(&out, resumed.is_some())?;

    let train_ds = TextDataset::from_text(TRAIN_TEXT);
    let val_ds = TextDataset::from_text(VAL_TEXT);
    let val_batch = upload_batch(
        b,
        val_ds.eval_batch(VAL_WINDOWS, spec.seq_len)?,
        VAL_WINDOWS,
        spec.seq_len,
    )?;

    let (mut trainer, mut meta) = match resumed {
        Some((tensors, mut meta)) => {
            meta.settings = settings.clone();
            let mut trainer = load_trainer(b, &meta, tensors)?;
            trainer.cfg = trainer_config(&settings);
            (trainer, meta)
        }
        None => {
            let model = Model::new(b, &spec, settings.seed, DType::F32)?;
            let trainer = Trainer::new(b, model, trainer_config(&settings))?;
            let meta = RunMeta {
                settings: settings.clone(),
                spec: spec.clone(),
                step: 0,
                sampler: BatchSampler::new(settings.seed),
                losses: Vec::new(),
                val_losses: Vec::new(),
                train_seconds: 0.0,
            };
            (trainer, meta)
        }
    };
    let (params_total, params_active) = trainer.model.param_counts();

    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out.join("metrics.jsonl"))
        .map_err(|e| CliError::io("cannot open", &out.join("metrics.jsonl"), e))?;
    let pb = ProgressBar::new(settings.steps);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("static template"),
    );
    pb.set_position(meta.step);
    say(&pb, format!(
        "foldmoe: training `{}` ({:.2} M parameters, {:.2} M active per token) on {}, {} tokens/step, run directory {}",
        spec.name,
        params_total as f64 / 1e6,
        params_active as f64 / 1e6,
        settings.device,
        settings.batch_tokens,
        out.display()
    ));

    let started = Instant::now();
    let first_step = meta.step;
    let mut last_val = meta.val_losses.last().map(|&(_, v)| v).unwrap_or(f64::NAN);
    while meta.step < settings.steps {
        if stop.load(Ordering::SeqCst) {
            meta.train_seconds += started.elapsed().as_secs_f64();
            save_checkpoint(b, &out, &trainer, &meta)?;
            pb.abandon();
            return Err(CliError::Interrupted {
                step: meta.step,
                dir: checkpoint_dir(&out).display().to_string(),
            });
        }
        if opts.exit_after.is_some_and(|n| meta.step - first_step >= n) {
            break;
        }
        let step_start = Instant::now();
        let mut micro = Vec::with_capacity(settings.micro_batches);
        for _ in 0..settings.micro_batches {
            let batch = meta.sampler.next_batch(&train_ds, seqs, spec.seq_len)?;
            micro.push(upload_batch(b, batch, seqs, spec.seq_len)?);
        }
        let stats = match trainer.step(b, &micro) {
            Ok(stats) => stats,
            Err(e) => {
                pb.abandon();
                return Err(CliError::usage(format!(
                    "training stopped at step {}: {e}; the last good checkpoint is kept in {}",
                    meta.step + 1,
                    checkpoint_dir(&out).display()
                )));
            }
        };
        meta.step += 1;
        meta.losses.push(stats.loss);
        let tokens_per_s = settings.batch_tokens as f64 / step_start.elapsed().as_secs_f64();
        let eval_now = meta.step % settings.eval_every == 0 || meta.step == settings.steps;
        if eval_now {
            last_val = validation_loss(b, &trainer.model, &val_batch)?;
            meta.val_losses.push((meta.step, last_val));
        }
        let record = serde_json::json!({
            "step": meta.step,
            "loss": stats.loss,
            "aux_loss": stats.aux_loss,
            "val_loss": if eval_now { Some(last_val) } else { None },
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "load_imbalance": stats.load_imbalance,
            "tokens_per_s": tokens_per_s,
        });
        writeln!(metrics, "{record}")
            .map_err(|e| CliError::io("cannot write", &out.join("metrics.jsonl"), e))?;
        let line = format!(
            "step {:>4} | loss {:.4} | val {:.4} | {:>6.0} tok/s | lr {:.2e} | imbalance {:.2}",
            meta.step, stats.loss, last_val, tokens_per_s, stats.lr, stats.load_imbalance
        );
        pb.set_message(line.clone());
        pb.inc(1);
        if eval_now {
            say(&pb, line);
        }
        if meta.step % settings.checkpoint_every == 0 {
            let mut snapshot = meta.clone();
            snapshot.train_seconds += started.elapsed().as_secs_f64();
            save_checkpoint(b, &out, &trainer, &snapshot)?;
        }
    }
    let session_seconds = started.elapsed().as_secs_f64();
    meta.train_seconds += session_seconds;
    save_checkpoint(b, &out, &trainer, &meta)?;
    pb.finish();
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
    };
    let summary_path = out.join("summary.json");
    let json = serde_json::to_string_pretty(&summary)
        .map_err(|e| CliError::io("cannot encode", &summary_path, e))?;
    std::fs::write(&summary_path, json)
        .map_err(|e| CliError::io("cannot write", &summary_path, e))?;
    crate::plot::loss_png(&out.join("loss.png"), &meta.losses, &meta.val_losses)?;
    if settings.sample_tokens > 0 && meta.step == settings.steps {
        let prompt = "And God said";
        let tok = ByteTokenizer;
        let ids = crate::generate::sample(
            b,
            &trainer.model,
            &tok.encode(prompt),
            settings.sample_tokens,
            0.8,
            settings.seed,
        )?;
        println!("\nsample: {prompt}{}\n", tok.decode(&ids));
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
