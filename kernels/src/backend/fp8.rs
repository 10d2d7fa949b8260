use super::{Device, ElementwiseOps, LinalgOps, RoutingOps};
use crate::error::{arg_err, Result};
use crate::fp8::{dequantize_via_host, quantize_via_host, Fp8Matrix, Fp8Tiles};
use crate::tensor::{DType, Tensor};

/// Blockwise fp8 (e4m3) GEMMs, DeepSeek-V3's recipe (Megatron-Core's
/// `--fp8-recipe blockwise`): activations scaled per 1 × 128 tile along the
/// summed dimension, weights per 128 × 128 block, products accumulated in
/// f32 (docs/ARCHITECTURE.md §6).
///
/// The provided methods emulate the tensor cores: quantise, dequantise to
/// f32 and run the f32 grouped GEMM, whose sums differ from an fp8 kernel's
/// (promoted every 128 of K, [`crate::fp8::blockwise_matmul_host`]) only in
/// f32 rounding. The CPU uses them as they are.
pub trait Fp8Ops: Device + LinalgOps + ElementwiseOps + RoutingOps {
    /// `x` quantised under `tiles`: `[M, K]` activations (`Rows`, or
    /// `GroupColumns` with the row groups `group_sizes: [G]`, i32), or
    /// `[G, R, C]` weights (`Blocks`).
    fn quantize_fp8(
        &self,
        x: &Tensor<Self>,
        tiles: Fp8Tiles,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Fp8Matrix<Self>> {
        quantize_via_host(self, x, tiles, group_sizes)
    }

    /// The rows `[M, K]` — `x` itself, or with `row_src: [M]` (i32) the
    /// rows of `x: [T, K]` it names ([`RoutingOps::permute`]: `-1` a zero
    /// row) — quantised both ways their GEMMs read them: in `Rows` tiles
    /// (the forward's or data gradient's operand) and in `GroupColumns`
    /// tiles of `group_sizes` (the weight gradient's, which the backward
    /// keeps); equal to a permute and two [`Self::quantize_fp8`] calls. A
    /// backend with a fused kernel reads each row of `x` once and writes no
    /// permuted copy, so one pass serves the GEMM and the saved copy.
    fn quantize_fp8_rows_and_columns(
        &self,
        x: &Tensor<Self>,
        row_src: Option<&Tensor<Self>>,
        group_sizes: &Tensor<Self>,
    ) -> Result<(Fp8Matrix<Self>, Fp8Matrix<Self>)> {
        rows_and_columns_in_two_passes(self, x, row_src, group_sizes)
    }

    /// The matrix `q` was quantised from, as its codes and scales give it
    /// back: f32, in the logical shape (`group_sizes` as quantised).
    fn dequantize_fp8(
        &self,
        q: &Fp8Matrix<Self>,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>> {
        dequantize_via_host(self, q, group_sizes)
    }

    /// [`LinalgOps::grouped_matmul`] of fp8 operands: `x: [M, K]` in `Rows`
    /// tiles, `w: [G, K, N]` in `Blocks` (`[G, N, K]` with `trans_w`),
    /// stored with K contiguous (transposed exactly when `trans_w` is false),
    /// → `[M, N]` in `dtype`.
    fn grouped_matmul_fp8(
        &self,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        dtype: DType,
    ) -> Result<Tensor<Self>> {
        grouped_matmul_fp8_emulated(self, x, w, group_sizes, trans_w, dtype)
    }

    /// `y += x · op(w)` in place ([`Self::grouped_matmul_fp8`] into `y:
    /// [M, N]`'s dtype, then added as [`ElementwiseOps::axpy`] with alpha 1
    /// adds: the same bits). A backend with a fused kernel adds in the
    /// GEMM's stores, so no product is written and read back (the fc1 data
    /// gradient's two halves, gate and up, summed).
    fn grouped_matmul_fp8_accumulate(
        &self,
        y: &mut Tensor<Self>,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<()> {
        let p = self.grouped_matmul_fp8(x, w, group_sizes, trans_w, y.dtype())?;
        self.axpy(y, 1.0, &p)
    }

    /// [`LinalgOps::grouped_matmul_weight_grad`] of fp8 operands: `x: [M,
    /// K]` and `dy: [M, N]`, both in `GroupColumns` tiles of the same
    /// `group_sizes` → `[G, K, N]` in `dtype`.
    fn grouped_matmul_weight_grad_fp8(
        &self,
        x: &Fp8Matrix<Self>,
        dy: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        dtype: DType,
    ) -> Result<Tensor<Self>> {
        grouped_wgrad_fp8_emulated(self, x, dy, group_sizes, dtype)
    }
}

/// [`Fp8Ops::quantize_fp8_rows_and_columns`] as a permute (with `row_src`)
/// and two quantisations: what the trait provides, and a backend's path
/// where its fused kernel does not fit.
pub(crate) fn rows_and_columns_in_two_passes<B: Fp8Ops>(
    b: &B,
    x: &Tensor<B>,
    row_src: Option<&Tensor<B>>,
    group_sizes: &Tensor<B>,
) -> Result<(Fp8Matrix<B>, Fp8Matrix<B>)> {
    let rows = match row_src {
        Some(r) => b.permute(x, r)?,
        None => x.clone(),
    };
    Ok((
        b.quantize_fp8(&rows, Fp8Tiles::Rows, None)?,
        b.quantize_fp8(&rows, Fp8Tiles::GroupColumns, Some(group_sizes))?,
    ))
}

/// [`Fp8Ops::grouped_matmul_weight_grad_fp8`] emulated: the operands
/// dequantised, then the f32 weight-gradient GEMM (what the trait provides).
pub(crate) fn grouped_wgrad_fp8_emulated<B: Fp8Ops>(
    b: &B,
    x: &Fp8Matrix<B>,
    dy: &Fp8Matrix<B>,
    group_sizes: &Tensor<B>,
    dtype: DType,
) -> Result<Tensor<B>> {
    check_wgrad_operands(x, dy)?;
    let x32 = b.dequantize_fp8(x, Some(group_sizes))?;
    let dy32 = b.dequantize_fp8(dy, Some(group_sizes))?;
    let dw = b.grouped_matmul_weight_grad(&x32, &dy32, group_sizes)?;
    in_dtype(b, dw, dtype)
}

/// The operand checks of [`Fp8Ops::grouped_matmul_weight_grad_fp8`]: both
/// in `GroupColumns` tiles.
pub(crate) fn check_wgrad_operands<B: Device>(x: &Fp8Matrix<B>, dy: &Fp8Matrix<B>) -> Result<()> {
    const OP: &str = "grouped_matmul_weight_grad_fp8";
    for (name, q) in [("x", x), ("dy", dy)] {
        if q.tiles != Fp8Tiles::GroupColumns {
            return Err(arg_err(
                OP,
                format!("{name} must be in GroupColumns tiles, got {:?}", q.tiles),
            ));
        }
    }
    Ok(())
}

/// [`Fp8Ops::grouped_matmul_fp8`] emulated: the operands dequantised, then
/// the f32 grouped GEMM (what the trait provides; a backend with fp8 kernels
/// falls back to it where they cannot run).
pub(crate) fn grouped_matmul_fp8_emulated<B: Fp8Ops>(
    b: &B,
    x: &Fp8Matrix<B>,
    w: &Fp8Matrix<B>,
    group_sizes: &Tensor<B>,
    trans_w: bool,
    dtype: DType,
) -> Result<Tensor<B>> {
    check_gemm_operands(x, w, trans_w)?;
    let x32 = b.dequantize_fp8(x, None)?;
    let w32 = b.dequantize_fp8(w, None)?;
    let y = b.grouped_matmul(&x32, &w32, group_sizes, trans_w)?;
    in_dtype(b, y, dtype)
}

/// The operand checks of [`Fp8Ops::grouped_matmul_fp8`], shared by every
/// implementation: `x` in row tiles, `w` in blocks stored with the summed
/// dimension contiguous.
pub(crate) fn check_gemm_operands<B: Device>(
    x: &Fp8Matrix<B>,
    w: &Fp8Matrix<B>,
    trans_w: bool,
) -> Result<()> {
    const OP: &str = "grouped_matmul_fp8";
    if x.tiles != Fp8Tiles::Rows {
        return Err(arg_err(
            OP,
            format!("x must be in Rows tiles, got {:?}", x.tiles),
        ));
    }
    let want = Fp8Tiles::Blocks {
        transposed: !trans_w,
    };
    if w.tiles != want {
        return Err(arg_err(
            OP,
            format!(
                "w (trans_w = {trans_w}) must be stored as {want:?}, with the summed dimension contiguous; got {:?}",
                w.tiles
            ),
        ));
    }
    Ok(())
}

fn in_dtype<B: Device>(b: &B, t: Tensor<B>, dtype: DType) -> Result<Tensor<B>> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        b.cast(&t, dtype)
    }
}
