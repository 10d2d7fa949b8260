//! Blends of datasets, in Megatron's syntax and with its sampling: `--data-path
//! 0.3 A 0.7 B` (weights and prefixes) or `--data-path A [B ...]` (prefixes;
//! weighted by their tokens), and the blending index of Megatron's
//! `build_blending_indices`: sample i goes to the dataset furthest behind
//! its share, `weight·max(i, 1) − taken`, so every prefix of the blend
//! holds each dataset in its proportion (to one sample), with no randomness.

use std::path::PathBuf;

use crate::error::{DataError, Result};
use crate::gpt::GptDataset;

/// The datasets of `--data-path` and their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct BlendSpec {
    /// Dataset prefixes (`PATH` of `PATH.bin`/`PATH.idx`).
    pub prefixes: Vec<PathBuf>,
    /// Weights as given (normalised when sampling); `None`: by tokens.
    pub weights: Option<Vec<f64>>,
}

impl BlendSpec {
    /// Parses Megatron's `--data-path` list: an even list that alternates
    /// weights and prefixes, or a list of prefixes.
    pub fn parse(args: &[String]) -> Result<Self> {
        let bad =
            |why: String| DataError::Invalid(format!("--data-path {}: {why}", args.join(" ")));
        if args.is_empty() {
            return Err(bad("give a dataset prefix, or weight prefix pairs".into()));
        }
        let weighted = args.len().is_multiple_of(2) && args[0].parse::<f64>().is_ok();
        if !weighted {
            if let Some(w) = args.iter().find(|a| a.parse::<f64>().is_ok()) {
                return Err(bad(format!(
                    "`{w}` looks like a weight; give weight prefix pairs (`0.3 A 0.7 B`) or prefixes only"
                )));
            }
            return Ok(BlendSpec {
                prefixes: args.iter().map(PathBuf::from).collect(),
                weights: None,
            });
        }
        let mut prefixes = Vec::new();
        let mut weights = Vec::new();
        for pair in args.chunks(2) {
            let w: f64 = pair[0]
                .parse()
                .map_err(|_| bad(format!("`{}` is not a weight", pair[0])))?;
            if !(w.is_finite() && w > 0.0) {
                return Err(bad(format!("weight {w} of {} must be positive", pair[1])));
            }
            if pair[1].parse::<f64>().is_ok() {
                return Err(bad(format!(
                    "`{}` is a number where a prefix goes",
                    pair[1]
                )));
            }
            weights.push(w);
            prefixes.push(PathBuf::from(&pair[1]));
        }
        Ok(BlendSpec {
            prefixes,
            weights: Some(weights),
        })
    }
}

/// Megatron's blending index: for each of `size` samples, the dataset it
/// comes from and its sample number in that dataset.
pub fn blending_indices(weights: &[f64], size: usize) -> (Vec<u16>, Vec<u64>) {
    let sum: f64 = weights.iter().sum();
    let w: Vec<f64> = weights.iter().map(|x| x / sum).collect();
    let mut taken = vec![0u64; w.len()];
    let mut dataset = Vec::with_capacity(size);
    let mut sample = Vec::with_capacity(size);
    for i in 0..size {
        let at = (i as f64).max(1.0);
        let mut best = 0;
        let mut best_err = w[0] * at - taken[0] as f64;
        for (d, &wd) in w.iter().enumerate().skip(1) {
            let err = wd * at - taken[d] as f64;
            if err > best_err {
                best = d;
                best_err = err;
            }
        }
        dataset.push(best as u16);
        sample.push(taken[best]);
        taken[best] += 1;
    }
    (dataset, sample)
}

/// Samples needed of a dataset of weight `w` (normalised) for `n` blended
/// samples: Megatron's margin of 0.5 %.
pub fn samples_for(n: u64, w: f64) -> u64 {
    (n as f64 * w * 1.005).ceil() as u64
}

/// The samples of one split of a blend: one dataset, or several mixed by
/// [`blending_indices`].
pub struct BlendedDataset {
    parts: Vec<GptDataset>,
    index: Option<(Vec<u16>, Vec<u64>)>,
}

impl BlendedDataset {
    /// One dataset alone.
    pub fn single(part: GptDataset) -> Self {
        BlendedDataset {
            parts: vec![part],
            index: None,
        }
    }

    /// `parts` mixed by `weights` over `size` samples.
    pub fn mixed(parts: Vec<GptDataset>, weights: &[f64], size: usize) -> Self {
        BlendedDataset {
            index: Some(blending_indices(weights, size)),
            parts,
        }
    }

    /// The datasets.
    pub fn parts(&self) -> &[GptDataset] {
        &self.parts
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        match &self.index {
            Some((d, _)) => d.len(),
            None => self.parts[0].len(),
        }
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which dataset sample `i` comes from.
    pub fn source_of(&self, i: usize) -> usize {
        self.index.as_ref().map_or(0, |(d, _)| d[i] as usize)
    }

    /// Appends the `seq_len + 1` ids of sample `i`.
    pub fn sample(&self, i: usize, out: &mut Vec<u32>) -> Result<()> {
        match &self.index {
            None => self.parts[0].sample(i, out),
            Some((d, s)) => {
                if i >= d.len() {
                    return Err(DataError::Invalid(format!(
                        "blended sample {i} asked, {} were built",
                        d.len()
                    )));
                }
                self.parts[d[i] as usize].sample(s[i] as usize, out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn blend_syntax_weights_and_prefixes() {
        let b = BlendSpec::parse(&strings("0.3 A 0.7 B")).unwrap();
        assert_eq!(b.prefixes, vec![PathBuf::from("A"), PathBuf::from("B")]);
        assert_eq!(b.weights, Some(vec![0.3, 0.7]));
        let one = BlendSpec::parse(&strings("data/x_text_document")).unwrap();
        assert_eq!(one.weights, None);
        let two = BlendSpec::parse(&strings("A B")).unwrap();
        assert_eq!(two.prefixes.len(), 2);
        for (bad, needle) in [
            ("0.3 A 0.7", "looks like a weight"),
            ("-1 A 2 B", "must be positive"),
            ("0.5 0.5", "is a number where a prefix goes"),
        ] {
            let err = BlendSpec::parse(&strings(bad)).unwrap_err().to_string();
            assert!(
                err.contains(needle) && err.starts_with("--data-path"),
                "{err}"
            );
        }
    }

    #[test]
    fn blending_index_keeps_every_prefix_in_proportion() {
        let (d, s) = blending_indices(&[0.3, 0.7], 1000);
        // Golden start (Megatron's greedy rule).
        assert_eq!(&d[..10], &[1, 0, 1, 1, 0, 1, 1, 0, 1, 1]);
        for n in 1..=1000 {
            let a = d[..n].iter().filter(|&&x| x == 0).count() as f64;
            assert!((a - 0.3 * n as f64).abs() <= 1.0, "at {n}: {a}");
        }
        // Sample numbers count up per dataset.
        let mut next = [0u64; 2];
        for (&di, &si) in d.iter().zip(&s) {
            assert_eq!(si, next[di as usize]);
            next[di as usize] += 1;
        }
        assert!(next[0] <= samples_for(1000, 0.3) && next[1] <= samples_for(1000, 0.7));
    }
}
