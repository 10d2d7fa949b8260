//! The model IR: what a model is, independent of how it is laid out or run.
//!
//! Both front ends (the `#[moe_model]` macro and config files) produce a
//! [`ModelSpec`]; [`ModelSpec::check`] holds the model rules (docs/ARCHITECTURE.md §3,
//! routing) once, returning every violation with its values and a fix.

use serde::{Deserialize, Serialize};

/// A whole model: global dims and the groups of identical blocks, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Model name (`tiny`, `deepseek-v3`, ...).
    pub name: String,
    /// Vocabulary size V.
    pub vocab: usize,
    /// Hidden size D.
    pub hidden: usize,
    /// Training sequence length S.
    pub seq_len: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Context extension of the rotary embedding (YaRN), if any: the
    /// `rope_scaling` of a Hugging Face config (docs/ARCHITECTURE.md §4).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the LM head reuses the embedding table.
    pub tied_embeddings: bool,
    /// Standard deviation of the normal initialisation of weights.
    pub init_std: f64,
    /// Block groups, first to last.
    pub groups: Vec<BlockGroup>,
    /// Multi-token-prediction modules after the last block (DeepSeek-V3: 1):
    /// module k predicts the token k + 1 places ahead (docs/ARCHITECTURE.md §4).
    #[serde(default)]
    pub mtp_layers: usize,
    /// Weight λ of the MTP loss: the step's loss adds `λ/D · Σ_k CE_k` over
    /// the D modules (Megatron-Core's `--mtp-loss-scaling-factor`, 0.1).
    #[serde(default = "default_mtp_loss_coef")]
    pub mtp_loss_coef: f64,
}

fn default_mtp_loss_coef() -> f64 {
    keywords::DEFAULT_MTP_LOSS_COEF
}

/// A rotary-embedding scaling method (`rope_scaling`'s `rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeScalingType {
    /// YaRN (Peng et al. 2023): the frequency ramp between the original and
    /// interpolated frequencies, and the attention (magnitude) factor.
    Yarn,
}

/// YaRN scaling of the rotary embedding, in the published `rope_scaling`
/// fields (DeepSeek-V3's: `factor = 40`, `original_max_position_embeddings =
/// 4096`, `beta_fast = 32`, `beta_slow = 1`, `mscale = mscale_all_dim = 1`).
///
/// The rotary frequencies blend the original and the `factor`-interpolated
/// ones along a ramp between the dims that turn `beta_fast` and `beta_slow`
/// times over `original_max_position_embeddings`; cos and sin are scaled by
/// `m(factor, mscale) / m(factor, mscale_all_dim)` when both are given
/// (else `m(factor, 1)`), `m(s, k) = 0.1·k·ln s + 1`. MLA attention also
/// multiplies its softmax scale by `m(factor, mscale_all_dim)²`, as
/// DeepSeek-V3 does (GQA models do not: transformers' Mixtral and Qwen3-MoE).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// The method (only YaRN).
    #[serde(rename = "rope_type")]
    pub kind: RopeScalingType,
    /// The context stretch s ≥ 1.
    pub factor: f64,
    /// The context length the model was pretrained at.
    pub original_max_position_embeddings: usize,
    /// Rotations over the original context below which a dim is
    /// interpolated fully (ramp end; default 32).
    pub beta_fast: f64,
    /// Rotations above which a dim keeps its frequency (ramp start;
    /// default 1; below `beta_fast`).
    pub beta_slow: f64,
    /// The numerator's k of the attention factor.
    #[serde(default)]
    pub mscale: Option<f64>,
    /// The denominator's k of the attention factor, and MLA's softmax
    /// correction.
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
}

impl RopeScaling {
    /// YaRN with the published defaults `beta_fast = 32`, `beta_slow = 1`
    /// and no `mscale`s.
    pub fn yarn(factor: f64, original_max_position_embeddings: usize) -> Self {
        RopeScaling {
            kind: RopeScalingType::Yarn,
            factor,
            original_max_position_embeddings,
            beta_fast: keywords::DEFAULT_YARN_BETA_FAST,
            beta_slow: keywords::DEFAULT_YARN_BETA_SLOW,
            mscale: None,
            mscale_all_dim: None,
        }
    }

    /// YaRN's magnitude correction `0.1·k·ln s + 1` of the stretch s =
    /// `factor` (1 when s ≤ 1).
    pub fn mscale_of(&self, k: f64) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * k * self.factor.ln() + 1.0
        }
    }

    /// The factor on MLA's softmax scale: `m(factor, mscale_all_dim)²`
    /// (1 without `mscale_all_dim`).
    pub fn softmax_scale_factor(&self) -> f64 {
        let m = self.mscale_of(self.mscale_all_dim.unwrap_or(0.0));
        m * m
    }
}

/// `count` identical transformer blocks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockGroup {
    /// Number of blocks in the group.
    pub count: usize,
    /// The attention of every block.
    pub attention: AttentionSpec,
    /// The feed-forward part of every block.
    pub ffn: FfnSpec,
    /// Recompute, offload and precision choices of the group (docs/ARCHITECTURE.md §5–§6).
    #[serde(default)]
    pub policy: Policy,
}

impl BlockGroup {
    /// `count` blocks with the default policy (keep everything, bf16 GEMMs).
    pub fn new(count: usize, attention: AttentionSpec, ffn: FfnSpec) -> Self {
        BlockGroup {
            count,
            attention,
            ffn,
            policy: Policy::default(),
        }
    }

    /// Parameters of one block of the group, by part, for hidden size
    /// `hidden`: the one count that [`ModelSpec::param_counts`] and the memory
    /// planner both use. Each SwiGLU MLP is `3·D·F`.
    pub fn params(&self, hidden: usize) -> BlockParams {
        let d = hidden as u64;
        let a = &self.attention;
        let h = a.heads as u64;
        let (attention, latent_norms) = match &a.mla {
            // q/k norms are counted with the norms (replicated, 1-d).
            None => (
                d * h * a.head_dim as u64 * 2 + 2 * d * a.kv_heads as u64 * a.head_dim as u64,
                if a.qk_norm { 2 * a.head_dim as u64 } else { 0 },
            ),
            Some(m) => {
                let qk = (m.qk_nope_head_dim + m.qk_rope_head_dim) as u64;
                let (ql, kvl) = (m.q_lora_rank as u64, m.kv_lora_rank as u64);
                let q = if ql == 0 {
                    d * h * qk
                } else {
                    d * ql + ql * h * qk
                };
                let kv = d * (kvl + m.qk_rope_head_dim as u64)
                    + kvl * h * (m.qk_nope_head_dim + m.v_head_dim) as u64;
                (q + kv + h * m.v_head_dim as u64 * d, ql + kvl)
            }
        };
        let mut p = BlockParams {
            norms: 2 * d + latent_norms,
            attention,
            ..BlockParams::default()
        };
        match &self.ffn {
            FfnSpec::Dense { ffn } => p.dense_mlp = 3 * d * *ffn as u64,
            FfnSpec::Moe(m) => {
                // The expert bias is a buffer updated from loads, not a
                // trained parameter: not counted (nor by the engine).
                let gate = if m.shared_gate && m.shared_ffn > 0 {
                    d
                } else {
                    0
                };
                let expert = 3 * d * m.expert_ffn as u64;
                p.router = d * m.experts as u64;
                p.shared_experts = 3 * d * m.shared_ffn as u64 + gate;
                p.routed_experts = m.experts as u64 * expert;
                p.routed_active = m.top_k as u64 * expert;
            }
        }
        p
    }
}

/// Parameters of one block by part (see [`BlockGroup::params`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockParams {
    /// The two block norms, and MLA's latent norms.
    pub norms: u64,
    /// Attention projections (GQA or MLA), norms excluded.
    pub attention: u64,
    /// The dense MLP (0 in an MoE block).
    pub dense_mlp: u64,
    /// The router's `D×E` weight.
    pub router: u64,
    /// All routed experts.
    pub routed_experts: u64,
    /// The routed experts one token visits (`top_k` of them).
    pub routed_active: u64,
    /// Shared experts and their gate.
    pub shared_experts: u64,
}

/// Multi-head / grouped-query attention dims (MHA when `kv_heads == heads`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Dimension of one head (for MLA: the value head dim is in `mla`).
    pub head_dim: usize,
    /// Multi-head latent attention (DeepSeek-V2/V3) instead of GQA.
    #[serde(default)]
    pub mla: Option<MlaSpec>,
    /// RMSNorm of every query and key head over its `head_dim` before the
    /// rotary embedding, one `[head_dim]` scale for queries and one for keys
    /// shared by all heads (Qwen3's `q_norm`/`k_norm`). GQA only.
    #[serde(default)]
    pub qk_norm: bool,
    /// Number format of the attention's linear layers (its projections; the
    /// attention core stays in the model's dtype): `fp8_blockwise` runs them
    /// as blockwise fp8 GEMMs, DeepSeek-V3's recipe.
    #[serde(default)]
    pub precision: GemmPrecision,
}

impl AttentionSpec {
    /// Grouped-query attention (multi-head when `kv_heads == heads`).
    pub fn gqa(heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        AttentionSpec {
            heads,
            kv_heads,
            head_dim,
            mla: None,
            qk_norm: false,
            precision: GemmPrecision::Bf16,
        }
    }
}

/// Multi-head latent attention dims: queries and keys/values pass through
/// low-rank latents; each head's query/key is a no-position part plus a
/// rotary part shared by all heads on the key side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaSpec {
    /// Rank of the query latent (0: full-rank query projection).
    pub q_lora_rank: usize,
    /// Rank of the key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without rotary embedding.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dims with rotary embedding.
    pub qk_rope_head_dim: usize,
    /// Per-head value dim.
    pub v_head_dim: usize,
}

/// Saved-activation parts that may be dropped after forward and recomputed
/// in backward (docs/ARCHITECTURE.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RecomputePart {
    /// The RMSNorms.
    Norm,
    /// The attention core (softmax(QKᵀ)V).
    CoreAttn,
    /// The dense MLP's activation.
    MlpAct,
    /// The experts' activation.
    MoeAct,
    /// The router.
    Router,
    /// The shared experts.
    SharedExperts,
    /// MLA's up-projections.
    MlaUpProj,
    /// The whole block.
    Block,
}

/// Saved activations that may be moved to host memory between forward and
/// backward (docs/ARCHITECTURE.md §5); also the parts that may be stored in fp8.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OffloadPart {
    /// Input of the attention norm.
    AttnNorm,
    /// Query/key/value projections.
    Qkv,
    /// Attention core output.
    CoreAttn,
    /// Attention output projection input.
    AttnProj,
    /// Input of the MLP norm.
    MlpNorm,
    /// The experts' first projection output.
    ExpertFc1,
    /// The experts' activation.
    MoeAct,
}

/// Number format of the GEMMs of a group (docs/ARCHITECTURE.md §6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GemmPrecision {
    /// fp32 GEMMs (the CPU reference).
    F32,
    /// bf16 inputs, fp32 accumulation.
    #[default]
    Bf16,
    /// fp8 (e4m3) with one scale per tensor.
    Fp8Tensorwise,
    /// fp8 with 1×128 activation and 128×128 weight block scales.
    Fp8Blockwise,
}

impl GemmPrecision {
    /// Whether the GEMMs run in fp8 (either scaling), which constrains dims.
    pub fn is_fp8(self) -> bool {
        matches!(
            self,
            GemmPrecision::Fp8Tensorwise | GemmPrecision::Fp8Blockwise
        )
    }
}

/// Keyword spelling of every policy value, in one place: used by the macro,
/// config files and error messages.
///
/// The key tables (`MODEL_KEYS`, `MOE_KEYS`, ...) are the words of both front
/// ends: `#[moe_model(...)]` and model config files accept exactly these
/// keys. Each pairs a key with the IR path, relative to its section, that the
/// rules blame (`z_loss` → `router.z_loss_coef`), so each front end can point
/// a rule's error back at the key the user wrote.
pub mod keywords {
    use super::{
        DropPolicySpec, GemmPrecision, LoadBalance, OffloadPart, RecomputePart, RopeScalingType,
        RouterDtype, ScoreFunction,
    };

    /// Keys of the model (`#[moe_model(...)]`, a config file's top level).
    pub const MODEL_KEYS: &[(&str, &str)] = &[
        ("name", "name"),
        ("vocab", "vocab"),
        ("hidden", "hidden"),
        ("seq_len", "seq_len"),
        ("norm_eps", "norm_eps"),
        ("rope_theta", "rope_theta"),
        ("rope_scaling", "rope_scaling"),
        ("tied_embeddings", "tied_embeddings"),
        ("init_std", "init_std"),
        ("mtp_layers", "mtp_layers"),
        ("mtp_loss_coef", "mtp_loss_coef"),
        ("layout", "layout"),
    ];
    /// Keys of one named layout (`layout(...)`, `[[layout]]`).
    pub const LAYOUT_KEYS: &[(&str, &str)] = &[
        ("name", "name"),
        ("world", "world"),
        ("tp", "tp"),
        ("cp", "cp"),
        ("dp", "dp"),
        ("pp", "pp"),
        ("vpp", "vpp"),
        ("ep", "ep"),
        ("etp", "etp"),
        ("edp", "edp"),
        ("order", "order"),
        ("pp_layers", "pp_layers"),
    ];
    /// Keys of one group of blocks (`#[blocks(...)]`, `[[blocks]]`).
    pub const GROUP_KEYS: &[(&str, &str)] = &[
        ("count", "count"),
        ("attention", "attention"),
        ("dense", "dense"),
        ("moe", "moe"),
        ("recompute", "policy.recompute"),
        ("offload", "policy.offload"),
        ("store_fp8", "policy.store_fp8"),
        ("precision", "policy.precision"),
    ];
    /// Keys of `attention`.
    pub const ATTENTION_KEYS: &[(&str, &str)] = &[
        ("heads", "heads"),
        ("kv_heads", "kv_heads"),
        ("head_dim", "head_dim"),
        ("mla", "mla"),
        ("qk_norm", "qk_norm"),
        ("precision", "precision"),
    ];
    /// Keys of `mla`.
    pub const MLA_KEYS: &[(&str, &str)] = &[
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("qk_nope_head_dim", "qk_nope_head_dim"),
        ("qk_rope_head_dim", "qk_rope_head_dim"),
        ("v_head_dim", "v_head_dim"),
    ];
    /// Keys of `dense`.
    pub const DENSE_KEYS: &[(&str, &str)] = &[("ffn", "ffn")];
    /// Keys of `moe`; router settings are written flat, as in a model card.
    pub const MOE_KEYS: &[(&str, &str)] = &[
        ("experts", "experts"),
        ("top_k", "top_k"),
        ("expert_ffn", "expert_ffn"),
        ("shared_experts", "shared_ffn"),
        ("shared_ffn", "shared_ffn"),
        ("shared_gate", "shared_gate"),
        ("score", "router.score"),
        ("pre_softmax", "router.pre_softmax"),
        ("scaling_factor", "router.scaling_factor"),
        ("groups", "router.groups"),
        ("group_top_k", "router.group_top_k"),
        ("expert_bias", "router.expert_bias"),
        ("load_balance", "router.load_balance"),
        ("aux_coef", "router.aux_coef"),
        ("z_loss", "router.z_loss_coef"),
        ("router_dtype", "router.dtype"),
        ("capacity", "capacity"),
    ];
    /// Keys of `rope_scaling` (Hugging Face's names).
    pub const ROPE_SCALING_KEYS: &[(&str, &str)] = &[
        ("rope_type", "rope_type"),
        ("factor", "factor"),
        (
            "original_max_position_embeddings",
            "original_max_position_embeddings",
        ),
        ("beta_fast", "beta_fast"),
        ("beta_slow", "beta_slow"),
        ("mscale", "mscale"),
        ("mscale_all_dim", "mscale_all_dim"),
    ];
    /// Values of `rope_scaling`'s `rope_type` (transformers 5's key; older
    /// Hugging Face configs also spell it `type`, which the macro cannot,
    /// `type` being a Rust keyword).
    pub const ROPE_SCALING_TYPE: &[(&str, RopeScalingType)] = &[("yarn", RopeScalingType::Yarn)];
    /// Default `beta_fast` of YaRN.
    pub const DEFAULT_YARN_BETA_FAST: f64 = 32.0;
    /// Default `beta_slow` of YaRN.
    pub const DEFAULT_YARN_BETA_SLOW: f64 = 1.0;
    /// Keys of `capacity`.
    pub const CAPACITY_KEYS: &[(&str, &str)] = &[
        ("factor", "factor"),
        ("drop", "drop_policy"),
        ("pad", "pad_to_capacity"),
    ];

    /// Values of `score`.
    pub const SCORE: &[(&str, ScoreFunction)] = &[
        ("softmax", ScoreFunction::Softmax),
        ("sigmoid", ScoreFunction::Sigmoid),
    ];
    /// Values of `router_dtype`.
    pub const ROUTER_DTYPE: &[(&str, RouterDtype)] =
        &[("model", RouterDtype::Model), ("fp32", RouterDtype::Fp32)];
    /// Values of `load_balance`.
    pub const LOAD_BALANCE: &[(&str, LoadBalance)] = &[
        ("none", LoadBalance::None),
        ("aux", LoadBalance::Aux),
        ("seq_aux", LoadBalance::SeqAux),
        ("global_aux", LoadBalance::GlobalAux),
    ];
    /// Values of `capacity`'s `drop`; the first is the default.
    pub const DROP: &[(&str, DropPolicySpec)] = &[
        ("probs", DropPolicySpec::Probs),
        ("position", DropPolicySpec::Position),
    ];

    /// Defaults of the optional model keys, shared by both front ends.
    pub const DEFAULT_NORM_EPS: f64 = 1e-5;
    /// Default RoPE base.
    pub const DEFAULT_ROPE_THETA: f64 = 10000.0;
    /// Default standard deviation of the weight initialisation.
    pub const DEFAULT_INIT_STD: f64 = 0.02;
    /// Default weight of the multi-token-prediction loss (Megatron-Core's).
    pub const DEFAULT_MTP_LOSS_COEF: f64 = 0.1;

    /// `(keyword, part)` of every recompute part.
    pub const RECOMPUTE: &[(&str, RecomputePart)] = &[
        ("norm", RecomputePart::Norm),
        ("core_attn", RecomputePart::CoreAttn),
        ("mlp_act", RecomputePart::MlpAct),
        ("moe_act", RecomputePart::MoeAct),
        ("router", RecomputePart::Router),
        ("shared_experts", RecomputePart::SharedExperts),
        ("mla_up_proj", RecomputePart::MlaUpProj),
        ("block", RecomputePart::Block),
    ];
    /// `(keyword, part)` of every offload (and fp8-storage) part.
    pub const OFFLOAD: &[(&str, OffloadPart)] = &[
        ("attn_norm", OffloadPart::AttnNorm),
        ("qkv", OffloadPart::Qkv),
        ("core_attn", OffloadPart::CoreAttn),
        ("attn_proj", OffloadPart::AttnProj),
        ("mlp_norm", OffloadPart::MlpNorm),
        ("expert_fc1", OffloadPart::ExpertFc1),
        ("moe_act", OffloadPart::MoeAct),
    ];
    /// `(keyword, precision)` of every GEMM precision.
    pub const PRECISION: &[(&str, GemmPrecision)] = &[
        ("fp32", GemmPrecision::F32),
        ("bf16", GemmPrecision::Bf16),
        ("fp8", GemmPrecision::Fp8Tensorwise),
        ("fp8_blockwise", GemmPrecision::Fp8Blockwise),
    ];

    /// The keyword of `value` in `table`.
    pub fn name_of<T: Copy + PartialEq>(table: &[(&'static str, T)], value: T) -> &'static str {
        table
            .iter()
            .find(|(_, v)| *v == value)
            .map_or("?", |(k, _)| k)
    }

    /// The known name a misspelt `word` most likely meant, for "did you mean"
    /// hints: the nearest by edit distance (at most 2), else the name `word`
    /// extends with a suffix (`hidden_size` → `hidden`), as model cards and
    /// Hugging Face configs often spell keys.
    pub fn suggest<'a>(word: &str, names: &[&'a str]) -> Option<&'a str> {
        names
            .iter()
            .map(|n| (edit_distance(word, n), *n))
            .filter(|(d, _)| *d <= 2)
            .min_by_key(|(d, _)| *d)
            .map(|(_, n)| n)
            .or_else(|| {
                names
                    .iter()
                    .filter(|n| word.len() > n.len() && word.starts_with(**n))
                    .max_by_key(|n| n.len())
                    .copied()
            })
    }

    /// Levenshtein distance between `a` and `b`, in characters.
    fn edit_distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut prev: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut cur = vec![i + 1];
            for (j, cb) in b.iter().enumerate() {
                let sub = prev[j] + usize::from(ca != *cb);
                cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
            }
            prev = cur;
        }
        prev[b.len()]
    }

    /// The values of a comma-separated `list` (`norm, moe_act`; empty or
    /// `none` for no part), each looked up in `table`: the one parser of the
    /// `--recompute`, `--offload` and `--store-fp8` flags.
    pub fn parse_list<T: Copy>(
        table: &[(&str, T)],
        what: &str,
        list: &str,
    ) -> Result<Vec<T>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|w| !w.is_empty() && *w != "none")
            .map(|w| lookup(table, what, w))
            .collect()
    }

    /// The value spelled `word` in `table`, or an error listing the choices.
    pub fn lookup<T: Copy>(table: &[(&str, T)], what: &str, word: &str) -> Result<T, String> {
        table
            .iter()
            .find(|(k, _)| *k == word)
            .map(|&(_, v)| v)
            .ok_or_else(|| {
                let names: Vec<&str> = table.iter().map(|(k, _)| *k).collect();
                format!(
                    "unknown {what} `{word}`; choose one of {}",
                    names.join(", ")
                )
            })
    }
}

/// What a block group keeps, recomputes, offloads or compresses, and its GEMM precision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    /// Parts recomputed in backward.
    pub recompute: Vec<RecomputePart>,
    /// Parts offloaded to host memory.
    pub offload: Vec<OffloadPart>,
    /// Parts stored in fp8 between forward and backward.
    pub store_fp8: Vec<OffloadPart>,
    /// GEMM precision.
    pub precision: GemmPrecision,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            recompute: Vec::new(),
            offload: Vec::new(),
            store_fp8: Vec::new(),
            precision: GemmPrecision::Bf16,
        }
    }
}

/// The feed-forward part of a block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FfnSpec {
    /// A dense SwiGLU MLP with hidden size `ffn`.
    Dense {
        /// Intermediate size.
        ffn: usize,
    },
    /// A Mixture-of-Experts layer.
    Moe(MoeSpec),
}

/// An MoE layer: routed experts, optional shared experts, router, dispatcher.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// Routed experts E.
    pub experts: usize,
    /// Experts per token K.
    pub top_k: usize,
    /// Intermediate size F of each routed expert.
    pub expert_ffn: usize,
    /// Intermediate size of the shared expert MLP (0: none). Megatron sizes it
    /// as `shared_experts × expert_ffn`.
    pub shared_ffn: usize,
    /// Whether the shared experts' output is scaled by `sigmoid(x · w_gate)`.
    pub shared_gate: bool,
    /// Router configuration.
    pub router: RouterSpec,
    /// Capacity mode (`None`: dropless).
    pub capacity: Option<CapacitySpec>,
}

/// How router scores are formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScoreFunction {
    /// Softmax scores.
    Softmax,
    /// Sigmoid scores (chosen ones renormalised to sum to 1).
    Sigmoid,
}

/// The number format the router computes in (Megatron-Core's
/// `--moe-router-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RouterDtype {
    /// The model's dtype.
    #[default]
    Model,
    /// f32: the logits' product, scores, top-k and the routing losses of a
    /// bf16 model in f32 (DeepSeek-V3's gating, as its Hugging Face code
    /// computes it).
    Fp32,
}

/// Load-balancing loss kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadBalance {
    /// No load-balancing loss.
    None,
    /// `coef·E·Σ f_e P_e` over the micro-batch.
    Aux,
    /// The same per sequence, averaged over sequences.
    SeqAux,
    /// The same with `f_e` from the loads of every tp, cp and dp rank's
    /// micro-batch, averaged over the step's micro-batches so far
    /// (Megatron-Core's global-batch loss); `P_e` stays the rank's.
    GlobalAux,
}

impl LoadBalance {
    /// Whether a capacity factor may be combined with this kind. Megatron-Core
    /// allows capacity only with `aux`, `seq_aux`, `global_aux` or no loss
    /// (not with Sinkhorn balancing); every kind foldmoe has is among them,
    /// and the match is exhaustive so that a new kind must decide.
    pub fn allows_capacity(self) -> bool {
        match self {
            LoadBalance::None | LoadBalance::Aux | LoadBalance::SeqAux | LoadBalance::GlobalAux => {
                true
            }
        }
    }
}

/// Router configuration (docs/ARCHITECTURE.md §4, Route).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterSpec {
    /// Score function.
    pub score: ScoreFunction,
    /// Softmax over all experts before top-k (no renormalisation); only with softmax.
    pub pre_softmax: bool,
    /// Multiplier of the routing weights.
    pub scaling_factor: f64,
    /// Expert groups for group-limited routing (1: off).
    pub groups: usize,
    /// Groups kept per token in group-limited routing.
    pub group_top_k: usize,
    /// Update rate of the aux-loss-free expert bias (`None`: no bias).
    pub expert_bias_rate: Option<f64>,
    /// Load-balancing loss kind.
    pub load_balance: LoadBalance,
    /// Coefficient of the load-balancing loss.
    pub aux_coef: f64,
    /// Coefficient of the z-loss (0: off).
    pub z_loss_coef: f64,
    /// The number format the router computes in.
    #[serde(default)]
    pub dtype: RouterDtype,
}

impl Default for RouterSpec {
    fn default() -> Self {
        RouterSpec {
            score: ScoreFunction::Softmax,
            pre_softmax: false,
            scaling_factor: 1.0,
            groups: 1,
            group_top_k: 1,
            expert_bias_rate: None,
            load_balance: LoadBalance::Aux,
            aux_coef: 1e-2,
            z_loss_coef: 0.0,
            dtype: RouterDtype::Model,
        }
    }
}

/// Token-drop policy in capacity mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DropPolicySpec {
    /// Drop the lowest-probability copies.
    Probs,
    /// Drop the latest tokens.
    Position,
}

/// Capacity mode of the dispatcher.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapacitySpec {
    /// `capacity = ceil(T·K/E · factor)`.
    pub factor: f64,
    /// Which copies an over-full expert drops.
    pub drop_policy: DropPolicySpec,
    /// Pad every expert to exactly `capacity` rows.
    pub pad_to_capacity: bool,
}

impl CapacitySpec {
    /// Rows each expert may hold for `tokens` tokens.
    pub fn capacity(&self, tokens: usize, top_k: usize, experts: usize) -> usize {
        ((tokens * top_k) as f64 / experts as f64 * self.factor).ceil() as usize
    }
}

/// One violated model rule, with the values and a fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct SpecError {
    /// Where in the spec (`groups[1].moe.top_k`).
    pub path: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

/// The largest vocabulary, hidden size and sequence length a spec may have
/// (2^24: beyond every published model, and small enough that parameter
/// and byte counts stay exact in u64).
pub const MAX_DIM: usize = 1 << 24;

impl ModelSpec {
    /// Total number of blocks.
    pub fn layers(&self) -> usize {
        self.groups.iter().map(|g| g.count).sum()
    }

    /// The model cut to its first `n` blocks (in declaration order, the
    /// groups shortened or dropped as needed), without MTP modules; the
    /// rest of the spec is unchanged. `n` must be in `1..=self.layers()`;
    /// the error says so, naming the model and its block count.
    pub fn first_layers(&self, n: usize) -> Result<ModelSpec, String> {
        let total = self.layers();
        if n == 0 || n > total {
            return Err(format!(
                "{} has {total} blocks; keep between 1 and {total}",
                self.name
            ));
        }
        let mut spec = self.clone();
        let mut left = n;
        spec.groups.retain_mut(|g| {
            g.count = g.count.min(left);
            left -= g.count;
            g.count > 0
        });
        spec.mtp_layers = 0;
        Ok(spec)
    }

    /// The group of block `layer` (none past the last block).
    pub fn group_of_layer(&self, layer: usize) -> Option<&BlockGroup> {
        let mut first = 0;
        for g in &self.groups {
            if layer < first + g.count {
                return Some(g);
            }
            first += g.count;
        }
        None
    }

    /// `(total, active per token)` parameters of the main model (MTP modules not
    /// counted, as in the published totals), from the spec alone: embedding, head
    /// (if untied), final norm, and per block two norms, attention (GQA or MLA
    /// with its latent norms), the router, routed and shared
    /// experts, or the dense MLP — each SwiGLU MLP is `3·D·F`.
    pub fn param_counts(&self) -> (u64, u64) {
        let d = self.hidden as u64;
        let embed = self.vocab as u64 * d * if self.tied_embeddings { 1 } else { 2 };
        let (mut total, mut active) = (embed + d, embed + d);
        for g in &self.groups {
            let p = g.params(self.hidden);
            let n = g.count as u64;
            let fixed = p.norms + p.attention + p.dense_mlp + p.router + p.shared_experts;
            total += n * (fixed + p.routed_experts);
            active += n * (fixed + p.routed_active);
        }
        (total, active)
    }

    /// Training FLOPs per token (forward + backward) at sequence length
    /// `seq_len`, counted as Megatron-LM's throughput formula does: every
    /// matrix product costs 2 FLOPs per multiply-add, the backward twice the
    /// forward (so 3× in all), attention scores and the weighted sum of values
    /// are counted over the full `seq_len` (no causal halving), and only the
    /// routed experts a token visits count. Matrix parameters are the active
    /// parameters less the embedding lookup (when untied from the head) and
    /// the norm weights.
    pub fn flops_per_token(&self) -> u64 {
        let d = self.hidden as u64;
        let (_, active) = self.param_counts();
        let mut matmul = active - d; // final norm
        if !self.tied_embeddings {
            matmul -= self.vocab as u64 * d;
        }
        let mut attention = 0;
        for g in &self.groups {
            let n = g.count as u64;
            let h = g.attention.heads as u64;
            let (qk, v, latent_norms) = match &g.attention.mla {
                None => (g.attention.head_dim as u64, g.attention.head_dim as u64, 0),
                Some(m) => (
                    (m.qk_nope_head_dim + m.qk_rope_head_dim) as u64,
                    m.v_head_dim as u64,
                    (m.q_lora_rank + m.kv_lora_rank) as u64,
                ),
            };
            matmul -= n * (2 * d + latent_norms);
            attention += n * 2 * self.seq_len as u64 * h * (qk + v);
        }
        3 * (2 * matmul + attention)
    }

    /// `train --fp8`: blockwise fp8 expert GEMMs in every group that allows
    /// them — an MoE group whose dims pass the fp8 rules and which does not
    /// offload `moe_act`. A `store_fp8(moe_act)` is dropped there, since the
    /// fp8 GEMMs keep that activation in fp8 already. Returns, for each
    /// group left as it was, its index and why; an error when no group can.
    pub fn use_fp8_experts(&mut self) -> Result<Vec<(usize, String)>, String> {
        let mut left = Vec::new();
        for i in 0..self.groups.len() {
            let mut g = self.groups[i].clone();
            if g.policy.precision == GemmPrecision::Fp8Blockwise {
                continue;
            }
            g.policy.precision = GemmPrecision::Fp8Blockwise;
            g.policy.store_fp8.retain(|o| *o != OffloadPart::MoeAct);
            let mut why = Vec::new();
            check_policy(&g, self, &format!("groups[{i}].policy"), &mut |_, m| {
                why.push(m)
            });
            if why.is_empty() {
                self.groups[i] = g;
            } else {
                left.push((i, why.join("; ")));
            }
        }
        if left.len() == self.groups.len() {
            let why: Vec<String> = left
                .iter()
                .map(|(i, w)| format!("groups[{i}]: {w}"))
                .collect();
            return Err(format!(
                "--fp8: no group of model {} can run its experts in fp8: {}",
                self.name,
                why.join("; ")
            ));
        }
        Ok(left)
    }

    /// Checks every model rule; returns all violations, not only the first.
    pub fn check(&self) -> Result<(), Vec<SpecError>> {
        let mut errs = Vec::new();
        let mut err = |path: String, message: String| errs.push(SpecError { path, message });
        for (name, v) in [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("seq_len", self.seq_len),
        ] {
            if v == 0 {
                err(name.into(), format!("{name} = 0; it must be at least 1"));
            } else if v > MAX_DIM {
                err(
                    name.into(),
                    format!("{name} = {v}; it must be at most {MAX_DIM} (2^24)"),
                );
            }
        }
        if self.norm_eps.is_nan() || self.norm_eps <= 0.0 {
            err(
                "norm_eps".into(),
                format!("norm_eps = {}; it must be > 0", self.norm_eps),
            );
        }
        if let Some(r) = &self.rope_scaling {
            check_rope_scaling(r, &mut err);
        }
        if self.groups.is_empty() {
            err(
                "groups".into(),
                "the model has no blocks; declare at least one group".into(),
            );
        }
        if !self.mtp_loss_coef.is_finite() || self.mtp_loss_coef < 0.0 {
            err(
                "mtp_loss_coef".into(),
                format!(
                    "mtp_loss_coef = {}; it must be a finite weight ≥ 0",
                    self.mtp_loss_coef
                ),
            );
        }
        if self.mtp_layers >= self.seq_len.max(1) {
            err(
                "mtp_layers".into(),
                format!(
                    "mtp_layers = {} predicts tokens beyond a sequence of seq_len = {}; keep it below seq_len",
                    self.mtp_layers, self.seq_len
                ),
            );
        }
        for (i, g) in self.groups.iter().enumerate() {
            let p = format!("groups[{i}]");
            if g.count == 0 {
                err(
                    format!("{p}.count"),
                    "count = 0; a group holds at least one block".into(),
                );
            }
            let a = &g.attention;
            if a.heads == 0 || a.kv_heads == 0 || a.head_dim == 0 {
                let zero = [
                    ("heads", a.heads),
                    ("kv_heads", a.kv_heads),
                    ("head_dim", a.head_dim),
                ]
                .into_iter()
                .find(|(_, v)| *v == 0)
                .map_or("", |(k, _)| k);
                err(
                    format!("{p}.attention.{zero}"),
                    format!(
                        "heads = {}, kv_heads = {}, head_dim = {}; all must be at least 1",
                        a.heads, a.kv_heads, a.head_dim
                    ),
                );
            } else if !a.heads.is_multiple_of(a.kv_heads) {
                err(
                    format!("{p}.attention.kv_heads"),
                    format!(
                        "kv_heads = {} does not divide heads = {}; choose kv_heads in {:?}",
                        a.kv_heads,
                        a.heads,
                        divisors(a.heads)
                    ),
                );
            }
            if a.mla.is_none() && !a.head_dim.is_multiple_of(2) {
                err(
                    format!("{p}.attention.head_dim"),
                    format!(
                        "head_dim = {} is odd; rotary embedding needs an even head_dim",
                        a.head_dim
                    ),
                );
            }
            if let Some(mla) = &a.mla {
                check_mla(mla, &format!("{p}.attention.mla"), &mut err);
                if a.qk_norm {
                    err(
                        format!("{p}.attention.qk_norm"),
                        "qk_norm applies to grouped-query attention; MLA normalises its \
                         latents instead: remove qk_norm"
                            .into(),
                    );
                }
            }
            check_attention_precision(a, self.hidden, &format!("{p}.attention"), &mut err);
            check_policy(g, self, &format!("{p}.policy"), &mut err);
            match &g.ffn {
                FfnSpec::Dense { ffn } => {
                    if *ffn == 0 {
                        err(
                            format!("{p}.dense.ffn"),
                            "ffn = 0; it must be at least 1".into(),
                        );
                    }
                }
                FfnSpec::Moe(m) => check_moe(m, &format!("{p}.moe"), &mut err),
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }
}

/// YaRN's stretch is at least 1, its ramp runs from `beta_slow` up to
/// `beta_fast` (both > 0: the dims are found from their logarithms), the
/// original context is at least one position and the `mscale`s finite.
fn check_rope_scaling(r: &RopeScaling, err: &mut impl FnMut(String, String)) {
    let p = "rope_scaling";
    if !(r.factor.is_finite() && r.factor >= 1.0) {
        err(
            format!("{p}.factor"),
            format!(
                "factor = {}; YaRN stretches the context by a finite factor ≥ 1",
                r.factor
            ),
        );
    }
    if !(r.beta_slow.is_finite() && r.beta_slow > 0.0) {
        err(
            format!("{p}.beta_slow"),
            format!(
                "beta_slow = {}; it must be a finite number > 0",
                r.beta_slow
            ),
        );
    } else if !(r.beta_fast.is_finite() && r.beta_fast > r.beta_slow) {
        err(
            format!("{p}.beta_fast"),
            format!(
                "beta_fast = {} is not above beta_slow = {}; the ramp runs from beta_slow up \
                 to beta_fast (32 and 1 by default)",
                r.beta_fast, r.beta_slow
            ),
        );
    }
    if r.original_max_position_embeddings == 0 {
        err(
            format!("{p}.original_max_position_embeddings"),
            "original_max_position_embeddings = 0; it is the pretraining context, at least 1"
                .into(),
        );
    }
    for (name, v) in [("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim)] {
        if let Some(v) = v.filter(|v| !v.is_finite()) {
            err(
                format!("{p}.{name}"),
                format!("{name} = {v}; it must be a finite number"),
            );
        }
    }
}

/// MLA dims must all be positive except the optional query latent, and the
/// rotary part must be even.
fn check_mla(m: &MlaSpec, p: &str, err: &mut impl FnMut(String, String)) {
    for (name, v) in [
        ("kv_lora_rank", m.kv_lora_rank),
        ("qk_nope_head_dim", m.qk_nope_head_dim),
        ("qk_rope_head_dim", m.qk_rope_head_dim),
        ("v_head_dim", m.v_head_dim),
    ] {
        if v == 0 {
            err(
                format!("{p}.{name}"),
                format!("{name} = 0; it must be at least 1"),
            );
        }
    }
    if !m.qk_rope_head_dim.is_multiple_of(2) {
        err(
            format!("{p}.qk_rope_head_dim"),
            format!(
                "qk_rope_head_dim = {} is odd; rotary embedding needs it even",
                m.qk_rope_head_dim
            ),
        );
    }
}

/// `attention(precision = ...)`: `fp8_blockwise` runs the attention's
/// projections as blockwise fp8 GEMMs, whose dims must be multiples of 16
/// (the fp8 operands' 16-byte rows); the other formats are not executed.
fn check_attention_precision(
    a: &AttentionSpec,
    hidden: usize,
    p: &str,
    err: &mut impl FnMut(String, String),
) {
    let precision = keywords::name_of(keywords::PRECISION, a.precision);
    match a.precision {
        GemmPrecision::Bf16 => {}
        GemmPrecision::Fp8Blockwise => {
            for (name, v) in attention_gemm_dims(a, hidden) {
                if !v.is_multiple_of(16) {
                    err(
                        format!("{p}.precision"),
                        format!(
                            "fp8 attention projections need {name} = {v} to be a multiple of 16; \
                             pad it to {} or use bf16",
                            v.div_ceil(16) * 16
                        ),
                    );
                }
            }
        }
        GemmPrecision::F32 | GemmPrecision::Fp8Tensorwise => err(
            format!("{p}.precision"),
            format!(
                "precision = {precision}: this GEMM precision is not executed yet (the attention's \
                 projections run in the model's dtype or in fp8_blockwise), so the key would be \
                 ignored; remove it"
            ),
        ),
    }
}

/// The dims of an attention's projections (each one a summed or an output
/// dim of some projection), by their key names.
fn attention_gemm_dims(a: &AttentionSpec, hidden: usize) -> Vec<(&'static str, usize)> {
    let mut dims = vec![("hidden", hidden)];
    match &a.mla {
        None => dims.push(("head_dim", a.head_dim)),
        Some(m) => {
            if m.q_lora_rank > 0 {
                dims.push(("q_lora_rank", m.q_lora_rank));
            }
            dims.extend([
                ("kv_lora_rank", m.kv_lora_rank),
                ("qk_nope_head_dim", m.qk_nope_head_dim),
                ("qk_rope_head_dim", m.qk_rope_head_dim),
                ("v_head_dim", m.v_head_dim),
            ]);
        }
    }
    dims
}

/// What a group must have for recompute part `part` to name something in
/// it (`None`: every group has it).
fn recompute_needs(g: &BlockGroup, part: RecomputePart) -> Option<&'static str> {
    let is_moe = matches!(g.ffn, FfnSpec::Moe(_));
    let has_shared = matches!(&g.ffn, FfnSpec::Moe(m) if m.shared_ffn > 0);
    match part {
        RecomputePart::MoeAct | RecomputePart::Router if !is_moe => Some("an MoE layer"),
        RecomputePart::SharedExperts if !has_shared => Some("shared experts"),
        RecomputePart::MlpAct if is_moe => Some("a dense MLP"),
        RecomputePart::MlaUpProj if g.attention.mla.is_none() => Some("MLA attention"),
        _ => None,
    }
}

/// What a group must have for offload (or fp8) part `part` to name
/// something in it.
fn offload_needs(g: &BlockGroup, part: OffloadPart) -> Option<&'static str> {
    let is_moe = matches!(g.ffn, FfnSpec::Moe(_));
    match part {
        OffloadPart::ExpertFc1 | OffloadPart::MoeAct if !is_moe => Some("an MoE layer"),
        _ => None,
    }
}

/// Policy lists given for a whole model (`--recompute`, `--offload`,
/// `--store-fp8`, as keyword lists), replacing every group's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyOverride {
    /// Recompute parts, if given.
    pub recompute: Option<Vec<RecomputePart>>,
    /// Offload parts, if given.
    pub offload: Option<Vec<OffloadPart>>,
    /// fp8-storage parts, if given.
    pub store_fp8: Option<Vec<OffloadPart>>,
}

impl PolicyOverride {
    /// Parses the three keyword lists (each optional), naming the flag in
    /// an error: `--offload: unknown offload part `qk`; choose one of ...`.
    pub fn parse(
        recompute: Option<&str>,
        offload: Option<&str>,
        store_fp8: Option<&str>,
    ) -> Result<Self, String> {
        fn parse<T: Copy>(
            list: Option<&str>,
            table: &[(&str, T)],
            flag: &str,
            what: &str,
        ) -> Result<Option<Vec<T>>, String> {
            list.map(|l| keywords::parse_list(table, what, l).map_err(|e| format!("{flag}: {e}")))
                .transpose()
        }
        Ok(PolicyOverride {
            recompute: parse(
                recompute,
                keywords::RECOMPUTE,
                "--recompute",
                "recompute part",
            )?,
            offload: parse(offload, keywords::OFFLOAD, "--offload", "offload part")?,
            store_fp8: parse(
                store_fp8,
                keywords::OFFLOAD,
                "--store-fp8",
                "fp8-storage part",
            )?,
        })
    }

    /// Whether no list was given.
    pub fn is_empty(&self) -> bool {
        self.recompute.is_none() && self.offload.is_none() && self.store_fp8.is_none()
    }

    /// Replaces every group's lists with the given ones. A part a group
    /// lacks (`moe_act` in a dense block) names nothing there and is left
    /// out of that group's list, so one list serves a mixed model; with
    /// `block`, the other recompute parts are covered and left out too.
    pub fn apply(&self, spec: &mut ModelSpec) {
        for g in &mut spec.groups {
            if let Some(parts) = &self.recompute {
                let block = parts.contains(&RecomputePart::Block);
                let mut kept: Vec<RecomputePart> = Vec::new();
                for &p in parts {
                    let covered = block && p != RecomputePart::Block;
                    if !covered && recompute_needs(g, p).is_none() && !kept.contains(&p) {
                        kept.push(p);
                    }
                }
                g.policy.recompute = kept;
            }
            let offload_parts = |parts: &[OffloadPart]| {
                let mut kept: Vec<OffloadPart> = Vec::new();
                for &p in parts {
                    if offload_needs(g, p).is_none() && !kept.contains(&p) {
                        kept.push(p);
                    }
                }
                kept
            };
            let offload = self.offload.as_deref().map(offload_parts);
            let store_fp8 = self.store_fp8.as_deref().map(offload_parts);
            if let Some(parts) = offload {
                g.policy.offload = parts;
            }
            if let Some(parts) = store_fp8 {
                g.policy.store_fp8 = parts;
            }
        }
    }
}

/// Policies name only parts the group has, each once (`block` alone, since
/// it already covers every part), and fp8 GEMMs need dims that are multiples
/// of 16 (docs/ARCHITECTURE.md §3, precision). A part's error blames its place in the list
/// (`policy.recompute[1]`), so a front end points at the word, not the key.
fn check_policy(g: &BlockGroup, spec: &ModelSpec, p: &str, err: &mut impl FnMut(String, String)) {
    let recompute = &g.policy.recompute;
    for (i, part) in recompute.iter().enumerate() {
        let name = keywords::name_of(keywords::RECOMPUTE, *part);
        let at = format!("{p}.recompute[{i}]");
        if recompute[..i].contains(part) {
            err(
                at,
                format!("recompute part `{name}` is listed twice; list it once"),
            );
            continue;
        }
        if *part != RecomputePart::Block && recompute.contains(&RecomputePart::Block) {
            err(
                at,
                format!("recompute part `{name}` is already covered by `block`, which recomputes the whole block; drop one of them"),
            );
            continue;
        }
        let missing = recompute_needs(g, *part);
        if let Some(what) = missing {
            err(
                at,
                format!(
                    "recompute part `{name}` needs {what}, which this group does not have; remove it"
                ),
            );
        }
    }
    for (list, key) in [
        (&g.policy.offload, "offload"),
        (&g.policy.store_fp8, "store_fp8"),
    ] {
        for (i, part) in list.iter().enumerate() {
            let name = keywords::name_of(keywords::OFFLOAD, *part);
            let at = format!("{p}.{key}[{i}]");
            if list[..i].contains(part) {
                err(
                    at,
                    format!("{key} part `{name}` is listed twice; list it once"),
                );
            } else if offload_needs(g, *part).is_some() {
                err(
                    at,
                    format!(
                        "{key} part `{name}` needs an MoE layer, which this group does not have; remove it"
                    ),
                );
            }
        }
    }
    let precision = keywords::name_of(keywords::PRECISION, g.policy.precision);
    match g.policy.precision {
        GemmPrecision::Bf16 => {}
        GemmPrecision::Fp8Blockwise => {
            if !matches!(g.ffn, FfnSpec::Moe(_)) {
                err(
                    format!("{p}.precision"),
                    format!(
                        "precision = {precision} runs a group's routed experts in fp8, and this group has no MoE layer \
                         (its other GEMMs stay in the model's dtype); remove it"
                    ),
                );
            }
            for (list, key) in [(&g.policy.store_fp8, "store_fp8"), (&g.policy.offload, "offload")] {
                if let Some(i) = list.iter().position(|o| *o == OffloadPart::MoeAct) {
                    err(
                        format!("{p}.{key}[{i}]"),
                        format!(
                            "{key} part `moe_act` with precision = {precision}: the experts already keep their \
                             activation as its fp8 GEMM operand, {}; remove it",
                            if key == "store_fp8" {
                                "so storing it in fp8 would change nothing"
                            } else {
                                "which is not offloaded yet"
                            }
                        ),
                    );
                }
            }
        }
        GemmPrecision::F32 | GemmPrecision::Fp8Tensorwise => err(
            format!("{p}.precision"),
            format!(
                "precision = {precision}: this GEMM precision is not executed yet (every GEMM \
                 runs in the model's dtype, `train --dtype`, or the experts' in fp8_blockwise), so the key would be ignored; remove it"
            ),
        ),
    }
    if g.policy.precision.is_fp8() {
        for (name, v) in gemm_dims(g, spec) {
            if !v.is_multiple_of(16) {
                err(
                    format!("{p}.precision"),
                    format!("fp8 GEMMs need {name} = {v} to be a multiple of 16; pad it to {} or use bf16", v.div_ceil(16) * 16),
                );
            }
        }
    }
}

/// The unsplit GEMM dimensions of a group's blocks, by their key names: the
/// dims fp8 GEMMs need to be multiples of 16.
fn gemm_dims(g: &BlockGroup, spec: &ModelSpec) -> Vec<(&'static str, usize)> {
    let mut dims = vec![("hidden", spec.hidden), ("head_dim", g.attention.head_dim)];
    match &g.ffn {
        FfnSpec::Dense { ffn } => dims.push(("ffn", *ffn)),
        FfnSpec::Moe(m) => dims.push(("expert_ffn", m.expert_ffn)),
    }
    dims
}

/// The routing rules of docs/ARCHITECTURE.md §3.
fn check_moe(m: &MoeSpec, p: &str, err: &mut impl FnMut(String, String)) {
    let r = &m.router;
    if m.experts == 0 || m.expert_ffn == 0 {
        for (name, v) in [("experts", m.experts), ("expert_ffn", m.expert_ffn)] {
            if v == 0 {
                err(
                    format!("{p}.{name}"),
                    format!("{name} = 0; it must be at least 1"),
                );
            }
        }
        return;
    }
    if m.top_k == 0 || m.top_k > m.experts {
        err(
            format!("{p}.top_k"),
            format!(
                "top_k = {} must be in 1..={} (the number of experts)",
                m.top_k, m.experts
            ),
        );
    }
    if r.groups == 0 || !m.experts.is_multiple_of(r.groups) {
        err(
            format!("{p}.router.groups"),
            format!(
                "groups = {} does not divide experts = {}; choose groups in {:?}",
                r.groups,
                m.experts,
                divisors(m.experts)
            ),
        );
    } else if r.groups > 1 {
        if r.group_top_k == 0 || r.group_top_k > r.groups {
            err(
                format!("{p}.router.group_top_k"),
                format!(
                    "group_top_k = {} must be in 1..={} (groups)",
                    r.group_top_k, r.groups
                ),
            );
        } else {
            let reachable = r.group_top_k * m.experts / r.groups;
            if m.top_k > reachable {
                err(
                    format!("{p}.top_k"),
                    format!(
                        "top_k = {} exceeds the {reachable} experts in the {} chosen group{}; raise group_top_k or lower top_k",
                        m.top_k, r.group_top_k, if r.group_top_k == 1 { "" } else { "s" }
                    ),
                );
            }
            if !m.top_k.is_multiple_of(r.group_top_k) {
                err(
                    format!("{p}.router.group_top_k"),
                    format!(
                        "group_top_k = {} does not divide top_k = {}; a group scores the sum of its best top_k/group_top_k experts",
                        r.group_top_k, m.top_k
                    ),
                );
            }
        }
    }
    if r.expert_bias_rate.is_some() && r.score != ScoreFunction::Sigmoid {
        err(
            format!("{p}.router.expert_bias"),
            "expert bias needs sigmoid scores; set score = sigmoid or drop the bias".into(),
        );
    }
    if r.pre_softmax && r.score != ScoreFunction::Softmax {
        err(
            format!("{p}.router.pre_softmax"),
            "pre_softmax applies to softmax scores only; drop it for sigmoid".into(),
        );
    }
    // Blamed on top_k, the key written: pre_softmax is usually left out.
    if m.top_k == 1 && r.score == ScoreFunction::Softmax && !r.pre_softmax {
        err(
            format!("{p}.top_k"),
            "top_k = 1 with softmax after top-k gives every token weight 1 and no router gradient; set pre_softmax".into(),
        );
    }
    if let Some(c) = &m.capacity {
        if c.factor.is_nan() || c.factor <= 0.0 {
            err(
                format!("{p}.capacity.factor"),
                format!("capacity factor = {}; it must be > 0", c.factor),
            );
        }
        if !r.load_balance.allows_capacity() {
            err(
                format!("{p}.router.load_balance"),
                "a capacity factor works only with load_balance = none, aux, seq_aux or global_aux; change load_balance or drop capacity(...)".into(),
            );
        }
    }
    if r.scaling_factor.is_nan() || r.scaling_factor <= 0.0 {
        err(
            format!("{p}.router.scaling_factor"),
            format!("scaling_factor = {}; it must be > 0", r.scaling_factor),
        );
    }
}

/// Divisors of `n` in increasing order (used in fix suggestions).
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe_group() -> BlockGroup {
        BlockGroup::new(
            1,
            AttentionSpec::gqa(4, 2, 8),
            FfnSpec::Moe(MoeSpec {
                experts: 8,
                top_k: 2,
                expert_ffn: 16,
                shared_ffn: 0,
                shared_gate: false,
                router: RouterSpec::default(),
                capacity: None,
            }),
        )
    }

    fn spec_with(group: BlockGroup) -> ModelSpec {
        ModelSpec {
            name: "t".into(),
            vocab: 16,
            hidden: 32,
            seq_len: 8,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tied_embeddings: false,
            init_std: 0.02,
            groups: vec![group],
            mtp_layers: 0,
            mtp_loss_coef: 0.1,
        }
    }

    /// `--fp8` sets blockwise fp8 on every MoE group that passes the fp8
    /// rules, drops a `store_fp8(moe_act)` it subsumes, says why it leaves
    /// the others, and is an error when no group can take it.
    #[test]
    fn use_fp8_experts_picks_the_groups_that_allow_it() {
        let mut moe = moe_group();
        moe.attention = AttentionSpec::gqa(4, 2, 16);
        moe.policy.store_fp8 = vec![OffloadPart::ExpertFc1, OffloadPart::MoeAct];
        let mut offloading = moe.clone();
        offloading.policy.offload = vec![OffloadPart::MoeAct];
        let mut dense = moe.clone();
        dense.ffn = FfnSpec::Dense { ffn: 64 };
        dense.policy.store_fp8.clear();
        let mut spec = spec_with(dense.clone());
        spec.groups.extend([moe, offloading]);
        let left = spec.use_fp8_experts().unwrap();
        assert_eq!(left.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [0, 2]);
        assert!(left[0].1.contains("no MoE layer"), "{left:?}");
        assert!(left[1].1.contains("offload part `moe_act`"), "{left:?}");
        let g = &spec.groups[1].policy;
        assert_eq!(
            (g.precision, g.store_fp8.as_slice()),
            (GemmPrecision::Fp8Blockwise, &[OffloadPart::ExpertFc1][..])
        );
        assert_eq!(spec.groups[2].policy.precision, GemmPrecision::Bf16);
        assert!(spec.check().is_ok());
        let e = spec_with(dense).use_fp8_experts().unwrap_err();
        assert!(
            e.starts_with("--fp8: no group of model t can run its experts in fp8: groups[0]: "),
            "{e}"
        );
    }

    #[test]
    fn first_layers_cuts_groups_in_order() {
        let mut spec = spec_with(moe_group());
        spec.groups[0].count = 2;
        let mut dense = spec.groups[0].clone();
        dense.ffn = FfnSpec::Dense { ffn: 64 };
        dense.count = 3;
        spec.groups.push(dense);
        spec.mtp_layers = 1;
        let cut = spec.first_layers(3).unwrap();
        assert_eq!(cut.layers(), 3);
        assert_eq!(
            cut.groups.iter().map(|g| g.count).collect::<Vec<_>>(),
            [2, 1]
        );
        assert_eq!(cut.groups[1].ffn, FfnSpec::Dense { ffn: 64 });
        assert_eq!(cut.mtp_layers, 0);
        assert!(cut.param_counts().0 < spec.param_counts().0);
        let one = spec.first_layers(1).unwrap();
        assert_eq!((one.groups.len(), one.groups[0].count), (1, 1));
        assert_eq!(spec.first_layers(5).unwrap().groups, spec.groups);
        for bad in [0, 6] {
            assert_eq!(
                spec.first_layers(bad).unwrap_err(),
                "t has 5 blocks; keep between 1 and 5"
            );
        }
    }

    #[test]
    fn valid_spec_passes() {
        spec_with(moe_group()).check().unwrap();
    }

    #[test]
    fn every_violation_is_reported_with_values() {
        let mut g = moe_group();
        g.attention.kv_heads = 3;
        if let FfnSpec::Moe(m) = &mut g.ffn {
            m.top_k = 9;
            m.router.groups = 3;
            m.router.expert_bias_rate = Some(1e-3);
        }
        let errs = spec_with(g).check().unwrap_err();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert_eq!(errs.len(), 4, "{text:#?}");
        assert!(text[0].contains("kv_heads = 3 does not divide heads = 4"));
        assert!(text[1].contains("top_k = 9 must be in 1..=8"));
        assert!(text[2]
            .contains("groups = 3 does not divide experts = 8; choose groups in [1, 2, 4, 8]"));
        assert!(text[3].contains("expert bias needs sigmoid"));
    }

    #[test]
    fn group_limited_reach_is_checked() {
        let mut g = moe_group();
        if let FfnSpec::Moe(m) = &mut g.ffn {
            m.top_k = 4;
            m.router.groups = 4;
            m.router.group_top_k = 1;
        }
        let errs = spec_with(g).check().unwrap_err();
        assert!(
            errs[0].message.contains("exceeds the 2 experts"),
            "{errs:?}"
        );
    }

    #[test]
    fn policy_parts_must_exist_in_the_group() {
        let mut g = BlockGroup::new(1, AttentionSpec::gqa(4, 2, 8), FfnSpec::Dense { ffn: 32 });
        g.policy.recompute = vec![
            RecomputePart::Router,
            RecomputePart::MlaUpProj,
            RecomputePart::Norm,
        ];
        g.policy.offload = vec![OffloadPart::ExpertFc1];
        g.policy.precision = GemmPrecision::Fp8Blockwise;
        let errs = spec_with(g).check().unwrap_err();
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert_eq!(errs.len(), 5, "{text:#?}");
        assert!(text[0].contains("`router` needs an MoE layer"));
        assert!(text[1].contains("`mla_up_proj` needs MLA attention"));
        assert!(text[2].contains("`expert_fc1` needs an MoE layer"));
        assert!(text[3].contains(
            "precision = fp8_blockwise runs a group's routed experts in fp8, and this group has no MoE layer"
        ));
        assert!(
            text[4].contains("fp8 GEMMs need head_dim = 8 to be a multiple of 16; pad it to 16")
        );
    }

    #[test]
    fn mla_dims_are_checked() {
        let mut g = moe_group();
        g.attention.mla = Some(MlaSpec {
            q_lora_rank: 0,
            kv_lora_rank: 0,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 3,
            v_head_dim: 8,
        });
        let errs = spec_with(g).check().unwrap_err();
        assert!(errs[0].message.contains("kv_lora_rank = 0"), "{errs:?}");
        assert!(
            errs[1].message.contains("qk_rope_head_dim = 3 is odd"),
            "{errs:?}"
        );
    }

    #[test]
    fn policy_lists_apply_to_every_group_that_has_the_part() {
        let mut spec = spec_with(moe_group());
        let mut dense = spec.groups[0].clone();
        dense.ffn = FfnSpec::Dense { ffn: 64 };
        spec.groups.push(dense);
        let over = PolicyOverride::parse(
            Some("norm, moe_act,mlp_act"),
            Some("expert_fc1,qkv"),
            Some("none"),
        )
        .unwrap();
        over.apply(&mut spec);
        assert_eq!(
            spec.groups[0].policy.recompute,
            [RecomputePart::Norm, RecomputePart::MoeAct]
        );
        assert_eq!(
            spec.groups[1].policy.recompute,
            [RecomputePart::Norm, RecomputePart::MlpAct]
        );
        assert_eq!(spec.groups[1].policy.offload, [OffloadPart::Qkv]);
        assert!(spec.groups[0].policy.store_fp8.is_empty());
        assert!(spec.check().is_ok(), "{:?}", spec.check());
        // `block` covers the rest.
        PolicyOverride::parse(Some("norm,block"), None, None)
            .unwrap()
            .apply(&mut spec);
        assert_eq!(spec.groups[1].policy.recompute, [RecomputePart::Block]);
        let err = PolicyOverride::parse(None, None, Some("qk")).unwrap_err();
        assert!(
            err.starts_with("--store-fp8: unknown fp8-storage part `qk`; choose one of attn_norm"),
            "{err}"
        );
    }

    #[test]
    fn suggestions_catch_typos_and_suffixed_names() {
        let names = ["hidden", "heads", "top_k", "tp"];
        assert_eq!(keywords::suggest("z_los", &["z_loss"]), Some("z_loss"));
        assert_eq!(keywords::suggest("hidden_size", &names), Some("hidden"));
        assert_eq!(keywords::suggest("top_kk", &names), Some("top_k"));
        assert_eq!(keywords::suggest("vocabulary", &names), None);
    }

    #[test]
    fn keywords_look_up_and_list_choices() {
        assert_eq!(
            keywords::lookup(keywords::RECOMPUTE, "recompute part", "moe_act"),
            Ok(RecomputePart::MoeAct)
        );
        let err = keywords::lookup(keywords::OFFLOAD, "offload part", "qk").unwrap_err();
        assert!(
            err.contains("unknown offload part `qk`; choose one of attn_norm, qkv"),
            "{err}"
        );
    }

    #[test]
    fn flops_per_token_by_hand() {
        // One dense block, D = 4, V = 10 untied, GQA 2 heads of 2 (kv 1), F = 8, S = 16.
        let mut spec = spec_with(BlockGroup::new(
            1,
            AttentionSpec::gqa(2, 1, 2),
            FfnSpec::Dense { ffn: 8 },
        ));
        spec.vocab = 10;
        spec.hidden = 4;
        spec.seq_len = 16;
        // matrices: wq 4·4 + wk 4·2 + wv 4·2 + wo 4·4 = 48, MLP 3·4·8 = 96, head 40
        let matmul = 48 + 96 + 40;
        // scores and values: 2 · S · heads · (qk + v) = 2·16·2·4
        let attention = 2 * 16 * 2 * 4;
        assert_eq!(spec.flops_per_token(), 3 * (2 * matmul + attention));
        let (total, active) = spec.param_counts();
        assert_eq!(
            (total, active),
            (40 + 40 + 4 + 2 * 4 + 48 + 96, 40 + 40 + 4 + 2 * 4 + 48 + 96)
        );
    }

    #[test]
    fn capacity_rounds_up() {
        let c = CapacitySpec {
            factor: 1.25,
            drop_policy: DropPolicySpec::Probs,
            pad_to_capacity: false,
        };
        assert_eq!(c.capacity(10, 2, 8), 4); // 20/8*1.25 = 3.125 -> 4
    }

    #[test]
    fn policy_errors_blame_the_part_in_its_list() {
        let mut g = moe_group();
        g.policy.recompute = vec![
            RecomputePart::Norm,
            RecomputePart::MlpAct,
            RecomputePart::Norm,
        ];
        g.policy.offload = vec![OffloadPart::Qkv, OffloadPart::Qkv];
        let errs = spec_with(g).check().unwrap_err();
        let got: Vec<(&str, &str)> = errs
            .iter()
            .map(|e| (e.path.as_str(), e.message.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "groups[0].policy.recompute[1]",
                    "recompute part `mlp_act` needs a dense MLP, which this group does not have; remove it"
                ),
                (
                    "groups[0].policy.recompute[2]",
                    "recompute part `norm` is listed twice; list it once"
                ),
                (
                    "groups[0].policy.offload[1]",
                    "offload part `qkv` is listed twice; list it once"
                ),
            ]
        );
    }

    #[test]
    fn block_recompute_stands_alone() {
        let mut g = moe_group();
        g.policy.recompute = vec![RecomputePart::Block, RecomputePart::Router];
        let errs = spec_with(g).check().unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "groups[0].policy.recompute[1]");
        assert!(errs[0].message.contains("already covered by `block`"));
    }

    #[test]
    fn top_k_one_needs_pre_softmax_and_blames_top_k() {
        let mut g = moe_group();
        if let FfnSpec::Moe(m) = &mut g.ffn {
            m.top_k = 1;
        }
        let errs = spec_with(g.clone()).check().unwrap_err();
        assert_eq!(errs[0].path, "groups[0].moe.top_k");
        assert!(errs[0].message.contains("set pre_softmax"), "{errs:?}");
        if let FfnSpec::Moe(m) = &mut g.ffn {
            m.router.pre_softmax = true;
        }
        spec_with(g).check().unwrap();
    }

    #[test]
    fn capacity_goes_with_every_load_balance_kind() {
        for kind in [
            LoadBalance::None,
            LoadBalance::Aux,
            LoadBalance::SeqAux,
            LoadBalance::GlobalAux,
        ] {
            assert!(kind.allows_capacity());
            let mut g = moe_group();
            if let FfnSpec::Moe(m) = &mut g.ffn {
                m.router.load_balance = kind;
                m.capacity = Some(CapacitySpec {
                    factor: 1.0,
                    drop_policy: DropPolicySpec::Probs,
                    pad_to_capacity: true,
                });
            }
            spec_with(g).check().unwrap();
        }
    }

    #[test]
    fn zero_sizes_blame_their_own_key() {
        let mut g = moe_group();
        g.attention.kv_heads = 0;
        if let FfnSpec::Moe(m) = &mut g.ffn {
            m.expert_ffn = 0;
        }
        let errs = spec_with(g).check().unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            ["groups[0].attention.kv_heads", "groups[0].moe.expert_ffn"]
        );
    }

    /// A vocabulary or sequence past 2^24 is an error naming it, before any
    /// count of parameters or bytes could overflow.
    #[test]
    fn sizes_past_the_bound_are_errors() {
        let mut spec = spec_with(moe_group());
        spec.vocab = MAX_DIM + 1;
        spec.seq_len = usize::MAX;
        let errs = spec.check().unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["vocab", "seq_len"]);
        assert!(errs[0].message.contains("at most 16777216"), "{}", errs[0]);
    }
}
