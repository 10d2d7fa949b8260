//! The shard plan: for one rank of a layout, which block of every global
//! tensor of the model it owns (torchtitan's `parallelize` plan, as a table).
//!
//! Everything that places a tensor reads this one plan: initialisation draws
//! only the rank's block ([`crate::engine::param::Init`]), the model holds only
//! its stage's layers, the distributed optimizer shards the rank's blocks
//! over its data-parallel group, and checkpoints write and read blocks by the
//! same coordinates.
//!
//! | tensor | split |
//! |---|---|
//! | `embed.weight`, `head.weight` `[V, D]` | rows over tp (balanced: the first `V % tp` ranks hold one row more) |
//! | GQA `attn.wq`, `wk`, `wv` `[D, H·hd]` | columns over tp (whole heads) |
//! | MLA `attn.wq_b` `[C, H·Q]`, `wkv_b` `[L, H·(P+V)]` (or full-rank `wq` `[D, H·Q]`) | columns over tp (whole heads) |
//! | `attn.wo` `[H·hd, D]` (MLA `[H·V, D]`) | rows over tp |
//! | dense `mlp.w1`, `w3` and `moe.shared_experts.w1`, `w3` `[D, F]` | columns over tp |
//! | dense `mlp.w2`, `moe.shared_experts.w2` `[F, D]` | rows over tp |
//! | `moe.experts.w1`, `w3` `[E, D, F]` | experts over ep, F over etp |
//! | `moe.experts.w2` `[E, F, D]` | experts over ep, F over etp |
//! | norms, router, shared-expert gate, MLA `wq_a`, `wkv_a` and latent norms | replicated |
//! | MTP `mtp.{k}.block.*` | as a block of the last group |
//! | MTP `mtp.{k}.enorm`, `hnorm`, `eh_proj`, `norm` | replicated |
//!
//! A tensor of a layer outside the rank's pipeline stage is not held at all.

use std::ops::Range;

use super::shard::{ShardSpec, Split, SplitAxis};
use super::RankLayout;
use crate::engine::{EngineError, Result};
use crate::spec::ModelSpec;

/// One rank's share of a model under a layout.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    spec: ModelSpec,
    rank: RankLayout,
    /// The full model's layer index of each held block, chunk after chunk.
    layers: Vec<usize>,
    /// Indices into `layers` of each model chunk (virtual stage).
    chunks: Vec<Range<usize>>,
}

impl ShardPlan {
    /// The plan of `rank` (its layout checked against `spec` already).
    pub fn new(spec: &ModelSpec, rank: &RankLayout) -> Self {
        let ranges = rank.layout.pp_rank_layers(rank.pp_index, spec.layers());
        let mut chunks = Vec::with_capacity(ranges.len());
        let mut start = 0;
        for r in &ranges {
            chunks.push(start..start + r.len());
            start += r.len();
        }
        ShardPlan {
            spec: spec.clone(),
            rank: rank.clone(),
            layers: ranges.into_iter().flatten().collect(),
            chunks,
        }
    }

    /// The rank's place in the layout.
    pub fn rank(&self) -> &RankLayout {
        &self.rank
    }

    /// The full model's layer index of each held block, in the rank's order.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Indices into [`Self::layers`] of each model chunk of the rank.
    pub fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    /// `(start, len)` of the rank's vocabulary rows.
    pub fn vocab_rows(&self) -> (usize, usize) {
        super::shard::part_range(self.spec.vocab, self.rank.tp_index, self.rank.tp.size())
    }

    /// The splits of the global tensor `name` (its mesh axes and the
    /// dimension each cuts), whatever the rank's coordinates.
    fn placement(&self, name: &str) -> Vec<(SplitAxis, usize)> {
        use SplitAxis::{Ep, Etp, Tp};
        if name == "embed.weight" || name == "head.weight" {
            return vec![(Tp, 0)];
        }
        // A block's tensors: `blocks.{layer}.{part}`, or an MTP module's
        // block `mtp.{k}.block.{part}` (a block of the last group).
        let (group, part) = if let Some(rest) = name.strip_prefix("blocks.") {
            let Some((layer, part)) = rest.split_once('.') else {
                return Vec::new();
            };
            let Some(group) = layer.parse().ok().and_then(|l| self.spec.group_of_layer(l)) else {
                return Vec::new();
            };
            (group, part)
        } else if let Some(rest) = name.strip_prefix("mtp.") {
            let Some((_, part)) = rest.split_once(".block.") else {
                return Vec::new();
            };
            let Some(group) = self.spec.groups.last() else {
                return Vec::new();
            };
            (group, part)
        } else {
            return Vec::new();
        };
        let gqa = group.attention.mla.is_none();
        match part {
            "attn.wq" | "attn.wk" | "attn.wv" if gqa => vec![(Tp, 1)],
            // MLA's up projections (each head's columns contiguous); its
            // down projections and latent norms are replicated.
            "attn.wq" | "attn.wq_b" | "attn.wkv_b" if !gqa => vec![(Tp, 1)],
            "attn.wo" => vec![(Tp, 0)],
            "mlp.w1" | "mlp.w3" | "moe.shared_experts.w1" | "moe.shared_experts.w3" => {
                vec![(Tp, 1)]
            }
            "mlp.w2" | "moe.shared_experts.w2" => vec![(Tp, 0)],
            "moe.experts.w1" | "moe.experts.w3" => vec![(Ep, 0), (Etp, 2)],
            "moe.experts.w2" => vec![(Ep, 0), (Etp, 1)],
            _ => Vec::new(),
        }
    }

    /// The block of the global tensor `name` of `full_shape` this rank owns.
    /// Only the vocabulary may split unevenly; every other split must
    /// divide its dimension.
    pub fn shard_of(&self, name: &str, full_shape: &[usize]) -> Result<ShardSpec> {
        let rank = &self.rank;
        let mut splits = Vec::new();
        for (axis, dim) in self.placement(name) {
            let (index, parts) = match axis {
                SplitAxis::Tp => (rank.tp_index, rank.tp.size()),
                SplitAxis::Ep => (rank.ep_index, rank.ep.size()),
                SplitAxis::Etp => (rank.etp_index, rank.etp.size()),
            };
            if parts == 1 {
                continue;
            }
            let len = full_shape.get(dim).copied().unwrap_or(0);
            let vocab = name == "embed.weight" || name == "head.weight";
            if len < parts || (!vocab && !len.is_multiple_of(parts)) {
                return Err(EngineError::Invalid(format!(
                    "parameter {name} of shape {full_shape:?}: dimension {dim} ({len}) does not \
                     split into {parts} parts over {axis:?}"
                )));
            }
            splits.push(Split {
                axis,
                dim,
                index,
                parts,
            });
        }
        Ok(ShardSpec {
            full_shape: full_shape.to_vec(),
            splits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testutil::{small_moe, small_spec};
    use crate::layout::{check, LayoutSpec};
    use crate::spec::FfnSpec;

    fn plan(spec: &ModelSpec, text: &str, rank: usize) -> ShardPlan {
        let layout = check(&LayoutSpec::parse(text).unwrap(), spec).unwrap();
        ShardPlan::new(spec, &RankLayout::new(&layout, rank).unwrap())
    }

    /// The table's splits, with this rank's part; a vocabulary tp does not
    /// divide splits unevenly and every row is owned once.
    #[test]
    fn placements_follow_the_table() {
        let spec = small_spec(&[FfnSpec::Dense { ffn: 6 }, small_moe()], false);
        let p = plan(&spec, "world=4,tp=2,ep=2", 3);
        let wq = p.shard_of("blocks.0.attn.wq", &[8, 16]).unwrap();
        assert_eq!(wq.ranges(), vec![(0, 8), (8, 8)]);
        let w2 = p.shard_of("blocks.1.moe.experts.w2", &[4, 6, 8]).unwrap();
        assert_eq!(w2.ranges(), vec![(2, 2), (0, 6), (0, 8)]);
        let norm = p.shard_of("blocks.1.ffn_norm.weight", &[8]).unwrap();
        assert!(norm.splits.is_empty());
        let mut rows = Vec::new();
        let mut odd = spec.clone();
        odd.vocab = 9;
        for r in 0..2 {
            let p = plan(&odd, "world=2,tp=2", r);
            rows.push(p.shard_of("embed.weight", &[9, 8]).unwrap().ranges()[0]);
            assert_eq!(p.vocab_rows(), rows[r]);
        }
        assert_eq!(rows, vec![(0, 5), (5, 4)]);
        let err = p
            .shard_of("blocks.0.mlp.w1", &[8, 5])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("blocks.0.mlp.w1") && err.contains("(5)"),
            "{err}"
        );
    }
}
