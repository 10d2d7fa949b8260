//! A precision the attention's projections cannot run in is refused, not
//! ignored.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 16, precision = fp8),
        dense(ffn = 32))]
    dense: Blocks,
}

fn main() {}
