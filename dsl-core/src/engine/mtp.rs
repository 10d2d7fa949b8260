//! DeepSeek-V3's multi-token prediction (MTP; the report's §2.2, Megatron-Core's
//! `multi_token_prediction.py`): D modules after the main model, module k
//! predicting the token k + 1 places ahead of each position.
//!
//! Module k takes `h` (the main model's last block output for k = 1, module
//! k − 1's output after) and the embeddings of the tokens k places ahead,
//! `e = Emb(t_{i+k})` (the model's embedding table, shared), and computes
//!
//! `h' = [RMSNorm_e(e); RMSNorm_h(h)] · W_eh`, `h_k = Block_k(h')`,
//! `logits_k = Head(RMSNorm_k(h_k))` (the model's head, shared),
//!
//! whose cross-entropy against the targets k places ahead (ignored past the
//! end of each sequence) enters the loss with weight `mtp_loss_coef / D`.
//! The embedding comes first in the concatenation, as in Megatron-Core.
//!
//! Parameters, under `mtp.{k-1}`: `enorm.weight`, `hnorm.weight` `[D]`,
//! `eh_proj.weight` `[2D, D]` (replicated over tp: each tp rank projects its
//! sequence-parallel rows, the gradient is summed over tp like a norm's),
//! `block.*` (a block of the model's last group, split as that group's
//! blocks are), `norm.weight` `[D]`. The modules live on the last pipeline
//! stage, which also holds a copy of the embedding table (its gradient summed
//! with the first stage's, as a tied table's).
//!
//! Shapes: T this rank's rows, D hidden.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::activations::{hold_all, Held, Slot};
use super::block::{Block, BlockSaved};
use super::moe::MoeStats;
use super::norm::{NormSaved, RmsNorm};
use super::parallel::{Exec, LayerGroups};
use super::param::{Init, Module, Param};
use super::{EngineError, Result};
use crate::memory::Part;
use crate::spec::ModelSpec;

/// What [`MtpModule::forward`] returns: the block's output `[T, D]`, the
/// module's state and its MoE layer's stats (when its block has one).
pub type MtpOut<B> = (Tensor<B>, MtpSaved<B>, Option<MoeStats<B>>);

/// One MTP module (see the module docs).
pub struct MtpModule<B: Backend> {
    /// Norm of the shifted tokens' embeddings.
    pub enorm: RmsNorm<B>,
    /// Norm of the previous depth's hidden states.
    pub hnorm: RmsNorm<B>,
    /// The projection `[2D, D]` of the concatenated norms (embedding rows first).
    pub eh_proj: Param<B>,
    /// The module's transformer block.
    pub block: Block<B>,
    /// The norm before the shared head.
    pub norm: RmsNorm<B>,
}

/// What the module's backward needs, but the embedding's and the loss's
/// (the model keeps those, as for its own).
pub struct MtpSaved<B: Backend> {
    enorm: NormSaved<B>,
    hnorm: NormSaved<B>,
    /// The two normed inputs of the projection.
    e_td: Tensor<B>,
    h_td: Tensor<B>,
    block: BlockSaved<B>,
    /// Ledger bytes of the norms' state and the projection's inputs (the
    /// block counts its own), under `norms`, until the backward.
    _held: Held,
}

impl<B: Backend> MtpModule<B> {
    /// Module `index` (0-based) of `model`, its block a block of the last
    /// group, under `mtp.{index}`.
    pub fn new(
        b: &B,
        model: &ModelSpec,
        index: usize,
        init: Init<'_>,
        dtype: DType,
        groups: LayerGroups,
    ) -> Result<Self> {
        let group = model.groups.last().ok_or_else(|| {
            EngineError::Invalid(format!(
                "model {}: MTP needs at least one block group",
                model.name
            ))
        })?;
        let (d, eps) = (model.hidden, model.norm_eps);
        let prefix = format!("mtp.{index}");
        let eh_proj = init.normal(
            b,
            format!("{prefix}.eh_proj.weight"),
            &[2 * d, d],
            model.init_std,
            dtype,
        )?;
        Ok(MtpModule {
            enorm: RmsNorm::new(b, &format!("{prefix}.enorm"), d, eps, dtype)?,
            hnorm: RmsNorm::new(b, &format!("{prefix}.hnorm"), d, eps, dtype)?,
            eh_proj,
            block: Block::new(
                b,
                &format!("{prefix}.block"),
                model,
                group,
                init,
                dtype,
                groups,
            )?,
            norm: RmsNorm::new(b, &format!("{prefix}.norm"), d, eps, dtype)?,
        })
    }

    /// `e: [T, D]` (the shifted tokens' embeddings) and `h: [T, D]` (the
    /// previous depth) → the block's output `[T, D]`, its state and MoE stats.
    pub fn forward(
        &self,
        ctx: &Exec<B>,
        e_td: &Tensor<B>,
        h_td: &Tensor<B>,
        seq_len: usize,
        tokens: usize,
    ) -> Result<MtpOut<B>> {
        let b = ctx.b;
        let (en_td, enorm) = self.enorm.forward(b, e_td)?;
        let (hn_td, hnorm) = self.hnorm.forward(b, h_td)?;
        let (w_e, w_h) = self.weights(b)?;
        let mut x_td = b.matmul(&en_td, &w_e, false, false)?;
        b.axpy(&mut x_td, 1.0, &b.matmul(&hn_td, &w_h, false, false)?)?;
        let (y_td, block, stats) = self.block.forward(ctx, &x_td, seq_len, tokens)?;
        let (mut enorm, mut hnorm, mut e_td, mut h_td) = (enorm, hnorm, en_td, hn_td);
        let norms = Slot::kept(Part::Norms);
        let held = hold_all(&self.block.ledger, &self.block.name, |f| {
            enorm.visit_saved(norms, f);
            hnorm.visit_saved(norms, f);
            f(norms, &mut e_td);
            f(norms, &mut h_td);
        });
        let saved = MtpSaved {
            enorm,
            hnorm,
            e_td,
            h_td,
            block,
            _held: held,
        };
        Ok((y_td, saved, stats))
    }

    /// From `dy` (the gradient of the block's output): accumulates the
    /// module's gradients and returns `(de, dh)`, the gradients of the
    /// embeddings and of the previous depth.
    pub fn backward(
        &mut self,
        ctx: &Exec<B>,
        dy_td: &Tensor<B>,
        saved: MtpSaved<B>,
        loss_scale: f64,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let b = ctx.b;
        let MtpSaved {
            enorm,
            hnorm,
            e_td,
            h_td,
            block,
            ..
        } = saved;
        let dx_td = self.block.backward(ctx, dy_td, block, loss_scale)?;
        let (w_e, w_h) = self.weights(b)?;
        let dw_e = b.matmul(&e_td, &dx_td, true, false)?;
        let dw_h = b.matmul(&h_td, &dx_td, true, false)?;
        self.eh_proj.accumulate(b, &b.concat(&[&dw_e, &dw_h])?)?;
        let de_td = self
            .enorm
            .backward(b, &b.matmul(&dx_td, &w_e, false, true)?, enorm)?;
        let dh_td = self
            .hnorm
            .backward(b, &b.matmul(&dx_td, &w_h, false, true)?, hnorm)?;
        Ok((de_td, dh_td))
    }

    /// The projection's embedding rows `[D, D]` and hidden rows `[D, D]`.
    fn weights(&self, b: &B) -> Result<(Tensor<B>, Tensor<B>)> {
        let d = self.eh_proj.value.shape()[1];
        Ok((
            b.narrow(&self.eh_proj.value, 0, d)?,
            b.narrow(&self.eh_proj.value, d, d)?,
        ))
    }

    /// The module's dense parameters (attention mesh), in a fixed order:
    /// the block's, then the two input norms, the projection and the norm.
    pub fn visit_dense<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        self.block.visit_dense(f);
        self.enorm.visit_params(f);
        self.hnorm.visit_params(f);
        f(&self.eh_proj);
        self.norm.visit_params(f);
    }

    /// Mutable [`Self::visit_dense`].
    pub fn visit_dense_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        self.block.visit_dense_mut(f);
        self.enorm.visit_params_mut(f);
        self.hnorm.visit_params_mut(f);
        f(&mut self.eh_proj);
        self.norm.visit_params_mut(f);
    }
}

/// `ids` and `targets` (`[B·S]`, sequences of `seq_len`) moved `k` places
/// ahead within each sequence: position i gets token i + k and target
/// i + k; past the end the token is 0 (embedded, never attended by a valid
/// position: attention is causal) and the target −1 (ignored).
pub fn shifted(ids: &[i32], targets: &[i32], seq_len: usize, k: usize) -> (Vec<i32>, Vec<i32>) {
    let mut out_ids = vec![0; ids.len()];
    let mut out_targets = vec![-1; targets.len()];
    for (i, (id, y)) in out_ids.iter_mut().zip(out_targets.iter_mut()).enumerate() {
        let pos = i % seq_len;
        if pos + k < seq_len {
            *id = ids[i + k];
            *y = targets[i + k];
        }
    }
    (out_ids, out_targets)
}

#[cfg(test)]
mod tests {
    use super::shifted;

    #[test]
    fn shifting_stays_within_each_sequence() {
        let ids = [1, 2, 3, 4, 5, 6];
        let targets = [2, 3, -1, 5, 6, 7];
        let (i1, t1) = shifted(&ids, &targets, 3, 1);
        assert_eq!(i1, [2, 3, 0, 5, 6, 0]);
        assert_eq!(t1, [3, -1, -1, 6, 7, -1]);
        let (i2, t2) = shifted(&ids, &targets, 3, 2);
        assert_eq!(i2, [3, 0, 0, 6, 0, 0]);
        assert_eq!(t2, [-1, -1, -1, 7, -1, -1]);
    }
}
