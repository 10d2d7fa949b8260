//! CUDA RMSNorm and rotary position embedding (kernels in `norm.cu`), with
//! the checks of `cpu/norm.rs` in the same order.
//!
//! Shape letters: R rows (leading dims flattened), D normalised dim,
//! B batch, S sequence, H heads, Hd head dim.

use cudarc::driver::LaunchConfig;

use super::compile::NORM;
use super::{float_sfx, launch, rows_cfg, warp_rows_cfg, Cuda};
use crate::backend::{check_positions, NormOps, Rope};
use crate::error::{arg_err, shape_err, Result};
use crate::tensor::{DType, Tensor};

use crate::backend::check_norm_args;

/// The kernel of a per-row norm op `base` and its launch: one warp per row
/// (`{base}_rows8_bf16`) for bf16 rows of a multiple of 8 values at 16-byte
/// aligned addresses, else one block per row (`{base}_{sfx}`).
fn rows_kernel(
    base: &str,
    sfx: &str,
    r: usize,
    d: usize,
    ts: &[&Tensor<Cuda>],
) -> (String, LaunchConfig) {
    let vectors = sfx == "bf16"
        && d.is_multiple_of(8)
        && ts.iter().all(|t| t.storage().ptr().is_multiple_of(16));
    if vectors {
        (format!("{base}_rows8_bf16"), warp_rows_cfg(r))
    } else {
        (format!("{base}_{sfx}"), rows_cfg(r, 256))
    }
}

impl NormOps for Cuda {
    fn rms_norm(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f64,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "rms_norm";
        let sfx = float_sfx(OP, x.dtype())?;
        let (r, d) = check_norm_args(OP, x, w)?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(arg_err(OP, format!("eps = {eps} must be finite and >= 0")));
        }
        w.expect_dtype(OP, x.dtype())?;
        let lead = &x.shape()[..x.shape().len() - 1];
        let y = self.alloc(OP, x.shape(), x.dtype())?;
        let rstd = self.alloc(OP, lead, x.dtype())?;
        if r > 0 {
            let (name, cfg) = rows_kernel("rmsnorm_fwd", sfx, r, d, &[x, w, &y, &rstd]);
            let f = self.func(NORM, &name)?;
            launch!(
                self,
                f,
                cfg,
                x.storage().ptr(),
                w.storage().ptr(),
                y.storage().ptr(),
                rstd.storage().ptr(),
                r as i64,
                d as i64,
                eps
            )?;
        }
        Ok((y, rstd))
    }

    fn rms_norm_backward(
        &self,
        dy: &Tensor<Self>,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        rstd: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "rms_norm_backward";
        let sfx = float_sfx(OP, x.dtype())?;
        let (r, d) = check_norm_args(OP, x, w)?;
        dy.expect_shape(OP, "dy", x.shape())?;
        let lead = &x.shape()[..x.shape().len() - 1];
        if rstd.shape() != lead && rstd.shape() != [r] {
            return Err(shape_err(
                OP,
                format!(
                    "x has shape {:?}, so rstd must have shape {lead:?} or [{r}], got {:?}",
                    x.shape(),
                    rstd.shape()
                ),
            ));
        }
        for t in [w, dy, rstd] {
            t.expect_dtype(OP, x.dtype())?;
        }
        let dx = self.alloc(OP, x.shape(), x.dtype())?;
        let dw = self.alloc(OP, &[d], x.dtype())?;
        if r > 0 {
            let (name, cfg) = rows_kernel("rmsnorm_dx", sfx, r, d, &[dy, x, w, rstd, &dx]);
            let f = self.func(NORM, &name)?;
            launch!(
                self,
                f,
                cfg,
                dy.storage().ptr(),
                x.storage().ptr(),
                w.storage().ptr(),
                rstd.storage().ptr(),
                dx.storage().ptr(),
                r as i64,
                d as i64
            )?;
        }
        // Chunks of `per` rows (DW_ROWS, more past 65535 chunks, the grid's
        // y limit) each give one partial per column, so the sum spreads over
        // many blocks; the finish adds them in order.
        const DW_ROWS: usize = 256;
        let per = DW_ROWS.max(r.div_ceil(65535));
        let chunks = r.div_ceil(per).max(1);
        let acc = if x.dtype() == DType::F64 { 8 } else { 4 };
        let part = self.scratch(OP, chunks * d * acc)?;
        let f = self.func(NORM, &format!("rmsnorm_dw_part_{sfx}"))?;
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(32) as u32, chunks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            f,
            cfg,
            dy.storage().ptr(),
            x.storage().ptr(),
            rstd.storage().ptr(),
            part.ptr(),
            r as i64,
            d as i64,
            per as i64
        )?;
        let f = self.func(NORM, &format!("rmsnorm_dw_finish_{sfx}"))?;
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 16, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            f,
            cfg,
            part.ptr(),
            dw.storage().ptr(),
            chunks as i64,
            d as i64
        )?;
        Ok((dx, dw))
    }

    fn rope(
        &self,
        x: &Tensor<Self>,
        rope: Rope,
        inverse: bool,
        positions: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "rope";
        let sfx = float_sfx(OP, x.dtype())?;
        let (b, s, h, hd) = x.dims4(OP)?;
        rope.check(OP, hd)?;
        check_positions(OP, x, positions)?;
        let out = self.alloc(OP, x.shape(), x.dtype())?;
        let pairs = x.numel() / 2;
        if pairs > 0 {
            let f = self.func(NORM, &format!("rope_{sfx}"))?;
            let sign = if inverse { -1.0f64 } else { 1.0 };
            let (factor, low, high) = rope
                .yarn
                .map_or((1.0, 0.0, 1.0), |y| (y.factor, y.low, y.high));
            // A block per token, grid-stride past 4096 (rope_impl).
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: ((b * s).min(4096) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                f,
                cfg,
                x.storage().ptr(),
                out.storage().ptr(),
                positions.map_or(0u64, |p| p.storage().ptr()),
                s as i64,
                h as i64,
                hd as i64,
                rope.theta,
                sign,
                factor,
                low,
                high,
                rope.amplitude(),
                pairs as i64
            )?;
        }
        Ok(out)
    }
}
