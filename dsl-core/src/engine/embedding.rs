//! Token embedding and the language-model head, tied or untied (Megatron-Core's
//! `LanguageModelEmbedding` and `output_layer` with
//! `share_embeddings_and_output_weights`).
//!
//! Both hold a `[V, D]` table (Hugging Face's `embed_tokens` / `lm_head` layout):
//! the embedding picks rows, the head multiplies by its transpose. A tied head
//! owns no weight and uses the embedding's table, so both gradients land in one
//! parameter.
//!
//! Shapes: T tokens, D hidden, V vocabulary.

use foldmoe_kernels::{Backend, DType, Tensor};

use super::param::{Init, Module, Param};
use super::Result;

/// The token embedding table `[V, D]`.
pub struct Embedding<B: Backend> {
    /// The table `[V, D]`, normal(0, init_std).
    pub table: Param<B>,
}

/// What the embedding's backward needs: the token ids.
pub struct EmbeddingSaved<B: Backend> {
    ids_t: Tensor<B>,
}

impl<B: Backend> Embedding<B> {
    /// A table named `{prefix}.weight`.
    pub fn new(
        b: &B,
        prefix: &str,
        vocab: usize,
        hidden: usize,
        std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        Ok(Embedding {
            table: init.normal(b, format!("{prefix}.weight"), &[vocab, hidden], std, dtype)?,
        })
    }

    /// Vocabulary size V.
    pub fn vocab(&self) -> usize {
        self.table.value.shape()[0]
    }

    /// `ids: [T]` (i32, each below V) `-> [T, D]`.
    pub fn forward(&self, b: &B, ids_t: &Tensor<B>) -> Result<(Tensor<B>, EmbeddingSaved<B>)> {
        let x_td = b.embedding(&self.table.value, ids_t)?;
        Ok((
            x_td,
            EmbeddingSaved {
                ids_t: ids_t.clone(),
            },
        ))
    }

    /// Accumulates the table's gradient; token ids have no gradient.
    pub fn backward(&mut self, b: &B, dy_td: &Tensor<B>, saved: EmbeddingSaved<B>) -> Result<()> {
        let dtable_vd = b.embedding_backward(dy_td, &saved.ids_t, self.vocab())?;
        self.table.accumulate(b, &dtable_vd)
    }
}

impl<B: Backend> Module<B> for Embedding<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        f(&self.table);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        f(&mut self.table);
    }
}

/// The output layer `logits = x · Wᵀ`, with `W: [V, D]` its own (untied) or
/// the embedding's table (tied).
pub struct LmHead<B: Backend> {
    /// The untied weight `[V, D]`; `None` when tied to the embedding.
    pub weight: Option<Param<B>>,
}

/// What the head's backward needs: its input.
pub struct HeadSaved<B: Backend> {
    /// The input's rows (under tp the rank's sequence shard, which the
    /// model keeps in place of the gathered rows and gathers again).
    x: super::linear::LinearSaved<B>,
}

impl<B: Backend> HeadSaved<B> {
    /// Lists the saved input under `slot`.
    pub(crate) fn visit_saved(
        &mut self,
        slot: super::activations::Slot,
        f: &mut dyn FnMut(super::activations::Slot, &mut Tensor<B>),
    ) {
        self.x.visit(slot, f);
    }

    /// The kept input (the model swaps in the rank's sequence shard).
    pub(crate) fn input_mut(&mut self) -> &mut super::linear::LinearSaved<B> {
        &mut self.x
    }
}

impl<B: Backend> LmHead<B> {
    /// A head tied to the embedding table: it owns no parameter.
    pub fn tied() -> Self {
        LmHead { weight: None }
    }

    /// An untied head named `{prefix}.weight`.
    pub fn untied(
        b: &B,
        prefix: &str,
        vocab: usize,
        hidden: usize,
        std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let weight = init.normal(b, format!("{prefix}.weight"), &[vocab, hidden], std, dtype)?;
        Ok(LmHead {
            weight: Some(weight),
        })
    }

    /// `x: [T, D] -> logits: [T, V]`; `embedding` supplies the weight when tied.
    pub fn forward(
        &self,
        b: &B,
        embedding: &Embedding<B>,
        x_td: &Tensor<B>,
    ) -> Result<(Tensor<B>, HeadSaved<B>)> {
        let w_vd = self.weight.as_ref().unwrap_or(&embedding.table);
        let logits_tv = b.matmul(x_td, &w_vd.value, false, true)?;
        let x = super::linear::LinearSaved::Rows(x_td.clone());
        Ok((logits_tv, HeadSaved { x }))
    }

    /// Accumulates the weight's gradient (into the embedding's table when tied)
    /// and returns `dx: [T, D]`.
    pub fn backward(
        &mut self,
        b: &B,
        embedding: &mut Embedding<B>,
        dlogits_tv: &Tensor<B>,
        saved: HeadSaved<B>,
    ) -> Result<Tensor<B>> {
        let x_td = saved.x.into_rows("head backward")?;
        let w_vd = self.weight.as_mut().unwrap_or(&mut embedding.table);
        w_vd.accumulate(b, &b.matmul(dlogits_tv, &x_td, true, false)?)?;
        Ok(b.matmul(dlogits_tv, &w_vd.value, false, false)?)
    }
}

impl<B: Backend> Module<B> for LmHead<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        if let Some(w) = &self.weight {
            f(w);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        if let Some(w) = &mut self.weight {
            f(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::DType;

    use super::{Embedding, LmHead};
    use crate::engine::param::{Module, Param};
    use crate::engine::testutil::{
        check_param_grads, dot, f64_tensor, i32_tensor, uniform, values,
    };

    const V: usize = 5;
    const D: usize = 3;

    #[test]
    fn embedding_layer_grad() {
        let b = Cpu;
        let mut emb = Embedding::new(
            &b,
            "embed",
            V,
            D,
            0.5,
            crate::engine::Init::full(1),
            DType::F64,
        )
        .unwrap();
        // Repeated ids: their rows' gradients must add up.
        let ids = i32_tensor(vec![0, 3, 1, 3, 4, 2, 0], &[7]);
        let r = uniform(2, 7 * D, 1.0);
        let (_, saved) = emb.forward(&b, &ids).unwrap();
        emb.backward(&b, &f64_tensor(r.clone(), &[7, D]), saved)
            .unwrap();
        check_param_grads("embedding", &mut emb, 64, 1e-6, |e| {
            dot(&e.forward(&b, &ids).unwrap().0, &r)
        });
    }

    /// An embedding and a head as one module, so a tied head's two
    /// contributions to the table are checked together.
    struct Pair(Embedding<Cpu>, LmHead<Cpu>);

    impl Module<Cpu> for Pair {
        fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<Cpu>)) {
            self.0.visit_params(f);
            self.1.visit_params(f);
        }
        fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<Cpu>)) {
            self.0.visit_params_mut(f);
            self.1.visit_params_mut(f);
        }
    }

    /// `loss = Σ r1 ⊙ embed(ids) + Σ r2 ⊙ head(x)` and its gradients, for a
    /// tied or untied head.
    fn check_head(tied: bool) {
        let b = Cpu;
        let mut emb = Embedding::new(
            &b,
            "embed",
            V,
            D,
            0.5,
            crate::engine::Init::full(1),
            DType::F64,
        )
        .unwrap();
        let mut head = if tied {
            LmHead::tied()
        } else {
            LmHead::untied(
                &b,
                "head",
                V,
                D,
                0.5,
                crate::engine::Init::full(2),
                DType::F64,
            )
            .unwrap()
        };
        let t = 4;
        let ids = i32_tensor(vec![1, 4, 0, 2], &[t]);
        let x = uniform(3, t * D, 1.0);
        let x_td = f64_tensor(x.clone(), &[t, D]);
        let r1 = uniform(4, t * D, 1.0);
        let r2 = uniform(5, t * V, 1.0);

        let (_, emb_saved) = emb.forward(&b, &ids).unwrap();
        let (_, head_saved) = head.forward(&b, &emb, &x_td).unwrap();
        let dx = head
            .backward(&b, &mut emb, &f64_tensor(r2.clone(), &[t, V]), head_saved)
            .unwrap();
        emb.backward(&b, &f64_tensor(r1.clone(), &[t, D]), emb_saved)
            .unwrap();

        let what = if tied {
            "lm_head tied"
        } else {
            "lm_head untied"
        };
        assert_grad(&format!("{what} dx"), &x, &values(&dx), 1e-6, |xs| {
            let x_td = f64_tensor(xs.to_vec(), &[t, D]);
            dot(&head.forward(&b, &emb, &x_td).unwrap().0, &r2)
        });
        let mut pair = Pair(emb, head);
        check_param_grads(what, &mut pair, 64, 1e-6, |p| {
            dot(&p.0.forward(&b, &ids).unwrap().0, &r1)
                + dot(&p.1.forward(&b, &p.0, &x_td).unwrap().0, &r2)
        });
        let mut n = 0;
        pair.visit_params(&mut |_| n += 1);
        assert_eq!(n, if tied { 1 } else { 2 });
    }

    #[test]
    fn lm_head_tied_grad() {
        check_head(true);
    }

    #[test]
    fn lm_head_untied_grad() {
        check_head(false);
    }
}
