//! The CUDA backend, on cudarc with dynamic loading: the crate builds without
//! a CUDA toolkit, and a machine without a driver or GPU gets a clear
//! [`KernelError::DeviceUnavailable`] from [`Cuda::new`] naming what is missing.
//!
//! The files mirror `cpu/` (one per op area), each with its CUDA C kernels in
//! a `.cu` file beside it, compiled at first use by NVRTC (`compile.rs`).
//! Memory comes from a caching allocator (`alloc.rs`); all work of one handle
//! runs on one stream, in order.
//!
//! Data-dependent errors (an index out of range, a NaN where none is allowed,
//! group sizes larger than the rows) are found by the kernels, which cannot
//! return them without a host synchronisation. Each such kernel records the
//! first failure in the handle's error record and writes a harmless value
//! instead; the error is returned by the next [`Device::download`] or
//! [`Cuda::synchronize`]. Shape and dtype errors are returned at once, as on
//! the CPU.
//!
//! Every op area is implemented, so `Cuda` is a [`crate::Backend`]. Dense
//! products run on cuBLAS; the grouped GEMMs are mma.sync tensor-core
//! kernels of our own on bf16 (group sizes read on the device), plain
//! kernels on f32/f64; bf16 attention with a head dim of 64 or 128 is a
//! flash kernel of our own, other attention runs its products on cuBLAS.

mod alloc;
mod attention;
mod attention_sm90;
mod compile;
mod elementwise;
mod fp8;
mod graph;
mod linalg;
mod loss;
pub mod nccl;
mod norm;
mod offload;
mod optim;
mod routing;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    result as drv, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig,
};

use crate::backend::Device;
use crate::error::{KernelError, Result};
use crate::tensor::{DType, HostData, StorageInfo, Tensor};
use alloc::{driver_err, Block, Pool};
use compile::Module;
pub use graph::CudaGraphExec;
pub use offload::CudaOffloaded;

/// The oldest architecture accepted: Ampere, the first with native bf16.
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Handle to one CUDA device: a stream, a memory pool and an error record.
/// Clones share all three; [`Cuda::new`] makes an independent handle.
#[derive(Clone)]
pub struct Cuda {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cuda({}, {})", self.inner.name, self.inner.arch)
    }
}

/// A point on the compute stream's timeline ([`Cuda::mark`]).
pub struct StreamMark(CudaEvent);

impl StreamMark {
    /// Milliseconds of device time from this mark to `later`, waiting until
    /// `later` has been reached.
    pub fn ms_until(&self, later: &StreamMark) -> Result<f64> {
        self.0
            .elapsed_ms(&later.0)
            .map(f64::from)
            .map_err(|e| driver_err("reading a timing interval", e))
    }
}

/// A builder of the error a failed device-side check reports, from the
/// recorded element index and value.
type ErrorBuilder = Box<dyn Fn(i64, f64) -> KernelError + Send>;

/// Checks launched since the last read of the error record.
#[derive(Default)]
struct Checks {
    next: u32,
    pending: HashMap<u32, ErrorBuilder>,
}

/// Pending checks after which an op reads the error record itself, so the
/// table cannot grow without bound in a loop that never downloads.
const MAX_PENDING_CHECKS: usize = 1 << 16;

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: Arc<Pool>,
    /// `sm_90a`-style target for NVRTC.
    arch: String,
    /// Whether kernels are launched programmatically dependent
    /// (`FOLDMOE_PDL=1` on sm_90+; see [`Cuda::launch_params`]).
    programmatic: AtomicBool,
    /// Whether the device can (sm_90+; read by the tests' toggle).
    #[cfg_attr(not(test), allow(dead_code))]
    programmatic_capable: bool,
    name: String,
    /// The device's `ErrRec` (see common.cuh): code, pad, index, value.
    err: Block,
    checks: Mutex<Checks>,
    blas: Mutex<Option<linalg::Blas>>,
    /// Host waits on the stream so far (downloads, synchronize).
    syncs: AtomicU64,
    /// Activation offload's copy stream and pinned buffers (at first use).
    offload: Mutex<Option<offload::OffloadState>>,
    /// Pinned copies of the uploads of a CUDA graph capture under way.
    capture_uploads: graph::CaptureUploads,
}

/// Device memory of a tensor: a pooled block shared by clones (copied before
/// an in-place op writes to a shared one, so tensors keep value semantics).
#[derive(Clone)]
pub struct CudaStorage {
    block: Arc<Block>,
    dtype: DType,
    len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({:?}; {})", self.dtype, self.len)
    }
}

impl StorageInfo for CudaStorage {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl CudaStorage {
    /// The device address of the first element.
    pub(crate) fn ptr(&self) -> u64 {
        self.block.ptr()
    }
}

/// Bytes per element of `dtype` on the device.
pub(crate) fn dtype_size(dtype: DType) -> usize {
    match dtype {
        DType::F32 | DType::I32 => 4,
        DType::F64 => 8,
        DType::BF16 => 2,
    }
}

/// Kernel-name suffix of a float dtype, or an unsupported-dtype error.
pub(crate) fn float_sfx(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        DType::BF16 => Ok("bf16"),
        DType::I32 => Err(KernelError::UnsupportedDType {
            op,
            dtype,
            backend: "cuda",
        }),
    }
}

/// Kernel-name suffix of any dtype.
fn any_sfx(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::BF16 => "bf16",
        DType::I32 => "i32",
    }
}

/// Blocks for a grid-stride elementwise kernel of 256 threads over `n`
/// elements: enough to fill the GPU, few enough that each thread loops.
pub(crate) fn grid_for(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 8192) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per row (grid-stride over rows past the limit).
pub(crate) fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row, 8 rows (256 threads) per block, at most 2^16 blocks
/// (the kernels stride over the rest): the attention backward's per-row
/// delta kernels.
pub(crate) fn warp_rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `grid` blocks of `threads` threads with `smem` bytes of dynamic shared
/// memory.
pub(crate) fn block_cfg(grid: (u32, u32, u32), threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Launches `$func` on the handle's stream with `cfg` and the arguments
/// (device addresses as `u64`, sizes as `i64`, scalars as `f64`/`i32`/`u32`;
/// any [`cudarc::driver::DeviceRepr`] value, never a `CudaSlice`).
/// Each argument is bound to a local so its address lives until the launch
/// ([`Cuda::launch_params`] queues it).
macro_rules! launch {
    ($dev:expr, $func:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let func: cudarc::driver::CudaFunction = $func;
        let mut params: Vec<*mut std::ffi::c_void> = Vec::new();
        $(
            let a = $arg;
            params.push($crate::cuda::kernel_param(&a));
        )*
        $dev.launch_params(&func, $cfg, &mut params)
    }};
}
pub(crate) use launch;

/// The switch of programmatic dependent launches (0|1, default 0): read
/// when a device opens.
const PDL_SWITCH: &str = "FOLDMOE_PDL";

/// A kernel argument's address, as `cuLaunchKernelEx` takes it: only plain
/// device representations (a `CudaSlice` would pass its own address).
pub(crate) fn kernel_param<T: cudarc::driver::DeviceRepr>(a: &T) -> *mut std::ffi::c_void {
    a as *const T as *mut std::ffi::c_void
}

/// A failed launch, as the crate's error.
pub(crate) fn launch_err(f: &CudaFunction, e: drv::DriverError) -> KernelError {
    KernelError::DeviceUnavailable {
        device: "cuda",
        reason: format!("kernel launch failed ({f:?}): {e:?}"),
    }
}

impl Cuda {
    /// Opens CUDA device `ordinal`. Errors name what is missing: the driver
    /// library, NVRTC, cuBLAS, a GPU, or a new enough architecture.
    pub fn new(ordinal: usize) -> Result<Self> {
        let unavailable = |reason: String| KernelError::DeviceUnavailable {
            device: "cuda",
            reason,
        };
        let mut missing = Vec::new();
        if !unsafe { sys::is_culib_present() } {
            missing.push("the NVIDIA driver library (libcuda.so): install the NVIDIA driver");
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            missing.push(
                "NVRTC (libnvrtc.so, CUDA toolkit): put its lib directory on LD_LIBRARY_PATH",
            );
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            missing.push(
                "cuBLAS (libcublas.so, CUDA toolkit): put its lib directory on LD_LIBRARY_PATH",
            );
        }
        if !missing.is_empty() {
            return Err(unavailable(format!(
                "not found: {}; or use --device cpu",
                missing.join("; ")
            )));
        }
        // cudarc panics when a symbol is missing from an old driver; turn that
        // into the same kind of error.
        let opened = std::panic::catch_unwind(|| -> Result<Inner> {
            let count = CudaContext::device_count()
                .map_err(|e| unavailable(format!("the CUDA driver did not start: {e:?}")))?;
            if count <= 0 {
                return Err(unavailable(
                    "the CUDA driver found no GPU; use --device cpu".to_string(),
                ));
            }
            if ordinal >= count as usize {
                return Err(unavailable(format!(
                    "device {ordinal} requested, but only {count} GPU(s) found (ordinals 0..{count})"
                )));
            }
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| unavailable(format!("creating a context on GPU {ordinal}: {e:?}")))?;
            let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
            let (major, minor) = ctx
                .compute_capability()
                .map_err(|e| unavailable(format!("reading the compute capability: {e:?}")))?;
            if (major, minor) < MIN_COMPUTE_CAPABILITY {
                return Err(unavailable(format!(
                    "{name} has compute capability {major}.{minor} (sm_{major}{minor}); this backend needs sm_{}{} or newer (native bf16)",
                    MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
                )));
            }
            // sm_90a: Hopper's architecture-specific features (wgmma, TMA);
            // the code then runs on that family only, which is the device.
            let arch = if major == 9 && minor == 0 {
                "sm_90a".to_string()
            } else {
                format!("sm_{major}{minor}")
            };
            let programmatic_capable = major >= 9;
            let programmatic = AtomicBool::new(
                compile::env_switch(PDL_SWITCH)
                    .map_err(unavailable)?
                    .unwrap_or(false)
                    && programmatic_capable,
            );
            let stream = ctx
                .new_stream()
                .map_err(|e| unavailable(format!("creating a stream: {e:?}")))?;
            let pool = Pool::new(ctx.clone(), stream.clone());
            let err = pool.alloc(24, "the error record")?;
            unsafe { drv::memset_d8_async(err.ptr(), 0, 24, stream.cu_stream()) }
                .map_err(|e| driver_err("clearing the error record", e))?;
            Ok(Inner {
                ctx,
                stream,
                pool,
                arch,
                programmatic,
                programmatic_capable,
                name,
                err,
                checks: Mutex::new(Checks::default()),
                blas: Mutex::new(None),
                syncs: AtomicU64::new(0),
                offload: Mutex::new(None),
                capture_uploads: Default::default(),
            })
        });
        match opened {
            Ok(r) => r.map(|inner| Cuda {
                inner: Arc::new(inner),
            }),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown failure".into());
                Err(unavailable(format!(
                    "the CUDA libraries could not be used: {msg}"
                )))
            }
        }
    }

    /// The GPU's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Queues `func` on the handle's stream with `cfg` and `params` (the
    /// arguments' addresses, [`launch!`]). With `FOLDMOE_PDL=1` on sm_90+
    /// the launch is programmatically dependent: its blocks may be scheduled
    /// while the kernel before it still runs, each waiting in `pdl_enter`
    /// (common.cuh, every kernel's first statement) until that kernel has
    /// completed, which hides the launch latency between kernels.
    pub(crate) fn launch_params(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: an all-zero attribute is a valid (ignored) value; the id
        // and the union field are set together below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: self.inner.programmatic.load(Ordering::Relaxed) as u32,
        };
        // SAFETY: `params` holds one valid address per kernel parameter, in
        // order, alive until this returns (the driver copies them).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| launch_err(func, e))
    }

    /// Turns programmatic dependent launches on or off for this handle's
    /// later launches (on only where the device is sm_90+), whatever
    /// `FOLDMOE_PDL` said: tests compare both in one process.
    #[cfg(test)]
    pub(crate) fn set_programmatic(&self, on: bool) {
        self.inner
            .programmatic
            .store(on && self.inner.programmatic_capable, Ordering::Relaxed);
    }

    /// The architecture kernels are compiled for (`sm_90a` on Hopper).
    pub fn arch(&self) -> &str {
        &self.inner.arch
    }

    /// Waits for all queued work, then reports the first data-dependent error
    /// any kernel recorded since the last check (see the module docs).
    pub fn synchronize(&self) -> Result<()> {
        self.check_errors()
    }

    /// How many times this handle has made the host wait for the stream
    /// (each download and each synchronize). Every other op only queues
    /// work, so the count across a training step shows whether the step
    /// stays on the device (the MoE layer's "sync-free" property).
    pub fn host_syncs(&self) -> u64 {
        self.inner.syncs.load(Ordering::Relaxed)
    }

    /// `(driver allocations, allocation retries)` of this handle's caching
    /// allocator so far: blocks asked of the driver, and those asked again
    /// after an out-of-memory answer emptied the cache (each retry waits
    /// for the stream and frees every cached block: a step that needs one
    /// runs near the device's memory with sizes the cache cannot reuse).
    pub fn allocator_counts(&self) -> (u64, u64) {
        self.inner.pool.driver_counts()
    }

    /// Bytes this handle's pool holds for reuse.
    pub fn cached_bytes(&self) -> usize {
        self.inner.pool.cached_bytes()
    }

    /// `(in use, peak in use)`: bytes of device memory held by live tensors
    /// and scratch buffers now, and at most since the last
    /// [`Cuda::reset_peak_memory`] (the caching allocator's cache excluded).
    pub fn memory_in_use(&self) -> (usize, usize) {
        self.inner.pool.usage()
    }

    /// Records a timing event on the compute stream: it completes once
    /// everything queued before it has, without the host waiting. Two marks
    /// around queued work time it on the device's own clock (what
    /// `torch.cuda.Event` pairs measure).
    pub fn mark(&self) -> Result<StreamMark> {
        self.bind()?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = self
            .inner
            .ctx
            .new_event(timing)
            .map_err(|e| driver_err("creating a timing event", e))?;
        event
            .record(&self.inner.stream)
            .map_err(|e| driver_err("recording a timing event", e))?;
        Ok(StreamMark(event))
    }

    /// Starts a new peak-memory measurement from the current use.
    pub fn reset_peak_memory(&self) {
        self.inner.pool.reset_peak()
    }

    /// Makes the device's context current on this thread: raw driver calls
    /// (copies, memsets) need it, and tests call from many threads.
    pub(crate) fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the CUDA context", e))
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.inner.pool
    }

    pub(crate) fn capture_uploads(&self) -> &graph::CaptureUploads {
        &self.inner.capture_uploads
    }

    /// A kernel of `m`, compiling the module on first use.
    pub(crate) fn func(&self, m: Module, name: &str) -> Result<CudaFunction> {
        compile::module(&self.inner.ctx, &self.inner.arch, m)?.function(m.name, name)
    }

    /// Kernel `name` of module `m`, allowed `dynamic_smem` bytes of dynamic
    /// shared memory: past 48 KiB a kernel must opt in before its launch.
    pub(crate) fn func_smem(
        &self,
        m: Module,
        name: &str,
        dynamic_smem: u32,
    ) -> Result<CudaFunction> {
        let f = self.func(m, name)?;
        if dynamic_smem > 48 << 10 {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_smem as i32,
            )
            .map_err(|e| launch_err(&f, e))?;
        }
        Ok(f)
    }

    /// An uninitialised tensor of `shape` and `dtype`; `op` names the caller
    /// in an out-of-memory error.
    pub(crate) fn alloc(&self, op: &str, shape: &[usize], dtype: DType) -> Result<Tensor<Self>> {
        let len: usize = shape.iter().product();
        let bytes = len * dtype_size(dtype);
        let block = self.inner.pool.alloc(
            bytes,
            &format!("{op}: a {dtype:?} tensor of shape {shape:?}"),
        )?;
        Tensor::from_storage(
            CudaStorage {
                block: Arc::new(block),
                dtype,
                len,
            },
            shape,
        )
    }

    /// Scratch device memory of `bytes` (returned to the pool on drop).
    pub(crate) fn scratch(&self, op: &str, bytes: usize) -> Result<Block> {
        self.inner.pool.alloc(bytes, &format!("{op}: scratch"))
    }

    /// Queues a copy of `bytes` from device address `src` to `dst`.
    pub(crate) fn copy_bytes(&self, op: &str, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream().cu_stream()) }
            .map_err(|e| driver_err(op, e))
    }

    /// Makes `t`'s storage unshared before an in-place write: a tensor whose
    /// buffer another clone still holds gets a private copy first.
    pub(crate) fn make_unique(&self, op: &str, t: &mut Tensor<Self>) -> Result<()> {
        if Arc::strong_count(&t.storage().block) == 1 {
            return Ok(());
        }
        let copy = self.alloc(op, t.shape(), t.dtype())?;
        let bytes = t.numel() * dtype_size(t.dtype());
        self.copy_bytes(op, copy.storage().ptr(), t.storage().ptr(), bytes)?;
        *t = copy;
        Ok(())
    }

    /// Registers a device-side check: the returned code is passed to the
    /// kernel with [`Cuda::err_ptr`]; if the kernel reports it, `build` turns
    /// the recorded index and value into the error returned at the next read.
    pub(crate) fn check(
        &self,
        build: impl Fn(i64, f64) -> KernelError + Send + 'static,
    ) -> Result<u32> {
        let full = self.checks().pending.len() >= MAX_PENDING_CHECKS;
        if full {
            self.check_errors()?;
        }
        let mut c = self.checks();
        c.next = c.next.wrapping_add(1).max(1);
        let code = c.next;
        c.pending.insert(code, Box::new(build));
        Ok(code)
    }

    /// The device address of the error record, for kernels that check data.
    pub(crate) fn err_ptr(&self) -> u64 {
        self.inner.err.ptr()
    }

    fn checks(&self) -> std::sync::MutexGuard<'_, Checks> {
        self.inner.checks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Synchronises the stream and turns a recorded failure into its error
    /// (clearing the record and the table of checks either way).
    fn check_errors(&self) -> Result<()> {
        self.bind()?;
        let mut rec = [0u64; 3];
        unsafe { drv::memcpy_dtoh_async(&mut rec, self.err_ptr(), self.stream().cu_stream()) }
            .map_err(|e| driver_err("reading the error record", e))?;
        self.inner.syncs.fetch_add(1, Ordering::Relaxed);
        self.stream()
            .synchronize()
            .map_err(|e| driver_err("synchronising the stream", e))?;
        let code = (rec[0] & 0xffff_ffff) as u32;
        let pending = std::mem::take(&mut self.checks().pending);
        if code == 0 {
            return Ok(());
        }
        unsafe { drv::memset_d8_async(self.err_ptr(), 0, 24, self.stream().cu_stream()) }
            .map_err(|e| driver_err("clearing the error record", e))?;
        let (index, value) = (rec[1] as i64, f64::from_bits(rec[2]));
        Err(match pending.get(&code) {
            Some(build) => build(index, value),
            None => KernelError::DeviceUnavailable {
                device: "cuda",
                reason: format!(
                    "a kernel reported unknown check {code} (index {index}, value {value})"
                ),
            },
        })
    }

    /// Launches the grid-stride `cast_<from>_<to>` kernel.
    fn cast_into(&self, src: &Tensor<Self>, dst: &Tensor<Self>) -> Result<()> {
        let n = src.numel();
        if n == 0 {
            return Ok(());
        }
        let name = format!("cast_{}_{}", any_sfx(src.dtype()), any_sfx(dst.dtype()));
        let f = self.func(compile::ELEMENTWISE, &name)?;
        launch!(
            self,
            f,
            grid_for(n),
            src.storage().ptr(),
            dst.storage().ptr(),
            n as i64
        )
    }
}

impl Device for Cuda {
    const NAME: &'static str = "cuda";
    type Storage = CudaStorage;

    fn memory_in_use(&self) -> (usize, usize) {
        self.inner.pool.usage()
    }

    fn reset_peak_memory(&self) {
        self.inner.pool.reset_peak()
    }

    fn memory_available(&self) -> Option<u64> {
        self.bind().ok()?;
        let (free, _) = cudarc::driver::result::mem_get_info().ok()?;
        Some((free + self.inner.pool.cached_bytes()) as u64)
    }

    fn upload(&self, data: HostData, shape: &[usize]) -> Result<Tensor<Self>> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(crate::error::shape_err(
                "upload",
                format!(
                    "shape {shape:?} holds {n} elements, the data has {}",
                    data.len()
                ),
            ));
        }
        let t = self.alloc("upload", shape, data.dtype())?;
        self.bind()?;
        let (dst, cu) = (t.storage().ptr(), self.stream().cu_stream());
        if n == 0 {
            return Ok(t);
        }
        let (src, bytes) = match &data {
            HostData::F32(v) => (v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])),
            HostData::F64(v) => (v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])),
            HostData::I32(v) => (v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])),
        };
        // From pageable memory the driver stages the data before returning,
        // so `data` may be dropped as soon as the call is back. A graph being
        // captured would record the pageable address instead: its copy reads
        // a pinned buffer the graph keeps.
        let src = self
            .stage_upload(src, bytes)?
            .map_or(src, |p| p as *const u8);
        // SAFETY: `src` holds `bytes` bytes until the call is back (pageable)
        // or as long as the graph that reads it (pinned).
        let host = unsafe { std::slice::from_raw_parts(src, bytes) };
        unsafe { drv::memcpy_htod_async(dst, host, cu) }.map_err(|e| driver_err("upload", e))?;
        Ok(t)
    }

    /// Reads back after all queued work; a bf16 tensor comes back as F32
    /// (exact), since the host side has no bf16 type. Returns any
    /// data-dependent error recorded since the last read instead.
    fn download(&self, t: &Tensor<Self>) -> Result<HostData> {
        self.bind()?;
        let (src, cu, n) = (t.storage().ptr(), self.stream().cu_stream(), t.numel());
        let copy =
            |r: std::result::Result<(), drv::DriverError>| r.map_err(|e| driver_err("download", e));
        let out = match t.dtype() {
            DType::F32 => {
                let mut v = vec![0f32; n];
                if n > 0 {
                    copy(unsafe { drv::memcpy_dtoh_async(&mut v, src, cu) })?;
                }
                self.check_errors()?;
                HostData::F32(v)
            }
            DType::F64 => {
                let mut v = vec![0f64; n];
                if n > 0 {
                    copy(unsafe { drv::memcpy_dtoh_async(&mut v, src, cu) })?;
                }
                self.check_errors()?;
                HostData::F64(v)
            }
            DType::I32 => {
                let mut v = vec![0i32; n];
                if n > 0 {
                    copy(unsafe { drv::memcpy_dtoh_async(&mut v, src, cu) })?;
                }
                self.check_errors()?;
                HostData::I32(v)
            }
            DType::BF16 => {
                let mut v = vec![0u16; n];
                if n > 0 {
                    copy(unsafe { drv::memcpy_dtoh_async(&mut v, src, cu) })?;
                }
                self.check_errors()?;
                HostData::F32(
                    v.iter()
                        .map(|&b| half::bf16::from_bits(b).to_f32())
                        .collect(),
                )
            }
        };
        Ok(out)
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor<Self>> {
        let t = self.alloc("zeros", shape, dtype)?;
        let bytes = t.numel() * dtype_size(dtype);
        self.bind()?;
        if bytes > 0 {
            // All-zero bits are 0 in every dtype here.
            unsafe { drv::memset_d8_async(t.storage().ptr(), 0, bytes, self.stream().cu_stream()) }
                .map_err(|e| driver_err("zeros", e))?;
        }
        Ok(t)
    }

    fn cast(&self, t: &Tensor<Self>, dtype: DType) -> Result<Tensor<Self>> {
        let out = self.alloc("cast", t.shape(), dtype)?;
        self.cast_into(t, &out)?;
        Ok(out)
    }

    // Row ranges and concatenations are device-to-device copies: the
    // distributed optimizer cuts and joins every gradient and parameter of
    // the model each step, which the host round trip of the provided
    // methods made take tens of seconds on a billion-parameter model.
    fn narrow(&self, t: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        let shape = crate::backend::narrow_shape(t.shape(), start, len)?;
        let out = self.alloc("narrow", &shape, t.dtype())?;
        let row: usize = shape[1..].iter().product::<usize>() * dtype_size(t.dtype());
        self.copy_bytes(
            "narrow",
            out.storage().ptr(),
            t.storage().ptr() + (start * row) as u64,
            len * row,
        )?;
        Ok(out)
    }

    fn concat(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let (shape, dtype) = crate::backend::concat_shape(parts)?;
        let out = self.alloc("concat", &shape, dtype)?;
        let mut at = out.storage().ptr();
        for p in parts {
            let bytes = p.numel() * dtype_size(dtype);
            self.copy_bytes("concat", at, p.storage().ptr(), bytes)?;
            at += bytes as u64;
        }
        Ok(out)
    }
}

/// The CUDA device (ordinal 0) of a test that needs a GPU, here or in a crate
/// built on the kernels. Such a test is marked
/// `#[cfg_attr(not(foldmoe_gpu_tests), ignore = "needs a CUDA GPU: ...")]`:
/// reported as ignored in a plain `cargo test`, it runs in a build with
/// `RUSTFLAGS='--cfg foldmoe_gpu_tests'` (or with `--ignored`), where a
/// missing GPU fails the test, naming why, rather than passing silently.
pub fn require_test_device() -> Cuda {
    Cuda::new(0).unwrap_or_else(|e| {
        if cfg!(foldmoe_gpu_tests) {
            panic!("foldmoe_gpu_tests is set but no CUDA device was found: {e}")
        } else {
            panic!("this test needs a CUDA GPU, and no CUDA device was found: {e}")
        }
    })
}

/// [`require_test_device`] for the tests of the sm_90a (TMA + wgmma)
/// kernels: `None`, saying so, on a device of another architecture.
#[cfg(test)]
pub(crate) fn require_sm90_test_device() -> Option<Cuda> {
    let d = require_test_device();
    if d.arch() != "sm_90a" {
        eprintln!("skipping: {} is not sm_90a", d.arch());
        return None;
    }
    Some(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver (CI) the error names what is missing; with a GPU
    /// (the device machine) the handle opens and names its architecture.
    #[test]
    fn cuda_opens_or_names_what_is_missing() {
        match Cuda::new(0) {
            Ok(d) => assert!(d.arch().starts_with("sm_"), "{d:?}"),
            Err(KernelError::DeviceUnavailable {
                device: "cuda",
                reason,
            }) => {
                assert!(
                    reason.contains("not found")
                        || reason.contains("no GPU")
                        || reason.contains("driver"),
                    "{reason}"
                )
            }
            Err(e) => panic!("{e:?}"),
        }
    }

    /// Programmatic dependent launches change when a kernel's blocks start,
    /// never what they read or overwrite: a chain of dependent kernels
    /// (in-place updates, each reading the last one's output; a wgmma
    /// grouped GEMM between small kernels, its input rewritten right after)
    /// gives the same bits with them as without.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn programmatic_launches_keep_every_dependency() {
        use crate::backend::{ElementwiseOps, LinalgOps};
        let probe = require_test_device();
        if !probe.inner.programmatic_capable {
            eprintln!(
                "skipping: {} has no programmatic launches (sm_90+)",
                probe.arch()
            );
            return;
        }
        let (m, k, g, n) = (1000, 256, 5, 384);
        let values = |len: usize, seed: u32| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 20) as f32 / 4096.0
                        - 0.5
                })
                .collect()
        };
        let run = |programmatic: bool| -> Vec<HostData> {
            let d = require_test_device();
            d.set_programmatic(programmatic);
            let x = d.upload(HostData::F32(values(m * k, 1)), &[m, k]).unwrap();
            let mut y = d.upload(HostData::F32(values(m * k, 2)), &[m, k]).unwrap();
            for _ in 0..200 {
                y = d.add(&y, &x).unwrap();
                d.axpy(&mut y, -0.5, &x).unwrap();
                y = d.scale(&y, 0.999).unwrap();
            }
            let sizes = d
                .upload(HostData::I32(vec![300, 0, 17, 600, 83]), &[g])
                .unwrap();
            let w = d
                .cast(
                    &d.upload(HostData::F32(values(g * k * n, 3)), &[g, k, n])
                        .unwrap(),
                    DType::BF16,
                )
                .unwrap();
            let mut a = d.cast(&y, DType::BF16).unwrap();
            let xb = d.cast(&x, DType::BF16).unwrap();
            let mut outs = Vec::new();
            for _ in 0..4 {
                let o = d.grouped_matmul(&a, &w, &sizes, false).unwrap();
                // The product's input is rewritten at once (its last reader
                // must be done) and its output read at once.
                d.axpy(&mut a, 0.25, &xb).unwrap();
                outs.push(d.add(&o, &o).unwrap());
            }
            let mut host: Vec<HostData> = outs.iter().map(|o| d.download(o).unwrap()).collect();
            host.push(d.download(&y).unwrap());
            host.push(d.download(&a).unwrap());
            host
        };
        let ordinary = run(false);
        let programmatic = run(true);
        assert_eq!(ordinary.len(), programmatic.len());
        for (i, (a, b)) in ordinary.iter().zip(&programmatic).enumerate() {
            assert!(a == b, "output {i} differs under programmatic launches");
        }
    }

    #[test]
    fn out_of_range_ordinal_is_named() {
        if let Err(KernelError::DeviceUnavailable { reason, .. }) = Cuda::new(1000) {
            assert!(!reason.is_empty());
        }
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn upload_download_roundtrip_every_dtype() {
        let d = require_test_device();
        let f = d
            .upload(HostData::F32(vec![1.5, -2.0, 3.25]), &[3])
            .unwrap();
        assert_eq!(
            d.download(&f).unwrap(),
            HostData::F32(vec![1.5, -2.0, 3.25])
        );
        let g = d.upload(HostData::F64(vec![0.1; 4]), &[2, 2]).unwrap();
        assert_eq!(d.download(&g).unwrap(), HostData::F64(vec![0.1; 4]));
        let i = d.upload(HostData::I32(vec![-1, 7]), &[2]).unwrap();
        assert_eq!(d.download(&i).unwrap(), HostData::I32(vec![-1, 7]));
        let z = d.zeros(&[2, 3], DType::BF16).unwrap();
        assert_eq!(d.download(&z).unwrap(), HostData::F32(vec![0.0; 6]));
        let e = d.upload(HostData::F32(vec![]), &[0, 4]).unwrap();
        assert_eq!(d.download(&e).unwrap(), HostData::F32(vec![]));
        assert!(d.upload(HostData::F32(vec![1.0]), &[2]).is_err());
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn cast_rounds_and_truncates_like_the_cpu() {
        use crate::cpu::Cpu;
        let d = require_test_device();
        let x = vec![
            1.0 + 2f64.powi(-8) + 2f64.powi(-30),
            -2.7,
            3e9,
            f64::NAN,
            1e-40,
            -0.5,
        ];
        for to in [DType::F32, DType::I32, DType::F64] {
            let c = Cpu
                .cast(&Cpu.upload(HostData::F64(x.clone()), &[6]).unwrap(), to)
                .unwrap();
            let g = d
                .cast(&d.upload(HostData::F64(x.clone()), &[6]).unwrap(), to)
                .unwrap();
            let (c, g) = (
                Cpu.download(&c).unwrap().to_f64(),
                d.download(&g).unwrap().to_f64(),
            );
            for (a, b) in c.iter().zip(&g) {
                assert!(
                    a == b || (a.is_nan() && b.is_nan()),
                    "{to:?}: cpu {c:?} cuda {g:?}"
                );
            }
        }
        // To bf16 and back: nearest-even, as half's conversion.
        let v: Vec<f32> = vec![
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -7.3,
            65504.0,
        ];
        let b = d
            .cast(
                &d.upload(HostData::F32(v.clone()), &[4]).unwrap(),
                DType::BF16,
            )
            .unwrap();
        let back = d.download(&b).unwrap().to_f32();
        let want: Vec<f32> = v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect();
        assert_eq!(back, want);
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn clones_keep_value_semantics_under_in_place_ops() {
        use crate::backend::ElementwiseOps;
        let d = require_test_device();
        let mut y = d.upload(HostData::F32(vec![1.0, 2.0]), &[2]).unwrap();
        let keep = y.clone();
        let x = d.upload(HostData::F32(vec![10.0, 10.0]), &[2]).unwrap();
        d.axpy(&mut y, 1.0, &x).unwrap();
        assert_eq!(d.download(&y).unwrap(), HostData::F32(vec![11.0, 12.0]));
        assert_eq!(d.download(&keep).unwrap(), HostData::F32(vec![1.0, 2.0]));
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn pool_reuses_freed_blocks() {
        let d = require_test_device();
        for elems in [1000usize, 3 << 20, 8 << 20] {
            let a = d.zeros(&[elems], DType::F32).unwrap();
            drop(a);
            assert!(d.cached_bytes() >= 4 * elems);
            let (allocs, _) = d.allocator_counts();
            let b = d.zeros(&[elems], DType::F32).unwrap();
            assert_eq!(
                d.allocator_counts().0,
                allocs,
                "{elems} elements again must come from the cache"
            );
            // Two halves fit where the whole was freed.
            drop(b);
            let halves = [
                d.zeros(&[elems / 2], DType::F32).unwrap(),
                d.zeros(&[elems / 2], DType::F32).unwrap(),
            ];
            assert_eq!(d.allocator_counts().0, allocs, "{elems} / 2, twice");
            drop(halves);
        }
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn out_of_memory_names_the_request_and_what_was_free() {
        let d = require_test_device();
        // 2^40 f32 elements: 4 TiB, more than any GPU has.
        let err = d.zeros(&[1 << 20, 1 << 20], DType::F32).err().unwrap();
        assert!(
            matches!(err, crate::KernelError::OutOfMemory { .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("4.00 TiB = 4398046511104 bytes"), "{msg}");
        assert!(msg.contains("free of"), "{msg}");
        // The failure leaves the device usable, and the peak counts only
        // what was handed out.
        d.reset_peak_memory();
        let a = d.zeros(&[1 << 20], DType::F32).unwrap();
        let (in_use, peak) = d.memory_in_use();
        assert!(in_use >= 4 << 20 && peak >= in_use, "{in_use} {peak}");
        drop(a);
        assert!(d.memory_in_use().0 < in_use);
    }

    /// Rough timings of the kernels at Qwen3-30B-A3B's sizes, as a baseline
    /// for faster versions (ignored: run with `--ignored` on a
    /// GPU; host clock around a synchronised run, after a warm-up).
    #[test]
    #[ignore]
    fn baseline_timings() {
        use crate::backend::{AttentionOps, ElementwiseOps, LinalgOps};
        let d = require_test_device();
        let bf16 = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
                .collect();
            d.cast(&d.upload(HostData::F32(v), shape).unwrap(), DType::BF16)
                .unwrap()
        };
        let time = |what: &str, flop: f64, f: &dyn Fn()| {
            f();
            d.synchronize().unwrap();
            let t0 = std::time::Instant::now();
            let reps = 3;
            for _ in 0..reps {
                f();
            }
            d.synchronize().unwrap();
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!("{what}: {:.3} ms, {:.1} TFLOP/s", s * 1e3, flop / s / 1e12);
        };
        let (t, h, e, k, f) = (16384usize, 2048usize, 128usize, 8usize, 768usize);
        let a = bf16(&[t, h]);
        let w = bf16(&[h, f]);
        time(
            "cuBLAS bf16 matmul 16384x2048x768",
            2.0 * (t * h * f) as f64,
            &|| {
                d.matmul(&a, &w, false, false).unwrap();
            },
        );
        let n = t * k;
        let x = bf16(&[n, h]);
        let wg = bf16(&[e, h, f]);
        let sizes = d
            .upload(HostData::I32(vec![(n / e) as i32; e]), &[e])
            .unwrap();
        time(
            "grouped_matmul bf16 (default kernel: wgmma on sm_90a, else mma.sync) 131072x2048x768, 128 groups",
            2.0 * (n * h * f) as f64,
            &|| {
                d.grouped_matmul(&x, &wg, &sizes, false).unwrap();
            },
        );
        let dy = bf16(&[n, f]);
        time(
            "grouped_matmul bf16 trans_w (default kernel) 131072x768x2048, 128 groups",
            2.0 * (n * h * f) as f64,
            &|| {
                d.grouped_matmul(&dy, &wg, &sizes, true).unwrap();
            },
        );
        time(
            "grouped_matmul_weight_grad bf16 (default kernel) 128x2048x768 over 131072 rows",
            2.0 * (n * h * f) as f64,
            &|| {
                d.grouped_matmul_weight_grad(&x, &dy, &sizes).unwrap();
            },
        );
        // Rates count the causal half of the products (useful work).
        let (b, s, hq, hkv, hd) = (4usize, 4096usize, 32usize, 4usize, 128usize);
        let q = bf16(&[b, s, hq, hd]);
        let kv = bf16(&[b, s, hkv, hd]);
        let causal = 2.0 * (b * hq * s * s * hd) as f64;
        time(
            "attention bf16 fwd (flash; FOLDMOE_ATTENTION=cublas: cuBLAS) B=4 S=4096 Hq=32 Hkv=4 Hd=128",
            causal,
            &|| {
                d.attention(&q, &kv, &kv, None).unwrap();
            },
        );
        let (o, lse) = d.attention(&q, &kv, &kv, None).unwrap();
        time(
            "attention bf16 bwd (flash; FOLDMOE_ATTENTION=cublas: cuBLAS) B=4 S=4096 Hq=32 Hkv=4 Hd=128",
            2.0 * causal,
            &|| {
                d.attention_backward(&q, &q, &kv, &kv, &o, &lse, None).unwrap();
            },
        );
        let y = bf16(&[t, h]);
        time("swiglu bf16 16384x2048", 0.0, &|| {
            d.swiglu(&y, &y).unwrap();
        });
    }
}
