//! CUDA blockwise fp8 GEMMs. Until the wgmma fp8 kernels exist, the
//! operands are quantised through the host and the products emulated in
//! f32 ([`Fp8Ops`]'s provided methods), on GPUs that have fp8 tensor cores
//! only, so a run that will need them fails at its first fp8 op rather than
//! later.

use super::Cuda;
use crate::backend::Fp8Ops;
use crate::error::{KernelError, Result};
use crate::fp8::{quantize_via_host, Fp8Matrix, Fp8Tiles};
use crate::tensor::Tensor;

/// The oldest architecture with e4m3 tensor cores (Ada, sm_89).
const MIN_FP8_CAPABILITY: u32 = 89;

impl Cuda {
    /// Whether this GPU has fp8 tensor cores (sm_89 or newer).
    pub fn has_fp8_tensor_cores(&self) -> bool {
        let digits: String = self.arch().chars().filter(char::is_ascii_digit).collect();
        digits
            .parse::<u32>()
            .is_ok_and(|sm| sm >= MIN_FP8_CAPABILITY)
    }
}

impl Fp8Ops for Cuda {
    fn quantize_fp8(
        &self,
        x: &Tensor<Self>,
        tiles: Fp8Tiles,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Fp8Matrix<Self>> {
        if !self.has_fp8_tensor_cores() {
            return Err(KernelError::DeviceUnavailable {
                device: "cuda",
                reason: format!(
                    "fp8 GEMMs need fp8 tensor cores (sm_89 or newer), but {} is {}; train in bf16 (no --fp8, no precision = fp8_blockwise)",
                    self.name(),
                    self.arch()
                ),
            });
        }
        quantize_via_host(self, x, tiles, group_sizes)
    }
}
