//! Tokenizers: bytes (the default, vocabulary 256) or a Hugging Face
//! `tokenizer.json` through the `tokenizers` crate (pure Rust: its
//! fancy-regex engine, no C library), and the training of a byte-level BPE.
//! Token ids are `u32` throughout the data path.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

use crate::error::{DataError, Result};

/// Bytes are tokens: vocabulary 256, no unknowns, no training.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Vocabulary size.
    pub const VOCAB: usize = 256;

    /// Token ids of `text` (its UTF-8 bytes).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Text of `ids`; ids outside 0..256 are skipped, invalid UTF-8 replaced.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The end-of-document token of a trained BPE (GPT-2's name for it).
pub const EOD_TOKEN: &str = "<|endoftext|>";

/// Names an end-of-document token goes by in published `tokenizer.json`
/// files, in the order they are looked for (`tokenizer.json` does not say
/// which token is the eos; `tokenizer_config.json` does, and is not read).
const EOD_NAMES: &[&str] = &[EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"];

/// A tokenizer of the data path.
#[derive(Clone)]
pub enum Tokenizer {
    /// [`ByteTokenizer`].
    Byte,
    /// A Hugging Face `tokenizer.json`.
    Hf {
        /// The file it was read from.
        path: PathBuf,
        /// The tokenizer.
        inner: Box<tokenizers::Tokenizer>,
    },
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({})", self.name())
    }
}

impl Tokenizer {
    /// `None` or `byte`: the byte tokenizer; otherwise a `tokenizer.json`.
    pub fn load(spec: Option<&Path>) -> Result<Self> {
        match spec {
            None => Ok(Tokenizer::Byte),
            Some(p) if p == Path::new("byte") => Ok(Tokenizer::Byte),
            Some(p) => Self::from_file(p),
        }
    }

    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(DataError::Tokenizer {
                path: path.display().to_string(),
                msg: "no such file (give a tokenizer.json, or `byte`)".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| DataError::Tokenizer {
            path: path.display().to_string(),
            msg: one_line(&e.to_string()),
        })?;
        Ok(Tokenizer::Hf {
            path: path.to_path_buf(),
            inner: Box::new(inner),
        })
    }

    /// `byte`, or the file's path.
    pub fn name(&self) -> String {
        match self {
            Tokenizer::Byte => "byte".into(),
            Tokenizer::Hf { path, .. } => path.display().to_string(),
        }
    }

    /// Vocabulary size, added tokens included: every id is below it.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => ByteTokenizer::VOCAB,
            Tokenizer::Hf { inner, .. } => inner.get_vocab_size(true),
        }
    }

    /// The end-of-document token, if the tokenizer has one.
    pub fn eod(&self) -> Option<u32> {
        match self {
            Tokenizer::Byte => None,
            Tokenizer::Hf { inner, .. } => EOD_NAMES.iter().find_map(|n| inner.token_to_id(n)),
        }
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Byte => Ok(ByteTokenizer.encode(text)),
            Tokenizer::Hf { inner, path } => inner
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer {
                    path: path.display().to_string(),
                    msg: one_line(&e.to_string()),
                }),
        }
    }

    /// Text of `ids` (special tokens kept; invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Byte => Ok(ByteTokenizer.decode(ids)),
            Tokenizer::Hf { inner, path } => {
                inner.decode(ids, false).map_err(|e| DataError::Tokenizer {
                    path: path.display().to_string(),
                    msg: one_line(&e.to_string()),
                })
            }
        }
    }
}

/// What [`train_bpe`] made.
#[derive(Clone, Debug)]
pub struct TrainedBpe {
    /// Vocabulary size, special tokens included.
    pub vocab_size: usize,
    /// Id of [`EOD_TOKEN`].
    pub eod: u32,
}

/// Trains a byte-level BPE (GPT-2's: every byte in the initial alphabet, no
/// normalizer, no prefix space, so decoding gives back the text) of
/// `vocab_size` tokens on `texts`, with [`EOD_TOKEN`] as a special token,
/// and writes it to `out` as a `tokenizer.json`.
pub fn train_bpe<I>(texts: I, vocab_size: usize, out: &Path) -> Result<TrainedBpe>
where
    I: Iterator<Item = String> + Send,
{
    let min = ByteLevel::alphabet().len() + 1;
    if vocab_size < min {
        return Err(DataError::Invalid(format!(
            "--vocab-size {vocab_size}: a byte-level BPE needs at least {min} tokens (256 bytes and {EOD_TOKEN})"
        )));
    }
    let fail = |e: tokenizers::Error| DataError::Tokenizer {
        path: out.display().to_string(),
        msg: one_line(&e.to_string()),
    };
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(0)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(EOD_TOKEN.to_string(), true)])
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(byte_level.into()))
    .with_post_processor(Some(byte_level.into()))
    .with_decoder(Some(byte_level.into()))
    .build()
    .map_err(fail)?;
    tokenizer.train(&mut trainer, texts).map_err(fail)?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| DataError::io("cannot create", dir, e))?;
    }
    tokenizer.save(out, true).map_err(fail)?;
    let eod = tokenizer
        .token_to_id(EOD_TOKEN)
        .ok_or_else(|| DataError::Tokenizer {
            path: out.display().to_string(),
            msg: format!("the trained vocabulary lacks {EOD_TOKEN}"),
        })?;
    Ok(TrainedBpe {
        vocab_size: tokenizer.get_vocab_size(true),
        eod,
    })
}

/// `text` on one line (the `tokenizers` crate's messages may span several).
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_round_trips_utf8() {
        let t = ByteTokenizer;
        let s = "In the beginning — ünïcode";
        assert_eq!(t.decode(&t.encode(s)), s);
        assert!(t.encode("A").iter().all(|&i| i == 65));
        assert_eq!(Tokenizer::load(None).unwrap().vocab_size(), 256);
        assert_eq!(
            Tokenizer::load(Some(Path::new("byte"))).unwrap().eod(),
            None
        );
    }

    #[test]
    fn trained_bpe_round_trips_and_compresses() {
        let dir = std::env::temp_dir().join(format!("foldmoe-bpe-{}", std::process::id()));
        let out = dir.join("tokenizer.json");
        let text = "And God said, Let there be light: and there was light.\n".repeat(40);
        let trained = train_bpe(std::iter::once(text.clone()), 300, &out).unwrap();
        // Training stops early once no pair is left to merge.
        assert!((258..=300).contains(&trained.vocab_size), "{trained:?}");
        let tok = Tokenizer::from_file(&out).unwrap();
        assert_eq!(tok.vocab_size(), trained.vocab_size);
        assert_eq!(tok.eod(), Some(trained.eod));
        let s = "And God said — ünïcode, Let there be light\n";
        let ids = tok.encode(s).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), s);
        assert!(ids.iter().all(|&i| (i as usize) < trained.vocab_size));
        let line = "And God said, Let there be light: and there was light.\n";
        assert!(tok.encode(line).unwrap().len() < line.len() / 3);
        let err = train_bpe(std::iter::empty(), 100, &out)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--vocab-size 100") && err.contains("257"),
            "{err}"
        );
        let err = Tokenizer::from_file(&dir.join("missing.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.json"), "{err}");
        std::fs::write(dir.join("bad.json"), "{not json").unwrap();
        let err = Tokenizer::from_file(&dir.join("bad.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad.json") && !err.contains('\n'), "{err}");
    }
}
