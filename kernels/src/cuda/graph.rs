//! CUDA graphs: a sequence of device work captured once and replayed without
//! the host, which is possible because no op of this backend synchronises
//! with the host except [`crate::Device::download`] and
//! [`Cuda::synchronize`] (counted by [`Cuda::host_syncs`]).
//!
//! Replays write the same buffers as the captured run. The graph holds what
//! the capture freed (its scratch and intermediate tensors, see `alloc.rs`)
//! and the pinned host copies of what it uploaded; the tensors still alive
//! when the capture ended (its inputs, outputs and parameters) are the
//! caller's: keep them alive as long as the graph. A data error a kernel finds
//! during a replay (rather than during the capture) is reported at the next
//! read as an unknown check, since the capture's checks were resolved at the
//! first read after it.

use std::sync::Mutex;

use cudarc::driver::{result as drv, sys};

use super::alloc::{driver_err, GraphBlocks};
use super::Cuda;
use crate::error::Result;

/// A captured graph of device work on one [`Cuda`] handle's stream.
pub struct CudaGraphExec {
    graph: cudarc::driver::CudaGraph,
    /// Device blocks the capture freed: the graph's own buffers.
    memory: GraphBlocks,
    /// Pinned host copies of the capture's uploads, which replays read.
    uploads: Vec<PinnedUpload>,
    cuda: Cuda,
}

impl std::fmt::Debug for CudaGraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaGraphExec({} bytes held, {} uploads)",
            self.memory.bytes(),
            self.uploads.len()
        )
    }
}

impl CudaGraphExec {
    /// Queues one replay of the captured work on the handle's stream.
    pub fn replay(&self) -> Result<()> {
        self.cuda.bind()?;
        self.graph
            .launch()
            .map_err(|e| driver_err("replaying a CUDA graph", e))
    }

    /// Device bytes the graph holds beyond the caller's tensors.
    pub fn held_bytes(&self) -> usize {
        self.memory.bytes()
    }
}

impl Drop for CudaGraphExec {
    fn drop(&mut self) {
        // A replay still queued may be reading the pinned uploads: wait for
        // it before they are freed (device blocks need no wait, see alloc.rs).
        if !self.uploads.is_empty() {
            let _ = self.cuda.bind();
            let _ = self.cuda.stream().synchronize();
        }
    }
}

/// Pinned host memory holding one upload of a capture (freed on drop).
pub(crate) struct PinnedUpload {
    ptr: usize,
}

impl Drop for PinnedUpload {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed once, after the
        // graph that reads it (see `CudaGraphExec`'s drop).
        let _ = unsafe { drv::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// The uploads of the capture under way on a handle (see [`Cuda::capture`]).
pub(crate) type CaptureUploads = Mutex<Vec<PinnedUpload>>;

impl Cuda {
    /// Runs `f` with this handle's stream in capture mode and returns the
    /// captured graph with `f`'s result. `f` must not read to the host (a
    /// download fails the capture). Allocations it makes come from the pool
    /// (relaxed capture mode allows the pool to call the driver on a cache
    /// miss); the blocks it frees and the host data it uploads are kept for
    /// the graph's replays.
    pub fn capture<R>(&self, f: impl FnOnce(&Cuda) -> Result<R>) -> Result<(CudaGraphExec, R)> {
        self.bind()?;
        self.pool().begin_capture()?;
        let begun = self
            .stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| driver_err("beginning a CUDA graph capture", e));
        let out = begun.and_then(|()| f(self));
        let graph = self
            .stream()
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| driver_err("ending a CUDA graph capture", e));
        // Nothing captured has run: on failure the blocks are free at once.
        let memory = self.pool().end_capture();
        let uploads = std::mem::take(
            &mut *self
                .capture_uploads()
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let out = out?;
        match graph? {
            Some(graph) => Ok((
                CudaGraphExec {
                    graph,
                    memory,
                    uploads,
                    cuda: self.clone(),
                },
                out,
            )),
            None => Err(crate::error::KernelError::DeviceUnavailable {
                device: "cuda",
                reason: "the CUDA graph capture recorded nothing".into(),
            }),
        }
    }

    /// During a capture, copies `bytes` at `src` to pinned host memory the
    /// graph keeps and returns its address (a replay reads the copy, long
    /// after the caller's buffer is gone); `None` outside a capture.
    pub(crate) fn stage_upload(&self, src: *const u8, bytes: usize) -> Result<Option<usize>> {
        if !self.pool().capturing() {
            return Ok(None);
        }
        let ptr = unsafe { drv::malloc_host(bytes.max(1), 0) }
            .map_err(|e| driver_err("pinning an upload captured in a CUDA graph", e))?
            as usize;
        // SAFETY: `src` holds `bytes` bytes (the caller's slice) and the new
        // pinned buffer as many; they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, ptr as *mut u8, bytes) };
        self.capture_uploads()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(PinnedUpload { ptr });
        Ok(Some(ptr))
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{Backend, Device, ElementwiseOps};
    use crate::cpu::test_util::{rel_err, rng, uniform, TestDevice};
    use crate::cpu::Cpu;
    use crate::cuda::Cuda;
    use crate::tensor::{DType, HostData, Tensor};

    /// Shape letters: T tokens, D hidden, E experts, K top-k, F expert ffn.
    const T: usize = 256;
    const D: usize = 64;
    const E: usize = 8;
    const K: usize = 2;
    const F: usize = 32;

    /// Forward and backward of a dropless MoE layer (router, top-k, plan,
    /// permute, SwiGLU experts on grouped GEMMs, combine), returning the
    /// output and every gradient. Written once for any backend.
    fn moe_step<B: Backend>(d: &B, inputs: &[Tensor<B>; 6]) -> crate::Result<Vec<Tensor<B>>> {
        let [x, w_router, w_gate, w_up, w_down, dout] = inputs;
        // Forward.
        let probs = d.softmax(&d.matmul(x, w_router, false, false)?)?;
        let idx = d.topk(&probs, K, 1, 1)?;
        let wts = d.gather_cols(&probs, &idx)?;
        let plan = d.routing_plan(&idx, E)?;
        let xp = d.permute(x, &plan.row_src)?;
        let g = d.grouped_matmul(&xp, w_gate, &plan.counts, false)?;
        let u = d.grouped_matmul(&xp, w_up, &plan.counts, false)?;
        let p = d.permute_weights(&wts, &plan.slot, plan.row_src.numel())?;
        let h = d.swiglu_weighted(&g, &u, &p)?;
        let y = d.grouped_matmul(&h, w_down, &plan.counts, false)?;
        let out = d.unpermute(&y, &plan.slot)?;
        // Backward, walking the forward in reverse.
        let dy = d.permute(dout, &plan.row_src)?;
        let dw_down = d.grouped_matmul_weight_grad(&h, &dy, &plan.counts)?;
        let dh = d.grouped_matmul(&dy, w_down, &plan.counts, true)?;
        let (dg, du, dp) = d.swiglu_weighted_backward(&g, &u, &p, &dh)?;
        let dwts = d.permute_weights_backward(&dp, &plan.slot)?;
        let dw_gate = d.grouped_matmul_weight_grad(&xp, &dg, &plan.counts)?;
        let dw_up = d.grouped_matmul_weight_grad(&xp, &du, &plan.counts)?;
        let mut dxp = d.grouped_matmul(&dg, w_gate, &plan.counts, true)?;
        d.axpy(
            &mut dxp,
            1.0,
            &d.grouped_matmul(&du, w_up, &plan.counts, true)?,
        )?;
        let mut dx = d.permute_backward(&dxp, &plan.row_src, T)?;
        let dprobs = d.scatter_cols(&dwts, &idx, E)?;
        let dlogits = d.softmax_backward(&probs, &dprobs)?;
        d.axpy(&mut dx, 1.0, &d.matmul(&dlogits, w_router, false, true)?)?;
        let dw_router = d.matmul(x, &dlogits, true, false)?;
        Ok(vec![out, dx, dw_router, dw_gate, dw_up, dw_down])
    }

    fn inputs<B: Device>(d: &B) -> [Tensor<B>; 6] {
        let mut g = rng(7);
        let mut t = |shape: &[usize], scale: f64| {
            let n = shape.iter().product();
            let v: Vec<f64> = uniform(&mut g, n).iter().map(|x| x * scale).collect();
            d.t32(&v.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape)
        };
        [
            t(&[T, D], 1.0),
            t(&[D, E], 0.5),
            t(&[E, D, F], 0.2),
            t(&[E, D, F], 0.2),
            t(&[E, F, D], 0.2),
            t(&[T, D], 1.0),
        ]
    }

    /// The MoE layer's forward and backward queue every op without one host
    /// wait (counted), match the CPU, and replay as a CUDA graph with the
    /// same results: the dropless layer reads its sizes on the device.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn moe_layer_needs_no_host_sync_and_replays_as_a_graph() {
        let d = crate::cuda::require_test_device();
        let want: Vec<Vec<f64>> = moe_step(&Cpu, &inputs(&Cpu))
            .unwrap()
            .iter()
            .map(|t| Cpu.h64(t))
            .collect();
        let inp = inputs(&d);
        // Warm up: compile the modules, create the cuBLAS handle, fill the pool.
        let _ = moe_step(&d, &inp).unwrap();
        d.synchronize().unwrap();
        let before = d.host_syncs();
        let eager = moe_step(&d, &inp).unwrap();
        assert_eq!(d.host_syncs(), before, "the MoE step waited for the host");
        let names = ["out", "dx", "dw_router", "dw_gate", "dw_up", "dw_down"];
        let eager_h: Vec<Vec<f64>> = eager.iter().map(|t| d.h64(t)).collect();
        for ((name, got), want) in names.iter().zip(&eager_h).zip(&want) {
            let e = rel_err(got, want);
            println!("moe step {name}: relative error vs CPU {e:.2e}");
            assert!(e < 1e-5, "{name}: {e:.3e}");
        }
        let (graph, outs) = d.capture(|d| moe_step(d, &inp)).unwrap();
        assert!(
            graph.held_bytes() > 0,
            "the capture's intermediates are the graph's"
        );
        // Tensors made after the capture, of the intermediates' shapes, get
        // blocks of their own: replays must leave them alone.
        let bystanders: Vec<Tensor<Cuda>> = [[T, D], [T * K, F], [T * K, D], [T, E]]
            .iter()
            .flat_map(|s| (0..4).map(move |_| s))
            .map(|s| d.fill(s, 7.0, DType::F32).unwrap())
            .collect();
        for _ in 0..2 {
            graph.replay().unwrap();
            for ((name, t), e) in names.iter().zip(&outs).zip(&eager_h) {
                assert_eq!(&d.h64(t), e, "{name} after a graph replay");
            }
        }
        for t in &bystanders {
            assert!(
                d.h64(t).iter().all(|&v| v == 7.0),
                "a replay wrote a bystander"
            );
        }
    }

    /// An upload captured in a graph is replayed from a pinned copy: the
    /// caller's host buffer is gone by then.
    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn captured_uploads_replay_from_their_own_copy() {
        let d = crate::cuda::require_test_device();
        let x = d.t32(&[1.0, 2.0, 3.0, 4.0], &[4]);
        let (graph, (sum, _)) = d
            .capture(|d| {
                let c = d.upload(HostData::F32(vec![10.0, 20.0, 30.0, 40.0]), &[4])?;
                Ok((d.add(&x, &c)?, c))
            })
            .unwrap();
        // Overwrite the output, then let the replay write it again.
        let mut sum = sum;
        d.axpy(&mut sum, -1.0, &x.clone()).unwrap();
        // Host allocations of the uploaded vector's size, likely to take its
        // freed memory, held while the replay runs.
        let reused: Vec<Vec<f32>> = (0..8).map(|i| vec![i as f32; 4]).collect();
        graph.replay().unwrap();
        assert_eq!(d.h64(&sum), vec![11.0, 22.0, 33.0, 44.0]);
        drop(reused);
    }
}
