//! Samples packed across documents, as Megatron-Core's `GPTDataset` packs
//! them: the documents of a split, in a shuffled order (the document
//! index), cut into windows of `seq_len + 1` tokens that cross document
//! boundaries (the sample index: where each window starts, as a position in
//! the document index and an offset in that document; consecutive windows
//! share one token, the last target of one being the first token of the
//! next), visited in a shuffled order (the shuffle index).
//!
//! One difference from Megatron, on purpose: the document index is shuffled
//! per epoch (each epoch a permutation of the split's documents) and the
//! shuffle index within the samples that start in each epoch, so every
//! token of an epoch is trained on once before the next epoch begins.
//! Megatron shuffles all epochs but a short last one together.
//!
//! The three indices are built once per (dataset, split, seq_len, epochs,
//! seed) and cached beside the data (`PREFIX.<split>-<key>.gptidx`, the key
//! a SHA-256 of those inputs and of the dataset's index; the file carries a
//! SHA-256 of its own content); a cache that does not match is rebuilt.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};
use crate::indexed::IndexedDataset;

/// The three parts of `--split 969,30,1`: train, validation, test.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Split {
    /// Normalised weights (summing to 1).
    pub weights: [f64; 3],
}

/// Names of the three splits, as cache files and messages write them.
pub const SPLIT_NAMES: [&str; 3] = ["train", "valid", "test"];

impl Split {
    /// Megatron's default, `969,30,1`.
    pub const DEFAULT: &'static str = "969,30,1";

    /// Parses `969,30,1` (or `98,2`, missing parts 0; `/` also separates).
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: &str| DataError::Invalid(format!("--split {text}: {why}"));
        let parts: Vec<&str> = text.split([',', '/']).map(str::trim).collect();
        if parts.is_empty() || parts.len() > 3 {
            return Err(bad("give up to three weights, e.g. 969,30,1"));
        }
        let mut w = [0.0f64; 3];
        for (slot, p) in w.iter_mut().zip(&parts) {
            *slot = p
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| bad(&format!("`{p}` is not a non-negative number")))?;
        }
        let sum: f64 = w.iter().sum();
        if sum <= 0.0 {
            return Err(bad("the weights sum to 0"));
        }
        Ok(Split {
            weights: w.map(|x| x / sum),
        })
    }

    /// The document ranges of the three splits of `n` documents
    /// (Megatron's `get_split_indices`: rounded running sums, the rounding
    /// error taken off every boundary).
    pub fn ranges(&self, n: usize) -> [Range<usize>; 3] {
        let mut idx = [0i64; 4];
        for i in 0..3 {
            idx[i + 1] = idx[i] + (self.weights[i] * n as f64).round() as i64;
        }
        let diff = idx[3] - n as i64;
        for v in idx.iter_mut().skip(1) {
            *v -= diff;
        }
        let c = |v: i64| v.clamp(0, n as i64) as usize;
        [
            c(idx[0])..c(idx[1]),
            c(idx[1])..c(idx[2]),
            c(idx[2])..c(idx[3]),
        ]
    }
}

/// The packed samples of one split of one dataset.
pub struct GptDataset {
    data: Arc<IndexedDataset>,
    seq_len: usize,
    /// Sequence ids, epoch after epoch, each epoch shuffled.
    doc_index: Vec<u32>,
    /// `(position in doc_index, offset)` where each sample starts; one more
    /// than the samples (the end of the last).
    sample_index: Vec<(u64, u32)>,
    /// The order samples are visited in.
    shuffle_index: Vec<u64>,
    /// Tokens of the split (one epoch).
    tokens_per_epoch: u64,
    /// Epochs built.
    epochs: u64,
    /// How the indices were obtained (for the run's log).
    pub origin: IndexOrigin,
}

/// Where a [`GptDataset`]'s indices came from.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexOrigin {
    /// Read from this cache file.
    Cached(PathBuf),
    /// Built and written to this cache file.
    Built(PathBuf),
    /// Built; the cache could not be written (the reason).
    Uncached(String),
}

/// What a sample index is built from.
#[derive(Clone, Debug)]
pub struct GptConfig {
    /// Tokens per sample, less the one extra target.
    pub seq_len: usize,
    /// Samples needed (more are built: whole epochs).
    pub num_samples: u64,
    /// Seed of the shuffles.
    pub seed: u64,
    /// Which split (0 train, 1 valid, 2 test), for the cache's name and seed.
    pub split: usize,
}

/// Version of the cache format (part of the key).
const CACHE_MAGIC: &[u8; 8] = b"FMGPTIX1";

/// What a shuffle orders: documents or samples.
const DOCUMENTS: u64 = 1;
const SAMPLES: u64 = 2;

/// A ChaCha8 stream for `(seed, split, what, epoch)`.
fn rng(seed: u64, split: usize, what: u64, epoch: u64) -> ChaCha8Rng {
    let mut h = Sha256::new();
    h.update(b"foldmoe gpt shuffle");
    for v in [seed, split as u64, what, epoch] {
        h.update(v.to_le_bytes());
    }
    let d: [u8; 32] = h.finalize().into();
    ChaCha8Rng::from_seed(d)
}

impl GptDataset {
    /// The samples of documents `docs` of `data` (see the module doc),
    /// enough whole epochs for `cfg.num_samples`; indices read from the cache
    /// beside the data when it matches, else built (and cached if the
    /// directory is writable).
    pub fn build(data: Arc<IndexedDataset>, docs: Range<usize>, cfg: &GptConfig) -> Result<Self> {
        let di = data.document_indices();
        let seqs = di[docs.start] as usize..di[docs.end] as usize;
        let sizes = data.sequence_lengths();
        let tokens: u64 = sizes[seqs.clone()].iter().map(|&l| u64::from(l)).sum();
        let s = cfg.seq_len as u64;
        if tokens == 0 {
            return Err(DataError::Invalid(format!(
                "{}: the {} split (documents {}..{} of {}) has no tokens; choose another --split",
                data.prefix().display(),
                SPLIT_NAMES[cfg.split],
                docs.start,
                docs.end,
                data.documents()
            )));
        }
        if u32::try_from(seqs.end).is_err() {
            return Err(DataError::Invalid(format!(
                "{}: {} sequences, more than 2^32",
                data.prefix().display(),
                seqs.end
            )));
        }
        // The fewest epochs whose samples number at least num_samples,
        // counting the samples that start in an epoch as its own. The
        // document index holds spare epochs after them, enough for the
        // last sample's tokens, so that what is built for a run is a prefix
        // of what a longer run builds (a resumed run may raise --steps).
        let need = cfg.num_samples.max(1);
        let mut epochs = (need * s).div_ceil(tokens).max(1);
        while (epochs * tokens).div_ceil(s) < need {
            epochs += 1;
        }
        let spare = (s + 1).div_ceil(tokens);
        let key = {
            let mut h = Sha256::new();
            h.update(CACHE_MAGIC);
            h.update(data.fingerprint());
            for v in [
                docs.start as u64,
                docs.end as u64,
                s,
                epochs,
                cfg.seed,
                cfg.split as u64,
            ] {
                h.update(v.to_le_bytes());
            }
            let d: [u8; 32] = h.finalize().into();
            d
        };
        let hex: String = key[..8].iter().map(|b| format!("{b:02x}")).collect();
        let mut name = data.prefix().as_os_str().to_owned();
        name.push(format!(".{}-{hex}.gptidx", SPLIT_NAMES[cfg.split]));
        let cache = PathBuf::from(name);
        if let Ok(Some((doc_index, sample_index, shuffle_index))) = read_cache(&cache, &key) {
            return Ok(GptDataset {
                data,
                seq_len: cfg.seq_len,
                doc_index,
                sample_index,
                shuffle_index,
                tokens_per_epoch: tokens,
                epochs,
                origin: IndexOrigin::Cached(cache),
            });
        }
        // The document index: each epoch a permutation of the split's sequences.
        let mut doc_index = Vec::with_capacity(seqs.len() * epochs as usize);
        for e in 0..epochs + spare {
            let mut epoch: Vec<u32> = seqs.clone().map(|q| q as u32).collect();
            epoch.shuffle(&mut rng(cfg.seed, cfg.split, DOCUMENTS, e));
            doc_index.extend(epoch);
        }
        // The sample index (Megatron's `build_sample_idx`, one extra token).
        let num_samples = (epochs * tokens).div_ceil(s);
        let mut sample_index = Vec::with_capacity(num_samples as usize + 1);
        sample_index.push((0u64, 0u32));
        let (mut pos, mut offset) = (0usize, 0i64);
        for _ in 0..num_samples {
            let mut remaining = s as i64 + 1;
            while remaining != 0 {
                let q = *doc_index.get(pos).ok_or_else(|| {
                    DataError::Invalid(format!(
                        "{}: the document index ran out while packing (an internal error)",
                        data.prefix().display()
                    ))
                })?;
                let doc_len = i64::from(sizes[q as usize]) - offset;
                remaining -= doc_len;
                if remaining <= 0 {
                    offset += remaining + doc_len - 1;
                    remaining = 0;
                } else {
                    pos += 1;
                    offset = 0;
                }
            }
            sample_index.push((pos as u64, offset as u32));
        }
        // The shuffle index: within the samples that start in each epoch.
        let mut shuffle_index: Vec<u64> = (0..num_samples).collect();
        for e in 0..epochs {
            let from = (e * tokens).div_ceil(s).min(num_samples) as usize;
            let to = ((e + 1) * tokens).div_ceil(s).min(num_samples) as usize;
            shuffle_index[from..to].shuffle(&mut rng(cfg.seed, cfg.split, SAMPLES, e));
        }
        let origin = match write_cache(&cache, &key, &doc_index, &sample_index, &shuffle_index) {
            Ok(()) => IndexOrigin::Built(cache),
            Err(e) => IndexOrigin::Uncached(e.to_string()),
        };
        Ok(GptDataset {
            data,
            seq_len: cfg.seq_len,
            doc_index,
            sample_index,
            shuffle_index,
            tokens_per_epoch: tokens,
            epochs,
            origin,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// The dataset the samples come from.
    pub fn data(&self) -> &IndexedDataset {
        &self.data
    }

    /// Appends the `seq_len + 1` ids of sample `i` (in visiting order).
    pub fn sample(&self, i: usize, out: &mut Vec<u32>) -> Result<()> {
        let j = *self.shuffle_index.get(i).ok_or_else(|| {
            DataError::Invalid(format!(
                "{}: sample {i} asked, {} were built",
                self.data.prefix().display(),
                self.len()
            ))
        })? as usize;
        self.unshuffled(j, out)
    }

    /// Appends the ids of sample `j` in packing order (before the shuffle).
    pub fn unshuffled(&self, j: usize, out: &mut Vec<u32>) -> Result<()> {
        let (d0, o0) = self.sample_index[j];
        let (d1, o1) = self.sample_index[j + 1];
        let (d0, d1, o0, o1) = (d0 as usize, d1 as usize, o0 as usize, o1 as usize);
        let start = out.len();
        let sizes = self.data.sequence_lengths();
        if d0 == d1 {
            self.data
                .read(self.doc_index[d0] as usize, o0, o1 - o0 + 1, out)?;
        } else {
            let first = self.doc_index[d0] as usize;
            self.data.read(first, o0, sizes[first] as usize - o0, out)?;
            for &q in &self.doc_index[d0 + 1..d1] {
                self.data
                    .read(q as usize, 0, sizes[q as usize] as usize, out)?;
            }
            self.data
                .read(self.doc_index[d1] as usize, 0, o1 + 1, out)?;
        }
        debug_assert_eq!(out.len() - start, self.seq_len + 1);
        Ok(())
    }

    /// Epochs the samples span.
    pub fn epochs(&self) -> u64 {
        self.epochs
    }

    /// Where each epoch's samples begin, and the end of the last: the
    /// shuffle keeps samples within these bounds.
    pub fn epoch_bounds(&self) -> Vec<usize> {
        let (t, s, n) = (
            self.tokens_per_epoch,
            self.seq_len as u64,
            self.len() as u64,
        );
        (0..=self.epochs)
            .map(|e| (e * t).div_ceil(s).min(n) as usize)
            .collect()
    }
}

/// The cache file's bytes: magic, key, the three lengths, the arrays, and
/// a SHA-256 of everything before it.
fn write_cache(
    path: &Path,
    key: &[u8; 32],
    doc: &[u32],
    sample: &[(u64, u32)],
    shuffle: &[u64],
) -> Result<()> {
    let mut b = Vec::with_capacity(64 + 4 * doc.len() + 12 * sample.len() + 8 * shuffle.len());
    b.extend_from_slice(CACHE_MAGIC);
    b.extend_from_slice(key);
    for n in [doc.len(), sample.len(), shuffle.len()] {
        b.extend((n as u64).to_le_bytes());
    }
    doc.iter().for_each(|v| b.extend(v.to_le_bytes()));
    for (p, o) in sample {
        b.extend(p.to_le_bytes());
        b.extend(o.to_le_bytes());
    }
    shuffle.iter().for_each(|v| b.extend(v.to_le_bytes()));
    let sum: [u8; 32] = Sha256::digest(&b).into();
    b.extend_from_slice(&sum);
    // A name of this process's own, renamed into place: ranks building the
    // same cache at once never see each other's half-written file.
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(
        ".tmp{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, &b).map_err(|e| DataError::io("cannot write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| DataError::io("cannot write", path, e))
}

/// The cached indices, `None` if the file is absent, of another key, or
/// fails its checksum.
#[allow(clippy::type_complexity)]
fn read_cache(
    path: &Path,
    key: &[u8; 32],
) -> Result<Option<(Vec<u32>, Vec<(u64, u32)>, Vec<u64>)>> {
    let Ok(b) = std::fs::read(path) else {
        return Ok(None);
    };
    if b.len() < 8 + 32 + 24 + 32 || &b[..8] != CACHE_MAGIC || &b[8..40] != key {
        return Ok(None);
    }
    let (body, sum) = b.split_at(b.len() - 32);
    if Sha256::digest(body).as_slice() != sum {
        return Ok(None);
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let (nd, ns, nh) = (
        u64_at(40) as usize,
        u64_at(48) as usize,
        u64_at(56) as usize,
    );
    if body.len() as u128 != 64 + 4 * nd as u128 + 12 * ns as u128 + 8 * nh as u128 {
        return Ok(None);
    }
    let mut at = 64;
    let doc = (0..nd)
        .map(|i| u32::from_le_bytes(body[at + 4 * i..at + 4 * i + 4].try_into().expect("4")))
        .collect();
    at += 4 * nd;
    let sample = (0..ns)
        .map(|i| {
            let p = u64_at(at + 12 * i);
            let o = u32::from_le_bytes(
                body[at + 12 * i + 8..at + 12 * i + 12]
                    .try_into()
                    .expect("4"),
            );
            (p, o)
        })
        .collect();
    at += 12 * ns;
    let shuffle = (0..nh).map(|i| u64_at(at + 8 * i)).collect();
    Ok(Some((doc, sample, shuffle)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::{IndexedWriter, TokenDtype};

    /// Documents of lengths 5, 1, 0, 9, 3, 7, 4 whose tokens are all
    /// distinct (token = 1000·doc + position).
    fn dataset(tag: &str) -> Arc<IndexedDataset> {
        let dir = std::env::temp_dir().join(format!("foldmoe-gpt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("d");
        let mut w = IndexedWriter::create(&p, TokenDtype::U16).unwrap();
        for (d, n) in [5u32, 1, 0, 9, 3, 7, 4].into_iter().enumerate() {
            let ids: Vec<u32> = (0..n).map(|t| 1000 * d as u32 + t).collect();
            let lengths: Vec<usize> = if n == 0 { vec![] } else { vec![n as usize] };
            w.add_document(&ids, &lengths).unwrap();
        }
        w.finalize().unwrap();
        Arc::new(IndexedDataset::open(&p).unwrap())
    }

    fn cfg(num_samples: u64, seed: u64) -> GptConfig {
        GptConfig {
            seq_len: 4,
            num_samples,
            seed,
            split: 0,
        }
    }

    #[test]
    fn split_boundaries_follow_megatron() {
        let s = Split::parse("969,30,1").unwrap();
        assert_eq!(s.ranges(1000), [0..969, 969..999, 999..1000]);
        assert_eq!(s.ranges(10), [0..10, 10..10, 10..10]);
        let s = Split::parse("98,2").unwrap();
        assert_eq!(s.ranges(100), [0..98, 98..100, 100..100]);
        // Rounding error taken off every boundary: 3 × round(3.33) = 9 of 10.
        let s = Split::parse("1,1,1").unwrap();
        assert_eq!(s.ranges(10), [0..4, 4..7, 7..10]);
        for bad in ["", "1,2,3,4", "a,1", "0,0,0", "-1,2"] {
            let err = Split::parse(bad).unwrap_err().to_string();
            assert!(err.starts_with("--split"), "{err}");
        }
    }

    /// Every token of an epoch is in exactly one sample of that epoch, and
    /// the windows are packed across documents.
    #[test]
    fn each_epoch_covers_every_token_once() {
        let data = dataset("epoch");
        let g = GptDataset::build(data.clone(), 0..7, &cfg(20, 3)).unwrap();
        // 29 tokens an epoch; 20 samples of 4 need 3 epochs (⌈3·29 / 4⌉ = 22).
        assert_eq!((g.epochs(), g.len()), (3, 22));
        let bounds = g.epoch_bounds();
        assert_eq!(bounds, vec![0, 8, 15, 22]);
        // The shuffle keeps each epoch's samples in that epoch.
        let window = |shuffled: bool, i: usize| {
            let mut w = Vec::new();
            if shuffled {
                g.sample(i, &mut w).unwrap();
            } else {
                g.unshuffled(i, &mut w).unwrap();
            }
            w
        };
        for e in 0..3 {
            let mut a: Vec<_> = (bounds[e]..bounds[e + 1])
                .map(|i| window(true, i))
                .collect();
            let mut b: Vec<_> = (bounds[e]..bounds[e + 1])
                .map(|i| window(false, i))
                .collect();
            assert_ne!(a, b, "epoch {e} not shuffled");
            a.sort();
            b.sort();
            assert_eq!(a, b, "epoch {e}'s samples left it");
        }
        // Rebuilt from the cache: the same samples.
        let first = window(true, 0);
        // Golden: the order for seed 3 (a change here changes every run's data).
        let starts: Vec<u32> = (0..8).map(|i| window(true, i)[0]).collect();
        assert_eq!(starts, [3008, 3000, 6000, 5003, 3004, 0, 4, 1000]);
        assert_eq!(
            first,
            [3008, 5000, 5001, 5002, 5003],
            "packed across documents 3 and 5"
        );
        let again = GptDataset::build(data.clone(), 0..7, &cfg(20, 3)).unwrap();
        assert!(
            matches!(again.origin, IndexOrigin::Cached(_)),
            "{:?}",
            again.origin
        );
        let mut w = Vec::new();
        again.sample(0, &mut w).unwrap();
        assert_eq!(w, first);
        let other = GptDataset::build(data, 0..7, &cfg(20, 4)).unwrap();
        let order = |g: &GptDataset| {
            (0..g.len())
                .map(|i| {
                    let mut w = Vec::new();
                    g.sample(i, &mut w).unwrap();
                    w
                })
                .collect::<Vec<_>>()
        };
        assert_ne!(
            order(&other),
            order(&g),
            "the seed does not change the order"
        );
    }

    /// Unshuffled, the windows of one epoch are the split's tokens in the
    /// document order, each sample starting where the last one ended.
    #[test]
    fn packing_crosses_documents_with_one_shared_token() {
        let g = GptDataset::build(dataset("pack"), 0..7, &cfg(3, 1)).unwrap();
        let mut all = Vec::new();
        // The 7 samples that fit in the first epoch's 29 tokens.
        for j in 0..7 {
            let mut w = Vec::new();
            g.unshuffled(j, &mut w).unwrap();
            if let Some(&last) = all.last() {
                assert_eq!(w[0], last, "sample {j} does not start at the last target");
                all.pop();
            }
            all.extend(w);
        }
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len());
        assert_eq!(
            all.len(),
            29,
            "one epoch: (29 − 1) / 4 = 7 samples, 29 tokens"
        );
    }

    /// A longer run (more samples, more epochs) sees the shorter run's
    /// samples first, in the same order: raising --steps on resume keeps
    /// the data.
    #[test]
    fn more_samples_extend_the_sequence() {
        let data = dataset("prefix");
        let short = GptDataset::build(data.clone(), 0..7, &cfg(9, 5)).unwrap();
        let long = GptDataset::build(data, 0..7, &cfg(40, 5)).unwrap();
        assert!(long.epochs() > short.epochs());
        for i in 0..short.len() {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            short.sample(i, &mut a).unwrap();
            long.sample(i, &mut b).unwrap();
            assert_eq!(a, b, "sample {i}");
        }
    }

    #[test]
    fn a_corrupt_cache_is_rebuilt_and_an_empty_split_is_an_error() {
        let data = dataset("cache");
        let g = GptDataset::build(data.clone(), 0..7, &cfg(5, 9)).unwrap();
        let IndexOrigin::Built(path) = &g.origin else {
            panic!("{:?}", g.origin)
        };
        let mut bytes = std::fs::read(path).unwrap();
        let n = bytes.len();
        bytes[n - 40] ^= 1;
        std::fs::write(path, &bytes).unwrap();
        let again = GptDataset::build(data.clone(), 0..7, &cfg(5, 9)).unwrap();
        assert!(
            matches!(again.origin, IndexOrigin::Built(_)),
            "{:?}",
            again.origin
        );
        let err = GptDataset::build(data, 2..3, &cfg(5, 9))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("train split") && err.contains("no tokens"),
            "{err}"
        );
    }
}
