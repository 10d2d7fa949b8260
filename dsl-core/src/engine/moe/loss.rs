//! The router's auxiliary losses (DESIGN §4; Megatron-Core `moe_utils.py`):
//! the load-balancing loss `coef·E·Σ_e f_e·P_e` and the z-loss
//! `coef·mean_t(logsumexp(logits_t)²)`, each forward next to its backward.
//!
//! Shapes: T tokens, E experts, B sequences (segments of T), K top-k.
//!
//! `f_e` (the share of routed copies) is a count and carries no gradient, so
//! the balancing loss is linear in the probabilities `P`: its gradient is a
//! constant computed in the forward and kept for the backward.

use foldmoe_kernels::{Backend, Tensor};

use super::ops::constant;
use crate::engine::Result;

/// What the backward of the load-balancing loss needs.
pub struct BalanceSaved<B: Backend> {
    /// Gradient of the loss with respect to the probabilities `probs_te`.
    pub dprobs_te: Tensor<B>,
}

/// Load-balancing loss over `n_seq` equal, consecutive segments of the T
/// tokens, averaged over segments: `n_seq = 1` is Megatron's `aux` (and
/// `global_aux` on one rank), `n_seq = batch` its `seq_aux`.
///
/// `probs_te` are the full-softmax probabilities (or sigmoid scores
/// normalised over E), `mask_te` is 1 where a token chose an expert.
/// Returns the loss `[1]` with `coef` applied.
pub fn balance_forward<B: Backend>(
    b: &B,
    probs_te: &Tensor<B>,
    mask_te: &Tensor<B>,
    n_seq: usize,
    top_k: usize,
    coef: f64,
) -> Result<(Tensor<B>, BalanceSaved<B>)> {
    let (t, e) = probs_te.dims2("balance_forward")?;
    let seq = t / n_seq;
    // Rows of ones marking each segment's tokens: per-segment sums as one product.
    let mut seg = vec![0.0; n_seq * t];
    for (i, v) in seg.iter_mut().enumerate() {
        if (i % t) / seq == i / t {
            *v = 1.0;
        }
    }
    let seg_bt = constant(b, seg, &[n_seq, t], probs_te.dtype())?;
    // f_be = copies of e in segment b / (S·K); P_be = mean over b's tokens.
    let f_be = b.scale(
        &b.matmul(&seg_bt, mask_te, false, false)?,
        1.0 / (seq * top_k) as f64,
    )?;
    let p_be = b.scale(
        &b.matmul(&seg_bt, probs_te, false, false)?,
        1.0 / seq as f64,
    )?;
    let c = coef * e as f64 / n_seq as f64;
    let loss = b.scale(&b.sum(&b.mul(&f_be, &p_be)?)?, c)?;
    let dprobs_te = b.scale(&b.matmul(&seg_bt, &f_be, true, false)?, c / seq as f64)?;
    Ok((loss, BalanceSaved { dprobs_te }))
}

/// Gradient of the load-balancing loss with respect to its probabilities.
pub fn balance_backward<B: Backend>(saved: BalanceSaved<B>) -> Tensor<B> {
    saved.dprobs_te
}

/// What the backward of the z-loss needs.
pub struct ZSaved<B: Backend> {
    softmax_te: Tensor<B>,
    lse_t: Tensor<B>,
    coef: f64,
}

/// z-loss `coef·mean_t(lse_t²)`, `lse_t = logsumexp(logits_t)`: keeps the
/// router logits small (ST-MoE). Returns the loss `[1]` with `coef` applied.
pub fn z_forward<B: Backend>(
    b: &B,
    logits_te: &Tensor<B>,
    coef: f64,
) -> Result<(Tensor<B>, ZSaved<B>)> {
    let (t, _) = logits_te.dims2("z_forward")?;
    let lse_t = b.logsumexp(logits_te)?;
    let loss = b.scale(&b.sum_squares(&lse_t)?, coef / t as f64)?;
    let saved = ZSaved {
        softmax_te: b.softmax(logits_te)?,
        lse_t,
        coef,
    };
    Ok((loss, saved))
}

/// `d z / d logits = coef·2·lse_t/T · softmax(logits_t)`, times `dloss`.
pub fn z_backward<B: Backend>(b: &B, saved: ZSaved<B>, dloss: f64) -> Result<Tensor<B>> {
    let (t, _) = saved.softmax_te.dims2("z_backward")?;
    let g = b.mul_rows(&saved.softmax_te, &saved.lse_t)?;
    Ok(b.scale(&g, dloss * 2.0 * saved.coef / t as f64)?)
}
