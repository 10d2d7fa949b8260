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
use super::compile::FP8;
use super::{dtype_size, float_sfx, launch, rows_cfg, Cuda};
use crate::backend::OffloadOps;
use crate::error::{arg_err, Result};
use crate::fp8::{block_count, row_len, Fp8Tensor};
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

    fn compress_fp8(&self, t: &Tensor<Self>) -> Result<Fp8Tensor<Self>> {
        const OP: &str = "compress_fp8";
        let sfx = float_sfx(OP, t.dtype())?;
        let n = t.numel();
        let cols = row_len(t.shape());
        let codes = self.alloc(OP, &[n.div_ceil(4)], DType::I32)?;
        let scales = self.alloc(OP, &[block_count(t.shape())], DType::F32)?;
        if n > 0 {
            let f = self.func(FP8, &format!("fp8_compress_{sfx}"))?;
            let rows = n / cols;
            launch!(
                self,
                f,
                rows_cfg(rows, 256),
                t.storage().ptr(),
                codes.storage().ptr(),
                scales.storage().ptr(),
                rows as i64,
                cols as i64
            )?;
        }
        Ok(Fp8Tensor {
            codes,
            scales,
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
        })
    }

    fn expand_fp8(&self, f: &Fp8Tensor<Self>) -> Result<Tensor<Self>> {
        const OP: &str = "expand_fp8";
        let sfx = float_sfx(OP, f.dtype)?;
        let n: usize = f.shape.iter().product();
        f.codes.expect_dtype(OP, DType::I32)?;
        f.scales.expect_dtype(OP, DType::F32)?;
        if f.codes.numel() != n.div_ceil(4) || f.scales.numel() != block_count(&f.shape) {
            return Err(arg_err(
                OP,
                format!(
                    "{} code words and {} scales do not fit shape {:?}",
                    f.codes.numel(),
                    f.scales.numel(),
                    f.shape
                ),
            ));
        }
        let out = self.alloc(OP, &f.shape, f.dtype)?;
        if n > 0 {
            let cols = f.row_len();
            let func = self.func(FP8, &format!("fp8_expand_{sfx}"))?;
            launch!(
                self,
                func,
                rows_cfg(n / cols, 256),
                f.codes.storage().ptr(),
                f.scales.storage().ptr(),
                out.storage().ptr(),
                (n / cols) as i64,
                cols as i64
            )?;
        }
        Ok(out)
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

    /// fp8 compression on the device gives the host reference's codes and
    /// scales bit for bit, and expands to its values, for f32, f64 and bf16,
    /// rows with a short last block, an all-zero block, huge and tiny
    /// (subnormal after scaling) values, and no host wait.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn fp8_compression_matches_the_host_reference() {
        use crate::fp8::{compress_host, expand_host, unpack_codes};
        let d = crate::cuda::require_test_device();
        for (shape, dtype) in [
            (vec![3usize, 300], DType::F32),
            (vec![2, 5, 128], DType::BF16),
            (vec![7, 1], DType::F64),
            (vec![4096, 2048], DType::BF16),
            (vec![0, 64], DType::F32),
        ] {
            let n: usize = shape.iter().product();
            let row = *shape.last().unwrap();
            let mut v: Vec<f32> = (0..n)
                .map(|j| ((j as f32) * 0.731).sin() * (1.0 + (j % 17) as f32))
                .collect();
            if n > 300 {
                v[5] = 3e4;
                v[6] = 1e-6;
                v[130..256].iter_mut().for_each(|x| *x = 0.0);
            }
            let x = d.upload(HostData::F32(v), &shape).unwrap();
            let x = d.cast(&x, dtype).unwrap();
            let host_values = d.download(&x).unwrap().to_f32();
            let (want_codes, want_scales) = compress_host(&host_values, row);
            let syncs = d.host_syncs();
            let f = d.compress_fp8(&x).unwrap();
            let back = d.expand_fp8(&f).unwrap();
            assert_eq!(d.host_syncs(), syncs, "{shape:?}: a host wait");
            let codes = match d.download(&f.codes).unwrap() {
                HostData::I32(w) => unpack_codes(&w, n),
                other => panic!("codes as {:?}", other.dtype()),
            };
            let scales = d.download(&f.scales).unwrap().to_f32();
            assert_eq!(scales, want_scales, "{shape:?} {dtype:?}: scales");
            let diff = codes
                .iter()
                .zip(&want_codes)
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(diff, 0, "{shape:?} {dtype:?}: {diff} of {n} codes differ");
            assert_eq!(back.dtype(), dtype);
            assert_eq!(back.shape(), &shape[..]);
            let want: Vec<f32> = expand_host(&want_codes, &want_scales, row);
            let want = d
                .cast(&d.upload(HostData::F32(want), &shape).unwrap(), dtype)
                .unwrap();
            assert_eq!(
                d.download(&back).unwrap().to_f64(),
                d.download(&want).unwrap().to_f64(),
                "{shape:?} {dtype:?}: expanded values"
            );
        }
    }

    /// Many bf16 and f32 tensors offloaded while the memory they held is
    /// reused by new work, then reloaded (some prefetched long before):
    /// every one comes back bit for bit, with no host wait on the way.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn offload_overlaps_and_round_trips_exactly() {
        let d = crate::cuda::require_test_device();
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
