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
    /// `targets: [T]` (i32; `-1` ignores the token, loss 0). Returns `(loss: [T], lse: [T])`.
    fn cross_entropy(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;
    /// `dlogits[t] = dloss[t] * (softmax(logits[t]) - onehot(target[t]))` (zero for ignored tokens).
    fn cross_entropy_backward(
        &self,
        logits: &Tensor<Self>,
        targets: &Tensor<Self>,
        lse: &Tensor<Self>,
        dloss: &Tensor<Self>,
    ) -> Result<Tensor<Self>>;
}
