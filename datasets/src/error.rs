//! The data path's one error type: every variant prints as one line naming
//! the file (or flag) and what is wrong with it.

/// Why reading, writing or indexing data failed.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened, read, written or renamed.
    #[error("{what} {path}: {msg}")]
    Io {
        /// What was being done (`cannot read`, `cannot write`).
        what: &'static str,
        /// The file.
        path: String,
        /// The operating system's reason.
        msg: String,
    },
    /// A file exists but its content is wrong: a corrupt or truncated
    /// `.idx`/`.bin`, a cache whose checksum does not match.
    #[error("{path}: {field}: {msg}")]
    Corrupt {
        /// The file.
        path: String,
        /// The header field or array that is wrong.
        field: &'static str,
        /// What is wrong, with the values.
        msg: String,
    },
    /// A tokenizer could not be loaded, trained, or used.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer {
        /// The `tokenizer.json` (or `byte`).
        path: String,
        /// The reason.
        msg: String,
    },
    /// Bad input given by the user: a blend, a split, a token id outside the
    /// vocabulary, a dataset too small.
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    /// An I/O failure `what`-ing `path`.
    pub fn io(what: &'static str, path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        DataError::Io {
            what,
            path: path.display().to_string(),
            msg: e.to_string(),
        }
    }

    /// A corrupt `field` of `path`.
    pub fn corrupt(path: &std::path::Path, field: &'static str, msg: impl Into<String>) -> Self {
        DataError::Corrupt {
            path: path.display().to_string(),
            field,
            msg: msg.into(),
        }
    }
}

/// Results of the data path.
pub type Result<T> = std::result::Result<T, DataError>;
