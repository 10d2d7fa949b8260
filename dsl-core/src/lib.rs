//! foldmoe's core: the model IR ([`spec`]) and, behind the default `engine`
//! feature, the training engine ([`engine`]) that runs it on a kernel backend.

pub mod layout;
pub mod spec;

#[cfg(feature = "engine")]
pub mod engine;
