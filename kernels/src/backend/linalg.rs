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
