//! Tensorwise fp8 (and fp32) GEMMs are not executed yet: asking for them is
//! an error, not a key accepted and ignored.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 16),
        moe(experts = 8, top_k = 2, expert_ffn = 32), precision = fp8)]
    moe: Blocks,
}

fn main() {}
