//! Parallel layouts: the two meshes of Parallel Folding, their rank maps and
//! process groups, and the layout rules of docs/ARCHITECTURE.md §3, held once.
//!
//! Both front ends call this module: the `#[moe_model]` macro at compile time
//! (so it must build without the `engine` feature) and the runtime when a
//! layout is chosen at launch. Both therefore print the same messages.
//!
//! # The two meshes
//! World size `W`, pipeline size `pp` shared. Within a pipeline stage the same
//! ranks are arranged twice (Megatron-Core's Parallel Folding):
//! - the **attention mesh** `tp × cp × dp` (embedding, attention, dense MLP,
//!   shared experts, LM head),
//! - the **expert mesh** `etp × ep × edp` (routed experts),
//!
//! with `W = tp·cp·dp·pp = etp·ep·edp·pp`. Because the expert mesh is laid out
//! independently, `ep` may exceed `dp`: an expert-parallel group then spans
//! tensor- and context-parallel ranks of the attention mesh ("folding").
//!
//! # Rank order
//! [`LayoutSpec::order`] names the five axes `tp`, `cp`, `ep`, `dp`, `pp`,
//! fastest-varying first; any permutation is accepted. As in Megatron-Core's
//! `RankGenerator`, one order string yields both meshes:
//! - attention mesh: the order with `ep` removed;
//! - expert mesh: the order with `cp` removed, `tp` read as `etp` and `dp` read
//!   as `edp`.
//!
//! For the default `tp-cp-ep-dp-pp` this gives
//! `rank = tp_i + TP·cp_i + TP·CP·dp_i + TP·CP·DP·pp_i` and
//! `rank = etp_i + ETP·ep_i + ETP·EP·edp_i + ETP·EP·EDP·pp_i`.
//! A rank's pipeline stage must be the same in both meshes (a stage holds
//! whole blocks, attention and experts), so an order is rejected when the
//! axes placed before `pp` have a different product in the two meshes; `pp`
//! first or last is always fine.
//!
//! # CLI / config form
//! [`LayoutSpec::parse`] reads comma-separated `key=value` pairs, e.g.
//! `world=8,tp=2,ep=4` or `name=big,world=1024,tp=2,pp=16,ep=64,pp_layers=[3,4,...]`.
//! Keys: `name world tp cp dp pp vpp ep etp edp order pp_layers`; omitted
//! sizes are 1, omitted `dp`/`edp` are derived. `Display` writes the same
//! form back, so the two round-trip.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::spec::{FfnSpec, ModelSpec};

/// Megatron-Core's default rank order (first named varies fastest).
pub const DEFAULT_ORDER: &str = "tp-cp-ep-dp-pp";

/// The keys [`LayoutSpec::parse`] accepts, in the order `Display` writes them.
pub const KEYS: &[&str] = &[
    "name",
    "world",
    "tp",
    "cp",
    "dp",
    "pp",
    "vpp",
    "ep",
    "etp",
    "edp",
    "order",
    "pp_layers",
];

/// A named parallel layout as declared: sizes are 1 unless given, `dp` and
/// `edp` are derived from `world` when `None`.
///
/// `etp` defaults to 1 (experts not tensor-split), not to `tp` as in
/// Megatron-Core: with folding, splitting small expert FFNs over tp is rarely
/// what one wants, and a declared layout should say so explicitly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LayoutSpec {
    /// Layout name (`default`, `cluster`, ...), used in messages.
    pub name: String,
    /// Number of ranks W.
    pub world: usize,
    /// Tensor-parallel size of the attention mesh.
    pub tp: usize,
    /// Context-parallel size (sequence split for attention).
    pub cp: usize,
    /// Data-parallel size of the attention mesh (`None`: `W / (tp·cp·pp)`).
    pub dp: Option<usize>,
    /// Pipeline-parallel size, shared by both meshes.
    pub pp: usize,
    /// Virtual pipeline stages (model chunks) per pipeline rank.
    pub vpp: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size (splits each expert's FFN).
    pub etp: usize,
    /// Expert data-parallel size (`None`: `W / (etp·ep·pp)`).
    pub edp: Option<usize>,
    /// Rank order, a `-`-joined permutation of `tp cp ep dp pp`, fastest first.
    pub order: String,
    /// Layers of each of the `pp·vpp` virtual stages (indexed as in
    /// [`Layout::stage_layers`]); `None`: an even split.
    pub pp_layers: Option<Vec<usize>>,
}

impl Default for LayoutSpec {
    fn default() -> Self {
        LayoutSpec {
            name: "default".into(),
            world: 1,
            tp: 1,
            cp: 1,
            dp: None,
            pp: 1,
            vpp: 1,
            ep: 1,
            etp: 1,
            edp: None,
            order: DEFAULT_ORDER.into(),
            pp_layers: None,
        }
    }
}

/// One violated layout rule, with the values and a fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("layout `{layout}`: {message}")]
pub struct LayoutError {
    /// Name of the layout.
    pub layout: String,
    /// The key the user wrote that the message is about (`tp`, `ep`,
    /// `world`, `pp_layers`, `order`, ...; `layout` for syntax errors), so a
    /// front end can point at it.
    pub field: &'static str,
    /// What is wrong, with the numbers, and how to fix it.
    pub message: String,
}

impl LayoutSpec {
    /// Parses the CLI/config form: comma-separated `key=value` pairs, e.g.
    /// `world=8,tp=2,ep=4`; `pp_layers` takes a bracketed list
    /// (`pp_layers=[3,5]`). Whitespace is ignored; an empty text is the
    /// default layout. Errors quote the bad token. Only the syntax is checked
    /// here; the rules are [`check`]'s.
    pub fn parse(text: &str) -> Result<LayoutSpec, LayoutError> {
        // The name is looked up first so that every error carries it.
        let name = split_pairs(text)
            .ok()
            .and_then(|tokens| {
                tokens.iter().find_map(|t| {
                    t.split_once('=')
                        .filter(|(k, _)| k.trim() == "name")
                        .map(|(_, v)| v.trim().to_string())
                })
            })
            .unwrap_or_else(|| "default".into());
        let fail = |field: &'static str, message: String| LayoutError {
            layout: name.clone(),
            field,
            message,
        };
        let tokens = split_pairs(text).map_err(|m| fail("layout", m))?;
        let mut spec = LayoutSpec {
            name: name.clone(),
            ..LayoutSpec::default()
        };
        let mut seen: Vec<&'static str> = Vec::new();
        for token in tokens {
            let Some((key, value)) = token.split_once('=') else {
                return Err(fail(
                    "layout",
                    format!(
                        "`{token}` is not key=value (e.g. tp=2); keys: {}",
                        KEYS.join(", ")
                    ),
                ));
            };
            let (key, value) = (key.trim(), value.trim());
            let Some(&field) = KEYS.iter().find(|&&k| k == key) else {
                return Err(fail(
                    "layout",
                    format!(
                        "unknown key `{key}` in `{token}`; keys: {}",
                        KEYS.join(", ")
                    ),
                ));
            };
            if seen.contains(&field) {
                return Err(fail(
                    field,
                    format!("`{token}`: {field} is given twice; give it once"),
                ));
            }
            seen.push(field);
            let number = |v: &str| {
                v.parse::<usize>().map_err(|_| {
                    fail(
                        field,
                        format!("`{token}`: `{v}` is not a whole number; write e.g. {field}=2"),
                    )
                })
            };
            match field {
                "name" => {
                    if value.is_empty() {
                        return Err(fail("name", format!("`{token}`: the name is empty")));
                    }
                    spec.name = value.to_string();
                }
                "order" => spec.order = value.to_string(),
                "pp_layers" => {
                    let inner = value
                        .strip_prefix('[')
                        .and_then(|v| v.strip_suffix(']'))
                        .ok_or_else(|| {
                            fail(
                                field,
                                format!(
                                    "`{token}`: write the layers per stage in brackets, e.g. pp_layers=[3,5]"
                                ),
                            )
                        })?;
                    let mut layers = Vec::new();
                    for item in inner.split(',').map(str::trim) {
                        layers.push(item.parse::<usize>().map_err(|_| {
                            fail(
                                field,
                                format!("`{token}`: `{item}` is not a whole number of layers"),
                            )
                        })?);
                    }
                    spec.pp_layers = Some(layers);
                }
                "world" => spec.world = number(value)?,
                "tp" => spec.tp = number(value)?,
                "cp" => spec.cp = number(value)?,
                "dp" => spec.dp = Some(number(value)?),
                "pp" => spec.pp = number(value)?,
                "vpp" => spec.vpp = number(value)?,
                "ep" => spec.ep = number(value)?,
                "etp" => spec.etp = number(value)?,
                "edp" => spec.edp = Some(number(value)?),
                _ => unreachable!("every key of KEYS is matched"),
            }
        }
        Ok(spec)
    }
}

/// Splits `text` at commas outside brackets (so `pp_layers=[3,5]` stays one
/// pair), dropping empty pieces.
fn split_pairs(text: &str) -> Result<Vec<&str>, String> {
    let mut pieces = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, ch) in text.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unmatched `]` in `{text}`"))?
            }
            ',' if depth == 0 => {
                pieces.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unclosed `[` in `{text}`"));
    }
    pieces.push(&text[start..]);
    Ok(pieces
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect())
}

impl fmt::Display for LayoutSpec {
    /// The [`LayoutSpec::parse`] form: `name` (unless `default`), `world`,
    /// then every field that differs from its default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.name != "default" {
            parts.push(format!("name={}", self.name));
        }
        parts.push(format!("world={}", self.world));
        for (key, v) in [
            ("tp", Some(self.tp)),
            ("cp", Some(self.cp)),
            ("dp", self.dp),
            ("pp", Some(self.pp)),
            ("vpp", Some(self.vpp)),
            ("ep", Some(self.ep)),
            ("etp", Some(self.etp)),
            ("edp", self.edp),
        ] {
            let optional = key == "dp" || key == "edp";
            match v {
                Some(v) if optional || v != 1 => parts.push(format!("{key}={v}")),
                _ => {}
            }
        }
        if self.order != DEFAULT_ORDER {
            parts.push(format!("order={}", self.order));
        }
        if let Some(layers) = &self.pp_layers {
            parts.push(format!("pp_layers={}", list(layers, "[", "]", ",")));
        }
        f.write_str(&parts.join(","))
    }
}

/// One of the five axes of a rank order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Axis {
    /// Tensor parallel (read as `etp` in the expert mesh).
    Tp,
    /// Context parallel (absent from the expert mesh).
    Cp,
    /// Expert parallel (absent from the attention mesh).
    Ep,
    /// Data parallel (read as `edp` in the expert mesh).
    Dp,
    /// Pipeline parallel (shared).
    Pp,
}

impl Axis {
    /// The five axes in Megatron's default order.
    pub const ALL: [Axis; 5] = [Axis::Tp, Axis::Cp, Axis::Ep, Axis::Dp, Axis::Pp];

    /// The axis' name in an order string.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
        }
    }
}

/// Parses an order string (`tp-cp-ep-dp-pp`): exactly the five axes, each
/// once, joined by `-`, fastest-varying first.
pub fn parse_order(order: &str) -> Result<[Axis; 5], String> {
    let bad = |why: String| {
        format!(
            "order `{order}` is not a permutation of tp, cp, ep, dp, pp ({why}); write e.g. order = \"{DEFAULT_ORDER}\""
        )
    };
    let mut axes = Vec::with_capacity(5);
    for word in order.split('-').map(str::trim) {
        let axis = Axis::ALL
            .into_iter()
            .find(|a| a.name() == word)
            .ok_or_else(|| bad(format!("unknown name `{word}`")))?;
        if axes.contains(&axis) {
            return Err(bad(format!("{word} appears twice")));
        }
        axes.push(axis);
    }
    let missing: Vec<&str> = Axis::ALL
        .into_iter()
        .filter(|a| !axes.contains(a))
        .map(Axis::name)
        .collect();
    if !missing.is_empty() {
        return Err(bad(format!("missing {}", missing.join(", "))));
    }
    Ok([axes[0], axes[1], axes[2], axes[3], axes[4]])
}

/// A checked layout with every size resolved (see the module docs for the
/// meshes and the rank order).
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// Layout name.
    pub name: String,
    /// Number of ranks W.
    pub world: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Data-parallel size (attention mesh).
    pub dp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Virtual stages per pipeline rank.
    pub vpp: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size.
    pub etp: usize,
    /// Expert data-parallel size.
    pub edp: usize,
    /// Hidden states between blocks are split along the sequence over the tp
    /// group: on exactly when `tp > 1` (docs/ARCHITECTURE.md §3; the engine
    /// always runs tp with it, and Megatron-Core requires it for MoE with
    /// tp).
    pub sequence_parallel: bool,
    /// Rank order, fastest-varying first.
    pub order: [Axis; 5],
    /// The declared uneven split over the `pp·vpp` virtual stages, if any.
    pub pp_layers: Option<Vec<usize>>,
    /// The vocabulary rounded up to a multiple of `tp`: the rows of the
    /// largest vocabulary shard times tp. A vocab not divisible by tp is
    /// accepted: the embedding and LM head split into balanced parts (the
    /// first `vocab % tp` ranks hold one row more), which computes what
    /// Megatron's padding with never-targeted rows does, without pad logits.
    pub padded_vocab: usize,
    /// What the layout changes without being an error (kv-head replication,
    /// vocab padding, sequence parallelism, folding), one sentence each.
    pub notes: Vec<String>,
}

/// A rank's position in the attention mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionCoords {
    /// Tensor-parallel index.
    pub tp: usize,
    /// Context-parallel index.
    pub cp: usize,
    /// Data-parallel index.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

/// A rank's position in the expert mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertCoords {
    /// Expert tensor-parallel index.
    pub etp: usize,
    /// Expert-parallel index (which slice of the experts the rank holds).
    pub ep: usize,
    /// Expert data-parallel index.
    pub edp: usize,
    /// Pipeline stage (equal to the attention mesh's).
    pub pp: usize,
}

/// The process groups the runtime builds from a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Tensor parallel (attention mesh).
    Tp,
    /// Context parallel.
    Cp,
    /// Data parallel (attention mesh).
    Dp,
    /// Data × context parallel: where dense weights' gradients are reduced.
    DpCp,
    /// Pipeline (identical in both meshes).
    Pp,
    /// Expert parallel: the all-to-all of token dispatch.
    Ep,
    /// Expert tensor parallel.
    Etp,
    /// Expert data parallel: where expert weights' gradients are reduced.
    Edp,
    /// First and last pipeline stage of each pipeline (tied embeddings'
    /// gradients); for `pp == 1` the rank alone.
    Embedding,
}

impl GroupKind {
    /// Every kind.
    pub const ALL: [GroupKind; 9] = [
        GroupKind::Tp,
        GroupKind::Cp,
        GroupKind::Dp,
        GroupKind::DpCp,
        GroupKind::Pp,
        GroupKind::Ep,
        GroupKind::Etp,
        GroupKind::Edp,
        GroupKind::Embedding,
    ];
}

// Slots of the four axes of a mesh: attention (tp, cp, dp, pp), expert
// (etp, ep, edp, pp).
const S0: usize = 0;
const S1: usize = 1;
const S2: usize = 2;
const PP: usize = 3;

/// Sizes and strides of one mesh's four axes, indexed by slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mesh {
    size: [usize; 4],
    stride: [usize; 4],
}

impl Mesh {
    /// Lays out `size` (by slot) in `order`, mapping each axis to a slot or
    /// dropping it, fastest-varying first.
    fn new(size: [usize; 4], order: &[Axis; 5], slot: impl Fn(Axis) -> Option<usize>) -> Mesh {
        let mut stride = [0; 4];
        let mut s = 1;
        for &axis in order {
            if let Some(i) = slot(axis) {
                stride[i] = s;
                s *= size[i];
            }
        }
        Mesh { size, stride }
    }

    fn coord(&self, rank: usize, slot: usize) -> usize {
        rank / self.stride[slot] % self.size[slot]
    }

    fn rank(&self, coords: [usize; 4]) -> usize {
        (0..4).map(|i| coords[i] * self.stride[i]).sum()
    }

    /// The ranks that share `rank`'s coordinates except on `slots`, ascending.
    fn group(&self, rank: usize, slots: &[usize]) -> Vec<usize> {
        let base = rank
            - slots
                .iter()
                .map(|&s| self.coord(rank, s) * self.stride[s])
                .sum::<usize>();
        let mut group = vec![base];
        for &s in slots {
            group = group
                .iter()
                .flat_map(|&r| (0..self.size[s]).map(move |i| r + i * self.stride[s]))
                .collect();
        }
        group.sort_unstable();
        group
    }
}

impl Layout {
    fn attention_mesh(&self) -> Mesh {
        Mesh::new(
            [self.tp, self.cp, self.dp, self.pp],
            &self.order,
            |a| match a {
                Axis::Tp => Some(S0),
                Axis::Cp => Some(S1),
                Axis::Dp => Some(S2),
                Axis::Pp => Some(PP),
                Axis::Ep => None,
            },
        )
    }

    fn expert_mesh(&self) -> Mesh {
        Mesh::new(
            [self.etp, self.ep, self.edp, self.pp],
            &self.order,
            |a| match a {
                Axis::Tp => Some(S0),
                Axis::Ep => Some(S1),
                Axis::Dp => Some(S2),
                Axis::Pp => Some(PP),
                Axis::Cp => None,
            },
        )
    }

    /// Number of virtual pipeline stages, `pp·vpp`.
    pub fn stages(&self) -> usize {
        self.pp * self.vpp
    }

    /// `rank`'s position in the attention mesh.
    pub fn attention_coords(&self, rank: usize) -> AttentionCoords {
        assert!(rank < self.world, "rank {rank} >= world {}", self.world);
        let m = self.attention_mesh();
        AttentionCoords {
            tp: m.coord(rank, S0),
            cp: m.coord(rank, S1),
            dp: m.coord(rank, S2),
            pp: m.coord(rank, PP),
        }
    }

    /// `rank`'s position in the expert mesh.
    pub fn expert_coords(&self, rank: usize) -> ExpertCoords {
        assert!(rank < self.world, "rank {rank} >= world {}", self.world);
        let m = self.expert_mesh();
        ExpertCoords {
            etp: m.coord(rank, S0),
            ep: m.coord(rank, S1),
            edp: m.coord(rank, S2),
            pp: m.coord(rank, PP),
        }
    }

    /// The rank at attention coordinates `c` (inverse of [`Self::attention_coords`]).
    pub fn attention_rank(&self, c: AttentionCoords) -> usize {
        self.attention_mesh().rank([c.tp, c.cp, c.dp, c.pp])
    }

    /// The rank at expert coordinates `c` (inverse of [`Self::expert_coords`]).
    pub fn expert_rank(&self, c: ExpertCoords) -> usize {
        self.expert_mesh().rank([c.etp, c.ep, c.edp, c.pp])
    }

    /// The group of `kind` that holds `rank`, ranks ascending.
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Vec<usize> {
        assert!(rank < self.world, "rank {rank} >= world {}", self.world);
        let (att, exp) = (self.attention_mesh(), self.expert_mesh());
        match kind {
            GroupKind::Tp => att.group(rank, &[S0]),
            GroupKind::Cp => att.group(rank, &[S1]),
            GroupKind::Dp => att.group(rank, &[S2]),
            GroupKind::DpCp => att.group(rank, &[S1, S2]),
            GroupKind::Pp => att.group(rank, &[PP]),
            GroupKind::Etp => exp.group(rank, &[S0]),
            GroupKind::Ep => exp.group(rank, &[S1]),
            GroupKind::Edp => exp.group(rank, &[S2]),
            GroupKind::Embedding => {
                let pipeline = att.group(rank, &[PP]);
                let (first, last) = (pipeline[0], pipeline[pipeline.len() - 1]);
                if first == last {
                    vec![first]
                } else {
                    vec![first, last]
                }
            }
        }
    }

    /// The tp×cp group of `rank` (attention mesh): where Megatron-Core
    /// reduces the MoE balancing statistics and z-loss, since the tokens of a
    /// micro-batch are spread over the tensor- and context-parallel ranks.
    pub fn tp_cp_group(&self, rank: usize) -> Vec<usize> {
        assert!(rank < self.world, "rank {rank} >= world {}", self.world);
        self.attention_mesh().group(rank, &[S0, S1])
    }

    /// Every group of `kind`, each ascending, ordered by their smallest
    /// rank. For [`GroupKind::Embedding`], only ranks on the first or last
    /// stage belong to a group (other ranks' `group_of` is their pipeline's
    /// group, which they take no part in).
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        let mut seen = vec![false; self.world];
        let mut groups = Vec::new();
        for rank in 0..self.world {
            if seen[rank] {
                continue;
            }
            let group = if kind == GroupKind::Embedding {
                // Walk pipelines, not ranks, so middle stages are not listed.
                for r in self.group_of(GroupKind::Pp, rank) {
                    seen[r] = true;
                }
                self.group_of(kind, rank)
            } else {
                self.group_of(kind, rank)
            };
            for &r in &group {
                seen[r] = true;
            }
            groups.push(group);
        }
        groups
    }

    /// Layers of each of the `pp·vpp` virtual stages, indexed by virtual
    /// stage `s = v·pp + p` (Megatron's interleaved assignment): model chunk
    /// `v` of pipeline rank `p` holds `stage_layers(L)[v·pp + p]`, and the
    /// ranges, in index order, cover `0..layers` contiguously. So with pp = 2,
    /// vpp = 2 and 8 layers, rank 0 holds layers 0–1 and 4–5, rank 1 holds
    /// 2–3 and 6–7.
    ///
    /// `layers` is the count the layout was checked against. The declared
    /// `pp_layers` is used when it sums to `layers`; otherwise (or without
    /// one) the split is even, the first `layers % stages` stages taking one
    /// layer more — which [`check`] only lets through for an exact split,
    /// so the remainder case serves callers reusing a layout for a smaller
    /// model.
    pub fn stage_layers(&self, layers: usize) -> Vec<Range<usize>> {
        let sizes = match &self.pp_layers {
            Some(p) if p.iter().sum::<usize>() == layers => p.clone(),
            _ => balanced(layers, self.stages()),
        };
        let mut start = 0;
        sizes
            .into_iter()
            .map(|n| {
                start += n;
                start - n..start
            })
            .collect()
    }

    /// The layer ranges of pipeline rank `pp_rank`, one per model chunk
    /// `v = 0..vpp` (see [`Self::stage_layers`]).
    pub fn pp_rank_layers(&self, pp_rank: usize, layers: usize) -> Vec<Range<usize>> {
        let stages = self.stage_layers(layers);
        (0..self.vpp)
            .map(|v| stages[v * self.pp + pp_rank].clone())
            .collect()
    }

    /// The [`LayoutSpec`] that checks back to this layout (with `dp`/`edp` given).
    pub fn spec(&self) -> LayoutSpec {
        LayoutSpec {
            name: self.name.clone(),
            world: self.world,
            tp: self.tp,
            cp: self.cp,
            dp: Some(self.dp),
            pp: self.pp,
            vpp: self.vpp,
            ep: self.ep,
            etp: self.etp,
            edp: Some(self.edp),
            order: self
                .order
                .iter()
                .map(|a| a.name())
                .collect::<Vec<_>>()
                .join("-"),
            pp_layers: self.pp_layers.clone(),
        }
    }
}

impl fmt::Display for Layout {
    /// `name: tp2·cp1·dp4·pp1 | etp1·ep8·edp1 (world 8)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: tp{}·cp{}·dp{}·pp{} | etp{}·ep{}·edp{} (world {}",
            self.name, self.tp, self.cp, self.dp, self.pp, self.etp, self.ep, self.edp, self.world
        )?;
        if self.vpp > 1 {
            write!(f, ", vpp {}", self.vpp)?;
        }
        f.write_str(")")
    }
}

/// `n` split into `parts` near-equal pieces, larger ones first.
fn balanced(n: usize, parts: usize) -> Vec<usize> {
    if parts == 0 {
        return Vec::new();
    }
    (0..parts)
        .map(|i| n / parts + usize::from(i < n % parts))
        .collect()
}

/// Divisors of `n`, ascending (by pairs up to √n, so a huge size typed by
/// mistake does not stall the macro).
fn divisors_of(n: usize) -> Vec<usize> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            low.push(d);
            if d * d != n {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

/// Sizes worth suggesting: divisors of `world` (any divisor of the model
/// dimension when world is 0) that satisfy `ok`.
fn choices(world: usize, dim: usize, ok: impl Fn(usize) -> bool) -> String {
    let pool = if world > 0 {
        divisors_of(world)
    } else {
        divisors_of(dim)
    };
    let v: Vec<usize> = pool.into_iter().filter(|&d| ok(d)).collect();
    list(&v, "{", "}", ", ")
}

fn list(v: &[usize], open: &str, close: &str, sep: &str) -> String {
    let items: Vec<String> = v.iter().map(usize::to_string).collect();
    format!("{open}{}{close}", items.join(sep))
}

/// Collects violations (once each: several block groups with the same dims
/// would repeat a message) and notes.
struct Report {
    layout: String,
    errors: Vec<LayoutError>,
    notes: Vec<String>,
}

impl Report {
    fn err(&mut self, field: &'static str, message: String) {
        if !self
            .errors
            .iter()
            .any(|e| e.field == field && e.message == message)
        {
            self.errors.push(LayoutError {
                layout: self.layout.clone(),
                field,
                message,
            });
        }
    }

    fn note(&mut self, note: String) {
        if !self.notes.contains(&note) {
            self.notes.push(note);
        }
    }
}

/// Checks every layout rule of docs/ARCHITECTURE.md §3 against `model` and resolves the
/// derived sizes; returns all violations, each naming the key to fix.
///
/// The model's own rules are [`ModelSpec::check`]'s; model dimensions that
/// are 0 are skipped here. While a size is 0 (itself an error) the rules
/// that divide by sizes are not evaluated.
pub fn check(layout: &LayoutSpec, model: &ModelSpec) -> Result<Layout, Vec<LayoutError>> {
    let s = layout;
    let mut r = Report {
        layout: s.name.clone(),
        errors: Vec::new(),
        notes: Vec::new(),
    };
    check_positive(s, &mut r);
    let order = match parse_order(&s.order) {
        Ok(o) => Some(o),
        Err(m) => {
            r.err("order", m);
            None
        }
    };
    if !r.errors.is_empty() && r.errors.iter().any(|e| e.field != "order") {
        return Err(r.errors);
    }
    let dp = derive_dp(s, &mut r);
    let edp = derive_edp(s, &mut r);
    check_model_dims(s, model, &mut r);
    check_fp8_shards(s, model, &mut r);
    check_stages(s, model, &mut r);
    let sequence_parallel = s.tp > 1;
    check_sequence(s, model, sequence_parallel, &mut r);
    let (Some(order), Some(dp), Some(edp)) = (order, dp, edp) else {
        return Err(r.errors);
    };
    let mut out = Layout {
        name: s.name.clone(),
        world: s.world,
        tp: s.tp,
        cp: s.cp,
        dp,
        pp: s.pp,
        vpp: s.vpp,
        ep: s.ep,
        etp: s.etp,
        edp,
        sequence_parallel,
        order,
        pp_layers: s.pp_layers.clone(),
        padded_vocab: model.vocab.div_ceil(s.tp) * s.tp,
        notes: Vec::new(),
    };
    check_pipeline_groups(&out, &mut r);
    if !r.errors.is_empty() {
        return Err(r.errors);
    }
    if sequence_parallel {
        r.note(format!(
            "sequence parallelism is on (tp = {}): hidden states between blocks are split along the sequence over the tp group",
            s.tp
        ));
    }
    if has_moe(model) && folds(&out) {
        r.note(format!(
            "ep = {} with dp = {dp}: expert-parallel groups span tensor- or context-parallel ranks (folding)",
            s.ep
        ));
    }
    out.notes = r.notes;
    debug_assert_eq!(
        out.attention_mesh().group(0, &[PP]),
        out.expert_mesh().group(0, &[PP]),
        "pipeline groups of the two meshes differ"
    );
    Ok(out)
}

/// Whether some expert-parallel group holds ranks of different tp or cp
/// index, i.e. the expert mesh is folded over the attention mesh's model
/// parallel axes rather than nested in its data-parallel axis.
fn folds(l: &Layout) -> bool {
    l.groups(GroupKind::Ep).iter().any(|g| {
        let first = l.attention_coords(g[0]);
        g.iter().any(|&r| {
            let c = l.attention_coords(r);
            (c.tp, c.cp) != (first.tp, first.cp)
        })
    })
}

/// The most ranks (and so the largest size of any mesh axis) a layout may
/// have: beyond any machine built, and small enough that every product and
/// every search over divisors stays cheap and exact.
pub const MAX_RANKS: usize = 1 << 20;

/// Every size is at least 1 (a 0 would make a mesh empty) and at most
/// [`MAX_RANKS`] (a larger one is no machine, and would overflow the rank
/// arithmetic).
fn check_positive(s: &LayoutSpec, r: &mut Report) {
    for (field, v) in [
        ("world", s.world),
        ("tp", s.tp),
        ("cp", s.cp),
        ("pp", s.pp),
        ("vpp", s.vpp),
        ("ep", s.ep),
        ("etp", s.etp),
    ] {
        if v == 0 {
            r.err(field, format!("{field} = 0; every size must be at least 1"));
        } else if v > MAX_RANKS {
            r.err(
                field,
                format!("{field} = {v}; every size must be at most {MAX_RANKS} (2^20 ranks)"),
            );
        }
    }
    for (field, v) in [("dp", s.dp), ("edp", s.edp)] {
        if v == Some(0) {
            r.err(
                field,
                format!("{field} = 0; every size must be at least 1 (or leave {field} out to derive it)"),
            );
        } else if let Some(v) = v.filter(|&v| v > MAX_RANKS) {
            r.err(
                field,
                format!("{field} = {v}; every size must be at most {MAX_RANKS} (2^20 ranks)"),
            );
        }
    }
}

/// The attention mesh fills the world: `W % (tp·cp·pp) == 0`, and a given
/// `dp` makes `tp·cp·dp·pp == W`.
fn derive_dp(s: &LayoutSpec, r: &mut Report) -> Option<usize> {
    let (w, tp, cp, pp) = (s.world, s.tp, s.cp, s.pp);
    let model = tp.saturating_mul(cp).saturating_mul(pp);
    let fits = w.is_multiple_of(model);
    let make = format!("make tp·cp·pp one of {}", choices(w, w, |_| true));
    match s.dp {
        None if fits => Some(w / model),
        None => {
            r.err(
                "world",
                format!(
                    "tp({tp}) × cp({cp}) × pp({pp}) = {model} does not divide world = {w}; {make}"
                ),
            );
            None
        }
        Some(dp) => {
            let total = model.saturating_mul(dp);
            if total == w {
                return Some(dp);
            }
            let (field, fix) = if fits {
                (
                    "dp",
                    format!("set dp = {} or leave dp out to derive it", w / model),
                )
            } else {
                ("world", format!("{make}, then leave dp out to derive it"))
            };
            r.err(
                field,
                format!(
                    "tp({tp}) × cp({cp}) × dp({dp}) × pp({pp}) = {total}, but world = {w}; {fix}"
                ),
            );
            None
        }
    }
}

/// The expert mesh fills the world: `W % (etp·ep·pp) == 0`, and a given
/// `edp` makes `etp·ep·edp·pp == W`.
fn derive_edp(s: &LayoutSpec, r: &mut Report) -> Option<usize> {
    let (w, etp, ep, pp) = (s.world, s.etp, s.ep, s.pp);
    let model = etp.saturating_mul(ep).saturating_mul(pp);
    let fits = w.is_multiple_of(model);
    let make = format!("make etp·ep·pp one of {}", choices(w, w, |_| true));
    match s.edp {
        None if fits => Some(w / model),
        None => {
            r.err(
                "world",
                format!("etp({etp}) × ep({ep}) × pp({pp}) = {model} does not divide world = {w}; {make}"),
            );
            None
        }
        Some(edp) => {
            let total = model.saturating_mul(edp);
            if total == w {
                return Some(edp);
            }
            let (field, fix) = if fits {
                (
                    "edp",
                    format!("set edp = {} or leave edp out to derive it", w / model),
                )
            } else {
                ("world", format!("{make}, then leave edp out to derive it"))
            };
            r.err(
                field,
                format!("etp({etp}) × ep({ep}) × edp({edp}) × pp({pp}) = {total}, but world = {w}; {fix}"),
            );
            None
        }
    }
}

fn has_moe(model: &ModelSpec) -> bool {
    model
        .groups
        .iter()
        .any(|g| matches!(g.ffn, FfnSpec::Moe(_)))
}

/// Every split dimension divides by its parallel size: heads, kv heads (or
/// replication), dense and shared-expert FFNs by tp; experts by ep; expert
/// FFNs by etp. The vocabulary is padded instead.
fn check_model_dims(s: &LayoutSpec, model: &ModelSpec, r: &mut Report) {
    let (w, tp, ep, etp) = (s.world, s.tp, s.ep, s.etp);
    for g in &model.groups {
        let a = &g.attention;
        let (heads, kv) = (a.heads, a.kv_heads);
        if !heads.is_multiple_of(tp) {
            r.err(
                "tp",
                format!(
                    "tp = {tp} does not divide heads = {heads}; choose tp in {}",
                    choices(w, heads, |d| heads.is_multiple_of(d))
                ),
            );
        }
        // MLA has no kv heads to split: its latent is replicated on every tp rank.
        if a.mla.is_none() && kv > 0 && heads.is_multiple_of(tp) {
            if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
                r.err(
                    "tp",
                    format!(
                        "tp = {tp} and kv_heads = {kv}: neither divides the other, so key/value heads can be neither split nor replicated evenly; choose tp in {}",
                        choices(w, heads, |d| heads.is_multiple_of(d)
                            && (kv.is_multiple_of(d) || d.is_multiple_of(kv)))
                    ),
                );
            } else if tp > kv {
                // Megatron-Core replicates each key/value head on tp / kv
                // ranks; the engine's shard plan splits them only.
                r.err(
                    "tp",
                    format!(
                        "tp = {tp} > kv_heads = {kv} would replicate each key/value head on {} tensor-parallel ranks, which the engine does not run yet; choose tp in {}",
                        tp / kv,
                        choices(w, heads, |d| heads.is_multiple_of(d) && kv.is_multiple_of(d))
                    ),
                );
            }
        }

        match &g.ffn {
            FfnSpec::Dense { ffn } => {
                if !ffn.is_multiple_of(tp) {
                    r.err(
                        "tp",
                        format!(
                            "tp = {tp} does not divide ffn = {ffn} (dense MLP); choose tp in {}",
                            choices(w, *ffn, |d| ffn.is_multiple_of(d))
                        ),
                    );
                }
            }
            FfnSpec::Moe(m) => {
                let (e, f, sh) = (m.experts, m.expert_ffn, m.shared_ffn);
                if e > 0 && !e.is_multiple_of(ep) {
                    r.err(
                        "ep",
                        format!(
                            "ep = {ep} does not divide experts = {e}; choose ep in {}",
                            choices(w, e, |d| e.is_multiple_of(d))
                        ),
                    );
                }
                if f > 0 && !f.is_multiple_of(etp) {
                    r.err(
                        "etp",
                        format!(
                            "etp = {etp} does not divide expert_ffn = {f}; choose etp in {}",
                            choices(w, f, |d| f.is_multiple_of(d))
                        ),
                    );
                }
                // Shared experts are a dense MLP on the attention mesh, split over tp.
                if !sh.is_multiple_of(tp) {
                    r.err(
                        "tp",
                        format!(
                            "tp = {tp} does not divide shared_ffn = {sh} (shared experts, split over tp); choose tp in {}",
                            choices(w, sh, |d| sh.is_multiple_of(d))
                        ),
                    );
                }
            }
        }
    }
    if !has_moe(model) {
        for (field, v) in [("ep", ep), ("etp", etp)] {
            if v > 1 {
                r.err(
                    field,
                    format!("{field} = {v}, but the model has no MoE layers; set {field} = 1"),
                );
            }
        }
    }
    let v = model.vocab;
    if !v.is_multiple_of(tp) {
        r.note(format!(
            "vocab = {v} is padded to {} for the memory plan (tp = {tp} does not divide it): \
             the embedding and LM head split into parts of {} and {} rows",
            v.div_ceil(tp) * tp,
            v.div_ceil(tp),
            v / tp
        ));
    }
}

/// fp8 GEMMs need every dimension a multiple of 16 on each rank, not only in
/// the whole model (docs/ARCHITECTURE.md §3, precision): tp splits dense and shared-expert
/// FFNs and etp splits expert FFNs, and a split can break the multiple.
/// Attention needs no check here: `head_dim` is itself a multiple of 16 when
/// the model passes its own fp8 rule, and tp splits whole heads. A dim that
/// is not a multiple of 16 at all, or not divisible by its size, is already
/// reported by another rule and skipped.
fn check_fp8_shards(s: &LayoutSpec, model: &ModelSpec, r: &mut Report) {
    let w = s.world;
    for g in model.groups.iter().filter(|g| g.policy.precision.is_fp8()) {
        let mut dims: Vec<(&'static str, &str, usize, usize)> = Vec::new();
        match &g.ffn {
            FfnSpec::Dense { ffn } => dims.push(("tp", "ffn", *ffn, s.tp)),
            FfnSpec::Moe(m) => {
                dims.push(("etp", "expert_ffn", m.expert_ffn, s.etp));
                dims.push(("tp", "shared_ffn", m.shared_ffn, s.tp));
            }
        }
        for (field, name, dim, size) in dims {
            if dim == 0 || size == 0 || !dim.is_multiple_of(16) || !dim.is_multiple_of(size) {
                continue;
            }
            let local = dim / size;
            if !local.is_multiple_of(16) {
                r.err(
                    field,
                    format!(
                        "{field} = {size} splits {name} = {dim} into {local} per rank, but fp8 GEMMs need a multiple of 16; choose {field} in {} or use bf16",
                        choices(w, dim, |d| dim.is_multiple_of(d) && (dim / d).is_multiple_of(16))
                    ),
                );
            }
        }
    }
}

/// The blocks split over the `pp·vpp` virtual stages: evenly, or as the
/// declared `pp_layers` says (one entry per stage, each ≥ 1, summing to the
/// layer count); interleaving (`vpp > 1`) needs a pipeline.
fn check_stages(s: &LayoutSpec, model: &ModelSpec, r: &mut Report) {
    let (pp, vpp) = (s.pp, s.vpp);
    if vpp > 1 && pp == 1 {
        r.err(
            "vpp",
            format!("vpp = {vpp} needs pp > 1 (it interleaves model chunks over pipeline ranks); set pp >= 2 or vpp = 1"),
        );
    }
    let stages = pp.saturating_mul(vpp);
    let layers = model.layers();
    if layers == 0 {
        return;
    }
    match &s.pp_layers {
        Some(split) => {
            if split.len() != stages {
                r.err(
                    "pp_layers",
                    format!(
                        "pp_layers has {} entries, but pp({pp}) × vpp({vpp}) = {stages} virtual stages; give one entry per stage",
                        split.len()
                    ),
                );
            }
            for (i, &n) in split.iter().enumerate() {
                if n == 0 {
                    r.err(
                        "pp_layers",
                        format!("pp_layers[{i}] = 0; every stage holds at least one layer"),
                    );
                }
            }
            let sum: usize = split.iter().sum();
            if sum != layers {
                r.err(
                    "pp_layers",
                    format!("pp_layers sums to {sum}, but the model has {layers} layers; make the entries sum to {layers}"),
                );
            }
        }
        None if stages > layers => r.err(
            "pp",
            format!("pp({pp}) × vpp({vpp}) = {stages} stages, but the model has {layers} layers; every stage needs at least one layer, so choose pp·vpp <= {layers}"),
        ),
        None if !layers.is_multiple_of(stages) => {
            let example = if stages <= 16 {
                format!(" (e.g. {})", list(&balanced(layers, stages), "[", "]", ", "))
            } else {
                String::new()
            };
            r.err(
                "pp",
                format!(
                    "layers = {layers} do not split evenly over pp({pp}) × vpp({vpp}) = {stages} stages; declare pp_layers with {stages} entries summing to {layers}{example}, or choose pp·vpp in {}",
                    list(&divisors_of(layers), "{", "}", ", ")
                ),
            );
        }
        None => {}
    }
}

/// The two chunks of a sequence cut into `2·cp` that context-parallel rank
/// `cp_index` holds, in the order it holds them: `cp_index` and `2·cp − 1 −
/// cp_index`, so that under a causal mask every rank attends over the same
/// number of key positions (Megatron-Core's load-balanced split).
pub fn cp_chunks(cp: usize, cp_index: usize) -> [usize; 2] {
    assert!(cp_index < cp, "cp index {cp_index} >= cp {cp}");
    [cp_index, 2 * cp - 1 - cp_index]
}

/// The positions within a sequence of `seq` tokens that context-parallel rank
/// `cp_index` holds, in its local order (its [`cp_chunks`], each `seq / 2cp`
/// consecutive positions); `0..seq` for `cp = 1`.
pub fn cp_positions(seq: usize, cp: usize, cp_index: usize) -> Vec<usize> {
    if cp == 1 {
        return (0..seq).collect();
    }
    assert!(
        seq.is_multiple_of(2 * cp),
        "seq_len {seq} is not a multiple of 2·cp = {}",
        2 * cp
    );
    let chunk = seq / (2 * cp);
    cp_chunks(cp, cp_index)
        .iter()
        .flat_map(|&c| c * chunk..(c + 1) * chunk)
        .collect()
}

/// Load-balanced context parallelism cuts each sequence into `2·cp` chunks
/// (`seq % 2cp == 0`); sequence parallelism splits each rank's `seq/cp`
/// tokens over tp.
fn check_sequence(s: &LayoutSpec, model: &ModelSpec, sp: bool, r: &mut Report) {
    let (w, tp, cp, seq) = (s.world, s.tp, s.cp, model.seq_len);
    if seq == 0 {
        return;
    }
    if cp > 1 && !seq.is_multiple_of(2 * cp) {
        r.err(
            "cp",
            format!(
                "seq_len = {seq} is not a multiple of 2·cp = {} (load-balanced context parallelism cuts each sequence into 2·cp chunks); choose cp in {}",
                2 * cp,
                choices(w, seq, |d| d == 1 || seq.is_multiple_of(2 * d))
            ),
        );
        return;
    }
    let local = seq / cp;
    if sp && !local.is_multiple_of(tp) {
        let what = if cp == 1 {
            format!("seq_len = {seq}")
        } else {
            format!("seq_len / cp = {local}")
        };
        r.err(
            "tp",
            format!(
                "{what} is not a multiple of tp = {tp} (sequence parallelism, on with tp > 1, splits each sequence over the tp group); choose tp in {}",
                choices(w, local, |d| local.is_multiple_of(d))
            ),
        );
    }
}

/// A rank's pipeline stage must be the same in both meshes, which holds iff
/// the axes ordered before `pp` have the same product in each (`pp` first or
/// last always works).
fn check_pipeline_groups(l: &Layout, r: &mut Report) {
    let (att, exp) = (l.attention_mesh(), l.expert_mesh());
    if l.pp == 1 || att.stride[PP] == exp.stride[PP] {
        return;
    }
    let before = |expert: bool| {
        let mut names = Vec::new();
        for &a in l.order.iter().take_while(|&&a| a != Axis::Pp) {
            let (name, size) = match (a, expert) {
                (Axis::Tp, false) => ("tp", l.tp),
                (Axis::Cp, false) => ("cp", l.cp),
                (Axis::Dp, false) => ("dp", l.dp),
                (Axis::Tp, true) => ("etp", l.etp),
                (Axis::Ep, true) => ("ep", l.ep),
                (Axis::Dp, true) => ("edp", l.edp),
                _ => continue,
            };
            names.push(format!("{name}({size})"));
        }
        if names.is_empty() {
            "nothing".to_string()
        } else {
            names.join(" × ")
        }
    };
    let order: Vec<&str> = l.order.iter().map(|a| a.name()).collect();
    r.err(
        "order",
        format!(
            "order `{}` puts {} = {} before pp in the attention mesh but {} = {} in the expert mesh, so their pipeline groups differ; put pp last (as in {DEFAULT_ORDER}) or first",
            order.join("-"),
            before(false),
            att.stride[PP],
            before(true),
            exp.stride[PP]
        ),
    );
}

/// Every layout of `world` ranks (default order, vpp 1, no declared split)
/// that passes [`check`] for `model`, ordered by pp, tp, cp, ep, etp — the
/// set the parallel-equivalence tests sweep.
pub fn valid_layouts(world: usize, model: &ModelSpec) -> Vec<Layout> {
    let sizes = divisors_of(world);
    let mut out = Vec::new();
    for &pp in &sizes {
        for &tp in &sizes {
            for &cp in &sizes {
                for &ep in &sizes {
                    for &etp in &sizes {
                        let spec = LayoutSpec {
                            name: format!("tp{tp}-cp{cp}-pp{pp}-ep{ep}-etp{etp}"),
                            world,
                            tp,
                            cp,
                            pp,
                            ep,
                            etp,
                            ..LayoutSpec::default()
                        };
                        if let Ok(l) = check(&spec, model) {
                            out.push(l);
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{
        AttentionSpec, BlockGroup, LoadBalance, MlaSpec, MoeSpec, RouterSpec, ScoreFunction,
    };

    fn moe(experts: usize, top_k: usize, expert_ffn: usize, shared_ffn: usize) -> FfnSpec {
        FfnSpec::Moe(MoeSpec {
            experts,
            top_k,
            expert_ffn,
            shared_ffn,
            shared_gate: false,
            router: RouterSpec::default(),
            capacity: None,
        })
    }

    fn model(vocab: usize, seq_len: usize, groups: Vec<BlockGroup>) -> ModelSpec {
        ModelSpec {
            name: "t".into(),
            vocab,
            hidden: 64,
            seq_len,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tied_embeddings: false,
            init_std: 0.02,
            groups,
            mtp_layers: 0,
            mtp_loss_coef: 0.1,
        }
    }

    /// 8 layers, 8 heads (4 kv), 8 experts, vocab 64, seq 32.
    fn small() -> ModelSpec {
        model(
            64,
            32,
            vec![BlockGroup::new(
                8,
                AttentionSpec::gqa(8, 4, 8),
                moe(8, 2, 32, 0),
            )],
        )
    }

    fn spec(text: &str) -> LayoutSpec {
        LayoutSpec::parse(text).unwrap()
    }

    fn ok(text: &str, m: &ModelSpec) -> Layout {
        check(&spec(text), m).unwrap_or_else(|e| panic!("{text}: {e:#?}"))
    }

    fn messages(text: &str, m: &ModelSpec) -> Vec<(&'static str, String)> {
        check(&spec(text), m)
            .expect_err(text)
            .into_iter()
            .map(|e| (e.field, e.message))
            .collect()
    }

    fn one(text: &str, m: &ModelSpec) -> (&'static str, String) {
        let errs = messages(text, m);
        assert_eq!(errs.len(), 1, "{errs:#?}");
        errs.into_iter().next().unwrap()
    }

    fn singletons(w: usize) -> Vec<Vec<usize>> {
        (0..w).map(|r| vec![r]).collect()
    }

    /// Every rank in exactly one group of each kind, groups of the right
    /// size, coordinates inverting the rank maps, pp groups equal in both
    /// meshes.
    fn assert_consistent(l: &Layout) {
        let sizes = [
            (GroupKind::Tp, l.tp),
            (GroupKind::Cp, l.cp),
            (GroupKind::Dp, l.dp),
            (GroupKind::DpCp, l.dp * l.cp),
            (GroupKind::Pp, l.pp),
            (GroupKind::Ep, l.ep),
            (GroupKind::Etp, l.etp),
            (GroupKind::Edp, l.edp),
        ];
        for (kind, size) in sizes {
            let groups = l.groups(kind);
            assert_eq!(groups.len() * size, l.world, "{l} {kind:?}");
            let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..l.world).collect::<Vec<_>>(), "{l} {kind:?}");
            for g in &groups {
                assert_eq!(g.len(), size, "{l} {kind:?}");
                assert!(g.windows(2).all(|p| p[0] < p[1]), "{l} {kind:?}");
                for &r in g {
                    assert_eq!(&l.group_of(kind, r), g, "{l} {kind:?}");
                }
            }
        }
        let emb = l.groups(GroupKind::Embedding);
        assert_eq!(emb.len(), l.world / l.pp, "{l}");
        for r in 0..l.world {
            let (a, e) = (l.attention_coords(r), l.expert_coords(r));
            assert_eq!(l.attention_rank(a), r);
            assert_eq!(l.expert_rank(e), r);
            assert_eq!(a.pp, e.pp, "{l} rank {r}");
            assert_eq!(
                l.attention_mesh().group(r, &[PP]),
                l.expert_mesh().group(r, &[PP])
            );
        }
    }

    // --- rank maps and groups, checked by hand -------------------------------

    #[test]
    fn tp2_dp4_with_ep4_folds_experts_over_tp() {
        let l = ok("world=8,tp=2,ep=4", &small());
        assert_eq!((l.dp, l.edp), (4, 2));
        assert_eq!(l.groups(GroupKind::Tp), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(l.groups(GroupKind::Dp), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        assert_eq!(l.groups(GroupKind::DpCp), l.groups(GroupKind::Dp));
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(l.groups(GroupKind::Edp), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(l.groups(GroupKind::Etp), singletons(8));
        assert_eq!(l.groups(GroupKind::Cp), singletons(8));
        assert_eq!(l.groups(GroupKind::Pp), singletons(8));
        assert_eq!(l.groups(GroupKind::Embedding), singletons(8));
        assert_eq!(
            l.attention_coords(5),
            AttentionCoords {
                tp: 1,
                cp: 0,
                dp: 2,
                pp: 0
            }
        );
        assert_eq!(
            l.expert_coords(5),
            ExpertCoords {
                etp: 0,
                ep: 1,
                edp: 1,
                pp: 0
            }
        );
        assert!(l.sequence_parallel);
        assert!(
            l.notes.iter().any(|n| n.contains("folding")),
            "{:?}",
            l.notes
        );
        assert_consistent(&l);
    }

    #[test]
    fn tp2_dp2_with_ep4_puts_all_ranks_in_one_ep_group() {
        let l = ok("world=4,tp=2,ep=4", &small());
        assert_eq!((l.dp, l.edp), (2, 1));
        assert_eq!(l.groups(GroupKind::Dp), [[0, 2], [1, 3]]);
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1, 2, 3]]);
        assert_eq!(l.groups(GroupKind::Edp), singletons(4));
        assert_consistent(&l);
    }

    #[test]
    fn tp4_with_ep4_makes_the_ep_group_the_tp_group() {
        let l = ok(
            "world=4,tp=4,ep=4",
            &model(
                64,
                32,
                vec![BlockGroup::new(
                    2,
                    AttentionSpec::gqa(8, 4, 8),
                    moe(8, 2, 32, 0),
                )],
            ),
        );
        assert_eq!((l.dp, l.edp), (1, 1));
        assert_eq!(l.groups(GroupKind::Tp), [[0, 1, 2, 3]]);
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1, 2, 3]]);
        assert_eq!(l.groups(GroupKind::Dp), singletons(4));
        assert_consistent(&l);
    }

    #[test]
    fn tp2_dp4_with_ep8_spans_the_world() {
        let l = ok("world=8,tp=2,ep=8", &small());
        assert_eq!((l.dp, l.edp), (4, 1));
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1, 2, 3, 4, 5, 6, 7]]);
        assert_eq!(l.groups(GroupKind::Edp), singletons(8));
        assert_consistent(&l);
    }

    #[test]
    fn tp2_with_etp2_matches_tp_and_dp_groups() {
        let l = ok("world=4,tp=2,etp=2", &small());
        assert_eq!((l.dp, l.ep, l.edp), (2, 1, 2));
        assert_eq!(l.groups(GroupKind::Etp), [[0, 1], [2, 3]]);
        assert_eq!(l.groups(GroupKind::Etp), l.groups(GroupKind::Tp));
        assert_eq!(l.groups(GroupKind::Edp), [[0, 2], [1, 3]]);
        assert_eq!(l.groups(GroupKind::Edp), l.groups(GroupKind::Dp));
        assert_eq!(l.groups(GroupKind::Ep), singletons(4));
        assert_consistent(&l);
    }

    #[test]
    fn dp4_with_ep2_and_given_edp2() {
        let l = ok("world=4,ep=2,edp=2", &small());
        assert_eq!(l.dp, 4);
        assert_eq!(l.groups(GroupKind::Dp), [[0, 1, 2, 3]]);
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1], [2, 3]]);
        assert_eq!(l.groups(GroupKind::Edp), [[0, 2], [1, 3]]);
        assert!(!l.sequence_parallel);
        assert_consistent(&l);
    }

    #[test]
    fn cp_positions_balance_the_causal_work() {
        assert_eq!(cp_chunks(2, 0), [0, 3]);
        assert_eq!(cp_chunks(2, 1), [1, 2]);
        assert_eq!(cp_positions(8, 2, 0), [0, 1, 6, 7]);
        assert_eq!(cp_positions(8, 2, 1), [2, 3, 4, 5]);
        assert_eq!(cp_positions(4, 1, 0), [0, 1, 2, 3]);
        // Every position held once, and every rank sees the same number of
        // causal (query, key) pairs.
        let (seq, cp) = (24, 3);
        let mut all: Vec<usize> = (0..cp).flat_map(|i| cp_positions(seq, cp, i)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..seq).collect::<Vec<_>>());
        let work: Vec<usize> = (0..cp)
            .map(|i| cp_positions(seq, cp, i).iter().map(|p| p + 1).sum())
            .collect();
        assert!(work.iter().all(|&w| w == work[0]), "{work:?}");
    }

    #[test]
    fn tp_cp_groups() {
        let l = ok("world=8,tp=2,cp=2,ep=4", &small());
        assert_eq!(l.tp_cp_group(5), [4, 5, 6, 7]);
        assert_eq!(l.tp_cp_group(0), [0, 1, 2, 3]);
    }

    #[test]
    fn cp_groups_and_dp_cp_groups() {
        let l = ok("world=8,tp=2,cp=2,ep=4", &small());
        assert_eq!(l.dp, 2);
        assert_eq!(l.groups(GroupKind::Cp), [[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert_eq!(l.groups(GroupKind::Dp), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(l.groups(GroupKind::DpCp), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        // The expert mesh has no cp: ep spans tp and cp ranks.
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_consistent(&l);
    }

    #[test]
    fn pipeline_and_embedding_groups() {
        let l = ok("world=8,tp=2,pp=2,ep=4", &small());
        assert_eq!((l.dp, l.edp), (2, 1));
        assert_eq!(l.groups(GroupKind::Pp), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(l.groups(GroupKind::Embedding), l.groups(GroupKind::Pp));
        assert_eq!(l.groups(GroupKind::Ep), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(
            l.expert_coords(6),
            ExpertCoords {
                etp: 0,
                ep: 2,
                edp: 0,
                pp: 1
            }
        );
        assert_consistent(&l);

        let l = ok("world=8,tp=2,pp=4", &small());
        assert_eq!(l.groups(GroupKind::Pp), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        assert_eq!(l.groups(GroupKind::Embedding), [[0, 6], [1, 7]]);
        assert_eq!(l.group_of(GroupKind::Embedding, 7), [1, 7]);
        assert_consistent(&l);
    }

    #[test]
    fn other_orders_permute_the_rank_maps() {
        // dp fastest: attention rank = dp + 4·tp, expert rank = edp + 2·ep.
        let l = ok("world=8,tp=2,ep=4,order=dp-tp-cp-ep-pp", &small());
        assert_eq!(l.groups(GroupKind::Tp), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(l.groups(GroupKind::Dp), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(l.groups(GroupKind::Edp), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(l.groups(GroupKind::Ep), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        assert_consistent(&l);
        // pp first is always consistent.
        let l = ok("world=8,tp=2,pp=2,ep=2,order=pp-tp-cp-ep-dp", &small());
        assert_eq!(l.groups(GroupKind::Pp), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_consistent(&l);
    }

    #[test]
    fn every_valid_small_layout_is_consistent() {
        let m = small();
        for w in [1, 2, 4, 8] {
            let layouts = valid_layouts(w, &m);
            assert!(!layouts.is_empty());
            for l in &layouts {
                assert_consistent(l);
            }
        }
        assert!(valid_layouts(8, &m).iter().any(|l| l.ep > l.dp));
    }

    #[test]
    fn stage_layers_follow_the_interleaved_order() {
        let l = ok("world=2,pp=2,vpp=2", &small());
        assert_eq!(l.stage_layers(8), [0..2, 2..4, 4..6, 6..8]);
        assert_eq!(l.pp_rank_layers(0, 8), [0..2, 4..6]);
        assert_eq!(l.pp_rank_layers(1, 8), [2..4, 6..8]);
        let l = ok("world=2,pp=2,vpp=2,pp_layers=[1,3,3,1]", &small());
        assert_eq!(l.stage_layers(8), [0..1, 1..4, 4..7, 7..8]);
        assert_eq!(l.pp_rank_layers(1, 8), [1..4, 7..8]);
        // Reused for a model of another depth: balanced, larger stages first.
        assert_eq!(l.stage_layers(6), [0..2, 2..4, 4..5, 5..6]);
    }

    // --- one test per rule, with the exact message ---------------------------

    #[test]
    fn ep_must_divide_experts() {
        let m = model(
            64,
            32,
            vec![BlockGroup::new(
                8,
                AttentionSpec::gqa(8, 4, 8),
                moe(64, 2, 32, 0),
            )],
        );
        let l = LayoutSpec {
            world: 64,
            ep: 6,
            edp: Some(1),
            ..LayoutSpec::default()
        };
        let errs = check(&l, &m).unwrap_err();
        // 6 does not divide 64 either: both are reported.
        assert_eq!(errs[0].field, "world");
        assert_eq!(errs[1].field, "ep");
        assert_eq!(
            errs[1].to_string(),
            "layout `default`: ep = 6 does not divide experts = 64; choose ep in {1, 2, 4, 8, 16, 32, 64}"
        );
        assert_eq!(errs.len(), 2, "{errs:#?}");
        assert_eq!(
            one("world=12,ep=6", &m),
            (
                "ep",
                "ep = 6 does not divide experts = 64; choose ep in {1, 2, 4}".into()
            )
        );
    }

    #[test]
    fn attention_mesh_must_fill_the_world() {
        let m = small();
        assert_eq!(
            one("world=64,tp=4,cp=2,dp=3,pp=2", &m),
            ("dp", "tp(4) × cp(2) × dp(3) × pp(2) = 48, but world = 64; set dp = 4 or leave dp out to derive it".into())
        );
        assert_eq!(
            one("world=8,pp=8,cp=1,tp=1,ep=1,pp_layers=[1,1,1,1,1,1,1,1],dp=2", &m),
            ("dp", "tp(1) × cp(1) × dp(2) × pp(8) = 16, but world = 8; set dp = 1 or leave dp out to derive it".into())
        );
        let errs = messages("world=6,tp=4", &m);
        assert_eq!(
            errs[0],
            ("world", "tp(4) × cp(1) × pp(1) = 4 does not divide world = 6; make tp·cp·pp one of {1, 2, 3, 6}".into())
        );
    }

    #[test]
    fn expert_mesh_must_fill_the_world() {
        let m = small();
        assert_eq!(
            one("world=4,ep=8", &m),
            ("world", "etp(1) × ep(8) × pp(1) = 8 does not divide world = 4; make etp·ep·pp one of {1, 2, 4}".into())
        );
        assert_eq!(
            one("world=8,ep=2,edp=2", &m),
            ("edp", "etp(1) × ep(2) × edp(2) × pp(1) = 4, but world = 8; set edp = 4 or leave edp out to derive it".into())
        );
    }

    #[test]
    fn sizes_must_be_positive() {
        let errs = messages("world=0,tp=0,dp=0", &small());
        assert_eq!(
            errs,
            [
                (
                    "world",
                    "world = 0; every size must be at least 1".to_string()
                ),
                ("tp", "tp = 0; every size must be at least 1".to_string()),
                (
                    "dp",
                    "dp = 0; every size must be at least 1 (or leave dp out to derive it)"
                        .to_string()
                ),
            ]
        );
    }

    #[test]
    fn tp_must_divide_heads() {
        let m = model(
            64,
            48,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(12, 12, 8),
                FfnSpec::Dense { ffn: 48 },
            )],
        );
        assert_eq!(
            one("world=16,tp=8", &m),
            (
                "tp",
                "tp = 8 does not divide heads = 12; choose tp in {1, 2, 4}".into()
            )
        );
    }

    #[test]
    fn kv_heads_split_or_replicate() {
        let m = model(
            64,
            48,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(12, 4, 8),
                FfnSpec::Dense { ffn: 48 },
            )],
        );
        assert_eq!(
            one("world=6,tp=6", &m),
            ("tp", "tp = 6 and kv_heads = 4: neither divides the other, so key/value heads can be neither split nor replicated evenly; choose tp in {1, 2}".into())
        );
        ok("world=4,tp=4", &m);
        assert_eq!(
            one("world=12,tp=12", &m),
            ("tp", "tp = 12 > kv_heads = 4 would replicate each key/value head on 3 tensor-parallel ranks, which the engine does not run yet; choose tp in {1, 2, 4}".into())
        );
    }

    #[test]
    fn mla_checks_heads_only() {
        let mut att = AttentionSpec::gqa(8, 1, 16);
        att.mla = Some(MlaSpec {
            q_lora_rank: 0,
            kv_lora_rank: 16,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 8,
            v_head_dim: 8,
        });
        let m = model(64, 32, vec![BlockGroup::new(2, att, moe(8, 2, 32, 0))]);
        // kv_heads = 1 means nothing for MLA: no replication error at dp,
        // ep or tp (its heads split over tp, its latent is replicated).
        ok("world=4,ep=4", &m);
        ok("world=4,tp=4", &m);
        ok("world=2,cp=2", &m);
        let errs = messages("world=16,tp=16", &m);
        assert!(
            errs.iter()
                .any(|(_, e)| e == "tp = 16 does not divide heads = 8; choose tp in {1, 2, 4, 8}"),
            "{errs:?}"
        );
    }

    #[test]
    fn tp_must_divide_dense_and_shared_ffn() {
        let m = model(
            64,
            48,
            vec![
                BlockGroup::new(1, AttentionSpec::gqa(6, 6, 8), FfnSpec::Dense { ffn: 20 }),
                BlockGroup::new(1, AttentionSpec::gqa(6, 6, 8), moe(6, 2, 30, 10)),
            ],
        );
        assert_eq!(
            messages("world=6,tp=3", &m),
            [
                ("tp", "tp = 3 does not divide ffn = 20 (dense MLP); choose tp in {1, 2}".to_string()),
                ("tp", "tp = 3 does not divide shared_ffn = 10 (shared experts, split over tp); choose tp in {1, 2}".to_string()),
            ]
        );
    }

    #[test]
    fn etp_must_divide_expert_ffn() {
        let m = model(
            64,
            32,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(8, 4, 8),
                moe(8, 2, 20, 0),
            )],
        );
        assert_eq!(
            one("world=8,etp=8", &m),
            (
                "etp",
                "etp = 8 does not divide expert_ffn = 20; choose etp in {1, 2, 4}".into()
            )
        );
    }

    #[test]
    fn expert_sizes_need_experts() {
        let m = model(
            64,
            32,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(8, 4, 8),
                FfnSpec::Dense { ffn: 32 },
            )],
        );
        assert_eq!(
            one("world=4,ep=4", &m),
            (
                "ep",
                "ep = 4, but the model has no MoE layers; set ep = 1".into()
            )
        );
    }

    #[test]
    fn vocab_is_padded_and_said_so() {
        let m = model(
            100,
            48,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(6, 6, 8),
                moe(6, 2, 30, 0),
            )],
        );
        let l = ok("world=3,tp=3", &m);
        assert_eq!(l.padded_vocab, 102);
        assert!(l.notes.contains(&"vocab = 100 is padded to 102 for the memory plan (tp = 3 does not divide it): the embedding and LM head split into parts of 34 and 33 rows".to_string()), "{:?}", l.notes);
        assert_eq!(ok("world=2,tp=2", &m).padded_vocab, 100);
    }

    #[test]
    fn layers_split_evenly_unless_declared() {
        let m = model(
            64,
            32,
            vec![BlockGroup::new(
                7,
                AttentionSpec::gqa(8, 4, 8),
                moe(8, 2, 32, 0),
            )],
        );
        assert_eq!(
            one("world=4,pp=4", &m),
            ("pp", "layers = 7 do not split evenly over pp(4) × vpp(1) = 4 stages; declare pp_layers with 4 entries summing to 7 (e.g. [2, 2, 2, 1]), or choose pp·vpp in {1, 7}".into())
        );
        assert_eq!(
            one("world=8,pp=8", &m),
            ("pp", "pp(8) × vpp(1) = 8 stages, but the model has 7 layers; every stage needs at least one layer, so choose pp·vpp <= 7".into())
        );
        ok("world=4,pp=4,pp_layers=[1,2,2,2]", &m);
    }

    #[test]
    fn declared_split_is_checked() {
        let m = small();
        assert_eq!(
            one("world=2,pp=2,vpp=2,pp_layers=[4,4]", &m),
            ("pp_layers", "pp_layers has 2 entries, but pp(2) × vpp(2) = 4 virtual stages; give one entry per stage".into())
        );
        assert_eq!(
            messages("world=2,pp=2,pp_layers=[0,7]", &m),
            [
                (
                    "pp_layers",
                    "pp_layers[0] = 0; every stage holds at least one layer".to_string()
                ),
                (
                    "pp_layers",
                    "pp_layers sums to 7, but the model has 8 layers; make the entries sum to 8"
                        .to_string()
                ),
            ]
        );
    }

    #[test]
    fn vpp_needs_a_pipeline() {
        assert_eq!(
            one("world=1,vpp=2", &small()),
            ("vpp", "vpp = 2 needs pp > 1 (it interleaves model chunks over pipeline ranks); set pp >= 2 or vpp = 1".into())
        );
    }

    #[test]
    fn context_parallel_needs_2cp_chunks() {
        let m = model(
            64,
            36,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(8, 4, 8),
                moe(8, 2, 32, 0),
            )],
        );
        assert_eq!(
            one("world=4,cp=4", &m),
            ("cp", "seq_len = 36 is not a multiple of 2·cp = 8 (load-balanced context parallelism cuts each sequence into 2·cp chunks); choose cp in {1, 2}".into())
        );
    }

    #[test]
    fn sequence_parallel_needs_seq_divisible_by_tp() {
        let m = model(
            64,
            36,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(8, 8, 8),
                moe(8, 2, 32, 0),
            )],
        );
        assert_eq!(
            one("world=8,tp=8", &m),
            ("tp", "seq_len = 36 is not a multiple of tp = 8 (sequence parallelism, on with tp > 1, splits each sequence over the tp group); choose tp in {1, 2, 4}".into())
        );
        assert_eq!(
            one("world=8,tp=4,cp=2", &m).1,
            "seq_len / cp = 18 is not a multiple of tp = 4 (sequence parallelism, on with tp > 1, splits each sequence over the tp group); choose tp in {1, 2}"
        );
        // A dense model runs tp with sequence parallelism too.
        let dense = model(
            64,
            36,
            vec![BlockGroup::new(
                2,
                AttentionSpec::gqa(8, 8, 8),
                FfnSpec::Dense { ffn: 32 },
            )],
        );
        assert_eq!(one("world=8,tp=8", &dense).0, "tp");
        assert!(ok("world=8,tp=4", &dense).sequence_parallel);
    }

    #[test]
    fn order_must_be_a_permutation() {
        let m = small();
        assert_eq!(
            one("world=2,order=tp-cp-dp-pp", &m),
            ("order", "order `tp-cp-dp-pp` is not a permutation of tp, cp, ep, dp, pp (missing ep); write e.g. order = \"tp-cp-ep-dp-pp\"".into())
        );
        assert_eq!(one("order=tp-cp-ep-dp-xp", &m).1, "order `tp-cp-ep-dp-xp` is not a permutation of tp, cp, ep, dp, pp (unknown name `xp`); write e.g. order = \"tp-cp-ep-dp-pp\"");
        assert_eq!(one("order=tp-tp-ep-dp-pp", &m).1, "order `tp-tp-ep-dp-pp` is not a permutation of tp, cp, ep, dp, pp (tp appears twice); write e.g. order = \"tp-cp-ep-dp-pp\"");
    }

    #[test]
    fn order_must_keep_pipeline_groups_equal() {
        assert_eq!(
            one("world=8,tp=2,pp=2,order=tp-pp-cp-ep-dp", &small()),
            ("order", "order `tp-pp-cp-ep-dp` puts tp(2) = 2 before pp in the attention mesh but etp(1) = 1 in the expert mesh, so their pipeline groups differ; put pp last (as in tp-cp-ep-dp-pp) or first".into())
        );
        // Equal products before pp are fine: tp(2) vs etp(2).
        assert_consistent(&ok(
            "world=8,tp=2,etp=2,pp=2,order=tp-pp-cp-ep-dp",
            &small(),
        ));
    }

    #[test]
    fn every_violation_is_reported() {
        let m = model(
            64,
            34,
            vec![BlockGroup::new(
                7,
                AttentionSpec::gqa(12, 4, 8),
                moe(10, 2, 30, 0),
            )],
        );
        let errs = messages("world=64,tp=8,cp=2,dp=3,ep=4,etp=4,vpp=2", &m);
        let fields: Vec<&str> = errs.iter().map(|e| e.0).collect();
        assert_eq!(
            fields,
            ["dp", "tp", "ep", "etp", "vpp", "pp", "cp"],
            "{errs:#?}"
        );
    }

    /// The seed report's example of folding: attention tp4·cp2·dp8·pp4 and
    /// experts etp1·ep64·edp1 over the same 256 ranks. Worked by hand: in a
    /// stage the attention mesh has strides tp 1, cp 4, dp 8, so the 64 ranks
    /// of a stage form one ep group that spans tp, cp and dp.
    #[test]
    fn seed_example_folds_ep_over_tp_cp_and_dp() {
        let m = model(
            32000,
            4096,
            vec![BlockGroup::new(
                16,
                AttentionSpec::gqa(32, 8, 128),
                moe(64, 8, 1024, 0),
            )],
        );
        let l = ok("world=256,tp=4,cp=2,dp=8,pp=4,ep=64,etp=1,edp=1", &m);
        assert_consistent(&l);
        assert_eq!(l.group_of(GroupKind::Tp, 0), vec![0, 1, 2, 3]);
        assert_eq!(l.group_of(GroupKind::Cp, 0), vec![0, 4]);
        assert_eq!(
            l.group_of(GroupKind::Dp, 0),
            (0..64).step_by(8).collect::<Vec<_>>()
        );
        assert_eq!(
            l.group_of(GroupKind::DpCp, 5),
            vec![1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61]
        );
        assert_eq!(l.group_of(GroupKind::Pp, 0), vec![0, 64, 128, 192]);
        assert_eq!(l.group_of(GroupKind::Ep, 70), (64..128).collect::<Vec<_>>());
        assert_eq!(l.group_of(GroupKind::Etp, 70), vec![70]);
        assert_eq!(l.group_of(GroupKind::Edp, 70), vec![70]);
        let a = l.attention_coords(70);
        assert_eq!((a.tp, a.cp, a.dp, a.pp), (2, 1, 0, 1));
        let e = l.expert_coords(70);
        assert_eq!((e.etp, e.ep, e.edp, e.pp), (0, 6, 0, 1));
        assert!(l.sequence_parallel);
    }

    // --- real cluster layouts ---------------------------------------------------

    fn deepseek_v3() -> ModelSpec {
        let mut att = AttentionSpec::gqa(128, 128, 192);
        att.mla = Some(MlaSpec {
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        });
        let mut ffn = moe(256, 8, 2048, 2048);
        if let FfnSpec::Moe(m) = &mut ffn {
            m.router = RouterSpec {
                score: ScoreFunction::Sigmoid,
                scaling_factor: 2.5,
                groups: 8,
                group_top_k: 4,
                expert_bias_rate: Some(1e-3),
                load_balance: LoadBalance::SeqAux,
                aux_coef: 1e-4,
                ..RouterSpec::default()
            };
        }
        let mut m = model(
            129280,
            4096,
            vec![
                BlockGroup::new(3, att.clone(), FfnSpec::Dense { ffn: 18432 }),
                BlockGroup::new(58, att, ffn),
            ],
        );
        m.hidden = 7168;
        m.mtp_layers = 1;
        m
    }

    #[test]
    fn deepseek_v3_on_1024_gpus() {
        let m = deepseek_v3();
        m.check().unwrap();
        assert_eq!(m.layers(), 61);
        let split = "[3,4,4,4,4,4,4,4,4,4,4,4,4,4,4,2]";
        let l = ok(
            &format!("name=dsv3,world=1024,pp=16,ep=64,pp_layers={split}"),
            &m,
        );
        assert_eq!((l.dp, l.edp), (64, 1));
        assert!(!l.sequence_parallel);
        assert_eq!(l.stage_layers(61).last(), Some(&(59..61)));
        assert_eq!(l.groups(GroupKind::Ep).len(), 16);
        assert_eq!(l.groups(GroupKind::Embedding)[0], [0, 15 * 64]);
        assert_consistent(&l);
        // MLA splits its heads over tp (dp 32, the tokens between blocks
        // split over tp).
        let tp2 = format!("name=dsv3,world=1024,tp=2,pp=16,ep=64,pp_layers={split}");
        let l = ok(&tp2, &m);
        assert!(l.dp == 32 && l.sequence_parallel);
        // Without the declared split, 61 layers do not divide over 16 stages.
        assert_eq!(one("world=1024,pp=16,ep=64", &m).0, "pp");
    }

    #[test]
    fn mixtral_8x7b_on_64_gpus() {
        let m = model(
            32000,
            4096,
            vec![BlockGroup::new(
                32,
                AttentionSpec::gqa(32, 8, 128),
                moe(8, 2, 14336, 0),
            )],
        );
        let l = ok("world=64,tp=2,pp=4,ep=8", &m);
        assert_eq!((l.dp, l.edp), (8, 2));
        assert_eq!(l.stage_layers(32)[1], 8..16);
        assert_consistent(&l);
    }

    #[test]
    fn qwen3_30b_a3b_on_16_gpus() {
        let m = model(
            151936,
            4096,
            vec![BlockGroup::new(
                48,
                AttentionSpec::gqa(32, 4, 128),
                moe(128, 8, 768, 0),
            )],
        );
        let l = ok("world=16,ep=8", &m);
        assert_eq!((l.dp, l.edp), (16, 2));
        assert!(!l.sequence_parallel);
        assert_consistent(&l);
    }

    // --- parse -----------------------------------------------------------------

    #[test]
    fn parse_reads_pairs_and_round_trips() {
        assert_eq!(LayoutSpec::parse("").unwrap(), LayoutSpec::default());
        let s = spec(" name=big, world=64 ,tp=2,pp=4,vpp=2,ep=8,etp=2,dp=8,edp=2,order=pp-tp-cp-ep-dp,pp_layers=[4, 4,4,4,4,4,4,4] ");
        assert_eq!(
            s,
            LayoutSpec {
                name: "big".into(),
                world: 64,
                tp: 2,
                cp: 1,
                dp: Some(8),
                pp: 4,
                vpp: 2,
                ep: 8,
                etp: 2,
                edp: Some(2),
                order: "pp-tp-cp-ep-dp".into(),
                pp_layers: Some(vec![4; 8]),
            }
        );
        for s in [s, LayoutSpec::default(), spec("world=8,ep=4")] {
            assert_eq!(LayoutSpec::parse(&s.to_string()).unwrap(), s, "{s}");
        }
        assert_eq!(spec("world=8,ep=4").to_string(), "world=8,ep=4");
        let l = ok("world=8,tp=2,ep=4", &small());
        assert_eq!(
            check(&l.spec(), &small()).unwrap().groups(GroupKind::Ep),
            l.groups(GroupKind::Ep)
        );
    }

    #[test]
    fn parse_errors_name_the_token() {
        let err = |t: &str| LayoutSpec::parse(t).unwrap_err().to_string();
        assert_eq!(err("tp2"), "layout `default`: `tp2` is not key=value (e.g. tp=2); keys: name, world, tp, cp, dp, pp, vpp, ep, etp, edp, order, pp_layers");
        assert_eq!(err("name=x,tpp=2"), "layout `x`: unknown key `tpp` in `tpp=2`; keys: name, world, tp, cp, dp, pp, vpp, ep, etp, edp, order, pp_layers");
        assert_eq!(
            err("tp=two"),
            "layout `default`: `tp=two`: `two` is not a whole number; write e.g. tp=2"
        );
        assert_eq!(
            err("tp=2,tp=4"),
            "layout `default`: `tp=4`: tp is given twice; give it once"
        );
        assert_eq!(err("pp_layers=3"), "layout `default`: `pp_layers=3`: write the layers per stage in brackets, e.g. pp_layers=[3,5]");
        assert_eq!(
            err("pp_layers=[3,x]"),
            "layout `default`: `pp_layers=[3,x]`: `x` is not a whole number of layers"
        );
        assert_eq!(
            err("pp_layers=[3,4"),
            "layout `default`: unclosed `[` in `pp_layers=[3,4`"
        );
        assert_eq!(LayoutSpec::parse("tp=-1").unwrap_err().field, "tp");
    }

    #[test]
    fn fp8_needs_multiples_of_16_on_each_rank() {
        use crate::spec::GemmPrecision;
        let mut dense =
            BlockGroup::new(1, AttentionSpec::gqa(8, 4, 16), FfnSpec::Dense { ffn: 48 });
        dense.policy.precision = GemmPrecision::Fp8Blockwise;
        let mut experts = BlockGroup::new(1, AttentionSpec::gqa(8, 4, 16), moe(8, 2, 32, 0));
        experts.policy.precision = GemmPrecision::Fp8Tensorwise;
        let m = model(64, 32, vec![dense, experts]);
        ok("world=4,tp=1,etp=2", &m);
        assert_eq!(
            one("world=2,tp=2", &m),
            ("tp", "tp = 2 splits ffn = 48 into 24 per rank, but fp8 GEMMs need a multiple of 16; choose tp in {1} or use bf16".into())
        );
        assert_eq!(
            one("world=4,etp=4,ep=1", &m),
            ("etp", "etp = 4 splits expert_ffn = 32 into 8 per rank, but fp8 GEMMs need a multiple of 16; choose etp in {1, 2} or use bf16".into())
        );
        // The same splits are fine in bf16.
        let mut bf16 = m.clone();
        for g in &mut bf16.groups {
            g.policy.precision = GemmPrecision::Bf16;
        }
        ok("world=4,tp=2,etp=4", &bf16);
    }
}
