//! The shipped declarations against the rules, the published sizes, and the
//! engine.

use foldmoe_core::engine::declared::{LayoutChoice, MoeModel};
use foldmoe_core::engine::model::Batch;
use foldmoe_core::engine::parallel::Exec;
use foldmoe_core::layout;
use foldmoe_core::spec::*;
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::{DType, Device, HostData};

use super::*;

/// The hand-built `tiny` this crate shipped before the macro: the declaration
/// must give exactly this spec (checkpoints and the CLI depend on it).
fn tiny_by_hand() -> ModelSpec {
    let attention = AttentionSpec::gqa(4, 2, 32);
    ModelSpec {
        name: "tiny".into(),
        vocab: 256,
        hidden: 128,
        seq_len: 128,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tied_embeddings: false,
        init_std: 0.02,
        groups: vec![
            BlockGroup::new(1, attention.clone(), FfnSpec::Dense { ffn: 384 }),
            BlockGroup::new(
                3,
                attention,
                FfnSpec::Moe(MoeSpec {
                    experts: 16,
                    top_k: 2,
                    expert_ffn: 128,
                    shared_ffn: 128,
                    shared_gate: false,
                    router: RouterSpec {
                        aux_coef: 1e-2,
                        z_loss_coef: 1e-3,
                        ..RouterSpec::default()
                    },
                    capacity: None,
                }),
            ),
        ],
        mtp_layers: 0,
        mtp_loss_coef: 0.1,
    }
}

#[test]
fn tiny_is_unchanged() {
    assert_eq!(tiny(), tiny_by_hand());
    assert_eq!(by_name("tiny").unwrap(), tiny_by_hand());
}

#[test]
fn every_model_and_layout_passes_the_rules() {
    for name in names() {
        let (spec, layouts) = layouts_by_name(&name).unwrap();
        assert_eq!(spec.name, name);
        spec.check().unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert!(!layouts.is_empty(), "{name} declares no layout");
        for l in &layouts {
            layout::check(l, &spec).unwrap_or_else(|e| panic!("{name} / {}: {e:?}", l.name));
        }
    }
}

#[test]
fn unknown_names_list_the_known_ones() {
    let err = by_name("gpt-5").unwrap_err();
    assert!(err.contains("deepseek-v3-small"), "{err}");
    assert_eq!(
        DeepSeekV3Layout::by_name("h100x1024"),
        Ok(DeepSeekV3Layout::H100x1024)
    );
}

/// Published totals are rounded to three significant figures, so the total
/// must agree within 1 %; active counts are quoted more loosely (and Mixtral's
/// and Qwen3's exclude nothing we count), so within 3 %.
#[test]
fn full_size_models_match_published_parameter_counts() {
    let published: &[(&str, f64, f64)] = &[
        ("mixtral-8x7b", 46.7e9, 12.9e9),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("qwen3-235b-a22b", 235e9, 22e9),
        ("deepseek-v3", 671e9, 37e9),
    ];
    for &(name, total_pub, active_pub) in published {
        let (total, active) = ModelSpec::param_counts(&by_name(name).unwrap());
        let (t, a) = (total as f64, active as f64);
        eprintln!(
            "{name}: {:.2} B total ({total_pub:.3e} published), {:.2} B active ({active_pub:.3e})",
            t / 1e9,
            a / 1e9
        );
        assert!(
            (t / total_pub - 1.0).abs() < 0.01,
            "{name}: {t:.4e} vs {total_pub:.4e}"
        );
        assert!(
            (a / active_pub - 1.0).abs() < 0.03,
            "{name}: active {a:.4e} vs {active_pub:.4e}"
        );
    }
}

/// The spec-side count agrees with the engine's own count on a model it
/// builds, so the full-size figures above count what the engine would build.
#[test]
fn spec_count_matches_the_engine() {
    fn engine_counts<M: MoeModel<Cpu>>(layout: M::Layout) -> (u64, u64) {
        let mut m = M::new(&Cpu, layout, 0, 1, DType::F32).unwrap();
        let (total, active) = m.model().param_counts();
        (total as u64, active as u64)
    }
    assert_eq!(
        ModelSpec::param_counts(&tiny()),
        engine_counts::<Tiny<Cpu>>(TinyLayout::Cpu)
    );
    assert_eq!(
        ModelSpec::param_counts(&by_name("qwen3-30b-a3b-small").unwrap()),
        engine_counts::<Qwen3A3bSmall<Cpu>>(Qwen3A3bSmallLayout::Cpu)
    );
    // The spec's count is the main model's (published sizes exclude the MTP
    // module): the engine's without its MTP module, which the engine builds
    // and counts too.
    let dsv3 = by_name("deepseek-v3-small").unwrap();
    let mut main_only = dsv3.clone();
    main_only.mtp_layers = 0;
    let main = foldmoe_core::engine::model::Model::single(&Cpu, &main_only, 1, DType::F32).unwrap();
    let (t, a) = main.param_counts();
    assert_eq!(ModelSpec::param_counts(&dsv3), (t as u64, a as u64));
    let with_mtp = engine_counts::<DeepSeekV3Small<Cpu>>(DeepSeekV3SmallLayout::Cpu);
    assert!(
        with_mtp.0 > t as u64 && with_mtp.1 > a as u64,
        "{with_mtp:?}"
    );
}

/// One training step's forward and backward for a declared small model.
fn forward_backward<M: MoeModel<Cpu>>(layout: M::Layout) {
    let mut m = M::new(&Cpu, layout, 0, 3, DType::F32).unwrap();
    let seq = 16;
    let tokens: Vec<i32> = (0..2 * seq as i32).map(|i| (i * 37) % 256).collect();
    let targets: Vec<i32> = tokens.iter().map(|t| (t + 1) % 256).collect();
    let tokens = Cpu.upload(HostData::I32(tokens), &[2, seq]).unwrap();
    let targets = Cpu.upload(HostData::I32(targets), &[2, seq]).unwrap();
    let exec = Exec::solo(&Cpu);
    let batch = Batch::Device {
        tokens: &tokens,
        targets: &targets,
    };
    let out = m.forward(&exec, batch, seq).unwrap();
    let loss = Cpu.download(&out.loss).unwrap().to_f64()[0];
    assert!(
        loss.is_finite() && loss > 0.0,
        "{}: loss {loss}",
        M::spec().name
    );
    m.backward(&exec, out.saved, 1.0).unwrap();
}

#[test]
fn small_models_run_on_the_cpu() {
    forward_backward::<Tiny<Cpu>>(TinyLayout::Cpu);
    forward_backward::<Mixtral8x7bSmall<Cpu>>(Mixtral8x7bSmallLayout::Cpu);
    forward_backward::<Qwen3A3bSmall<Cpu>>(Qwen3A3bSmallLayout::Cpu);
    forward_backward::<Qwen3A22bSmall<Cpu>>(Qwen3A22bSmallLayout::Cpu);
}

#[test]
fn deepseek_v3_small_runs_on_the_cpu() {
    forward_backward::<DeepSeekV3Small<Cpu>>(DeepSeekV3SmallLayout::Cpu);
}

/// The second front end: each shipped model's config file
/// (`models/configs/<name>.toml`) gives exactly the spec and layouts of its
/// `#[moe_model]` declaration, so the two cannot drift apart.
#[test]
fn every_config_file_matches_its_declaration() {
    use foldmoe_core::config::ModelConfig;
    for name in names() {
        let path = format!("{}/configs/{name}.toml", env!("CARGO_MANIFEST_DIR"));
        let config = ModelConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let (spec, layouts) = layouts_by_name(&name).unwrap();
        assert_eq!(config.spec, spec, "{name}");
        assert_eq!(config.layouts, layouts, "{name}");
    }
    let tiny = ModelConfig::load(format!("{}/configs/tiny.toml", env!("CARGO_MANIFEST_DIR")));
    assert_eq!(tiny.unwrap().spec, tiny_by_hand());
}
