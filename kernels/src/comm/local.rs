//! N ranks as threads of one process, exchanging through shared memory
//! (docs/ARCHITECTURE.md §7): the communicator of tests and CPU runs.
//!
//! [`LocalWorld::comms`] makes one [`LocalComm`] per rank, all sharing one
//! state behind a mutex and a condition variable; [`run_local`] runs a
//! closure on each of them in its own thread and returns every rank's result.
//!
//! # Matching
//!
//! Each handle counts its calls per group (the group's ordered rank list is
//! the key), and a collective meets the calls with the same count on the
//! same group. So the tensor-parallel and the expert-parallel groups can run
//! interleaved on different threads without their calls mixing, and a member
//! that calls a different op, or passes an incompatible dtype or shape, is
//! reported to every member as a [`KernelError::Comm`] naming both sides,
//! instead of a hang. A member whose own arguments are wrong (a `send_rows`
//! that does not add up, an indivisible `reduce_scatter`, a root outside the
//! group) gets the argument error at once, and its peers a
//! [`KernelError::Comm`] naming it.
//!
//! Values travel as host copies ([`Device::download`] and
//! [`Device::upload`]), in the tensor's dtype. Reductions fold the
//! contributions in group order, `((t₀ + t₁) + t₂) + …`, so the result is
//! bit-identical on every member and on every run, whatever the timing.
//!
//! # Failure
//!
//! Nothing waits forever:
//! - [`Communicator::abort`] (called by [`run_local`] when a rank returns an
//!   error or panics, and by the handle's `Drop` while its thread panics)
//!   fails the whole world, groups without the aborted rank included: every
//!   later call, and every pending one still missing a contribution, on
//!   every rank returns a [`KernelError::Comm`] naming the first aborted
//!   rank and its reason, at once rather than at the timeout (a collective
//!   whose contributions were all in still completes, so its members agree
//!   on its outcome);
//! - a handle dropped without a panic has left: a collective still waiting
//!   for its contribution, a `recv` from it with nothing queued, or a `send`
//!   to it, is an error (what it contributed or sent before leaving is still
//!   delivered, so a rank may finish and drop its handle while its peers
//!   collect the last results);
//! - any other wait ends after the handle's timeout (default
//!   [`DEFAULT_TIMEOUT`]) with an error naming the op, the group and the
//!   ranks that have not arrived.
//!
//! After a call has failed the handle's per-group counts may no longer match
//! its peers'; abort it rather than calling on.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    abort_failure, wait_for_change, Call, CallSig, Calls, Communicator, Group, Landed, Op, Pending,
    Progress, ReduceOp,
};
use crate::backend::Device;
use crate::error::{arg_err, shape_err, KernelError, Result};
use crate::tensor::{DType, HostData, Tensor};

/// How long a call waits for its peers unless told otherwise: long enough for
/// a slow rank's step on a loaded CPU, short enough that a lost rank is
/// reported within a minute.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Builder of a world of `n` connected [`LocalComm`] handles.
#[derive(Clone, Debug)]
pub struct LocalWorld {
    n: usize,
    timeout: Duration,
}

impl LocalWorld {
    /// A world of `n` ranks, waiting at most [`DEFAULT_TIMEOUT`] per call.
    pub fn new(n: usize) -> Self {
        LocalWorld {
            n,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Sets how long every handle waits for its peers before a call fails.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// One handle per rank, in rank order, all connected to each other.
    pub fn comms(self) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            n: self.n,
            state: Mutex::new(State {
                aborted: Vec::new(),
                departed: vec![false; self.n],
                slots: HashMap::new(),
                mail: HashMap::new(),
            }),
            cv: Condvar::new(),
        });
        (0..self.n)
            .map(|rank| LocalComm {
                core: Core {
                    rank,
                    timeout: self.timeout,
                    shared: Arc::clone(&shared),
                },
                calls: Calls::default(),
                managed: false,
                progress: Progress::new(rank),
            })
            .collect()
    }
}

/// Runs `f` once per rank of a new world of `n` ranks, each in its own
/// scoped thread, and returns each rank's result in rank order.
///
/// A rank whose `f` returns an error or panics is aborted, so its peers stop
/// with a [`KernelError::Comm`] instead of waiting for it; a panic becomes
/// that rank's [`KernelError::Comm`] carrying the panic message.
pub fn run_local<T, F>(n: usize, timeout: Duration, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(LocalComm) -> Result<T> + Sync,
{
    let comms = LocalWorld::new(n).with_timeout(timeout).comms();
    let f = &f;
    std::thread::scope(|scope| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let rank = comm.core.rank;
                // `f` consumes the handle, and would drop it (leaving the
                // world) before its error could be reported: `run_rank`
                // reports the outcome itself, through a second reference.
                comm.managed = true;
                let shared = Arc::clone(&comm.core.shared);
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, {
                        let shared = Arc::clone(&shared);
                        move || run_rank(rank, &shared, || f(comm))
                    });
                (rank, shared, spawned)
            })
            .collect();
        threads
            .into_iter()
            .map(|(rank, shared, spawned)| {
                let comm_err = |detail: String| KernelError::Comm { rank, detail };
                match spawned {
                    Ok(handle) => handle.join().unwrap_or_else(|payload| {
                        Err(comm_err(format!(
                            "rank {rank} panicked: {}",
                            panic_message(payload.as_ref())
                        )))
                    }),
                    Err(e) => {
                        let reason = format!("could not start the thread of rank {rank}: {e}");
                        shared.abort(rank, reason.clone());
                        shared.depart(rank);
                        Err(comm_err(reason))
                    }
                }
            })
            .collect()
    })
}

/// One rank's body under [`run_local`]: runs `body`, then aborts the rank on
/// an error or a panic (with the error or the panic message as the reason),
/// so its peers are released, and finally marks it departed.
fn run_rank<T>(rank: usize, shared: &Shared, body: impl FnOnce() -> Result<T>) -> Result<T> {
    let out = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            shared.abort(rank, format!("rank {rank} returned an error: {e}"));
            Err(e)
        }
        Err(payload) => {
            let detail = format!("rank {rank} panicked: {}", panic_message(payload.as_ref()));
            shared.abort(rank, detail.clone());
            Err(KernelError::Comm { rank, detail })
        }
    };
    shared.depart(rank);
    out
}

/// The text of a panic payload (`panic!` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// One rank's handle on a world made by [`LocalWorld`].
///
/// Dropping it while its thread panics aborts the rank ("rank N panicked");
/// dropping it otherwise means the rank has left (see the module docs).
/// Under [`run_local`] the drop does neither: `run_local` reports the rank's
/// end itself, with the error or the panic message as the reason.
pub struct LocalComm {
    core: Core,
    /// Calls made so far on each group: the number that matches a call
    /// with its peers' calls.
    calls: Calls,
    /// Run by [`run_local`], which reports the rank's end itself: `Drop`
    /// then does nothing.
    managed: bool,
    /// Runs the collectives started on this handle.
    progress: Progress,
}

/// What a collective of one rank needs once its place among the group's
/// calls is taken: the blocking calls use it on the caller's thread, the
/// started ones on the handle's progress thread.
#[derive(Clone)]
struct Core {
    rank: usize,
    timeout: Duration,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.core.rank)
            .field("world", &self.core.shared.n)
            .field("timeout", &self.core.timeout)
            .finish()
    }
}

/// What the handles of one world share.
struct Shared {
    n: usize,
    state: Mutex<State>,
    /// Signalled on every change of `state`: all waiters recheck their
    /// condition, which keeps one primitive for every kind of wait.
    cv: Condvar,
}

impl Shared {
    /// The state, even if a thread panicked while holding the lock: every
    /// update is a single insert or push, so the state stays consistent, and
    /// failing here would turn one rank's panic into everyone's.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `rank` as gone (its handle dropped) and wakes every waiter.
    fn depart(&self, rank: usize) {
        self.lock().departed[rank] = true;
        self.cv.notify_all();
    }

    /// Marks `rank` failed (its first reason is kept) and wakes every waiter.
    fn abort(&self, rank: usize, reason: String) {
        let mut st = self.lock();
        if !st.aborted.iter().any(|(r, _)| *r == rank) {
            st.aborted.push((rank, reason));
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// The world's mutable state.
struct State {
    /// Aborted ranks with their reasons, in the order they aborted.
    aborted: Vec<(usize, String)>,
    /// Ranks whose handle was dropped.
    departed: Vec<bool>,
    /// Collectives in progress, keyed by the group's ranks and call number.
    slots: HashMap<(Vec<usize>, u64), Slot>,
    /// Point-to-point messages not yet received, keyed by (from, to).
    mail: HashMap<(usize, usize), VecDeque<Message>>,
}

/// One collective call being assembled.
struct Slot {
    /// Each member's contribution, by group index.
    parts: Vec<Option<Arc<Part>>>,
    /// Members that are done with the slot; at the group size it is removed.
    taken: usize,
}

/// A tensor in flight from `send` to `recv`.
struct Message {
    data: HostData,
    shape: Vec<usize>,
    dtype: DType,
}

/// One member's contribution to a collective.
struct Part {
    op: Op,
    /// The tensor's dtype and shape (unused by `barrier`).
    dtype: DType,
    shape: Vec<usize>,
    /// The values; `None` where the op does not need them (barrier,
    /// broadcast from another member, invalid arguments).
    data: Option<HostData>,
    /// Rows sent to each member (`all_to_all_v` only).
    send_rows: Vec<usize>,
    /// This member's arguments were wrong: it has returned this error, and
    /// its peers report it instead of waiting for data that will not come.
    invalid: Option<KernelError>,
}

impl Part {
    /// A contribution describing tensor `t`.
    fn of<B: Device>(op: Op, t: &Tensor<B>, data: Option<HostData>) -> Part {
        Part {
            op,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data,
            send_rows: Vec::new(),
            invalid: None,
        }
    }
}

/// Every member's contribution to one completed collective.
struct Gathered {
    parts: Vec<Arc<Part>>,
    /// This rank's group index.
    me: usize,
    /// "op on group [..] (call #k on this group)", prefixed to messages.
    ctx: String,
}

impl LocalComm {
    // `rank`, `world`, `barrier` and `abort` are also inherent methods:
    // their trait versions do not mention the device type, so on a handle
    // that implements `Communicator<B>` for every `B` a plain `c.rank()`
    // would not know which impl to call.

    /// This rank's global index.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Number of ranks in the world.
    pub fn world(&self) -> usize {
        self.core.shared.n
    }

    /// How long a call waits for its peers before failing.
    pub fn timeout(&self) -> Duration {
        self.core.timeout
    }

    /// Returns once every member of `group` has called it (also reachable as
    /// [`Communicator::barrier`], which needs the device type spelled out).
    pub fn barrier(&self, group: &Group) -> Result<()> {
        let part = Part {
            op: Op::Barrier,
            dtype: DType::F32,
            shape: Vec::new(),
            data: None,
            send_rows: Vec::new(),
            invalid: None,
        };
        self.exchange(group, part).map(|_| ())
    }

    /// Marks this rank failed with `reason` (also reachable as
    /// [`Communicator::abort`]): every pending and later call on every rank
    /// returns an error naming this rank and the reason.
    pub fn abort(&self, reason: &str) {
        self.core.shared.abort(self.core.rank, reason.to_string());
    }

    /// Checks `group` and takes this rank's next place among its calls:
    /// the call's number is fixed here, in the order the caller makes its
    /// calls, wherever the call then runs.
    fn enter(&self, group: &Group, op: Op) -> Result<Call> {
        self.calls
            .enter(self.core.rank, self.core.shared.n, group, op)
    }

    /// Contributes `part` to this rank's next call on `group` and waits for
    /// every member's contribution, then checks that they agree.
    fn exchange(&self, group: &Group, part: Part) -> Result<Gathered> {
        self.core.exchange(&self.enter(group, part.op)?, part)
    }

    /// Runs `finish` (a collective's host part) on this thread and uploads
    /// its result as `dtype`.
    fn run<B: Device>(
        &self,
        b: &B,
        dtype: DType,
        call: Call,
        part: Part,
        finish: Finish,
    ) -> Result<Tensor<B>> {
        let (values, shape) = finish(&self.core, &call, part)?;
        upload_as(b, values, &shape, dtype)
    }

    /// Queues `finish` on the progress thread (see [`super`], "Started
    /// collectives").
    fn start<B: Device>(
        &self,
        b: &B,
        dtype: DType,
        call: Call,
        part: Part,
        finish: Finish,
    ) -> Result<Pending<B>> {
        let core = self.core.clone();
        let ctx = call.ctx.clone();
        self.progress
            .start(b, dtype, ctx, move || finish(&core, &call, part))
    }
}

/// The host part of a collective whose arguments were checked and whose
/// place is taken: the exchange and this rank's result.
type Finish = fn(&Core, &Call, Part) -> Landed;

impl Core {
    fn comm_err(&self, detail: String) -> KernelError {
        KernelError::Comm {
            rank: self.rank,
            detail,
        }
    }

    /// The error every call returns once some rank has aborted.
    fn failure(&self, st: &State, ctx: &str) -> Option<KernelError> {
        abort_failure(self.rank, &st.aborted, ctx)
    }

    /// Contributes `part` to `call` and waits for every member's
    /// contribution, then checks that they agree.
    fn exchange(&self, call: &Call, part: Part) -> Result<Gathered> {
        let (group, me, seq) = (&call.group, call.me, call.seq);
        let ctx = call.ctx.clone();
        let size = group.size();
        let key = (group.ranks().to_vec(), seq);
        let deadline = Instant::now() + self.timeout;
        let own_invalid = part.invalid.clone();

        let mut st = self.shared.lock();
        // Wrong arguments are reported as such even when the world has
        // already failed: the caller's own mistake is the more useful news.
        if own_invalid.is_none() {
            if let Some(e) = self.failure(&st, &ctx) {
                return Err(e);
            }
        }
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
            parts: vec![None; size],
            taken: 0,
        });
        slot.parts[me] = Some(Arc::new(part));
        if let Some(e) = own_invalid {
            // Leave the invalid contribution for the peers to report, and
            // return at once: there is nothing to wait for.
            take(&mut st, &key, size);
            drop(st);
            self.shared.cv.notify_all();
            return Err(e);
        }
        self.shared.cv.notify_all();

        loop {
            // Order of the checks: a member's bad arguments, then completion
            // (a call whose contributions are all in succeeds even if a
            // member aborted since: the data is there, and every member
            // sees the same outcome), then failure, departure and timeout.
            let Some(slot) = st.slots.get(&key) else {
                return Err(self.comm_err(format!(
                    "{ctx}: the call's state vanished before it completed (internal error)"
                )));
            };
            let ranks = group.ranks();
            let bad = slot
                .parts
                .iter()
                .enumerate()
                .find_map(|(i, p)| Some((i, p.as_ref()?.invalid.clone()?)));
            if let Some((i, e)) = bad {
                take(&mut st, &key, size);
                return Err(self.comm_err(format!(
                    "{ctx}: rank {} passed invalid arguments: {e}",
                    ranks[i]
                )));
            }
            if slot.parts.iter().all(Option::is_some) {
                let parts: Vec<Arc<Part>> = slot.parts.iter().flatten().cloned().collect();
                take(&mut st, &key, size);
                drop(st);
                let gathered = Gathered { parts, me, ctx };
                self.check_agreement(group, &gathered)?;
                return Ok(gathered);
            }
            if let Some(e) = self.failure(&st, &ctx) {
                return Err(e);
            }
            let missing: Vec<usize> = slot
                .parts
                .iter()
                .zip(ranks)
                .filter(|(p, _)| p.is_none())
                .map(|(_, &r)| r)
                .collect();
            if let Some(&r) = missing.iter().find(|&&r| st.departed[r]) {
                return Err(self.comm_err(format!(
                    "{ctx}: rank {r} dropped its communicator without making this call"
                )));
            }
            st = wait_for_change(st, &self.shared.cv, deadline, || {
                self.comm_err(format!(
                    "{ctx}: timed out after {:?}: ranks {missing:?} have not arrived",
                    self.timeout
                ))
            })?;
        }
    }

    /// Checks that every member called the same op with compatible tensors.
    fn check_agreement(&self, group: &Group, g: &Gathered) -> Result<()> {
        let calls: Vec<CallSig> = g
            .parts
            .iter()
            .map(|p| CallSig {
                op: p.op,
                dtype: p.dtype,
                shape: &p.shape,
            })
            .collect();
        super::check_agreement(&g.ctx, group.ranks(), &calls).map_err(|m| self.comm_err(m))
    }

    /// The values of member `i`'s contribution.
    fn data<'a>(&self, g: &'a Gathered, i: usize) -> Result<&'a HostData> {
        g.parts[i].data.as_ref().ok_or_else(|| {
            self.comm_err(format!(
                "{}: member {i} sent no values (internal error)",
                g.ctx
            ))
        })
    }

    /// Turns a helper's `None` (contributions of different dtypes or lengths,
    /// which the agreement check rules out) into an error, not a panic.
    fn internal(&self, g: &Gathered, out: Option<HostData>) -> Result<HostData> {
        out.ok_or_else(|| {
            self.comm_err(format!(
                "{}: contributions disagree in dtype or length (internal error)",
                g.ctx
            ))
        })
    }
}

/// Marks one member done with slot `key`, removing it after the last one.
fn take(st: &mut State, key: &(Vec<usize>, u64), size: usize) {
    if let Some(slot) = st.slots.get_mut(key) {
        slot.taken += 1;
        if slot.taken >= size {
            st.slots.remove(key);
        }
    }
}

/// Error of an op that splits along dimension 0 and got a 0-d tensor.
pub(super) fn needs_dim0(op: &'static str, shape: &[usize]) -> Option<KernelError> {
    shape.is_empty().then(|| {
        shape_err(
            op,
            "a 0-d tensor has no dimension 0 to split or concatenate; reshape it to [1]",
        )
    })
}

/// Uploads `data` as a tensor of `shape`, cast back to `dtype` when the
/// host copy had another type (bf16 reads back as f32).
pub(super) fn upload_as<B: Device>(
    b: &B,
    data: HostData,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor<B>> {
    let t = b.upload(data, shape)?;
    if t.dtype() == dtype {
        Ok(t)
    } else {
        b.cast(&t, dtype)
    }
}

/// The element types of [`HostData`], for the generic reduce and copy.
trait Elem: Copy {
    fn slice(h: &HostData) -> Option<&[Self]>;
    fn host(v: Vec<Self>) -> HostData;
    fn combine(self, other: Self, op: ReduceOp) -> Self;
}

macro_rules! float_elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            fn slice(h: &HostData) -> Option<&[Self]> {
                match h {
                    HostData::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn host(v: Vec<Self>) -> HostData {
                HostData::$variant(v)
            }
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum => self + other,
                    // NaN wins, so a non-finite value on any rank is seen by
                    // all (`f32::max` would drop it).
                    ReduceOp::Max if self.is_nan() => self,
                    ReduceOp::Max if other.is_nan() => other,
                    ReduceOp::Max => self.max(other),
                }
            }
        }
    };
}
float_elem!(f32, F32);
float_elem!(f64, F64);

impl Elem for i32 {
    fn slice(h: &HostData) -> Option<&[Self]> {
        match h {
            HostData::I32(v) => Some(v),
            _ => None,
        }
    }
    fn host(v: Vec<Self>) -> HostData {
        HostData::I32(v)
    }
    fn combine(self, other: Self, op: ReduceOp) -> Self {
        match op {
            // Wrapping like the device's integer adds, never a panic.
            ReduceOp::Sum => self.wrapping_add(other),
            ReduceOp::Max => self.max(other),
        }
    }
}

/// Elements `range` of every part combined with `op`, folded in order.
fn reduce_t<T: Elem>(parts: &[&HostData], range: Range<usize>, op: ReduceOp) -> Option<HostData> {
    let (first, rest) = parts.split_first()?;
    let mut acc = T::slice(first)?.get(range.clone())?.to_vec();
    for h in rest {
        let xs = T::slice(h)?.get(range.clone())?;
        for (a, &x) in acc.iter_mut().zip(xs) {
            *a = a.combine(x, op);
        }
    }
    Some(T::host(acc))
}

pub(super) fn reduce_host(
    parts: &[&HostData],
    range: Range<usize>,
    op: ReduceOp,
) -> Option<HostData> {
    match parts.first()? {
        HostData::F32(_) => reduce_t::<f32>(parts, range, op),
        HostData::F64(_) => reduce_t::<f64>(parts, range, op),
        HostData::I32(_) => reduce_t::<i32>(parts, range, op),
    }
}

/// The given element ranges of the given parts, concatenated in order.
fn concat_t<T: Elem>(pieces: &[(&HostData, Range<usize>)]) -> Option<HostData> {
    let total = pieces.iter().map(|(_, r)| r.len()).sum();
    let mut out = Vec::with_capacity(total);
    for (h, r) in pieces {
        out.extend_from_slice(T::slice(h)?.get(r.clone())?);
    }
    Some(T::host(out))
}

pub(super) fn concat_host(pieces: &[(&HostData, Range<usize>)]) -> Option<HostData> {
    match pieces.first()?.0 {
        HostData::F32(_) => concat_t::<f32>(pieces),
        HostData::F64(_) => concat_t::<f64>(pieces),
        HostData::I32(_) => concat_t::<i32>(pieces),
    }
}

impl LocalComm {
    /// This rank's contribution to its next `op` on `group` and the call's
    /// place: `t`'s values read to the host, unless its arguments are
    /// `invalid` (then the contribution carries the error to the peers).
    fn contribution<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        op: Op,
        invalid: Option<KernelError>,
        send_rows: &[usize],
    ) -> Result<(Call, Part)> {
        let data = if invalid.is_none() {
            Some(b.download(t)?)
        } else {
            None
        };
        let part = Part {
            invalid,
            send_rows: send_rows.to_vec(),
            ..Part::of(op, t, data)
        };
        Ok((self.enter(group, op)?, part))
    }

    /// `reduce_scatter`'s contribution (its arguments checked, its values
    /// read to the host) and place.
    fn reduce_scatter_call<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
    ) -> Result<(Call, Part)> {
        let invalid = super::reduce_scatter_args_error(t.shape(), group.size());
        self.contribution(b, group, t, Op::ReduceScatter, invalid, &[])
    }

    /// `all_gather`'s contribution and place.
    fn all_gather_call<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
    ) -> Result<(Call, Part)> {
        let invalid = needs_dim0("all_gather", t.shape());
        self.contribution(b, group, t, Op::AllGather, invalid, &[])
    }

    /// `all_to_all_v`'s contribution and place.
    fn all_to_all_v_call<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Call, Part)> {
        let invalid = super::all_to_all_v_args_error(t.shape(), group.size(), send_rows);
        self.contribution(b, group, t, Op::AllToAllV, invalid, send_rows)
    }
}

impl Core {
    /// `reduce_scatter` from its place: only this member's part is summed,
    /// elementwise, so the same bits as summing everything and splitting.
    fn reduce_scatter(&self, call: &Call, part: Part) -> Landed {
        let size = call.group.size();
        let mut shape = part.shape.clone();
        let numel: usize = shape.iter().product();
        let g = self.exchange(call, part)?;
        let hosts = (0..g.parts.len())
            .map(|i| self.data(&g, i))
            .collect::<Result<Vec<_>>>()?;
        let chunk = numel / size;
        let range = g.me * chunk..(g.me + 1) * chunk;
        let out = self.internal(&g, reduce_host(&hosts, range, ReduceOp::Sum))?;
        shape[0] /= size;
        Ok((out, shape))
    }

    /// `all_to_all_v` from its place: the rows every member addressed to
    /// this one, in group order, with their shape and the row count from
    /// each member.
    fn all_to_all_v(&self, call: &Call, part: Part) -> Result<(HostData, Vec<usize>, Vec<usize>)> {
        let mut shape = part.shape.clone();
        let row_len: usize = shape[1..].iter().product();
        let g = self.exchange(call, part)?;
        let mut pieces = Vec::with_capacity(g.parts.len());
        let mut counts = Vec::with_capacity(g.parts.len());
        for (i, p) in g.parts.iter().enumerate() {
            let start: usize = p.send_rows[..g.me].iter().sum();
            let rows = p.send_rows[g.me];
            pieces.push((self.data(&g, i)?, start * row_len..(start + rows) * row_len));
            counts.push(rows);
        }
        let out = self.internal(&g, concat_host(&pieces))?;
        shape[0] = counts.iter().sum();
        Ok((out, shape, counts))
    }

    /// `all_gather` from its place: every member's values in group order.
    fn all_gather(&self, call: &Call, part: Part) -> Landed {
        let mut shape = part.shape.clone();
        let g = self.exchange(call, part)?;
        let mut pieces = Vec::with_capacity(g.parts.len());
        for i in 0..g.parts.len() {
            let h = self.data(&g, i)?;
            pieces.push((h, 0..h.len()));
        }
        let out = self.internal(&g, concat_host(&pieces))?;
        shape[0] = g.parts.iter().map(|p| p.shape[0]).sum();
        Ok((out, shape))
    }
}

impl<B: Device> Communicator<B> for LocalComm {
    fn rank(&self) -> usize {
        LocalComm::rank(self)
    }

    fn world(&self) -> usize {
        LocalComm::world(self)
    }

    fn all_reduce(&self, b: &B, group: &Group, t: &Tensor<B>, op: ReduceOp) -> Result<Tensor<B>> {
        let part = Part::of(Op::AllReduce(op), t, Some(b.download(t)?));
        let g = self.exchange(group, part)?;
        let hosts = (0..g.parts.len())
            .map(|i| self.core.data(&g, i))
            .collect::<Result<Vec<_>>>()?;
        let out = self
            .core
            .internal(&g, reduce_host(&hosts, 0..t.numel(), op))?;
        upload_as(b, out, t.shape(), t.dtype())
    }

    fn reduce_scatter(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        let (call, part) = self.reduce_scatter_call(b, group, t)?;
        self.run(b, t.dtype(), call, part, Core::reduce_scatter)
    }

    fn reduce_scatter_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        let (call, part) = self.reduce_scatter_call(b, group, t)?;
        self.start(b, t.dtype(), call, part, Core::reduce_scatter)
    }

    fn all_gather(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        let (call, part) = self.all_gather_call(b, group, t)?;
        self.run(b, t.dtype(), call, part, Core::all_gather)
    }

    fn all_gather_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        let (call, part) = self.all_gather_call(b, group, t)?;
        self.start(b, t.dtype(), call, part, Core::all_gather)
    }

    fn all_to_all_v(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Tensor<B>, Vec<usize>)> {
        let (call, part) = self.all_to_all_v_call(b, group, t, send_rows)?;
        let (values, shape, counts) = self.core.all_to_all_v(&call, part)?;
        Ok((upload_as(b, values, &shape, t.dtype())?, counts))
    }

    fn all_to_all_v_start(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Pending<B>> {
        let (call, part) = self.all_to_all_v_call(b, group, t, send_rows)?;
        if part.invalid.is_some() {
            // Told to the peers and returned here, at the start.
            return Err(match self.core.all_to_all_v(&call, part) {
                Err(e) => e,
                Ok(_) => self.core.comm_err(format!(
                    "{}: invalid arguments were accepted (internal error)",
                    call.ctx
                )),
            });
        }
        let (core, ctx) = (self.core.clone(), call.ctx.clone());
        let expected = recv_rows.to_vec();
        self.progress.start(b, t.dtype(), ctx, move || {
            let (values, shape, counts) = core.all_to_all_v(&call, part)?;
            super::check_recv_rows(&call.ctx, &counts, &expected)
                .map_err(|detail| core.comm_err(detail))?;
            Ok((values, shape))
        })
    }

    fn broadcast(&self, b: &B, group: &Group, root: usize, t: &Tensor<B>) -> Result<Tensor<B>> {
        let size = group.size();
        let invalid = (root >= size).then(|| {
            arg_err(
                "broadcast",
                format!("root {root} is not a group index: the group has {size} members"),
            )
        });
        let is_root = group.index_of(self.core.rank) == Some(root);
        let data = if invalid.is_none() && is_root {
            Some(b.download(t)?)
        } else {
            None
        };
        let part = Part {
            invalid,
            ..Part::of(Op::Broadcast { root }, t, data)
        };
        let g = self.exchange(group, part)?;
        let out = self.core.data(&g, root)?.clone();
        let r = &g.parts[root];
        upload_as(b, out, &r.shape, r.dtype)
    }

    fn send(&self, b: &B, to: usize, t: &Tensor<B>) -> Result<()> {
        let n = self.core.shared.n;
        if to >= n {
            return Err(arg_err(
                "send",
                format!("destination rank {to} is outside the world of {n} ranks"),
            ));
        }
        let msg = Message {
            data: b.download(t)?,
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
        };
        let ctx = format!("send from rank {} to rank {to}", self.core.rank);
        let mut st = self.core.shared.lock();
        if let Some(e) = self.core.failure(&st, &ctx) {
            return Err(e);
        }
        if st.departed[to] {
            return Err(self
                .core
                .comm_err(format!("{ctx}: rank {to} has dropped its communicator")));
        }
        st.mail
            .entry((self.core.rank, to))
            .or_default()
            .push_back(msg);
        drop(st);
        self.core.shared.cv.notify_all();
        Ok(())
    }

    fn recv(&self, b: &B, from: usize) -> Result<Tensor<B>> {
        let n = self.core.shared.n;
        if from >= n {
            return Err(arg_err(
                "recv",
                format!("source rank {from} is outside the world of {n} ranks"),
            ));
        }
        let ctx = format!("recv on rank {} from rank {from}", self.core.rank);
        let deadline = Instant::now() + self.core.timeout;
        let mut st = self.core.shared.lock();
        let msg = loop {
            if let Some(e) = self.core.failure(&st, &ctx) {
                return Err(e);
            }
            if let Some(msg) = st
                .mail
                .get_mut(&(from, self.core.rank))
                .and_then(VecDeque::pop_front)
            {
                break msg;
            }
            if st.departed[from] {
                return Err(self.core.comm_err(format!(
                    "{ctx}: rank {from} dropped its communicator with nothing left to send"
                )));
            }
            st = wait_for_change(st, &self.core.shared.cv, deadline, || {
                self.core.comm_err(format!(
                    "{ctx}: timed out after {:?}: rank {from} has sent nothing",
                    self.core.timeout
                ))
            })?;
        };
        drop(st);
        upload_as(b, msg.data, &msg.shape, msg.dtype)
    }

    fn barrier(&self, group: &Group) -> Result<()> {
        LocalComm::barrier(self, group)
    }

    fn abort(&self, reason: &str) {
        LocalComm::abort(self, reason)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        if self.managed {
            return;
        }
        // The panic message is not reachable from here; `run_local` catches
        // the panic instead and passes it on.
        if std::thread::panicking() {
            self.core
                .shared
                .abort(self.core.rank, format!("rank {} panicked", self.core.rank));
        }
        self.core.shared.depart(self.core.rank);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Cpu;

    /// Generous: the failure tests assert they finish well before it.
    const TIMEOUT: Duration = Duration::from_secs(5);

    fn t32(v: &[f32], shape: &[usize]) -> Tensor<Cpu> {
        Cpu.upload(HostData::F32(v.to_vec()), shape).unwrap()
    }

    fn t64(v: &[f64], shape: &[usize]) -> Tensor<Cpu> {
        Cpu.upload(HostData::F64(v.to_vec()), shape).unwrap()
    }

    fn ti32(v: &[i32], shape: &[usize]) -> Tensor<Cpu> {
        Cpu.upload(HostData::I32(v.to_vec()), shape).unwrap()
    }

    fn host(t: &Tensor<Cpu>) -> HostData {
        Cpu.download(t).unwrap()
    }

    fn world_group(n: usize) -> Group {
        Group::new((0..n).collect())
    }

    /// Every rank's `Ok` value, or a panic showing every rank's result.
    fn all_ok<T: std::fmt::Debug>(results: Vec<Result<T>>) -> Vec<T> {
        assert!(results.iter().all(Result::is_ok), "{results:#?}");
        results.into_iter().map(Result::unwrap).collect()
    }

    /// The detail of a `Comm` error, or a panic naming what came instead.
    fn comm_detail<T: std::fmt::Debug>(r: &Result<T>) -> &str {
        match r {
            Err(KernelError::Comm { detail, .. }) => detail,
            other => panic!("expected a Comm error, got {other:?}"),
        }
    }

    #[test]
    fn all_reduce_sums_and_maxes_for_1_to_4_ranks() {
        for n in 1..=4 {
            let out = all_ok(run_local(n, TIMEOUT, |c| {
                let r = c.rank() as f32;
                let g = world_group(n);
                let x = t32(&[r + 1.0, -10.0 * r, 0.5], &[3]);
                let sum = c.all_reduce(&Cpu, &g, &x, ReduceOp::Sum)?;
                let max = c.all_reduce(&Cpu, &g, &x, ReduceOp::Max)?;
                Ok((host(&sum), host(&max), sum.shape().to_vec()))
            }));
            // Σ(r+1) = n(n+1)/2, Σ -10r = -5n(n-1), Σ 0.5 = n/2.
            let nf = n as f32;
            let want_sum = vec![nf * (nf + 1.0) / 2.0, -5.0 * nf * (nf - 1.0), nf / 2.0];
            let want_max = vec![nf, 0.0, 0.5];
            for (sum, max, shape) in out {
                assert_eq!(sum, HostData::F32(want_sum.clone()), "n = {n}");
                assert_eq!(max, HostData::F32(want_max.clone()), "n = {n}");
                assert_eq!(shape, vec![3]);
            }
        }
    }

    #[test]
    fn all_reduce_keeps_dtype_and_shape() {
        let out = all_ok(run_local(3, TIMEOUT, |c| {
            let g = world_group(3);
            let r = c.rank() as i32;
            let i = c.all_reduce(&Cpu, &g, &ti32(&[r, -r, 7, r * r], &[2, 2]), ReduceOp::Sum)?;
            let m = c.all_reduce(&Cpu, &g, &ti32(&[r, -r, 7, r * r], &[2, 2]), ReduceOp::Max)?;
            let d = c.all_reduce(&Cpu, &g, &t64(&[0.25 * r as f64], &[]), ReduceOp::Sum)?;
            Ok((
                host(&i),
                host(&m),
                host(&d),
                i.shape().to_vec(),
                d.shape().to_vec(),
            ))
        }));
        for (i, m, d, ishape, dshape) in out {
            assert_eq!(i, HostData::I32(vec![3, -3, 21, 5]));
            assert_eq!(m, HostData::I32(vec![2, 0, 7, 4]));
            assert_eq!(d, HostData::F64(vec![0.75]));
            assert_eq!(ishape, vec![2, 2]);
            assert_eq!(dshape, Vec::<usize>::new());
        }
    }

    #[test]
    fn all_reduce_max_propagates_nan() {
        let out = all_ok(run_local(2, TIMEOUT, |c| {
            let v = if c.rank() == 1 { f32::NAN } else { 1.0 };
            let m = c.all_reduce(&Cpu, &world_group(2), &t32(&[v, 2.0], &[2]), ReduceOp::Max)?;
            Ok(host(&m).to_f32())
        }));
        for m in out {
            assert!(m[0].is_nan());
            assert_eq!(m[1], 2.0);
        }
    }

    #[test]
    fn all_reduce_sum_is_bit_reproducible_in_group_order() {
        use rand::{Rng, SeedableRng};
        let n = 4;
        let len = 257;
        // Values of very different magnitudes, so the order of the adds
        // changes the bits.
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(r as u64);
                (0..len)
                    .map(|_| rng.gen_range(-1.0f32..1.0) * 10f32.powi(rng.gen_range(-6..6)))
                    .collect()
            })
            .collect();
        let run = || {
            all_ok(run_local(n, TIMEOUT, |c| {
                let x = t32(&inputs[c.rank()], &[len]);
                let s = c.all_reduce(&Cpu, &world_group(n), &x, ReduceOp::Sum)?;
                Ok(host(&s).to_f32())
            }))
        };
        let want: Vec<u32> = (0..len)
            .map(|i| (((inputs[0][i] + inputs[1][i]) + inputs[2][i]) + inputs[3][i]).to_bits())
            .collect();
        for _ in 0..2 {
            for s in run() {
                assert_eq!(s.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
            }
        }
    }

    #[test]
    fn reduce_scatter_sums_then_splits_for_1_to_4_ranks() {
        for n in 1..=4 {
            // Rank r holds x[i] = 100 r + i over [2n, 2], so member k keeps
            // elements 4k..4k+4 of Σ_r x = 100·n(n-1)/2 + n·i.
            let out = all_ok(run_local(n, TIMEOUT, |c| {
                let x: Vec<f64> = (0..4 * n).map(|i| (100 * c.rank() + i) as f64).collect();
                let y = c.reduce_scatter(&Cpu, &world_group(n), &t64(&x, &[2 * n, 2]))?;
                Ok((host(&y), y.shape().to_vec()))
            }));
            let base = (100 * n * (n - 1) / 2) as f64;
            for (k, (y, shape)) in out.into_iter().enumerate() {
                let want: Vec<f64> = (4 * k..4 * k + 4).map(|i| base + (n * i) as f64).collect();
                assert_eq!(y, HostData::F64(want), "n = {n}, member {k}");
                assert_eq!(shape, vec![2, 2]);
            }
        }
    }

    #[test]
    fn reduce_scatter_indivisible_is_an_error_naming_the_values() {
        let out = run_local(3, TIMEOUT, |c| {
            c.reduce_scatter(&Cpu, &world_group(3), &t32(&[0.0; 4], &[4, 1]))
        });
        for r in &out {
            match r {
                Err(KernelError::InvalidArgument { detail, .. }) => {
                    assert!(
                        detail.contains("is 4") && detail.contains("group size 3"),
                        "{detail}"
                    )
                }
                other => panic!("expected InvalidArgument, got {other:?}"),
            }
        }
    }

    #[test]
    fn all_gather_concatenates_in_group_order_for_1_to_4_ranks() {
        for n in 1..=4 {
            // Rank r sends r+1 rows of [r, 10r].
            let out = all_ok(run_local(n, TIMEOUT, |c| {
                let r = c.rank() as i32;
                let x: Vec<i32> = (0..=r).flat_map(|_| [r, 10 * r]).collect();
                let y = c.all_gather(&Cpu, &world_group(n), &ti32(&x, &[r as usize + 1, 2]))?;
                Ok((host(&y), y.shape().to_vec()))
            }));
            let want: Vec<i32> = (0..n as i32)
                .flat_map(|r| (0..=r).flat_map(move |_| [r, 10 * r]))
                .collect();
            for (y, shape) in out {
                assert_eq!(y, HostData::I32(want.clone()));
                assert_eq!(shape, vec![n * (n + 1) / 2, 2]);
            }
        }
        // A literal case: two ranks, group order [1, 0].
        let out = all_ok(run_local(2, TIMEOUT, |c| {
            let x = if c.rank() == 0 {
                [1.0, 2.0]
            } else {
                [3.0, 4.0]
            };
            let y = c.all_gather(&Cpu, &Group::new(vec![1, 0]), &t32(&x, &[1, 2]))?;
            Ok(host(&y))
        }));
        assert_eq!(out, vec![HostData::F32(vec![3.0, 4.0, 1.0, 2.0]); 2]);
    }

    #[test]
    fn all_gather_trailing_dims_mismatch_is_a_comm_error_naming_both() {
        let out = run_local(2, TIMEOUT, |c| {
            let cols = 2 + c.rank();
            c.all_gather(&Cpu, &world_group(2), &t32(&vec![0.0; cols], &[1, cols]))
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(d.contains("rank 0 passed F32 [1, 2]"), "{d}");
            assert!(d.contains("rank 1 passed F32 [1, 3]"), "{d}");
        }
    }

    #[test]
    fn all_to_all_v_two_ranks_by_hand() {
        // Rank 0 rows: a0 a1 a2, sends [1, 2]; rank 1 rows: b0 b1, sends [2, 0].
        let out = all_ok(run_local(2, TIMEOUT, |c| {
            let (x, rows, send) = if c.rank() == 0 {
                (vec![0.0, 0.1, 1.0, 1.1, 2.0, 2.1], 3, [1, 2])
            } else {
                (vec![10.0, 10.1, 11.0, 11.1], 2, [2, 0])
            };
            let (y, counts) = c.all_to_all_v(&Cpu, &world_group(2), &t64(&x, &[rows, 2]), &send)?;
            Ok((host(&y), y.shape().to_vec(), counts))
        }));
        assert_eq!(
            out[0],
            (
                HostData::F64(vec![0.0, 0.1, 10.0, 10.1, 11.0, 11.1]),
                vec![3, 2],
                vec![1, 2]
            )
        );
        assert_eq!(
            out[1],
            (
                HostData::F64(vec![1.0, 1.1, 2.0, 2.1]),
                vec![2, 2],
                vec![2, 0]
            )
        );
    }

    #[test]
    fn all_to_all_v_routes_rows_for_1_to_4_ranks() {
        for n in 1..=4 {
            // Rank s sends (s + k) % 3 rows to member k; row j of those is
            // [100 s + 10 k + j, -1].
            let send = |s: usize| (0..n).map(|k| (s + k) % 3).collect::<Vec<usize>>();
            let out = all_ok(run_local(n, TIMEOUT, |c| {
                let s = c.rank();
                let x: Vec<i32> = (0..n)
                    .flat_map(|k| {
                        (0..(s + k) % 3).flat_map(move |j| [(100 * s + 10 * k + j) as i32, -1])
                    })
                    .collect();
                let rows = send(s).iter().sum::<usize>();
                let (y, counts) =
                    c.all_to_all_v(&Cpu, &world_group(n), &ti32(&x, &[rows, 2]), &send(s))?;
                Ok((host(&y), y.shape().to_vec(), counts))
            }));
            for (k, (y, shape, counts)) in out.into_iter().enumerate() {
                let want_counts: Vec<usize> = (0..n).map(|s| (s + k) % 3).collect();
                let want: Vec<i32> = (0..n)
                    .flat_map(|s| {
                        (0..(s + k) % 3).flat_map(move |j| [(100 * s + 10 * k + j) as i32, -1])
                    })
                    .collect();
                assert_eq!(y, HostData::I32(want), "n = {n}, member {k}");
                assert_eq!(shape, vec![want_counts.iter().sum(), 2]);
                assert_eq!(counts, want_counts);
            }
        }
    }

    #[test]
    fn all_to_all_v_bad_send_rows_names_the_rank_on_its_peers() {
        // Plain threads, not run_local: nobody aborts, so the peers learn of
        // the bad arguments from the call itself.
        let comms = LocalWorld::new(3).with_timeout(TIMEOUT).comms();
        let out: Vec<Result<_>> = std::thread::scope(|s| {
            let threads: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let send = if c.rank() == 1 { [1, 1, 1] } else { [1, 0, 0] };
                        c.all_to_all_v(&Cpu, &world_group(3), &t32(&[0.0; 2], &[1, 2]), &send)
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        match &out[1] {
            Err(KernelError::ShapeMismatch { detail, .. }) => {
                assert!(
                    detail.contains("sum to 3") && detail.contains("1 rows"),
                    "{detail}"
                )
            }
            other => panic!("expected ShapeMismatch on rank 1, got {other:?}"),
        }
        for r in [&out[0], &out[2]] {
            let d = comm_detail(r);
            assert!(d.contains("rank 1 passed invalid arguments"), "{d}");
        }
    }

    #[test]
    fn broadcast_from_every_root_for_1_to_4_ranks() {
        for n in 1..=4 {
            for root in 0..n {
                let out = all_ok(run_local(n, TIMEOUT, |c| {
                    let r = c.rank() as f32;
                    let y = c.broadcast(&Cpu, &world_group(n), root, &t32(&[r, r * r], &[2, 1]))?;
                    Ok((host(&y), y.shape().to_vec()))
                }));
                let rf = root as f32;
                for (y, shape) in out {
                    assert_eq!(y, HostData::F32(vec![rf, rf * rf]), "n = {n}, root {root}");
                    assert_eq!(shape, vec![2, 1]);
                }
            }
        }
    }

    #[test]
    fn broadcast_root_is_a_group_index() {
        // Group [2, 0]: root index 0 is global rank 2.
        let out = all_ok(run_local(3, TIMEOUT, |c| {
            if c.rank() == 1 {
                return Ok(None);
            }
            let y = c.broadcast(
                &Cpu,
                &Group::new(vec![2, 0]),
                0,
                &ti32(&[c.rank() as i32], &[1]),
            )?;
            Ok(Some(host(&y)))
        }));
        assert_eq!(
            out,
            vec![
                Some(HostData::I32(vec![2])),
                None,
                Some(HostData::I32(vec![2]))
            ]
        );
    }

    #[test]
    fn send_recv_is_fifo_per_pair_and_keeps_dtype() {
        let out = all_ok(run_local(3, TIMEOUT, |c| {
            let (r, n) = (c.rank(), c.world());
            // A ring, three messages each, then one i32 message back.
            for m in 0..3 {
                c.send(&Cpu, (r + 1) % n, &t32(&[(10 * r + m) as f32], &[1]))?;
            }
            let got: Vec<HostData> = (0..3)
                .map(|_| c.recv(&Cpu, (r + n - 1) % n).map(|t| host(&t)))
                .collect::<Result<_>>()?;
            c.send(&Cpu, (r + n - 1) % n, &ti32(&[r as i32, 0], &[1, 2]))?;
            let back = c.recv(&Cpu, (r + 1) % n)?;
            Ok((got, host(&back), back.shape().to_vec()))
        }));
        for (r, (got, back, shape)) in out.into_iter().enumerate() {
            let from = (r + 2) % 3;
            let want: Vec<HostData> = (0..3)
                .map(|m| HostData::F32(vec![(10 * from + m) as f32]))
                .collect();
            assert_eq!(got, want);
            assert_eq!(back, HostData::I32(vec![((r + 1) % 3) as i32, 0]));
            assert_eq!(shape, vec![1, 2]);
        }
    }

    #[test]
    fn barrier_waits_for_every_member() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let arrived = AtomicUsize::new(0);
        let out = all_ok(run_local(4, TIMEOUT, |c| {
            if c.rank() == 3 {
                std::thread::sleep(Duration::from_millis(50));
            }
            arrived.fetch_add(1, Ordering::SeqCst);
            c.barrier(&world_group(4))?;
            Ok(arrived.load(Ordering::SeqCst))
        }));
        assert_eq!(out, vec![4; 4]);
    }

    #[test]
    fn concurrent_subgroups_do_not_mix() {
        // World 4 as a 2×2 grid: rows [0,1], [2,3]; columns [0,2], [1,3].
        // Ranks 0, 1 call row then column, ranks 2, 3 column then row, three
        // times, so calls on different groups interleave.
        let out = all_ok(run_local(4, TIMEOUT, |c| {
            let r = c.rank();
            let row = Group::new(vec![r / 2 * 2, r / 2 * 2 + 1]);
            let col = Group::new(vec![r % 2, r % 2 + 2]);
            let mut seen = Vec::new();
            for step in 0..3 {
                let x = t64(&[(10 * step + r) as f64], &[1]);
                let row_sum = |c: &LocalComm| c.all_reduce(&Cpu, &row, &x, ReduceOp::Sum);
                let col_cat = |c: &LocalComm| c.all_gather(&Cpu, &col, &x);
                let (a, b) = if r < 2 {
                    let a = row_sum(&c)?;
                    (a, col_cat(&c)?)
                } else {
                    let b = col_cat(&c)?;
                    (row_sum(&c)?, b)
                };
                seen.push((host(&a).to_f64(), host(&b).to_f64()));
            }
            Ok(seen)
        }));
        for (r, seen) in out.into_iter().enumerate() {
            for (step, (a, b)) in seen.into_iter().enumerate() {
                let v = |q: usize| (10 * step + q) as f64;
                let r0 = r / 2 * 2;
                assert_eq!(a, vec![v(r0) + v(r0 + 1)], "rank {r}, step {step}");
                assert_eq!(b, vec![v(r % 2), v(r % 2 + 2)], "rank {r}, step {step}");
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_a_comm_error_naming_both() {
        let out = run_local(3, TIMEOUT, |c| {
            let len = if c.rank() == 2 { 3 } else { 2 };
            c.all_reduce(
                &Cpu,
                &world_group(3),
                &t32(&vec![1.0; len], &[len]),
                ReduceOp::Sum,
            )
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(
                d.contains("rank 0 passed F32 [2]") && d.contains("rank 2 passed F32 [3]"),
                "{d}"
            );
        }
        let out = run_local(2, TIMEOUT, |c| {
            let x = if c.rank() == 0 {
                t32(&[1.0], &[1])
            } else {
                t64(&[1.0], &[1])
            };
            c.all_reduce(&Cpu, &world_group(2), &x, ReduceOp::Sum)
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(d.contains("F32 [1]") && d.contains("F64 [1]"), "{d}");
        }
    }

    #[test]
    fn mismatched_ops_are_a_comm_error_naming_both() {
        let out = run_local(2, TIMEOUT, |c| {
            let x = t32(&[1.0], &[1]);
            if c.rank() == 0 {
                c.all_reduce(&Cpu, &world_group(2), &x, ReduceOp::Sum)
                    .map(|_| ())
            } else {
                c.all_gather(&Cpu, &world_group(2), &x).map(|_| ())
            }
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(
                d.contains("rank 0 called all_reduce but rank 1 called all_gather"),
                "{d}"
            );
        }
        let out = run_local(2, TIMEOUT, |c| {
            let op = if c.rank() == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            c.all_reduce(&Cpu, &world_group(2), &t32(&[1.0], &[1]), op)
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(
                d.contains("AllReduce(Sum)") && d.contains("AllReduce(Max)"),
                "{d}"
            );
        }
    }

    #[test]
    fn invalid_groups_are_argument_errors() {
        let [c0, _c1] = <[LocalComm; 2]>::try_from(LocalWorld::new(2).comms()).unwrap();
        let x = t32(&[1.0], &[1]);
        for (g, want) in [
            (vec![1], "not a member"),
            (vec![0, 2], "names rank 2"),
            (vec![0, 0], "twice"),
            (vec![], "not a member"),
        ] {
            match c0.all_reduce(&Cpu, &Group::new(g), &x, ReduceOp::Sum) {
                Err(KernelError::InvalidArgument { detail, .. }) => {
                    assert!(detail.contains(want), "{detail}")
                }
                other => panic!("expected InvalidArgument, got {other:?}"),
            }
        }
        assert!(matches!(
            c0.send(&Cpu, 5, &x),
            Err(KernelError::InvalidArgument { .. })
        ));
    }

    #[test]
    fn a_failing_rank_releases_its_peers_before_the_timeout() {
        let start = Instant::now();
        let out = run_local(4, TIMEOUT, |c| {
            if c.rank() == 2 {
                return Err(arg_err("test", "boom"));
            }
            c.all_reduce(&Cpu, &world_group(4), &t32(&[1.0], &[1]), ReduceOp::Sum)
        });
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
        assert!(matches!(out[2], Err(KernelError::InvalidArgument { .. })));
        for r in [0, 1, 3] {
            let d = comm_detail(&out[r]);
            assert!(d.contains("rank 2 aborted") && d.contains("boom"), "{d}");
        }
    }

    #[test]
    fn a_panicking_rank_releases_its_peers_before_the_timeout() {
        let start = Instant::now();
        let out = run_local(3, TIMEOUT, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(20));
                panic!("deliberate test panic");
            }
            // Peers wait in different calls: a collective and a recv.
            if c.rank() == 0 {
                c.barrier(&world_group(3)).map(|_| ())
            } else {
                c.recv(&Cpu, 1).map(|_| ())
            }
        });
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
        let d = comm_detail(&out[1]);
        assert!(d.contains("rank 1 panicked: deliberate test panic"), "{d}");
        for r in [0, 2] {
            let d = comm_detail(&out[r]);
            assert!(
                d.contains("rank 1 aborted: rank 1 panicked: deliberate test panic"),
                "{d}"
            );
        }
    }

    #[test]
    fn dropping_a_handle_while_panicking_aborts_the_rank() {
        // Plain threads, not run_local: the handle's Drop is what reports.
        let [c0, c1] =
            <[LocalComm; 2]>::try_from(LocalWorld::new(2).with_timeout(TIMEOUT).comms()).unwrap();
        let start = Instant::now();
        let r0 = std::thread::scope(|s| {
            let waiter = s.spawn(move || c0.barrier(&world_group(2)));
            let panicker = s.spawn(move || {
                let _c1 = c1;
                std::thread::sleep(Duration::from_millis(20));
                panic!("deliberate test panic");
            });
            assert!(panicker.join().is_err());
            waiter.join().unwrap()
        });
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
        let d = comm_detail(&r0);
        assert!(d.contains("rank 1 aborted: rank 1 panicked"), "{d}");
    }

    #[test]
    fn abort_fails_later_calls_on_every_rank() {
        let out = run_local(3, TIMEOUT, |c| {
            if c.rank() == 0 {
                c.abort("out of memory");
                return c.barrier(&world_group(3));
            }
            std::thread::sleep(Duration::from_millis(20));
            // A group without rank 0 fails too: the whole world stops.
            c.barrier(&Group::new(vec![1, 2]))
        });
        let d = comm_detail(&out[0]);
        assert!(
            d.contains("this rank (0) aborted earlier: out of memory"),
            "{d}"
        );
        for r in [1, 2] {
            let d = comm_detail(&out[r]);
            assert!(d.contains("rank 0 aborted: out of memory"), "{d}");
        }
    }

    #[test]
    fn an_absent_rank_times_out_with_a_named_error() {
        let timeout = Duration::from_millis(200);
        let start = Instant::now();
        let out = run_local(3, timeout, |c| {
            if c.rank() > 0 {
                // Keep their handles but never call.
                std::thread::sleep(Duration::from_millis(400));
                return Ok(());
            }
            c.all_gather(&Cpu, &world_group(3), &t32(&[1.0], &[1]))
                .map(|_| ())
        });
        let elapsed = start.elapsed();
        assert!(
            elapsed >= timeout && elapsed < Duration::from_secs(2),
            "{elapsed:?}"
        );
        assert!(out[1].is_ok() && out[2].is_ok());
        let d = comm_detail(&out[0]);
        assert!(
            d.contains("all_gather on group [0, 1, 2]")
                && d.contains("timed out after 200ms")
                && d.contains("ranks [1, 2] have not arrived"),
            "{d}"
        );
        // A recv with nothing sent times out the same way.
        let out = run_local(2, timeout, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(300));
                return Ok(());
            }
            c.recv(&Cpu, 1).map(|_| ())
        });
        let d = comm_detail(&out[0]);
        assert!(
            d.contains("timed out") && d.contains("rank 1 has sent nothing"),
            "{d}"
        );
    }

    #[test]
    fn a_dropped_rank_fails_its_waiting_peers_but_keeps_what_it_sent() {
        let start = Instant::now();
        let out = run_local(2, TIMEOUT, |c| {
            if c.rank() == 1 {
                c.send(&Cpu, 0, &t32(&[7.0], &[1]))?;
                return Ok(None); // drops its handle without a panic
            }
            std::thread::sleep(Duration::from_millis(20));
            let got = c.recv(&Cpu, 1)?;
            assert_eq!(host(&got), HostData::F32(vec![7.0]));
            c.barrier(&world_group(2)).map(|_| Some(()))
        });
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
        assert!(matches!(out[1], Ok(None)));
        let d = comm_detail(&out[0]);
        assert!(d.contains("rank 1 dropped its communicator"), "{d}");
    }

    #[test]
    fn a_rank_may_leave_after_its_last_contribution() {
        // Rank 0 waits in the all_reduce; rank 1 arrives last, completes at
        // once and drops its handle, usually before rank 0 has woken up to
        // collect: rank 0 still gets the sum.
        let out = all_ok(run_local(2, TIMEOUT, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
            }
            let s = c.all_reduce(&Cpu, &world_group(2), &t32(&[1.0], &[1]), ReduceOp::Sum)?;
            Ok(host(&s))
        }));
        assert_eq!(out, vec![HostData::F32(vec![2.0]); 2]);
    }

    /// Each rank's values for the started-collective tests: distinct, and
    /// not exactly representable sums, so an order change would show.
    fn values_of(rank: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| 0.1 * (rank * n + i) as f32 + 1.0 / (i + 3) as f32)
            .collect()
    }

    #[test]
    fn started_collectives_equal_the_blocking_ones_bit_for_bit_in_call_order() {
        // Started and blocking calls interleave on one group: the started
        // ones take their places in call order, so each meets its peers'.
        let run = |started: bool| {
            all_ok(run_local(3, TIMEOUT, |c| {
                let g = world_group(3);
                let r = c.rank();
                let x = t32(&values_of(r, 6), &[6]);
                let y = t32(&values_of(r + 7, 2 + r), &[2 + r]);
                // Rank r sends (r + k) % 3 + 1 rows of two to member k.
                let send: Vec<usize> = (0..3).map(|k| (r + k) % 3 + 1).collect();
                let recv: Vec<usize> = (0..3).map(|j| (j + r) % 3 + 1).collect();
                let rows: usize = send.iter().sum();
                let z = t32(&values_of(r + 11, 2 * rows), &[rows, 2]);
                let mut out = Vec::new();
                if started {
                    let rs = c.reduce_scatter_start(&Cpu, &g, &x)?;
                    let sum = c.all_reduce(&Cpu, &g, &x, ReduceOp::Sum)?;
                    let ag = c.all_gather_start(&Cpu, &g, &y)?;
                    let a2a = c.all_to_all_v_start(&Cpu, &g, &z, &send, &recv)?;
                    let rs2 = c.reduce_scatter_start(&Cpu, &g, &sum)?;
                    out.push(host(&ag.wait()?));
                    out.push(host(&rs.wait()?));
                    out.push(host(&sum));
                    out.push(host(&rs2.wait()?));
                    out.push(host(&a2a.wait()?));
                } else {
                    let rs = c.reduce_scatter(&Cpu, &g, &x)?;
                    let sum = c.all_reduce(&Cpu, &g, &x, ReduceOp::Sum)?;
                    let ag = c.all_gather(&Cpu, &g, &y)?;
                    let (a2a, got) = c.all_to_all_v(&Cpu, &g, &z, &send)?;
                    assert_eq!(got, recv);
                    let rs2 = c.reduce_scatter(&Cpu, &g, &sum)?;
                    out.extend([host(&ag), host(&rs), host(&sum), host(&rs2), host(&a2a)]);
                }
                Ok(out)
            }))
        };
        let (blocking, started) = (run(false), run(true));
        assert_eq!(started, blocking);
        // And the values are the sums and concatenations they should be.
        let sums: Vec<f32> = (0..6)
            .map(|i| values_of(0, 6)[i] + values_of(1, 6)[i] + values_of(2, 6)[i])
            .collect();
        assert_eq!(blocking[1][1], HostData::F32(sums[2..4].to_vec()));
        let cat: Vec<f32> = (0..3).flat_map(|r| values_of(r + 7, 2 + r)).collect();
        assert_eq!(blocking[2][0], HostData::F32(cat));
    }

    #[test]
    fn a_rank_that_fails_during_a_started_collective_releases_its_peers() {
        let start = Instant::now();
        let out = run_local(3, TIMEOUT, |c| {
            let g = world_group(3);
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(20));
                return Err(arg_err("test", "died with a collective pending"));
            }
            let first = c.reduce_scatter_start(&Cpu, &g, &t32(&[1.0; 3], &[3]))?;
            let second = c.all_gather_start(&Cpu, &g, &t32(&[1.0], &[1]))?;
            let first = first.wait().map(|_| ());
            let second = second.wait().map(|_| ());
            Ok((first, second))
        });
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
        for r in [0, 2] {
            let (first, second) = out[r].as_ref().unwrap();
            let d = comm_detail(first);
            assert!(d.contains("rank 1 aborted") && d.contains("died"), "{d}");
            assert!(!d.contains('\n'), "{d}");
            // The later one fails at once, naming the first failure.
            let d = comm_detail(second);
            assert!(
                d.contains("all_gather") && d.contains("an earlier started collective failed"),
                "{d}"
            );
        }
    }

    #[test]
    fn a_started_collective_of_an_absent_rank_times_out_naming_it() {
        let timeout = Duration::from_millis(200);
        let out = run_local(2, timeout, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(400));
                return Ok(());
            }
            let p = c.reduce_scatter_start(&Cpu, &world_group(2), &t32(&[1.0; 2], &[2]))?;
            p.wait().map(|_| ())
        });
        let d = comm_detail(&out[0]);
        assert!(
            d.contains("reduce_scatter on group [0, 1]")
                && d.contains("timed out after 200ms")
                && d.contains("ranks [1] have not arrived"),
            "{d}"
        );
    }

    #[test]
    fn a_started_reduce_scatter_with_bad_arguments_is_an_argument_error() {
        let out = run_local(2, TIMEOUT, |c| {
            c.reduce_scatter_start(&Cpu, &world_group(2), &t32(&[1.0; 3], &[3]))?
                .wait()
                .map(|_| ())
        });
        for r in &out {
            match r {
                Err(KernelError::InvalidArgument { detail, .. }) => {
                    assert!(
                        detail.contains("not divisible by the group size 2"),
                        "{detail}"
                    )
                }
                other => panic!("expected InvalidArgument, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_started_all_to_all_v_told_the_wrong_counts_fails_naming_both() {
        let out = run_local(2, TIMEOUT, |c| {
            let x = t32(&[1.0, 2.0, 3.0], &[3, 1]);
            // Each sends one row to member 0 and two to member 1, but both
            // expect one row from each: rank 0 is right, rank 1 is not.
            c.all_to_all_v_start(&Cpu, &world_group(2), &x, &[1, 2], &[1, 1])?
                .wait()
                .map(|t| host(&t))
        });
        assert_eq!(out[0].as_ref().unwrap(), &HostData::F32(vec![1.0, 1.0]));
        let d = comm_detail(&out[1]);
        assert!(
            d.contains("all_to_all_v on group [0, 1]")
                && d.contains("sent [2, 2] rows")
                && d.contains("expect [1, 1]"),
            "{d}"
        );
    }
}
