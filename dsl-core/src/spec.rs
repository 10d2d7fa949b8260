//! The model IR: what a model is, independent of how it is laid out or run.
//!
//! Both front ends (the `#[moe_model]` macro and config files) produce a
//! [`ModelSpec`]; [`ModelSpec::check`] holds the model rules (DESIGN §3,
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
    /// Whether the LM head reuses the embedding table.
    pub tied_embeddings: bool,
    /// Standard deviation of the normal initialisation of weights.
    pub init_std: f64,
    /// Block groups, first to last.
    pub groups: Vec<BlockGroup>,
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
}

/// Multi-head / grouped-query attention dims (MHA when `kv_heads == heads`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
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

/// Load-balancing loss kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadBalance {
    /// No load-balancing loss.
    None,
    /// `coef·E·Σ f_e P_e` over the micro-batch.
    Aux,
    /// The same per sequence, averaged over sequences.
    SeqAux,
    /// The same over the data-parallel group and accumulation steps.
    GlobalAux,
}

/// Router configuration (DESIGN §4, Route).
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

impl ModelSpec {
    /// Total number of blocks.
    pub fn layers(&self) -> usize {
        self.groups.iter().map(|g| g.count).sum()
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
            }
        }
        if self.norm_eps.is_nan() || self.norm_eps <= 0.0 {
            err(
                "norm_eps".into(),
                format!("norm_eps = {}; it must be > 0", self.norm_eps),
            );
        }
        if self.groups.is_empty() {
            err(
                "groups".into(),
                "the model has no blocks; declare at least one group".into(),
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
                err(
                    format!("{p}.attention"),
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
            if a.head_dim % 2 != 0 {
                err(
                    format!("{p}.attention.head_dim"),
                    format!(
                        "head_dim = {} is odd; rotary embedding needs an even head_dim",
                        a.head_dim
                    ),
                );
            }
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

/// The routing rules of DESIGN §3.
fn check_moe(m: &MoeSpec, p: &str, err: &mut impl FnMut(String, String)) {
    let r = &m.router;
    if m.experts == 0 || m.expert_ffn == 0 {
        err(
            p.into(),
            format!(
                "experts = {}, expert_ffn = {}; both must be at least 1",
                m.experts, m.expert_ffn
            ),
        );
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
                        "top_k = {} exceeds the {reachable} experts in the {} chosen groups; raise group_top_k or lower top_k",
                        m.top_k, r.group_top_k
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
    if m.top_k == 1 && r.score == ScoreFunction::Softmax && !r.pre_softmax {
        err(
            format!("{p}.router.pre_softmax"),
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
        BlockGroup {
            count: 1,
            attention: AttentionSpec {
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
            },
            ffn: FfnSpec::Moe(MoeSpec {
                experts: 8,
                top_k: 2,
                expert_ffn: 16,
                shared_ffn: 0,
                shared_gate: false,
                router: RouterSpec::default(),
                capacity: None,
            }),
        }
    }

    fn spec_with(group: BlockGroup) -> ModelSpec {
        ModelSpec {
            name: "t".into(),
            vocab: 16,
            hidden: 32,
            seq_len: 8,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            tied_embeddings: false,
            init_std: 0.02,
            groups: vec![group],
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
    fn capacity_rounds_up() {
        let c = CapacitySpec {
            factor: 1.25,
            drop_policy: DropPolicySpec::Probs,
            pad_to_capacity: false,
        };
        assert_eq!(c.capacity(10, 2, 8), 4); // 20/8*1.25 = 3.125 -> 4
    }
}
