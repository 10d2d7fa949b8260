//! A small model declared, built on the CPU under its single-rank layout, its
//! typed group accessors and layout enum used; the multi-rank layout is valid
//! but refused at build time until the parallel runtime lands. Its vocabulary
//! (31) does not divide tp = 2: that is padded, not refused (DESIGN §3), and
//! the checked layout says so.
use foldmoe_core::engine::declared::{LayoutChoice, MoeModel};
use foldmoe_core::layout;
use foldmoe_core::spec::FfnSpec;
use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::DType;
use foldmoe_macros::moe_model;

#[moe_model(name = "pass-moe", vocab = 31, hidden = 16, seq_len = 8, norm_eps = 1e-6,
    layout(name = "cpu", world = 1),
    layout(name = "h100x8", world = 8, tp = 2, ep = 4, order = "tp-cp-ep-dp-pp"))]
/// A model used by the pass test.
pub struct PassMoe {
    /// The dense first block.
    #[blocks(count = 1, attention(heads = 4, kv_heads = 2, head_dim = 4), dense(ffn = 32))]
    dense: Blocks,
    #[blocks(count = 2, attention(heads = 4, kv_heads = 2, head_dim = 4),
        moe(experts = 4, top_k = 2, expert_ffn = 8, shared_experts = 1, shared_gate, z_loss = 1e-3,
            capacity(factor = 1.25, drop = position, pad = true)),
        recompute(moe_act, norm), offload(expert_fc1), precision = fp32)]
    moe: Blocks,
}

fn main() {
    let spec = <PassMoe<Cpu> as MoeModel<Cpu>>::spec();
    assert_eq!(spec.layers(), 3);
    match &spec.groups[1].ffn {
        FfnSpec::Moe(m) => assert_eq!(m.shared_ffn, 8),
        FfnSpec::Dense { .. } => panic!("group 1 is MoE"),
    }
    assert_eq!(PassMoeLayout::ALL, &[PassMoeLayout::Cpu, PassMoeLayout::H100x8]);
    assert_eq!(PassMoeLayout::H100x8.spec().ep, 4);
    let h100 = layout::check(&PassMoeLayout::H100x8.spec(), &spec).unwrap();
    assert_eq!(h100.padded_vocab, 32);
    assert!(h100.notes.iter().any(|n| n.contains("vocab = 31 is padded to 32")), "{:?}", h100.notes);
    assert_eq!(PassMoeLayout::by_name("cpu"), Ok(PassMoeLayout::Cpu));
    let m = PassMoe::new(&Cpu, PassMoeLayout::Cpu, 0, 7, DType::F32).unwrap();
    assert_eq!(m.dense().len(), 1);
    assert_eq!(m.moe().len(), 2);
    let err = PassMoe::<Cpu>::new(&Cpu, PassMoeLayout::H100x8, 0, 7, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("Parallel Folding runtime"), "{err}");
}
