//! W % (tp·cp·pp) == 0: the attention mesh must fill the world.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1),
    layout(name = "gpu6", world = 6, tp = 4))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 4, head_dim = 4),
        moe(experts = 8, top_k = 2, expert_ffn = 8))]
    moe: Blocks,
}

fn main() {}
