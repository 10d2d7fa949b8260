//! Training data: a byte-level tokenizer, a text dataset, and deterministic,
//! resumable sampling of training windows.
//!
//! A batch is `B` windows of `S + 1` bytes; tokens are the first `S`, targets
//! the last `S`. Batch number `n` of a run depends only on `(seed, n)`, so a
//! resumed run that restores `n` draws exactly the batches the uninterrupted
//! run would have drawn.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{EngineError, Result};

/// Bytes are tokens: vocabulary 256, no unknowns, no training.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Vocabulary size.
    pub const VOCAB: usize = 256;

    /// Token ids of `text` (its UTF-8 bytes).
    pub fn encode(&self, text: &str) -> Vec<i32> {
        text.bytes().map(i32::from).collect()
    }

    /// Text of `ids`; ids outside 0..256 are skipped, invalid UTF-8 replaced.
    pub fn decode(&self, ids: &[i32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// A tokenized corpus held in memory.
#[derive(Clone, Debug)]
pub struct TextDataset {
    tokens: Vec<u8>,
}

impl TextDataset {
    /// Reads a UTF-8 text file; errors name the path and the problem.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| {
            EngineError::Invalid(format!("cannot read dataset {}: {e}", path.display()))
        })?;
        if let Err(e) = std::str::from_utf8(&bytes) {
            return Err(EngineError::Invalid(format!(
                "dataset {} is not UTF-8 text (bad byte at offset {})",
                path.display(),
                e.valid_up_to()
            )));
        }
        Ok(TextDataset { tokens: bytes })
    }

    /// A dataset over the bytes of `text`.
    pub fn from_text(text: &str) -> Self {
        TextDataset {
            tokens: text.as_bytes().to_vec(),
        }
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
            return Err(EngineError::Invalid(format!(
                "{what} has {} tokens, fewer than one window of seq_len + 1 = {}",
                self.tokens.len(),
                seq_len + 1
            )));
        }
        Ok(())
    }

    /// `(tokens, targets)` of the window starting at `start`, each `seq_len` long.
    fn window(
        &self,
        start: usize,
        seq_len: usize,
    ) -> (
        impl Iterator<Item = i32> + '_,
        impl Iterator<Item = i32> + '_,
    ) {
        let w = &self.tokens[start..start + seq_len + 1];
        (
            w[..seq_len].iter().map(|&b| i32::from(b)),
            w[1..].iter().map(|&b| i32::from(b)),
        )
    }

    /// Host batch of the windows starting at `starts`: `(tokens, targets)`, each `[B·S]`.
    fn batch_at(&self, starts: &[usize], seq_len: usize) -> (Vec<i32>, Vec<i32>) {
        let mut tokens = Vec::with_capacity(starts.len() * seq_len);
        let mut targets = Vec::with_capacity(starts.len() * seq_len);
        for &s in starts {
            let (x, y) = self.window(s, seq_len);
            tokens.extend(x);
            targets.extend(y);
        }
        (tokens, targets)
    }

    /// `count` windows evenly spaced over the dataset: a fixed evaluation set.
    pub fn eval_batch(&self, count: usize, seq_len: usize) -> Result<(Vec<i32>, Vec<i32>)> {
        self.check_fits(seq_len, "validation set")?;
        let last = self.tokens.len() - seq_len - 1;
        let starts: Vec<usize> = (0..count)
            .map(|i| {
                if count <= 1 {
                    0
                } else {
                    i * last / (count - 1)
                }
            })
            .collect();
        Ok(self.batch_at(&starts, seq_len))
    }
}

/// Draws batches of random windows; batch `n` depends only on `(seed, n)`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchSampler {
    /// Seed of the run.
    pub seed: u64,
    /// Number of batches drawn so far (the resume position).
    pub position: u64,
}

impl BatchSampler {
    /// A sampler at position 0.
    pub fn new(seed: u64) -> Self {
        BatchSampler { seed, position: 0 }
    }

    /// The next `(tokens, targets)` batch of `batch` windows, each `[B·S]`.
    pub fn next_batch(
        &mut self,
        ds: &TextDataset,
        batch: usize,
        seq_len: usize,
    ) -> Result<(Vec<i32>, Vec<i32>)> {
        ds.check_fits(seq_len, "training set")?;
        // Mixing the position into the seed (rather than continuing one stream)
        // is what makes a batch reproducible from its number alone.
        let mut rng = ChaCha8Rng::seed_from_u64(
            self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ self.position,
        );
        let last = ds.len() - seq_len - 1;
        let starts: Vec<usize> = (0..batch).map(|_| rng.gen_range(0..=last)).collect();
        self.position += 1;
        Ok(ds.batch_at(&starts, seq_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_round_trips_utf8() {
        let t = ByteTokenizer;
        let s = "In the beginning — ünïcode";
        assert_eq!(t.decode(&t.encode(s)), s);
        assert!(t.encode("A").iter().all(|&i| i == 65));
    }

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
        };
        assert_eq!(resumed.next_batch(&ds, 2, 8).unwrap(), first[3]);
        let mut other = BatchSampler::new(8);
        assert_ne!(other.next_batch(&ds, 2, 8).unwrap(), first[0]);
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
        let err = TextDataset::from_file(&p).unwrap_err().to_string();
        assert!(
            err.contains("not UTF-8") && err.contains("offset 1"),
            "{err}"
        );
        let missing = TextDataset::from_file(&dir.join("missing.txt"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("missing.txt"), "{missing}");
    }
}
