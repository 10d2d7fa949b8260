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

use foldmoe_core::engine::declared::MoeModel;
use foldmoe_core::layout::LayoutSpec;
use foldmoe_core::spec::ModelSpec;
use foldmoe_kernels::cpu::Cpu;

/// The spec and layouts of a declared model. The spec does not depend on the
/// backend; `Cpu` only names one to reach the trait's associated functions.
fn declared<M: MoeModel<Cpu>>() -> Declared {
    (M::spec(), M::layouts())
}

/// A model's spec and its declared layouts.
type Declared = (ModelSpec, Vec<LayoutSpec>);

/// A shipped model: its name and the function giving its declaration.
type Entry = (&'static str, fn() -> Declared);

/// Every shipped model: its name and its declaration's spec and layouts.
const MODELS: &[Entry] = &[
    ("tiny", declared::<Tiny<Cpu>>),
    ("mixtral-8x7b", declared::<Mixtral8x7b<Cpu>>),
    ("mixtral-8x7b-small", declared::<Mixtral8x7bSmall<Cpu>>),
    ("qwen3-30b-a3b", declared::<Qwen3A3b<Cpu>>),
    ("qwen3-30b-a3b-small", declared::<Qwen3A3bSmall<Cpu>>),
    ("qwen3-235b-a22b", declared::<Qwen3A22b<Cpu>>),
    ("qwen3-235b-a22b-small", declared::<Qwen3A22bSmall<Cpu>>),
    ("deepseek-v3", declared::<DeepSeekV3<Cpu>>),
    ("deepseek-v3-small", declared::<DeepSeekV3Small<Cpu>>),
];

/// The default model: a small MoE language model over bytes that trains on a
/// CPU in minutes (see [`tiny`](mod@tiny)).
pub fn tiny() -> ModelSpec {
    <Tiny<Cpu> as MoeModel<Cpu>>::spec()
}

/// The names of every shipped model, in a stable order.
pub fn names() -> Vec<&'static str> {
    MODELS.iter().map(|(n, _)| *n).collect()
}

/// Looks a model up by name; an error lists the known names.
pub fn by_name(name: &str) -> Result<ModelSpec, String> {
    layouts_by_name(name).map(|(spec, _)| spec)
}

/// A model's spec and its declared layouts, by name; an error lists the
/// known names.
pub fn layouts_by_name(name: &str) -> Result<(ModelSpec, Vec<LayoutSpec>), String> {
    MODELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| f())
        .ok_or_else(|| {
            format!(
                "unknown model `{name}`; known models: {}",
                names().join(", ")
            )
        })
}

#[cfg(test)]
mod tests;
