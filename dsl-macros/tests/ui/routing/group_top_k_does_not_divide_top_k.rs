//! A group scores the sum of its best top_k / group_top_k experts.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4),
        moe(experts = 8, top_k = 4, expert_ffn = 8, groups = 4, group_top_k = 3))]
    moe: Blocks,
}

fn main() {}
