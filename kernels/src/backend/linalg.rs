use super::Device;
use crate::error::Result;
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
