//! The training engine for one rank: layers with explicit forward/backward
//! pairs (DESIGN §5), the model built from a [`crate::spec::ModelSpec`], and
//! the optimizer and trainer around it.
//!
//! Convention for every layer: `forward(&self, b, x) -> (y, Saved)` and
//! `backward(&mut self, b, dy, saved) -> dx`, next to each other in the same
//! file; `backward` accumulates into the layer's parameter gradients.

pub mod attention;
pub mod block;
pub mod checkpoint;
pub mod data;
pub mod embedding;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod param;
pub mod schedule;
pub mod trainer;

pub use param::{init_normal, Module, Param};

/// Errors of the engine: kernel failures and invalid configurations.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A kernel rejected its inputs or the device failed.
    #[error(transparent)]
    Kernel(#[from] foldmoe_kernels::KernelError),
    /// The model spec breaks a rule.
    #[error("invalid model spec: {}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Spec(Vec<crate::spec::SpecError>),
    /// A run-time argument is invalid (names the value).
    #[error("{0}")]
    Invalid(String),
}

/// Result of an engine call.
pub type Result<T> = std::result::Result<T, EngineError>;
