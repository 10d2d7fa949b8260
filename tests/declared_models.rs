//! Models declared with `#[moe_model]`, exercised through the engine: every
//! model `foldmoe_models` ships (its spec and each named layout checked again
//! by foldmoe-core's rules at run time, and found again by name), and a small
//! model declared here, built on the CPU.
//!
//! These were the `pass` cases of `dsl-macros/tests/ui.rs`; they live here
//! so that trybuild builds only the macro's light dependencies for its
//! compile-fail cases, not the engine and the kernels.

use foldmoe_core::engine::declared::{LayoutChoice, MoeModel};
use foldmoe_core::layout;
use foldmoe_core::spec::FfnSpec;
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::{DType, Device};
use foldmoe_macros::moe_model;
use foldmoe_models::{
    DeepSeekV3, DeepSeekV3Layout, DeepSeekV3Small, DeepSeekV3SmallLayout, Mixtral8x7b,
    Mixtral8x7bLayout, Mixtral8x7bSmall, Mixtral8x7bSmallLayout, Qwen3A22b, Qwen3A22bLayout,
    Qwen3A22bSmall, Qwen3A22bSmallLayout, Qwen3A3b, Qwen3A3bLayout, Qwen3A3bSmall,
    Qwen3A3bSmallLayout, Tiny, TinyLayout,
};

/// The declaration passed the macro; the runtime must agree on its spec and
/// on each layout, each layout must be found by its declared name, and the
/// model by its name. Returns the model's name.
fn check<M: MoeModel<Cpu, Layout = L>, L: LayoutChoice>() -> String {
    let spec = M::spec();
    let name = spec.name.clone();
    spec.check().unwrap_or_else(|e| panic!("{name}: {e:?}"));
    assert!(!L::ALL.is_empty(), "{name} declares no layout");
    for &choice in L::ALL {
        let l = choice.spec();
        assert_eq!(l.name, choice.name(), "{name}");
        layout::check(&l, &spec).unwrap_or_else(|e| panic!("{name} / {}: {e:?}", l.name));
        assert_eq!(L::by_name(&l.name), Ok(choice), "{name}");
    }
    let (by_name, layouts) = foldmoe_models::layouts_by_name(&name).unwrap();
    assert_eq!(by_name, spec, "{name}: by_name gives another spec");
    assert_eq!(layouts, M::layouts(), "{name}: by_name gives other layouts");
    name
}

#[test]
fn every_shipped_model_and_layout_checks() {
    let checked = [
        check::<Tiny<Cpu>, TinyLayout>(),
        check::<Mixtral8x7b<Cpu>, Mixtral8x7bLayout>(),
        check::<Mixtral8x7bSmall<Cpu>, Mixtral8x7bSmallLayout>(),
        check::<Qwen3A3b<Cpu>, Qwen3A3bLayout>(),
        check::<Qwen3A3bSmall<Cpu>, Qwen3A3bSmallLayout>(),
        check::<Qwen3A22b<Cpu>, Qwen3A22bLayout>(),
        check::<Qwen3A22bSmall<Cpu>, Qwen3A22bSmallLayout>(),
        check::<DeepSeekV3<Cpu>, DeepSeekV3Layout>(),
        check::<DeepSeekV3Small<Cpu>, DeepSeekV3SmallLayout>(),
    ];
    // A model shipped later must be added above.
    assert_eq!(checked.to_vec(), foldmoe_models::names());
}

#[moe_model(
    name = "pass-moe",
    vocab = 31,
    hidden = 16,
    seq_len = 8,
    norm_eps = 1e-6,
    rope_scaling(rope_type = yarn, factor = 4, original_max_position_embeddings = 4, mscale_all_dim = 1.0),
    layout(name = "cpu", world = 1),
    layout(name = "h100x8", world = 8, tp = 2, ep = 4, order = "tp-cp-ep-dp-pp"),
    layout(name = "cpu-ep4", world = 4, ep = 4),
    layout(name = "cpu-pp2", world = 2, pp = 2, pp_layers = [1, 2])
)]
/// A small model: a dense block, then two MoE blocks with every option the
/// macro takes.
pub struct PassMoe {
    /// The dense first block.
    #[blocks(
        count = 1,
        attention(heads = 4, kv_heads = 2, head_dim = 4),
        dense(ffn = 32)
    )]
    dense: Blocks,
    /// The MoE blocks.
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4, qk_norm),
        moe(experts = 4, top_k = 2, expert_ffn = 8, shared_experts = 1, shared_gate, z_loss = 1e-3,
            capacity(factor = 1.25, drop = position, pad = true)),
        recompute(moe_act, norm), offload(expert_fc1), precision = bf16)]
    moe: Blocks,
}

/// A model declared in place: its spec, typed layout enum and group fields.
/// Its vocabulary (31) does not divide tp = 2: that is padded, not refused
/// (docs/ARCHITECTURE.md §3), and the checked layout says so. `new` builds the
/// whole model under the one-rank layout and a rank's shard under the others.
#[test]
fn a_declared_model_builds_on_the_cpu() {
    let spec = <PassMoe<Cpu> as MoeModel<Cpu>>::spec();
    spec.check().unwrap();
    assert_eq!(spec.layers(), 3);
    let mut yarn = foldmoe_core::spec::RopeScaling::yarn(4.0, 4);
    yarn.mscale_all_dim = Some(1.0);
    assert_eq!(spec.rope_scaling, Some(yarn));
    assert!(spec.groups[1].attention.qk_norm && !spec.groups[0].attention.qk_norm);
    match &spec.groups[1].ffn {
        FfnSpec::Moe(m) => assert_eq!(m.shared_ffn, 8),
        FfnSpec::Dense { .. } => panic!("group 1 is MoE"),
    }
    assert_eq!(
        PassMoeLayout::ALL,
        &[
            PassMoeLayout::Cpu,
            PassMoeLayout::H100x8,
            PassMoeLayout::CpuEp4,
            PassMoeLayout::CpuPp2
        ]
    );
    assert_eq!(PassMoeLayout::H100x8.spec().ep, 4);
    let h100 = layout::check(&PassMoeLayout::H100x8.spec(), &spec).unwrap();
    assert_eq!(h100.padded_vocab, 32);
    assert!(
        h100.notes
            .iter()
            .any(|n| n.contains("vocab = 31 is padded to 32")),
        "{:?}",
        h100.notes
    );
    assert_eq!(PassMoeLayout::by_name("cpu"), Ok(PassMoeLayout::Cpu));

    let mut m = PassMoe::new(&Cpu, PassMoeLayout::Cpu, 0, 7, DType::F32).unwrap();
    assert_eq!(m.dense.len(), 1);
    assert_eq!(m.moe.len(), 2);
    assert_eq!(m.model().spec, spec);
    // The lent model has the groups; they are the fields' again after.
    assert_eq!(m.model().block_count(), 3);
    assert_eq!((m.dense.len(), m.moe.len()), (1, 2));

    // The vocabulary (31) does not divide tp = 2: the rank's shard holds
    // its balanced part of the rows (16 on tp rank 0, 15 on tp rank 1).
    let shard = PassMoe::<Cpu>::new(&Cpu, PassMoeLayout::H100x8, 5, 7, DType::F32)
        .unwrap()
        .into_model();
    if shard.owns_embed() {
        let want = if shard.rank.tp_index == 0 { 16 } else { 15 };
        assert_eq!(shard.embed.vocab(), want);
    }
    let err = PassMoe::<Cpu>::new(&Cpu, PassMoeLayout::H100x8, 8, 7, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("rank 8 is outside layout `h100x8`"), "{err}");

    // Under the expert-parallel layout, `new` builds the rank's shard, and
    // the typed accessors give the rank's blocks of each group: the dense
    // group its MLP, the MoE group its routers (all E experts), the rank's
    // E/ep = 1 routed experts and the shared experts.
    let m = PassMoe::<Cpu>::new(&Cpu, PassMoeLayout::CpuEp4, 3, 7, DType::F32).unwrap();
    assert_eq!((m.dense.len(), m.moe.len()), (1, 2));
    let (dense, moe) = (&m.dense, &m.moe);
    assert_eq!((dense.first_layer(), moe.first_layer()), (0, 1));
    assert_eq!(dense.mlp(0).unwrap().w1.value.shape(), &[16, 32]);
    assert_eq!(moe.router(1).unwrap().weight.value.shape(), &[16, 4]);
    assert_eq!(moe.experts(0).unwrap().w1.value.shape(), &[1, 16, 8]);
    assert_eq!(moe.experts(0).unwrap().w1.name, "blocks.1.moe.experts.w1");
    assert!(moe.shared_experts(1).is_some());
    assert!(moe.router(2).is_none() && dense.mlp(1).is_none());
    let shard = m.into_model();
    assert_eq!(shard.spec, spec);
    assert_eq!(shard.rank.rank, 3);
    assert_eq!(shard.rank.ep.size(), 4);
    assert_eq!(shard.rank.tp.size(), 1);
    assert_eq!(shard.block_count(), 3);
    assert_eq!(shard.embed.vocab(), 31);
}

#[moe_model(
    name = "pass-fp8",
    vocab = 32,
    hidden = 32,
    seq_len = 8,
    layout(name = "cpu", world = 1)
)]
/// Attention projections declared in fp8, on GQA and on MLA (whose routed
/// experts are declared in fp8 too).
pub struct PassFp8 {
    /// GQA with fp8 projections.
    #[blocks(count = 1,
        attention(heads = 2, kv_heads = 1, head_dim = 16, precision = fp8_blockwise),
        dense(ffn = 32))]
    gqa: Blocks,
    /// MLA with fp8 projections and fp8 experts.
    #[blocks(count = 1,
        attention(heads = 2, mla(q_lora_rank = 16, kv_lora_rank = 16, qk_nope_head_dim = 16,
            qk_rope_head_dim = 16, v_head_dim = 16), precision = fp8_blockwise),
        moe(experts = 4, top_k = 2, expert_ffn = 16), precision = fp8_blockwise)]
    mla: Blocks,
}

/// `attention(precision = fp8_blockwise)` passes the macro onto the spec and
/// turns on the built layers' fp8 projections (the layers' numerics are
/// checked in their own tests; this checks the declaration reaches them).
#[test]
fn declared_fp8_attention_reaches_the_layers() {
    use foldmoe_core::engine::block::Attn;
    use foldmoe_core::spec::GemmPrecision;
    let spec = <PassFp8<Cpu> as MoeModel<Cpu>>::spec();
    spec.check().unwrap();
    for g in &spec.groups {
        assert_eq!(g.attention.precision, GemmPrecision::Fp8Blockwise);
    }
    let m = PassFp8::new(&Cpu, PassFp8Layout::Cpu, 0, 7, DType::F32).unwrap();
    match m.gqa.attention(0) {
        Some(Attn::Gqa(a)) => assert!(a.fp8()),
        _ => panic!("block 0 has GQA attention"),
    }
    match m.mla.attention(0) {
        Some(Attn::Mla(a)) => assert!(a.fp8),
        _ => panic!("block 1 has MLA attention"),
    }
    assert!(m.mla.experts(0).unwrap().fp8);
}

/// Each `#[blocks]` field is the group itself, as this rank holds it: what
/// is changed through a field is what the engine model trains, the struct
/// visits its parameters in the engine model's order, a pipeline stage
/// without a group has it empty, and a model of another spec is refused.
#[test]
fn group_fields_own_the_rank_blocks() {
    use foldmoe_core::engine::Module;

    let mut m = PassMoe::<Cpu>::new(&Cpu, PassMoeLayout::Cpu, 0, 7, DType::F32).unwrap();
    let mut names = Vec::new();
    m.visit_params(&mut |p| names.push(p.name.clone()));
    // Typed mutable access: zero the second MoE block's router.
    let router = m.moe.router_mut(1).unwrap();
    let shape = router.weight.value.shape().to_vec();
    router.weight.value = Cpu.zeros(&shape, DType::F32).unwrap();
    assert!(m.dense.mlp_mut(0).is_some() && m.moe.experts_mut(0).is_some());
    let model = m.into_model();
    let mut engine_names = Vec::new();
    model.visit_params(&mut |p| engine_names.push(p.name.clone()));
    assert_eq!(
        names, engine_names,
        "the struct visits in the engine's order"
    );
    let zeroed = model
        .blocks()
        .nth(2)
        .and_then(|blk| blk.moe())
        .map(|moe| Cpu.download(&moe.router.weight.value).unwrap().to_f64())
        .unwrap();
    assert!(zeroed.iter().all(|&w| w == 0.0) && !zeroed.is_empty());
    let groups = model.groups();
    assert_eq!(groups.len(), 2);
    assert_eq!((groups[0].kind(), groups[1].kind()), ("dense", "MoE"));
    assert_eq!(groups[1].blocks().layers(), &[1, 2]);

    // Back into the struct: the same groups.
    let m = PassMoe::<Cpu>::from_model(model).unwrap();
    assert_eq!((m.dense.len(), m.moe.len()), (1, 2));

    // Pipeline stage 1 of `pp_layers = [1, 2]` holds no dense block.
    for (rank, (dense, moe)) in [(1usize, 0usize), (0, 2)].into_iter().enumerate() {
        let m = PassMoe::<Cpu>::new(&Cpu, PassMoeLayout::CpuPp2, rank, 7, DType::F32).unwrap();
        assert_eq!((m.dense.len(), m.moe.len()), (dense, moe), "rank {rank}");
        assert_eq!(m.dense.declared_layers(), 0..1);
        assert_eq!(m.moe.first_layer(), 1);
        assert_eq!(m.dense.is_empty(), rank == 1);
    }

    // A model of another spec is not this struct's.
    let tiny =
        foldmoe_models::Tiny::<Cpu>::new(&Cpu, foldmoe_models::TinyLayout::Cpu, 0, 7, DType::F32)
            .unwrap()
            .into_model();
    let err = PassMoe::<Cpu>::from_model(tiny).err().unwrap().to_string();
    assert!(
        err.contains("`tiny`") && err.contains("`pass-moe`") && err.contains("3 blocks"),
        "{err}"
    );
}
