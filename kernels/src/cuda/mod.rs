//! The CUDA backend. Until its kernels land it is a device that cannot be
//! opened, so callers already handle "no GPU" through the normal error path.

use crate::error::{KernelError, Result};

/// Handle to a CUDA device (not yet available in this build).
#[derive(Clone, Debug)]
pub struct Cuda {
    _private: (),
}

impl Cuda {
    /// Opens CUDA device `ordinal`; always an error until the backend lands.
    pub fn new(ordinal: usize) -> Result<Self> {
        Err(KernelError::DeviceUnavailable {
            device: "cuda",
            reason: format!(
                "device {ordinal} requested, but this build has no CUDA kernels yet; use --device cpu"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_reports_unavailable_with_reason() {
        let err = Cuda::new(0).unwrap_err();
        assert!(matches!(
            err,
            KernelError::DeviceUnavailable { device: "cuda", .. }
        ));
        assert!(err.to_string().contains("--device cpu"));
    }
}
