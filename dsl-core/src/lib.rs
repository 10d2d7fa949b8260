//! foldmoe's core: the parallel layout rules ([`layout`]), the model IR
//! ([`spec`]) and, behind the default `engine` feature, the training engine
//! (`engine`) that runs it on a kernel backend. Without `engine` the crate is
//! light enough for the `#[moe_model]` macro to call at compile time.

pub mod layout;
pub mod spec;

#[cfg(feature = "engine")]
pub mod engine;
