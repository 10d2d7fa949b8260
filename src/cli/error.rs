//! Errors of the `foldmoe` command: each prints as one line naming the
//! problem and the value.

use foldmoe::core::engine::EngineError;
use foldmoe::data::DataError;
use foldmoe::kernels::KernelError;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad flags, config files or paths given by the user.
    #[error("{0}")]
    Usage(String),
    /// The engine failed (bad checkpoint, non-finite loss, ...).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Data could not be read, tokenized or indexed (a corrupt `.idx`, a
    /// token outside the vocabulary, ...).
    #[error(transparent)]
    Data(#[from] DataError),
    /// A kernel or device failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A command that ends with its own exit status (`launch`: its ranks
    /// failed, or were interrupted).
    #[error("{msg}")]
    Exit {
        /// The process exit status.
        code: i32,
        /// What happened.
        msg: String,
    },
    /// The run was interrupted (Ctrl-C) after saving its checkpoint.
    #[error("interrupted at step {step}; checkpoint saved in {dir}")]
    Interrupted {
        /// Last completed step.
        step: u64,
        /// Where the checkpoint went.
        dir: String,
    },
}

impl CliError {
    /// A usage error with `msg`.
    pub fn usage(msg: impl Into<String>) -> Self {
        CliError::Usage(msg.into())
    }

    /// The exit status of a command that failed this way: 130 after an
    /// interrupt (as a shell reports Ctrl-C), its own for [`CliError::Exit`],
    /// 1 for any other error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Interrupted { .. } => 130,
            CliError::Exit { code, .. } => *code,
            _ => 1,
        }
    }

    /// An I/O failure on `path`.
    pub fn io(what: &str, path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        CliError::Usage(format!("{what} {}: {e}", path.display()))
    }
}
