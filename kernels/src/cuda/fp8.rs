//! CUDA blockwise fp8 GEMM operands: quantisation into the three tilings of
//! [`Fp8Tiles`] and dequantisation, on the device (`fp8.cu`, equal to the
//! host reference bit for bit), with no host wait. The forward and data
//! gradient GEMM ([`Fp8Ops::grouped_matmul_fp8`]) runs on `fp8_sm90.cu`'s
//! TMA + wgmma e4m3 kernel on sm_90a (K a multiple of 16, bf16 or f32
//! out), and the weight gradient
//! ([`Fp8Ops::grouped_matmul_weight_grad_fp8`]) on its second kernel (M a
//! multiple of 16, K and N of 4: copies of whole aligned 128-row blocks of
//! the transposed codes, other groups' rows zeroed in shared memory, see
//! [`Fp8Tiles::GroupColumns`]); elsewhere, or with `FOLDMOE_FP8_GEMM=
//! emulate`, on [`Fp8Ops`]' provided emulation (dequantise, f32 grouped
//! GEMM). GPUs without fp8 tensor cores are refused at the first
//! quantisation, so a run that will need them fails at once.

use std::sync::OnceLock;

use cudarc::driver::{sys, LaunchConfig};

use super::compile::{FP8, FP8_SM90};
use super::linalg::{tma_map_of, TmaMap};
use super::routing::row_src_1d;
use super::{block_cfg, float_sfx, grid_for, launch, Cuda};
use crate::backend::fp8::{
    check_gemm_operands, check_wgrad_operands, grouped_matmul_fp8_emulated,
    grouped_wgrad_fp8_emulated, rows_and_columns_in_two_passes,
};
use crate::backend::{Device, ElementwiseOps, Fp8Ops, OffloadOps};
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::fp8::{
    check_quantize_input, check_tiles, column_tiles, Fp8Matrix, Fp8Tensor, Fp8Tiles,
    FP8_WEIGHT_BLOCK,
};
use crate::tensor::{DType, Tensor};

/// The oldest architecture with e4m3 tensor cores (Ada, sm_89).
const MIN_FP8_CAPABILITY: u32 = 89;

impl Cuda {
    /// Whether this GPU has fp8 tensor cores (sm_89 or newer).
    pub fn has_fp8_tensor_cores(&self) -> bool {
        let digits: String = self.arch().chars().filter(char::is_ascii_digit).collect();
        digits
            .parse::<u32>()
            .is_ok_and(|sm| sm >= MIN_FP8_CAPABILITY)
    }

    /// The one-line error of an fp8 GEMM's first quantisation on a GPU
    /// without fp8 tensor cores.
    fn require_fp8_tensor_cores(&self) -> Result<()> {
        if self.has_fp8_tensor_cores() {
            return Ok(());
        }
        Err(KernelError::DeviceUnavailable {
            device: "cuda",
            reason: format!(
                "fp8 GEMMs need fp8 tensor cores (sm_89 or newer), but {} is {}; train in bf16 (no --fp8, no precision = fp8_blockwise)",
                self.name(),
                self.arch()
            ),
        })
    }

    /// The group sizes' count, checked to be an i32 vector.
    fn group_count(op: &'static str, sizes: Option<&Tensor<Self>>) -> Result<usize> {
        let Some(s) = sizes else { return Ok(0) };
        s.expect_dtype(op, DType::I32)?;
        if s.shape().len() != 1 {
            return Err(arg_err(
                op,
                format!("group sizes must be 1-d, got shape {:?}", s.shape()),
            ));
        }
        Ok(s.numel())
    }
}

/// Bytes of one stage of `fp8_sm90.cu`'s pipeline (`F8_STAGE_BYTES`: a 128
/// × 128 tile of each operand's codes, one 128-deep block of K).
const F8_STAGE_BYTES: usize = 2 * 128 * 128;

/// Stages of that pipeline (`F8_ST`).
const F8_STAGES: usize = 6;

/// Rows and columns of one output tile of the fp8 kernel (`F8_BM`, `F8_BN`).
const F8_TILE: usize = 128;

/// Threads of the fp8 kernel's block: two consumer warpgroups, one producer.
const F8_THREADS: u32 = 384;

/// The most dynamic shared memory a Hopper block may ask for.
const MAX_SMEM: usize = 227 << 10;

/// Dynamic shared memory of the fp8 kernel over `g` groups: 1024 bytes to
/// align the stages, the stages, 128 bytes of mbarriers, the 8 consumer
/// warps' store buffers of 16 × 144 bytes (`F8_OFFS`), then the group and
/// tile offsets (16 (G + 1)).
fn f8_smem_bytes(g: usize) -> usize {
    1024 + F8_STAGES * F8_STAGE_BYTES + 128 + 8 * 16 * 144 + 16 * (g + 1)
}

/// Columns a block of the group-column quantisation takes (`fp8.cu`'s
/// `GC_COLS`, in chunks of 64).
const GC_COLS: usize = 512;

/// Columns a block of the one-pass row and column quantisation takes
/// (`fp8.cu`'s `RC_COLS`, in chunks of 128).
const RC_COLS: usize = 512;

/// Bytes of one stage of the weight-gradient kernel (`F8W_STAGE`): the
/// codes of a stage of the forward's, then 128 row scales of A and 128
/// column scales of B (f32).
const F8W_STAGE_BYTES: usize = F8_STAGE_BYTES + 2 * 512;

/// Dynamic shared memory of the weight-gradient kernel over `g` groups:
/// 1024 bytes to align the stages, the stages, 128 bytes of mbarriers, the
/// consumer warps' store buffers, then the groups' first rows and first
/// tiles (16 (G + 1), `F8W_OFFS`).
fn f8w_smem_bytes(g: usize) -> usize {
    1024 + F8_STAGES * F8W_STAGE_BYTES + 128 + 8 * 16 * 144 + 16 * (g + 1)
}

/// Which kernel runs [`Fp8Ops::grouped_matmul_fp8`] on sm_90a.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fp8Kernel {
    /// Dequantise, then the f32 grouped GEMM (the provided emulation).
    Emulated,
    /// `fp8_sm90.cu`'s first version: one temporary accumulator, each
    /// block waited for and promoted before the next, stores from registers.
    WgmmaV1,
    /// Two temporaries (a pair of blocks' wgmmas in flight, the first
    /// promoted while the second runs), stores staged in shared memory;
    /// 1.2–1.4× V1 on the H200.
    WgmmaV2,
    /// The default: V2 with tiles of 6 or 16 blocks of K (the experts' K of
    /// 768 and 2048) as one unrolled chain, so only a tile's last block
    /// drains the tensor cores; the same sums as V2, bit for bit. 2–5 % over
    /// V2 on the H100 (`bench gemm --fp8`, three alternated runs).
    WgmmaV3,
}

/// `FOLDMOE_FP8_GEMM=emulate` keeps the emulated fp8 products (forward, data
/// and weight gradients) on Hopper too, `=v1` and `=v2` pick the earlier
/// wgmma versions of the forward / data gradient (read once per process).
fn fp8_kernel_default() -> Fp8Kernel {
    static KERNEL: OnceLock<Fp8Kernel> = OnceLock::new();
    *KERNEL.get_or_init(|| match std::env::var("FOLDMOE_FP8_GEMM").as_deref() {
        Ok("emulate") => Fp8Kernel::Emulated,
        Ok("v1") => Fp8Kernel::WgmmaV1,
        Ok("v2") => Fp8Kernel::WgmmaV2,
        _ => Fp8Kernel::WgmmaV3,
    })
}

/// The tensor map of a dense row-major byte array at `ptr` whose dimensions,
/// innermost first, are `dims`, copied in boxes of `boxes` with the 128-byte
/// swizzle (a box row: 128 codes = 128 bytes); elements outside the array
/// arrive as zeros.
fn fp8_map(op: &'static str, ptr: u64, dims: &[u64], boxes: &[u32]) -> Result<TmaMap> {
    let codes = sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
    tma_map_of(op, codes, 1, ptr, dims, boxes)
}

/// The code words and scales `q` must have for its shape and tiles (over
/// `groups` row groups for [`Fp8Tiles::GroupColumns`]).
fn check_parts(op: &'static str, q: &Fp8Matrix<Cuda>, groups: usize) -> Result<()> {
    q.codes.expect_dtype(op, DType::I32)?;
    q.scales.expect_dtype(op, DType::F32)?;
    let n: usize = q.shape.iter().product();
    let want_scales = match (q.tiles, q.shape.as_slice()) {
        (Fp8Tiles::Rows, &[m, k]) => m * k.div_ceil(128),
        (Fp8Tiles::GroupColumns, &[m, k]) => k * column_tiles(m, groups),
        (Fp8Tiles::Blocks { .. }, &[g, r, c]) => {
            g * r.div_ceil(FP8_WEIGHT_BLOCK) * c.div_ceil(FP8_WEIGHT_BLOCK)
        }
        _ => return Err(arg_err(op, format!("{:?} of shape {:?}", q.tiles, q.shape))),
    };
    if q.codes.numel() != n.div_ceil(4) || q.scales.numel() != want_scales {
        return Err(arg_err(
            op,
            format!(
                "{:?} of shape {:?}: {} code words and {} scales, want {} and {want_scales}",
                q.tiles,
                q.shape,
                q.codes.numel(),
                q.scales.numel(),
                n.div_ceil(4)
            ),
        ));
    }
    Ok(())
}

impl Cuda {
    /// Whether `fp8_sm90.cu`'s kernel can take `x [M, K] · op(w[g])` (`n`
    /// output columns, `g` groups) into `dtype`: an sm_90a device, bf16 or
    /// f32 out, K a multiple of 16 (the codes' rows in the tensor maps are
    /// 16-byte multiples), 16-byte aligned code arrays, sizes within the copy
    /// engine's 32-bit coordinates, the offsets within shared memory.
    fn fp8_wgmma_fits(
        &self,
        (m, k, n, g): (usize, usize, usize, usize),
        dtype: DType,
        ptrs: &[u64],
    ) -> bool {
        matches!(dtype, DType::BF16 | DType::F32)
            && k.is_multiple_of(16)
            && self.sm90_product_fits((m, k, n, g), f8_smem_bytes(g) <= MAX_SMEM, ptrs)
    }

    /// [`Fp8Ops::grouped_matmul_fp8`] on `kernel` where it fits (the
    /// emulation elsewhere).
    pub(crate) fn grouped_matmul_fp8_on(
        &self,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        dtype: DType,
        kernel: Fp8Kernel,
    ) -> Result<Tensor<Self>> {
        self.fp8_product(x, w, group_sizes, trans_w, Fp8Out::New(dtype), kernel)?
            .ok_or_else(|| arg_err("grouped_matmul_fp8", "the product was added, not returned"))
    }

    /// [`Fp8Ops::grouped_matmul_fp8_accumulate`] on `kernel`: V3's adding
    /// kernel where it fits; elsewhere (V1, V2, the emulation, shapes it
    /// does not take) the product, then `axpy`.
    pub(crate) fn grouped_matmul_fp8_accumulate_on(
        &self,
        y: &mut Tensor<Self>,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        kernel: Fp8Kernel,
    ) -> Result<()> {
        self.fp8_product(x, w, group_sizes, trans_w, Fp8Out::Add(y), kernel)
            .map(|_| ())
    }

    /// The product of [`Self::grouped_matmul_fp8_on`] into `out`: a new
    /// tensor (returned), or added to one (by V3's adding kernel; V1, V2
    /// and the emulation's product are added with `axpy`).
    fn fp8_product(
        &self,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        out: Fp8Out<'_>,
        kernel: Fp8Kernel,
    ) -> Result<Option<Tensor<Self>>> {
        const OP: &str = "grouped_matmul_fp8";
        let out = match out {
            Fp8Out::Add(y) if kernel != Fp8Kernel::WgmmaV3 => {
                let p =
                    self.grouped_matmul_fp8_on(x, w, group_sizes, trans_w, y.dtype(), kernel)?;
                return self.axpy(y, 1.0, &p).map(|()| None);
            }
            out => out,
        };
        let dtype = match &out {
            Fp8Out::New(dtype) => *dtype,
            Fp8Out::Add(y) => y.dtype(),
        };
        // Where the kernel cannot run: the emulation's product, added to
        // the output with axpy when there is one.
        let emulated = |out: Fp8Out<'_>| -> Result<Option<Tensor<Self>>> {
            let p = grouped_matmul_fp8_emulated(self, x, w, group_sizes, trans_w, dtype)?;
            match out {
                Fp8Out::New(_) => Ok(Some(p)),
                Fp8Out::Add(y) => self.axpy(y, 1.0, &p).map(|()| None),
            }
        };
        check_gemm_operands(x, w, trans_w)?;
        let dims = match (x.shape.as_slice(), w.shape.as_slice()) {
            (&[m, k], &[g, wr, wc]) if k == if trans_w { wc } else { wr } => {
                Some((m, k, if trans_w { wr } else { wc }, g))
            }
            _ => None,
        };
        // Shapes that disagree are reported by the emulation's checks.
        let Some((m, k, n, g)) = dims else {
            return emulated(out);
        };
        check_parts(OP, x, 0)?;
        check_parts(OP, w, 0)?;
        let (xp, wp) = (x.codes.storage().ptr(), w.codes.storage().ptr());
        if kernel == Fp8Kernel::Emulated || !self.fp8_wgmma_fits((m, k, n, g), dtype, &[xp, wp]) {
            return emulated(out);
        }
        let (offs, tiles) = self.group_offsets(OP, group_sizes, g, m)?;
        // Every row is written (or added to): tiles past the last group
        // store (add) zeros.
        let (y, add) = match out {
            Fp8Out::New(dtype) => (self.alloc(OP, &[m, n], dtype)?, None),
            Fp8Out::Add(y) => {
                if y.shape() != [m, n] {
                    return Err(shape_err(
                        OP,
                        format!(
                            "the accumulated output has shape {:?}, the product [{m}, {n}]",
                            y.shape()
                        ),
                    ));
                }
                self.make_unique(OP, y)?;
                (y.clone(), Some(()))
            }
        };
        let (kb, nb) = (k.div_ceil(F8_TILE), n.div_ceil(F8_TILE));
        // Strides of w's scale grid (group, block of K, block of N): the
        // logical matrix is [G, K, N], or [G, N, K] with trans_w.
        let (sbk, sbn) = if trans_w { (1, kb) } else { (nb, 1) };
        let (m64, k64, n64, g64) = (m as u64, k as u64, n as u64, g as u64);
        let ta = fp8_map(OP, xp, &[k64, m64], &[128, 128])?;
        let tb = fp8_map(OP, wp, &[k64, n64, g64], &[128, 128, 1])?;
        let smem = f8_smem_bytes(g) as u32;
        self.bind()?;
        let name = match (dtype == DType::F32, kernel) {
            (true, Fp8Kernel::WgmmaV3) if add.is_some() => "grouped_mm_fp8_wgmma_f32_v3_add",
            (false, Fp8Kernel::WgmmaV3) if add.is_some() => "grouped_mm_fp8_wgmma_bf16_v3_add",
            // Unreachable: other kernels' adds were turned into axpy above.
            (_, kernel) if add.is_some() => {
                return Err(arg_err(
                    OP,
                    format!("{kernel:?} has no adding kernel (only V3)"),
                ));
            }
            (true, Fp8Kernel::WgmmaV1) => "grouped_mm_fp8_wgmma_f32_v1",
            (false, Fp8Kernel::WgmmaV1) => "grouped_mm_fp8_wgmma_bf16_v1",
            (true, Fp8Kernel::WgmmaV3) => "grouped_mm_fp8_wgmma_f32_v3",
            (false, Fp8Kernel::WgmmaV3) => "grouped_mm_fp8_wgmma_bf16_v3",
            (true, _) => "grouped_mm_fp8_wgmma_f32",
            (false, _) => "grouped_mm_fp8_wgmma_bf16",
        };
        let f = self.func_smem(FP8_SM90, name, smem)?;
        // At most M / 128 + G + 1 row tiles (the last for the rows past
        // the groups), each ⌈N / 128⌉ column tiles.
        let cfg = LaunchConfig {
            grid_dim: (
                self.persistent_grid((m.div_ceil(F8_TILE) + g + 1) * nb)?,
                1,
                1,
            ),
            block_dim: (F8_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        launch!(
            self,
            f,
            cfg,
            ta,
            tb,
            x.scales.storage().ptr(),
            w.scales.storage().ptr(),
            (kb * nb) as i64,
            sbk as i64,
            sbn as i64,
            offs.ptr(),
            tiles.ptr(),
            y.storage().ptr(),
            m as i64,
            k as i64,
            n as i64,
            g as i32
        )?;
        Ok(add.is_none().then_some(y))
    }
}

/// Where [`Cuda::fp8_product`] puts its product.
enum Fp8Out<'a> {
    /// A new `[M, N]` tensor of this dtype.
    New(DType),
    /// Added to this `[M, N]` tensor (its dtype the product's).
    Add(&'a mut Tensor<Cuda>),
}

impl Cuda {
    /// Whether `fp8_sm90.cu`'s weight-gradient kernel can take `x [M, K]ᵀ ·
    /// dy [M, N]` over `g` groups into `dtype`: an sm_90a device, bf16 or
    /// f32 out, M a multiple of 16 (the transposed codes' rows in the tensor
    /// maps are 16-byte multiples), K and N multiples of 4 (the scales' bulk
    /// copies: 16-byte aligned, whole 16-byte pieces), 16-byte aligned code
    /// and scale arrays, sizes within the copy engine's 32-bit coordinates,
    /// the offsets within shared memory.
    fn fp8_wgrad_fits(
        &self,
        (m, k, n, g): (usize, usize, usize, usize),
        dtype: DType,
        ptrs: &[u64],
    ) -> bool {
        matches!(dtype, DType::BF16 | DType::F32)
            && m.is_multiple_of(16)
            && k.is_multiple_of(4)
            && n.is_multiple_of(4)
            && self.sm90_product_fits((m, k, n, g), f8w_smem_bytes(g) <= MAX_SMEM, ptrs)
    }

    /// [`Fp8Ops::grouped_matmul_weight_grad_fp8`] on `fp8_sm90.cu`'s kernel
    /// unless `kernel` is [`Fp8Kernel::Emulated`] or it does not fit (then
    /// the emulation).
    pub(crate) fn grouped_wgrad_fp8_on(
        &self,
        x: &Fp8Matrix<Self>,
        dy: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        dtype: DType,
        kernel: Fp8Kernel,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "grouped_matmul_weight_grad_fp8";
        check_wgrad_operands(x, dy)?;
        let dims = match (x.shape.as_slice(), dy.shape.as_slice(), group_sizes.shape()) {
            (&[m, k], &[my, n], &[g]) if m == my => Some((m, k, n, g)),
            _ => None,
        };
        // Shapes that disagree are reported by the emulation's checks.
        let Some((m, k, n, g)) = dims else {
            return grouped_wgrad_fp8_emulated(self, x, dy, group_sizes, dtype);
        };
        check_parts(OP, x, g)?;
        check_parts(OP, dy, g)?;
        let (xp, dp) = (x.codes.storage().ptr(), dy.codes.storage().ptr());
        let (xs, ds) = (x.scales.storage().ptr(), dy.scales.storage().ptr());
        if kernel == Fp8Kernel::Emulated
            || !self.fp8_wgrad_fits((m, k, n, g), dtype, &[xp, dp, xs, ds])
        {
            return grouped_wgrad_fp8_emulated(self, x, dy, group_sizes, dtype);
        }
        let (offs, _tiles) = self.group_offsets(OP, group_sizes, g, m)?;
        // Every element is written: an empty group's tiles store zeros.
        let out = self.alloc(OP, &[g, k, n], dtype)?;
        let (m64, k64, n64) = (m as u64, k as u64, n as u64);
        let ta = fp8_map(OP, xp, &[m64, k64], &[128, 128])?;
        let tb = fp8_map(OP, dp, &[m64, n64], &[128, 128])?;
        let smem = f8w_smem_bytes(g) as u32;
        self.bind()?;
        let name = if dtype == DType::F32 {
            "grouped_wgrad_fp8_wgmma_f32"
        } else {
            "grouped_wgrad_fp8_wgmma_bf16"
        };
        let f = self.func_smem(FP8_SM90, name, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (
                self.persistent_grid(g * k.div_ceil(F8_TILE) * n.div_ceil(F8_TILE))?,
                1,
                1,
            ),
            block_dim: (F8_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        launch!(
            self,
            f,
            cfg,
            ta,
            tb,
            xs,
            ds,
            offs.ptr(),
            out.storage().ptr(),
            m as i64,
            k as i64,
            n as i64,
            g as i32
        )?;
        Ok(out)
    }
}

/// The grid of the per-group column-tile kernels: a block per tile and 32
/// columns.
fn group_cols_grid(m: usize, k: usize, groups: usize) -> (u32, u32, u32) {
    (
        column_tiles(m, groups) as u32,
        k.div_ceil(32).max(1) as u32,
        1,
    )
}

impl Fp8Ops for Cuda {
    /// On sm_90a `fp8_sm90.cu`'s weight-gradient kernel (scales applied per
    /// tile of a group's rows, promoted into f32), where it fits; else the
    /// emulation.
    fn grouped_matmul_weight_grad_fp8(
        &self,
        x: &Fp8Matrix<Self>,
        dy: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        dtype: DType,
    ) -> Result<Tensor<Self>> {
        self.grouped_wgrad_fp8_on(x, dy, group_sizes, dtype, fp8_kernel_default())
    }

    /// On sm_90a the e4m3 wgmma kernel of `fp8_sm90.cu` (scales applied
    /// per 128 of K, promoted into f32), where it fits; else the emulation.
    fn grouped_matmul_fp8(
        &self,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        dtype: DType,
    ) -> Result<Tensor<Self>> {
        self.grouped_matmul_fp8_on(x, w, group_sizes, trans_w, dtype, fp8_kernel_default())
    }

    /// On sm_90a V3's adding kernel (the product added in its stores),
    /// where it fits; else the product, then `axpy`.
    fn grouped_matmul_fp8_accumulate(
        &self,
        y: &mut Tensor<Self>,
        x: &Fp8Matrix<Self>,
        w: &Fp8Matrix<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<()> {
        self.grouped_matmul_fp8_accumulate_on(y, x, w, group_sizes, trans_w, fp8_kernel_default())
    }

    fn quantize_fp8(
        &self,
        x: &Tensor<Self>,
        tiles: Fp8Tiles,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Fp8Matrix<Self>> {
        const OP: &str = "quantize_fp8";
        self.require_fp8_tensor_cores()?;
        check_quantize_input(OP, x, tiles, group_sizes.is_some())?;
        let sfx = float_sfx(OP, x.dtype())?;
        let groups = Self::group_count(OP, group_sizes)?;
        let shape = x.shape().to_vec();
        let n = x.numel();
        let (codes, scales) = match (tiles, shape.as_slice()) {
            (Fp8Tiles::Rows, _) => {
                let f = self.compress_fp8(x)?;
                (f.codes, f.scales)
            }
            (Fp8Tiles::Blocks { transposed }, &[g, r, c]) => {
                let (gr, gc) = (r.div_ceil(FP8_WEIGHT_BLOCK), c.div_ceil(FP8_WEIGHT_BLOCK));
                let codes = self.alloc(OP, &[n.div_ceil(4)], DType::I32)?;
                let scales = self.alloc(OP, &[g * gr * gc], DType::F32)?;
                if n > 0 {
                    let f = self.func(FP8, &format!("fp8_quant_blocks_{sfx}"))?;
                    launch!(
                        self,
                        f,
                        block_cfg((gc as u32, gr as u32, g as u32), 256, 0),
                        x.storage().ptr(),
                        codes.storage().ptr(),
                        scales.storage().ptr(),
                        r as i64,
                        c as i64,
                        i32::from(transposed)
                    )?;
                }
                (codes, scales)
            }
            (Fp8Tiles::GroupColumns, &[m, k]) => {
                if let Some(sizes) = group_sizes {
                    // Negative sizes or a sum past m are reported at the next
                    // read, as by the grouped GEMMs (the kernel clamps).
                    self.group_offsets(OP, sizes, groups, m)?;
                }
                let t = column_tiles(m, groups);
                // Rows past the groups are code 0.
                let codes = self.zeros(&[n.div_ceil(4)], DType::I32)?;
                let scales = self.alloc(OP, &[k * t], DType::F32)?;
                if k > 0 {
                    let f = self.func(FP8, &format!("fp8_quant_group_cols_{sfx}"))?;
                    launch!(
                        self,
                        f,
                        // A block per (tile, GC_COLS columns).
                        block_cfg(
                            (
                                column_tiles(m, groups) as u32,
                                k.div_ceil(GC_COLS).max(1) as u32,
                                1
                            ),
                            256,
                            0
                        ),
                        x.storage().ptr(),
                        codes.storage().ptr(),
                        scales.storage().ptr(),
                        group_sizes.map_or(0, |s| s.storage().ptr()),
                        m as i64,
                        k as i64,
                        groups as i64,
                        t as i64
                    )?;
                }
                (codes, scales)
            }
            _ => unreachable!("check_tiles passed"),
        };
        Ok(Fp8Matrix {
            codes,
            scales,
            shape,
            tiles,
        })
    }

    fn quantize_fp8_rows_and_columns(
        &self,
        x: &Tensor<Self>,
        row_src: Option<&Tensor<Self>>,
        group_sizes: &Tensor<Self>,
    ) -> Result<(Fp8Matrix<Self>, Fp8Matrix<Self>)> {
        const OP: &str = "quantize_fp8_rows_and_columns";
        self.require_fp8_tensor_cores()?;
        check_quantize_input(OP, x, Fp8Tiles::Rows, false)?;
        let groups = Self::group_count(OP, Some(group_sizes))?;
        let (x_rows, k) = x.dims2(OP)?;
        let m = match row_src {
            Some(r) => row_src_1d(OP, r)?,
            None => x_rows,
        };
        // The fused kernel's 16-byte loads take bf16 rows of a multiple of 8.
        if x.dtype() != DType::BF16 || !k.is_multiple_of(8) || m == 0 || k == 0 {
            return rows_and_columns_in_two_passes(self, x, row_src, group_sizes);
        }
        if let Some(r) = row_src {
            // An index past x's rows is reported at the next read.
            self.check_range(OP, r, -1, x_rows as i64)?;
        }
        let shape = vec![m, k];
        // Negative sizes or a sum past m are reported at the next read, as
        // by the grouped GEMMs (the kernel clamps).
        self.group_offsets(OP, group_sizes, groups, m)?;
        let (n, t) = (m * k, column_tiles(m, groups));
        let row_codes = self.alloc(OP, &[n.div_ceil(4)], DType::I32)?;
        let row_scales = self.alloc(OP, &[m * k.div_ceil(128)], DType::F32)?;
        // Rows past the groups are code 0 in the column tiling.
        let col_codes = self.zeros(&[n.div_ceil(4)], DType::I32)?;
        let col_scales = self.alloc(OP, &[k * t], DType::F32)?;
        let f = self.func(FP8, "fp8_quant_rows_cols_bf16")?;
        launch!(
            self,
            f,
            // A block per (tile, RC_COLS columns); the tiles past the
            // groups' own take the rows past the groups.
            block_cfg((t as u32, k.div_ceil(RC_COLS) as u32, 1), 256, 0),
            x.storage().ptr(),
            row_src.map_or(0, |r| r.storage().ptr()),
            row_codes.storage().ptr(),
            row_scales.storage().ptr(),
            col_codes.storage().ptr(),
            col_scales.storage().ptr(),
            group_sizes.storage().ptr(),
            m as i64,
            k as i64,
            groups as i64
        )?;
        let matrix = |codes, scales, tiles| Fp8Matrix {
            codes,
            scales,
            shape: shape.clone(),
            tiles,
        };
        Ok((
            matrix(row_codes, row_scales, Fp8Tiles::Rows),
            matrix(col_codes, col_scales, Fp8Tiles::GroupColumns),
        ))
    }

    fn dequantize_fp8(
        &self,
        q: &Fp8Matrix<Self>,
        group_sizes: Option<&Tensor<Self>>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "dequantize_fp8";
        check_tiles(OP, &q.shape, q.tiles, group_sizes.is_some())?;
        let groups = Self::group_count(OP, group_sizes)?;
        check_parts(OP, q, groups)?;
        let n: usize = q.shape.iter().product();
        match (q.tiles, q.shape.as_slice()) {
            (Fp8Tiles::Rows, _) => self.expand_fp8(&Fp8Tensor {
                codes: q.codes.clone(),
                scales: q.scales.clone(),
                shape: q.shape.clone(),
                dtype: DType::F32,
            }),
            (Fp8Tiles::Blocks { transposed }, &[g, r, c]) => {
                let out = self.alloc(OP, &q.shape, DType::F32)?;
                if n > 0 {
                    let f = self.func(FP8, "fp8_dequant_blocks")?;
                    launch!(
                        self,
                        f,
                        grid_for(n),
                        q.codes.storage().ptr(),
                        q.scales.storage().ptr(),
                        out.storage().ptr(),
                        g as i64,
                        r as i64,
                        c as i64,
                        i32::from(transposed)
                    )?;
                }
                Ok(out)
            }
            (Fp8Tiles::GroupColumns, &[m, k]) => {
                let out = self.zeros(&q.shape, DType::F32)?;
                if k > 0 {
                    let f = self.func(FP8, "fp8_dequant_group_cols")?;
                    launch!(
                        self,
                        f,
                        block_cfg(group_cols_grid(m, k, groups), 256, 0),
                        q.codes.storage().ptr(),
                        q.scales.storage().ptr(),
                        group_sizes.map_or(0, |s| s.storage().ptr()),
                        out.storage().ptr(),
                        m as i64,
                        k as i64,
                        groups as i64,
                        column_tiles(m, groups) as i64
                    )?;
                }
                Ok(out)
            }
            _ => unreachable!("check_tiles passed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LinalgOps;
    use crate::tensor::HostData;

    /// `n` values in [-1, 1] from a xorshift of `seed`.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    use crate::cuda::linalg::tests::{host, mean_seconds, uneven_sizes};

    /// The f64 weight gradient of dequantised operands: `(Σ_r x[r, j] ·
    /// dy[r, l], Σ_r |x[r, j] · dy[r, l]|)` over each group's rows, `[G, K,
    /// N]` flattened.
    fn wgrad_f64(x: &[f64], dy: &[f64], sizes: &[usize], k: usize, n: usize) -> Vec<(f64, f64)> {
        let mut out = vec![(0f64, 0f64); sizes.len() * k * n];
        let mut start = 0;
        for (e, &size) in sizes.iter().enumerate() {
            for r in start..start + size {
                for j in 0..k {
                    let a = x[r * k + j];
                    let o = &mut out[(e * k + j) * n..(e * k + j + 1) * n];
                    for (l, slot) in o.iter_mut().enumerate() {
                        let p = a * dy[r * n + l];
                        slot.0 += p;
                        slot.1 += p.abs();
                    }
                }
            }
            start += size;
        }
        out
    }

    /// The fp8 weight gradient on wgmma (`fp8_sm90.cu`'s second kernel)
    /// against the f64 product of its dequantised operands, at groups that
    /// start at rows not multiples of 16 (70, 220, 305: the copies start at
    /// the aligned 128-row block and zero the other groups' rows), group
    /// sizes (the summed dimension) not multiples of 128, a group inside one
    /// block, one spanning three, empty groups (exact zeros) and padding
    /// rows past the groups, K and N not multiples of 128, bf16 and f32 out.
    /// Tolerance as the forward's on the tensor cores
    /// (`fp8_gemms_at_tensor_core_shapes`): f32 accumulation, 2·K_g·ε of
    /// Σ|a·b|, plus 2⁻⁹ Σ|a·b| for the narrower accumulation inside each
    /// 128-row block, plus bf16's rounding of the result. The worst
    /// |err| / Σ|a·b| is printed. The emulation (`FOLDMOE_FP8_GEMM=emulate`)
    /// is checked on the same operands.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn fp8_weight_gradient_on_wgmma_matches_the_f64_product() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let cases: [(usize, usize, usize, &[usize]); 3] = [
            (304, 400, 144, &[70, 0, 150, 64]),
            (512, 132, 136, &[0, 300, 5, 0, 197]),
            (256, 128, 128, &[128, 0, 128]),
        ];
        for (case, &(m, k, n, sizes)) in cases.iter().enumerate() {
            let g = sizes.len();
            let gs = d
                .upload(
                    HostData::I32(sizes.iter().map(|&s| s as i32).collect()),
                    &[g],
                )
                .unwrap();
            let mut xv = values(m * k, 100 + case as u64);
            xv[75 * k + 7] = 40.0; // a large value in one tile of one group
            let dyv = values(m * n, 200 + case as u64);
            let xt = d.upload(HostData::F32(xv), &[m, k]).unwrap();
            let dyt = d.upload(HostData::F32(dyv), &[m, n]).unwrap();
            let q = |t: &Tensor<Cuda>| {
                d.quantize_fp8(t, Fp8Tiles::GroupColumns, Some(&gs))
                    .unwrap()
            };
            let (xq, dyq) = (q(&xt), q(&dyt));
            let deq = |qm: &Fp8Matrix<Cuda>| -> Vec<f64> {
                host(&d, &d.dequantize_fp8(qm, Some(&gs)).unwrap())
                    .into_iter()
                    .map(f64::from)
                    .collect()
            };
            let want = wgrad_f64(&deq(&xq), &deq(&dyq), sizes, k, n);
            let ptrs = [
                xq.codes.storage().ptr(),
                dyq.codes.storage().ptr(),
                xq.scales.storage().ptr(),
                dyq.scales.storage().ptr(),
            ];
            assert!(
                d.fp8_wgrad_fits((m, k, n, g), DType::F32, &ptrs),
                "case {case}: the wgmma kernel should take it"
            );
            for kernel in [Fp8Kernel::WgmmaV2, Fp8Kernel::Emulated] {
                for dtype in [DType::F32, DType::BF16] {
                    let dw = d
                        .grouped_wgrad_fp8_on(&xq, &dyq, &gs, dtype, kernel)
                        .unwrap();
                    assert_eq!((dw.shape(), dw.dtype()), (&[g, k, n][..], dtype));
                    let got = host(&d, &dw);
                    let mut worst = 0f64;
                    for (idx, (&v, &(exact, mag))) in got.iter().zip(&want).enumerate() {
                        let e = idx / (k * n);
                        let v = f64::from(v);
                        let mut tol = 2.0 * sizes[e] as f64 * f64::from(f32::EPSILON) * mag;
                        if kernel != Fp8Kernel::Emulated {
                            tol += mag / 512.0;
                        }
                        if dtype == DType::BF16 {
                            tol += exact.abs() / 256.0;
                        }
                        let err = (v - exact).abs();
                        if dtype == DType::F32 && mag > 0.0 {
                            worst = worst.max(err / mag);
                        }
                        assert!(
                            err <= tol,
                            "case {case} {kernel:?} {dtype:?}: dw[{e}, {}, {}] = {v} vs {exact} (tol {tol})",
                            (idx / n) % k,
                            idx % n
                        );
                    }
                    if dtype == DType::F32 {
                        println!(
                            "case {case} (m {m}, k {k}, n {n}, sizes {sizes:?}) {kernel:?}: worst |err| / sum |a b| = {worst:.3e}"
                        );
                    }
                }
            }
        }
    }

    /// V3's chained tiles (K 768 and 2048: 6 and 16 blocks) with more tiles
    /// than blocks (each block takes several in turn, so a tile's store can
    /// run after the next tile's first wgmmas, `FOLDMOE_F8_OVERLAP`), uneven
    /// groups and padding rows: the bf16 output is the f32 one rounded to
    /// nearest even, bit for bit, and the adding kernel gives
    /// `bf16(y + bf16(product))` on every element (what storing the product
    /// and adding it would give).
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn fp8_v3_chained_tiles_store_and_add_exactly() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let (rows, n, g) = (8192usize, 512usize, 7usize);
        let used = rows - 40;
        let gs = d
            .upload(HostData::I32(uneven_sizes(g, used)), &[g])
            .unwrap();
        let round = |v: f32| crate::cpu::Bf16::round(v).to_f32();
        for (case, k) in [768usize, 2048].into_iter().enumerate() {
            let seed = 300 + 10 * case as u64;
            let x = d
                .upload(HostData::F32(values(rows * k, seed)), &[rows, k])
                .unwrap();
            let w = d
                .upload(HostData::F32(values(g * k * n, seed + 1)), &[g, k, n])
                .unwrap();
            let xq = d.quantize_fp8(&x, Fp8Tiles::Rows, None).unwrap();
            let wq = d
                .quantize_fp8(&w, Fp8Tiles::Blocks { transposed: true }, None)
                .unwrap();
            let run = |dtype| {
                d.grouped_matmul_fp8_on(&xq, &wq, &gs, false, dtype, Fp8Kernel::WgmmaV3)
                    .unwrap()
            };
            let y32 = host(&d, &run(DType::F32));
            let yb = host(&d, &run(DType::BF16));
            assert!(
                y32[used * n..].iter().all(|&v| v == 0.0),
                "K {k}: padding rows"
            );
            for (i, (&b, &v)) in yb.iter().zip(&y32).enumerate() {
                assert_eq!(
                    b.to_bits(),
                    round(v).to_bits(),
                    "K {k}: bf16 out [{i}] {b} vs f32 out {v}"
                );
            }
            let base: Vec<f32> = values(rows * n, seed + 2).into_iter().map(round).collect();
            let mut y = d.upload(HostData::F32(base.clone()), &[rows, n]).unwrap();
            y = d.cast(&y, DType::BF16).unwrap();
            d.grouped_matmul_fp8_accumulate_on(&mut y, &xq, &wq, &gs, false, Fp8Kernel::WgmmaV3)
                .unwrap();
            let got = host(&d, &y);
            for (i, ((&a, &o), &v)) in got.iter().zip(&base).zip(&y32).enumerate() {
                let want = round(o + round(v));
                assert_eq!(
                    a.to_bits(),
                    want.to_bits(),
                    "K {k}: added out [{i}] {a} vs {want}"
                );
            }
        }
    }

    /// The fp8 weight gradient on wgmma at the Qwen3-30B-A3B expert shapes
    /// (131072 rows = 16384 tokens × top-8, the last 40 past the groups, in
    /// 128 uneven groups; hidden D 2048, ffn F 768): fc1's (x [M, D] with
    /// dgate [M, F] → [G, D, F], and with gate and up together, [M, 2F] →
    /// [G, D, 2F]) and fc2's (act [M, F] with dy [M, D] → [G, F, D]),
    /// against the emulation on the same operands (relative Frobenius
    /// difference within 2⁻⁹, as the forward's full-shape test), the bf16
    /// output the f32 one rounded. Prints each product's time (host clock,
    /// 20 synchronised calls after 3 warm-ups, the group offsets included)
    /// and TFLOP/s beside the emulation and the bf16 wgmma weight gradient
    /// on the same shape. Ignored (large): run with `--ignored` on a GPU.
    #[test]
    #[ignore]
    fn fp8_weight_gradient_full_shape_timings() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let (rows, h, f, e) = (131072usize, 2048usize, 768usize, 128usize);
        let used = rows - 40;
        let gs = d
            .upload(HostData::I32(uneven_sizes(e, used)), &[e])
            .unwrap();
        let up = |cols: usize, seed| {
            d.upload(HostData::F32(values(rows * cols, seed)), &[rows, cols])
                .unwrap()
        };
        let time = |run: &dyn Fn()| mean_seconds(&d, run);
        println!("| product | M x K x N (G {e}) | fp8 wgmma ms | TFLOP/s | emulated ms | TFLOP/s | bf16 wgmma ms | TFLOP/s | wgmma / bf16 | rel. diff vs emulation | max abs diff |");
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        let cases = [
            ("fc1 dw (gate)", h, f, 51),
            ("fc1 dw (gate+up)", h, 2 * f, 52),
            ("fc2 dw", f, h, 53),
        ];
        for (name, k, n, seed) in cases {
            let (a, b) = (up(k, seed), up(n, seed + 100));
            let q = |t: &Tensor<Cuda>| {
                d.quantize_fp8(t, Fp8Tiles::GroupColumns, Some(&gs))
                    .unwrap()
            };
            let (aq, bq) = (q(&a), q(&b));
            let (ab, bb) = (
                d.cast(&a, DType::BF16).unwrap(),
                d.cast(&b, DType::BF16).unwrap(),
            );
            drop((a, b));
            let run = |dtype, kernel| {
                d.grouped_wgrad_fp8_on(&aq, &bq, &gs, dtype, kernel)
                    .unwrap()
            };
            let w32 = host(&d, &run(DType::F32, Fp8Kernel::Emulated));
            let g32 = host(&d, &run(DType::F32, Fp8Kernel::WgmmaV2));
            let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
            for (&p, &r) in g32.iter().zip(&w32) {
                let diff = f64::from(p) - f64::from(r);
                num += diff * diff;
                den += f64::from(r) * f64::from(r);
                max_abs = max_abs.max(diff.abs());
            }
            let rel = (num / den.max(1e-300)).sqrt();
            assert!(rel <= 1.0 / 512.0, "{name}: relative difference {rel:.3e}");
            let gb = host(&d, &run(DType::BF16, Fp8Kernel::WgmmaV2));
            for (i, (&b, &v)) in gb.iter().zip(&g32).enumerate() {
                assert!(
                    (b - v).abs() <= v.abs() / 256.0,
                    "{name}: bf16 out [{i}] {b} vs f32 out {v}"
                );
            }
            drop((w32, g32, gb));
            let flop = 2.0 * (used * k * n) as f64;
            let t8 = time(&|| {
                run(DType::BF16, Fp8Kernel::WgmmaV2);
            });
            let te = time(&|| {
                run(DType::BF16, Fp8Kernel::Emulated);
            });
            let t16 = time(&|| {
                d.grouped_matmul_weight_grad(&ab, &bb, &gs).unwrap();
            });
            println!(
                "| {name} | {used}x{k}x{n} | {:.3} | {:.1} | {:.3} | {:.1} | {:.3} | {:.1} | {:.2} | {rel:.2e} | {max_abs:.2e} |",
                t8 * 1e3,
                flop / t8 / 1e12,
                te * 1e3,
                flop / te / 1e12,
                t16 * 1e3,
                flop / t16 / 1e12,
                t16 / t8
            );
        }
    }

    /// The fp8 wgmma products at the Qwen3-30B-A3B expert shapes (131072
    /// rows, the last 40 past the groups, in 128 uneven groups; hidden 2048,
    /// ffn 768): fc1's forward (K 2048 → N 768) and data gradient (K 768 → N
    /// 2048), fc2's likewise, each on the three wgmma versions, against the
    /// emulation (dequantise, f32 grouped GEMM) on the same operands (V3
    /// bit-equal to V2): relative Frobenius difference within 2⁻⁹
    /// (the tensor cores' narrower accumulation inside each 128-block, see
    /// `fp8_gemms_at_tensor_core_shapes`), padding rows zero, the bf16
    /// output the f32 one rounded. Prints each product's time (host clock,
    /// 20 synchronised calls after 3 warm-ups) beside the bf16 wgmma
    /// grouped GEMM on the same shape. Ignored (large): run with
    /// `--ignored` on a GPU.
    #[test]
    #[ignore]
    fn fp8_products_full_shape_match_the_emulation() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let (rows, h, f, e) = (131072usize, 2048usize, 768usize, 128usize);
        let used = rows - 40;
        let gs = d
            .upload(HostData::I32(uneven_sizes(e, used)), &[e])
            .unwrap();
        let up = |shape: &[usize], seed| {
            let n = shape.iter().product();
            d.upload(HostData::F32(values(n, seed)), shape).unwrap()
        };
        let (x, dy) = (up(&[rows, h], 41), up(&[rows, f], 42));
        let (w1, w2) = (up(&[e, h, f], 43), up(&[e, f, h], 44));
        let q = |t: &Tensor<Cuda>, tiles| d.quantize_fp8(t, tiles, None).unwrap();
        let (t, nt) = (
            Fp8Tiles::Blocks { transposed: true },
            Fp8Tiles::Blocks { transposed: false },
        );
        let (xq, dyq) = (q(&x, Fp8Tiles::Rows), q(&dy, Fp8Tiles::Rows));
        let (w1t, w1n, w2t, w2n) = (q(&w1, t), q(&w1, nt), q(&w2, t), q(&w2, nt));
        let bf = |t: &Tensor<Cuda>| d.cast(t, DType::BF16).unwrap();
        let (xb, dyb, w1b, w2b) = (bf(&x), bf(&dy), bf(&w1), bf(&w2));
        drop((x, dy, w1, w2));
        let time = |run: &dyn Fn()| mean_seconds(&d, run);
        println!("| product | M x K x N | kernel | fp8 ms | fp8 TFLOP/s | bf16 ms | bf16 TFLOP/s | fp8 / bf16 | rel. diff vs emulation | max abs diff |");
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        let cases = [
            ("fc1 fwd", &xq, &w1t, &xb, &w1b, false, h, f),
            ("fc1 dgrad", &dyq, &w1n, &dyb, &w1b, true, f, h),
            ("fc2 fwd", &dyq, &w2t, &dyb, &w2b, false, f, h),
            ("fc2 dgrad", &xq, &w2n, &xb, &w2b, true, h, f),
        ];
        for (name, a, w, ab, wb, trans, k, n) in cases {
            let want = grouped_matmul_fp8_emulated(&d, a, w, &gs, trans, DType::F32).unwrap();
            let w32 = host(&d, &want);
            drop(want);
            let flop = 2.0 * (rows * k * n) as f64;
            let t16 = time(&|| {
                d.grouped_matmul(ab, wb, &gs, trans).unwrap();
            });
            let mut v2_out = None;
            for kernel in [Fp8Kernel::WgmmaV2, Fp8Kernel::WgmmaV3, Fp8Kernel::WgmmaV1] {
                let run = |dtype| {
                    d.grouped_matmul_fp8_on(a, w, &gs, trans, dtype, kernel)
                        .unwrap()
                };
                let g32 = host(&d, &run(DType::F32));
                // V3 promotes the same products in the same order as V2.
                match (kernel, &v2_out) {
                    (Fp8Kernel::WgmmaV2, _) => v2_out = Some(g32.clone()),
                    (Fp8Kernel::WgmmaV3, Some(v2)) => assert!(
                        g32.iter().zip(v2).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name}: V3 differs from V2"
                    ),
                    _ => {}
                }
                let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
                for (&p, &r) in g32.iter().zip(&w32) {
                    let diff = f64::from(p) - f64::from(r);
                    num += diff * diff;
                    den += f64::from(r) * f64::from(r);
                    max_abs = max_abs.max(diff.abs());
                }
                let rel = (num / den.max(1e-300)).sqrt();
                assert!(
                    g32[used * n..].iter().all(|&v| v == 0.0),
                    "{name} {kernel:?}: padding rows"
                );
                assert!(
                    rel <= 1.0 / 512.0,
                    "{name} {kernel:?}: relative difference {rel:.3e}"
                );
                let gb = host(&d, &run(DType::BF16));
                for (i, (&b, &v)) in gb.iter().zip(&g32).enumerate() {
                    assert!(
                        (b - v).abs() <= v.abs() / 256.0,
                        "{name} {kernel:?}: bf16 out [{i}] {b} vs f32 out {v}"
                    );
                }
                let t8 = time(&|| {
                    run(DType::BF16);
                });
                println!(
                    "| {name} | {rows}x{k}x{n} | {kernel:?} | {:.3} | {:.1} | {:.3} | {:.1} | {:.2} | {rel:.2e} | {max_abs:.2e} |",
                    t8 * 1e3,
                    flop / t8 / 1e12,
                    t16 * 1e3,
                    flop / t16 / 1e12,
                    t16 / t8
                );
            }
        }
        let tq = time(&|| {
            d.quantize_fp8(&xb, Fp8Tiles::Rows, None).unwrap();
        });
        println!(
            "quantize_fp8 of x [{rows}, {h}] bf16 in 1x128 rows: {:.3} ms",
            tq * 1e3
        );
    }
}
