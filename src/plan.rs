//! `foldmoe plan`: what a model costs and how a layout places it, before
//! anything runs — parameters, training FLOPs per token, and the process
//! groups of a rank, checked by the same layout rules as `#[moe_model]`.

use std::path::Path;

use foldmoe::core::config::ModelConfig;
use foldmoe::core::layout::{self, GroupKind, LayoutSpec};
use foldmoe::core::spec::ModelSpec;
use serde::Serialize;

use crate::error::CliError;

/// The plan of one model under one layout.
#[derive(Serialize)]
struct Plan {
    model: String,
    params_total: u64,
    params_active: u64,
    flops_per_token: u64,
    seq_len: usize,
    layout: String,
    rank: usize,
    groups: Vec<(String, Vec<usize>)>,
    notes: Vec<String>,
}

/// Which model to plan.
pub enum ModelSource<'a> {
    /// A shipped model by name (`--model`).
    Name(&'a str),
    /// A model config file (`--model-config`), read and checked by the same
    /// rules and messages as a `#[moe_model]` declaration.
    Config(&'a Path),
}

impl ModelSource<'_> {
    /// The model's spec and its declared layouts.
    fn load(&self) -> Result<(ModelSpec, Vec<LayoutSpec>), CliError> {
        match self {
            ModelSource::Name(name) => foldmoe::models::layouts_by_name(name)
                .map_err(|e| CliError::usage(format!("--model {name}: {e}"))),
            ModelSource::Config(path) => ModelConfig::load(path)
                .map(ModelConfig::into_parts)
                .map_err(|e| CliError::usage(format!("--model-config {e}"))),
        }
    }
}

/// Plans `model` under `layout_text` (else its first declared layout), with
/// `ranks` overriding the world size, for `rank`; JSON or a text table.
pub fn run(
    model: ModelSource,
    layout_text: Option<&str>,
    ranks: Option<usize>,
    rank: usize,
    json: bool,
) -> Result<String, CliError> {
    let (spec, declared) = model.load()?;
    let mut layout_spec = match layout_text {
        Some(text) => {
            LayoutSpec::parse(text).map_err(|e| CliError::usage(format!("--layout: {e}")))?
        }
        None => declared.into_iter().next().unwrap_or_default(),
    };
    if let Some(w) = ranks {
        layout_spec.world = w;
    }
    let layout = layout::check(&layout_spec, &spec).map_err(|errs| {
        let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        CliError::usage(format!("--layout: {}", msgs.join("; ")))
    })?;
    if rank >= layout.world {
        return Err(CliError::usage(format!(
            "--rank {rank}: must be below the world size {}",
            layout.world
        )));
    }
    let (params_total, params_active) = spec.param_counts();
    let plan = Plan {
        model: spec.name.clone(),
        params_total,
        params_active,
        flops_per_token: spec.flops_per_token(),
        seq_len: spec.seq_len,
        layout: layout.to_string(),
        rank,
        groups: GroupKind::ALL
            .iter()
            .map(|&k| (format!("{k:?}").to_lowercase(), layout.group_of(k, rank)))
            .collect(),
        notes: layout.notes.clone(),
    };
    if json {
        return serde_json::to_string_pretty(&plan)
            .map_err(|e| CliError::usage(format!("cannot encode the plan: {e}")));
    }
    let mut out = format!(
        "model {}\n  parameters        {:.3} B total, {:.3} B active per token\n  training FLOPs    {:.3} GFLOP per token (seq_len {})\nlayout {}\n  process groups of rank {}:\n",
        plan.model,
        params_total as f64 / 1e9,
        params_active as f64 / 1e9,
        plan.flops_per_token as f64 / 1e9,
        plan.seq_len,
        plan.layout,
        rank
    );
    for (kind, ranks) in &plan.groups {
        let shown: Vec<String> = ranks.iter().take(16).map(|r| r.to_string()).collect();
        let more = if ranks.len() > 16 {
            format!(", … ({} ranks)", ranks.len())
        } else {
            String::new()
        };
        out.push_str(&format!("    {kind:<10} [{}{more}]\n", shown.join(", ")));
    }
    for note in &plan.notes {
        out.push_str(&format!("  note: {note}\n"));
    }
    Ok(out)
}
