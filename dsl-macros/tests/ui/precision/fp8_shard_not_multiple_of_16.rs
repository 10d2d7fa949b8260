//! The multiple of 16 must hold on each rank, after expert tensor
//! parallelism splits the experts' FFN.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1),
    layout(name = "gpu4", world = 4, etp = 4))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 16),
        moe(experts = 8, top_k = 2, expert_ffn = 32), precision = fp8_blockwise)]
    moe: Blocks,
}

fn main() {}
