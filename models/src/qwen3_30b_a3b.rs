//! Qwen3-30B-A3B (Qwen team, "Qwen3 Technical Report", 2025): 48 MoE blocks
//! with 128 fine-grained experts, top-8, no shared expert, GQA 32:4 with
//! head dim 128.
//!
//! Dims from Hugging Face `Qwen/Qwen3-30B-A3B/config.json` (`hidden_size`
//! 2048, `num_hidden_layers` 48, `num_attention_heads` 32,
//! `num_key_value_heads` 4, `head_dim` 128, `num_experts` 128,
//! `num_experts_per_tok` 8, `moe_intermediate_size` 768, `vocab_size` 151936,
//! `rope_theta` 1e6, `rms_norm_eps` 1e-6, `norm_topk_prob` true,
//! `router_aux_loss_coef` 0.001). Published size: 30.5 B parameters, 3.3 B
//! active. Every attention block RMS-normalises each query and key head
//! before RoPE (`qk_norm`, transformers' `q_norm`/`k_norm`: 2 × 128 weights
//! per block, 12 288 in all).

use foldmoe_macros::moe_model;

#[moe_model(crate = "foldmoe_core", name = "qwen3-30b-a3b", vocab = 151936, hidden = 2048, seq_len = 4096,
    norm_eps = 1e-6, rope_theta = 1e6,
    // 32 GPUs: tp 2 × pp 2 → dp 8 for attention; ep 8 × pp 2 → edp 2 for experts.
    layout(name = "h100x32", world = 32, tp = 2, pp = 2, ep = 8, etp = 1))]
/// Qwen3-30B-A3B at full size.
pub struct Qwen3A3b {
    /// All 48 blocks are MoE blocks.
    #[blocks(count = 48, attention(heads = 32, kv_heads = 4, head_dim = 128, qk_norm = true),
        moe(experts = 128, top_k = 8, expert_ffn = 768, load_balance = global_aux, aux_coef = 1e-3))]
    pub layers: Blocks,
}

#[moe_model(
    crate = "foldmoe_core",
    name = "qwen3-30b-a3b-small",
    vocab = 256,
    hidden = 128,
    seq_len = 128,
    norm_eps = 1e-6,
    rope_theta = 1e6,
    layout(name = "cpu", world = 1)
)]
/// Qwen3-30B-A3B's shape (many small experts, top-k 4, GQA 4:1) on a CPU.
pub struct Qwen3A3bSmall {
    /// Four MoE blocks.
    #[blocks(count = 4, attention(heads = 4, kv_heads = 1, head_dim = 32, qk_norm = true),
        moe(experts = 16, top_k = 4, expert_ffn = 64, load_balance = aux, aux_coef = 1e-3))]
    pub layers: Blocks,
}
