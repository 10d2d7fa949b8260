use super::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Elementwise maps, activations, row/column broadcasts and reductions.
///
/// Binary ops need equal shapes and dtypes. "Rows" are all leading dims
/// flattened; "columns" the last dim.
pub trait ElementwiseOps: Device {
    /// `a + b`.
    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `a - b`.
    fn sub(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `a * b`.
    fn mul(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `s * a`.
    fn scale(&self, a: &Tensor<Self>, s: f64) -> Result<Tensor<Self>>;
    /// `y += alpha * x` in place (gradient accumulation).
    fn axpy(&self, y: &mut Tensor<Self>, alpha: f64, x: &Tensor<Self>) -> Result<()>;
    /// A tensor of `shape` with every element `value`, written on the device
    /// (no host upload). F32 and F64 take any value but NaN (±∞ is allowed, for
    /// masks); a finite value beyond the dtype's range is an error, not a silent
    /// ∞. I32 takes integral values in its range.
    fn fill(&self, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor<Self>>;

    /// `sign(x)`: −1, 0 or +1 (both zeros give 0, ±∞ give ±1). A NaN has no
    /// sign and is a [`crate::KernelError::NonFinite`] error. Its gradient is
    /// zero wherever it exists, so there is no backward.
    fn sign(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Natural logarithm, elementwise; `ln(0) = −∞` (the log of a zero
    /// probability). Negative inputs and NaN are errors. Gradient:
    /// `dx = dy · recip(x)`.
    fn ln(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `1 / x`, elementwise; `1/±∞ = ±0`. Zero (which would give ±∞ and, a few
    /// ops later, NaN) and NaN are errors. Gradient from the output `y`:
    /// `dx = −dy · y²`.
    fn recip(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;

    /// `silu(x) = x * sigmoid(x)`.
    fn silu(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Gradient of `silu` at `x` times `dy`.
    fn silu_backward(&self, x: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `silu(gate) * up`.
    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Gradients `(d gate, d up)` of `swiglu` given `dy`.
    fn swiglu_backward(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dy: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// `probs[r] · silu(gate[r]) ⊙ up[r]` for the rows of `gate, up: [N, F]`
    /// and `probs: [N]`: SwiGLU scaled by each row's routing weight (the
    /// MoE experts apply the weights here, Megatron-Core's weighted SwiGLU,
    /// so that combine is a plain sum and its backward a gather).
    fn swiglu_weighted(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        probs: &Tensor<Self>,
    ) -> Result<Tensor<Self>>;
    /// Gradients `(d gate, d up, d probs)` of [`Self::swiglu_weighted`]
    /// given `dy: [N, F]`: `d probs[r] = Σ_f dy[r, f] · silu(gate[r, f]) ·
    /// up[r, f]` (accumulated in the accumulation type).
    #[allow(clippy::type_complexity)]
    fn swiglu_weighted_backward(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        probs: &Tensor<Self>,
        dy: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)>;
    /// `1 / (1 + exp(-x))`.
    fn sigmoid(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Gradient of `sigmoid` from its output `y` and `dy`: `dy * y * (1 - y)`.
    fn sigmoid_backward(&self, y: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `log(sigmoid(x)) = −softplus(−x)`, computed as
    /// `min(x, 0) − log1p(exp(−|x|))` so it stays finite and accurate for large
    /// |x| (where `ln(sigmoid(x))` would hit `ln(0)`). Gradient:
    /// `dx = dy · (1 − sigmoid(x))`, from [`ElementwiseOps::sigmoid`]. NaN
    /// propagates, as in `sigmoid`.
    fn log_sigmoid(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Softmax over the last dim (max-subtracted).
    fn softmax(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Gradient of `softmax` from its output `y` and `dy`: `y * (dy - sum(dy * y))`.
    fn softmax_backward(&self, y: &Tensor<Self>, dy: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `log(sum(exp(x)))` over the last dim: shape drops the last dim.
    fn logsumexp(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Rounds every value to the nearest bf16 (ties to even), kept in the input dtype.
    fn round_bf16(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;

    /// `x[r, c] * s[r]` for `x: [R, C]`, `s: [R]`.
    fn mul_rows(&self, x: &Tensor<Self>, s: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `x[r, c] * s[c]` for `x: [R, C]`, `s: [C]`.
    fn mul_cols(&self, x: &Tensor<Self>, s: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `x[r, c] + b[c]` for `x: [R, C]`, `b: [C]`.
    fn add_cols(&self, x: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Sum over the last dim: `[R, C] -> [R]`.
    fn sum_rows(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Sum over the first dim: `[R, C] -> [C]`.
    fn sum_cols(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Row-wise dot product: `[R, C] x [R, C] -> [R]`.
    fn dot_rows(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Sum of all elements as a `[1]` tensor (f64 accumulation).
    fn sum(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Sum of squares of all elements as a `[1]` tensor (f64 accumulation).
    fn sum_squares(&self, x: &Tensor<Self>) -> Result<Tensor<Self>>;
}

/// `(R, C, leading dims)` of `x`, with rows all leading dims flattened: the
/// view every row-wise op of every backend takes.
pub(crate) fn rows_cols<'a, B: Device>(
    op: &'static str,
    x: &'a Tensor<B>,
) -> Result<(usize, usize, &'a [usize])> {
    match x.shape().split_last() {
        Some((&c, lead)) => Ok((lead.iter().product(), c, lead)),
        None => Err(crate::error::shape_err(
            op,
            "expected at least one dimension, got a 0-d tensor",
        )),
    }
}

/// Checks [`ElementwiseOps::swiglu_weighted`]'s operands (`gate`, `up` and,
/// for the backward, `dy`: one shape `[N, F]` and dtype; `probs: [N]` of
/// that dtype) and returns `(N, F)`: one check for every backend.
pub(crate) fn swiglu_weighted_args<B: Device>(
    op: &'static str,
    gate: &Tensor<B>,
    up: &Tensor<B>,
    probs: &Tensor<B>,
    dy: Option<&Tensor<B>>,
) -> Result<(usize, usize)> {
    let (n, f) = gate.dims2(op)?;
    for (what, t) in std::iter::once(("up", up)).chain(dy.map(|d| ("dy", d))) {
        t.expect_dtype(op, gate.dtype())?;
        t.expect_shape(op, what, gate.shape())?;
    }
    probs.expect_dtype(op, gate.dtype())?;
    probs.expect_shape(op, "probs", &[n])?;
    Ok((n, f))
}
