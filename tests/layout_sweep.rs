//! The rules accept exactly what the engine runs (docs/ARCHITECTURE.md §3):
//! every layout of W ≤ 8 ranks that `layout::check` accepts for a small
//! shipped model (declared in `foldmoe-models`; their config-file twins
//! read to the same spec, `models/src/tests.rs`) builds every rank's shard
//! and trains one step on the CPU, ranks as threads, with a finite loss
//! equal on every rank.
//!
//! The models are cut to two blocks (one of each kind they have: dense and
//! MoE, or two MoE; DeepSeek-V3-small keeps its MTP module) and one
//! sequence of 16 tokens, so a layout is what is
//! tested, not the model's size; `pp` ranges up to the two blocks.

use std::time::{Duration, Instant};

use foldmoe_core::engine::model::Model;
use foldmoe_core::engine::parallel::{run_local_layout, RankLayout, Trainer};
use foldmoe_core::engine::trainer::TrainConfig;
use foldmoe_core::engine::EngineError;
use foldmoe_core::layout::{self, Layout};
use foldmoe_core::spec::{FfnSpec, ModelSpec};
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::DType;

const SEQ: usize = 16;

/// The shipped small models, cut to two blocks and a short sequence.
fn small_models() -> Vec<ModelSpec> {
    let registry = foldmoe_models::registry();
    let names: Vec<String> = registry
        .names()
        .into_iter()
        .filter(|n| *n == "tiny" || n.ends_with("-small"))
        .map(str::to_string)
        .collect();
    assert!(names.len() >= 5, "small models: {names:?}");
    names
        .iter()
        .map(|n| {
            let mut spec = registry.spec(n).unwrap();
            // Keep the last dense block (if any) and the first MoE block.
            let mut groups = Vec::new();
            if let Some(dense) = spec
                .groups
                .iter()
                .find(|g| matches!(g.ffn, FfnSpec::Dense { .. }))
            {
                let mut g = dense.clone();
                g.count = 1;
                groups.push(g);
            }
            let moe = spec
                .groups
                .iter()
                .find(|g| matches!(g.ffn, FfnSpec::Moe(_)))
                .unwrap();
            let mut g = moe.clone();
            g.count = if groups.is_empty() { 2 } else { 1 };
            groups.push(g);
            spec.groups = groups;
            spec.seq_len = SEQ;
            spec.check().unwrap_or_else(|e| panic!("{n} cut: {e:?}"));
            spec
        })
        .collect()
}

/// One step of `spec` under `layout`: every rank's loss.
fn one_step(spec: &ModelSpec, layout: &Layout) -> Vec<Result<f64, EngineError>> {
    let micro = layout.pp.max(1);
    run_local_layout(&Cpu, layout, Duration::from_secs(120), |ctx| {
        let rank = RankLayout::new(layout, ctx.rank.rank)?;
        let model = Model::new(ctx.b, spec, rank, 11, DType::F32)?;
        let mut trainer = Trainer::new(ctx.b, model, TrainConfig::default())?;
        let batches: Vec<(Vec<i32>, Vec<i32>)> = (0..micro)
            .map(|m| {
                let d = ctx.rank.dp_index * micro + m;
                let ids: Vec<i32> = (0..=SEQ)
                    .map(|i| ((i * 7 + d * 13) % spec.vocab) as i32)
                    .collect();
                (ids[..SEQ].to_vec(), ids[1..].to_vec())
            })
            .collect();
        Ok(trainer.step(ctx, &batches, SEQ)?.loss)
    })
}

#[test]
fn every_valid_layout_up_to_8_ranks_trains_a_step() {
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut runs = 0;
    for spec in small_models() {
        for world in 1..=8 {
            for layout in layout::valid_layouts(world, &spec) {
                runs += 1;
                let losses = one_step(&spec, &layout);
                let mut values = Vec::new();
                for (r, l) in losses.into_iter().enumerate() {
                    match l {
                        Ok(v) if v.is_finite() => values.push(v),
                        Ok(v) => failures
                            .push(format!("{} {}: rank {r}: loss {v}", spec.name, layout.name)),
                        Err(e) => {
                            failures.push(format!("{} {}: rank {r}: {e}", spec.name, layout.name))
                        }
                    }
                }
                if values.windows(2).any(|w| w[0] != w[1]) {
                    failures.push(format!(
                        "{} {}: ranks disagree: {values:?}",
                        spec.name, layout.name
                    ));
                }
            }
        }
    }
    println!(
        "{runs} model × layout runs in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(runs > 50, "only {runs} runs");
    assert!(
        failures.is_empty(),
        "{} of {runs} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
