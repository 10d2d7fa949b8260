use super::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Causal attention with grouped-query heads, computed blockwise with an
/// online softmax so memory is O(S·block) per head, not O(S²).
pub trait AttentionOps: Device {
    /// `q: [B, S, Hq, Hd]`, `k, v: [B, S, Hkv, Hd]` with `Hq % Hkv == 0` (query
    /// head `h` reads kv head `h / (Hq / Hkv)`); scores scaled by `1/sqrt(Hd)`.
    /// Returns `(o: [B, S, Hq, Hd], lse: [B, Hq, S])`, `lse` the log-sum-exp of
    /// each query's scaled scores (kept for the backward).
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// Gradients `(dq, dk, dv)`, recomputing probabilities blockwise from `lse`.
    fn attention_backward(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)>;
}
