//! Models shipped with foldmoe, each declared with `#[moe_model]` in its own
//! file: `tiny` (the default), Mixtral-8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B
//! and DeepSeek-V3, each full-size model with its named cluster layouts and a
//! `-small` variant of the same shape that trains on a CPU.
//!
//! The functions here give each model's [`ModelSpec`] without a backend (for
//! the CLI and the planner); the declared types (`Tiny<B>`, `DeepSeekV3<B>`,
//! ...) build the model on a backend through
//! [`MoeModel`](foldmoe_core::engine::declared::MoeModel).

pub mod deepseek_v3;
pub mod mixtral_8x7b;
pub mod qwen3_235b_a22b;
pub mod qwen3_30b_a3b;
pub mod tiny;

pub use deepseek_v3::{DeepSeekV3, DeepSeekV3Layout, DeepSeekV3Small, DeepSeekV3SmallLayout};
pub use mixtral_8x7b::{Mixtral8x7b, Mixtral8x7bLayout, Mixtral8x7bSmall, Mixtral8x7bSmallLayout};
pub use qwen3_235b_a22b::{Qwen3A22b, Qwen3A22bLayout, Qwen3A22bSmall, Qwen3A22bSmallLayout};
pub use qwen3_30b_a3b::{Qwen3A3b, Qwen3A3bLayout, Qwen3A3bSmall, Qwen3A3bSmallLayout};
pub use tiny::{Tiny, TinyLayout};

use foldmoe_core::engine::declared::{MoeModel, Registry};
use foldmoe_core::layout::LayoutSpec;
use foldmoe_core::spec::ModelSpec;
use foldmoe_kernels::cpu::Cpu;

/// Every shipped model, `tiny` (the default) first: what the `foldmoe`
/// command serves.
pub fn registry() -> Registry {
    Registry::new(vec![
        Registry::entry::<Tiny<Cpu>>(),
        Registry::entry::<Mixtral8x7b<Cpu>>(),
        Registry::entry::<Mixtral8x7bSmall<Cpu>>(),
        Registry::entry::<Qwen3A3b<Cpu>>(),
        Registry::entry::<Qwen3A3bSmall<Cpu>>(),
        Registry::entry::<Qwen3A22b<Cpu>>(),
        Registry::entry::<Qwen3A22bSmall<Cpu>>(),
        Registry::entry::<DeepSeekV3<Cpu>>(),
        Registry::entry::<DeepSeekV3Small<Cpu>>(),
    ])
}

/// The default model: a small MoE language model over bytes that trains on a
/// CPU in minutes (see [`tiny`](mod@tiny)).
pub fn tiny() -> ModelSpec {
    <Tiny<Cpu> as MoeModel<Cpu>>::spec()
}

/// The names of every shipped model, in a stable order.
pub fn names() -> Vec<String> {
    registry().names().into_iter().map(String::from).collect()
}

/// Looks a shipped model up by name (through [`registry`]); an error lists
/// the known names.
pub fn by_name(name: &str) -> Result<ModelSpec, String> {
    registry().spec(name)
}

/// A shipped model's spec and its declared layouts, by name (through
/// [`registry`]); an error lists the known names.
pub fn layouts_by_name(name: &str) -> Result<(ModelSpec, Vec<LayoutSpec>), String> {
    registry().layouts(name)
}

#[cfg(test)]
mod tests;
