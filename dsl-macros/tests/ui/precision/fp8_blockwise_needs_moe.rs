//! Blockwise fp8 runs a group's routed experts: a dense group has none, so
//! the key would change nothing there.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 1, attention(heads = 4, kv_heads = 2, head_dim = 16), dense(ffn = 48),
        precision = fp8_blockwise)]
    dense: Blocks,
}

fn main() {}
