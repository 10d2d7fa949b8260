use super::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// Which token copies an over-full expert drops in capacity mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropPolicy {
    /// Keep the copies with the highest routing probability.
    Probs,
    /// Keep the earliest tokens in sequence order.
    Position,
}

/// Where each token copy goes in expert-major order, all on the device.
pub struct RoutingPlan<B: Device> {
    /// `[N]` i32: source token of each permuted row, `-1` for a padding row.
    pub row_src: Tensor<B>,
    /// `[T, K]` i32: permuted row of each (token, choice), `-1` if dropped.
    pub slot: Tensor<B>,
    /// `[E]` i32: rows given to each expert (the grouped GEMM's group sizes).
    pub counts: Tensor<B>,
}

impl<B: Device> Clone for RoutingPlan<B> {
    fn clone(&self) -> Self {
        RoutingPlan {
            row_src: self.row_src.clone(),
            slot: self.slot.clone(),
            counts: self.counts.clone(),
        }
    }
}

/// By hand: a derive would require `B: Debug`, which no device needs to be,
/// while `Tensor<B>` is `Debug` for every `B`.
impl<B: Device> std::fmt::Debug for RoutingPlan<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutingPlan")
            .field("row_src", &self.row_src)
            .field("slot", &self.slot)
            .field("counts", &self.counts)
            .finish()
    }
}

/// Top-k selection, gathers and the permutations of the MoE dispatcher.
pub trait RoutingOps: Device {
    /// Indices `[T, K]` (i32) of the `k` largest values of each row of `x: [T, E]`,
    /// in descending order, ties broken toward the lower index. With
    /// `n_groups > 1` the E columns form `n_groups` equal groups; a group scores
    /// the sum of its best `k / group_top_k` values; only the best `group_top_k`
    /// groups (ties to the lower group) are eligible.
    fn topk(
        &self,
        x: &Tensor<Self>,
        k: usize,
        n_groups: usize,
        group_top_k: usize,
    ) -> Result<Tensor<Self>>;
    /// `out[t, j] = x[t, idx[t, j]]` for `x: [T, E]`, `idx: [T, K]`.
    fn gather_cols(&self, x: &Tensor<Self>, idx: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Backward of `gather_cols`: `out: [T, E]` zeros with `v[t, j]` added at `idx[t, j]`.
    fn scatter_cols(
        &self,
        v: &Tensor<Self>,
        idx: &Tensor<Self>,
        cols: usize,
    ) -> Result<Tensor<Self>>;
    /// Rows of `table: [V, D]` picked by `ids: [T]` (i32, checked against V).
    fn embedding(&self, table: &Tensor<Self>, ids: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Backward of `embedding`: `[V, D]` with `dy[t]` added into row `ids[t]`.
    fn embedding_backward(
        &self,
        dy: &Tensor<Self>,
        ids: &Tensor<Self>,
        vocab: usize,
    ) -> Result<Tensor<Self>>;
    /// Dropless plan: the `T·K` copies of `idx: [T, K]` sorted by expert, stable
    /// in (token, choice) order; `N = T·K`.
    fn routing_plan(&self, idx: &Tensor<Self>, n_experts: usize) -> Result<RoutingPlan<Self>>;
    /// Capacity plan: each expert keeps at most `capacity` copies, chosen by
    /// `policy` (using `probs: [T, K]` for [`DropPolicy::Probs`]); dropped copies
    /// get slot `-1`. With `pad`, every expert has exactly `capacity` rows
    /// (`N = E·capacity`, padding rows have source `-1`); without, `N = min(T·K, E·capacity)`
    /// and rows past the kept total are unused (source `-1`).
    fn capacity_plan(
        &self,
        idx: &Tensor<Self>,
        probs: &Tensor<Self>,
        n_experts: usize,
        capacity: usize,
        policy: DropPolicy,
        pad: bool,
    ) -> Result<RoutingPlan<Self>>;
    /// Gathers token rows into permuted order: `out[n] = x[row_src[n]]`
    /// (zeros where `row_src[n] = -1`), `x: [T, D]` → `[N, D]`.
    fn permute(&self, x: &Tensor<Self>, row_src: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// Backward of `permute`: `[T, D]` with `dy[n]` added into row `row_src[n]`.
    fn permute_backward(
        &self,
        dy: &Tensor<Self>,
        row_src: &Tensor<Self>,
        tokens: usize,
    ) -> Result<Tensor<Self>>;
    /// Combines expert outputs: `out[t] = Σ_k y[slot[t, k]]` over kept
    /// copies, `y: [N, D]`, `slot: [T, K]` → `[T, D]`. The routing weights
    /// are already in `y` (the experts apply them: see
    /// [`crate::ElementwiseOps::swiglu_weighted`]), as in Megatron-Core.
    /// Its backward is `permute(dout, row_src)` of the same plan: a row
    /// holds at most one copy, of token `row_src[n]`.
    fn unpermute(&self, y: &Tensor<Self>, slot: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// The routing weights in permuted order: `out[slot[t, k]] = w[t, k]`
    /// for kept copies, zero on rows that hold no copy; `w, slot: [T, K]`
    /// → `[rows]` (the plan's row count).
    fn permute_weights(
        &self,
        w: &Tensor<Self>,
        slot: &Tensor<Self>,
        rows: usize,
    ) -> Result<Tensor<Self>>;
    /// Backward of [`RoutingOps::permute_weights`]: `dw[t, k] =
    /// dp[slot[t, k]]`, zero for a dropped copy; `dp: [N]` → `[T, K]`.
    fn permute_weights_backward(
        &self,
        dp: &Tensor<Self>,
        slot: &Tensor<Self>,
    ) -> Result<Tensor<Self>>;
}

/// Checks combine's operands, `y: [N, D]` and `slot: [T, K]` (i32), and
/// returns `(T, K, N, D)` (the slots' range is the backend's to check).
pub(crate) fn unpermute_args<B: Device>(
    op: &'static str,
    y: &Tensor<B>,
    slot: &Tensor<B>,
) -> Result<(usize, usize, usize, usize)> {
    let (n, d) = y.dims2(op)?;
    slot.expect_dtype(op, DType::I32)?;
    let (t, k) = slot.dims2(op)?;
    Ok((t, k, n, d))
}

/// Checks the routing weights' permutation: `w: [T, K]` (a float) beside
/// `slot: [T, K]` (i32); returns `(T, K)`.
pub(crate) fn permute_weights_args<B: Device>(
    op: &'static str,
    w: &Tensor<B>,
    slot: &Tensor<B>,
) -> Result<(usize, usize)> {
    slot.expect_dtype(op, DType::I32)?;
    let (t, k) = slot.dims2(op)?;
    w.expect_shape(op, "w", &[t, k])?;
    Ok((t, k))
}

/// Checks [`RoutingOps::permute_weights_backward`]'s operands, `dp: [N]`
/// and `slot: [T, K]` (i32); returns `(N, T, K)`.
pub(crate) fn permute_weights_backward_args<B: Device>(
    op: &'static str,
    dp: &Tensor<B>,
    slot: &Tensor<B>,
) -> Result<(usize, usize, usize)> {
    let n = match dp.shape() {
        &[n] => n,
        other => {
            return Err(crate::error::shape_err(
                op,
                format!("dp must hold one value per permuted row, [N], got {other:?}"),
            ))
        }
    };
    slot.expect_dtype(op, DType::I32)?;
    let (t, k) = slot.dims2(op)?;
    Ok((n, t, k))
}

/// Group-limited routing parameters, validated (DeepSeek-V3's node-limited
/// routing: experts in `groups` groups, the best `keep_groups` kept).
#[derive(Clone, Copy)]
pub(crate) struct GroupLimit {
    pub(crate) groups: usize,
    pub(crate) per_group: usize,
    pub(crate) keep_groups: usize,
    /// Values summed into a group's score: `k / keep_groups`.
    pub(crate) score_top: usize,
}

/// Checks top-k routing arguments as every backend must: `1 ≤ k ≤ e`, and
/// with `n_groups > 1` a valid group limit; `None` when routing is not
/// group-limited.
pub(crate) fn check_topk_args(
    op: &'static str,
    e: usize,
    k: usize,
    n_groups: usize,
    group_top_k: usize,
) -> Result<Option<GroupLimit>> {
    if k == 0 || k > e {
        return Err(crate::error::arg_err(
            op,
            format!("k = {k} must be in 1..={e} (the number of experts E = {e})"),
        ));
    }
    if n_groups <= 1 {
        return Ok(None);
    }
    if !e.is_multiple_of(n_groups) {
        return Err(crate::error::arg_err(
            op,
            format!("n_groups = {n_groups} does not divide the E = {e} experts"),
        ));
    }
    if group_top_k == 0 || group_top_k > n_groups {
        return Err(crate::error::arg_err(
            op,
            format!("group_top_k = {group_top_k} must be in 1..={n_groups} (n_groups)"),
        ));
    }
    let per_group = e / n_groups;
    if k > group_top_k * per_group {
        return Err(crate::error::arg_err(
            op,
            format!(
                "k = {k} exceeds the {} experts of the best group_top_k = {group_top_k} groups of {per_group}",
                group_top_k * per_group
            ),
        ));
    }
    if k < group_top_k {
        return Err(crate::error::arg_err(
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
