//! Hugging Face conversion against transformers: the fixtures of
//! `tests/fixtures/hf/` (made once by `make_fixtures.py` with transformers
//! 5.17 and 5.24 and PyTorch 2.11; no Python at test time) imported, run through the
//! engine and compared with transformers' fp32 logits; exported back and
//! compared byte for byte; and bad inputs, each a one-line error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use foldmoe::core::engine::checkpoint::{load_params, Source};
use foldmoe::core::engine::hf::{self, ExpertLayout, ExportDtype};
use foldmoe::core::engine::model::{Batch, Model};
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

/// A fresh scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("foldmoe-hf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Scratch(d)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fixture imported by the library: its config (as read, or edited
/// before import), the checkpoint and the expert layout found.
struct Imported {
    cfg: hf::HfConfig,
    experts: ExpertLayout,
    ckpt: PathBuf,
    _dir: Scratch,
}

impl Imported {
    /// `family`'s fixture under `layout`, its config read and then changed
    /// by `edit`.
    fn with(family: &str, layout: &str, edit: impl FnOnce(&mut hf::HfConfig)) -> Self {
        let src = fixture(family);
        let mut cfg = hf::read_config(&src).unwrap();
        edit(&mut cfg);
        let l = check(&LayoutSpec::parse(layout).unwrap(), &cfg.spec).unwrap();
        let dir = Scratch::new(&format!("{family}-{}", layout.replace([',', '='], "_")));
        let ckpt = dir.join("ckpt");
        let experts = hf::import(&src, &cfg, &l, &ckpt, &serde_json::Value::Null).unwrap();
        Imported {
            cfg,
            experts,
            ckpt,
            _dir: dir,
        }
    }

    fn new(family: &str, layout: &str) -> Self {
        Self::with(family, layout, |_| {})
    }

    fn source(&self) -> Source {
        let (source, _): (Source, serde_json::Value) = Source::open(&self.ckpt).unwrap();
        source
    }

    /// The imported model on one CPU rank, in f32.
    fn model(&self) -> Model<Cpu> {
        let mut model = Model::single(&Cpu, &self.cfg.spec, 1, DType::F32).unwrap();
        load_params(&Cpu, &self.source(), &mut model, true).unwrap();
        model
    }

    /// The engine's logits for the sequences `ids`, one after the other.
    fn logits(&self, ids: &[Vec<i32>]) -> Vec<f32> {
        let model = self.model();
        let exec = Exec::solo(&Cpu);
        let mut out = Vec::new();
        for seq in ids {
            let l = model.logits(&exec, seq, seq.len()).unwrap();
            out.extend(Cpu.download(&l).unwrap().to_f32());
        }
        out
    }

    /// Exports the import into a fresh directory.
    fn export(&self, tag: &str, max_shard: u64, dtype: ExportDtype) -> Scratch {
        let out = Scratch::new(tag);
        hf::export(
            &self.source(),
            &self.cfg,
            self.experts,
            &out.0,
            max_shard,
            dtype,
        )
        .unwrap();
        out
    }
}

/// A safetensors file of `dir`, by name: its tensors as f32 values
/// (`I64` ids too).
fn read_safetensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| {
            let vals = match t.dtype() {
                Dtype::I64 => t
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::F32 => t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: {other:?}"),
            };
            (name, (t.shape().to_vec(), vals))
        })
        .collect()
}

/// The fixture's input ids `[B, S]` and transformers' logits `[B, S, V]`.
fn reference(family: &str) -> (Vec<Vec<i32>>, Vec<f32>) {
    let t = read_safetensors(&fixture(family).join("logits.safetensors"));
    let (shape, ids) = &t["input_ids"];
    let ids: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let logits = t["logits"].1.iter().map(|&x| x as f32).collect();
    (ids.chunks(shape[1]).map(<[i32]>::to_vec).collect(), logits)
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
    let imported = Imported::new(family, layout);
    let (ids, want) = reference(&family.replace("_fused", ""));
    let got = imported.logits(&ids);
    let diff = max_abs_diff(&got, &want);
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    println!("{family} ({layout}): max |logit diff| {diff:.2e} (logits up to {scale:.2})");
    assert!(
        diff <= 1e-4,
        "{family}: max abs logit difference {diff:e} > 1e-4"
    );
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

/// YaRN (factor 4 over an original context of 8, the input 12 long, the
/// ramp inside the rotary dims): Qwen3-MoE's cos/sin attention factor, and
/// DeepSeek-V3's too with its mscale² softmax scale; the DeepSeek fixture
/// also carries an MTP module, which transformers' logits ignore.
#[test]
fn yarn_logits_match_transformers() {
    check_parity("qwen3_moe_yarn", "world=1");
    check_parity("deepseek_v3_yarn_mtp", "world=1");
}

/// What the fixtures exercise: imported as if their rotary dims were
/// halves (DeepSeek's interleaved layout ignored), or without their YaRN
/// scaling, the logits are far off.
#[test]
fn rope_interleave_and_yarn_matter() {
    for (family, edit) in [
        (
            "deepseek_v3",
            Box::new(|c: &mut hf::HfConfig| c.rope_interleave = false)
                as Box<dyn FnOnce(&mut hf::HfConfig)>,
        ),
        (
            "deepseek_v3_yarn_mtp",
            Box::new(|c: &mut hf::HfConfig| c.spec.rope_scaling = None),
        ),
        (
            "qwen3_moe_yarn",
            Box::new(|c: &mut hf::HfConfig| c.spec.rope_scaling = None),
        ),
    ] {
        let imported = Imported::with(family, "world=1", edit);
        let (ids, want) = reference(family);
        let diff = max_abs_diff(&imported.logits(&ids), &want);
        assert!(diff > 1e-2, "{family}, edited: {diff:e}");
    }
}

/// A checkpoint imported for a parallel layout (each rank's file its own
/// blocks) gives the same model when read back on one rank.
#[test]
fn import_for_a_layout_reads_back_on_one_rank() {
    check_parity("qwen3_moe", "world=4,tp=2,ep=4");
    check_parity("deepseek_v3", "world=6,pp=3,ep=2");
    check_parity("deepseek_v3_yarn_mtp", "world=4,pp=2,ep=2");
}

/// The imported MTP module's loss on the fixture input (the mean
/// cross-entropy of its predictions two tokens ahead) is the one the
/// fixture script computed in PyTorch from the same weights.
#[test]
fn mtp_loss_matches_the_reference() {
    let imported = Imported::new("deepseek_v3_yarn_mtp", "world=1");
    assert_eq!(imported.cfg.spec.mtp_layers, 1);
    let want =
        read_safetensors(&fixture("deepseek_v3_yarn_mtp").join("mtp.safetensors"))["mtp_loss"].1[0];
    let (ids, _) = reference("deepseek_v3_yarn_mtp");
    let s = ids[0].len();
    let tokens: Vec<i32> = ids.concat();
    // Next-token targets, the last of each sequence ignored.
    let targets: Vec<i32> = ids
        .iter()
        .flat_map(|seq| seq[1..].iter().copied().chain([-1]))
        .collect();
    let out = imported
        .model()
        .forward(
            &Exec::solo(&Cpu),
            Batch::Host {
                tokens: &tokens,
                targets: &targets,
                docs: None,
            },
            s,
        )
        .unwrap();
    let got = Cpu
        .download(out.mtp_loss.as_ref().unwrap())
        .unwrap()
        .to_f32()[0] as f64;
    println!("mtp loss {got:.6} (PyTorch {want:.6})");
    assert!((got - want).abs() <= 1e-4, "mtp loss {got} vs {want}");
}

/// An MTP module's copy of the embedding that is not the main model's is
/// a one-line error naming both.
#[test]
fn an_mtp_copy_that_differs_is_named() {
    let copy = "model.layers.2.shared_head.head.weight";
    let dir = edited("deepseek_v3_yarn_mtp", "mtp-copy", |t| {
        t.get_mut(copy).unwrap().2[0] ^= 1;
    });
    let e = import_error(&dir.0);
    assert!(
        e.contains(copy) && e.contains("differs from lm_head.weight"),
        "{e}"
    );
}

/// Every tensor of a safetensors file, by name: dtype, shape, bytes.
fn tensors_of(dir: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors")
            && !path.ends_with("logits.safetensors")
            && !path.ends_with("dequantised.safetensors")
            && !path.ends_with("mtp.safetensors")
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
/// layout the model came in (per expert; fused, over shards), the MTP
/// module's tensors and its copies of the embedding and head included.
#[test]
fn export_gives_back_the_original_tensors() {
    for (family, max_shard) in [
        ("mixtral", u64::MAX),
        ("qwen3_moe", u64::MAX),
        ("deepseek_v3", u64::MAX),
        ("qwen3_moe_fused", 100_000),
        ("qwen3_moe_yarn", u64::MAX),
        ("deepseek_v3_yarn_mtp", u64::MAX),
    ] {
        let imported = Imported::new(family, "world=2,ep=2");
        let out = imported.export(&format!("export-{family}"), max_shard, ExportDtype::F32);
        let (want, got) = (tensors_of(&fixture(family)), tensors_of(&out.0));
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
    }
}

/// A bf16 checkpoint (`qwen3_moe_bf16`: the Qwen3-MoE fixture saved by
/// transformers in bfloat16, `torch_dtype` bfloat16) imports and exports
/// back in bf16 byte for byte — the dtype the config names, also through
/// `convert`'s default — and `--dtype f32` widens every value exactly.
#[test]
fn bf16_export_gives_back_the_original_tensors() {
    let imported = Imported::new("qwen3_moe_bf16", "world=1");
    assert_eq!(
        ExportDtype::of_config(&imported.cfg.raw),
        Some(ExportDtype::Bf16)
    );
    let want = tensors_of(&fixture("qwen3_moe_bf16"));
    let out = imported.export("export-bf16", u64::MAX, ExportDtype::Bf16);
    let got = tensors_of(&out.0);
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
    let wide = imported.export("export-bf16-as-f32", u64::MAX, ExportDtype::F32);
    for (name, (dtype, shape, bytes)) in tensors_of(&wide.0) {
        assert_eq!(dtype, Dtype::F32);
        assert_eq!(shape, want[&name].1);
        let back: Vec<u8> = bytes.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        assert_eq!(back, want[&name].2, "{name}: f32 is not the bf16 widened");
    }
}

/// DeepSeek's fp8 form: e4m3 weights times their block `weight_scale_inv`
/// give exactly the dequantised values the script computed.
#[test]
fn deepseek_fp8_weights_are_dequantised_on_import() {
    let imported = Imported::new("deepseek_v3_fp8", "world=1");
    assert_eq!(imported.cfg.fp8_block, Some([128, 128]));
    assert_eq!(imported.experts, ExpertLayout::PerExpert);
    let out = imported.export("export-fp8", u64::MAX, ExportDtype::F32);
    let got = tensors_of(&out.0);
    let bytes = std::fs::read(fixture("deepseek_v3_fp8").join("dequantised.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for (name, view) in want.tensors() {
        assert_eq!(got[&name].2, view.data(), "{name}");
        checked += 1;
    }
    assert!(checked > 10, "{checked} fp8 tensors");
    assert!(!got.keys().any(|k| k.ends_with("_scale_inv")));
}

/// `family`'s fixture copied with its tensors edited by `edit` (name →
/// (dtype, shape, bytes)).
fn edited(
    family: &str,
    tag: &str,
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) -> Scratch {
    let src = fixture(family);
    let mut t = tensors_of(&src);
    edit(&mut t);
    let dir = Scratch::new(tag);
    std::fs::create_dir_all(&dir.0).unwrap();
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
    e
}

#[test]
fn missing_unexpected_and_misshapen_tensors_are_named() {
    let name = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
    let dir = edited("mixtral", "missing", |t| {
        t.remove(name);
    });
    let e = import_error(&dir.0);
    assert!(e.contains(name) && e.contains("missing"), "{e}");

    let dir = edited("mixtral", "extra", |t| {
        let v = t["model.norm.weight"].clone();
        t.insert("model.layers.0.self_attn.q_bias".into(), v);
    });
    let e = import_error(&dir.0);
    assert!(
        e.contains("model.layers.0.self_attn.q_bias") && e.contains("not used"),
        "{e}"
    );

    let dir = edited("mixtral", "shape", |t| {
        let (d, _, b) = t["model.layers.0.self_attn.k_proj.weight"].clone();
        t.insert(
            "model.layers.0.self_attn.k_proj.weight".into(),
            (d, vec![32, 16], b),
        );
    });
    let e = import_error(&dir.0);
    assert!(
        e.contains("model.layers.0.self_attn.k_proj.weight") && e.contains("[32, 16]"),
        "{e}"
    );

    let dir = edited("mixtral", "dtype", |t| {
        let (_, s, b) = t["model.norm.weight"].clone();
        t.insert("model.norm.weight".into(), (Dtype::I32, s, b));
    });
    let e = import_error(&dir.0);
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");
}

fn foldmoe(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_foldmoe"))
        .args(args)
        .output()
        .unwrap()
}

/// `foldmoe args`, which must succeed (its stderr shown otherwise).
fn foldmoe_ok<S: AsRef<str>>(args: &[S]) -> Output {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let out = foldmoe(&args);
    assert!(
        out.status.success(),
        "foldmoe {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `foldmoe args`, which must fail with one line on stderr containing `want`.
fn foldmoe_err(args: &[&str], want: &str) {
    let out = foldmoe(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(want), "{err}");
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// `foldmoe convert --from-hf` of `family`'s fixture into `ckpt`.
fn convert_fixture(family: &str, ckpt: &Path) -> Output {
    foldmoe_ok(&[
        "convert",
        "--from-hf",
        &s(&fixture(family)),
        "--out",
        &s(ckpt),
    ])
}

/// `foldmoe convert --from-hf`, `generate` from the import, `convert
/// --to-hf`: the exported tensors and config are the originals.
#[test]
fn cli_round_trip_and_errors() {
    let root = Scratch::new("cli");
    let (ckpt, back) = (root.join("ckpt"), root.join("hf"));
    let src = fixture("qwen3_moe");
    let out = foldmoe_ok(&[
        "convert",
        "--from-hf",
        &s(&src),
        "--out",
        &s(&ckpt),
        "--layout",
        "world=2,tp=2",
    ]);
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.contains("qwen3_moe") && line.contains("per-expert"),
        "{line}"
    );
    let out = foldmoe_ok(&[
        "generate",
        "--checkpoint",
        &s(&ckpt),
        "--tokens",
        "8",
        "--temperature",
        "0",
        "--raw",
    ]);
    assert!(out.stdout.len() >= 8, "{:?}", out.stdout);
    foldmoe_ok(&["convert", "--to-hf", &s(&ckpt), "--out", &s(&back)]);
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
    let mut c = cfg(&src);
    c["rope_parameters"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0});
    let dynamic = root.join("dynamic");
    std::fs::create_dir_all(&dynamic).unwrap();
    std::fs::write(dynamic.join("config.json"), c.to_string()).unwrap();
    let x = s(&root.join("x"));
    for (args, want) in [
        (
            vec!["convert", "--from-hf", &s(&bad), "--out", &x],
            "field `use_qk_clip`",
        ),
        (
            vec!["convert", "--from-hf", &s(&dynamic), "--out", &x],
            "rope_type `dynamic`",
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
        foldmoe_err(&args, want);
    }
}

/// `foldmoe score` on an imported model: its per-token log-probabilities
/// are transformers' (log-softmax of the fixture's logits at the next
/// token) within 1e-4, for every family, YaRN included.
#[test]
fn score_matches_transformers_log_probs() {
    for family in [
        "mixtral",
        "qwen3_moe",
        "deepseek_v3",
        "deepseek_v3_yarn_mtp",
    ] {
        let root = Scratch::new(&format!("score-{family}"));
        let ckpt = root.join("ckpt");
        convert_fixture(family, &ckpt);
        let (ids, logits) = reference(family);
        let vocab = logits.len() / (ids.len() * ids[0].len());
        // The fixture's first sequence, one byte per id (all below 128).
        let text: Vec<u8> = ids[0].iter().map(|&t| t as u8).collect();
        let input = root.join("input.txt");
        std::fs::write(&input, &text).unwrap();
        let out = foldmoe_ok(&[
            "score",
            "--checkpoint",
            &s(&ckpt),
            "--input",
            &s(&input),
            "--json",
        ]);
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
    }
}

/// A foldmoe-trained model exports (as Mixtral), imports back, and the
/// import starts a fine-tune with `train --resume` under its own flags (its
/// run settings are only defaults), its moments at zero.
#[test]
fn trained_model_exports_imports_and_fine_tunes() {
    let root = Scratch::new("finetune");
    let (run, hf_dir, ckpt, ft) = (
        s(&root.join("run")),
        s(&root.join("hf")),
        s(&root.join("ckpt")),
        s(&root.join("ft")),
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
        &run,
    ];
    args.extend(small);
    foldmoe_ok(&args);
    foldmoe_ok(&["convert", "--to-hf", &run, "--out", &hf_dir]);
    foldmoe_ok(&["convert", "--from-hf", &hf_dir, "--out", &ckpt]);
    let mut args = vec!["train", "--resume", &ckpt, "--steps", "2", "--out", &ft];
    args.extend(small);
    foldmoe_ok(&args);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("ft/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["steps"], 2);
}

/// `score --tokenizer`: a BPE's ids read the text; an id past the model's
/// vocabulary is a one-line error naming it.
#[test]
fn score_reads_the_text_with_a_tokenizer() {
    let root = Scratch::new("score-tok");
    std::fs::create_dir_all(&root.0).unwrap();
    let (ckpt, text, tok) = (root.join("ckpt"), root.join("t.txt"), root.join("tok.json"));
    std::fs::write(&text, "abab abab abab cdcd cdcd abab cdcd ".repeat(20)).unwrap();
    convert_fixture("mixtral", &ckpt);
    foldmoe_ok(&[
        "train-tokenizer",
        "--input",
        &s(&text),
        "--vocab-size",
        "300",
        "--out",
        &s(&tok),
    ]);
    let score = |tokenizer: &str| {
        vec![
            "score".to_string(),
            "--checkpoint".into(),
            s(&ckpt),
            "--input".into(),
            s(&text),
            "--tokenizer".into(),
            tokenizer.into(),
        ]
    };
    let args = score(&s(&tok));
    foldmoe_err(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "outside the model's vocabulary of 128",
    );
    // Bytes as the tokenizer: the same text scores.
    let out = foldmoe_ok(&score("byte"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("tokens scored"));
}

/// `score --data-path` scores each document of an indexed dataset on its
/// own: the fixture's two sequences written as two documents score as
/// each does alone with `--input` (within transformers' 1e-4 of each
/// other through the same engine: exactly), their mean weighted by tokens;
/// a truncated `.bin` is a one-line error.
#[test]
fn score_reads_an_indexed_dataset_by_document() {
    use foldmoe::data::indexed::{IndexedWriter, TokenDtype};
    let root = Scratch::new("score-bin");
    let ckpt = root.join("ckpt");
    convert_fixture("mixtral", &ckpt);
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
        serde_json::from_slice(&foldmoe_ok(&all).stdout).unwrap()
    };
    let got = score(&["--data-path", &s(&prefix)]);
    assert_eq!(got["documents"], 2);
    assert_eq!(got["skipped"], 1);
    let (mut sum, mut n) = (0.0, 0);
    for (d, seq) in ids.iter().enumerate() {
        let input = root.join(&format!("doc{d}.txt"));
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
    foldmoe_err(
        &[
            "score",
            "--checkpoint",
            &s(&ckpt),
            "--data-path",
            &s(&prefix),
        ],
        "data.bin",
    );
}
