//! Under fp8 GEMMs the experts keep their activation as its fp8 operand:
//! compressing it again is refused rather than silently skipped.
use foldmoe_macros::moe_model;

#[moe_model(name = "ui", vocab = 32, hidden = 16, seq_len = 8,
    layout(name = "cpu", world = 1))]
pub struct Ui {
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 16),
        moe(experts = 8, top_k = 2, expert_ffn = 32), precision = fp8_blockwise,
        store_fp8(moe_act))]
    moe: Blocks,
}

fn main() {}
