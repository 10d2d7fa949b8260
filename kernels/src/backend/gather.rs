//! Grouped products whose rows are gathered as the product reads them
//! (docs/ARCHITECTURE.md §4, Megatron-Core's fused permute): the MoE
//! experts read the tokens `x[row_src[n]]` in expert order, and their down
//! projection's backward the token gradients `dy[row_src[n]]`, without a
//! permuted copy `[N, D]` ever being written or kept for the backward.
//!
//! Shapes: T source rows, K inner dimension, N gathered rows, G groups.

use super::{Device, LinalgOps, RoutingOps};
use crate::error::{shape_err, Result};
use crate::tensor::Tensor;

/// Grouped products over gathered rows: each op equals
/// [`RoutingOps::permute`] followed by the plain product, bit for bit.
///
/// A backend with a kernel that gathers inside its loads overrides the
/// `*_kernel` hooks (returning `None` where its kernel cannot take the
/// operands); every other case, and every backend without such a kernel
/// (the CPU), permutes and runs the plain product.
pub trait GatheredGemmOps: LinalgOps + RoutingOps {
    /// `grouped_matmul(permute(x, row_src), w, group_sizes, trans_w)`:
    /// `x: [T, K]`, `row_src: [N]` (i32, `-1` for a zero row), `w: [G, K,
    /// Nout]` (`[G, Nout, K]` with `trans_w`) → `[N, Nout]`.
    fn grouped_matmul_gathered(
        &self,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        w: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>> {
        match self.grouped_matmul_gathered_kernel(x, row_src, w, group_sizes, trans_w)? {
            Some(out) => Ok(out),
            None => self.grouped_matmul(&self.permute(x, row_src)?, w, group_sizes, trans_w),
        }
    }

    /// `grouped_matmul_weight_grad(permute(x, row_src), dy, group_sizes)`:
    /// `x: [T, K]`, `row_src: [N]`, `dy: [N, Nout]` → `[G, K, Nout]`.
    fn grouped_matmul_weight_grad_gathered(
        &self,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        match self.grouped_matmul_weight_grad_gathered_kernel(x, row_src, dy, group_sizes)? {
            Some(out) => Ok(out),
            None => self.grouped_matmul_weight_grad(&self.permute(x, row_src)?, dy, group_sizes),
        }
    }

    /// `grouped_matmul_weight_grad(x, permute(dy, row_src), group_sizes)`:
    /// the gathered rows on the output-gradient side (the experts' down
    /// projection, whose output gradient is each row's token gradient):
    /// `x: [N, K]`, `dy: [T, Nout]`, `row_src: [N]` → `[G, K, Nout]`.
    fn grouped_matmul_weight_grad_gathered_dy(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        row_src: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        match self.grouped_matmul_weight_grad_gathered_dy_kernel(x, dy, row_src, group_sizes)? {
            Some(out) => Ok(out),
            None => self.grouped_matmul_weight_grad(x, &self.permute(dy, row_src)?, group_sizes),
        }
    }

    /// The weight gradients of two products over the same gathered rows:
    /// `(grouped_matmul_weight_grad_gathered(x, row_src, dy1, ..), the same
    /// with dy2)`, bit for bit (the gate and up projections' gradients).
    fn grouped_matmul_weight_grad_pair_gathered(
        &self,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        dy1: &Tensor<Self>,
        dy2: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        same_shapes(
            "grouped_matmul_weight_grad_pair_gathered",
            ("dy1", dy1),
            ("dy2", dy2),
        )?;
        if let Some(out) =
            self.grouped_matmul_weight_grad_pair_gathered_kernel(x, row_src, dy1, dy2, group_sizes)?
        {
            return Ok(out);
        }
        Ok((
            self.grouped_matmul_weight_grad_gathered(x, row_src, dy1, group_sizes)?,
            self.grouped_matmul_weight_grad_gathered(x, row_src, dy2, group_sizes)?,
        ))
    }

    /// Whether the products gather rows of `source` inside their kernels;
    /// where they do not, the provided methods permute on every call, so a
    /// caller reading the same rows several times permutes once itself.
    fn gathers_rows_of(&self, _source: &Tensor<Self>) -> bool {
        false
    }

    /// The backend's gathering kernel for
    /// [`GatheredGemmOps::grouped_matmul_gathered`], or `None` to permute.
    fn grouped_matmul_gathered_kernel(
        &self,
        _x: &Tensor<Self>,
        _row_src: &Tensor<Self>,
        _w: &Tensor<Self>,
        _group_sizes: &Tensor<Self>,
        _trans_w: bool,
    ) -> Result<Option<Tensor<Self>>> {
        Ok(None)
    }

    /// The backend's kernel for
    /// [`GatheredGemmOps::grouped_matmul_weight_grad_gathered_dy`], or `None`.
    fn grouped_matmul_weight_grad_gathered_dy_kernel(
        &self,
        _x: &Tensor<Self>,
        _dy: &Tensor<Self>,
        _row_src: &Tensor<Self>,
        _group_sizes: &Tensor<Self>,
    ) -> Result<Option<Tensor<Self>>> {
        Ok(None)
    }

    /// The backend's gathering kernel for
    /// [`GatheredGemmOps::grouped_matmul_weight_grad_gathered`], or `None`.
    fn grouped_matmul_weight_grad_gathered_kernel(
        &self,
        _x: &Tensor<Self>,
        _row_src: &Tensor<Self>,
        _dy: &Tensor<Self>,
        _group_sizes: &Tensor<Self>,
    ) -> Result<Option<Tensor<Self>>> {
        Ok(None)
    }

    /// The backend's kernel for
    /// [`GatheredGemmOps::grouped_matmul_weight_grad_pair_gathered`], or
    /// `None` to compose.
    fn grouped_matmul_weight_grad_pair_gathered_kernel(
        &self,
        _x: &Tensor<Self>,
        _row_src: &Tensor<Self>,
        _dy1: &Tensor<Self>,
        _dy2: &Tensor<Self>,
        _group_sizes: &Tensor<Self>,
    ) -> Result<Option<(Tensor<Self>, Tensor<Self>)>> {
        Ok(None)
    }
}

/// Checks that the two operands of a paired op have one shape and dtype.
fn same_shapes<B: Device>(
    op: &'static str,
    (n1, t1): (&str, &Tensor<B>),
    (n2, t2): (&str, &Tensor<B>),
) -> Result<()> {
    if t1.shape() != t2.shape() || t1.dtype() != t2.dtype() {
        return Err(shape_err(
            op,
            format!(
                "{n1} {:?} {:?} and {n2} {:?} {:?} must have one shape and dtype",
                t1.shape(),
                t1.dtype(),
                t2.shape(),
                t2.dtype()
            ),
        ));
    }
    Ok(())
}

/// The CPU permutes (the provided methods).
impl GatheredGemmOps for crate::cpu::Cpu {}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use crate::cpu::test_util::*;
    use crate::tensor::DType;

    /// The gathered products against permute + the plain ones, exactly, in
    /// f64 and bf16 (where a device gathers inside its kernel, the bf16
    /// case runs it): ragged and empty groups, rows past the groups, zero
    /// rows (`-1`), repeated sources, K and N off the kernels' tiles; an
    /// out-of-range source and a non-i32 map are errors naming the op.
    fn gathered_products_equal_the_permuted_ones<B: TestOps>(d: &B) {
        let mut r = rng(29);
        for (sizes, n_rows, t, k, n) in [
            (vec![2i32, 0, 3, 0], 7, 4, 8, 16),
            (vec![1, 0, 130, 64, 3], 203, 150, 136, 264),
            (vec![0, 0], 3, 2, 24, 40),
        ] {
            let g = sizes.len();
            let gs = d.ti32(&sizes, &[g]);
            // Sources: any token (repeats allowed), -1 on every 9th row.
            let src: Vec<i32> = (0..n_rows)
                .map(|i| {
                    if i % 9 == 4 {
                        -1
                    } else {
                        r.gen_range(0..t as i32)
                    }
                })
                .collect();
            let row_src = d.ti32(&src, &[n_rows]);
            for dtype in [DType::F64, DType::BF16] {
                let mk = |r: &mut rand_chacha::ChaCha8Rng, shape: &[usize]| {
                    let v = uniform(r, shape.iter().product());
                    d.cast(&d.t64(&v, shape), dtype).unwrap()
                };
                let x = mk(&mut r, &[t, k]);
                let w = mk(&mut r, &[g, k, n]);
                let dy = mk(&mut r, &[n_rows, n]);
                let xp = d.permute(&x, &row_src).unwrap();
                let what = format!("{sizes:?} {dtype:?}");
                let got = d
                    .grouped_matmul_gathered(&x, &row_src, &w, &gs, false)
                    .unwrap();
                let want = d.grouped_matmul(&xp, &w, &gs, false).unwrap();
                assert_eq!(got.shape(), want.shape(), "forward {what}");
                assert_eq!(d.h64(&got), d.h64(&want), "forward {what}");
                // The transposed weights (the data gradient's layout).
                let wt = mk(&mut r, &[g, n, k]);
                let got = d
                    .grouped_matmul_gathered(&x, &row_src, &wt, &gs, true)
                    .unwrap();
                let want = d.grouped_matmul(&xp, &wt, &gs, true).unwrap();
                assert_eq!(got.shape(), want.shape(), "transposed {what}");
                assert_eq!(d.h64(&got), d.h64(&want), "transposed {what}");
                // The gathered rows on the output-gradient side: x [N, K]
                // dense, dy's rows gathered from [T, K] (here x's source).
                let xn = mk(&mut r, &[n_rows, n]);
                let got = d
                    .grouped_matmul_weight_grad_gathered_dy(&xn, &x, &row_src, &gs)
                    .unwrap();
                let want = d.grouped_matmul_weight_grad(&xn, &xp, &gs).unwrap();
                assert_eq!(got.shape(), want.shape(), "gathered dy {what}");
                assert_eq!(d.h64(&got), d.h64(&want), "gathered dy {what}");
                let got = d
                    .grouped_matmul_weight_grad_gathered(&x, &row_src, &dy, &gs)
                    .unwrap();
                let want = d.grouped_matmul_weight_grad(&xp, &dy, &gs).unwrap();
                assert_eq!(got.shape(), want.shape(), "weight grad {what}");
                assert_eq!(d.h64(&got), d.h64(&want), "weight grad {what}");
                // The paired weight gradients (one kernel for both where a
                // device has it) against the single ones.
                let dy2 = mk(&mut r, &[n_rows, n]);
                let (dw1, dw2) = d
                    .grouped_matmul_weight_grad_pair_gathered(&x, &row_src, &dy, &dy2, &gs)
                    .unwrap();
                assert_eq!(d.h64(&dw1), d.h64(&want), "dw1 {what}");
                let want_dw2 = d.grouped_matmul_weight_grad(&xp, &dy2, &gs).unwrap();
                assert_eq!(d.h64(&dw2), d.h64(&want_dw2), "dw2 {what}");
                let e = d.err_of(
                    d.grouped_matmul_weight_grad_pair_gathered(&x, &row_src, &dy, &xp, &gs)
                        .map(|t| t.1),
                );
                assert!(e.to_string().contains("weight_grad_pair_gathered"), "{e}");
                let bad = d.ti32(&[t as i32; 1].repeat(n_rows), &[n_rows]);
                let e = d.err_of(d.grouped_matmul_gathered(&x, &bad, &w, &gs, false));
                assert!(
                    e.to_string().contains("permute") || e.to_string().contains("gathered"),
                    "{e}"
                );
                let e = d.err_of(d.grouped_matmul_weight_grad_gathered(&x, &bad, &dy, &gs));
                assert!(
                    e.to_string().contains("permute") || e.to_string().contains("gathered"),
                    "{e}"
                );
                let e = d.err_of(d.grouped_matmul_weight_grad_gathered_dy(&xn, &x, &bad, &gs));
                assert!(
                    e.to_string().contains("permute") || e.to_string().contains("gathered"),
                    "{e}"
                );
                let e = d.err_of(
                    d.grouped_matmul_weight_grad_pair_gathered(&x, &bad, &dy, &dy2, &gs)
                        .map(|t| t.1),
                );
                assert!(
                    e.to_string().contains("permute") || e.to_string().contains("gathered"),
                    "{e}"
                );
            }
        }
    }

    device_tests!(gathered_products_equal_the_permuted_ones);
}
