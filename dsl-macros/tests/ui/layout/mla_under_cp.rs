//! MLA attention runs with cp = 1 only.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1),
    layout(name = "gpu2", world = 2, cp = 2))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, mla(kv_lora_rank = 8, qk_nope_head_dim = 4,
            qk_rope_head_dim = 4, v_head_dim = 4)),
        moe(experts = 8, top_k = 2, expert_ffn = 8))]
    moe: Blocks,
}

fn main() {}
