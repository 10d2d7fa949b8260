//! Context parallelism (cp): the sequence of every micro-batch cut into
//! `2·cp` chunks, context-parallel rank `i` holding chunks `i` and
//! `2·cp − 1 − i` (the layout's [`cp_positions`], Megatron-Core's causal load
//! balance). Everything but attention is per token and runs on the rank's
//! tokens; attention needs every earlier key.
//!
//! **Exchange: all-gather of K and V** over the cp group (not a ring): the
//! simplest exact scheme, one collective each way. The whole sequence's keys
//! and values are held only while the attention runs: the backward keeps
//! this rank's q, k and v and gathers the keys and values again (as
//! Megatron-Core's all-gather context parallelism does). Its backward sums
//! every rank's key and value gradients and gives each owner its rows: a
//! reduce-scatter.
//!
//! The backend's attention is causal over a whole `[B, S, H, Hd]` sequence,
//! so a query chunk `g` (positions `g·c .. (g+1)·c`, `c = S / 2cp`) is run
//! against the key prefix `0 .. (g+1)·c` with its queries placed at the end of
//! a zero-padded query block: the diagonal block is then causal and the
//! earlier blocks fully visible, exactly as in the one-rank attention, and
//! RoPE sees each token's original position. Padding rows get a zero output
//! gradient, which makes their contribution to every gradient exactly zero,
//! whatever their output: the backward rebuilds the padded queries and
//! outputs from this rank's rows (zeros in the padding) instead of keeping
//! them.
//!
//! Documents (reset positions and attention at end-of-document) carry over
//! unchanged: every tensor here is in natural order, so the keys take the
//! whole sequences' positions and a chunk's padded queries and key prefix
//! the prefix's positions and document ids — the padding rows are queries
//! of the prefix's own tokens, so each sees at least itself.
//!
//! Shapes: B sequences of the micro-batch, S sequence, L = S / cp tokens of
//! a sequence held here, c = S / 2cp chunk, T = B·L tokens held, D hidden,
//! Hq / Hkv heads held (under tp), Hd head dim, P = (g+1)·c a key prefix.

use foldmoe_kernels::{Backend, HostData, Tensor};

use super::{Exec, LayerGroups};
use crate::engine::activations::Slot as Slot_;
use crate::engine::attention::{project_backward, Attention};
use crate::engine::documents::DocTensors;
use crate::engine::linear::{LinearInput, LinearSaved};
use crate::engine::{EngineError, Result};
use crate::layout::{cp_chunks, cp_positions};
use crate::memory::Part;
use crate::spec::{OffloadPart, RecomputePart};

/// This cp rank's part of `x` (one value per token of sequences of
/// `seq_len`): its two chunks of every sequence, in its local order.
pub fn split_sequences<T: Copy>(
    x: &[T],
    seq_len: usize,
    cp: usize,
    cp_index: usize,
) -> Result<Vec<T>> {
    if cp == 1 {
        return Ok(x.to_vec());
    }
    if seq_len == 0 || !seq_len.is_multiple_of(2 * cp) || !x.len().is_multiple_of(seq_len) {
        return Err(EngineError::Invalid(format!(
            "context parallel: {} tokens in sequences of {seq_len} do not split into 2·cp = {} \
             chunks per sequence",
            x.len(),
            2 * cp
        )));
    }
    let positions = cp_positions(seq_len, cp, cp_index);
    Ok(x.chunks(seq_len)
        .flat_map(|s| positions.iter().map(move |&p| s[p]))
        .collect())
}

/// Row indices (for `permute`) of one micro-batch's exchange, built on the host.
struct CpIndex<B: Backend> {
    /// `[B·S]`: natural row `bi·S + s` ← row of the cp-gathered `[cp·T]`.
    natural_src: Tensor<B>,
    /// `[cp·T]`: gathered row ← natural row (the inverse, for the gradients).
    gathered_src: Tensor<B>,
    /// Per held chunk: `(g, prefix_src [B·P] into natural rows, q_pad_src
    /// [B·P] into [local T rows; a zero row], chunk_src [B·c] into [B·P])`.
    slots: Vec<Slot<B>>,
    /// `[T]`: local row ← row of [chunk 0's B·c rows; chunk 1's B·c rows].
    assemble_src: Tensor<B>,
    batch: usize,
    seq: usize,
}

struct Slot<B: Backend> {
    prefix: usize,
    prefix_src: Tensor<B>,
    q_pad_src: Tensor<B>,
    chunk_src: Tensor<B>,
}

impl<B: Backend> Slot<B> {
    /// The chunk's key prefix of `x` (`[B·S, Hkv·Hd]` in natural rows, K or
    /// V) as attention input `[B, P, Hkv, Hd]`; the forward and the
    /// backward both gather it (the backward again rather than keeping it).
    fn prefix(
        &self,
        b: &B,
        x: &Tensor<B>,
        batch: usize,
        hkv: usize,
        hd: usize,
    ) -> Result<Tensor<B>> {
        Ok(b.permute(x, &self.prefix_src)?
            .reshape(&[batch, self.prefix, hkv, hd])?)
    }
}

fn ids<B: Backend>(b: &B, v: Vec<usize>) -> Result<Tensor<B>> {
    let n = v.len();
    Ok(b.upload(
        HostData::I32(v.into_iter().map(|i| i as i32).collect()),
        &[n],
    )?)
}

impl<B: Backend> CpIndex<B> {
    fn new(b: &B, batch: usize, seq: usize, cp: usize, cp_index: usize) -> Result<Self> {
        let local = seq / cp;
        let chunk = seq / (2 * cp);
        let t = batch * local;
        let mut natural = vec![0; batch * seq];
        let mut gathered = vec![0; cp * t];
        for r in 0..cp {
            for (p, &s) in cp_positions(seq, cp, r).iter().enumerate() {
                for bi in 0..batch {
                    natural[bi * seq + s] = r * t + bi * local + p;
                    gathered[r * t + bi * local + p] = bi * seq + s;
                }
            }
        }
        let mut slots = Vec::with_capacity(2);
        for (j, &g) in cp_chunks(cp, cp_index).iter().enumerate() {
            let prefix = (g + 1) * chunk;
            let mut prefix_src = Vec::with_capacity(batch * prefix);
            let mut q_pad_src = Vec::with_capacity(batch * prefix);
            let mut chunk_src = Vec::with_capacity(batch * chunk);
            for bi in 0..batch {
                for s in 0..prefix {
                    prefix_src.push(bi * seq + s);
                    // Index t is the zero row appended after the local rows.
                    q_pad_src.push(if s < g * chunk {
                        t
                    } else {
                        bi * local + j * chunk + s - g * chunk
                    });
                }
                chunk_src.extend((g * chunk..prefix).map(|s| bi * prefix + s));
            }
            slots.push(Slot {
                prefix,
                prefix_src: ids(b, prefix_src)?,
                q_pad_src: ids(b, q_pad_src)?,
                chunk_src: ids(b, chunk_src)?,
            });
        }
        let mut assemble = vec![0; t];
        for j in 0..2 {
            for bi in 0..batch {
                for u in 0..chunk {
                    assemble[bi * local + j * chunk + u] = j * batch * chunk + bi * chunk + u;
                }
            }
        }
        Ok(CpIndex {
            natural_src: ids(b, natural)?,
            gathered_src: ids(b, gathered)?,
            slots,
            assemble_src: ids(b, assemble)?,
            batch,
            seq,
        })
    }
}

/// One micro-batch's cp exchange: the row maps, and the documents of the
/// whole sequences and of each held chunk's key prefix. Built by a forward,
/// kept for its backward; the attention core of GQA and MLA alike.
pub(crate) struct CpExchange<B: Backend> {
    index: CpIndex<B>,
    /// The micro-batch's documents (natural order) and each held chunk's
    /// prefix of them (not counted: a few ints per token).
    docs: Option<(DocTensors<B>, Vec<DocTensors<B>>)>,
}

impl<B: Backend> CpExchange<B> {
    /// The exchange of this rank's `t` tokens (whole sequences of
    /// `seq_len` / cp), with the forward's documents (`ctx.docs`).
    pub(crate) fn new(
        ctx: &Exec<B>,
        groups: &LayerGroups,
        t: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let b = ctx.b;
        let (cp, cp_i) = (groups.cp.size(), groups.cp_index);
        let local = seq_len / cp.max(1);
        if !seq_len.is_multiple_of(2 * cp) || local == 0 || !t.is_multiple_of(local) {
            return Err(EngineError::Invalid(format!(
                "cp attention: {t} tokens are not whole sequences of {seq_len} / cp = {local}"
            )));
        }
        let index = CpIndex::new(b, t / local, seq_len, cp, cp_i)?;
        let docs = ctx
            .docs
            .map(|d| {
                let prefixes = index
                    .slots
                    .iter()
                    .map(|s| d.prefix(b, s.prefix))
                    .collect::<Result<Vec<_>>>()?;
                Ok::<_, EngineError>((d.clone(), prefixes))
            })
            .transpose()?;
        Ok(CpExchange { index, docs })
    }

    /// Sequences of the micro-batch.
    pub(crate) fn batch(&self) -> usize {
        self.index.batch
    }

    /// The sequence length.
    pub(crate) fn seq(&self) -> usize {
        self.index.seq
    }

    /// The whole sequences' documents, if any.
    pub(crate) fn whole_docs(&self) -> Option<&DocTensors<B>> {
        self.docs.as_ref().map(|(d, _)| d)
    }

    /// Held chunk `i`'s key prefix of the documents, if any.
    pub(crate) fn chunk_docs(&self, i: usize) -> Option<&DocTensors<B>> {
        self.docs.as_ref().map(|(_, p)| &p[i])
    }

    /// Every cp rank's rows `[T, W]` of the micro-batch, in natural order
    /// `[B·S, W]` (an all-gather over cp).
    pub(crate) fn natural(
        &self,
        ctx: &Exec<B>,
        groups: &LayerGroups,
        x: &Tensor<B>,
    ) -> Result<Tensor<B>> {
        let all = ctx.comm.all_gather(ctx.b, &groups.cp, x)?;
        Ok(ctx.b.permute(&all, &self.index.natural_src)?)
    }

    /// The backward of [`Self::natural`]: every rank's gradient of the
    /// natural rows summed, this rank's rows `[T, W]` kept (a
    /// reduce-scatter over cp).
    pub(crate) fn owned(
        &self,
        ctx: &Exec<B>,
        groups: &LayerGroups,
        d: &Tensor<B>,
    ) -> Result<Tensor<B>> {
        let gathered = ctx.b.permute(d, &self.index.gathered_src)?;
        Ok(ctx.comm.reduce_scatter(ctx.b, &groups.cp, &gathered)?)
    }

    /// Attention of this rank's queries over the whole sequence's keys. For
    /// each held chunk `i`, `queries(i, rows)` makes the kernel's queries
    /// `[B, P, Hq, Hd]` from this rank's query rows `q: [T, W]` placed in the
    /// chunk's padded prefix (`rows: [B·P, W]`, zero rows in the padding);
    /// `k, v: [B·S, Hk·Hd]` in natural order. Returns this rank's output
    /// rows `[T, Hq·Hd]` and each chunk's log-sum-exp.
    pub(crate) fn attend(
        &self,
        b: &B,
        q_td: &Tensor<B>,
        queries: &dyn Fn(usize, Tensor<B>) -> Result<Tensor<B>>,
        k_nat: &Tensor<B>,
        v_nat: &Tensor<B>,
        hk: usize,
    ) -> Result<(Tensor<B>, Vec<Tensor<B>>)> {
        let batch = self.index.batch;
        let q_src = with_zero_row(b, q_td)?;
        let (mut chunks, mut lses) = (Vec::with_capacity(2), Vec::with_capacity(2));
        for (i, s) in self.index.slots.iter().enumerate() {
            let q_pad = queries(i, b.permute(&q_src, &s.q_pad_src)?)?;
            let (_, p, hq, hd) = q_pad.dims4("cp attention")?;
            let k = s.prefix(b, k_nat, batch, hk, hd)?;
            let v = s.prefix(b, v_nat, batch, hk, hd)?;
            let mask = self.chunk_docs(i).and_then(|d| d.docs.as_ref());
            let (o_pad, lse) = b.attention(&q_pad, &k, &v, mask)?;
            chunks.push(b.permute(&o_pad.reshape(&[batch * p, hq * hd])?, &s.chunk_src)?);
            lses.push(lse);
        }
        Ok((self.assemble(b, &chunks)?, lses))
    }

    /// The backward of [`Self::attend`] from this rank's output gradient
    /// `do: [T, Hq·Hd]`, with the forward's `q` rows, output rows `o` and
    /// log-sum-exps; `queries_backward(i, dq)` takes chunk `i`'s gradient of
    /// the kernel's queries back to padded rows `[B·P, W]`. The padded
    /// queries are made again and the padded outputs rebuilt from `o` (zero
    /// in the padding, whose zero output gradient makes its outputs
    /// irrelevant). `value_width`: values zero past it (MLA's padding).
    /// Returns this rank's `dq: [T, W]` and the natural-order `dk, dv`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend_backward(
        &self,
        b: &B,
        (q_td, o_td, do_td): (&Tensor<B>, &Tensor<B>, &Tensor<B>),
        lses: Vec<Tensor<B>>,
        queries: &dyn Fn(usize, Tensor<B>) -> Result<Tensor<B>>,
        queries_backward: &dyn Fn(usize, Tensor<B>) -> Result<Tensor<B>>,
        (k_nat, v_nat): (&Tensor<B>, &Tensor<B>),
        hk: usize,
        value_width: Option<usize>,
    ) -> Result<(Tensor<B>, Tensor<B>, Tensor<B>)> {
        let (batch, rows) = (self.index.batch, self.index.batch * self.index.seq);
        if lses.len() != self.index.slots.len() {
            return Err(EngineError::Invalid(format!(
                "cp attention backward: {} log-sum-exps kept for {} held chunks",
                lses.len(),
                self.index.slots.len()
            )));
        }
        let (q_src, o_src, do_src) = (
            with_zero_row(b, q_td)?,
            with_zero_row(b, o_td)?,
            with_zero_row(b, do_td)?,
        );
        let width = k_nat.shape()[1];
        let mut dk_nat = b.zeros(&[rows, width], k_nat.dtype())?;
        let mut dv_nat = b.zeros(&[rows, width], v_nat.dtype())?;
        let mut dq_chunks = Vec::with_capacity(2);
        for (i, (s, lse)) in self.index.slots.iter().zip(lses).enumerate() {
            let q_pad = queries(i, b.permute(&q_src, &s.q_pad_src)?)?;
            let (_, p, hq, hd) = q_pad.dims4("cp attention backward")?;
            let pad = |src: &Tensor<B>| -> Result<Tensor<B>> {
                Ok(b.permute(src, &s.q_pad_src)?.reshape(&[batch, p, hq, hd])?)
            };
            let (o_pad, do_pad) = (pad(&o_src)?, pad(&do_src)?);
            let k = s.prefix(b, k_nat, batch, hk, hd)?;
            let v = s.prefix(b, v_nat, batch, hk, hd)?;
            let mask = self.chunk_docs(i).and_then(|d| d.docs.as_ref());
            let (dq_pad, dk, dv) = match value_width {
                None => b.attention_backward(&do_pad, &q_pad, &k, &v, &o_pad, &lse, mask)?,
                Some(w) => b.attention_backward_padded_values(
                    &do_pad, &q_pad, &k, &v, &o_pad, &lse, mask, w,
                )?,
            };
            dq_chunks.push(b.permute(&queries_backward(i, dq_pad)?, &s.chunk_src)?);
            let scatter = |d: Tensor<B>| -> Result<Tensor<B>> {
                Ok(b.permute_backward(&d.reshape(&[batch * p, width])?, &s.prefix_src, rows)?)
            };
            b.axpy(&mut dk_nat, 1.0, &scatter(dk)?)?;
            b.axpy(&mut dv_nat, 1.0, &scatter(dv)?)?;
        }
        Ok((self.assemble(b, &dq_chunks)?, dk_nat, dv_nat))
    }

    /// This rank's rows `[T, W]` from its two held chunks' rows.
    fn assemble(&self, b: &B, chunks: &[Tensor<B>]) -> Result<Tensor<B>> {
        Ok(b.permute(
            &b.concat(&[&chunks[0], &chunks[1]])?,
            &self.index.assemble_src,
        )?)
    }

    /// Lists the int32 row maps under `slot`.
    pub(crate) fn visit_saved(&mut self, slot: Slot_, f: &mut dyn FnMut(Slot_, &mut Tensor<B>)) {
        f(slot, &mut self.index.natural_src);
        f(slot, &mut self.index.gathered_src);
        f(slot, &mut self.index.assemble_src);
    }
}

/// What [`backward`] needs from [`forward`].
pub struct CpAttentionSaved<B: Backend> {
    /// The projections' input (under fp8 its column tiles).
    x: LinearSaved<B>,
    /// This rank's queries, keys and values `[T, H·Hd]`, before the
    /// rotation: the backward pads the queries and gathers the keys and
    /// values again.
    q_td: Tensor<B>,
    k_td: Tensor<B>,
    v_td: Tensor<B>,
    /// Per held chunk: its padded queries' log-sum-exp `[B, Hq, P]`.
    lse: Vec<Tensor<B>>,
    o_td: Tensor<B>,
    exchange: CpExchange<B>,
}

impl<B: Backend> CpAttentionSaved<B> {
    /// Lists the saved tensors with the slots of the plain attention's:
    /// the input, this rank's q, k and v (`qkv`), each held chunk's
    /// log-sum-exp (`core_attn`), the output (`attn_proj`), and the int32
    /// row maps.
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot_, &mut Tensor<B>)) {
        let qkv = Slot_::kept(Part::Attention).offload(OffloadPart::Qkv);
        let out = Slot_::kept(Part::Attention).offload(OffloadPart::AttnProj);
        let core = Slot_::kept(Part::Attention)
            .recompute(RecomputePart::CoreAttn)
            .offload(OffloadPart::CoreAttn);
        self.x.visit(Slot_::NORM_OUT, f);
        f(qkv, &mut self.q_td);
        f(qkv, &mut self.k_td);
        f(qkv, &mut self.v_td);
        for lse in &mut self.lse {
            f(core, lse);
        }
        f(out, &mut self.o_td);
        self.exchange.visit_saved(Slot_::kept(Part::Attention), f);
    }

    /// The kept input (the block swaps in the rank's sequence shard).
    pub(crate) fn input_mut(&mut self) -> &mut LinearSaved<B> {
        &mut self.x
    }
}

/// Rows of `x` with a zero row appended (the padding source of `permute`).
fn with_zero_row<B: Backend>(b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
    let zero = b.zeros(&[1, x.shape()[1]], x.dtype())?;
    Ok(b.concat(&[x, &zero])?)
}

/// `x: [T, D]` (this rank's tokens of `T / (S/cp)` sequences of `seq_len` S)
/// → `[T, D]`: `attn`'s projections on the rank's tokens, the core attention
/// over the whole sequence's keys.
pub fn forward<B: Backend>(
    ctx: &Exec<B>,
    groups: &LayerGroups,
    attn: &Attention<B>,
    x_td: &Tensor<B>,
    seq_len: usize,
) -> Result<(Tensor<B>, CpAttentionSaved<B>)> {
    let b = ctx.b;
    let (t, _) = x_td.dims2("cp attention")?;
    let exchange = CpExchange::new(ctx, groups, t, seq_len)?;
    let (hq, hkv, hd) = (attn.heads(), attn.kv_heads(), attn.head_dim());
    let input = attn.input(x_td);
    let q_td = input.project(b, &attn.wq.value)?;
    let k_td = input.project(b, &attn.wk.value)?;
    let v_td = input.project(b, &attn.wv.value)?;
    let (k_rot, v_nat) = gqa_keys_values(ctx, groups, &exchange, attn, &k_td, &v_td)?;
    let (o_td, lse) = {
        let queries = gqa_queries(b, &exchange, attn, hq, hd);
        exchange.attend(b, &q_td, &queries, &k_rot, &v_nat, hkv)?
    };
    let y_td = LinearInput::new(&o_td, attn.fp8()).project(b, &attn.wo.value)?;
    Ok((
        y_td,
        CpAttentionSaved {
            x: input.into_saved(b)?,
            q_td,
            k_td,
            v_td,
            lse,
            o_td,
            exchange,
        },
    ))
}

/// The whole micro-batch's rotated keys and its values, natural order
/// `[B·S, Hkv·Hd]`, from every cp rank's `k, v: [T, Hkv·Hd]` (the forward
/// and, again, the backward).
fn gqa_keys_values<B: Backend>(
    ctx: &Exec<B>,
    groups: &LayerGroups,
    exchange: &CpExchange<B>,
    attn: &Attention<B>,
    k_td: &Tensor<B>,
    v_td: &Tensor<B>,
) -> Result<(Tensor<B>, Tensor<B>)> {
    let b = ctx.b;
    let (batch, seq) = (exchange.batch(), exchange.seq());
    let (hkv, hd) = (attn.kv_heads(), attn.head_dim());
    let positions = exchange.whole_docs().and_then(|d| d.positions.as_ref());
    let k_rot = b
        .rope(
            &exchange
                .natural(ctx, groups, k_td)?
                .reshape(&[batch, seq, hkv, hd])?,
            attn.rope(),
            false,
            positions,
        )?
        .reshape(&[batch * seq, hkv * hd])?;
    Ok((k_rot, exchange.natural(ctx, groups, v_td)?))
}

/// GQA's kernel queries of a held chunk: its padded query rows rotated at
/// the prefix's positions.
fn gqa_queries<'a, B: Backend>(
    b: &'a B,
    exchange: &'a CpExchange<B>,
    attn: &'a Attention<B>,
    hq: usize,
    hd: usize,
) -> impl Fn(usize, Tensor<B>) -> Result<Tensor<B>> + 'a {
    move |i, rows: Tensor<B>| {
        let p = rows.shape()[0] / exchange.batch();
        let positions = exchange.chunk_docs(i).and_then(|d| d.positions.as_ref());
        Ok(b.rope(
            &rows.reshape(&[exchange.batch(), p, hq, hd])?,
            attn.rope(),
            false,
            positions,
        )?)
    }
}

/// Accumulates `attn`'s projection gradients and returns `dx: [T, D]`; the
/// key and value gradients of every rank's queries are reduce-scattered
/// back to the ranks that hold those tokens.
pub fn backward<B: Backend>(
    ctx: &Exec<B>,
    groups: &LayerGroups,
    attn: &mut Attention<B>,
    dy_td: &Tensor<B>,
    saved: CpAttentionSaved<B>,
) -> Result<Tensor<B>> {
    let b = ctx.b;
    let CpAttentionSaved {
        x,
        q_td,
        k_td,
        v_td,
        lse,
        o_td,
        exchange,
    } = saved;
    let (batch, seq) = (exchange.batch(), exchange.seq());
    let (hq, hkv, hd, rope) = (attn.heads(), attn.kv_heads(), attn.head_dim(), attn.rope());
    let do_td = LinearInput::new(&o_td, attn.fp8()).backward(b, &mut attn.wo, dy_td)?;
    // The forward's keys and values again.
    let (k_rot, v_nat) = gqa_keys_values(ctx, groups, &exchange, attn, &k_td, &v_td)?;
    let (dq_td, dk_rot, dv_nat) = {
        let queries = gqa_queries(b, &exchange, attn, hq, hd);
        // The rotation's backward is its transpose: it rotates back.
        let queries_backward = |i: usize, dq_pad: Tensor<B>| -> Result<Tensor<B>> {
            let positions = exchange.chunk_docs(i).and_then(|d| d.positions.as_ref());
            let p = dq_pad.shape()[1];
            Ok(b.rope(&dq_pad, rope, true, positions)?
                .reshape(&[batch * p, hq * hd])?)
        };
        exchange.attend_backward(
            b,
            (&q_td, &o_td, &do_td),
            lse,
            &queries,
            &queries_backward,
            (&k_rot, &v_nat),
            hkv,
            None,
        )?
    };
    let whole_positions = exchange.whole_docs().and_then(|d| d.positions.as_ref());
    let dk_nat = b
        .rope(
            &dk_rot.reshape(&[batch, seq, hkv, hd])?,
            rope,
            true,
            whole_positions,
        )?
        .reshape(&[batch * seq, hkv * hd])?;
    let dk_td = exchange.owned(ctx, groups, &dk_nat)?;
    let dv_td = exchange.owned(ctx, groups, &dv_nat)?;
    let input = LinearInput::from_saved(x, attn.fp8())?;
    let mut dx_td = project_backward(b, &mut attn.wq, &input, dq_td)?;
    b.axpy(
        &mut dx_td,
        1.0,
        &project_backward(b, &mut attn.wk, &input, dk_td)?,
    )?;
    b.axpy(
        &mut dx_td,
        1.0,
        &project_backward(b, &mut attn.wv, &input, dv_td)?,
    )?;
    Ok(dx_td)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::DType;

    use super::split_sequences;
    use crate::engine::attention::Attention;
    use crate::engine::parallel::run_local_layout;
    use crate::engine::param::{Module, Param};
    use crate::engine::testutil::{f64_tensor, relative_distance, small_spec, uniform, values};
    use crate::layout::{self, LayoutSpec};
    use crate::spec::{FfnSpec, GemmPrecision};

    #[test]
    fn split_keeps_chunks_i_and_mirror() {
        let x: Vec<i32> = (0..16).collect();
        assert_eq!(
            split_sequences(&x, 8, 2, 0).unwrap(),
            [0, 1, 6, 7, 8, 9, 14, 15]
        );
        assert_eq!(
            split_sequences(&x, 8, 2, 1).unwrap(),
            [2, 3, 4, 5, 10, 11, 12, 13]
        );
        assert_eq!(split_sequences(&x, 8, 1, 0).unwrap(), x);
        let err = split_sequences(&x, 6, 2, 0).unwrap_err();
        assert!(err.to_string().contains("2·cp = 4"), "{err}");
    }

    fn grads(a: &Attention<Cpu>) -> Vec<Vec<f64>> {
        let mut g = Vec::new();
        a.visit_params(&mut |p: &Param<Cpu>| g.push(values(&p.grad)));
        g
    }

    /// The cp attention of every rank's tokens equals the one-rank attention
    /// of the whole sequences: outputs, input gradients and (summed over the
    /// ranks) weight gradients, in f64 — for chunks of 2 and of 1 token.
    #[test]
    fn cp_attention_equals_one_rank() {
        check_cp_attention(false);
    }

    /// With fp8 projections the rows quantise alone, so outputs and input
    /// gradients still equal the one-rank layer's (within the f32 products
    /// of the emulation); the weight gradients' column tiles span a rank's
    /// tokens, so they track the one-rank ones as one fp8 product does.
    #[test]
    fn cp_fp8_attention_equals_one_rank() {
        check_cp_attention(true);
    }

    fn check_cp_attention(fp8: bool) {
        let b = Cpu;
        let mut spec = small_spec(&[FfnSpec::Dense { ffn: 4 }], false);
        let (batch, seq, d) = (2, 8, spec.hidden);
        spec.seq_len = seq;
        if fp8 {
            spec.groups[0].attention.precision = GemmPrecision::Fp8Blockwise;
        }
        let attn_spec = spec.groups[0].attention.clone();
        // Exact in f64; the fp8 emulation's products run in f32.
        let tol = if fp8 { 1e-5 } else { 1e-12 };
        let t = batch * seq;
        let x = uniform(1, t * d, 1.0);
        let r = uniform(2, t * d, 1.0);
        let mut reference = Attention::new(
            &b,
            "attn",
            &spec,
            &attn_spec,
            crate::engine::Init::full(7),
            DType::F64,
        )
        .unwrap();
        let (y_ref, saved) = reference
            .forward(&b, &f64_tensor(x.clone(), &[t, d]), seq, None)
            .unwrap();
        let dx_ref = values(
            &reference
                .backward(&b, &f64_tensor(r.clone(), &[t, d]), saved)
                .unwrap(),
        );
        let (y_ref, g_ref) = (values(&y_ref), grads(&reference));
        for cp in [2, 4] {
            let text = format!("world={cp},cp={cp}");
            let l = layout::check(&LayoutSpec::parse(&text).unwrap(), &spec).unwrap();
            let results = run_local_layout(&b, &l, Duration::from_secs(30), |ctx| {
                let rows: Vec<usize> = (0..t).collect();
                let mine = split_sequences(&rows, seq, cp, ctx.rank.cp_index)?;
                let take = |v: &[f64]| -> Vec<f64> {
                    mine.iter()
                        .flat_map(|&i| v[i * d..(i + 1) * d].to_vec())
                        .collect()
                };
                let n = mine.len();
                let mut attn = Attention::new(
                    ctx.b,
                    "attn",
                    &spec,
                    &attn_spec,
                    crate::engine::Init::full(7),
                    DType::F64,
                )?;
                let (exec, groups) = (ctx.exec(), ctx.rank.layer_groups());
                let x_td = f64_tensor(take(&x), &[n, d]);
                let (y, saved) = super::forward(&exec, &groups, &attn, &x_td, seq)?;
                let r_td = f64_tensor(take(&r), &[n, d]);
                let dx = super::backward(&exec, &groups, &mut attn, &r_td, saved)?;
                Ok((mine, values(&y), values(&dx), grads(&attn)))
            });
            let mut g_sum: Vec<Vec<f64>> = g_ref.iter().map(|g| vec![0.0; g.len()]).collect();
            for res in results {
                let (mine, y, dx, g) = res.unwrap();
                for (k, &i) in mine.iter().enumerate() {
                    for c in 0..d {
                        let (at, want) = (k * d + c, i * d + c);
                        assert!((y[at] - y_ref[want]).abs() < tol, "cp{cp} y row {i}");
                        assert!((dx[at] - dx_ref[want]).abs() < tol, "cp{cp} dx row {i}");
                    }
                }
                for (s, g) in g_sum.iter_mut().zip(g) {
                    for (a, v) in s.iter_mut().zip(g) {
                        *a += v;
                    }
                }
            }
            for (p, (s, want)) in g_sum.iter().zip(&g_ref).enumerate() {
                if fp8 {
                    let d = relative_distance(s, want);
                    assert!(d < 0.08, "cp{cp} fp8 weight {p}: relative distance {d:e}");
                    continue;
                }
                for (a, w) in s.iter().zip(want) {
                    assert!((a - w).abs() < 1e-12, "cp{cp} weight {p}: {a} vs {w}");
                }
            }
        }
    }
}
