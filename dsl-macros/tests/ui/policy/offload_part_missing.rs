//! An offload part must exist in the group; the error points at the part.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4),
        dense(ffn = 32), offload(attn_norm, expert_fc1))]
    moe: Blocks,
}

fn main() {}
