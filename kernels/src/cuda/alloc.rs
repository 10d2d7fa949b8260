//! A caching allocator: memory comes from the driver in segments, and
//! blocks are cut from them best-fit, split, and merged with their free
//! neighbours when freed (PyTorch's design: small requests from 2 MiB
//! segments, large ones from their own), so a training step stops calling
//! the driver after the first one, and sizes that peak at different times
//! share memory instead of each keeping its own blocks (a cache keyed by
//! exact size holds the sum of every size's peak, which on a card near full
//! failed allocations each step, emptied the cache and waited for the
//! stream).
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

use std::collections::{BTreeMap, BTreeSet, HashMap};
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

/// Requests up to [`SMALL_LIMIT`] are cut from segments of this size.
const SMALL_SEGMENT: usize = 2 << 20;
/// Large requests below this get a segment of [`MID_SEGMENT`] bytes (room
/// for a few of them); larger ones a segment of their own size.
const MID_LIMIT: usize = 10 << 20;
const MID_SEGMENT: usize = 20 << 20;

/// One block of a segment: its size, its segment's base, whether free.
#[derive(Clone, Copy, Debug)]
struct Span {
    size: usize,
    segment: u64,
    free: bool,
}

/// The blocks of some segments of device memory: every block by address,
/// the free ones by `(size, address)` for best fit, the segments' sizes.
/// Addresses only: the driver calls are the [`Pool`]'s.
#[derive(Default)]
struct Arena {
    blocks: BTreeMap<u64, Span>,
    free: BTreeSet<(usize, u64)>,
    segments: BTreeMap<u64, usize>,
    free_bytes: usize,
}

impl Arena {
    /// A new segment `[base, base + size)`, one free block.
    fn add_segment(&mut self, base: u64, size: usize) {
        self.segments.insert(base, size);
        self.blocks.insert(
            base,
            Span {
                size,
                segment: base,
                free: true,
            },
        );
        self.free.insert((size, base));
        self.free_bytes += size;
    }

    /// The smallest free block of at least `size` bytes (the lowest address
    /// among equals), cut to `size` with the rest left free: `(address,
    /// size)`; `None` if no free block is that large.
    fn take(&mut self, size: usize) -> Option<(u64, usize)> {
        let &(have, addr) = self.free.range((size, 0)..).next()?;
        self.free.remove(&(have, addr));
        self.free_bytes -= have;
        let span = self.blocks.get_mut(&addr)?;
        span.free = false;
        span.size = size;
        let segment = span.segment;
        if have > size {
            let rest = addr + size as u64;
            self.blocks.insert(
                rest,
                Span {
                    size: have - size,
                    segment,
                    free: true,
                },
            );
            self.free.insert((have - size, rest));
            self.free_bytes += have - size;
        }
        Some((addr, size))
    }

    /// Frees the block at `addr` (from [`Arena::take`]), merged with free
    /// neighbours of its segment; returns its size (0 if `addr` is no
    /// block taken from this arena).
    fn give_back(&mut self, addr: u64) -> usize {
        let Some(span) = self.blocks.get(&addr).copied().filter(|s| !s.free) else {
            return 0;
        };
        let (mut start, mut size) = (addr, span.size);
        self.free_bytes += span.size;
        let next = addr + span.size as u64;
        if let Some(n) = self.blocks.get(&next).copied() {
            if n.free && n.segment == span.segment {
                self.free.remove(&(n.size, next));
                self.blocks.remove(&next);
                size += n.size;
            }
        }
        if let Some((&prev, p)) = self.blocks.range(..addr).next_back() {
            let p = *p;
            if p.free && p.segment == span.segment && prev + p.size as u64 == addr {
                self.free.remove(&(p.size, prev));
                self.blocks.remove(&addr);
                start = prev;
                size += p.size;
            }
        }
        self.blocks.insert(
            start,
            Span {
                size,
                segment: span.segment,
                free: true,
            },
        );
        self.free.insert((size, start));
        span.size
    }

    /// Removes the segments that are wholly free and returns their bases,
    /// for the driver to free.
    fn drain_free_segments(&mut self) -> Vec<u64> {
        let empty: Vec<(u64, usize)> = self
            .segments
            .iter()
            .filter(|&(base, &size)| {
                self.blocks
                    .get(base)
                    .is_some_and(|s| s.free && s.size == size)
            })
            .map(|(&b, &s)| (b, s))
            .collect();
        for &(base, size) in &empty {
            self.segments.remove(&base);
            self.blocks.remove(&base);
            self.free.remove(&(size, base));
            self.free_bytes -= size;
        }
        empty.into_iter().map(|(b, _)| b).collect()
    }
}

/// The arenas of small and large blocks, plus what the pool holds in total.
#[derive(Default)]
struct Cache {
    small: Arena,
    large: Arena,
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
    /// Driver allocations that failed for memory, after which the cache's
    /// wholly free segments were given back (a stream wait and a free of
    /// each) and the allocation tried again: PyTorch's `num_alloc_retries`.
    alloc_retries: u64,
}

impl Cache {
    /// The arena a block (or request) of `size` rounded bytes lives in.
    fn arena(&mut self, size: usize) -> &mut Arena {
        if size <= SMALL_LIMIT {
            &mut self.small
        } else {
            &mut self.large
        }
    }

    /// Bytes free in the arenas' segments.
    fn cached_bytes(&self) -> usize {
        self.small.free_bytes + self.large.free_bytes
    }

    /// Returns the block `ptr` of `size` bytes to its arena.
    fn give_back(&mut self, ptr: u64, size: usize) {
        self.arena(size).give_back(ptr);
        self.in_use -= size;
    }

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
        c.give_back(self.ptr, self.bytes);
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
            c.give_back(ptr, size);
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
            if let Some((ptr, size)) = c.arena(size).take(size) {
                c.hand_out(size);
                return Ok(Block {
                    ptr,
                    bytes: size,
                    pool: self.clone(),
                });
            }
        }
        // A new segment: a small request's 2 MiB, a mid-sized one's 20
        // MiB, a large one's own size; when the segment does not fit even
        // after the free segments are given back, the request's own size.
        let segment = if size <= SMALL_LIMIT {
            SMALL_SEGMENT
        } else if size < MID_LIMIT {
            MID_SEGMENT
        } else {
            size
        };
        let (base, segment) = self.new_segment(size, segment, bytes, what)?;
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        c.arena(size).add_segment(base, segment);
        let (ptr, size) =
            c.arena(size)
                .take(size)
                .ok_or_else(|| KernelError::DeviceUnavailable {
                    device: "cuda",
                    reason: format!(
                        "{what}: a new {segment}-byte segment could not hold {size} bytes"
                    ),
                })?;
        c.hand_out(size);
        Ok(Block {
            ptr,
            bytes: size,
            pool: self.clone(),
        })
    }

    /// `(base, size)` of a new segment from the driver: `segment` bytes,
    /// or `size` if those do not fit; on out-of-memory the cache's free
    /// segments are given back first and the allocation tried again.
    fn new_segment(
        &self,
        size: usize,
        segment: usize,
        bytes: usize,
        what: &str,
    ) -> Result<(u64, usize)> {
        // One driver allocation, counted: Ok(None) if it ran out of memory.
        let attempt = |want: usize, retry: bool| -> Result<Option<u64>> {
            {
                let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
                c.driver_allocs += 1;
                c.alloc_retries += u64::from(retry);
            }
            match self.driver_alloc(want) {
                Ok(p) => Ok(Some(p)),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Ok(None),
                Err(e) => Err(driver_err(what, e)),
            }
        };
        let tries = if segment > size {
            vec![segment, size]
        } else {
            vec![size]
        };
        for want in tries {
            if let Some(p) = attempt(want, false)? {
                return Ok((p, want));
            }
            // Free segments may be what is missing: give them back to the
            // driver and try once more (not during a graph capture, where
            // the stream cannot be waited for).
            if self.capturing() || self.release_cached()? == 0 {
                continue;
            }
            if let Some(p) = attempt(want, true)? {
                return Ok((p, want));
            }
        }
        Err(self.oom_error(bytes, size, what, self.cached_bytes()))
    }

    fn driver_alloc(&self, size: usize) -> std::result::Result<u64, drv::DriverError> {
        self.ctx.bind_to_thread()?;
        unsafe { drv::malloc_sync(size) }
    }

    /// Gives every wholly free segment back to the driver, after the
    /// stream has finished with them; returns how many.
    pub(crate) fn release_cached(&self) -> Result<usize> {
        let blocks: Vec<u64> = {
            let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            let mut v = c.small.drain_free_segments();
            v.extend(c.large.drain_free_segments());
            v
        };
        if blocks.is_empty() {
            return Ok(0);
        }
        let n = blocks.len();
        self.stream
            .synchronize()
            .map_err(|e| driver_err("release cached memory", e))?;
        for p in blocks {
            unsafe { drv::free_sync(p) }.map_err(|e| driver_err("release cached memory", e))?;
        }
        Ok(n)
    }

    /// Bytes held in the cache (free for this device handle, not for others).
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cached_bytes()
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

    /// Every block of `a` in address order, as `(address, size, free)`.
    fn layout(a: &Arena) -> Vec<(u64, usize, bool)> {
        a.blocks.iter().map(|(&p, s)| (p, s.size, s.free)).collect()
    }

    /// The bookkeeping agrees with itself: blocks tile each segment
    /// without gaps, free ones are exactly those in the best-fit set, no
    /// two free neighbours are left unmerged, and the free bytes add up.
    fn check(a: &Arena) {
        for (&base, &size) in &a.segments {
            let mut at = base;
            let mut last_free = false;
            for (&p, s) in a.blocks.range(base..base + size as u64) {
                assert_eq!(p, at, "a gap in segment {base}");
                assert_eq!(s.segment, base);
                assert!(!(last_free && s.free), "unmerged free neighbours at {p}");
                assert_eq!(a.free.contains(&(s.size, p)), s.free);
                last_free = s.free;
                at += s.size as u64;
            }
            assert_eq!(at, base + size as u64, "segment {base} not tiled");
        }
        let free: usize = a.blocks.values().filter(|s| s.free).map(|s| s.size).sum();
        assert_eq!(
            (free, a.free.len()),
            (a.free_bytes, a.blocks.values().filter(|s| s.free).count())
        );
    }

    #[test]
    fn arena_cuts_best_fit_and_merges_on_free() {
        let mut a = Arena::default();
        a.add_segment(1000, 100);
        a.add_segment(5000, 40);
        // Best fit: 30 bytes from the 40-byte segment, not the 100-byte one.
        assert_eq!(a.take(30), Some((5000, 30)));
        assert_eq!(a.take(50), Some((1000, 50)));
        assert_eq!(a.take(20), Some((1050, 20)));
        check(&a);
        assert_eq!(a.take(31), None, "free: 30 at 1070 and 10 at 5030");
        assert_eq!(a.free_bytes, 40);
        // Freeing the middle block merges it with the free tail after it;
        // freeing the first merges the three into the whole segment.
        assert_eq!(a.give_back(1050), 20);
        assert_eq!(layout(&a)[..2], [(1000, 50, false), (1050, 50, true)]);
        assert_eq!(a.give_back(1050), 0, "a free block is not freed twice");
        assert_eq!(a.give_back(1000), 50);
        check(&a);
        assert_eq!(a.blocks.range(1000..1100).count(), 1);
        // Blocks never merge across segments, even adjacent ones.
        a.add_segment(1100, 60);
        assert_eq!(a.take(100), Some((1000, 100)));
        assert_eq!(a.give_back(1000), 100);
        check(&a);
        assert_eq!(a.blocks.range(1000..1160).count(), 2);
        // Only wholly free segments go back to the driver.
        assert_eq!(a.drain_free_segments(), vec![1000, 1100]);
        assert_eq!(a.give_back(5000), 30);
        assert_eq!(a.drain_free_segments(), vec![5000]);
        assert!(a.blocks.is_empty() && a.free.is_empty() && a.free_bytes == 0);
    }

    /// A long random sequence of takes and frees against a plain model of
    /// which bytes are handed out: no two live blocks overlap, every block
    /// lies inside a segment, and the bookkeeping stays consistent.
    #[test]
    fn arena_random_takes_and_frees_never_overlap() {
        let mut a = Arena::default();
        let mut live: Vec<(u64, usize)> = Vec::new();
        let mut next_base = 0u64;
        let mut seed = 12345u64;
        let mut rand = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for step in 0..4000 {
            if live.is_empty() || rand(3) > 0 {
                let size = 512 * (1 + rand(64) as usize);
                let got = a.take(size).or_else(|| {
                    a.add_segment(next_base, 2 << 20);
                    next_base += 4 << 20;
                    a.take(size)
                });
                let (p, got_size) = got.expect("a fresh segment holds the request");
                assert_eq!(got_size, size);
                for &(q, n) in &live {
                    assert!(
                        p + size as u64 <= q || q + n as u64 <= p,
                        "step {step}: overlap"
                    );
                }
                live.push((p, size));
            } else {
                let (p, size) = live.swap_remove(rand(live.len() as u64) as usize);
                assert_eq!(a.give_back(p), size);
            }
            if step % 97 == 0 {
                check(&a);
            }
        }
        check(&a);
        let held: usize = live.iter().map(|l| l.1).sum();
        let total: usize = a.segments.values().sum();
        assert_eq!(total - a.free_bytes, held);
        for (p, _) in live.drain(..) {
            a.give_back(p);
        }
        let n = a.segments.len();
        assert_eq!(a.drain_free_segments().len(), n, "all segments free again");
    }

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
