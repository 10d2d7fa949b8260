//! CUDA blockwise fp8 GEMM operands: quantisation into the three tilings of
//! [`Fp8Tiles`] and dequantisation, on the device (`fp8.cu`, equal to the
//! host reference bit for bit), with no host wait. The GEMMs are
//! [`Fp8Ops`]' provided emulation (dequantise, f32 grouped GEMM) until the
//! wgmma fp8 kernels exist. GPUs without fp8 tensor cores are refused at
//! the first quantisation, so a run that will need them fails at once.

use super::compile::FP8;
use super::{block_cfg, float_sfx, grid_for, launch, Cuda};
use crate::backend::{Device, Fp8Ops, OffloadOps};
use crate::error::{arg_err, KernelError, Result};
use crate::fp8::{
    check_quantize_input, check_tiles, column_tiles, Fp8Matrix, Fp8Tensor, Fp8Tiles,
    FP8_WEIGHT_BLOCK,
};
use crate::tensor::{DType, Tensor};

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

    /// The group sizes' count, checked to be an i32 vector.
    fn group_count(op: &'static str, sizes: Option<&Tensor<Self>>) -> Result<usize> {
        let Some(s) = sizes else { return Ok(0) };
        s.expect_dtype(op, DType::I32)?;
        if s.shape().len() != 1 {
            return Err(arg_err(
                op,
                format!("group sizes must be 1-d, got shape {:?}", s.shape()),
            ));
        }
        Ok(s.numel())
    }
}

/// The grid of the per-group column-tile kernels: a block per tile and 32
/// columns.
fn group_cols_grid(m: usize, k: usize, groups: usize) -> (u32, u32, u32) {
    (
        column_tiles(m, groups) as u32,
        k.div_ceil(32).max(1) as u32,
        1,
    )
}

impl Fp8Ops for Cuda {
    fn quantize_fp8(
        &self,
        x: &Tensor<Self>,
        tiles: Fp8Tiles,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Fp8Matrix<Self>> {
        const OP: &str = "quantize_fp8";
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
        check_quantize_input(OP, x, tiles, group_sizes.is_some())?;
        let sfx = float_sfx(OP, x.dtype())?;
        let groups = Self::group_count(OP, group_sizes)?;
        let shape = x.shape().to_vec();
        let n = x.numel();
        let (codes, scales) = match (tiles, shape.as_slice()) {
            (Fp8Tiles::Rows, _) => {
                let f = self.compress_fp8(x)?;
                (f.codes, f.scales)
            }
            (Fp8Tiles::Blocks { transposed }, &[g, r, c]) => {
                let (gr, gc) = (r.div_ceil(FP8_WEIGHT_BLOCK), c.div_ceil(FP8_WEIGHT_BLOCK));
                let codes = self.alloc(OP, &[n.div_ceil(4)], DType::I32)?;
                let scales = self.alloc(OP, &[g * gr * gc], DType::F32)?;
                if n > 0 {
                    let f = self.func(FP8, &format!("fp8_quant_blocks_{sfx}"))?;
                    launch!(
                        self,
                        f,
                        block_cfg((gc as u32, gr as u32, g as u32), 256, 0),
                        x.storage().ptr(),
                        codes.storage().ptr(),
                        scales.storage().ptr(),
                        r as i64,
                        c as i64,
                        i32::from(transposed)
                    )?;
                }
                (codes, scales)
            }
            (Fp8Tiles::GroupColumns, &[m, k]) => {
                if let Some(sizes) = group_sizes {
                    // Negative sizes or a sum past m are reported at the next
                    // read, as by the grouped GEMMs (the kernel clamps).
                    self.group_offsets(OP, sizes, groups, m)?;
                }
                let t = column_tiles(m, groups);
                // Rows past the groups are code 0.
                let codes = self.zeros(&[n.div_ceil(4)], DType::I32)?;
                let scales = self.alloc(OP, &[k * t], DType::F32)?;
                if k > 0 {
                    let f = self.func(FP8, &format!("fp8_quant_group_cols_{sfx}"))?;
                    launch!(
                        self,
                        f,
                        block_cfg(group_cols_grid(m, k, groups), 256, 0),
                        x.storage().ptr(),
                        codes.storage().ptr(),
                        scales.storage().ptr(),
                        group_sizes.map_or(0, |s| s.storage().ptr()),
                        m as i64,
                        k as i64,
                        groups as i64,
                        t as i64
                    )?;
                }
                (codes, scales)
            }
            _ => unreachable!("check_tiles passed"),
        };
        Ok(Fp8Matrix {
            codes,
            scales,
            shape,
            tiles,
        })
    }

    fn dequantize_fp8(
        &self,
        q: &Fp8Matrix<Self>,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "dequantize_fp8";
        check_tiles(OP, &q.shape, q.tiles, group_sizes.is_some())?;
        let groups = Self::group_count(OP, group_sizes)?;
        q.codes.expect_dtype(OP, DType::I32)?;
        q.scales.expect_dtype(OP, DType::F32)?;
        let n: usize = q.shape.iter().product();
        let want_scales = match (q.tiles, q.shape.as_slice()) {
            (Fp8Tiles::Rows, &[m, k]) => m * k.div_ceil(128),
            (Fp8Tiles::GroupColumns, &[m, k]) => k * column_tiles(m, groups),
            (Fp8Tiles::Blocks { .. }, &[g, r, c]) => {
                g * r.div_ceil(FP8_WEIGHT_BLOCK) * c.div_ceil(FP8_WEIGHT_BLOCK)
            }
            _ => unreachable!("check_tiles passed"),
        };
        if q.codes.numel() != n.div_ceil(4) || q.scales.numel() != want_scales {
            return Err(arg_err(
                OP,
                format!(
                    "{:?} of shape {:?}: {} code words and {} scales, want {} and {want_scales}",
                    q.tiles,
                    q.shape,
                    q.codes.numel(),
                    q.scales.numel(),
                    n.div_ceil(4)
                ),
            ));
        }
        match (q.tiles, q.shape.as_slice()) {
            (Fp8Tiles::Rows, _) => self.expand_fp8(&Fp8Tensor {
                codes: q.codes.clone(),
                scales: q.scales.clone(),
                shape: q.shape.clone(),
                dtype: DType::F32,
            }),
            (Fp8Tiles::Blocks { transposed }, &[g, r, c]) => {
                let out = self.alloc(OP, &q.shape, DType::F32)?;
                if n > 0 {
                    let f = self.func(FP8, "fp8_dequant_blocks")?;
                    launch!(
                        self,
                        f,
                        grid_for(n),
                        q.codes.storage().ptr(),
                        q.scales.storage().ptr(),
                        out.storage().ptr(),
                        g as i64,
                        r as i64,
                        c as i64,
                        i32::from(transposed)
                    )?;
                }
                Ok(out)
            }
            (Fp8Tiles::GroupColumns, &[m, k]) => {
                let out = self.zeros(&q.shape, DType::F32)?;
                if k > 0 {
                    let f = self.func(FP8, "fp8_dequant_group_cols")?;
                    launch!(
                        self,
                        f,
                        block_cfg(group_cols_grid(m, k, groups), 256, 0),
                        q.codes.storage().ptr(),
                        q.scales.storage().ptr(),
                        group_sizes.map_or(0, |s| s.storage().ptr()),
                        out.storage().ptr(),
                        m as i64,
                        k as i64,
                        groups as i64,
                        column_tiles(m, groups) as i64
                    )?;
                }
                Ok(out)
            }
            _ => unreachable!("check_tiles passed"),
        }
    }
}
