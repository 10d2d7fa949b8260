//! `foldmoe plan`: what a model costs and how a layout places it, before
//! anything runs — parameters, training FLOPs per token, the process groups
//! of a rank, checked by the same layout rules as `#[moe_model]`, and the
//! rank's memory and communication (`foldmoe_core::memory`).

use std::path::Path;

use foldmoe::core::config::ModelConfig;
use foldmoe::core::layout::{self, GroupKind, LayoutSpec};
use foldmoe::core::memory::{self, MemoryOptions, MemoryPlan, GIB};
use foldmoe::core::spec::{keywords, ModelSpec, PolicyOverride};
use serde::Serialize;

use crate::cli::error::CliError;

/// Most tokens per step a plan is made for (2^32: no run comes near it, and
/// every byte count stays exact).
const MAX_PLAN_TOKENS: u128 = 1 << 32;

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
    /// The activation policy planned: `declared` or the flags given.
    policy: String,
    memory: MemoryPlan,
    memory_total_gib: f64,
}

/// The memory flags of `foldmoe plan`.
pub struct MemoryFlags<'a> {
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per step on each dp rank (`None`: pp).
    pub micro_batches: Option<usize>,
    /// `--recompute LIST`, replacing every group's recompute parts.
    pub recompute: Option<&'a str>,
    /// `--offload LIST`, replacing every group's offloaded parts.
    pub offload: Option<&'a str>,
    /// `--store-fp8 LIST`, replacing every group's fp8-stored parts.
    pub store_fp8: Option<&'a str>,
    /// `--overlap-moe-expert-parallel-comm`: one more chunk in flight.
    pub overlap_moe_comm: bool,
}

/// Devices the plan's total is compared with, by the memory `nvidia-smi`
/// reports (81559 MiB and 143771 MiB), in GiB.
const DEVICES: [(&str, f64); 2] = [("H100 80 GB", 79.6), ("H200 141 GB", 140.4)];

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
            ModelSource::Name(name) => super::registry()
                .layouts(name)
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
    flags: &MemoryFlags,
) -> Result<String, CliError> {
    let (mut spec, declared) = model.load()?;
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
    if flags.micro_batch_size == 0 || flags.micro_batches == Some(0) {
        return Err(CliError::usage(
            "--micro-batch-size and --micro-batches must be at least 1".to_string(),
        ));
    }
    // Tokens of a step must stay far inside exact arithmetic (the planner
    // works in u64 bytes and f64 products).
    let step_tokens = (flags.micro_batch_size as u128)
        * (spec.seq_len as u128)
        * (flags.micro_batches.unwrap_or(1) as u128);
    if step_tokens > MAX_PLAN_TOKENS {
        return Err(CliError::usage(format!(
            "--micro-batch-size {} × seq_len {} × --micro-batches {}: {step_tokens} tokens a step; \
             at most {MAX_PLAN_TOKENS} (2^32)",
            flags.micro_batch_size,
            spec.seq_len,
            flags.micro_batches.unwrap_or(1)
        )));
    }
    // The same lists and rules as `foldmoe train`'s flags.
    let over = PolicyOverride::parse(flags.recompute, flags.offload, flags.store_fp8)
        .map_err(CliError::usage)?;
    over.apply(&mut spec);
    let given: Vec<String> = [
        ("--recompute", flags.recompute),
        ("--offload", flags.offload),
        ("--store-fp8", flags.store_fp8),
    ]
    .iter()
    .filter_map(|(flag, list)| list.map(|l| format!("{flag} {l}")))
    .collect();
    let policy = if given.is_empty() {
        "declared".to_string()
    } else {
        given.join(" ")
    };
    let mem = memory::plan_memory(
        &spec,
        &layout,
        &MemoryOptions {
            overlap_moe_comm: flags.overlap_moe_comm,
            ..MemoryOptions::new(
                rank,
                flags.micro_batch_size,
                flags.micro_batches.unwrap_or(layout.pp),
            )
        },
    );
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
        policy,
        memory_total_gib: mem.total as f64 / GIB,
        memory: mem,
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
    out.push_str(&memory_table(&plan, &spec));
    Ok(out)
}

/// The memory table of the plan's rank and its communication per step.
fn memory_table(plan: &Plan, spec: &ModelSpec) -> String {
    let m = &plan.memory;
    let gib = |b: u64| format!("{:.2}", b as f64 / GIB);
    let blocks: Vec<String> = m.layers.iter().map(|(a, b)| format!("{a}..{b}")).collect();
    let mut out = format!(
        "memory per GPU of rank {} (pp stage {}, blocks {}; micro-batch {} × {} tokens, {} micro-batches per step, {} in flight), GiB:\n  policy: {}{}\n",
        m.rank,
        m.pp_stage,
        blocks.join(", "),
        m.micro_batch_size,
        m.seq_len,
        m.micro_batches,
        m.in_flight,
        plan.policy,
        if plan.policy == "declared" {
            declared_policies(spec)
        } else {
            String::new()
        },
    );
    out.push_str(&format!(
        "    {:<16}{:>10}{:>9}{:>9}{:>11}{:>11}{:>13}{:>11}\n",
        "part",
        "params M",
        "weights",
        "grads",
        "optimizer",
        "act/µbatch",
        "activations",
        "offloaded"
    ));
    let row = |name: &str, params: u64, w: u64, g: u64, o: u64, a1: u64, a: u64, h: u64| {
        format!(
            "    {name:<16}{:>10.1}{:>9}{:>9}{:>11}{:>11}{:>13}{:>11}\n",
            params as f64 / 1e6,
            gib(w),
            gib(g),
            gib(o),
            gib(a1),
            gib(a),
            gib(h)
        )
    };
    for p in &m.parts {
        out.push_str(&row(
            p.part,
            p.params,
            p.weights,
            p.grads,
            p.optimizer,
            p.activations_per_micro_batch,
            p.activations,
            p.offloaded,
        ));
    }
    out.push_str(&row(
        "sum",
        m.sum(|p| p.params),
        m.sum(|p| p.weights),
        m.sum(|p| p.grads),
        m.sum(|p| p.optimizer),
        m.sum(|p| p.activations_per_micro_batch),
        m.sum(|p| p.activations),
        m.sum(|p| p.offloaded),
    ));
    out.push_str(&format!(
        "    comm buffers {} (send + receive of the largest all-to-all dispatch, tokens·top_k·hidden·2 B, and of pipeline p2p)\n",
        gib(m.comm_buffers)
    ));
    out.push_str(&format!(
        "    step buffers {} (the optimizer step's flat copies of the largest bucket: gradients, then values)\n",
        gib(m.step_buffers)
    ));
    if m.fp8_weight_cache > 0 {
        out.push_str(&format!(
            "    fp8 weight cache {} (the fp8 experts' weights in both layouts, kept for the step's micro-batches)\n",
            gib(m.fp8_weight_cache)
        ));
    }
    let fits: Vec<String> = DEVICES
        .iter()
        .map(|(name, gib_avail)| {
            let verdict = if (m.total as f64) < *gib_avail * GIB {
                "fits"
            } else {
                "does NOT fit"
            };
            format!("{verdict} in an {name} ({gib_avail} GiB)")
        })
        .collect();
    out.push_str(&format!(
        "  total {} GiB on rank {} ({}; before allocator fragmentation and framework overhead)\n",
        gib(m.total),
        m.rank,
        fits.join(", ")
    ));
    out.push_str(&format!("communication per step from rank {}:\n", m.rank));
    for c in &m.comm {
        out.push_str(&format!(
            "    {:<6} ({:>4} ranks) {:>10} GiB  {}\n",
            c.group,
            c.size,
            gib(c.bytes_per_step),
            c.what
        ));
    }
    out
}

/// `(recompute …; offload …)` of each group, for the table's policy line.
fn declared_policies(spec: &ModelSpec) -> String {
    let groups: Vec<String> = spec
        .groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let names = |v: Vec<&str>| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    v.join(",")
                }
            };
            let r = g
                .policy
                .recompute
                .iter()
                .map(|p| keywords::name_of(keywords::RECOMPUTE, *p));
            let o = g
                .policy
                .offload
                .iter()
                .map(|p| keywords::name_of(keywords::OFFLOAD, *p));
            let f = g
                .policy
                .store_fp8
                .iter()
                .map(|p| keywords::name_of(keywords::OFFLOAD, *p));
            format!(
                "groups[{i}] recompute {} offload {} store_fp8 {}",
                names(r.collect()),
                names(o.collect()),
                names(f.collect())
            )
        })
        .collect();
    format!(" ({})", groups.join("; "))
}
