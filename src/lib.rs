//! foldmoe: Mixture-of-Experts models declared as annotated Rust structs and
//! trained from one CPU to GPU clusters. This facade re-exports the crates a
//! user needs through [`prelude`].

pub use foldmoe_core as core;
pub use foldmoe_kernels as kernels;
pub use foldmoe_models as models;

/// The names a model author or training script needs.
pub mod prelude {
    pub use foldmoe_core::spec::*;
    pub use foldmoe_kernels::{cpu::Cpu, Backend, DType, Device, HostData, Tensor};
}
