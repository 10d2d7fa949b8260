//! The one error type of the kernel crate: every op validates its inputs and
//! reports what was wrong with the values, instead of panicking.

use crate::tensor::DType;

/// Result of a kernel operation.
pub type Result<T> = std::result::Result<T, KernelError>;

/// What went wrong in a kernel call, carrying the offending values.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KernelError {
    /// Two operands (or an operand and a parameter) disagree on shape.
    #[error("{op}: shape mismatch: {detail}")]
    ShapeMismatch {
        /// The op that was called.
        op: &'static str,
        /// The shapes involved, spelled out.
        detail: String,
    },
    /// An operand has a dtype the op does not accept here.
    #[error("{op}: expected dtype {expected:?}, got {got:?}")]
    DTypeMismatch {
        /// The op that was called.
        op: &'static str,
        /// The dtype the op needed.
        expected: DType,
        /// The dtype it was given.
        got: DType,
    },
    /// The op has no implementation for this dtype on this backend.
    #[error("{op}: dtype {dtype:?} is not supported on the {backend} backend")]
    UnsupportedDType {
        /// The op that was called.
        op: &'static str,
        /// The dtype it was given.
        dtype: DType,
        /// The backend's name.
        backend: &'static str,
    },
    /// An input that must hold at least one element is empty.
    #[error("{op}: {what} is empty")]
    Empty {
        /// The op that was called.
        op: &'static str,
        /// Which input was empty.
        what: &'static str,
    },
    /// A scalar argument is out of its valid range.
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument {
        /// The op that was called.
        op: &'static str,
        /// What was wrong, with the value.
        detail: String,
    },
    /// An index tensor holds a value outside `[lo, hi)`.
    #[error("{op}: index {index} out of range [{lo}, {hi})")]
    IndexOutOfRange {
        /// The op that was called.
        op: &'static str,
        /// The offending index value.
        index: i64,
        /// Lowest valid index.
        lo: i64,
        /// One past the highest valid index.
        hi: i64,
    },
    /// An input holds NaN or infinity where the op needs finite values.
    #[error("{op}: {what} contains a non-finite value ({value})")]
    NonFinite {
        /// The op that was called.
        op: &'static str,
        /// Which input.
        what: &'static str,
        /// The first non-finite value found.
        value: f64,
    },
    /// The device (driver, library or hardware) cannot be used.
    #[error("{device} backend not available: {reason}")]
    DeviceUnavailable {
        /// The backend's name.
        device: &'static str,
        /// Why it cannot be used, naming what is missing.
        reason: String,
    },
    /// The device ran out of memory: what was being allocated, how much, and
    /// what the device still had.
    #[error("{device}: out of memory allocating {what} ({} = {requested} bytes); {} free of {} on the device, {} was cached by this process and released first: use smaller batches or sequences, recompute, or more ranks", human_bytes(*requested), human_bytes(*free), human_bytes(*total), human_bytes(*cached))]
    OutOfMemory {
        /// The backend's name.
        device: &'static str,
        /// The op and tensor being allocated.
        what: String,
        /// Bytes requested.
        requested: usize,
        /// Free device memory when the allocation failed, in bytes.
        free: usize,
        /// Total device memory, in bytes.
        total: usize,
        /// Bytes this process had cached for reuse (given back to the
        /// driver before the failing retry).
        cached: usize,
    },
    /// A collective failed: a peer rank aborted, or it timed out.
    #[error("communicator (rank {rank}): {detail}")]
    Comm {
        /// The rank that reports the failure.
        rank: usize,
        /// What happened, naming the peer rank and its reason where known.
        detail: String,
    },
}

/// Shorthand for building a [`KernelError::ShapeMismatch`].
pub fn shape_err(op: &'static str, detail: impl Into<String>) -> KernelError {
    KernelError::ShapeMismatch {
        op,
        detail: detail.into(),
    }
}

/// Shorthand for building a [`KernelError::InvalidArgument`].
pub fn arg_err(op: &'static str, detail: impl Into<String>) -> KernelError {
    KernelError::InvalidArgument {
        op,
        detail: detail.into(),
    }
}

/// Bytes in binary units, for messages (`3.00 GiB`, `100 B`).
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_in_binary_units() {
        assert_eq!(human_bytes(100), "100 B");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_bytes(1536), "1.50 KiB");
    }
}
