//! DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024): multi-head
//! latent attention, 3 dense blocks then 58 MoE blocks with 1 shared and 256
//! routed experts (top-8 by sigmoid scores, limited to the best 4 of 8 expert
//! groups, aux-loss-free balancing by expert bias plus a small sequence-wise
//! aux loss), and one multi-token-prediction module.
//!
//! Dims from Hugging Face `deepseek-ai/DeepSeek-V3/config.json`
//! (`hidden_size` 7168, `intermediate_size` 18432, `moe_intermediate_size`
//! 2048, `num_hidden_layers` 61, `first_k_dense_replace` 3,
//! `num_attention_heads` 128, `q_lora_rank` 1536, `kv_lora_rank` 512,
//! `qk_nope_head_dim` 128, `qk_rope_head_dim` 64, `v_head_dim` 128,
//! `n_routed_experts` 256, `n_shared_experts` 1, `num_experts_per_tok` 8,
//! `n_group` 8, `topk_group` 4, `routed_scaling_factor` 2.5,
//! `scoring_func` sigmoid, `vocab_size` 129280, `rms_norm_eps` 1e-6,
//! `num_nextn_predict_layers` 1) and the report (bias update speed 0.001,
//! sequence-wise balance factor 0.0001, FP8 blockwise training, 4096-token
//! pre-training sequences). Published size: 671 B parameters in the main model
//! (plus 14 B in the MTP module), 37 B active.
//!
//! The report trains its routed experts' GEMMs in blockwise FP8: `train
//! --fp8` runs them so (`precision = fp8_blockwise` on the MoE group, which
//! subsumes its `store_fp8(moe_act)`). The declaration keeps bf16, so an
//! imported checkpoint reproduces the reference implementation's logits.

use foldmoe_macros::moe_model;

#[moe_model(crate = "foldmoe_core", name = "deepseek-v3", vocab = 129280, hidden = 7168, seq_len = 4096,
    norm_eps = 1e-6, rope_theta = 10000.0, tied_embeddings = false, mtp_layers = 1,
    // The report's training layout: pp 16 × ep 64 over 1024 GPUs (dp 64 for
    // attention, no tensor parallelism). 61 blocks over 16 stages: the first
    // stage (embedding) gets 3, the last (head and MTP) 2.
    layout(name = "h100x1024", world = 1024, pp = 16, ep = 64,
        pp_layers = [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]))]
/// DeepSeek-V3 at full size.
pub struct DeepSeekV3 {
    /// The first three blocks have a dense MLP.
    #[blocks(
        count = 3,
        attention(
            heads = 128,
            mla(
                q_lora_rank = 1536,
                kv_lora_rank = 512,
                qk_nope_head_dim = 128,
                qk_rope_head_dim = 64,
                v_head_dim = 128
            )
        ),
        dense(ffn = 18432),
        recompute(mla_up_proj)
    )]
    pub dense: Blocks,
    /// 58 MoE blocks.
    #[blocks(count = 58,
        attention(heads = 128, mla(q_lora_rank = 1536, kv_lora_rank = 512,
            qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128)),
        moe(experts = 256, top_k = 8, expert_ffn = 2048, shared_experts = 1,
            score = sigmoid, expert_bias = 1e-3, groups = 8, group_top_k = 4,
            scaling_factor = 2.5, load_balance = seq_aux, aux_coef = 1e-4, router_dtype = fp32),
        recompute(mla_up_proj, moe_act), store_fp8(moe_act))]
    pub moe: Blocks,
}

#[moe_model(
    crate = "foldmoe_core",
    name = "deepseek-v3-small",
    vocab = 256,
    hidden = 128,
    seq_len = 128,
    norm_eps = 1e-6,
    rope_theta = 10000.0,
    mtp_layers = 1,
    layout(name = "cpu", world = 1)
)]
/// DeepSeek-V3's shape (MLA, a dense block first, shared + 16 routed experts,
/// sigmoid group-limited routing with expert bias) on a CPU.
pub struct DeepSeekV3Small {
    /// One dense block.
    #[blocks(
        count = 1,
        attention(
            heads = 4,
            mla(
                q_lora_rank = 64,
                kv_lora_rank = 32,
                qk_nope_head_dim = 16,
                qk_rope_head_dim = 16,
                v_head_dim = 16
            )
        ),
        dense(ffn = 256)
    )]
    pub dense: Blocks,
    /// Three MoE blocks.
    #[blocks(count = 3,
        attention(heads = 4, mla(q_lora_rank = 64, kv_lora_rank = 32,
            qk_nope_head_dim = 16, qk_rope_head_dim = 16, v_head_dim = 16)),
        moe(experts = 16, top_k = 4, expert_ffn = 32, shared_experts = 1,
            score = sigmoid, expert_bias = 1e-3, groups = 4, group_top_k = 2,
            scaling_factor = 2.5, load_balance = seq_aux, aux_coef = 1e-4, router_dtype = fp32))]
    pub moe: Blocks,
}
