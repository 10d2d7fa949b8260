//! foldmoe's data path, from text to the engine's batches (see
//! docs/ARCHITECTURE.md §8):
//!
//! ```text
//! text ─tokenizer (bytes | tokenizer.json)─► u32 ids ─preprocess─► PATH.bin + PATH.idx (Megatron MMIDIDX v1)
//!   PATH.idx/.bin ─indexed (memmap, checked)─► gpt (document, sample, shuffle indices; cached)
//!   ─blend (weights, Megatron's blending index)─► loader (the rank's micro-batches, i32 ids < vocab)
//! ```
//!
//! The bundled corpus read as bytes goes through the same loader
//! ([`text::TextDataset`]).

pub mod blend;
pub mod error;
pub mod gpt;
pub mod indexed;
pub mod loader;
pub mod preprocess;
pub mod text;
pub mod tokenizer;

pub use error::{DataError, Result};
pub use loader::{Batch, IndexedConfig, Loader};
pub use text::{BatchSampler, TextDataset};
pub use tokenizer::{ByteTokenizer, Tokenizer};
