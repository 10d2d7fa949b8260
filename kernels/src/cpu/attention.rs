//! CPU causal attention with grouped-query heads, flash-attention style.
//!
//! Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads,
//! Hd head dim, G = Hq / Hkv query heads per kv head, R the rows of a query
//! block, W the keys it sees.
//!
//! Work goes by query blocks of R rows: a block sees keys `lo..i1` (`lo` its
//! first query's document start, `i1` its end), so its scores are one
//! `[R, W]` tile, computed by one GEMM (`Q Kᵀ`), masked to each row's
//! visible keys, soft-maxed in place, and multiplied by `V` in a second GEMM;
//! `lse = m + ln l` is kept for the backward. The tile bounds the scratch by
//! `R · S` per task instead of `S²` per head.
//!
//! The backward owns one kv head per task: for each of its G query heads and
//! query blocks it recomputes `P` from `lse`, takes `dP = dO Vᵀ`, `dS = P ⊙
//! (dP − D)` (D = Σ_j P_j dP_j, which is `dO · O`) and adds `dSᵀ Q`, `Pᵀ dO` to the
//! head's `dK`, `dV`, writing `dS K` as the block's `dQ` — five GEMMs per
//! block. Each output element is written by one task in a fixed order, so
//! results are deterministic without atomics, whatever the thread count.
//!
//! Inputs are first copied to head-major `[B, H, S, Hd]` so every GEMM reads
//! contiguous rows.

use rayon::prelude::*;

use super::elementwise::{dot, lane_max, lane_sum};
use super::linalg::{gemm_acc_into, gemm_into, MatRef};
use super::{pool, simd, Cpu, Float, FloatStorage};
use crate::backend::AttentionOps;
use crate::cpu_float_dispatch;
use crate::error::Result;
use crate::tensor::Tensor;
use gemm::Parallelism;

/// Query rows per block: the `[64, W]` score tile of a block and its K and V
/// rows stay in L2 while the block's GEMMs run.
pub(crate) const ATTN_BLOCK: usize = 64;

#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
}

impl Dims {
    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

fn check_qkv(op: &'static str, q: &Tensor<Cpu>, k: &Tensor<Cpu>, v: &Tensor<Cpu>) -> Result<Dims> {
    let (b, s, hq, hkv, hd) = crate::backend::check_qkv(op, q, k, v)?;
    Ok(Dims { b, s, hq, hkv, hd })
}

/// Rows `i0..` of head `h` of sequence `bi` in a `[B, S, H, Hd]` operand,
/// in place (row stride `H·Hd`; read transposed when `trans`): the GEMMs pack
/// their operands anyway, so a head-major copy of the inputs would only add a
/// pass over them.
fn head_rows<T>(
    x: &[T],
    (s, heads, hd): (usize, usize, usize),
    (bi, h): (usize, usize),
    i0: usize,
    trans: bool,
) -> MatRef<'_, T> {
    let rs = heads * hd;
    let data = &x[((bi * s + i0) * heads + h) * hd..];
    if trans {
        MatRef::strided(data, 1, rs)
    } else {
        MatRef::strided(data, rs, 1)
    }
}

/// `[B, H, S, Hd]` → `[B, S, H, Hd]`.
fn from_head_major<T: FloatStorage>(x: &[T], s: usize, h: usize, hd: usize) -> Vec<T> {
    let mut out = pool::take::<T>(x.len());
    if x.is_empty() {
        return out;
    }
    out.par_chunks_mut(h * hd)
        .enumerate()
        .for_each(|(bs, dst)| {
            let (bi, si) = (bs / s, bs % s);
            for (hi, d) in dst.chunks_mut(hd).enumerate() {
                let src = ((bi * h + hi) * s + si) * hd;
                d.copy_from_slice(&x[src..src + hd]);
            }
        });
    out
}

/// The visible keys of each query: `first[i]..=i`, `first[i]` the first
/// token of query `i`'s document (0 for every query without documents).
/// Shapes: `[B·S]`.
struct Spans {
    first: Vec<usize>,
}

impl Spans {
    /// Spans of `docs: [B, S]` (checked nondecreasing along each sequence),
    /// or the causal ones.
    fn new(
        op: &'static str,
        q: &Tensor<Cpu>,
        docs: Option<&Tensor<Cpu>>,
        b: usize,
        s: usize,
    ) -> Result<Self> {
        crate::backend::check_docs(op, q, docs)?;
        let Some(docs) = docs else {
            return Ok(Spans {
                first: vec![0; b * s],
            });
        };
        let ids = super::index_slice(docs, op)?;
        let mut first = vec![0; b * s];
        for (bi, seq) in ids.chunks(s.max(1)).enumerate() {
            if let Some(w) = seq.windows(2).position(|w| w[1] < w[0]) {
                return Err(crate::error::arg_err(
                    op,
                    format!(
                        "document ids must not decrease along a sequence: sequence {bi} has {} \
                         then {} at position {}",
                        seq[w],
                        seq[w + 1],
                        w + 1
                    ),
                ));
            }
            let mut start = 0;
            for i in 0..seq.len() {
                if seq[i] != seq[start] {
                    start = i;
                }
                first[bi * s + i] = start;
            }
        }
        Ok(Spans { first })
    }
}

/// The keys query block `i0..i1` sees: `lo..i1`, `lo` the first query's
/// document start (document ids do not decrease, so no later query of the
/// block sees an earlier key).
fn key_range(first: &[usize], i0: usize, i1: usize) -> (usize, usize) {
    (first[i0], i1)
}

/// `p_RW = softmax(scale · s_RW)` over each row's visible keys (row `r` is
/// query `i0 + r`, column `c` key `lo + c`: visible from `first[i0 + r]` to
/// the query itself), masked entries 0; returns nothing but writes each
/// row's log-sum-exp of the scaled scores to `lse`.
fn softmax_rows<T: Float>(
    s_rw: &mut [T],
    w: usize,
    first: &[usize],
    (i0, lo): (usize, usize),
    scale: T,
    lse: &mut [T],
) {
    let rows = s_rw.chunks_mut(w).zip(lse.iter_mut()).enumerate();
    simd(
        #[inline(always)]
        || {
            for (r, (row, lse_r)) in rows {
                let qi = i0 + r;
                let (a, e) = (first[qi] - lo, qi + 1 - lo);
                // Separate maps and lane reductions, so that each loop vectorises.
                row[a..e].iter_mut().for_each(|x| *x *= scale);
                let mx = lane_max(&row[a..e]);
                row[a..e].iter_mut().for_each(|x| *x = (*x - mx).exp());
                let sum = lane_sum(&row[a..e]);
                let inv = T::ONE / sum;
                row[a..e].iter_mut().for_each(|x| *x *= inv);
                row[..a].fill(T::ZERO);
                row[e..].fill(T::ZERO);
                *lse_r = mx + sum.ln();
            }
        },
    )
}

/// The `[B, S, H, Hd]` inputs of the forward and the head a task works on.
struct FwdHead<'a, T> {
    d: Dims,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    /// Sequence `bi`, query head `h` (of the sequence's `Hq`).
    bi: usize,
    h: usize,
}

/// Forward for one head's query block starting at row `i0`: `o` holds the
/// block's rows (`[rows, Hd]`), `lse` its log-sum-exps; `first` is the
/// sequence's [`Spans::first`].
fn forward_block<T: FloatStorage>(
    x: &FwdHead<'_, T>,
    first: &[usize],
    i0: usize,
    o: &mut [T],
    lse: &mut [T],
    scale: T,
) {
    let Dims { s, hq, hkv, hd, .. } = x.d;
    let kvh = (x.bi, x.h / x.d.group());
    let rows = lse.len();
    let i1 = i0 + rows;
    let (lo, hi) = key_range(first, i0, i1);
    let w = hi - lo;
    let mut s_rw = vec![T::ZERO; rows * w];
    gemm_into(
        &mut s_rw,
        (rows, w, hd),
        head_rows(x.q, (s, hq, hd), (x.bi, x.h), i0, false),
        head_rows(x.k, (s, hkv, hd), kvh, lo, true),
        Parallelism::None,
    );
    softmax_rows(&mut s_rw, w, first, (i0, lo), scale, lse);
    gemm_into(
        o,
        (rows, hd, w),
        MatRef::row_major(&s_rw, w, false),
        head_rows(x.v, (s, hkv, hd), kvh, lo, false),
        Parallelism::None,
    );
}

fn attention_t<T: FloatStorage>(
    q: &Tensor<Cpu>,
    k: &Tensor<Cpu>,
    v: &Tensor<Cpu>,
    docs: Option<&Tensor<Cpu>>,
    block: usize,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    const OP: &str = "attention";
    let d = check_qkv(OP, q, k, v)?;
    let Dims { b, s, hq, hd, .. } = d;
    let spans = Spans::new(OP, q, docs, b, s)?;
    let block = block.max(1);
    let (qs, ks, vs) = (T::slice(q, OP)?, T::slice(k, OP)?, T::slice(v, OP)?);
    // The output head-major, each task writing its head's rows; one copy
    // back to `[B, S, Hq, Hd]` at the end.
    let mut oh = pool::take::<T>(qs.len());
    let mut lse = pool::take::<T>(b * hq * s);
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    if !qs.is_empty() {
        oh.par_chunks_mut(s * hd)
            .zip(lse.par_chunks_mut(s))
            .enumerate()
            .for_each(|(bh, (o_head, lse_head))| {
                let (bi, h) = (bh / hq, bh % hq);
                let x = FwdHead {
                    d,
                    q: qs,
                    k: ks,
                    v: vs,
                    bi,
                    h,
                };
                let first = &spans.first[bi * s..][..s];
                o_head
                    .par_chunks_mut(block * hd)
                    .zip(lse_head.par_chunks_mut(block))
                    .enumerate()
                    .for_each(|(ib, (ob, lb))| forward_block(&x, first, ib * block, ob, lb, scale));
            });
    }
    let o = from_head_major(&oh, s, hq, hd);
    // lse stays in the accumulation type (f32 for bf16), as on CUDA.
    let lse: Vec<T::Acc> = lse.into_iter().map(T::to_acc).collect();
    Ok((T::tensor(o, q.shape())?, T::Acc::tensor(lse, &[b, hq, s])?))
}

/// Read-only `[B, S, H, Hd]` operands of the backward.
struct BwdInputs<'a, T> {
    d: Dims,
    block: usize,
    scale: T,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    d_o: &'a [T],
    /// `[B, Hq, S]` log-sum-exps from the forward.
    lse: &'a [T],
    /// The visible keys of each query and queries of each key.
    spans: &'a Spans,
}

impl<T: FloatStorage> BwdInputs<'_, T> {
    /// Rows `i0..` of query head `h` of sequence `bi` (of `q` or `d_o`).
    fn q_rows<'s>(&self, x: &'s [T], (bi, h): (usize, usize), i0: usize) -> MatRef<'s, T> {
        head_rows(x, (self.d.s, self.d.hq, self.d.hd), (bi, h), i0, false)
    }

    /// Rows `i0..` of kv head `h` of sequence `bi` (of `k` or `v`), read
    /// transposed when `trans`.
    fn kv_rows<'s>(
        &self,
        x: &'s [T],
        (bi, h): (usize, usize),
        i0: usize,
        trans: bool,
    ) -> MatRef<'s, T> {
        head_rows(x, (self.d.s, self.d.hkv, self.d.hd), (bi, h), i0, trans)
    }

    /// Global kv head `kvh`'s `dk`, `dv` (`[S, Hd]` each, accumulated) and
    /// its G query heads' `dq` (`[G, S, Hd]`, written), query block after
    /// query block of each query head in order.
    fn kv_head(&self, kvh: usize, dq: &mut [T], dk: &mut [T], dv: &mut [T]) {
        let (s, hd, hkv, g) = (self.d.s, self.d.hd, self.d.hkv, self.d.group());
        let (bi, hk) = (kvh / hkv, kvh % hkv);
        let first = &self.spans.first[bi * s..][..s];
        let block = self.block;
        let mut p_rw = Vec::new();
        let mut ds_rw = Vec::new();
        for x in 0..g {
            let qh = bi * self.d.hq + hk * g + x;
            let dq_head = &mut dq[x * s * hd..][..s * hd];
            for i0 in (0..s).step_by(block) {
                let i1 = (i0 + block).min(s);
                let rows = i1 - i0;
                let (lo, hi) = key_range(first, i0, i1);
                let w = hi - lo;
                let hqs = (bi, hk * g + x);
                let (q_r, do_r) = (self.q_rows(self.q, hqs, i0), self.q_rows(self.d_o, hqs, i0));
                let k_w = |trans| self.kv_rows(self.k, (bi, hk), lo, trans);
                p_rw.resize(rows * w, T::ZERO);
                ds_rw.resize(rows * w, T::ZERO);
                // P from lse; dP = dO Vᵀ.
                gemm_into(&mut p_rw, (rows, w, hd), q_r, k_w(true), Parallelism::None);
                gemm_into(
                    &mut ds_rw,
                    (rows, w, hd),
                    do_r,
                    self.kv_rows(self.v, (bi, hk), lo, true),
                    Parallelism::None,
                );
                let stats = qh * s + i0;
                simd(
                    #[inline(always)]
                    || {
                        for r in 0..rows {
                            let qi = i0 + r;
                            let (a, e) = (first[qi] - lo, qi + 1 - lo);
                            let lse = self.lse[stats + r];
                            let p_row = &mut p_rw[r * w..][..w];
                            let ds_row = &mut ds_rw[r * w..][..w];
                            // The softmax backward's row term D = Σ_j P_j dP_j (=
                            // dO·O), from the tile's own P and dP.
                            // (A map, then a lane dot: both loops vectorise.)
                            for p in &mut p_row[a..e] {
                                *p = (*p * self.scale - lse).exp();
                            }
                            let delta = dot(&p_row[a..e], &ds_row[a..e]);
                            for (&p, ds) in p_row[a..e].iter().zip(&mut ds_row[a..e]) {
                                // dS scaled once here: dQ and dK both carry the scale.
                                *ds = p * (*ds - delta) * self.scale;
                            }
                            if e - a == 1 {
                                // A softmax over one key is constant: its dS is 0,
                                // not the rounding left by a P that is 1 ± ulp.
                                ds_row[a] = T::ZERO;
                            }
                            for row in [p_row, ds_row] {
                                row[..a].fill(T::ZERO);
                                row[e..].fill(T::ZERO);
                            }
                        }
                    },
                );
                // dQ = dS K (this block's rows, written once).
                gemm_into(
                    &mut dq_head[i0 * hd..i1 * hd],
                    (rows, hd, w),
                    MatRef::row_major(&ds_rw, w, false),
                    k_w(false),
                    Parallelism::None,
                );
                // dK += dSᵀ Q, dV += Pᵀ dO over the block's keys.
                gemm_acc_into(
                    &mut dk[lo * hd..hi * hd],
                    (w, hd, rows),
                    MatRef::strided(&ds_rw, 1, w),
                    q_r,
                    Parallelism::None,
                );
                gemm_acc_into(
                    &mut dv[lo * hd..hi * hd],
                    (w, hd, rows),
                    MatRef::strided(&p_rw, 1, w),
                    do_r,
                    Parallelism::None,
                );
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_backward_t<T: FloatStorage>(
    d_o: &Tensor<Cpu>,
    q: &Tensor<Cpu>,
    k: &Tensor<Cpu>,
    v: &Tensor<Cpu>,
    o: &Tensor<Cpu>,
    lse: &Tensor<Cpu>,
    docs: Option<&Tensor<Cpu>>,
    block: usize,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>, Tensor<Cpu>)> {
    const OP: &str = "attention_backward";
    let d = check_qkv(OP, q, k, v)?;
    let Dims { b, s, hq, hkv, hd } = d;
    let spans = Spans::new(OP, q, docs, b, s)?;
    let block = block.max(1);
    d_o.expect_shape(OP, "d_o", q.shape())?;
    o.expect_shape(OP, "o", q.shape())?;
    lse.expect_shape(OP, "lse", &[b, hq, s])?;
    let dos = T::slice(d_o, OP)?;
    let lses: Vec<T> = (T::Acc::slice(lse, OP)?.iter())
        .map(|&x| T::from_acc(x))
        .collect();

    let (qs, ks, vs) = (T::slice(q, OP)?, T::slice(k, OP)?, T::slice(v, OP)?);
    let inp = BwdInputs {
        d,
        block,
        scale: T::from_f64(1.0 / (hd as f64).sqrt()),
        q: qs,
        k: ks,
        v: vs,
        d_o: dos,
        lse: &lses,
        spans: &spans,
    };
    // Recycled buffers, each task clearing its own heads (dK and dV are sums
    // over the query blocks): no serial memset on the calling thread.
    let mut dq = pool::take::<T>(qs.len());
    let mut dk = pool::take::<T>(ks.len());
    let mut dv = pool::take::<T>(vs.len());
    if !qs.is_empty() {
        let g = d.group();
        dq.par_chunks_mut(g * s * hd)
            .zip(dk.par_chunks_mut(s * hd))
            .zip(dv.par_chunks_mut(s * hd))
            .enumerate()
            .for_each(|(kvh, ((dqg, dkh), dvh))| {
                for part in [&mut *dqg, &mut *dkh, &mut *dvh] {
                    part.fill(T::ZERO);
                }
                inp.kv_head(kvh, dqg, dkh, dvh)
            });
    }
    Ok((
        T::tensor(from_head_major(&dq, s, hq, hd), q.shape())?,
        T::tensor(from_head_major(&dk, s, hkv, hd), k.shape())?,
        T::tensor(from_head_major(&dv, s, hkv, hd), v.shape())?,
    ))
}

/// [`AttentionOps::attention`] with an explicit block size (tests use small
/// blocks so that several blocks, and a ragged last one, are exercised).
pub(crate) fn attention_blocked(
    q: &Tensor<Cpu>,
    k: &Tensor<Cpu>,
    v: &Tensor<Cpu>,
    docs: Option<&Tensor<Cpu>>,
    block: usize,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    cpu_float_dispatch!("attention", q, attention_t(q, k, v, docs, block))
}

/// [`AttentionOps::attention_backward`] with an explicit block size.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward_blocked(
    d_o: &Tensor<Cpu>,
    q: &Tensor<Cpu>,
    k: &Tensor<Cpu>,
    v: &Tensor<Cpu>,
    o: &Tensor<Cpu>,
    lse: &Tensor<Cpu>,
    docs: Option<&Tensor<Cpu>>,
    block: usize,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>, Tensor<Cpu>)> {
    cpu_float_dispatch!(
        "attention_backward",
        q,
        attention_backward_t(d_o, q, k, v, o, lse, docs, block)
    )
}

impl AttentionOps for Cpu {
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        attention_blocked(q, k, v, docs, ATTN_BLOCK)
    }

    fn attention_backward(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        attention_backward_blocked(d_o, q, k, v, o, lse, docs, ATTN_BLOCK)
    }
}

#[cfg(test)]
mod tests {
    use super::{attention_backward_blocked, attention_blocked};
    use crate::backend::AttentionOps;
    use crate::backend::Device;
    use crate::cpu::test_util::*;
    use crate::cpu::Cpu;
    use crate::error::KernelError;
    use crate::tensor::Tensor;

    /// Plain causal GQA attention with the full score matrix, in f64:
    /// returns `(o [B,S,Hq,Hd], lse [B,Hq,S])`.
    fn naive(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        dims: (usize, usize, usize, usize, usize),
    ) -> (Vec<f64>, Vec<f64>) {
        naive_docs(q, k, v, dims, None)
    }

    /// [`naive`] with keys of other documents than the query's masked
    /// (`docs: [B·S]`), each key tested on its own.
    fn naive_docs(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        (b, s, hq, hkv, hd): (usize, usize, usize, usize, usize),
        docs: Option<&[i32]>,
    ) -> (Vec<f64>, Vec<f64>) {
        let seen =
            |bi: usize, i: usize, j: usize| docs.is_none_or(|d| d[bi * s + i] == d[bi * s + j]);
        let mut o = vec![0.0; q.len()];
        let mut lse = vec![0.0; b * hq * s];
        let scale = 1.0 / (hd as f64).sqrt();
        let qa = |bi: usize, i: usize, h: usize| ((bi * s + i) * hq + h) * hd;
        let ka = |bi: usize, j: usize, h: usize| ((bi * s + j) * hkv + h) * hd;
        for bi in 0..b {
            for h in 0..hq {
                let kh = h / (hq / hkv);
                for i in 0..s {
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            if !seen(bi, i, j) {
                                return f64::NEG_INFINITY;
                            }
                            (0..hd)
                                .map(|d| q[qa(bi, i, h) + d] * k[ka(bi, j, kh) + d])
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                    lse[(bi * hq + h) * s + i] = mx + z.ln();
                    for (j, x) in sc.iter().enumerate() {
                        let p = (x - mx).exp() / z;
                        for d in 0..hd {
                            o[qa(bi, i, h) + d] += p * v[ka(bi, j, kh) + d];
                        }
                    }
                }
            }
        }
        (o, lse)
    }

    struct Case {
        dims: (usize, usize, usize, usize, usize),
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
    }

    /// `[B·S]` document ids: documents of 1, 4, 2, 9, 3, ... tokens
    /// (restarting per sequence; a lone first token, documents across the
    /// blocks of the tests).
    fn doc_ids(b: usize, s: usize) -> Vec<i32> {
        let lens = [1usize, 4, 2, 9, 3, 70, 5];
        let mut ids = Vec::with_capacity(b * s);
        for bi in 0..b {
            let (mut doc, mut left) = (0i32, lens[bi % lens.len()]);
            for _ in 0..s {
                if left == 0 {
                    doc += 1;
                    left = lens[(bi + doc as usize) % lens.len()];
                }
                ids.push(doc);
                left -= 1;
            }
        }
        ids
    }

    impl Case {
        fn new(seed: u64, dims: (usize, usize, usize, usize, usize)) -> Self {
            let (b, s, hq, hkv, hd) = dims;
            let mut g = rng(seed);
            // Scaled up so the softmax is far from uniform.
            let mut draw = |n| -> Vec<f64> { uniform(&mut g, n).iter().map(|x| 2.0 * x).collect() };
            let q = draw(b * s * hq * hd);
            let k = draw(b * s * hkv * hd);
            let v = draw(b * s * hkv * hd);
            Case { dims, q, k, v }
        }
        fn qs(&self) -> [usize; 4] {
            let (b, s, hq, _, hd) = self.dims;
            [b, s, hq, hd]
        }
        fn ks(&self) -> [usize; 4] {
            let (b, s, _, hkv, hd) = self.dims;
            [b, s, hkv, hd]
        }
        fn tensors(&self, q: &[f64], k: &[f64], v: &[f64]) -> [Tensor<Cpu>; 3] {
            self.tensors_on(&Cpu, q, k, v)
        }
        fn tensors_on<B: Device>(&self, d: &B, q: &[f64], k: &[f64], v: &[f64]) -> [Tensor<B>; 3] {
            [
                d.t64(q, &self.qs()),
                d.t64(k, &self.ks()),
                d.t64(v, &self.ks()),
            ]
        }
    }

    #[test]
    fn attention_forward_matches_naive() {
        for (dims, block) in [
            ((2, 10, 4, 2, 4), 4),  // GQA, ragged last block
            ((1, 9, 3, 3, 6), 3),   // MHA, S a multiple of the block
            ((1, 5, 2, 1, 2), 64),  // MQA, one block
            ((1, 70, 2, 1, 8), 64), // the default block, two blocks
        ] {
            let c = Case::new(41, dims);
            let [q, k, v] = c.tensors(&c.q, &c.k, &c.v);
            let ids = doc_ids(dims.0, dims.1);
            let docs = crate::cpu::index_tensor(ids.clone(), &[dims.0, dims.1]).unwrap();
            for with_docs in [false, true] {
                let (o, lse) =
                    attention_blocked(&q, &k, &v, with_docs.then_some(&docs), block).unwrap();
                let (o_ref, lse_ref) =
                    naive_docs(&c.q, &c.k, &c.v, dims, with_docs.then_some(&ids[..]));
                assert_eq!(lse.shape(), &[dims.0, dims.2, dims.1]);
                let what = format!("{dims:?} block {block} docs {with_docs}");
                assert!(max_diff(&h64(&o), &o_ref) < 1e-12, "{what}");
                assert!(max_diff(&h64(&lse), &lse_ref) < 1e-12, "{what}");
            }
        }
    }

    /// Document ids that decrease along a sequence are a named error (the
    /// kernels rely on documents being contiguous runs).
    #[test]
    fn attention_docs_must_not_decrease() {
        let c = Case::new(49, (1, 4, 2, 1, 2));
        let [q, k, v] = c.tensors(&c.q, &c.k, &c.v);
        let docs = crate::cpu::index_tensor(vec![0, 1, 0, 2], &[1, 4]).unwrap();
        let err = Cpu
            .attention(&q, &k, &v, Some(&docs))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("must not decrease") && err.contains("position 2"),
            "{err}"
        );
    }

    fn attention_f32_matches_f64_reference<B: TestOps>(d: &B) {
        let dims = (2, 20, 4, 2, 8);
        let c = Case::new(42, dims);
        let f = |x: &[f64], shape: &[usize]| {
            d.t32(&x.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape)
        };
        let (o, lse) = d
            .attention(
                &f(&c.q, &c.qs()),
                &f(&c.k, &c.ks()),
                &f(&c.v, &c.ks()),
                None,
            )
            .unwrap();
        let (o_ref, lse_ref) = naive(&c.q, &c.k, &c.v, dims);
        assert!(max_diff(&d.h64(&o), &o_ref) < 1e-5);
        assert!(max_diff(&d.h64(&lse), &lse_ref) < 1e-5);
    }

    /// Checks dq, dk, dv of `Σ o ⊙ w` against finite differences, without
    /// and with documents.
    fn grad_case(seed: u64, dims: (usize, usize, usize, usize, usize), block: usize) {
        let docs = crate::cpu::index_tensor(doc_ids(dims.0, dims.1), &[dims.0, dims.1]).unwrap();
        grad_case_docs(seed, dims, block, None);
        grad_case_docs(seed, dims, block, Some(&docs));
    }

    fn grad_case_docs(
        seed: u64,
        dims: (usize, usize, usize, usize, usize),
        block: usize,
        docs: Option<&Tensor<Cpu>>,
    ) {
        let c = Case::new(seed, dims);
        let w = uniform(&mut rng(seed + 100), c.q.len());
        let [q, k, v] = c.tensors(&c.q, &c.k, &c.v);
        let (o, lse) = attention_blocked(&q, &k, &v, docs, block).unwrap();
        let d_o = t64(&w, &c.qs());
        let (dq, dk, dv) =
            attention_backward_blocked(&d_o, &q, &k, &v, &o, &lse, docs, block).unwrap();
        let f = |q: &[f64], k: &[f64], v: &[f64]| {
            let [q, k, v] = c.tensors(q, k, v);
            dotv(
                &h64(&attention_blocked(&q, &k, &v, docs, block).unwrap().0),
                &w,
            )
        };
        check("attention dq", &c.q, &h64(&dq), |x| f(x, &c.k, &c.v));
        check("attention dk", &c.k, &h64(&dk), |x| f(&c.q, x, &c.v));
        check("attention dv", &c.v, &h64(&dv), |x| f(&c.q, &c.k, x));
    }

    #[test]
    fn attention_grad_gqa() {
        // S = 7 with block 3: blocks of 3, 3, 1.
        grad_case(43, (2, 7, 4, 2, 4), 3);
    }

    #[test]
    fn attention_grad_mha() {
        grad_case(44, (1, 8, 2, 2, 6), 3);
    }

    #[test]
    fn attention_grad_independent_of_block_size() {
        let dims = (1, 13, 4, 2, 4);
        let c = Case::new(45, dims);
        let [q, k, v] = c.tensors(&c.q, &c.k, &c.v);
        let d_o = t64(&uniform(&mut rng(46), c.q.len()), &c.qs());
        let docs = crate::cpu::index_tensor(doc_ids(1, 13), &[1, 13]).unwrap();
        for docs in [None, Some(&docs)] {
            let run = |block| {
                let (o, lse) = attention_blocked(&q, &k, &v, docs, block).unwrap();
                let (dq, dk, dv) =
                    attention_backward_blocked(&d_o, &q, &k, &v, &o, &lse, docs, block).unwrap();
                [h64(&dq), h64(&dk), h64(&dv)]
            };
            let (a, b) = (run(2), run(64));
            for (x, y) in a.iter().zip(&b) {
                assert!(max_diff(x, y) < 1e-12);
            }
        }
    }

    fn attention_is_deterministic<B: TestOps>(d: &B) {
        let dims = (2, 150, 4, 2, 16);
        let c = Case::new(47, dims);
        let f = |x: &[f64], shape: &[usize]| {
            d.t32(&x.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape)
        };
        let (q, k, v) = (f(&c.q, &c.qs()), f(&c.k, &c.ks()), f(&c.v, &c.ks()));
        let d_o = f(&uniform(&mut rng(48), c.q.len()), &c.qs());
        let run = || {
            let (o, lse) = d.attention(&q, &k, &v, None).unwrap();
            let (dq, dk, dv) = d
                .attention_backward(&d_o, &q, &k, &v, &o, &lse, None)
                .unwrap();
            [o, lse, dq, dk, dv].map(|t| d.h64(&t))
        };
        let first = run();
        assert_eq!(first, run());
    }

    fn attention_bad_inputs<B: TestOps>(d: &B) {
        let q = d.t64(&[0.0; 2 * 3 * 4], &[1, 2, 3, 4]);
        let kv = d.t64(&[0.0; 2 * 2 * 4], &[1, 2, 2, 4]);
        match d.attention(&q, &kv, &kv, None).unwrap_err() {
            KernelError::ShapeMismatch {
                op: "attention",
                detail,
            } => {
                assert!(
                    detail.contains("Hq = 3") && detail.contains("Hkv = 2"),
                    "{detail}"
                )
            }
            e => panic!("{e:?}"),
        }
        let q = d.t64(&[0.0; 2 * 4 * 4], &[1, 2, 4, 4]);
        let k3 = d.t64(&[0.0; 3 * 2 * 4], &[1, 3, 2, 4]);
        let err = d.attention(&q, &k3, &k3, None).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::ShapeMismatch {
                    op: "attention",
                    ..
                }
            ),
            "{err:?}"
        );
        let k32 = d.t32(&[0.0; 2 * 2 * 4], &[1, 2, 2, 4]);
        let err = d.attention(&q, &k32, &k32, None).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::DTypeMismatch {
                    op: "attention",
                    ..
                }
            ),
            "{err:?}"
        );
        let qi = d.ti32(&[0; 2 * 4 * 4], &[1, 2, 4, 4]);
        let err = d.attention(&qi, &kv, &kv, None).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::DTypeMismatch { .. } | KernelError::UnsupportedDType { .. }
            ),
            "{err:?}"
        );
        let (o, lse) = d.attention(&q, &kv, &kv, None).unwrap();
        let bad_lse = d.t64(&[0.0; 8], &[1, 2, 4]);
        let err = d
            .attention_backward(&o, &q, &kv, &kv, &o, &bad_lse, None)
            .unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { op: "attention_backward", detail } if detail.contains("lse")),
            "{err:?}"
        );
        assert!(d
            .attention_backward(&o, &q, &kv, &kv, &o, &lse, None)
            .is_ok());
        // Document ids must be [B, S] of i32.
        let docs3 = d.ti32(&[0; 3], &[1, 3]);
        let err = d.attention(&q, &kv, &kv, Some(&docs3)).unwrap_err();
        assert!(
            matches!(&err, KernelError::ShapeMismatch { op: "attention", detail } if detail.contains("docs")),
            "{err:?}"
        );
        let docs_f = d.t64(&[0.0; 2], &[1, 2]);
        let err = d.attention(&q, &kv, &kv, Some(&docs_f)).unwrap_err();
        assert!(matches!(err, KernelError::DTypeMismatch { .. }), "{err:?}");
    }

    /// The backend's own attention (its default blocking) against the naive
    /// f64 reference, in f64, on GQA, MHA and MQA shapes, without and with
    /// documents.
    fn attention_matches_naive_on_device<B: TestOps>(d: &B) {
        for dims in [
            (2, 10, 4, 2, 4),
            (1, 9, 3, 3, 6),
            (1, 5, 2, 1, 2),
            (1, 70, 2, 1, 8),
        ] {
            let c = Case::new(41, dims);
            let [q, k, v] = c.tensors_on(d, &c.q, &c.k, &c.v);
            let ids = doc_ids(dims.0, dims.1);
            let docs = d.ti32(&ids, &[dims.0, dims.1]);
            for with_docs in [false, true] {
                let (o, lse) = d.attention(&q, &k, &v, with_docs.then_some(&docs)).unwrap();
                let (o_ref, lse_ref) =
                    naive_docs(&c.q, &c.k, &c.v, dims, with_docs.then_some(&ids[..]));
                assert_eq!(lse.shape(), &[dims.0, dims.2, dims.1]);
                assert!(max_diff(&d.h64(&o), &o_ref) < 1e-12, "{dims:?} {with_docs}");
                assert!(
                    max_diff(&d.h64(&lse), &lse_ref) < 1e-12,
                    "{dims:?} {with_docs}"
                );
            }
        }
    }

    /// dq, dk, dv of the backend's own attention against finite differences,
    /// for GQA and MHA, the second with documents.
    fn attention_grad_on_device<B: TestOps>(d: &B) {
        for (seed, dims, with_docs) in [(43, (2, 7, 4, 2, 4), false), (44, (1, 8, 2, 2, 6), true)] {
            let c = Case::new(seed, dims);
            let w = uniform(&mut rng(seed + 100), c.q.len());
            let [q, k, v] = c.tensors_on(d, &c.q, &c.k, &c.v);
            let docs_t = d.ti32(&doc_ids(dims.0, dims.1), &[dims.0, dims.1]);
            let docs = with_docs.then_some(&docs_t);
            let (o, lse) = d.attention(&q, &k, &v, docs).unwrap();
            let d_o = d.t64(&w, &c.qs());
            let (dq, dk, dv) = d
                .attention_backward(&d_o, &q, &k, &v, &o, &lse, docs)
                .unwrap();
            let f = |q: &[f64], k: &[f64], v: &[f64]| {
                let [q, k, v] = c.tensors_on(d, q, k, v);
                dotv(&d.h64(&d.attention(&q, &k, &v, docs).unwrap().0), &w)
            };
            check("attention dq", &c.q, &d.h64(&dq), |x| f(x, &c.k, &c.v));
            check("attention dk", &c.k, &d.h64(&dk), |x| f(&c.q, x, &c.v));
            check("attention dv", &c.v, &d.h64(&dv), |x| f(&c.q, &c.k, x));
        }
    }

    /// Forward and backward on random f32 (and bf16 where the device stores
    /// it) against the CPU, at a sequence longer than the CPU's block and a
    /// realistic head dim; the backward gets the device's own `o` and `lse`
    /// on both sides.
    fn attention_matches_cpu<B: TestOps>(d: &B) {
        let (b, s, hq, hkv, hd) = (2, 100, 8, 2, 64);
        let ids = doc_ids(b, s);
        let (docs_t, docs_c) = (d.ti32(&ids, &[b, s]), ti32(&ids, &[b, s]));
        for (dtype, with_docs) in Compare::precisions(d)
            .into_iter()
            .flat_map(|t| [(t, false), (t, true)])
        {
            let (docs, docs_c) = (with_docs.then_some(&docs_t), with_docs.then_some(&docs_c));
            let mut c = Compare::new(d, dtype, 95);
            let (q, qc) = c.rand(&[b, s, hq, hd], 1.0);
            let (k, kc) = c.rand(&[b, s, hkv, hd], 1.0);
            let (v, vc) = c.rand(&[b, s, hkv, hd], 1.0);
            let (o, lse) = d.attention(&q, &k, &v, docs).unwrap();
            let (oc, lsec) = Cpu.attention(&qc, &kc, &vc, docs_c).unwrap();
            c.check("attention o", &o, &oc);
            c.check("attention lse", &lse, &lsec);
            let same = |t: &Tensor<B>| {
                let h: Vec<f32> = d.h64(t).iter().map(|&x| x as f32).collect();
                t32(&h, t.shape())
            };
            let (d_o, d_oc) = c.rand(&[b, s, hq, hd], 1.0);
            let (dq, dk, dv) = d
                .attention_backward(&d_o, &q, &k, &v, &o, &lse, docs)
                .unwrap();
            let (dqc, dkc, dvc) = Cpu
                .attention_backward(&d_oc, &qc, &kc, &vc, &same(&o), &same(&lse), docs_c)
                .unwrap();
            c.check("attention_backward dq", &dq, &dqc);
            c.check("attention_backward dk", &dk, &dkc);
            c.check("attention_backward dv", &dv, &dvc);
            c.report(if with_docs {
                "attention with documents"
            } else {
                "attention"
            });
        }
    }

    /// Forward (o, lse) and backward (dq, dk, dv) against the CPU at the
    /// shapes the tensor-core kernels specialise on: head dims 64, 128 and
    /// MLA's query/key 192 with values 128 (zero-padded to 192, as mla.rs
    /// gives them, and so the gradient of the output), S = 1 and lengths
    /// that are not a multiple of any tile, GQA ratios 1 and 8; inputs
    /// scaled so that the softmax is peaked (a wrong mask or running maximum
    /// shows).
    fn attention_matches_cpu_at_kernel_shapes<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            let mut c = Compare::new(d, dtype, 97);
            for (b, s, hq, hkv, hd) in [
                (1, 1, 2, 2, 64),
                (2, 67, 8, 1, 64),
                (1, 130, 8, 1, 128),
                (1, 1, 2, 1, 192),
                (1, 101, 2, 2, 192),
                (1, 75, 8, 1, 192),
            ] {
                let hv = if hd == 192 { 128 } else { hd };
                let (q, qc) = c.rand(&[b, s, hq, hd], 2.0);
                let (k, kc) = c.rand(&[b, s, hkv, hd], 2.0);
                let (v, vc) = c.rand_padded(&[b, s, hkv, hd], 1.0, hv);
                let what = |t: &str| format!("attention {t} B={b} S={s} Hq={hq} Hkv={hkv} Hd={hd}");
                let (o, lse) = d.attention(&q, &k, &v, None).unwrap();
                let (oc, lsec) = Cpu.attention(&qc, &kc, &vc, None).unwrap();
                c.check(&what("o"), &o, &oc);
                c.check(&what("lse"), &lse, &lsec);
                let same = |t: &Tensor<B>| {
                    let h: Vec<f32> = d.h64(t).iter().map(|&x| x as f32).collect();
                    t32(&h, t.shape())
                };
                let (d_o, d_oc) = c.rand_padded(&[b, s, hq, hd], 1.0, hv);
                let (dq, dk, dv) = d
                    .attention_backward_padded_values(&d_o, &q, &k, &v, &o, &lse, None, hv)
                    .unwrap();
                let (dqc, dkc, dvc) = Cpu
                    .attention_backward(&d_oc, &qc, &kc, &vc, &same(&o), &same(&lse), None)
                    .unwrap();
                c.check(&what("dq"), &dq, &dqc);
                c.check(&what("dk"), &dk, &dkc);
                c.check(&what("dv"), &dv, &dvc);
            }
            c.report("attention at kernel shapes");
        }
    }

    device_tests!(
        attention_matches_cpu_at_kernel_shapes,
        attention_matches_naive_on_device,
        attention_grad_on_device,
        attention_matches_cpu,
        attention_f32_matches_f64_reference,
        attention_is_deterministic,
        attention_bad_inputs,
    );
}
