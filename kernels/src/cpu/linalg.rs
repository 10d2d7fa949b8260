//! CPU implementation of the `linalg` ops: dense and grouped GEMM through the
//! `gemm` crate, whose row/column strides express transposes without copies.
//!
//! Shape letters: M rows, K inner dimension, N columns, G groups.

use gemm::Parallelism;
use rayon::prelude::*;

use super::{index_slice, pool, Cpu, FloatStorage};
use crate::backend::LinalgOps;
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, Result};
use crate::tensor::Tensor;

/// Below this many multiply-adds (`m·n·k`) a product runs on one thread: the
/// fork-join and the per-task packing of `b` cost more than the second core
/// gives.
const PARALLEL_MIN_MACS: usize = 1 << 22;

/// Fewest rows of one task when a product's rows are split over the pool:
/// each task packs its own copy of `b`, which a few microkernel tiles of rows
/// do not repay.
const MIN_TASK_ROWS: usize = 64;

/// A grouped product whose total work is below this runs its groups one after
/// another on one thread (a handful of tiny GEMMs cost less than a fork-join).
const GROUPED_PARALLEL_MIN_MACS: usize = 1 << 18;

/// A strided read-only view of a matrix inside a slice: element `(i, j)` is at
/// `i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// Element `(i, j)` at `data[i·rs + j·cs]`.
    pub(crate) fn strided(data: &'a [T], rs: usize, cs: usize) -> Self {
        MatRef { data, rs, cs }
    }

    /// A row-major `[rows, cols]` matrix, read transposed when `trans`.
    pub(crate) fn row_major(data: &'a [T], cols: usize, trans: bool) -> Self {
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
pub(crate) fn gemm_into<T: FloatStorage>(
    dst: &mut [T],
    dims: (usize, usize, usize),
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    par: Parallelism,
) {
    gemm_with(dst, dims, a, b, par, false)
}

/// `dst[m×n] += a[m×k] · b[k×n]`, in the gemm type (f32 for bf16: `dst`
/// holds unrounded values until the result's one rounding).
pub(crate) fn gemm_acc_into<T: FloatStorage>(
    dst: &mut [T],
    dims: (usize, usize, usize),
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    par: Parallelism,
) {
    gemm_with(dst, dims, a, b, par, true)
}

/// Rows per task of a product with `m` rows split over the pool: about 16
/// tasks (enough for 16 threads to balance), a multiple of 16 rows, and at
/// least [`MIN_TASK_ROWS`]. A function of the shape only, so the split, and
/// with it the result, is the same for every pool size; it is also the same
/// as unsplit, since each task computes whole rows, each element summed over
/// `k` as the unsplit product sums it (the `gemm` crate's `k` blocking
/// depends on `k` and the caches only).
fn task_rows(m: usize) -> usize {
    (m.div_ceil(16).div_ceil(16) * 16).max(MIN_TASK_ROWS)
}

/// [`gemm_into`] (`acc` false: overwrite) or [`gemm_acc_into`] (true: add).
/// `Parallelism::Rayon` splits the rows of `dst` into [`task_rows`] blocks,
/// one single-threaded product each, on rayon's pool: a fork-join per
/// product rather than the `gemm` crate's own threading, whose
/// synchronisation costs as much as it gains on the K = 128 products of
/// small models.
fn gemm_with<T: FloatStorage>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    par: Parallelism,
    acc: bool,
) {
    assert!(
        dst.len() >= m * n && a.covers(m, k) && b.covers(k, n),
        "gemm_into: views do not cover m={m} n={n} k={k}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            dst[..m * n].fill(T::ZERO);
        }
        return;
    }
    let rows = task_rows(m);
    if matches!(par, Parallelism::Rayon(_)) && m > rows {
        dst[..m * n]
            .par_chunks_mut(rows * n)
            .enumerate()
            .for_each(|(i, d)| {
                let a_i = MatRef {
                    data: &a.data[i * rows * a.rs..],
                    ..a
                };
                gemm_with(d, (d.len() / n, n, k), a_i, b, Parallelism::None, acc);
            });
        return;
    }
    // SAFETY: `covers` checked that every element the product reads lies in
    // `a.data` / `b.data`, and `dst` holds `m·n` row-major elements; the
    // output does not alias the inputs (it is a distinct `&mut`).
    // `T` and `T::Gemm` have one layout (the same type, or `Bf16`, a
    // `repr(transparent)` f32), so the pointer casts reinterpret nothing.
    let (zero, one) = (T::to_gemm(T::ZERO), T::to_gemm(T::ONE));
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().cast::<T::Gemm>(),
            1,
            n as isize,
            acc,
            a.data.as_ptr().cast::<T::Gemm>(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().cast::<T::Gemm>(),
            b.cs as isize,
            b.rs as isize,
            if acc { one } else { zero },
            one,
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

/// The `[m, n]` output of a grouped product: the groups' rows left for
/// their GEMMs to overwrite, the padding rows past the last group zero.
fn grouped_output<T: FloatStorage>(m: usize, n: usize, offsets: &[usize]) -> Vec<T> {
    let mut out = pool::take::<T>(m * n);
    let used = offsets.last().copied().unwrap_or(0) * n;
    out[used..].fill(T::ZERO);
    out
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
    let (m, ka, n, ac, bc) = crate::backend::matmul_dims(OP, a, b, trans_a, trans_b)?;
    let av = T::slice(a, OP)?;
    let bv = T::slice(b, OP)?;
    let mut out = pool::take::<T>(m * n);
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
    let mut out = grouped_output::<T>(m, n, &offsets);
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

/// [`LinalgOps::grouped_matmul_sum2`]: per group, the first product into
/// the output and the second added to it before the one rounding.
fn grouped_matmul_sum2_impl<T: FloatStorage>(
    x1: &Tensor<Cpu>,
    w1: &Tensor<Cpu>,
    x2: &Tensor<Cpu>,
    w2: &Tensor<Cpu>,
    group_sizes: &Tensor<Cpu>,
    trans_w: bool,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "grouped_matmul_sum2";
    let (m, k1, k2, g, n) = crate::backend::linalg::sum2_dims(OP, x1, w1, x2, w2, trans_w)?;
    let (x1v, w1v) = (T::slice(x1, OP)?, T::slice(w1, OP)?);
    let (x2v, w2v) = (T::slice(x2, OP)?, T::slice(w2, OP)?);
    let offsets = group_offsets(OP, group_sizes, g, m)?;
    let mut out = grouped_output::<T>(m, n, &offsets);
    let macs: Vec<usize> = offsets
        .windows(2)
        .map(|o| (o[1] - o[0]) * (k1 + k2) * n)
        .collect();
    let parts = split_groups(&mut out, &offsets, n);
    // The stored row length of w (`[K, N]`, or `[N, K]` with trans_w).
    let cols = |k: usize| if trans_w { k } else { n };
    run_groups(parts, &macs, |gi, dst, par| {
        let (lo, hi) = (offsets[gi], offsets[gi + 1]);
        let rows = hi - lo;
        gemm_into(
            dst,
            (rows, n, k1),
            MatRef::row_major(&x1v[lo * k1..hi * k1], k1, false),
            MatRef::row_major(&w1v[gi * k1 * n..(gi + 1) * k1 * n], cols(k1), trans_w),
            par,
        );
        gemm_acc_into(
            dst,
            (rows, n, k2),
            MatRef::row_major(&x2v[lo * k2..hi * k2], k2, false),
            MatRef::row_major(&w2v[gi * k2 * n..(gi + 1) * k2 * n], cols(k2), trans_w),
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
    let mut out = pool::take::<T>(g * k * n);
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

    fn grouped_matmul_sum2(
        &self,
        x1: &Tensor<Self>,
        w1: &Tensor<Self>,
        x2: &Tensor<Self>,
        w2: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "grouped_matmul_sum2",
            x1,
            grouped_matmul_sum2_impl(x1, w1, x2, w2, group_sizes, trans_w)
        )
    }
}

#[cfg(test)]
mod tests {
    use rand::Rng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cpu::test_util::{
        device_tests, dotv as dot, rng, uniform as rand_vec, Compare, TestDevice, TestOps,
    };
    use crate::error::KernelError;
    use crate::gradcheck::assert_grad;
    use crate::tensor::{DType, HostData};
    use crate::Device;

    fn f32t<B: Device>(d: &B, v: &[f64], shape: &[usize]) -> Tensor<B> {
        d.upload(HostData::F32(v.iter().map(|&x| x as f32).collect()), shape)
            .unwrap()
    }

    fn i32t<B: Device>(d: &B, v: &[i32]) -> Tensor<B> {
        d.upload(HostData::I32(v.to_vec()), &[v.len()]).unwrap()
    }

    /// Row-major transpose of a `[r, c]` matrix.
    fn transpose(v: &[f64], r: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0.0; v.len()];
        for i in 0..r {
            for j in 0..c {
                out[j * r + i] = v[i * c + j];
            }
        }
        out
    }

    /// Naive f64 `op(a) · op(b)`: the independent reference.
    fn naive_matmul(
        a: &[f64],
        b: &[f64],
        (m, k, n): (usize, usize, usize),
        ta: bool,
        tb: bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    s += av * bv;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    fn shape_of(rows: usize, cols: usize, trans: bool) -> [usize; 2] {
        if trans {
            [cols, rows]
        } else {
            [rows, cols]
        }
    }

    fn matmul_grad_all_transposes<B: TestOps>(d: &B) {
        let mut r = rng(1);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let (m, k, n) = (r.gen_range(1..5), r.gen_range(1..5), r.gen_range(1..5));
            let sa = shape_of(m, k, ta);
            let sb = shape_of(k, n, tb);
            let a = rand_vec(&mut r, m * k);
            let b = rand_vec(&mut r, k * n);
            let rr = rand_vec(&mut r, m * n);
            let rt = d.t64(&rr, &[m, n]);
            let (at, bt) = (d.t64(&a, &sa), d.t64(&b, &sb));
            // dop(a) = R · op(b)ᵀ and dop(b) = op(a)ᵀ · R, written back in the
            // operands' own (possibly transposed) layouts.
            let da = if ta {
                d.matmul(&bt, &rt, tb, true)
            } else {
                d.matmul(&rt, &bt, false, !tb)
            }
            .unwrap();
            let db = if tb {
                d.matmul(&rt, &at, true, ta)
            } else {
                d.matmul(&at, &rt, !ta, false)
            }
            .unwrap();
            assert_eq!(da.shape(), sa);
            assert_eq!(db.shape(), sb);
            let obj = |a: &[f64], b: &[f64]| {
                let out = d.matmul(&d.t64(a, &sa), &d.t64(b, &sb), ta, tb).unwrap();
                dot(&d.h64(&out), &rr)
            };
            let what = format!("matmul da (ta={ta}, tb={tb})");
            assert_grad(&what, &a, &d.h64(&da), 1e-6, |a| obj(a, &b));
            let what = format!("matmul db (ta={ta}, tb={tb})");
            assert_grad(&what, &b, &d.h64(&db), 1e-6, |b| obj(&a, b));
        }
    }

    fn matmul_f32_and_f64_match_naive_reference<B: TestOps>(d: &B) {
        let mut r = rng(2);
        for &(m, k, n) in &[(1, 1, 1), (7, 13, 5), (33, 70, 17), (160, 128, 129)] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = rand_vec(&mut r, m * k);
                let b = rand_vec(&mut r, k * n);
                let want = naive_matmul(&a, &b, (m, k, n), ta, tb);
                let (sa, sb) = (shape_of(m, k, ta), shape_of(k, n, tb));
                let got64 = d.h64(&d.matmul(&d.t64(&a, &sa), &d.t64(&b, &sb), ta, tb).unwrap());
                let got32 = d
                    .matmul(&f32t(d, &a, &sa), &f32t(d, &b, &sb), ta, tb)
                    .unwrap();
                assert_eq!(got32.dtype(), DType::F32);
                assert_eq!(got32.shape(), [m, n]);
                let got32 = d.h64(&got32);
                for i in 0..m * n {
                    assert!(
                        (got64[i] - want[i]).abs() <= 1e-12 * k as f64,
                        "f64 {m}x{k}x{n}"
                    );
                    // Inputs rounded to f32 plus f32 accumulation: ~k ulps.
                    assert!(
                        (got32[i] - want[i]).abs() <= 1e-6 * k as f64,
                        "f32 {m}x{k}x{n} ta={ta} tb={tb}: {} vs {}",
                        got32[i],
                        want[i]
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_threaded_gemm_matches_naive_reference() {
        // Below PARALLEL_MIN_MACS the op itself stays single-threaded, so the
        // threaded path is driven directly.
        let mut r = rng(6);
        let (m, k, n) = (70, 50, 90);
        for (ta, tb) in [(false, false), (true, true)] {
            let a = rand_vec(&mut r, m * k);
            let b = rand_vec(&mut r, k * n);
            let mut out = vec![0.0f64; m * n];
            gemm_into(
                &mut out,
                (m, n, k),
                MatRef::row_major(&a, if ta { m } else { k }, ta),
                MatRef::row_major(&b, if tb { k } else { n }, tb),
                Parallelism::Rayon(2),
            );
            let want = naive_matmul(&a, &b, (m, k, n), ta, tb);
            for (x, y) in out.iter().zip(&want) {
                assert!((x - y).abs() <= 1e-12 * k as f64);
            }
        }
    }

    fn matmul_empty_dimensions_give_zeros<B: TestOps>(d: &B) {
        for &(m, k, n) in &[(0, 3, 4), (3, 0, 4), (3, 4, 0), (0, 0, 0)] {
            let a = d.t64(&vec![1.0; m * k], &[m, k]);
            let b = d.t64(&vec![1.0; k * n], &[k, n]);
            let out = d.matmul(&a, &b, false, false).unwrap();
            assert_eq!(out.shape(), [m, n]);
            assert!(d.h64(&out).iter().all(|&v| v == 0.0));
        }
    }

    fn matmul_rejects_bad_input<B: TestOps>(d: &B) {
        let a = d.t64(&[0.0; 6], &[2, 3]);
        let b = d.t64(&[0.0; 8], &[4, 2]);
        let err = d.matmul(&a, &b, false, false).unwrap_err();
        assert!(matches!(
            err,
            KernelError::ShapeMismatch { op: "matmul", .. }
        ));
        let msg = err.to_string();
        assert!(msg.contains("[2, 3]") && msg.contains("[4, 2]"), "{msg}");

        let b32 = f32t(d, &[0.0; 6], &[3, 2]);
        let err = d.matmul(&a, &b32, false, false).unwrap_err();
        assert_eq!(
            err,
            KernelError::DTypeMismatch {
                op: "matmul",
                expected: DType::F64,
                got: DType::F32
            }
        );
        let ai = d.upload(HostData::I32(vec![0; 6]), &[2, 3]).unwrap();
        let err = d.matmul(&ai, &b32, false, false).unwrap_err();
        assert!(matches!(
            err,
            KernelError::UnsupportedDType {
                dtype: DType::I32,
                ..
            }
        ));
        let a3 = d.t64(&[0.0; 6], &[1, 2, 3]);
        let err = d.matmul(&a3, &a, false, false).unwrap_err();
        assert!(err.to_string().contains("[1, 2, 3]"), "{err}");
    }

    /// Naive grouped product: per-group naive matmul, padding rows zero.
    fn naive_grouped(
        x: &[f64],
        w: &[f64],
        sizes: &[usize],
        (m, k, n): (usize, usize, usize),
        trans_w: bool,
    ) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        let mut off = 0;
        for (g, &s) in sizes.iter().enumerate() {
            let y = naive_matmul(
                &x[off * k..(off + s) * k],
                &w[g * k * n..(g + 1) * k * n],
                (s, k, n),
                false,
                trans_w,
            );
            out[off * n..(off + s) * n].copy_from_slice(&y);
            off += s;
        }
        out
    }

    fn naive_weight_grad(
        x: &[f64],
        dy: &[f64],
        sizes: &[usize],
        (k, n): (usize, usize),
    ) -> Vec<f64> {
        let mut out = Vec::new();
        let mut off = 0;
        for &s in sizes {
            out.extend(naive_matmul(
                &x[off * k..(off + s) * k],
                &dy[off * n..(off + s) * n],
                (k, s, n),
                true,
                false,
            ));
            off += s;
        }
        out
    }

    fn as_i32(sizes: &[usize]) -> Vec<i32> {
        sizes.iter().map(|&s| s as i32).collect()
    }

    /// Ragged sizes with some empty groups, summing to at most `m`.
    fn ragged_sizes(r: &mut ChaCha8Rng, g: usize, m: usize) -> Vec<usize> {
        let mut left = m;
        (0..g)
            .map(|_| {
                if r.gen_bool(0.3) || left == 0 {
                    0
                } else {
                    let s = r.gen_range(0..=left);
                    left -= s;
                    s
                }
            })
            .collect()
    }

    fn grouped_matmul_matches_naive_per_group<B: TestOps>(d: &B) {
        let mut r = rng(3);
        let mut cases: Vec<(Vec<usize>, usize, usize, usize)> = vec![
            (vec![0, 0, 0], 4, 3, 5),        // all empty, every row padding
            (vec![2, 0, 3, 0], 6, 4, 3),     // empty groups and a padding row
            (vec![0], 0, 2, 2),              // no rows at all
            (vec![90, 80, 70], 240, 64, 48), // groups in parallel
            (vec![3, 230, 5], 240, 64, 48),  // one big group, one after another
        ];
        for _ in 0..6 {
            let g = r.gen_range(1..6);
            let m = r.gen_range(0..20);
            cases.push((
                ragged_sizes(&mut r, g, m),
                m,
                r.gen_range(1..7),
                r.gen_range(1..7),
            ));
        }
        for (sizes, m, k, n) in cases {
            let g = sizes.len();
            for trans_w in [false, true] {
                let x = rand_vec(&mut r, m * k);
                let w = rand_vec(&mut r, g * k * n);
                let want = naive_grouped(&x, &w, &sizes, (m, k, n), trans_w);
                let ws = if trans_w { [g, n, k] } else { [g, k, n] };
                let gs = i32t(d, &as_i32(&sizes));
                let got = d.grouped_matmul(&d.t64(&x, &[m, k]), &d.t64(&w, &ws), &gs, trans_w);
                let got = got.unwrap();
                assert_eq!(got.shape(), [m, n]);
                for (a, b) in d.h64(&got).iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-12 * k as f64, "{sizes:?} {a} vs {b}");
                }
                let got32 = d
                    .grouped_matmul(&f32t(d, &x, &[m, k]), &f32t(d, &w, &ws), &gs, trans_w)
                    .unwrap();
                for (a, b) in d.h64(&got32).iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-6 * k as f64, "f32 {sizes:?} {a} vs {b}");
                }
            }
        }
    }

    fn grouped_matmul_weight_grad_matches_naive_per_group<B: TestOps>(d: &B) {
        let mut r = rng(4);
        let mut cases = vec![(vec![0, 0], 3, 2, 2), (vec![100, 90, 0, 60], 250, 64, 40)];
        for _ in 0..6 {
            let g = r.gen_range(1..6);
            let m = r.gen_range(0..20);
            cases.push((
                ragged_sizes(&mut r, g, m),
                m,
                r.gen_range(1..7),
                r.gen_range(1..7),
            ));
        }
        for (sizes, m, k, n) in cases {
            let g = sizes.len();
            let x = rand_vec(&mut r, m * k);
            let dy = rand_vec(&mut r, m * n);
            let want = naive_weight_grad(&x, &dy, &sizes, (k, n));
            let gs = i32t(d, &as_i32(&sizes));
            let got = d
                .grouped_matmul_weight_grad(&d.t64(&x, &[m, k]), &d.t64(&dy, &[m, n]), &gs)
                .unwrap();
            assert_eq!(got.shape(), [g, k, n]);
            for (a, b) in d.h64(&got).iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-12 * m.max(1) as f64,
                    "{sizes:?} {a} vs {b}"
                );
            }
        }
    }

    fn grouped_matmul_grad_ragged_and_empty_groups<B: TestOps>(d: &B) {
        let mut r = rng(5);
        // Empty groups first, last and in the middle, plus padding rows.
        let cases = [
            (vec![0, 3, 0, 2, 0], 7, 3, 4),
            (vec![4, 0, 1], 5, 2, 3),
            (vec![1, 2, 3], 6, 4, 2),
        ];
        for (sizes, m, k, n) in cases {
            let g = sizes.len();
            let gs = i32t(d, &as_i32(&sizes));
            for trans_w in [false, true] {
                let ws = if trans_w { [g, n, k] } else { [g, k, n] };
                let x = rand_vec(&mut r, m * k);
                let w = rand_vec(&mut r, g * k * n);
                let rr = rand_vec(&mut r, m * n);
                let obj = |x: &[f64], w: &[f64]| {
                    let y = d
                        .grouped_matmul(&d.t64(x, &[m, k]), &d.t64(w, &ws), &gs, trans_w)
                        .unwrap();
                    dot(&d.h64(&y), &rr)
                };
                let rt = d.t64(&rr, &[m, n]);
                // dx = R · wᵀ per group (padding rows get zero), dw = xᵀ · R.
                let dx = d
                    .grouped_matmul(&rt, &d.t64(&w, &ws), &gs, !trans_w)
                    .unwrap();
                let mut dw = d.h64(
                    &d.grouped_matmul_weight_grad(&d.t64(&x, &[m, k]), &rt, &gs)
                        .unwrap(),
                );
                if trans_w {
                    dw = (0..g)
                        .flat_map(|gi| transpose(&dw[gi * k * n..(gi + 1) * k * n], k, n))
                        .collect();
                }
                let what = format!("grouped_matmul dx {sizes:?} trans_w={trans_w}");
                assert_grad(&what, &x, &d.h64(&dx), 1e-6, |x| obj(x, &w));
                let what = format!("grouped_matmul dw {sizes:?} trans_w={trans_w}");
                assert_grad(&what, &w, &dw, 1e-6, |w| obj(&x, w));
            }
        }
    }

    fn grouped_matmul_rejects_bad_group_sizes<B: TestOps>(d: &B) {
        let x = d.t64(&[0.0; 12], &[4, 3]);
        let w = d.t64(&[0.0; 12], &[2, 3, 2]);
        let err = d.err_of(d.grouped_matmul(&x, &w, &i32t(d, &[3, 2]), false));
        assert!(matches!(err, KernelError::InvalidArgument { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("[3, 2]") && msg.contains("sum to 5") && msg.contains('4'),
            "{msg}"
        );

        let err = d.err_of(d.grouped_matmul(&x, &w, &i32t(d, &[-1, 2]), false));
        assert!(matches!(err, KernelError::InvalidArgument { .. }));
        assert!(err.to_string().contains("-1"), "{err}");

        let err = d
            .grouped_matmul(&x, &w, &i32t(d, &[1, 1, 1]), false)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(
            err.to_string().contains("[3]") && err.to_string().contains("[2]"),
            "{err}"
        );

        let fsizes = d.t64(&[1.0, 1.0], &[2]);
        let err = d.grouped_matmul(&x, &w, &fsizes, false).unwrap_err();
        assert_eq!(
            err,
            KernelError::DTypeMismatch {
                op: "grouped_matmul",
                expected: DType::I32,
                got: DType::F64
            }
        );

        let err = d
            .grouped_matmul(&x, &w, &i32t(d, &[1, 1]), true)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[2, 3, 2]"), "{err}");

        let w32 = f32t(d, &[0.0; 12], &[2, 3, 2]);
        let err = d
            .grouped_matmul(&x, &w32, &i32t(d, &[1, 1]), false)
            .unwrap_err();
        assert!(matches!(
            err,
            KernelError::DTypeMismatch {
                got: DType::F32,
                ..
            }
        ));

        let dy = d.t64(&[0.0; 10], &[5, 2]);
        let err = d
            .grouped_matmul_weight_grad(&x, &dy, &i32t(d, &[1, 1]))
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[4, 3]") && err.to_string().contains("[5, 2]"));
        let dy = d.t64(&[0.0; 8], &[4, 2]);
        let err = d.err_of(d.grouped_matmul_weight_grad(&x, &dy, &i32t(d, &[4, 1])));
        assert!(err.to_string().contains("sum to 5"), "{err}");
    }

    /// Dense GEMMs in every transpose, and the grouped GEMM and its weight
    /// gradient over ragged groups (empty ones and padding rows included),
    /// on random f32 (and bf16 where the device stores it) against the CPU.
    fn linalg_matches_cpu<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            let mut c = Compare::new(d, dtype, 50);
            for (m, k, n) in [(64, 96, 80), (257, 130, 33), (1, 1000, 3)] {
                for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                    let (a, ac) = c.rand(&shape_of(m, k, ta), 1.0);
                    let (b, bc) = c.rand(&shape_of(k, n, tb), 1.0);
                    c.check(
                        &format!("matmul {m}x{k}x{n} ta={ta} tb={tb}"),
                        &d.matmul(&a, &b, ta, tb).unwrap(),
                        &Cpu.matmul(&ac, &bc, ta, tb).unwrap(),
                    );
                }
            }
            // Small and ragged, then several 128-row tiles per group and
            // columns over two tiles (the bf16 tensor-core kernel's edges).
            let cases: [(&[i32], usize, usize, usize); 2] = [
                (&[37, 0, 5, 64, 0, 1, 100, 20], 240, 96, 72),
                (&[300, 0, 129, 1], 500, 200, 300),
            ];
            for (sizes, m, k, n) in cases {
                let g = sizes.len();
                let (gs, gsc) = c.idx(sizes, &[g]);
                let (x, xc) = c.rand(&[m, k], 1.0);
                for trans_w in [false, true] {
                    let (w, wc) = c.rand(&if trans_w { [g, n, k] } else { [g, k, n] }, 1.0);
                    c.check(
                        &format!("grouped_matmul {sizes:?} trans_w={trans_w}"),
                        &d.grouped_matmul(&x, &w, &gs, trans_w).unwrap(),
                        &Cpu.grouped_matmul(&xc, &wc, &gsc, trans_w).unwrap(),
                    );
                }
                let (dy, dyc) = c.rand(&[m, n], 1.0);
                c.check(
                    &format!("grouped_matmul_weight_grad {sizes:?}"),
                    &d.grouped_matmul_weight_grad(&x, &dy, &gs).unwrap(),
                    &Cpu.grouped_matmul_weight_grad(&xc, &dyc, &gsc).unwrap(),
                );
                // The experts' dx over both projections (wgmma on sm_90a in
                // bf16 for the first case; the second has N = 300, not a
                // multiple of 8).
                let (x2, x2c) = c.rand(&[m, 2 * k], 1.0);
                for trans_w in [false, true] {
                    let ws = |kk: usize| if trans_w { [g, n, kk] } else { [g, kk, n] };
                    let (w1, w1c) = c.rand(&ws(k), 1.0);
                    let (w2, w2c) = c.rand(&ws(2 * k), 1.0);
                    c.check(
                        &format!("grouped_matmul_sum2 {sizes:?} trans_w={trans_w}"),
                        &d.grouped_matmul_sum2(&x, &w1, &x2, &w2, &gs, trans_w)
                            .unwrap(),
                        &Cpu.grouped_matmul_sum2(&xc, &w1c, &x2c, &w2c, &gsc, trans_w)
                            .unwrap(),
                    );
                }
            }
            c.report("linalg");
        }
    }

    /// The experts' fused dx product against the products it fuses, in f64
    /// on every device: `grouped_matmul_sum2` is the sum of two
    /// `grouped_matmul`s (to rounding); shape errors name the op.
    fn fused_grouped_ops_match_their_compositions<B: TestOps>(d: &B) {
        let mut r = rng(17);
        for (sizes, m, k, n) in [
            (vec![2usize, 0, 3, 0], 6, 4, 3),
            (vec![0, 0], 3, 2, 5),
            (vec![5, 7, 1], 13, 6, 9),
        ] {
            let g = sizes.len();
            let gs = i32t(d, &as_i32(&sizes));
            let k2 = k + 3;
            for trans_w in [false, true] {
                let ws = |kk: usize| if trans_w { [g, n, kk] } else { [g, kk, n] };
                let x1 = d.t64(&rand_vec(&mut r, m * k), &[m, k]);
                let x2 = d.t64(&rand_vec(&mut r, m * k2), &[m, k2]);
                let w1 = d.t64(&rand_vec(&mut r, g * k * n), &ws(k));
                let w2 = d.t64(&rand_vec(&mut r, g * k2 * n), &ws(k2));
                let got = d.h64(
                    &d.grouped_matmul_sum2(&x1, &w1, &x2, &w2, &gs, trans_w)
                        .unwrap(),
                );
                let a = d.h64(&d.grouped_matmul(&x1, &w1, &gs, trans_w).unwrap());
                let b = d.h64(&d.grouped_matmul(&x2, &w2, &gs, trans_w).unwrap());
                for (i, v) in got.iter().enumerate() {
                    assert!(
                        (v - (a[i] + b[i])).abs() <= 1e-12 * (k + k2) as f64,
                        "sum2 {sizes:?} [{i}]"
                    );
                }
                let err = d.err_of(d.grouped_matmul_sum2(&x1, &w1, &x1, &w2, &gs, trans_w));
                assert!(err.to_string().contains("grouped_matmul_sum2"), "{err}");
            }
        }
    }

    device_tests!(
        fused_grouped_ops_match_their_compositions,
        linalg_matches_cpu,
        matmul_grad_all_transposes,
        matmul_f32_and_f64_match_naive_reference,
        matmul_empty_dimensions_give_zeros,
        matmul_rejects_bad_input,
        grouped_matmul_matches_naive_per_group,
        grouped_matmul_weight_grad_matches_naive_per_group,
        grouped_matmul_grad_ragged_and_empty_groups,
        grouped_matmul_rejects_bad_group_sizes,
    );
}
