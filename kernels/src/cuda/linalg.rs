//! CUDA dense and grouped matrix products (row-major). Dense GEMMs run on
//! cuBLAS; the grouped GEMM and its weight gradient are kernels of
//! `linalg.cu` that read the group sizes on the device, so the MoE layer
//! never waits for the host: on bf16 tensor-core kernels (mma.sync, 128 × 256
//! tiles, a 4-stage cp.async pipeline), on f32/f64 plain ones.
//!
//! Shape letters: M rows, K inner dimension, N columns, G groups.

use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{result as drv, LaunchConfig};

use super::compile::LINALG;
use super::{float_sfx, launch, Cuda};
use crate::backend::{Device, LinalgOps};
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, Tensor};

/// Rows of one tile of the bf16 tensor-core grouped GEMM (`TC_BM` in
/// linalg.cu; also the wgrad's tile along K).
const TC_TILE: usize = 128;

/// Columns of one tile of the bf16 tensor-core kernels (`TC_BN`).
const TC_TILE_N: usize = 256;

/// Dynamic shared memory of the bf16 tensor-core kernels (`TC_SMEM_BYTES`:
/// 4 stages of a 128 × 64 and a 64 × 256 bf16 tile).
const TC_SMEM_BYTES: usize = 4 * (128 * 64 + 64 * 256) * 2;

/// Kernel `name` of linalg.cu, allowed `TC_SMEM_BYTES` of dynamic shared
/// memory (above the default 48 KiB, so it must be asked for).
fn tc_func(d: &Cuda, name: &str) -> Result<cudarc::driver::CudaFunction> {
    d.bind()?;
    d.func_smem(LINALG, name, TC_SMEM_BYTES as u32)
}

/// A 1-d grid of `blocks`, or an error naming `op` past CUDA's limit.
fn grid_1d(op: &'static str, blocks: usize) -> Result<u32> {
    u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| arg_err(op, format!("{blocks} blocks exceed CUDA's grid limit")))
}

/// Bytes of the cuBLAS workspace (what cuBLAS asks for on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// A cuBLAS handle bound to the device handle's stream, with its workspace.
pub(crate) struct Blas(bsys::cublasHandle_t, super::alloc::Block);

// The handle is only used under the `Cuda`'s mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

fn blas_err(what: &str, e: blas::CublasError) -> KernelError {
    KernelError::DeviceUnavailable {
        device: "cuda",
        reason: format!("{what}: cuBLAS error {e:?}"),
    }
}

impl Cuda {
    /// Runs `f` with this handle's cuBLAS handle, creating it on first use.
    fn with_blas<R>(&self, f: impl FnOnce(bsys::cublasHandle_t) -> Result<R>) -> Result<R> {
        let mut guard = self.inner.blas.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            // A workspace of our own, so cuBLAS never allocates during a CUDA
            // graph capture (its documented requirement for capture).
            let workspace = self.scratch("cuBLAS workspace", BLAS_WORKSPACE)?;
            self.ctx()
                .bind_to_thread()
                .map_err(|e| super::alloc::driver_err("cuBLAS init", e))?;
            let h = blas::create_handle().map_err(|e| blas_err("creating the cuBLAS handle", e))?;
            let blas = Blas(h, workspace);
            unsafe { blas::set_stream(h, self.stream().cu_stream() as _) }
                .map_err(|e| blas_err("binding cuBLAS to the stream", e))?;
            unsafe { bsys::cublasSetWorkspace_v2(h, blas.1.ptr() as *mut _, BLAS_WORKSPACE) }
                .result()
                .map_err(|e| blas_err("setting the cuBLAS workspace", e))?;
            *guard = Some(blas);
        }
        self.ctx()
            .bind_to_thread()
            .map_err(|e| super::alloc::driver_err("cuBLAS call", e))?;
        f(guard.as_ref().map(|b| b.0).expect("created above"))
    }

    /// Group offsets `[G + 1]` and the tensor-core kernel's tile offsets
    /// `[G + 1]` (both i64, scratch) from device sizes `[G]`, checked on the
    /// device against `m` rows.
    fn group_offsets(
        &self,
        op: &'static str,
        sizes: &Tensor<Self>,
        g: usize,
        m: usize,
    ) -> Result<(super::alloc::Block, super::alloc::Block)> {
        sizes.expect_dtype(op, DType::I32)?;
        sizes.expect_shape(op, "group_sizes", &[g])?;
        let neg =
            self.check(move |i, s| arg_err(op, format!("group_sizes[{i}] = {s} is negative")))?;
        // The message lists the sizes, as the CPU's does: the builder reads
        // them back when the error is reported (after the stream has synced).
        let held = sizes.storage().clone();
        let total = self.check(move |t, _| {
            let mut v = vec![0i32; g];
            let listed = if g == 0 || unsafe { drv::memcpy_dtoh_sync(&mut v, held.ptr()) }.is_ok() {
                format!("{v:?} ")
            } else {
                String::new()
            };
            arg_err(
                op,
                format!("group sizes {listed}sum to {t}, more than the {m} rows of x"),
            )
        })?;
        let offs = self.scratch(op, (g + 1) * 8)?;
        let tiles = self.scratch(op, (g + 1) * 8)?;
        let f = self.func(LINALG, "group_offsets")?;
        launch!(
            self,
            f,
            super::rows_cfg(1, 32),
            sizes.storage().ptr(),
            g as i32,
            m as i64,
            offs.ptr(),
            self.err_ptr(),
            neg,
            total,
            tiles.ptr(),
            TC_TILE as i64
        )?;
        Ok((offs, tiles))
    }
}

/// One row-major GEMM on cuBLAS, or `batch` of them at fixed element strides:
/// `C[i] = op(A[i])·op(B[i])` (`op` transposes where asked), `C` being
/// `[m, n]` and the inner dimension `k`. Row lengths are those of the stored
/// matrices (cuBLAS's leading dimensions). Accumulation is f32 (f64 for f64),
/// never TF32.
pub(crate) struct RowGemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub a_row: usize,
    pub a_stride: usize,
    pub trans_a: bool,
    pub b: u64,
    pub b_row: usize,
    pub b_stride: usize,
    pub trans_b: bool,
    pub c: u64,
    pub c_row: usize,
    pub c_stride: usize,
    pub batch: usize,
    /// Element type of A and B.
    pub dtype: DType,
    /// Element type of C: A's, or f32 for bf16 inputs.
    pub out_dtype: DType,
}

fn cuda_type(dtype: DType) -> bsys::cudaDataType {
    match dtype {
        DType::F32 => bsys::cudaDataType::CUDA_R_32F,
        DType::F64 => bsys::cudaDataType::CUDA_R_64F,
        _ => bsys::cudaDataType::CUDA_R_16BF,
    }
}

impl Cuda {
    /// Runs `g` on the handle's stream; `op` names the caller in errors.
    pub(crate) fn row_gemm(&self, op: &'static str, g: &RowGemm) -> Result<()> {
        if g.m * g.n * g.batch == 0 {
            return Ok(());
        }
        for (what, v) in [
            ("M", g.m),
            ("N", g.n),
            ("K", g.k),
            ("A's row length", g.a_row),
            ("B's row length", g.b_row),
            ("C's row length", g.c_row),
            ("the batch", g.batch),
        ] {
            if v > i32::MAX as usize {
                return Err(arg_err(
                    op,
                    format!("{what} = {v} exceeds cuBLAS's 32-bit sizes"),
                ));
            }
        }
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: hand
        // cuBLAS B as its first operand, A as its second, each with its own
        // row length as the leading dimension.
        let op_of = |t: bool| {
            if t {
                bsys::cublasOperation_t::CUBLAS_OP_T
            } else {
                bsys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let compute = match g.dtype {
            // PEDANTIC: plain fp32 FMA, never TF32, whatever the environment
            // says, so f32 results match the CPU to 1e-5.
            DType::F32 => bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            DType::F64 => bsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
            _ => bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let (in_t, out_t) = (cuda_type(g.dtype), cuda_type(g.out_dtype));
        let (one64, zero64) = (1.0f64, 0.0f64);
        let (one32, zero32) = (1.0f32, 0.0f32);
        let (alpha, beta) = if g.dtype == DType::F64 {
            (
                &one64 as *const f64 as *const std::ffi::c_void,
                &zero64 as *const f64 as *const std::ffi::c_void,
            )
        } else {
            (
                &one32 as *const f32 as *const std::ffi::c_void,
                &zero32 as *const f32 as *const std::ffi::c_void,
            )
        };
        let algo = bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        self.with_blas(|h| {
            unsafe {
                if g.batch == 1 {
                    blas::gemm_ex(
                        h,
                        op_of(g.trans_b),
                        op_of(g.trans_a),
                        g.n as i32,
                        g.m as i32,
                        g.k as i32,
                        alpha,
                        g.b as *const _,
                        in_t,
                        g.b_row as i32,
                        g.a as *const _,
                        in_t,
                        g.a_row as i32,
                        beta,
                        g.c as *mut _,
                        out_t,
                        g.c_row as i32,
                        compute,
                        algo,
                    )
                } else {
                    blas::gemm_strided_batched_ex(
                        h,
                        op_of(g.trans_b),
                        op_of(g.trans_a),
                        g.n as i32,
                        g.m as i32,
                        g.k as i32,
                        alpha,
                        g.b as *const _,
                        in_t,
                        g.b_row as i32,
                        g.b_stride as i64,
                        g.a as *const _,
                        in_t,
                        g.a_row as i32,
                        g.a_stride as i64,
                        beta,
                        g.c as *mut _,
                        out_t,
                        g.c_row as i32,
                        g.c_stride as i64,
                        g.batch as i32,
                        compute,
                        algo,
                    )
                }
            }
            .map_err(|e| blas_err(op, e))
        })
    }
}

impl LinalgOps for Cuda {
    fn matmul(
        &self,
        a: &Tensor<Self>,
        b: &Tensor<Self>,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "matmul";
        float_sfx(OP, a.dtype())?;
        let (m, k, n, ac, bc) = crate::backend::matmul_dims(OP, a, b, trans_a, trans_b)?;
        b.expect_dtype(OP, a.dtype())?;
        if m * n == 0 || k == 0 {
            return self.zeros(&[m, n], a.dtype());
        }
        let out = self.alloc(OP, &[m, n], a.dtype())?;
        self.row_gemm(
            OP,
            &RowGemm {
                m,
                n,
                k,
                a: a.storage().ptr(),
                a_row: ac,
                a_stride: 0,
                trans_a,
                b: b.storage().ptr(),
                b_row: bc,
                b_stride: 0,
                trans_b,
                c: out.storage().ptr(),
                c_row: n,
                c_stride: 0,
                batch: 1,
                dtype: a.dtype(),
                out_dtype: a.dtype(),
            },
        )?;
        Ok(out)
    }

    fn grouped_matmul(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "grouped_matmul";
        let sfx = float_sfx(OP, x.dtype())?;
        let (m, k) = x.dims2(OP)?;
        let (g, wr, wc) = w.dims3(OP)?;
        let (wk, n) = if trans_w { (wc, wr) } else { (wr, wc) };
        if wk != k {
            return Err(shape_err(
                OP,
                format!(
                    "x {:?} has K = {k}, w {:?} (trans_w = {trans_w}) has K = {wk}",
                    x.shape(),
                    w.shape()
                ),
            ));
        }
        w.expect_dtype(OP, x.dtype())?;
        let (offs, tiles) = self.group_offsets(OP, group_sizes, g, m)?;
        if x.dtype() == DType::BF16 {
            // Tensor cores; rows past the last group stay zero from here.
            let out = self.zeros(&[m, n], x.dtype())?;
            if m * n > 0 && k > 0 {
                let name = if trans_w {
                    "grouped_mm_tc_bf16_nt"
                } else {
                    "grouped_mm_tc_bf16_nn"
                };
                let f = tc_func(self, name)?;
                // Row tiles (at most M / 128 + G) times column tiles, the
                // column tiles fastest.
                let blocks = (m.div_ceil(TC_TILE) + g) * n.div_ceil(TC_TILE_N);
                let cfg = LaunchConfig {
                    grid_dim: (grid_1d(OP, blocks)?, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: TC_SMEM_BYTES as u32,
                };
                launch!(
                    self,
                    f,
                    cfg,
                    x.storage().ptr(),
                    w.storage().ptr(),
                    offs.ptr(),
                    tiles.ptr(),
                    out.storage().ptr(),
                    k as i64,
                    n as i64,
                    g as i32
                )?;
            }
            return Ok(out);
        }
        let out = self.alloc(OP, &[m, n], x.dtype())?;
        if m * n > 0 {
            let f = self.func(LINALG, &format!("grouped_mm_{sfx}"))?;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
                block_dim: (16, 16, 1),
                shared_mem_bytes: ((g + 1) * 8) as u32,
            };
            launch!(
                self,
                f,
                cfg,
                x.storage().ptr(),
                w.storage().ptr(),
                offs.ptr(),
                out.storage().ptr(),
                m as i64,
                k as i64,
                n as i64,
                g as i32,
                trans_w as i32
            )?;
        }
        Ok(out)
    }

    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "grouped_matmul_weight_grad";
        let sfx = float_sfx(OP, x.dtype())?;
        let (m, k) = x.dims2(OP)?;
        let (my, n) = dy.dims2(OP)?;
        if my != m {
            return Err(shape_err(
                OP,
                format!(
                    "x {:?} and dy {:?} disagree on the row count",
                    x.shape(),
                    dy.shape()
                ),
            ));
        }
        let g = match group_sizes.shape() {
            [g] => *g,
            other => {
                return Err(shape_err(
                    OP,
                    format!("group_sizes must be 1-d [G], got shape {other:?}"),
                ))
            }
        };
        dy.expect_dtype(OP, x.dtype())?;
        let (offs, _tiles) = self.group_offsets(OP, group_sizes, g, m)?;
        let out = self.alloc(OP, &[g, k, n], x.dtype())?;
        if g * k * n > 0 {
            let (f, cfg) = if x.dtype() == DType::BF16 {
                // Tensor cores; one block per 128 × 256 output tile of a group.
                let grid = (
                    n.div_ceil(TC_TILE_N) as u32,
                    k.div_ceil(TC_TILE) as u32,
                    g as u32,
                );
                let f = tc_func(self, "grouped_wgrad_tc_bf16")?;
                (f, (grid, (256, 1, 1), TC_SMEM_BYTES as u32))
            } else {
                let grid = (n.div_ceil(32) as u32, k.div_ceil(8) as u32, g as u32);
                let f = self.func(LINALG, &format!("grouped_wgrad_{sfx}"))?;
                (f, (grid, (32, 8, 1), 0))
            };
            let cfg = LaunchConfig {
                grid_dim: cfg.0,
                block_dim: cfg.1,
                shared_mem_bytes: cfg.2,
            };
            launch!(
                self,
                f,
                cfg,
                x.storage().ptr(),
                dy.storage().ptr(),
                offs.ptr(),
                out.storage().ptr(),
                k as i64,
                n as i64
            )?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::HostData;

    /// f32 values uniform in [-1, 1) rounded to bf16, as an f32 tensor (the
    /// reference's input) and a bf16 one (the tensor-core kernels').
    fn pair(d: &Cuda, shape: &[usize], seed: u64) -> (Tensor<Cuda>, Tensor<Cuda>) {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        let b = d
            .cast(&d.upload(HostData::F32(v), shape).unwrap(), DType::BF16)
            .unwrap();
        (d.cast(&b, DType::F32).unwrap(), b)
    }

    fn host(d: &Cuda, t: &Tensor<Cuda>) -> Vec<f32> {
        let t = d.cast(t, DType::F32).unwrap();
        match d.download(&t).unwrap() {
            HostData::F32(v) => v,
            other => panic!("expected f32, got {other:?}"),
        }
    }

    /// Asserts every element of `got` is within 1% of `want`'s largest
    /// magnitude of `want` (bf16 output rounding is 0.4%), naming the worst.
    fn assert_close(what: &str, got: &[f32], want: &[f32], cols: usize) {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let (mut worst, mut at) = (0f32, 0);
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            let e = (a - b).abs();
            if e > worst || e.is_nan() {
                (worst, at) = (e, i);
            }
        }
        assert!(
            worst <= 1e-2 * scale,
            "{what}: element ({}, {}) is {} against {} (scale {scale})",
            at / cols.max(1),
            at % cols.max(1),
            got[at],
            want[at]
        );
    }

    /// The bf16 tensor-core grouped GEMMs (both layouts) and weight gradient
    /// against the f32 kernels on the same bf16-rounded inputs, at the edges
    /// of their tiles: group ends inside a 128-row tile, empty groups,
    /// padding rows, N past a 256-column tile, K over more steps than the
    /// 4-stage pipeline holds (and at the MoE's 2048), K and N not multiples
    /// of 8 (element loads and stores), and the fc2 shape K = 768, N = 2048
    /// with groups of 64·n + 1, 64·n and 64·n - 1 rows (the weight gradient
    /// loads whole 64-row steps unchecked and checks only a group's last).
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn tensor_core_grouped_gemms_match_f32() {
        let d = crate::cuda::require_test_device();
        let cases: [(&[i32], usize, usize, usize); 6] = [
            (&[300, 0, 1, 257, 64, 0, 513], 1200, 320, 520),
            (&[1024, 1000, 0, 1100], 3200, 2048, 768),
            (&[129, 1024, 0, 63, 640, 65], 2000, 768, 2048),
            (&[5, 130, 0, 70], 210, 77, 203),
            (&[129, 3], 140, 72, 13),
            (&[0, 0], 10, 64, 64),
        ];
        for (ci, (sizes, m, k, n)) in cases.into_iter().enumerate() {
            let g = sizes.len();
            let gs = d.upload(HostData::I32(sizes.to_vec()), &[g]).unwrap();
            let seed = 10 * ci as u64;
            let (x32, x16) = pair(&d, &[m, k], seed + 1);
            for trans_w in [false, true] {
                let ws = if trans_w { [g, n, k] } else { [g, k, n] };
                let (w32, w16) = pair(&d, &ws, seed + 2);
                let want = host(&d, &d.grouped_matmul(&x32, &w32, &gs, trans_w).unwrap());
                let got = host(&d, &d.grouped_matmul(&x16, &w16, &gs, trans_w).unwrap());
                let what = format!("grouped_matmul {sizes:?} m={m} k={k} n={n} trans_w={trans_w}");
                assert_close(&what, &got, &want, n);
            }
            let (dy32, dy16) = pair(&d, &[m, n], seed + 3);
            let want = host(&d, &d.grouped_matmul_weight_grad(&x32, &dy32, &gs).unwrap());
            let got = host(&d, &d.grouped_matmul_weight_grad(&x16, &dy16, &gs).unwrap());
            let what = format!("grouped_matmul_weight_grad {sizes:?} m={m} k={k} n={n}");
            assert_close(&what, &got, &want, n);
        }
    }
}
