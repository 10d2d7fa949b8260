//! The data path end to end (issue 19): `train-tokenizer` → `preprocess` →
//! `train --data-path` with a blend and a split, on a BPE that lowers the
//! loss; resume continues exactly, dp ranks read their own samples, and bad
//! data is a one-line error.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{foldmoe, losses, scratch, stderr, Scratch, FAST};
use foldmoe::data::indexed::{idx_path, IndexedDataset};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Asserts a failed command with a one-line `error:` containing every needle.
fn assert_fails_with(o: &Output, needles: &[&str]) {
    assert!(!o.status.success(), "expected failure: {}", stderr(o));
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got {err:?}");
    for n in needles {
        assert!(
            lines[0].contains(n),
            "{:?} does not mention {n:?}",
            lines[0]
        );
    }
}

/// A corpus of the bundled text's first 400 kB as JSON lines (one document
/// per paragraph), a BPE of 512 tokens trained on it, its dataset
/// preprocessed with end-of-document tokens, a byte-level dataset of the
/// same text, and the tiny model with a vocabulary of 512.
struct Setup {
    /// Removed when the test ends.
    dir: Scratch,
    tokenizer: PathBuf,
    bpe: PathBuf,
    bytes: PathBuf,
    model: PathBuf,
}

fn setup(tag: &str) -> Setup {
    let dir = scratch(tag);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("data/train.txt")).unwrap();
    let cut = text
        .char_indices()
        .nth(400_000)
        .map_or(text.len(), |(i, _)| i);
    let jsonl: String = text[..cut]
        .split("\n\n")
        .map(|p| serde_json::json!({ "text": p, "id": 1 }).to_string() + "\n")
        .collect();
    let input = dir.join("corpus.jsonl");
    std::fs::write(&input, jsonl).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let o = foldmoe(&[
        "train-tokenizer",
        "--input",
        s(&input),
        "--vocab-size",
        "512",
        "--out",
        s(&tokenizer),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bpe = dir.join("bpe/corpus");
    let o = foldmoe(&[
        "preprocess",
        "--input",
        s(&input),
        "--tokenizer",
        s(&tokenizer),
        "--output-prefix",
        s(&bpe),
        "--append-eod",
        "--workers",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("MB/s") && out.contains("U16"), "{out}");
    let bytes = dir.join("bytes/corpus");
    let o = foldmoe(&[
        "preprocess",
        "--input",
        s(&input),
        "--output-prefix",
        s(&bytes),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let tiny = std::fs::read_to_string(root.join("models/configs/tiny.toml")).unwrap();
    let model = dir.join("tiny512.toml");
    std::fs::write(
        &model,
        tiny.replace("name = \"tiny\"", "name = \"tiny512\"")
            .replace("vocab = 256", "vocab = 512"),
    )
    .unwrap();
    Setup {
        dir,
        tokenizer,
        bpe,
        bytes,
        model,
    }
}

impl Setup {
    fn train(&self, out: &str, extra: &[&str]) -> Output {
        let run = self.dir.join(out);
        let mut args = vec![
            "train",
            "--out",
            s(&run),
            "--model-config",
            s(&self.model),
            "--tokenizer",
            s(&self.tokenizer),
        ];
        args.extend_from_slice(FAST);
        args.extend_from_slice(extra);
        foldmoe(&args)
    }
}

#[test]
fn bpe_dataset_trains_resumes_exactly_and_splits_over_dp_ranks() {
    let d = setup("bpe");
    // The dataset reads back as the tokenizer's ids, one document per
    // paragraph with the end-of-document token last.
    let ds = IndexedDataset::open(&d.bpe).unwrap();
    assert!(ds.documents() > 50, "{}", ds.documents());
    let tok = foldmoe::data::Tokenizer::from_file(&d.tokenizer).unwrap();
    let first = ds.sequence(0).unwrap();
    assert_eq!(first.last().copied(), tok.eod());
    assert!(tok
        .decode(&first[..first.len() - 1])
        .unwrap()
        .starts_with("In the beginning God created"));

    let blend = ["--data-path", "0.3", s(&d.bytes), "0.7", s(&d.bpe)];
    let mut args: Vec<&str> = blend.to_vec();
    args.extend([
        "--split",
        "90,10,0",
        "--steps",
        "6",
        "--seed",
        "5",
        "--warmup-steps",
        "2",
    ]);
    let a = d.train("a", &args);
    assert!(a.status.success(), "{}", stderr(&a));
    let log = String::from_utf8_lossy(&a.stdout);
    assert!(log.contains("indices built, cached in"), "{log}");
    let l = losses(&d.dir.join("a"));
    assert!(l[5] < l[0] - 0.5, "loss did not fall: {l:?}");
    // Interrupted at 3 and resumed: the same losses; the indices come from
    // the cache.
    let mut first = args.clone();
    first.extend(["--exit-after", "3"]);
    let c = d.train("c", &first);
    assert!(c.status.success(), "{}", stderr(&c));
    assert!(String::from_utf8_lossy(&c.stdout).contains("indices read from"));
    let resumed = foldmoe(&["train", "--resume", s(&d.dir.join("c"))]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(losses(&d.dir.join("c")), l, "resumed run differs");
    // Changing the data on resume is refused.
    let o = foldmoe(&[
        "train",
        "--resume",
        s(&d.dir.join("c")),
        "--steps",
        "8",
        "--data-path",
        s(&d.bpe),
    ]);
    assert_fails_with(&o, &["--data-path", "cannot change on resume"]);

    // Two dp ranks, each reading its own micro-batch, train as one rank
    // with two micro-batches.
    let mut one = blend.to_vec();
    one.extend(["--steps", "3", "--micro-batches", "2"]);
    let one_run = d.train("one", &one);
    assert!(one_run.status.success(), "{}", stderr(&one_run));
    let mut two = blend.to_vec();
    two.extend(["--steps", "3", "--ranks", "2"]);
    let two_run = d.train("two", &two);
    assert!(two_run.status.success(), "{}", stderr(&two_run));
    let (want, got) = (losses(&d.dir.join("one")), losses(&d.dir.join("two")));
    for (step, (x, y)) in got.iter().zip(&want).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "step {step}: {x} vs {y}");
    }

    // Positions and attention reset at each end-of-document token, and no
    // loss after one: the flags reach the run, which trains (their effect
    // is checked in the engine: `documents_equal_each_document_alone`,
    // `documents_under_cp_and_tp_match_one_rank`).
    let mut reset = one.clone();
    reset.extend([
        "--reset-position-ids",
        "--reset-attention-mask",
        "--eod-mask-loss",
    ]);
    let r = d.train("reset", &reset);
    assert!(r.status.success(), "{}", stderr(&r));
    let got = losses(&d.dir.join("reset"));
    assert!(
        got.iter().all(|l| l.is_finite()) && got.len() == 3,
        "{got:?}"
    );
    // The byte tokenizer has no end-of-document token.
    let o = foldmoe(&[
        "train",
        "--out",
        s(&d.dir.join("bytes-reset")),
        "--data-path",
        s(&d.bytes),
        "--reset-attention-mask",
    ]);
    assert_fails_with(&o, &["--reset-attention-mask", "no end-of-document token"]);
}

#[test]
fn bad_data_gives_one_line_errors() {
    let d = setup("bad");
    // The model's vocabulary must cover the tokenizer's.
    let o = foldmoe(&["train", "--tokenizer", s(&d.tokenizer), "--steps", "1"]);
    assert_fails_with(&o, &["512 tokens", "`tiny`", "vocab 256"]);
    // BPE ids in a byte model.
    let o = foldmoe(&["train", "--data-path", s(&d.bpe), "--steps", "1"]);
    assert_fails_with(&o, &["token id", "vocabulary of 256"]);
    // Data that changed under a run is refused on resume.
    let copy = d.dir.join("copy/corpus");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    for ext in ["bin", "idx"] {
        std::fs::copy(d.bpe.with_extension(ext), copy.with_extension(ext)).unwrap();
    }
    let o = d.train(
        "changed",
        &["--data-path", s(&copy), "--steps", "2", "--exit-after", "1"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // Another dataset under the same prefix (its index differs).
    for ext in ["bin", "idx"] {
        std::fs::copy(d.bytes.with_extension(ext), copy.with_extension(ext)).unwrap();
    }
    let o = foldmoe(&["train", "--resume", s(&d.dir.join("changed"))]);
    assert_fails_with(&o, &["changed since the checkpoint"]);
    // A corrupt index names the file and the field.
    let idx = idx_path(&d.bytes);
    let mut bytes = std::fs::read(&idx).unwrap();
    bytes[9] = 3;
    std::fs::write(&idx, &bytes).unwrap();
    let o = foldmoe(&["train", "--data-path", s(&d.bytes), "--steps", "1"]);
    assert_fails_with(&o, &[s(&idx), "version: 3"]);
    bytes[9] = 1;
    std::fs::write(&idx, &bytes[..bytes.len() - 5]).unwrap();
    let o = foldmoe(&["train", "--data-path", s(&d.bytes), "--steps", "1"]);
    assert_fails_with(&o, &[s(&idx), "truncated"]);
    let o = foldmoe(&[
        "train",
        "--data-path",
        s(&d.dir.join("absent")),
        "--steps",
        "1",
    ]);
    assert_fails_with(&o, &["absent.idx"]);
    // Flags.
    let o = foldmoe(&["train", "--split", "90,10,0"]);
    assert_fails_with(&o, &["--split", "--data-path"]);
    let o = foldmoe(&["train", "--data-path", "0.5", s(&d.bpe), "0.5"]);
    assert_fails_with(&o, &["--data-path", "weight"]);
    let o = foldmoe(&["train", "--data-path", s(&d.bpe), "--split", "1,x"]);
    assert_fails_with(&o, &["--split 1,x"]);
    let o = foldmoe(&[
        "preprocess",
        "--input",
        s(&d.dir.join("corpus.jsonl")),
        "--output-prefix",
        s(&d.dir.join("eod")),
        "--append-eod",
    ]);
    assert_fails_with(&o, &["--append-eod", "byte"]);
    let o = foldmoe(&[
        "preprocess",
        "--input",
        s(&d.dir.join("corpus.jsonl")),
        "--json-key",
        "body",
        "--output-prefix",
        s(&d.dir.join("key")),
    ]);
    assert_fails_with(&o, &["line 1", "--json-key body"]);
    // A training with the split's validation share empty still trains.
    let o = d.train(
        "noval",
        &["--data-path", s(&d.bpe), "--split", "1,0,0", "--steps", "2"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}
