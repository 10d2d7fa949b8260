//! CUDA dense and grouped matrix products (row-major). Dense GEMMs run on
//! cuBLAS; the grouped GEMM and its weight gradient are kernels that read the
//! group sizes on the device, so the MoE layer never waits for the host. In
//! bf16 on Hopper (sm_90a) they are `grouped_sm90.cu`'s persistent,
//! warp-specialised TMA + wgmma kernels (tensor maps built here per call);
//! elsewhere, and for shapes a tensor map cannot describe (K or N not a
//! multiple of 8), `linalg.cu`'s mma.sync kernels (128 × 256 tiles, a 4-stage
//! cp.async pipeline); f32/f64 run on plain kernels.
//!
//! Shape letters: M rows, K inner dimension, N columns, G groups.

use std::borrow::Cow;
use std::sync::OnceLock;

use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{result as drv, sys, LaunchConfig};

use super::compile::{GROUPED_SM90, LINALG};
use super::{float_sfx, launch, Cuda};
use crate::backend::linalg::grouped_dims;
use crate::backend::{Device, ElementwiseOps, GatheredGemmOps, LinalgOps};
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

/// Which kernels run a bf16 grouped GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GroupedKernel {
    /// `linalg.cu`'s mma.sync kernels: any sm_80+ GPU, any shape.
    MmaSync,
    /// `grouped_sm90.cu`'s TMA + wgmma kernels: sm_90a, K and N multiples of 8.
    Wgmma,
}

/// `FOLDMOE_GROUPED_GEMM=mma` keeps the mma.sync kernels on Hopper too (read
/// once per process).
fn wgmma_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("FOLDMOE_GROUPED_GEMM").map_or(true, |v| v != "mma"))
}

/// The entry point of a plain wgmma product: `name`, or its deferred-epilogue
/// variant (`name_defer`: the consumers hand each output tile to the
/// producer warpgroup's spare warps and start the next tile) when
/// `FOLDMOE_GEMM_EPILOGUE=deferred` (read once per process; for
/// comparisons).
fn gw_entry(name: &'static str) -> Cow<'static, str> {
    static DEFERRED: OnceLock<bool> = OnceLock::new();
    let deferred = *DEFERRED
        .get_or_init(|| std::env::var("FOLDMOE_GEMM_EPILOGUE").is_ok_and(|v| v == "deferred"));
    if deferred {
        Cow::Owned(format!("{name}_defer"))
    } else {
        Cow::Borrowed(name)
    }
}

/// `FOLDMOE_GATE_UP=split` makes the experts' paired gathered weight
/// gradients (gate and up) run as two products instead of one kernel over
/// both (read once per process; for comparisons).
fn paired_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("FOLDMOE_GATE_UP").map_or(true, |v| v != "split"))
}

/// `FOLDMOE_GATHER=0` makes the gathered products permute and run the plain
/// kernels instead of gathering inside their loads (read once per process;
/// for comparisons).
fn gather_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("FOLDMOE_GATHER").map_or(true, |v| v != "0"))
}

/// Bytes of one pipeline stage of the wgmma kernels (`GW_STAGE_BYTES`: a
/// 128 × 64 A tile and a 64 × 256 B tile, bf16).
const GW_STAGE_BYTES: usize = (128 * 64 + 64 * 256) * 2;

/// Threads of a wgmma kernel's block: two consumer warpgroups, one producer.
const GW_THREADS: u32 = 384;

/// Dynamic shared memory of a wgmma kernel over `g` groups: 1024 bytes to
/// align the stages, then `GwLayout::OFFS` bytes (inline epilogue: 4 stages,
/// 128 bytes of mbarriers, the 8 consumer warps' buffers of 16 × 144 bytes;
/// deferred: 3 stages, the mbarriers, the 128 × 256 tile in rows of 528
/// bytes; the same total), then the group and tile offsets (16 (G + 1)).
fn gw_smem_bytes(g: usize) -> usize {
    const INLINE: usize = 4 * GW_STAGE_BYTES + 128 + 8 * 16 * 144;
    const DEFERRED: usize = 3 * GW_STAGE_BYTES + 128 + 128 * 528;
    const _: () = assert!(INLINE == DEFERRED);
    1024 + INLINE + 16 * (g + 1)
}

/// The most dynamic shared memory a Hopper block may ask for.
const GW_MAX_SMEM: usize = 227 << 10;

/// A `CUtensorMap`, passed by value to the wgmma kernels
/// (`__grid_constant__ TmaMap`).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap(sys::CUtensorMap);

// 128 plain bytes, laid out as the kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for TmaMap {}

/// The tensor map of a dense row-major bf16 array at `ptr` whose dimensions,
/// innermost first, are `dims`, copied in boxes of `boxes` elements with the
/// 128-byte swizzle (the box's inner extent is 64 elements = 128 bytes);
/// elements outside the array arrive as zeros.
pub(crate) fn tma_map(op: &'static str, ptr: u64, dims: &[u64], boxes: &[u32]) -> Result<TmaMap> {
    tma_map_of(
        op,
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2,
        ptr,
        dims,
        boxes,
    )
}

/// [`tma_map`] of elements of `data_type`, `elem_bytes` each (the box's
/// inner extent must span 128 bytes for the swizzle).
pub(crate) fn tma_map_of(
    op: &'static str,
    data_type: sys::CUtensorMapDataType,
    elem_bytes: u64,
    ptr: u64,
    dims: &[u64],
    boxes: &[u32],
) -> Result<TmaMap> {
    let rank = dims.len();
    let mut strides = [0u64; 4];
    let mut s = elem_bytes;
    for i in 0..rank - 1 {
        s *= dims[i];
        strides[i] = s;
    }
    let elem = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            rank as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| {
        arg_err(
            op,
            format!("no tensor map for dims {dims:?}, boxes {boxes:?}: {e:?}"),
        )
    })?;
    Ok(TmaMap(unsafe { map.assume_init() }))
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
    pub(super) fn group_offsets(
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

impl Cuda {
    /// Whether the wgmma kernels can take a product of `m` rows, inner
    /// dimension `k` (wgrad: the row count), `n` columns and `g` groups over
    /// the arrays at `ptrs`: an sm_90a device, K and N multiples of 8 (the
    /// tensor maps' 16-byte row strides), 16-byte aligned bases, sizes within
    /// the copy engine's 32-bit coordinates, the offsets within shared memory.
    fn wgmma_fits(&self, m: usize, k: usize, n: usize, g: usize, ptrs: &[u64]) -> bool {
        k.is_multiple_of(8)
            && n.is_multiple_of(8)
            && self.sm90_product_fits((m, k, n, g), gw_smem_bytes(g) <= GW_MAX_SMEM, ptrs)
    }

    /// What every Hopper (TMA + wgmma) product kernel needs, bf16 or fp8: an
    /// sm_90a device, nonzero sizes within the copy engine's 32-bit
    /// coordinates, the group offsets within shared memory (`smem_fits`),
    /// 16-byte aligned arrays at `ptrs`. Each kernel adds its own multiples.
    pub(super) fn sm90_product_fits(
        &self,
        (m, k, n, g): (usize, usize, usize, usize),
        smem_fits: bool,
        ptrs: &[u64],
    ) -> bool {
        let lim = i32::MAX as usize;
        self.arch() == "sm_90a"
            && [m, k, n, g].iter().all(|&d| d > 0 && d < lim)
            && smem_fits
            && ptrs.iter().all(|p| p % 16 == 0)
    }

    /// The kernel for a bf16 grouped product: `want`, or (None) the wgmma
    /// kernels where they fit and `FOLDMOE_GROUPED_GEMM` is not `mma`. Asking
    /// for wgmma where it does not fit is an error.
    fn grouped_kernel(
        &self,
        op: &'static str,
        want: Option<GroupedKernel>,
        fits: bool,
    ) -> Result<GroupedKernel> {
        match want {
            Some(GroupedKernel::Wgmma) if !fits => Err(arg_err(
                op,
                format!(
                    "the wgmma grouped GEMM needs an sm_90a GPU (this one: {}), K and N multiples of 8 and 16-byte aligned operands",
                    self.arch()
                ),
            )),
            Some(k) => Ok(k),
            None if fits && wgmma_allowed() => Ok(GroupedKernel::Wgmma),
            None => Ok(GroupedKernel::MmaSync),
        }
    }

    /// Blocks of a persistent launch over at most `tiles` tiles: one per
    /// multiprocessor (the wgmma GEMMs and attention forward).
    pub(crate) fn persistent_grid(&self, tiles: usize) -> Result<u32> {
        let sms = self
            .ctx()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| super::alloc::driver_err("reading the multiprocessor count", e))?;
        Ok(tiles.clamp(1, sms.max(1) as usize) as u32)
    }

    /// The tensor maps of an nn / nt wgmma product of `x: [M, K]` at `xp` by
    /// `w` at `wp` (`[G, N, K]` with `trans_w`, else `[G, K, N]`).
    #[allow(clippy::too_many_arguments)]
    fn gw_maps(
        op: &'static str,
        xp: u64,
        wp: u64,
        m: usize,
        k: usize,
        n: usize,
        g: usize,
        trans_w: bool,
    ) -> Result<(TmaMap, TmaMap)> {
        let (m64, k64, n64, g64) = (m as u64, k as u64, n as u64, g as u64);
        let ta = tma_map(op, xp, &[k64, m64], &[64, 128])?;
        let tb = if trans_w {
            tma_map(op, wp, &[k64, n64, g64], &[64, 256, 1])?
        } else {
            tma_map(op, wp, &[n64, k64, g64], &[64, 64, 1])?
        };
        Ok((ta, tb))
    }

    /// The function and launch of a wgmma kernel `name` over `g` groups:
    /// one block per multiprocessor, at most one per tile of `tiles`.
    fn gw_launch(
        &self,
        name: &str,
        g: usize,
        tiles: usize,
    ) -> Result<(cudarc::driver::CudaFunction, LaunchConfig)> {
        let smem = gw_smem_bytes(g) as u32;
        self.bind()?;
        let f = self.func_smem(GROUPED_SM90, name, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (self.persistent_grid(tiles)?, 1, 1),
            block_dim: (GW_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        Ok((f, cfg))
    }

    /// [`Cuda::gw_launch`] of an nn / nt kernel with an `[M, N]` output:
    /// at most M / 128 + G + 1 row tiles (TC_TILE, the kernels' GW_BM; the
    /// last for the rows past the groups), each ⌈N / 256⌉ column tiles.
    fn gw_mm_launch(
        &self,
        name: &str,
        m: usize,
        n: usize,
        g: usize,
    ) -> Result<(cudarc::driver::CudaFunction, LaunchConfig)> {
        self.gw_launch(
            name,
            g,
            (m.div_ceil(TC_TILE) + g + 1) * n.div_ceil(TC_TILE_N),
        )
    }

    /// [`Cuda::gw_launch`] of a weight-gradient kernel with a `[G, K, N]`
    /// output: G · ⌈K / 128⌉ · ⌈N / 256⌉ tiles.
    fn gw_wgrad_launch(
        &self,
        name: &str,
        g: usize,
        k: usize,
        n: usize,
    ) -> Result<(cudarc::driver::CudaFunction, LaunchConfig)> {
        self.gw_launch(name, g, g * k.div_ceil(TC_TILE) * n.div_ceil(TC_TILE_N))
    }

    /// `grouped_matmul_sum2` with the bf16 kernel chosen by `kernel` (None:
    /// the default). The wgmma kernels accumulate both products before one
    /// rounding; elsewhere (mma.sync, f32, f64) the two products are added
    /// after each is rounded.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grouped_matmul_sum2_on(
        &self,
        x1: &Tensor<Self>,
        w1: &Tensor<Self>,
        x2: &Tensor<Self>,
        w2: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        kernel: Option<GroupedKernel>,
    ) -> Result<Tensor<Self>> {
        const OP: &str = "grouped_matmul_sum2";
        float_sfx(OP, x1.dtype())?;
        let (m, k1, k2, g, n) = crate::backend::linalg::sum2_dims(OP, x1, w1, x2, w2, trans_w)?;
        if x1.dtype() == DType::BF16 {
            let ptrs = [
                x1.storage().ptr(),
                w1.storage().ptr(),
                x2.storage().ptr(),
                w2.storage().ptr(),
            ];
            let fits = self.wgmma_fits(m, k1, n, g, &ptrs) && self.wgmma_fits(m, k2, n, g, &ptrs);
            let kernel = self.grouped_kernel(OP, kernel, fits)?;
            if kernel == GroupedKernel::Wgmma {
                let (offs, tiles) = self.group_offsets(OP, group_sizes, g, m)?;
                let out = self.alloc(OP, &[m, n], x1.dtype())?;
                let (ta, tb) = Self::gw_maps(OP, ptrs[0], ptrs[1], m, k1, n, g, trans_w)?;
                let (ta2, tb2) = Self::gw_maps(OP, ptrs[2], ptrs[3], m, k2, n, g, trans_w)?;
                let name = if trans_w {
                    "grouped_mm2_wgmma_bf16_nt"
                } else {
                    "grouped_mm2_wgmma_bf16_nn"
                };
                let (f, cfg) = self.gw_mm_launch(&gw_entry(name), m, n, g)?;
                launch!(
                    self,
                    f,
                    cfg,
                    ta,
                    tb,
                    ta2,
                    tb2,
                    offs.ptr(),
                    tiles.ptr(),
                    out.storage().ptr(),
                    m as i64,
                    k1 as i64,
                    k2 as i64,
                    n as i64,
                    g as i32
                )?;
                return Ok(out);
            }
        }
        let mut out = self.grouped_matmul_on(x1, w1, group_sizes, trans_w, kernel)?;
        let second = self.grouped_matmul_on(x2, w2, group_sizes, trans_w, kernel)?;
        self.axpy(&mut out, 1.0, &second)?;
        Ok(out)
    }

    /// `grouped_matmul` with the bf16 kernel chosen by `kernel` (None: the
    /// default); f32 and f64 ignore it.
    pub(crate) fn grouped_matmul_on(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
        kernel: Option<GroupedKernel>,
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
            let (xp, wp) = (x.storage().ptr(), w.storage().ptr());
            let fits = self.wgmma_fits(m, k, n, g, &[xp, wp]);
            let kernel = self.grouped_kernel(OP, kernel, fits)?;
            if m * n == 0 || k == 0 || g == 0 {
                return self.zeros(&[m, n], x.dtype());
            }
            if kernel == GroupedKernel::Wgmma {
                // Every row is written: tiles past the last group store zeros.
                let out = self.alloc(OP, &[m, n], x.dtype())?;
                let (ta, tb) = Self::gw_maps(OP, xp, wp, m, k, n, g, trans_w)?;
                let name = if trans_w {
                    "grouped_mm_wgmma_bf16_nt"
                } else {
                    "grouped_mm_wgmma_bf16_nn"
                };
                let (f, cfg) = self.gw_mm_launch(&gw_entry(name), m, n, g)?;
                launch!(
                    self,
                    f,
                    cfg,
                    ta,
                    tb,
                    offs.ptr(),
                    tiles.ptr(),
                    out.storage().ptr(),
                    m as i64,
                    k as i64,
                    n as i64,
                    g as i32
                )?;
                return Ok(out);
            }
            // mma.sync; rows past the last group stay zero from here.
            let out = self.zeros(&[m, n], x.dtype())?;
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
                xp,
                wp,
                offs.ptr(),
                tiles.ptr(),
                out.storage().ptr(),
                k as i64,
                n as i64,
                g as i32
            )?;
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

    /// `grouped_matmul_weight_grad` with the bf16 kernel chosen by `kernel`
    /// (None: the default); f32 and f64 ignore it.
    pub(crate) fn grouped_wgrad_on(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        kernel: Option<GroupedKernel>,
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
        if x.dtype() == DType::BF16 {
            let (xp, dp) = (x.storage().ptr(), dy.storage().ptr());
            let fits = self.wgmma_fits(m, k, n, g, &[xp, dp]);
            let kernel = self.grouped_kernel(OP, kernel, fits)?;
            if kernel == GroupedKernel::Wgmma {
                // m, k, n, g > 0 (wgmma_fits); empty groups store zeros.
                let out = self.alloc(OP, &[g, k, n], x.dtype())?;
                let (m64, k64, n64) = (m as u64, k as u64, n as u64);
                let ta = tma_map(OP, xp, &[k64, m64], &[64, 64])?;
                let tb = tma_map(OP, dp, &[n64, m64], &[64, 64])?;
                let (f, cfg) =
                    self.gw_wgrad_launch(&gw_entry("grouped_wgrad_wgmma_bf16"), g, k, n)?;
                launch!(
                    self,
                    f,
                    cfg,
                    ta,
                    tb,
                    offs.ptr(),
                    out.storage().ptr(),
                    m as i64,
                    k as i64,
                    n as i64,
                    g as i32
                )?;
                return Ok(out);
            }
        }
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
        self.grouped_matmul_on(x, w, group_sizes, trans_w, None)
    }

    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Tensor<Self>> {
        self.grouped_wgrad_on(x, dy, group_sizes, None)
    }

    fn grouped_matmul_sum2(
        &self,
        x1: &Tensor<Self>,
        w1: &Tensor<Self>,
        x2: &Tensor<Self>,
        w2: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Tensor<Self>> {
        self.grouped_matmul_sum2_on(x1, w1, x2, w2, group_sizes, trans_w, None)
    }
}

/// The gathered products on Hopper: `grouped_sm90.cu`'s GATHER kernels read
/// A's rows through the row map with cp.async (B by TMA), for bf16 where
/// the wgmma kernels fit, `FOLDMOE_GROUPED_GEMM` is not `mma` and
/// `FOLDMOE_GATHER` is not `0`; every other case permutes (the trait's
/// fallback).
impl GatheredGemmOps for Cuda {
    fn gathers_rows_of(&self, source: &Tensor<Self>) -> bool {
        source.dtype() == DType::BF16
            && self.arch() == "sm_90a"
            && wgmma_allowed()
            && gather_allowed()
            && matches!(source.shape(), [_, k] if k.is_multiple_of(8))
            && source.storage().ptr().is_multiple_of(16)
    }

    fn grouped_matmul_gathered_kernel(
        &self,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        w: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
        trans_w: bool,
    ) -> Result<Option<Tensor<Self>>> {
        const OP: &str = "grouped_matmul_gathered";
        let (t, k, g, n) = grouped_dims(OP, x, w, trans_w)?;
        let m = super::routing::row_src_1d(OP, row_src)?;
        let (xp, wp) = (x.storage().ptr(), w.storage().ptr());
        if !self.gathers_rows_of(x) || !self.wgmma_fits(m, k, n, g, &[xp, wp]) {
            return Ok(None);
        }
        self.check_range(OP, row_src, -1, t as i64)?;
        let (offs, tiles) = self.group_offsets(OP, group_sizes, g, m)?;
        let out = self.alloc(OP, &[m, n], x.dtype())?;
        // The B maps of the plain kernels (A's rows come through row_src).
        let (_, tb) = Self::gw_maps(OP, xp, wp, m, k, n, g, trans_w)?;
        let name = if trans_w {
            "grouped_mm_gather_wgmma_bf16_nt"
        } else {
            "grouped_mm_gather_wgmma_bf16_nn"
        };
        let (f, cfg) = self.gw_mm_launch(name, m, n, g)?;
        launch!(
            self,
            f,
            cfg,
            tb,
            xp,
            row_src.storage().ptr(),
            offs.ptr(),
            tiles.ptr(),
            out.storage().ptr(),
            m as i64,
            k as i64,
            n as i64,
            g as i32
        )?;
        Ok(Some(out))
    }

    fn grouped_matmul_weight_grad_gathered_dy_kernel(
        &self,
        x: &Tensor<Self>,
        dy: &Tensor<Self>,
        row_src: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Option<Tensor<Self>>> {
        const OP: &str = "grouped_matmul_weight_grad_gathered_dy";
        let (m, k) = x.dims2(OP)?;
        let (t, n) = dy.dims2(OP)?;
        dy.expect_dtype(OP, x.dtype())?;
        if super::routing::row_src_1d(OP, row_src)? != m {
            return Err(shape_err(
                OP,
                format!(
                    "row_src {:?} and x {:?} disagree on the row count",
                    row_src.shape(),
                    x.shape()
                ),
            ));
        }
        let g = match group_sizes.shape() {
            [g] => *g,
            _ => return Ok(None),
        };
        let (xp, dp) = (x.storage().ptr(), dy.storage().ptr());
        if !self.gathers_rows_of(dy) || !self.wgmma_fits(m, k, n, g, &[xp, dp]) {
            return Ok(None);
        }
        self.check_range(OP, row_src, -1, t as i64)?;
        let (offs, _tiles) = self.group_offsets(OP, group_sizes, g, m)?;
        let out = self.alloc(OP, &[g, k, n], x.dtype())?;
        let ta = tma_map(OP, xp, &[k as u64, m as u64], &[64, 64])?;
        let (f, cfg) = self.gw_wgrad_launch("grouped_wgrad_gatherb_wgmma_bf16", g, k, n)?;
        launch!(
            self,
            f,
            cfg,
            ta,
            dp,
            row_src.storage().ptr(),
            offs.ptr(),
            out.storage().ptr(),
            m as i64,
            k as i64,
            n as i64,
            g as i32
        )?;
        Ok(Some(out))
    }

    fn grouped_matmul_weight_grad_gathered_kernel(
        &self,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        dy: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Option<Tensor<Self>>> {
        const OP: &str = "grouped_matmul_weight_grad_gathered";
        let Some(s) = self.gathered_wgrad_sizes(OP, x, row_src, &[dy], group_sizes)? else {
            return Ok(None);
        };
        let out = self.alloc(OP, &[s.g, s.k, s.n], x.dtype())?;
        let tb = tma_map(OP, dy.storage().ptr(), &[s.n as u64, s.m as u64], &[64, 64])?;
        let (f, cfg) = self.gw_wgrad_launch("grouped_wgrad_gather_wgmma_bf16", s.g, s.k, s.n)?;
        launch!(
            self,
            f,
            cfg,
            tb,
            x.storage().ptr(),
            row_src.storage().ptr(),
            s.offs.ptr(),
            out.storage().ptr(),
            s.m as i64,
            s.k as i64,
            s.n as i64,
            s.g as i32
        )?;
        Ok(Some(out))
    }

    fn grouped_matmul_weight_grad_pair_gathered_kernel(
        &self,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        dy1: &Tensor<Self>,
        dy2: &Tensor<Self>,
        group_sizes: &Tensor<Self>,
    ) -> Result<Option<(Tensor<Self>, Tensor<Self>)>> {
        const OP: &str = "grouped_matmul_weight_grad_pair_gathered";
        if !paired_allowed() {
            return Ok(None);
        }
        let Some(s) = self.gathered_wgrad_sizes(OP, x, row_src, &[dy1, dy2], group_sizes)? else {
            return Ok(None);
        };
        let dw1 = self.alloc(OP, &[s.g, s.k, s.n], x.dtype())?;
        let dw2 = self.alloc(OP, &[s.g, s.k, s.n], x.dtype())?;
        let dims = [s.n as u64, s.m as u64];
        let tb = tma_map(OP, dy1.storage().ptr(), &dims, &[64, 64])?;
        let tb2 = tma_map(OP, dy2.storage().ptr(), &dims, &[64, 64])?;
        // A tile is 128 columns of each gradient: the grid of a 2N-wide one.
        let (f, cfg) =
            self.gw_wgrad_launch("grouped_wgrad_pair_gather_wgmma_bf16", s.g, s.k, 2 * s.n)?;
        launch!(
            self,
            f,
            cfg,
            tb,
            tb2,
            x.storage().ptr(),
            row_src.storage().ptr(),
            s.offs.ptr(),
            dw1.storage().ptr(),
            dw2.storage().ptr(),
            s.m as i64,
            s.k as i64,
            s.n as i64,
            s.g as i32
        )?;
        Ok(Some((dw1, dw2)))
    }
}

/// The sizes of a gathered weight gradient the wgmma kernels take, and the
/// group offsets they read.
struct GatheredWgrad {
    m: usize,
    k: usize,
    n: usize,
    g: usize,
    offs: super::alloc::Block,
}

impl Cuda {
    /// The checks of a gathered weight gradient of `x: [T, K]` through
    /// `row_src: [M]` by each of `dys` (`[M, N]`, x's dtype): an error for
    /// inconsistent operands, `None` where the gathering kernels do not
    /// take them, else the sizes with the group offsets (and the row map's
    /// range check queued).
    fn gathered_wgrad_sizes(
        &self,
        op: &'static str,
        x: &Tensor<Self>,
        row_src: &Tensor<Self>,
        dys: &[&Tensor<Self>],
        group_sizes: &Tensor<Self>,
    ) -> Result<Option<GatheredWgrad>> {
        let (t, k) = x.dims2(op)?;
        let (m, n) = dys[0].dims2(op)?;
        if super::routing::row_src_1d(op, row_src)? != m {
            return Err(shape_err(
                op,
                format!(
                    "row_src {:?} and dy {:?} disagree on the row count",
                    row_src.shape(),
                    dys[0].shape()
                ),
            ));
        }
        let mut ptrs = vec![x.storage().ptr()];
        for dy in dys {
            dy.expect_dtype(op, x.dtype())?;
            ptrs.push(dy.storage().ptr());
        }
        let g = match group_sizes.shape() {
            [g] => *g,
            _ => return Ok(None),
        };
        if !self.gathers_rows_of(x) || !self.wgmma_fits(m, k, n, g, &ptrs) {
            return Ok(None);
        }
        self.check_range(op, row_src, -1, t as i64)?;
        let (offs, _tiles) = self.group_offsets(op, group_sizes, g, m)?;
        Ok(Some(GatheredWgrad { m, k, n, g, offs }))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::backend::RoutingOps;
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

    pub(in crate::cuda) fn host(d: &Cuda, t: &Tensor<Cuda>) -> Vec<f32> {
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

    /// The kernels to check at K, N: mma.sync always, wgmma where the device
    /// is sm_90a and the shape fits it.
    fn kernels_for(d: &Cuda, k: usize, n: usize) -> Vec<GroupedKernel> {
        let mut v = vec![GroupedKernel::MmaSync];
        if d.arch() == "sm_90a" && k.is_multiple_of(8) && n.is_multiple_of(8) {
            v.push(GroupedKernel::Wgmma);
        }
        v
    }

    /// Leaves a freed NaN-filled block of `shape` in the pool, so the next
    /// allocation of that size (the product's output) starts as NaN: an
    /// element the kernel fails to write shows up.
    fn poison(d: &Cuda, shape: &[usize]) {
        let n: usize = shape.iter().product();
        let t = d
            .cast(
                &d.upload(HostData::F32(vec![f32::NAN; n]), shape).unwrap(),
                DType::BF16,
            )
            .unwrap();
        drop(t);
    }

    /// The bf16 grouped GEMMs (both layouts) and weight gradient, on every
    /// kernel the device has (mma.sync; wgmma on sm_90a), against the f32
    /// kernels on the same bf16-rounded inputs, at the edges of their tiles:
    /// group ends inside a 128-row tile, empty groups, 1-row groups, sizes
    /// summing to less than M (the rows past them must come out zero), N past
    /// a 256-column tile, K over more steps than the 4-stage pipeline holds
    /// (and at the MoE's 2048), K and N multiples of 8 but not of 64 (the
    /// copy engine's zero fill), K and N not multiples of 8 (mma.sync only:
    /// element loads and stores), the fc2 shape K = 768, N = 2048 with groups
    /// of 64·n + 1, 64·n and 64·n - 1 rows (the weight gradient's last,
    /// partial step of a group), and 128 groups of uneven sizes. Each output
    /// starts as NaN (`poison`), and each wgmma result is computed twice and
    /// must be bit-identical (no race).
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn tensor_core_grouped_gemms_match_f32() {
        let d = crate::cuda::require_test_device();
        let uneven: Vec<i32> = (0..128)
            .map(|i| if i % 11 == 3 { 0 } else { i * 37 % 97 + i % 3 })
            .collect();
        let uneven_m = uneven.iter().sum::<i32>() as usize;
        let cases: Vec<(Vec<i32>, usize, usize, usize)> = vec![
            (vec![300, 0, 1, 257, 64, 0, 513], 1200, 320, 520),
            (vec![1024, 1000, 0, 1100], 3200, 2048, 768),
            (vec![129, 1024, 0, 63, 640, 65], 2000, 768, 2048),
            (vec![5, 130, 0, 70], 210, 77, 203),
            (vec![129, 3], 140, 72, 13),
            (vec![0, 0], 10, 64, 64),
            (vec![1, 1, 0, 1, 200, 0, 127, 128, 129], 700, 136, 264),
            (vec![0, 0, 0, 333, 0], 400, 2048, 768),
            (vec![1], 1, 8, 8),
            (uneven, uneven_m + 3, 256, 520),
        ];
        for (ci, (sizes, m, k, n)) in cases.into_iter().enumerate() {
            let g = sizes.len();
            let gs = d.upload(HostData::I32(sizes.clone()), &[g]).unwrap();
            let seed = 10 * ci as u64;
            let (x32, x16) = pair(&d, &[m, k], seed + 1);
            for trans_w in [false, true] {
                let ws = if trans_w { [g, n, k] } else { [g, k, n] };
                let (w32, w16) = pair(&d, &ws, seed + 2);
                let want = host(&d, &d.grouped_matmul(&x32, &w32, &gs, trans_w).unwrap());
                for kernel in kernels_for(&d, k, n) {
                    poison(&d, &[m, n]);
                    let run = || {
                        d.grouped_matmul_on(&x16, &w16, &gs, trans_w, Some(kernel))
                            .unwrap()
                    };
                    let got = host(&d, &run());
                    let what = format!(
                        "grouped_matmul {kernel:?} {sizes:?} m={m} k={k} n={n} trans_w={trans_w}"
                    );
                    assert_close(&what, &got, &want, n);
                    if kernel == GroupedKernel::Wgmma {
                        assert_eq!(host(&d, &run()), got, "{what}: a second run differs");
                    }
                }
            }
            let (dy32, dy16) = pair(&d, &[m, n], seed + 3);
            let want = host(&d, &d.grouped_matmul_weight_grad(&x32, &dy32, &gs).unwrap());
            for kernel in kernels_for(&d, k, n) {
                poison(&d, &[g, k, n]);
                let run = || d.grouped_wgrad_on(&x16, &dy16, &gs, Some(kernel)).unwrap();
                let got = host(&d, &run());
                let what =
                    format!("grouped_matmul_weight_grad {kernel:?} {sizes:?} m={m} k={k} n={n}");
                assert_close(&what, &got, &want, n);
                if kernel == GroupedKernel::Wgmma {
                    assert_eq!(host(&d, &run()), got, "{what}: a second run differs");
                }
            }
        }
    }

    /// The wgmma kernels alone on one small ragged case (1-row and empty
    /// groups, a partial 64-row step, K and N not multiples of 64, rows past
    /// the groups): the case `compute-sanitizer` runs (NOTES.md).
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn wgmma_grouped_gemms_small() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let sizes = vec![1, 0, 130, 64, 3];
        let (m, k, n, g) = (210usize, 136usize, 264usize, 5usize);
        let gs = d.upload(HostData::I32(sizes), &[g]).unwrap();
        let (x32, x16) = pair(&d, &[m, k], 7);
        let (dy32, dy16) = pair(&d, &[m, n], 9);
        {
            let kernel = GroupedKernel::Wgmma;
            let kn = Some(kernel);
            for trans_w in [false, true] {
                let ws = if trans_w { [g, n, k] } else { [g, k, n] };
                let (w32, w16) = pair(&d, &ws, 8);
                let want = host(&d, &d.grouped_matmul(&x32, &w32, &gs, trans_w).unwrap());
                poison(&d, &[m, n]);
                let got = host(
                    &d,
                    &d.grouped_matmul_on(&x16, &w16, &gs, trans_w, kn).unwrap(),
                );
                assert_close(
                    &format!("small {kernel:?} trans_w={trans_w}"),
                    &got,
                    &want,
                    n,
                );
            }
            let want = host(&d, &d.grouped_matmul_weight_grad(&x32, &dy32, &gs).unwrap());
            poison(&d, &[g, k, n]);
            let got = host(&d, &d.grouped_wgrad_on(&x16, &dy16, &gs, kn).unwrap());
            assert_close(&format!("small {kernel:?} wgrad"), &got, &want, n);
        }
    }

    /// The wgmma sum of two products (the experts' dx over both
    /// projections) on small ragged groups (1-row and empty groups, a
    /// partial last tile, rows past the groups, N past a 256-column tile, K
    /// not a multiple of 64) and on 128 uneven groups at the MoE shapes,
    /// against the two products added after rounding: within bf16 rounding,
    /// and deterministic. Outputs start as NaN.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn wgmma_fused_grouped_ops_small() {
        check_fused(vec![1, 0, 130, 64, 3], 210, 136, 264);
    }

    /// [`wgmma_fused_grouped_ops_small`]'s checks on 128 uneven groups of
    /// 16384 rows, K = 256, N = 768.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn wgmma_fused_grouped_ops_moe_groups() {
        check_fused(uneven_sizes(128, 16384), 16384, 256, 768);
    }

    fn check_fused(sizes: Vec<i32>, m: usize, k: usize, n: usize) {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let kn = Some(GroupedKernel::Wgmma);
        {
            let g = sizes.len();
            let gs = d.upload(HostData::I32(sizes), &[g]).unwrap();
            let (_, x2) = pair(&d, &[m, n], 12);
            let (_, gate) = pair(&d, &[m, n], 13);
            for trans_w in [false, true] {
                let ws = |kk: usize| if trans_w { [g, k, kk] } else { [g, kk, k] };
                let (_, w1) = pair(&d, &ws(n), 16);
                let (_, w2) = pair(&d, &ws(n), 17);
                // x2 and gate: both [M, N], so K1 = K2 = N here, output [M, K].
                poison(&d, &[m, k]);
                let got = host(
                    &d,
                    &d.grouped_matmul_sum2_on(&x2, &w1, &gate, &w2, &gs, trans_w, kn)
                        .unwrap(),
                );
                let mut want = d.grouped_matmul_on(&x2, &w1, &gs, trans_w, kn).unwrap();
                d.axpy(
                    &mut want,
                    1.0,
                    &d.grouped_matmul_on(&gate, &w2, &gs, trans_w, kn).unwrap(),
                )
                .unwrap();
                assert_close(
                    &format!("sum2 m={m} trans_w={trans_w}"),
                    &got,
                    &host(&d, &want),
                    k,
                );
                let again = host(
                    &d,
                    &d.grouped_matmul_sum2_on(&x2, &w1, &gate, &w2, &gs, trans_w, kn)
                        .unwrap(),
                );
                assert_eq!(
                    got, again,
                    "sum2 m={m} trans_w={trans_w}: not deterministic"
                );
            }
        }
    }

    /// Asking for the wgmma kernels where they cannot run (K or N not a
    /// multiple of 8, or a GPU other than sm_90a) is a typed error, and the
    /// default then takes mma.sync.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn wgmma_refuses_shapes_it_cannot_take() {
        let d = crate::cuda::require_test_device();
        let gs = d.upload(HostData::I32(vec![3, 4]), &[2]).unwrap();
        let (_, x) = pair(&d, &[7, 12], 1);
        let (_, w) = pair(&d, &[2, 12, 20], 2);
        let err = d
            .grouped_matmul_on(&x, &w, &gs, false, Some(GroupedKernel::Wgmma))
            .unwrap_err();
        assert!(err.to_string().contains("multiples of 8"), "{err}");
        assert_eq!(
            d.grouped_matmul(&x, &w, &gs, false).unwrap().shape(),
            &[7, 20]
        );
    }

    /// The gathered products at the Qwen3-30B-A3B expert shape (16384
    /// tokens × top-8 = 131072 rows in 128 uneven groups, hidden 2048, ffn
    /// 768, bf16; every 97th row a zero row): the GATHER kernels against
    /// permute + the plain wgmma kernels, bit for bit (the same products in
    /// the same order, only the loads differ). Ignored (large): run with
    /// `--ignored` on a GPU.
    #[test]
    #[ignore]
    fn gathered_products_full_shape_equal_the_permuted_ones() {
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let (tokens, rows, h, f, e) = (16384usize, 131072usize, 2048usize, 768usize, 128usize);
        let gs = d
            .upload(HostData::I32(uneven_sizes(e, rows)), &[e])
            .unwrap();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let src: Vec<i32> = (0..rows)
            .map(|r| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                if r % 97 == 5 {
                    -1
                } else {
                    (state % tokens as u64) as i32
                }
            })
            .collect();
        let row_src = d.upload(HostData::I32(src), &[rows]).unwrap();
        let (_, x) = pair(&d, &[tokens, h], 31);
        let (_, w1) = pair(&d, &[e, h, f], 32);
        let (_, dg) = pair(&d, &[rows, f], 33);
        let xp = d.permute(&x, &row_src).unwrap();
        let got = d
            .grouped_matmul_gathered(&x, &row_src, &w1, &gs, false)
            .unwrap();
        let want = d.grouped_matmul(&xp, &w1, &gs, false).unwrap();
        assert_eq!(host(&d, &got), host(&d, &want), "gate projection");
        let got = d
            .grouped_matmul_weight_grad_gathered(&x, &row_src, &dg, &gs)
            .unwrap();
        let want = d.grouped_matmul_weight_grad(&xp, &dg, &gs).unwrap();
        assert_eq!(host(&d, &got), host(&d, &want), "gate weight gradient");
        // The paired kernel (both weight gradients in one) against the
        // single products.
        let (_, du) = pair(&d, &[rows, f], 35);
        let (dw1, dw3) = d
            .grouped_matmul_weight_grad_pair_gathered(&x, &row_src, &dg, &du, &gs)
            .unwrap();
        assert_eq!(
            host(&d, &dw1),
            host(&d, &want),
            "paired gate weight gradient"
        );
        let dw3_want = d.grouped_matmul_weight_grad(&xp, &du, &gs).unwrap();
        assert_eq!(
            host(&d, &dw3),
            host(&d, &dw3_want),
            "paired up weight gradient"
        );
        // The down projection's backward over the gathered output
        // gradient: dact = dy_perm · w2ᵀ and dw2 = actᵀ dy_perm, dy's rows
        // gathered from [tokens, h].
        let (_, w2) = pair(&d, &[e, f, h], 36);
        let (_, act) = pair(&d, &[rows, f], 37);
        let got = d
            .grouped_matmul_gathered(&x, &row_src, &w2, &gs, true)
            .unwrap();
        let want = d.grouped_matmul(&xp, &w2, &gs, true).unwrap();
        assert_eq!(host(&d, &got), host(&d, &want), "down projection dgrad");
        let got = d
            .grouped_matmul_weight_grad_gathered_dy(&act, &x, &row_src, &gs)
            .unwrap();
        let want = d.grouped_matmul_weight_grad(&act, &xp, &gs).unwrap();
        assert_eq!(host(&d, &got), host(&d, &want), "down projection wgrad");
        println!("gathered products at the full expert shape: bit-identical to permute + product (single and paired weight gradients, the transposed product, the gathered output gradient)");
    }

    /// The MoE layer's experts and combine at the Qwen3-30B-A3B shape (16384
    /// tokens, top-8 of 128 experts, hidden 2048, ffn 768, bf16), forward
    /// and backward, with the routing weights applied in SwiGLU and the
    /// output gradient gathered (this design) against the previous path
    /// (plain SwiGLU, the weights applied to the experts' outputs in combine,
    /// the permuted output gradient scaled and written out, the weights'
    /// gradient from the saved outputs): the combined output, dx, the down
    /// projection's weight gradient and the weights' gradient within bf16
    /// rounding (1e-2 of the largest magnitude); prints the relative
    /// Frobenius differences. Ignored (large): run with `--ignored` on a GPU.
    #[test]
    #[ignore]
    fn moe_weights_in_swiglu_full_shape_against_weighted_combine() {
        use crate::backend::{ElementwiseOps, GatheredGemmOps};
        let Some(d) = crate::cuda::require_sm90_test_device() else {
            return;
        };
        let (t, k, h, f, e) = (16384usize, 8usize, 2048usize, 768usize, 128usize);
        let n = t * k;
        let (_, logits) = pair(&d, &[t, e], 41);
        let idx = d.topk(&logits, k, 1, 1).unwrap();
        let w_tk = d.softmax(&d.gather_cols(&logits, &idx).unwrap()).unwrap();
        let plan = d.routing_plan(&idx, e).unwrap();
        let gs = &plan.counts;
        let (_, x) = pair(&d, &[t, h], 42);
        let (_, w1) = pair(&d, &[e, h, f], 43);
        let (_, w3) = pair(&d, &[e, h, f], 44);
        let (_, w2) = pair(&d, &[e, f, h], 45);
        let (_, dout) = pair(&d, &[t, h], 46);
        let rs = &plan.row_src;
        let gate = d.grouped_matmul_gathered(&x, rs, &w1, gs, false).unwrap();
        let up = d.grouped_matmul_gathered(&x, rs, &w3, gs, false).unwrap();
        let p = d.permute_weights(&w_tk, &plan.slot, n).unwrap();
        let dx_of = |dg: &Tensor<Cuda>, du: &Tensor<Cuda>| {
            let dx_nd = d.grouped_matmul_sum2(dg, &w1, du, &w3, gs, true).unwrap();
            d.permute_backward(&dx_nd, rs, t).unwrap()
        };
        // This design.
        let act = d.swiglu_weighted(&gate, &up, &p).unwrap();
        let y = d.grouped_matmul(&act, &w2, gs, false).unwrap();
        let out = d.unpermute(&y, &plan.slot).unwrap();
        let dw2 = d
            .grouped_matmul_weight_grad_gathered_dy(&act, &dout, rs, gs)
            .unwrap();
        let dact = d.grouped_matmul_gathered(&dout, rs, &w2, gs, true).unwrap();
        let (dg, du, dp) = d.swiglu_weighted_backward(&gate, &up, &p, &dact).unwrap();
        let dw = d.permute_weights_backward(&dp, &plan.slot).unwrap();
        let new = [out, dx_of(&dg, &du), dw2, dw].map(|t| host(&d, &t));
        // The previous path.
        let act = d.swiglu(&gate, &up).unwrap();
        let y = d.grouped_matmul(&act, &w2, gs, false).unwrap();
        let out = d
            .unpermute(&d.mul_rows(&y, &p).unwrap(), &plan.slot)
            .unwrap();
        let dy_perm = d.permute(&dout, rs).unwrap();
        let dy = d.mul_rows(&dy_perm, &p).unwrap();
        let dw2 = d.grouped_matmul_weight_grad(&act, &dy, gs).unwrap();
        let dact = d.grouped_matmul(&dy, &w2, gs, true).unwrap();
        let (dg, du) = d.swiglu_backward(&gate, &up, &dact).unwrap();
        let dp = d.dot_rows(&dy_perm, &y).unwrap();
        let dw = d.permute_weights_backward(&dp, &plan.slot).unwrap();
        let old = [out, dx_of(&dg, &du), dw2, dw].map(|t| host(&d, &t));
        for (name, (a, b)) in ["out", "dx", "dw2", "dweights"]
            .iter()
            .zip(new.iter().zip(&old))
        {
            let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
            println!(
                "weights in SwiGLU vs weighted combine, {name}: relative Frobenius difference {:.3e}",
                (num / den.max(1e-300)).sqrt()
            );
            assert!(a.iter().all(|v| v.is_finite()), "{name}: not finite");
            assert_close(&format!("weights in SwiGLU, {name}"), a, b, 1);
        }
    }

    /// Seconds per call of `run` on the host clock: 20 synchronised calls
    /// after 3 warm-ups (the ignored timing tests).
    pub(in crate::cuda) fn mean_seconds<R>(d: &Cuda, run: &dyn Fn() -> R) -> f64 {
        for _ in 0..3 {
            run();
        }
        d.synchronize().unwrap();
        let reps = 20;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            run();
        }
        d.synchronize().unwrap();
        t0.elapsed().as_secs_f64() / reps as f64
    }

    /// The sizes of `g` uneven groups over `rows` rows: weights 64 + (37 i
    /// mod 128), scaled down, the last group taking the remainder (the
    /// same formula is in kernels/scripts/grouped_gemm_peer.py).
    pub(in crate::cuda) fn uneven_sizes(g: usize, rows: usize) -> Vec<i32> {
        let w: Vec<usize> = (0..g).map(|i| 64 + (i * 37) % 128).collect();
        let total: usize = w.iter().sum();
        let mut s: Vec<i32> = w.iter().map(|&wi| (rows * wi / total) as i32).collect();
        let used: i32 = s.iter().sum();
        s[g - 1] += rows as i32 - used;
        s
    }

    /// Timings of the bf16 grouped GEMMs at the Qwen3-30B-A3B expert shapes
    /// (128 experts, 16384 tokens × top-8 = 131072 rows, hidden 2048, expert
    /// ffn 768), uniform and uneven groups, mma.sync against wgmma, with the
    /// relative difference of the two results (Frobenius norm); ignored: run
    /// with `--ignored` on a GPU. Host clock around 20 synchronised calls
    /// after 3 warm-ups; the calls include the group-offsets kernel (and, for
    /// mma.sync, the output's zero fill).
    #[test]
    #[ignore]
    fn grouped_gemm_timings() {
        type Run<'a> = (&'static str, String, Box<dyn Fn() -> Tensor<Cuda> + 'a>);
        let d = crate::cuda::require_test_device();
        let (rows, h, f, e) = (131072usize, 2048usize, 768usize, 128usize);
        let rel = |a: &Tensor<Cuda>, b: &Tensor<Cuda>| {
            let (a, b) = (host(&d, a), host(&d, b));
            let num: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum();
            let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
            (num / den.max(1e-300)).sqrt()
        };
        let time = |f: &dyn Fn() -> Tensor<Cuda>| mean_seconds(&d, f);
        let mut kernels = vec![GroupedKernel::MmaSync];
        if d.arch() == "sm_90a" {
            kernels.push(GroupedKernel::Wgmma);
        }
        println!("| product | groups | shape | kernel | ms | TFLOP/s | rel. diff vs mma.sync |");
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for (label, sizes) in [
            ("uniform", vec![(rows / e) as i32; e]),
            ("uneven", uneven_sizes(e, rows)),
        ] {
            let gs = d.upload(HostData::I32(sizes), &[e]).unwrap();
            // (name, K, N): fc1 is gate or up (hidden -> ffn), fc2 down.
            for (name, k, n) in [("fc1", h, f), ("fc2", f, h)] {
                let flop = 2.0 * (rows * k * n) as f64;
                let (_, x) = pair(&d, &[rows, k], 1);
                let (_, w) = pair(&d, &[e, k, n], 2);
                let (_, dy) = pair(&d, &[rows, n], 3);
                let mut outs: Vec<(&str, Tensor<Cuda>)> = Vec::new();
                for kernel in &kernels {
                    let kn = Some(*kernel);
                    let runs: [Run; 3] = [
                        (
                            "nn",
                            format!("{name} fwd {rows}x{k}x{n}"),
                            Box::new(|| d.grouped_matmul_on(&x, &w, &gs, false, kn).unwrap()),
                        ),
                        (
                            "nt",
                            format!("{name} dgrad {rows}x{n}x{k}"),
                            Box::new(|| d.grouped_matmul_on(&dy, &w, &gs, true, kn).unwrap()),
                        ),
                        (
                            "wgrad",
                            format!("{name} wgrad {e}x{k}x{n}"),
                            Box::new(|| d.grouped_wgrad_on(&x, &dy, &gs, kn).unwrap()),
                        ),
                    ];
                    for (prod, shape, run) in runs.iter() {
                        let s = time(run.as_ref());
                        let out = run();
                        let diff = match outs.iter().find(|(p, _)| p == prod) {
                            Some((_, base)) => {
                                let nb = host(&d, base)
                                    .iter()
                                    .map(|v| (*v as f64).powi(2))
                                    .sum::<f64>();
                                format!("{:.2e} (‖ref‖ {:.3e})", rel(&out, base), nb.sqrt())
                            }
                            None => {
                                outs.push((prod, out));
                                "-".to_string()
                            }
                        };
                        println!(
                            "| {prod} | {label} | {shape} | {kernel:?} | {:.3} | {:.1} | {diff} |",
                            s * 1e3,
                            flop / s / 1e12
                        );
                    }
                }
            }
        }
    }
}
