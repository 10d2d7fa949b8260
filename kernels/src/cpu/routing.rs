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

use super::{index_slice, index_tensor, Cpu, FloatStorage};
use crate::backend::{DropPolicy, RoutingOps, RoutingPlan};
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

/// Group-limit parameters, validated.
#[derive(Clone, Copy)]
struct GroupLimit {
    groups: usize,
    per_group: usize,
    keep_groups: usize,
    /// Values summed into a group's score: `k / keep_groups`.
    score_top: usize,
}

fn check_topk_args(
    op: &'static str,
    e: usize,
    k: usize,
    n_groups: usize,
    group_top_k: usize,
) -> Result<Option<GroupLimit>> {
    if k == 0 || k > e {
        return Err(arg_err(
            op,
            format!("k = {k} must be in 1..={e} (the number of experts E = {e})"),
        ));
    }
    if n_groups <= 1 {
        return Ok(None);
    }
    if e % n_groups != 0 {
        return Err(arg_err(
            op,
            format!("n_groups = {n_groups} does not divide the E = {e} experts"),
        ));
    }
    if group_top_k == 0 || group_top_k > n_groups {
        return Err(arg_err(
            op,
            format!("group_top_k = {group_top_k} must be in 1..={n_groups} (n_groups)"),
        ));
    }
    let per_group = e / n_groups;
    if k > group_top_k * per_group {
        return Err(arg_err(
            op,
            format!(
                "k = {k} exceeds the {} experts of the best group_top_k = {group_top_k} groups of {per_group}",
                group_top_k * per_group
            ),
        ));
    }
    if k < group_top_k {
        return Err(arg_err(
            op,
            format!(
                "k = {k} < group_top_k = {group_top_k}: a group would score the sum of k / group_top_k = 0 values"
            ),
        ));
    }
    Ok(Some(GroupLimit {
        groups: n_groups,
        per_group,
        keep_groups: group_top_k,
        score_top: k / group_top_k,
    }))
}

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
    let mut out = vec![T::ZERO; t * cols];
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
    let mut out = vec![T::ZERO; iv.len() * d];
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
    let mut out = vec![T::ZERO; targets * d];
    for_each_row(&mut out, d, |i, o| {
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
    let mut out = vec![T::ZERO; rv.len() * d];
    for_each_row(&mut out, d, |n, o| {
        if let Ok(s) = usize::try_from(rv[n]) {
            o.copy_from_slice(&xv[s * d..(s + 1) * d]);
        }
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

/// Checks the combine operands `y: [N, D]`, `slot: [T, K]` (i32 in
/// `[-1, N)`), `w: [T, K]` and returns `(y, slot, w, T, K, N, D)`.
#[allow(clippy::type_complexity)]
fn combine_args<'a, T: FloatStorage>(
    op: &'static str,
    y: &'a Tensor<Cpu>,
    slot: &'a Tensor<Cpu>,
    w: &'a Tensor<Cpu>,
) -> Result<(&'a [T], &'a [i32], &'a [T], usize, usize, usize, usize)> {
    let (n, d) = y.dims2(op)?;
    let yv = T::slice(y, op)?;
    let sv = index_slice(slot, op)?;
    let (t, k) = slot.dims2(op)?;
    let wv = T::slice(w, op)?;
    w.expect_shape(op, "w", &[t, k])?;
    check_range(op, sv, -1, n as i64)?;
    Ok((yv, sv, wv, t, k, n, d))
}

fn unpermute_impl<T: FloatStorage>(
    y: &Tensor<Cpu>,
    slot: &Tensor<Cpu>,
    w: &Tensor<Cpu>,
) -> Result<Tensor<Cpu>> {
    const OP: &str = "unpermute";
    let (yv, sv, wv, t, k, _, d) = combine_args::<T>(OP, y, slot, w)?;
    let mut out = vec![T::ZERO; t * d];
    for_each_row(&mut out, d, |tok, o| {
        for j in tok * k..(tok + 1) * k {
            if let Ok(r) = usize::try_from(sv[j]) {
                axpy(o, wv[j], &yv[r * d..(r + 1) * d]);
            }
        }
    });
    T::tensor(out, &[t, d])
}

fn unpermute_backward_impl<T: FloatStorage>(
    dout: &Tensor<Cpu>,
    y: &Tensor<Cpu>,
    slot: &Tensor<Cpu>,
    w: &Tensor<Cpu>,
) -> Result<(Tensor<Cpu>, Tensor<Cpu>)> {
    const OP: &str = "unpermute_backward";
    let (yv, sv, wv, t, k, n, d) = combine_args::<T>(OP, y, slot, w)?;
    let dov = T::slice(dout, OP)?;
    dout.expect_shape(OP, "dout", &[t, d])?;
    // dy[r] = Σ over the copies (t, j) placed at row r of w[t, j] · dout[t].
    let (offsets, items) = invert(sv, n);
    let mut dy = vec![T::ZERO; n * d];
    for_each_row(&mut dy, d, |r, o| {
        for &copy in &items[offsets[r]..offsets[r + 1]] {
            let tok = copy / k;
            axpy(o, wv[copy], &dov[tok * d..(tok + 1) * d]);
        }
    });
    // dw[t, j] = dout[t] · y[slot[t, j]], zero for a dropped copy.
    let dw: Vec<T> = sv
        .iter()
        .enumerate()
        .map(|(copy, &s)| match usize::try_from(s) {
            Ok(r) => {
                let tok = copy / k;
                dov[tok * d..(tok + 1) * d]
                    .iter()
                    .zip(&yv[r * d..(r + 1) * d])
                    .fold(T::ZERO, |acc, (&a, &b)| acc + a * b)
            }
            Err(_) => T::ZERO,
        })
        .collect();
    Ok((T::tensor(dy, &[n, d])?, T::tensor(dw, &[t, k])?))
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

    fn unpermute(
        &self,
        y: &Tensor<Self>,
        slot: &Tensor<Self>,
        w: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        cpu_float_dispatch!("unpermute", y, unpermute_impl(y, slot, w))
    }

    fn unpermute_backward(
        &self,
        dout: &Tensor<Self>,
        y: &Tensor<Self>,
        slot: &Tensor<Self>,
        w: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        cpu_float_dispatch!(
            "unpermute_backward",
            y,
            unpermute_backward_impl(dout, y, slot, w)
        )
    }
}
