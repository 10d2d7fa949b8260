//! `tiny`: the default model, a small MoE language model over bytes that
//! trains on a CPU in minutes — about 2.9 M parameters, 0.86 M active per
//! token: a dense first block, then three MoE blocks with 16 routed experts,
//! top-2, and one shared expert.

use foldmoe_macros::moe_model;

#[moe_model(
    crate = "foldmoe_core",
    name = "tiny",
    vocab = 256,
    hidden = 128,
    seq_len = 128,
    norm_eps = 1e-5,
    rope_theta = 10000.0,
    tied_embeddings = false,
    init_std = 0.02,
    layout(name = "cpu", world = 1),
    layout(name = "cpu-ep4", world = 4, ep = 4)
)]
/// The default model (see the module docs).
pub struct Tiny {
    /// One dense block first, as DeepSeek does, so routing sees mixed features.
    #[blocks(
        count = 1,
        attention(heads = 4, kv_heads = 2, head_dim = 32),
        dense(ffn = 384)
    )]
    pub dense: Blocks,
    /// Three MoE blocks: 16 experts, top-2, one shared expert.
    #[blocks(count = 3, attention(heads = 4, kv_heads = 2, head_dim = 32),
        moe(experts = 16, top_k = 2, expert_ffn = 128, shared_experts = 1,
            load_balance = aux, aux_coef = 1e-2, z_loss = 1e-3))]
    pub moe: Blocks,
}
