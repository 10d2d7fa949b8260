//! `foldmoe plan` predicts memory per GPU: DeepSeek-V3 on its declared
//! 1024-GPU layout (pp16·ep64) prints the per-part table, `--json` carries
//! the same numbers, and `--recompute` / `--offload` move them the way
//! they should.

mod common;

use common::foldmoe;

/// The JSON plan, on the model's declared layout `h100x1024` (pp16·ep64,
/// uneven pp_layers), of DeepSeek-V3's rank 64 (pp stage 1: four MoE blocks, 15
/// micro-batches in flight, the stage with the most activations) with `extra` flags.
fn deepseek(extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["plan", "--model", "deepseek-v3", "--rank", "64", "--json"];
    args.extend_from_slice(extra);
    let o = foldmoe(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("plan --json parses")
}

fn part(v: &serde_json::Value, name: &str, field: &str) -> u64 {
    v["memory"]["parts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["part"] == name)
        .unwrap()[field]
        .as_u64()
        .unwrap()
}

#[test]
fn deepseek_v3_on_1024_gpus_prints_the_memory_table() {
    let o = foldmoe(&["plan", "--model", "deepseek-v3", "--rank", "64"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "memory per GPU of rank 64 (pp stage 1",
        "routed_experts",
        "shared_experts",
        "embedding_head",
        "total ",
        "communication per step from rank 64",
        "ep     (  64 ranks)",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in\n{text}");
    }
}

#[test]
fn deepseek_v3_json_total_fits_an_h200_under_its_declared_policy() {
    let v = deepseek(&[]);
    let m = &v["memory"];
    assert_eq!(m["pp_stage"], 1);
    assert_eq!(m["in_flight"], 15.0);
    let total = m["total"].as_u64().unwrap() as f64;
    assert!((v["memory_total_gib"].as_f64().unwrap() - total / (1u64 << 30) as f64).abs() < 1e-9);
    // Declared policy (mla_up_proj and moe_act recomputed): under an H200's
    // 140 GiB but over an H100's 80 GiB with 1F1B's 15 micro-batches in flight.
    let gib = total / (1u64 << 30) as f64;
    assert!(gib < 140.0 && gib > 80.0, "{gib} GiB");
    // The distributed optimizer: edp = 1 keeps every expert's 12 bytes,
    // dp = 64 shards the dense ones.
    let experts = part(&v, "routed_experts", "params");
    assert_eq!(part(&v, "routed_experts", "optimizer"), 12 * experts);
    let attn = part(&v, "attention", "params");
    assert_eq!(part(&v, "attention", "optimizer"), (12 * attn).div_ceil(64));
    assert!(m["comm"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["group"] == "ep"));
}

#[test]
fn recompute_and_offload_flags_change_the_activations() {
    let declared = deepseek(&[]);
    let keep = deepseek(&["--recompute", "none"]);
    let block = deepseek(&["--recompute", "block"]);
    let offload = deepseek(&["--recompute", "none", "--offload", "expert_fc1,moe_act"]);
    let act = |v: &serde_json::Value, p: &str| part(v, p, "activations");
    let per_mb = |v: &serde_json::Value, p: &str| part(v, p, "activations_per_micro_batch");
    assert!(act(&keep, "routed_experts") > act(&declared, "routed_experts"));
    // `block` keeps only block inputs; one block's tensors come back during
    // its backward, a fraction of a micro-batch in flight.
    assert!(per_mb(&block, "routed_experts") == 0 && per_mb(&block, "attention") == 0);
    assert!(act(&block, "routed_experts") < per_mb(&keep, "routed_experts"));
    assert!(act(&offload, "routed_experts") < act(&keep, "routed_experts"));
    assert_eq!(
        act(&keep, "routed_experts") - act(&offload, "routed_experts"),
        part(&offload, "routed_experts", "offloaded")
    );
    assert_eq!(
        offload["policy"],
        "--recompute none --offload expert_fc1,moe_act"
    );
    // fp8 storage: one byte per element instead of bf16's two (the declared
    // fp8 storage of moe_act replaced by none in the reference).
    let plain = |extra: &[&str]| {
        let mut args = vec!["--recompute", "none", "--store-fp8", "none"];
        args.extend_from_slice(extra);
        deepseek(&args)
    };
    let (bf16, moved) = (plain(&[]), plain(&["--offload", "expert_fc1,moe_act"]));
    let fp8 = deepseek(&["--recompute", "none", "--store-fp8", "expert_fc1,moe_act"]);
    assert_eq!(
        2 * (per_mb(&bf16, "routed_experts") - per_mb(&fp8, "routed_experts")),
        per_mb(&bf16, "routed_experts") - per_mb(&moved, "routed_experts")
    );
    let o = foldmoe(&["plan", "--model", "deepseek-v3", "--recompute", "moe_actt"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown recompute part `moe_actt`"));
}

/// The planner's arithmetic over extreme sizes (issue 24): for the largest
/// published model and the smallest, on one rank and on the largest world a
/// layout allows, every micro-batch size up to the 2^32-token bound plans
/// without a panic or an overflow, and memory never falls as the micro-batch
/// grows (the planner's sums saturate rather than wrap past that); sizes past
/// the bounds are one-line errors.
#[test]
fn planner_arithmetic_is_monotone_and_bounded_at_extreme_sizes() {
    use foldmoe_core::layout::{check, LayoutSpec, MAX_RANKS};
    use foldmoe_core::memory::{plan_memory, MemoryOptions};
    for name in ["deepseek-v3", "tiny"] {
        let spec = foldmoe_models::by_name(name).unwrap();
        let big = format!("world={MAX_RANKS},ep=1");
        for text in ["world=1", big.as_str()] {
            let layout = check(&LayoutSpec::parse(text).unwrap(), &spec).unwrap();
            let mut last = 0u64;
            let mut mbs = 1usize;
            while (mbs as u128) * (spec.seq_len as u128) <= 1u128 << 32 {
                let plan = plan_memory(&spec, &layout, &MemoryOptions::new(0, mbs, 1));
                assert!(
                    plan.total >= last,
                    "{name} {text}: micro-batch {mbs} plans {} < {last}",
                    plan.total
                );
                assert!(
                    plan.total < u64::MAX / 2,
                    "{name} {text}: {mbs}: near overflow"
                );
                last = plan.total;
                mbs *= 4;
            }
        }
    }
    for (args, needle) in [
        (
            vec!["plan", "--layout", "world=1099511627776"],
            "at most 1048576",
        ),
        (
            vec![
                "plan",
                "--model",
                "deepseek-v3",
                "--layout",
                "world=18446744073709551615,ep=64",
            ],
            "at most 1048576",
        ),
        (
            vec!["plan", "--micro-batch-size", "4503599627370497"],
            "(2^32)",
        ),
    ] {
        let o = foldmoe(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
