//! CPU elementwise maps, activations, row/column broadcasts and reductions.
//!
//! Shape letters: R rows (all leading dims flattened), C columns (last dim).
//! Every parallel loop splits work by shape alone, never by thread count, and
//! reductions combine their partial results in a fixed order, so results are
//! bit-identical from run to run and across pool sizes.

use rayon::prelude::*;

use super::{index_tensor, pool, simd, Cpu, Float, FloatStorage};
use crate::backend::{swiglu_weighted_args, ElementwiseOps};
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

/// Elements per rayon task: below this a task is not worth its scheduling cost.
pub(crate) const GRAIN: usize = 1 << 14;

/// Upper bound on the partial results of a column or total reduction, so their
/// memory stays small whatever the input size.
pub(crate) const MAX_PARTIALS: usize = 64;

/// Rows per rayon task for rows of `c` columns.
pub(crate) fn rows_per_task(c: usize) -> usize {
    (GRAIN / c.max(1)).max(1)
}

pub(crate) use crate::backend::rows_cols;

/// Both operands' values, after checking they agree on shape (and, through
/// the typed slices, on dtype).
fn same_shape<'a, T: FloatStorage>(
    op: &'static str,
    a: &'a Tensor<Cpu>,
    b: &'a Tensor<Cpu>,
) -> Result<(&'a [T], &'a [T])> {
    if a.shape() != b.shape() {
        return Err(shape_err(
            op,
            format!(
                "operands have shapes {:?} and {:?}; they must be equal",
                a.shape(),
                b.shape()
            ),
        ));
    }
    Ok((T::slice(a, op)?, T::slice(b, op)?))
}

// The maps below write into preallocated outputs chunk by chunk: each
// chunk's loop is plain indexing, which the compiler vectorises (rayon's
// `collect`/`unzip` over element iterators does not, and `unzip` splits
// every result in two buffers on the way).

fn unary<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    f: impl Fn(T) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let xs = T::slice(x, op)?;
    let mut out = pool::take::<T>(xs.len());
    out.par_chunks_mut(GRAIN)
        .zip(xs.par_chunks(GRAIN))
        .for_each(|(o, x)| {
            simd(
                #[inline(always)]
                || {
                    for (o, &x) in o.iter_mut().zip(x) {
                        *o = f(x);
                    }
                },
            )
        });
    T::tensor(out, x.shape())
}

fn binary<T: FloatStorage>(
    op: &'static str,
    a: &Tensor<Cpu>,
    b: &Tensor<Cpu>,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let (xs, ys) = same_shape::<T>(op, a, b)?;
    let mut out = pool::take::<T>(xs.len());
    out.par_chunks_mut(GRAIN)
        .zip(xs.par_chunks(GRAIN).zip(ys.par_chunks(GRAIN)))
        .for_each(|(o, (x, y))| {
            simd(
                #[inline(always)]
                || {
                    for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                        *o = f(x, y);
                    }
                },
            )
        });
    T::tensor(out, a.shape())
}

fn ternary<T: FloatStorage>(
    op: &'static str,
    a: &Tensor<Cpu>,
    b: &Tensor<Cpu>,
    c: &Tensor<Cpu>,
    f: impl Fn(T, T, T) -> (T, T) + Sync + Send,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    let (xs, ys) = same_shape::<T>(op, a, b)?;
    let (_, zs) = same_shape::<T>(op, a, c)?;
    let (mut o1, mut o2) = (pool::take::<T>(xs.len()), pool::take::<T>(xs.len()));
    o1.par_chunks_mut(GRAIN)
        .zip(o2.par_chunks_mut(GRAIN))
        .zip(xs.par_chunks(GRAIN).zip(ys.par_chunks(GRAIN)))
        .zip(zs.par_chunks(GRAIN))
        .for_each(|(((o1, o2), (x, y)), z)| {
            simd(
                #[inline(always)]
                || {
                    for i in 0..o1.len() {
                        (o1[i], o2[i]) = f(x[i], y[i], z[i]);
                    }
                },
            )
        });
    Ok((T::tensor(o1, a.shape())?, T::tensor(o2, a.shape())?))
}

/// Logistic function from `e = exp(−|x|)`, which never overflows: `1/(1+e)`
/// for x ≥ 0, `e/(1+e)` below (both computed, one selected, so that loops
/// over it vectorise).
pub(crate) fn sigmoid_f<T: Float>(x: T) -> T {
    let ax = if x >= T::ZERO { x } else { T::ZERO - x };
    let e = (T::ZERO - ax).exp();
    let s = T::ONE / (T::ONE + e);
    if x >= T::ZERO {
        s
    } else {
        e * s
    }
}

/// `log(sigmoid(x)) = min(x, 0) − log1p(exp(−|x|))`: the exponent is never
/// positive, and `log1p` keeps the tail (`≈ −exp(−x)` for large x) that
/// `ln(1 + ·)` would round to 0. Evaluated in f64 because [`Float`] has no
/// `log1p`; f32 results are then rounded once.
fn log_sigmoid_f<T: Float>(x: T) -> T {
    let v = x.to_f64();
    T::from_f64(v.min(0.0) - (-v.abs()).exp().ln_1p())
}

fn sign_f<T: Float>(x: T) -> T {
    if x > T::ZERO {
        T::ONE
    } else if x < T::ZERO {
        -T::ONE
    } else {
        T::ZERO
    }
}

/// [`unary`] after checking the input: NaN is a [`KernelError::NonFinite`],
/// and a value `in_domain` rejects is an invalid argument explained by `rule`.
/// The first offender in memory order is reported, found deterministically.
fn checked_unary<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    rule: &str,
    in_domain: impl Fn(f64) -> bool + Sync + Send,
    f: impl Fn(T) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let xs = T::slice(x, op)?;
    let bad = xs.par_iter().with_min_len(GRAIN).position_first(|&v| {
        let v = v.to_f64();
        v.is_nan() || !in_domain(v)
    });
    if let Some(i) = bad {
        let value = xs[i].to_f64();
        if value.is_nan() {
            return Err(KernelError::NonFinite {
                op,
                what: "x",
                value,
            });
        }
        return Err(arg_err(
            op,
            format!(
                "element {i} of x (shape {:?}) is {value}; {rule}",
                x.shape()
            ),
        ));
    }
    unary::<T>(op, x, f)
}

/// `shape` filled with `value`. Plain `vec!`: writing a constant is bound by
/// memory bandwidth, which more threads do not add on a CPU.
fn fill_t(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor<Cpu>> {
    const OP: &str = "fill";
    if value.is_nan() {
        return Err(KernelError::NonFinite {
            op: OP,
            what: "value",
            value,
        });
    }
    let n = shape.iter().product();
    match dtype {
        DType::F64 => f64::tensor(vec![value; n], shape),
        DType::F32 => {
            let v = value as f32;
            if value.is_finite() && !v.is_finite() {
                return Err(arg_err(
                    OP,
                    format!(
                        "value {value:e} is beyond f32's range (±{:e}); use F64 or pass ±inf explicitly",
                        f32::MAX
                    ),
                ));
            }
            f32::tensor(vec![v; n], shape)
        }
        DType::I32 => {
            let (lo, hi) = (i32::MIN as f64, i32::MAX as f64);
            if value.fract() != 0.0 || value < lo || value > hi {
                return Err(arg_err(
                    OP,
                    format!("value {value} is not an integer in [{lo}, {hi}], so it cannot fill an I32 tensor"),
                ));
            }
            index_tensor(vec![value as i32; n], shape)
        }
        DType::BF16 => {
            let v = super::bf16::round_f64(value);
            if value.is_finite() && !v.is_finite() {
                return Err(arg_err(
                    OP,
                    format!(
                        "value {value:e} is beyond BF16's range (±{:e}); use F64 or pass ±inf explicitly",
                        half::bf16::MAX.to_f64()
                    ),
                ));
            }
            super::Bf16::tensor(vec![super::Bf16::round(v); n], shape)
        }
    }
}

fn silu_grad_f<T: Float>(x: T) -> T {
    silu_grad_of(x, sigmoid_f(x))
}

/// `silu'(x)` from `s = sigmoid(x)`, for callers that need `s` too.
fn silu_grad_of<T: Float>(x: T, s: T) -> T {
    s * (T::ONE + x * (T::ONE - s))
}

/// Applies `f(x_row, out_row)` to every row, in parallel for large inputs.
fn map_rows<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    f: impl Fn(&[T], &mut [T]) + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let (_, c, _) = rows_cols(op, x)?;
    let xs = T::slice(x, op)?;
    let mut out = pool::take::<T>(xs.len());
    if c > 0 {
        out.par_chunks_mut(c)
            .zip(xs.par_chunks(c))
            .with_min_len(rows_per_task(c))
            .for_each(|(o, r)| {
                simd(
                    #[inline(always)]
                    || f(r, o),
                )
            });
    }
    T::tensor(out, x.shape())
}

/// Reduces every row to one value; output shape is the leading dims.
fn reduce_rows<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    f: impl Fn(usize, &[T]) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let (r, c, lead) = rows_cols(op, x)?;
    let xs = T::slice(x, op)?;
    let out: Vec<T> = if c == 0 {
        (0..r).map(|i| f(i, &[])).collect()
    } else {
        xs.par_chunks(c)
            .enumerate()
            .with_min_len(rows_per_task(c))
            .map(|(i, row)| f(i, row))
            .collect()
    };
    T::tensor(out, lead)
}

fn softmax_t<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    map_rows::<T>("softmax", x, |row, out| {
        let mx = lane_max(row);
        for (o, &v) in out.iter_mut().zip(row) {
            *o = (v - mx).exp();
        }
        let inv = T::ONE / lane_sum(out);
        out.iter_mut().for_each(|o| *o *= inv);
    })
}

fn softmax_backward_t<T: FloatStorage>(y: &Tensor<Cpu>, dy: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "softmax_backward";
    let (ys, dys) = same_shape::<T>(OP, y, dy)?;
    let (_, c, _) = rows_cols(OP, y)?;
    let mut out = pool::take::<T>(ys.len());
    if c > 0 {
        out.par_chunks_mut(c)
            .zip(ys.par_chunks(c).zip(dys.par_chunks(c)))
            .with_min_len(rows_per_task(c))
            .for_each(|(o, (yr, dr))| {
                let s = dot(yr, dr);
                for ((o, &y), &d) in o.iter_mut().zip(yr).zip(dr) {
                    *o = y * (d - s);
                }
            });
    }
    T::tensor(out, y.shape())
}

/// `log Σ exp(row)`, shifted by the row max; an infinite or NaN max is the
/// answer itself (shifting by it would turn `inf - inf` into NaN).
#[inline(always)]
pub(crate) fn row_logsumexp<T: Float>(row: &[T]) -> T {
    let mx = lane_max(row);
    if !mx.is_finite() {
        return mx;
    }
    // Exponentials in blocks on the stack, so that the map vectorises
    // before the lane sum adds them.
    const BLOCK: usize = 256;
    let mut buf = [T::ZERO; BLOCK];
    let mut s = T::ZERO;
    for chunk in row.chunks(BLOCK) {
        let e = &mut buf[..chunk.len()];
        for (e, &v) in e.iter_mut().zip(chunk) {
            *e = (v - mx).exp();
        }
        s += lane_sum(e);
    }
    mx + s.ln()
}

fn logsumexp_t<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    let (r, c, _) = rows_cols("logsumexp", x)?;
    if c == 0 && r > 0 {
        return Err(KernelError::Empty {
            op: "logsumexp",
            what: "last dimension",
        });
    }
    reduce_rows::<T>("logsumexp", x, |_, row| row_logsumexp(row))
}

/// Rounding to bfloat16 (8 significant bits), ties to even.
pub(crate) trait RoundBf16: FloatStorage {
    /// The nearest bf16 value, in `Self`.
    fn round_bf16(self) -> Self;
}

/// Round-to-nearest-even on the f32 bit pattern: adding `0x7fff` plus the
/// kept LSB carries into the kept bits exactly when the dropped half is above
/// the tie, or at the tie with an odd kept LSB. A carry out of the mantissa
/// bumps the exponent, which is also right (up to infinity on overflow).
pub(crate) fn f32_to_bf16_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Truncating could clear every mantissa bit and turn NaN into infinity.
        return (bits & 0xffff_0000) | 0x0040_0000;
    }
    let lsb = (bits >> 16) & 1;
    bits.wrapping_add(0x7fff + lsb) & 0xffff_0000
}

impl RoundBf16 for f32 {
    fn round_bf16(self) -> Self {
        f32::from_bits(f32_to_bf16_bits(self))
    }
}

/// f64 → f32 rounding to odd: truncate, and if anything was dropped force the
/// last bit to 1. Rounding to odd into a format with at least two more bits
/// than the final one (24 ≥ 8 + 2) makes the second, nearest-even, rounding
/// correct, where f64 → f32 → bf16 with nearest-even twice could round a value
/// just above a bf16 tie down to the tie and then to even.
pub(crate) fn f64_to_f32_odd(x: f64) -> f32 {
    let f = x as f32;
    if x.is_nan() || f as f64 == x {
        return f;
    }
    // `as` rounds to nearest; step back toward zero if it went past `x`.
    let mut bits = f.to_bits();
    if (f as f64).abs() > x.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

impl RoundBf16 for super::Bf16 {
    fn round_bf16(self) -> Self {
        // Stored bf16 values are representable already: the identity there.
        self.stored()
    }
}

impl RoundBf16 for f64 {
    fn round_bf16(self) -> Self {
        f32::from_bits(f32_to_bf16_bits(f64_to_f32_odd(self))) as f64
    }
}

fn round_bf16_t<T: RoundBf16>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    unary::<T>("round_bf16", x, T::round_bf16)
}

/// Dot product in a fixed order: eight interleaved partial sums, combined
/// pairwise, then the tail. A single running sum is one long dependency
/// chain the compiler may not reorder; eight independent lanes vectorise.
#[inline(always)]
pub(crate) fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    const L: usize = 8;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    let mut acc = [T::ZERO; L];
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&x, &y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `op` folded over `a` in a fixed order, as [`dot`] sums: eight interleaved
/// lanes from `init`, combined pairwise, then the tail (so that the loop
/// vectorises).
#[inline(always)]
fn lane_fold<T: Float>(a: &[T], init: T, op: impl Fn(T, T) -> T) -> T {
    const L: usize = 8;
    let ca = a.chunks_exact(L);
    let ra = ca.remainder();
    let mut acc = [init; L];
    for x in ca {
        for l in 0..L {
            acc[l] = op(acc[l], x[l]);
        }
    }
    let pair = |i: usize| op(acc[i], acc[i + 4]);
    let mut r = op(op(pair(0), pair(1)), op(pair(2), pair(3)));
    for &x in ra {
        r = op(r, x);
    }
    r
}

/// Sum in a fixed order ([`lane_fold`]).
#[inline(always)]
pub(crate) fn lane_sum<T: Float>(a: &[T]) -> T {
    lane_fold(a, T::ZERO, |x, y| x + y)
}

/// Largest element (−∞ for none), over eight lanes ([`lane_fold`]); the
/// maximum does not depend on the order.
#[inline(always)]
pub(crate) fn lane_max<T: Float>(a: &[T]) -> T {
    lane_fold(a, T::NEG_INF, T::max)
}

/// The row scale vector of `mul_rows`: shape `[R]` or the leading dims of `x`.
fn check_row_vector(
    op: &'static str,
    x: &Tensor<Cpu>,
    s: &Tensor<Cpu>,
    r: usize,
    lead: &[usize],
) -> Result<()> {
    if s.shape() == lead || s.shape() == [r] {
        return Ok(());
    }
    Err(shape_err(
        op,
        format!(
            "x has shape {:?} ({r} rows), so the row vector must have shape [{r}] or {lead:?}, got {:?}",
            x.shape(),
            s.shape()
        ),
    ))
}

fn check_col_vector(op: &'static str, x: &Tensor<Cpu>, s: &Tensor<Cpu>, c: usize) -> Result<()> {
    if s.shape() == [c] {
        return Ok(());
    }
    Err(shape_err(
        op,
        format!(
            "x has shape {:?} ({c} columns), so the column vector must have shape [{c}], got {:?}",
            x.shape(),
            s.shape()
        ),
    ))
}

fn mul_rows_t<T: FloatStorage>(x: &Tensor<Cpu>, s: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "mul_rows";
    let (r, c, lead) = rows_cols(OP, x)?;
    check_row_vector(OP, x, s, r, lead)?;
    let ss = T::slice(s, OP)?;
    let xs = T::slice(x, OP)?;
    let mut out = pool::take::<T>(xs.len());
    if c > 0 {
        out.par_chunks_mut(c)
            .zip(xs.par_chunks(c))
            .zip(ss.par_iter())
            .with_min_len(rows_per_task(c))
            .for_each(|((o, row), &k)| {
                for (o, &v) in o.iter_mut().zip(row) {
                    *o = v * k;
                }
            });
    }
    T::tensor(out, x.shape())
}

fn broadcast_cols<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    s: &Tensor<Cpu>,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let (_, c, _) = rows_cols(op, x)?;
    check_col_vector(op, x, s, c)?;
    let ss = T::slice(s, op)?;
    map_rows::<T>(op, x, |row, out| {
        for ((o, &v), &k) in out.iter_mut().zip(row).zip(ss) {
            *o = f(v, k);
        }
    })
}

fn sum_rows_t<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    reduce_rows::<T>("sum_rows", x, |_, row| {
        row.iter().fold(T::ZERO, |s, &v| s + v)
    })
}

/// Column sums over row blocks whose size depends only on the shape; the
/// blocks' partial sums are then added in block order.
fn sum_cols_t<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    let (r, c, _) = rows_cols("sum_cols", x)?;
    let xs = T::slice(x, "sum_cols")?;
    let mut total = vec![T::ZERO; c];
    if c > 0 && r > 0 {
        let block_rows = rows_per_task(c).max(r.div_ceil(MAX_PARTIALS));
        let partials: Vec<Vec<T>> = xs
            .par_chunks(block_rows * c)
            .map(|blk| {
                let mut acc = vec![T::ZERO; c];
                for row in blk.chunks(c) {
                    acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
                }
                acc
            })
            .collect();
        for p in &partials {
            total.iter_mut().zip(p).for_each(|(a, &v)| *a += v);
        }
    }
    T::tensor(total, &[c])
}

fn dot_rows_t<T: FloatStorage>(a: &Tensor<Cpu>, b: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "dot_rows";
    let (_, bs) = same_shape::<T>(OP, a, b)?;
    let (_, c, _) = rows_cols(OP, a)?;
    reduce_rows::<T>(OP, a, |i, row| dot(row, &bs[i * c..(i + 1) * c]))
}

/// Sum of `f(x)` over all elements in f64, in fixed-size chunks whose
/// partial sums are added in chunk order.
fn total_f64<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    f: impl Fn(f64) -> f64 + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let xs = T::slice(x, op)?;
    let chunk = GRAIN.max(xs.len().div_ceil(MAX_PARTIALS));
    let partials: Vec<f64> = xs
        .par_chunks(chunk)
        .map(|c| c.iter().fold(0.0f64, |s, &v| s + f(v.to_f64())))
        .collect();
    let total = partials.iter().fold(0.0f64, |s, &p| s + p);
    T::tensor(vec![T::from_f64(total)], &[1])
}

fn axpy_t<T: FloatStorage>(y: &mut Tensor<Cpu>, alpha: f64, x: &Tensor<Cpu>) -> Result<()> {
    const OP: &str = "axpy";
    if y.shape() != x.shape() {
        return Err(shape_err(
            OP,
            format!(
                "y has shape {:?}, x has shape {:?}; they must be equal",
                y.shape(),
                x.shape()
            ),
        ));
    }
    let xs = T::slice(x, OP)?;
    let ys = T::slice_mut(y, OP)?;
    let a = T::from_f64(alpha);
    ys.par_iter_mut()
        .zip(xs.par_iter())
        .with_min_len(GRAIN)
        .for_each(|(y, &x)| *y = (*y + a * x).stored());
    Ok(())
}

impl ElementwiseOps for Cpu {
    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("add", a, binary("add", a, b, |x, y| x + y))
    }

    fn sub(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("sub", a, binary("sub", a, b, |x, y| x - y))
    }

    fn mul(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("mul", a, binary("mul", a, b, |x, y| x * y))
    }

    fn scale(&self, a: &Tensor<Self>, s: f64) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(a: &Tensor<Cpu>, s: f64) -> Result<Tensor<Cpu>> {
            let k = T::from_f64(s);
            unary::<T>("scale", a, move |x| x * k)
        }
        cpu_float_dispatch!("scale", a, go(a, s))
    }

    fn axpy(&self, y: &mut Tensor<Self>, alpha: f64, x: &Tensor<Self>) -> Result<()> {
        cpu_float_dispatch!("axpy", y, axpy_t(y, alpha, x))
    }

    fn fill(&self, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor<Self>> {
        fill_t(shape, value, dtype)
    }

    fn sign(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            checked_unary::<T>("sign", x, "", |_| true, sign_f)
        }
        cpu_float_dispatch!("sign", x, go(x))
    }

    fn ln(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            let rule = "the natural log is defined for x ≥ 0 only";
            checked_unary::<T>("ln", x, rule, |v| v >= 0.0, T::ln)
        }
        cpu_float_dispatch!("ln", x, go(x))
    }

    fn recip(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            let rule = "zero has no reciprocal; add an epsilon (or clamp) before recip";
            checked_unary::<T>("recip", x, rule, |v| v != 0.0, |v| T::ONE / v)
        }
        cpu_float_dispatch!("recip", x, go(x))
    }

    fn silu(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            unary::<T>("silu", x, |v| v * sigmoid_f(v))
        }
        cpu_float_dispatch!("silu", x, go(x))
    }

    fn silu_backward(&self, x: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>, dy: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            binary::<T>("silu_backward", x, dy, |v, d| d * silu_grad_f(v))
        }
        cpu_float_dispatch!("silu_backward", x, go(x, dy))
    }

    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(g: &Tensor<Cpu>, u: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            binary::<T>("swiglu", g, u, |g, u| g * sigmoid_f(g) * u)
        }
        cpu_float_dispatch!("swiglu", gate, go(gate, up))
    }

    fn swiglu_backward(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dy: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        fn go<T: FloatStorage>(
            g: &Tensor<Cpu>,
            u: &Tensor<Cpu>,
            dy: &Tensor<Cpu>,
        ) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
            // One sigmoid per element, shared by both gradients.
            ternary::<T>("swiglu_backward", g, u, dy, |g, u, d| {
                let s = sigmoid_f(g);
                (d * u * silu_grad_of(g, s), d * g * s)
            })
        }
        cpu_float_dispatch!("swiglu_backward", gate, go(gate, up, dy))
    }

    fn swiglu_weighted(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        probs: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(
            g: &Tensor<Cpu>,
            u: &Tensor<Cpu>,
            p: &Tensor<Cpu>,
        ) -> Result<Tensor<Cpu>> {
            const OP: &str = "swiglu_weighted";
            let (_, f) = swiglu_weighted_args(OP, g, u, p, None)?;
            let (gv, uv, pv) = (T::slice(g, OP)?, T::slice(u, OP)?, T::slice(p, OP)?);
            let mut out = pool::take::<T>(gv.len());
            if f > 0 {
                out.par_chunks_mut(f)
                    .zip(gv.par_chunks(f).zip(uv.par_chunks(f)))
                    .zip(pv.par_iter())
                    .with_min_len(rows_per_task(f))
                    .for_each(|((o, (g, u)), &p)| {
                        simd(
                            #[inline(always)]
                            || {
                                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                                    *o = g * sigmoid_f(g) * u * p;
                                }
                            },
                        )
                    });
            }
            T::tensor(out, g.shape())
        }
        cpu_float_dispatch!("swiglu_weighted", gate, go(gate, up, probs))
    }

    fn swiglu_weighted_backward(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        probs: &Tensor<Self>,
        dy: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        fn go<T: FloatStorage>(
            g: &Tensor<Cpu>,
            u: &Tensor<Cpu>,
            p: &Tensor<Cpu>,
            dy: &Tensor<Cpu>,
        ) -> Result<(Tensor<Cpu>, Tensor<Cpu>, Tensor<Cpu>)> {
            const OP: &str = "swiglu_weighted_backward";
            let (n, f) = swiglu_weighted_args(OP, g, u, p, Some(dy))?;
            let (gv, uv, pv) = (T::slice(g, OP)?, T::slice(u, OP)?, T::slice(p, OP)?);
            let dyv = T::slice(dy, OP)?;
            let (mut dg, mut du) = (pool::take::<T>(gv.len()), pool::take::<T>(gv.len()));
            let mut dp = vec![T::ZERO; n];
            if f > 0 {
                dg.par_chunks_mut(f)
                    .zip(du.par_chunks_mut(f))
                    .zip(dp.par_iter_mut())
                    .enumerate()
                    .with_min_len(rows_per_task(f))
                    .for_each(|(r, ((dg, du), dp))| {
                        let rows = r * f..(r + 1) * f;
                        let (g, u, d) = (&gv[rows.clone()], &uv[rows.clone()], &dyv[rows]);
                        let p = pv[r];
                        // 64 columns at a time: the gradients vectorise, and
                        // the products dy · a go to a buffer summed in lanes
                        // (one running sum would chain every column).
                        const CH: usize = 64;
                        let mut prod = [T::ZERO; CH];
                        let mut acc = <T::Acc as Float>::ZERO;
                        for c0 in (0..f).step_by(CH) {
                            let cols = c0..f.min(c0 + CH);
                            let w = cols.len();
                            let (g, u, d) = (&g[cols.clone()], &u[cols.clone()], &d[cols.clone()]);
                            let (dg, du) = (&mut dg[cols.clone()], &mut du[cols]);
                            let prod = &mut prod[..w];
                            simd(
                                #[inline(always)]
                                || {
                                    for i in 0..w {
                                        let s = sigmoid_f(g[i]);
                                        prod[i] = d[i] * (g[i] * s * u[i]);
                                        let da = d[i] * p;
                                        dg[i] = da * u[i] * silu_grad_of(g[i], s);
                                        du[i] = da * g[i] * s;
                                    }
                                },
                            );
                            acc += lane_sum(prod).to_acc();
                        }
                        *dp = T::from_acc(acc);
                    });
            }
            Ok((
                T::tensor(dg, g.shape())?,
                T::tensor(du, g.shape())?,
                T::tensor(dp, &[n])?,
            ))
        }
        cpu_float_dispatch!("swiglu_weighted_backward", gate, go(gate, up, probs, dy))
    }

    fn sigmoid(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            unary::<T>("sigmoid", x, sigmoid_f)
        }
        cpu_float_dispatch!("sigmoid", x, go(x))
    }

    fn sigmoid_backward(&self, y: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(y: &Tensor<Cpu>, dy: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            binary::<T>("sigmoid_backward", y, dy, |y, d| d * y * (T::ONE - y))
        }
        cpu_float_dispatch!("sigmoid_backward", y, go(y, dy))
    }

    fn log_sigmoid(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        fn go<T: FloatStorage>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
            unary::<T>("log_sigmoid", x, log_sigmoid_f)
        }
        cpu_float_dispatch!("log_sigmoid", x, go(x))
    }

    fn softmax(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("softmax", x, softmax_t(x))
    }

    fn softmax_backward(&self, y: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("softmax_backward", y, softmax_backward_t(y, dy))
    }

    fn logsumexp(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("logsumexp", x, logsumexp_t(x))
    }

    fn round_bf16(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("round_bf16", x, round_bf16_t(x))
    }

    fn mul_rows(&self, x: &Tensor<Self>, s: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("mul_rows", x, mul_rows_t(x, s))
    }

    fn mul_cols(&self, x: &Tensor<Self>, s: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "mul_cols",
            x,
            broadcast_cols("mul_cols", x, s, |v, k| v * k)
        )
    }

    fn add_cols(&self, x: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "add_cols",
            x,
            broadcast_cols("add_cols", x, b, |v, k| v + k)
        )
    }

    fn sum_rows(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("sum_rows", x, sum_rows_t(x))
    }

    fn sum_cols(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("sum_cols", x, sum_cols_t(x))
    }

    fn dot_rows(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("dot_rows", a, dot_rows_t(a, b))
    }

    fn sum(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("sum", x, total_f64("sum", x, |v| v))
    }

    fn sum_squares(&self, x: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("sum_squares", x, total_f64("sum_squares", x, |v| v * v))
    }
}

#[cfg(test)]
mod tests {
    use super::RoundBf16;
    use crate::backend::ElementwiseOps;
    use crate::cpu::test_util::*;
    use crate::cpu::Cpu;
    use crate::error::KernelError;
    use crate::tensor::DType;

    const R: usize = 5;
    const C: usize = 7;

    /// Checks the gradient of a unary op against finite differences of
    /// `Σ f(x) ⊙ w` for a fixed random weight `w`.
    fn unary_grad(
        what: &str,
        seed: u64,
        fwd: impl Fn(&[f64]) -> Vec<f64>,
        bwd: impl Fn(&[f64], &[f64]) -> Vec<f64>,
    ) {
        let mut g = rng(seed);
        let x: Vec<f64> = uniform(&mut g, R * C).iter().map(|v| 3.0 * v).collect();
        let w = uniform(&mut g, R * C);
        check(what, &x, &bwd(&x, &w), |xs| dotv(&fwd(xs), &w));
    }

    fn silu_grad<B: TestOps>(d: &B) {
        unary_grad(
            "silu",
            1,
            |x| d.h64(&d.silu(&d.t64(x, &[R, C])).unwrap()),
            |x, w| {
                d.h64(
                    &d.silu_backward(&d.t64(x, &[R, C]), &d.t64(w, &[R, C]))
                        .unwrap(),
                )
            },
        );
    }

    fn sigmoid_grad<B: TestOps>(d: &B) {
        unary_grad(
            "sigmoid",
            2,
            |x| d.h64(&d.sigmoid(&d.t64(x, &[R, C])).unwrap()),
            |x, w| {
                let y = d.sigmoid(&d.t64(x, &[R, C])).unwrap();
                d.h64(&d.sigmoid_backward(&y, &d.t64(w, &[R, C])).unwrap())
            },
        );
    }

    fn softmax_grad<B: TestOps>(d: &B) {
        unary_grad(
            "softmax",
            3,
            |x| d.h64(&d.softmax(&d.t64(x, &[R, C])).unwrap()),
            |x, w| {
                let y = d.softmax(&d.t64(x, &[R, C])).unwrap();
                d.h64(&d.softmax_backward(&y, &d.t64(w, &[R, C])).unwrap())
            },
        );
    }

    /// The gradient of logsumexp is the softmax, weighted per row.
    fn logsumexp_grad<B: TestOps>(d: &B) {
        let mut g = rng(4);
        let x: Vec<f64> = uniform(&mut g, R * C).iter().map(|v| 3.0 * v).collect();
        let w = uniform(&mut g, R);
        let y = d.softmax(&d.t64(&x, &[R, C])).unwrap();
        let an = d.h64(&d.mul_rows(&y, &d.t64(&w, &[R])).unwrap());
        check("logsumexp", &x, &an, |xs| {
            dotv(&d.h64(&d.logsumexp(&d.t64(xs, &[R, C])).unwrap()), &w)
        });
    }

    fn swiglu_grad<B: TestOps>(d: &B) {
        let mut g = rng(5);
        let gate: Vec<f64> = uniform(&mut g, R * C).iter().map(|v| 3.0 * v).collect();
        let up = uniform(&mut g, R * C);
        let w = uniform(&mut g, R * C);
        let (dg, du) = d
            .swiglu_backward(
                &d.t64(&gate, &[R, C]),
                &d.t64(&up, &[R, C]),
                &d.t64(&w, &[R, C]),
            )
            .unwrap();
        let f = |g: &[f64], u: &[f64]| {
            dotv(
                &d.h64(&d.swiglu(&d.t64(g, &[R, C]), &d.t64(u, &[R, C])).unwrap()),
                &w,
            )
        };
        check("swiglu d gate", &gate, &d.h64(&dg), |x| f(x, &up));
        check("swiglu d up", &up, &d.h64(&du), |x| f(&gate, x));
    }

    /// The routing-weighted SwiGLU against finite differences in all three
    /// inputs, and against the plain SwiGLU scaled row by row.
    fn swiglu_weighted_grad<B: TestOps>(d: &B) {
        let mut g = rng(15);
        let gate: Vec<f64> = uniform(&mut g, R * C).iter().map(|v| 3.0 * v).collect();
        let up = uniform(&mut g, R * C);
        let probs = uniform(&mut g, R);
        let w = uniform(&mut g, R * C);
        let t = |v: &[f64]| d.t64(v, &[R, C]);
        let run = |g: &[f64], u: &[f64], p: &[f64]| {
            d.h64(&d.swiglu_weighted(&t(g), &t(u), &d.t64(p, &[R])).unwrap())
        };
        let plain = d.h64(&d.swiglu(&t(&gate), &t(&up)).unwrap());
        for (i, v) in run(&gate, &up, &probs).iter().enumerate() {
            let want = plain[i] * probs[i / C];
            assert!(
                (v - want).abs() <= 1e-14 * want.abs().max(1.0),
                "{i}: {v} vs {want}"
            );
        }
        let (dg, du, dp) = d
            .swiglu_weighted_backward(&t(&gate), &t(&up), &d.t64(&probs, &[R]), &t(&w))
            .unwrap();
        assert_eq!(dp.shape(), [R]);
        let f = |g: &[f64], u: &[f64], p: &[f64]| dotv(&run(g, u, p), &w);
        check("swiglu_weighted d gate", &gate, &d.h64(&dg), |x| {
            f(x, &up, &probs)
        });
        check("swiglu_weighted d up", &up, &d.h64(&du), |x| {
            f(&gate, x, &probs)
        });
        check("swiglu_weighted d probs", &probs, &d.h64(&dp), |x| {
            f(&gate, &up, x)
        });
        let bad = d.swiglu_weighted(&t(&gate), &t(&up), &d.t64(&probs[..R - 1], &[R - 1]));
        let err = bad.unwrap_err().to_string();
        assert!(
            err.contains("probs") && err.contains(&format!("[{}]", R - 1)),
            "{err}"
        );
    }

    fn mul_rows_grad<B: TestOps>(d: &B) {
        let mut g = rng(6);
        let (x, s, w) = (
            uniform(&mut g, R * C),
            uniform(&mut g, R),
            uniform(&mut g, R * C),
        );
        let wt = d.t64(&w, &[R, C]);
        let dx = d.h64(&d.mul_rows(&wt, &d.t64(&s, &[R])).unwrap());
        let ds = d.h64(&d.dot_rows(&wt, &d.t64(&x, &[R, C])).unwrap());
        let f = |x: &[f64], s: &[f64]| {
            dotv(
                &d.h64(&d.mul_rows(&d.t64(x, &[R, C]), &d.t64(s, &[R])).unwrap()),
                &w,
            )
        };
        check("mul_rows dx", &x, &dx, |v| f(v, &s));
        check("mul_rows ds", &s, &ds, |v| f(&x, v));
    }

    fn mul_cols_grad<B: TestOps>(d: &B) {
        let mut g = rng(7);
        let (x, s, w) = (
            uniform(&mut g, R * C),
            uniform(&mut g, C),
            uniform(&mut g, R * C),
        );
        let wt = d.t64(&w, &[R, C]);
        let dx = d.h64(&d.mul_cols(&wt, &d.t64(&s, &[C])).unwrap());
        let ds = d.h64(
            &d.sum_cols(&d.mul(&wt, &d.t64(&x, &[R, C])).unwrap())
                .unwrap(),
        );
        let f = |x: &[f64], s: &[f64]| {
            dotv(
                &d.h64(&d.mul_cols(&d.t64(x, &[R, C]), &d.t64(s, &[C])).unwrap()),
                &w,
            )
        };
        check("mul_cols dx", &x, &dx, |v| f(v, &s));
        check("mul_cols ds", &s, &ds, |v| f(&x, v));
    }

    fn add_cols_grad<B: TestOps>(d: &B) {
        let mut g = rng(8);
        let (x, b, w) = (
            uniform(&mut g, R * C),
            uniform(&mut g, C),
            uniform(&mut g, R * C),
        );
        let db = d.h64(&d.sum_cols(&d.t64(&w, &[R, C])).unwrap());
        let f = |x: &[f64], b: &[f64]| {
            dotv(
                &d.h64(&d.add_cols(&d.t64(x, &[R, C]), &d.t64(b, &[C])).unwrap()),
                &w,
            )
        };
        check("add_cols dx", &x, &w, |v| f(v, &b));
        check("add_cols db", &b, &db, |v| f(&x, v));
    }

    fn dot_rows_grad<B: TestOps>(d: &B) {
        let mut g = rng(9);
        let (a, b, w) = (
            uniform(&mut g, R * C),
            uniform(&mut g, R * C),
            uniform(&mut g, R),
        );
        let wt = d.t64(&w, &[R]);
        let da = d.h64(&d.mul_rows(&d.t64(&b, &[R, C]), &wt).unwrap());
        let db = d.h64(&d.mul_rows(&d.t64(&a, &[R, C]), &wt).unwrap());
        let f = |a: &[f64], b: &[f64]| {
            dotv(
                &d.h64(&d.dot_rows(&d.t64(a, &[R, C]), &d.t64(b, &[R, C])).unwrap()),
                &w,
            )
        };
        check("dot_rows da", &a, &da, |v| f(v, &b));
        check("dot_rows db", &b, &db, |v| f(&a, v));
    }

    /// `sum_rows` and `sum_cols` are each other's adjoint broadcasts: the
    /// gradient of a row sum broadcasts over columns, and vice versa.
    fn sum_rows_and_sum_cols_grad<B: TestOps>(d: &B) {
        let mut g = rng(10);
        let x = uniform(&mut g, R * C);
        let (wr, wc) = (uniform(&mut g, R), uniform(&mut g, C));
        let zeros = d.t64(&vec![0.0; R * C], &[R, C]);
        let ones = d.t64(&vec![1.0; R * C], &[R, C]);
        let dr = d.h64(&d.mul_rows(&ones, &d.t64(&wr, &[R])).unwrap());
        let dc = d.h64(&d.add_cols(&zeros, &d.t64(&wc, &[C])).unwrap());
        check("sum_rows", &x, &dr, |v| {
            dotv(&d.h64(&d.sum_rows(&d.t64(v, &[R, C])).unwrap()), &wr)
        });
        check("sum_cols", &x, &dc, |v| {
            dotv(&d.h64(&d.sum_cols(&d.t64(v, &[R, C])).unwrap()), &wc)
        });
    }

    /// Naive reference of `sign`, in f64.
    fn sign_ref(x: f64) -> f64 {
        if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else {
            0.0
        }
    }

    fn sign_matches_reference_in_both_dtypes<B: TestOps>(d: &B) {
        let tiny32 = f32::from_bits(1) as f64; // smallest f32 subnormal
        let mut x = vec![-3.0, -0.0, 0.0, 2.5, f64::INFINITY, f64::NEG_INFINITY];
        x.extend([1e-300, -1e-300, tiny32, -tiny32]);
        x.extend(uniform(&mut rng(20), 40));
        let want: Vec<f64> = x.iter().map(|&v| sign_ref(v)).collect();
        assert_eq!(d.h64(&d.sign(&d.t64(&x, &[x.len()])).unwrap()), want);
        // f32 loses 1e-300 to zero, so its reference is taken after rounding.
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let want32: Vec<f64> = x32.iter().map(|&v| sign_ref(v as f64)).collect();
        let got = d.sign(&d.t32(&x32, &[2, x.len() / 2])).unwrap();
        assert_eq!(got.shape(), &[2, x.len() / 2]);
        assert_eq!(d.h64(&got), want32);
    }

    fn sign_rejects_nan_and_non_floats<B: TestOps>(d: &B) {
        let err = d.err_of(d.sign(&d.t32(&[1.0, -2.0, f32::NAN, f32::NAN], &[4])));
        assert!(
            matches!(err, KernelError::NonFinite { op: "sign", what: "x", value } if value.is_nan()),
            "{err:?}"
        );
        assert_eq!(
            d.sign(&d.ti32(&[1, -1], &[2])).unwrap_err(),
            KernelError::UnsupportedDType {
                op: "sign",
                dtype: DType::I32,
                backend: B::NAME
            }
        );
    }

    fn ln_matches_reference_in_both_dtypes<B: TestOps>(d: &B) {
        let mut g = rng(21);
        let mut x: Vec<f64> = uniform(&mut g, R * C)
            .iter()
            .map(|v| 10f64.powf(8.0 * v))
            .collect();
        x[0] = 1.0;
        x[1] = f64::INFINITY;
        let got = d.h64(&d.ln(&d.t64(&x, &[R, C])).unwrap());
        for (&v, &y) in x.iter().zip(&got) {
            assert!(
                y == v.ln() || (y - v.ln()).abs() <= 1e-15 * v.ln().abs().max(1.0),
                "ln({v:e}) = {y}"
            );
        }
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let got = d.h64(&d.ln(&d.t32(&x32, &[R, C])).unwrap());
        for (&v, &y) in x32.iter().zip(&got) {
            let want = (v as f64).ln();
            assert!(
                y == want || (y - want).abs() <= 1e-6 * want.abs().max(1.0),
                "ln({v:e}) = {y}"
            );
        }
        // The log of a zero probability (either zero) is −∞, not an error.
        let z = d.h64(&d.ln(&d.t64(&[0.0, -0.0], &[2])).unwrap());
        assert_eq!(z, vec![f64::NEG_INFINITY; 2]);
    }

    /// `d ln(x) = dy · recip(x)`, checked on positive inputs away from the pole.
    fn ln_grad<B: TestOps>(d: &B) {
        let mut g = rng(22);
        let x: Vec<f64> = uniform(&mut g, R * C).iter().map(|v| 1.5 + v).collect();
        let w = uniform(&mut g, R * C);
        let inv = d.recip(&d.t64(&x, &[R, C])).unwrap();
        let an = d.h64(&d.mul(&d.t64(&w, &[R, C]), &inv).unwrap());
        check("ln", &x, &an, |xs| {
            dotv(&d.h64(&d.ln(&d.t64(xs, &[R, C])).unwrap()), &w)
        });
    }

    fn ln_rejects_negative_and_nan<B: TestOps>(d: &B) {
        let err = d.err_of(d.ln(&d.t64(&[1.0, 2.0, -0.5], &[3])));
        match &err {
            KernelError::InvalidArgument { op: "ln", detail } => assert!(
                detail.contains("element 2") && detail.contains("-0.5") && detail.contains("x ≥ 0"),
                "{detail}"
            ),
            e => panic!("{e:?}"),
        }
        let err = d.err_of(d.ln(&d.t32(&[f32::NAN, -1.0], &[2])));
        assert!(
            matches!(err, KernelError::NonFinite { op: "ln", what: "x", value } if value.is_nan()),
            "{err:?}"
        );
        assert!(matches!(
            d.ln(&d.ti32(&[1], &[1])).unwrap_err(),
            KernelError::UnsupportedDType { op: "ln", .. }
        ));
    }

    fn recip_matches_reference_in_both_dtypes<B: TestOps>(d: &B) {
        let mut g = rng(23);
        let mut x: Vec<f64> = uniform(&mut g, R * C)
            .iter()
            .map(|v| v.signum() * 10f64.powf(6.0 * v))
            .collect();
        x[0] = f64::INFINITY;
        x[1] = f64::NEG_INFINITY;
        let got = d.h64(&d.recip(&d.t64(&x, &[R, C])).unwrap());
        let want: Vec<f64> = x.iter().map(|&v| 1.0 / v).collect();
        assert_eq!(got, want);
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let got = d.h64(&d.recip(&d.t32(&x32, &[R, C])).unwrap());
        for (&v, &y) in x32.iter().zip(&got) {
            let want = 1.0 / v as f64;
            assert!((y - want).abs() <= 1e-7 * want.abs(), "1/{v:e} = {y}");
        }
    }

    /// `d recip(x) = −dy · y²` with `y = recip(x)`, on both signs of x.
    fn recip_grad<B: TestOps>(d: &B) {
        let mut g = rng(24);
        let x: Vec<f64> = uniform(&mut g, R * C)
            .iter()
            .enumerate()
            .map(|(i, v)| if i % 2 == 0 { 1.5 + v } else { -1.5 - v })
            .collect();
        let w = uniform(&mut g, R * C);
        let y = d.recip(&d.t64(&x, &[R, C])).unwrap();
        let wy2 = d.mul(&d.t64(&w, &[R, C]), &d.mul(&y, &y).unwrap()).unwrap();
        let an = d.h64(&d.scale(&wy2, -1.0).unwrap());
        check("recip", &x, &an, |xs| {
            dotv(&d.h64(&d.recip(&d.t64(xs, &[R, C])).unwrap()), &w)
        });
    }

    fn recip_rejects_zero_and_nan<B: TestOps>(d: &B) {
        let err = d.err_of(d.recip(&d.t64(&[2.0, 0.0], &[1, 2])));
        match &err {
            KernelError::InvalidArgument {
                op: "recip",
                detail,
            } => assert!(
                detail.contains("element 1")
                    && detail.contains("[1, 2]")
                    && detail.contains("epsilon"),
                "{detail}"
            ),
            e => panic!("{e:?}"),
        }
        d.err_of(d.recip(&d.t32(&[-0.0], &[1])));
        let err = d.err_of(d.recip(&d.t64(&[f64::NAN], &[1])));
        assert!(
            matches!(err, KernelError::NonFinite { op: "recip", .. }),
            "{err:?}"
        );
        assert!(matches!(
            d.recip(&d.ti32(&[1], &[1])).unwrap_err(),
            KernelError::UnsupportedDType { op: "recip", .. }
        ));
    }

    fn log_sigmoid_matches_reference_and_is_stable<B: TestOps>(d: &B) {
        let mut g = rng(25);
        let x: Vec<f64> = uniform(&mut g, R * C).iter().map(|v| 20.0 * v).collect();
        let naive = |v: f64| (1.0 / (1.0 + (-v).exp())).ln();
        let got = d.h64(&d.log_sigmoid(&d.t64(&x, &[R, C])).unwrap());
        for (&v, &y) in x.iter().zip(&got) {
            assert!(
                (y - naive(v)).abs() <= 1e-14 * naive(v).abs().max(1.0),
                "{v}: {y}"
            );
        }
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let got = d.h64(&d.log_sigmoid(&d.t32(&x32, &[R, C])).unwrap());
        for (&v, &y) in x32.iter().zip(&got) {
            let want = naive(v as f64);
            assert!((y - want).abs() <= 1e-6 * want.abs().max(1e-30), "{v}: {y}");
        }
        // Where the naive form fails: ln(0) = −∞ far left, and the tail
        // −exp(−x) that 1 + exp(−x) rounds away far right.
        let ext = d.h64(
            &d.log_sigmoid(&d.t64(&[-1000.0, 40.0, 1000.0, f64::NEG_INFINITY], &[4]))
                .unwrap(),
        );
        assert_eq!(ext[0], -1000.0);
        assert!((ext[1] / -(-40f64).exp() - 1.0).abs() < 1e-12, "{}", ext[1]);
        assert_eq!(ext[2], 0.0);
        assert_eq!(ext[3], f64::NEG_INFINITY);
        let ext32 = d.h64(&d.log_sigmoid(&d.t32(&[-1000.0, 1000.0], &[2])).unwrap());
        assert_eq!(ext32, vec![-1000.0, 0.0]);
    }

    /// `d log_sigmoid(x) = dy · (1 − sigmoid(x))`, built from the existing ops.
    fn log_sigmoid_grad<B: TestOps>(d: &B) {
        unary_grad(
            "log_sigmoid",
            26,
            |x| d.h64(&d.log_sigmoid(&d.t64(x, &[R, C])).unwrap()),
            |x, w| {
                let s = d.sigmoid(&d.t64(x, &[R, C])).unwrap();
                let wt = d.t64(w, &[R, C]);
                d.h64(&d.sub(&wt, &d.mul(&wt, &s).unwrap()).unwrap())
            },
        );
    }

    fn log_sigmoid_propagates_nan_and_rejects_non_floats<B: TestOps>(d: &B) {
        let y = d.h64(&d.log_sigmoid(&d.t64(&[f64::NAN, 0.0], &[2])).unwrap());
        assert!(y[0].is_nan());
        assert!((y[1] + std::f64::consts::LN_2).abs() < 1e-16);
        assert_eq!(
            d.log_sigmoid(&d.ti32(&[0], &[1])).unwrap_err(),
            KernelError::UnsupportedDType {
                op: "log_sigmoid",
                dtype: DType::I32,
                backend: B::NAME
            }
        );
    }

    fn fill_writes_the_value_in_every_dtype<B: TestOps>(d: &B) {
        let a = d.fill(&[2, 3], 0.25, DType::F64).unwrap();
        assert_eq!((a.shape(), a.dtype()), (&[2, 3][..], DType::F64));
        assert_eq!(d.h64(&a), vec![0.25; 6]);
        let b = d.fill(&[4], 1.0 / 3.0, DType::F32).unwrap();
        assert_eq!(d.h64(&b), vec![(1.0f64 / 3.0) as f32 as f64; 4]);
        let m = d.fill(&[2], f64::NEG_INFINITY, DType::F32).unwrap();
        assert_eq!(d.h64(&m), vec![f64::NEG_INFINITY; 2]);
        let i = d.fill(&[3], -1.0, DType::I32).unwrap();
        assert_eq!(i.dtype(), DType::I32);
        assert_eq!(d.h64(&i), vec![-1.0; 3]);
        assert_eq!(d.fill(&[0, 5], 7.0, DType::F32).unwrap().numel(), 0);
        assert_eq!(d.h64(&d.fill(&[], 7.0, DType::F64).unwrap()), vec![7.0]);
    }

    fn fill_rejects_values_the_dtype_cannot_hold<B: TestOps>(d: &B) {
        let err = d.fill(&[2], f64::NAN, DType::F32).unwrap_err();
        assert!(
            matches!(err, KernelError::NonFinite { op: "fill", what: "value", value } if value.is_nan()),
            "{err:?}"
        );
        let err = d.fill(&[2], 1e39, DType::F32).unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "fill", detail } if detail.contains("1e39")),
            "{err:?}"
        );
        for bad in [2.5, 3e9, f64::INFINITY] {
            let err = d.fill(&[2], bad, DType::I32).unwrap_err();
            assert!(
                matches!(&err, KernelError::InvalidArgument { op: "fill", detail } if detail.contains("I32")),
                "{bad}: {err:?}"
            );
        }
        // bf16 (emulated on the CPU): rounded to nearest even, range-checked.
        let t = d.fill(&[2], 1.0 / 3.0, DType::BF16).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(d.h64(&t), vec![half::bf16::from_f64(1.0 / 3.0).to_f64(); 2]);
        let err = d.fill(&[2], 1e39, DType::BF16).unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidArgument { op: "fill", detail } if detail.contains("BF16")),
            "{err:?}"
        );
    }

    fn softmax_rows_sum_to_one_and_resist_overflow<B: TestOps>(d: &B) {
        let mut g = rng(11);
        let mut x: Vec<f32> = uniform(&mut g, R * C)
            .iter()
            .map(|v| (20.0 * v) as f32)
            .collect();
        x[0] = 1.0e4; // exp would overflow without the max shift
        let y = d.h64(&d.softmax(&d.t32(&x, &[R, C])).unwrap());
        for row in y.chunks(C) {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6, "{row:?}");
        }
        assert!((y[0] - 1.0).abs() < 1e-6);
        let lse = d.h64(&d.logsumexp(&d.t32(&x, &[R, C])).unwrap());
        assert!((lse[0] - 1.0e4).abs() < 1e-2, "{}", lse[0]);
    }

    fn row_ops_take_leading_dims_as_rows<B: TestOps>(d: &B) {
        let x: Vec<f64> = (0..24).map(f64::from).collect();
        let t = d.t64(&x, &[2, 3, 4]);
        let s = d.sum_rows(&t).unwrap();
        assert_eq!(s.shape(), &[2, 3]);
        assert_eq!(d.h64(&s), vec![6.0, 22.0, 38.0, 54.0, 70.0, 86.0]);
        let sc = d.sum_cols(&t).unwrap();
        assert_eq!(d.h64(&sc), vec![60.0, 66.0, 72.0, 78.0]);
        assert_eq!(d.logsumexp(&t).unwrap().shape(), &[2, 3]);
    }

    fn sum_and_sum_squares_accumulate_in_f64<B: TestOps>(d: &B) {
        // 2^24 + 1 + 1 + ... is lost one by one in f32 but not in f64.
        let mut x = vec![1.0f32; 70_001];
        x[0] = 16_777_216.0;
        let s = d.h64(&d.sum(&d.t32(&x, &[x.len()])).unwrap());
        assert_eq!(s, vec![(16_777_216.0f64 + 70_000.0) as f32 as f64]);
        let q = d.h64(&d.sum_squares(&d.t64(&[3.0, -4.0], &[2])).unwrap());
        assert_eq!(q, vec![25.0]);
    }

    fn large_reductions_are_deterministic<B: TestOps>(d: &B) {
        let mut g = rng(12);
        let x: Vec<f32> = uniform(&mut g, 300 * 257)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let t = d.t32(&x, &[300, 257]);
        let a = (d.sum_cols(&t).unwrap(), d.sum(&t).unwrap());
        for _ in 0..3 {
            let b = (d.sum_cols(&t).unwrap(), d.sum(&t).unwrap());
            assert_eq!(d.h64(&a.0), d.h64(&b.0));
            assert_eq!(d.h64(&a.1), d.h64(&b.1));
        }
        let exact: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((d.h64(&a.1)[0] - exact).abs() < 1e-3);
    }

    fn axpy_and_scale<B: TestOps>(d: &B) {
        let mut y = d.t64(&[1.0, 2.0], &[2]);
        d.axpy(&mut y, 0.5, &d.t64(&[4.0, -2.0], &[2])).unwrap();
        assert_eq!(d.h64(&y), vec![3.0, 1.0]);
        assert_eq!(d.h64(&d.scale(&y, -2.0).unwrap()), vec![-6.0, -2.0]);
        let err = d.axpy(&mut y, 1.0, &d.t32(&[1.0, 1.0], &[2])).unwrap_err();
        assert_eq!(
            err,
            KernelError::DTypeMismatch {
                op: "axpy",
                expected: DType::F64,
                got: DType::F32
            }
        );
    }

    fn round_bf16_ties_to_even_known_bits<B: TestOps>(d: &B) {
        let e = |k: i32| 2f32.powi(k);
        let cases: [(f32, f32); 9] = [
            (1.0 + e(-8), 1.0),                      // tie, even below
            (1.0 + 3.0 * e(-8), 1.0 + e(-6)),        // tie, odd below: up
            (1.0 + e(-8) + e(-20), 1.0 + e(-7)),     // just above the tie
            (-(1.0 + e(-8)), -1.0),                  // sign is symmetric
            (1.0 + e(-7), 1.0 + e(-7)),              // representable
            ((2.0 - e(-8)) * e(127), f32::INFINITY), // overflows at the tie
            (f32::MAX, f32::INFINITY),               // above the last tie
            (f32::NEG_INFINITY, f32::NEG_INFINITY),
            (f32::from_bits(0x0000_8000), 0.0), // smallest subnormal tie → 0
        ];
        for (x, want) in cases {
            let got = d.h64(&d.round_bf16(&d.t32(&[x], &[1])).unwrap())[0] as f32;
            assert_eq!(got.to_bits(), want.to_bits(), "round_bf16({x:e})");
        }
        // A NaN whose payload lies only in the dropped bits must stay NaN.
        let nan = f32::from_bits(0x7f80_0001);
        assert!(nan.round_bf16().is_nan());
    }

    fn round_bf16_matches_half_crate<B: TestOps>(d: &B) {
        let mut g = rng(13);
        let mut xs: Vec<f32> = (0..20_000)
            .map(|_| f32::from_bits(rand::Rng::gen::<u32>(&mut g)))
            .collect();
        // Exact ties and their neighbours, where the rounding rule shows.
        for m in 0..64u32 {
            let base = 0x3f80_0000 | (m << 16);
            xs.extend([base | 0x8000, base | 0x7fff, base | 0x8001].map(f32::from_bits));
        }
        let got = d.h64(&d.round_bf16(&d.t32(&xs, &[xs.len()])).unwrap());
        for (&x, &y) in xs.iter().zip(&got) {
            let want = half::bf16::from_f32(x).to_f32();
            if want.is_nan() {
                assert!(y.is_nan(), "{x:e}");
            } else {
                assert_eq!((y as f32).to_bits(), want.to_bits(), "round_bf16({x:e})");
            }
        }
    }

    /// f64 input is rounded once, not through a nearest-f32 step: a value a
    /// hair above a bf16 tie would otherwise become the tie and round to even.
    #[test]
    fn round_bf16_f64_rounds_once() {
        let e = |k: i32| 2f64.powi(k);
        assert_eq!((1.0 + e(-8) + e(-30)).round_bf16(), 1.0 + e(-7));
        assert_eq!((1.0 + e(-8) - e(-30)).round_bf16(), 1.0);
        assert_eq!((1.0 + e(-8)).round_bf16(), 1.0);
        assert!(f64::NAN.round_bf16().is_nan());
        assert_eq!(1e300f64.round_bf16(), f64::INFINITY);
        assert_eq!(1e-300f64.round_bf16(), 0.0);
        // Reference for normal values: nearest-even directly on the f64 bits
        // (bf16 keeps the top 7 of f64's 52 mantissa bits).
        let mut g = rng(14);
        for _ in 0..20_000 {
            let x = rand::Rng::gen_range(&mut g, -1.0..1.0)
                * e(rand::Rng::gen_range(&mut g, -100..100));
            let b = x.to_bits();
            let lsb = (b >> 45) & 1;
            let want = f64::from_bits((b + (1 << 44) - 1 + lsb) & !((1u64 << 45) - 1));
            assert_eq!(x.round_bf16(), want, "{x:e}");
        }
    }

    fn bad_inputs_name_the_values<B: TestOps>(d: &B) {
        let a = d.t64(&[1.0; 6], &[2, 3]);
        let b = d.t64(&[1.0; 6], &[3, 2]);
        match d.add(&a, &b).unwrap_err() {
            KernelError::ShapeMismatch { op: "add", detail } => {
                assert!(
                    detail.contains("[2, 3]") && detail.contains("[3, 2]"),
                    "{detail}"
                )
            }
            e => panic!("{e:?}"),
        }
        assert_eq!(
            d.mul(&a, &d.t32(&[1.0; 6], &[2, 3])).unwrap_err(),
            KernelError::DTypeMismatch {
                op: "mul",
                expected: DType::F64,
                got: DType::F32
            }
        );
        assert_eq!(
            d.silu(&d.ti32(&[1, 2], &[2])).unwrap_err(),
            KernelError::UnsupportedDType {
                op: "silu",
                dtype: DType::I32,
                backend: B::NAME
            }
        );
        let err = d.mul_rows(&a, &d.t64(&[1.0; 3], &[3])).unwrap_err();
        assert!(
            matches!(err, KernelError::ShapeMismatch { op: "mul_rows", .. }),
            "{err:?}"
        );
        let err = d.add_cols(&a, &d.t64(&[1.0; 2], &[2])).unwrap_err();
        assert!(err.to_string().contains("[3]"), "{err}");
        assert_eq!(
            d.logsumexp(&d.t64(&[], &[2, 0])).unwrap_err(),
            KernelError::Empty {
                op: "logsumexp",
                what: "last dimension"
            }
        );
        let err = d.softmax(&d.t64(&[1.0], &[])).unwrap_err();
        assert!(matches!(
            err,
            KernelError::ShapeMismatch { op: "softmax", .. }
        ));
    }

    /// Every elementwise op on random f32 (and, where the device stores it,
    /// bf16) inputs against the CPU reference, at shapes that take many
    /// blocks, rows longer than a block, and many short rows.
    fn elementwise_matches_cpu<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            for (r, c) in [(67usize, 300usize), (3, 3000), (1000, 5)] {
                let mut k = Compare::new(d, dtype, 40 + c as u64);
                let (x, xc) = k.rand(&[r, c], 4.0);
                let (y, yc) = k.rand(&[r, c], 1.0);
                let (p, pc) = k.rand(&[r, c], 1.0);
                let (rv, rvc) = k.rand(&[r], 1.0);
                let (cv, cvc) = k.rand(&[c], 1.0);
                let pos: Vec<f64> = uniform(&mut k.g, r * c)
                    .iter()
                    .map(|v| v.abs() + 0.1)
                    .collect();
                let (q, qc) = k.pair(&pos, &[r, c]);
                k.check("add", &d.add(&x, &y).unwrap(), &Cpu.add(&xc, &yc).unwrap());
                k.check("sub", &d.sub(&x, &y).unwrap(), &Cpu.sub(&xc, &yc).unwrap());
                k.check("mul", &d.mul(&x, &y).unwrap(), &Cpu.mul(&xc, &yc).unwrap());
                k.check(
                    "scale",
                    &d.scale(&x, 0.37).unwrap(),
                    &Cpu.scale(&xc, 0.37).unwrap(),
                );
                k.check("sign", &d.sign(&x).unwrap(), &Cpu.sign(&xc).unwrap());
                k.check("ln", &d.ln(&q).unwrap(), &Cpu.ln(&qc).unwrap());
                k.check("recip", &d.recip(&q).unwrap(), &Cpu.recip(&qc).unwrap());
                k.check("silu", &d.silu(&x).unwrap(), &Cpu.silu(&xc).unwrap());
                k.check(
                    "silu_backward",
                    &d.silu_backward(&x, &y).unwrap(),
                    &Cpu.silu_backward(&xc, &yc).unwrap(),
                );
                k.check(
                    "swiglu",
                    &d.swiglu(&x, &y).unwrap(),
                    &Cpu.swiglu(&xc, &yc).unwrap(),
                );
                let (dg, du) = d.swiglu_backward(&x, &y, &p).unwrap();
                let (dgc, duc) = Cpu.swiglu_backward(&xc, &yc, &pc).unwrap();
                k.check("swiglu_backward d gate", &dg, &dgc);
                k.check("swiglu_backward d up", &du, &duc);
                let (dg, du, dpr) = d.swiglu_weighted_backward(&x, &y, &rv, &p).unwrap();
                let (dgc, duc, dprc) = Cpu.swiglu_weighted_backward(&xc, &yc, &rvc, &pc).unwrap();
                k.check(
                    "swiglu_weighted",
                    &d.swiglu_weighted(&x, &y, &rv).unwrap(),
                    &Cpu.swiglu_weighted(&xc, &yc, &rvc).unwrap(),
                );
                k.check("swiglu_weighted_backward d gate", &dg, &dgc);
                k.check("swiglu_weighted_backward d up", &du, &duc);
                k.check("swiglu_weighted_backward d probs", &dpr, &dprc);
                k.check(
                    "sigmoid",
                    &d.sigmoid(&x).unwrap(),
                    &Cpu.sigmoid(&xc).unwrap(),
                );
                k.check(
                    "sigmoid_backward",
                    &d.sigmoid_backward(&p, &y).unwrap(),
                    &Cpu.sigmoid_backward(&pc, &yc).unwrap(),
                );
                k.check(
                    "log_sigmoid",
                    &d.log_sigmoid(&x).unwrap(),
                    &Cpu.log_sigmoid(&xc).unwrap(),
                );
                k.check(
                    "softmax",
                    &d.softmax(&x).unwrap(),
                    &Cpu.softmax(&xc).unwrap(),
                );
                k.check(
                    "softmax_backward",
                    &d.softmax_backward(&p, &y).unwrap(),
                    &Cpu.softmax_backward(&pc, &yc).unwrap(),
                );
                k.check(
                    "logsumexp",
                    &d.logsumexp(&x).unwrap(),
                    &Cpu.logsumexp(&xc).unwrap(),
                );
                k.check(
                    "round_bf16",
                    &d.round_bf16(&x).unwrap(),
                    &Cpu.round_bf16(&xc).unwrap(),
                );
                k.check(
                    "mul_rows",
                    &d.mul_rows(&x, &rv).unwrap(),
                    &Cpu.mul_rows(&xc, &rvc).unwrap(),
                );
                k.check(
                    "mul_cols",
                    &d.mul_cols(&x, &cv).unwrap(),
                    &Cpu.mul_cols(&xc, &cvc).unwrap(),
                );
                k.check(
                    "add_cols",
                    &d.add_cols(&x, &cv).unwrap(),
                    &Cpu.add_cols(&xc, &cvc).unwrap(),
                );
                k.check(
                    "sum_rows",
                    &d.sum_rows(&x).unwrap(),
                    &Cpu.sum_rows(&xc).unwrap(),
                );
                k.check(
                    "sum_cols",
                    &d.sum_cols(&x).unwrap(),
                    &Cpu.sum_cols(&xc).unwrap(),
                );
                k.check(
                    "dot_rows",
                    &d.dot_rows(&x, &y).unwrap(),
                    &Cpu.dot_rows(&xc, &yc).unwrap(),
                );
                k.check("sum", &d.sum(&x).unwrap(), &Cpu.sum(&xc).unwrap());
                k.check(
                    "sum_squares",
                    &d.sum_squares(&x).unwrap(),
                    &Cpu.sum_squares(&xc).unwrap(),
                );
                let (mut acc, mut accc) = (y.clone(), yc.clone());
                d.axpy(&mut acc, -0.5, &x).unwrap();
                Cpu.axpy(&mut accc, -0.5, &xc).unwrap();
                k.check("axpy", &acc, &accc);
                k.report(&format!("elementwise [{r}, {c}]"));
            }
        }
    }

    device_tests!(
        elementwise_matches_cpu,
        silu_grad,
        sigmoid_grad,
        softmax_grad,
        logsumexp_grad,
        swiglu_grad,
        swiglu_weighted_grad,
        mul_rows_grad,
        mul_cols_grad,
        add_cols_grad,
        dot_rows_grad,
        sum_rows_and_sum_cols_grad,
        sign_matches_reference_in_both_dtypes,
        sign_rejects_nan_and_non_floats,
        ln_matches_reference_in_both_dtypes,
        ln_grad,
        ln_rejects_negative_and_nan,
        recip_matches_reference_in_both_dtypes,
        recip_grad,
        recip_rejects_zero_and_nan,
        log_sigmoid_matches_reference_and_is_stable,
        log_sigmoid_grad,
        log_sigmoid_propagates_nan_and_rejects_non_floats,
        fill_writes_the_value_in_every_dtype,
        fill_rejects_values_the_dtype_cannot_hold,
        softmax_rows_sum_to_one_and_resist_overflow,
        row_ops_take_leading_dims_as_rows,
        sum_and_sum_squares_accumulate_in_f64,
        large_reductions_are_deterministic,
        axpy_and_scale,
        round_bf16_ties_to_even_known_bits,
        round_bf16_matches_half_crate,
        bad_inputs_name_the_values,
    );
}
