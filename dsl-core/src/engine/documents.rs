//! Documents inside packed sequences (Megatron's `--reset-position-ids`
//! and `--reset-attention-mask`): a micro-batch may carry each token's
//! document index, from which RoPE positions restart at every document and
//! attention stops at document boundaries.
//!
//! The ids and the flags come with the micro-batch ([`Documents`], host
//! side, whole sequences in natural order); the model turns them once per
//! micro-batch into [`DocTensors`] on the device, which every attention
//! layer reads (under cp each rank takes the key prefixes it needs, with
//! their original positions, see `parallel::context`).
//!
//! Shapes: B sequences, S sequence length, P a prefix of the sequence.

use foldmoe_kernels::{Backend, HostData, Tensor};

use super::{EngineError, Result};

/// Each token's document within its sequence and what to do with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Documents {
    /// `[B·S]` document index of each token, nondecreasing along each
    /// sequence (any values: only changes between neighbours count).
    pub ids: Vec<i32>,
    /// RoPE positions restart at 0 at each document's first token.
    pub reset_positions: bool,
    /// Attention sees only keys of the query's own document.
    pub mask_attention: bool,
}

impl Documents {
    /// Megatron's `get_ltor_masks_and_position_ids` boundaries: a new
    /// document starts after every `eod` token of `tokens` (`[B·S]`, in
    /// sequences of `seq_len`), the end-of-document token belonging to the
    /// document it ends; ids restart at 0 for every sequence.
    pub fn after_eod(
        tokens: &[i32],
        seq_len: usize,
        eod: i32,
        reset_positions: bool,
        mask_attention: bool,
    ) -> Self {
        let mut ids = Vec::with_capacity(tokens.len());
        for seq in tokens.chunks(seq_len.max(1)) {
            let mut doc = 0;
            for &t in seq {
                ids.push(doc);
                if t == eod {
                    doc += 1;
                }
            }
        }
        Documents {
            ids,
            reset_positions,
            mask_attention,
        }
    }

    /// `[B·S]` position of each token within its document.
    pub fn positions(&self, seq_len: usize) -> Vec<i32> {
        let mut pos = Vec::with_capacity(self.ids.len());
        for seq in self.ids.chunks(seq_len.max(1)) {
            let mut p = 0;
            for (i, &d) in seq.iter().enumerate() {
                if i > 0 && d != seq[i - 1] {
                    p = 0;
                }
                pos.push(p);
                p += 1;
            }
        }
        pos
    }

    /// Errors unless there is one id per token of `n` and the ids do not
    /// decrease along a sequence of `seq_len`.
    pub fn check(&self, n: usize, seq_len: usize) -> Result<()> {
        if self.ids.len() != n {
            return Err(EngineError::Invalid(format!(
                "documents: {} document ids for {n} tokens",
                self.ids.len()
            )));
        }
        for (bi, seq) in self.ids.chunks(seq_len.max(1)).enumerate() {
            if let Some(w) = seq.windows(2).position(|w| w[1] < w[0]) {
                return Err(EngineError::Invalid(format!(
                    "documents: sequence {bi}'s document ids decrease at position {} ({} then {})",
                    w + 1,
                    seq[w],
                    seq[w + 1]
                )));
            }
        }
        Ok(())
    }
}

/// A micro-batch's documents as the attention layers take them: `[B, S]`
/// i32 positions (with `reset_positions`) and document ids (with
/// `mask_attention`) on the device, and their host copies for the cp
/// prefixes.
pub struct DocTensors<B: Backend> {
    /// RoPE positions `[B, S]`.
    pub positions: Option<Tensor<B>>,
    /// Document ids `[B, S]` for the attention mask.
    pub docs: Option<Tensor<B>>,
    host_positions: Option<Vec<i32>>,
    host_docs: Option<Vec<i32>>,
    batch: usize,
    seq: usize,
}

impl<B: Backend> Clone for DocTensors<B> {
    fn clone(&self) -> Self {
        DocTensors {
            positions: self.positions.clone(),
            docs: self.docs.clone(),
            host_positions: self.host_positions.clone(),
            host_docs: self.host_docs.clone(),
            batch: self.batch,
            seq: self.seq,
        }
    }
}

impl<B: Backend> DocTensors<B> {
    /// Uploads what `docs` asks for (whole sequences of `seq_len`); `None`
    /// when it asks for nothing.
    pub fn new(b: &B, docs: &Documents, seq_len: usize) -> Result<Option<Self>> {
        if !docs.reset_positions && !docs.mask_attention {
            return Ok(None);
        }
        let n = docs.ids.len();
        docs.check(n, seq_len)?;
        let host_positions = docs.reset_positions.then(|| docs.positions(seq_len));
        let host_docs = docs.mask_attention.then(|| docs.ids.clone());
        Self::from_host(b, host_positions, host_docs, n / seq_len, seq_len).map(Some)
    }

    fn from_host(
        b: &B,
        host_positions: Option<Vec<i32>>,
        host_docs: Option<Vec<i32>>,
        batch: usize,
        seq: usize,
    ) -> Result<Self> {
        let up = |v: &Option<Vec<i32>>| -> Result<Option<Tensor<B>>> {
            v.as_ref()
                .map(|v| Ok(b.upload(HostData::I32(v.clone()), &[batch, seq])?))
                .transpose()
        };
        Ok(DocTensors {
            positions: up(&host_positions)?,
            docs: up(&host_docs)?,
            host_positions,
            host_docs,
            batch,
            seq,
        })
    }

    /// The first `len` tokens of every sequence (`[B, P]`): a cp chunk's key
    /// prefix, whose padded queries share its positions and documents.
    pub fn prefix(&self, b: &B, len: usize) -> Result<Self> {
        let cut = |v: &Option<Vec<i32>>| {
            v.as_ref().map(|v| {
                v.chunks(self.seq)
                    .flat_map(|s| s[..len].iter().copied())
                    .collect::<Vec<_>>()
            })
        };
        Self::from_host(
            b,
            cut(&self.host_positions),
            cut(&self.host_docs),
            self.batch,
            len,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Documents;

    /// Megatron's boundaries: the document after an EOD starts at the next
    /// token, positions restart there, ids restart per sequence.
    #[test]
    fn documents_after_eod() {
        let eod = 9;
        let tokens = [
            5, 9, 1, 2, 9, 9, 3, 4, /* second sequence */ 1, 2, 3, 9, 4, 5, 6, 7,
        ];
        let d = Documents::after_eod(&tokens, 8, eod, true, true);
        assert_eq!(d.ids, [0, 0, 1, 1, 1, 2, 3, 3, 0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(
            d.positions(8),
            [0, 1, 0, 1, 2, 0, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3]
        );
        d.check(16, 8).unwrap();
        let bad = Documents {
            ids: vec![0, 1, 0, 1],
            ..d
        };
        let err = bad.check(4, 4).unwrap_err().to_string();
        assert!(err.contains("decrease at position 2"), "{err}");
    }
}
