//! The multiple of 16 must hold on each rank, after tensor parallelism splits the FFN.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1),
    layout(name = "gpu2", world = 2, tp = 2))]
pub struct Ui {
    #[blocks(count = 1, attention(heads = 4, kv_heads = 2, head_dim = 16), dense(ffn = 48),
        precision = fp8_blockwise)]
    dense: Blocks,
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 16),
        moe(experts = 8, top_k = 2, expert_ffn = 8))]
    moe: Blocks,
}

fn main() {}
