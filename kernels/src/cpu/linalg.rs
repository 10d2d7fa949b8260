//! CPU implementation of the `linalg` ops: dense and grouped GEMM through the
//! `gemm` crate, whose row/column strides express transposes without copies.
//!
//! Shape letters: M rows, K inner dimension, N columns, G groups.

use gemm::Parallelism;
use rayon::prelude::*;

use super::{index_slice, Cpu, FloatStorage};
use crate::backend::LinalgOps;
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, Result};
use crate::tensor::Tensor;

/// Below this many multiply-adds (`m·n·k`) a product runs on one thread: the
/// cost of waking the pool outweighs the split. Measured with
/// `examples/gemm_bench.rs` on a 2-core box, where threading starts paying
/// off around 128³ and clearly wins from 256×128×512 up.
const PARALLEL_MIN_MACS: usize = 1 << 21;

/// A grouped product whose total work is below this runs its groups one after
/// another on one thread (a handful of tiny GEMMs cost less than a fork-join).
const GROUPED_PARALLEL_MIN_MACS: usize = 1 << 18;

/// A strided read-only view of a matrix inside a slice: element `(i, j)` is at
/// `i·rs + j·cs`.
#[derive(Clone, Copy)]
struct MatRef<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A row-major `[rows, cols]` matrix, read transposed when `trans`.
    fn row_major(data: &'a [T], cols: usize, trans: bool) -> Self {
        if trans {
            MatRef {
                data,
                rs: 1,
                cs: cols,
            }
        } else {
            MatRef {
                data,
                rs: cols,
                cs: 1,
            }
        }
    }

    /// Whether every element of a `rows × cols` view lies inside the slice:
    /// the guard that keeps the raw-pointer call below sound.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// Threads to give one product of `m·n·k` multiply-adds.
fn parallelism_for(macs: usize) -> Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 && macs >= PARALLEL_MIN_MACS {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `dst[m×n] (row-major, overwritten) = a[m×k] · b[k×n]`.
///
/// The views were built from validated shapes, so a failing bounds check is a
/// bug in this file, not bad user input; it panics rather than read out of
/// bounds.
fn gemm_into<T: FloatStorage>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    par: Parallelism,
) {
    assert!(
        dst.len() >= m * n && a.covers(m, k) && b.covers(k, n),
        "gemm_into: views do not cover m={m} n={n} k={k}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst[..m * n].fill(T::ZERO);
        return;
    }
    // SAFETY: `covers` checked that every element the product reads lies in
    // `a.data` / `b.data`, and `dst` holds `m·n` row-major elements; the
    // output does not alias the inputs (it is a distinct `&mut`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            par,
        );
    }
}

/// Group sizes as offsets `[G + 1]`, checked: i32, shape `[G]`, non-negative,
/// summing to at most `m`.
fn group_offsets(
    op: &'static str,
    group_sizes: &Tensor<Cpu>,
    g: usize,
    m: usize,
) -> Result<Vec<usize>> {
    let sizes = index_slice(group_sizes, op)?;
    group_sizes.expect_shape(op, "group_sizes", &[g])?;
    let mut offsets = Vec::with_capacity(g + 1);
    offsets.push(0usize);
    let mut total = 0usize;
    for (i, &s) in sizes.iter().enumerate() {
        let s = usize::try_from(s)
            .map_err(|_| arg_err(op, format!("group_sizes[{i}] = {s} is negative")))?;
        total += s;
        offsets.push(total);
    }
    if total > m {
        return Err(arg_err(
            op,
            format!("group sizes {sizes:?} sum to {total}, more than the {m} rows of x"),
        ));
    }
    Ok(offsets)
}

/// Splits `out` into the consecutive row blocks of the groups, `width`
/// elements per row; what is left after the last group is dropped.
fn split_groups<'a, T>(mut out: &'a mut [T], offsets: &[usize], width: usize) -> Vec<&'a mut [T]> {
    let mut parts = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, tail) = std::mem::take(&mut out).split_at_mut((w[1] - w[0]) * width);
        parts.push(head);
        out = tail;
    }
    parts
}

/// Runs `job(g)` for every group, either in parallel over groups (each GEMM
/// single-threaded) or one after another with threaded GEMMs. Parallel over
/// groups wins when there are at least as many non-empty groups as threads and
/// no single group dominates; otherwise the threaded GEMM splits the big one.
fn run_groups<T: Send>(
    parts: Vec<&mut [T]>,
    macs: &[usize],
    job: impl Fn(usize, &mut [T], Parallelism) + Sync,
) {
    let total: usize = macs.iter().sum();
    let biggest = macs.iter().copied().max().unwrap_or(0);
    let threads = rayon::current_num_threads();
    let busy = macs.iter().filter(|&&w| w > 0).count();
    if total < GROUPED_PARALLEL_MIN_MACS || threads == 1 {
        for (g, part) in parts.into_iter().enumerate() {
            job(g, part, Parallelism::None);
        }
    } else if busy >= threads && biggest * threads <= total * 2 {
        parts
            .into_par_iter()
            .enumerate()
            .for_each(|(g, part)| job(g, part, Parallelism::None));
    } else {
        for (g, part) in parts.into_iter().enumerate() {
            job(g, part, parallelism_for(macs[g]));
        }
    }
}

fn matmul_impl<T: FloatStorage>(
    a: &Tensor<Cpu>,
    b: &Tensor<Cpu>,
    trans_a: bool,
    trans_b: bool,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "matmul";
    let (ar, ac) = a.dims2(OP)?;
    let (br, bc) = b.dims2(OP)?;
    let (m, ka) = if trans_a { (ac, ar) } else { (ar, ac) };
    let (kb, n) = if trans_b { (bc, br) } else { (br, bc) };
    if ka != kb {
        return Err(shape_err(
            OP,
            format!(
                "a {:?} (trans_a = {trans_a}) has inner dimension {ka}, b {:?} (trans_b = {trans_b}) has {kb}",
                a.shape(),
                b.shape()
            ),
        ));
    }
    let av = T::slice(a, OP)?;
    let bv = T::slice(b, OP)?;
    let mut out = vec![T::ZERO; m * n];
    gemm_into(
        &mut out,
        (m, n, ka),
        MatRef::row_major(av, ac, trans_a),
        MatRef::row_major(bv, bc, trans_b),
        parallelism_for(m * n * ka),
    );
    T::tensor(out, &[m, n])
}

fn grouped_matmul_impl<T: FloatStorage>(
    x: &Tensor<Cpu>,
    w: &Tensor<Cpu>,
    group_sizes: &Tensor<Cpu>,
    trans_w: bool,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "grouped_matmul";
    let (m, k) = x.dims2(OP)?;
    let (g, wr, wc) = w.dims3(OP)?;
    let (wk, n) = if trans_w { (wc, wr) } else { (wr, wc) };
    if wk != k {
        return Err(shape_err(
            OP,
            format!(
                "x {:?} has K = {k}, w {:?} (trans_w = {trans_w}) has K = {wk}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    let xv = T::slice(x, OP)?;
    let wv = T::slice(w, OP)?;
    let offsets = group_offsets(OP, group_sizes, g, m)?;
    let mut out = vec![T::ZERO; m * n];
    let macs: Vec<usize> = offsets.windows(2).map(|o| (o[1] - o[0]) * k * n).collect();
    let parts = split_groups(&mut out, &offsets, n);
    run_groups(parts, &macs, |gi, dst, par| {
        let rows = offsets[gi + 1] - offsets[gi];
        let xg = &xv[offsets[gi] * k..offsets[gi + 1] * k];
        let wg = &wv[gi * k * n..(gi + 1) * k * n];
        gemm_into(
            dst,
            (rows, n, k),
            MatRef::row_major(xg, k, false),
            MatRef::row_major(wg, wc, trans_w),
            par,
        );
    });
    T::tensor(out, &[m, n])
}

fn grouped_matmul_weight_grad_impl<T: FloatStorage>(
    x: &Tensor<Cpu>,
    dy: &Tensor<Cpu>,
    group_sizes: &Tensor<Cpu>,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "grouped_matmul_weight_grad";
    let (m, k) = x.dims2(OP)?;
    let (my, n) = dy.dims2(OP)?;
    if my != m {
        return Err(shape_err(
            OP,
            format!(
                "x {:?} and dy {:?} disagree on the row count",
                x.shape(),
                dy.shape()
            ),
        ));
    }
    let g = match group_sizes.shape() {
        [g] => *g,
        other => {
            return Err(shape_err(
                OP,
                format!("group_sizes must be 1-d [G], got shape {other:?}"),
            ))
        }
    };
    let xv = T::slice(x, OP)?;
    let dyv = T::slice(dy, OP)?;
    let offsets = group_offsets(OP, group_sizes, g, m)?;
    let mut out = vec![T::ZERO; g * k * n];
    let macs: Vec<usize> = offsets.windows(2).map(|o| (o[1] - o[0]) * k * n).collect();
    let parts: Vec<&mut [T]> = if k * n == 0 {
        (0..g).map(|_| <&mut [T]>::default()).collect()
    } else {
        out.chunks_mut(k * n).collect()
    };
    run_groups(parts, &macs, |gi, dst, par| {
        let xg = &xv[offsets[gi] * k..offsets[gi + 1] * k];
        let dyg = &dyv[offsets[gi] * n..offsets[gi + 1] * n];
        // An empty group leaves its gradient at zero (k = 0 in the product).
        gemm_into(
            dst,
            (k, n, offsets[gi + 1] - offsets[gi]),
            MatRef::row_major(xg, k, true),
            MatRef::row_major(dyg, n, false),
            par,
        );
    });
    T::tensor(out, &[g, k, n])
}

impl LinalgOps for Cpu {
    fn matmul(
        &self,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("matmul", a, matmul_impl(a, b, trans_a, trans_b))
    }

    fn grouped_matmul(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "grouped_matmul",
            x,
            grouped_matmul_impl(x, w, group_sizes, trans_w)
        )
    }

    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "grouped_matmul_weight_grad",
            x,
            grouped_matmul_weight_grad_impl(x, dy, group_sizes)
        )
    }
}
