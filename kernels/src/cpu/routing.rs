//! CPU implementation of the `routing` ops: top-k (optionally group-limited),
//! column gathers, embeddings, and the permutations of the MoE dispatcher.
//!
//! Shape letters: T tokens, E experts, K top-k, N permuted rows, D hidden,
//! V vocabulary.
//!
//! Every accumulation (scatters, backward passes) runs in a fixed order per
//! output row, so results are bit-identical from run to run and between
//! thread counts: the inverse of an index map is built first (a stable
//! counting sort), then each output row sums its sources in index order.

use std::cmp::Ordering;

use rayon::prelude::*;

use super::{index_slice, index_tensor, pool, Cpu, FloatStorage};
use crate::backend::{
    permute_weights_args, permute_weights_backward_args, unpermute_args, DropPolicy, RoutingOps,
    RoutingPlan,
};
use crate::cpu_float_dispatch;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::Tensor;

/// Work (elements touched) below which a loop stays on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// Rows handled per rayon task, chosen so that each task has about
/// `PARALLEL_MIN_WORK` elements of work when rows are `width` wide.
fn rows_per_task(width: usize) -> usize {
    (PARALLEL_MIN_WORK / width.max(1)).max(1)
}

/// Runs `f(row, out_row)` over the `width`-element rows of `out`, in parallel
/// when the work is large enough.
fn for_each_row<T: Send>(out: &mut [T], width: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if width == 0 {
        return;
    }
    if out.len() < PARALLEL_MIN_WORK {
        out.chunks_mut(width).enumerate().for_each(|(r, o)| f(r, o));
    } else {
        let per = rows_per_task(width);
        out.par_chunks_mut(per * width)
            .enumerate()
            .for_each(|(c, block)| {
                for (i, o) in block.chunks_mut(width).enumerate() {
                    f(c * per + i, o);
                }
            });
    }
}

/// Checks that every index lies in `[lo, hi)`.
fn check_range(op: &'static str, idx: &[i32], lo: i64, hi: i64) -> Result<()> {
    match idx.iter().find(|&&i| (i as i64) < lo || (i as i64) >= hi) {
        Some(&bad) => Err(KernelError::IndexOutOfRange {
            op,
            index: bad as i64,
            lo,
            hi,
        }),
        None => Ok(()),
    }
}

/// The inverse of a map `src: [R]` with values in `[-1, targets)`: for every
/// target, the positions `r` with `src[r] = target`, in increasing `r`
/// (`-1` entries are skipped). Returned as CSR offsets `[targets + 1]` and
/// positions. Values must have been range-checked.
fn invert(src: &[i32], targets: usize) -> (Vec<usize>, Vec<usize>) {
    let mut offsets = vec![0usize; targets + 1];
    for &s in src {
        if s >= 0 {
            offsets[s as usize + 1] += 1;
        }
    }
    for i in 0..targets {
        offsets[i + 1] += offsets[i];
    }
    let mut next = offsets.clone();
    let mut items = vec![0usize; offsets[targets]];
    for (r, &s) in src.iter().enumerate() {
        if s >= 0 {
            items[next[s as usize]] = r;
            next[s as usize] += 1;
        }
    }
    (offsets, items)
}

/// `dst += a · src`, elementwise.
fn axpy<T: FloatStorage>(dst: &mut [T], a: T, src: &[T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += a * s;
    }
}

/// The order of top-k: larger value first, then lower index. A total order on
/// NaN-free values, so selection is deterministic.
fn desc_then_index<T: FloatStorage>(row: &[T], a: usize, b: usize) -> Ordering {
    row[b]
        .partial_cmp(&row[a])
        .unwrap_or(Ordering::Equal)
        .then(a.cmp(&b))
}

/// Sorts `cand` so that its first `k` entries are the best `k` of `row`, in
/// descending order (ties to the lower index); the rest are left unordered.
fn select_top<T: FloatStorage>(row: &[T], cand: &mut [usize], k: usize) {
    if k == 0 || cand.is_empty() {
        return;
    }
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, |&a, &b| desc_then_index(row, a, b));
    }
    let k = k.min(cand.len());
    cand[..k].sort_unstable_by(|&a, &b| desc_then_index(row, a, b));
}

use crate::backend::{check_topk_args, GroupLimit};

/// Top-k of one row, written to `out: [k]`; `cand` and `gscore` are scratch.
fn topk_row<T: FloatStorage>(
    row: &[T],
    out: &mut [i32],
    limit: Option<GroupLimit>,
    cand: &mut Vec<usize>,
    gscore: &mut Vec<(f64, usize)>,
) {
    let k = out.len();
    cand.clear();
    match limit {
        None => cand.extend(0..row.len()),
        Some(gl) => {
            gscore.clear();
            for g in 0..gl.groups {
                let base = g * gl.per_group;
                cand.clear();
                cand.extend(base..base + gl.per_group);
                select_top(row, cand, gl.score_top);
                let s: f64 = cand[..gl.score_top].iter().map(|&i| row[i].to_f64()).sum();
                // +inf and -inf in one group sum to NaN; rank such a group last.
                gscore.push((if s.is_nan() { f64::NEG_INFINITY } else { s }, g));
            }
            gscore.sort_by(|a, b| {
                b.0.partial_cmp(&a.0)
                    .unwrap_or(Ordering::Equal)
                    .then(a.1.cmp(&b.1))
            });
            cand.clear();
            for &(_, g) in &gscore[..gl.keep_groups] {
                let base = g * gl.per_group;
                cand.extend(base..base + gl.per_group);
            }
        }
    }
    select_top(row, cand, k);
    for (o, &c) in out.iter_mut().zip(cand.iter()) {
        *o = c as i32;
    }
}

fn topk_impl<T: FloatStorage>(
    x: &Tensor<Cpu>,
    k: usize,
    n_groups: usize,
    group_top_k: usize,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "topk";
    let (t, e) = x.dims2(OP)?;
    let xv = T::slice(x, OP)?;
    if e == 0 {
        return Err(KernelError::Empty {
            op: OP,
            what: "the expert dimension E of x",
        });
    }
    if e > i32::MAX as usize {
        return Err(arg_err(OP, format!("E = {e} does not fit an i32 index")));
    }
    let limit = check_topk_args(OP, e, k, n_groups, group_top_k)?;
    if let Some(v) = xv.iter().find(|v| v.to_f64().is_nan()) {
        return Err(KernelError::NonFinite {
            op: OP,
            what: "x",
            value: v.to_f64(),
        });
    }
    let mut out = vec![0i32; t * k];
    let run = |rows: &mut [i32], first: usize| {
        let mut cand = Vec::with_capacity(e);
        let mut gscore = Vec::new();
        for (i, o) in rows.chunks_mut(k).enumerate() {
            let r = first + i;
            topk_row(&xv[r * e..(r + 1) * e], o, limit, &mut cand, &mut gscore);
        }
    };
    if t * e < PARALLEL_MIN_WORK {
        run(&mut out, 0);
    } else {
        let per = rows_per_task(e);
        out.par_chunks_mut(per * k)
            .enumerate()
            .for_each(|(c, rows)| run(rows, c * per));
    }
    index_tensor(out, &[t, k])
}

/// Checks that `idx` is an i32 `[T, K]` tensor for `x: [T, E]` and returns it.
fn col_index<'a>(
    op: &'static str,
    idx: &'a Tensor<Cpu>,
    t: usize,
    cols: usize,
) -> Result<(&'a [i32], usize)> {
    let iv = index_slice(idx, op)?;
    let (ti, k) = idx.dims2(op)?;
    if ti != t {
        return Err(shape_err(
            op,
            format!(
                "idx has shape {:?} but the values have {t} rows",
                idx.shape()
            ),
        ));
    }
    check_range(op, iv, 0, cols as i64)?;
    Ok((iv, k))
}

fn gather_cols_impl<T: FloatStorage>(x: &Tensor<Cpu>, idx: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "gather_cols";
    let (t, e) = x.dims2(OP)?;
    let xv = T::slice(x, OP)?;
    let (iv, k) = col_index(OP, idx, t, e)?;
    let out: Vec<T> = iv
        .iter()
        .enumerate()
        .map(|(p, &c)| xv[(p / k) * e + c as usize])
        .collect();
    T::tensor(out, &[t, k])
}

fn scatter_cols_impl<T: FloatStorage>(
    v: &Tensor<Cpu>,
    idx: &Tensor<Cpu>,
    cols: usize,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "scatter_cols";
    let (t, k) = v.dims2(OP)?;
    let vv = T::slice(v, OP)?;
    let (iv, ki) = col_index(OP, idx, t, cols)?;
    if ki != k {
        return Err(shape_err(
            OP,
            format!(
                "v has shape {:?}, idx has shape {:?}",
                v.shape(),
                idx.shape()
            ),
        ));
    }
    let mut out = pool::zeroed::<T>(t * cols);
    for (p, &c) in iv.iter().enumerate() {
        out[(p / k) * cols + c as usize] += vv[p];
    }
    T::tensor(out, &[t, cols])
}

/// Checks that `ids` is a 1-d i32 tensor and returns its values.
fn ids_1d<'a>(op: &'static str, ids: &'a Tensor<Cpu>) -> Result<&'a [i32]> {
    let iv = index_slice(ids, op)?;
    if ids.shape().len() != 1 {
        return Err(shape_err(
            op,
            format!("ids must be 1-d [T], got shape {:?}", ids.shape()),
        ));
    }
    Ok(iv)
}

fn embedding_impl<T: FloatStorage>(table: &Tensor<Cpu>, ids: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "embedding";
    let (v, d) = table.dims2(OP)?;
    let tv = T::slice(table, OP)?;
    let iv = ids_1d(OP, ids)?;
    check_range(OP, iv, 0, v as i64)?;
    let mut out = pool::take::<T>(iv.len() * d);
    for_each_row(&mut out, d, |r, o| {
        let s = iv[r] as usize;
        o.copy_from_slice(&tv[s * d..(s + 1) * d]);
    });
    T::tensor(out, &[iv.len(), d])
}

/// `out: [targets, D]` where row `i` sums the rows `src` maps to it, each
/// scaled by `scale(r)`, in increasing `r`. `src` values must be range-checked.
fn scatter_rows<T: FloatStorage>(
    src_rows: &[T],
    src: &[i32],
    d: usize,
    targets: usize,
    scale: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let (offsets, items) = invert(src, targets);
    // Each row is cleared by the task that sums into it (on rayon's pool,
    // not as a serial memset of a new buffer on the calling thread).
    let mut out = pool::take::<T>(targets * d);
    for_each_row(&mut out, d, |i, o| {
        o.fill(T::ZERO);
        for &r in &items[offsets[i]..offsets[i + 1]] {
            axpy(o, scale(r), &src_rows[r * d..(r + 1) * d]);
        }
    });
    out
}

fn embedding_backward_impl<T: FloatStorage>(
    dy: &Tensor<Cpu>,
    ids: &Tensor<Cpu>,
    vocab: usize,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "embedding_backward";
    let (t, d) = dy.dims2(OP)?;
    let dyv = T::slice(dy, OP)?;
    let iv = ids_1d(OP, ids)?;
    if iv.len() != t {
        return Err(shape_err(
            OP,
            format!(
                "dy has shape {:?}, ids has shape {:?}",
                dy.shape(),
                ids.shape()
            ),
        ));
    }
    check_range(OP, iv, 0, vocab as i64)?;
    let out = scatter_rows(dyv, iv, d, vocab, |_| T::ONE);
    T::tensor(out, &[vocab, d])
}

/// Checks an expert-index tensor `idx: [T, K]` against `n_experts`.
fn expert_index<'a>(
    op: &'static str,
    idx: &'a Tensor<Cpu>,
    n_experts: usize,
) -> Result<(&'a [i32], usize, usize)> {
    let iv = index_slice(idx, op)?;
    let (t, k) = idx.dims2(op)?;
    if n_experts == 0 {
        return Err(arg_err(op, "n_experts = 0: there is no expert to route to"));
    }
    if n_experts > i32::MAX as usize || iv.len() > i32::MAX as usize {
        return Err(arg_err(
            op,
            format!(
                "n_experts = {n_experts} or T·K = {} does not fit an i32 index",
                iv.len()
            ),
        ));
    }
    check_range(op, iv, 0, n_experts as i64)?;
    Ok((iv, t, k))
}

fn routing_plan_impl(idx: &Tensor<Cpu>, n_experts: usize) -> Result<RoutingPlan<Cpu>> {
    const OP: &str = "routing_plan";
    let (iv, _, _) = expert_index(OP, idx, n_experts)?;
    let (offsets, items) = invert(iv, n_experts);
    // `items` is already expert-major and stable in (token, choice) order.
    let n = items.len();
    let k = idx.shape()[1];
    let mut row_src = vec![0i32; n];
    let mut slot = vec![0i32; n];
    for (row, &copy) in items.iter().enumerate() {
        row_src[row] = (copy / k) as i32;
        slot[copy] = row as i32;
    }
    let counts = offsets.windows(2).map(|w| (w[1] - w[0]) as i32).collect();
    Ok(RoutingPlan {
        row_src: index_tensor(row_src, &[n])?,
        slot: index_tensor(slot, idx.shape())?,
        counts: index_tensor(counts, &[n_experts])?,
    })
}

/// For each expert, which of its copies (positions in `[T·K]`, listed in
/// increasing order in `items[offsets[e]..offsets[e + 1]]`) it keeps.
fn kept_copies<T: FloatStorage>(
    probs: &[T],
    offsets: &[usize],
    items: &[usize],
    capacity: usize,
    policy: DropPolicy,
) -> Vec<Vec<usize>> {
    offsets
        .windows(2)
        .map(|w| {
            let mine = &items[w[0]..w[1]];
            let mut keep: Vec<usize> = match policy {
                DropPolicy::Position => mine.iter().copied().take(capacity).collect(),
                DropPolicy::Probs => {
                    let mut c = mine.to_vec();
                    if c.len() > capacity {
                        // Highest probability first, the earlier copy on ties.
                        c.select_nth_unstable_by(capacity, |&a, &b| desc_then_index(probs, a, b));
                        c.truncate(capacity);
                    }
                    c
                }
            };
            // Kept rows stay in (token, choice) order inside the expert's block.
            keep.sort_unstable();
            keep
        })
        .collect()
}

fn capacity_plan_impl<T: FloatStorage>(
    idx: &Tensor<Cpu>,
    probs: &Tensor<Cpu>,
    n_experts: usize,
    capacity: usize,
    policy: DropPolicy,
    pad: bool,
) -> Result<RoutingPlan<Cpu>> {
    const OP: &str = "capacity_plan";
    let (iv, t, k) = expert_index(OP, idx, n_experts)?;
    let pv = T::slice(probs, OP)?;
    probs.expect_shape(OP, "probs", &[t, k])?;
    if capacity == 0 {
        return Err(arg_err(OP, "capacity = 0 would drop every token copy"));
    }
    if policy == DropPolicy::Probs {
        if let Some(v) = pv.iter().find(|v| v.to_f64().is_nan()) {
            return Err(KernelError::NonFinite {
                op: OP,
                what: "probs",
                value: v.to_f64(),
            });
        }
    }
    let n_full = n_experts.checked_mul(capacity).ok_or_else(|| {
        arg_err(
            OP,
            format!("n_experts = {n_experts} × capacity = {capacity} overflows"),
        )
    })?;
    let n = if pad { n_full } else { n_full.min(t * k) };
    if n > i32::MAX as usize {
        return Err(arg_err(
            OP,
            format!("{n} permuted rows (n_experts = {n_experts} × capacity = {capacity}) do not fit an i32 index"),
        ));
    }
    let (offsets, items) = invert(iv, n_experts);
    let kept = kept_copies(pv, &offsets, &items, capacity, policy);
    let mut row_src = vec![-1i32; n];
    let mut slot = vec![-1i32; t * k];
    let mut counts = Vec::with_capacity(n_experts);
    let mut row = 0usize;
    for (e, copies) in kept.iter().enumerate() {
        if pad {
            row = e * capacity;
        }
        for &copy in copies {
            row_src[row] = (copy / k) as i32;
            slot[copy] = row as i32;
            row += 1;
        }
        counts.push(if pad { capacity } else { copies.len() } as i32);
    }
    Ok(RoutingPlan {
        row_src: index_tensor(row_src, &[n])?,
        slot: index_tensor(slot, &[t, k])?,
        counts: index_tensor(counts, &[n_experts])?,
    })
}

/// Checks a `row_src: [N]` map against `tokens` (`-1` marks padding rows).
fn row_src_1d<'a>(op: &'static str, row_src: &'a Tensor<Cpu>, tokens: usize) -> Result<&'a [i32]> {
    let rv = index_slice(row_src, op)?;
    if row_src.shape().len() != 1 {
        return Err(shape_err(
            op,
            format!("row_src must be 1-d [N], got shape {:?}", row_src.shape()),
        ));
    }
    check_range(op, rv, -1, tokens as i64)?;
    Ok(rv)
}

fn permute_impl<T: FloatStorage>(x: &Tensor<Cpu>, row_src: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "permute";
    let (t, d) = x.dims2(OP)?;
    let xv = T::slice(x, OP)?;
    let rv = row_src_1d(OP, row_src, t)?;
    let mut out = pool::take::<T>(rv.len() * d);
    for_each_row(&mut out, d, |n, o| match usize::try_from(rv[n]) {
        Ok(s) => o.copy_from_slice(&xv[s * d..(s + 1) * d]),
        Err(_) => o.fill(T::ZERO),
    });
    T::tensor(out, &[rv.len(), d])
}

fn permute_backward_impl<T: FloatStorage>(
    dy: &Tensor<Cpu>,
    row_src: &Tensor<Cpu>,
    tokens: usize,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "permute_backward";
    let (n, d) = dy.dims2(OP)?;
    let dyv = T::slice(dy, OP)?;
    let rv = row_src_1d(OP, row_src, tokens)?;
    if rv.len() != n {
        return Err(shape_err(
            OP,
            format!(
                "dy has shape {:?}, row_src has shape {:?}",
                dy.shape(),
                row_src.shape()
            ),
        ));
    }
    let out = scatter_rows(dyv, rv, d, tokens, |_| T::ONE);
    T::tensor(out, &[tokens, d])
}

fn unpermute_impl<T: FloatStorage>(y: &Tensor<Cpu>, slot: &Tensor<Cpu>) -> Result<Tensor<Cpu>> {
    const OP: &str = "unpermute";
    let (t, k, n, d) = unpermute_args(OP, y, slot)?;
    let yv = T::slice(y, OP)?;
    let sv = index_slice(slot, OP)?;
    check_range(OP, sv, -1, n as i64)?;
    let mut out = pool::take::<T>(t * d);
    for_each_row(&mut out, d, |tok, o| {
        o.fill(T::ZERO);
        for &s in &sv[tok * k..(tok + 1) * k] {
            if let Ok(r) = usize::try_from(s) {
                for (o, &v) in o.iter_mut().zip(&yv[r * d..(r + 1) * d]) {
                    *o += v;
                }
            }
        }
    });
    T::tensor(out, &[t, d])
}

fn permute_weights_impl<T: FloatStorage>(
    w: &Tensor<Cpu>,
    slot: &Tensor<Cpu>,
    rows: usize,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "permute_weights";
    permute_weights_args(OP, w, slot)?;
    let wv = T::slice(w, OP)?;
    let sv = index_slice(slot, OP)?;
    check_range(OP, sv, -1, rows as i64)?;
    let mut out = vec![T::ZERO; rows];
    for (&s, &wc) in sv.iter().zip(wv) {
        if let Ok(r) = usize::try_from(s) {
            out[r] = wc;
        }
    }
    T::tensor(out, &[rows])
}

fn permute_weights_backward_impl<T: FloatStorage>(
    dp: &Tensor<Cpu>,
    slot: &Tensor<Cpu>,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "permute_weights_backward";
    let (n, t, k) = permute_weights_backward_args(OP, dp, slot)?;
    let dpv = T::slice(dp, OP)?;
    let sv = index_slice(slot, OP)?;
    check_range(OP, sv, -1, n as i64)?;
    let dw: Vec<T> = sv
        .iter()
        .map(|&s| usize::try_from(s).map_or(T::ZERO, |r| dpv[r]))
        .collect();
    T::tensor(dw, &[t, k])
}

impl RoutingOps for Cpu {
    fn topk(
        &self,
        x: &Tensor<Self>,
        k: usize,
        n_groups: usize,
        group_top_k: usize,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("topk", x, topk_impl(x, k, n_groups, group_top_k))
    }

    fn gather_cols(&self, x: &Tensor<Self>, idx: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("gather_cols", x, gather_cols_impl(x, idx))
    }

    fn scatter_cols(
        &self,
        v: &Tensor<Self>,
        idx: &Tensor<Self>,
        cols: usize,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("scatter_cols", v, scatter_cols_impl(v, idx, cols))
    }

    fn embedding(&self, table: &Tensor<Self>, ids: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("embedding", table, embedding_impl(table, ids))
    }

    fn embedding_backward(
        &self,
        dy: &Tensor<Self>,
        ids: &Tensor<Self>,
        vocab: usize,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "embedding_backward",
            dy,
            embedding_backward_impl(dy, ids, vocab)
        )
    }

    fn routing_plan(&self, idx: &Tensor<Self>, n_experts: usize) -> Result<RoutingPlan<Self>> {
        routing_plan_impl(idx, n_experts)
    }

    fn capacity_plan(
        &self,
        idx: &Tensor<Self>,
        probs: &Tensor<Self>,
        n_experts: usize,
        capacity: usize,
        policy: DropPolicy,
        pad: bool,
    ) -> Result<RoutingPlan<Self>> {
        cpu_float_dispatch!(
            "capacity_plan",
            probs,
            capacity_plan_impl(idx, probs, n_experts, capacity, policy, pad)
        )
    }

    fn permute(&self, x: &Tensor<Self>, row_src: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("permute", x, permute_impl(x, row_src))
    }

    fn permute_backward(
        &self,
        dy: &Tensor<Self>,
        row_src: &Tensor<Self>,
        tokens: usize,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "permute_backward",
            dy,
            permute_backward_impl(dy, row_src, tokens)
        )
    }

    fn unpermute(&self, y: &Tensor<Self>, slot: &Tensor<Self>) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("unpermute", y, unpermute_impl(y, slot))
    }

    fn permute_weights(
        &self,
        w: &Tensor<Self>,
        slot: &Tensor<Self>,
        rows: usize,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("permute_weights", w, permute_weights_impl(w, slot, rows))
    }

    fn permute_weights_backward(
        &self,
        dp: &Tensor<Self>,
        slot: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!(
            "permute_weights_backward",
            dp,
            permute_weights_backward_impl(dp, slot)
        )
    }
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use super::*;
    use crate::cpu::test_util::{
        device_tests, dotv as dot, rng, uniform as rand_vec, Compare, TestDevice, TestOps,
    };
    use crate::gradcheck::assert_grad;
    use crate::tensor::{DType, HostData};
    use crate::Device;

    fn f32t<B: Device>(d: &B, v: &[f64], shape: &[usize]) -> Tensor<B> {
        d.upload(HostData::F32(v.iter().map(|&x| x as f32).collect()), shape)
            .unwrap()
    }

    fn i32t<B: Device>(d: &B, v: &[i32], shape: &[usize]) -> Tensor<B> {
        d.upload(HostData::I32(v.to_vec()), shape).unwrap()
    }

    /// Indices of `cand` sorted by value, largest first; the sort is stable,
    /// so equal values keep the lower index first.
    fn sorted_desc(row: &[f64], mut cand: Vec<usize>) -> Vec<usize> {
        cand.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
        cand
    }

    /// Group-limited top-k by brute force: every subset of `gk` groups is
    /// scored, the best total wins (ties to the lexicographically smallest
    /// subset), then top-k among its experts.
    fn brute_force_topk(row: &[f64], k: usize, groups: usize, gk: usize) -> Vec<usize> {
        let per = row.len() / groups;
        let score: Vec<f64> = (0..groups)
            .map(|g| {
                let best = sorted_desc(row, (g * per..(g + 1) * per).collect());
                best[..k / gk].iter().map(|&i| row[i]).sum()
            })
            .collect();
        let mut best: Option<(f64, Vec<usize>)> = None;
        for mask in 0u32..(1 << groups) {
            if mask.count_ones() as usize != gk {
                continue;
            }
            let set: Vec<usize> = (0..groups).filter(|g| mask & (1 << g) != 0).collect();
            let total: f64 = set.iter().map(|&g| score[g]).sum();
            let better = match &best {
                None => true,
                Some((bt, bs)) => total > *bt || (total == *bt && set < *bs),
            };
            if better {
                best = Some((total, set));
            }
        }
        let (_, set) = best.unwrap();
        let cand = set.iter().flat_map(|&g| g * per..(g + 1) * per).collect();
        sorted_desc(row, cand)[..k].to_vec()
    }

    fn topk_matches_stable_sort_reference_with_ties<B: TestOps>(d: &B) {
        let mut r = rng(10);
        for _ in 0..30 {
            let (t, e) = (r.gen_range(0..6), r.gen_range(1..12));
            let k = r.gen_range(1..=e);
            // Few distinct values, so ties are everywhere; -inf as a masked score.
            let x: Vec<f64> = (0..t * e)
                .map(|_| [-f64::INFINITY, -0.5, 0.0, 0.25, 1.0][r.gen_range(0..5)])
                .collect();
            for dt in [DType::F32, DType::F64] {
                let xt = if dt == DType::F32 {
                    f32t(d, &x, &[t, e])
                } else {
                    d.t64(&x, &[t, e])
                };
                let got = d.topk(&xt, k, 1, 1).unwrap();
                assert_eq!(got.shape(), [t, k]);
                let got = d.hi32(&got);
                for row in 0..t {
                    let want = sorted_desc(&x[row * e..(row + 1) * e], (0..e).collect());
                    let want: Vec<i32> = want[..k].iter().map(|&i| i as i32).collect();
                    assert_eq!(
                        got[row * k..(row + 1) * k],
                        want[..],
                        "row {:?}",
                        &x[row * e..(row + 1) * e]
                    );
                }
            }
        }
        // Large enough for the parallel path; distinct values.
        let (t, e, k) = (300, 128, 8);
        let x = rand_vec(&mut r, t * e);
        let got = d.hi32(&d.topk(&d.t64(&x, &[t, e]), k, 0, 0).unwrap());
        for row in 0..t {
            let want = sorted_desc(&x[row * e..(row + 1) * e], (0..e).collect());
            let want: Vec<i32> = want[..k].iter().map(|&i| i as i32).collect();
            assert_eq!(got[row * k..(row + 1) * k], want[..]);
        }
    }

    fn topk_group_limited_matches_brute_force_over_group_subsets<B: TestOps>(d: &B) {
        let mut r = rng(11);
        for case in 0..200 {
            let groups = r.gen_range(2..6);
            let per = r.gen_range(1..5);
            let e = groups * per;
            let gk = r.gen_range(1..=groups);
            let k = r.gen_range(gk..=gk * per);
            let t = r.gen_range(1..4);
            let x: Vec<f64> = if case % 2 == 0 {
                (0..t * e)
                    .map(|_| [0.0, 0.5, 1.0][r.gen_range(0..3)])
                    .collect()
            } else {
                rand_vec(&mut r, t * e)
            };
            let got = d.hi32(&d.topk(&d.t64(&x, &[t, e]), k, groups, gk).unwrap());
            for row in 0..t {
                let xr = &x[row * e..(row + 1) * e];
                let want: Vec<i32> = brute_force_topk(xr, k, groups, gk)
                    .iter()
                    .map(|&i| i as i32)
                    .collect();
                assert_eq!(
                    got[row * k..(row + 1) * k],
                    want[..],
                    "k={k} groups={groups} gk={gk} row {xr:?}"
                );
            }
        }
    }

    fn topk_rejects_bad_input<B: TestOps>(d: &B) {
        let x = d.t64(&[0.0; 8], &[2, 4]);
        let err = d.topk(&x, 5, 1, 1).unwrap_err();
        assert!(matches!(
            err,
            KernelError::InvalidArgument { op: "topk", .. }
        ));
        assert!(
            err.to_string().contains("k = 5") && err.to_string().contains("E = 4"),
            "{err}"
        );
        let err = d.topk(&x, 0, 1, 1).unwrap_err();
        assert!(err.to_string().contains("k = 0"), "{err}");
        let err = d.topk(&x, 2, 3, 1).unwrap_err();
        assert!(matches!(err, KernelError::InvalidArgument { .. }));
        assert!(err.to_string().contains("n_groups = 3") && err.to_string().contains("E = 4"));
        let err = d.topk(&x, 2, 2, 3).unwrap_err();
        assert!(err.to_string().contains("group_top_k = 3"), "{err}");
        let err = d.topk(&x, 3, 2, 1).unwrap_err();
        assert!(
            err.to_string().contains("k = 3") && err.to_string().contains("2 experts"),
            "{err}"
        );
        let err = d.topk(&x, 1, 2, 2).unwrap_err();
        assert!(err.to_string().contains("group_top_k = 2"), "{err}");

        let nan = f32t(d, &[0.0, f64::NAN, 1.0, 2.0], &[1, 4]);
        let err = d.err_of(d.topk(&nan, 1, 1, 1));
        assert!(matches!(err, KernelError::NonFinite { op: "topk", value, .. } if value.is_nan()));

        let empty = d.t64(&[], &[3, 0]);
        let err = d.topk(&empty, 1, 1, 1).unwrap_err();
        assert!(matches!(err, KernelError::Empty { op: "topk", .. }));
        let xi = i32t(d, &[0; 4], &[1, 4]);
        let err = d.topk(&xi, 1, 1, 1).unwrap_err();
        assert!(matches!(
            err,
            KernelError::UnsupportedDType {
                dtype: DType::I32,
                ..
            }
        ));
        let x1 = d.t64(&[0.0; 4], &[4]);
        let err = d.topk(&x1, 1, 1, 1).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[4]"));
    }

    fn gather_cols_grad_is_scatter_cols<B: TestOps>(d: &B) {
        let mut r = rng(12);
        let (t, e, k) = (4, 5, 3);
        let x = rand_vec(&mut r, t * e);
        // Repeated columns in a row check that scatter accumulates.
        let idx = [0, 4, 4, 1, 2, 3, 3, 3, 3, 0, 1, 2];
        let it = i32t(d, &idx, &[t, k]);
        let rr = rand_vec(&mut r, t * k);
        let got = d.h64(&d.gather_cols(&d.t64(&x, &[t, e]), &it).unwrap());
        for p in 0..t * k {
            assert_eq!(got[p], x[(p / k) * e + idx[p] as usize]);
        }
        let dx = d.h64(&d.scatter_cols(&d.t64(&rr, &[t, k]), &it, e).unwrap());
        assert_grad("gather_cols", &x, &dx, 1e-6, |x| {
            dot(
                &d.h64(&d.gather_cols(&d.t64(x, &[t, e]), &it).unwrap()),
                &rr,
            )
        });
        // scatter_cols is linear in v, with gather_cols as its backward.
        let v = rand_vec(&mut r, t * k);
        let re = rand_vec(&mut r, t * e);
        let dv = d.h64(&d.gather_cols(&d.t64(&re, &[t, e]), &it).unwrap());
        assert_grad("scatter_cols grad", &v, &dv, 1e-6, |v| {
            dot(
                &d.h64(&d.scatter_cols(&d.t64(v, &[t, k]), &it, e).unwrap()),
                &re,
            )
        });
    }

    fn gather_and_scatter_cols_reject_bad_input<B: TestOps>(d: &B) {
        let x = d.t64(&[0.0; 6], &[2, 3]);
        let err = d.err_of(d.gather_cols(&x, &i32t(d, &[0, 3], &[2, 1])));
        assert_eq!(
            err,
            KernelError::IndexOutOfRange {
                op: "gather_cols",
                index: 3,
                lo: 0,
                hi: 3
            }
        );
        let err = d
            .gather_cols(&x, &i32t(d, &[0, 1, 2], &[3, 1]))
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[3, 1]"), "{err}");
        let err = d.gather_cols(&x, &d.t64(&[0.0, 1.0], &[2, 1])).unwrap_err();
        assert!(matches!(
            err,
            KernelError::DTypeMismatch {
                expected: DType::I32,
                got: DType::F64,
                ..
            }
        ));
        let v = d.t64(&[0.0; 2], &[2, 1]);
        let err = d.err_of(d.scatter_cols(&v, &i32t(d, &[0, -1], &[2, 1]), 3));
        assert!(matches!(
            err,
            KernelError::IndexOutOfRange { index: -1, .. }
        ));
        let err = d
            .scatter_cols(&v, &i32t(d, &[0, 1, 0, 1], &[2, 2]), 3)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
    }

    fn embedding_grad_with_repeated_ids<B: TestOps>(dev: &B) {
        let mut r = rng(13);
        let (v, d) = (6, 3);
        let ids = [5, 0, 2, 5, 5, 1, 0];
        let t = ids.len();
        let table = rand_vec(&mut r, v * d);
        let it = i32t(dev, &ids, &[t]);
        let out = dev.h64(&dev.embedding(&dev.t64(&table, &[v, d]), &it).unwrap());
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(
                out[i * d..(i + 1) * d],
                table[id as usize * d..(id as usize + 1) * d]
            );
        }
        let rr = rand_vec(&mut r, t * d);
        let dtable = dev
            .embedding_backward(&dev.t64(&rr, &[t, d]), &it, v)
            .unwrap();
        assert_eq!(dtable.shape(), [v, d]);
        assert_grad("embedding", &table, &dev.h64(&dtable), 1e-6, |tb| {
            dot(
                &dev.h64(&dev.embedding(&dev.t64(tb, &[v, d]), &it).unwrap()),
                &rr,
            )
        });
        // Equal to a sequential sum: large enough for the parallel path, and
        // a vocabulary of Qwen3's size plus one (the inverse's scan splits
        // it over 32 warps with a ragged tail), ids clustered at both ends.
        let sums_in_order = |r: &mut _, v: usize, d: usize, ids: Vec<i32>| {
            let t = ids.len();
            let dy = rand_vec(r, t * d);
            let got = dev.h64(
                &dev.embedding_backward(&dev.t64(&dy, &[t, d]), &i32t(dev, &ids, &[t]), v)
                    .unwrap(),
            );
            let mut want = vec![0.0; v * d];
            for (i, &id) in ids.iter().enumerate() {
                for j in 0..d {
                    want[id as usize * d + j] += dy[i * d + j];
                }
            }
            assert_eq!(got, want, "vocabulary {v}, {t} ids");
        };
        let ids = (0..1000).map(|_| r.gen_range(0..50)).collect();
        sums_in_order(&mut r, 50, 64, ids);
        let v = 151_937;
        let ids = (0..3000)
            .map(|i| match i % 3 {
                0 => r.gen_range(0..64),
                1 => r.gen_range(v as i32 - 64..v as i32),
                _ => r.gen_range(0..v as i32),
            })
            .collect();
        sums_in_order(&mut r, v, 4, ids);
    }

    fn embedding_rejects_bad_ids<B: TestOps>(d: &B) {
        let table = f32t(d, &[0.0; 10], &[5, 2]);
        let err = d.err_of(d.embedding(&table, &i32t(d, &[1, 5], &[2])));
        assert_eq!(
            err,
            KernelError::IndexOutOfRange {
                op: "embedding",
                index: 5,
                lo: 0,
                hi: 5
            }
        );
        assert!(
            err.to_string().contains("index 5 out of range [0, 5)"),
            "{err}"
        );
        let err = d.err_of(d.embedding(&table, &i32t(d, &[-1], &[1])));
        assert!(matches!(
            err,
            KernelError::IndexOutOfRange { index: -1, .. }
        ));
        let err = d.embedding(&table, &f32t(d, &[1.0], &[1])).unwrap_err();
        assert!(matches!(
            err,
            KernelError::DTypeMismatch {
                expected: DType::I32,
                got: DType::F32,
                ..
            }
        ));
        let err = d.embedding(&table, &i32t(d, &[1, 2], &[1, 2])).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        let dy = f32t(d, &[0.0; 4], &[2, 2]);
        let err = d
            .embedding_backward(&dy, &i32t(d, &[1, 2, 3], &[3]), 5)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[2, 2]") && err.to_string().contains("[3]"));
        let err = d.err_of(d.embedding_backward(&dy, &i32t(d, &[1, 7], &[2]), 5));
        assert!(matches!(
            err,
            KernelError::IndexOutOfRange {
                index: 7,
                hi: 5,
                ..
            }
        ));
    }

    /// Copies of each expert in (token, choice) order: the dropless reference.
    fn copies_by_expert(idx: &[i32], e: usize) -> Vec<Vec<usize>> {
        let mut by = vec![Vec::new(); e];
        for (copy, &x) in idx.iter().enumerate() {
            by[x as usize].push(copy);
        }
        by
    }

    fn routing_plan_is_expert_major_and_stable<B: TestOps>(d: &B) {
        let mut r = rng(14);
        for _ in 0..20 {
            let (t, e) = (r.gen_range(0..9), r.gen_range(1..6));
            let k = r.gen_range(1..=e);
            let idx: Vec<i32> = (0..t * k).map(|_| r.gen_range(0..e as i32)).collect();
            let plan = d.routing_plan(&i32t(d, &idx, &[t, k]), e).unwrap();
            let by = copies_by_expert(&idx, e);
            let order: Vec<usize> = by.iter().flatten().copied().collect();
            let want_src: Vec<i32> = order.iter().map(|&c| (c / k) as i32).collect();
            let mut want_slot = vec![0i32; t * k];
            for (row, &c) in order.iter().enumerate() {
                want_slot[c] = row as i32;
            }
            let want_counts: Vec<i32> = by.iter().map(|v| v.len() as i32).collect();
            assert_eq!(d.hi32(&plan.row_src), want_src);
            assert_eq!(plan.row_src.shape(), [t * k]);
            assert_eq!(d.hi32(&plan.slot), want_slot);
            assert_eq!(plan.slot.shape(), [t, k]);
            assert_eq!(d.hi32(&plan.counts), want_counts);
        }
        // A hand-checked case: expert 1 gets nothing.
        let plan = d
            .routing_plan(&i32t(d, &[2, 0, 0, 2, 2, 0], &[3, 2]), 3)
            .unwrap();
        assert_eq!(d.hi32(&plan.row_src), [0, 1, 2, 0, 1, 2]);
        assert_eq!(d.hi32(&plan.slot), [3, 0, 1, 4, 5, 2]);
        assert_eq!(d.hi32(&plan.counts), [3, 0, 3]);
    }

    fn routing_plan_rejects_bad_input<B: TestOps>(d: &B) {
        let err = d.err_of(
            d.routing_plan(&i32t(d, &[0, 3], &[1, 2]), 3)
                .map(|p| p.row_src),
        );
        assert_eq!(
            err,
            KernelError::IndexOutOfRange {
                op: "routing_plan",
                index: 3,
                lo: 0,
                hi: 3
            }
        );
        let err = d
            .routing_plan(&f32t(d, &[0.0, 1.0], &[1, 2]), 3)
            .unwrap_err();
        assert!(matches!(
            err,
            KernelError::DTypeMismatch {
                expected: DType::I32,
                got: DType::F32,
                ..
            }
        ));
        let err = d.routing_plan(&i32t(d, &[0, 1], &[2]), 3).unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        let err = d.routing_plan(&i32t(d, &[0, 1], &[1, 2]), 0).unwrap_err();
        assert!(matches!(err, KernelError::InvalidArgument { .. }));
        assert!(err.to_string().contains("n_experts = 0"));
    }

    /// Capacity reference: per expert, the kept copies (by policy), in
    /// (token, choice) order.
    fn kept_reference(
        idx: &[i32],
        probs: &[f64],
        e: usize,
        cap: usize,
        policy: DropPolicy,
    ) -> Vec<Vec<usize>> {
        copies_by_expert(idx, e)
            .into_iter()
            .map(|mut c| {
                if policy == DropPolicy::Probs {
                    // Stable: the earlier copy wins a tie.
                    c.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap());
                }
                c.truncate(cap);
                c.sort();
                c
            })
            .collect()
    }

    fn check_capacity_plan<B: TestOps>(
        d: &B,
        idx: &[i32],
        probs: &[f64],
        t: usize,
        k: usize,
        e: usize,
        cap: usize,
    ) {
        for policy in [DropPolicy::Probs, DropPolicy::Position] {
            for pad in [false, true] {
                let plan = d
                    .capacity_plan(
                        &i32t(d, idx, &[t, k]),
                        &f32t(d, probs, &[t, k]),
                        e,
                        cap,
                        policy,
                        pad,
                    )
                    .unwrap();
                let kept = kept_reference(idx, probs, e, cap, policy);
                let n = if pad { e * cap } else { (t * k).min(e * cap) };
                let mut want_src = vec![-1i32; n];
                let mut want_slot = vec![-1i32; t * k];
                let mut row = 0;
                for (ex, c) in kept.iter().enumerate() {
                    if pad {
                        row = ex * cap;
                    }
                    for &copy in c {
                        want_src[row] = (copy / k) as i32;
                        want_slot[copy] = row as i32;
                        row += 1;
                    }
                }
                let want_counts: Vec<i32> = kept
                    .iter()
                    .map(|c| if pad { cap } else { c.len() } as i32)
                    .collect();
                let ctx = format!("{policy:?} pad={pad} idx={idx:?} probs={probs:?} cap={cap}");
                assert_eq!(d.hi32(&plan.row_src), want_src, "{ctx}");
                assert_eq!(d.hi32(&plan.slot), want_slot, "{ctx}");
                assert_eq!(d.hi32(&plan.counts), want_counts, "{ctx}");
            }
        }
    }

    fn capacity_plan_drops_the_right_copies_for_both_policies<B: TestOps>(d: &B) {
        // Hand-checked: expert 0 is over-full (3 copies, capacity 2).
        let idx = [0, 0, 0, 1];
        let probs = [0.1, 0.9, 0.5, 0.3];
        let by_probs = d
            .capacity_plan(
                &i32t(d, &idx, &[4, 1]),
                &d.t64(&probs, &[4, 1]),
                2,
                2,
                DropPolicy::Probs,
                false,
            )
            .unwrap();
        assert_eq!(d.hi32(&by_probs.slot), [-1, 0, 1, 2]);
        assert_eq!(d.hi32(&by_probs.row_src), [1, 2, 3, -1]);
        assert_eq!(d.hi32(&by_probs.counts), [2, 1]);
        let by_pos = d
            .capacity_plan(
                &i32t(d, &idx, &[4, 1]),
                &d.t64(&probs, &[4, 1]),
                2,
                2,
                DropPolicy::Position,
                true,
            )
            .unwrap();
        assert_eq!(d.hi32(&by_pos.slot), [0, 1, -1, 2]);
        assert_eq!(d.hi32(&by_pos.row_src), [0, 1, 3, -1]);
        assert_eq!(d.hi32(&by_pos.counts), [2, 2]);

        let mut r = rng(15);
        for case in 0..40 {
            let (t, e) = (r.gen_range(0..10), r.gen_range(1..5));
            let k = r.gen_range(1..=e);
            let cap = r.gen_range(1..6);
            let idx: Vec<i32> = (0..t * k).map(|_| r.gen_range(0..e as i32)).collect();
            // Every other case uses coarse probabilities, to exercise ties.
            let probs: Vec<f64> = (0..t * k)
                .map(|_| {
                    if case % 2 == 0 {
                        r.gen_range(0..3) as f64 * 0.25
                    } else {
                        r.gen_range(0.0..1.0)
                    }
                })
                .collect();
            check_capacity_plan(d, &idx, &probs, t, k, e, cap);
        }
    }

    fn capacity_plan_rejects_bad_input<B: TestOps>(d: &B) {
        let idx = i32t(d, &[0, 1], &[2, 1]);
        let probs = d.t64(&[0.5, f64::NAN], &[2, 1]);
        let err = d.err_of(
            d.capacity_plan(&idx, &probs, 2, 1, DropPolicy::Probs, false)
                .map(|p| p.row_src),
        );
        assert!(matches!(err, KernelError::NonFinite { what: "probs", .. }));
        let probs = d.t64(&[0.5, 0.5, 0.5], &[3, 1]);
        let err = d
            .capacity_plan(&idx, &probs, 2, 1, DropPolicy::Position, false)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[3, 1]") && err.to_string().contains("[2, 1]"));
        let probs = d.t64(&[0.5, 0.5], &[2, 1]);
        let err = d
            .capacity_plan(&idx, &probs, 2, 0, DropPolicy::Position, true)
            .unwrap_err();
        assert!(matches!(err, KernelError::InvalidArgument { .. }));
        assert!(err.to_string().contains("capacity = 0"));
        let err = d.err_of(
            d.capacity_plan(&idx, &probs, 1, 1, DropPolicy::Position, true)
                .map(|p| p.row_src),
        );
        assert!(matches!(
            err,
            KernelError::IndexOutOfRange {
                index: 1,
                hi: 1,
                ..
            }
        ));
    }

    fn permute_grad_with_padding_rows<B: TestOps>(dev: &B) {
        let mut r = rng(16);
        let (t, d, e, k) = (5, 3, 3, 2);
        let idx: Vec<i32> = vec![0, 1, 0, 2, 0, 1, 0, 2, 0, 1];
        let probs = rand_vec(&mut r, t * k);
        // Capacity 3 with padding: expert 0 drops copies, padding rows appear.
        let plan = dev
            .capacity_plan(
                &i32t(dev, &idx, &[t, k]),
                &dev.t64(&probs, &[t, k]),
                e,
                3,
                DropPolicy::Probs,
                true,
            )
            .unwrap();
        let src = dev.hi32(&plan.row_src);
        assert!(src.contains(&-1));
        let n = src.len();
        let x = rand_vec(&mut r, t * d);
        let px = dev.h64(&dev.permute(&dev.t64(&x, &[t, d]), &plan.row_src).unwrap());
        for (row, &s) in src.iter().enumerate() {
            let want = if s < 0 {
                vec![0.0; d]
            } else {
                x[s as usize * d..(s as usize + 1) * d].to_vec()
            };
            assert_eq!(px[row * d..(row + 1) * d], want[..]);
        }
        let rr = rand_vec(&mut r, n * d);
        let dx = dev
            .permute_backward(&dev.t64(&rr, &[n, d]), &plan.row_src, t)
            .unwrap();
        assert_eq!(dx.shape(), [t, d]);
        assert_grad("permute", &x, &dev.h64(&dx), 1e-6, |x| {
            dot(
                &dev.h64(&dev.permute(&dev.t64(x, &[t, d]), &plan.row_src).unwrap()),
                &rr,
            )
        });
    }

    fn permute_rejects_bad_input<B: TestOps>(d: &B) {
        let x = d.t64(&[0.0; 6], &[3, 2]);
        let err = d.err_of(d.permute(&x, &i32t(d, &[0, -2], &[2])));
        assert_eq!(
            err,
            KernelError::IndexOutOfRange {
                op: "permute",
                index: -2,
                lo: -1,
                hi: 3
            }
        );
        let err = d.err_of(d.permute(&x, &i32t(d, &[3], &[1])));
        assert!(matches!(err, KernelError::IndexOutOfRange { index: 3, .. }));
        let err = d.permute(&x, &d.t64(&[0.0], &[1])).unwrap_err();
        assert!(matches!(err, KernelError::DTypeMismatch { .. }));
        let dy = d.t64(&[0.0; 4], &[2, 2]);
        let err = d
            .permute_backward(&dy, &i32t(d, &[0, 1, 2], &[3]), 3)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[2, 2]") && err.to_string().contains("[3]"));
        let err = d.err_of(d.permute_backward(&dy, &i32t(d, &[0, 4], &[2]), 3));
        assert!(matches!(
            err,
            KernelError::IndexOutOfRange {
                index: 4,
                hi: 3,
                ..
            }
        ));
    }

    /// Combine (`unpermute`, a plain sum of each token's kept copies) and
    /// the routing weights' permutation, on a dropless and a capacity plan:
    /// the values against a direct sum, each backward (combine's is
    /// `permute` of the plan's `row_src`) against finite differences.
    fn unpermute_grad_dropless_and_dropped_copies<B: TestOps>(dev: &B) {
        let mut r = rng(17);
        let (t, d, e, k) = (6, 3, 4, 2);
        let idx: Vec<i32> = vec![0, 1, 0, 2, 0, 1, 1, 0, 0, 2, 3, 0];
        let it = i32t(dev, &idx, &[t, k]);
        let probs = rand_vec(&mut r, t * k);
        let dropless = dev.routing_plan(&it, e).unwrap();
        let capped = dev
            .capacity_plan(
                &it,
                &dev.t64(&probs, &[t, k]),
                e,
                2,
                DropPolicy::Position,
                true,
            )
            .unwrap();
        assert!(dev.hi32(&capped.slot).contains(&-1));
        assert!(dev.hi32(&capped.row_src).contains(&-1));
        for plan in [dropless, capped] {
            let n = plan.row_src.shape()[0];
            let y = rand_vec(&mut r, n * d);
            let w = rand_vec(&mut r, t * k);
            let rr = rand_vec(&mut r, t * d);
            let rn = rand_vec(&mut r, n);
            let slot = dev.hi32(&plan.slot);
            let out = dev.h64(&dev.unpermute(&dev.t64(&y, &[n, d]), &plan.slot).unwrap());
            for tok in 0..t {
                for j in 0..d {
                    let want: f64 = (0..k)
                        .filter(|&c| slot[tok * k + c] >= 0)
                        .map(|c| y[slot[tok * k + c] as usize * d + j])
                        .sum();
                    assert!((out[tok * d + j] - want).abs() < 1e-12);
                }
            }
            let dy = dev.permute(&dev.t64(&rr, &[t, d]), &plan.row_src).unwrap();
            assert_eq!(dy.shape(), [n, d]);
            let obj = |y: &[f64]| {
                let out = dev.unpermute(&dev.t64(y, &[n, d]), &plan.slot).unwrap();
                dot(&dev.h64(&out), &rr)
            };
            assert_grad("unpermute dy", &y, &dev.h64(&dy), 1e-6, obj);
            let p = dev.h64(
                &dev.permute_weights(&dev.t64(&w, &[t, k]), &plan.slot, n)
                    .unwrap(),
            );
            let mut want = vec![0.0; n];
            for (c, &s) in slot.iter().enumerate() {
                if s >= 0 {
                    want[s as usize] = w[c];
                }
            }
            assert_eq!(p, want, "permute_weights");
            let dw = dev
                .permute_weights_backward(&dev.t64(&rn, &[n]), &plan.slot)
                .unwrap();
            assert_eq!(dw.shape(), [t, k]);
            let obj = |w: &[f64]| {
                let p = dev
                    .permute_weights(&dev.t64(w, &[t, k]), &plan.slot, n)
                    .unwrap();
                dot(&dev.h64(&p), &rn)
            };
            assert_grad("permute_weights dw", &w, &dev.h64(&dw), 1e-6, obj);
        }
    }

    fn unpermute_rejects_bad_input<B: TestOps>(d: &B) {
        let y = d.t64(&[0.0; 6], &[3, 2]);
        let err = d.err_of(d.unpermute(&y, &i32t(d, &[0, 3], &[1, 2])));
        assert_eq!(
            err,
            KernelError::IndexOutOfRange {
                op: "unpermute",
                index: 3,
                lo: -1,
                hi: 3
            }
        );
        let err = d.unpermute(&y, &d.t64(&[0.0, 1.0], &[1, 2])).unwrap_err();
        assert!(matches!(err, KernelError::DTypeMismatch { .. }));
        let w = d.t64(&[0.0; 2], &[1, 2]);
        let err = d
            .permute_weights(&w, &i32t(d, &[0, 1, 2], &[1, 3]), 3)
            .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("[1, 2]") && err.to_string().contains("[1, 3]"));
        let err = d.err_of(d.permute_weights(&w, &i32t(d, &[0, 3], &[1, 2]), 3));
        assert!(matches!(err, KernelError::IndexOutOfRange { index: 3, .. }));
        let err = d
            .permute_weights_backward(&d.t64(&[0.0; 6], &[3, 2]), &i32t(d, &[0, 1], &[1, 2]))
            .unwrap_err();
        assert!(err.to_string().contains("[3, 2]"), "{err}");
        let err = d.err_of(
            d.permute_weights_backward(&d.t64(&[0.0; 3], &[3]), &i32t(d, &[0, 5], &[1, 2])),
        );
        assert!(matches!(err, KernelError::IndexOutOfRange { index: 5, .. }));
    }

    /// The whole dropless expert path as the MoE layer runs it, with an
    /// expert that receives no token: permute → gate and up grouped GEMMs →
    /// SwiGLU weighted by the permuted routing weights → combine, and back.
    fn moe_dispatch_chain_grad_with_empty_expert<B: TestOps>(dev: &B) {
        let mut r = rng(18);
        let (t, d, f, e, k) = (5, 3, 2, 4, 2);
        let idx: Vec<i32> = vec![0, 2, 2, 0, 3, 0, 0, 2, 3, 2];
        let plan = dev.routing_plan(&i32t(dev, &idx, &[t, k]), e).unwrap();
        assert_eq!(dev.hi32(&plan.counts)[1], 0);
        let n = plan.row_src.numel();
        let x = rand_vec(&mut r, t * d);
        let wg = rand_vec(&mut r, e * d * f);
        let wu = rand_vec(&mut r, e * d * f);
        let wts = rand_vec(&mut r, t * k);
        let rr = rand_vec(&mut r, t * f);
        let w3 = |v: &[f64]| dev.t64(v, &[e, d, f]);
        let fwd = |x: &[f64], wg: &[f64], wts: &[f64]| {
            let xp = dev.permute(&dev.t64(x, &[t, d]), &plan.row_src).unwrap();
            let gate = dev
                .grouped_matmul(&xp, &w3(wg), &plan.counts, false)
                .unwrap();
            let up = dev
                .grouped_matmul(&xp, &w3(&wu), &plan.counts, false)
                .unwrap();
            let p = dev
                .permute_weights(&dev.t64(wts, &[t, k]), &plan.slot, n)
                .unwrap();
            let act = dev.swiglu_weighted(&gate, &up, &p).unwrap();
            let out = dev.unpermute(&act, &plan.slot).unwrap();
            (xp, gate, up, p, dot(&dev.h64(&out), &rr))
        };
        let (xp, gate, up, p, _) = fwd(&x, &wg, &wts);
        let dact = dev.permute(&dev.t64(&rr, &[t, f]), &plan.row_src).unwrap();
        let (dgate, dup, dp) = dev.swiglu_weighted_backward(&gate, &up, &p, &dact).unwrap();
        let dwts = dev.permute_weights_backward(&dp, &plan.slot).unwrap();
        let dwg = dev
            .grouped_matmul_weight_grad(&xp, &dgate, &plan.counts)
            .unwrap();
        let dxp = dev
            .grouped_matmul_sum2(&dgate, &w3(&wg), &dup, &w3(&wu), &plan.counts, true)
            .unwrap();
        let dx = dev.permute_backward(&dxp, &plan.row_src, t).unwrap();
        assert_grad("chain dx", &x, &dev.h64(&dx), 1e-6, |x| fwd(x, &wg, &wts).4);
        assert_grad("chain dw", &wg, &dev.h64(&dwg), 1e-6, |w| {
            fwd(&x, w, &wts).4
        });
        assert_grad("chain dwts", &wts, &dev.h64(&dwts), 1e-6, |w| {
            fwd(&x, &wg, w).4
        });
    }

    /// Every routing op on random f32 (and bf16 where the device stores it)
    /// inputs against the CPU: indices and plans must match exactly (bf16
    /// ties are broken the same way on both sides, as the CPU sees the same
    /// rounded values), values within the tolerance.
    fn routing_matches_cpu<B: TestOps>(d: &B) {
        for dtype in Compare::precisions(d) {
            let mut c = Compare::new(d, dtype, 90);
            // Rows of a multiple of 8 (the vector paths of the CUDA kernels)
            // and rows that are not.
            for dim in [48, 13] {
                let (t, e, k, v) = (300, 64, 6, 50);
                let (x, xc) = c.rand(&[t, e], 3.0);
                for (groups, gk) in [(1, 1), (8, 3)] {
                    let got = d.hi32(&d.topk(&x, k, groups, gk).unwrap());
                    let want = Cpu
                        .download(&Cpu.topk(&xc, k, groups, gk).unwrap())
                        .unwrap();
                    assert_eq!(
                        got,
                        want.to_i32().unwrap(),
                        "topk groups={groups} ({dtype:?})"
                    );
                }
                let idx_h = Cpu
                    .download(&Cpu.topk(&xc, k, 1, 1).unwrap())
                    .unwrap()
                    .to_i32()
                    .unwrap();
                let (idx, idxc) = c.idx(&idx_h, &[t, k]);
                c.check(
                    "gather_cols",
                    &d.gather_cols(&x, &idx).unwrap(),
                    &Cpu.gather_cols(&xc, &idxc).unwrap(),
                );
                let (pv, pvc) = c.rand(&[t, k], 1.0);
                c.check(
                    "scatter_cols",
                    &d.scatter_cols(&pv, &idx, e).unwrap(),
                    &Cpu.scatter_cols(&pvc, &idxc, e).unwrap(),
                );
                let ids_h: Vec<i32> = (0..t).map(|i| ((i * i * 7 + 3) % v) as i32).collect();
                let (ids, idsc) = c.idx(&ids_h, &[t]);
                let (table, tablec) = c.rand(&[v, dim], 1.0);
                c.check(
                    "embedding",
                    &d.embedding(&table, &ids).unwrap(),
                    &Cpu.embedding(&tablec, &idsc).unwrap(),
                );
                let (dy, dyc) = c.rand(&[t, dim], 1.0);
                c.check(
                    "embedding_backward",
                    &d.embedding_backward(&dy, &ids, v).unwrap(),
                    &Cpu.embedding_backward(&dyc, &idsc, v).unwrap(),
                );
                let plan_eq = |what: &str, a: &RoutingPlan<B>, b: &RoutingPlan<Cpu>| {
                    let h = |t: &Tensor<Cpu>| Cpu.download(t).unwrap().to_i32().unwrap();
                    assert_eq!(d.hi32(&a.row_src), h(&b.row_src), "{what} row_src");
                    assert_eq!(d.hi32(&a.slot), h(&b.slot), "{what} slot");
                    assert_eq!(d.hi32(&a.counts), h(&b.counts), "{what} counts");
                };
                plan_eq(
                    "routing_plan",
                    &d.routing_plan(&idx, e).unwrap(),
                    &Cpu.routing_plan(&idxc, e).unwrap(),
                );
                let (probs, probsc) = c.rand(&[t, k], 1.0);
                let cap = t * k / e * 3 / 4;
                for policy in [DropPolicy::Probs, DropPolicy::Position] {
                    for pad in [false, true] {
                        plan_eq(
                            &format!("capacity_plan {policy:?} pad={pad}"),
                            &d.capacity_plan(&idx, &probs, e, cap, policy, pad).unwrap(),
                            &Cpu.capacity_plan(&idxc, &probsc, e, cap, policy, pad)
                                .unwrap(),
                        );
                    }
                }
                // The dispatcher chain on a padded capacity plan (padding rows
                // and dropped copies included).
                let plan = d
                    .capacity_plan(&idx, &probs, e, cap, DropPolicy::Probs, true)
                    .unwrap();
                let planc = Cpu
                    .capacity_plan(&idxc, &probsc, e, cap, DropPolicy::Probs, true)
                    .unwrap();
                let n = plan.row_src.numel();
                let (h, hc) = c.rand(&[t, dim], 1.0);
                c.check(
                    "permute",
                    &d.permute(&h, &plan.row_src).unwrap(),
                    &Cpu.permute(&hc, &planc.row_src).unwrap(),
                );
                let (dp, dpc) = c.rand(&[n, dim], 1.0);
                c.check(
                    "permute_backward",
                    &d.permute_backward(&dp, &plan.row_src, t).unwrap(),
                    &Cpu.permute_backward(&dpc, &planc.row_src, t).unwrap(),
                );
                let (y, yc) = c.rand(&[n, dim], 1.0);
                let (w, wc) = c.rand(&[t, k], 1.0);
                c.check(
                    "unpermute",
                    &d.unpermute(&y, &plan.slot).unwrap(),
                    &Cpu.unpermute(&yc, &planc.slot).unwrap(),
                );
                c.check(
                    "permute_weights",
                    &d.permute_weights(&w, &plan.slot, n).unwrap(),
                    &Cpu.permute_weights(&wc, &planc.slot, n).unwrap(),
                );
                let (dpw, dpwc) = c.rand(&[n], 1.0);
                c.check(
                    "permute_weights_backward",
                    &d.permute_weights_backward(&dpw, &plan.slot).unwrap(),
                    &Cpu.permute_weights_backward(&dpwc, &planc.slot).unwrap(),
                );
            }
            c.report("routing");
        }
    }

    /// Shapes past the fast paths of the device kernels: an expert's segment
    /// longer than the inverse's shared-memory stage (8192 copies), and rows
    /// of more experts than a warp has lanes, several picks per lane.
    fn routing_at_long_segments_and_wide_rows_matches_cpu<B: TestOps>(d: &B) {
        let mut r = rng(13);
        let (t, k, e) = (5000, 2, 3);
        // Most copies go to expert 0 (about 9,000 of 10,000).
        let idx_h: Vec<i32> = (0..t * k)
            .map(|_| {
                if r.gen_range(0..10) < 9 {
                    0
                } else {
                    r.gen_range(1..3)
                }
            })
            .collect();
        let h = |t: &Tensor<Cpu>| Cpu.download(t).unwrap().to_i32().unwrap();
        let plan = d.routing_plan(&i32t(d, &idx_h, &[t, k]), e).unwrap();
        let want = Cpu.routing_plan(&i32t(&Cpu, &idx_h, &[t, k]), e).unwrap();
        assert_eq!(d.hi32(&plan.row_src), h(&want.row_src), "row_src");
        assert_eq!(d.hi32(&plan.slot), h(&want.slot), "slot");
        assert_eq!(d.hi32(&plan.counts), h(&want.counts), "counts");
        for (t, e, k, groups, gk) in [(70, 300, 12, 1, 1), (40, 256, 8, 8, 4)] {
            let x = rand_vec(&mut r, t * e);
            let got = d.hi32(&d.topk(&d.t64(&x, &[t, e]), k, groups, gk).unwrap());
            let want = h(&Cpu.topk(&Cpu.t64(&x, &[t, e]), k, groups, gk).unwrap());
            assert_eq!(got, want, "topk t={t} e={e} k={k} groups={groups}");
        }
    }

    device_tests!(
        routing_matches_cpu,
        routing_at_long_segments_and_wide_rows_matches_cpu,
        topk_matches_stable_sort_reference_with_ties,
        topk_group_limited_matches_brute_force_over_group_subsets,
        topk_rejects_bad_input,
        gather_cols_grad_is_scatter_cols,
        gather_and_scatter_cols_reject_bad_input,
        embedding_grad_with_repeated_ids,
        embedding_rejects_bad_ids,
        routing_plan_is_expert_major_and_stable,
        routing_plan_rejects_bad_input,
        capacity_plan_drops_the_right_copies_for_both_policies,
        capacity_plan_rejects_bad_input,
        permute_grad_with_padding_rows,
        permute_rejects_bad_input,
        unpermute_grad_dropless_and_dropped_copies,
        unpermute_rejects_bad_input,
        moe_dispatch_chain_grad_with_empty_expert,
    );
}
