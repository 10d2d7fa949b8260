//! Parallel layouts: the two meshes of Parallel Folding, their rank maps and
//! process groups, and the layout rules of DESIGN §3, held once.
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
    /// group: on exactly when the model has MoE layers and `tp > 1` (DESIGN
    /// §3; Megatron-Core requires it for MoE with tp).
    pub sequence_parallel: bool,
    /// Rank order, fastest-varying first.
    pub order: [Axis; 5],
    /// The declared uneven split over the `pp·vpp` virtual stages, if any.
    pub pp_layers: Option<Vec<usize>>,
    /// The vocabulary rounded up to a multiple of `tp`, so the embedding and
    /// LM head split evenly: a vocab not divisible by tp is accepted and
    /// padded (Megatron pads too), the extra rows never being targets.
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

/// Checks every layout rule of DESIGN §3 against `model` and resolves the
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
    check_stages(s, model, &mut r);
    let sequence_parallel = has_moe(model) && s.tp > 1;
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
            "sequence parallelism is on (MoE with tp = {}): hidden states between blocks are split along the sequence over the tp group",
            s.tp
        ));
    }
    if s.ep * s.etp > dp && has_moe(model) {
        r.note(format!(
            "etp({}) × ep({}) > dp({dp}): expert-parallel groups span tensor/context-parallel ranks (folding)",
            s.etp, s.ep
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

/// Every size is at least 1: a 0 would make a mesh empty.
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
        }
    }
    for (field, v) in [("dp", s.dp), ("edp", s.edp)] {
        if v == Some(0) {
            r.err(
                field,
                format!("{field} = 0; every size must be at least 1 (or leave {field} out to derive it)"),
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
        if a.mla.is_none() && kv > 0 {
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
                r.note(format!(
                    "tp = {tp} > kv_heads = {kv}: each key/value head is replicated on {} tensor-parallel ranks",
                    tp / kv
                ));
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
            "vocab = {v} is padded to {}, the next multiple of tp = {tp}, so the embedding and LM head split evenly",
            v.div_ceil(tp) * tp
        ));
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
                "{what} is not a multiple of tp = {tp} (sequence parallelism, on with MoE and tp > 1, splits each sequence over the tp group); choose tp in {}",
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
