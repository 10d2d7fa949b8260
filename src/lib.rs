//! foldmoe: Mixture-of-Experts models declared as annotated Rust structs and
//! trained from one CPU to GPU clusters.
//!
//! This facade is the one dependency a model crate needs: it re-exports the
//! `#[moe_model]` attribute (whose expansion names everything through this
//! crate), the crates it is built from, and in [`prelude`] what a model file
//! and a training script use.
//!
//! ```toml
//! [dependencies]
//! foldmoe = { version = "0.1", path = "../foldmoe" }
//! ```

// The CLI's modules name this crate `foldmoe::…`, as a model crate would.
extern crate self as foldmoe;

pub mod cli;

pub use foldmoe_core as core;
pub use foldmoe_data as data;
pub use foldmoe_kernels as kernels;
pub use foldmoe_macros::moe_model;
pub use foldmoe_models as models;

/// The registry of a binary's models, for [`cli::main`]: `models![Tiny,
/// MyMoe]` lists declared model types (each `Name<B>` with `#[moe_model]`),
/// the first being the default of `train`.
#[macro_export]
macro_rules! models {
    ($($($segment:ident)::+),* $(,)?) => {
        $crate::core::engine::declared::Registry::new(::std::vec![
            $($crate::core::engine::declared::Registry::entry::<
                $($segment)::+<$crate::kernels::cpu::Cpu>
            >()),*
        ])
    };
}

/// What a `#[moe_model]` expansion names; not a public API.
#[doc(hidden)]
pub use foldmoe_core::__private;

/// The names a model author or training script needs: the attribute, the
/// spec IR, the declared-model traits, the engine's model and trainer, and
/// the kernel types.
pub mod prelude {
    pub use crate::moe_model;
    pub use foldmoe_core::engine::declared::{LayoutChoice, MoeModel};
    pub use foldmoe_core::engine::group::{DenseGroup, GroupBlocks, MoeGroup};
    pub use foldmoe_core::engine::model::{Batch, Model};
    pub use foldmoe_core::engine::parallel::{run_local_layout, Ctx, Exec, RankLayout, Trainer};
    pub use foldmoe_core::engine::trainer::TrainConfig;
    pub use foldmoe_core::engine::{Module, Param};
    pub use foldmoe_core::spec::*;
    pub use foldmoe_kernels::{cpu::Cpu, Backend, DType, Device, HostData, Tensor};
}
