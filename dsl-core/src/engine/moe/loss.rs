//! The router's auxiliary losses (docs/ARCHITECTURE.md §4; Megatron-Core `moe_utils.py`):
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

/// Which rows of a micro-batch this rank's router sees, and how the micro-batch
/// splits into the segments the balancing loss averages over.
///
/// On one rank the shard is the whole micro-batch. Under sequence parallelism
/// each tensor-parallel rank holds `rows` consecutive rows starting at
/// `offset` of the micro-batch's `total` rows; the losses computed on a shard
/// are partial sums whose sum over the group is the micro-batch's loss.
/// Under context parallelism each of `cp` ranks holds `segment / cp` tokens
/// of every segment (its chunks of every sequence), and rows are numbered
/// within that rank's `total / cp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenShard {
    /// First row of this shard within the micro-batch.
    pub offset: usize,
    /// Rows of the whole micro-batch.
    pub total: usize,
    /// Rows per balancing segment: `total` for `aux`, the sequence length for
    /// `seq_aux`.
    pub segment: usize,
    /// Context-parallel ranks sharing every segment (1 without cp).
    pub cp: usize,
}

impl TokenShard {
    /// The whole micro-batch of `total` rows in `n_seg` equal segments.
    pub fn whole(total: usize, n_seg: usize) -> Self {
        TokenShard {
            offset: 0,
            total,
            segment: total / n_seg.max(1),
            cp: 1,
        }
    }
}

/// Load-balancing loss over the equal, consecutive segments of the
/// micro-batch, averaged over segments: one segment is Megatron's `aux` (and
/// `global_aux` within a micro-batch), one per sequence its `seq_aux`.
///
/// `probs_te` are the full-softmax probabilities (or sigmoid scores
/// normalised over E) of the shard's rows, `mask_te` is 1 where a token chose
/// an expert (in the accumulation type, so counts stay exact). `reduce` sums a tensor over the ranks sharing the micro-batch
/// (the identity on one rank): the routed-copy shares `f` must count every
/// row of a segment. Returns the shard's part of the loss `[1]` with `coef`
/// applied.
pub fn balance_forward<B: Backend>(
    b: &B,
    probs_te: &Tensor<B>,
    mask_te: &Tensor<B>,
    shard: TokenShard,
    top_k: usize,
    coef: f64,
    reduce: &dyn Fn(&Tensor<B>) -> Result<Tensor<B>>,
) -> Result<(Tensor<B>, BalanceSaved<B>)> {
    let (t, e) = probs_te.dims2("balance_forward")?;
    let seq = shard.segment;
    let n_seq = shard.total / seq;
    // Rows of ones marking each segment's tokens: per-segment sums as one
    // product. Under cp this rank's rows of a segment are `seq / cp` of them.
    let held = seq / shard.cp.max(1);
    let mut seg = vec![0.0; n_seq * t];
    for (i, v) in seg.iter_mut().enumerate() {
        if (shard.offset + i % t) / held == i / t {
            *v = 1.0;
        }
    }
    let seg_bt = constant(b, seg.clone(), &[n_seq, t], probs_te.dtype())?;
    // f_be = copies of e in segment b / (S·K); P_be = mean over b's tokens.
    // The copies are counted in the mask's dtype (the accumulation type: a
    // bf16 count past 256 would round), the share then takes the probs'.
    let counts_be = if mask_te.dtype() == probs_te.dtype() {
        b.matmul(&seg_bt, mask_te, false, false)?
    } else {
        let seg_mask_bt = constant(b, seg, &[n_seq, t], mask_te.dtype())?;
        b.matmul(&seg_mask_bt, mask_te, false, false)?
    };
    let f_be = b.scale(&reduce(&counts_be)?, 1.0 / (seq * top_k) as f64)?;
    let f_be = if f_be.dtype() == probs_te.dtype() {
        f_be
    } else {
        b.cast(&f_be, probs_te.dtype())?
    };
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
    total: usize,
}

impl<B: Backend> ZSaved<B> {
    /// Lists the saved tensors, all under `slot`.
    pub(crate) fn visit_saved(
        &mut self,
        slot: crate::engine::activations::Slot,
        f: &mut dyn FnMut(crate::engine::activations::Slot, &mut Tensor<B>),
    ) {
        f(slot, &mut self.softmax_te);
        f(slot, &mut self.lse_t);
    }
}

/// z-loss `coef·mean_t(lse_t²)`, `lse_t = logsumexp(logits_t)`: keeps the
/// router logits small (ST-MoE). The mean is over the `total` rows of the
/// micro-batch, of which `logits_te` holds a shard (see [`TokenShard`]).
/// Returns the shard's part of the loss `[1]` with `coef` applied.
pub fn z_forward<B: Backend>(
    b: &B,
    logits_te: &Tensor<B>,
    coef: f64,
    total: usize,
) -> Result<(Tensor<B>, ZSaved<B>)> {
    let lse_t = b.logsumexp(logits_te)?;
    let loss = b.scale(&b.sum_squares(&lse_t)?, coef / total as f64)?;
    let saved = ZSaved {
        softmax_te: b.softmax(logits_te)?,
        lse_t,
        coef,
        total,
    };
    Ok((loss, saved))
}

/// `d z / d logits = coef·2·lse_t/T · softmax(logits_t)`, times `dloss`.
pub fn z_backward<B: Backend>(b: &B, saved: ZSaved<B>, dloss: f64) -> Result<Tensor<B>> {
    let g = b.mul_rows(&saved.softmax_te, &saved.lse_t)?;
    Ok(b.scale(&g, dloss * 2.0 * saved.coef / saved.total as f64)?)
}
