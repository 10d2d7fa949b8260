//! YaRN's ramp runs from beta_slow up to beta_fast.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    rope_scaling(rope_type = yarn, factor = 40, original_max_position_embeddings = 4,
        beta_fast = 1, beta_slow = 32),
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4),
        moe(experts = 8, top_k = 2, expert_ffn = 8))]
    moe: Blocks,
}

fn main() {}
