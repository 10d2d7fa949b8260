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
//! Shapes: T tokens, K the summed (input) dim, N the output dim.

use std::cell::OnceCell;

use foldmoe_kernels::fp8::{Fp8Matrix, Fp8Tiles};
use foldmoe_kernels::{Backend, DType, Tensor};

use super::param::Param;
use super::Result;

/// One projection input `x: [T, K]` and, in fp8, its quantised forms (each
/// made at most once, when a projection first needs it).
pub(crate) struct LinearInput<'a, B: Backend> {
    x_tk: &'a Tensor<B>,
    fp8: Option<Fp8Forms<B>>,
}

/// The fp8 forms of an input, and the one group of all its T rows that the
/// grouped fp8 GEMMs take.
struct Fp8Forms<B: Backend> {
    group_sizes: OnceCell<Tensor<B>>,
    rows: OnceCell<Fp8Matrix<B>>,
    columns: OnceCell<Fp8Matrix<B>>,
}

impl<'a, B: Backend> LinearInput<'a, B> {
    /// `x: [T, K]`, projected in fp8 when `fp8` is set.
    pub(crate) fn new(x_tk: &'a Tensor<B>, fp8: bool) -> Self {
        LinearInput {
            x_tk,
            fp8: fp8.then(|| Fp8Forms {
                group_sizes: OnceCell::new(),
                rows: OnceCell::new(),
                columns: OnceCell::new(),
            }),
        }
    }

    /// T, the rows of the input.
    pub(crate) fn tokens(&self) -> Result<usize> {
        Ok(self.x_tk.dims2("projection")?.0)
    }

    /// `x·w: [T, N]` for `w: [K, N]`.
    pub(crate) fn project(&self, b: &B, w_kn: &Tensor<B>) -> Result<Tensor<B>> {
        let Some(q) = &self.fp8 else {
            return Ok(b.matmul(self.x_tk, w_kn, false, false)?);
        };
        let (k, n) = w_kn.dims2("fp8 projection")?;
        let w = b.quantize_fp8(
            &w_kn.clone().reshape(&[1, k, n])?,
            Fp8Tiles::Blocks { transposed: true },
            None,
        )?;
        let rows = get_or_try(&q.rows, || {
            Ok(b.quantize_fp8(self.x_tk, Fp8Tiles::Rows, None)?)
        })?;
        let groups = q.group_sizes(b, self.x_tk)?;
        Ok(b.grouped_matmul_fp8(rows, &w, groups, false, self.x_tk.dtype())?)
    }

    /// The backward of [`Self::project`] with `w`: accumulates `xᵀ·dy` into
    /// `w`'s gradient and returns this projection's `dy·wᵀ: [T, K]`.
    pub(crate) fn backward(&self, b: &B, w: &mut Param<B>, dy_tn: &Tensor<B>) -> Result<Tensor<B>> {
        let Some(q) = &self.fp8 else {
            w.accumulate(b, &b.matmul(self.x_tk, dy_tn, true, false)?)?;
            return Ok(b.matmul(dy_tn, &w.value, false, true)?);
        };
        let (k, n) = w.value.dims2("fp8 projection backward")?;
        let dtype = dy_tn.dtype();
        let groups = q.group_sizes(b, self.x_tk)?;
        let columns = get_or_try(&q.columns, || {
            Ok(b.quantize_fp8(self.x_tk, Fp8Tiles::GroupColumns, Some(groups))?)
        })?;
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
    fn group_sizes(&self, b: &B, x_tk: &Tensor<B>) -> Result<&Tensor<B>> {
        get_or_try(&self.group_sizes, || {
            let (tokens, _) = x_tk.dims2("fp8 projection")?;
            Ok(b.fill(&[1], tokens as f64, DType::I32)?)
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
