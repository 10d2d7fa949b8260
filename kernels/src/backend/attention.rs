use super::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Causal attention with grouped-query heads, computed blockwise with an
/// online softmax so memory is O(S·block) per head, not O(S²).
pub trait AttentionOps: Device {
    /// `q: [B, S, Hq, Hd]`, `k, v: [B, S, Hkv, Hd]` with `Hq % Hkv == 0` (query
    /// head `h` reads kv head `h / (Hq / Hkv)`); scores scaled by `1/sqrt(Hd)`.
    /// Returns `(o: [B, S, Hq, Hd], lse: [B, Hq, S])`, `lse` the log-sum-exp of
    /// each query's scaled scores (kept for the backward) in the accumulation
    /// type: f32 for bf16 inputs, so the backward's probabilities are not
    /// recomputed from a rounded lse.
    ///
    /// `docs: [B, S]` (i32 document index of each token, nondecreasing
    /// along each sequence, as packing makes them) also masks every key of
    /// another document than the query's (Megatron's
    /// `--reset-attention-mask`); the diagonal is always visible, so no row
    /// is empty. Without it the mask is causal only.
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// Gradients `(dq, dk, dv)`, recomputing probabilities blockwise from
    /// `lse`, under the same `docs` mask as the forward.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)>;

    /// [`Self::attention_backward`] of MLA's shape: values `value_dim` wide
    /// zero-padded to the query/key head dim in `v` and `d_o` (as the MLA
    /// block builds `v`, and `d_o` by slicing `o`). A backend may read only
    /// their first `value_dim` columns (Hopper's kernel at Hd 192 / values
    /// 128 does, and reports a nonzero padding element as an invalid
    /// argument at the next read of a result); the default is the general
    /// backward.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_padded_values(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
        value_dim: usize,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        let _ = value_dim;
        self.attention_backward(d_o, q, k, v, o, lse, docs)
    }
}

/// Checks `docs` against `q: [B, S, ..]`: `[B, S]` of i32.
pub(crate) fn check_docs<B: Device>(
    op: &'static str,
    q: &Tensor<B>,
    docs: Option<&Tensor<B>>,
) -> Result<()> {
    if let Some(d) = docs {
        d.expect_shape(op, "docs", &q.shape()[..2])?;
        d.expect_dtype(op, crate::tensor::DType::I32)?;
    }
    Ok(())
}

/// `(B, S, Hq, Hkv, Hd)` of causal grouped-query attention inputs, after the
/// checks every backend makes: matching batch, sequence and head dim, `Hq` a
/// multiple of `Hkv`, `Hd > 0`, one dtype.
pub(crate) fn check_qkv<B: Device>(
    op: &'static str,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
) -> Result<(usize, usize, usize, usize, usize)> {
    use crate::error::{arg_err, shape_err, KernelError};
    let (b, s, hq, hd) = q.dims4(op)?;
    let (kb, ks, hkv, khd) = k.dims4(op)?;
    if (kb, ks, khd) != (b, s, hd) {
        return Err(shape_err(
            op,
            format!(
                "q has shape {:?} [B, S, Hq, Hd] but k has shape {:?}; k must be [{b}, {s}, Hkv, {hd}]",
                q.shape(),
                k.shape()
            ),
        ));
    }
    v.expect_shape(op, "v", k.shape())?;
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(shape_err(
            op,
            format!(
                "Hq = {hq} query heads must be a positive multiple of Hkv = {hkv} kv heads \
                 (grouped-query attention shares each kv head among Hq / Hkv query heads)"
            ),
        ));
    }
    if hd == 0 {
        return Err(arg_err(
            op,
            "head dim Hd = 0: scores would be scaled by 1/sqrt(0)",
        ));
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return Err(KernelError::DTypeMismatch {
            op,
            expected: q.dtype(),
            got: if k.dtype() != q.dtype() {
                k.dtype()
            } else {
                v.dtype()
            },
        });
    }
    Ok((b, s, hq, hkv, hd))
}
