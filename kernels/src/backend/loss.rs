use super::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Cross-entropy over the vocabulary.
pub trait LossOps: Device {
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
