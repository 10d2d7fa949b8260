//! Each layout has its own name: two names that make the same enum variant
//! are refused.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1),
    layout(name = "gpu-8", world = 8),
    layout(name = "gpu_8", world = 8))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4),
        moe(experts = 8, top_k = 2, expert_ffn = 8))]
    moe: Blocks,
}

fn main() {}
