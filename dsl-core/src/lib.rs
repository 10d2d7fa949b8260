//! foldmoe's core: the parallel layout rules ([`layout`]), the model IR
//! ([`spec`]), the memory planner ([`memory`]), behind the `config` feature
//! the model config files that are the IR's second front end (`config`), and
//! behind the default `engine` feature (which includes `config`) the training
//! engine (`engine`) that runs it on a kernel backend. Without features the
//! crate is light enough for the `#[moe_model]` macro to call at compile time.

#[cfg(feature = "config")]
pub mod config;
pub mod layout;
pub mod memory;
pub mod spec;

#[cfg(feature = "engine")]
pub mod engine;

/// What a `#[moe_model(crate = "foldmoe_core")]` expansion names (crates that
/// depend on the parts instead of the `foldmoe` facade); not a public API.
#[cfg(feature = "engine")]
#[doc(hidden)]
pub use engine::declared::__private;
