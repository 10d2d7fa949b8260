//! Hugging Face conversion against transformers: the fixtures of
//! `tests/fixtures/hf/` (made once by `make_fixtures.py` with transformers
//! 5.17 and PyTorch 2.11; no Python at test time) imported, run through the
//! engine and compared with transformers' fp32 logits; exported back and
//! compared byte for byte; and bad inputs, each a one-line error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use foldmoe::core::engine::checkpoint::Source;
use foldmoe::core::engine::hf::{self, ExpertLayout, ExportDtype};
use foldmoe::core::engine::model::Model;
use foldmoe::core::engine::parallel::Exec;
use foldmoe::core::layout::{check, LayoutSpec};
use foldmoe::kernels::cpu::Cpu;
use foldmoe::kernels::{DType, Device};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("foldmoe-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Imports `family`'s fixture under `layout` into a fresh directory.
fn import(family: &str, layout: &str) -> (hf::HfConfig, PathBuf, ExpertLayout) {
    let dir = fixture(family);
    let cfg = hf::read_config(&dir).unwrap();
    let l = check(&LayoutSpec::parse(layout).unwrap(), &cfg.spec).unwrap();
    let out = tmp(&format!("{family}-{}", layout.replace([',', '='], "_")));
    let experts = hf::import(&dir, &cfg, &l, &out, &serde_json::Value::Null).unwrap();
    (cfg, out, experts)
}

/// The fixture's input ids `[B, S]` and transformers' logits `[B, S, V]`.
fn reference(family: &str) -> (Vec<Vec<i32>>, Vec<f32>) {
    let bytes = std::fs::read(fixture(family).join("logits.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    assert_eq!(ids.dtype(), Dtype::I64);
    let (b, s) = (ids.shape()[0], ids.shape()[1]);
    let flat: Vec<i32> = ids
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as i32)
        .collect();
    let logits = st.tensor("logits").unwrap();
    let vals = logits
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (flat.chunks(s).take(b).map(<[i32]>::to_vec).collect(), vals)
}

/// The engine's logits for `family`'s fixture input from checkpoint `ckpt`.
fn engine_logits(cfg: &hf::HfConfig, ckpt: &Path, ids: &[Vec<i32>]) -> Vec<f32> {
    let b = Cpu;
    let (source, _): (Source, serde_json::Value) = Source::open(ckpt).unwrap();
    let mut model = Model::single(&b, &cfg.spec, 1, DType::F32).unwrap();
    foldmoe::core::engine::checkpoint::load_params(&b, &source, &mut model, true).unwrap();
    let exec = Exec::solo(&b);
    let mut out = Vec::new();
    for seq in ids {
        let l = model.logits(&exec, seq, seq.len()).unwrap();
        out.extend(b.download(&l).unwrap().to_f32());
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Import → engine logits within 1e-4 of transformers' (max abs).
fn check_parity(family: &str, layout: &str) -> f32 {
    let (cfg, out, _) = import(family, layout);
    let (ids, want) = reference(&family.replace("_fused", ""));
    let got = engine_logits(&cfg, &out, &ids);
    let diff = max_abs_diff(&got, &want);
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    println!("{family} ({layout}): max |logit diff| {diff:.2e} (logits up to {scale:.2})");
    assert!(
        diff <= 1e-4,
        "{family}: max abs logit difference {diff:e} > 1e-4"
    );
    let _ = std::fs::remove_dir_all(&out);
    diff
}

#[test]
fn mixtral_logits_match_transformers() {
    check_parity("mixtral", "world=1");
}

#[test]
fn qwen3_moe_logits_match_transformers() {
    check_parity("qwen3_moe", "world=1");
}

#[test]
fn qwen3_moe_fused_sharded_logits_match_transformers() {
    check_parity("qwen3_moe_fused", "world=1");
}

#[test]
fn deepseek_v3_logits_match_transformers() {
    check_parity("deepseek_v3", "world=1");
}

/// The fixture exercises DeepSeek's interleaved rotary layout: imported as
/// if its rotary dims were halves, the logits are far off.
#[test]
fn deepseek_v3_rope_interleave_matters() {
    let dir = fixture("deepseek_v3");
    let mut cfg = hf::read_config(&dir).unwrap();
    cfg.rope_interleave = false;
    let l = check(&LayoutSpec::default(), &cfg.spec).unwrap();
    let out = tmp("deepseek-no-interleave");
    hf::import(&dir, &cfg, &l, &out, &serde_json::Value::Null).unwrap();
    let (ids, want) = reference("deepseek_v3");
    let diff = max_abs_diff(&engine_logits(&cfg, &out, &ids), &want);
    assert!(diff > 1e-2, "without de-interleaving: {diff:e}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A checkpoint imported for a parallel layout (each rank's file its own
/// blocks) gives the same model when read back on one rank.
#[test]
fn import_for_a_layout_reads_back_on_one_rank() {
    check_parity("qwen3_moe", "world=4,tp=2,ep=4");
    check_parity("deepseek_v3", "world=6,pp=3,ep=2");
}

/// Every tensor of a safetensors file, by name: dtype, shape, bytes.
fn tensors_of(dir: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors")
            && !path.ends_with("logits.safetensors")
            && !path.ends_with("dequantised.safetensors")
        {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                out.insert(
                    name,
                    (view.dtype(), view.shape().to_vec(), view.data().to_vec()),
                );
            }
        }
    }
    out
}

/// Export → every tensor byte-identical to the original, in the expert
/// layout the model came in (per expert; fused, over shards).
#[test]
fn export_gives_back_the_original_tensors() {
    for (family, max_shard) in [
        ("mixtral", u64::MAX),
        ("qwen3_moe", u64::MAX),
        ("deepseek_v3", u64::MAX),
        ("qwen3_moe_fused", 100_000),
    ] {
        let (cfg, ckpt, experts) = import(family, "world=2,ep=2");
        let (source, _): (Source, serde_json::Value) = Source::open(&ckpt).unwrap();
        let out = tmp(&format!("export-{family}"));
        hf::export(&source, &cfg, experts, &out, max_shard, ExportDtype::F32).unwrap();
        let (want, got) = (tensors_of(&fixture(family)), tensors_of(&out));
        assert_eq!(
            want.keys().collect::<Vec<_>>(),
            got.keys().collect::<Vec<_>>(),
            "{family}: tensor names"
        );
        for (name, w) in &want {
            assert!(got[name] == *w, "{family}: tensor {name} differs");
        }
        if max_shard != u64::MAX {
            assert!(out.join("model.safetensors.index.json").exists());
        }
        let _ = std::fs::remove_dir_all(&out);
        let _ = std::fs::remove_dir_all(&ckpt);
    }
}

/// A bf16 checkpoint (`qwen3_moe_bf16`: the Qwen3-MoE fixture saved by
/// transformers in bfloat16, `torch_dtype` bfloat16) imports and exports
/// back in bf16 byte for byte — the dtype the config names, also through
/// `convert`'s default — and `--dtype f32` widens every value exactly.
#[test]
fn bf16_export_gives_back_the_original_tensors() {
    let (cfg, ckpt, experts) = import("qwen3_moe_bf16", "world=1");
    assert_eq!(ExportDtype::of_config(&cfg.raw), Some(ExportDtype::Bf16));
    let (source, _): (Source, serde_json::Value) = Source::open(&ckpt).unwrap();
    let want = tensors_of(&fixture("qwen3_moe_bf16"));
    let out = tmp("export-bf16");
    hf::export(&source, &cfg, experts, &out, u64::MAX, ExportDtype::Bf16).unwrap();
    let got = tensors_of(&out);
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>()
    );
    for (name, w) in &want {
        assert_eq!(w.0, Dtype::BF16, "{name}");
        assert!(got[name] == *w, "tensor {name} differs");
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["dtype"], "bfloat16");
    let wide = tmp("export-bf16-as-f32");
    hf::export(&source, &cfg, experts, &wide, u64::MAX, ExportDtype::F32).unwrap();
    for (name, (dtype, shape, bytes)) in tensors_of(&wide) {
        assert_eq!(dtype, Dtype::F32);
        assert_eq!(shape, want[&name].1);
        let back: Vec<u8> = bytes.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        assert_eq!(back, want[&name].2, "{name}: f32 is not the bf16 widened");
    }
    for d in [out, wide, ckpt] {
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// DeepSeek's fp8 form: e4m3 weights times their block `weight_scale_inv`
/// give exactly the dequantised values the script computed.
#[test]
fn deepseek_fp8_weights_are_dequantised_on_import() {
    let (cfg, ckpt, _) = import("deepseek_v3_fp8", "world=1");
    assert_eq!(cfg.fp8_block, Some([128, 128]));
    let (source, _): (Source, serde_json::Value) = Source::open(&ckpt).unwrap();
    let out = tmp("export-fp8");
    hf::export(
        &source,
        &cfg,
        ExpertLayout::PerExpert,
        &out,
        u64::MAX,
        ExportDtype::F32,
    )
    .unwrap();
    let got = tensors_of(&out);
    let bytes = std::fs::read(fixture("deepseek_v3_fp8").join("dequantised.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for (name, view) in want.tensors() {
        assert_eq!(got[&name].2, view.data(), "{name}");
        checked += 1;
    }
    assert!(checked > 10, "{checked} fp8 tensors");
    assert!(!got.keys().any(|k| k.ends_with("_scale_inv")));
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&ckpt);
}

/// The Mixtral fixture copied with its tensors edited by `edit` (name →
/// (dtype, shape, bytes)).
fn edited_mixtral(
    tag: &str,
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) -> PathBuf {
    let src = fixture("mixtral");
    let mut t = tensors_of(&src);
    edit(&mut t);
    let dir = tmp(tag);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = t
        .iter()
        .map(|(n, (d, s, b))| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

fn import_error(dir: &Path) -> String {
    let cfg = hf::read_config(dir).unwrap();
    let l = check(&LayoutSpec::default(), &cfg.spec).unwrap();
    let out = dir.join("ckpt");
    let e = hf::import(dir, &cfg, &l, &out, &serde_json::Value::Null)
        .expect_err("an error")
        .to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(!out.exists(), "no checkpoint left behind");
    let _ = std::fs::remove_dir_all(dir);
    e
}

#[test]
fn missing_unexpected_and_misshapen_tensors_are_named() {
    let name = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
    let dir = edited_mixtral("missing", |t| {
        t.remove(name);
    });
    let e = import_error(&dir);
    assert!(e.contains(name) && e.contains("missing"), "{e}");

    let dir = edited_mixtral("extra", |t| {
        let v = t["model.norm.weight"].clone();
        t.insert("model.layers.0.self_attn.q_bias".into(), v);
    });
    let e = import_error(&dir);
    assert!(
        e.contains("model.layers.0.self_attn.q_bias") && e.contains("not used"),
        "{e}"
    );

    let dir = edited_mixtral("shape", |t| {
        let (d, _, b) = t["model.layers.0.self_attn.k_proj.weight"].clone();
        t.insert(
            "model.layers.0.self_attn.k_proj.weight".into(),
            (d, vec![32, 16], b),
        );
    });
    let e = import_error(&dir);
    assert!(
        e.contains("model.layers.0.self_attn.k_proj.weight") && e.contains("[32, 16]"),
        "{e}"
    );

    let dir = edited_mixtral("dtype", |t| {
        let (_, s, b) = t["model.norm.weight"].clone();
        t.insert("model.norm.weight".into(), (Dtype::I32, s, b));
    });
    let e = import_error(&dir);
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");
}

fn foldmoe(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_foldmoe"))
        .args(args)
        .output()
        .unwrap()
}

/// `foldmoe convert --from-hf`, `generate` from the import, `convert
/// --to-hf`: the exported tensors and config are the originals.
#[test]
fn cli_round_trip_and_errors() {
    let root = tmp("cli");
    let (ckpt, back) = (root.join("ckpt"), root.join("hf"));
    let src = fixture("qwen3_moe");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = foldmoe(&[
        "convert",
        "--from-hf",
        &s(&src),
        "--out",
        &s(&ckpt),
        "--layout",
        "world=2,tp=2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.contains("qwen3_moe") && line.contains("per-expert"),
        "{line}"
    );
    let out = foldmoe(&[
        "generate",
        "--checkpoint",
        &s(&ckpt),
        "--tokens",
        "8",
        "--temperature",
        "0",
        "--raw",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.len() >= 8, "{:?}", out.stdout);
    let out = foldmoe(&["convert", "--to-hf", &s(&ckpt), "--out", &s(&back)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(tensors_of(&src) == tensors_of(&back), "tensors differ");
    let cfg = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(cfg(&src), cfg(&back));

    // Bad input: one line each, non-zero exit.
    let bad = root.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let mut c = cfg(&src);
    c["use_qk_clip"] = true.into();
    std::fs::write(bad.join("config.json"), c.to_string()).unwrap();
    for (args, want) in [
        (
            vec![
                "convert",
                "--from-hf",
                &s(&bad),
                "--out",
                &s(&root.join("x")),
            ],
            "field `use_qk_clip`",
        ),
        (
            vec!["convert", "--from-hf", &s(&src), "--out", &s(&ckpt)],
            "not empty",
        ),
        (
            vec![
                "convert",
                "--from-hf",
                &s(&src),
                "--out",
                &s(&root.join("y")),
                "--layout",
                "world=2,tp=3",
            ],
            "--layout",
        ),
    ] {
        let out = foldmoe(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains(want), "{err}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// `foldmoe score` on an imported model: its per-token log-probabilities
/// are transformers' (log-softmax of the fixture's logits at the next
/// token) within 1e-4, for every family.
#[test]
fn score_matches_transformers_log_probs() {
    for family in ["mixtral", "qwen3_moe", "deepseek_v3"] {
        let root = tmp(&format!("score-{family}"));
        let ckpt = root.join("ckpt");
        let s = |p: &Path| p.to_str().unwrap().to_string();
        let out = foldmoe(&[
            "convert",
            "--from-hf",
            &s(&fixture(family)),
            "--out",
            &s(&ckpt),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (ids, logits) = reference(family);
        let vocab = logits.len() / (ids.len() * ids[0].len());
        // The fixture's first sequence, one byte per id (all below 128).
        let text: Vec<u8> = ids[0].iter().map(|&t| t as u8).collect();
        let input = root.join("input.txt");
        std::fs::write(&input, &text).unwrap();
        let out = foldmoe(&[
            "score",
            "--checkpoint",
            &s(&ckpt),
            "--input",
            &s(&input),
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let lp: Vec<f64> = got["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(lp.len(), text.len() - 1);
        let mut worst = 0.0f64;
        for (t, &l) in lp.iter().enumerate() {
            let row: Vec<f64> = logits[t * vocab..(t + 1) * vocab]
                .iter()
                .map(|&x| x as f64)
                .collect();
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            worst = worst.max((row[ids[0][t + 1] as usize] - lse - l).abs());
        }
        println!("{family}: score log-probs within {worst:.2e} of transformers'");
        assert!(worst <= 1e-4, "{family}: {worst:e}");
        let mean = -lp.iter().sum::<f64>() / lp.len() as f64;
        assert!((got["mean_loss"].as_f64().unwrap() - mean).abs() < 1e-12);
        assert!((got["perplexity"].as_f64().unwrap() - mean.exp()).abs() < 1e-9);
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// A foldmoe-trained model exports (as Mixtral), imports back, and the
/// import starts a fine-tune with `train --resume` under its own flags (its
/// run settings are only defaults), its moments at zero.
#[test]
fn trained_model_exports_imports_and_fine_tunes() {
    let root = tmp("finetune");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (run, hf_dir, ckpt, ft) = (
        root.join("run"),
        root.join("hf"),
        root.join("ckpt"),
        root.join("ft"),
    );
    let small = [
        "--batch-tokens",
        "128",
        "--eval-every",
        "1",
        "--sample-tokens",
        "0",
    ];
    let mut args = vec![
        "train",
        "--model",
        "mixtral-8x7b-small",
        "--steps",
        "1",
        "--out",
    ];
    let run_s = s(&run);
    args.push(&run_s);
    args.extend(small);
    let out = foldmoe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for args in [
        vec![
            "convert".to_string(),
            "--to-hf".into(),
            s(&run),
            "--out".into(),
            s(&hf_dir),
        ],
        vec![
            "convert".to_string(),
            "--from-hf".into(),
            s(&hf_dir),
            "--out".into(),
            s(&ckpt),
        ],
    ] {
        let out = foldmoe(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (ckpt_s, ft_s) = (s(&ckpt), s(&ft));
    let mut args = vec!["train", "--resume", &ckpt_s, "--steps", "2", "--out"];
    args.push(&ft_s);
    args.extend(small);
    let out = foldmoe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ft.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 2);
    let _ = std::fs::remove_dir_all(&root);
}

/// `score --tokenizer`: a BPE's ids read the text; an id past the model's
/// vocabulary is a one-line error naming it.
#[test]
fn score_reads_the_text_with_a_tokenizer() {
    let root = tmp("score-tok");
    std::fs::create_dir_all(&root).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (ckpt, text, tok) = (root.join("ckpt"), root.join("t.txt"), root.join("tok.json"));
    std::fs::write(&text, "abab abab abab cdcd cdcd abab cdcd ".repeat(20)).unwrap();
    for args in [
        vec![
            "convert".to_string(),
            "--from-hf".into(),
            s(&fixture("mixtral")),
            "--out".into(),
            s(&ckpt),
        ],
        vec![
            "train-tokenizer".to_string(),
            "--input".into(),
            s(&text),
            "--vocab-size".into(),
            "300".into(),
            "--out".into(),
            s(&tok),
        ],
    ] {
        let out = foldmoe(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = foldmoe(&[
        "score",
        "--checkpoint",
        &s(&ckpt),
        "--input",
        &s(&text),
        "--tokenizer",
        &s(&tok),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("outside the model's vocabulary of 128"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    // Bytes as the tokenizer: the same text scores.
    let out = foldmoe(&[
        "score",
        "--checkpoint",
        &s(&ckpt),
        "--input",
        &s(&text),
        "--tokenizer",
        "byte",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("tokens scored"));
    let _ = std::fs::remove_dir_all(&root);
}

/// `score --data-path` scores each document of an indexed dataset on its
/// own: the fixture's two sequences written as two documents score as
/// each does alone with `--input` (within transformers' 1e-4 of each
/// other through the same engine: exactly), their mean weighted by tokens;
/// a truncated `.bin` is a one-line error.
#[test]
fn score_reads_an_indexed_dataset_by_document() {
    use foldmoe::data::indexed::{IndexedWriter, TokenDtype};
    let root = tmp("score-bin");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let ckpt = root.join("ckpt");
    let out = foldmoe(&[
        "convert",
        "--from-hf",
        &s(&fixture("mixtral")),
        "--out",
        &s(&ckpt),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ids, _) = reference("mixtral");
    let prefix = root.join("data");
    let mut w = IndexedWriter::create(&prefix, TokenDtype::U16).unwrap();
    for seq in &ids {
        let doc: Vec<u32> = seq.iter().map(|&t| t as u32).collect();
        w.add_document(&doc, &[doc.len()]).unwrap();
    }
    w.add_document(&[7], &[1]).unwrap();
    w.finalize().unwrap();
    let score = |args: &[&str]| -> serde_json::Value {
        let ckpt = s(&ckpt);
        let mut all = vec!["score", "--checkpoint", &ckpt];
        all.extend_from_slice(args);
        all.push("--json");
        let out = foldmoe(&all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let got = score(&["--data-path", &s(&prefix)]);
    assert_eq!(got["documents"], 2);
    assert_eq!(got["skipped"], 1);
    let (mut sum, mut n) = (0.0, 0);
    for (d, seq) in ids.iter().enumerate() {
        let input = root.join(format!("doc{d}.txt"));
        std::fs::write(&input, seq.iter().map(|&t| t as u8).collect::<Vec<_>>()).unwrap();
        let alone = score(&["--input", &s(&input)]);
        let doc = &got["per_document"][d];
        assert_eq!(doc["document"], d);
        assert_eq!(doc["tokens"], alone["tokens"]);
        assert_eq!(doc["mean_loss"], alone["mean_loss"], "document {d}");
        let t = alone["tokens"].as_u64().unwrap() as usize;
        sum += alone["mean_loss"].as_f64().unwrap() * t as f64;
        n += t;
    }
    assert_eq!(got["tokens"], n);
    assert!((got["mean_loss"].as_f64().unwrap() - sum / n as f64).abs() < 1e-12);
    // A truncated .bin: one line naming the file.
    let bin = prefix.with_extension("bin");
    let bytes = std::fs::read(&bin).unwrap();
    std::fs::write(&bin, &bytes[..bytes.len() - 3]).unwrap();
    let out = foldmoe(&[
        "score",
        "--checkpoint",
        &s(&ckpt),
        "--data-path",
        &s(&prefix),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("data.bin"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let _ = std::fs::remove_dir_all(&root);
}
