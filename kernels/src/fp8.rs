//! fp8 (e4m3) storage of saved activations, with one scale per 1×128 block
//! of a row (docs/ARCHITECTURE.md §2, §5): the codec, the compressed tensor, and the host
//! reference that [`crate::OffloadOps::compress_fp8`] provides and the CUDA
//! backend reproduces bit for bit on the device.
//!
//! Every step is in f32, whatever the tensor's dtype: a block's scale is
//! `amax / 448` (1 for an all-zero block), its codes are `e4m3(x / scale)`
//! rounded to nearest even and saturated at ±448, and expansion is
//! `decode(code) · scale`. f64 tensors go through f32 first (fp8 keeps far
//! less than f32 anyway).

use crate::backend::Device;
use crate::error::{arg_err, Result};
use crate::tensor::{DType, HostData, Tensor};

/// The largest finite e4m3 (OCP `E4M3FN`) value.
pub const E4M3_MAX: f32 = 448.0;

/// Elements per scaling block: 1 × 128 along the last dimension (the last
/// block of a row may be shorter).
pub const FP8_BLOCK: usize = 128;

/// The e4m3 code of `v` (already scaled into range), rounded to nearest
/// even and saturated at ±448; NaN gives the NaN code 0x7f.
pub fn e4m3_encode(v: f32) -> u8 {
    let v = f64::from(v);
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    if v.is_nan() {
        return 0x7f;
    }
    let a = v.abs().min(f64::from(E4M3_MAX));
    // The exponent of `a` (subnormals below 2^-6 share exponent -6); a
    // quantum of 2^(e-3) gives the three mantissa bits.
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

/// The value of e4m3 code `c`.
pub fn e4m3_decode(c: u8) -> f32 {
    if c & 0x7f == 0x7f {
        return f32::NAN;
    }
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((c >> 3) & 0xf) as i32, f32::from(c & 7));
    let mag = if e == 0 {
        m * (-9f32).exp2()
    } else {
        (1.0 + m / 8.0) * ((e - 7) as f32).exp2()
    };
    sign * mag
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
/// scales of `values`, rows of `row` elements.
pub fn compress_host(values: &[f32], row: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len().div_ceil(FP8_BLOCK.max(1)));
    if row == 0 {
        return (codes, scales);
    }
    for r in values.chunks(row) {
        for block in r.chunks(FP8_BLOCK) {
            let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            codes.extend(block.iter().map(|&x| e4m3_encode(x / scale)));
            scales.push(scale);
        }
    }
    (codes, scales)
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
}
