//! `foldmoe preprocess`'s work: documents read from a `.jsonl` (one JSON
//! object a line, the text under a key) or a `.txt` (documents separated by
//! blank lines), tokenized in parallel and written in order as Megatron's
//! `tools/preprocess_data.py` writes them: one sequence per document (its
//! ids, the end-of-document token appended with `append_eod`), an empty
//! document ending a document with no sequence.

use std::io::{BufRead, BufReader};
use std::path::Path;

use rayon::prelude::*;

use crate::error::{DataError, Result};
use crate::indexed::{IndexedWriter, TokenDtype};
use crate::tokenizer::Tokenizer;

/// Where the documents of an input file come from.
#[derive(Clone, Debug)]
pub enum Format {
    /// One JSON object a line, the document under this key.
    Jsonl(String),
    /// Documents separated by blank lines.
    Text,
}

impl Format {
    /// `.jsonl`/`.json` files are JSON lines read at `key`; others text.
    pub fn of(path: &Path, key: &str) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "json") => Format::Jsonl(key.to_string()),
            _ => Format::Text,
        }
    }
}

/// Reads documents of `path` in chunks of about `chunk_bytes`, calling `f`
/// with each chunk and the input bytes read so far.
pub fn read_documents(
    path: &Path,
    format: &Format,
    chunk_bytes: usize,
    mut f: impl FnMut(Vec<String>, u64) -> Result<()>,
) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io("cannot read", path, e))?;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let (mut chunk, mut bytes_in_chunk, mut read) = (Vec::new(), 0usize, 0u64);
    let mut line = String::new();
    let mut para = String::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        let n = r.read_line(&mut line).map_err(|e| {
            DataError::io("cannot read", path, format!("line {}: {e}", line_no + 1))
        })?;
        read += n as u64;
        line_no += 1;
        let eof = n == 0;
        match format {
            Format::Jsonl(key) => {
                if !eof && !line.trim().is_empty() {
                    let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
                        DataError::Invalid(format!(
                            "{} line {line_no}: not JSON: {e}",
                            path.display()
                        ))
                    })?;
                    let text = v.get(key).and_then(|t| t.as_str()).ok_or_else(|| {
                        DataError::Invalid(format!(
                            "{} line {line_no}: no string under --json-key {key}",
                            path.display()
                        ))
                    })?;
                    bytes_in_chunk += text.len();
                    chunk.push(text.to_string());
                }
            }
            Format::Text => {
                if eof || line.trim().is_empty() {
                    if !para.is_empty() {
                        bytes_in_chunk += para.len();
                        chunk.push(std::mem::take(&mut para));
                    }
                } else {
                    para.push_str(&line);
                    if !line.ends_with('\n') {
                        para.push('\n');
                    }
                }
            }
        }
        if bytes_in_chunk >= chunk_bytes || (eof && !chunk.is_empty()) {
            f(std::mem::take(&mut chunk), read)?;
            bytes_in_chunk = 0;
        }
        if eof {
            return Ok(());
        }
    }
}

/// What [`preprocess`] wrote.
#[derive(Clone, Debug, Default)]
pub struct Written {
    /// Documents.
    pub documents: usize,
    /// Tokens.
    pub tokens: u64,
    /// Bytes of document text read.
    pub text_bytes: u64,
}

/// Tokenizes the documents of `input` on `workers` threads and writes
/// `prefix.bin`/`prefix.idx` (ids as uint16 below 65,500 tokens of
/// vocabulary, else int32); `progress` gets the input bytes read so far.
pub fn preprocess(
    input: &Path,
    format: &Format,
    tokenizer: &Tokenizer,
    prefix: &Path,
    append_eod: bool,
    workers: usize,
    mut progress: impl FnMut(u64),
) -> Result<Written> {
    let eod = match (append_eod, tokenizer.eod()) {
        (false, _) => None,
        (true, Some(id)) => Some(id),
        (true, None) => {
            return Err(DataError::Invalid(format!(
                "--append-eod: tokenizer {} has no end-of-document token (looked for <|endoftext|>, </s>, ...)",
                tokenizer.name()
            )))
        }
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(workers.max(1))
        .build()
        .map_err(|e| DataError::Invalid(format!("--workers {workers}: {e}")))?;
    let mut w = IndexedWriter::create(prefix, TokenDtype::for_vocab(tokenizer.vocab_size()))?;
    let mut text_bytes = 0u64;
    read_documents(input, format, 4 << 20, |docs, read| {
        text_bytes += docs.iter().map(|d| d.len() as u64).sum::<u64>();
        let encoded: Vec<Result<Vec<u32>>> =
            pool.install(|| docs.par_iter().map(|d| tokenizer.encode(d)).collect());
        for ids in encoded {
            let mut ids = ids?;
            if !ids.is_empty() {
                if let Some(e) = eod {
                    ids.push(e);
                }
                let n = ids.len();
                w.add_document(&ids, &[n])?;
            } else {
                w.add_document(&[], &[])?;
            }
        }
        progress(read);
        Ok(())
    })?;
    let written = Written {
        documents: w.documents(),
        tokens: w.tokens(),
        text_bytes,
    };
    w.finalize()?;
    Ok(written)
}
