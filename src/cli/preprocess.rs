//! `foldmoe preprocess` (text to a Megatron `.bin`/`.idx`) and `foldmoe
//! train-tokenizer` (a byte-level BPE `tokenizer.json`): the data path's
//! commands, around `foldmoe::data`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use foldmoe::data::indexed::{bin_path, idx_path, TokenDtype};
use foldmoe::data::preprocess::{self, Format};
use foldmoe::data::tokenizer::{self, EOD_TOKEN};
use foldmoe::data::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::error::CliError;

/// Options of `foldmoe preprocess`.
#[derive(clap::Args, Debug, Clone)]
pub struct PreprocessOptions {
    /// Input: a `.jsonl` (one JSON object a line) or a text file (documents
    /// separated by blank lines).
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Key of the document text in each JSON line.
    #[arg(long, default_value = "text")]
    pub json_key: String,
    /// Tokenizer: a `tokenizer.json`, or `byte`.
    #[arg(long, value_name = "FILE", default_value = "byte")]
    pub tokenizer: PathBuf,
    /// Writes `PATH.bin` and `PATH.idx`.
    #[arg(long, value_name = "PATH")]
    pub output_prefix: PathBuf,
    /// Append the tokenizer's end-of-document token to every document.
    #[arg(long)]
    pub append_eod: bool,
    /// Tokenizing threads (default: the machine's cores).
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
}

/// Options of `foldmoe train-tokenizer`.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainTokenizerOptions {
    /// Training text: `.jsonl` files (the text under --json-key) or text files.
    #[arg(long, value_name = "FILES", num_args = 1.., required = true)]
    pub input: Vec<PathBuf>,
    /// Key of the document text in each JSON line.
    #[arg(long, default_value = "text")]
    pub json_key: String,
    /// Vocabulary size (256 bytes, `<|endoftext|>`, and the merges).
    #[arg(long, value_name = "N")]
    pub vocab_size: usize,
    /// Where to write the `tokenizer.json`.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// A bar over `total` bytes of input, hidden when stderr is not a terminal.
fn byte_bar(total: u64) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} [{elapsed_precise}<{eta_precise}] {bytes_per_sec}",
        )
        .expect("static template"),
    );
    pb
}

fn input_len(path: &Path) -> Result<u64, CliError> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|e| CliError::io("--input: cannot read", path, e))
}

/// Runs `foldmoe preprocess`; returns the line it reports.
pub fn run(o: &PreprocessOptions) -> Result<String, CliError> {
    let total = input_len(&o.input)?;
    let tok = Tokenizer::load(Some(&o.tokenizer))?;
    let workers = o.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    if workers == 0 {
        return Err(CliError::usage("--workers 0: must be at least 1"));
    }
    let format = Format::of(&o.input, &o.json_key);
    let pb = byte_bar(total);
    let t0 = Instant::now();
    let w = preprocess::preprocess(
        &o.input,
        &format,
        &tok,
        &o.output_prefix,
        o.append_eod,
        workers,
        |read| pb.set_position(read),
    );
    pb.finish_and_clear();
    let w = w?;
    let s = t0.elapsed().as_secs_f64().max(1e-9);
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    Ok(format!(
        "preprocess: {} documents, {} tokens ({:?}, vocab {}) from {:.2} MB of text in {:.2} s: \
         {:.2} MB/s, {:.0} tokens/s on {workers} worker{}; wrote {} and {}",
        w.documents,
        w.tokens,
        dtype,
        tok.vocab_size(),
        w.text_bytes as f64 / 1e6,
        s,
        w.text_bytes as f64 / 1e6 / s,
        w.tokens as f64 / s,
        if workers == 1 { "" } else { "s" },
        bin_path(&o.output_prefix).display(),
        idx_path(&o.output_prefix).display()
    ))
}

/// Runs `foldmoe train-tokenizer`; returns the line it reports.
pub fn train_tokenizer(o: &TrainTokenizerOptions) -> Result<String, CliError> {
    let mut texts = Vec::new();
    let mut bytes = 0u64;
    for path in &o.input {
        input_len(path)?;
        let format = Format::of(path, &o.json_key);
        preprocess::read_documents(path, &format, 4 << 20, |docs, _| {
            bytes += docs.iter().map(|d| d.len() as u64).sum::<u64>();
            texts.extend(docs);
            Ok(())
        })?;
    }
    let t0 = Instant::now();
    let trained = tokenizer::train_bpe(texts.into_iter(), o.vocab_size, &o.out)?;
    Ok(format!(
        "train-tokenizer: byte-level BPE of {} tokens ({EOD_TOKEN} = {}) trained on {:.2} MB in {:.2} s; wrote {}",
        trained.vocab_size,
        trained.eod,
        bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64(),
        o.out.display()
    ))
}
