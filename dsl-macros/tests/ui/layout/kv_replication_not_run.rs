//! tp above kv_heads would replicate key/value heads, which the engine does not run.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1),
    layout(name = "gpu4", world = 4, tp = 4))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4),
        moe(experts = 8, top_k = 2, expert_ffn = 8))]
    moe: Blocks,
}

fn main() {}
