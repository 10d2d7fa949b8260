//! `deepseek-v3` exactly as `models/` declares it: the model file is compiled
//! here as a module (no copy to drift), its spec and every named layout
//! checked again by foldmoe-core's rules at run time.
#![allow(dead_code)]

use foldmoe_core::engine::declared::{LayoutChoice, MoeModel};
use foldmoe_core::layout;
use foldmoe_kernels::cpu::Cpu;

#[path = "../../../../models/src/deepseek_v3.rs"]
mod model;

/// The declaration passed the macro; the runtime must agree on its spec and
/// on each layout, and each layout must be found by its declared name.
fn check<M: MoeModel<Cpu, Layout = L>, L: LayoutChoice>() {
    let spec = M::spec();
    spec.check().unwrap();
    for &choice in L::ALL {
        let l = choice.spec();
        layout::check(&l, &spec).unwrap();
        assert_eq!(L::by_name(&l.name), Ok(choice));
    }
}

fn main() {
    check::<model::DeepSeekV3<Cpu>, model::DeepSeekV3Layout>();
    check::<model::DeepSeekV3Small<Cpu>, model::DeepSeekV3SmallLayout>();
}
