//! The planner's activation estimate (`foldmoe plan`, `core::memory`) against
//! what the engine really holds: the tiny model, one micro-batch, forward
//! and backward on the CPU in f32, under several recompute / offload / fp8
//! policies. The engine's ledger peak (device and host) must be within 1%
//! of the planner's prediction with 4-byte activations.

use std::time::Duration;

use foldmoe::core::engine::model::{Batch, Model};
use foldmoe::core::engine::parallel::{run_local_layout, Exec, RankLayout};
use foldmoe::core::layout::{check, LayoutSpec};
use foldmoe::core::memory::{plan_memory, MemoryOptions};
use foldmoe::core::spec::{ModelSpec, PolicyOverride};
use foldmoe::kernels::cpu::Cpu;
use foldmoe::kernels::{DType, Device, HostData};

/// `(device, host)` peak bytes the engine's ledger saw over one forward and
/// backward of `seqs` sequences, in f32.
fn measured(spec: &ModelSpec, seqs: usize) -> (u64, u64) {
    measured_in(spec, seqs, DType::F32)
}

/// [`measured`] with the model in `dtype`.
fn measured_in(spec: &ModelSpec, seqs: usize, dtype: DType) -> (u64, u64) {
    let b = Cpu;
    let mut model = Model::single(&b, spec, 7, dtype).unwrap();
    let t = seqs * spec.seq_len;
    let ids: Vec<i32> = (0..t)
        .map(|i| ((i * 37 + 11) % spec.vocab) as i32)
        .collect();
    let targets: Vec<i32> = (0..t).map(|i| ((i * 53 + 5) % spec.vocab) as i32).collect();
    let tokens = b.upload(HostData::I32(ids), &[seqs, spec.seq_len]).unwrap();
    let targets = b
        .upload(HostData::I32(targets), &[seqs, spec.seq_len])
        .unwrap();
    let exec = Exec::solo(&b);
    let batch = Batch::Device {
        tokens: &tokens,
        targets: &targets,
    };
    let out = model.forward(&exec, batch, spec.seq_len).unwrap();
    model.backward(&exec, out.saved, 1.0).unwrap();
    let c = model.ledger.counts();
    (c.peak_device, c.peak_host)
}

/// One forward and backward of `seqs` sequences on every rank of `layout`
/// (threads): each rank's ledger peak, and of it the norms part, which
/// holds the norms' inputs and outputs.
fn measured_under(spec: &ModelSpec, layout_text: &str, seqs: usize) -> Vec<(u64, u64)> {
    let layout = check(&LayoutSpec::parse(layout_text).unwrap(), spec).unwrap();
    let t = seqs * spec.seq_len;
    let ids: Vec<i32> = (0..t)
        .map(|i| ((i * 37 + 11) % spec.vocab) as i32)
        .collect();
    let targets: Vec<i32> = (0..t).map(|i| ((i * 53 + 5) % spec.vocab) as i32).collect();
    run_local_layout(&Cpu, &layout, Duration::from_secs(60), |ctx| {
        let rank = RankLayout::new(&layout, ctx.rank.rank)?;
        let mut model = Model::new(ctx.b, spec, rank, 7, DType::F32)?;
        let upload = |v: &[i32]| {
            ctx.b
                .upload(HostData::I32(v.to_vec()), &[seqs, spec.seq_len])
        };
        let (tokens, targets) = (upload(&ids)?, upload(&targets)?);
        let exec = ctx.exec();
        let batch = Batch::Device {
            tokens: &tokens,
            targets: &targets,
        };
        let out = model.forward(&exec, batch, spec.seq_len)?;
        model.backward(&exec, out.saved, 1.0)?;
        let norms = foldmoe::core::memory::Part::ALL
            .iter()
            .position(|p| *p == foldmoe::core::memory::Part::Norms)
            .unwrap();
        let counts = model.ledger.counts();
        Ok((counts.peak_device, counts.peak_by_part[norms]))
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{layout_text}: {e}")))
    .collect()
}

/// `(device, host)` bytes the planner predicts for one rank holding every
/// block, one micro-batch of `seqs` sequences, f32 activations.
fn predicted(spec: &ModelSpec, seqs: usize) -> (u64, u64) {
    predicted_in(spec, seqs, 4.0)
}

/// [`predicted`] with activations of `activation_bytes` an element.
fn predicted_in(spec: &ModelSpec, seqs: usize, activation_bytes: f64) -> (u64, u64) {
    let layout = check(&LayoutSpec::parse("world=1").unwrap(), spec).unwrap();
    let opts = MemoryOptions {
        activation_bytes,
        ..MemoryOptions::new(0, seqs, 1)
    };
    let plan = plan_memory(spec, &layout, &opts);
    (plan.sum(|p| p.activations), plan.sum(|p| p.offloaded))
}

/// `(recompute, offload, store_fp8)` policies the planner is checked under:
/// none, selective recompute, block recompute, offload, fp8 storage, and
/// mixes of them.
const POLICIES: [(&str, &str, &str); 7] = [
    ("none", "none", "none"),
    (
        "norm,core_attn,mlp_act,moe_act,router,shared_experts",
        "none",
        "none",
    ),
    ("block", "none", "none"),
    ("none", "qkv,expert_fc1", "none"),
    ("none", "none", "expert_fc1,moe_act,attn_proj"),
    ("moe_act,norm", "attn_norm,mlp_norm", "qkv"),
    ("block", "attn_norm", "attn_norm"),
];

#[test]
fn planner_predicts_the_engines_activation_peak_within_10_percent() {
    let policies = POLICIES;
    let seqs = 1;
    let mut rows = Vec::new();
    // The first two again with the experts' GEMMs in fp8 (`train --fp8`),
    // which keep their inputs as fp8 codes.
    let fp8_gemms = policies
        .iter()
        .map(|p| (p, false))
        .chain([(&policies[0], true), (&policies[1], true)]);
    for (&(recompute, offload, fp8), fp8_experts) in fp8_gemms {
        let mut spec = foldmoe::models::by_name("tiny").unwrap();
        PolicyOverride::parse(Some(recompute), Some(offload), Some(fp8))
            .unwrap()
            .apply(&mut spec);
        if fp8_experts {
            spec.use_fp8_experts().unwrap();
        }
        let fp8 = if fp8_experts {
            format!("{fp8} + fp8 experts")
        } else {
            fp8.to_string()
        };
        let (dev, host) = measured(&spec, seqs);
        let (p_dev, p_host) = predicted(&spec, seqs);
        let label = format!("recompute {recompute} / offload {offload} / fp8 {fp8}");
        eprintln!("{label}: device predicted {p_dev} measured {dev}; host predicted {p_host} measured {host}");
        rows.push((label, p_dev, dev, p_host, host));
    }
    for (label, p_dev, dev, p_host, host) in rows {
        // The brief asks for 10%; the two lists agree to well under 1% (the
        // planner leaves out per-layer constants such as group sizes).
        let close = |p: u64, m: u64| (p as f64 - m as f64).abs() <= 0.01 * m.max(1) as f64;
        assert!(
            close(p_dev, dev),
            "{label}: device predicted {p_dev}, measured {dev}"
        );
        assert!(
            close(p_host, host),
            "{label}: host predicted {p_host}, measured {host}"
        );
    }
}

/// Attention projections in fp8 keep their inputs' column tiles (a byte a
/// value and f32 scales) instead of the rows: GQA's input on `tiny`, MLA's
/// input and normed latents on `deepseek-v3-small`, kept and under `norm`
/// recompute (which drops the attention input's tiles with the norm output).
/// The planner's whole figure and the bytes fp8 saves must both be within
/// 1% (`deepseek-v3-small` without its MTP module, which has a test of its
/// own).
#[test]
fn planner_counts_the_fp8_projections_inputs_within_1_percent() {
    use foldmoe::core::spec::GemmPrecision;
    let close = |p: u64, m: u64| (p as f64 - m as f64).abs() <= 0.01 * m.max(1) as f64;
    for model in ["tiny", "deepseek-v3-small"] {
        for recompute in ["none", "norm"] {
            let mut spec = foldmoe::models::by_name(model).unwrap();
            spec.mtp_layers = 0;
            PolicyOverride::parse(Some(recompute), Some("none"), Some("none"))
                .unwrap()
                .apply(&mut spec);
            let (bf16_dev, _) = measured(&spec, 1);
            let (bf16_p_dev, _) = predicted(&spec, 1);
            for g in &mut spec.groups {
                g.attention.precision = GemmPrecision::Fp8Blockwise;
            }
            spec.check().unwrap();
            let (dev, host) = measured(&spec, 1);
            let (p_dev, p_host) = predicted(&spec, 1);
            let label = format!("{model} fp8 attention, recompute {recompute}");
            eprintln!(
                "{label}: device predicted {p_dev} measured {dev} (model dtype: predicted \
                 {bf16_p_dev} measured {bf16_dev})"
            );
            assert_eq!((p_host, host), (0, 0), "{label}");
            assert!(
                close(p_dev, dev),
                "{label}: device predicted {p_dev}, measured {dev}"
            );
            let (saved, p_saved) = (bf16_dev - dev, bf16_p_dev - p_dev);
            assert!(
                close(p_saved, saved),
                "{label}: fp8 saves {saved} bytes, the planner says {p_saved}"
            );
            // `norm` recompute drops GQA's input either way; MLA's latents
            // stay.
            let fewer = if recompute == "none" || model != "tiny" {
                saved > 0
            } else {
                saved == 0
            };
            assert!(
                fewer,
                "{label}: keeps {dev} bytes, the model dtype {bf16_dev}"
            );
        }
    }
}

/// Under tp (with sequence parallelism) the attention, the dense MLP and the
/// shared experts gather their input over tp; each rank keeps only its
/// sequence shard of it and gathers it again in the backward, as the
/// planner counts (Megatron-Core's sequence-parallel linears), and so does
/// the head. Under cp the attention keeps this rank's q, k and v, not the
/// gathered keys and values nor the padded queries and outputs. Every
/// rank's peak and its norms part within 1% of the plan, under tp, cp and
/// both, in the model dtype and with fp8 attention projections (which keep
/// the shard too, not fp8 tiles of the gathered rows), and for MLA under tp
/// (whose down projections and latent norms read the shard, the input kept
/// as fp8 column tiles under fp8 projections, the latents as the shard),
/// cp (this cp rank's query rows, this rank's latents) and both.
#[test]
fn under_tp_and_cp_each_rank_keeps_its_own_rows() {
    use foldmoe::core::spec::GemmPrecision;
    let base = foldmoe::models::by_name("tiny").unwrap();
    let mla = foldmoe::models::by_name("deepseek-v3-small").unwrap();
    let with_fp8 = |spec: &foldmoe::core::spec::ModelSpec| {
        let mut spec = spec.clone();
        for g in &mut spec.groups {
            g.attention.precision = GemmPrecision::Fp8Blockwise;
        }
        spec
    };
    let (fp8, mla_fp8) = (with_fp8(&base), with_fp8(&mla));
    for (spec, what, layout_text) in [
        (&base, "model dtype", "world=2,tp=2"),
        (&fp8, "fp8 attention", "world=2,tp=2"),
        (&base, "model dtype", "world=2,cp=2"),
        (&fp8, "fp8 attention", "world=4,tp=2,cp=2"),
        (&mla, "MLA with its MTP module", "world=2,tp=2"),
        (&mla, "MLA with its MTP module", "world=2,cp=2"),
        (&mla, "MLA with its MTP module", "world=4,tp=2,cp=2"),
        (&mla_fp8, "MLA with fp8 projections", "world=2,tp=2"),
        (&mla_fp8, "MLA with fp8 projections", "world=4,tp=2,cp=2"),
    ] {
        let what = format!("{what} under {layout_text}");
        let layout = check(&LayoutSpec::parse(layout_text).unwrap(), spec).unwrap();
        let measured = measured_under(spec, layout_text, 2);
        for (rank, (peak, m)) in measured.into_iter().enumerate() {
            let opts = MemoryOptions {
                activation_bytes: 4.0,
                ..MemoryOptions::new(rank, 2, 1)
            };
            let plan = plan_memory(spec, &layout, &opts);
            let p = plan
                .parts
                .iter()
                .find(|p| p.part == "norms")
                .unwrap()
                .activations;
            assert!(
                (p as f64 - m as f64).abs() <= 0.01 * m as f64,
                "{what}, rank {rank}: norms predicted {p}, measured {m}"
            );
            let p = plan.sum(|p| p.activations);
            assert!(
                (p as f64 - peak as f64).abs() <= 0.01 * peak as f64,
                "{what}, rank {rank}: peak predicted {p}, measured {peak}"
            );
        }
    }
}

/// MTP modules (DeepSeek-V3's, on the last stage) hold a block of the last
/// group, their norms' state and one more loss state each, and the last
/// module's block runs its backward beside the other modules' loss states:
/// the planner counts them. What the modules add is within 1%, and so is
/// the whole figure, also under `block` recompute (where a block's rerun
/// sits beside the inputs of the blocks before it, the MTP modules' beside
/// the other modules' loss states).
#[test]
fn planner_counts_the_mtp_modules_within_1_percent() {
    let close = |p: u64, m: u64| (p as f64 - m as f64).abs() <= 0.01 * m.max(1) as f64;
    for (model, depth) in [("tiny", 1), ("deepseek-v3-small", 1), ("tiny", 2)] {
        for recompute in ["none", "block"] {
            let mut spec = foldmoe::models::by_name(model).unwrap();
            PolicyOverride::parse(Some(recompute), Some("none"), Some("none"))
                .unwrap()
                .apply(&mut spec);
            spec.mtp_layers = 0;
            let (base, _) = measured(&spec, 1);
            let (p_base, _) = predicted(&spec, 1);
            spec.mtp_layers = depth;
            spec.check().unwrap();
            let (dev, _) = measured(&spec, 1);
            let (p_dev, _) = predicted(&spec, 1);
            let label = format!("{model} with {depth} MTP modules, recompute {recompute}");
            eprintln!(
                "{label}: device predicted {p_dev} measured {dev} (without: predicted {p_base} \
                 measured {base})"
            );
            assert!(
                close(p_dev, dev),
                "{label}: device predicted {p_dev}, measured {dev}"
            );
            assert!(
                close(p_dev - p_base, dev - base),
                "{label}: the modules add {} bytes, the planner says {}",
                dev - base,
                p_dev - p_base
            );
        }
    }
}

/// In bf16 the norms' rstd, the router's state and the logits are kept in
/// the model's dtype and the log-sum-exps and fp8 scales in f32: the
/// planner's bf16 figure is within 1% of the ledger's on `tiny` and on
/// `deepseek-v3-small` (with its MTP module), under the policies of the f32
/// test.
#[test]
fn planner_matches_the_ledger_in_bf16() {
    let close = |p: u64, m: u64| (p as f64 - m as f64).abs() <= 0.01 * m.max(1) as f64;
    for model in ["tiny", "deepseek-v3-small"] {
        for &(recompute, offload, fp8) in &POLICIES {
            let mut spec = foldmoe::models::by_name(model).unwrap();
            PolicyOverride::parse(Some(recompute), Some(offload), Some(fp8))
                .unwrap()
                .apply(&mut spec);
            let (dev, host) = measured_in(&spec, 1, DType::BF16);
            let (p_dev, p_host) = predicted_in(&spec, 1, 2.0);
            let label =
                format!("{model} bf16, recompute {recompute} / offload {offload} / fp8 {fp8}");
            eprintln!("{label}: device predicted {p_dev} measured {dev}; host predicted {p_host} measured {host}");
            assert!(
                close(p_dev, dev) && close(p_host, host),
                "{label}: device predicted {p_dev} measured {dev}, host predicted {p_host} \
                 measured {host}"
            );
        }
    }
}

/// Qwen3's per-head q/k norms save their inputs and rstd with the attention:
/// the planner counts them, also when `norm` recompute drops the rstd and
/// when `qkv` is offloaded.
#[test]
fn planner_counts_the_qk_norms_within_1_percent() {
    for (recompute, offload) in [("none", "none"), ("norm", "none"), ("none", "qkv")] {
        let mut spec = foldmoe::models::by_name("tiny").unwrap();
        for g in &mut spec.groups {
            g.attention.qk_norm = true;
        }
        PolicyOverride::parse(Some(recompute), Some(offload), Some("none"))
            .unwrap()
            .apply(&mut spec);
        let (dev, host) = measured(&spec, 1);
        let (p_dev, p_host) = predicted(&spec, 1);
        let close = |p: u64, m: u64| (p as f64 - m as f64).abs() <= 0.01 * m.max(1) as f64;
        assert!(
            close(p_dev, dev) && close(p_host, host),
            "qk_norm, recompute {recompute} / offload {offload}: device predicted {p_dev} \
             measured {dev}, host predicted {p_host} measured {host}"
        );
    }
}
