//! The one loader of training data: the bundled (or any in-memory) text, or
//! Megatron indexed datasets blended and split; it hands each dp rank the
//! micro-batches of a step that are its own, as the engine takes them
//! (`i32` host ids, each checked below the model's vocabulary), and keeps
//! the run's position in a [`BatchSampler`].

use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::blend::{samples_for, BlendSpec, BlendedDataset};
use crate::error::{DataError, Result};
use crate::gpt::{GptConfig, GptDataset, IndexOrigin, Split, SPLIT_NAMES};
use crate::indexed::IndexedDataset;
use crate::text::{BatchSampler, TextDataset};

/// `(tokens, targets)` of a micro-batch, each `[B·S]`, as the engine takes them.
pub type Batch = (Vec<i32>, Vec<i32>);

/// The batch of `windows` (back to back, `seq_len + 1` ids each): tokens are
/// the first `seq_len` of each, targets the last. Every id must be below
/// `vocab`; the first that is not is an error naming `source`.
pub fn to_batch(
    windows: &[u32],
    seq_len: usize,
    vocab: usize,
    source: &dyn std::fmt::Display,
) -> Result<Batch> {
    let w = seq_len + 1;
    let n = windows.len() / w;
    let mut tokens = Vec::with_capacity(n * seq_len);
    let mut targets = Vec::with_capacity(n * seq_len);
    let limit = vocab.min(i32::MAX as usize);
    if let Some(&bad) = windows.iter().find(|&&id| id as usize >= limit) {
        return Err(DataError::Invalid(format!(
            "{source}: token id {bad} is not below the model's vocabulary of {vocab}; \
             train a model whose vocab covers the tokenizer's"
        )));
    }
    for win in windows.chunks_exact(w) {
        tokens.extend(win[..seq_len].iter().map(|&i| i as i32));
        targets.extend(win[1..].iter().map(|&i| i as i32));
    }
    Ok((tokens, targets))
}

/// Training and validation data of a run.
enum Data {
    Text(TextDataset),
    Indexed(BlendedDataset),
}

/// What `train --data-path` builds the loader from.
#[derive(Clone, Debug)]
pub struct IndexedConfig {
    /// The blend.
    pub blend: BlendSpec,
    /// `--split`.
    pub split: Split,
    /// The model's sequence length.
    pub seq_len: usize,
    /// Seed of the shuffles.
    pub seed: u64,
    /// Training samples the run takes (steps × sequences per step).
    pub train_samples: u64,
    /// Validation samples (the evaluation batch).
    pub valid_samples: u64,
}

/// The run's data (see the module doc).
pub struct Loader {
    train: Data,
    val: Option<Data>,
    seq_len: usize,
    vocab: usize,
    /// Normalised blend weights (empty for text).
    weights: Vec<f64>,
    notes: Vec<String>,
}

impl Loader {
    /// In-memory text: random windows of `train`, a fixed evaluation set of `val`.
    pub fn text(
        train: TextDataset,
        val: TextDataset,
        seq_len: usize,
        vocab: usize,
    ) -> Result<Self> {
        train.check_fits(seq_len, "training set")?;
        val.check_fits(seq_len, "validation set")?;
        Ok(Loader {
            train: Data::Text(train),
            val: Some(Data::Text(val)),
            seq_len,
            vocab,
            weights: Vec::new(),
            notes: Vec::new(),
        })
    }

    /// Megatron indexed datasets: each prefix opened and split by documents,
    /// its train (and validation, where the split gives it a share) samples
    /// packed and shuffled, the datasets blended by weight.
    pub fn indexed(cfg: &IndexedConfig, vocab: usize) -> Result<Self> {
        let mut opened = Vec::new();
        for p in &cfg.blend.prefixes {
            opened.push(Arc::new(IndexedDataset::open(p)?));
        }
        let ranges: Vec<_> = opened
            .iter()
            .map(|d| cfg.split.ranges(d.documents()))
            .collect();
        let weights: Vec<f64> = match &cfg.blend.weights {
            Some(w) => w.clone(),
            // Unweighted: in proportion to each dataset's training tokens.
            None => opened
                .iter()
                .zip(&ranges)
                .map(|(d, r)| {
                    let di = d.document_indices();
                    let seqs = di[r[0].start] as usize..di[r[0].end] as usize;
                    d.sequence_lengths()[seqs]
                        .iter()
                        .map(|&l| l as f64)
                        .sum::<f64>()
                        .max(1.0)
                })
                .collect(),
        };
        let total: f64 = weights.iter().sum();
        let weights: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let mut notes = Vec::new();
        let mut build = |split: usize, samples: u64| -> Result<BlendedDataset> {
            let mut parts = Vec::new();
            for ((d, r), &w) in opened.iter().zip(&ranges).zip(&weights) {
                let n = if opened.len() == 1 {
                    samples
                } else {
                    samples_for(samples, w)
                };
                let g = GptDataset::build(
                    d.clone(),
                    r[split].clone(),
                    &GptConfig {
                        seq_len: cfg.seq_len,
                        num_samples: n,
                        seed: cfg.seed,
                        split,
                    },
                )?;
                let what = format!(
                    "{} {} (documents {}..{}, {} samples over {} epoch{})",
                    d.prefix().display(),
                    SPLIT_NAMES[split],
                    r[split].start,
                    r[split].end,
                    g.len(),
                    g.epochs(),
                    if g.epochs() == 1 { "" } else { "s" }
                );
                notes.push(match &g.origin {
                    IndexOrigin::Cached(p) => {
                        format!("data: {what}: indices read from {}", p.display())
                    }
                    IndexOrigin::Built(p) => {
                        format!("data: {what}: indices built, cached in {}", p.display())
                    }
                    IndexOrigin::Uncached(why) => {
                        format!("data: {what}: indices built, not cached ({why})")
                    }
                });
                parts.push(g);
            }
            Ok(if parts.len() == 1 {
                BlendedDataset::single(parts.pop().expect("one part"))
            } else {
                BlendedDataset::mixed(parts, &weights, samples as usize)
            })
        };
        let train = build(0, cfg.train_samples)?;
        let val = if cfg.split.weights[1] > 0.0 {
            Some(build(1, cfg.valid_samples)?)
        } else {
            None
        };
        Ok(Loader {
            train: Data::Indexed(train),
            val: val.map(Data::Indexed),
            seq_len: cfg.seq_len,
            vocab,
            weights,
            notes,
        })
    }

    /// A SHA-256 (hex, 16 digits) of the indexed datasets (each `.idx`, its
    /// `.bin`'s length) and their weights; `None` for text in memory.
    pub fn fingerprint(&self) -> Option<String> {
        let Data::Indexed(b) = &self.train else {
            return None;
        };
        let mut h = Sha256::new();
        for p in b.parts() {
            h.update(p.data().fingerprint());
        }
        for w in &self.weights {
            h.update(w.to_le_bytes());
        }
        let d: [u8; 32] = h.finalize().into();
        Some(d[..8].iter().map(|x| format!("{x:02x}")).collect())
    }

    /// Lines for the run's log (where each dataset's indices came from).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The micro-batches of the next step that dp rank `dp_index` of `dp`
    /// trains on: of the step's `micro_batches` (each `seqs` windows), the
    /// rank's equal share, in order, read alone (no rank reads another's
    /// samples). `pos` advances past the whole step on every rank.
    pub fn rank_batches(
        &self,
        pos: &mut BatchSampler,
        seqs: usize,
        micro_batches: usize,
        dp: usize,
        dp_index: usize,
    ) -> Result<Vec<Batch>> {
        let per = micro_batches / dp;
        let mut out = Vec::with_capacity(per);
        for j in dp_index * per..(dp_index + 1) * per {
            let mut w = Vec::with_capacity(seqs * (self.seq_len + 1));
            match &self.train {
                Data::Text(ds) => {
                    pos.windows_at(ds, pos.position + j as u64, seqs, self.seq_len, &mut w)?
                }
                Data::Indexed(b) => {
                    let first = pos.samples + (j * seqs) as u64;
                    for k in 0..seqs as u64 {
                        b.sample((first + k) as usize, &mut w)?;
                    }
                }
            }
            out.push(to_batch(&w, self.seq_len, self.vocab, &"training data")?);
        }
        pos.position += micro_batches as u64;
        pos.samples += (micro_batches * seqs) as u64;
        Ok(out)
    }

    /// The fixed validation batch of `windows` windows; `None` when the
    /// split gives validation no share.
    pub fn validation_batch(&self, windows: usize) -> Result<Option<Batch>> {
        let Some(val) = &self.val else {
            return Ok(None);
        };
        let mut w = Vec::with_capacity(windows * (self.seq_len + 1));
        match val {
            Data::Text(ds) => {
                for s in ds.eval_starts(windows, self.seq_len)? {
                    ds.window(s, self.seq_len, &mut w);
                }
            }
            Data::Indexed(b) => {
                for i in 0..windows.min(b.len()) {
                    b.sample(i, &mut w)?;
                }
            }
        }
        to_batch(&w, self.seq_len, self.vocab, &"validation data").map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::{IndexedWriter, TokenDtype};

    /// A dataset of `docs` documents of 3..40 tokens (ids below 500).
    fn write(tag: &str, docs: usize) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("foldmoe-loader-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("d");
        let mut w = IndexedWriter::create(&p, TokenDtype::U16).unwrap();
        for d in 0..docs {
            let n = 3 + (d * 7) % 38;
            let ids: Vec<u32> = (0..n).map(|t| ((d * 31 + t) % 500) as u32).collect();
            w.add_document(&ids, &[n]).unwrap();
        }
        w.finalize().unwrap();
        p
    }

    fn loader(prefixes: &[&std::path::Path], weights: Option<Vec<f64>>, vocab: usize) -> Loader {
        let cfg = IndexedConfig {
            blend: BlendSpec {
                prefixes: prefixes.iter().map(|p| p.to_path_buf()).collect(),
                weights,
            },
            split: Split::parse("90,10,0").unwrap(),
            seq_len: 16,
            seed: 11,
            train_samples: 64,
            valid_samples: 4,
        };
        Loader::indexed(&cfg, vocab).unwrap()
    }

    /// Two dp ranks together read exactly what one rank reads for the same
    /// step, each only its half, and both end at the same position.
    #[test]
    fn dp_ranks_read_disjoint_shares_of_one_step() {
        let (a, b) = (write("dp-a", 200), write("dp-b", 120));
        let l = loader(&[&a, &b], Some(vec![0.3, 0.7]), 512);
        let mut one = BatchSampler::new(11);
        let mut r0 = one.clone();
        let mut r1 = one.clone();
        for _ in 0..3 {
            let all = l.rank_batches(&mut one, 2, 4, 1, 0).unwrap();
            let mut halves = l.rank_batches(&mut r0, 2, 4, 2, 0).unwrap();
            halves.extend(l.rank_batches(&mut r1, 2, 4, 2, 1).unwrap());
            assert_eq!(halves, all);
        }
        assert_eq!((one.position, one.samples), (12, 24));
        assert_eq!(r0, one);
        assert_eq!(r1, one);
        // Targets are the tokens shifted by one.
        let (x, y) = &l.rank_batches(&mut one, 1, 1, 1, 0).unwrap()[0];
        assert_eq!(&x[1..], &y[..15]);
        assert!(l.validation_batch(4).unwrap().is_some());
        assert_eq!(
            l.fingerprint(),
            loader(&[&a, &b], Some(vec![0.3, 0.7]), 512).fingerprint()
        );
        assert_ne!(
            l.fingerprint(),
            loader(&[&a, &b], Some(vec![0.5, 0.5]), 512).fingerprint()
        );
    }

    #[test]
    fn ids_outside_the_model_vocabulary_are_an_error() {
        let a = write("vocab", 50);
        let l = loader(&[&a], None, 100);
        let err = l
            .rank_batches(&mut BatchSampler::new(0), 2, 1, 1, 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not below the model's vocabulary of 100"),
            "{err}"
        );
    }

    /// Samples per second of the loader on 2 M tokens (`cargo test -p
    /// foldmoe-data --release -- --ignored --nocapture loader_throughput`).
    #[test]
    #[ignore]
    fn loader_throughput() {
        let a = write("speed", 100_000);
        let cfg = IndexedConfig {
            blend: BlendSpec {
                prefixes: vec![a],
                weights: None,
            },
            split: Split::parse("969,30,1").unwrap(),
            seq_len: 2048,
            seed: 1,
            train_samples: 1000,
            valid_samples: 16,
        };
        let t0 = std::time::Instant::now();
        let l = Loader::indexed(&cfg, 512).unwrap();
        let built = t0.elapsed().as_secs_f64();
        let mut pos = BatchSampler::new(1);
        let t0 = std::time::Instant::now();
        for _ in 0..100 {
            l.rank_batches(&mut pos, 8, 1, 1, 0).unwrap();
        }
        let s = t0.elapsed().as_secs_f64();
        println!(
            "loader: indices in {built:.3} s; {:.0} samples/s of 2048 tokens ({:.1} M tokens/s)",
            800.0 / s,
            800.0 * 2048.0 / s / 1e6
        );
    }
}
