//! CPU elementwise maps, activations, row/column broadcasts and reductions.
//!
//! Shape letters: R rows (all leading dims flattened), C columns (last dim).
//! Every parallel loop splits work by shape alone, never by thread count, and
//! reductions combine their partial results in a fixed order, so results are
//! bit-identical from run to run and across pool sizes.

use rayon::prelude::*;

use super::{Cpu, Float, FloatStorage};
use crate::backend::ElementwiseOps;
use crate::cpu_float_dispatch;
use crate::error::{shape_err, KernelError, Result};
use crate::tensor::Tensor;

/// Elements per rayon task: below this a task is not worth its scheduling cost.
pub(crate) const GRAIN: usize = 1 << 14;

/// Upper bound on the partial results of a column or total reduction, so their
/// memory stays small whatever the input size.
pub(crate) const MAX_PARTIALS: usize = 64;

/// Rows per rayon task for rows of `c` columns.
pub(crate) fn rows_per_task(c: usize) -> usize {
    (GRAIN / c.max(1)).max(1)
}

/// `(R, C, leading dims)` of `x`, with rows all leading dims flattened.
pub(crate) fn rows_cols<'a>(
    op: &'static str,
    x: &'a Tensor<Cpu>,
) -> Result<(usize, usize, &'a [usize])> {
    match x.shape().split_last() {
        Some((&c, lead)) => Ok((lead.iter().product(), c, lead)),
        None => Err(shape_err(
            op,
            "expected at least one dimension, got a 0-d tensor",
        )),
    }
}

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

fn unary<T: FloatStorage>(
    op: &'static str,
    x: &Tensor<Cpu>,
    f: impl Fn(T) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let xs = T::slice(x, op)?;
    let out: Vec<T> = xs.par_iter().with_min_len(GRAIN).map(|&a| f(a)).collect();
    T::tensor(out, x.shape())
}

fn binary<T: FloatStorage>(
    op: &'static str,
    a: &Tensor<Cpu>,
    b: &Tensor<Cpu>,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Result<Tensor<Cpu>> {
    let (xs, ys) = same_shape::<T>(op, a, b)?;
    let out: Vec<T> = xs
        .par_iter()
        .zip(ys.par_iter())
        .with_min_len(GRAIN)
        .map(|(&x, &y)| f(x, y))
        .collect();
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
    let (o1, o2): (Vec<T>, Vec<T>) = xs
        .par_iter()
        .zip(ys.par_iter())
        .zip(zs.par_iter())
        .with_min_len(GRAIN)
        .map(|((&x, &y), &z)| f(x, y, z))
        .unzip();
    Ok((T::tensor(o1, a.shape())?, T::tensor(o2, a.shape())?))
}

/// Logistic function, split by sign so `exp` never overflows.
pub(crate) fn sigmoid_f<T: Float>(x: T) -> T {
    if x >= T::ZERO {
        T::ONE / (T::ONE + (-x).exp())
    } else {
        let e = x.exp();
        e / (T::ONE + e)
    }
}

fn silu_grad_f<T: Float>(x: T) -> T {
    let s = sigmoid_f(x);
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
    let mut out = vec![T::ZERO; xs.len()];
    if c > 0 {
        out.par_chunks_mut(c)
            .zip(xs.par_chunks(c))
            .with_min_len(rows_per_task(c))
            .for_each(|(o, r)| f(r, o));
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
        let mx = row.iter().fold(T::NEG_INF, |m, &v| m.max(v));
        let mut sum = T::ZERO;
        for (o, &v) in out.iter_mut().zip(row) {
            *o = (v - mx).exp();
            sum += *o;
        }
        let inv = T::ONE / sum;
        out.iter_mut().for_each(|o| *o *= inv);
    })
}

fn softmax_backward_t<T: FloatStorage>(y: &Tensor<Cpu>, dy: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "softmax_backward";
    let (ys, dys) = same_shape::<T>(OP, y, dy)?;
    let (_, c, _) = rows_cols(OP, y)?;
    let mut out = vec![T::ZERO; ys.len()];
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
pub(crate) fn row_logsumexp<T: Float>(row: &[T]) -> T {
    let mx = row.iter().fold(T::NEG_INF, |m, &v| m.max(v));
    if !mx.is_finite() {
        return mx;
    }
    let s: T = row.iter().map(|&v| (v - mx).exp()).sum();
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
fn f32_to_bf16_bits(x: f32) -> u32 {
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
fn f64_to_f32_odd(x: f64) -> f32 {
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

impl RoundBf16 for f64 {
    fn round_bf16(self) -> Self {
        f32::from_bits(f32_to_bf16_bits(f64_to_f32_odd(self))) as f64
    }
}

fn round_bf16_t<T: RoundBf16>(x: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    unary::<T>("round_bf16", x, T::round_bf16)
}

/// Fixed-order dot product of two equal-length slices.
pub(crate) fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::ZERO, |s, (&x, &y)| s + x * y)
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
    let mut out = vec![T::ZERO; xs.len()];
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
        .for_each(|(y, &x)| *y += a * x);
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
            ternary::<T>("swiglu_backward", g, u, dy, |g, u, d| {
                (d * u * silu_grad_f(g), d * g * sigmoid_f(g))
            })
        }
        cpu_float_dispatch!("swiglu_backward", gate, go(gate, up, dy))
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
