//! A caching allocator: freed blocks go back to a pool keyed by their
//! (rounded) byte size, so a training step that allocates the same shapes
//! every iteration stops calling the driver after the first one.
//!
//! All work runs on one stream, so a block freed on the host while kernels
//! that use it are still queued can be handed to the next op at once: that op
//! is queued behind them (the same rule as PyTorch's caching allocator).
//! NCCL's communication stream (`nccl.rs`) keeps the rule: the compute stream
//! waits for each of its calls before the work queued after the call.
//!
//! A CUDA graph replays its captured work on the addresses the capture used,
//! long after the host freed them, so blocks freed while a graph is being
//! captured are not returned to the pool: the capture may reuse them (its
//! work is ordered like the stream's), and then the graph holds them
//! ([`GraphBlocks`]) until it is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys, CudaContext, CudaStream};

use crate::error::{KernelError, Result};

/// Blocks below this are rounded up to a multiple of [`SMALL_ROUND`] bytes,
/// larger ones to a multiple of [`LARGE_ROUND`], so nearby sizes share a key
/// without wasting more than a few percent.
const SMALL_LIMIT: usize = 1 << 20;
const SMALL_ROUND: usize = 512;
const LARGE_ROUND: usize = 2 << 20;

/// The byte size a request of `bytes` is served with.
pub(crate) fn round_size(bytes: usize) -> usize {
    if bytes <= SMALL_LIMIT {
        bytes.div_ceil(SMALL_ROUND) * SMALL_ROUND
    } else {
        bytes.div_ceil(LARGE_ROUND) * LARGE_ROUND
    }
}

/// Free blocks by rounded size, plus what the pool holds in total.
#[derive(Default)]
struct Cache {
    free: HashMap<usize, Vec<sys::CUdeviceptr>>,
    cached_bytes: usize,
    /// Bytes held by live blocks (rounded sizes).
    in_use: usize,
    /// The highest `in_use` since the last [`Pool::reset_peak`].
    peak_in_use: usize,
    /// While a graph is being captured: the blocks freed since it began, by
    /// rounded size. They stay counted in `in_use` (the graph's memory).
    capture: Option<HashMap<usize, Vec<sys::CUdeviceptr>>>,
    /// Blocks asked of the driver so far (none once a step's sizes are
    /// cached).
    driver_allocs: u64,
    /// Driver allocations that failed for memory, after which the cache
    /// was emptied (a stream wait and a free of every cached block) and the
    /// allocation tried again: PyTorch's `num_alloc_retries`.
    alloc_retries: u64,
}

impl Cache {
    fn hand_out(&mut self, size: usize) {
        self.in_use += size;
        self.peak_in_use = self.peak_in_use.max(self.in_use);
    }
}

/// The pool of one device handle: its context, its stream and the cache.
pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cache: Mutex<Cache>,
}

/// Device memory owned by a tensor (or a scratch buffer); dropping it returns
/// the memory to its pool, not to the driver.
pub(crate) struct Block {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    pool: Arc<Pool>,
}

impl Block {
    /// The device address (0 for an empty block).
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let mut c = self.pool.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(held) = &mut c.capture {
            held.entry(self.bytes).or_default().push(self.ptr);
            return;
        }
        c.free.entry(self.bytes).or_default().push(self.ptr);
        c.cached_bytes += self.bytes;
        c.in_use -= self.bytes;
    }
}

/// The blocks a captured CUDA graph reads and writes that no tensor owns any
/// more: back to the pool when the graph is dropped (work queued after that
/// runs after its replays, on the same stream).
pub(crate) struct GraphBlocks {
    blocks: Vec<(usize, sys::CUdeviceptr)>,
    pool: Arc<Pool>,
}

impl GraphBlocks {
    /// Bytes the graph holds.
    pub(crate) fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.0).sum()
    }
}

impl Drop for GraphBlocks {
    fn drop(&mut self) {
        let mut c = self.pool.cache.lock().unwrap_or_else(|p| p.into_inner());
        for (size, ptr) in self.blocks.drain(..) {
            c.free.entry(size).or_default().push(ptr);
            c.cached_bytes += size;
            c.in_use -= size;
        }
    }
}

impl Pool {
    /// An empty pool allocating in `ctx` for work on `stream`.
    pub(crate) fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Arc<Self> {
        Arc::new(Pool {
            ctx,
            stream,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// A block of at least `bytes` bytes (contents undefined); `what` names the
    /// op and tensor in an out-of-memory error.
    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize, what: &str) -> Result<Block> {
        if bytes == 0 {
            return Ok(Block {
                ptr: 0,
                bytes: 0,
                pool: self.clone(),
            });
        }
        let size = round_size(bytes);
        {
            let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            // A block the capture freed is still counted in use.
            if let Some(ptr) = c
                .capture
                .as_mut()
                .and_then(|held| held.get_mut(&size))
                .and_then(Vec::pop)
            {
                return Ok(Block {
                    ptr,
                    bytes: size,
                    pool: self.clone(),
                });
            }
            if let Some(ptr) = c.free.get_mut(&size).and_then(Vec::pop) {
                c.cached_bytes -= size;
                c.hand_out(size);
                return Ok(Block {
                    ptr,
                    bytes: size,
                    pool: self.clone(),
                });
            }
        }
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .driver_allocs += 1;
        let ptr = match self.driver_alloc(size) {
            Ok(p) => p,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                // Cached blocks of other sizes may be what is missing: give
                // them back to the driver and try once more (not during a
                // graph capture, where the stream cannot be waited for).
                let cached = self.cached_bytes();
                if self.capturing() {
                    return Err(self.oom_error(bytes, size, what, cached));
                }
                self.cache
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .alloc_retries += 1;
                self.release_cached()?;
                self.driver_alloc(size)
                    .map_err(|_| self.oom_error(bytes, size, what, cached))?
            }
            Err(e) => return Err(driver_err(what, e)),
        };
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .hand_out(size);
        Ok(Block {
            ptr,
            bytes: size,
            pool: self.clone(),
        })
    }

    fn driver_alloc(&self, size: usize) -> std::result::Result<u64, drv::DriverError> {
        self.ctx.bind_to_thread()?;
        unsafe { drv::malloc_sync(size) }
    }

    /// Frees every cached block, after the stream has finished with them.
    pub(crate) fn release_cached(&self) -> Result<()> {
        let blocks: Vec<u64> = {
            let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            c.cached_bytes = 0;
            c.free.drain().flat_map(|(_, v)| v).collect()
        };
        if blocks.is_empty() {
            return Ok(());
        }
        self.stream
            .synchronize()
            .map_err(|e| driver_err("release cached memory", e))?;
        for p in blocks {
            unsafe { drv::free_sync(p) }.map_err(|e| driver_err("release cached memory", e))?;
        }
        Ok(())
    }

    /// Bytes held in the cache (free for this device handle, not for others).
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cached_bytes
    }

    /// `(in use, peak in use)` bytes of live blocks: what the run needs,
    /// cache excluded.
    pub(crate) fn usage(&self) -> (usize, usize) {
        let c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        (c.in_use, c.peak_in_use)
    }

    /// `(driver allocations, allocation retries)` so far: see
    /// [`Cache::driver_allocs`] and [`Cache::alloc_retries`].
    pub(crate) fn driver_counts(&self) -> (u64, u64) {
        let c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        (c.driver_allocs, c.alloc_retries)
    }

    /// Holds the blocks freed from now on for a graph being captured; an
    /// error if a capture is already under way on this pool.
    pub(crate) fn begin_capture(&self) -> Result<()> {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if c.capture.is_some() {
            return Err(KernelError::DeviceUnavailable {
                device: "cuda",
                reason: "a CUDA graph capture began while another was under way on the same \
                         device handle"
                    .into(),
            });
        }
        c.capture = Some(HashMap::new());
        Ok(())
    }

    /// Ends [`Pool::begin_capture`]: the blocks freed during the capture,
    /// for the graph to hold.
    pub(crate) fn end_capture(self: &Arc<Self>) -> GraphBlocks {
        let held = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .capture
            .take()
            .unwrap_or_default();
        GraphBlocks {
            blocks: held
                .into_iter()
                .flat_map(|(size, ptrs)| ptrs.into_iter().map(move |p| (size, p)))
                .collect(),
            pool: self.clone(),
        }
    }

    /// Whether a graph is being captured on this pool's stream.
    pub(crate) fn capturing(&self) -> bool {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .capture
            .is_some()
    }

    /// Starts a new peak measurement from the current use.
    pub(crate) fn reset_peak(&self) {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        c.peak_in_use = c.in_use;
    }

    fn oom_error(&self, bytes: usize, size: usize, what: &str, cached: usize) -> KernelError {
        let (free, total) = drv::mem_get_info().unwrap_or((0, 0));
        KernelError::OutOfMemory {
            device: "cuda",
            what: format!("{what} ({size} bytes with rounding)"),
            requested: bytes,
            free,
            total,
            cached,
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Best effort: a failure here has nowhere to go, and the driver frees
        // everything at process exit anyway.
        let _ = self.release_cached();
    }
}

/// A driver error during `what`, as the crate's error.
pub(crate) fn driver_err(what: &str, e: drv::DriverError) -> KernelError {
    KernelError::DeviceUnavailable {
        device: "cuda",
        reason: format!("{what}: CUDA driver error {e:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_to_shared_keys() {
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(round_size(SMALL_LIMIT), SMALL_LIMIT);
        assert_eq!(round_size(SMALL_LIMIT + 1), LARGE_ROUND);
        assert_eq!(round_size(5 << 20), 6 << 20);
    }
}
