//! Parameter shards: which block of a full parameter one rank holds (the
//! shard plan says which), how blocks are walked run by run (initialisation,
//! checkpoints), and how shards are put back together (tests).
//!
//! A parameter is split along at most one dimension per mesh axis: tp splits
//! attention heads, the dense ffn and the vocabulary; ep splits the expert
//! dimension of the stacked expert weights; etp splits the expert ffn.

use foldmoe_kernels::{Backend, DType, HostData, Tensor};

use crate::engine::Result;

/// The mesh axis a parameter is split over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitAxis {
    /// Tensor parallel (attention mesh).
    Tp,
    /// Expert parallel (expert mesh).
    Ep,
    /// Expert tensor parallel (expert mesh).
    Etp,
}

/// One split of a parameter: part `index` of `parts` parts of `dim`. The
/// parts are equal when `parts` divides the dimension; otherwise (the
/// vocabulary under tp) the first `len % parts` parts hold one row more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The mesh axis the parts follow.
    pub axis: SplitAxis,
    /// The dimension cut.
    pub dim: usize,
    /// This rank's part.
    pub index: usize,
    /// Number of equal parts.
    pub parts: usize,
}

/// Where a rank's shard sits in the full parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// Shape of the full parameter.
    pub full_shape: Vec<usize>,
    /// The splits applied (at most one per dimension).
    pub splits: Vec<Split>,
}

impl ShardSpec {
    /// `(start, len)` of the shard along every dimension of the full shape.
    pub fn ranges(&self) -> Vec<(usize, usize)> {
        let mut ranges: Vec<(usize, usize)> = self.full_shape.iter().map(|&n| (0, n)).collect();
        for s in &self.splits {
            ranges[s.dim] = part_range(self.full_shape[s.dim], s.index, s.parts);
        }
        ranges
    }

    /// The shard's shape.
    pub fn shape(&self) -> Vec<usize> {
        self.ranges().iter().map(|r| r.1).collect()
    }

    /// Whether the parameter is split over `axis`.
    pub fn split_over(&self, axis: SplitAxis) -> bool {
        self.splits.iter().any(|s| s.axis == axis)
    }
}

/// `(start, len)` of part `index` of `len` rows cut into `parts` balanced
/// parts (equal when `parts` divides `len`, else the first `len % parts`
/// one longer).
pub fn part_range(len: usize, index: usize, parts: usize) -> (usize, usize) {
    let (base, extra) = (len / parts, len % parts);
    (
        index * base + index.min(extra),
        base + usize::from(index < extra),
    )
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// Calls `f(full_offset, shard_offset)` for every element of the block
/// `ranges` of a row-major tensor of `full_shape`.
pub(crate) fn for_each_in_block(
    full_shape: &[usize],
    ranges: &[(usize, usize)],
    mut f: impl FnMut(usize, usize),
) {
    let full_st = strides(full_shape);
    let shard_shape: Vec<usize> = ranges.iter().map(|r| r.1).collect();
    let n: usize = shard_shape.iter().product();
    let shard_st = strides(&shard_shape);
    for i in 0..n {
        let mut full = 0;
        for d in 0..shard_shape.len() {
            let idx = (i / shard_st[d]) % shard_shape[d];
            full += (ranges[d].0 + idx) * full_st[d];
        }
        f(full, i);
    }
}

/// Calls `f(full_offset, block_offset, len)` for every contiguous run of the
/// block `ranges` of a row-major tensor of `full_shape`: the block's rows
/// along its last dimension, in block order (one run for a block of whole
/// rows). What reads and writes blocks by slices (initialisation,
/// checkpoints) iterates.
pub fn for_each_run(
    full_shape: &[usize],
    ranges: &[(usize, usize)],
    mut f: impl FnMut(usize, usize, usize),
) {
    // Trailing dimensions the block holds whole merge into one run.
    let mut merged = full_shape.len();
    while merged > 1 && ranges[merged - 1] == (0, full_shape[merged - 1]) {
        merged -= 1;
    }
    if full_shape.is_empty() {
        f(0, 0, 1);
        return;
    }
    let inner: usize = full_shape[merged..].iter().product();
    let run = ranges[merged - 1].1 * inner;
    if run == 0 {
        return;
    }
    let outer_ranges = &ranges[..merged - 1];
    let outer_full: Vec<usize> = full_shape[..merged].to_vec();
    let full_st = strides(&outer_full);
    let outer_shape: Vec<usize> = outer_ranges.iter().map(|r| r.1).collect();
    let n_runs: usize = outer_shape.iter().product();
    let outer_st = strides(&outer_shape);
    for i in 0..n_runs {
        let mut full = ranges[merged - 1].0 * full_st[merged - 1];
        for d in 0..outer_shape.len() {
            let idx = (i / outer_st[d]) % outer_shape[d];
            full += (outer_ranges[d].0 + idx) * full_st[d];
        }
        f(full * inner, i * run, run);
    }
}

/// The block of `full` (row-major, `full_shape`) that `spec` describes.
pub fn cut_block(full: &[f64], spec: &ShardSpec) -> Vec<f64> {
    let ranges = spec.ranges();
    let mut out = vec![0.0; ranges.iter().map(|r| r.1).product()];
    for_each_in_block(&spec.full_shape, &ranges, |fo, so| out[so] = full[fo]);
    out
}

/// Writes a shard's values into its block of `full`.
pub fn place_block(full: &mut [f64], spec: &ShardSpec, shard: &[f64]) {
    for_each_in_block(&spec.full_shape, &spec.ranges(), |fo, so| {
        full[fo] = shard[so]
    });
}

/// Uploads host values as a tensor of `dtype` (f64 kept exact; other float
/// types through f32).
pub fn upload_as<B: Backend>(
    b: &B,
    vals: Vec<f64>,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor<B>> {
    let host = match dtype {
        DType::F64 => HostData::F64(vals),
        _ => HostData::F32(vals.iter().map(|&x| x as f32).collect()),
    };
    upload_host(b, host, shape, dtype)
}

/// Uploads host data of any type as a tensor of `dtype` (cast on the device
/// when the types differ).
pub fn upload_host<B: Backend>(
    b: &B,
    vals: HostData,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor<B>> {
    let t = b.upload(vals, shape)?;
    Ok(if t.dtype() == dtype {
        t
    } else {
        b.cast(&t, dtype)?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs of a block cover exactly its elements, in block order, with
    /// the full offsets `for_each_in_block` gives; uneven parts tile the
    /// dimension.
    #[test]
    fn runs_match_elements_and_uneven_parts_tile() {
        for (shape, ranges) in [
            (vec![4, 2, 6], vec![(2, 2), (0, 2), (2, 2)]),
            (vec![4, 2, 6], vec![(1, 2), (0, 2), (0, 6)]),
            (vec![5, 3], vec![(0, 5), (1, 1)]),
            (vec![7], vec![(3, 4)]),
        ] {
            let mut want = Vec::new();
            for_each_in_block(&shape, &ranges, |fo, so| want.push((fo, so)));
            let mut got = Vec::new();
            for_each_run(&shape, &ranges, |fo, so, len| {
                got.extend((0..len).map(|k| (fo + k, so + k)))
            });
            assert_eq!(got, want, "{shape:?} {ranges:?}");
        }
        let parts: Vec<_> = (0..4).map(|i| part_range(10, i, 4)).collect();
        assert_eq!(parts, vec![(0, 3), (3, 3), (6, 2), (8, 2)]);
        assert_eq!(part_range(12, 2, 4), (6, 3));
    }

    #[test]
    fn cut_and_place_round_trip_over_two_axes() {
        // [4, 2, 6] split 2 ways on dim 0 (ep) and 3 ways on dim 2 (etp).
        let full: Vec<f64> = (0..48).map(f64::from).collect();
        let mut rebuilt = vec![f64::NAN; 48];
        for e in 0..2 {
            for f in 0..3 {
                let spec = ShardSpec {
                    full_shape: vec![4, 2, 6],
                    splits: vec![
                        Split {
                            axis: SplitAxis::Ep,
                            dim: 0,
                            index: e,
                            parts: 2,
                        },
                        Split {
                            axis: SplitAxis::Etp,
                            dim: 2,
                            index: f,
                            parts: 3,
                        },
                    ],
                };
                let block = cut_block(&full, &spec);
                assert_eq!(block.len(), 8);
                // First element: expert 2e, row 0, column 2f.
                assert_eq!(block[0], (2 * e * 12 + 2 * f) as f64);
                place_block(&mut rebuilt, &spec, &block);
            }
        }
        assert_eq!(rebuilt, full);
    }
}
