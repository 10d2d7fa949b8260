use super::Device;
use crate::error::{shape_err, Result};
use crate::tensor::Tensor;

/// Dense and grouped matrix products (row-major).
pub trait LinalgOps: Device {
    /// `op(a) · op(b)` where `op` transposes when asked:
    /// `a: [M, K]` (or `[K, M]` with `trans_a`), `b: [K, N]` (or `[N, K]` with `trans_b`) → `[M, N]`.
    fn matmul(
        &self,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<Tensor<Self>>;

    /// Grouped product over consecutive row blocks: rows of `x: [M, K]` are split
    /// into groups of `group_sizes: [G]` (i32, on the device; empty groups allowed)
    /// and group `g` is multiplied by `w[g]`: `w: [G, K, N]` (or `[G, N, K]` with
    /// `trans_w`) → `[M, N]`. Rows past the sum of the sizes are zero (padding);
    /// a sum larger than `M` is an error.
    fn grouped_matmul(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>>;

    /// Weight gradient of [`LinalgOps::grouped_matmul`] (untransposed form):
    /// `dw[g] = x_gᵀ · dy_g` for `x: [M, K]`, `dy: [M, N]` → `[G, K, N]`.
    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Tensor<Self>>;

    /// Two grouped products over the same rows and groups, summed:
    /// `x1 · op(w1[g]) + x2 · op(w2[g])` for `x1: [M, K1]`, `x2: [M, K2]`,
    /// `w1: [G, K1, N]`, `w2: [G, K2, N]` (`[G, N, K·]` with `trans_w`) →
    /// `[M, N]`, accumulated over both inner dimensions before one rounding
    /// (the MoE experts' dx over the gate and up projections). Rows past the
    /// groups are zero, as in [`LinalgOps::grouped_matmul`].
    fn grouped_matmul_sum2(
        &self,
        x1: &Tensor<Self>,
        w1: &Tensor<Self>,
        x2: &Tensor<Self>,
        w2: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>>;
}

/// The sizes `(M, K, G, N)` of `grouped_matmul(x, w, _, trans_w)` after
/// every backend's checks (x 2-d, w 3-d, K agreeing, one dtype).
pub(crate) fn grouped_dims<B: Device>(
    op: &'static str,
    x: &Tensor<B>,
    w: &Tensor<B>,
    trans_w: bool,
) -> Result<(usize, usize, usize, usize)> {
    let (m, k) = x.dims2(op)?;
    let (g, wr, wc) = w.dims3(op)?;
    let (wk, n) = if trans_w { (wc, wr) } else { (wr, wc) };
    if wk != k {
        return Err(shape_err(
            op,
            format!(
                "x {:?} has K = {k}, w {:?} (trans_w = {trans_w}) has K = {wk}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    w.expect_dtype(op, x.dtype())?;
    Ok((m, k, g, n))
}

/// The checks of [`LinalgOps::grouped_matmul_sum2`]: both products'
/// sizes, the same M, G and N, one dtype; returns `(M, K1, K2, G, N)`.
pub(crate) fn sum2_dims<B: Device>(
    op: &'static str,
    x1: &Tensor<B>,
    w1: &Tensor<B>,
    x2: &Tensor<B>,
    w2: &Tensor<B>,
    trans_w: bool,
) -> Result<(usize, usize, usize, usize, usize)> {
    let (m, k1, g, n) = grouped_dims(op, x1, w1, trans_w)?;
    let (m2, k2, g2, n2) = grouped_dims(op, x2, w2, trans_w)?;
    if (m2, g2, n2) != (m, g, n) {
        return Err(shape_err(
            op,
            format!(
                "x1 {:?} · w1 {:?} and x2 {:?} · w2 {:?} (trans_w = {trans_w}) differ in rows, groups or columns",
                x1.shape(),
                w1.shape(),
                x2.shape(),
                w2.shape()
            ),
        ));
    }
    x2.expect_dtype(op, x1.dtype())?;
    Ok((m, k1, k2, g, n))
}

/// The sizes of `op(a)·op(b)` after every backend's checks: `(M, K, N)`
/// and the stored row lengths of `a` and `b`, or an error naming both
/// shapes when the inner dimensions disagree.
pub(crate) fn matmul_dims<B: Device>(
    op: &'static str,
    a: &Tensor<B>,
    b: &Tensor<B>,
    trans_a: bool,
    trans_b: bool,
) -> Result<(usize, usize, usize, usize, usize)> {
    let (ar, ac) = a.dims2(op)?;
    let (br, bc) = b.dims2(op)?;
    let (m, ka) = if trans_a { (ac, ar) } else { (ar, ac) };
    let (kb, n) = if trans_b { (bc, br) } else { (br, bc) };
    if ka != kb {
        return Err(shape_err(
            op,
            format!(
                "a {:?} (trans_a = {trans_a}) has inner dimension {ka}, b {:?} (trans_b = {trans_b}) has {kb}",
                a.shape(),
                b.shape()
            ),
        ));
    }
    Ok((m, ka, n, ac, bc))
}
