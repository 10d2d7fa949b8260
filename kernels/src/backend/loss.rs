use super::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Cross-entropy over the vocabulary.
pub trait LossOps: Device {
    /// The tokens that count towards a mean loss: `1` where `targets[t] ≥ 0`,
    /// `0` where it is `-1` (ignored), as a float tensor of `dtype` shaped like
    /// `targets` (i32). Its sum is the number of valid tokens, so the mean
    /// needs no read back to the host. A target below `-1` is an error.
    fn valid_mask(&self, targets: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>>;
    /// Per-token loss `lse(logits[t]) - logits[t, target[t]]` for `logits: [T, V]`,
    /// `targets: [T]` (i32; `-1` ignores the token, loss 0). Returns `(loss: [T], lse: [T])`
    /// in the accumulation type of the logits ([`DType::acc`]: F32 for BF16 and
    /// F32, F64 for F64), as Megatron-Core computes its cross-entropy in fp32:
    /// a bf16 loss would quantise the reported loss and the backward's softmax.
    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// `dlogits[t] = dloss[t] * (softmax(logits[t]) - onehot(target[t]))` (zero for ignored
    /// tokens), the softmax formed as `exp(logits[t] - lse[t])`. `lse` and `dloss` are `[T]`
    /// in the logits' accumulation type (as [`LossOps::cross_entropy`] returns them);
    /// `dlogits` has the logits' dtype and shape.
    fn cross_entropy_backward(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
        lse: &Tensor<Self>,
        dloss: &Tensor<Self>,
    ) -> Result<Tensor<Self>>;
}
