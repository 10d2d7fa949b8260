//! CUDA activation offload: saved tensors go to pinned host memory on a
//! copy stream of their own and come back on it, ahead of the backward
//! that needs them, so the copies overlap the compute stream's work.
//!
//! Ordering, all without host waits:
//! - offload: the copy stream waits for the work queued on the compute
//!   stream (an event), then copies device → pinned host. The source
//!   tensor is kept alive until an event after the copy has completed
//!   (checked, never waited for, at later offload / reload calls), so the
//!   caching allocator cannot hand its memory to new work while the copy
//!   still reads it;
//! - prefetch: a fresh device tensor (the copy stream first waits for the
//!   compute stream, the block's last user), copied pinned host → device on
//!   the copy stream, which already runs after the offload's copy;
//! - reload: the compute stream waits for the prefetch's event.
//!
//! Pinned buffers are allocated once per size and reused (allocating
//! pinned memory is slow and synchronising); a buffer goes back to the pool
//! when its tensor has been reloaded: any later copy into it is queued on
//! the same copy stream, after the copy out of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, CudaEvent, CudaStream};

use super::alloc::driver_err;
use super::{dtype_size, Cuda};
use crate::backend::OffloadOps;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// A handle's offload machinery, made at its first offload.
pub(crate) struct OffloadState {
    copy: Arc<CudaStream>,
    pinned: Arc<PinnedPool>,
    /// Offloaded sources still being copied: released once their event is done.
    pending: Vec<(Arc<CudaEvent>, Tensor<Cuda>)>,
}

/// Free pinned host buffers by byte size (addresses as integers).
#[derive(Default)]
pub(crate) struct PinnedPool(Mutex<HashMap<usize, Vec<usize>>>);

impl Drop for PinnedPool {
    fn drop(&mut self) {
        let free = self.0.get_mut().unwrap_or_else(|p| p.into_inner());
        for ptr in free.drain().flat_map(|(_, v)| v) {
            // SAFETY: each address came from `malloc_host` and is freed once;
            // the pool is dropped only when no offloaded tensor holds it.
            let _ = unsafe { drv::free_host(ptr as *mut std::ffi::c_void) };
        }
    }
}

/// A tensor in pinned host memory, waiting to come back.
pub struct CudaOffloaded {
    host: usize,
    bytes: usize,
    shape: Vec<usize>,
    dtype: DType,
    pool: Arc<PinnedPool>,
    /// The prefetched device copy and the event after its copy.
    fetched: Option<(Tensor<Cuda>, CudaEvent)>,
}

impl std::fmt::Debug for CudaOffloaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaOffloaded({:?} {:?}, {} bytes pinned, prefetched: {})",
            self.dtype,
            self.shape,
            self.bytes,
            self.fetched.is_some()
        )
    }
}

impl Drop for CudaOffloaded {
    fn drop(&mut self) {
        let mut free = self.pool.0.lock().unwrap_or_else(|p| p.into_inner());
        free.entry(self.bytes).or_default().push(self.host);
    }
}

impl Cuda {
    /// Runs `f` on the offload state, making it (copy stream) at first use
    /// and releasing the sources whose copies have finished.
    fn with_offload<R>(&self, f: impl FnOnce(&mut OffloadState) -> Result<R>) -> Result<R> {
        let mut guard = self.inner.offload.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let copy = self
                .inner
                .ctx
                .new_stream()
                .map_err(|e| driver_err("offload: creating the copy stream", e))?;
            *guard = Some(OffloadState {
                copy,
                pinned: Arc::new(PinnedPool::default()),
                pending: Vec::new(),
            });
        }
        let state = guard.as_mut().expect("made above");
        state.pending.retain(|(done, _)| !done.is_complete());
        f(state)
    }

    /// A pinned buffer of `bytes` from the pool, or a new one.
    fn pinned(&self, pool: &PinnedPool, bytes: usize) -> Result<usize> {
        if let Some(ptr) = pool
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&bytes)
            .and_then(Vec::pop)
        {
            return Ok(ptr);
        }
        self.bind()?;
        // SAFETY: a plain pinned allocation, freed by the pool's drop.
        unsafe { drv::malloc_host(bytes.max(1), 0) }
            .map(|p| p as usize)
            .map_err(|e| driver_err(&format!("offload: {bytes} bytes of pinned host memory"), e))
    }

    /// An event recorded on `stream` now.
    fn event_on(&self, what: &str, stream: &CudaStream) -> Result<CudaEvent> {
        let ev = self
            .inner
            .ctx
            .new_event(None)
            .map_err(|e| driver_err(what, e))?;
        ev.record(stream).map_err(|e| driver_err(what, e))?;
        Ok(ev)
    }
}

impl OffloadOps for Cuda {
    type Offloaded = CudaOffloaded;

    fn offload(&self, t: &Tensor<Self>) -> Result<CudaOffloaded> {
        const OP: &str = "offload";
        let bytes = t.numel() * dtype_size(t.dtype());
        self.with_offload(|st| {
            let host = self.pinned(&st.pinned, bytes)?;
            let handle = CudaOffloaded {
                host,
                bytes,
                shape: t.shape().to_vec(),
                dtype: t.dtype(),
                pool: st.pinned.clone(),
                fetched: None,
            };
            if bytes > 0 {
                let queued = self.event_on(OP, self.stream())?;
                st.copy.wait(&queued).map_err(|e| driver_err(OP, e))?;
                // SAFETY: `host` holds `bytes` bytes until the handle drops,
                // which happens only after a reload orders everything after
                // this copy; the source stays alive in `pending` until the
                // copy's event completes.
                let dst = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, bytes) };
                unsafe { drv::memcpy_dtoh_async(dst, t.storage().ptr(), st.copy.cu_stream()) }
                    .map_err(|e| driver_err(OP, e))?;
                let done = Arc::new(self.event_on(OP, &st.copy)?);
                st.pending.push((done, t.clone()));
            }
            Ok(handle)
        })
    }

    fn prefetch(&self, h: &mut CudaOffloaded) -> Result<()> {
        const OP: &str = "offload prefetch";
        if h.fetched.is_some() {
            return Ok(());
        }
        let t = self.alloc(OP, &h.shape, h.dtype)?;
        self.with_offload(|st| {
            if h.bytes > 0 {
                // The new block's previous user ran on the compute stream.
                let queued = self.event_on(OP, self.stream())?;
                st.copy.wait(&queued).map_err(|e| driver_err(OP, e))?;
                // SAFETY: the pinned buffer lives as long as `h`; the copy
                // stream already runs after the copy that filled it.
                let src = unsafe { std::slice::from_raw_parts(h.host as *const u8, h.bytes) };
                unsafe { drv::memcpy_htod_async(t.storage().ptr(), src, st.copy.cu_stream()) }
                    .map_err(|e| driver_err(OP, e))?;
            }
            let ready = self.event_on(OP, &st.copy)?;
            h.fetched = Some((t, ready));
            Ok(())
        })
    }

    fn reload(&self, mut h: CudaOffloaded) -> Result<Tensor<Self>> {
        self.prefetch(&mut h)?;
        let (t, ready) = h.fetched.take().expect("prefetched above");
        self.stream()
            .wait(&ready)
            .map_err(|e| driver_err("offload reload", e))?;
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Device, ElementwiseOps};
    use crate::tensor::HostData;

    /// Many bf16 and f32 tensors offloaded while the memory they held is
    /// reused by new work, then reloaded (some prefetched long before):
    /// every one comes back bit for bit, with no host wait on the way.
    #[test]
    fn offload_overlaps_and_round_trips_exactly() {
        let Some(d) = crate::cuda::test_device() else {
            return;
        };
        let syncs = d.host_syncs();
        let mut handles = Vec::new();
        let mut wants = Vec::new();
        for i in 0..12usize {
            let n = 1000 + 997 * i;
            let v: Vec<f32> = (0..n)
                .map(|j| ((j * 31 + i) % 1013) as f32 * 0.25 - 100.0)
                .collect();
            let x = d.upload(HostData::F32(v), &[n]).unwrap();
            let x = if i % 2 == 0 {
                d.cast(&x, DType::BF16).unwrap()
            } else {
                x
            };
            // Work queued after the offload, on memory the pool hands back.
            let h = d.offload(&d.scale(&x, 1.0).unwrap()).unwrap();
            let _ = d.fill(&[n], 3.0, x.dtype()).unwrap();
            wants.push(x);
            handles.push(h);
        }
        assert_eq!(d.host_syncs(), syncs, "offload waited on the host");
        for h in handles.iter_mut().step_by(3) {
            d.prefetch(h).unwrap();
        }
        for (i, (h, want)) in handles.into_iter().zip(&wants).enumerate() {
            let back = d.reload(h).unwrap();
            assert_eq!(back.dtype(), want.dtype());
            let (a, b) = (d.download(&back).unwrap(), d.download(want).unwrap());
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "tensor {i}");
        }
    }
}
