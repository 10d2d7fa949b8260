//! CUDA top-k, column gathers, embeddings and the MoE dispatcher's
//! permutations (kernels in `routing.cu`), with the checks of
//! `cpu/routing.rs`. Index ranges and NaNs are checked on the device and
//! reported at the next read; every plan size (`N`) follows from shapes
//! alone, so building a plan never waits for the host.
//!
//! Shape letters: T tokens, E experts, K top-k, N permuted rows, D hidden,
//! V vocabulary.

use cudarc::driver::result as drv;

use super::alloc::{driver_err, Block};
use super::compile::{ELEMENTWISE, ROUTING};
use super::{float_sfx, grid_for, launch, rows_cfg, warp_rows_cfg, Cuda};
use crate::backend::{
    permute_weights_args, permute_weights_backward_args, unpermute_args, Device, DropPolicy,
    RoutingOps, RoutingPlan,
};
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

/// Group counts above this do not fit the top-k kernel's group mask.
const MAX_GROUPS: usize = 64;

/// The inverse of an index map on the device: CSR `offsets [targets + 1]`
/// and `items`, each target's sources in increasing order.
struct Inverse {
    offsets: Block,
    items: Block,
}

// Every op finishes its host-side checks before it launches a device-side
// one: an op that returns an error at once must leave no pending check that
// would resurface at the next read.

impl Cuda {
    /// Reports, at the next read, the first entry of `idx` outside `[lo, hi)`
    /// as the CPU's [`KernelError::IndexOutOfRange`].
    pub(super) fn check_range(
        &self,
        op: &'static str,
        idx: &Tensor<Self>,
        lo: i64,
        hi: i64,
    ) -> Result<()> {
        let n = idx.numel();
        if n == 0 {
            return Ok(());
        }
        let code = self.check(move |_, bad| KernelError::IndexOutOfRange {
            op,
            index: bad as i64,
            lo,
            hi,
        })?;
        let f = self.func(ROUTING, "check_range")?;
        launch!(
            self,
            f,
            grid_for(n),
            idx.storage().ptr(),
            n as i64,
            lo,
            hi,
            self.err_ptr(),
            code
        )
    }

    /// Reports the first NaN of `x` as [`KernelError::NonFinite`] naming `what`.
    fn check_nan(&self, op: &'static str, what: &'static str, x: &Tensor<Self>) -> Result<()> {
        let sfx = float_sfx(op, x.dtype())?;
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        let code = self.check(move |_, value| KernelError::NonFinite { op, what, value })?;
        let f = self.func(ROUTING, &format!("check_nan_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(n),
            x.storage().ptr(),
            n as i64,
            self.err_ptr(),
            code
        )
    }

    fn memset_zero(&self, op: &str, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        unsafe { drv::memset_d8_async(ptr, 0, bytes, self.stream().cu_stream()) }
            .map_err(|e| driver_err(op, e))
    }

    /// An i32 tensor of `shape` filled with `v`.
    fn fill_i32(&self, op: &'static str, shape: &[usize], v: i32) -> Result<Tensor<Self>> {
        let t = self.alloc(op, shape, DType::I32)?;
        let n = t.numel();
        if n > 0 {
            let f = self.func(ELEMENTWISE, "fill_i32")?;
            launch!(self, f, grid_for(n), t.storage().ptr(), n as i64, v as f64)?;
        }
        Ok(t)
    }

    /// Inverts `src` (values in `[0, targets)` count, others are skipped) by
    /// count, scan and a stable placement in chunks of rows (`routing.cu`).
    fn invert(&self, op: &'static str, src: &Tensor<Self>, targets: usize) -> Result<Inverse> {
        let n = src.numel();
        let counts = self.scratch(op, targets * 4)?;
        let offsets = self.scratch(op, (targets + 1) * 4)?;
        let items = self.scratch(op, n.max(1) * 4)?;
        self.bind()?;
        self.memset_zero(op, counts.ptr(), targets * 4)?;
        if n > 0 {
            let f = self.func(ROUTING, "inv_count")?;
            launch!(
                self,
                f,
                grid_for(n),
                src.storage().ptr(),
                n as i64,
                targets as i64,
                counts.ptr()
            )?;
        }
        let f = self.func(ROUTING, "inv_scan")?;
        let one_block = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            f,
            one_block,
            counts.ptr(),
            targets as i64,
            offsets.ptr()
        )?;
        if n > 0 && targets > 0 {
            // Chunks of at least 256 rows, few enough that the per-chunk
            // starts stay within INV_CHUNK_CELLS.
            const INV_CHUNK_CELLS: usize = 1 << 22;
            let ch = (n * targets).div_ceil(INV_CHUNK_CELLS).max(256);
            let chunks = n.div_ceil(ch);
            let cc = self.scratch(op, chunks * targets * 4)?;
            self.memset_zero(op, cc.ptr(), chunks * targets * 4)?;
            let (n64, t64, ch64, c64) = (n as i64, targets as i64, ch as i64, chunks as i64);
            let f = self.func(ROUTING, "inv_chunk_count")?;
            launch!(
                self,
                f,
                grid_for(n),
                src.storage().ptr(),
                n64,
                t64,
                ch64,
                cc.ptr()
            )?;
            let f = self.func(ROUTING, "inv_chunk_base")?;
            launch!(
                self,
                f,
                grid_for(targets),
                offsets.ptr(),
                t64,
                c64,
                cc.ptr()
            )?;
            let f = self.func(ROUTING, "inv_chunk_place")?;
            launch!(
                self,
                f,
                warp_rows_cfg(chunks),
                src.storage().ptr(),
                n64,
                t64,
                ch64,
                c64,
                cc.ptr(),
                items.ptr()
            )?;
        }
        Ok(Inverse { offsets, items })
    }

    /// `out: [targets, D]`, row `i` the sum over the sources `r` of target
    /// `i` (in order) of `w[r] · rows[r / kdiv]` (`w` = 1 when absent).
    #[allow(clippy::too_many_arguments)]
    fn seg_sum(
        &self,
        op: &'static str,
        rows: &Tensor<Self>,
        w: Option<&Tensor<Self>>,
        inv: &Inverse,
        targets: usize,
        d: usize,
        kdiv: usize,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(op, rows.dtype())?;
        let out = self.alloc(op, &[targets, d], rows.dtype())?;
        if targets * d > 0 {
            let f = self.func(ROUTING, &format!("seg_sum_{sfx}"))?;
            launch!(
                self,
                f,
                rows_cfg(targets, 256),
                rows.storage().ptr(),
                w.map_or(0u64, |w| w.storage().ptr()),
                inv.offsets.ptr(),
                inv.items.ptr(),
                out.storage().ptr(),
                targets as i64,
                d as i64,
                kdiv as i64
            )?;
        }
        Ok(out)
    }

    /// `out[n] = x[src[n]]` row by row (0 for `-1`), `x: [rows, D]`.
    fn gather_rows(
        &self,
        op: &'static str,
        x: &Tensor<Self>,
        src: &Tensor<Self>,
        rows: usize,
        d: usize,
    ) -> Result<Tensor<Self>> {
        let sfx = float_sfx(op, x.dtype())?;
        let n = src.numel();
        let out = self.alloc(op, &[n, d], x.dtype())?;
        if n * d > 0 {
            let f = self.func(ROUTING, &format!("gather_rows_{sfx}"))?;
            launch!(
                self,
                f,
                rows_cfg(n, 256),
                x.storage().ptr(),
                src.storage().ptr(),
                out.storage().ptr(),
                n as i64,
                rows as i64,
                d as i64
            )?;
        }
        Ok(out)
    }
}

/// The shared top-k checks plus the CUDA kernel's group limit; returns
/// `(groups, per_group, keep_groups, score_top)` (groups = 1 without limit).
fn check_topk_args(
    op: &'static str,
    e: usize,
    k: usize,
    n_groups: usize,
    group_top_k: usize,
) -> Result<(usize, usize, usize, usize)> {
    let Some(limit) = crate::backend::check_topk_args(op, e, k, n_groups, group_top_k)? else {
        return Ok((1, e, 1, k));
    };
    if n_groups > MAX_GROUPS {
        return Err(arg_err(
            op,
            format!(
                "n_groups = {n_groups} exceeds the {MAX_GROUPS} groups the CUDA top-k supports"
            ),
        ));
    }
    Ok((
        limit.groups,
        limit.per_group,
        limit.keep_groups,
        limit.score_top,
    ))
}

/// `K` of `idx: [T, K]` after checking it is i32 with `t` rows.
fn col_index(op: &'static str, idx: &Tensor<Cuda>, t: usize) -> Result<usize> {
    idx.expect_dtype(op, DType::I32)?;
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
    Ok(k)
}

/// Checks that `ids` is a 1-d i32 tensor.
fn ids_1d(op: &'static str, ids: &Tensor<Cuda>) -> Result<usize> {
    ids.expect_dtype(op, DType::I32)?;
    match ids.shape() {
        [t] => Ok(*t),
        other => Err(shape_err(
            op,
            format!("ids must be 1-d [T], got shape {other:?}"),
        )),
    }
}

/// `(T, K)` of an expert-index tensor after the CPU's argument checks.
fn expert_index(op: &'static str, idx: &Tensor<Cuda>, n_experts: usize) -> Result<(usize, usize)> {
    idx.expect_dtype(op, DType::I32)?;
    let (t, k) = idx.dims2(op)?;
    if n_experts == 0 {
        return Err(arg_err(op, "n_experts = 0: there is no expert to route to"));
    }
    if n_experts > i32::MAX as usize || t * k > i32::MAX as usize {
        return Err(arg_err(
            op,
            format!(
                "n_experts = {n_experts} or T·K = {} does not fit an i32 index",
                t * k
            ),
        ));
    }
    Ok((t, k))
}

/// Checks that `row_src` is a 1-d i32 tensor; returns N.
pub(super) fn row_src_1d(op: &'static str, row_src: &Tensor<Cuda>) -> Result<usize> {
    row_src.expect_dtype(op, DType::I32)?;
    match row_src.shape() {
        [n] => Ok(*n),
        other => Err(shape_err(
            op,
            format!("row_src must be 1-d [N], got shape {other:?}"),
        )),
    }
}

impl RoutingOps for Cuda {
    fn topk(
        &self,
        x: &Tensor<Self>,
        k: usize,
        n_groups: usize,
        group_top_k: usize,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "topk";
        let sfx = float_sfx(OP, x.dtype())?;
        let (t, e) = x.dims2(OP)?;
        if e == 0 {
            return Err(KernelError::Empty {
                op: OP,
                what: "the expert dimension E of x",
            });
        }
        if e > i32::MAX as usize {
            return Err(arg_err(OP, format!("E = {e} does not fit an i32 index")));
        }
        let (groups, per_group, keep, score_top) =
            check_topk_args(OP, e, k, n_groups, group_top_k)?;
        let code = self.check(|_, value| KernelError::NonFinite {
            op: OP,
            what: "x",
            value,
        })?;
        let out = self.alloc(OP, &[t, k], DType::I32)?;
        if t > 0 {
            let f = self.func(ROUTING, &format!("topk_{sfx}"))?;
            launch!(
                self,
                f,
                warp_rows_cfg(t),
                x.storage().ptr(),
                out.storage().ptr(),
                t as i64,
                e as i64,
                k as i64,
                groups as i64,
                per_group as i64,
                keep as i64,
                score_top as i64,
                self.err_ptr(),
                code
            )?;
        }
        Ok(out)
    }

    fn gather_cols(&self, x: &Tensor<Self>, idx: &Tensor<Self>) -> Result<Tensor<Self>> {
        const OP: &str = "gather_cols";
        let sfx = float_sfx(OP, x.dtype())?;
        let (t, e) = x.dims2(OP)?;
        let k = col_index(OP, idx, t)?;
        self.check_range(OP, idx, 0, e as i64)?;
        let out = self.alloc(OP, &[t, k], x.dtype())?;
        if t * k > 0 {
            let f = self.func(ROUTING, &format!("gather_cols_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(t * k),
                x.storage().ptr(),
                idx.storage().ptr(),
                out.storage().ptr(),
                t as i64,
                e as i64,
                k as i64
            )?;
        }
        Ok(out)
    }

    fn scatter_cols(
        &self,
        v: &Tensor<Self>,
        idx: &Tensor<Self>,
        cols: usize,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "scatter_cols";
        let sfx = float_sfx(OP, v.dtype())?;
        let (t, k) = v.dims2(OP)?;
        let ki = col_index(OP, idx, t)?;
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
        self.check_range(OP, idx, 0, cols as i64)?;
        let out = self.zeros(&[t, cols], v.dtype())?;
        if t * k > 0 {
            let f = self.func(ROUTING, &format!("scatter_cols_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(t),
                v.storage().ptr(),
                idx.storage().ptr(),
                out.storage().ptr(),
                t as i64,
                k as i64,
                cols as i64
            )?;
        }
        Ok(out)
    }

    fn embedding(&self, table: &Tensor<Self>, ids: &Tensor<Self>) -> Result<Tensor<Self>> {
        const OP: &str = "embedding";
        float_sfx(OP, table.dtype())?;
        let (v, d) = table.dims2(OP)?;
        ids_1d(OP, ids)?;
        self.check_range(OP, ids, 0, v as i64)?;
        self.gather_rows(OP, table, ids, v, d)
    }

    fn embedding_backward(
        &self,
        dy: &Tensor<Self>,
        ids: &Tensor<Self>,
        vocab: usize,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "embedding_backward";
        float_sfx(OP, dy.dtype())?;
        let (t, d) = dy.dims2(OP)?;
        if ids_1d(OP, ids)? != t {
            return Err(shape_err(
                OP,
                format!(
                    "dy has shape {:?}, ids has shape {:?}",
                    dy.shape(),
                    ids.shape()
                ),
            ));
        }
        self.check_range(OP, ids, 0, vocab as i64)?;
        let inv = self.invert(OP, ids, vocab)?;
        self.seg_sum(OP, dy, None, &inv, vocab, d, 1)
    }

    fn routing_plan(&self, idx: &Tensor<Self>, n_experts: usize) -> Result<RoutingPlan<Self>> {
        const OP: &str = "routing_plan";
        let (t, k) = expert_index(OP, idx, n_experts)?;
        self.check_range(OP, idx, 0, n_experts as i64)?;
        let n = t * k;
        let inv = self.invert(OP, idx, n_experts)?;
        let row_src = self.alloc(OP, &[n], DType::I32)?;
        let slot = self.fill_i32(OP, &[t, k], -1)?;
        let counts = self.alloc(OP, &[n_experts], DType::I32)?;
        let f = self.func(ROUTING, "plan_fill")?;
        launch!(
            self,
            f,
            grid_for(n.max(n_experts)),
            inv.offsets.ptr(),
            inv.items.ptr(),
            n as i64,
            k as i64,
            n_experts as i64,
            row_src.storage().ptr(),
            slot.storage().ptr(),
            counts.storage().ptr()
        )?;
        Ok(RoutingPlan {
            row_src,
            slot,
            counts,
        })
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
        const OP: &str = "capacity_plan";
        let sfx = float_sfx(OP, probs.dtype())?;
        let (t, k) = expert_index(OP, idx, n_experts)?;
        probs.expect_shape(OP, "probs", &[t, k])?;
        if capacity == 0 {
            return Err(arg_err(OP, "capacity = 0 would drop every token copy"));
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
        self.check_range(OP, idx, 0, n_experts as i64)?;
        if policy == DropPolicy::Probs {
            self.check_nan(OP, "probs", probs)?;
        }
        let inv = self.invert(OP, idx, n_experts)?;
        let row_src = self.fill_i32(OP, &[n], -1)?;
        let slot = self.fill_i32(OP, &[t, k], -1)?;
        let counts = self.alloc(OP, &[n_experts], DType::I32)?;
        let f = self.func(ROUTING, &format!("cap_place_{sfx}"))?;
        launch!(
            self,
            f,
            grid_for(n_experts),
            probs.storage().ptr(),
            inv.offsets.ptr(),
            inv.items.ptr(),
            n_experts as i64,
            k as i64,
            capacity as i64,
            (policy == DropPolicy::Probs) as i32,
            pad as i32,
            row_src.storage().ptr(),
            slot.storage().ptr(),
            counts.storage().ptr()
        )?;
        Ok(RoutingPlan {
            row_src,
            slot,
            counts,
        })
    }

    fn permute(&self, x: &Tensor<Self>, row_src: &Tensor<Self>) -> Result<Tensor<Self>> {
        const OP: &str = "permute";
        float_sfx(OP, x.dtype())?;
        let (t, d) = x.dims2(OP)?;
        row_src_1d(OP, row_src)?;
        self.check_range(OP, row_src, -1, t as i64)?;
        self.gather_rows(OP, x, row_src, t, d)
    }

    fn permute_backward(
        &self,
        dy: &Tensor<Self>,
        row_src: &Tensor<Self>,
        tokens: usize,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "permute_backward";
        float_sfx(OP, dy.dtype())?;
        let (n, d) = dy.dims2(OP)?;
        let rn = row_src_1d(OP, row_src)?;
        if rn != n {
            return Err(shape_err(
                OP,
                format!(
                    "dy has shape {:?}, row_src has shape {:?}",
                    dy.shape(),
                    row_src.shape()
                ),
            ));
        }
        self.check_range(OP, row_src, -1, tokens as i64)?;
        let inv = self.invert(OP, row_src, tokens)?;
        self.seg_sum(OP, dy, None, &inv, tokens, d, 1)
    }

    fn unpermute(&self, y: &Tensor<Self>, slot: &Tensor<Self>) -> Result<Tensor<Self>> {
        const OP: &str = "unpermute";
        let sfx = float_sfx(OP, y.dtype())?;
        let (t, k, n, d) = unpermute_args(OP, y, slot)?;
        self.check_range(OP, slot, -1, n as i64)?;
        let out = self.alloc(OP, &[t, d], y.dtype())?;
        if t * d > 0 {
            let f = self.func(ROUTING, &format!("unpermute_{sfx}"))?;
            launch!(
                self,
                f,
                rows_cfg(t, 256),
                y.storage().ptr(),
                slot.storage().ptr(),
                out.storage().ptr(),
                t as i64,
                k as i64,
                n as i64,
                d as i64
            )?;
        }
        Ok(out)
    }

    fn permute_weights(
        &self,
        w: &Tensor<Self>,
        slot: &Tensor<Self>,
        rows: usize,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "permute_weights";
        let sfx = float_sfx(OP, w.dtype())?;
        let (t, k) = permute_weights_args(OP, w, slot)?;
        self.check_range(OP, slot, -1, rows as i64)?;
        let p = self.zeros(&[rows], w.dtype())?;
        if t * k > 0 {
            let f = self.func(ROUTING, &format!("permute_w_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(t * k),
                w.storage().ptr(),
                slot.storage().ptr(),
                (t * k) as i64,
                rows as i64,
                p.storage().ptr()
            )?;
        }
        Ok(p)
    }

    fn permute_weights_backward(
        &self,
        dp: &Tensor<Self>,
        slot: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "permute_weights_backward";
        let sfx = float_sfx(OP, dp.dtype())?;
        let (n, t, k) = permute_weights_backward_args(OP, dp, slot)?;
        self.check_range(OP, slot, -1, n as i64)?;
        let dw = self.alloc(OP, &[t, k], dp.dtype())?;
        if t * k > 0 {
            let f = self.func(ROUTING, &format!("permute_w_bwd_{sfx}"))?;
            launch!(
                self,
                f,
                grid_for(t * k),
                dp.storage().ptr(),
                slot.storage().ptr(),
                (t * k) as i64,
                n as i64,
                dw.storage().ptr()
            )?;
        }
        Ok(dw)
    }
}
