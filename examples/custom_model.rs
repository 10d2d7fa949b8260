//! A model declared outside `foldmoe-models`: an annotated struct is the whole
//! architecture table, checked when this file compiles (a layout whose `ep`
//! did not divide `experts` would not build). One rank's shard of its cluster
//! layout is built, then the whole model on the CPU under its one-rank
//! layout (`world = 1`), which the trainer trains a few steps on the bundled
//! text.
//!
//! Run with `cargo run --release --example custom_model`.

use std::time::Duration;

use foldmoe_core::engine::declared::{LayoutChoice, MoeModel};
use foldmoe_core::engine::parallel::{run_local_layout, Trainer};
use foldmoe_core::engine::trainer::TrainConfig;
use foldmoe_core::engine::EngineError;
use foldmoe_core::layout;
use foldmoe_data::{BatchSampler, TextDataset};
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::DType;
use foldmoe_macros::moe_model;

#[moe_model(name = "byte-moe", vocab = 256, hidden = 64, seq_len = 64, norm_eps = 1e-5,
    layout(name = "laptop", world = 1),
    // A cluster layout (checked at compile time): each rank builds its shard.
    layout(name = "dgx-h100", world = 8, tp = 2, ep = 8))]
/// A two-group byte-level MoE language model.
pub struct ByteMoe {
    /// One dense block.
    #[blocks(
        count = 1,
        attention(heads = 4, kv_heads = 2, head_dim = 16),
        dense(ffn = 192)
    )]
    dense: Blocks,
    /// Two MoE blocks: 8 experts, top-2, a gated shared expert.
    #[blocks(
        count = 2,
        attention(heads = 4, kv_heads = 2, head_dim = 16),
        moe(
            experts = 8,
            top_k = 2,
            expert_ffn = 64,
            shared_experts = 1,
            shared_gate,
            aux_coef = 1e-2,
            z_loss = 1e-3
        ),
        recompute(moe_act)
    )]
    moe: Blocks,
}

const TEXT: &str = include_str!("../data/train.txt");

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let b = Cpu;
    let spec = <ByteMoe<Cpu> as MoeModel<Cpu>>::spec();
    println!(
        "{}: {} blocks; layouts: {}",
        spec.name,
        spec.layers(),
        ByteMoeLayout::ALL
            .iter()
            .map(|l| l.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Rank 3 of the 8-GPU layout: half the heads (tp = 2), one of the 8
    // experts (ep = 8), cut from the same seeded weights as every other rank.
    let shard = ByteMoe::new(&b, ByteMoeLayout::DgxH100, 3, 42, DType::F32)?.into_model();
    let mut experts = Vec::new();
    shard.visit_experts(&mut |p| experts.push(format!("{} {:?}", p.name, p.value.shape())));
    println!("dgx-h100 rank 3 holds {}", experts.join(", "));

    let model = ByteMoe::new(&b, ByteMoeLayout::Laptop, 0, 42, DType::F32)?;
    println!(
        "dense group: {} block(s), MoE group: {} block(s)",
        model.dense.len(),
        model.moe.len()
    );
    let cfg = TrainConfig {
        lr: 3e-3,
        warmup_steps: 2,
        total_steps: 10,
        ..TrainConfig::default()
    };
    let data = TextDataset::from_text(TEXT);
    let (batch, seq) = (4, spec.seq_len);
    let laptop = layout::check(&ByteMoeLayout::Laptop.spec(), &spec)
        .map_err(|errs| format!("layout laptop: {errs:?}"))?;
    let results = run_local_layout(&b, &laptop, Duration::from_secs(600), |ctx| {
        let shard = ByteMoe::new(ctx.b, ByteMoeLayout::Laptop, 0, 42, DType::F32)?.into_model();
        let mut trainer = Trainer::new(ctx.b, shard, cfg)?;
        let mut sampler = BatchSampler::new(42);
        for step in 1..=10 {
            let micro_batch = sampler
                .next_batch(&data, batch, seq)
                .map_err(|e| EngineError::Invalid(e.to_string()))?;
            let stats = trainer.step(ctx, &[micro_batch], seq)?;
            println!(
                "step {step:2}: loss {:.4}, aux {:.4}, lr {:.2e}",
                stats.loss, stats.aux_loss, stats.lr
            );
        }
        Ok(())
    });
    for result in results {
        result?;
    }
    Ok(())
}
