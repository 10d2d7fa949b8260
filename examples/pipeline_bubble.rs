//! The pipeline bubble on the CPU: ranks as threads, 1F1B over 8
//! micro-batches, for pp = 2 and 4. Each stage's bubble is the time its
//! `accumulate` waited for other stages' activations and gradients, over the
//! time `accumulate` took; printed next to the 1F1B formula (pp−1)/(m+pp−1).
//!
//! `cargo run --release --example pipeline_bubble`

use std::time::{Duration, Instant};

use foldmoe_core::engine::model::Model;
use foldmoe_core::engine::parallel::{run_local_layout, RankLayout, Trainer};
use foldmoe_core::engine::trainer::TrainConfig;
use foldmoe_core::layout::{self, LayoutSpec};
use foldmoe_core::spec::{AttentionSpec, BlockGroup, FfnSpec, ModelSpec, MoeSpec};
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::DType;

const MICRO: usize = 8;
const SEQ: usize = 64;
const SEQS: usize = 2;
const STEPS: usize = 4;

/// Eight blocks (dense and MoE alternating), so every stage of pp ≤ 4 gets
/// two; the head's cost lands on the last stage, as in a real pipeline.
fn spec() -> ModelSpec {
    let attention = AttentionSpec::gqa(8, 4, 8);
    let moe = MoeSpec {
        experts: 8,
        top_k: 2,
        expert_ffn: 64,
        shared_ffn: 64,
        shared_gate: false,
        router: Default::default(),
        capacity: None,
    };
    let pair = [
        BlockGroup::new(1, attention.clone(), FfnSpec::Dense { ffn: 256 }),
        BlockGroup::new(1, attention.clone(), FfnSpec::Moe(moe)),
    ];
    ModelSpec {
        name: "bubble".into(),
        vocab: 256,
        hidden: 64,
        seq_len: SEQ,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tied_embeddings: false,
        init_std: 0.02,
        groups: (0..4).flat_map(|_| pair.clone()).collect(),
        mtp_layers: 0,
        mtp_loss_coef: 0.1,
    }
}

fn batch(step: usize) -> Vec<(Vec<i32>, Vec<i32>)> {
    let mut state = 0x2545_f491_4f6c_dd1du64 ^ step as u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % 256) as i32
    };
    (0..MICRO)
        .map(|_| {
            let stream: Vec<i32> = (0..SEQS * SEQ + 1).map(|_| next()).collect();
            (stream[..SEQS * SEQ].to_vec(), stream[1..].to_vec())
        })
        .collect()
}

fn main() {
    let spec = spec();
    for pp in [2usize, 4] {
        let text = format!("world={pp},pp={pp}");
        let layout = layout::check(&LayoutSpec::parse(&text).unwrap(), &spec).unwrap();
        let results = run_local_layout(&Cpu, &layout, Duration::from_secs(600), |ctx| {
            let rank = RankLayout::new(&layout, ctx.rank.rank)?;
            let model = Model::new(ctx.b, &spec, rank, 1, DType::F32)?;
            let mut trainer = Trainer::new(ctx.b, model, TrainConfig::default())?;
            let (mut busy, mut wait) = (Duration::ZERO, Duration::ZERO);
            for step in 0..STEPS {
                let started = Instant::now();
                trainer.accumulate(ctx, &batch(step), SEQ)?;
                // The first step warms allocations up; it is not counted.
                if step > 0 {
                    busy += started.elapsed();
                    wait += trainer.pipeline_wait;
                }
                ctx.comm.barrier(&ctx.rank.world)?;
            }
            Ok((busy, wait))
        });
        let per_stage: Vec<(Duration, Duration)> =
            results.into_iter().map(|r| r.unwrap()).collect();
        let fractions: Vec<f64> = per_stage
            .iter()
            .map(|(total, wait)| wait.as_secs_f64() / total.as_secs_f64())
            .collect();
        let mean = fractions.iter().sum::<f64>() / pp as f64;
        let formula = (pp - 1) as f64 / (MICRO + pp - 1) as f64;
        let step_s = per_stage[0].0.as_secs_f64() / (STEPS - 1) as f64;
        println!(
            "pp={pp} m={MICRO}: bubble per stage {:?}, mean {mean:.3}; formula (pp-1)/(m+pp-1) = {formula:.3}; {step_s:.3} s per accumulate",
            fractions
                .iter()
                .map(|f| format!("{f:.3}"))
                .collect::<Vec<_>>()
        );
    }
}
