//! A tokenized text held in memory (the bundled corpus by default) and its
//! sampler: batch `n` is `B` windows of `S + 1` tokens at random starts
//! drawn from `(seed, n)` alone, so a resumed run that restores `n` draws
//! exactly the batches the uninterrupted run would have drawn.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{DataError, Result};
use crate::loader::{to_batch, Batch};
use crate::tokenizer::{ByteTokenizer, Tokenizer};

/// A tokenized corpus held in memory.
#[derive(Clone, Debug)]
pub struct TextDataset {
    tokens: Vec<u32>,
}

impl TextDataset {
    /// Reads a UTF-8 text file and tokenizes it; errors name the path.
    pub fn from_file(path: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let bytes =
            std::fs::read(path).map_err(|e| DataError::io("cannot read dataset", path, e))?;
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            DataError::Invalid(format!(
                "dataset {} is not UTF-8 text (bad byte at offset {})",
                path.display(),
                e.valid_up_to()
            ))
        })?;
        Ok(TextDataset {
            tokens: tokenizer.encode(text)?,
        })
    }

    /// A dataset over the bytes of `text` (the byte tokenizer).
    pub fn from_text(text: &str) -> Self {
        TextDataset {
            tokens: ByteTokenizer.encode(text),
        }
    }

    /// A dataset over `tokens`.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        TextDataset { tokens }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the dataset has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Errors unless at least one window of `seq_len + 1` tokens fits.
    pub fn check_fits(&self, seq_len: usize, what: &str) -> Result<()> {
        if self.tokens.len() < seq_len + 1 {
            return Err(DataError::Invalid(format!(
                "{what} has {} tokens, fewer than one window of seq_len + 1 = {}",
                self.tokens.len(),
                seq_len + 1
            )));
        }
        Ok(())
    }

    /// Appends the `seq_len + 1` tokens of the window at `start`.
    pub(crate) fn window(&self, start: usize, seq_len: usize, out: &mut Vec<u32>) {
        out.extend_from_slice(&self.tokens[start..start + seq_len + 1]);
    }

    /// Starts of `count` windows evenly spaced over the dataset: a fixed
    /// evaluation set.
    pub fn eval_starts(&self, count: usize, seq_len: usize) -> Result<Vec<usize>> {
        self.check_fits(seq_len, "validation set")?;
        let last = self.tokens.len() - seq_len - 1;
        Ok((0..count)
            .map(|i| {
                if count <= 1 {
                    0
                } else {
                    i * last / (count - 1)
                }
            })
            .collect())
    }

    /// The evaluation batch of [`Self::eval_starts`] (ids below `i32::MAX`).
    pub fn eval_batch(&self, count: usize, seq_len: usize) -> Result<Batch> {
        let mut w = Vec::new();
        for s in self.eval_starts(count, seq_len)? {
            self.window(s, seq_len, &mut w);
        }
        to_batch(&w, seq_len, i32::MAX as usize, &"validation set")
    }
}

/// The position of a run's data: batches and windows drawn so far. Text
/// data draws batch `position` from `(seed, position)`; indexed data takes
/// samples `samples..` of its blend. Saved in every checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchSampler {
    /// Seed of the run.
    pub seed: u64,
    /// Number of batches (micro-batches) drawn so far.
    pub position: u64,
    /// Number of windows (samples) drawn so far.
    #[serde(default)]
    pub samples: u64,
}

impl BatchSampler {
    /// A sampler at position 0.
    pub fn new(seed: u64) -> Self {
        BatchSampler {
            seed,
            position: 0,
            samples: 0,
        }
    }

    /// Appends the windows of text batch `n` (`batch` windows of `seq_len + 1`).
    pub(crate) fn windows_at(
        &self,
        ds: &TextDataset,
        n: u64,
        batch: usize,
        seq_len: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        ds.check_fits(seq_len, "training set")?;
        // Mixing the position into the seed (rather than continuing one stream)
        // is what makes a batch reproducible from its number alone.
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n);
        let last = ds.len() - seq_len - 1;
        for _ in 0..batch {
            ds.window(rng.gen_range(0..=last), seq_len, out);
        }
        Ok(())
    }

    /// The next `(tokens, targets)` batch of `batch` windows, each `[B·S]`.
    pub fn next_batch(&mut self, ds: &TextDataset, batch: usize, seq_len: usize) -> Result<Batch> {
        let mut w = Vec::with_capacity(batch * (seq_len + 1));
        self.windows_at(ds, self.position, batch, seq_len, &mut w)?;
        self.position += 1;
        self.samples += batch as u64;
        to_batch(&w, seq_len, i32::MAX as usize, &"training set")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_tokens_shifted_by_one() {
        let ds = TextDataset::from_text("abcdefghijklmnopqrstuvwxyz");
        let mut s = BatchSampler::new(3);
        let (x, y) = s.next_batch(&ds, 4, 5).unwrap();
        assert_eq!(x.len(), 20);
        for b in 0..4 {
            assert_eq!(&x[b * 5 + 1..b * 5 + 5], &y[b * 5..b * 5 + 4]);
            assert_eq!(y[b * 5 + 4], x[b * 5 + 4] + 1);
        }
    }

    #[test]
    fn sampling_is_deterministic_and_resumable() {
        let ds = TextDataset::from_text(&"the quick brown fox ".repeat(50));
        let mut a = BatchSampler::new(7);
        let first: Vec<_> = (0..5).map(|_| a.next_batch(&ds, 2, 8).unwrap()).collect();
        let mut resumed = BatchSampler {
            seed: 7,
            position: 3,
            samples: 6,
        };
        assert_eq!(resumed.next_batch(&ds, 2, 8).unwrap(), first[3]);
        let mut other = BatchSampler::new(8);
        assert_ne!(other.next_batch(&ds, 2, 8).unwrap(), first[0]);
        // A checkpoint written before `samples` existed still loads.
        let old: BatchSampler = serde_json::from_str(r#"{"seed":7,"position":3}"#).unwrap();
        assert_eq!(old.samples, 0);
    }

    #[test]
    fn too_short_dataset_is_an_error_naming_sizes() {
        let ds = TextDataset::from_text("abc");
        let err = BatchSampler::new(0)
            .next_batch(&ds, 1, 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 tokens") && err.contains("9"), "{err}");
    }

    #[test]
    fn non_utf8_file_is_rejected() {
        let dir = std::env::temp_dir().join(format!("foldmoe-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.txt");
        std::fs::write(&p, [b'a', 0xff, b'b']).unwrap();
        let err = TextDataset::from_file(&p, &Tokenizer::Byte)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not UTF-8") && err.contains("offset 1"),
            "{err}"
        );
        let missing = TextDataset::from_file(&dir.join("missing.txt"), &Tokenizer::Byte)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("missing.txt"), "{missing}");
    }
}
