//! Mixtral-8x7B (Jiang et al., "Mixtral of Experts", 2024): 32 blocks, each
//! with GQA attention (32 query / 8 key-value heads) and 8 SwiGLU experts of
//! which a token uses 2, routed by softmax over the chosen two.
//!
//! Dims from Hugging Face `mistralai/Mixtral-8x7B-v0.1/config.json`
//! (`hidden_size` 4096, `intermediate_size` 14336, `num_hidden_layers` 32,
//! `num_attention_heads` 32, `num_key_value_heads` 8, `num_local_experts` 8,
//! `num_experts_per_tok` 2, `vocab_size` 32000, `rope_theta` 1e6,
//! `rms_norm_eps` 1e-5, `router_aux_loss_coef` 0.02). Published size: 46.7 B
//! parameters, 12.9 B active per token.

use foldmoe_macros::moe_model;

#[moe_model(crate = "foldmoe_core", name = "mixtral-8x7b", vocab = 32000, hidden = 4096, seq_len = 4096,
    norm_eps = 1e-5, rope_theta = 1e6, tied_embeddings = false,
    // 64 GPUs: tp 2 × pp 4 → dp 8 for attention; ep 8 × pp 4 → edp 2 for experts.
    layout(name = "h100x64", world = 64, tp = 2, pp = 4, ep = 8, etp = 1))]
/// Mixtral-8x7B at full size.
pub struct Mixtral8x7b {
    /// All 32 blocks are MoE blocks.
    #[blocks(count = 32, attention(heads = 32, kv_heads = 8, head_dim = 128),
        moe(experts = 8, top_k = 2, expert_ffn = 14336, score = softmax,
            load_balance = aux, aux_coef = 0.02))]
    pub layers: Blocks,
}

#[moe_model(
    crate = "foldmoe_core",
    name = "mixtral-8x7b-small",
    vocab = 256,
    hidden = 128,
    seq_len = 128,
    norm_eps = 1e-5,
    rope_theta = 1e6,
    layout(name = "cpu", world = 1)
)]
/// Mixtral's shape (8 experts, top-2, GQA 4:1, no shared expert) at a size
/// that trains on a CPU.
pub struct Mixtral8x7bSmall {
    /// Four MoE blocks.
    #[blocks(count = 4, attention(heads = 4, kv_heads = 1, head_dim = 32),
        moe(experts = 8, top_k = 2, expert_ffn = 256, load_balance = aux, aux_coef = 0.02))]
    pub layers: Blocks,
}
