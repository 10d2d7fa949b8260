//! Hugging Face `config.json` ↔ [`ModelSpec`], for Mixtral, Qwen3-MoE and
//! DeepSeek-V3 (transformers 5's `MixtralConfig`, `Qwen3MoeConfig`,
//! `DeepseekV3Config`, and the older spellings of the same fields).
//!
//! Every field of the file is either read into the spec, checked to hold
//! the one value foldmoe implements (`hidden_act = "silu"`, no attention
//! bias, no sliding window, RoPE plain or YaRN, ...), or listed as not affecting
//! the forward pass (token ids, `use_cache`, training-only coefficients that
//! foldmoe sets itself). Anything else — an unknown field, or a value foldmoe
//! cannot represent — is an error naming the field: nothing is defaulted
//! silently. DeepSeek-V3's `num_nextn_predict_layers` is the spec's
//! `mtp_layers`; YaRN (`rope_parameters` or `rope_scaling`) its
//! `rope_scaling`.

use serde_json::{Map, Value};

use crate::engine::{EngineError, Result};
use crate::spec::{
    keywords, AttentionSpec, BlockGroup, FfnSpec, GemmPrecision, LoadBalance, MlaSpec, ModelSpec,
    MoeSpec, RopeScaling, RopeScalingType, RouterDtype, RouterSpec, ScoreFunction,
};

/// The model families converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `mixtral`: GQA, softmax top-k routing renormalised over the chosen.
    Mixtral,
    /// `qwen3_moe`: GQA with per-head q/k RMSNorm, softmax routing.
    Qwen3Moe,
    /// `deepseek_v3`: MLA, group-limited sigmoid routing with a correction
    /// bias, shared experts, dense first layers.
    DeepseekV3,
}

impl Family {
    /// The `model_type` of the family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }

    /// The `architectures` entry of a causal LM of the family.
    fn architecture(self) -> &'static str {
        match self {
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    fn of(model_type: &str) -> Option<Self> {
        [Family::Mixtral, Family::Qwen3Moe, Family::DeepseekV3]
            .into_iter()
            .find(|f| f.model_type() == model_type)
    }
}

/// A `config.json` read: the family, the spec, the file's own fields (kept
/// so an export writes them back), whether the RoPE dims of MLA are stored
/// interleaved, and the fp8 block size of a quantised checkpoint.
#[derive(Clone, Debug)]
pub struct HfConfig {
    /// The family.
    pub family: Family,
    /// The model.
    pub spec: ModelSpec,
    /// The file as read.
    pub raw: Map<String, Value>,
    /// DeepSeek's `rope_interleave`: the rotary dims of `q_b_proj` and
    /// `kv_a_proj_with_mqa` stored as interleaved pairs.
    pub rope_interleave: bool,
    /// `quantization_config.weight_block_size` of an fp8 checkpoint.
    pub fp8_block: Option<[usize; 2]>,
}

/// Fields that do not change the model's forward pass, in every family:
/// metadata, token ids, generation and training-only settings.
const IGNORED: &[&str] = &[
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "initializer_range",
    "max_position_embeddings",
    "auto_map",
    "_name_or_path",
    "ep_size",
    "aux_loss_alpha",
    "seq_aux",
    "max_window_layers",
];

/// Every field that is read or checked below, with the families that have
/// it (one table: a field shared by families is listed once).
const FIELDS: &[(&str, &[Family])] = {
    use Family::{DeepseekV3 as D, Mixtral as M, Qwen3Moe as Q};
    &[
        ("vocab_size", &[M, Q, D]),
        ("hidden_size", &[M, Q, D]),
        ("intermediate_size", &[M, Q, D]),
        ("num_hidden_layers", &[M, Q, D]),
        ("num_attention_heads", &[M, Q, D]),
        ("num_key_value_heads", &[M, Q, D]),
        ("head_dim", &[M, Q, D]),
        ("num_experts_per_tok", &[M, Q, D]),
        ("rms_norm_eps", &[M, Q, D]),
        ("rope_theta", &[M, Q, D]),
        ("rope_parameters", &[M, Q, D]),
        ("rope_scaling", &[M, Q, D]),
        ("tie_word_embeddings", &[M, Q, D]),
        ("hidden_act", &[M, Q, D]),
        ("num_local_experts", &[M, Q]),
        ("sliding_window", &[M, Q]),
        ("router_jitter_noise", &[M]),
        ("attention_bias", &[Q, D]),
        ("moe_intermediate_size", &[Q, D]),
        ("norm_topk_prob", &[Q, D]),
        ("num_experts", &[Q]),
        ("decoder_sparse_step", &[Q]),
        ("mlp_only_layers", &[Q]),
        ("use_sliding_window", &[Q]),
        ("n_shared_experts", &[D]),
        ("n_routed_experts", &[D]),
        ("routed_scaling_factor", &[D]),
        ("kv_lora_rank", &[D]),
        ("q_lora_rank", &[D]),
        ("qk_rope_head_dim", &[D]),
        ("qk_nope_head_dim", &[D]),
        ("qk_head_dim", &[D]),
        ("v_head_dim", &[D]),
        ("n_group", &[D]),
        ("topk_group", &[D]),
        ("first_k_dense_replace", &[D]),
        ("rope_interleave", &[D]),
        ("num_nextn_predict_layers", &[D]),
        ("pretraining_tp", &[D]),
        ("scoring_func", &[D]),
        ("topk_method", &[D]),
        ("moe_layer_freq", &[D]),
        ("quantization_config", &[D]),
    ]
};

/// Fields of one `rope_parameters` / `rope_scaling` object, beside the
/// type's key: those read into [`RopeScaling`] or checked.
const ROPE_FIELDS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "attention_factor",
    "partial_rotary_factor",
];

/// The transformers `rms_norm_eps` of DeepSeek-V3's latent norms
/// (`q_a_layernorm`, `kv_a_layernorm` are built with their default eps),
/// which foldmoe's MLA gives the model's `norm_eps`.
const DEEPSEEK_LATENT_EPS: f64 = 1e-6;

/// Reads one `config.json` text (`what` names the file in errors).
pub fn parse(text: &str, what: &str) -> Result<HfConfig> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| EngineError::Invalid(format!("{what}: not JSON: {e}")))?;
    let Value::Object(raw) = value else {
        return Err(EngineError::Invalid(format!("{what}: not a JSON object")));
    };
    let c = Fields { raw: &raw, what };
    let model_type = c.str("model_type")?;
    let family = Family::of(model_type).ok_or_else(|| {
        EngineError::Invalid(format!(
            "{what}: model_type `{model_type}` is not converted; foldmoe reads mixtral, \
             qwen3_moe and deepseek_v3"
        ))
    })?;
    let known = |key: &str| {
        IGNORED.contains(&key)
            || FIELDS
                .iter()
                .any(|(k, families)| *k == key && families.contains(&family))
    };
    for key in raw.keys() {
        if !known(key) {
            return Err(EngineError::Invalid(format!(
                "{what}: field `{key}` is not one foldmoe knows for {model_type}; it cannot \
                 say whether the model needs it (remove it if it does not change the model)"
            )));
        }
    }
    c.expect_str("hidden_act", "silu")?;
    c.expect_bool("attention_bias", false)?;
    let (rope_theta, rope_scaling) = c.rope()?;
    let norm_eps = c.f64_or("rms_norm_eps", keywords::DEFAULT_NORM_EPS)?;
    let (hidden, heads) = (c.usize("hidden_size")?, c.usize("num_attention_heads")?);
    let layers = c.usize("num_hidden_layers")?;
    let seq_len = c.usize_or("max_position_embeddings", 4096)?;
    let mut spec = ModelSpec {
        name: c
            .raw
            .get("_name_or_path")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(|s| s.rsplit('/').next().unwrap_or(s).to_string())
            .unwrap_or_else(|| model_type.replace('_', "-")),
        vocab: c.usize("vocab_size")?,
        hidden,
        seq_len,
        norm_eps,
        rope_theta,
        rope_scaling,
        tied_embeddings: c.bool_or("tie_word_embeddings", false)?,
        init_std: c.f64_or("initializer_range", keywords::DEFAULT_INIT_STD)?,
        groups: Vec::new(),
        mtp_layers: 0,
        mtp_loss_coef: 0.1,
    };
    let mut rope_interleave = false;
    let mut fp8_block = None;
    let softmax_router = |norm_topk: bool| RouterSpec {
        score: ScoreFunction::Softmax,
        pre_softmax: !norm_topk,
        aux_coef: c.f64_or("router_aux_loss_coef", 1e-3).unwrap_or(1e-3),
        ..RouterSpec::default()
    };
    match family {
        Family::Mixtral => {
            c.no_sliding_window(seq_len)?;
            if c.f64_or("router_jitter_noise", 0.0)? != 0.0 {
                return Err(c.unsupported(
                    "router_jitter_noise",
                    "foldmoe's router adds no noise to its logits",
                ));
            }
            let attention = c.gqa(hidden, heads, false)?;
            let moe = MoeSpec {
                experts: c.usize("num_local_experts")?,
                top_k: c.usize("num_experts_per_tok")?,
                expert_ffn: c.usize("intermediate_size")?,
                shared_ffn: 0,
                shared_gate: false,
                router: softmax_router(true),
                capacity: None,
            };
            spec.groups
                .push(BlockGroup::new(layers, attention, FfnSpec::Moe(moe)));
        }
        Family::Qwen3Moe => {
            c.no_sliding_window(seq_len)?;
            c.expect_bool("use_sliding_window", false)?;
            let attention = c.gqa(hidden, heads, true)?;
            let experts = match c.raw.get("num_experts") {
                Some(_) => c.usize("num_experts")?,
                None => c.usize("num_local_experts")?,
            };
            let moe = MoeSpec {
                experts,
                top_k: c.usize("num_experts_per_tok")?,
                expert_ffn: c.usize("moe_intermediate_size")?,
                shared_ffn: 0,
                shared_gate: false,
                router: softmax_router(c.bool_or("norm_topk_prob", false)?),
                capacity: None,
            };
            let step = c.usize_or("decoder_sparse_step", 1)?.max(1);
            let dense: Vec<usize> = match c.raw.get("mlp_only_layers") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(v)) => v
                    .iter()
                    .map(|x| x.as_u64().map(|n| n as usize))
                    .collect::<Option<_>>()
                    .ok_or_else(|| c.bad("mlp_only_layers", "a list of layer indices"))?,
                Some(_) => return Err(c.bad("mlp_only_layers", "a list of layer indices")),
            };
            let dense_ffn = FfnSpec::Dense {
                ffn: c.usize_or("intermediate_size", 0)?,
            };
            for layer in 0..layers {
                let is_moe = experts > 0 && !dense.contains(&layer) && (layer + 1) % step == 0;
                let ffn = if is_moe {
                    FfnSpec::Moe(moe.clone())
                } else {
                    dense_ffn.clone()
                };
                push_layer(&mut spec.groups, &attention, ffn);
            }
        }
        Family::DeepseekV3 => {
            if (norm_eps - DEEPSEEK_LATENT_EPS).abs() > 1e-12 {
                return Err(c.unsupported(
                    "rms_norm_eps",
                    "transformers builds DeepSeek-V3's latent norms with eps 1e-6 whatever \
                     rms_norm_eps says, foldmoe's MLA uses the model's one norm_eps; only \
                     rms_norm_eps = 1e-6 converts exactly",
                ));
            }
            // DeepSeek-V3's MTP modules (`model.layers.{L + k}`), which
            // transformers does not run.
            spec.mtp_layers = c.usize_or("num_nextn_predict_layers", 0)?;
            if c.usize_or("pretraining_tp", 1)? != 1 {
                return Err(c.unsupported("pretraining_tp", "only 1 is the plain model"));
            }
            c.expect_str("scoring_func", "sigmoid")?;
            c.expect_str("topk_method", "noaux_tc")?;
            if c.usize_or("moe_layer_freq", 1)? != 1 {
                return Err(
                    c.unsupported("moe_layer_freq", "every layer past the dense ones is MoE")
                );
            }
            rope_interleave = c.bool_or("rope_interleave", true)?;
            fp8_block = c.fp8_block()?;
            let (nope, rope) = (c.usize("qk_nope_head_dim")?, c.usize("qk_rope_head_dim")?);
            if let Some(qk) = c.opt_usize("qk_head_dim")? {
                if qk != nope + rope {
                    return Err(c.bad("qk_head_dim", "qk_nope_head_dim + qk_rope_head_dim"));
                }
            }
            let mla = MlaSpec {
                q_lora_rank: c.opt_usize("q_lora_rank")?.unwrap_or(0),
                kv_lora_rank: c.usize("kv_lora_rank")?,
                qk_nope_head_dim: nope,
                qk_rope_head_dim: rope,
                v_head_dim: c.usize("v_head_dim")?,
            };
            let attention = AttentionSpec {
                heads,
                kv_heads: heads,
                head_dim: nope + rope,
                mla: Some(mla),
                qk_norm: false,
                precision: GemmPrecision::Bf16,
            };
            let top_k = c.usize("num_experts_per_tok")?;
            let (groups, group_top_k) = (
                c.opt_usize("n_group")?.unwrap_or(1),
                c.opt_usize("topk_group")?.unwrap_or(1),
            );
            // transformers scores a group by its best two experts;
            // foldmoe (as Megatron-Core) by its best top_k / topk_group.
            if groups > 1 && (group_top_k == 0 || top_k / group_top_k != 2) {
                return Err(c.unsupported(
                    "topk_group",
                    &format!(
                        "transformers scores each of the n_group = {groups} groups by its top \
                         2 experts, foldmoe by its top num_experts_per_tok / topk_group = \
                         {top_k} / {group_top_k}; they agree only when that is 2"
                    ),
                ));
            }
            if top_k > 1 && !c.bool_or("norm_topk_prob", true)? {
                return Err(c.unsupported(
                    "norm_topk_prob",
                    "foldmoe's sigmoid router renormalises the chosen scores when top_k > 1",
                ));
            }
            let expert_ffn = c.usize("moe_intermediate_size")?;
            let moe = MoeSpec {
                experts: c.usize("n_routed_experts")?,
                top_k,
                expert_ffn,
                shared_ffn: c.usize_or("n_shared_experts", 0)? * expert_ffn,
                shared_gate: false,
                router: RouterSpec {
                    score: ScoreFunction::Sigmoid,
                    pre_softmax: false,
                    scaling_factor: c.f64_or("routed_scaling_factor", 1.0)?,
                    groups,
                    group_top_k,
                    // DeepSeek-V3's aux-loss-free balancing: the bias is
                    // `e_score_correction_bias`, updated at rate 1e-3,
                    // with a small sequence-wise auxiliary loss.
                    expert_bias_rate: Some(1e-3),
                    load_balance: LoadBalance::SeqAux,
                    aux_coef: 1e-4,
                    z_loss_coef: 0.0,
                    // Its gate computes in f32 (`DeepseekV3TopkRouter`).
                    dtype: RouterDtype::Fp32,
                },
                capacity: None,
            };
            let dense = c.usize_or("first_k_dense_replace", 0)?.min(layers);
            if dense > 0 {
                let ffn = FfnSpec::Dense {
                    ffn: c.usize("intermediate_size")?,
                };
                spec.groups
                    .push(BlockGroup::new(dense, attention.clone(), ffn));
            }
            if layers > dense {
                spec.groups.push(BlockGroup::new(
                    layers - dense,
                    attention,
                    FfnSpec::Moe(moe),
                ));
            }
        }
    }
    spec.check().map_err(|errs| {
        let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        EngineError::Invalid(format!(
            "{what}: the model it describes breaks foldmoe's rules: {}",
            msgs.join("; ")
        ))
    })?;
    Ok(HfConfig {
        family,
        spec,
        raw,
        rope_interleave,
        fp8_block,
    })
}

/// Appends one layer to `groups`: to the last group when identical.
fn push_layer(groups: &mut Vec<BlockGroup>, attention: &AttentionSpec, ffn: FfnSpec) {
    match groups.last_mut() {
        Some(g) if g.ffn == ffn && &g.attention == attention => g.count += 1,
        _ => groups.push(BlockGroup::new(1, attention.clone(), ffn)),
    }
}

/// The family a foldmoe model exports as, and its `config.json`: MLA is
/// DeepSeek-V3, per-head q/k norms Qwen3-MoE, otherwise Mixtral. A model no
/// family represents (a shared expert without MLA, a gate on the shared
/// experts, ...) is an error naming what does not fit.
pub fn to_config(spec: &ModelSpec) -> Result<(Family, Map<String, Value>)> {
    let no = |what: &str| {
        EngineError::Invalid(format!(
            "model {}: {what}; it has no Hugging Face form among mixtral, qwen3_moe and \
             deepseek_v3",
            spec.name
        ))
    };
    let first = spec.groups.first().ok_or_else(|| no("no blocks"))?;
    let a = &first.attention;
    if spec.groups.iter().any(|g| &g.attention != a) {
        return Err(no("its blocks have different attention"));
    }
    let family = if a.mla.is_some() {
        Family::DeepseekV3
    } else if a.qk_norm {
        Family::Qwen3Moe
    } else {
        Family::Mixtral
    };
    let moes: Vec<&MoeSpec> = spec
        .groups
        .iter()
        .filter_map(|g| match &g.ffn {
            FfnSpec::Moe(m) => Some(m),
            FfnSpec::Dense { .. } => None,
        })
        .collect();
    let m = *moes.first().ok_or_else(|| no("it has no MoE block"))?;
    if moes.iter().any(|x| *x != m) {
        return Err(no("its MoE blocks differ"));
    }
    let dense_ffns: Vec<usize> = spec
        .groups
        .iter()
        .filter_map(|g| match g.ffn {
            FfnSpec::Dense { ffn } => Some(ffn),
            FfnSpec::Moe(_) => None,
        })
        .collect();
    if dense_ffns.windows(2).any(|w| w[0] != w[1]) {
        return Err(no("its dense blocks differ"));
    }
    if m.shared_gate {
        return Err(no("its shared experts are gated"));
    }
    let r = &m.router;
    let mut c = Map::new();
    let mut put = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    put("architectures", Value::from(vec![family.architecture()]));
    put("model_type", Value::from(family.model_type()));
    put("vocab_size", spec.vocab.into());
    put("hidden_size", spec.hidden.into());
    put("num_hidden_layers", spec.layers().into());
    put("num_attention_heads", a.heads.into());
    put("num_key_value_heads", a.kv_heads.into());
    put("max_position_embeddings", spec.seq_len.into());
    put("rms_norm_eps", spec.norm_eps.into());
    put("rope_parameters", rope_parameters(spec));
    put("tie_word_embeddings", spec.tied_embeddings.into());
    put("initializer_range", spec.init_std.into());
    put("hidden_act", "silu".into());
    put("num_experts_per_tok", m.top_k.into());
    put("dtype", "float32".into());
    let softmax = r.score == ScoreFunction::Softmax;
    match family {
        Family::Mixtral | Family::Qwen3Moe => {
            if !softmax || r.groups > 1 || r.expert_bias_rate.is_some() || r.scaling_factor != 1.0 {
                return Err(no("its router is not a plain softmax router"));
            }
            if m.shared_ffn > 0 {
                return Err(no("it has shared experts without MLA"));
            }
            if spec.mtp_layers > 0 {
                return Err(no("it has multi-token-prediction modules without MLA"));
            }
            put("head_dim", a.head_dim.into());
            put("sliding_window", Value::Null);
            put("router_aux_loss_coef", r.aux_coef.into());
        }
        Family::DeepseekV3 => {
            if softmax || r.expert_bias_rate.is_none() {
                return Err(no("a DeepSeek-V3 router is sigmoid with an expert bias"));
            }
            if m.shared_ffn % m.expert_ffn != 0 {
                return Err(no("its shared ffn is not a multiple of the expert ffn"));
            }
        }
    }
    match family {
        Family::Mixtral => {
            if !dense_ffns.is_empty() {
                return Err(no("Mixtral has no dense blocks"));
            }
            if r.pre_softmax {
                return Err(no("Mixtral renormalises the chosen experts' probabilities"));
            }
            put("num_local_experts", m.experts.into());
            put("intermediate_size", m.expert_ffn.into());
        }
        Family::Qwen3Moe => {
            let dense: Vec<usize> = (0..spec.layers())
                .filter(|&l| {
                    matches!(
                        spec.group_of_layer(l).map(|g| &g.ffn),
                        Some(FfnSpec::Dense { .. })
                    )
                })
                .collect();
            put("attention_bias", false.into());
            put("num_experts", m.experts.into());
            put("moe_intermediate_size", m.expert_ffn.into());
            put(
                "intermediate_size",
                dense_ffns.first().copied().unwrap_or(0).into(),
            );
            put("norm_topk_prob", (!r.pre_softmax).into());
            put("decoder_sparse_step", 1.into());
            put("mlp_only_layers", Value::from(dense));
            put("use_sliding_window", false.into());
        }
        Family::DeepseekV3 => {
            let mla = a.mla.as_ref().expect("DeepSeek-V3 is MLA");
            let dense = match &spec.groups[0].ffn {
                FfnSpec::Dense { .. } => spec.groups[0].count,
                FfnSpec::Moe(_) => 0,
            };
            if spec.groups.len() > 2 || (dense == 0 && spec.groups.len() > 1) {
                return Err(no(
                    "DeepSeek-V3's dense blocks come first, then only MoE ones",
                ));
            }
            if (spec.norm_eps - DEEPSEEK_LATENT_EPS).abs() > 1e-12 {
                return Err(no(
                    "its norm_eps is not 1e-6, the eps of transformers' latent norms",
                ));
            }
            if r.groups > 1 && m.top_k / r.group_top_k != 2 {
                return Err(no(
                    "its group-limited routing does not score groups by two experts",
                ));
            }
            put("attention_bias", false.into());
            put("n_routed_experts", m.experts.into());
            put("n_shared_experts", (m.shared_ffn / m.expert_ffn).into());
            put("moe_intermediate_size", m.expert_ffn.into());
            put(
                "intermediate_size",
                dense_ffns.first().copied().unwrap_or(0).into(),
            );
            put("first_k_dense_replace", dense.into());
            put("routed_scaling_factor", r.scaling_factor.into());
            put("n_group", r.groups.into());
            put("topk_group", r.group_top_k.into());
            put("norm_topk_prob", true.into());
            let q_lora = if mla.q_lora_rank == 0 {
                Value::Null
            } else {
                mla.q_lora_rank.into()
            };
            put("q_lora_rank", q_lora);
            put("kv_lora_rank", mla.kv_lora_rank.into());
            put("qk_nope_head_dim", mla.qk_nope_head_dim.into());
            put("qk_rope_head_dim", mla.qk_rope_head_dim.into());
            put("v_head_dim", mla.v_head_dim.into());
            put("rope_interleave", false.into());
            put("num_nextn_predict_layers", spec.mtp_layers.into());
        }
    }
    Ok((family, c))
}

/// transformers 5's `rope_parameters` of `spec`: the base, and YaRN's
/// fields when scaled (the mscales only when the spec has them).
fn rope_parameters(spec: &ModelSpec) -> Value {
    let mut p = Map::new();
    p.insert("rope_theta".into(), spec.rope_theta.into());
    match &spec.rope_scaling {
        None => {
            p.insert("rope_type".into(), "default".into());
        }
        Some(r) => {
            let RopeScalingType::Yarn = r.kind;
            p.insert("rope_type".into(), "yarn".into());
            p.insert("factor".into(), r.factor.into());
            p.insert(
                "original_max_position_embeddings".into(),
                r.original_max_position_embeddings.into(),
            );
            p.insert("beta_fast".into(), r.beta_fast.into());
            p.insert("beta_slow".into(), r.beta_slow.into());
            for (k, v) in [("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim)] {
                if let Some(v) = v {
                    p.insert(k.into(), v.into());
                }
            }
        }
    }
    Value::Object(p)
}

/// Typed reads of a config's fields, each error naming the field.
struct Fields<'a> {
    raw: &'a Map<String, Value>,
    what: &'a str,
}

impl Fields<'_> {
    fn bad(&self, key: &str, want: &str) -> EngineError {
        EngineError::Invalid(format!(
            "{}: field `{key}` = {} is not {want}",
            self.what,
            self.raw
                .get(key)
                .map_or("(missing)".into(), |v| v.to_string())
        ))
    }

    fn unsupported(&self, key: &str, why: &str) -> EngineError {
        EngineError::Invalid(format!(
            "{}: field `{key}` = {} cannot be represented: {why}",
            self.what,
            self.raw
                .get(key)
                .map_or("(missing)".into(), |v| v.to_string())
        ))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.raw.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.bad(key, "a whole number ≥ 0")),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| EngineError::Invalid(format!("{}: field `{key}` is missing", self.what)))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.raw.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(key, "a number")),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.raw.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, "true or false")),
        }
    }

    fn str(&self, key: &str) -> Result<&str> {
        self.raw
            .get(key)
            .and_then(Value::as_str)
            .ok_or_else(|| self.bad(key, "a string"))
    }

    /// A field that, when present, must be the string `want`.
    fn expect_str(&self, key: &str, want: &str) -> Result<()> {
        match self.raw.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if v.as_str() == Some(want) => Ok(()),
            Some(_) => Err(self.unsupported(key, &format!("foldmoe implements `{want}` only"))),
        }
    }

    /// A field that, when present, must be `want`.
    fn expect_bool(&self, key: &str, want: bool) -> Result<()> {
        match self.bool_or(key, want)? {
            v if v == want => Ok(()),
            _ => Err(self.unsupported(key, &format!("foldmoe implements {want} only"))),
        }
    }

    /// A sliding window no shorter than the sequence changes nothing.
    fn no_sliding_window(&self, seq_len: usize) -> Result<()> {
        match self.opt_usize("sliding_window")? {
            Some(w) if w < seq_len => Err(self.unsupported(
                "sliding_window",
                "foldmoe's attention is causal over the whole sequence",
            )),
            _ => Ok(()),
        }
    }

    /// The RoPE base and its scaling: `rope_parameters` (transformers 5)
    /// or `rope_scaling` with `rope_theta` (older files). YaRN reads into
    /// [`RopeScaling`]; any other type (linear, dynamic, longrope, llama3,
    /// ...) is an error naming it, as is a YaRN field foldmoe does not
    /// implement (an explicit `attention_factor`, `truncate = false`,
    /// partial rotary dims). Missing YaRN fields take transformers'
    /// defaults: `beta_fast` 32, `beta_slow` 1 (also for 0, as transformers
    /// reads them), `original_max_position_embeddings` the model's
    /// `max_position_embeddings`.
    fn rope(&self) -> Result<(f64, Option<RopeScaling>)> {
        let mut theta = None;
        let mut scaling: Option<(&str, RopeScaling)> = None;
        for key in ["rope_parameters", "rope_scaling"] {
            let p = match self.raw.get(key) {
                None | Some(Value::Null) => continue,
                Some(Value::Object(p)) => p,
                Some(_) => return Err(self.bad(key, "an object")),
            };
            let field = |f: &str| p.get(f).filter(|v| !v.is_null());
            let num = |f: &str| -> Result<Option<f64>> {
                field(f)
                    .map(|v| {
                        v.as_f64().ok_or_else(|| {
                            self.unsupported(key, &format!("its `{f}` = {v} is not a number"))
                        })
                    })
                    .transpose()
            };
            if let Some(f) = p.keys().find(|f| !ROPE_FIELDS.contains(&f.as_str())) {
                return Err(
                    self.unsupported(key, &format!("its field `{f}` is not one foldmoe knows"))
                );
            }
            if let Some(t) = num("rope_theta")? {
                theta.get_or_insert(t);
            }
            let kind = field("rope_type")
                .or_else(|| field("type"))
                .map(|v| v.as_str().unwrap_or("?"))
                .unwrap_or("default");
            match kind {
                "default" => continue,
                "yarn" => {}
                other => {
                    return Err(self.unsupported(
                        key,
                        &format!(
                            "rope_type `{other}`: foldmoe's rotary embedding is plain or YaRN \
                             (`default`, `yarn`)"
                        ),
                    ))
                }
            }
            if num("attention_factor")?.is_some() {
                return Err(self.unsupported(
                    key,
                    "an explicit YaRN `attention_factor`: foldmoe derives it from factor and \
                     the mscales",
                ));
            }
            if field("truncate").is_some_and(|v| v != &Value::Bool(true)) {
                return Err(self.unsupported(
                    key,
                    "YaRN `truncate` other than true: foldmoe rounds the ramp's ends",
                ));
            }
            if num("partial_rotary_factor")?.is_some_and(|f| f != 1.0) {
                return Err(self.unsupported(
                    key,
                    "a `partial_rotary_factor`: foldmoe rotates whole heads",
                ));
            }
            let factor =
                num("factor")?.ok_or_else(|| self.unsupported(key, "YaRN without its `factor`"))?;
            let original = match field("original_max_position_embeddings") {
                None => self.usize_or("max_position_embeddings", 4096)?,
                Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    self.unsupported(
                        key,
                        &format!(
                            "its `original_max_position_embeddings` = {v} is not a whole number"
                        ),
                    )
                })?,
            };
            let mut r = RopeScaling::yarn(factor, original);
            // transformers reads the betas with `or`: 0 is the default too.
            r.beta_fast = num("beta_fast")?
                .filter(|&b| b != 0.0)
                .unwrap_or(r.beta_fast);
            r.beta_slow = num("beta_slow")?
                .filter(|&b| b != 0.0)
                .unwrap_or(r.beta_slow);
            r.mscale = num("mscale")?;
            r.mscale_all_dim = num("mscale_all_dim")?;
            match &scaling {
                Some((first, s)) if *s != r => {
                    return Err(self
                        .unsupported(key, &format!("its YaRN differs from `{first}`'s; keep one")))
                }
                _ => scaling = Some((key, r)),
            }
        }
        let theta = match theta {
            Some(t) => t,
            None => self.f64_or("rope_theta", keywords::DEFAULT_ROPE_THETA)?,
        };
        Ok((theta, scaling.map(|(_, r)| r)))
    }

    /// GQA attention: `head_dim` (default `hidden / heads`), kv heads.
    fn gqa(&self, hidden: usize, heads: usize, qk_norm: bool) -> Result<AttentionSpec> {
        let head_dim = match self.opt_usize("head_dim")? {
            Some(d) => d,
            None if heads > 0 => hidden / heads,
            None => 0,
        };
        Ok(AttentionSpec {
            heads,
            kv_heads: self.usize_or("num_key_value_heads", heads)?,
            head_dim,
            mla: None,
            qk_norm,
            precision: GemmPrecision::Bf16,
        })
    }

    /// `quantization_config` of DeepSeek's fp8 release: e4m3 weights with
    /// one `weight_scale_inv` per block.
    fn fp8_block(&self) -> Result<Option<[usize; 2]>> {
        let Some(q) = self.raw.get("quantization_config") else {
            return Ok(None);
        };
        let q = q
            .as_object()
            .ok_or_else(|| self.bad("quantization_config", "an object"))?;
        let method = q.get("quant_method").and_then(Value::as_str);
        let fmt = q.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
        if method != Some("fp8") || fmt != "e4m3" {
            return Err(self.unsupported(
                "quantization_config",
                "foldmoe dequantises fp8 (e4m3) block-scaled weights only",
            ));
        }
        let block = q
            .get("weight_block_size")
            .and_then(Value::as_array)
            .and_then(|v| Some([v.first()?.as_u64()? as usize, v.get(1)?.as_u64()? as usize]))
            .filter(|b| b[0] > 0 && b[1] > 0)
            .ok_or_else(|| {
                self.bad(
                    "quantization_config",
                    "one with weight_block_size [rows, cols]",
                )
            })?;
        Ok(Some(block))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(family: &str) -> Map<String, Value> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hf")
            .join(family)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn parse_with(family: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> Result<HfConfig> {
        let mut c = fixture(family);
        edit(&mut c);
        parse(&Value::Object(c).to_string(), "config.json")
    }

    fn error(family: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> String {
        let e = parse_with(family, edit).expect_err("an error").to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        e
    }

    #[test]
    fn fixtures_read_into_specs() {
        let m = parse_with("mixtral", |_| {}).unwrap();
        assert_eq!(m.family, Family::Mixtral);
        assert_eq!(m.spec.layers(), 2);
        assert_eq!(m.spec.rope_theta, 1e6);
        let q = parse_with("qwen3_moe", |_| {}).unwrap();
        assert!(q.spec.groups[0].attention.qk_norm);
        assert_eq!(q.spec.groups[0].attention.head_dim, 16);
        let d = parse_with("deepseek_v3", |_| {}).unwrap();
        assert_eq!(d.spec.groups.len(), 2, "a dense group, then MoE");
        assert!(d.rope_interleave);
        let FfnSpec::Moe(moe) = &d.spec.groups[1].ffn else {
            panic!("MoE second")
        };
        assert_eq!((moe.router.groups, moe.router.group_top_k), (4, 2));
        assert_eq!(moe.router.scaling_factor, 2.5);
        assert_eq!(moe.shared_ffn, 16);
    }

    #[test]
    fn qwen3_dense_layers_follow_mlp_only_layers_and_the_sparse_step() {
        let q = parse_with("qwen3_moe", |c| {
            c.insert("num_hidden_layers".into(), 5.into());
            c.insert("mlp_only_layers".into(), serde_json::json!([0]));
            c.insert("decoder_sparse_step".into(), 2.into());
        })
        .unwrap();
        let moe: Vec<bool> = (0..5)
            .map(|l| matches!(q.spec.group_of_layer(l).unwrap().ffn, FfnSpec::Moe(_)))
            .collect();
        assert_eq!(moe, vec![false, true, false, true, false]);
    }

    #[test]
    fn unknown_and_unrepresentable_fields_are_named() {
        let e = error("mixtral", |c| {
            c.insert("attn_logit_softcapping".into(), 30.into());
        });
        assert!(e.contains("field `attn_logit_softcapping`"), "{e}");
        for kind in ["linear", "dynamic", "longrope", "llama3"] {
            let e = error("deepseek_v3", |c| {
                c.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_type": kind, "factor": 4, "rope_theta": 10000}),
                );
            });
            assert!(
                e.contains("`rope_parameters`") && e.contains(&format!("`{kind}`")),
                "{e}"
            );
        }
        for (extra, want) in [
            (
                serde_json::json!({"attention_factor": 1.5}),
                "attention_factor",
            ),
            (serde_json::json!({"truncate": false}), "truncate"),
            (serde_json::json!({"low_freq_factor": 1}), "low_freq_factor"),
        ] {
            let e = error("qwen3_moe_yarn", |c| {
                let p = c["rope_parameters"].as_object_mut().unwrap();
                p.extend(extra.as_object().unwrap().clone());
            });
            assert!(e.contains("`rope_parameters`") && e.contains(want), "{e}");
        }
        let e = error("qwen3_moe_yarn", |c| {
            c["rope_parameters"]["beta_slow"] = 40.into();
        });
        assert!(
            e.contains("rope_scaling.beta_fast") && e.contains("beta_slow = 40"),
            "{e}"
        );
        let e = error("mixtral", |c| {
            c.insert("sliding_window".into(), 16.into());
        });
        assert!(e.contains("`sliding_window`"), "{e}");
        let e = error("qwen3_moe", |c| {
            c.insert("hidden_act".into(), "gelu".into());
        });
        assert!(e.contains("`hidden_act`"), "{e}");
        let e = error("deepseek_v3", |c| {
            c.insert("topk_group".into(), 1.into());
        });
        assert!(e.contains("`topk_group`") && e.contains("top 2"), "{e}");
        let e = error("qwen3_moe", |c| {
            c.remove("hidden_size");
        });
        assert!(e.contains("`hidden_size` is missing"), "{e}");
        let e = error("qwen3_moe", |c| {
            c.insert("model_type".into(), "llama".into());
        });
        assert!(e.contains("model_type `llama`"), "{e}");
    }

    /// A spec read from a config writes the same model back.
    #[test]
    fn specs_write_back_as_configs_that_read_the_same() {
        for family in [
            "mixtral",
            "qwen3_moe",
            "deepseek_v3",
            "qwen3_moe_yarn",
            "deepseek_v3_yarn_mtp",
        ] {
            let cfg = parse_with(family, |_| {}).unwrap();
            let (fam, raw) = to_config(&cfg.spec).unwrap();
            assert_eq!(fam, cfg.family);
            let back = parse(&Value::Object(raw).to_string(), "exported").unwrap();
            let mut want = cfg.spec.clone();
            want.name = back.spec.name.clone();
            assert_eq!(back.spec, want, "{family}");
        }
    }

    /// YaRN reads from transformers 5's `rope_parameters` and from the
    /// older `rope_scaling` + `rope_theta` the same way, with
    /// transformers' defaults for what is left out.
    #[test]
    fn yarn_reads_from_either_spelling() {
        let new = parse_with("deepseek_v3_yarn_mtp", |_| {}).unwrap();
        let r = new.spec.rope_scaling.clone().expect("YaRN");
        assert_eq!(r.kind, RopeScalingType::Yarn);
        assert_eq!((r.factor, r.original_max_position_embeddings), (4.0, 8));
        assert_eq!((r.beta_fast, r.beta_slow), (0.5, 0.05));
        assert_eq!((r.mscale, r.mscale_all_dim), (Some(1.0), Some(0.5)));
        assert_eq!(new.spec.rope_theta, 100.0);
        assert_eq!(new.spec.mtp_layers, 1);
        let old = parse_with("deepseek_v3_yarn_mtp", |c| {
            let Some(Value::Object(mut p)) = c.remove("rope_parameters") else {
                panic!("an object")
            };
            c.insert("rope_theta".into(), p.remove("rope_theta").unwrap());
            let kind = p.remove("rope_type").unwrap();
            p.insert("type".into(), kind);
            c.insert("rope_scaling".into(), Value::Object(p));
        })
        .unwrap();
        assert_eq!(old.spec, new.spec);
        let bare = parse_with("qwen3_moe", |c| {
            c.insert(
                "rope_scaling".into(),
                serde_json::json!({"type": "yarn", "factor": 4, "beta_fast": 0}),
            );
        })
        .unwrap();
        // original_max_position_embeddings: the model's max_position_embeddings.
        assert_eq!(
            bare.spec.rope_scaling,
            Some(RopeScaling::yarn(4.0, bare.spec.seq_len))
        );
    }

    /// The published DeepSeek-V3 `config.json` (deepseek-ai/DeepSeek-V3 on
    /// the Hugging Face hub; its weights are too large for a test) reads
    /// into a spec: YaRN of factor 40, one MTP module, fp8 blocks.
    #[test]
    fn the_published_deepseek_v3_config_reads() {
        let text = r#"{
          "architectures": ["DeepseekV3ForCausalLM"],
          "attention_bias": false, "attention_dropout": 0.0,
          "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                       "AutoModel": "modeling_deepseek.DeepseekV3Model",
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
          "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
          "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
          "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
          "max_position_embeddings": 163840, "model_type": "deepseek_v3",
          "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
          "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
          "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
          "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": [128, 128]},
          "rms_norm_eps": 1e-06,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                           "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
          "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4,
          "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
          "transformers_version": "4.46.3", "use_cache": true, "v_head_dim": 128,
          "vocab_size": 129280
        }"#;
        let cfg = parse(text, "DeepSeek-V3/config.json").unwrap();
        let s = &cfg.spec;
        assert_eq!((s.layers(), s.mtp_layers, s.vocab), (61, 1, 129280));
        let r = s.rope_scaling.as_ref().expect("YaRN");
        assert_eq!((r.factor, r.original_max_position_embeddings), (40.0, 4096));
        assert_eq!((r.beta_fast, r.beta_slow), (32.0, 1.0));
        assert_eq!((r.mscale, r.mscale_all_dim), (Some(1.0), Some(1.0)));
        // m(40, 1)² = (0.1·ln 40 + 1)²: MLA's softmax scale correction.
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((r.softmax_scale_factor() - m * m).abs() < 1e-12);
        assert_eq!(cfg.fp8_block, Some([128, 128]));
        assert_eq!(s.param_counts().0 / 1_000_000_000, 671);
        let (_, back) = to_config(s).unwrap();
        let again = parse(&Value::Object(back).to_string(), "exported").unwrap();
        assert_eq!(again.spec.rope_scaling, s.rope_scaling);
        assert_eq!(again.spec.mtp_layers, 1);
    }
}
