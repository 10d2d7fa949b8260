//! Compute: the routed experts, each a SwiGLU FFN `(p · silu(x·W1) ⊙ (x·W3))·W2`
//! with `p` the row's routing weight, all run at once as grouped GEMMs over
//! the expert-major rows (docs/ARCHITECTURE.md §4; Megatron-Core
//! `moe/experts.py`, `GroupedMLP` with the permuted probs in its activation:
//! combine is then a plain sum, and the weights' gradient comes out of the
//! activation's backward instead of a pass over the experts' outputs).
//!
//! Shapes: E experts, D hidden, F expert ffn, N permuted rows; group `e` is
//! the next `counts_e[e]` rows (empty groups allowed; rows past the total
//! are padding and come out zero).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use foldmoe_kernels::fp8::{Fp8Matrix, Fp8Tiles};
use foldmoe_kernels::{Backend, DType, Tensor};

use crate::engine::activations::{visit_fp8, Slot};
use crate::engine::{Init, Module, Param, Result};
use crate::memory::Part;
use crate::spec::{MoeSpec, OffloadPart, RecomputePart};

/// The routed experts' weights, stacked over experts.
pub struct Experts<B: Backend> {
    /// Gate projections `[E, D, F]`, named `{prefix}.w1`.
    pub w1: Param<B>,
    /// Up projections `[E, D, F]`, named `{prefix}.w3`.
    pub w3: Param<B>,
    /// Down projections `[E, F, D]`, named `{prefix}.w2`.
    pub w2: Param<B>,
    /// Whether the three products run as blockwise fp8 GEMMs (the group's
    /// `precision = fp8_blockwise`, or `train --fp8`).
    pub fp8: bool,
    /// The weights' fp8 forms kept for an optimizer step.
    step_fp8: Fp8WeightCache<B>,
}

/// The experts' weights in blockwise fp8, each quantised once per optimizer
/// step in each layout a product reads it in (the forward's, with the output
/// dimension contiguous, and the data gradients'), as Transformer Engine
/// keeps fp8 weights across a step's micro-batches: on for a step of
/// several micro-batches ([`Experts::begin_step`]), filled at each form's
/// first use inside the step, emptied when the step's last backward is done
/// ([`Experts::end_step`]), before the update changes the weights. Outside
/// a step (validation, `bench`), or with one micro-batch, each use
/// quantises.
struct Fp8WeightCache<B: Backend> {
    on: AtomicBool,
    /// w1, w3, w2 in the forward's layout, then in the data gradients'.
    forms: Mutex<[Option<Arc<Fp8Matrix<B>>>; 6]>,
}

impl<B: Backend> Fp8WeightCache<B> {
    fn new() -> Self {
        Fp8WeightCache {
            on: AtomicBool::new(false),
            forms: Mutex::new([None, None, None, None, None, None]),
        }
    }

    fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
        if let Ok(mut forms) = self.forms.lock() {
            *forms = [None, None, None, None, None, None];
        }
    }

    /// Weight `w` (index `i`: w1, w3, w2) in 128 × 128 blocks, laid out for
    /// the forward (`transposed`) or the data gradients; inside a training
    /// step (`in_step`) with the cache on, the step's copy.
    fn weight(
        &self,
        b: &B,
        i: usize,
        w: &Param<B>,
        transposed: bool,
        in_step: bool,
    ) -> Result<Arc<Fp8Matrix<B>>> {
        let quantise = || -> Result<Arc<Fp8Matrix<B>>> {
            let tiles = Fp8Tiles::Blocks { transposed };
            Ok(Arc::new(b.quantize_fp8(&w.value, tiles, None)?))
        };
        if !(in_step && self.on.load(Ordering::Relaxed)) {
            return quantise();
        }
        let mut forms = self.forms.lock().map_err(|_| {
            crate::engine::EngineError::Invalid(
                "experts: the step's fp8 weights were poisoned by a failed pass".into(),
            )
        })?;
        let slot = &mut forms[i + if transposed { 0 } else { 3 }];
        if let Some(q) = slot {
            return Ok(q.clone());
        }
        let q = quantise()?;
        *slot = Some(q.clone());
        Ok(q)
    }
}

/// The experts' input rows `[N, D]` in expert-major order: a tensor, or
/// the rows `source[row_src[n]]` (zero where `row_src[n] = -1`) that the
/// products gather as they read them, so the permuted copy is never
/// written nor kept for the backward (Megatron-Core's fused permute).
pub enum ExpertRows<B: Backend> {
    /// The rows themselves.
    Dense(Tensor<B>),
    /// Rows of `source: [T, D]` through `row_src: [N]` (i32).
    Gathered {
        /// The tokens the rows are copies of.
        source: Tensor<B>,
        /// Each row's source token (`-1`: a zero row).
        row_src: Tensor<B>,
        /// Whether `source` is the layer's input (the norm output that the
        /// router keeps too), so a saved copy counts as an alias of it.
        source_is_input: bool,
    },
}

impl<B: Backend> Clone for ExpertRows<B> {
    fn clone(&self) -> Self {
        match self {
            ExpertRows::Dense(x) => ExpertRows::Dense(x.clone()),
            ExpertRows::Gathered {
                source,
                row_src,
                source_is_input,
            } => ExpertRows::Gathered {
                source: source.clone(),
                row_src: row_src.clone(),
                source_is_input: *source_is_input,
            },
        }
    }
}

impl<B: Backend> ExpertRows<B> {
    /// The rows for one pass of products: as they are where the backend
    /// gathers inside its kernels, else permuted once here (a backend
    /// without a gathering kernel would permute at every product; the
    /// permuted copy lives for the pass only, never between forward and
    /// backward).
    fn for_products(&self, b: &B) -> Result<ExpertRows<B>> {
        Ok(match self {
            ExpertRows::Gathered { source, .. } if !b.gathers_rows_of(source) => {
                ExpertRows::Dense(self.materialize(b)?)
            }
            rows => rows.clone(),
        })
    }

    /// The rows as a tensor (the permutation, where they are gathered).
    pub fn materialize(&self, b: &B) -> Result<Tensor<B>> {
        Ok(match self {
            ExpertRows::Dense(x) => x.clone(),
            ExpertRows::Gathered {
                source, row_src, ..
            } => b.permute(source, row_src)?,
        })
    }

    /// The rows' dtype.
    fn dtype(&self) -> DType {
        match self {
            ExpertRows::Dense(x) => x.dtype(),
            ExpertRows::Gathered { source, .. } => source.dtype(),
        }
    }

    /// The rows in fp8 row tiles and group column tiles of `counts_e`, read
    /// where they lie (no permuted copy where the backend gathers).
    fn quantize_fp8(&self, b: &B, counts_e: &Tensor<B>) -> Result<(Fp8Matrix<B>, Fp8Matrix<B>)> {
        Ok(match self {
            ExpertRows::Dense(x) => b.quantize_fp8_rows_and_columns(x, None, counts_e)?,
            ExpertRows::Gathered {
                source, row_src, ..
            } => b.quantize_fp8_rows_and_columns(source, Some(row_src), counts_e)?,
        })
    }

    /// `grouped_matmul(rows, w, counts_e, trans_w)`.
    fn product(
        &self,
        b: &B,
        w: &Tensor<B>,
        counts_e: &Tensor<B>,
        trans_w: bool,
    ) -> Result<Tensor<B>> {
        Ok(match self {
            ExpertRows::Dense(x) => b.grouped_matmul(x, w, counts_e, trans_w)?,
            ExpertRows::Gathered {
                source, row_src, ..
            } => b.grouped_matmul_gathered(source, row_src, w, counts_e, trans_w)?,
        })
    }

    /// `grouped_matmul_weight_grad(x, rows, counts_e)`: these rows as the
    /// output gradient of a product whose input was `x: [N, K]`.
    fn weight_grad_of(&self, b: &B, x: &Tensor<B>, counts_e: &Tensor<B>) -> Result<Tensor<B>> {
        Ok(match self {
            ExpertRows::Dense(dy) => b.grouped_matmul_weight_grad(x, dy, counts_e)?,
            ExpertRows::Gathered {
                source, row_src, ..
            } => b.grouped_matmul_weight_grad_gathered_dy(x, source, row_src, counts_e)?,
        })
    }

    /// The weight gradients of the gate and up projections:
    /// `grouped_matmul_weight_grad(rows, dy, counts_e)` of `dgate` and `dup`.
    fn gate_up_weight_grads(
        &self,
        b: &B,
        dgate: &Tensor<B>,
        dup: &Tensor<B>,
        counts_e: &Tensor<B>,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        Ok(match self {
            ExpertRows::Dense(x) => (
                b.grouped_matmul_weight_grad(x, dgate, counts_e)?,
                b.grouped_matmul_weight_grad(x, dup, counts_e)?,
            ),
            ExpertRows::Gathered {
                source, row_src, ..
            } => {
                b.grouped_matmul_weight_grad_pair_gathered(source, row_src, dgate, dup, counts_e)?
            }
        })
    }
}

/// A weight gradient's saved input: the rows it reads, or under fp8 their
/// column-tile quantisation, which is all that gradient reads (so the
/// forward's quantisation is what the backward keeps, at a byte a value).
pub enum SavedInput<B: Backend> {
    /// The rows, in the model's dtype (gathered rows keep only their source
    /// and map).
    Rows(ExpertRows<B>),
    /// Their [`Fp8Tiles::GroupColumns`] codes and scales.
    Fp8(Fp8Matrix<B>),
}

impl<B: Backend> SavedInput<B> {
    fn visit(&mut self, slot: Slot, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            SavedInput::Rows(ExpertRows::Dense(t)) => f(slot, t),
            SavedInput::Rows(ExpertRows::Gathered {
                source,
                row_src,
                source_is_input,
            }) => {
                // The map is the routing plan's (or the exchange's sort),
                // counted there; the layer input is counted by the router.
                let source_slot = if *source_is_input {
                    Slot::NORM_OUT_ALIAS
                } else {
                    slot
                };
                f(source_slot, source);
                f(slot.alias(), row_src);
            }
            SavedInput::Fp8(q) => visit_fp8(slot, q, f),
        }
    }
}

/// What the experts' weight gradients need once their data gradients are
/// computed ([`Experts::backward_data`]); `None` when none are left (fp8).
pub struct WeightGrads<B: Backend>(Option<WeightInputs<B>>);

/// The products' inputs of the weight gradients.
struct WeightInputs<B: Backend> {
    x_nd: ExpertRows<B>,
    act_nf: Tensor<B>,
    dy_nd: ExpertRows<B>,
    dgate_nf: Tensor<B>,
    dup_nf: Tensor<B>,
    counts_e: Tensor<B>,
}

/// What the experts' backward needs from their forward.
pub struct ExpertsSaved<B: Backend> {
    x_nd: SavedInput<B>,
    counts_e: Tensor<B>,
    gate_nf: Tensor<B>,
    up_nf: Tensor<B>,
    probs_n: Tensor<B>,
    act_nf: SavedInput<B>,
}

impl<B: Backend> ExpertsSaved<B> {
    /// Lists the saved tensors: the dispatched rows, the group sizes, the
    /// rows' routing weights, the first projections (`expert_fc1`) and the
    /// activation (`moe_act`, which recompute drops and offload or fp8 may
    /// move).
    pub(crate) fn visit_saved(&mut self, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        let e = Slot::kept(Part::RoutedExperts);
        self.x_nd.visit(e, f);
        f(e, &mut self.counts_e);
        f(e, &mut self.probs_n);
        f(e.offload(OffloadPart::ExpertFc1), &mut self.gate_nf);
        f(e.offload(OffloadPart::ExpertFc1), &mut self.up_nf);
        self.act_nf.visit(
            e.recompute(RecomputePart::MoeAct)
                .offload(OffloadPart::MoeAct),
            f,
        );
    }
}

impl<B: Backend> Experts<B> {
    /// The `moe.experts` SwiGLU experts of size `hidden → moe.expert_ffn →
    /// hidden`, normal(0, std) weights seeded by `(seed, name)`, in bf16 (or
    /// the model's dtype) until [`Experts::fp8`] is set.
    pub fn new(
        b: &B,
        prefix: &str,
        hidden: usize,
        moe: &MoeSpec,
        std: f64,
        init: Init<'_>,
        dtype: DType,
    ) -> Result<Self> {
        let (experts, ffn) = (moe.experts, moe.expert_ffn);
        let mk = |name: &str, shape: &[usize]| {
            init.normal(b, format!("{prefix}.{name}"), shape, std, dtype)
        };
        Ok(Experts {
            w1: mk("w1", &[experts, hidden, ffn])?,
            w3: mk("w3", &[experts, hidden, ffn])?,
            w2: mk("w2", &[experts, ffn, hidden])?,
            fp8: false,
            step_fp8: Fp8WeightCache::new(),
        })
    }

    /// Starts an optimizer step of `micro_batches`: with more than one, the
    /// fp8 weights are quantised once for the step ([`Fp8WeightCache`]).
    pub fn begin_step(&self, micro_batches: usize) {
        self.step_fp8.set(self.fp8 && micro_batches > 1);
    }

    /// Ends the step's backward passes: the fp8 weights kept for it go.
    pub fn end_step(&self) {
        self.step_fp8.set(false);
    }

    /// How many fp8 weight forms the step keeps now (of 6).
    pub fn step_fp8_forms(&self) -> usize {
        self.step_fp8
            .forms
            .lock()
            .map_or(0, |forms| forms.iter().flatten().count())
    }

    /// The rows `x: [N, D]` grouped by `counts: [E]` (i32), each row's
    /// activation scaled by its routing weight `probs: [N]` → `[N, D]`;
    /// `in_step`: inside a training step (fp8 weights may be the step's).
    pub fn forward(
        &self,
        b: &B,
        x_nd: ExpertRows<B>,
        probs_n: &Tensor<B>,
        counts_e: &Tensor<B>,
        in_step: bool,
    ) -> Result<(Tensor<B>, ExpertsSaved<B>)> {
        if self.fp8 {
            return self.forward_fp8(b, &x_nd, probs_n, counts_e, in_step);
        }
        let rows = x_nd.for_products(b)?;
        let gate_nf = rows.product(b, &self.w1.value, counts_e, false)?;
        let up_nf = rows.product(b, &self.w3.value, counts_e, false)?;
        let act_nf = b.swiglu_weighted(&gate_nf, &up_nf, probs_n)?;
        let y_nd = b.grouped_matmul(&act_nf, &self.w2.value, counts_e, false)?;
        let saved = ExpertsSaved {
            x_nd: SavedInput::Rows(x_nd),
            counts_e: counts_e.clone(),
            gate_nf,
            up_nf,
            probs_n: probs_n.clone(),
            act_nf: SavedInput::Rows(ExpertRows::Dense(act_nf)),
        };
        Ok((y_nd, saved))
    }

    /// The forward in blockwise fp8: each product's input quantised in row
    /// tiles for its GEMM and in group column tiles for its weight gradient
    /// (the copy kept), the weights in 128 × 128 blocks; SwiGLU and the
    /// outputs in the model's dtype.
    fn forward_fp8(
        &self,
        b: &B,
        x_nd: &ExpertRows<B>,
        probs_n: &Tensor<B>,
        counts_e: &Tensor<B>,
        in_step: bool,
    ) -> Result<(Tensor<B>, ExpertsSaved<B>)> {
        let dtype = x_nd.dtype();
        let fwd_weight = |i, w: &Param<B>| self.step_fp8.weight(b, i, w, true, in_step);
        // One pass quantises each input for its GEMM and for the copy kept.
        let (x_rows, x_cols) = x_nd.quantize_fp8(b, counts_e)?;
        let gate_nf =
            b.grouped_matmul_fp8(&x_rows, &*fwd_weight(0, &self.w1)?, counts_e, false, dtype)?;
        let up_nf =
            b.grouped_matmul_fp8(&x_rows, &*fwd_weight(1, &self.w3)?, counts_e, false, dtype)?;
        drop(x_rows);
        let act_nf = b.swiglu_weighted(&gate_nf, &up_nf, probs_n)?;
        let (act_rows, act_cols) = b.quantize_fp8_rows_and_columns(&act_nf, None, counts_e)?;
        let y_nd = b.grouped_matmul_fp8(
            &act_rows,
            &*fwd_weight(2, &self.w2)?,
            counts_e,
            false,
            dtype,
        )?;
        let saved = ExpertsSaved {
            x_nd: SavedInput::Fp8(x_cols),
            counts_e: counts_e.clone(),
            act_nf: SavedInput::Fp8(act_cols),
            gate_nf,
            up_nf,
            probs_n: probs_n.clone(),
        };
        Ok((y_nd, saved))
    }

    /// Accumulates the weight gradients and returns `(dx: [N, D], dprobs:
    /// [N])` from `dy: [N, D]`: [`Self::backward_data`] then
    /// [`Self::backward_weights`].
    pub fn backward(
        &mut self,
        b: &B,
        dy_nd: ExpertRows<B>,
        saved: ExpertsSaved<B>,
        in_step: bool,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let (dx_nd, dprobs_n, weights) = self.backward_data(b, dy_nd, saved, in_step)?;
        self.backward_weights(b, weights)?;
        Ok((dx_nd, dprobs_n))
    }

    /// The data half of the backward: `(dx, dprobs)` and what the weight
    /// gradients need, so the caller can send the data gradients on their
    /// way before computing those (Megatron-Core's `--delay-wgrad-compute`
    /// split). The same products as computing them together, so the same
    /// bits. The fp8 experts compute their weight gradients here (none
    /// are left).
    pub fn backward_data(
        &mut self,
        b: &B,
        dy_nd: ExpertRows<B>,
        saved: ExpertsSaved<B>,
        in_step: bool,
    ) -> Result<(Tensor<B>, Tensor<B>, WeightGrads<B>)> {
        let ExpertsSaved {
            x_nd,
            counts_e,
            gate_nf,
            up_nf,
            probs_n,
            act_nf,
        } = saved;
        let (x_nd, act_nf) = match (x_nd, act_nf) {
            (SavedInput::Rows(x), SavedInput::Rows(ExpertRows::Dense(act))) => (x, act),
            (SavedInput::Fp8(x), SavedInput::Fp8(act)) => {
                let (dx_nd, dprobs_n) = self.backward_fp8(
                    b,
                    &dy_nd,
                    &counts_e,
                    (&gate_nf, &up_nf, &probs_n),
                    (&x, &act),
                    in_step,
                )?;
                return Ok((dx_nd, dprobs_n, WeightGrads(None)));
            }
            _ => {
                return Err(crate::engine::EngineError::Invalid(
                    "experts backward: the saved inputs mix fp8 and plain tensors".into(),
                ))
            }
        };
        // The down projection's products read the rows' output gradients
        // where they lie (gathered from the combined output's, or permuted
        // once here where the backend cannot gather).
        let dy_nd = dy_nd.for_products(b)?;
        let dact_nf = dy_nd.product(b, &self.w2.value, &counts_e, true)?;
        let (dgate_nf, dup_nf, dprobs_n) =
            b.swiglu_weighted_backward(&gate_nf, &up_nf, &probs_n, &dact_nf)?;
        // dx = dgate · w1ᵀ + dup · w3ᵀ as one product over both.
        let dx_nd = b.grouped_matmul_sum2(
            &dgate_nf,
            &self.w1.value,
            &dup_nf,
            &self.w3.value,
            &counts_e,
            true,
        )?;
        let weights = WeightGrads(Some(WeightInputs {
            x_nd,
            act_nf,
            dy_nd,
            dgate_nf,
            dup_nf,
            counts_e,
        }));
        Ok((dx_nd, dprobs_n, weights))
    }

    /// The weight half of the backward: accumulates `w2`'s gradient from
    /// the activation and the output gradient, `w1`'s and `w3`'s from the
    /// rows and the SwiGLU's input gradients.
    pub fn backward_weights(&mut self, b: &B, weights: WeightGrads<B>) -> Result<()> {
        let Some(w) = weights.0 else {
            return Ok(());
        };
        self.w2
            .accumulate(b, &w.dy_nd.weight_grad_of(b, &w.act_nf, &w.counts_e)?)?;
        let (dw1, dw3) =
            w.x_nd
                .for_products(b)?
                .gate_up_weight_grads(b, &w.dgate_nf, &w.dup_nf, &w.counts_e)?;
        self.w1.accumulate(b, &dw1)?;
        self.w3.accumulate(b, &dw3)?;
        Ok(())
    }

    /// The backward in blockwise fp8: each incoming gradient quantised in
    /// row tiles for its data gradient and in group column tiles for the
    /// weight gradients, against the saved column tiles of the inputs.
    fn backward_fp8(
        &mut self,
        b: &B,
        dy_nd: &ExpertRows<B>,
        counts_e: &Tensor<B>,
        (gate_nf, up_nf, probs_n): (&Tensor<B>, &Tensor<B>, &Tensor<B>),
        (x_cols, act_cols): (&Fp8Matrix<B>, &Fp8Matrix<B>),
        in_step: bool,
    ) -> Result<(Tensor<B>, Tensor<B>)> {
        let dtype = gate_nf.dtype();
        // Each gradient in row tiles (its data gradient) and group column
        // tiles (the weight gradients) from one pass.
        let both = |t: &Tensor<B>| b.quantize_fp8_rows_and_columns(t, None, counts_e);
        // Data gradients read each weight (w1, w3, w2: 0, 1, 2) with its
        // output dimension summed.
        let cache = &self.step_fp8;
        let wgrad = |x: &Fp8Matrix<B>, dy: &Fp8Matrix<B>| {
            b.grouped_matmul_weight_grad_fp8(x, dy, counts_e, dtype)
        };
        let dgrad = |dy: &Fp8Matrix<B>, i: usize, w: &Param<B>| -> Result<Tensor<B>> {
            let w = cache.weight(b, i, w, false, in_step)?;
            Ok(b.grouped_matmul_fp8(dy, &w, counts_e, true, dtype)?)
        };
        let (dy_rows, dy_cols) = dy_nd.quantize_fp8(b, counts_e)?;
        let dw2 = wgrad(act_cols, &dy_cols)?;
        self.w2.accumulate(b, &dw2)?;
        drop(dy_cols);
        let dact_nf = dgrad(&dy_rows, 2, &self.w2)?;
        drop(dy_rows);
        let (dgate_nf, dup_nf, dprobs_n) =
            b.swiglu_weighted_backward(gate_nf, up_nf, probs_n, &dact_nf)?;
        // Gate, then up: one gradient's two quantised forms live at a time;
        // up's data gradient is added onto gate's in the GEMM's stores.
        let gate_up = |w: &mut Param<B>, d_nf: &Tensor<B>| -> Result<Fp8Matrix<B>> {
            let (d_rows, d_cols) = both(d_nf)?;
            w.accumulate(b, &wgrad(x_cols, &d_cols)?)?;
            Ok(d_rows)
        };
        let dgate_rows = gate_up(&mut self.w1, &dgate_nf)?;
        let mut dx_nd = dgrad(&dgate_rows, 0, &self.w1)?;
        drop(dgate_rows);
        let dup_rows = gate_up(&mut self.w3, &dup_nf)?;
        let w3 = cache.weight(b, 1, &self.w3, false, in_step)?;
        b.grouped_matmul_fp8_accumulate(&mut dx_nd, &dup_rows, &w3, counts_e, true)?;
        Ok((dx_nd, dprobs_n))
    }
}

impl<B: Backend> Module<B> for Experts<B> {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<B>)) {
        f(&self.w1);
        f(&self.w3);
        f(&self.w2);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param<B>)) {
        f(&mut self.w1);
        f(&mut self.w3);
        f(&mut self.w2);
    }
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::gradcheck::assert_grad;
    use foldmoe_kernels::RoutingOps;

    use super::*;
    use crate::engine::moe::testutil::*;
    use crate::engine::testutil::relative_distance;

    const D: usize = 3;

    fn check_experts(what: &str, counts: Vec<i32>, rows: usize) {
        let e = counts.len();
        let mut m = Experts::new(
            &Cpu,
            "x",
            D,
            &moe_spec(e, 1, 5, 0),
            0.6,
            crate::engine::Init::full(9),
            DType::F64,
        )
        .unwrap();
        let counts_e = ti32(counts, &[e]);
        let x = uniform(21, rows * D, 1.0);
        let r = uniform(22, rows * D, 1.0);
        let p = uniform(23, rows, 1.0);
        let probs = t64(p.clone(), &[rows]);
        let (y, saved) = m
            .forward(
                &Cpu,
                dense(t64(x.clone(), &[rows, D])),
                &probs,
                &counts_e,
                false,
            )
            .unwrap();
        let (dx, dp) = m
            .backward(&Cpu, dense(t64(r.clone(), &[rows, D])), saved, false)
            .unwrap();
        let total: i32 = counts_e_sum(&counts_e);
        // Padding rows past the groups come out zero and pass no gradient.
        let (yv, dxv, dpv) = (host(&y), host(&dx), host(&dp));
        for i in total as usize * D..rows * D {
            assert_eq!((yv[i], dxv[i]), (0.0, 0.0), "{what}: padding row value {i}");
        }
        assert!(
            dpv[total as usize..].iter().all(|v| *v == 0.0),
            "{what}: padding dprobs"
        );
        assert_grad(&format!("{what}: probs"), &p, &dpv, TOL, |pv| {
            let probs = t64(pv.to_vec(), &[rows]);
            let x = dense(t64(x.clone(), &[rows, D]));
            dot(&m.forward(&Cpu, x, &probs, &counts_e, false).unwrap().0, &r)
        });
        check_grads(what, &mut m, &x, &[rows, D], &dxv, |m, x| {
            dot(
                &m.forward(&Cpu, dense(x.clone()), &probs, &counts_e, false)
                    .unwrap()
                    .0,
                &r,
            )
        });
    }

    fn dense(x: Tensor<Cpu>) -> ExpertRows<Cpu> {
        ExpertRows::Dense(x)
    }

    /// Rows gathered from their source tokens (the input, and the output
    /// gradient) give the dense rows' output, dx and weight gradients
    /// exactly, exact and in fp8; the exact backward keeps only the source
    /// (an alias of the layer input) and the map, not the rows.
    #[test]
    fn gathered_rows_match_dense_ones() {
        let (e, t, rows) = (3, 5, 8);
        let counts_e = ti32(vec![3, 0, 4], &[e]); // one padding row
        let src = vec![4, 0, 0, 2, -1, 1, 3, -1];
        let row_src = ti32(src.clone(), &[rows]);
        let x_td = t64(uniform(51, t * D, 1.0), &[t, D]);
        let dy_td = t64(uniform(52, t * D, 1.0), &[t, D]);
        let probs = t64(uniform(53, rows, 1.0), &[rows]);
        let gathered = |source: &Tensor<Cpu>, source_is_input| ExpertRows::Gathered {
            source: source.clone(),
            row_src: row_src.clone(),
            source_is_input,
        };
        let permuted = |source: &Tensor<Cpu>| dense(Cpu.permute(source, &row_src).unwrap());
        for fp8 in [false, true] {
            let mk = || {
                let mut m = Experts::new(
                    &Cpu,
                    "x",
                    D,
                    &moe_spec(e, 1, 5, 0),
                    0.6,
                    crate::engine::Init::full(4),
                    DType::F64,
                )
                .unwrap();
                m.fp8 = fp8;
                m
            };
            let (mut a, mut g) = (mk(), mk());
            let (ya, sa) = a
                .forward(&Cpu, permuted(&x_td), &probs, &counts_e, false)
                .unwrap();
            let (yg, mut sg) = g
                .forward(&Cpu, gathered(&x_td, true), &probs, &counts_e, false)
                .unwrap();
            if !fp8 {
                let mut slots = Vec::new();
                sg.visit_saved(&mut |s, t| slots.push((s, t.shape().to_vec())));
                assert_eq!(slots[0], (Slot::NORM_OUT_ALIAS, vec![t, D]), "{slots:?}");
                assert!(slots[1].0.alias && slots[1].1 == [rows], "{slots:?}");
                assert!(slots[2..].iter().all(|(s, _)| !s.alias), "{slots:?}");
            }
            assert_eq!(host(&ya), host(&yg), "fp8 {fp8}: y");
            let (dxa, dpa) = a.backward(&Cpu, permuted(&dy_td), sa, false).unwrap();
            let (dxg, dpg) = g
                .backward(&Cpu, gathered(&dy_td, false), sg, false)
                .unwrap();
            assert_eq!(host(&dxa), host(&dxg), "fp8 {fp8}: dx");
            assert_eq!(host(&dpa), host(&dpg), "fp8 {fp8}: dprobs");
            for ((name, _, ga), (_, _, gg)) in params(&a).into_iter().zip(params(&g)) {
                assert_eq!(ga, gg, "fp8 {fp8}: {name}");
            }
        }
    }

    fn counts_e_sum(c: &Tensor<Cpu>) -> i32 {
        host_i32(c).iter().sum()
    }

    #[test]
    fn experts_grad_ragged_with_empty_group_and_padding() {
        check_experts("ragged [3, 0, 2, 1] + 1 padding row", vec![3, 0, 2, 1], 7);
    }

    #[test]
    fn experts_grad_trailing_empty_groups() {
        check_experts("ragged [2, 3, 0, 0]", vec![2, 3, 0, 0], 5);
        check_experts("one group [0, 0, 4]", vec![0, 0, 4], 4);
    }

    /// A step of two micro-batches keeps each fp8 weight form once (six:
    /// three weights, two layouts), and its passes give the bits of passes
    /// that quantise at each use; one micro-batch, validation (outside a
    /// step) and a step's end keep none.
    #[test]
    fn fp8_weights_are_quantised_once_per_step() {
        let (e, d, f, rows) = (4, 40, 136, 17);
        let counts_e = ti32(vec![5, 0, 7, 4], &[e]);
        let mut m = Experts::new(
            &Cpu,
            "x",
            d,
            &moe_spec(e, 1, f, 0),
            0.3,
            crate::engine::Init::full(3),
            DType::F64,
        )
        .unwrap();
        m.fp8 = true;
        let probs = t64(uniform(33, rows, 1.0), &[rows]);
        let pass = |m: &mut Experts<Cpu>, seed: u64, in_step: bool| {
            let x = t64(uniform(seed, rows * d, 1.0), &[rows, d]);
            let dy = t64(uniform(seed + 1, rows * d, 1.0), &[rows, d]);
            let (y, saved) = m
                .forward(&Cpu, dense(x), &probs, &counts_e, in_step)
                .unwrap();
            let (dx, dp) = m.backward(&Cpu, dense(dy), saved, in_step).unwrap();
            [host(&y), host(&dx), host(&dp)]
        };
        let fresh = [pass(&mut m, 41, false), pass(&mut m, 51, false)];
        assert_eq!(m.step_fp8_forms(), 0, "outside a step");
        m.begin_step(1);
        pass(&mut m, 41, true);
        assert_eq!(m.step_fp8_forms(), 0, "one micro-batch");
        m.begin_step(2);
        let first = pass(&mut m, 41, true);
        assert_eq!(m.step_fp8_forms(), 6, "after the first micro-batch");
        let second = pass(&mut m, 51, true);
        assert_eq!(m.step_fp8_forms(), 6, "after the second");
        assert_eq!(
            [first, second],
            fresh,
            "the step's weights give the same bits"
        );
        m.end_step();
        assert_eq!(m.step_fp8_forms(), 0, "after the step");
    }

    /// The fp8 experts (quantised operands, f32 accumulation) against the
    /// same experts in f64: output, dx and each weight gradient within what
    /// e4m3's 3-bit mantissa allows (a few percent), yet not equal (the fp8
    /// path ran); padding rows stay zero; the saved inputs are fp8 codes.
    #[test]
    fn fp8_experts_track_the_exact_ones() {
        let (e, d, f, rows) = (4, 40, 136, 17);
        let counts = vec![5, 0, 7, 4]; // one padding row
        let spec = moe_spec(e, 1, f, 0);
        let mk = |fp8| {
            let mut m = Experts::new(
                &Cpu,
                "x",
                d,
                &spec,
                0.3,
                crate::engine::Init::full(3),
                DType::F64,
            )
            .unwrap();
            m.fp8 = fp8;
            m
        };
        let (mut exact, mut quant) = (mk(false), mk(true));
        let counts_e = ti32(counts, &[e]);
        let x = t64(uniform(31, rows * d, 1.0), &[rows, d]);
        let dy = t64(uniform(32, rows * d, 1.0), &[rows, d]);
        let probs = t64(uniform(33, rows, 1.0), &[rows]);
        let (y0, s0) = exact
            .forward(&Cpu, dense(x.clone()), &probs, &counts_e, false)
            .unwrap();
        let (y1, mut s1) = quant
            .forward(&Cpu, dense(x.clone()), &probs, &counts_e, false)
            .unwrap();
        let mut saved = Vec::new();
        s1.visit_saved(&mut |_, t| saved.push(t.dtype()));
        // x and act as codes + scales, counts, probs, gate, up.
        assert_eq!(
            saved,
            [
                DType::I32,
                DType::F32,
                DType::I32,
                DType::F64,
                DType::F64,
                DType::F64,
                DType::I32,
                DType::F32
            ]
        );
        let (dx0, dp0) = exact.backward(&Cpu, dense(dy.clone()), s0, false).unwrap();
        let (dx1, dp1) = quant.backward(&Cpu, dense(dy), s1, false).unwrap();
        let (y1v, dx1v) = (host(&y1), host(&dx1));
        assert!(
            y1v[16 * d..]
                .iter()
                .chain(&dx1v[16 * d..])
                .all(|v| *v == 0.0),
            "padding row"
        );
        let mut pairs = vec![
            ("y", host(&y0), y1v),
            ("dx", host(&dx0), dx1v),
            ("dprobs", host(&dp0), host(&dp1)),
        ];
        for ((name, _, g0), (_, _, g1)) in params(&exact).into_iter().zip(params(&quant)) {
            pairs.push((
                if name.ends_with("w1") {
                    "dw1"
                } else if name.ends_with("w3") {
                    "dw3"
                } else {
                    "dw2"
                },
                g0,
                g1,
            ));
        }
        for (what, want, got) in pairs {
            let r = relative_distance(&got, &want);
            // dprobs = Σ dact · a multiplies two quantities that each carry
            // one fp8 product's error (the data gradient's and the forward
            // projections'): independent errors add in quadrature, √2 × the
            // bound of the others (measured: 8.4 % against 5.7–6.5 %).
            let bound = if what == "dprobs" {
                0.08 * 2f64.sqrt()
            } else {
                0.08
            };
            assert!(r > 1e-4 && r < bound, "{what}: relative error {r}");
        }
    }
}
