//! The [`Communicator`] of multi-GPU runs, on NCCL (one process per GPU).
//!
//! One NCCL communicator spans the world; every process group of the layout
//! (tp, cp, dp, ep, etp, edp, pp…) gets its own, split from it once at start
//! (`ncclCommSplit` is collective over the whole world, so groups cannot be
//! made lazily by their members alone).
//!
//! NCCL work runs on a communication stream of its own (one per
//! [`NcclComm`], non-blocking), ordered with the handle's compute stream by
//! two events made once and reused: before a call the communication stream
//! waits for the compute work queued so far (which writes the call's
//! inputs), and after it the compute stream waits for the call (whose
//! outputs it reads next). The host waits for neither. A blocking call makes
//! the compute stream wait at once; a started one
//! ([`Communicator::reduce_scatter_start`], [`Communicator::all_gather_start`],
//! [`Communicator::all_to_all_v_start`])
//! records an event of its own and returns an [`InFlight`] guard in its
//! [`Pending`], and the compute stream waits for that event only at
//! [`Pending::wait`] (or when the handle is dropped): the compute queued in
//! between overlaps the collective.
//!
//! That wait is also what keeps the caching allocator (`alloc.rs`) safe: the
//! pool hands a freed block to the next op at once because that op queues
//! behind the block's last use on the compute stream. A block freed after a
//! call (a temporary of the call, an input its caller drops) may still be
//! read or written by NCCL on the communication stream; since the compute
//! stream waits for the call's end before anything queued after it, no
//! compute op reuses the block too early. A started call's guard holds its
//! input and output until the compute stream waits for it, for the same
//! reason.
//!
//! NCCL has no all-to-all-v and its `recv` needs the size up front, so:
//! - [`Communicator::all_to_all_v`] exchanges the row counts (a small
//!   all-gather read on the host, which waits for the communication stream:
//!   the trait returns host counts), then moves the rows with grouped
//!   point-to-point sends and receives; [`Communicator::all_to_all_v_start`]
//!   is given the receive counts (the MoE layer exchanged them first) and
//!   queues only the sends and receives, with no host wait;
//! - [`Communicator::all_gather`] with unequal row counts does the same;
//! - [`Communicator::send`] sends a fixed-size header (dtype and shape)
//!   before the data, which [`Communicator::recv`] reads on the host first.
//!
//! Sums are NCCL's: their order is not the group order, so results match a
//! single-rank run to rounding, not bit for bit (unlike [`crate::comm::local`]).
//! A rank that dies leaves NCCL kernels on its peers waiting; `foldmoe
//! launch` ends those processes (and [`Communicator::abort`] ends this one's
//! communicators so that pending work fails instead of waiting).

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, CudaEvent, CudaStream, DriverError};
use cudarc::nccl::sys;

use super::{dtype_size, Cuda};
use crate::backend::Device;
use crate::comm::{Communicator, Group, Pending, ReduceOp};
use crate::error::{KernelError, Result};
use crate::tensor::{DType, HostData, Tensor};

/// Bytes of an NCCL unique id, which rank 0 creates and every rank needs.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Entries of the header [`Communicator::send`] puts before a tensor: dtype,
/// number of dimensions, then up to 6 dimensions.
const HEADER_LEN: usize = 8;

/// A started collective the compute stream has not waited for yet: dropping
/// it makes the compute stream wait for the call's event (no host wait),
/// then releases the call's buffers, whose blocks later compute may reuse.
struct InFlight {
    done: CudaEvent,
    compute: Arc<CudaStream>,
    waits: Arc<WaitLog>,
    _buffers: [Tensor<Cuda>; 2],
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Nowhere to report a failure at drop; the stream's next call would
        // report a broken context anyway.
        let _ = self.waits.wait(&self.compute, &self.done);
    }
}

/// The compute stream's waits for communication, timed on the device: each
/// wait sits between two timing events recorded on the compute stream, and
/// the interval between them is how long compute stalled for it (zero when
/// the collective had already finished). This is the exposed
/// communication, which host clocks cannot see (an NCCL call returns once
/// queued). Timing starts at the first reading ([`WaitLog::take_ms`]), so
/// a run nobody measures records no events. Intervals whose events have
/// completed are folded into a sum as the log grows, so a long run keeps a
/// bounded number of events.
#[derive(Default)]
struct WaitLog {
    /// Whether waits are timed (set by the first reading).
    timing: std::sync::atomic::AtomicBool,
    state: Mutex<WaitSum>,
}

#[derive(Default)]
struct WaitSum {
    /// Intervals not yet read.
    pending: Vec<(CudaEvent, CudaEvent)>,
    /// Milliseconds of the intervals already read.
    folded_ms: f64,
    /// The first failure to read an interval since the last take.
    failed: Option<DriverError>,
}

/// Intervals kept before completed ones are folded.
const WAITS_KEPT: usize = 256;

impl WaitLog {
    /// Makes `compute` wait for `done`, timed. The wait is made even when
    /// the timing events cannot be (their error is dropped: timing is a
    /// report, ordering is correctness).
    fn wait(
        &self,
        compute: &Arc<CudaStream>,
        done: &CudaEvent,
    ) -> std::result::Result<(), DriverError> {
        if !self.timing.load(Ordering::Relaxed) {
            return compute.wait(done);
        }
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let ctx = compute.context();
        let mark = || {
            ctx.new_event(timing)
                .and_then(|e| e.record(compute).map(|()| e))
        };
        let before = mark().ok();
        let waited = compute.wait(done);
        if let (Some(before), Ok(after)) = (before, mark()) {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.pending.push((before, after));
            if s.pending.len() > WAITS_KEPT {
                // A failed reading is reported by the next take.
                if let Err(e) = s.fold(false) {
                    s.failed.get_or_insert(e);
                }
            }
        }
        waited
    }

    /// Milliseconds the compute stream stalled since the last call (zero
    /// at the first, which starts the timing), waiting for the device to
    /// reach every recorded interval.
    fn take_ms(&self) -> std::result::Result<f64, DriverError> {
        self.timing.store(true, Ordering::Relaxed);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let folded = s.fold(true);
        let ms = std::mem::take(&mut s.folded_ms);
        match s.failed.take() {
            Some(e) => Err(e),
            None => folded.map(|()| ms),
        }
    }
}

impl WaitSum {
    /// Adds the intervals that have completed (all of them, waiting, when
    /// `all`) to the sum and forgets their events.
    fn fold(&mut self, all: bool) -> std::result::Result<(), DriverError> {
        let mut kept = Vec::new();
        for (before, after) in self.pending.drain(..) {
            if all || after.is_complete() {
                self.folded_ms += f64::from(before.elapsed_ms(&after)?);
            } else {
                kept.push((before, after));
            }
        }
        self.pending = kept;
        Ok(())
    }
}

/// A raw NCCL communicator handle, destroyed on drop.
struct RawComm(sys::ncclComm_t);

// NCCL communicators may be used from any thread as long as calls on one are
// not concurrent; every call goes through `NcclComm::ops`, a mutex.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.0.is_null() {
            return; // aborted: NCCL already released it
        }
        // Best effort: a failing destroy has nowhere to go at drop.
        unsafe {
            let _ = sys::ncclCommDestroy(self.0);
        }
    }
}

/// This rank's NCCL communicators: the world's and one per process group.
pub struct NcclComm {
    cuda: Cuda,
    rank: usize,
    world: usize,
    ops: Mutex<State>,
    /// The compute stream's timed waits for this communicator's calls.
    waits: Arc<WaitLog>,
}

struct State {
    world: RawComm,
    /// Split communicators by their groups' ranks (groups of 2 or more
    /// ranks that are not the world in rank order).
    groups: HashMap<Vec<usize>, RawComm>,
    /// Why this rank aborted, once it has.
    aborted: Option<String>,
    /// Where NCCL work runs (under the mutex: its events are reused).
    streams: CommStream,
}

/// The communication stream and the two events that order it with the
/// compute stream (see the module docs).
struct CommStream {
    stream: Arc<CudaStream>,
    /// Recorded on the compute stream before a call; waited for by `stream`.
    ready: CudaEvent,
    /// Recorded on `stream` after a call; waited for by the compute stream.
    done: CudaEvent,
}

/// The NCCL data type of `dtype`.
fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
    }
}

fn dtype_code(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
    }
}

fn dtype_of_code(code: i32) -> Option<DType> {
    Some(match code {
        0 => DType::F32,
        1 => DType::F64,
        2 => DType::BF16,
        3 => DType::I32,
        _ => return None,
    })
}

/// NCCL's own description of `r`.
fn nccl_message(r: sys::ncclResult_t) -> String {
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        format!("{r:?}")
    } else {
        format!("{r:?}: {}", unsafe { CStr::from_ptr(p) }.to_string_lossy())
    }
}

fn ptr(t: &Tensor<Cuda>) -> *mut c_void {
    t.storage().ptr() as *mut c_void
}

impl NcclComm {
    /// A new unique id (on rank 0), to hand to every rank through the
    /// rendezvous. Fails with a clear error when NCCL is not installed.
    pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
        check_library()?;
        let mut id = std::mem::MaybeUninit::<sys::ncclUniqueId>::uninit();
        let r = unsafe { sys::ncclGetUniqueId(id.as_mut_ptr()) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(KernelError::Comm {
                rank: 0,
                detail: format!("creating the NCCL unique id: {}", nccl_message(r)),
            });
        }
        let id = unsafe { id.assume_init() };
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the world of `world` ranks as `rank` on `cuda`'s GPU, then splits
    /// a communicator for each of `groups`: this rank's group of every kind
    /// the layout has, listed in the same kind order on every rank (the
    /// split is collective over the world). Blocks until every rank joins.
    pub fn new(
        cuda: &Cuda,
        rank: usize,
        world: usize,
        id: &[u8; UNIQUE_ID_BYTES],
        groups: &[Group],
    ) -> Result<Self> {
        check_library()?;
        if rank >= world {
            return Err(KernelError::Comm {
                rank,
                detail: format!("rank {rank} is outside a world of {world}"),
            });
        }
        cuda.bind()?;
        let fail = |what: &str, r: sys::ncclResult_t| KernelError::Comm {
            rank,
            detail: format!("{what}: {}", nccl_message(r)),
        };
        let unique = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = std::ptr::null_mut();
        let r = unsafe { sys::ncclCommInitRank(&mut comm, world as i32, unique, rank as i32) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(fail(
                &format!("joining the NCCL world of {world} as rank {rank}"),
                r,
            ));
        }
        let world_comm = RawComm(comm);
        let driver = |what: &str, e: DriverError| KernelError::Comm {
            rank,
            detail: format!("{what}: {e:?}"),
        };
        let ctx = cuda.ctx();
        let streams = CommStream {
            stream: ctx
                .new_stream()
                .map_err(|e| driver("creating the communication stream", e))?,
            ready: ctx
                .new_event(None)
                .map_err(|e| driver("creating an event", e))?,
            done: ctx
                .new_event(None)
                .map_err(|e| driver("creating an event", e))?,
        };
        let everyone: Vec<usize> = (0..world).collect();
        let mut split = HashMap::new();
        for g in groups {
            let Some(key) = g.index_of(rank) else {
                return Err(KernelError::Comm {
                    rank,
                    detail: format!("rank {rank} is not in its group {:?}", g.ranks()),
                });
            };
            // Every rank of a kind sees the same group size and the same
            // "is the world" answer, so these skips agree across ranks.
            if g.size() < 2 || g.ranks() == everyone.as_slice() {
                continue;
            }
            let color = *g.ranks().iter().min().expect("a group of 2 or more ranks") as i32;
            let mut sub = std::ptr::null_mut();
            let r = unsafe {
                sys::ncclCommSplit(
                    world_comm.0,
                    color,
                    key as i32,
                    &mut sub,
                    std::ptr::null_mut(),
                )
            };
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(fail(
                    &format!("splitting the communicator of group {:?}", g.ranks()),
                    r,
                ));
            }
            // The same group listed under two kinds (e.g. tp and etp) gets
            // one communicator; the extra split is dropped.
            split.entry(g.ranks().to_vec()).or_insert(RawComm(sub));
        }
        Ok(NcclComm {
            cuda: cuda.clone(),
            rank,
            world,
            ops: Mutex::new(State {
                world: world_comm,
                groups: split,
                aborted: None,
                streams,
            }),
            waits: Arc::default(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, detail: impl Into<String>) -> KernelError {
        KernelError::Comm {
            rank: self.rank,
            detail: detail.into(),
        }
    }

    fn nccl(&self, what: &str, r: sys::ncclResult_t) -> Result<()> {
        if r == sys::ncclResult_t::ncclSuccess {
            Ok(())
        } else {
            Err(self.err(format!("{what}: {}", nccl_message(r))))
        }
    }

    fn driver(&self, what: &str, e: DriverError) -> KernelError {
        self.err(format!("{what}: {e:?}"))
    }

    /// Queues NCCL work (and its device copies) with `enqueue`, given the
    /// communication stream, between the two event waits of the module
    /// docs: after the compute work queued so far, before the compute work
    /// queued next.
    fn on_comm_stream<T>(
        &self,
        s: &State,
        enqueue: impl FnOnce(sys::cudaStream_t) -> Result<T>,
    ) -> Result<T> {
        let out = self.after_compute(s, enqueue)?;
        // Also after a failed call: compute must not run ahead of (or reuse
        // the buffers of) whatever part of it was queued.
        let c = &s.streams;
        c.done
            .record(&c.stream)
            .and_then(|()| self.waits.wait(self.cuda.stream(), &c.done))
            .map_err(|e| self.driver("ordering compute after the communication stream", e))?;
        out
    }

    /// Queues `enqueue`'s work on the communication stream after the compute
    /// work queued so far; the outer result is the ordering's.
    fn after_compute<T>(
        &self,
        s: &State,
        enqueue: impl FnOnce(sys::cudaStream_t) -> Result<T>,
    ) -> Result<Result<T>> {
        let c = &s.streams;
        c.ready
            .record(self.cuda.stream())
            .and_then(|()| c.stream.wait(&c.ready))
            .map_err(|e| self.driver("ordering the communication stream after compute", e))?;
        Ok(enqueue(c.stream.cu_stream() as sys::cudaStream_t))
    }

    /// A started call: `enqueue`'s work on the communication stream after
    /// the compute queued so far, the compute queued next not waiting for
    /// it until the returned handle is waited for or dropped. `buffers` (the
    /// call's input and output) are held until then.
    fn started(
        &self,
        s: &State,
        out: Tensor<Cuda>,
        input: &Tensor<Cuda>,
        enqueue: impl FnOnce(sys::cudaStream_t) -> Result<()>,
    ) -> Result<Pending<Cuda>> {
        let queued = self.after_compute(s, enqueue)?;
        let done = self
            .cuda
            .ctx()
            .new_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .and_then(|ev| ev.record(&s.streams.stream).map(|()| ev))
            .map_err(|e| self.driver("recording the end of a started collective", e));
        let done = match done {
            Ok(ev) => ev,
            Err(e) => {
                // Without an event of its own, order compute after the call now.
                let c = &s.streams;
                let _ = c
                    .done
                    .record(&c.stream)
                    .and_then(|()| self.cuda.stream().wait(&c.done));
                return Err(e);
            }
        };
        let guard = InFlight {
            done,
            compute: self.cuda.stream().clone(),
            waits: Arc::clone(&self.waits),
            _buffers: [input.clone(), out.clone()],
        };
        // A failed call still has its guard order compute after what was queued.
        queued?;
        Ok(Pending::queued(out, Box::new(guard)))
    }

    /// `enqueue` (which fills `out` from `input`) as a blocking call, its
    /// result ready in the handle, or started ([`NcclComm::started`]).
    fn run_or_start(
        &self,
        s: &State,
        out: Tensor<Cuda>,
        input: &Tensor<Cuda>,
        start: bool,
        enqueue: impl FnOnce(sys::cudaStream_t) -> Result<()>,
    ) -> Result<Pending<Cuda>> {
        if start {
            return self.started(s, out, input, enqueue);
        }
        self.on_comm_stream(s, enqueue)?;
        Ok(Pending::ready(Ok(out)))
    }

    /// [`Communicator::reduce_scatter`], blocking or started.
    fn reduce_scatter_on(
        &self,
        b: &Cuda,
        group: &Group,
        t: &Tensor<Cuda>,
        start: bool,
    ) -> Result<Pending<Cuda>> {
        let s = self.state();
        let (comm, _) = self.comm_of(&s, group)?;
        let n = group.size();
        let rows = t.shape().first().copied().unwrap_or(0);
        if !rows.is_multiple_of(n) {
            return Err(self.err(format!(
                "reduce_scatter: {rows} rows do not split over a group of {n}"
            )));
        }
        if n == 1 {
            return Ok(Pending::ready(Ok(t.clone())));
        }
        let mut shape = t.shape().to_vec();
        shape[0] = rows / n;
        let out = b.alloc("reduce_scatter", &shape, t.dtype())?;
        let (optr, count) = (ptr(&out), t.numel() / n);
        self.run_or_start(&s, out, t, start, |stream| {
            self.nccl("reduce_scatter", unsafe {
                sys::ncclReduceScatter(
                    ptr(t),
                    optr,
                    count,
                    nccl_type(t.dtype()),
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    stream,
                )
            })
        })
    }

    /// [`Communicator::all_gather`], blocking or started. Unequal row
    /// counts are exchanged first, which the host reads (a wait for the
    /// compute queued before, even when started).
    fn all_gather_on(
        &self,
        b: &Cuda,
        group: &Group,
        t: &Tensor<Cuda>,
        start: bool,
    ) -> Result<Pending<Cuda>> {
        let s = self.state();
        let (comm, me) = self.comm_of(&s, group)?;
        if group.size() == 1 {
            return Ok(Pending::ready(Ok(t.clone())));
        }
        if t.shape().is_empty() {
            return Err(self.err("all_gather: a scalar has no rows to gather"));
        }
        let rows = self.exchange_counts(&s, comm, &[t.shape()[0] as i32])?;
        let rows: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
        let mut shape = t.shape().to_vec();
        shape[0] = rows.iter().sum();
        let out = b.alloc("all_gather", &shape, t.dtype())?;
        let target = out.clone();
        self.run_or_start(&s, out, t, start, |stream| {
            if rows.iter().all(|&r| r == rows[0]) {
                self.nccl("all_gather", unsafe {
                    sys::ncclAllGather(
                        ptr(t),
                        ptr(&target),
                        t.numel(),
                        nccl_type(t.dtype()),
                        comm,
                        stream,
                    )
                })
            } else {
                // Every member gets all of this rank's rows.
                let n = group.size();
                let (from, send) = (vec![0; n], vec![t.shape()[0]; n]);
                self.exchange_rows(stream, comm, me, t, &from, &send, &target, &rows)
            }
        })
    }

    /// `t`'s values on the host, read on the communication stream after the
    /// NCCL call that filled it there: the host waits for that stream, not
    /// for compute queued since.
    fn read_on_comm_stream(&self, s: &State, t: &Tensor<Cuda>) -> Result<Vec<i32>> {
        let mut v = vec![0i32; t.numel()];
        if v.is_empty() {
            return Ok(v);
        }
        self.cuda.bind()?;
        let stream = &s.streams.stream;
        unsafe { drv::memcpy_dtoh_async(&mut v, t.storage().ptr(), stream.cu_stream()) }
            .map_err(|e| self.driver("reading to the host", e))?;
        // A host wait like a download's, counted with them (Cuda::host_syncs).
        self.cuda.inner.syncs.fetch_add(1, Ordering::Relaxed);
        stream
            .synchronize()
            .map_err(|e| self.driver("waiting for the communication stream", e))?;
        Ok(v)
    }

    /// The communicator of `group` and this rank's index in it, or an error
    /// naming a group that was not given to [`NcclComm::new`].
    fn comm_of(&self, s: &State, group: &Group) -> Result<(sys::ncclComm_t, usize)> {
        if let Some(why) = &s.aborted {
            return Err(self.err(format!("this rank ({}) aborted earlier: {why}", self.rank)));
        }
        let me = group.index_of(self.rank).ok_or_else(|| {
            self.err(format!(
                "rank {} called a collective of group {:?}, which it is not in",
                self.rank,
                group.ranks()
            ))
        })?;
        if group.ranks().iter().copied().eq(0..self.world) {
            return Ok((s.world.0, me));
        }
        if group.size() == 1 {
            // Callers answer one-member collectives without NCCL.
            return Ok((std::ptr::null_mut(), me));
        }
        match s.groups.get(group.ranks()) {
            Some(c) => Ok((c.0, me)),
            None => Err(self.err(format!(
                "group {:?} has no NCCL communicator: list it in NcclComm::new's groups",
                group.ranks()
            ))),
        }
    }

    /// A device copy on `stream` (the communication stream).
    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: sys::cudaStream_t) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.cuda.bind()?;
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, stream as _) }
            .map_err(|e| self.err(format!("device copy of {bytes} bytes: {e:?}")))
    }

    /// `mine` from every member of `comm`'s group, concatenated in member
    /// order (a small all-gather read back on the host).
    fn exchange_counts(&self, s: &State, comm: sys::ncclComm_t, mine: &[i32]) -> Result<Vec<i32>> {
        let b = &self.cuda;
        let n = mine.len();
        let send = b.upload(HostData::I32(mine.to_vec()), &[n])?;
        let size = unsafe {
            let mut c = 0;
            self.nccl("reading a group size", sys::ncclCommCount(comm, &mut c))?;
            c as usize
        };
        let recv = b.alloc("all-gather of row counts", &[size * n], DType::I32)?;
        self.on_comm_stream(s, |stream| {
            self.nccl("all-gather of row counts", unsafe {
                sys::ncclAllGather(
                    ptr(&send),
                    ptr(&recv),
                    n,
                    sys::ncclDataType_t::ncclInt32,
                    comm,
                    stream,
                )
            })
        })?;
        self.read_on_comm_stream(s, &recv)
    }

    /// Point-to-point exchange inside one NCCL group call: to member `k`,
    /// `send_rows[k]` rows of `t` starting at row `send_from[k]`; from member
    /// `j`, `recv_rows[j]` rows into `out`, concatenated in member order.
    /// This rank's own rows are copied on the device. Everything is queued
    /// on `stream` (call it inside [`NcclComm::on_comm_stream`]).
    #[allow(clippy::too_many_arguments)]
    fn exchange_rows(
        &self,
        stream: sys::cudaStream_t,
        comm: sys::ncclComm_t,
        me: usize,
        t: &Tensor<Cuda>,
        send_from: &[usize],
        send_rows: &[usize],
        out: &Tensor<Cuda>,
        recv_rows: &[usize],
    ) -> Result<()> {
        let row = t.numel().checked_div(t.shape()[0]).unwrap_or(0);
        let esize = dtype_size(t.dtype());
        let dt = nccl_type(t.dtype());
        let (send_off, recv_off) = (send_from, exclusive_sums(recv_rows));
        let (src, dst) = (t.storage().ptr(), out.storage().ptr());
        self.copy(
            dst + (recv_off[me] * row * esize) as u64,
            src + (send_off[me] * row * esize) as u64,
            send_rows[me] * row * esize,
            stream,
        )?;
        self.nccl("starting a group of sends and receives", unsafe {
            sys::ncclGroupStart()
        })?;
        let mut result = Ok(());
        for k in 0..send_rows.len() {
            if k == me {
                continue;
            }
            if send_rows[k] > 0 {
                let p = (src + (send_off[k] * row * esize) as u64) as *const c_void;
                let r = unsafe { sys::ncclSend(p, send_rows[k] * row, dt, k as i32, comm, stream) };
                result = result.and(self.nccl(&format!("sending rows to member {k}"), r));
            }
            if recv_rows[k] > 0 {
                let p = (dst + (recv_off[k] * row * esize) as u64) as *mut c_void;
                let r = unsafe { sys::ncclRecv(p, recv_rows[k] * row, dt, k as i32, comm, stream) };
                result = result.and(self.nccl(&format!("receiving rows from member {k}"), r));
            }
        }
        let end = self.nccl("ending a group of sends and receives", unsafe {
            sys::ncclGroupEnd()
        });
        result.and(end)
    }
}

/// Where each part starts when parts of `rows` rows are laid end to end.
fn exclusive_sums(rows: &[usize]) -> Vec<usize> {
    rows.iter()
        .scan(0, |acc, &r| {
            let start = *acc;
            *acc += r;
            Some(start)
        })
        .collect()
}

/// Fails with a clear error unless the NCCL library can be loaded.
fn check_library() -> Result<()> {
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::DeviceUnavailable {
            device: "cuda",
            reason: "NCCL not found (loaded as libnccl.so): install NCCL, or link its \
                     libnccl.so.2 as libnccl.so in a directory on LD_LIBRARY_PATH; multi-GPU \
                     runs need it"
                .into(),
        })
    }
}

impl Communicator<Cuda> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(
        &self,
        b: &Cuda,
        group: &Group,
        t: &Tensor<Cuda>,
        op: ReduceOp,
    ) -> Result<Tensor<Cuda>> {
        let s = self.state();
        let (comm, _) = self.comm_of(&s, group)?;
        if group.size() == 1 {
            return Ok(t.clone());
        }
        let out = b.alloc("all_reduce", t.shape(), t.dtype())?;
        let nop = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        };
        self.on_comm_stream(&s, |stream| {
            self.nccl("all_reduce", unsafe {
                sys::ncclAllReduce(
                    ptr(t),
                    ptr(&out),
                    t.numel(),
                    nccl_type(t.dtype()),
                    nop,
                    comm,
                    stream,
                )
            })
        })?;
        Ok(out)
    }

    fn reduce_scatter(&self, b: &Cuda, group: &Group, t: &Tensor<Cuda>) -> Result<Tensor<Cuda>> {
        self.reduce_scatter_on(b, group, t, false)?.wait()
    }

    fn reduce_scatter_start(
        &self,
        b: &Cuda,
        group: &Group,
        t: &Tensor<Cuda>,
    ) -> Result<Pending<Cuda>> {
        self.reduce_scatter_on(b, group, t, true)
    }

    fn all_gather(&self, b: &Cuda, group: &Group, t: &Tensor<Cuda>) -> Result<Tensor<Cuda>> {
        self.all_gather_on(b, group, t, false)?.wait()
    }

    fn all_gather_start(&self, b: &Cuda, group: &Group, t: &Tensor<Cuda>) -> Result<Pending<Cuda>> {
        self.all_gather_on(b, group, t, true)
    }

    fn all_to_all_v(
        &self,
        b: &Cuda,
        group: &Group,
        t: &Tensor<Cuda>,
        send_rows: &[usize],
    ) -> Result<(Tensor<Cuda>, Vec<usize>)> {
        let s = self.state();
        let (comm, me) = self.comm_of(&s, group)?;
        let n = group.size();
        if let Some(e) = crate::comm::all_to_all_v_args_error(t.shape(), n, send_rows) {
            return Err(e);
        }
        let rows = t.shape()[0];
        if n == 1 {
            return Ok((t.clone(), vec![rows]));
        }
        let mine: Vec<i32> = send_rows.iter().map(|&r| r as i32).collect();
        let all = self.exchange_counts(&s, comm, &mine)?;
        // Member j's row k is what j sends to k: this rank receives column `me`.
        let recv_rows: Vec<usize> = (0..n).map(|j| all[j * n + me] as usize).collect();
        let mut shape = t.shape().to_vec();
        shape[0] = recv_rows.iter().sum();
        let out = b.alloc("all_to_all_v", &shape, t.dtype())?;
        let from = exclusive_sums(send_rows);
        self.on_comm_stream(&s, |stream| {
            self.exchange_rows(stream, comm, me, t, &from, send_rows, &out, &recv_rows)
        })?;
        Ok((out, recv_rows))
    }

    /// Queued on the communication stream with no count exchange: the
    /// caller's `recv_rows` size the receive buffer and the receives. NCCL
    /// cannot check them against what the peers send without a host wait,
    /// which is what this call avoids, so only this rank's own rows are
    /// checked; the MoE layer derives them from the counts it exchanged.
    fn all_to_all_v_start(
        &self,
        b: &Cuda,
        group: &Group,
        t: &Tensor<Cuda>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Pending<Cuda>> {
        let s = self.state();
        let (comm, me) = self.comm_of(&s, group)?;
        let n = group.size();
        if let Some(e) = crate::comm::all_to_all_v_args_error(t.shape(), n, send_rows) {
            return Err(e);
        }
        if recv_rows.len() != n || recv_rows[me] != send_rows[me] {
            return Err(self.err(format!(
                "all_to_all_v: expected receive rows {recv_rows:?} for a group of {n} where \
                 this rank (member {me}) keeps {} of its own rows",
                send_rows[me]
            )));
        }
        if n == 1 {
            return Ok(Pending::ready(Ok(t.clone())));
        }
        let mut shape = t.shape().to_vec();
        shape[0] = recv_rows.iter().sum();
        let out = b.alloc("all_to_all_v", &shape, t.dtype())?;
        let target = out.clone();
        let from = exclusive_sums(send_rows);
        self.started(&s, out, t, |stream| {
            self.exchange_rows(stream, comm, me, t, &from, send_rows, &target, recv_rows)
        })
    }

    fn broadcast(
        &self,
        b: &Cuda,
        group: &Group,
        root: usize,
        t: &Tensor<Cuda>,
    ) -> Result<Tensor<Cuda>> {
        let s = self.state();
        let (comm, _) = self.comm_of(&s, group)?;
        if root >= group.size() {
            return Err(self.err(format!(
                "broadcast: root {root} is outside a group of {}",
                group.size()
            )));
        }
        if group.size() == 1 {
            return Ok(t.clone());
        }
        let out = b.alloc("broadcast", t.shape(), t.dtype())?;
        self.on_comm_stream(&s, |stream| {
            self.nccl("broadcast", unsafe {
                sys::ncclBroadcast(
                    ptr(t),
                    ptr(&out),
                    t.numel(),
                    nccl_type(t.dtype()),
                    root as i32,
                    comm,
                    stream,
                )
            })
        })?;
        Ok(out)
    }

    fn send(&self, b: &Cuda, to: usize, t: &Tensor<Cuda>) -> Result<()> {
        let s = self.state();
        let world = Group::new((0..self.world).collect());
        let (comm, _) = self.comm_of(&s, &world)?;
        if to >= self.world || to == self.rank {
            return Err(self.err(format!("send to rank {to}: not another rank of the world")));
        }
        if t.shape().len() > HEADER_LEN - 2 {
            return Err(self.err(format!(
                "send: tensors of up to {} dimensions, not {:?}",
                HEADER_LEN - 2,
                t.shape()
            )));
        }
        let mut header = vec![0i32; HEADER_LEN];
        header[0] = dtype_code(t.dtype());
        header[1] = t.shape().len() as i32;
        for (h, &d) in header[2..].iter_mut().zip(t.shape()) {
            *h =
                i32::try_from(d).map_err(|_| self.err(format!("send: dimension {d} too large")))?;
        }
        let header = b.upload(HostData::I32(header), &[HEADER_LEN])?;
        self.on_comm_stream(&s, |stream| {
            self.nccl("sending a tensor header", unsafe {
                sys::ncclSend(
                    ptr(&header),
                    HEADER_LEN,
                    sys::ncclDataType_t::ncclInt32,
                    to as i32,
                    comm,
                    stream,
                )
            })?;
            if t.numel() > 0 {
                self.nccl("sending a tensor", unsafe {
                    sys::ncclSend(
                        ptr(t),
                        t.numel(),
                        nccl_type(t.dtype()),
                        to as i32,
                        comm,
                        stream,
                    )
                })?;
            }
            Ok(())
        })
    }

    fn recv(&self, b: &Cuda, from: usize) -> Result<Tensor<Cuda>> {
        let s = self.state();
        let world = Group::new((0..self.world).collect());
        let (comm, _) = self.comm_of(&s, &world)?;
        if from >= self.world || from == self.rank {
            return Err(self.err(format!(
                "recv from rank {from}: not another rank of the world"
            )));
        }
        let header = b.alloc("recv header", &[HEADER_LEN], DType::I32)?;
        self.on_comm_stream(&s, |stream| {
            self.nccl("receiving a tensor header", unsafe {
                sys::ncclRecv(
                    ptr(&header),
                    HEADER_LEN,
                    sys::ncclDataType_t::ncclInt32,
                    from as i32,
                    comm,
                    stream,
                )
            })
        })?;
        let h = self.read_on_comm_stream(&s, &header)?;
        let dtype = dtype_of_code(h[0])
            .ok_or_else(|| self.err(format!("recv from rank {from}: bad header {h:?}")))?;
        let ndim = h[1] as usize;
        if ndim > HEADER_LEN - 2 || h[2..2 + ndim].iter().any(|&d| d < 0) {
            return Err(self.err(format!("recv from rank {from}: bad header {h:?}")));
        }
        let shape: Vec<usize> = h[2..2 + ndim].iter().map(|&d| d as usize).collect();
        let out = b.alloc("recv", &shape, dtype)?;
        if out.numel() > 0 {
            self.on_comm_stream(&s, |stream| {
                self.nccl("receiving a tensor", unsafe {
                    sys::ncclRecv(
                        ptr(&out),
                        out.numel(),
                        nccl_type(dtype),
                        from as i32,
                        comm,
                        stream,
                    )
                })
            })?;
        }
        Ok(out)
    }

    fn barrier(&self, group: &Group) -> Result<()> {
        // The download waits for the compute stream, which waits for the
        // all-reduce on the communication stream.
        let one = self.cuda.upload(HostData::F32(vec![1.0]), &[1])?;
        let sum = self.all_reduce(&self.cuda, group, &one, ReduceOp::Sum)?;
        self.cuda.download(&sum).map(|_| ())
    }

    fn device_wait_time(&self) -> Result<Option<std::time::Duration>> {
        let ms = self
            .waits
            .take_ms()
            .map_err(|e| self.driver("reading the timed waits for communication", e))?;
        Ok(Some(std::time::Duration::from_secs_f64(ms.max(0.0) / 1e3)))
    }

    fn abort(&self, reason: &str) {
        let mut s = self.state();
        if s.aborted.is_some() {
            return;
        }
        s.aborted = Some(reason.to_string());
        // Ending the communicators makes NCCL work still queued on this rank
        // fail instead of waiting for peers forever; the handles are then
        // dead, so they are forgotten rather than destroyed again.
        for (_, c) in s.groups.drain() {
            unsafe {
                let _ = sys::ncclCommAbort(c.0);
            }
            std::mem::forget(c);
        }
        unsafe {
            let _ = sys::ncclCommAbort(s.world.0);
        }
        s.world.0 = std::ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backend::ElementwiseOps;
    use crate::comm::local::run_local;
    use crate::cpu::Cpu;

    /// The same collectives on any backend and communicator; returns every
    /// result as f32 values, in call order.
    fn script<B: crate::backend::Backend>(
        b: &B,
        c: &dyn Communicator<B>,
        n: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let r = c.rank();
        let world = Group::new((0..n).collect());
        // Reversed order: a split communicator must number members by their
        // place in the group, not by global rank.
        let reversed = Group::new((0..n).rev().collect());
        let data = |rows: usize, salt: usize| -> Result<Tensor<B>> {
            let v: Vec<f32> = (0..rows * 3)
                .map(|i| ((r * 131 + i * 17 + salt * 7) % 97) as f32 * 0.0371 - 1.5)
                .collect();
            b.upload(HostData::F32(v), &[rows, 3])
        };
        let f32s = |t: &Tensor<B>| -> Result<Vec<f32>> { Ok(b.download(t)?.to_f32()) };
        let mut out = Vec::new();
        let x = data(2 * n, 0)?;
        out.push(f32s(&c.all_reduce(b, &world, &x, ReduceOp::Sum)?)?);
        out.push(f32s(&c.all_reduce(b, &reversed, &x, ReduceOp::Max)?)?);
        out.push(f32s(&c.reduce_scatter(b, &reversed, &x)?)?);
        out.push(f32s(&c.all_gather(b, &world, &data(2, 1)?)?)?);
        out.push(f32s(&c.all_gather(b, &reversed, &data(r + 1, 2)?)?)?);
        // Started: the inputs dropped at once, compute queued before the waits.
        let scattered = c.reduce_scatter_start(b, &reversed, &data(2 * n, 6)?)?;
        let gathered = c.all_gather_start(b, &world, &data(2, 7)?)?;
        let unwaited = c.reduce_scatter_start(b, &world, &x)?;
        let busy = b.scale(&data(2 * n, 8)?, 3.0)?;
        drop(unwaited);
        out.push(f32s(&gathered.wait()?)?);
        out.push(f32s(&scattered.wait()?)?);
        out.push(f32s(&busy)?);
        let send_rows: Vec<usize> = (0..n).map(|k| (r + 2 * k) % 3).collect();
        let (got, counts) =
            c.all_to_all_v(b, &reversed, &data(send_rows.iter().sum(), 3)?, &send_rows)?;
        out.push(f32s(&got)?);
        out.push(counts.iter().map(|&k| k as f32).collect());
        // Started with the receive counts the blocking call returned.
        let rows = send_rows.iter().sum();
        let started = c.all_to_all_v_start(b, &reversed, &data(rows, 9)?, &send_rows, &counts)?;
        out.push(f32s(&started.wait()?)?);
        out.push(f32s(&c.broadcast(b, &world, 1, &data(3, 4)?)?)?);
        // Even ranks send first, odd ones receive first: NCCL's send waits on
        // the device for its receive, so a ring of sends-first would stall.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let msg = data(r + 1, 5)?;
        if r % 2 == 0 {
            c.send(b, next, &msg)?;
            out.push(f32s(&c.recv(b, prev)?)?);
        } else {
            let got = c.recv(b, prev)?;
            c.send(b, next, &msg)?;
            out.push(f32s(&got)?);
        }
        c.barrier(&world)?;
        // The CPU has no bf16: the bf16 sum comes last, on the GPU only.
        if B::NAME == "cuda" {
            let sum = c.all_reduce(b, &world, &b.cast(&x, DType::BF16)?, ReduceOp::Sum)?;
            out.push(f32s(&b.cast(&sum, DType::F32)?)?);
        }
        Ok(out)
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn collectives_match_the_local_communicator_on_every_gpu() {
        let Some(got) = on_every_gpu(|b, c, n| script(b, c, n)) else {
            return;
        };
        let n = got.len();
        let want: Vec<Vec<Vec<f32>>> =
            run_local(n, Duration::from_secs(30), |comm| script(&Cpu, &comm, n))
                .into_iter()
                .collect::<Result<_>>()
                .unwrap();
        for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len() + 1);
            // The last GPU result is the bf16 sum, against the f32 one.
            let expected = w.iter().chain(std::iter::once(&w[0]));
            for (i, (a, e)) in g.iter().zip(expected).enumerate() {
                assert_eq!(a.len(), e.len(), "rank {rank}, result {i}");
                // NCCL adds in its own order, and bf16 keeps 8 bits.
                let tol = if i == w.len() { 2e-2 } else { 1e-5 };
                for (x, y) in a.iter().zip(e) {
                    assert!(
                        (x - y).abs() <= tol * y.abs().max(1.0),
                        "rank {rank}, result {i}: {x} vs {y}"
                    );
                }
            }
        }
    }

    /// Every rank of an even number of GPUs ≥ 2 runs `f(cuda, comm, n)` on
    /// its own thread and GPU; `None` (skipped, printing why) on a machine
    /// with one GPU or an odd number; a failure on one without a GPU.
    fn on_every_gpu<T: Send>(
        f: impl Fn(&Cuda, &NcclComm, usize) -> Result<T> + Sync,
    ) -> Option<Vec<T>> {
        crate::cuda::require_test_device();
        let n = cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize;
        if n < 2 || n % 2 == 1 {
            eprintln!("skipping the NCCL test: it needs an even number of GPUs ≥ 2, found {n}");
            return None;
        }
        let id = NcclComm::unique_id().unwrap();
        let groups = [Group::new((0..n).rev().collect())];
        let f = &f;
        Some(std::thread::scope(|s| {
            let threads: Vec<_> = (0..n)
                .map(|rank| {
                    let (id, groups) = (&id, &groups);
                    s.spawn(move || -> Result<T> {
                        let cuda = Cuda::new(rank)?;
                        let comm = NcclComm::new(&cuda, rank, n, id, groups)?;
                        f(&cuda, &comm, n)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("rank thread panicked").unwrap())
                .collect()
        }))
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn collectives_on_their_stream_stay_ordered_with_compute_and_the_pool() {
        // Each round, compute writes a fresh input (a pool block), NCCL sums
        // it on the communication stream, the input is dropped at once and
        // the next compute op likely gets its block; compute then adds the
        // sum. A missing event wait on either side shows as a wrong total.
        // Nothing reads to the host until the end, so nothing else orders
        // the streams; the tensors are large enough for the race to show.
        const ROUNDS: usize = 32;
        const LEN: usize = 1 << 22;
        let got = on_every_gpu(|b, c, n| {
            let world = Group::new((0..n).collect());
            let r = c.rank();
            let base: Vec<f32> = (0..LEN).map(|j| ((r + 1) * (j % 7)) as f32).collect();
            let base = b.upload(HostData::F32(base), &[LEN])?;
            let mut total = b.zeros(&[LEN], DType::F32)?;
            // The first reading starts the timing of the waits.
            assert_eq!(c.device_wait_time()?, Some(std::time::Duration::ZERO));
            for i in 0..ROUNDS {
                let x = b.scale(&base, i as f64)?;
                let sum = c.all_reduce(b, &world, &x, ReduceOp::Sum)?;
                drop(x);
                let overwrite = b.scale(&base, -1.0)?;
                total = b.add(&total, &sum)?;
                drop(overwrite);
                // Started: the compute queued before the wait overlaps it,
                // and reuses no block the collective still reads or writes.
                let x = b.scale(&base, i as f64)?;
                let started =
                    c.reduce_scatter_start(b, &world, &x.clone().reshape(&[n, LEN / n])?)?;
                drop(x);
                let overwrite = b.scale(&base, -2.0)?;
                let part = started.wait()?;
                drop(overwrite);
                let all = c.all_gather(b, &world, &part)?;
                total = b.add(&total, &all.reshape(&[LEN])?)?;
                // Uneven all-to-all-v: counts read on the host, rows moved
                // by grouped sends on the communication stream.
                let rows: Vec<usize> = (0..n).map(|k| (k + i) % 3).collect();
                let t = b.upload(
                    HostData::F32(vec![i as f32; rows.iter().sum::<usize>()]),
                    &[rows.iter().sum::<usize>(), 1],
                )?;
                let (got, counts) = c.all_to_all_v(b, &world, &t, &rows)?;
                assert_eq!(counts, vec![(r + i) % 3; n]);
                assert_eq!(
                    b.download(&got)?.to_f32(),
                    vec![i as f32; counts.iter().sum()]
                );
            }
            let total = b.download(&total)?.to_f32();
            // Every one of those calls made compute wait, timed: a finite
            // stall, read once (the next reading starts from zero).
            let waited = c.device_wait_time()?.expect("NCCL times its waits");
            let none_since = c.device_wait_time()?.expect("NCCL times its waits");
            assert!(waited.as_secs_f64().is_finite(), "{waited:?}");
            assert_eq!(none_since, std::time::Duration::ZERO);
            Ok((total, n))
        });
        let Some(got) = got else { return };
        // Twice (blocking, started) Σ_i i · Σ_r (r + 1)(j mod 7), exact in f32.
        let rounds: f32 = 2.0 * (0..ROUNDS).map(|i| i as f32).sum::<f32>();
        for (rank, (total, n)) in got.iter().enumerate() {
            let ranks: f32 = (1..=*n).map(|r| r as f32).sum();
            for (j, &v) in total.iter().enumerate() {
                let want = rounds * ranks * (j % 7) as f32;
                assert_eq!(v, want, "rank {rank}, element {j}");
            }
        }
    }

    #[test]
    #[cfg_attr(
        not(foldmoe_gpu_tests),
        ignore = "needs a CUDA GPU: RUSTFLAGS='--cfg foldmoe_gpu_tests' cargo test"
    )]
    fn a_group_not_given_at_start_is_a_clear_error() {
        let cuda = crate::cuda::require_test_device();
        let id = NcclComm::unique_id().unwrap();
        let comm = NcclComm::new(&cuda, 0, 1, &id, &[Group::new(vec![0])]).unwrap();
        let t = cuda.upload(HostData::F32(vec![1.0, 2.0]), &[2]).unwrap();
        // A one-rank world: its collectives are copies.
        let world = Group::new(vec![0]);
        let s = comm.all_reduce(&cuda, &world, &t, ReduceOp::Sum).unwrap();
        assert_eq!(cuda.download(&s).unwrap(), HostData::F32(vec![1.0, 2.0]));
        let err = comm
            .all_reduce(&cuda, &Group::new(vec![0, 1]), &t, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(err.contains("group [0, 1]"), "{err}");
        comm.abort("test");
        let err = comm.barrier(&world).unwrap_err().to_string();
        assert!(err.contains("aborted earlier: test"), "{err}");
    }
}
