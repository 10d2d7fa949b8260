//! `foldmoe convert`: Hugging Face checkpoints in (`--from-hf DIR`) and out
//! (`--to-hf CKPT`), through `foldmoe::core::engine::hf`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use foldmoe::core::engine::checkpoint::Source;
use foldmoe::core::engine::hf::{self, ExpertLayout, ExportDtype, HfConfig};
use foldmoe::core::layout::{self, LayoutSpec};
use foldmoe::data::BatchSampler;
use serde::{Deserialize, Serialize};

use crate::cli::error::CliError;
use crate::cli::settings::TrainSettings;
use crate::cli::train::RunMeta;

/// Where an imported model came from: its `config.json` (written back on
/// export) and its expert layout.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HfOrigin {
    /// The `config.json` imported.
    pub config: serde_json::Map<String, serde_json::Value>,
    /// Per-expert or fused experts.
    pub experts: ExpertLayout,
}

/// `foldmoe convert` flags.
#[derive(Args, Debug)]
pub struct ConvertOptions {
    /// Hugging Face model directory to import (`config.json` and
    /// `model.safetensors` or shards with `model.safetensors.index.json`).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "to_hf",
        required_unless_present = "to_hf"
    )]
    pub from_hf: Option<PathBuf>,
    /// foldmoe checkpoint (run or checkpoint directory) to export.
    #[arg(long, value_name = "CKPT")]
    pub to_hf: Option<PathBuf>,
    /// The checkpoint directory (import) or Hugging Face directory (export)
    /// to write; must be absent or empty.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Import: the parallel layout the checkpoint's files are cut for (e.g.
    /// `world=8,tp=2,ep=8`); any layout reads it back. Default one rank.
    #[arg(long, value_name = "SPEC")]
    pub layout: Option<String>,
    /// Export: `per-expert` (what `save_pretrained` writes) or `fused`
    /// (`experts.gate_up_proj`, `experts.down_proj`); default the layout the
    /// model was imported in, else per-expert.
    #[arg(long, value_name = "LAYOUT")]
    pub experts: Option<String>,
    /// Export: most bytes in one safetensors file before the next shard
    /// (then `model.safetensors.index.json` lists them).
    #[arg(long, value_name = "BYTES", default_value_t = 5_000_000_000)]
    pub max_shard_bytes: u64,
    /// Export: the tensors' dtype, `bf16` or `f32`; default what the
    /// imported `config.json`'s `torch_dtype` says, else the checkpoint's
    /// training dtype.
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
}

/// Runs `convert`; returns the line it prints.
pub fn run(o: &ConvertOptions) -> Result<String, CliError> {
    check_out(&o.out)?;
    let start = Instant::now();
    match (&o.from_hf, &o.to_hf) {
        (Some(dir), None) => {
            if o.experts.is_some() || o.dtype.is_some() {
                return Err(CliError::usage(
                    "--experts and --dtype apply to --to-hf".to_string(),
                ));
            }
            let cfg = hf::read_config(dir)?;
            let text = o.layout.as_deref().unwrap_or("world=1");
            let spec = LayoutSpec::parse(text)
                .map_err(|e| CliError::usage(format!("--layout {text}: {e}")))?;
            let layout = layout::check(&spec, &cfg.spec).map_err(|errors| {
                let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                CliError::usage(format!("--layout {text}: {}", msgs.join("; ")))
            })?;
            let experts = hf::expert_layout(dir, &cfg)?;
            hf::import(dir, &cfg, &layout, &o.out, &import_meta(&cfg, experts))?;
            let (total, _) = cfg.spec.param_counts();
            Ok(format!(
                "converted {} ({}, {:.2} M parameters, {} experts) to {} for layout {text} in {:.2} s",
                dir.display(),
                cfg.family.model_type(),
                total as f64 / 1e6,
                experts_name(experts),
                o.out.display(),
                start.elapsed().as_secs_f64()
            ))
        }
        (None, Some(ckpt)) => {
            if o.layout.is_some() {
                return Err(CliError::usage("--layout applies to --from-hf".to_string()));
            }
            let (source, meta): (Source, RunMeta) = Source::open(ckpt)?;
            let cfg = export_config(&meta)?;
            let experts = match o.experts.as_deref() {
                Some("per-expert") => ExpertLayout::PerExpert,
                Some("fused") => ExpertLayout::Fused,
                Some(other) => {
                    return Err(CliError::usage(format!(
                        "--experts {other}: choose per-expert or fused"
                    )))
                }
                None => meta
                    .hf
                    .as_ref()
                    .map_or(ExpertLayout::PerExpert, |h| h.experts),
            };
            let dtype = match o.dtype.as_deref() {
                Some(d) => ExportDtype::parse(d)?,
                // An imported model's own dtype, else the one it trained in.
                None => meta
                    .hf
                    .as_ref()
                    .and_then(|h| ExportDtype::of_config(&h.config))
                    .unwrap_or(if meta.settings.dtype == "bf16" {
                        ExportDtype::Bf16
                    } else {
                        ExportDtype::F32
                    }),
            };
            let files = hf::export(&source, &cfg, experts, &o.out, o.max_shard_bytes, dtype)?;
            Ok(format!(
                "exported {} (step {}) as {} with {} experts in {} to {} ({} files) in {:.2} s",
                source.dir().display(),
                source.step(),
                cfg.family.model_type(),
                experts_name(experts),
                match dtype {
                    ExportDtype::F32 => "f32",
                    ExportDtype::Bf16 => "bf16",
                },
                o.out.display(),
                files.len(),
                start.elapsed().as_secs_f64()
            ))
        }
        _ => Err(CliError::usage(
            "give one of --from-hf DIR or --to-hf CKPT".to_string(),
        )),
    }
}

fn experts_name(e: ExpertLayout) -> &'static str {
    match e {
        ExpertLayout::PerExpert => "per-expert",
        ExpertLayout::Fused => "fused",
    }
}

/// `out` must not hold anything yet.
fn check_out(out: &Path) -> Result<(), CliError> {
    if let Ok(mut entries) = std::fs::read_dir(out) {
        if entries.next().is_some() {
            return Err(CliError::usage(format!(
                "--out {}: not empty; give a new directory",
                out.display()
            )));
        }
        std::fs::remove_dir(out).map_err(|e| CliError::io("--out: cannot use", out, e))?;
    }
    Ok(())
}

/// The run state of an imported model: step 0, default settings for its
/// spec, and where it came from.
fn import_meta(cfg: &HfConfig, experts: ExpertLayout) -> RunMeta {
    let settings = TrainSettings {
        model: cfg.spec.name.clone(),
        ..TrainSettings::default()
    };
    RunMeta {
        sampler: BatchSampler::new(settings.seed),
        settings,
        spec: cfg.spec.clone(),
        step: 0,
        losses: Vec::new(),
        val_losses: Vec::new(),
        train_seconds: 0.0,
        data_fingerprint: None,
        hf: Some(HfOrigin {
            config: cfg.raw.clone(),
            experts,
        }),
    }
}

/// The Hugging Face config an export writes: the imported one when the
/// model came from Hugging Face (checked to still describe the model),
/// else one made from the spec.
fn export_config(meta: &RunMeta) -> Result<HfConfig, CliError> {
    if let Some(origin) = &meta.hf {
        let text = serde_json::Value::Object(origin.config.clone()).to_string();
        let cfg = hf::config::parse(&text, "the imported config.json")?;
        let mut spec = cfg.spec.clone();
        spec.name = meta.spec.name.clone();
        // Policies are training choices, not part of the model.
        for (g, m) in spec.groups.iter_mut().zip(&meta.spec.groups) {
            g.policy = m.policy.clone();
        }
        if spec == meta.spec {
            return Ok(HfConfig {
                spec: meta.spec.clone(),
                ..cfg
            });
        }
    }
    let (family, raw) = hf::config::to_config(&meta.spec)?;
    Ok(HfConfig {
        family,
        spec: meta.spec.clone(),
        raw,
        rope_interleave: false,
        fp8_block: None,
    })
}
