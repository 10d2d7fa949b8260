//! CPU blockwise fp8 GEMMs: the emulation [`Fp8Ops`] provides (quantise,
//! dequantise, f32 GEMM), run as it is, so CI checks the recipe's numerics.

use super::Cpu;
use crate::backend::Fp8Ops;

impl Fp8Ops for Cpu {}

#[cfg(test)]
mod tests {
    use crate::cpu::test_util::*;
    use crate::fp8::*;
    use crate::tensor::{DType, HostData, Tensor};

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    /// The codes of `q` as bytes.
    fn codes<B: TestOps>(d: &B, q: &Fp8Matrix<B>) -> Vec<u8> {
        let n: usize = q.shape.iter().product();
        match d.download(&q.codes).unwrap() {
            HostData::I32(v) => unpack_codes(&v, n),
            other => panic!("codes are {:?}", other.dtype()),
        }
    }

    /// `Σ_l a(i, l)·b(l, j)` in f64 and `Σ |a·b|`, for the error bound of an
    /// f32 accumulation of `k` terms.
    fn f64_product(a: impl Fn(usize) -> f64, b: impl Fn(usize) -> f64, k: usize) -> (f64, f64) {
        (0..k).fold((0.0, 0.0), |(s, m), l| {
            let p = a(l) * b(l);
            (s + p, m + p.abs())
        })
    }

    /// Quantisation gives the host reference's codes and scales in every
    /// layout; the three grouped fp8 GEMMs (forward, data gradient, weight
    /// gradient) equal the f64 products of their dequantised operands within
    /// f32 accumulation error, over ragged, empty and padded groups and K, N
    /// not multiples of 128; group tiles restart at each group.
    fn fp8_gemms_match_their_dequantised_operands<B: TestOps>(d: &B) {
        let (m, k, n) = (200, 300, 130);
        let sizes = [70usize, 0, 110]; // 20 padding rows
        let g = sizes.len();
        let gs = d.ti32(&sizes.map(|s| s as i32), &[g]);
        let (x, dy, w) = (sample(m * k, 3), sample(m * n, 5), sample(g * k * n, 9));
        let mut x = x;
        x[5 * k + 7] = 30.0; // a large value in group 0 alone
        let (xt, dyt) = (d.t32(&x, &[m, k]), d.t32(&dy, &[m, n]));
        let wt = d.t32(&w, &[g, k, n]);
        let gc = Fp8Tiles::GroupColumns;
        let q = |t, tiles, s: bool| d.quantize_fp8(t, tiles, s.then_some(&gs)).unwrap();
        let x_rows = q(&xt, Fp8Tiles::Rows, false);
        let x_cols = q(&xt, gc, true);
        let dy_rows = q(&dyt, Fp8Tiles::Rows, false);
        let dy_cols = q(&dyt, gc, true);
        let w_fwd = q(&wt, Fp8Tiles::Blocks { transposed: true }, false);
        let w_bwd = q(&wt, Fp8Tiles::Blocks { transposed: false }, false);
        for (what, qm, v, shape) in [
            ("x rows", &x_rows, &x, vec![m, k]),
            ("x columns", &x_cols, &x, vec![m, k]),
            ("dy columns", &dy_cols, &dy, vec![m, n]),
            ("w transposed", &w_fwd, &w, vec![g, k, n]),
            ("w", &w_bwd, &w, vec![g, k, n]),
        ] {
            let (c, s) = quantize_host(v, &shape, qm.tiles, &sizes);
            assert_eq!(codes(d, qm), c, "{what}: codes");
            assert_eq!(
                d.h64(&qm.scales),
                s.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
                "{what}: scales"
            );
        }
        // x's large value scales its own column tile of group 0 only (scales
        // [column_tiles, k], tile-major; group 2's first tile, rows 70..128,
        // is tile 1).
        let xs = d.h64(&x_cols.scales);
        assert_eq!(xs.len(), column_tiles(m, g) * k);
        assert_eq!(xs[7], f64::from(30.0 / E4M3_MAX));
        assert!(
            xs[k + 7] < 1.0 / f64::from(E4M3_MAX) + 1e-9,
            "group 2's first tile"
        );
        // Dequantised values, logical layout (what the emulation multiplies).
        let deq =
            |qm: &Fp8Matrix<B>, s: bool| d.h64(&d.dequantize_fp8(qm, s.then_some(&gs)).unwrap());
        let (xr, xc, dyr, dyc) = (
            deq(&x_rows, false),
            deq(&x_cols, true),
            deq(&dy_rows, false),
            deq(&dy_cols, true),
        );
        let (wf, wb) = (deq(&w_fwd, false), deq(&w_bwd, false));
        assert_eq!(wf, wb, "a weight's blocks dequantise alike in both layouts");
        let in_group = |i: usize| {
            let mut start = 0;
            for (e, &s) in sizes.iter().enumerate() {
                if i < start + s {
                    return Some(e);
                }
                start += s;
            }
            None
        };
        let check = |what: &str, got: Vec<f64>, want: &dyn Fn(usize) -> (f64, f64), kk: usize| {
            for (i, &v) in got.iter().enumerate() {
                let (exact, mag) = want(i);
                let tol = 2.0 * kk as f64 * f64::from(f32::EPSILON) * mag;
                assert!(
                    (v - exact).abs() <= tol,
                    "{what}[{i}]: {v} vs {exact} (tol {tol})"
                );
            }
        };
        for dtype in [DType::F32, DType::BF16] {
            let y = d
                .grouped_matmul_fp8(&x_rows, &w_fwd, &gs, false, dtype)
                .unwrap();
            assert_eq!((y.shape(), y.dtype()), (&[m, n][..], dtype));
            if dtype == DType::BF16 {
                continue;
            }
            check(
                "y",
                d.h64(&y),
                &|idx| {
                    let (i, j) = (idx / n, idx % n);
                    in_group(i).map_or((0.0, 0.0), |e| {
                        f64_product(|l| xr[i * k + l], |l| wf[e * k * n + l * n + j], k)
                    })
                },
                k,
            );
        }
        let dx = d
            .grouped_matmul_fp8(&dy_rows, &w_bwd, &gs, true, DType::F32)
            .unwrap();
        check(
            "dx",
            d.h64(&dx),
            &|idx| {
                let (i, j) = (idx / k, idx % k);
                in_group(i).map_or((0.0, 0.0), |e| {
                    f64_product(|l| dyr[i * n + l], |l| wb[e * k * n + j * n + l], n)
                })
            },
            n,
        );
        let dw = d
            .grouped_matmul_weight_grad_fp8(&x_cols, &dy_cols, &gs, DType::F32)
            .unwrap();
        assert_eq!(dw.shape(), &[g, k, n]);
        check(
            "dw",
            d.h64(&dw),
            &|idx| {
                let (e, j, l) = (idx / (k * n), (idx / n) % k, idx % n);
                let start: usize = sizes[..e].iter().sum();
                f64_product(
                    |r| xc[(start + r) * k + j],
                    |r| dyc[(start + r) * n + l],
                    sizes[e],
                )
            },
            110,
        );
        // Against the host blockwise GEMM (promoted every 128 of K) on group 0.
        let (ca, sa) = quantize_host(&x[..70 * k], &[70, k], Fp8Tiles::Rows, &[]);
        let (cb, sb) = quantize_host(
            &w[..k * n],
            &[1, k, n],
            Fp8Tiles::Blocks { transposed: false },
            &[],
        );
        let host = blockwise_matmul_host((&ca, &sa), (&cb, &sb), (70, k, n));
        let y = d.h64(
            &d.grouped_matmul_fp8(&x_rows, &w_fwd, &gs, false, DType::F32)
                .unwrap(),
        );
        for (i, (&a, &b)) in host.iter().zip(&y[..70 * n]).enumerate() {
            let (_, mag) = f64_product(|l| xr[(i / n) * k + l], |l| wf[l * n + i % n], k);
            assert!(
                (f64::from(a) - b).abs() <= 4.0 * k as f64 * f64::from(f32::EPSILON) * mag,
                "host blockwise [{i}]"
            );
        }
    }

    /// The three fp8 products at shapes the CUDA tensor-core kernels take
    /// (`fp8_sm90.cu`: the summed dimension a multiple of 16; here K = 400,
    /// N = 144, M = 304, none a multiple of 128, so the last blocks are
    /// partial), ragged groups (70 and 150 rows: partial column tiles) with
    /// an empty one and 20 padding rows, bf16 and f32 out, against the f64
    /// products of the dequantised operands. The CPU (emulation: f32 sums)
    /// is held to f32 accumulation error. CUDA's fp8 tensor cores add the
    /// products inside each 128-block of K with a narrower accumulator than
    /// f32 (DeepSeek-V3 measures about 14 bits kept on Hopper) before the
    /// kernel promotes the block into f32, so there the bound has 2⁻⁹ of
    /// Σ|a·b| on top. Measured on the H200 (both kernel versions alike):
    /// worst |err| / Σ|a·b| 1.6e-4 for y (K = 400) and 7.6e-4 for dx
    /// (K = 144), against at most 9e-7 for the f32 emulation; the f32 bound
    /// (2·K·ε, 3e-5 to 1e-4) fails by that accumulation, 2⁻⁹ ≈ 2e-3 holds
    /// with 2.5× room. The worst |err| / Σ|a·b| is printed.
    fn fp8_gemms_at_tensor_core_shapes<B: TestOps>(d: &B) {
        let (m, k, n) = (304, 400, 144);
        let sizes = [70usize, 0, 150, 64]; // 20 padding rows
        let g = sizes.len();
        let gs = d.ti32(&sizes.map(|s| s as i32), &[g]);
        let (x, dy, w) = (sample(m * k, 11), sample(m * n, 13), sample(g * k * n, 17));
        let mut x = x;
        x[75 * k + 130] = 40.0; // a large value in one row tile of group 2
        let (xt, dyt, wt) = (
            d.t32(&x, &[m, k]),
            d.t32(&dy, &[m, n]),
            d.t32(&w, &[g, k, n]),
        );
        let q = |t, tiles| d.quantize_fp8(t, tiles, None).unwrap();
        let x_rows = q(&xt, Fp8Tiles::Rows);
        let dy_rows = q(&dyt, Fp8Tiles::Rows);
        let w_fwd = q(&wt, Fp8Tiles::Blocks { transposed: true });
        let w_bwd = q(&wt, Fp8Tiles::Blocks { transposed: false });
        let deq = |qm: &Fp8Matrix<B>| d.h64(&d.dequantize_fp8(qm, None).unwrap());
        let (xr, dyr, wd) = (deq(&x_rows), deq(&dy_rows), deq(&w_fwd));
        let in_group = |i: usize| {
            let mut start = 0;
            for (e, &s) in sizes.iter().enumerate() {
                if i < start + s {
                    return Some(e);
                }
                start += s;
            }
            None
        };
        let fp8_cores = B::NAME == "cuda";
        let check = |what: &str,
                     got: Vec<f64>,
                     cols: usize,
                     want: &dyn Fn(usize, usize, usize) -> (f64, f64),
                     kk: usize,
                     bf16: bool| {
            let mut worst = 0f64;
            for (idx, &v) in got.iter().enumerate() {
                let (i, j) = (idx / cols, idx % cols);
                let Some(e) = in_group(i) else {
                    assert_eq!(v, 0.0, "{what}[{i}, {j}]: a padding row");
                    continue;
                };
                let (exact, mag) = want(e, i, j);
                let mut tol = 2.0 * kk as f64 * f64::from(f32::EPSILON) * mag;
                if fp8_cores {
                    tol += mag / 512.0;
                }
                if bf16 {
                    tol += exact.abs() / 256.0;
                }
                let err = (v - exact).abs();
                if !bf16 && mag > 0.0 {
                    worst = worst.max(err / mag);
                }
                assert!(err <= tol, "{what}[{i}, {j}]: {v} vs {exact} (tol {tol})");
            }
            if !bf16 {
                println!(
                    "{what}: worst |err| / sum |a b| = {worst:.3e} on {}",
                    B::NAME
                );
            }
        };
        for dtype in [DType::F32, DType::BF16] {
            let bf = dtype == DType::BF16;
            let y = d
                .grouped_matmul_fp8(&x_rows, &w_fwd, &gs, false, dtype)
                .unwrap();
            assert_eq!((y.shape(), y.dtype()), (&[m, n][..], dtype));
            check(
                &format!("y {dtype:?}"),
                d.h64(&y),
                n,
                &|e, i, j| f64_product(|l| xr[i * k + l], |l| wd[e * k * n + l * n + j], k),
                k,
                bf,
            );
            let dx = d
                .grouped_matmul_fp8(&dy_rows, &w_bwd, &gs, true, dtype)
                .unwrap();
            assert_eq!((dx.shape(), dx.dtype()), (&[m, k][..], dtype));
            check(
                &format!("dx {dtype:?}"),
                d.h64(&dx),
                k,
                &|e, i, j| f64_product(|l| dyr[i * n + l], |l| wd[e * k * n + j * n + l], n),
                n,
                bf,
            );
        }
        let x_cols = d
            .quantize_fp8(&xt, Fp8Tiles::GroupColumns, Some(&gs))
            .unwrap();
        let dy_cols = d
            .quantize_fp8(&dyt, Fp8Tiles::GroupColumns, Some(&gs))
            .unwrap();
        let deqc = |qm: &Fp8Matrix<B>| d.h64(&d.dequantize_fp8(qm, Some(&gs)).unwrap());
        let (xc, dyc) = (deqc(&x_cols), deqc(&dy_cols));
        for dtype in [DType::F32, DType::BF16] {
            let dw = d
                .grouped_matmul_weight_grad_fp8(&x_cols, &dy_cols, &gs, dtype)
                .unwrap();
            assert_eq!((dw.shape(), dw.dtype()), (&[g, k, n][..], dtype));
            // Rows of the check are (group, row of K): in_group sees none
            // past the groups, so map them onto the groups' rows.
            let got = d.h64(&dw);
            let mut worst = 0f64;
            for (idx, &v) in got.iter().enumerate() {
                let (e, j, l) = (idx / (k * n), (idx / n) % k, idx % n);
                let start: usize = sizes[..e].iter().sum();
                let (exact, mag) = f64_product(
                    |r| xc[(start + r) * k + j],
                    |r| dyc[(start + r) * n + l],
                    sizes[e],
                );
                let mut tol = 2.0 * 150.0 * f64::from(f32::EPSILON) * mag;
                if fp8_cores {
                    tol += mag / 512.0;
                }
                if dtype == DType::BF16 {
                    tol += exact.abs() / 256.0;
                } else if mag > 0.0 {
                    worst = worst.max((v - exact).abs() / mag);
                }
                assert!(
                    (v - exact).abs() <= tol,
                    "dw {dtype:?}[{e}, {j}, {l}]: {v} vs {exact} (tol {tol})"
                );
            }
            if dtype == DType::F32 {
                println!(
                    "dw F32: worst |err| / sum |a b| = {worst:.3e} on {}",
                    B::NAME
                );
            }
        }
    }

    /// Wrong operands are errors naming the layouts, not wrong numbers.
    fn fp8_rejects_mismatched_operands<B: TestOps>(d: &B) {
        let gs = d.ti32(&[2, 1], &[2]);
        let x = d.t32(&sample(3 * 16, 1), &[3, 16]);
        let w = d.t32(&sample(2 * 16 * 8, 2), &[2, 16, 8]);
        let rows = d.quantize_fp8(&x, Fp8Tiles::Rows, None).unwrap();
        let w_t = d
            .quantize_fp8(&w, Fp8Tiles::Blocks { transposed: true }, None)
            .unwrap();
        let w_n = d
            .quantize_fp8(&w, Fp8Tiles::Blocks { transposed: false }, None)
            .unwrap();
        let e = d
            .grouped_matmul_fp8(&rows, &w_n, &gs, false, DType::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("summed dimension contiguous"), "{e}");
        assert!(d
            .grouped_matmul_fp8(&rows, &w_t, &gs, false, DType::F32)
            .is_ok());
        let e = d
            .grouped_matmul_weight_grad_fp8(&rows, &rows, &gs, DType::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("GroupColumns"), "{e}");
        let e = d
            .quantize_fp8(&x, Fp8Tiles::GroupColumns, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("group sizes"), "{e}");
        let e = d
            .quantize_fp8(&w, Fp8Tiles::Rows, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2-d"), "{e}");
        // On CUDA the device reports the sizes at the next read.
        let big = d.ti32(&[3, 1], &[2]);
        let e = d
            .quantize_fp8(&x, Fp8Tiles::GroupColumns, Some(&big))
            .and_then(|q| d.download(&q.scales))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sum to 4"), "{e}");
        let idx = d.ti32(&[1, 2, 3], &[1, 3]);
        let e = d
            .quantize_fp8(&idx, Fp8Tiles::Rows, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a float dtype"), "{e}");
    }

    /// bf16 operands (the CUDA kernels' 16-byte staging paths) quantise to
    /// the host reference's codes and scales of the same bf16 values: weight
    /// blocks whole (rows a multiple of 8) and partial, plain and
    /// transposed; group columns over ragged, empty and padded groups, K past
    /// one block's 512 columns and not a multiple of 64.
    fn fp8_bf16_operands_quantise_as_the_host<B: TestOps>(d: &B) {
        let bf16_of = |v: &[f32], shape: &[usize]| {
            let t = d.cast(&d.t32(v, shape), DType::BF16).unwrap();
            let host: Vec<f32> = d.h64(&t).iter().map(|&x| x as f32).collect();
            (t, host)
        };
        // 130 rows: a whole block whose transposed codes are stored a byte
        // at a time (r not a multiple of 4).
        for (g, r, c) in [(2, 256, 384), (1, 200, 136), (1, 130, 136)] {
            let (w, wh) = bf16_of(&sample(g * r * c, 11), &[g, r, c]);
            for transposed in [false, true] {
                let tiles = Fp8Tiles::Blocks { transposed };
                let q = d.quantize_fp8(&w, tiles, None).unwrap();
                let (codes_h, scales_h) = quantize_host(&wh, &[g, r, c], tiles, &[]);
                assert_eq!(codes(d, &q), codes_h, "w {g}x{r}x{c} {tiles:?}: codes");
                let scales_d: Vec<f32> = d.h64(&q.scales).iter().map(|&x| x as f32).collect();
                assert_eq!(scales_d, scales_h, "w {g}x{r}x{c} {tiles:?}: scales");
            }
        }
        let (m, k) = (700, 1096);
        let sizes = [70usize, 0, 300, 5, 197];
        let gs = d.ti32(&sizes.map(|s| s as i32), &[sizes.len()]);
        let (x, xh) = bf16_of(&sample(m * k, 13), &[m, k]);
        let q = d
            .quantize_fp8(&x, Fp8Tiles::GroupColumns, Some(&gs))
            .unwrap();
        let (codes_h, scales_h) = quantize_host(&xh, &[m, k], Fp8Tiles::GroupColumns, &sizes);
        assert_eq!(codes(d, &q), codes_h, "x group columns: codes");
        let scales_d: Vec<f32> = d.h64(&q.scales).iter().map(|&x| x as f32).collect();
        assert_eq!(scales_d, scales_h, "x group columns: scales");
    }

    /// The one-pass row and column quantisation equals a permute and the
    /// two separate quantisations bit for bit: bf16 (the CUDA kernel's case)
    /// over ragged, empty and padded groups, rows the groups fill exactly, K
    /// past one block's 512 columns and not a multiple of 128, no rows in
    /// any group, rows gathered through an index (repeats, zero rows); f32
    /// and K not a multiple of 8 (the separate passes).
    fn fp8_rows_and_columns_in_one_pass_equal_two<B: TestOps>(d: &B) {
        let cases: [(usize, usize, &[i32], DType, bool); 8] = [
            (700, 1096, &[70, 0, 300, 5, 197], DType::BF16, false),
            (256, 2048, &[128, 128], DType::BF16, false),
            (300, 136, &[0, 0], DType::BF16, false),
            (129, 768, &[129], DType::BF16, false),
            (200, 264, &[3, 150], DType::F32, false),
            (90, 100, &[40, 50], DType::BF16, false),
            (700, 1096, &[70, 0, 300, 5, 197], DType::BF16, true),
            (200, 264, &[3, 150], DType::F32, true),
        ];
        for (m, k, sizes, dtype, gathered) in cases {
            let case = format!("{m}x{k} {dtype:?} groups {sizes:?} gathered {gathered}");
            // Gathered: m rows from 37 tokens, every 9th row a zero row.
            let tokens = if gathered { 37 } else { m };
            let x = d
                .cast(&d.t32(&sample(tokens * k, 17), &[tokens, k]), dtype)
                .unwrap();
            let src: Vec<i32> = (0..m)
                .map(|r| {
                    if r % 9 == 4 {
                        -1
                    } else {
                        ((r * 7) % tokens) as i32
                    }
                })
                .collect();
            let row_src = gathered.then(|| d.ti32(&src, &[m]));
            let gs = d.ti32(sizes, &[sizes.len()]);
            let (rows, cols) = d
                .quantize_fp8_rows_and_columns(&x, row_src.as_ref(), &gs)
                .unwrap();
            let x_rows = match &row_src {
                Some(r) => d.permute(&x, r).unwrap(),
                None => x.clone(),
            };
            let rows_2 = d.quantize_fp8(&x_rows, Fp8Tiles::Rows, None).unwrap();
            let cols_2 = d
                .quantize_fp8(&x_rows, Fp8Tiles::GroupColumns, Some(&gs))
                .unwrap();
            for (name, one, two) in [("rows", &rows, &rows_2), ("columns", &cols, &cols_2)] {
                assert_eq!(one.tiles, two.tiles, "{case}: {name} tiles");
                assert_eq!(one.shape, two.shape, "{case}: {name} shape");
                assert_eq!(codes(d, one), codes(d, two), "{case}: {name} codes");
                assert_eq!(
                    d.h64(&one.scales),
                    d.h64(&two.scales),
                    "{case}: {name} scales"
                );
            }
        }
    }

    /// `grouped_matmul_fp8_accumulate` gives the bits of the product added
    /// to the tensor (`grouped_matmul_fp8`, then `add`) in f32 and bf16, for
    /// the forward and the data gradient, over ragged, empty and padded
    /// groups, N a multiple of 8 and not; a tensor sharing the accumulated
    /// one's storage keeps its values.
    fn fp8_accumulate_adds_the_product_bit_for_bit<B: TestOps>(d: &B) {
        let bits = |t: &Tensor<B>| -> Vec<u64> { d.h64(t).iter().map(|v| v.to_bits()).collect() };
        for (case, (m, k, n, sizes)) in [
            (304usize, 400usize, 144usize, vec![70usize, 0, 150, 64]),
            (200, 256, 100, vec![0, 33, 128, 19]),
        ]
        .into_iter()
        .enumerate()
        {
            let g = sizes.len();
            let gs = d.ti32(&sizes.iter().map(|&s| s as i32).collect::<Vec<_>>(), &[g]);
            let seed = 40 + 10 * case as u32;
            let q = |v: Vec<f32>, shape: &[usize], tiles| {
                d.quantize_fp8(&d.t32(&v, shape), tiles, None).unwrap()
            };
            let x_rows = q(sample(m * k, seed), &[m, k], Fp8Tiles::Rows);
            let dy_rows = q(sample(m * n, seed + 1), &[m, n], Fp8Tiles::Rows);
            let w = sample(g * k * n, seed + 2);
            let w_fwd = q(w.clone(), &[g, k, n], Fp8Tiles::Blocks { transposed: true });
            let w_bwd = q(w, &[g, k, n], Fp8Tiles::Blocks { transposed: false });
            for dtype in [DType::F32, DType::BF16] {
                for (what, a, wq, trans_w, cols) in [
                    ("forward", &x_rows, &w_fwd, false, n),
                    ("data gradient", &dy_rows, &w_bwd, true, k),
                ] {
                    let y0 = d
                        .cast(&d.t32(&sample(m * cols, seed + 3), &[m, cols]), dtype)
                        .unwrap();
                    let before = bits(&y0);
                    let p = d.grouped_matmul_fp8(a, wq, &gs, trans_w, dtype).unwrap();
                    let want = bits(&d.add(&y0, &p).unwrap());
                    let mut y = y0.clone();
                    d.grouped_matmul_fp8_accumulate(&mut y, a, wq, &gs, trans_w)
                        .unwrap();
                    assert_eq!((y.shape(), y.dtype()), (&[m, cols][..], dtype));
                    let got = bits(&y);
                    let diff = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert!(
                        diff.is_none(),
                        "case {case} {what} {dtype:?}: element {diff:?} differs from product + add"
                    );
                    assert_eq!(
                        bits(&y0),
                        before,
                        "case {case} {what}: the shared tensor changed"
                    );
                }
            }
            let mut wrong = d.t32(&sample(m * (n + 1), 1), &[m, n + 1]);
            let err = d
                .grouped_matmul_fp8_accumulate(&mut wrong, &x_rows, &w_fwd, &gs, false)
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("{}", n + 1)), "{err}");
        }
    }

    device_tests!(
        fp8_accumulate_adds_the_product_bit_for_bit,
        fp8_bf16_operands_quantise_as_the_host,
        fp8_rows_and_columns_in_one_pass_equal_two,
        fp8_gemms_match_their_dequantised_operands,
        fp8_gemms_at_tensor_core_shapes,
        fp8_rejects_mismatched_operands
    );
}
