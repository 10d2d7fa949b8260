//! Qwen3-235B-A22B (Qwen team, "Qwen3 Technical Report", 2025): 94 MoE
//! blocks with 128 experts, top-8, GQA 64:4 with head dim 128.
//!
//! Dims from Hugging Face `Qwen/Qwen3-235B-A22B/config.json` (`hidden_size`
//! 4096, `num_hidden_layers` 94, `num_attention_heads` 64,
//! `num_key_value_heads` 4, `head_dim` 128, `num_experts` 128,
//! `num_experts_per_tok` 8, `moe_intermediate_size` 1536, `vocab_size`
//! 151936, `rope_theta` 1e6, `rms_norm_eps` 1e-6, `router_aux_loss_coef`
//! 0.001). Published size: 235 B parameters, 22 B active. Every attention
//! block RMS-normalises each query and key head before RoPE (`qk_norm`,
//! transformers' `q_norm`/`k_norm`: 2 × 128 weights per block, 24 064 in
//! all).

use foldmoe_macros::moe_model;

#[moe_model(crate = "foldmoe_core", name = "qwen3-235b-a22b", vocab = 151936, hidden = 4096, seq_len = 4096,
    norm_eps = 1e-6, rope_theta = 1e6,
    // 256 GPUs: tp 4 × pp 8 → dp 8; ep 32 × pp 8 → edp 1. 94 blocks do not
    // split evenly over 8 stages: the first stage, which also holds the
    // embedding, gets 10.
    layout(name = "h100x256", world = 256, tp = 4, pp = 8, ep = 32, etp = 1,
        pp_layers = [10, 12, 12, 12, 12, 12, 12, 12]))]
/// Qwen3-235B-A22B at full size.
pub struct Qwen3A22b {
    /// All 94 blocks are MoE blocks.
    #[blocks(count = 94, attention(heads = 64, kv_heads = 4, head_dim = 128, qk_norm = true),
        moe(experts = 128, top_k = 8, expert_ffn = 1536, load_balance = global_aux, aux_coef = 1e-3),
        recompute(moe_act))]
    pub layers: Blocks,
}

#[moe_model(
    crate = "foldmoe_core",
    name = "qwen3-235b-a22b-small",
    vocab = 256,
    hidden = 128,
    seq_len = 128,
    norm_eps = 1e-6,
    rope_theta = 1e6,
    layout(name = "cpu", world = 1)
)]
/// Qwen3-235B-A22B's shape (128→32 experts, top-8, GQA 16:1→4:1) on a CPU.
pub struct Qwen3A22bSmall {
    /// Six MoE blocks.
    #[blocks(count = 6, attention(heads = 8, kv_heads = 2, head_dim = 16, qk_norm = true),
        moe(experts = 32, top_k = 8, expert_ffn = 32, load_balance = aux, aux_coef = 1e-3))]
    pub layers: Blocks,
}
