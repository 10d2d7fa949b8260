//! fp8 (e4m3) storage of saved activations, with one scale per 1×128 block
//! of a row (docs/ARCHITECTURE.md §2, §5): the codec, the compressed tensor, and the host
//! reference that [`crate::OffloadOps::compress_fp8`] provides and the CUDA
//! backend reproduces bit for bit on the device.
//!
//! Every step is in f32, whatever the tensor's dtype: a block's scale is
//! `amax / 448`, its codes are `e4m3(x · (448 / amax))` (DeepSeek-V3's
//! reference quantisation: one division a block, not one a value) rounded
//! to nearest even and saturated at ±448, and expansion is `decode(code) ·
//! scale`; a block where `448 / amax` is not a finite f32 (all zero, or amax
//! below about 1.3e-36) has scale and factor 1, so its codes are 0. f64
//! tensors go through f32 first (fp8 keeps far less than f32 anyway).

use rayon::prelude::*;

use crate::backend::Device;
use crate::error::{arg_err, Result};
use crate::tensor::{DType, HostData, Tensor};

/// The largest finite e4m3 (OCP `E4M3FN`) value.
pub const E4M3_MAX: f32 = 448.0;

/// Elements per scaling block: 1 × 128 along the last dimension (the last
/// block of a row may be shorter).
pub const FP8_BLOCK: usize = 128;

/// The e4m3 code of `v` (already scaled into range), rounded to nearest
/// even and saturated at ±448; NaN gives the NaN code 0x7f. Normal values
/// round the f32 mantissa to three bits in its bit pattern (a carry moves
/// into the exponent); below 2⁻⁶ the quantum is the subnormals' 2⁻⁹.
pub fn e4m3_encode(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    if v.is_nan() {
        return 0x7f;
    }
    let a = v.abs().min(E4M3_MAX);
    if a < E4M3_MIN_NORMAL {
        // a · 2⁹ < 8 is exact; 8 itself is the smallest normal's code.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
    let exponent = (rounded >> 3) - (127 - 7);
    sign | ((exponent << 3) | (rounded & 7)).min(0x7e) as u8
}

/// The smallest normal e4m3 value, 2⁻⁶.
const E4M3_MIN_NORMAL: f32 = 1.0 / 64.0;

/// The value of e4m3 code `c`: `(1 + m/8) · 2^(e−7)`, or `m · 2⁻⁹` for
/// exponent 0, built as the f32 bit pattern (exact, no `exp2` call: the
/// CPU's fp8 emulation decodes every code it multiplies).
pub fn e4m3_decode(c: u8) -> f32 {
    if c & 0x7f == 0x7f {
        return f32::NAN;
    }
    let sign = u32::from(c & 0x80) << 24;
    let (e, m) = (u32::from((c >> 3) & 0xf), u32::from(c & 7));
    let mag = if e == 0 {
        // m · 2⁻⁹ (m < 8: exact in f32).
        m as f32 * (1.0 / 512.0)
    } else {
        f32::from_bits(((e + 120) << 23) | (m << 20))
    };
    f32::from_bits(sign | mag.to_bits())
}

/// A tensor compressed to e4m3 with one f32 scale per [`FP8_BLOCK`]
/// elements of a row: a quarter of f32's bytes (plus 4 bytes a block).
#[derive(Debug)]
pub struct Fp8Tensor<B: Device> {
    /// The codes, four to an i32 element (little-endian bytes, element
    /// order), so both backends store them in an ordinary tensor.
    pub codes: Tensor<B>,
    /// f32 scales, one per block: row by row, blocks in order within a row.
    pub scales: Tensor<B>,
    /// The original tensor's shape.
    pub shape: Vec<usize>,
    /// The original tensor's dtype, which expansion gives back.
    pub dtype: DType,
}

impl<B: Device> Fp8Tensor<B> {
    /// Elements per row (the last dimension; 1 for a scalar).
    pub fn row_len(&self) -> usize {
        row_len(&self.shape)
    }
}

/// Elements per row of `shape`: its last dimension (1 for a scalar).
pub fn row_len(shape: &[usize]) -> usize {
    shape.last().copied().unwrap_or(1)
}

/// Number of scaling blocks of a tensor of `shape`.
pub fn block_count(shape: &[usize]) -> usize {
    let row = row_len(shape);
    let rows = shape
        .iter()
        .product::<usize>()
        .checked_div(row)
        .unwrap_or(0);
    rows * row.div_ceil(FP8_BLOCK)
}

/// Host reference of compression: the codes (one byte per value) and the
/// scales of `values`, rows of `row` elements: [`quantize_blocks_host`]
/// with 1 × [`FP8_BLOCK`] blocks.
pub fn compress_host(values: &[f32], row: usize) -> (Vec<u8>, Vec<f32>) {
    if row == 0 {
        return (Vec::new(), Vec::new());
    }
    quantize_blocks_host(values, values.len() / row, row, (1, FP8_BLOCK))
}

/// The side of the square weight blocks of DeepSeek-V3's fp8 recipe
/// (activations use 1 × [`FP8_BLOCK`] tiles along their rows).
pub const FP8_WEIGHT_BLOCK: usize = 128;

/// The scale of a block of absolute maximum `amax` and the factor its codes
/// are made with: `(amax / 448, 448 / amax)`, or `(1, 1)` where `448 / amax`
/// is not a finite f32 (an all-zero block, or one so small that its values
/// all round to code 0 and expand to zeros). `fp8.cu`'s `fp8_scaling`.
fn block_scaling(amax: f32) -> (f32, f32) {
    let factor = E4M3_MAX / amax;
    if factor.is_finite() {
        (amax / E4M3_MAX, factor)
    } else {
        (1.0, 1.0)
    }
}

/// Host reference of blockwise quantisation of a row-major `[rows, cols]`
/// matrix, one f32 scale per `br × bc` block (`1 × 128` for activations,
/// `128 × 128` for weights; the blocks at the bottom and right edges may be
/// smaller): the codes `[rows, cols]` and the scales `[⌈rows/br⌉,
/// ⌈cols/bc⌉]`, both row-major. Each code is `e4m3(x · 448 / amax)` (the
/// block's factor, [`block_scaling`]), rounded to nearest even and saturated.
pub fn quantize_blocks_host(
    values: &[f32],
    rows: usize,
    cols: usize,
    (br, bc): (usize, usize),
) -> (Vec<u8>, Vec<f32>) {
    quantize_strided(values, rows, cols, (cols, 1), (br, bc))
}

/// Host reference of the quantisation the backward needs: the blocks of
/// `xᵀ` (`[cols, rows]`, blocks `br × bc` of the transpose) read straight
/// from the row-major `[rows, cols]` values, with no transposed copy made
/// first; equal, code for code, to quantising the transpose.
pub fn quantize_transposed_host(
    values: &[f32],
    rows: usize,
    cols: usize,
    (br, bc): (usize, usize),
) -> (Vec<u8>, Vec<f32>) {
    quantize_strided(values, cols, rows, (1, cols), (br, bc))
}

/// Blockwise quantisation of the `[rows, cols]` matrix whose element
/// `(i, j)` is `values[i·rs + j·cs]`.
fn quantize_strided(
    values: &[f32],
    rows: usize,
    cols: usize,
    (rs, cs): (usize, usize),
    (br, bc): (usize, usize),
) -> (Vec<u8>, Vec<f32>) {
    let (br, bc) = (br.max(1), bc.max(1));
    let at = |i: usize, j: usize| values[i * rs + j * cs];
    let (grid_r, grid_c) = (rows.div_ceil(br), cols.div_ceil(bc));
    let mut scales = vec![1.0f32; grid_r * grid_c];
    let mut codes = vec![0u8; rows * cols];
    if codes.is_empty() {
        return (codes, scales);
    }
    // Bands of block rows (at least 64 matrix rows each) in parallel: a
    // band's scales, then its codes (every step per element or per block,
    // so the result does not depend on the split).
    let band = 64usize.div_ceil(br);
    scales
        .par_chunks_mut(band * grid_c)
        .zip(codes.par_chunks_mut(band * br * cols))
        .enumerate()
        .for_each(|(b, (band_scales, band_codes))| {
            let (gr0, i0) = (b * band, b * band * br);
            let mut factors = vec![1.0f32; band_scales.len()];
            for (g, (scale, factor)) in band_scales.iter_mut().zip(&mut factors).enumerate() {
                let (r0, c0) = ((gr0 + g / grid_c) * br, (g % grid_c) * bc);
                let mut amax = 0f32;
                for i in r0..(r0 + br).min(rows) {
                    for j in c0..(c0 + bc).min(cols) {
                        amax = amax.max(at(i, j).abs());
                    }
                }
                (*scale, *factor) = block_scaling(amax);
            }
            for (x, code) in band_codes.iter_mut().enumerate() {
                let (i, j) = (i0 + x / cols, x % cols);
                *code = e4m3_encode(at(i, j) * factors[(i / br - gr0) * grid_c + j / bc]);
            }
        });
    (codes, scales)
}

/// Host reference of the blockwise fp8 GEMM `C[m, n] = A[m, k] · B[k, n]`:
/// `A` quantised in 1 × 128 tiles (scales `[m, ⌈k/128⌉]`), `B` in 128 × 128
/// blocks (scales `[⌈k/128⌉, ⌈n/128⌉]`), codes row-major. Each 128-long slice
/// of K is accumulated in f32 from the decoded codes and then promoted: its
/// sum, times the two blocks' scales, is added to the f32 result (as
/// DeepSeek-V3 does on the tensor cores, whose own accumulator is narrower).
pub fn blockwise_matmul_host(
    (a_codes, a_scales): (&[u8], &[f32]),
    (b_codes, b_scales): (&[u8], &[f32]),
    (m, k, n): (usize, usize, usize),
) -> Vec<f32> {
    let kb = k.div_ceil(FP8_BLOCK);
    let nb = n.div_ceil(FP8_WEIGHT_BLOCK);
    let a: Vec<f32> = a_codes.iter().map(|&c| e4m3_decode(c)).collect();
    let b: Vec<f32> = b_codes.iter().map(|&c| e4m3_decode(c)).collect();
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut total = 0f32;
            for q in 0..kb {
                let mut part = 0f32;
                for l in q * FP8_BLOCK..((q + 1) * FP8_BLOCK).min(k) {
                    part += a[i * k + l] * b[l * n + j];
                }
                total += part * (a_scales[i * kb + q] * b_scales[q * nb + j / FP8_WEIGHT_BLOCK]);
            }
            c[i * n + j] = total;
        }
    }
    c
}

/// How an [`Fp8Matrix`] is cut into scaling blocks: DeepSeek-V3's blockwise
/// recipe, where each GEMM operand is scaled along the dimension its product
/// sums over, in slices of [`FP8_BLOCK`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Tiles {
    /// 1 × 128 tiles along each row of an `[M, K]` activation: the left
    /// operand of a forward or data-gradient GEMM, which sums over K. Codes
    /// `[M, K]`, scales `[M, ⌈K/128⌉]`.
    Rows,
    /// Tiles of at most 128 × 1 down each column of an `[M, K]` activation
    /// whose rows are in groups: an operand of the grouped weight-gradient
    /// GEMM, which sums over a group's rows. A group's tiles are its rows
    /// in each aligned 128-row block `[128 b, 128 b + 128)` of M that it
    /// meets ([`group_column_tiles`]), so a tile never spans two groups and
    /// every tile starts inside one 128-aligned block: the fp8 kernel copies
    /// whole aligned blocks (the copy engine wants 16-byte aligned starts
    /// along the contiguous rows) and zeroes the other groups' rows in
    /// shared memory. Codes stored transposed, `[K, M]` (rows past the
    /// groups are code 0); scales `[column_tiles(M, G), K]`, tile-major,
    /// the groups' tiles in order (the rest are 1).
    GroupColumns,
    /// 128 × 128 blocks of each matrix of a `[G, R, C]` weight. Codes `[G, R,
    /// C]`, or `[G, C, R]` when `transposed` (the layout a GEMM that sums over
    /// R reads: the tensor cores take fp8 operands with the summed dimension
    /// contiguous); scales `[G, ⌈R/128⌉, ⌈C/128⌉]` of the logical matrix either way.
    Blocks {
        /// Whether each matrix's codes are stored transposed.
        transposed: bool,
    },
}

/// A matrix (or a stack of them) quantised to e4m3 with one f32 scale per
/// block of its [`Fp8Tiles`]: the operands of the blockwise fp8 GEMMs, and
/// what the experts keep for their backward in place of the activation.
pub struct Fp8Matrix<B: Device> {
    /// The codes in their stored layout, four to an i32 element
    /// (little-endian bytes, element order).
    pub codes: Tensor<B>,
    /// f32 scales, laid out as [`Fp8Tiles`] says.
    pub scales: Tensor<B>,
    /// The logical shape: `[M, K]` for activations, `[G, R, C]` for weights.
    pub shape: Vec<usize>,
    /// How the codes are blocked and laid out.
    pub tiles: Fp8Tiles,
}

impl<B: Device> std::fmt::Debug for Fp8Matrix<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Fp8Matrix({:?}, {:?} on {})",
            self.shape,
            self.tiles,
            B::NAME
        )
    }
}

/// The scale rows of [`Fp8Tiles::GroupColumns`] for `m` rows in `groups`
/// groups: room for every group's tiles ([`group_column_tiles`]), at most
/// `⌈m/128⌉ + groups - 1` whatever the sizes (each group boundary inside a
/// 128-row block adds one tile), so the buffer is sized without reading
/// them.
pub fn column_tiles(m: usize, groups: usize) -> usize {
    m.div_ceil(FP8_BLOCK) + groups
}

/// The tiles of [`Fp8Tiles::GroupColumns`] over groups of `sizes` (in row
/// order from row 0), in order: `(first row, rows)` of each, a group's rows
/// cut at the multiples of 128 (an empty group has none). The one definition
/// of the layout's tiles: the host reference and the CUDA kernels
/// (`fp8.cu`'s `group_tile`, `fp8_sm90.cu`'s weight gradient) count alike.
pub fn group_column_tiles(sizes: &[usize]) -> Vec<(usize, usize)> {
    let mut tiles = Vec::new();
    let mut start = 0;
    for &size in sizes {
        let end = start + size;
        let mut r = start;
        while r < end {
            let next = ((r / FP8_BLOCK + 1) * FP8_BLOCK).min(end);
            tiles.push((r, next - r));
            r = next;
        }
        start = end;
    }
    tiles
}

/// Host reference of [`Fp8Tiles::GroupColumns`] quantisation of a row-major
/// `[m, k]` matrix whose first rows are groups of `sizes` (their sum at most
/// `m`): the transposed codes `[k, m]` (rows past the groups 0) and the
/// scales `[column_tiles(m, G), k]`, tile `t` of [`group_column_tiles`] in
/// row `t`: each column's amax over the tile's rows / 448 (1 if zero).
pub fn quantize_group_columns_host(
    values: &[f32],
    m: usize,
    k: usize,
    sizes: &[usize],
) -> (Vec<u8>, Vec<f32>) {
    let t = column_tiles(m, sizes.len());
    let (mut codes, mut scales) = (vec![0u8; k * m], vec![1f32; t * k]);
    if codes.is_empty() {
        return (codes, scales);
    }
    let tiles = group_column_tiles(sizes);
    // Columns in parallel (a column's codes are one stored row); each
    // column's tile scales, placed after.
    let column_scales: Vec<Vec<f32>> = codes
        .par_chunks_mut(m)
        .enumerate()
        .map(|(j, column)| {
            tiles
                .iter()
                .map(|&(row0, rows)| {
                    let amax =
                        (row0..row0 + rows).fold(0f32, |a, i| a.max(values[i * k + j].abs()));
                    let (scale, factor) = block_scaling(amax);
                    for i in row0..row0 + rows {
                        column[i] = e4m3_encode(values[i * k + j] * factor);
                    }
                    scale
                })
                .collect()
        })
        .collect();
    for (j, col) in column_scales.iter().enumerate() {
        for (tile, &scale) in col.iter().enumerate() {
            scales[tile * k + j] = scale;
        }
    }
    (codes, scales)
}

/// Host reference of quantisation: the codes (stored layout, one byte per
/// value) and scales of the row-major values of logical `shape` under
/// `tiles` (`sizes`: the row groups, for [`Fp8Tiles::GroupColumns`]).
pub fn quantize_host(
    values: &[f32],
    shape: &[usize],
    tiles: Fp8Tiles,
    sizes: &[usize],
) -> (Vec<u8>, Vec<f32>) {
    match (tiles, shape) {
        (Fp8Tiles::Rows, &[m, k]) => quantize_blocks_host(values, m, k, (1, FP8_BLOCK)),
        (Fp8Tiles::GroupColumns, &[m, k]) => quantize_group_columns_host(values, m, k, sizes),
        (Fp8Tiles::Blocks { transposed }, &[g, r, c]) => {
            let block = (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK);
            let (mut codes, mut scales) = (Vec::with_capacity(g * r * c), Vec::new());
            for w in values.chunks(r * c).take(g) {
                let (cw, sw) = if transposed {
                    let (ct, st) = quantize_transposed_host(w, r, c, block);
                    // The transpose's block grid is the logical one's
                    // transpose: give the scales back in the logical order.
                    let (gr, gc) = (r.div_ceil(block.0), c.div_ceil(block.1));
                    let st = (0..gr * gc).map(|i| st[(i % gc) * gr + i / gc]).collect();
                    (ct, st)
                } else {
                    quantize_blocks_host(w, r, c, block)
                };
                codes.extend(cw);
                scales.extend(sw);
            }
            (codes, scales)
        }
        _ => (Vec::new(), Vec::new()),
    }
}

/// Host reference of dequantisation: the logical row-major values (the
/// matrix that was quantised) of codes and scales laid out as `tiles` says.
pub fn dequantize_host(
    codes: &[u8],
    scales: &[f32],
    shape: &[usize],
    tiles: Fp8Tiles,
    sizes: &[usize],
) -> Vec<f32> {
    let dec = |c: u8| e4m3_decode(c);
    match (tiles, shape) {
        (Fp8Tiles::Rows, &[m, k]) => {
            let kb = k.div_ceil(FP8_BLOCK);
            (0..m * k)
                .into_par_iter()
                .map(|x| dec(codes[x]) * scales[(x / k) * kb + (x % k) / FP8_BLOCK])
                .collect()
        }
        (Fp8Tiles::GroupColumns, &[m, k]) => {
            let mut out = vec![0f32; m * k];
            // Each row's tile (rows past the groups have none and stay 0).
            let mut tile_of = vec![None; m];
            for (tile, &(row0, rows)) in group_column_tiles(sizes).iter().enumerate() {
                tile_of[row0..row0 + rows].fill(Some(tile));
            }
            if k > 0 {
                out.par_chunks_mut(k)
                    .zip(&tile_of)
                    .enumerate()
                    .for_each(|(i, (row, tile))| {
                        if let Some(tile) = tile {
                            for (j, v) in row.iter_mut().enumerate() {
                                *v = dec(codes[j * m + i]) * scales[tile * k + j];
                            }
                        }
                    });
            }
            out
        }
        (Fp8Tiles::Blocks { transposed }, &[g, r, c]) => {
            let (gr, gc) = (r.div_ceil(FP8_WEIGHT_BLOCK), c.div_ceil(FP8_WEIGHT_BLOCK));
            (0..g * r * c)
                .into_par_iter()
                .map(|x| {
                    let (e, i, j) = (x / (r * c), (x / c) % r, x % c);
                    let code = if transposed {
                        codes[e * r * c + j * r + i]
                    } else {
                        codes[x]
                    };
                    let s =
                        scales[e * gr * gc + (i / FP8_WEIGHT_BLOCK) * gc + j / FP8_WEIGHT_BLOCK];
                    dec(code) * s
                })
                .collect()
        }
        _ => Vec::new(),
    }
}

/// The checks every backend's quantisation makes: `shape` suits `tiles`
/// (2-d activations, 3-d weights) and `sizes` are given exactly for
/// [`Fp8Tiles::GroupColumns`].
pub fn check_tiles(
    op: &'static str,
    shape: &[usize],
    tiles: Fp8Tiles,
    has_sizes: bool,
) -> Result<()> {
    let want = match tiles {
        Fp8Tiles::Rows | Fp8Tiles::GroupColumns => 2,
        Fp8Tiles::Blocks { .. } => 3,
    };
    if shape.len() != want {
        return Err(crate::error::shape_err(
            op,
            format!("{tiles:?} quantises {want}-d tensors, got shape {shape:?}"),
        ));
    }
    if has_sizes != (tiles == Fp8Tiles::GroupColumns) {
        return Err(arg_err(op, format!("{tiles:?}: group sizes are given {has_sizes}, but only GroupColumns takes (and needs) them")));
    }
    Ok(())
}

/// The checks of every backend's quantisation: a float tensor whose shape
/// suits `tiles` ([`check_tiles`]).
pub fn check_quantize_input<B: Device>(
    op: &'static str,
    x: &Tensor<B>,
    tiles: Fp8Tiles,
    has_sizes: bool,
) -> Result<()> {
    if !x.dtype().is_float() {
        return Err(arg_err(op, format!("{:?} is not a float dtype", x.dtype())));
    }
    check_tiles(op, x.shape(), tiles, has_sizes)
}

/// Group sizes read to the host and checked against `m` rows.
fn host_sizes<B: Device>(
    b: &B,
    op: &'static str,
    sizes: Option<&Tensor<B>>,
    m: usize,
) -> Result<Vec<usize>> {
    let Some(sizes) = sizes else {
        return Ok(Vec::new());
    };
    let v = match b.download(sizes)? {
        HostData::I32(v) => v,
        other => {
            return Err(arg_err(
                op,
                format!("group sizes must be I32, got {:?}", other.dtype()),
            ))
        }
    };
    let mut total = 0usize;
    let mut out = Vec::with_capacity(v.len());
    for (g, &s) in v.iter().enumerate() {
        let s =
            usize::try_from(s).map_err(|_| arg_err(op, format!("group {g} has size {s} < 0")))?;
        total += s;
        out.push(s);
    }
    if total > m {
        return Err(arg_err(
            op,
            format!("group sizes sum to {total}, more than the {m} rows"),
        ));
    }
    Ok(out)
}

/// Quantisation through the host: what [`crate::Fp8Ops::quantize_fp8`]
/// provides by default (the CPU's own, whose device memory is host memory).
pub fn quantize_via_host<B: Device>(
    b: &B,
    x: &Tensor<B>,
    tiles: Fp8Tiles,
    sizes: Option<&Tensor<B>>,
) -> Result<Fp8Matrix<B>> {
    const OP: &str = "quantize_fp8";
    check_quantize_input(OP, x, tiles, sizes.is_some())?;
    let sizes = host_sizes(b, OP, sizes, x.shape()[0])?;
    let values = b.download(x)?.to_f32();
    let (codes, scales) = quantize_host(&values, x.shape(), tiles, &sizes);
    let packed = pack_codes(&codes);
    let (np, ns) = (packed.len(), scales.len());
    Ok(Fp8Matrix {
        codes: b.upload(HostData::I32(packed), &[np])?,
        scales: b.upload(HostData::F32(scales), &[ns])?,
        shape: x.shape().to_vec(),
        tiles,
    })
}

/// Dequantisation through the host: what [`crate::Fp8Ops::dequantize_fp8`]
/// provides by default; f32, in the logical shape.
pub fn dequantize_via_host<B: Device>(
    b: &B,
    q: &Fp8Matrix<B>,
    sizes: Option<&Tensor<B>>,
) -> Result<Tensor<B>> {
    const OP: &str = "dequantize_fp8";
    check_tiles(OP, &q.shape, q.tiles, sizes.is_some())?;
    let sizes = host_sizes(b, OP, sizes, q.shape[0])?;
    let n: usize = q.shape.iter().product();
    let codes = match b.download(&q.codes)? {
        HostData::I32(v) => unpack_codes(&v, n),
        other => {
            return Err(arg_err(
                OP,
                format!("codes must be I32, got {:?}", other.dtype()),
            ))
        }
    };
    let scales = b.download(&q.scales)?.to_f32();
    let want_scales = match (q.tiles, q.shape.as_slice()) {
        (Fp8Tiles::Rows, &[m, k]) => m * k.div_ceil(FP8_BLOCK),
        (Fp8Tiles::GroupColumns, &[m, k]) => k * column_tiles(m, sizes.len()),
        (Fp8Tiles::Blocks { .. }, &[g, r, c]) => {
            g * r.div_ceil(FP8_WEIGHT_BLOCK) * c.div_ceil(FP8_WEIGHT_BLOCK)
        }
        _ => 0,
    };
    if codes.len() != n || scales.len() != want_scales {
        return Err(arg_err(
            OP,
            format!(
                "{:?} of shape {:?}: {} codes and {} scales, want {n} and {want_scales}",
                q.tiles,
                q.shape,
                codes.len(),
                scales.len()
            ),
        ));
    }
    b.upload(
        HostData::F32(dequantize_host(&codes, &scales, &q.shape, q.tiles, &sizes)),
        &q.shape,
    )
}

/// Host reference of expansion: `decode(code) · scale`, rows of `row`.
pub fn expand_host(codes: &[u8], scales: &[f32], row: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(codes.len());
    if row == 0 {
        return out;
    }
    let mut scales = scales.iter();
    for r in codes.chunks(row) {
        for block in r.chunks(FP8_BLOCK) {
            let scale = scales.next().copied().unwrap_or(1.0);
            out.extend(block.iter().map(|&c| e4m3_decode(c) * scale));
        }
    }
    out
}

/// Packs bytes four to an i32, little-endian (the last one zero-padded).
pub fn pack_codes(codes: &[u8]) -> Vec<i32> {
    codes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            i32::from_le_bytes(b)
        })
        .collect()
}

/// The first `n` bytes of i32s packed by [`pack_codes`].
pub fn unpack_codes(packed: &[i32], n: usize) -> Vec<u8> {
    let mut out: Vec<u8> = packed.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(n);
    out
}

/// Compression through the host: what [`crate::OffloadOps::compress_fp8`]
/// provides (the CPU's own, since its device memory is host memory).
pub fn compress_via_host<B: Device>(b: &B, t: &Tensor<B>) -> Result<Fp8Tensor<B>> {
    const OP: &str = "compress_fp8";
    if !t.dtype().is_float() {
        return Err(arg_err(OP, format!("{:?} is not a float dtype", t.dtype())));
    }
    let values = b.download(t)?.to_f32();
    let (codes, scales) = compress_host(&values, row_len(t.shape()));
    let packed = pack_codes(&codes);
    let n_packed = packed.len();
    let n_scales = scales.len();
    Ok(Fp8Tensor {
        codes: b.upload(HostData::I32(packed), &[n_packed])?,
        scales: b.upload(HostData::F32(scales), &[n_scales])?,
        shape: t.shape().to_vec(),
        dtype: t.dtype(),
    })
}

/// Expansion through the host: what [`crate::OffloadOps::expand_fp8`]
/// provides.
pub fn expand_via_host<B: Device>(b: &B, f: &Fp8Tensor<B>) -> Result<Tensor<B>> {
    let n: usize = f.shape.iter().product();
    let codes = match b.download(&f.codes)? {
        HostData::I32(v) => unpack_codes(&v, n),
        other => {
            return Err(arg_err(
                "expand_fp8",
                format!("codes must be I32, got {:?}", other.dtype()),
            ))
        }
    };
    let scales = b.download(&f.scales)?.to_f32();
    let values = expand_host(&codes, &scales, f.row_len());
    let data = match f.dtype {
        DType::F64 => HostData::F64(values.into_iter().map(f64::from).collect()),
        _ => HostData::F32(values),
    };
    let t = b.upload(data, &f.shape)?;
    if t.dtype() == f.dtype {
        Ok(t)
    } else {
        b.cast(&t, f.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: the nearest multiple of the quantum `2^(e-3)` of
    /// `|v|`'s binade (`e ≥ -6`), ties to even, saturated at 448.
    fn e4m3_by_definition(v: f32) -> u8 {
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(v).abs().min(f64::from(E4M3_MAX));
        let e = if a > 0.0 {
            a.log2().floor().max(-6.0)
        } else {
            -6.0
        };
        let quantum = (e - 3.0).exp2();
        let q = ((a / quantum).round_ties_even() * quantum).min(f64::from(E4M3_MAX));
        if q < (-6f64).exp2() {
            return sign | (q / (-9f64).exp2()) as u8;
        }
        let e = q.log2().floor();
        let m = (q / e.exp2() * 8.0 - 8.0) as u8;
        sign | (((e as i32 + 7) as u8) << 3) | m
    }

    /// The bit-pattern encoder is the definition on every f32 from 2⁻¹²
    /// to past 448, both signs, ties included (midpoints between codes).
    #[test]
    fn e4m3_encoding_matches_its_definition() {
        let mut checked = 0;
        let mut bits = (-12f32).exp2().to_bits();
        while f32::from_bits(bits) < 600.0 {
            let v = f32::from_bits(bits);
            for x in [v, -v] {
                assert_eq!(e4m3_encode(x), e4m3_by_definition(x), "{x:e}");
            }
            checked += 1;
            bits += 97; // about 350 thousand values, every exponent
        }
        for c in 0u8..0x7e {
            let mid = (e4m3_decode(c) + e4m3_decode(c + 1)) / 2.0;
            assert_eq!(
                e4m3_encode(mid),
                e4m3_by_definition(mid),
                "tie after {c:#04x}"
            );
        }
        assert!(checked > 100_000);
        assert_eq!((e4m3_encode(0.0), e4m3_encode(-0.0)), (0, 0x80));
        // Decoding: every code against the format's formula, in f64.
        for c in 0u8..=255 {
            let (e, m) = (i32::from((c >> 3) & 0xf), f64::from(c & 7));
            let mag = if e == 0 {
                m * (-9f64).exp2()
            } else {
                (1.0 + m / 8.0) * f64::from(e - 7).exp2()
            };
            let want = if c & 0x80 != 0 { -mag } else { mag };
            let got = e4m3_decode(c);
            if c & 0x7f == 0x7f {
                assert!(got.is_nan(), "{c:#04x}");
            } else {
                assert_eq!(got.to_bits(), (want as f32).to_bits(), "{c:#04x}");
            }
        }
    }

    #[test]
    fn e4m3_round_trips_its_codes_and_rounds_to_nearest_even() {
        for c in 0u8..=0xff {
            if c & 0x7f == 0x7f {
                assert!(e4m3_decode(c).is_nan());
                continue;
            }
            let v = e4m3_decode(c);
            let back = e4m3_encode(v);
            // +0 and -0 keep their sign bit.
            assert_eq!(back, c, "code {c:#04x} = {v}");
        }
        assert_eq!(e4m3_decode(e4m3_encode(448.0)), 448.0);
        assert_eq!(e4m3_decode(e4m3_encode(1000.0)), 448.0);
        // Halfway between 1 and 1.125: ties to the even mantissa.
        assert_eq!(e4m3_decode(e4m3_encode(1.0 + 1.0 / 16.0)), 1.0);
        assert_eq!(e4m3_decode(e4m3_encode(1.0 + 3.0 / 16.0)), 1.25);
        assert_eq!(e4m3_decode(e4m3_encode(-0.3)), -0.3125);
        // The smallest subnormal, 2^-9, and half of it (a tie, to zero).
        assert_eq!(e4m3_decode(1), (-9f32).exp2());
        assert_eq!(e4m3_encode((-10f32).exp2()), 0);
        assert_eq!(e4m3_encode(f32::NAN), 0x7f);
    }

    /// A large value costs precision only in its own block; the others keep
    /// e4m3's relative precision, and the short last block of a row works.
    #[test]
    fn blocks_scale_separately_and_pack_round_trips() {
        let row = 300;
        let mut v: Vec<f32> = (0..2 * row).map(|i| ((i as f32) * 0.37).sin()).collect();
        v[200] = 1e4;
        let (codes, scales) = compress_host(&v, row);
        assert_eq!(scales.len(), block_count(&[2, row]));
        assert_eq!(unpack_codes(&pack_codes(&codes), codes.len()), codes);
        let back = expand_host(&codes, &scales, row);
        for (range, what) in [
            (0..128, "first"),
            (256..300, "last, short"),
            (300..428, "row 2"),
        ] {
            let amax = v[range.clone()].iter().fold(0f32, |m, x| m.max(x.abs()));
            for i in range {
                assert!(
                    (back[i] - v[i]).abs() <= amax / 16.0,
                    "{what} block, element {i}: {} for {}",
                    back[i],
                    v[i]
                );
            }
        }
        assert_eq!(back[200], 1e4);
        // An all-zero block has scale 1 and comes back as zeros.
        let (c, s) = compress_host(&[0.0; 5], 5);
        assert_eq!((c, s), (vec![0; 5], vec![1.0]));
    }

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    /// A block's codes are `e4m3(x · 448 / amax)`: its largest value maps
    /// to 448 exactly; an all-zero block and one too small for `448 / amax`
    /// to be a finite f32 have scale 1 and codes 0 (not NaN), and a small
    /// block whose factor is finite keeps its resolution.
    #[test]
    fn block_scaling_uses_the_reciprocal_factor() {
        let (codes, scales) = quantize_blocks_host(&[0.5, -2.0, 1.0, 0.0], 1, 4, (1, 4));
        assert_eq!(scales, [2.0 / 448.0]);
        assert_eq!(e4m3_decode(codes[1]), -448.0);
        assert_eq!(codes[3], 0);
        for tiny in [0.0f32, 1e-37, -1e-38] {
            let (codes, scales) = quantize_blocks_host(&[tiny, 0.0], 1, 2, (1, 2));
            assert_eq!(
                (codes, scales),
                (vec![if tiny < 0.0 { 0x80 } else { 0 }, 0], vec![1.0]),
                "{tiny:e}"
            );
        }
        let (codes, scales) = quantize_blocks_host(&[1e-30, 0.0], 1, 2, (1, 2));
        assert_eq!(scales, [1e-30 / 448.0]);
        assert_eq!(e4m3_decode(codes[0]), 448.0);
    }

    /// Weight blocks of 128 × 128 (ragged at the edges): each block's largest
    /// value maps to ±448, every value comes back within its block's
    /// amax / 16, and the transposed quantisation is code for code that of
    /// the explicit transpose.
    #[test]
    fn square_blocks_and_their_transpose() {
        let (rows, cols) = (200, 300);
        let mut v = sample(rows * cols, 7);
        v[150 * cols + 290] = -40.0;
        let (codes, scales) = quantize_blocks_host(&v, rows, cols, (128, 128));
        assert_eq!(scales.len(), 2 * 3);
        assert_eq!(scales[3 + 2], 40.0 / E4M3_MAX);
        assert_eq!(e4m3_decode(codes[150 * cols + 290]), -448.0);
        for i in 0..rows {
            for j in 0..cols {
                let s = scales[(i / 128) * 3 + j / 128];
                let back = e4m3_decode(codes[i * cols + j]) * s;
                assert!((back - v[i * cols + j]).abs() <= s * E4M3_MAX / 16.0);
            }
        }
        let mut vt = vec![0f32; v.len()];
        for i in 0..rows {
            for j in 0..cols {
                vt[j * rows + i] = v[i * cols + j];
            }
        }
        for block in [(1, 128), (128, 128)] {
            assert_eq!(
                quantize_transposed_host(&v, rows, cols, block),
                quantize_blocks_host(&vt, cols, rows, block),
                "{block:?}"
            );
        }
        // Row tiles are the compression of the stored activations.
        assert_eq!(
            quantize_blocks_host(&v, rows, cols, (1, FP8_BLOCK)),
            compress_host(&v, cols)
        );
    }

    /// Group column tiles are a group's rows cut at the multiples of 128:
    /// none for an empty group, never more than `column_tiles`; the host
    /// quantisation scales each tile's columns alone and dequantises back
    /// within e4m3's precision, rows past the groups code 0.
    #[test]
    fn group_column_tiles_cut_at_multiples_of_128() {
        assert_eq!(
            group_column_tiles(&[70, 0, 150, 64]),
            vec![(0, 70), (70, 58), (128, 92), (220, 36), (256, 28)]
        );
        assert_eq!(
            group_column_tiles(&[128, 0, 256]),
            vec![(0, 128), (128, 128), (256, 128)]
        );
        assert!(group_column_tiles(&[0, 0]).is_empty());
        let mut s = 12345u32;
        for _ in 0..200 {
            let g = 1 + (s % 9) as usize;
            let sizes: Vec<usize> = (0..g)
                .map(|_| {
                    s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    ((s >> 8) % 300) as usize
                })
                .collect();
            let m: usize = sizes.iter().sum::<usize>() + (s % 7) as usize;
            let tiles = group_column_tiles(&sizes);
            assert!(tiles.len() <= column_tiles(m, g), "{sizes:?}");
            assert!(tiles
                .iter()
                .all(|&(r, n)| n > 0 && n <= 128 && r / 128 == (r + n - 1) / 128));
            assert_eq!(
                tiles.iter().map(|t| t.1).sum::<usize>(),
                m - (s % 7) as usize
            );
        }
        let (m, k, sizes) = (304, 5, [70usize, 0, 150, 64]);
        let mut v = sample(m * k, 21);
        v[100 * k + 3] = 9.0; // group 2's first tile, column 3
        let (codes, scales) = quantize_group_columns_host(&v, m, k, &sizes);
        assert_eq!(scales.len(), column_tiles(m, sizes.len()) * k);
        assert_eq!(scales[k + 3], 9.0 / E4M3_MAX);
        assert!(
            scales[2 * k + 3] < 1.0 / E4M3_MAX + 1e-9,
            "tile 2 is not scaled by it"
        );
        assert!(scales[5 * k..].iter().all(|&x| x == 1.0));
        assert!((284..304).all(|i| (0..k).all(|j| codes[j * m + i] == 0)));
        let back = dequantize_host(&codes, &scales, &[m, k], Fp8Tiles::GroupColumns, &sizes);
        for (tile, &(r0, rows)) in group_column_tiles(&sizes).iter().enumerate() {
            for i in r0..r0 + rows {
                for j in 0..k {
                    let s = scales[tile * k + j];
                    assert!((back[i * k + j] - v[i * k + j]).abs() <= s * E4M3_MAX / 16.0);
                }
            }
        }
        assert!(back[284 * k..].iter().all(|&x| x == 0.0));
    }

    /// The blockwise GEMM against the f64 product of its dequantised inputs:
    /// within f32 accumulation error (k · 2⁻²³ of Σ|a·b|, with room for the
    /// per-block promotion), K and N not multiples of 128.
    #[test]
    fn blockwise_matmul_matches_the_f64_product_of_its_inputs() {
        let (m, k, n) = (5, 300, 130);
        let (a, b) = (sample(m * k, 3), sample(k * n, 11));
        let qa = quantize_blocks_host(&a, m, k, (1, FP8_BLOCK));
        let qb = quantize_blocks_host(&b, k, n, (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK));
        let c = blockwise_matmul_host((&qa.0, &qa.1), (&qb.0, &qb.1), (m, k, n));
        let kb = k.div_ceil(FP8_BLOCK);
        let nb = n.div_ceil(FP8_WEIGHT_BLOCK);
        let da =
            |i: usize, l: usize| f64::from(e4m3_decode(qa.0[i * k + l]) * qa.1[i * kb + l / 128]);
        let db = |l: usize, j: usize| {
            f64::from(e4m3_decode(qb.0[l * n + j]) * qb.1[(l / 128) * nb + j / 128])
        };
        let mut worst = 0f64;
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut mag) = (0f64, 0f64);
                for l in 0..k {
                    exact += da(i, l) * db(l, j);
                    mag += (da(i, l) * db(l, j)).abs();
                }
                let err = (f64::from(c[i * n + j]) - exact).abs();
                assert!(
                    err <= 2.0 * k as f64 * f64::from(f32::EPSILON) * mag,
                    "({i}, {j})"
                );
                worst = worst.max(err / mag.max(1e-30));
            }
        }
        assert!(
            worst > 0.0,
            "an f32 accumulation should not be exact everywhere"
        );
        // Against the unquantised product: e4m3 keeps about 2 significant digits.
        let exact = |i: usize, j: usize| {
            (0..k)
                .map(|l| f64::from(a[i * k + l] * b[l * n + j]))
                .sum::<f64>()
        };
        let rel: f64 = (0..m * n)
            .map(|x| (f64::from(c[x]) - exact(x / n, x % n)).powi(2))
            .sum::<f64>()
            .sqrt()
            / (0..m * n)
                .map(|x| exact(x / n, x % n).powi(2))
                .sum::<f64>()
                .sqrt();
        assert!(rel < 0.05, "norm-wise error {rel} against the f32 inputs");
    }
}
