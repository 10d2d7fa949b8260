//! The attention layers' projections `y = x·w` (no bias), in the model's
//! dtype or as blockwise fp8 GEMMs (`attention(precision = fp8_blockwise)`,
//! DeepSeek-V3's recipe, which runs every linear layer but the embedding,
//! head, router and the attention core in fp8): one forward and one
//! backward for every projection of GQA and MLA.
//!
//! In fp8 the input is quantised in 1 × 128 row tiles along the summed
//! dimension, the weight in 128 × 128 blocks, and the product accumulates in
//! f32 (the experts' kernels with one group of all T rows); the weight
//! gradient reads both operands in 128 × 1 column tiles down the tokens.
//! Outputs and gradients come back in the input's dtype. An input read by
//! several projections (GQA's x by q, k and v) is quantised once.
//!
//! An input whose rows nothing else keeps for the backward (the layer input,
//! MLA's normed latents) is kept as a [`LinearSaved`]: under fp8 only its
//! column tiles, all its weight gradients read, made by the same pass that
//! makes the forward's row tiles (a byte a value instead of the dtype's).
//! An input gathered over tp from sequence shards is kept as the rank's
//! shard instead and gathered again for the backward
//! ([`LinearSaved::keep_shard`], as Megatron-Core's sequence-parallel
//! linear layers do): `1/tp` of the rows, less than fp8's byte a value.
//!
//! Shapes: T tokens, K the summed (input) dim, N the output dim.

use std::cell::OnceCell;

use foldmoe_kernels::fp8::{Fp8Matrix, Fp8Tiles};
use foldmoe_kernels::{Backend, DType, Tensor};

use super::activations::{visit_fp8, Slot};
use super::param::Param;
use super::{EngineError, Result};

/// One projection input `x: [T, K]` and, in fp8, its quantised forms (each
/// made at most once, when a projection first needs it).
pub(crate) struct LinearInput<B: Backend> {
    /// The rows; `None` in a backward from [`LinearSaved::Fp8`], which
    /// kept only the column tiles.
    x_tk: Option<Tensor<B>>,
    /// The input's dtype (the outputs' and gradients').
    dtype: DType,
    fp8: Option<Fp8Forms<B>>,
}

/// The fp8 forms of an input, and the one group of all its T rows that the
/// grouped fp8 GEMMs take.
struct Fp8Forms<B: Backend> {
    /// Whether the backward keeps the column tiles ([`LinearInput::kept`]):
    /// then the first projection makes them with the row tiles.
    keep_columns: bool,
    group_sizes: OnceCell<Tensor<B>>,
    rows: OnceCell<Fp8Matrix<B>>,
    columns: OnceCell<Fp8Matrix<B>>,
}

/// A projection input as its backward keeps it.
pub(crate) enum LinearSaved<B: Backend> {
    /// The rows `[T, K]`, in the model's dtype.
    Rows(Tensor<B>),
    /// This rank's sequence shard `[T/tp, K]` of rows gathered over tp,
    /// gathered again before the backward ([`Self::gather_shard`]).
    Shard(Tensor<B>),
    /// Under fp8, the rows' [`Fp8Tiles::GroupColumns`] codes and scales
    /// (one group of all T rows) and the input's dtype.
    Fp8 {
        /// The column tiles.
        columns: Fp8Matrix<B>,
        /// The input's dtype.
        dtype: DType,
    },
}

impl<B: Backend> LinearSaved<B> {
    /// Lists the kept tensors under `slot`.
    pub(crate) fn visit(&mut self, slot: Slot, f: &mut dyn FnMut(Slot, &mut Tensor<B>)) {
        match self {
            LinearSaved::Rows(x) | LinearSaved::Shard(x) => f(slot, x),
            LinearSaved::Fp8 { columns, .. } => visit_fp8(slot, columns, f),
        }
    }

    /// Keeps `shard`, this rank's sequence shard of the input that was
    /// gathered over tp for the forward, in place of what the layer kept.
    pub(crate) fn keep_shard(&mut self, shard: &Tensor<B>) {
        *self = LinearSaved::Shard(shard.clone());
    }

    /// Before the backward: a kept shard becomes the rows again through
    /// `gather` (the tp all-gather the forward ran); anything else stays.
    pub(crate) fn gather_shard(
        &mut self,
        gather: impl FnOnce(&Tensor<B>) -> Result<Tensor<B>>,
    ) -> Result<()> {
        if let LinearSaved::Shard(shard) = self {
            *self = LinearSaved::Rows(gather(shard)?);
        }
        Ok(())
    }

    /// The kept rows (an input only a model-dtype backward reads).
    pub(crate) fn into_rows(self, what: &str) -> Result<Tensor<B>> {
        match self {
            LinearSaved::Rows(x) => Ok(x),
            LinearSaved::Shard(_) => Err(EngineError::Invalid(format!(
                "{what}: the input's sequence shard was not gathered over tp before the backward"
            ))),
            LinearSaved::Fp8 { .. } => Err(EngineError::Invalid(format!(
                "{what}: the input was kept as fp8 column tiles, not rows"
            ))),
        }
    }
}

impl<B: Backend> LinearInput<B> {
    /// `x: [T, K]`, projected in fp8 when `fp8` is set; its backward reads
    /// `x` (which the caller keeps for other uses).
    pub(crate) fn new(x_tk: &Tensor<B>, fp8: bool) -> Self {
        Self::with(x_tk, fp8, false)
    }

    /// `x: [T, K]` as [`Self::new`], to be kept by [`Self::into_saved`]:
    /// under fp8 the first projection quantises it both ways in one pass.
    pub(crate) fn kept(x_tk: &Tensor<B>, fp8: bool) -> Self {
        Self::with(x_tk, fp8, true)
    }

    /// A layer's input `x`: [`Self::kept`], unless `gathered` (the caller
    /// keeps its own shard of it, or does not keep it at all), then
    /// [`Self::new`], so no column tiles are made for nothing.
    pub(crate) fn layer_input(x_tk: &Tensor<B>, fp8: bool, gathered: bool) -> Self {
        Self::with(x_tk, fp8, !gathered)
    }

    fn with(x_tk: &Tensor<B>, fp8: bool, keep_columns: bool) -> Self {
        LinearInput {
            x_tk: Some(x_tk.clone()),
            dtype: x_tk.dtype(),
            fp8: fp8.then(|| Fp8Forms {
                keep_columns,
                group_sizes: OnceCell::new(),
                rows: OnceCell::new(),
                columns: OnceCell::new(),
            }),
        }
    }

    /// What the backward keeps: the rows, or for a [`Self::kept`] input
    /// under fp8 their column tiles (made now if no projection made them).
    pub(crate) fn into_saved(self, b: &B) -> Result<LinearSaved<B>> {
        let Some(q) = self.fp8.as_ref().filter(|q| q.keep_columns) else {
            return Ok(LinearSaved::Rows(
                self.rows_for("projection input")?.clone(),
            ));
        };
        q.columns(b, &self)?;
        let dtype = self.dtype;
        let columns = self.fp8.and_then(|q| q.columns.into_inner());
        columns
            .map(|columns| LinearSaved::Fp8 { columns, dtype })
            .ok_or_else(|| EngineError::Invalid("fp8 projection input: no column tiles".into()))
    }

    /// The input of a backward from what [`Self::into_saved`] kept (`fp8`:
    /// the layer's precision, which must be the one it was kept under).
    pub(crate) fn from_saved(saved: LinearSaved<B>, fp8: bool) -> Result<Self> {
        match (saved, fp8) {
            (LinearSaved::Rows(x), _) => Ok(Self::with(&x, fp8, false)),
            (LinearSaved::Shard(_), _) => Err(EngineError::Invalid(
                "projection backward: the input's sequence shard was not gathered over tp".into(),
            )),
            (LinearSaved::Fp8 { columns, dtype }, true) => Ok(LinearInput {
                x_tk: None,
                dtype,
                fp8: Some(Fp8Forms {
                    keep_columns: true,
                    group_sizes: OnceCell::new(),
                    rows: OnceCell::new(),
                    columns: OnceCell::from(columns),
                }),
            }),
            (LinearSaved::Fp8 { .. }, false) => Err(EngineError::Invalid(
                "projection backward: fp8 column tiles kept for a projection in the model's dtype"
                    .into(),
            )),
        }
    }

    /// T, the rows of the input.
    pub(crate) fn tokens(&self) -> Result<usize> {
        let kept_columns = self.fp8.as_ref().and_then(|q| q.columns.get());
        match (&self.x_tk, kept_columns) {
            (Some(x), _) => Ok(x.dims2("projection")?.0),
            (None, Some(c)) => Ok(c.shape[0]),
            (None, None) => Err(EngineError::Invalid(
                "projection input: neither rows nor column tiles".into(),
            )),
        }
    }

    /// The rows, which `what` needs (absent in a backward from fp8 column
    /// tiles, which only weight gradients read).
    pub(crate) fn rows_for(&self, what: &str) -> Result<&Tensor<B>> {
        self.x_tk.as_ref().ok_or_else(|| {
            EngineError::Invalid(format!(
                "{what}: the input's rows were not kept (only its fp8 column tiles)"
            ))
        })
    }

    /// `x·w: [T, N]` for `w: [K, N]`.
    pub(crate) fn project(&self, b: &B, w_kn: &Tensor<B>) -> Result<Tensor<B>> {
        let x_tk = self.rows_for("projection")?;
        let Some(q) = &self.fp8 else {
            return Ok(b.matmul(x_tk, w_kn, false, false)?);
        };
        let (k, n) = w_kn.dims2("fp8 projection")?;
        let w = b.quantize_fp8(
            &w_kn.clone().reshape(&[1, k, n])?,
            Fp8Tiles::Blocks { transposed: true },
            None,
        )?;
        let groups = q.group_sizes(b, self)?;
        let rows = get_or_try(&q.rows, || {
            if q.keep_columns && q.columns.get().is_none() {
                // One read of x for the GEMM's row tiles and the kept
                // column tiles.
                let (rows, columns) = b.quantize_fp8_rows_and_columns(x_tk, None, groups)?;
                let _ = q.columns.set(columns);
                Ok(rows)
            } else {
                Ok(b.quantize_fp8(x_tk, Fp8Tiles::Rows, None)?)
            }
        })?;
        Ok(b.grouped_matmul_fp8(rows, &w, groups, false, self.dtype)?)
    }

    /// The backward of [`Self::project`] with `w`: accumulates `xᵀ·dy` into
    /// `w`'s gradient and returns this projection's `dy·wᵀ: [T, K]`.
    pub(crate) fn backward(&self, b: &B, w: &mut Param<B>, dy_tn: &Tensor<B>) -> Result<Tensor<B>> {
        let Some(q) = &self.fp8 else {
            let x_tk = self.rows_for("projection backward")?;
            w.accumulate(b, &b.matmul(x_tk, dy_tn, true, false)?)?;
            return Ok(b.matmul(dy_tn, &w.value, false, true)?);
        };
        let (k, n) = w.value.dims2("fp8 projection backward")?;
        let dtype = dy_tn.dtype();
        let groups = q.group_sizes(b, self)?;
        let columns = q.columns(b, self)?;
        // dy in both tilings from one pass: columns for the weight
        // gradient, rows for the data gradient.
        let (dy_rows, dy_columns) = b.quantize_fp8_rows_and_columns(dy_tn, None, groups)?;
        let dw = b.grouped_matmul_weight_grad_fp8(columns, &dy_columns, groups, dtype)?;
        w.accumulate(b, &dw.reshape(&[k, n])?)?;
        let w_blocks = b.quantize_fp8(
            &w.value.clone().reshape(&[1, k, n])?,
            Fp8Tiles::Blocks { transposed: false },
            None,
        )?;
        Ok(b.grouped_matmul_fp8(&dy_rows, &w_blocks, groups, true, dtype)?)
    }
}

impl<B: Backend> Fp8Forms<B> {
    /// `[T]` as the i32 group sizes of one group, written on the device (no
    /// host upload, so no host wait on CUDA).
    fn group_sizes(&self, b: &B, input: &LinearInput<B>) -> Result<&Tensor<B>> {
        get_or_try(&self.group_sizes, || {
            Ok(b.fill(&[1], input.tokens()? as f64, DType::I32)?)
        })
    }

    /// The input's column tiles, quantised from its rows if not made yet.
    fn columns(&self, b: &B, input: &LinearInput<B>) -> Result<&Fp8Matrix<B>> {
        get_or_try(&self.columns, || {
            let x_tk = input.rows_for("fp8 weight gradient")?;
            let groups = self.group_sizes(b, input)?;
            Ok(b.quantize_fp8(x_tk, Fp8Tiles::GroupColumns, Some(groups))?)
        })
    }
}

/// `cell`'s value, made by `make` if it has none (`OnceCell::get_or_try_init`
/// is not stable).
fn get_or_try<T>(cell: &OnceCell<T>, make: impl FnOnce() -> Result<T>) -> Result<&T> {
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let v = make()?;
    Ok(cell.get_or_init(|| v))
}

#[cfg(test)]
mod tests {
    use foldmoe_kernels::cpu::Cpu;
    use foldmoe_kernels::{Device, HostData};

    use super::*;
    use crate::engine::testutil::relative_distance;

    fn tensor(b: &Cpu, values: Vec<f32>, shape: &[usize]) -> Tensor<Cpu> {
        b.upload(HostData::F32(values), shape).unwrap()
    }

    fn values(b: &Cpu, t: &Tensor<Cpu>) -> Vec<f64> {
        let t = b.cast(t, DType::F32).unwrap();
        match b.download(&t).unwrap() {
            HostData::F32(v) => v.into_iter().map(f64::from).collect(),
            _ => unreachable!(),
        }
    }

    /// An input kept for its backward ([`LinearInput::kept`]) gives the
    /// backward's bits of one that keeps its rows: under fp8 it keeps only
    /// the column tiles (made with the forward's row tiles), a byte a value
    /// and one f32 scale per 128 rows of a column; otherwise the rows.
    #[test]
    fn kept_input_gives_the_same_backward() {
        let b = Cpu;
        let (t, k, n) = (150, 160, 144);
        let wave = |len: usize, f: f64| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as f64 * f).sin() * (1.0 + (i % 7) as f64)) as f32)
                .collect()
        };
        let x = tensor(&b, wave(t * k, 0.37), &[t, k]);
        let dy = tensor(&b, wave(t * n, 0.71), &[t, n]);
        let w_value = tensor(&b, wave(k * n, 0.13), &[k, n]);
        for fp8 in [false, true] {
            let (mut w_new, mut w_kept) = (
                Param::new(&b, "w", w_value.clone()).unwrap(),
                Param::new(&b, "w", w_value.clone()).unwrap(),
            );
            let plain = LinearInput::new(&x, fp8);
            let y = plain.project(&b, &w_new.value).unwrap();
            let dx = plain.backward(&b, &mut w_new, &dy).unwrap();

            let kept = LinearInput::kept(&x, fp8);
            let y_kept = kept.project(&b, &w_kept.value).unwrap();
            let mut saved = kept.into_saved(&b).unwrap();
            let mut bytes = 0;
            saved.visit(Slot::NORM_OUT, &mut |_, t| {
                bytes += crate::engine::activations::tensor_bytes(t)
            });
            let expected = if fp8 {
                (t * k + 4 * k * (t.div_ceil(128) + 1)) as u64
            } else {
                (4 * t * k) as u64
            };
            assert_eq!(bytes, expected, "fp8 {fp8}: bytes kept");
            assert_eq!(
                matches!(saved, LinearSaved::Fp8 { .. }),
                fp8,
                "fp8 {fp8}: what is kept"
            );
            let back = LinearInput::from_saved(saved, fp8).unwrap();
            assert_eq!(back.tokens().unwrap(), t);
            let dx_kept = back.backward(&b, &mut w_kept, &dy).unwrap();
            assert_eq!(values(&b, &y_kept), values(&b, &y), "fp8 {fp8}: y");
            assert_eq!(values(&b, &dx_kept), values(&b, &dx), "fp8 {fp8}: dx");
            assert_eq!(
                values(&b, &w_kept.grad),
                values(&b, &w_new.grad),
                "fp8 {fp8}: dw"
            );
            if fp8 {
                // Only weight gradients read the column tiles.
                let back = LinearInput::from_saved(
                    LinearInput::kept(&x, true).into_saved(&b).unwrap(),
                    true,
                )
                .unwrap();
                let e = back.project(&b, &w_value).err().unwrap().to_string();
                assert!(e.contains("only its fp8 column tiles"), "{e}");
                let kept = LinearInput::kept(&x, true).into_saved(&b).unwrap();
                let e = LinearInput::from_saved(kept, false)
                    .err()
                    .unwrap()
                    .to_string();
                assert!(e.contains("model's dtype"), "{e}");
            }
        }
    }

    /// The fp8 projection, its weight gradient and its data gradient
    /// against the same products in f32: within what e4m3's 3 mantissa bits
    /// allow (a few percent) and not equal (the fp8 path ran), at a T, K and N
    /// that are not multiples of 128 (partial tiles and blocks).
    #[test]
    fn fp8_projection_tracks_the_exact_one() {
        let b = Cpu;
        let (t, k, n) = (150, 160, 144);
        // Pseudo-random values in (-1, 1) with a range of magnitudes per
        // row (products of smooth waves cancel, which magnifies relative
        // errors far beyond the operands').
        let noise = |len: usize, seed: u64| -> Vec<f32> {
            let mut s = seed;
            (0..len)
                .map(|i| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                    ((2.0 * u - 1.0) * (1.0 + (i % 5) as f64)) as f32
                })
                .collect()
        };
        let x = tensor(&b, noise(t * k, 1), &[t, k]);
        let dy = tensor(&b, noise(t * n, 2), &[t, n]);
        let w_value = tensor(&b, noise(k * n, 3), &[k, n]);
        let run = |fp8: bool| {
            let mut w = Param::new(&b, "w", w_value.clone()).unwrap();
            let input = LinearInput::new(&x, fp8);
            let y = input.project(&b, &w.value).unwrap();
            let dx = input.backward(&b, &mut w, &dy).unwrap();
            assert_eq!(y.shape(), &[t, n]);
            assert_eq!(dx.shape(), &[t, k]);
            (values(&b, &y), values(&b, &dx), values(&b, &w.grad))
        };
        let (exact, fp8) = (run(false), run(true));
        for (what, e, q) in [
            ("y", &exact.0, &fp8.0),
            ("dx", &exact.1, &fp8.1),
            ("dw", &exact.2, &fp8.2),
        ] {
            let d = relative_distance(q, e);
            assert!(d < 0.05 && d > 1e-4, "{what}: relative distance {d:e}");
        }
    }
}
