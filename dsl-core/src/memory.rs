//! Memory per GPU and communication per step of a model under a layout and
//! its policies, before anything runs: the numbers behind `foldmoe plan`.
//!
//! Pure functions of [`ModelSpec`] (with each group's [`Policy`]) and a
//! checked [`Layout`]; the engine is not involved. Conventions, following
//! Megatron-Core with its distributed optimizer:
//! - weights and gradients in bf16 (2 bytes each), an fp32 master copy and
//!   two fp32 Adam moments (12 bytes) sharded over dp·cp (dense parameters)
//!   or edp (routed experts); gradients are not sharded (the reduce-scatter
//!   lands in a full-size buffer);
//! - tp splits attention, the dense MLP, shared experts and the vocabulary;
//!   ep·etp split the routed experts; norms and the router are replicated;
//!   a pipeline rank holds its stage's blocks, the embedding on the first
//!   stage and the final norm and head on the last (a tied table on both);
//! - activations per micro-batch follow Korthikanti et al. (2022): bytes per
//!   token per layer of every tensor a block saves for backward, with flash
//!   attention (softmax statistics rather than the s×s matrix) and no dropout
//!   masks (foldmoe has no dropout); tp divides what it splits (heads,
//!   ffn, vocabulary, and with sequence parallelism the tensors between
//!   blocks), cp divides the sequence. MTP modules (on the last stage)
//!   count as blocks of the last group, plus their norms, projection,
//!   a copy of the embedding table and one more loss state each;
//! - the tensors are those the engine saves (`engine::activations` counts
//!   the same list, tagged the same way, and a test holds the two within
//!   10% of each other); bf16 unless [`MemoryOptions::activation_bytes`]
//!   says otherwise, fp8 storage one byte per element;
//! - recompute frees a part between forward and backward, but a block's
//!   backward brings its dropped tensors back: the peak adds to the blocks'
//!   in-flight tensors the larger of one block's rematerialised tensors
//!   (the largest group's) and the loss's state (final norm, head, logits),
//!   which the loss backward frees before any block's backward.

use crate::layout::Layout;
use crate::spec::{
    FfnSpec, GemmPrecision, LoadBalance, ModelSpec, OffloadPart, Policy, RecomputePart,
    RouterDtype, ScoreFunction,
};
use serde::Serialize;

/// Bytes in a GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

/// The parts memory is broken down by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// Embedding table, final norm and LM head (and the logits).
    EmbeddingHead,
    /// Block norms (and MLA's latent norms), their inputs and outputs.
    Norms,
    /// Attention projections and core.
    Attention,
    /// Dense MLPs.
    DenseMlp,
    /// MoE routers.
    Router,
    /// Routed experts (and the dispatched tokens).
    RoutedExperts,
    /// Shared experts.
    SharedExperts,
}

impl Part {
    /// Every part, in table order.
    pub const ALL: [Part; 7] = [
        Part::EmbeddingHead,
        Part::Norms,
        Part::Attention,
        Part::DenseMlp,
        Part::Router,
        Part::RoutedExperts,
        Part::SharedExperts,
    ];

    /// The part's name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Part::EmbeddingHead => "embedding_head",
            Part::Norms => "norms",
            Part::Attention => "attention",
            Part::DenseMlp => "dense_mlp",
            Part::Router => "router",
            Part::RoutedExperts => "routed_experts",
            Part::SharedExperts => "shared_experts",
        }
    }
}

/// One part's memory on the rank, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PartMemory {
    /// The part's name ([`Part::name`]).
    pub part: &'static str,
    /// Parameters the rank holds.
    pub params: u64,
    /// bf16 weights.
    pub weights: u64,
    /// bf16 gradients.
    pub grads: u64,
    /// fp32 master weights and Adam moments, this rank's shard.
    pub optimizer: u64,
    /// Saved activations of one micro-batch on the device.
    pub activations_per_micro_batch: u64,
    /// Saved activations of all in-flight micro-batches on the device.
    pub activations: u64,
    /// Saved activations of all in-flight micro-batches moved to host memory.
    pub offloaded: u64,
}

/// Communication of one process group per optimizer step, from this rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommVolume {
    /// Group kind, named as in the plan's group list (`tp`, `ep`, `dpcp`, ...).
    pub group: &'static str,
    /// Ranks in the group.
    pub size: usize,
    /// Bytes this rank sends per step (ring algorithms).
    pub bytes_per_step: u64,
    /// What is exchanged.
    pub what: &'static str,
}

/// What [`plan_memory`] is asked.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryOptions {
    /// The rank whose memory is planned.
    pub rank: usize,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per optimizer step on each dp rank.
    pub micro_batches: usize,
    /// Bytes per element of saved activations: 2 (bf16, the default) on
    /// GPUs; 4 for the CPU engine's f32. fp32 statistics and int32 indices
    /// are 4 either way.
    pub activation_bytes: f64,
    /// Bytes per weight and per gradient element: 2 (bf16, the default), 4
    /// for an f32 model.
    pub weight_bytes: f64,
    /// The expert all-to-all overlapped with the other micro-batch
    /// (`--overlap-moe-expert-parallel-comm`): one more model chunk counted
    /// in flight, a bound (a pair's backward frees its blocks while its
    /// forward saves, so the engine's peak is below it).
    pub overlap_moe_comm: bool,
}

impl MemoryOptions {
    /// Options for `rank` with bf16 activations.
    pub fn new(rank: usize, micro_batch_size: usize, micro_batches: usize) -> Self {
        MemoryOptions {
            rank,
            micro_batch_size,
            micro_batches,
            activation_bytes: 2.0,
            weight_bytes: 2.0,
            overlap_moe_comm: false,
        }
    }
}

/// Memory per GPU and communication per step of one rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// The rank planned.
    pub rank: usize,
    /// Its pipeline stage.
    pub pp_stage: usize,
    /// Blocks it holds (all model chunks), as `[start, end)` ranges.
    pub layers: Vec<(usize, usize)>,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Micro-batches per step on each dp rank.
    pub micro_batches: usize,
    /// Micro-batches whose activations the stage holds at its peak.
    pub in_flight: f64,
    /// By part.
    pub parts: Vec<PartMemory>,
    /// Send and receive buffers of the largest dispatch and of pipeline p2p.
    pub comm_buffers: u64,
    /// Flat copies the engine's distributed optimizer makes during a step:
    /// its largest bucket (the routed experts, or the dense parameters)
    /// packed once as gradients for the reduce-scatter and once as values
    /// for the update (Megatron-Core keeps persistent contiguous buffers
    /// instead; foldmoe does not yet).
    pub step_buffers: u64,
    /// The fp8 experts' weights a step of several micro-batches keeps in
    /// fp8, both layouts (Transformer Engine's fp8 weight caching).
    pub fp8_weight_cache: u64,
    /// Weights, gradients, optimizer state, device activations and buffers.
    pub total: u64,
    /// Communication per step, one entry per group with traffic.
    pub comm: Vec<CommVolume>,
}

impl MemoryPlan {
    /// The sum of `field` over the parts.
    pub fn sum(&self, field: impl Fn(&PartMemory) -> u64) -> u64 {
        self.parts
            .iter()
            .map(field)
            .fold(0, |acc, x| acc.saturating_add(x))
    }
}

/// How a saved tensor's elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// In the activation dtype ([`MemoryOptions::activation_bytes`]).
    Act,
    /// fp32 statistics: the attention's and the loss's log-sum-exp, fp8
    /// scales. (Norms' rstd and the router's state are in the activation
    /// dtype, as the engine keeps them.)
    Fp32,
    /// int32 indices (chosen experts, permutation).
    Int,
    /// e4m3 codes, a byte each: the fp8 experts' saved GEMM operands
    /// (their scales are a tensor of their own, `Fp32`).
    Fp8,
}

/// One tensor a block saves for backward: which part it belongs to, what
/// frees it, and its elements per token of the rank's sequence shard.
struct Saved {
    part: Part,
    recompute: Option<RecomputePart>,
    offload: Option<OffloadPart>,
    kind: Kind,
    elems_per_token: f64,
}

/// The tensors one block of `group` saves, per token of the micro-batch's
/// `cp` shard (Korthikanti et al. with tp and sequence parallelism).
///
/// The list is the engine's: every `*Saved` struct of `engine` lists its
/// tensors with the same part, recompute and offload tags
/// (`engine::activations::Slot`), and `tests/memory_planner_vs_engine.rs`
/// checks the two against each other. Where one buffer is kept by several
/// layers (the norm output the router, shared experts and MLP all keep),
/// it is counted once. Per-layer constants (the experts' group sizes) are
/// left out, except the fp8 experts' scale buffers, sized per group, which
/// `tokens` (of the shard, per micro-batch) spreads over the tokens.
fn saved_tensors(spec: &ModelSpec, gi: usize, layout: &Layout, tokens: f64) -> Vec<Saved> {
    use Kind::{Act, Fp32, Int};
    use OffloadPart as O;
    use RecomputePart as R;
    let g = &spec.groups[gi];
    let (h, t) = (spec.hidden as f64, layout.tp as f64);
    // Tensors between blocks are split along the sequence over tp with
    // sequence parallelism, else replicated.
    let sp = if layout.sequence_parallel { t } else { 1.0 };
    let s = |part, recompute, offload, kind, elems_per_token| Saved {
        part,
        recompute,
        offload,
        kind,
        elems_per_token,
    };
    let a = &g.attention;
    // fp8 projections keep an input's column tiles (codes and their scales)
    // instead of its rows, unless the input is gathered over tp: then the
    // rank's sequence shard is kept, as in the model's dtype. An input of
    // `cols` columns and `rows` rows a token (1 / sp for a sequence shard).
    let attn_fp8 = a.precision == GemmPrecision::Fp8Blockwise;
    let projection_input =
        |v: &mut Vec<Saved>, part, recompute, (cols, rows): (f64, f64), gathered: bool| {
            if attn_fp8 && !gathered {
                v.push(s(part, recompute, None, Kind::Fp8, cols * rows));
                let scales = column_tile_scales(cols, rows, 1.0, tokens);
                v.push(s(part, recompute, None, Fp32, scales));
            } else {
                v.push(s(part, recompute, None, Act, cols * rows));
            }
        };
    let mut v = vec![
        // The block's input, kept even under `block` recompute (first in
        // the list: see `placed`), and its norm's rstd.
        s(Part::Norms, None, Some(O::AttnNorm), Act, h / sp),
        s(Part::Norms, Some(R::Norm), Some(O::AttnNorm), Act, 1.0 / sp),
    ];
    // The attention norm's output, the projections' input: this rank's
    // sequence shard. GQA's projections (and a full-rank MLA query) read it
    // gathered over tp, and the backward gathers it again; MLA's down
    // projections read the shard itself.
    let gathered = layout.tp > 1 && a.mla.as_ref().is_none_or(|m| m.q_lora_rank == 0);
    projection_input(&mut v, Part::Norms, Some(R::Norm), (h, 1.0 / sp), gathered);
    v.extend([
        s(Part::Norms, None, Some(O::MlpNorm), Act, h / sp),
        s(Part::Norms, Some(R::Norm), Some(O::MlpNorm), Act, 1.0 / sp),
        s(Part::Norms, Some(R::Norm), None, Act, h / sp),
    ]);
    let heads = a.heads as f64;
    let v_dim = match &a.mla {
        None => {
            // Replicated kv heads (tp > kv_heads) hold one head per rank.
            let kv = (a.kv_heads as f64 / t).max(1.0) * a.head_dim as f64;
            let q = heads * a.head_dim as f64 / t;
            v.push(s(Part::Attention, None, Some(O::Qkv), Act, q + 2.0 * kv));
            if a.qk_norm {
                // The per-head norms' inputs and fp32 rstd (one per head).
                let (hq, hkv) = (heads / t, (a.kv_heads as f64 / t).max(1.0));
                v.push(s(Part::Attention, None, None, Act, q + kv));
                v.push(s(Part::Attention, Some(R::Norm), None, Act, hq + hkv));
            }
            a.head_dim as f64
        }
        Some(m) if layout.cp > 1 => {
            // Under cp: the query latent before and after its norm (with
            // its rstd; under tp this rank's sequence shard of each), this
            // cp rank's query rows (`mla_up_proj` drops them), and the
            // key/value latent before and after its norm (with its rstd)
            // and the rotary key of this rank's tokens, which the backward
            // gathers again to expand the keys and values.
            let (c, l) = (m.q_lora_rank as f64, m.kv_lora_rank as f64);
            if m.q_lora_rank > 0 {
                v.push(s(Part::Attention, None, None, Act, c / sp));
                projection_input(&mut v, Part::Attention, None, (c, 1.0 / sp), layout.tp > 1);
                v.push(s(Part::Attention, Some(R::Norm), None, Act, 1.0 / sp));
            }
            let qk = (m.qk_nope_head_dim + m.qk_rope_head_dim) as f64;
            v.push(s(
                Part::Attention,
                Some(R::MlaUpProj),
                Some(O::Qkv),
                Act,
                heads * qk / t,
            ));
            let r = m.qk_rope_head_dim as f64;
            v.push(s(Part::Attention, None, None, Act, (2.0 * l + r) / sp));
            v.push(s(Part::Attention, Some(R::Norm), None, Act, 1.0 / sp));
            m.v_head_dim as f64
        }
        Some(m) => {
            // The latents before their norms (the norms' inputs, with
            // their rstd) and after them (the up-projections' inputs), of
            // this rank's tokens (its sequence shard under tp: the normed
            // latents are gathered for the up projections and gathered
            // again in the backward); `mla_up_proj` recomputes Q, K and V
            // from them. The kernel's q, k and v are padded to one head dim,
            // max(P + R, V).
            let latents = (m.q_lora_rank + m.kv_lora_rank) as f64;
            let norms = if m.q_lora_rank > 0 { 2.0 } else { 1.0 };
            v.push(s(Part::Attention, None, None, Act, latents / sp));
            for latent in [m.q_lora_rank, m.kv_lora_rank] {
                if latent > 0 {
                    let shard = (latent as f64, 1.0 / sp);
                    projection_input(&mut v, Part::Attention, None, shard, layout.tp > 1);
                }
            }
            v.push(s(Part::Attention, Some(R::Norm), None, Act, norms / sp));
            let qk = (m.qk_nope_head_dim + m.qk_rope_head_dim) as f64;
            let hd = qk.max(m.v_head_dim as f64);
            v.push(s(
                Part::Attention,
                Some(R::MlaUpProj),
                Some(O::Qkv),
                Act,
                3.0 * heads * hd / t,
            ));
            // The kernel's output is kept without its padding (the output
            // projection's input; padded again for the kernel's backward).
            m.v_head_dim as f64
        }
    };
    // Flash attention saves fp32 log-sum-exp per head; its output is the
    // output projection's input. Under cp each held chunk's queries run
    // padded to their key prefix (chunks i and 2cp − 1 − i: 2cp + 1 chunks
    // of rows for 2 held), each padded row with its log-sum-exp, and the
    // exchange keeps its int32 row maps (2cp + 1 a held token).
    let cp = layout.cp as f64;
    let padded_rows = if layout.cp > 1 {
        (2.0 * cp + 1.0) / 2.0
    } else {
        1.0
    };
    v.push(s(
        Part::Attention,
        Some(R::CoreAttn),
        Some(O::CoreAttn),
        Fp32,
        heads / t * padded_rows,
    ));
    if layout.cp > 1 {
        v.push(s(Part::Attention, None, None, Int, 2.0 * cp + 1.0));
    }
    v.push(s(
        Part::Attention,
        None,
        Some(O::AttnProj),
        Act,
        heads * v_dim / t,
    ));
    match &g.ffn {
        FfnSpec::Dense { ffn } => {
            let f = *ffn as f64 / t;
            v.push(s(Part::DenseMlp, None, None, Act, 2.0 * f));
            v.push(s(Part::DenseMlp, Some(R::MlpAct), None, Act, f));
        }
        FfnSpec::Moe(m) => {
            // The router's state of the rank's sequence shard: the chosen
            // experts and their probabilities, with the load-balancing loss
            // the full probabilities and their gradient, with the z-loss the
            // softmax and log-sum-exp. (The routing weights travel with the
            // experts' rows, counted there.)
            let (e, k) = (m.experts as f64, m.top_k as f64);
            let r = &m.router;
            let score = match (r.score, r.pre_softmax) {
                (ScoreFunction::Softmax, false) => k,
                (ScoreFunction::Softmax, true) => e,
                (ScoreFunction::Sigmoid, _) => e + if m.top_k > 1 { k } else { 0.0 },
            };
            let mut router = score;
            if r.load_balance != LoadBalance::None && r.aux_coef != 0.0 {
                router += 2.0 * e
                    + if r.score == ScoreFunction::Sigmoid {
                        e
                    } else {
                        0.0
                    };
            }
            if r.z_loss_coef != 0.0 {
                router += e + 1.0;
            }
            v.push(s(Part::Router, None, None, Int, k / sp));
            // In f32 under `router_dtype = fp32`.
            let state = if r.dtype == RouterDtype::Fp32 {
                Fp32
            } else {
                Act
            };
            v.push(s(Part::Router, Some(R::Router), None, state, router / sp));
            // Each token of the shard is dispatched top_k times; on average
            // a rank receives as many rows as it sends, gathered over etp
            // (which splits F).
            let etp = layout.etp as f64;
            let rows = k * etp / sp;
            let f = m.expert_ffn as f64 / etp;
            // fp8 experts keep their products' inputs as fp8 codes, with the
            // f32 scales of their column tiles: `⌈rows/128⌉ + G` per column,
            // what the engine allocates without reading the group sizes.
            let fp8 = g.policy.precision == GemmPrecision::Fp8Blockwise;
            let operand = if fp8 { Kind::Fp8 } else { Act };
            let local_experts = m.experts as f64 / layout.ep as f64;
            let scales = |cols: f64| column_tile_scales(cols, rows, local_experts, tokens);
            // The permutation (source token and slot of each row).
            v.push(s(Part::RoutedExperts, None, None, Int, 2.0 * rows));
            // The experts' input rows: on one expert rank the products
            // gather them from the layer input (kept by the router), so
            // only fp8 keeps a copy; under ep or etp the received rows.
            if fp8 || layout.ep > 1 || layout.etp > 1 {
                v.push(s(Part::RoutedExperts, None, None, operand, rows * h));
            }
            if fp8 {
                v.push(s(Part::RoutedExperts, None, None, Fp32, scales(h)));
            }
            v.push(s(
                Part::RoutedExperts,
                None,
                Some(O::ExpertFc1),
                Act,
                rows * 2.0 * f,
            ));
            v.push(s(
                Part::RoutedExperts,
                Some(R::MoeAct),
                Some(O::MoeAct),
                operand,
                rows * f,
            ));
            if fp8 {
                v.push(s(
                    Part::RoutedExperts,
                    Some(R::MoeAct),
                    Some(O::MoeAct),
                    Fp32,
                    scales(f),
                ));
            }
            // The rows' routing weights (the experts apply them in SwiGLU;
            // its backward gives their gradient).
            v.push(s(Part::RoutedExperts, None, None, Act, rows));
            if m.shared_ffn > 0 {
                let f = m.shared_ffn as f64 / t;
                let gate = if m.shared_gate { 1.0 + h } else { 0.0 };
                for elems in [2.0 * f, f, gate] {
                    v.push(s(
                        Part::SharedExperts,
                        Some(R::SharedExperts),
                        None,
                        Act,
                        elems,
                    ));
                }
            }
        }
    }
    v
}

/// Elements per token of the f32 scales of a matrix of `cols` columns and
/// `rows` rows a token, kept in fp8 column tiles over `groups` groups:
/// `⌈rows·tokens / 128⌉ + groups` scale rows (`kernels::fp8::column_tiles`,
/// what the engine allocates without reading the group sizes), spread over
/// the `tokens` of the shard's micro-batch.
fn column_tile_scales(cols: f64, rows: f64, groups: f64, tokens: f64) -> f64 {
    if tokens > 0.0 {
        cols * ((rows * tokens / 128.0).ceil() + groups) / tokens
    } else {
        0.0
    }
}

/// Bytes of `tensor` kept on the device and moved to the host under
/// `policy`, per token, with activations of `act_bytes` per element.
/// `block` recompute keeps only the block's input (`block_input`); fp8
/// storage keeps one byte per float element (an int32 index is not
/// compressed).
fn placed(tensor: &Saved, policy: &Policy, block_input: bool, act_bytes: f64) -> (f64, f64) {
    let recomputed = if policy.recompute.contains(&RecomputePart::Block) {
        !block_input
    } else {
        tensor
            .recompute
            .is_some_and(|r| policy.recompute.contains(&r))
    };
    if recomputed {
        return (0.0, 0.0);
    }
    let mut bytes = tensor.elems_per_token
        * match tensor.kind {
            Kind::Act => act_bytes,
            Kind::Fp32 | Kind::Int => 4.0,
            Kind::Fp8 => 1.0,
        };
    if let Some(o) = tensor.offload {
        if policy.store_fp8.contains(&o) && matches!(tensor.kind, Kind::Act | Kind::Fp32) {
            bytes = tensor.elems_per_token;
        }
        if policy.offload.contains(&o) {
            return (0.0, bytes);
        }
    }
    (bytes, 0.0)
}

/// Bytes per token of one block of group `gi` that recompute drops and its
/// backward rematerialises: while a block runs its backward, its dropped
/// tensors are back beside every other block's kept ones.
fn rematerialised(
    spec: &ModelSpec,
    gi: usize,
    layout: &Layout,
    act_bytes: f64,
    tokens: f64,
) -> Vec<(Part, f64)> {
    let policy = &spec.groups[gi].policy;
    let keep = Policy {
        recompute: Vec::new(),
        ..policy.clone()
    };
    saved_tensors(spec, gi, layout, tokens)
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (all, _) = placed(t, &keep, i == 0, act_bytes);
            let (kept, _) = placed(t, policy, i == 0, act_bytes);
            (t.part, all - kept)
        })
        .collect()
}

/// Micro-batches of activations a pipeline rank holds at its peak under
/// Megatron's schedules: 1F1B holds `pp − stage`; the interleaved schedule
/// (`vpp > 1`) runs `2·(pp − stage − 1) + (vpp − 1)·pp` warm-up forwards of
/// one model chunk each plus one more, i.e. that many chunks over `vpp`
/// stages' worth; both capped by the micro-batches of a step. With the
/// expert all-to-all overlapped (`overlapped`), one more chunk: the extra
/// warm-up forward of `pipeline::turns`, or in a pair the forward's saved
/// tensors beside the backward's not yet freed (a bound: the backward
/// frees its blocks as the forward saves its own).
pub fn in_flight(layout: &Layout, stage: usize, micro_batches: usize, overlapped: bool) -> f64 {
    let (pp, vpp) = (layout.pp, layout.vpp);
    let extra = usize::from(overlapped);
    let chunks = if vpp == 1 {
        (pp - stage + extra) as f64
    } else {
        (2 * (pp - stage - 1) + (vpp - 1) * pp + 1 + extra) as f64 / vpp as f64
    };
    chunks.min(micro_batches as f64)
}

/// Ring volume a rank sends in an all-gather or reduce-scatter of `bytes`
/// over `n` ranks.
fn ring(bytes: f64, n: usize) -> f64 {
    bytes * (n - 1) as f64 / n as f64
}

/// Plans memory per GPU and communication per step for `opts.rank` of
/// `layout`, each block group under its own policy.
pub fn plan_memory(spec: &ModelSpec, layout: &Layout, opts: &MemoryOptions) -> MemoryPlan {
    let stage = layout.attention_coords(opts.rank).pp;
    let ranges = layout.pp_rank_layers(stage, spec.layers());
    // Group index of every block.
    let group_of: Vec<usize> = spec
        .groups
        .iter()
        .enumerate()
        .flat_map(|(i, g)| std::iter::repeat_n(i, g.count))
        .collect();
    let mut blocks = vec![0usize; spec.groups.len()];
    for r in &ranges {
        for l in r.clone() {
            blocks[group_of[l]] += 1;
        }
    }
    let (t, d) = (layout.tp as u64, spec.hidden as u64);
    let mut params = [0u64; 7];
    let mut expert_params = 0u64;
    // Routed-expert parameters of fp8 groups, whose weights a step of
    // several micro-batches keeps in fp8.
    let mut fp8_expert_params = 0u64;
    let (first, last) = (stage == 0, stage + 1 == layout.pp);
    // MTP modules live on the last stage, each with a block of the last
    // group (split as that group's are), counted with the blocks.
    let mtp = if last { spec.mtp_layers } else { 0 };
    if let Some(n) = blocks.last_mut() {
        *n += mtp;
    }
    let table = layout.padded_vocab as u64 / t * d;
    if first {
        params[0] += table;
    }
    if last {
        params[0] += d + if spec.tied_embeddings && first {
            0
        } else {
            table
        };
    }
    if mtp > 0 {
        // Each module's input norms and final norm, and its projection
        // `[2D, D]` (replicated over tp); the stage embeds the tokens ahead
        // with a copy of the table unless it holds it already (the first
        // stage's, or the tied head's).
        params[1] += mtp as u64 * 3 * d;
        params[0] += mtp as u64 * 2 * d * d;
        if !first && !spec.tied_embeddings {
            params[0] += table;
        }
    }
    for (g, &n) in spec.groups.iter().zip(&blocks) {
        let p = g.params(spec.hidden);
        let n = n as u64;
        let routed = n * p.routed_experts / (layout.ep * layout.etp) as u64;
        params[1] += n * p.norms;
        params[2] += n * p.attention / t;
        params[3] += n * p.dense_mlp / t;
        params[4] += n * p.router;
        params[5] += routed;
        params[6] += n * p.shared_experts / t;
        expert_params += routed;
        if g.policy.precision == GemmPrecision::Fp8Blockwise && matches!(g.ffn, FfnSpec::Moe(_)) {
            fp8_expert_params += routed;
        }
    }
    // Activations per micro-batch: tokens of the rank's cp shard.
    let tokens = (spec.seq_len * opts.micro_batch_size) as f64 / layout.cp as f64;
    let act_bytes = opts.activation_bytes;
    let mut act = [0f64; 7];
    let mut host = [0f64; 7];
    let part_index = |part: Part| Part::ALL.iter().position(|p| *p == part).unwrap_or(0);
    // Per group, per token of one block: the bytes kept on the device and
    // on the host by part, and those its recompute drops and its backward
    // rematerialises.
    let per_group: Vec<[[f64; 7]; 3]> = (0..spec.groups.len())
        .map(|gi| {
            let policy = &spec.groups[gi].policy;
            let mut g = [[0f64; 7]; 3];
            for (i, tensor) in saved_tensors(spec, gi, layout, tokens).iter().enumerate() {
                let (dev, off) = placed(tensor, policy, i == 0, act_bytes);
                g[0][part_index(tensor.part)] += dev;
                g[1][part_index(tensor.part)] += off;
            }
            for (part, b) in rematerialised(spec, gi, layout, act_bytes, tokens) {
                g[2][part_index(part)] += b;
            }
            g
        })
        .collect();
    for (gi, &n) in blocks.iter().enumerate() {
        for k in 0..7 {
            act[k] += n as f64 * tokens * per_group[gi][0][k];
            host[k] += n as f64 * tokens * per_group[gi][1][k];
        }
    }
    let sp = if layout.sequence_parallel { t } else { 1 } as f64;
    // An MTP module's own state: its two input norms' inputs, outputs (the
    // projection's inputs) and rstd.
    let mtp_own = act_bytes * (4.0 * d as f64 + 2.0) / sp;
    act[part_index(Part::Norms)] += mtp as f64 * tokens * mtp_own;
    // The final norm's input, rstd and output (the head's input), the
    // logits of the vocabulary-parallel cross-entropy and their fp32
    // log-sum-exp: one micro-batch's at a time (its loss backward follows
    // its forward and frees them before any block's backward), and as much
    // again for each MTP module's loss.
    let one_loss = if last {
        tokens
            * (act_bytes * ((2.0 * d as f64 + 1.0) / sp + layout.padded_vocab as f64 / t as f64)
                + 4.0)
    } else {
        0.0
    };
    let head = (1 + mtp) as f64 * one_loss;
    act[0] += head;
    // The peak beyond the blocks' in-flight tensors: the loss states at the
    // end of a forward, or a block's rematerialised tensors during its
    // backward, whichever is larger. A chunk's blocks run their backward
    // last first, each freeing what it kept, so block i's rerun sits beside
    // the chunk's earlier blocks only: its rematerialised bytes less what
    // the later blocks kept. The last chunk's MTP modules come after its
    // blocks; the backward runs the main loss's, then the modules' from the
    // last, each module's block right after its loss, so module k's block
    // runs beside the loss states of modules 0..k.
    let mut extra = [0f64; 7];
    extra[0] = head;
    for (ci, range) in ranges.iter().enumerate() {
        // (group, the MTP module's own state a token, loss states held) of
        // each block of the chunk, in forward order.
        let mut chain: Vec<(usize, f64, f64)> =
            range.clone().map(|l| (group_of[l], 0.0, 0.0)).collect();
        if ci + 1 == ranges.len() {
            let last_group = spec.groups.len() - 1;
            chain.extend((0..mtp).map(|k| (last_group, mtp_own, k as f64 * one_loss)));
        }
        let mut later = [0f64; 7];
        for &(gi, own, losses) in chain.iter().rev() {
            let mut candidate = [0f64; 7];
            for k in 0..7 {
                candidate[k] = tokens * (per_group[gi][2][k] - later[k]);
            }
            candidate[0] += losses;
            if candidate.iter().sum::<f64>() > extra.iter().sum::<f64>() {
                extra = candidate;
            }
            for k in 0..7 {
                later[k] += per_group[gi][0][k];
            }
            later[part_index(Part::Norms)] += own;
        }
    }
    let flight = in_flight(layout, stage, opts.micro_batches, opts.overlap_moe_comm);
    let dense_shard = (layout.dp * layout.cp) as u64;
    let parts: Vec<PartMemory> = Part::ALL
        .iter()
        .enumerate()
        .map(|(k, part)| {
            let shard = if *part == Part::RoutedExperts {
                layout.edp as u64
            } else {
                dense_shard
            };
            let wb = opts.weight_bytes;
            PartMemory {
                part: part.name(),
                params: params[k],
                weights: (wb * params[k] as f64).round() as u64,
                grads: (wb * params[k] as f64).round() as u64,
                optimizer: (12 * params[k]).div_ceil(shard),
                activations_per_micro_batch: act[k].round() as u64,
                activations: ((act[k] - if k == 0 { head } else { 0.0 }) * flight + extra[k])
                    .round() as u64,
                offloaded: (host[k] * flight).round() as u64,
            }
        })
        .collect();
    // Buffers: send and receive of the largest dispatch (tokens of the
    // sequence shard × top_k × hidden, bf16, gathered over etp) and of the
    // pipeline's activation send and receive.
    let shard_tokens = tokens / sp;
    let top_k = (0..spec.groups.len())
        .filter(|&gi| blocks[gi] > 0)
        .filter_map(|gi| match &spec.groups[gi].ffn {
            FfnSpec::Moe(m) => Some(m.top_k),
            FfnSpec::Dense { .. } => None,
        })
        .max()
        .unwrap_or(0);
    let dispatch = shard_tokens * (top_k * layout.etp) as f64 * 2.0 * d as f64;
    let p2p = if layout.pp > 1 {
        shard_tokens * 2.0 * d as f64
    } else {
        0.0
    };
    let comm_buffers = (2.0 * (dispatch + p2p)).round() as u64;
    let comm = comm_volumes(spec, layout, opts, &blocks, &params, expert_params);
    let dense_params = params.iter().sum::<u64>() - expert_params;
    let step_buffers =
        (2.0 * opts.weight_bytes * expert_params.max(dense_params) as f64).round() as u64;
    // The fp8 experts' weights kept for a step of several micro-batches:
    // two layouts of a byte a weight, an f32 scale a 128 × 128 block each.
    let fp8_weight_cache = if opts.micro_batches > 1 {
        (2.0 * fp8_expert_params as f64 * (1.0 + 4.0 / 16384.0)).round() as u64
    } else {
        0
    };
    let mut plan = MemoryPlan {
        rank: opts.rank,
        pp_stage: stage,
        layers: ranges.iter().map(|r| (r.start, r.end)).collect(),
        micro_batch_size: opts.micro_batch_size,
        seq_len: spec.seq_len,
        micro_batches: opts.micro_batches,
        in_flight: flight,
        parts,
        comm_buffers,
        step_buffers,
        fp8_weight_cache,
        total: 0,
        comm,
    };
    // Saturating: the sizes `plan` admits keep every figure exact, and no
    // input makes the planner panic.
    plan.total = plan
        .sum(|p| {
            p.weights
                .saturating_add(p.grads)
                .saturating_add(p.optimizer)
                .saturating_add(p.activations)
        })
        .saturating_add(comm_buffers)
        .saturating_add(step_buffers)
        .saturating_add(fp8_weight_cache);
    plan
}

/// Bytes each group carries per step from this rank (ring algorithms): tp
/// all-gathers and reduce-scatters activations 4 times forward and 4
/// backward per block (sequence parallel; the all-reduces without it carry
/// the same), except that MLA gathers its down projections' latents (`C +
/// L + R` a token; a full-rank query reads the gathered input) instead of
/// the attention's input and reduce-scatters their gradients; cp
/// all-gathers K/V forward and reduce-scatters their gradients backward
/// (MLA: its latent and rotary key, `L + R` a token, gathered forward and
/// again backward, their gradients reduce-scattered); ep exchanges top_k copies of each token 4 times per
/// MoE block (dispatch, combine, and both backward); pp sends activations
/// and receives gradients at each chunk boundary; dp·cp and edp
/// reduce-scatter bf16 gradients and all-gather bf16 weights once a step.
fn comm_volumes(
    spec: &ModelSpec,
    layout: &Layout,
    opts: &MemoryOptions,
    blocks: &[usize],
    params: &[u64; 7],
    expert_params: u64,
) -> Vec<CommVolume> {
    let m = opts.micro_batches as f64;
    let d = spec.hidden as f64;
    let tokens = (spec.seq_len * opts.micro_batch_size) as f64 / layout.cp as f64;
    let sp = if layout.sequence_parallel {
        layout.tp
    } else {
        1
    } as f64;
    let mut out = Vec::new();
    let mut push = |group, size: usize, bytes: f64, what| {
        if size > 1 && bytes > 0.0 {
            out.push(CommVolume {
                group,
                size,
                bytes_per_step: bytes.round() as u64,
                what,
            });
        }
    };
    // Elements a token each block moves over tp: the feed-forward's 4
    // hidden-wide passes, and the attention's (MLA: the output's reduce-
    // scatter and its gradient's gather, plus its latents both ways).
    let tp_width: f64 = spec
        .groups
        .iter()
        .zip(blocks)
        .map(|(g, &n)| {
            let attn = match &g.attention.mla {
                None => 4.0 * d,
                Some(ml) => {
                    let kva = (ml.kv_lora_rank + ml.qk_rope_head_dim) as f64;
                    if ml.q_lora_rank > 0 {
                        2.0 * d + 2.0 * (ml.q_lora_rank as f64 + kva)
                    } else {
                        4.0 * d + 2.0 * kva
                    }
                }
            };
            n as f64 * (4.0 * d + attn)
        })
        .sum();
    push(
        "tp",
        layout.tp,
        m * ring(tokens * 2.0 * tp_width, layout.tp),
        "activation all-gather / reduce-scatter, 8 per block (MLA: its latents)",
    );
    // Bytes a token each block moves over cp, all passes.
    let kv: f64 = spec
        .groups
        .iter()
        .zip(blocks)
        .map(|(g, &n)| {
            let a = &g.attention;
            let bytes = match &a.mla {
                None => 2.0 * 2.0 * (2 * a.kv_heads * a.head_dim) as f64 / layout.tp as f64,
                Some(ml) => 3.0 * 2.0 * (ml.kv_lora_rank + ml.qk_rope_head_dim) as f64,
            };
            n as f64 * bytes
        })
        .sum();
    push(
        "cp",
        layout.cp,
        m * (layout.cp - 1) as f64 * tokens * kv,
        "K/V all-gather forward, reduce-scatter backward (MLA: latents, gathered twice)",
    );
    let routed: f64 = spec
        .groups
        .iter()
        .zip(blocks)
        .filter_map(|(g, &n)| match &g.ffn {
            FfnSpec::Moe(mo) => Some(n as f64 * mo.top_k as f64),
            FfnSpec::Dense { .. } => None,
        })
        .sum();
    push(
        "ep",
        layout.ep,
        m * 4.0 * ring(tokens / sp * routed * 2.0 * d, layout.ep),
        "all-to-all-v of top_k token copies, 4 per MoE block",
    );
    push(
        "etp",
        layout.etp,
        m * 4.0
            * ring(
                tokens / sp * routed * 2.0 * d * layout.etp as f64,
                layout.etp,
            ),
        "all-gather / reduce-scatter of dispatched tokens, 4 per MoE block",
    );
    push(
        "pp",
        layout.pp,
        m * 2.0 * layout.vpp as f64 * tokens / sp * 2.0 * d,
        "activations forward, gradients backward, per model chunk",
    );
    let dense: u64 = params.iter().sum::<u64>() - expert_params;
    push(
        "dpcp",
        layout.dp * layout.cp,
        2.0 * ring(2.0 * dense as f64, layout.dp * layout.cp),
        "gradient reduce-scatter + weight all-gather (distributed optimizer)",
    );
    push(
        "edp",
        layout.edp,
        2.0 * ring(2.0 * expert_params as f64, layout.edp),
        "expert gradient reduce-scatter + weight all-gather",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{check, LayoutSpec};
    use crate::spec::{AttentionSpec, BlockGroup, MoeSpec, RouterSpec};

    /// V 100, D 8, S 16; one dense block (4 heads of 2, MHA; ffn 16) and two
    /// MoE blocks (4 experts, top-2, F 4, shared ffn 4, no gate).
    fn tiny() -> ModelSpec {
        let attn = AttentionSpec::gqa(4, 4, 2);
        let moe = MoeSpec {
            experts: 4,
            top_k: 2,
            expert_ffn: 4,
            shared_ffn: 4,
            shared_gate: false,
            router: RouterSpec::default(),
            capacity: None,
        };
        ModelSpec {
            name: "t".into(),
            vocab: 100,
            hidden: 8,
            seq_len: 16,
            norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: None,
            tied_embeddings: false,
            init_std: 0.02,
            groups: vec![
                BlockGroup::new(1, attn.clone(), FfnSpec::Dense { ffn: 16 }),
                BlockGroup::new(2, attn, FfnSpec::Moe(moe)),
            ],
            mtp_layers: 0,
            mtp_loss_coef: 0.1,
        }
    }

    fn plan(spec: &ModelSpec, layout: &str, rank: usize, mbs: usize) -> MemoryPlan {
        let l = check(&LayoutSpec::parse(layout).unwrap(), spec).unwrap();
        let opts = MemoryOptions::new(rank, mbs, 8);
        plan_memory(spec, &l, &opts)
    }

    fn part<'a>(p: &'a MemoryPlan, name: &str) -> &'a PartMemory {
        p.parts.iter().find(|x| x.part == name).unwrap()
    }

    /// A step of several micro-batches keeps the fp8 experts' weights in
    /// fp8, both layouts, and the total counts them; bf16 experts, or one
    /// micro-batch a step, keep none.
    #[test]
    fn fp8_experts_weights_are_kept_for_a_step_of_several_micro_batches() {
        let mut spec = tiny();
        let layout = check(&LayoutSpec::parse("world=2,ep=2").unwrap(), &spec).unwrap();
        let plan_of =
            |spec: &ModelSpec, m| plan_memory(spec, &layout, &MemoryOptions::new(0, 1, m));
        assert_eq!(plan_of(&spec, 8).fp8_weight_cache, 0);
        for g in &mut spec.groups {
            if matches!(g.ffn, FfnSpec::Moe(_)) {
                g.policy.precision = GemmPrecision::Fp8Blockwise;
            }
        }
        let p = plan_of(&spec, 8);
        // 384 routed weights on the rank (768 over ep 2), two layouts.
        let want = (2.0 * 384.0 * (1.0 + 4.0 / 16384.0_f64)).round() as u64;
        assert_eq!(p.fp8_weight_cache, want);
        let rest = p.sum(|x| x.weights + x.grads + x.optimizer + x.activations)
            + p.comm_buffers
            + p.step_buffers;
        assert_eq!(p.total, rest + want);
        assert_eq!(plan_of(&spec, 1).fp8_weight_cache, 0);
    }

    #[test]
    fn one_rank_holds_every_parameter_with_16_bytes_each() {
        let spec = tiny();
        let p = plan(&spec, "world=1", 0, 1);
        // Worked by hand: embedding + head 2·100·8 + final norm 8 = 1608;
        // norms 3·16 = 48; attention 3·4·8·8 = 768; dense 3·8·16 = 384;
        // router 2·8·4 = 64; experts 2·4·3·8·4 = 768; shared 2·3·8·4 = 192.
        let want = [1608, 48, 768, 384, 64, 768, 192];
        let got: Vec<u64> = p.parts.iter().map(|x| x.params).collect();
        assert_eq!(got, want);
        assert_eq!(got.iter().sum::<u64>(), spec.param_counts().0);
        for x in &p.parts {
            assert_eq!(x.weights + x.grads + x.optimizer, 16 * x.params);
        }
    }

    #[test]
    fn optimizer_state_shards_over_dp_and_experts_over_ep_and_edp() {
        let spec = tiny();
        // world 4: dp 4; ep 2 → edp 2.
        let p = plan(&spec, "world=4,ep=2", 0, 1);
        let att = part(&p, "attention");
        assert_eq!((att.params, att.optimizer), (768, 12 * 768 / 4));
        let e = part(&p, "routed_experts");
        assert_eq!(e.params, 768 / 2);
        assert_eq!(e.optimizer, 12 * 384 / 2);
        assert_eq!(e.grads, 2 * 384);
        // tp 2 halves attention and dense weights; norms and router stay.
        let p = plan(&spec, "world=2,tp=2", 0, 1);
        assert_eq!(part(&p, "attention").params, 384);
        assert_eq!(part(&p, "dense_mlp").params, 192);
        assert_eq!(part(&p, "norms").params, 48);
        assert_eq!(part(&p, "router").params, 64);
    }

    #[test]
    fn a_pipeline_stage_holds_its_layers_and_the_ends_hold_embedding_and_head() {
        let spec = tiny();
        // 3 blocks over pp 3: block 0 (dense) on stage 0, block 2 on stage 2.
        let first = plan(&spec, "world=3,pp=3", 0, 1);
        assert_eq!(first.layers, vec![(0, 1)]);
        assert_eq!(part(&first, "embedding_head").params, 800);
        assert_eq!(part(&first, "dense_mlp").params, 384);
        assert_eq!(part(&first, "routed_experts").params, 0);
        let last = plan(&spec, "world=3,pp=3", 2, 1);
        assert_eq!(part(&last, "embedding_head").params, 808);
        assert_eq!(part(&last, "routed_experts").params, 384);
        // 1F1B: stage 0 holds pp = 3 micro-batches, the last one.
        assert_eq!((first.in_flight, last.in_flight), (3.0, 1.0));
        let a = part(&first, "attention");
        assert_eq!(a.activations, 3 * a.activations_per_micro_batch);
    }

    #[test]
    fn dp_and_edp_reduce_scatter_and_all_gather_their_bf16_parameters() {
        let p = plan(&tiny(), "world=4", 0, 1);
        // dp 4 = edp 4: 2 collectives × 3/4 × 2 B × params (3064 dense, 768 routed).
        let by = |g: &str| p.comm.iter().find(|c| c.group == g).unwrap().bytes_per_step;
        assert_eq!(by("dpcp"), 9192);
        assert_eq!(by("edp"), 2304);
        assert!(p.comm.iter().all(|c| c.group != "tp" && c.group != "ep"));
    }

    #[test]
    fn interleaved_stages_hold_their_warm_up_chunks_plus_one() {
        let mut spec = tiny();
        spec.groups[1].count = 3; // 4 blocks over pp 2 · vpp 2
        let l = check(&LayoutSpec::parse("world=2,pp=2,vpp=2").unwrap(), &spec).unwrap();
        // Stage 0: (2·1 + 1·2 + 1) / 2 = 2.5; stage 1: (0 + 2 + 1) / 2 = 1.5.
        assert_eq!(in_flight(&l, 0, 8, false), 2.5);
        assert_eq!(in_flight(&l, 1, 8, false), 1.5);
        assert_eq!(in_flight(&l, 1, 8, true), 2.0);
        // Fewer micro-batches than the warm-up cap it.
        assert_eq!(in_flight(&l, 0, 2, false), 2.0);
    }

    #[test]
    fn activations_by_hand_scale_with_seq_and_halve_with_tp() {
        let spec = tiny();
        let p = plan(&spec, "world=1", 0, 1);
        // Per token per block: norms 4·2·8 + two rstd (in the activation
        // dtype, as the engine keeps them) 2·2 = 68 B; attention qkv 2·24 +
        // fp32 lse 4·4 + output 2·8 = 80 B; over 16 tokens and 3 blocks.
        assert_eq!(part(&p, "norms").activations_per_micro_batch, 16 * 3 * 68);
        assert_eq!(
            part(&p, "attention").activations_per_micro_batch,
            16 * 3 * 80
        );
        // Routed: 2 rows × (fc1 4·4 + act 2·4 + routing weight 2 + two int32
        // indices 8) = 68 B per token, 2 blocks; the experts' input rows
        // are gathered from the norm output, so they add nothing.
        assert_eq!(
            part(&p, "routed_experts").activations_per_micro_batch,
            16 * 2 * 68
        );
        // Twice the sequences, twice the bytes.
        let p2 = plan(&spec, "world=1", 0, 2);
        for (a, b) in p.parts.iter().zip(&p2.parts) {
            assert_eq!(
                b.activations_per_micro_batch,
                2 * a.activations_per_micro_batch
            );
        }
        // tp 2 (sequence parallel with MoE): norms and attention halve.
        let t = plan(&spec, "world=2,tp=2", 0, 1);
        for name in ["norms", "attention", "dense_mlp", "routed_experts"] {
            assert_eq!(
                2 * part(&t, name).activations_per_micro_batch,
                part(&p, name).activations_per_micro_batch,
                "{name}"
            );
        }
    }

    #[test]
    fn recompute_removes_a_part_and_offload_moves_it_to_the_host() {
        let mut spec = tiny();
        let keep = plan(&spec, "world=1", 0, 1);
        for g in &mut spec.groups {
            g.policy.recompute = vec![RecomputePart::MoeAct, RecomputePart::Router];
            g.policy.offload = vec![OffloadPart::Qkv];
        }
        let p = plan(&spec, "world=1", 0, 1);
        // The router keeps only its int32 choices (2 per token, 2 blocks).
        assert_eq!(
            part(&p, "router").activations_per_micro_batch,
            16 * 2 * 2 * 4
        );
        // moe_act: 2 rows × 2·4 B per token over 2 blocks.
        let mb = |p: &MemoryPlan, name| part(p, name).activations_per_micro_batch;
        assert_eq!(
            mb(&keep, "routed_experts") - mb(&p, "routed_experts"),
            16 * 2 * 2 * 8
        );
        // The last stage's peak adds the loss's state (larger here than a
        // block's dropped tensors): the blocks' parts hold what they keep.
        assert_eq!(
            part(&p, "routed_experts").activations,
            mb(&p, "routed_experts")
        );
        // A middle stage has no loss state: while a block runs its backward,
        // one block's dropped tensors are back beside the in-flight ones.
        let middle = plan(&spec, "world=3,pp=3", 1, 1);
        let flight = middle.in_flight.round() as u64;
        assert_eq!(
            part(&middle, "routed_experts").activations - flight * mb(&middle, "routed_experts"),
            16 * 2 * 8
        );
        // qkv (48 B per token per block) moves to the host.
        assert_eq!(part(&p, "attention").offloaded, 16 * 3 * 48);
        assert_eq!(
            part(&keep, "attention").activations - part(&p, "attention").activations,
            16 * 3 * 48
        );
        // `block` keeps only each block's input.
        for g in &mut spec.groups {
            g.policy.recompute = vec![RecomputePart::Block];
            g.policy.offload.clear();
        }
        let p = plan(&spec, "world=1", 0, 1);
        let device: u64 = p
            .parts
            .iter()
            .skip(1)
            .map(|x| x.activations_per_micro_batch)
            .sum();
        assert_eq!(device, 16 * 3 * 16);
    }
}
