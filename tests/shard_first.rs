//! Shard-first start-up: a rank of a layout allocates only its shard while it
//! builds its model and optimizer state, and the shards are blocks of exactly
//! the weights one rank draws.

use std::collections::HashMap;

use foldmoe_core::engine::parallel::shard::place_block;
use foldmoe_core::engine::parallel::{RankLayout, Trainer};
use foldmoe_core::engine::trainer::TrainConfig;
use foldmoe_core::engine::{model::Model, Module};
use foldmoe_core::layout::{self, LayoutSpec};
use foldmoe_core::spec::{AttentionSpec, BlockGroup, FfnSpec, ModelSpec, MoeSpec, RouterSpec};
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::{DType, Device};

/// A model whose weight is almost all routed experts: 32 experts of ffn 128
/// in two MoE blocks, a small dense part.
fn wide_experts() -> ModelSpec {
    let moe = MoeSpec {
        experts: 32,
        top_k: 2,
        expert_ffn: 128,
        shared_ffn: 0,
        shared_gate: false,
        router: RouterSpec::default(),
        capacity: None,
    };
    ModelSpec {
        name: "wide-experts".into(),
        vocab: 64,
        hidden: 32,
        seq_len: 16,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tied_embeddings: true,
        init_std: 0.02,
        groups: vec![BlockGroup::new(
            2,
            AttentionSpec::gqa(4, 2, 8),
            FfnSpec::Moe(moe),
        )],
        mtp_layers: 0,
        mtp_loss_coef: 0.1,
    }
}

#[test]
fn every_rank_allocates_only_its_shard_and_shards_are_the_one_rank_weights() {
    let spec = wide_experts();
    let layout = layout::check(&LayoutSpec::parse("world=16,ep=8").unwrap(), &spec).unwrap();
    // Parameters, f32 masters and two moments of the whole model, f32.
    let (params, _) = spec.param_counts();
    let full_bytes = params * 4 * 4;
    let one = Model::single(&Cpu, &spec, 11, DType::F32).unwrap();
    let mut want = HashMap::new();
    one.visit_params(&mut |p| {
        want.insert(p.name.clone(), Cpu.download(&p.value).unwrap().to_f64());
    });
    drop(one);
    let mut rebuilt: HashMap<String, Vec<f64>> = HashMap::new();
    for rank in 0..16 {
        // The allocation meter counts this thread's tensors: build each rank
        // here, one after another.
        Cpu.reset_peak_memory();
        let (before, _) = Cpu.memory_in_use();
        let model = Model::new(
            &Cpu,
            &spec,
            RankLayout::new(&layout, rank).unwrap(),
            11,
            DType::F32,
        )
        .unwrap();
        let trainer = Trainer::new(&Cpu, model, TrainConfig::default()).unwrap();
        let (after, peak) = Cpu.memory_in_use();
        let (shard, startup_peak) = ((after - before) as u64, (peak - before) as u64);
        println!("rank {rank}: shard {shard} B, start-up peak {startup_peak} B, whole model {full_bytes} B");
        assert!(
            full_bytes >= 8 * shard,
            "rank {rank}: shard {shard} B of {full_bytes} B"
        );
        assert!(
            startup_peak as f64 <= 1.05 * shard as f64,
            "rank {rank}: start-up peak {startup_peak} B over its shard of {shard} B"
        );
        let mut place = |p: &foldmoe_core::engine::Param<Cpu>| {
            let vals = Cpu.download(&p.value).unwrap().to_f64();
            match &p.shard {
                Some(s) => {
                    let full = rebuilt
                        .entry(p.name.clone())
                        .or_insert_with(|| vec![f64::NAN; s.full_shape.iter().product()]);
                    place_block(full, s, &vals);
                }
                None => {
                    let prev = rebuilt.insert(p.name.clone(), vals.clone());
                    assert!(
                        prev.is_none_or(|v| v == vals),
                        "{}: replicas differ",
                        p.name
                    );
                }
            }
        };
        trainer.model.visit_dense(&mut place);
        trainer.model.visit_experts(&mut place);
    }
    assert_eq!(rebuilt.len(), want.len());
    for (name, vals) in &rebuilt {
        let w = &want[name];
        assert!(
            vals.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: the shards do not rebuild the one-rank weights bit for bit"
        );
    }
}

/// Saving and loading a distributed checkpoint allocate, on every rank, at
/// most one tensor of its shard beyond the shard (a parameter or an
/// optimizer chunk): nothing is gathered, and pieces stream one at a time.
#[test]
fn save_and_load_allocate_at_most_one_tensor_beyond_the_shard() {
    use foldmoe_core::engine::checkpoint::{self, Source};
    use foldmoe_core::engine::parallel::run_local_layout;
    use std::time::Duration;
    let spec = wide_experts();
    let root = std::env::temp_dir().join(format!("foldmoe-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let layout = layout::check(&LayoutSpec::parse("world=4,tp=2,ep=4").unwrap(), &spec).unwrap();
    let batch: Vec<(Vec<i32>, Vec<i32>)> = (0..4)
        .map(|m| {
            let ids: Vec<i32> = (0..33).map(|i| (i * 7 + m * 3) % 64).collect();
            (ids[..32].to_vec(), ids[1..].to_vec())
        })
        .collect();
    let largest = |t: &Trainer<Cpu>| {
        let mut most = 0usize;
        t.model
            .visit_dense(&mut |p| most = most.max(p.value.numel() * 4));
        t.model
            .visit_experts(&mut |p| most = most.max(p.value.numel() * 4));
        most
    };
    // Save: every rank measures its own allocation while it writes.
    let saved = run_local_layout(&Cpu, &layout, Duration::from_secs(60), |ctx| {
        let rank = RankLayout::new(&layout, ctx.rank.rank)?;
        let model = Model::new(&Cpu, &spec, rank, 3, DType::F32)?;
        let mut trainer = Trainer::new(&Cpu, model, TrainConfig::default())?;
        let per = 4 / ctx.rank.dp.size();
        let dp_i = ctx.rank.dp_index;
        trainer.step(ctx, &batch[dp_i * per..(dp_i + 1) * per], 16)?;
        Cpu.reset_peak_memory();
        let (before, _) = Cpu.memory_in_use();
        let dir = checkpoint::save(ctx, &mut trainer, &root, &serde_json::json!({}), 2)?;
        let (_, peak) = Cpu.memory_in_use();
        Ok((dir, peak.saturating_sub(before), largest(&trainer), before))
    });
    let mut dir = None;
    for (r, result) in saved.into_iter().enumerate() {
        let (d, extra, one, shard) = result.unwrap();
        println!(
            "save: rank {r}: shard {shard} B, {extra} B more at most (largest parameter {one} B)"
        );
        assert!(
            extra <= one.max(1),
            "rank {r}: save allocated {extra} B beyond the shard"
        );
        dir = Some(d);
    }
    let source = Source::open::<serde_json::Value>(&dir.unwrap()).unwrap().0;
    // Load under another layout.
    let other = layout::check(&LayoutSpec::parse("world=2,ep=2").unwrap(), &spec).unwrap();
    let loaded = run_local_layout(&Cpu, &other, Duration::from_secs(60), |ctx| {
        let rank = RankLayout::new(&other, ctx.rank.rank)?;
        let model = Model::new(&Cpu, &spec, rank, 3, DType::F32)?;
        let mut trainer = Trainer::new(&Cpu, model, TrainConfig::default())?;
        // The largest optimizer chunk is the largest tensor a load replaces.
        let (mut chunk, mut total) = (0usize, 0usize);
        trainer.model.visit_dense(&mut |p| total += p.value.numel());
        let dense = total;
        trainer
            .model
            .visit_experts(&mut |p| total += p.value.numel());
        chunk = chunk.max(dense.max(total - dense) * 4);
        Cpu.reset_peak_memory();
        let (before, _) = Cpu.memory_in_use();
        checkpoint::load(&Cpu, &source, &mut trainer)?;
        let (_, peak) = Cpu.memory_in_use();
        assert_eq!(trainer.step_count(), 1);
        Ok((
            peak.saturating_sub(before),
            chunk.max(largest(&trainer)),
            before,
        ))
    });
    for (r, result) in loaded.into_iter().enumerate() {
        let (extra, one, shard) = result.unwrap();
        println!("load: rank {r}: shard {shard} B, {extra} B more at most (largest parameter or optimizer chunk {one} B)");
        assert!(
            extra <= one,
            "rank {r}: load allocated {extra} B beyond the shard"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
