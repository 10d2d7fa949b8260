//! CUDA causal grouped-query attention: the scores and the products with
//! values and gradients are cuBLAS strided-batched GEMMs on tensor cores, the
//! softmax and its gradient are kernels of `attention.cu`.
//!
//! q, k, v (and dO) are first copied head-major, `[B, H, S, Hd]`, so that the
//! G query heads of one kv head are G·S consecutive rows against that kv
//! head's S keys: every product of a kv head is then one GEMM, and a chunk of
//! kv heads one strided-batched call. The full S × S score matrix of each
//! head is formed in the accumulation type (f32, f64 for f64) and the causal
//! mask applied by the softmax, so half of the score products are wasted;
//! in exchange every product runs at cuBLAS speed. Scores are bounded by
//! working through kv heads in chunks of [`SCORE_BUDGET`] bytes. The
//! backward recomputes the probabilities from the saved log-sum-exp, as a
//! flash-attention backward does; nothing S × S is kept between the passes.
//!
//! bf16 with a head dim of 64 or 128 takes the flash kernels of
//! `attention.cu` instead ([`flash_head_dim`]): tensor-core tiles with an
//! online softmax, nothing S × S in memory, the causal mask skipping whole
//! tiles, and q, k, v read in place. Setting `FOLDMOE_ATTENTION=cublas`
//! forces the cuBLAS path (for comparisons). On Hopper the forward (bf16,
//! Hd 64, 128 or 192) and the backward (Hd 64 or 128, and MLA's 192 with
//! 128-wide values through `attention_backward_padded_values`) run
//! `attention_sm90.rs`'s TMA + wgmma kernels where they fit
//! (`FOLDMOE_ATTENTION=mma` keeps the kernels above).
//!
//! Shape letters: B batch, S sequence, Hq query heads, Hkv kv heads, Hd head
//! dim, G = Hq / Hkv.

use super::compile::ATTENTION;
use super::linalg::RowGemm;
use super::{block_cfg, dtype_size, float_sfx, grid_for, launch, rows_cfg, warp_rows_cfg, Cuda};
use crate::backend::{AttentionOps, Device};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Bytes of score matrices (accumulation type) formed at once; kv heads are
/// processed in chunks that fit (at least one kv head per chunk).
const SCORE_BUDGET: usize = 2 << 30;

/// Threads per block of the row softmax.
const SOFTMAX_THREADS: u32 = 256;

/// Accumulation type of `dtype`: scores are formed in it.
fn acc_type(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The problem after the shared checks: sizes, and how many kv heads (of all
/// batches) each chunk takes.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    /// Query heads per kv head.
    g: usize,
    /// kv heads in a chunk.
    chunk: usize,
    dtype: DType,
}

impl Dims {
    fn new(
        op: &'static str,
        q: &Tensor<Cuda>,
        k: &Tensor<Cuda>,
        v: &Tensor<Cuda>,
        budget: usize,
    ) -> Result<Self> {
        float_sfx(op, q.dtype())?;
        let (b, s, hq, hkv, hd) = crate::backend::check_qkv(op, q, k, v)?;
        let g = hq / hkv.max(1);
        let per_head = g * s * s * dtype_size(acc_type(q.dtype()));
        let chunk = (budget / per_head.max(1)).clamp(1, (b * hkv).max(1));
        Ok(Dims {
            b,
            s,
            hq,
            hkv,
            hd,
            g,
            chunk,
            dtype: q.dtype(),
        })
    }

    /// Score rows of one kv head (its G query heads' S queries each).
    fn rows(&self) -> usize {
        self.g * self.s
    }

    /// Chunks of kv heads: `(first, count)`.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> {
        let (units, chunk) = (self.b * self.hkv, self.chunk);
        (0..units)
            .step_by(chunk)
            .map(move |u| (u, chunk.min(units - u)))
    }

    /// The backward's checks of `d_o`, `o` and `lse` against the inputs.
    fn check_backward(
        &self,
        op: &'static str,
        q: &Tensor<Cuda>,
        d_o: &Tensor<Cuda>,
        o: &Tensor<Cuda>,
        lse: &Tensor<Cuda>,
    ) -> Result<()> {
        d_o.expect_shape(op, "d_o", q.shape())?;
        o.expect_shape(op, "o", q.shape())?;
        lse.expect_shape(op, "lse", &[self.b, self.hq, self.s])?;
        for t in [d_o, o] {
            t.expect_dtype(op, self.dtype)?;
        }
        lse.expect_dtype(op, acc_type(self.dtype))?;
        Ok(())
    }

    fn scale(&self) -> f64 {
        1.0 / (self.hd as f64).sqrt()
    }

    fn elem(&self) -> usize {
        dtype_size(self.dtype)
    }

    fn acc_elem(&self) -> usize {
        dtype_size(acc_type(self.dtype))
    }
}

/// The device address of the document ids, or null (0) without them.
fn docs_ptr(docs: Option<&Tensor<Cuda>>) -> u64 {
    docs.map_or(0, |t| t.storage().ptr())
}

/// An address `n` elements of `size` bytes past `base`.
fn at(base: u64, n: usize, size: usize) -> u64 {
    base + (n * size) as u64
}

impl Cuda {
    /// `x` `[B, S, H, Hd]` copied to `[B, H, S, Hd]` (`to_heads`) or back.
    fn attn_heads(
        &self,
        op: &'static str,
        x: &Tensor<Self>,
        to_heads: bool,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(op, x.dtype())?;
        let [b, d1, d2, hd] = *x.shape() else {
            unreachable!("attention tensors were checked to be 4-d")
        };
        let out = self.alloc(op, &[b, d2, d1, hd], x.dtype())?;
        // [B, S, H, Hd] → heads: S = d1, H = d2; back: H = d1, S = d2.
        let (s, h) = if to_heads { (d1, d2) } else { (d2, d1) };
        if x.numel() > 0 {
            let f = self.func(ATTENTION, &format!("attn_heads_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(x.numel()),
                x.storage().ptr(),
                out.storage().ptr(),
                b as i64,
                s as i64,
                h as i64,
                hd as i64,
                to_heads as i32
            )?;
        }
        Ok(out)
    }

    /// Head-major scores of kv heads `u0..u0 + n`: `scores[u]` (G·S × S) =
    /// `qh[u]` (G·S × Hd) · `kh[u]`ᵀ, in the accumulation type.
    fn attn_scores(
        &self,
        op: &'static str,
        d: &Dims,
        (u0, n): (usize, usize),
        qh: u64,
        kh: u64,
        scores: u64,
    ) -> Result<()> {
        let (rows, s, hd) = (d.rows(), d.s, d.hd);
        self.row_gemm(
            op,
            &RowGemm {
                m: rows,
                n: s,
                k: hd,
                a: at(qh, u0 * rows * hd, d.elem()),
                a_row: hd,
                a_stride: rows * hd,
                trans_a: false,
                b: at(kh, u0 * s * hd, d.elem()),
                b_row: hd,
                b_stride: s * hd,
                trans_b: true,
                c: scores,
                c_row: s,
                c_stride: rows * s,
                batch: n,
                dtype: d.dtype,
                out_dtype: acc_type(d.dtype),
            },
        )
    }

    /// The forward with kv heads taken `budget` bytes of scores at a time.
    fn attention_chunked(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
        budget: usize,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention";
        let d = Dims::new(OP, q, k, v, budget)?;
        crate::backend::check_docs(OP, q, docs)?;
        let docs_ptr = docs_ptr(docs);
        let sfx = float_sfx(OP, d.dtype)?;
        let lse = self.alloc(OP, &[d.b, d.hq, d.s], acc_type(d.dtype))?;
        if q.numel() == 0 || d.hd == 0 {
            let o = self.zeros(q.shape(), d.dtype)?;
            return Ok((o, lse));
        }
        let (qh, kh, vh) = (
            self.attn_heads(OP, q, true)?,
            self.attn_heads(OP, k, true)?,
            self.attn_heads(OP, v, true)?,
        );
        let oh = self.alloc(OP, &[d.b, d.hq, d.s, d.hd], d.dtype)?;
        let (rows, s, hd) = (d.rows(), d.s, d.hd);
        let scores = self.scratch(OP, d.chunk * rows * s * d.acc_elem())?;
        let p = self.scratch(OP, d.chunk * rows * s * d.elem())?;
        let softmax = self.func(ATTENTION, &format!("attn_softmax_{sfx}"))?;
        for (u0, n) in d.chunks() {
            let (qp, kp, vp) = (qh.storage().ptr(), kh.storage().ptr(), vh.storage().ptr());
            self.attn_scores(OP, &d, (u0, n), qp, kp, scores.ptr())?;
            launch!(
                self,
                softmax.clone(),
                rows_cfg(n * rows, SOFTMAX_THREADS),
                scores.ptr(),
                p.ptr(),
                at(lse.storage().ptr(), u0 * rows, d.acc_elem()),
                (n * rows) as i64,
                s as i64,
                d.scale(),
                docs_ptr,
                u0 as i64,
                rows as i64,
                d.hkv as i64
            )?;
            // oh[u] (G·S × Hd) = p[u] (G·S × S) · vh[u] (S × Hd).
            self.row_gemm(
                OP,
                &RowGemm {
                    m: rows,
                    n: hd,
                    k: s,
                    a: p.ptr(),
                    a_row: s,
                    a_stride: rows * s,
                    trans_a: false,
                    b: at(vp, u0 * s * hd, d.elem()),
                    b_row: hd,
                    b_stride: s * hd,
                    trans_b: false,
                    c: at(oh.storage().ptr(), u0 * rows * hd, d.elem()),
                    c_row: hd,
                    c_stride: rows * hd,
                    batch: n,
                    dtype: d.dtype,
                    out_dtype: d.dtype,
                },
            )?;
        }
        Ok((self.attn_heads(OP, &oh, false)?, lse))
    }

    /// The backward with kv heads taken `budget` bytes of scores at a time.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_chunked(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
        budget: usize,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention_backward";
        let d = Dims::new(OP, q, k, v, budget)?;
        let sfx = float_sfx(OP, d.dtype)?;
        d.check_backward(OP, q, d_o, o, lse)?;
        crate::backend::check_docs(OP, q, docs)?;
        let docs_ptr = docs_ptr(docs);
        if q.numel() == 0 || d.hd == 0 {
            return Ok((
                self.zeros(q.shape(), d.dtype)?,
                self.zeros(k.shape(), d.dtype)?,
                self.zeros(v.shape(), d.dtype)?,
            ));
        }
        let delta = self.alloc(OP, &[d.b, d.hq, d.s], acc_type(d.dtype))?;
        let f = self.func(ATTENTION, &format!("attn_delta_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(d.b * d.hq * d.s),
            d_o.storage().ptr(),
            o.storage().ptr(),
            delta.storage().ptr(),
            d.b as i64,
            d.s as i64,
            d.hq as i64,
            d.hd as i64
        )?;
        let qh = self.attn_heads(OP, q, true)?;
        let kh = self.attn_heads(OP, k, true)?;
        let vh = self.attn_heads(OP, v, true)?;
        let doh = self.attn_heads(OP, d_o, true)?;
        let dqh = self.alloc(OP, &[d.b, d.hq, d.s, d.hd], d.dtype)?;
        let dkh = self.alloc(OP, &[d.b, d.hkv, d.s, d.hd], d.dtype)?;
        let dvh = self.alloc(OP, &[d.b, d.hkv, d.s, d.hd], d.dtype)?;
        let (rows, s, hd) = (d.rows(), d.s, d.hd);
        // `scores` holds the scores, then dP; `p` the probabilities, then dS.
        let scores = self.scratch(OP, d.chunk * rows * s * d.acc_elem())?;
        let p = self.scratch(OP, d.chunk * rows * s * d.elem())?;
        let probs = self.func(ATTENTION, &format!("attn_probs_{sfx}"))?;
        let dscores = self.func(ATTENTION, &format!("attn_dscores_{sfx}"))?;
        let ptrs = |t: &Tensor<Self>| t.storage().ptr();
        let (qp, kp, vp, dop) = (ptrs(&qh), ptrs(&kh), ptrs(&vh), ptrs(&doh));
        // One strided-batched product over the chunk's kv heads, each
        // operand given as (base, row length, batch stride, transposed).
        let product = |m: usize,
                       n_cols: usize,
                       inner: usize,
                       a: (u64, usize, usize, bool),
                       b: (u64, usize, usize, bool),
                       c: (u64, usize, usize),
                       batch: usize,
                       out_dtype: DType| {
            self.row_gemm(
                OP,
                &RowGemm {
                    m,
                    n: n_cols,
                    k: inner,
                    a: a.0,
                    a_row: a.1,
                    a_stride: a.2,
                    trans_a: a.3,
                    b: b.0,
                    b_row: b.1,
                    b_stride: b.2,
                    trans_b: b.3,
                    c: c.0,
                    c_row: c.1,
                    c_stride: c.2,
                    batch,
                    dtype: d.dtype,
                    out_dtype,
                },
            )
        };
        let (e, acc) = (d.elem(), acc_type(d.dtype));
        for (u0, n) in d.chunks() {
            let elems = n * rows * s;
            let lse_at = at(lse.storage().ptr(), u0 * rows, d.acc_elem());
            let delta_at = at(delta.storage().ptr(), u0 * rows, d.acc_elem());
            let (q_u, do_u) = (at(qp, u0 * rows * hd, e), at(dop, u0 * rows * hd, e));
            let (k_u, v_u) = (at(kp, u0 * s * hd, e), at(vp, u0 * s * hd, e));
            self.attn_scores(OP, &d, (u0, n), qp, kp, scores.ptr())?;
            launch!(
                self,
                probs.clone(),
                grid_for(elems),
                scores.ptr(),
                p.ptr(),
                lse_at,
                (n * rows) as i64,
                s as i64,
                d.scale(),
                docs_ptr,
                u0 as i64,
                rows as i64,
                d.hkv as i64
            )?;
            // dV[u] (S × Hd) = P[u]ᵀ (S × G·S) · dO[u] (G·S × Hd): the sum
            // over the kv head's G query heads is part of the product.
            product(
                s,
                hd,
                rows,
                (p.ptr(), s, rows * s, true),
                (do_u, hd, rows * hd, false),
                (at(ptrs(&dvh), u0 * s * hd, e), hd, s * hd),
                n,
                d.dtype,
            )?;
            // dP[u] (G·S × S) = dO[u] · V[u]ᵀ, over the scores.
            product(
                rows,
                s,
                hd,
                (do_u, hd, rows * hd, false),
                (v_u, hd, s * hd, true),
                (scores.ptr(), s, rows * s),
                n,
                acc,
            )?;
            launch!(
                self,
                dscores.clone(),
                grid_for(elems),
                scores.ptr(),
                p.ptr(),
                delta_at,
                (n * rows) as i64,
                s as i64,
                d.scale()
            )?;
            // dQ[u] (G·S × Hd) = dS[u] · K[u]; dK[u] (S × Hd) = dS[u]ᵀ · Q[u].
            product(
                rows,
                hd,
                s,
                (p.ptr(), s, rows * s, false),
                (k_u, hd, s * hd, false),
                (at(ptrs(&dqh), u0 * rows * hd, e), hd, rows * hd),
                n,
                d.dtype,
            )?;
            product(
                s,
                hd,
                rows,
                (p.ptr(), s, rows * s, true),
                (q_u, hd, rows * hd, false),
                (at(ptrs(&dkh), u0 * s * hd, e), hd, s * hd),
                n,
                d.dtype,
            )?;
        }
        Ok((
            self.attn_heads(OP, &dqh, false)?,
            self.attn_heads(OP, &dkh, false)?,
            self.attn_heads(OP, &dvh, false)?,
        ))
    }
}

/// Threads of a flash-attention block (4 warps).
const FLASH_THREADS: u32 = 128;
/// Queries of a forward block, keys of a backward block (`FA_BM`, `FA_BN`).
const FLASH_TILE: usize = 64;
/// Queries per step of the backward (`FA_BQ`).
const FLASH_BWD_QUERIES: usize = 32;

/// The head dim the flash kernels are compiled for, if this problem can use
/// them: bf16, Hd 64 or 128, and not turned off by `FOLDMOE_ATTENTION=cublas`.
fn flash_head_dim(d: &Dims) -> Option<usize> {
    // Read once: this runs on every attention call.
    static FORCED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let forced_off =
        *FORCED_OFF.get_or_init(|| std::env::var("FOLDMOE_ATTENTION").is_ok_and(|v| v == "cublas"));
    (d.dtype == DType::BF16 && matches!(d.hd, 64 | 128) && !forced_off).then_some(d.hd)
}

/// Dynamic shared memory of the flash backward (`flash_bwd_impl`'s layout):
/// K and V tiles, two buffers each of Q and dO, the dS tile, and two
/// buffers each of lse and delta.
fn flash_bwd_smem(hd: usize) -> u32 {
    let bf16_elems =
        2 * FLASH_TILE * hd + 4 * FLASH_BWD_QUERIES * hd + FLASH_TILE * FLASH_BWD_QUERIES;
    (bf16_elems * 2 + 4 * FLASH_BWD_QUERIES * 4) as u32
}

impl Cuda {
    /// The flash forward: `o` and `lse` straight from the `[B, S, H, Hd]`
    /// inputs.
    fn flash_attention(
        &self,
        d: &Dims,
        hd: usize,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention";
        let o = self.alloc(OP, q.shape(), d.dtype)?;
        let lse = self.alloc(OP, &[d.b, d.hq, d.s], acc_type(d.dtype))?;
        let f = self.func(ATTENTION, &format!("flash_fwd_bf16_hd{hd}"))?;
        let cfg = block_cfg(
            (d.s.div_ceil(FLASH_TILE) as u32, d.hq as u32, d.b as u32),
            FLASH_THREADS,
            0,
        );
        launch!(
            self,
            f,
            cfg,
            q.storage().ptr(),
            k.storage().ptr(),
            v.storage().ptr(),
            o.storage().ptr(),
            lse.storage().ptr(),
            d.s as i64,
            d.hq as i32,
            d.hkv as i32,
            (d.scale() * std::f64::consts::LOG2_E) as f32,
            docs_ptr(docs)
        )?;
        Ok((o, lse))
    }

    /// The flash backward: delta and a zeroed f32 dQ accumulator, the
    /// per-key-tile kernel, then dQ scaled and rounded.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        &self,
        d: &Dims,
        hd: usize,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention_backward";
        let rows = d.b * d.hq * d.s;
        let delta = self.scratch(OP, rows * 4)?;
        let dq_acc = self.scratch(OP, q.numel() * 4)?;
        let f = self.func(ATTENTION, "flash_delta_bf16")?;
        let cfg = warp_rows_cfg(rows);
        launch!(
            self,
            f,
            cfg,
            d_o.storage().ptr(),
            o.storage().ptr(),
            delta.ptr(),
            dq_acc.ptr(),
            d.b as i64,
            d.s as i64,
            d.hq as i64,
            hd as i64
        )?;
        let dk = self.alloc(OP, k.shape(), d.dtype)?;
        let dv = self.alloc(OP, v.shape(), d.dtype)?;
        let smem = flash_bwd_smem(hd);
        let f = self.func_smem(ATTENTION, &format!("flash_bwd_bf16_hd{hd}"), smem)?;
        let cfg = block_cfg(
            (d.s.div_ceil(FLASH_TILE) as u32, d.hkv as u32, d.b as u32),
            FLASH_THREADS,
            smem,
        );
        launch!(
            self,
            f,
            cfg,
            q.storage().ptr(),
            k.storage().ptr(),
            v.storage().ptr(),
            d_o.storage().ptr(),
            lse.storage().ptr(),
            delta.ptr(),
            dq_acc.ptr(),
            dk.storage().ptr(),
            dv.storage().ptr(),
            d.s as i64,
            d.hq as i32,
            d.hkv as i32,
            d.scale() as f32,
            docs_ptr(docs)
        )?;
        let dq = self.alloc(OP, q.shape(), d.dtype)?;
        let f = self.func(ATTENTION, "flash_dq_bf16")?;
        launch!(
            self,
            f,
            grid_for(q.numel()),
            dq_acc.ptr(),
            dq.storage().ptr(),
            q.numel() as i64,
            d.scale() as f32
        )?;
        Ok((dq, dk, dv))
    }
}

impl AttentionOps for Cuda {
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let d = Dims::new("attention", q, k, v, SCORE_BUDGET)?;
        crate::backend::check_docs("attention", q, docs)?;
        // Hopper: attention_sm90.rs's wgmma kernels where they fit (without
        // documents: a masked call runs the flash kernels, which skip tiles).
        let shape = (d.b, d.s, d.hq, d.hkv, d.hd);
        if docs.is_none() && self.sm90_attention_fits(&[q, k, v], shape) {
            return self.sm90_attention(q, k, v, shape);
        }
        match flash_head_dim(&d) {
            Some(hd) if q.numel() > 0 => self.flash_attention(&d, hd, q, k, v, docs),
            _ => self.attention_chunked(q, k, v, docs, SCORE_BUDGET),
        }
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
        self.attention_backward_with(d_o, q, k, v, o, lse, docs, None)
    }

    fn attention_backward_padded_values(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
        value_dim: usize,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        self.attention_backward_with(d_o, q, k, v, o, lse, docs, Some(value_dim))
    }
}

impl Cuda {
    /// The backward's dispatch: the wgmma kernels where they take the shape
    /// (at Hd 192 only for MLA's padded 128-wide values, `value_dim`), else
    /// the flash kernels, else the chunked cuBLAS path.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_with(
        &self,
        d_o: &Tensor<Self>,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        o: &Tensor<Self>,
        lse: &Tensor<Self>,
        docs: Option<&Tensor<Self>>,
        value_dim: Option<usize>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        const OP: &str = "attention_backward";
        let d = Dims::new(OP, q, k, v, SCORE_BUDGET)?;
        let shape = (d.b, d.s, d.hq, d.hkv, d.hd);
        // Documents run the flash kernels (the wgmma kernels take no mask).
        if docs.is_none() && self.sm90_attention_backward_fits(&[d_o, q, k, v, o], shape, value_dim)
        {
            d.check_backward(OP, q, d_o, o, lse)?;
            return self.sm90_attention_backward(d_o, q, k, v, o, lse, shape);
        }
        match flash_head_dim(&d) {
            Some(hd) if q.numel() > 0 => {
                d.check_backward(OP, q, d_o, o, lse)?;
                crate::backend::check_docs(OP, q, docs)?;
                self.flash_attention_backward(&d, hd, d_o, q, k, v, o, lse, docs)
            }
            _ => self.attention_backward_chunked(d_o, q, k, v, o, lse, docs, SCORE_BUDGET),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ElementwiseOps as _;
    use crate::tensor::HostData;

    fn random(d: &Cuda, shape: &[usize], seed: u64) -> Tensor<Cuda> {
        let n: usize = shape.iter().product();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        d.upload(HostData::F32(v), shape).unwrap()
    }

    fn host(d: &Cuda, t: &Tensor<Cuda>) -> Vec<f32> {
        match d.download(t).unwrap() {
            HostData::F32(v) => v,
            other => panic!("expected f32, got {other:?}"),
        }
    }

    /// Largest difference between `a` and `b` relative to `b`'s largest
    /// magnitude.
    fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// bf16 tensor of `shape` with entries uniform in [-1, 1).
    fn random_bf16(d: &Cuda, shape: &[usize], seed: u64) -> Tensor<Cuda> {
        d.cast(&random(d, shape, seed), DType::BF16).unwrap()
    }

    fn host_bf16(d: &Cuda, t: &Tensor<Cuda>) -> Vec<f32> {
        host(d, &d.cast(t, DType::F32).unwrap())
    }

    /// The flash kernels against the cuBLAS path (itself checked against
    /// the CPU by the shared test bodies; the backward of both given the
    /// flash forward's o and lse) in bf16, for both head dims, a
    /// sequence that is not a multiple of any tile, and grouped queries;
    /// scaled inputs make the softmax peaked, so a wrong mask or a wrong
    /// running maximum shows.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn flash_matches_the_cublas_path() {
        let d = crate::cuda::require_test_device();
        for (b, s, hq, hkv, hd) in [(2, 100, 4, 2, 64), (1, 200, 6, 2, 128), (1, 64, 2, 2, 128)] {
            let scale = |t: Tensor<Cuda>| d.scale(&t, 3.0).unwrap();
            let q = scale(random_bf16(&d, &[b, s, hq, hd], 11));
            let k = scale(random_bf16(&d, &[b, s, hkv, hd], 12));
            let v = random_bf16(&d, &[b, s, hkv, hd], 13);
            let d_o = random_bf16(&d, &[b, s, hq, hd], 14);
            let dims = Dims::new("test", &q, &k, &v, SCORE_BUDGET).unwrap();
            assert_eq!(flash_head_dim(&dims), Some(hd), "the flash path applies");
            // Without documents, and with documents of 1 to 90 tokens
            // (tiles skipped whole and tiles masked in part).
            for docs in [None, Some(doc_ids(&d, b, s))] {
                let docs = docs.as_ref();
                let (fo, fl) = d.flash_attention(&dims, hd, &q, &k, &v, docs).unwrap();
                let fg = d
                    .flash_attention_backward(&dims, hd, &d_o, &q, &k, &v, &fo, &fl, docs)
                    .unwrap();
                // The same inputs through the cuBLAS path (f32 scores).
                let co = d.attention_chunked(&q, &k, &v, docs, SCORE_BUDGET).unwrap();
                let cl = d
                    .attention_backward_chunked(&d_o, &q, &k, &v, &fo, &fl, docs, SCORE_BUDGET)
                    .unwrap();
                let what = format!(
                    "B={b} S={s} Hq={hq} Hkv={hkv} Hd={hd} docs={}",
                    docs.is_some()
                );
                for (name, got, want, tol) in [
                    ("o", &fo, &co.0, 1e-2),
                    ("lse", &fl, &co.1, 1e-2),
                    ("dq", &fg.0, &cl.0, 2e-2),
                    ("dk", &fg.1, &cl.1, 2e-2),
                    ("dv", &fg.2, &cl.2, 2e-2),
                ] {
                    let r = rel_diff(&host_bf16(&d, got), &host_bf16(&d, want));
                    println!("flash vs cuBLAS {what} {name}: {r:e}");
                    assert!(
                        r < tol,
                        "{what}: flash {name} differs from the cuBLAS path by {r:e}"
                    );
                }
            }
        }
    }

    /// `[B, S]` document ids of documents of 1, 90, 5, 37, ... tokens
    /// (restarting per sequence), uploaded as i32.
    fn doc_ids(d: &Cuda, b: usize, s: usize) -> Tensor<Cuda> {
        let lens = [1usize, 90, 5, 37, 64, 3];
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
        d.upload(HostData::I32(ids), &[b, s]).unwrap()
    }

    /// Chunks of one kv head give the results of one chunk of all (to
    /// rounding: cuBLAS may pick another algorithm for another batch
    /// count), so the chunk offsets of every operand and of lse and delta
    /// are right.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn chunked_equals_unchunked() {
        let d = crate::cuda::require_test_device();
        let (b, s, hq, hkv, hd) = (2, 37, 6, 3, 16);
        let q = random(&d, &[b, s, hq, hd], 1);
        let k = random(&d, &[b, s, hkv, hd], 2);
        let v = random(&d, &[b, s, hkv, hd], 3);
        let d_o = random(&d, &[b, s, hq, hd], 4);
        let one_head = (hq / hkv) * s * s * 4;
        let docs = doc_ids(&d, b, s);
        let (o1, l1) = d
            .attention_chunked(&q, &k, &v, Some(&docs), one_head)
            .unwrap();
        let (o2, l2) = d
            .attention_chunked(&q, &k, &v, Some(&docs), usize::MAX)
            .unwrap();
        let close = |a: &Tensor<Cuda>, b: &Tensor<Cuda>, what: &str| {
            let r = rel_diff(&host(&d, a), &host(&d, b));
            assert!(r < 1e-5, "{what}: chunked differs by {r:e}");
        };
        close(&o1, &o2, "o");
        close(&l1, &l2, "lse");
        let g1 = d
            .attention_backward_chunked(&d_o, &q, &k, &v, &o1, &l1, Some(&docs), one_head)
            .unwrap();
        let g2 = d
            .attention_backward_chunked(&d_o, &q, &k, &v, &o2, &l2, Some(&docs), usize::MAX)
            .unwrap();
        close(&g1.0, &g2.0, "dq");
        close(&g1.1, &g2.1, "dk");
        close(&g1.2, &g2.2, "dv");
    }
}
