//! One process per rank, exchanging over TCP (docs/ARCHITECTURE.md §7): the communicator
//! of multi-process CPU runs (`foldmoe launch`), and of any device whose
//! tensors can be copied to the host.
//!
//! [`TcpComm::connect`] meets the other ranks through a [`Rendezvous`] on
//! `MASTER_ADDR:MASTER_PORT`, where every rank shares the address of a
//! listener of its own; then each rank connects to every lower rank, which
//! makes a full mesh of connections. One reader thread per connection files
//! what arrives (collective contributions, point-to-point messages, aborts)
//! into a shared mailbox, so sends never wait for the peer's matching call
//! and collectives on different groups may interleave freely.
//!
//! # Results
//!
//! Values travel as host copies ([`Device::download`] and
//! [`Device::upload`]), in the tensor's dtype, like [`super::local`].
//! Every member sends every other member its call's description (op,
//! dtype, shape, `send_rows`) and the part of its values that member needs;
//! reductions then fold the contributions in group order with the same code
//! as [`super::local::LocalComm`], so results are bit-identical to the
//! threads' communicator, on every member and every run. Calls are matched
//! per group by their count, as in [`super::local`], and a member that calls
//! another op or passes an incompatible tensor is reported to every member.
//!
//! # Failure
//!
//! Nothing waits forever:
//! - [`Communicator::abort`] tells every peer; from then on every call on
//!   every rank fails naming the aborted rank and its reason (a call whose
//!   contributions had all arrived still completes);
//! - a peer whose connection closes (its handle dropped, its process exited
//!   or was killed) fails the calls that still need something from it,
//!   naming it; what it sent before is still delivered;
//! - any other wait ends after the timeout with an error naming the op, the
//!   group and the ranks that have not arrived; a send to a peer that stops
//!   reading fails after the timeout too.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::local::{concat_host, needs_dim0, reduce_host, upload_as};
use super::rendezvous::{configure, listen_any, DistEnv, Rendezvous};
use super::{
    abort_failure, wait_for_change, Call, CallSig, Calls, Communicator, Group, Landed, Op, Pending,
    Progress, ReduceOp,
};
use crate::backend::Device;
use crate::error::{arg_err, KernelError, Result};
use crate::tensor::{DType, HostData, Tensor};

/// First bytes of a mesh connection's hello.
const MESH_MAGIC: &[u8; 8] = b"FMOEMSH1";
/// Largest frame a peer may announce (1 TiB): a bigger length means a
/// corrupt stream, which must not turn into a huge allocation.
const MAX_FRAME: u64 = 1 << 40;

/// Frame kinds.
const KIND_COLL: u8 = 1;
const KIND_P2P: u8 = 2;
const KIND_ABORT: u8 = 3;
const KIND_BYE: u8 = 4;

impl Op {
    fn encode(self) -> (u8, u64) {
        match self {
            Op::AllReduce(ReduceOp::Sum) => (0, 0),
            Op::AllReduce(ReduceOp::Max) => (0, 1),
            Op::ReduceScatter => (1, 0),
            Op::AllGather => (2, 0),
            Op::AllToAllV => (3, 0),
            Op::Broadcast { root } => (4, root as u64),
            Op::Barrier => (5, 0),
        }
    }

    fn decode(code: u8, arg: u64) -> Option<Op> {
        Some(match (code, arg) {
            (0, 0) => Op::AllReduce(ReduceOp::Sum),
            (0, 1) => Op::AllReduce(ReduceOp::Max),
            (1, _) => Op::ReduceScatter,
            (2, _) => Op::AllGather,
            (3, _) => Op::AllToAllV,
            (4, root) => Op::Broadcast {
                root: usize::try_from(root).ok()?,
            },
            (5, _) => Op::Barrier,
            _ => return None,
        })
    }
}

/// What a member tells every other member about its call.
#[derive(Clone, Debug)]
struct Header {
    op: Op,
    /// The tensor's dtype and shape (unused by `barrier`).
    dtype: DType,
    shape: Vec<usize>,
    /// Rows sent to each member (`all_to_all_v` only).
    send_rows: Vec<usize>,
    /// This member's arguments were wrong: it has returned this error, and
    /// its peers report it instead of waiting for data that will not come.
    invalid: Option<String>,
}

impl Header {
    fn of<B: Device>(op: Op, t: &Tensor<B>) -> Header {
        Header {
            op,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            send_rows: Vec::new(),
            invalid: None,
        }
    }
}

/// A member's contribution to a collective, as it arrived here.
struct Contribution {
    header: Header,
    /// The part of its values meant for this rank.
    data: Option<HostData>,
}

/// A tensor in flight from `send` to `recv`.
struct Message {
    data: HostData,
    shape: Vec<usize>,
    dtype: DType,
}

/// What the reader threads file and the calls wait for.
struct State {
    /// Aborted ranks (this one included) with their reasons, in the order
    /// the aborts became known here.
    aborted: Vec<(usize, String)>,
    /// Why each peer's connection ended (`None` while open), phrased to
    /// follow "rank N".
    gone: Vec<Option<String>>,
    /// Contributions received, keyed by (sender, group ranks, call number).
    coll: HashMap<(usize, Vec<usize>, u64), Contribution>,
    /// Point-to-point messages not yet received, by sender, in order.
    mail: HashMap<usize, VecDeque<Message>>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled on every change of `state`.
    cv: Condvar,
}

impl Shared {
    /// The state, even if a thread panicked while holding the lock: each
    /// update is a single insert or push, so the state stays consistent.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.cv.notify_all();
    }
}

/// Every member's contribution to one completed collective.
struct Gathered {
    headers: Vec<Header>,
    /// Each member's values meant for this rank (this rank's own part at
    /// `me`).
    data: Vec<Option<HostData>>,
    /// This rank's group index.
    me: usize,
    /// "op on group [..] (call #k on this group)", prefixed to messages.
    ctx: String,
}

/// One rank's end of a full mesh of TCP connections to the other ranks.
///
/// Dropping it tells the peers it has left (their calls that still need it
/// fail); dropping it while its thread panics aborts the rank first.
pub struct TcpComm {
    net: Arc<Net>,
    /// Calls made so far on each group.
    calls: Calls,
    /// Runs the collectives started on this handle.
    progress: Progress,
}

/// This rank's connections and what its reader threads file: what a
/// collective needs once its place among the group's calls is taken (the
/// blocking calls use it on the caller's thread, the started ones on the
/// handle's progress thread).
struct Net {
    rank: usize,
    world: usize,
    timeout: Duration,
    shared: Arc<Shared>,
    /// The connection to each rank (`None` at this rank's own index), for
    /// writing; a reader thread owns a clone of each for reading.
    links: Vec<Option<Mutex<TcpStream>>>,
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpComm")
            .field("rank", &self.net.rank)
            .field("world", &self.net.world)
            .field("timeout", &self.net.timeout)
            .finish()
    }
}

impl TcpComm {
    /// Meets the other ranks of `env` through a [`Rendezvous`] on its
    /// master address and connects to all of them; every wait (for rank 0,
    /// for a peer's connection, later for a peer's call) lasts at most
    /// `timeout`.
    pub fn connect(env: &DistEnv, timeout: Duration) -> Result<TcpComm> {
        let rdv = Rendezvous::connect(env, timeout)?;
        TcpComm::from_rendezvous(&rdv, timeout)
    }

    /// Connects to every rank of `rdv`: each rank listens on a free port of
    /// the address it reached the rendezvous from, the addresses are
    /// all-gathered, and each rank connects to every lower rank.
    pub fn from_rendezvous(rdv: &Rendezvous, timeout: Duration) -> Result<TcpComm> {
        let (rank, world) = (rdv.rank(), rdv.world());
        let fail = |detail: String| KernelError::Comm { rank, detail };
        let (listener, addr) = listen_any(rdv.local_ip()).map_err(|e| {
            fail(format!(
                "cannot listen on {} for the other ranks: {e}",
                rdv.local_ip()
            ))
        })?;
        let blobs = rdv.all_gather_blobs(addr.to_string().as_bytes())?;
        let addrs = blobs
            .iter()
            .enumerate()
            .map(|(r, b)| {
                String::from_utf8_lossy(b)
                    .parse::<SocketAddr>()
                    .map_err(|e| {
                        fail(format!(
                            "rank {r} sent {:?} as its address: {e}",
                            String::from_utf8_lossy(b)
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(MESH_MAGIC);
        hello.extend_from_slice(&rdv.token().to_le_bytes());
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        // Lower ranks first: their listeners exist already (they were bound
        // before the all-gather), so the connections complete in the
        // kernel's backlog whatever the peers are doing; accepting from the
        // higher ranks afterwards can then never wait in a cycle.
        for (peer, &a) in addrs.iter().enumerate().take(rank) {
            let s = connect_until(a, deadline).map_err(|e| {
                fail(format!(
                    "could not connect to rank {peer} at {a} within {timeout:?}: {e}"
                ))
            })?;
            (&s).write_all(&hello)
                .map_err(|e| fail(format!("sending the hello to rank {peer} at {a}: {e}")))?;
            streams[peer] = Some(s);
        }
        accept_higher(&listener, rdv.token(), rank, &mut streams, deadline)
            .map_err(|detail| fail(format!("{detail} (waited {timeout:?})")))?;

        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                aborted: Vec::new(),
                gone: vec![None; world],
                coll: HashMap::new(),
                mail: HashMap::new(),
            }),
            cv: Condvar::new(),
        });
        let mut links = Vec::with_capacity(world);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                links.push(None);
                continue;
            };
            configure(&s, timeout)
                .and_then(|()| s.set_read_timeout(None))
                .map_err(|e| fail(format!("connection to rank {peer}: {e}")))?;
            let reading = s
                .try_clone()
                .map_err(|e| fail(format!("connection to rank {peer}: {e}")))?;
            let sh = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("tcpcomm-{rank}-from-{peer}"))
                .spawn(move || read_loop(&sh, peer, reading))
                .map_err(|e| fail(format!("cannot start the reader of rank {peer}: {e}")))?;
            links.push(Some(Mutex::new(s)));
        }
        Ok(TcpComm {
            net: Arc::new(Net {
                rank,
                world,
                timeout,
                shared,
                links,
            }),
            calls: Calls::default(),
            progress: Progress::new(rank),
        })
    }

    // `rank`, `world`, `barrier` and `abort` are also inherent methods, as
    // on `LocalComm`: the trait versions do not mention the device type.

    /// This rank's global index.
    pub fn rank(&self) -> usize {
        self.net.rank
    }

    /// Number of ranks in the world.
    pub fn world(&self) -> usize {
        self.net.world
    }

    /// How long a call waits for its peers before failing.
    pub fn timeout(&self) -> Duration {
        self.net.timeout
    }

    /// Returns once every member of `group` has called it (also reachable as
    /// [`Communicator::barrier`]).
    pub fn barrier(&self, group: &Group) -> Result<()> {
        let header = Header {
            op: Op::Barrier,
            dtype: DType::F32,
            shape: Vec::new(),
            send_rows: Vec::new(),
            invalid: None,
        };
        self.exchange(group, header, None, |_| 0..0).map(|_| ())
    }

    /// Marks this rank failed with `reason` and tells every peer (also
    /// reachable as [`Communicator::abort`]): every pending and later call
    /// on every rank returns an error naming this rank and the reason.
    pub fn abort(&self, reason: &str) {
        let me = self.net.rank;
        self.net.shared.update(|st| {
            if !st.aborted.iter().any(|(r, _)| *r == me) {
                st.aborted.push((me, reason.to_string()));
            }
        });
        let mut body = Enc::default();
        body.str(reason);
        for peer in 0..self.net.world {
            // Best effort: a peer that is gone needs no telling.
            let _ = self.net.write_frame(peer, KIND_ABORT, &[&body.0]);
        }
    }

    /// Checks `group` and takes this rank's next place among its calls.
    fn enter(&self, group: &Group, op: Op) -> Result<Call> {
        self.calls.enter(self.net.rank, self.net.world, group, op)
    }

    /// [`Net::exchange`] as this rank's next call on `group`.
    fn exchange(
        &self,
        group: &Group,
        header: Header,
        data: Option<&HostData>,
        range_for: impl Fn(usize) -> Range<usize>,
    ) -> Result<Gathered> {
        let call = self.enter(group, header.op)?;
        self.net.exchange(&call, header, data, range_for)
    }
}

impl Net {
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

    /// Writes one frame (`kind`, the total length, then `parts`) to `peer`.
    fn write_frame(&self, peer: usize, kind: u8, parts: &[&[u8]]) -> std::io::Result<()> {
        let Some(Some(link)) = self.links.get(peer) else {
            return Err(std::io::Error::new(
                ErrorKind::NotFound,
                format!("no connection to rank {peer}"),
            ));
        };
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut head = [0u8; 9];
        head[0] = kind;
        head[1..].copy_from_slice(&(len as u64).to_le_bytes());
        let mut s = link.lock().unwrap_or_else(|p| p.into_inner());
        s.write_all(&head)?;
        for p in parts {
            s.write_all(p)?;
        }
        s.flush()
    }

    /// The error of a call (`ctx`) whose write to `peer` failed with `e`.
    ///
    /// A peer that closed its connection usually said why first (an abort,
    /// or its goodbye), but the write may fail before this rank's reader has
    /// read that far: give the reader a moment to, so the error carries the
    /// cause rather than a bare "broken pipe".
    fn write_error(&self, peer: usize, e: std::io::Error, ctx: &str) -> KernelError {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            return self.comm_err(format!(
                "{ctx}: rank {peer} has not read what this rank sent for {:?}",
                self.timeout
            ));
        }
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(1));
        let mut st = self.shared.lock();
        while st.gone.get(peer).is_some_and(Option::is_none) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if let Some(failed) = self.failure(&st, ctx) {
            return failed;
        }
        match st.gone.get(peer).cloned().flatten() {
            Some(why) => self.comm_err(format!("{ctx}: rank {peer} {why}")),
            None => self.comm_err(format!("{ctx}: the connection to rank {peer} failed: {e}")),
        }
    }

    /// Sends `header` and the elements `range_for(j)` of `data` to every
    /// other member `j` of `call`'s group, then waits for every member's
    /// contribution to this call and checks that they agree.
    fn exchange(
        &self,
        call: &Call,
        header: Header,
        data: Option<&HostData>,
        range_for: impl Fn(usize) -> Range<usize>,
    ) -> Result<Gathered> {
        let (me, seq, ctx) = (call.me, call.seq, call.ctx.clone());
        let ranks = call.group.ranks();
        let key = |peer: usize| (peer, ranks.to_vec(), seq);
        // A member whose arguments to this call were wrong has usually
        // aborted since; its contribution names the mistake itself.
        let invalid_member = |st: &mut State| -> Option<KernelError> {
            let (r, why) = ranks.iter().find_map(|&r| {
                let c = st.coll.get(&key(r))?;
                Some((r, c.header.invalid.clone()?))
            })?;
            st.coll.remove(&key(r));
            Some(self.comm_err(format!("{ctx}: rank {r} passed invalid arguments: {why}")))
        };
        if header.invalid.is_none() {
            let mut st = self.shared.lock();
            if let Some(e) = self.failure(&st, &ctx) {
                return Err(invalid_member(&mut st).unwrap_or(e));
            }
        }
        let mut head = Enc::default();
        head.usizes(ranks);
        head.u64(seq);
        head.header(&header);
        let mut lost = None;
        for (j, &peer) in ranks.iter().enumerate() {
            if j == me {
                continue;
            }
            let mut piece = Enc::default();
            piece.host(data.map(|d| (d, range_for(j))));
            // On a failed write, the other members still get this rank's
            // contribution: their calls then fail naming the lost peer too,
            // not this rank.
            if let Err(e) = self.write_frame(peer, KIND_COLL, &[&head.0, &piece.0]) {
                lost.get_or_insert((peer, e));
            }
        }
        if let (Some((peer, e)), None) = (lost, &header.invalid) {
            return Err(self.write_error(peer, e, &ctx));
        }
        if let Some(why) = &header.invalid {
            // The peers report it; this rank has nothing to wait for.
            return Err(self.comm_err(format!("{ctx}: {why}")));
        }
        let own = match data {
            Some(d) => Some(
                slice_host(d, range_for(me))
                    .ok_or_else(|| self.comm_err(format!("{ctx}: bad range (internal error)")))?,
            ),
            None => None,
        };

        let deadline = Instant::now() + self.timeout;
        let mut st = self.shared.lock();
        loop {
            // The same order of checks as the local communicator: a
            // member's bad arguments, completion, failure, departure, time.
            if let Some(e) = invalid_member(&mut st) {
                return Err(e);
            }
            let missing: Vec<usize> = ranks
                .iter()
                .enumerate()
                .filter(|&(j, &r)| j != me && !st.coll.contains_key(&key(r)))
                .map(|(_, &r)| r)
                .collect();
            if missing.is_empty() {
                let mut headers = Vec::with_capacity(ranks.len());
                let mut values = Vec::with_capacity(ranks.len());
                for (j, &r) in ranks.iter().enumerate() {
                    if j == me {
                        headers.push(header.clone());
                        values.push(own.clone());
                    } else if let Some(c) = st.coll.remove(&key(r)) {
                        headers.push(c.header);
                        values.push(c.data);
                    }
                }
                drop(st);
                let g = Gathered {
                    headers,
                    data: values,
                    me,
                    ctx,
                };
                self.check_agreement(ranks, &g)?;
                return Ok(g);
            }
            if let Some(e) = self.failure(&st, &ctx) {
                return Err(e);
            }
            if let Some((r, why)) = missing.iter().find_map(|&r| Some((r, st.gone[r].clone()?))) {
                return Err(
                    self.comm_err(format!("{ctx}: rank {r} {why} without making this call"))
                );
            }
            st = wait_for_change(st, &self.shared.cv, deadline, || {
                self.comm_err(format!(
                    "{ctx}: timed out after {:?}: ranks {missing:?} have not arrived",
                    self.timeout
                ))
            })?;
        }
    }

    /// Checks that every member called the same op with compatible tensors
    /// (the local communicator's rules and messages). Every member sees every
    /// header, so all of them return the same verdict.
    fn check_agreement(&self, ranks: &[usize], g: &Gathered) -> Result<()> {
        let hs = &g.headers;
        let ctx = &g.ctx;
        let calls: Vec<CallSig> = hs
            .iter()
            .map(|h| CallSig {
                op: h.op,
                dtype: h.dtype,
                shape: &h.shape,
            })
            .collect();
        super::check_agreement(ctx, ranks, &calls).map_err(|m| self.comm_err(m))?;
        if matches!(hs[0].op, Op::AllToAllV) {
            if let Some(i) = hs.iter().position(|h| h.send_rows.len() != ranks.len()) {
                return Err(self.comm_err(format!(
                    "{ctx}: rank {} sent {} send_rows for {} members (internal error)",
                    ranks[i],
                    hs[i].send_rows.len(),
                    ranks.len()
                )));
            }
        }
        Ok(())
    }

    /// Every member's values, in group order.
    fn values<'a>(&self, g: &'a Gathered) -> Result<Vec<&'a HostData>> {
        g.data
            .iter()
            .enumerate()
            .map(|(i, d)| {
                d.as_ref().ok_or_else(|| {
                    self.comm_err(format!(
                        "{}: member {i} sent no values (internal error)",
                        g.ctx
                    ))
                })
            })
            .collect()
    }

    /// Turns a helper's `None` (contributions of different dtypes or
    /// lengths, which the agreement check rules out) into an error.
    fn internal(&self, g: &Gathered, out: Option<HostData>) -> Result<HostData> {
        out.ok_or_else(|| {
            self.comm_err(format!(
                "{}: contributions disagree in dtype or length (internal error)",
                g.ctx
            ))
        })
    }
}

/// Connects to `addr`, retrying until `deadline` (the listener exists, but
/// a loaded machine may refuse or time out a first attempt).
fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), Duration::from_secs(2));
        match TcpStream::connect_timeout(&addr, wait) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Accepts a connection from every rank above `rank` on `listener`; a
/// connection without this run's hello is dropped.
fn accept_higher(
    listener: &TcpListener,
    token: u64,
    rank: usize,
    streams: &mut [Option<TcpStream>],
    deadline: Instant,
) -> std::result::Result<(), String> {
    let world = streams.len();
    let waiting = |streams: &[Option<TcpStream>]| -> Vec<usize> {
        (rank + 1..world)
            .filter(|&r| streams[r].is_none())
            .collect()
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listening for the higher ranks: {e}"))?;
    while !waiting(streams).is_empty() {
        let s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "ranks {:?} never connected to rank {rank}",
                        waiting(streams)
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(format!("accepting the higher ranks: {e}")),
        };
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), Duration::from_secs(2));
        let mut hello = [0u8; 24];
        let read = configure(&s, wait).and_then(|()| (&s).read_exact(&mut hello));
        if read.is_err() || &hello[..8] != MESH_MAGIC || hello[8..16] != token.to_le_bytes() {
            continue;
        }
        let peer = u64::from_le_bytes(hello[16..24].try_into().unwrap_or_default());
        match usize::try_from(peer) {
            Ok(p) if p > rank && p < world && streams[p].is_none() => streams[p] = Some(s),
            _ => {
                return Err(format!(
                    "a process of this run connected to rank {rank} as rank {peer}, which is \
                     not one of the ranks {:?} it waits for",
                    waiting(streams)
                ))
            }
        }
    }
    Ok(())
}

/// The reader of the connection from `peer`: files every frame into the
/// shared state until the connection ends, then records why.
fn read_loop(shared: &Shared, peer: usize, mut s: TcpStream) {
    let why = loop {
        let mut head = [0u8; 9];
        if let Err(e) = s.read_exact(&mut head) {
            break match e.kind() {
                ErrorKind::UnexpectedEof
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted => {
                    "disconnected (its process exited or was killed)".to_string()
                }
                _ => format!("is unreachable (reading its connection failed: {e})"),
            };
        }
        let len = u64::from_le_bytes(head[1..].try_into().unwrap_or_default());
        if len > MAX_FRAME {
            break format!("sent a {len}-byte frame (protocol error)");
        }
        let mut body = vec![0u8; len as usize];
        if let Err(e) = s.read_exact(&mut body) {
            break format!("disconnected in the middle of a message ({e})");
        }
        let mut d = Dec(&body);
        let filed = match head[0] {
            KIND_COLL => (|| {
                let ranks = d.usizes()?;
                let seq = d.u64()?;
                let header = d.header()?;
                let data = d.host()?;
                shared.update(|st| {
                    st.coll
                        .insert((peer, ranks, seq), Contribution { header, data });
                });
                Some(())
            })(),
            KIND_P2P => (|| {
                let dtype = d.dtype()?;
                let shape = d.usizes()?;
                let data = d.host()??;
                shared.update(|st| {
                    st.mail
                        .entry(peer)
                        .or_default()
                        .push_back(Message { data, shape, dtype });
                });
                Some(())
            })(),
            KIND_ABORT => d.string().map(|reason| {
                shared.update(|st| {
                    if !st.aborted.iter().any(|(r, _)| *r == peer) {
                        st.aborted.push((peer, reason));
                    }
                });
            }),
            KIND_BYE => {
                // What it sent before leaving stays deliverable; only calls
                // that still need it fail. Keep reading until it closes.
                shared.update(|st| {
                    st.gone[peer] = Some("dropped its communicator".to_string());
                });
                Some(())
            }
            _ => None,
        };
        if filed.is_none() {
            break format!(
                "sent a malformed message of kind {} (protocol error)",
                head[0]
            );
        }
    };
    shared.update(|st| {
        if st.gone[peer].is_none() {
            st.gone[peer] = Some(why);
        }
    });
}

/// Elements `range` of `h`, as a new host buffer.
fn slice_host(h: &HostData, range: Range<usize>) -> Option<HostData> {
    Some(match h {
        HostData::F32(v) => HostData::F32(v.get(range)?.to_vec()),
        HostData::F64(v) => HostData::F64(v.get(range)?.to_vec()),
        HostData::I32(v) => HostData::I32(v.get(range)?.to_vec()),
    })
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
    }
}

/// Little-endian encoder of the wire format.
#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn usizes(&mut self, v: &[usize]) {
        self.u64(v.len() as u64);
        for &x in v {
            self.u64(x as u64);
        }
    }

    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn header(&mut self, h: &Header) {
        let (code, arg) = h.op.encode();
        self.u8(code);
        self.u64(arg);
        self.u8(dtype_code(h.dtype));
        self.usizes(&h.shape);
        self.usizes(&h.send_rows);
        match &h.invalid {
            Some(why) => {
                self.u8(1);
                self.str(why);
            }
            None => self.u8(0),
        }
    }

    /// Elements `range` of a host buffer (or none): a tag, the count, the
    /// values.
    fn host(&mut self, piece: Option<(&HostData, Range<usize>)>) {
        fn put<T: Copy, const N: usize>(
            out: &mut Vec<u8>,
            tag: u8,
            v: &[T],
            range: Range<usize>,
            bytes: fn(T) -> [u8; N],
        ) {
            // An out-of-range request sends nothing; the receiver's length
            // checks then report it instead of a panic here.
            let xs = v.get(range).unwrap_or(&[]);
            out.push(tag);
            out.extend_from_slice(&(xs.len() as u64).to_le_bytes());
            out.reserve(xs.len() * N);
            for &x in xs {
                out.extend_from_slice(&bytes(x));
            }
        }
        match piece {
            None => self.u8(0),
            Some((HostData::F32(v), r)) => put(&mut self.0, 1, v, r, f32::to_le_bytes),
            Some((HostData::F64(v), r)) => put(&mut self.0, 2, v, r, f64::to_le_bytes),
            Some((HostData::I32(v), r)) => put(&mut self.0, 3, v, r, i32::to_le_bytes),
        }
    }
}

/// Decoder of the wire format: every read checks the length, so a corrupt
/// frame is a `None`, never a panic.
struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }

    fn usizes(&mut self) -> Option<Vec<usize>> {
        let n = self.usize()?;
        if n > self.0.len() / 8 {
            return None;
        }
        (0..n).map(|_| self.usize()).collect()
    }

    fn string(&mut self) -> Option<String> {
        let n = self.usize()?;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn dtype(&mut self) -> Option<DType> {
        Some(match self.u8()? {
            0 => DType::F32,
            1 => DType::F64,
            2 => DType::BF16,
            3 => DType::I32,
            _ => return None,
        })
    }

    fn header(&mut self) -> Option<Header> {
        let code = self.u8()?;
        let arg = self.u64()?;
        let op = Op::decode(code, arg)?;
        let dtype = self.dtype()?;
        let shape = self.usizes()?;
        let send_rows = self.usizes()?;
        let invalid = match self.u8()? {
            0 => None,
            1 => Some(self.string()?),
            _ => return None,
        };
        Some(Header {
            op,
            dtype,
            shape,
            send_rows,
            invalid,
        })
    }

    /// A host buffer, `Some(None)` where none was sent.
    fn host(&mut self) -> Option<Option<HostData>> {
        fn get<T, const N: usize>(d: &mut Dec<'_>, from: fn([u8; N]) -> T) -> Option<Vec<T>> {
            let n = d.usize()?;
            let bytes = d.take(n.checked_mul(N)?)?;
            bytes
                .chunks_exact(N)
                .map(|c| c.try_into().ok().map(from))
                .collect()
        }
        Some(Some(match self.u8()? {
            0 => return Some(None),
            1 => HostData::F32(get(self, f32::from_le_bytes)?),
            2 => HostData::F64(get(self, f64::from_le_bytes)?),
            3 => HostData::I32(get(self, i32::from_le_bytes)?),
            _ => return None,
        }))
    }
}

impl TcpComm {
    /// `reduce_scatter`'s place, header and host values, its arguments
    /// checked (wrong ones are told to the peers and returned).
    fn reduce_scatter_call<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
    ) -> Result<(Call, Header, HostData)> {
        let header = Header::of(Op::ReduceScatter, t);
        if let Some(e) = super::reduce_scatter_args_error(t.shape(), group.size()) {
            return Err(self.reject(group, header, e));
        }
        let data = b.download(t)?;
        Ok((self.enter(group, Op::ReduceScatter)?, header, data))
    }

    /// `all_gather`'s place, header and host values, its arguments checked.
    fn all_gather_call<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
    ) -> Result<(Call, Header, HostData)> {
        let header = Header::of(Op::AllGather, t);
        if let Some(e) = needs_dim0("all_gather", t.shape()) {
            return Err(self.reject(group, header, e));
        }
        let data = b.download(t)?;
        Ok((self.enter(group, Op::AllGather)?, header, data))
    }

    /// `all_to_all_v`'s place, header and host values, its arguments checked.
    fn all_to_all_v_call<B: Device>(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Call, Header, HostData)> {
        let header = Header {
            send_rows: send_rows.to_vec(),
            ..Header::of(Op::AllToAllV, t)
        };
        if let Some(e) = super::all_to_all_v_args_error(t.shape(), group.size(), send_rows) {
            return Err(self.reject(group, header, e));
        }
        let data = b.download(t)?;
        Ok((self.enter(group, Op::AllToAllV)?, header, data))
    }
}

impl Net {
    /// `reduce_scatter` from its place: member j receives only its part from
    /// everyone and sums it in group order (elementwise, so the same bits as
    /// summing all and splitting).
    fn reduce_scatter(&self, call: &Call, header: Header, data: &HostData) -> Landed {
        let size = call.group.size();
        let mut shape = header.shape.clone();
        let chunk = data.len() / size;
        let g = self.exchange(call, header, Some(data), |j| j * chunk..(j + 1) * chunk)?;
        let out = reduce_host(&self.values(&g)?, 0..chunk, ReduceOp::Sum);
        shape[0] /= size;
        Ok((self.internal(&g, out)?, shape))
    }

    /// `all_gather` from its place: every member's values in group order.
    fn all_gather(&self, call: &Call, header: Header, data: &HostData) -> Landed {
        let mut shape = header.shape.clone();
        let n = data.len();
        let g = self.exchange(call, header, Some(data), |_| 0..n)?;
        let values = self.values(&g)?;
        let pieces: Vec<(&HostData, Range<usize>)> =
            values.iter().map(|&h| (h, 0..h.len())).collect();
        let out = concat_host(&pieces);
        shape[0] = g.headers.iter().map(|h| h.shape[0]).sum();
        Ok((self.internal(&g, out)?, shape))
    }
}

impl Net {
    /// `all_to_all_v` from its place: member k receives rows
    /// `[start_k, start_k + send_rows[k])` of every member's values, in group
    /// order; returns them with their shape and the row count from each.
    fn all_to_all_v(
        &self,
        call: &Call,
        header: Header,
        data: &HostData,
    ) -> Result<(HostData, Vec<usize>, Vec<usize>)> {
        let mut shape = header.shape.clone();
        let row_len: usize = shape[1..].iter().product();
        let starts: Vec<usize> = header
            .send_rows
            .iter()
            .scan(0, |acc, &r| {
                let s = *acc;
                *acc += r;
                Some(s)
            })
            .collect();
        let send_rows = header.send_rows.clone();
        let g = self.exchange(call, header, Some(data), |k| {
            starts[k] * row_len..(starts[k] + send_rows[k]) * row_len
        })?;
        let values = self.values(&g)?;
        let pieces: Vec<(&HostData, Range<usize>)> =
            values.iter().map(|&h| (h, 0..h.len())).collect();
        let counts: Vec<usize> = g.headers.iter().map(|h| h.send_rows[g.me]).collect();
        let out = self.internal(&g, concat_host(&pieces))?;
        shape[0] = counts.iter().sum();
        Ok((out, shape, counts))
    }
}

impl<B: Device> Communicator<B> for TcpComm {
    fn rank(&self) -> usize {
        TcpComm::rank(self)
    }

    fn world(&self) -> usize {
        TcpComm::world(self)
    }

    fn all_reduce(&self, b: &B, group: &Group, t: &Tensor<B>, op: ReduceOp) -> Result<Tensor<B>> {
        let data = b.download(t)?;
        let n = t.numel();
        let g = self.exchange(group, Header::of(Op::AllReduce(op), t), Some(&data), |_| {
            0..n
        })?;
        let out = reduce_host(&self.net.values(&g)?, 0..n, op);
        upload_as(b, self.net.internal(&g, out)?, t.shape(), t.dtype())
    }

    fn reduce_scatter(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        let (call, header, data) = self.reduce_scatter_call(b, group, t)?;
        let (values, shape) = self.net.reduce_scatter(&call, header, &data)?;
        upload_as(b, values, &shape, t.dtype())
    }

    fn reduce_scatter_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        let (call, header, data) = self.reduce_scatter_call(b, group, t)?;
        let net = Arc::clone(&self.net);
        let ctx = call.ctx.clone();
        self.progress.start(b, t.dtype(), ctx, move || {
            net.reduce_scatter(&call, header, &data)
        })
    }

    fn all_gather(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Tensor<B>> {
        let (call, header, data) = self.all_gather_call(b, group, t)?;
        let (values, shape) = self.net.all_gather(&call, header, &data)?;
        upload_as(b, values, &shape, t.dtype())
    }

    fn all_gather_start(&self, b: &B, group: &Group, t: &Tensor<B>) -> Result<Pending<B>> {
        let (call, header, data) = self.all_gather_call(b, group, t)?;
        let net = Arc::clone(&self.net);
        let ctx = call.ctx.clone();
        self.progress.start(b, t.dtype(), ctx, move || {
            net.all_gather(&call, header, &data)
        })
    }

    fn all_to_all_v(
        &self,
        b: &B,
        group: &Group,
        t: &Tensor<B>,
        send_rows: &[usize],
    ) -> Result<(Tensor<B>, Vec<usize>)> {
        let (call, header, data) = self.all_to_all_v_call(b, group, t, send_rows)?;
        let (values, shape, counts) = self.net.all_to_all_v(&call, header, &data)?;
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
        let (call, header, data) = self.all_to_all_v_call(b, group, t, send_rows)?;
        let (net, ctx) = (Arc::clone(&self.net), call.ctx.clone());
        let expected = recv_rows.to_vec();
        self.progress.start(b, t.dtype(), ctx, move || {
            let (values, shape, counts) = net.all_to_all_v(&call, header, &data)?;
            super::check_recv_rows(&call.ctx, &counts, &expected)
                .map_err(|detail| net.comm_err(detail))?;
            Ok((values, shape))
        })
    }

    fn broadcast(&self, b: &B, group: &Group, root: usize, t: &Tensor<B>) -> Result<Tensor<B>> {
        let size = group.size();
        let header = Header::of(Op::Broadcast { root }, t);
        if root >= size {
            let e = arg_err(
                "broadcast",
                format!("root {root} is not a group index: the group has {size} members"),
            );
            return Err(self.reject(group, header, e));
        }
        let is_root = group.index_of(self.net.rank) == Some(root);
        let data = if is_root { Some(b.download(t)?) } else { None };
        let n = t.numel();
        let g = self.exchange(group, header, data.as_ref(), |_| 0..n)?;
        let out = g.data[root].clone().ok_or_else(|| {
            self.net.comm_err(format!(
                "{}: the root sent no values (internal error)",
                g.ctx
            ))
        })?;
        let r = &g.headers[root];
        upload_as(b, out, &r.shape, r.dtype)
    }

    fn send(&self, b: &B, to: usize, t: &Tensor<B>) -> Result<()> {
        if to >= self.net.world {
            return Err(arg_err(
                "send",
                format!(
                    "destination rank {to} is outside the world of {} ranks",
                    self.net.world
                ),
            ));
        }
        let data = b.download(t)?;
        let ctx = format!("send from rank {} to rank {to}", self.net.rank);
        {
            let st = self.net.shared.lock();
            if let Some(e) = self.net.failure(&st, &ctx) {
                return Err(e);
            }
        }
        if to == self.net.rank {
            let (shape, dtype) = (t.shape().to_vec(), t.dtype());
            self.net.shared.update(|st| {
                st.mail
                    .entry(to)
                    .or_default()
                    .push_back(Message { data, shape, dtype });
            });
            return Ok(());
        }
        let mut body = Enc::default();
        body.u8(dtype_code(t.dtype()));
        body.usizes(t.shape());
        body.host(Some((&data, 0..data.len())));
        self.net
            .write_frame(to, KIND_P2P, &[&body.0])
            .map_err(|e| self.net.write_error(to, e, &ctx))
    }

    fn recv(&self, b: &B, from: usize) -> Result<Tensor<B>> {
        if from >= self.net.world {
            return Err(arg_err(
                "recv",
                format!(
                    "source rank {from} is outside the world of {} ranks",
                    self.net.world
                ),
            ));
        }
        let ctx = format!("recv on rank {} from rank {from}", self.net.rank);
        let deadline = Instant::now() + self.net.timeout;
        let mut st = self.net.shared.lock();
        let msg = loop {
            if let Some(e) = self.net.failure(&st, &ctx) {
                return Err(e);
            }
            if let Some(msg) = st.mail.get_mut(&from).and_then(VecDeque::pop_front) {
                break msg;
            }
            if let Some(why) = &st.gone[from] {
                return Err(self.net.comm_err(format!(
                    "{ctx}: rank {from} {why} with nothing left to send"
                )));
            }
            st = wait_for_change(st, &self.net.shared.cv, deadline, || {
                self.net.comm_err(format!(
                    "{ctx}: timed out after {:?}: rank {from} has sent nothing",
                    self.net.timeout
                ))
            })?;
        };
        drop(st);
        upload_as(b, msg.data, &msg.shape, msg.dtype)
    }

    fn barrier(&self, group: &Group) -> Result<()> {
        TcpComm::barrier(self, group)
    }

    fn abort(&self, reason: &str) {
        TcpComm::abort(self, reason)
    }
}

impl TcpComm {
    /// Tells the peers that this rank's arguments to its next call on
    /// `group` are wrong (so they report it instead of waiting), and returns
    /// the argument error `e` for this rank.
    fn reject(&self, group: &Group, header: Header, e: KernelError) -> KernelError {
        let header = Header {
            invalid: Some(e.to_string()),
            ..header
        };
        match self.exchange(group, header, None, |_| 0..0) {
            // An invalid group is the more basic mistake, reported first.
            Err(group_err @ KernelError::InvalidArgument { .. }) => group_err,
            _ => e,
        }
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort(&format!("rank {} panicked", self.net.rank));
        }
        for peer in 0..self.net.world {
            let _ = self.net.write_frame(peer, KIND_BYE, &[]);
            if let Some(Some(link)) = self.net.links.get(peer) {
                // Closing only the writing side: what the peer still sends
                // is read (and discarded) until it closes too, so it never
                // meets a reset that could lose data it has not yet read.
                let s = link.lock().unwrap_or_else(|p| p.into_inner());
                let _ = s.shutdown(Shutdown::Write);
            }
        }
    }
}

/// Runs `f` once per rank of a new world of `n` ranks, each in its own
/// thread with a [`TcpComm`] connected over loopback (a rendezvous on a
/// free port), and returns each rank's result in rank order, like
/// [`super::local::run_local`] does for the local communicator.
///
/// A rank whose `f` returns an error or panics is aborted, so its peers
/// stop with a [`KernelError::Comm`] instead of waiting for it; a panic
/// becomes that rank's [`KernelError::Comm`] carrying the panic message.
pub fn run_loopback<T, F>(n: usize, timeout: Duration, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(&TcpComm) -> Result<T> + Sync,
{
    let listener = match TcpListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => {
            let detail = format!("cannot listen on 127.0.0.1 for the rendezvous: {e}");
            return (0..n)
                .map(|rank| {
                    Err(KernelError::Comm {
                        rank,
                        detail: detail.clone(),
                    })
                })
                .collect();
        }
    };
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let mut listener = Some(listener);
    let f = &f;
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..n)
            .map(|rank| {
                let l = if rank == 0 { listener.take() } else { None };
                std::thread::Builder::new()
                    .name(format!("tcp-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let rdv = match l {
                            Some(l) => Rendezvous::host(l, n, timeout)?,
                            None => Rendezvous::join("127.0.0.1", port, rank, n, timeout)?,
                        };
                        let comm = TcpComm::from_rendezvous(&rdv, timeout)?;
                        drop(rdv);
                        match catch_unwind(AssertUnwindSafe(|| f(&comm))) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => {
                                comm.abort(&format!("rank {rank} returned an error: {e}"));
                                Err(e)
                            }
                            Err(payload) => {
                                let detail = format!(
                                    "rank {rank} panicked: {}",
                                    panic_message(payload.as_ref())
                                );
                                comm.abort(&detail);
                                Err(KernelError::Comm { rank, detail })
                            }
                        }
                    })
            })
            .collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(rank, t)| match t {
                Ok(handle) => handle.join().unwrap_or_else(|payload| {
                    Err(KernelError::Comm {
                        rank,
                        detail: format!(
                            "rank {rank} panicked: {}",
                            panic_message(payload.as_ref())
                        ),
                    })
                }),
                Err(e) => Err(KernelError::Comm {
                    rank,
                    detail: format!("could not start the thread of rank {rank}: {e}"),
                }),
            })
            .collect()
    })
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

#[cfg(test)]
impl TcpComm {
    /// Closes every connection without a goodbye, as a killed process's
    /// kernel would.
    fn sever(&self) {
        for link in self.net.links.iter().flatten() {
            let s = link.lock().unwrap_or_else(|p| p.into_inner());
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::comm::local::run_local;
    use crate::cpu::Cpu;
    use crate::ElementwiseOps;

    /// Generous: the failure tests assert they finish well before it.
    const TIMEOUT: Duration = Duration::from_secs(10);

    fn t32(v: &[f32], shape: &[usize]) -> Tensor<Cpu> {
        Cpu.upload(HostData::F32(v.to_vec()), shape).unwrap()
    }

    fn host(t: &Tensor<Cpu>) -> HostData {
        Cpu.download(t).unwrap()
    }

    fn world_group(n: usize) -> Group {
        Group::new((0..n).collect())
    }

    /// The detail of a `Comm` error, or a panic naming what came instead.
    fn comm_detail<T: std::fmt::Debug>(r: &Result<T>) -> &str {
        match r {
            Err(KernelError::Comm { detail, .. }) => detail,
            other => panic!("expected a Comm error, got {other:?}"),
        }
    }

    /// The exact bits of a host buffer (`==` on floats would equate 0 and
    /// -0 and tell NaN from itself).
    fn bits(h: &HostData) -> Vec<u64> {
        match h {
            HostData::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            HostData::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
            HostData::I32(v) => v.iter().map(|&x| x as u32 as u64).collect(),
        }
    }

    /// Values of mixed magnitudes, so that the order of a sum shows in its
    /// last bits.
    fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| rng.gen_range(-1.0f32..1.0) * 10f32.powi(rng.gen_range(-3..4)))
            .collect()
    }

    /// The inputs of [`every_collective`]: f32, bf16 values (the CPU keeps
    /// bf16 as f32 rounded to bf16, as in training), or f64.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Input {
        F32,
        Bf16,
        F64,
    }

    /// Every collective, on the world group and on subgroups in scrambled
    /// order, with inputs that depend on the rank; returns each result's
    /// dtype, shape and values.
    fn every_collective(
        c: &dyn Communicator<Cpu>,
        input: Input,
    ) -> Result<Vec<(DType, Vec<usize>, HostData)>> {
        let (rank, n) = (c.rank(), c.world());
        let mut rng = ChaCha8Rng::seed_from_u64(1000 + rank as u64);
        let mut out = Vec::new();
        let mut keep = |t: Tensor<Cpu>| -> Result<()> {
            out.push((t.dtype(), t.shape().to_vec(), Cpu.download(&t)?));
            Ok(())
        };
        let tensor = |rng: &mut ChaCha8Rng, shape: &[usize]| -> Result<Tensor<Cpu>> {
            let numel = shape.iter().product();
            let t = Cpu.upload(HostData::F32(values(rng, numel)), shape)?;
            match input {
                Input::F32 => Ok(t),
                Input::Bf16 => Cpu.round_bf16(&t),
                Input::F64 => Cpu.cast(&t, DType::F64),
            }
        };
        // The world, then the world backwards, then pairs (when there are
        // enough ranks): group order decides the order of the sums.
        let mut groups = vec![world_group(n), Group::new((0..n).rev().collect())];
        if n >= 3 {
            groups.push(Group::new(vec![2, 0]));
            groups.push(Group::new(vec![1]));
        }
        for g in &groups {
            if g.index_of(rank).is_none() {
                continue;
            }
            let size = g.size();
            let x = tensor(&mut rng, &[2 * size, 3])?;
            keep(c.all_reduce(&Cpu, g, &x, ReduceOp::Sum)?)?;
            keep(c.all_reduce(&Cpu, g, &x, ReduceOp::Max)?)?;
            keep(c.reduce_scatter(&Cpu, g, &x)?)?;
            // Different row counts per member, none for the first.
            let rows = g.index_of(rank).unwrap_or(0);
            keep(c.all_gather(&Cpu, g, &tensor(&mut rng, &[rows, 2])?)?)?;
            let send_rows: Vec<usize> = (0..size).map(|_| rng.gen_range(0..3)).collect();
            let total = send_rows.iter().sum();
            let (got, counts) =
                c.all_to_all_v(&Cpu, g, &tensor(&mut rng, &[total, 2])?, &send_rows)?;
            keep(got)?;
            let counts = counts.iter().map(|&k| k as i32).collect();
            keep(Cpu.upload(HostData::I32(counts), &[size])?)?;
            for root in 0..size {
                keep(c.broadcast(&Cpu, g, root, &tensor(&mut rng, &[3])?)?)?;
            }
            c.barrier(g)?;
        }
        // A ring of point-to-point messages, two per pair, read in order.
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        c.send(&Cpu, next, &tensor(&mut rng, &[2, 2])?)?;
        c.send(&Cpu, next, &tensor(&mut rng, &[1])?)?;
        keep(c.recv(&Cpu, prev)?)?;
        keep(c.recv(&Cpu, prev)?)?;
        Ok(out)
    }

    #[test]
    fn every_collective_is_bit_identical_to_the_local_communicator() {
        for input in [Input::F32, Input::Bf16, Input::F64] {
            for n in 1..=4 {
                let local: Vec<_> = run_local(n, TIMEOUT, |c| every_collective(&c, input))
                    .into_iter()
                    .map(Result::unwrap)
                    .collect();
                let tcp = run_loopback(n, TIMEOUT, |c| every_collective(c, input));
                for (rank, (want, got)) in local.iter().zip(&tcp).enumerate() {
                    let got = got.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    assert_eq!(want.len(), got.len());
                    for (i, (w, g)) in want.iter().zip(got).enumerate() {
                        let at = format!("{input:?}, {n} ranks, rank {rank}, result {i}");
                        assert_eq!((w.0, &w.1), (g.0, &g.1), "{at}");
                        assert_eq!(bits(&w.2), bits(&g.2), "{at}");
                    }
                }
            }
        }
    }

    #[test]
    fn large_tensors_cross_both_ways_at_once() {
        // Every rank writes 4 MB to every other while they write to it: the
        // reader threads keep the sockets drained, so nobody blocks.
        let n = 3;
        let len = 1 << 20;
        let out = run_loopback(n, TIMEOUT, |c| {
            let x = t32(&vec![c.rank() as f32 + 1.0; len], &[len]);
            let sum = Communicator::<Cpu>::all_reduce(c, &Cpu, &world_group(n), &x, ReduceOp::Sum)?;
            Ok(host(&sum))
        });
        for r in out {
            assert_eq!(r.unwrap(), HostData::F32(vec![6.0; len]));
        }
    }

    #[test]
    fn concurrent_subgroups_on_two_threads_do_not_mix() {
        // Each rank drives two groups from two threads at once, like
        // interleaved tensor- and expert-parallel calls.
        let out = run_loopback(4, TIMEOUT, |c| {
            let r = c.rank();
            let pair = Group::new(if r < 2 { vec![0, 1] } else { vec![2, 3] });
            let cross = Group::new(if r % 2 == 0 { vec![0, 2] } else { vec![1, 3] });
            std::thread::scope(|s| {
                let a = s.spawn(|| -> Result<Vec<HostData>> {
                    (0..20)
                        .map(|i| {
                            let x = t32(&[r as f32 + i as f32], &[1]);
                            c.all_reduce(&Cpu, &pair, &x, ReduceOp::Sum)
                                .map(|t| host(&t))
                        })
                        .collect()
                });
                let b: Result<Vec<HostData>> = (0..20)
                    .map(|i| {
                        let x = t32(&[10.0 * r as f32 + i as f32], &[1]);
                        c.all_gather(&Cpu, &cross, &x).map(|t| host(&t))
                    })
                    .collect();
                Ok((a.join().unwrap()?, b?))
            })
        });
        for (r, res) in out.into_iter().enumerate() {
            let (sums, gathers) = res.unwrap();
            let (p0, c0) = (if r < 2 { 0 } else { 2 }, r % 2);
            for i in 0..20 {
                let fi = i as f32;
                let want = (p0 as f32 + fi) + (p0 as f32 + 1.0 + fi);
                assert_eq!(sums[i], HostData::F32(vec![want]));
                let want = vec![10.0 * c0 as f32 + fi, 10.0 * (c0 + 2) as f32 + fi];
                assert_eq!(gathers[i], HostData::F32(want));
            }
        }
    }

    #[test]
    fn mismatched_calls_are_comm_errors_naming_both_ranks() {
        let out = run_loopback(2, TIMEOUT, |c| {
            let g = world_group(2);
            if c.rank() == 0 {
                c.all_reduce(&Cpu, &g, &t32(&[1.0], &[1]), ReduceOp::Sum)
                    .map(|_| ())
            } else {
                c.all_gather(&Cpu, &g, &t32(&[1.0], &[1])).map(|_| ())
            }
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(
                d.contains("rank 0 called all_reduce but rank 1 called all_gather"),
                "{d}"
            );
        }
        let out = run_loopback(2, TIMEOUT, |c| {
            let x = t32(&vec![1.0; c.rank() + 1], &[c.rank() + 1]);
            c.all_reduce(&Cpu, &world_group(2), &x, ReduceOp::Sum)
                .map(|_| ())
        });
        for r in &out {
            let d = comm_detail(r);
            assert!(
                d.contains("rank 0 passed F32 [1] but rank 1 passed F32 [2]"),
                "{d}"
            );
        }
    }

    #[test]
    fn bad_arguments_are_an_error_here_and_named_on_the_peers() {
        let start = Instant::now();
        let out = run_loopback(3, TIMEOUT, |c| {
            let rows = if c.rank() == 1 {
                vec![1, 1, 1]
            } else {
                vec![1, 0, 0]
            };
            c.all_to_all_v(&Cpu, &world_group(3), &t32(&[1.0, 2.0], &[1, 2]), &rows)
                .map(|_| ())
        });
        assert!(start.elapsed() < TIMEOUT / 2);
        assert!(
            matches!(&out[1], Err(KernelError::ShapeMismatch { .. })),
            "{:?}",
            out[1]
        );
        for r in [0, 2] {
            let d = comm_detail(&out[r]);
            assert!(
                d.contains("rank 1 passed invalid arguments") && d.contains("sum to 3"),
                "{d}"
            );
        }
        let out = run_loopback(2, TIMEOUT, |c| {
            c.all_reduce(
                &Cpu,
                &Group::new(vec![0, 5]),
                &t32(&[1.0], &[1]),
                ReduceOp::Sum,
            )
            .map(|_| ())
        });
        for r in &out {
            assert!(
                matches!(r, Err(KernelError::InvalidArgument { detail, .. }) if detail.contains("names rank 5")),
                "{r:?}"
            );
        }
    }

    #[test]
    fn an_abort_releases_the_peers_with_its_reason() {
        let start = Instant::now();
        let out = run_loopback(4, TIMEOUT, |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(50));
                return Err(arg_err("test", "boom"));
            }
            // Peers wait in different calls: collectives and a recv.
            match c.rank() {
                3 => c.recv(&Cpu, 2).map(|_| ()),
                _ => c
                    .all_reduce(&Cpu, &world_group(4), &t32(&[1.0], &[1]), ReduceOp::Sum)
                    .map(|_| ()),
            }
        });
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
        assert!(matches!(out[2], Err(KernelError::InvalidArgument { .. })));
        for r in [0, 1, 3] {
            let d = comm_detail(&out[r]);
            assert!(d.contains("rank 2 aborted") && d.contains("boom"), "{d}");
        }
    }

    #[test]
    fn a_panicking_rank_is_aborted_with_its_message() {
        let out = run_loopback(2, TIMEOUT, |c| {
            if c.rank() == 1 {
                panic!("deliberate test panic");
            }
            c.barrier(&world_group(2))
        });
        let d = comm_detail(&out[0]);
        assert!(
            d.contains("rank 1 aborted: rank 1 panicked: deliberate test panic"),
            "{d}"
        );
    }

    #[test]
    fn a_peer_that_leaves_or_dies_is_named_not_waited_for() {
        let start = Instant::now();
        // Leaves: its handle is dropped after its last send.
        let out = run_loopback(2, TIMEOUT, |c| {
            if c.rank() == 1 {
                c.send(&Cpu, 0, &t32(&[7.0], &[1]))?;
                return Ok(String::new());
            }
            std::thread::sleep(Duration::from_millis(100));
            // What it sent before leaving is still delivered.
            assert_eq!(host(&c.recv(&Cpu, 1)?), HostData::F32(vec![7.0]));
            let e = c.barrier(&world_group(2)).unwrap_err().to_string();
            let e2 = c.recv(&Cpu, 1).unwrap_err().to_string();
            Ok(format!("{e} / {e2}"))
        });
        let d = out[0].as_ref().unwrap();
        assert!(
            d.contains("rank 1 dropped its communicator without making this call"),
            "{d}"
        );
        assert!(d.contains("with nothing left to send"), "{d}");
        // Dies: its connections close without a word.
        let out = run_loopback(3, TIMEOUT, |c| {
            if c.rank() == 1 {
                c.sever();
                std::thread::sleep(Duration::from_millis(300));
                return Ok(String::new());
            }
            let e = c.barrier(&world_group(3)).unwrap_err().to_string();
            Ok(e)
        });
        for r in [0, 2] {
            let d = out[r].as_ref().unwrap();
            assert!(d.contains("rank 1 disconnected"), "{d}");
        }
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
    }

    #[test]
    fn a_silent_peer_times_out_naming_it() {
        let t = Duration::from_millis(500);
        let out = run_loopback(3, t, |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(1200));
                return Ok(String::new());
            }
            let start = Instant::now();
            let e = c.barrier(&world_group(3)).unwrap_err().to_string();
            assert!(start.elapsed() < Duration::from_millis(1100));
            Ok(e)
        });
        for r in [0, 1] {
            let d = out[r].as_ref().unwrap();
            assert!(
                d.contains("timed out after 500ms: ranks [2] have not arrived"),
                "{d}"
            );
        }
    }

    #[test]
    fn connect_builds_the_mesh_from_dist_env() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let results: Vec<Result<HostData>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    s.spawn(move || {
                        let env = DistEnv {
                            rank,
                            world: 2,
                            local_rank: rank,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                        };
                        let c = TcpComm::connect(&env, TIMEOUT)?;
                        let x = t32(&[rank as f32 + 0.5], &[1]);
                        let y = Communicator::<Cpu>::all_gather(&c, &Cpu, &world_group(2), &x)?;
                        Ok(host(&y))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert_eq!(r.unwrap(), HostData::F32(vec![0.5, 1.5]));
        }
    }

    #[test]
    fn corrupt_frames_decode_to_none_not_a_panic() {
        let mut e = Enc::default();
        e.header(&Header {
            op: Op::AllToAllV,
            dtype: DType::BF16,
            shape: vec![3, 2],
            send_rows: vec![1, 2],
            invalid: Some("why".into()),
        });
        e.host(Some((&HostData::I32(vec![1, 2, 3]), 1..3)));
        let bytes = e.0;
        let mut d = Dec(&bytes);
        let h = d.header().unwrap();
        assert_eq!(
            (h.op, h.dtype, h.shape, h.send_rows),
            (Op::AllToAllV, DType::BF16, vec![3, 2], vec![1, 2])
        );
        assert_eq!(h.invalid.as_deref(), Some("why"));
        assert_eq!(d.host(), Some(Some(HostData::I32(vec![2, 3]))));
        for cut in 0..bytes.len() {
            let mut d = Dec(&bytes[..cut]);
            assert!(d.header().and_then(|_| d.host()?).is_none(), "cut at {cut}");
        }
    }

    /// Reduce-scatters, all-to-alls and all-gathers over two orders of the
    /// world, with a blocking all-reduce between them on the same group:
    /// started (then waited in another order) or blocking.
    fn scatter_and_gather(c: &dyn Communicator<Cpu>, started: bool) -> Result<Vec<HostData>> {
        let (rank, n) = (c.rank(), c.world());
        let mut rng = ChaCha8Rng::seed_from_u64(2000 + rank as u64);
        let mut out = Vec::new();
        for g in [world_group(n), Group::new((0..n).rev().collect())] {
            let x = Cpu.upload(HostData::F32(values(&mut rng, 4 * n)), &[2 * n, 2])?;
            let rows = g.index_of(rank).unwrap_or(0);
            let y = Cpu.upload(HostData::F32(values(&mut rng, 3 * rows)), &[rows, 3])?;
            // Member k gets k + 1 rows from every member.
            let send: Vec<usize> = (1..=n).collect();
            let recv = vec![rows + 1; n];
            let z = Cpu.upload(
                HostData::F32(values(&mut rng, n * (n + 1))),
                &[n * (n + 1) / 2, 2],
            )?;
            if started {
                let rs = c.reduce_scatter_start(&Cpu, &g, &x)?;
                let sum = c.all_reduce(&Cpu, &g, &x, ReduceOp::Sum)?;
                let a2a = c.all_to_all_v_start(&Cpu, &g, &z, &send, &recv)?;
                let ag = c.all_gather_start(&Cpu, &g, &y)?;
                let (ag, rs) = (ag.wait()?, rs.wait()?);
                out.extend([host(&rs), host(&sum), host(&ag), host(&a2a.wait()?)]);
            } else {
                let rs = c.reduce_scatter(&Cpu, &g, &x)?;
                let sum = c.all_reduce(&Cpu, &g, &x, ReduceOp::Sum)?;
                let (a2a, _) = c.all_to_all_v(&Cpu, &g, &z, &send)?;
                let ag = c.all_gather(&Cpu, &g, &y)?;
                out.extend([host(&rs), host(&sum), host(&ag), host(&a2a)]);
            }
        }
        Ok(out)
    }

    #[test]
    fn started_collectives_are_bit_identical_to_the_local_blocking_ones() {
        for n in 1..=3 {
            let local: Vec<_> = run_local(n, TIMEOUT, |c| scatter_and_gather(&c, false))
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let tcp = run_loopback(n, TIMEOUT, |c| scatter_and_gather(c, true));
            for (rank, (want, got)) in local.iter().zip(&tcp).enumerate() {
                let got = got.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                let bits_of = |v: &[HostData]| v.iter().map(bits).collect::<Vec<_>>();
                assert_eq!(bits_of(want), bits_of(got), "{n} ranks, rank {rank}");
            }
        }
    }

    #[test]
    fn a_peer_that_dies_during_a_started_collective_is_named() {
        let start = Instant::now();
        let out = run_loopback(3, TIMEOUT, |c| {
            if c.rank() == 1 {
                c.sever();
                std::thread::sleep(Duration::from_millis(300));
                return Ok(String::new());
            }
            let p = c.reduce_scatter_start(&Cpu, &world_group(3), &t32(&[1.0; 3], &[3]))?;
            Ok(p.wait().unwrap_err().to_string())
        });
        for r in [0, 2] {
            let d = out[r].as_ref().unwrap();
            assert!(
                d.contains("reduce_scatter on group [0, 1, 2]")
                    && d.contains("rank 1 disconnected"),
                "{d}"
            );
            assert!(!d.contains('\n'), "{d}");
        }
        assert!(start.elapsed() < TIMEOUT / 2, "took {:?}", start.elapsed());
    }
}
