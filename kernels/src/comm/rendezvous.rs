//! How the processes of a multi-process run find each other (docs/ARCHITECTURE.md §7):
//! torchrun/Slurm-style variables ([`DistEnv`]) and a small TCP rendezvous
//! on `MASTER_ADDR:MASTER_PORT` ([`Rendezvous`]).
//!
//! Rank 0 listens on the master address; every other rank connects to it,
//! retrying until the timeout (rank 0 may start last). Over these star
//! connections the rendezvous offers three small exchanges, enough to set up
//! a real communicator:
//! - [`Rendezvous::broadcast_blob`]: rank 0's bytes to every rank (the NCCL
//!   unique id);
//! - [`Rendezvous::all_gather_blobs`]: every rank's bytes to every rank (the
//!   listen addresses of [`super::tcp::TcpComm`]'s mesh);
//! - [`Rendezvous::barrier`].
//!
//! Nothing waits forever: a rank that never connects makes rank 0 fail after
//! the timeout naming the missing ranks, a rank that cannot reach rank 0
//! fails naming the address, and a peer that disconnects or stays silent in
//! an exchange is named in the error. When rank 0 fails an exchange it tells
//! the other ranks why before closing, so their errors carry the cause.
//!
//! The exchanges are meant for setup, not for bulk data: every blob passes
//! through rank 0.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{arg_err, KernelError, Result};

/// The variables [`DistEnv::from_env`] reads, in the order it checks them.
pub const ENV_VARS: [&str; 5] = [
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// This process's place in a multi-process run, from torchrun/Slurm-style
/// environment variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank of this process (`RANK`), below `world`.
    pub rank: usize,
    /// Number of processes in the run (`WORLD_SIZE`), at least 1.
    pub world: usize,
    /// Rank of this process on its node (`LOCAL_RANK`; `RANK` when unset):
    /// the GPU it drives.
    pub local_rank: usize,
    /// Host or IP address where rank 0 listens (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port where rank 0 listens (`MASTER_PORT`), 1 to 65535.
    pub master_port: u16,
}

impl DistEnv {
    /// Reads `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR` and
    /// `MASTER_PORT` from the process environment.
    ///
    /// Returns `None` when `WORLD_SIZE` is unset (not a multi-process run);
    /// otherwise every variable but `LOCAL_RANK` must be set, and a missing
    /// or bad one is an error naming the variable and its value.
    pub fn from_env() -> Result<Option<DistEnv>> {
        DistEnv::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`DistEnv::from_env`] over any source of variables (`get(name)` is
    /// the variable's value, `None` when unset), so the parsing can be
    /// tested without touching the process environment.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let Some(world_text) = get("WORLD_SIZE") else {
            return Ok(None);
        };
        let world = parse_var("WORLD_SIZE", &world_text)?;
        if world == 0 {
            return Err(env_err(format!(
                "WORLD_SIZE = {world_text:?}: must be at least 1"
            )));
        }
        let required = |name: &str| {
            get(name).ok_or_else(|| {
                env_err(format!(
                    "WORLD_SIZE is set ({world}) but {name} is not; a multi-process run needs \
                     WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT"
                ))
            })
        };
        let rank_text = required("RANK")?;
        let rank = parse_var("RANK", &rank_text)?;
        if rank >= world {
            return Err(env_err(format!(
                "RANK = {rank_text:?} is not below WORLD_SIZE = {world}"
            )));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(text) => parse_var("LOCAL_RANK", &text)?,
            None => rank,
        };
        let master_addr = required("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(env_err(format!(
                "MASTER_ADDR = {master_addr:?}: must name a host or IP address"
            )));
        }
        let port_text = required("MASTER_PORT")?;
        let master_port = match port_text.trim().parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => {
                return Err(env_err(format!(
                    "MASTER_PORT = {port_text:?}: must be a port number from 1 to 65535"
                )))
            }
        };
        Ok(Some(DistEnv {
            rank,
            world,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT`, for messages.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// A non-negative integer variable, or an error naming it and its value.
fn parse_var(name: &str, text: &str) -> Result<usize> {
    text.trim()
        .parse::<usize>()
        .map_err(|_| env_err(format!("{name} = {text:?} is not a non-negative integer")))
}

fn env_err(detail: String) -> KernelError {
    arg_err("distributed environment", detail)
}

/// First bytes of a rendezvous hello: tells a foldmoe rank from a stray
/// connection (a port scanner, another program on the port).
const RDV_MAGIC: &[u8; 8] = b"FMOERDV1";
/// Frame tags of the rendezvous exchanges.
const TAG_DATA: u8 = b'D';
const TAG_ERROR: u8 = b'E';
/// Largest blob a rendezvous frame may carry: the exchanges carry ids and
/// addresses, so anything bigger is a stray or corrupt stream.
const MAX_BLOB: u64 = 64 << 20;

/// The connected ranks of a run, ready for small exchanges through rank 0.
///
/// Made by [`Rendezvous::connect`] (from a [`DistEnv`]), or by
/// [`Rendezvous::host`] and [`Rendezvous::join`] (tests, custom launchers).
/// Every rank must call the same exchanges in the same order. Calls on one
/// handle are serialised (it is `Sync`, but concurrent exchanges would not
/// be matched with the peers' in a defined order).
pub struct Rendezvous {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Rank 0: a stream to each other rank, in rank order; any other rank:
    /// its stream to rank 0.
    peers: Mutex<Vec<(usize, TcpStream)>>,
    /// The address other ranks reach this process on (the interface that
    /// carries the rendezvous).
    local_ip: IpAddr,
    /// Random number of this run, chosen by rank 0: later connections
    /// between the ranks carry it, so a stray one is told apart.
    token: u64,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("timeout", &self.timeout)
            .field("local_ip", &self.local_ip)
            .finish()
    }
}

impl Rendezvous {
    /// Rank 0 listens on `env.master()` and waits for the others; any other
    /// rank connects to it. Each waits at most `timeout` for the others.
    pub fn connect(env: &DistEnv, timeout: Duration) -> Result<Rendezvous> {
        if env.rank == 0 {
            let listener =
                TcpListener::bind((env.master_addr.as_str(), env.master_port)).map_err(|e| {
                    comm_err(
                        0,
                        format!(
                            "rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {}: {e} (is the \
                             port in use, or the address not this host's?)",
                            env.master()
                        ),
                    )
                })?;
            Rendezvous::host(listener, env.world, timeout)
        } else {
            Rendezvous::join(
                &env.master_addr,
                env.master_port,
                env.rank,
                env.world,
                timeout,
            )
        }
    }

    /// Rank 0 of a run of `world` ranks: accepts the other ranks on
    /// `listener` until all have connected, or fails after `timeout` naming
    /// the ranks that never did.
    pub fn host(listener: TcpListener, world: usize, timeout: Duration) -> Result<Rendezvous> {
        let fail = |detail: String| comm_err(0, detail);
        let addr = listener.local_addr().map_err(|e| {
            fail(format!(
                "rendezvous: cannot read the listening address: {e}"
            ))
        })?;
        if world == 0 {
            return Err(arg_err("rendezvous", "a run needs at least one rank"));
        }
        let token = RandomState::new().build_hasher().finish();
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(format!("rendezvous on {addr}: {e}")))?;
        let deadline = Instant::now() + timeout;
        while peers[1..].iter().any(Option::is_none) {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (1..world).filter(|&r| peers[r].is_none()).collect();
                        let detail = format!(
                            "rendezvous on {addr}: timed out after {timeout:?}: ranks {missing:?} \
                             of WORLD_SIZE = {world} never connected"
                        );
                        tell_error(peers.iter().flatten(), &detail);
                        return Err(fail(detail));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => return Err(fail(format!("rendezvous on {addr}: accept failed: {e}"))),
            };
            // A hello that is not a foldmoe rank's is ignored: whatever
            // connected, the run must not fail because of it.
            let Some((rank, their_world)) = read_hello(&stream, deadline) else {
                continue;
            };
            let reply = if their_world != world {
                Err(format!(
                    "rank {rank} has WORLD_SIZE = {their_world} but rank 0 has {world}; every \
                     rank must be started with the same WORLD_SIZE"
                ))
            } else if rank == 0 || rank >= world {
                Err(format!(
                    "a process connected as rank {rank}, outside 1..{world} (WORLD_SIZE = {world})"
                ))
            } else if peers[rank].is_some() {
                Err(format!(
                    "two processes connected as rank {rank}; every rank must have its own RANK"
                ))
            } else {
                Ok(())
            };
            let mut s = &stream;
            match reply {
                Ok(()) => {
                    let mut welcome = Vec::with_capacity(9);
                    welcome.push(TAG_DATA);
                    welcome.extend_from_slice(&token.to_le_bytes());
                    s.write_all(&welcome).map_err(|e| {
                        fail(format!(
                            "rendezvous: rank {rank} disconnected during its hello: {e}"
                        ))
                    })?;
                    peers[rank] = Some(stream);
                }
                Err(why) => {
                    let _ = write_frame(&mut s, TAG_ERROR, why.as_bytes());
                    let detail = format!("rendezvous on {addr}: {why}");
                    tell_error(peers.iter().flatten(), &detail);
                    return Err(fail(detail));
                }
            }
        }
        let peers: Vec<(usize, TcpStream)> = peers
            .into_iter()
            .enumerate()
            .filter_map(|(r, s)| Some((r, s?)))
            .collect();
        for (r, s) in &peers {
            configure(s, timeout).map_err(|e| fail(format!("rendezvous: rank {r}: {e}")))?;
        }
        // The address the other ranks used to reach rank 0 is the one they
        // can reach it on again (the listener may be on a wildcard address).
        let local_ip = match peers.first() {
            Some((_, s)) => s.local_addr().map(|a| a.ip()).unwrap_or(addr.ip()),
            None => addr.ip(),
        };
        Ok(Rendezvous {
            rank: 0,
            world,
            timeout,
            peers: Mutex::new(peers),
            local_ip,
            token,
        })
    }

    /// Rank `rank` (not 0) of a run of `world` ranks: connects to rank 0 at
    /// `master_addr:master_port`, retrying until `timeout` in case rank 0
    /// has not started listening yet.
    pub fn join(
        master_addr: &str,
        master_port: u16,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Rendezvous> {
        let fail = |detail: String| comm_err(rank, detail);
        if rank == 0 || rank >= world {
            return Err(arg_err(
                "rendezvous",
                format!("rank {rank} cannot join a run of {world} ranks (rank 0 hosts it)"),
            ));
        }
        let master = if master_addr.contains(':') {
            format!("[{master_addr}]:{master_port}")
        } else {
            format!("{master_addr}:{master_port}")
        };
        let deadline = Instant::now() + timeout;
        let mut last_err = String::from("no attempt made");
        let stream = loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(fail(format!(
                    "rendezvous: could not reach rank 0 at MASTER_ADDR:MASTER_PORT = {master} \
                     within {timeout:?} (last error: {last_err}); is rank 0 running?"
                )));
            }
            let attempt = (master_addr, master_port)
                .to_socket_addrs()
                .map_err(|e| format!("cannot resolve {master}: {e}"))
                .and_then(|addrs| {
                    let mut err = format!("{master} resolves to no address");
                    for a in addrs {
                        let wait = (deadline - now)
                            .clamp(Duration::from_millis(1), Duration::from_secs(2));
                        match TcpStream::connect_timeout(&a, wait) {
                            Ok(s) => return Ok(s),
                            Err(e) => err = format!("{a}: {e}"),
                        }
                    }
                    Err(err)
                });
            match attempt {
                Ok(s) => break s,
                Err(e) => {
                    last_err = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(RDV_MAGIC);
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        hello.extend_from_slice(&(world as u64).to_le_bytes());
        let mut s = &stream;
        s.write_all(&hello).map_err(|e| {
            fail(format!(
                "rendezvous: sending the hello to rank 0 at {master}: {e}"
            ))
        })?;
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        configure(&stream, remaining).map_err(|e| fail(format!("rendezvous: {e}")))?;
        let mut tag = [0u8; 1];
        read_exact(&stream, &mut tag, 0, "its reply to the hello").map_err(&fail)?;
        let token = match tag[0] {
            TAG_DATA => {
                let mut t = [0u8; 8];
                read_exact(&stream, &mut t, 0, "its reply to the hello").map_err(&fail)?;
                u64::from_le_bytes(t)
            }
            TAG_ERROR => {
                let why = read_body(&stream, 0, "its reply to the hello").map_err(&fail)?;
                return Err(fail(format!(
                    "rendezvous: rank 0 refused this rank: {}",
                    String::from_utf8_lossy(&why)
                )));
            }
            other => {
                return Err(fail(format!(
                    "rendezvous: {master} answered with byte {other:#04x}, not a foldmoe rank 0"
                )))
            }
        };
        configure(&stream, timeout).map_err(|e| fail(format!("rendezvous: {e}")))?;
        let local_ip = stream
            .local_addr()
            .map_err(|e| fail(format!("rendezvous: {e}")))?
            .ip();
        Ok(Rendezvous {
            rank,
            world,
            timeout,
            peers: Mutex::new(vec![(0, stream)]),
            local_ip,
            token,
        })
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the run.
    pub fn world(&self) -> usize {
        self.world
    }

    /// How long an exchange waits for a peer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The IP address the other ranks can reach this process on.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// The run's random number, the same on every rank (chosen by rank 0).
    pub fn token(&self) -> u64 {
        self.token
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(usize, TcpStream)>> {
        // The streams stay usable if another thread panicked mid-exchange;
        // the peers will then report a protocol error, not a hang.
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank 0's `blob` on every rank: rank 0 passes `Some(bytes)`, the
    /// others `None` (a rank 0 passing `None`, or another rank `Some`, is an
    /// argument error). Used to share the NCCL unique id.
    pub fn broadcast_blob(&self, blob: Option<&[u8]>) -> Result<Vec<u8>> {
        let peers = self.lock();
        if self.rank == 0 {
            let blob = blob.ok_or_else(|| {
                arg_err("broadcast_blob", "rank 0 must pass the bytes to distribute")
            })?;
            for (r, s) in peers.iter() {
                let mut w = s;
                write_frame(&mut w, TAG_DATA, blob).map_err(|e| {
                    self.fail(format!("broadcast_blob: sending to rank {r} failed: {e}"))
                })?;
            }
            Ok(blob.to_vec())
        } else {
            if blob.is_some() {
                return Err(arg_err(
                    "broadcast_blob",
                    format!(
                        "rank {} passed bytes, but only rank 0's are sent",
                        self.rank
                    ),
                ));
            }
            self.recv_from_root(&peers, "broadcast_blob")
        }
    }

    /// Every rank's `blob`, in rank order, on every rank (through rank 0).
    pub fn all_gather_blobs(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        let peers = self.lock();
        if self.rank == 0 {
            let mut all = vec![blob.to_vec()];
            for (r, s) in peers.iter() {
                match read_frame(s, *r, "all_gather_blobs") {
                    Ok(FrameIn::Data(b)) => all.push(b),
                    Ok(FrameIn::Error(why)) => {
                        let detail = format!("all_gather_blobs: rank {r} failed: {why}");
                        tell_error(peers.iter().map(|(_, s)| s), &detail);
                        return Err(self.fail(detail));
                    }
                    Err(detail) => {
                        tell_error(peers.iter().map(|(_, s)| s), &detail);
                        return Err(self.fail(detail));
                    }
                }
            }
            let packed = pack_blobs(&all);
            for (r, s) in peers.iter() {
                let mut w = s;
                write_frame(&mut w, TAG_DATA, &packed).map_err(|e| {
                    self.fail(format!("all_gather_blobs: sending to rank {r} failed: {e}"))
                })?;
            }
            Ok(all)
        } else {
            let (_, s) = &peers[0];
            let mut w = s;
            write_frame(&mut w, TAG_DATA, blob).map_err(|e| {
                self.fail(format!("all_gather_blobs: sending to rank 0 failed: {e}"))
            })?;
            let packed = self.recv_from_root(&peers, "all_gather_blobs")?;
            let all = unpack_blobs(&packed).ok_or_else(|| {
                self.fail("all_gather_blobs: rank 0 sent a malformed list".to_string())
            })?;
            if all.len() != self.world {
                return Err(self.fail(format!(
                    "all_gather_blobs: rank 0 sent {} blobs for {} ranks",
                    all.len(),
                    self.world
                )));
            }
            Ok(all)
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.all_gather_blobs(&[]).map(|_| ())
    }

    /// A non-zero rank's next frame from rank 0 (its error turned into ours).
    fn recv_from_root(&self, peers: &[(usize, TcpStream)], what: &str) -> Result<Vec<u8>> {
        let (_, s) = &peers[0];
        match read_frame(s, 0, what) {
            Ok(FrameIn::Data(b)) => Ok(b),
            Ok(FrameIn::Error(why)) => Err(self.fail(format!("{what}: rank 0 failed: {why}"))),
            Err(detail) => Err(self.fail(detail)),
        }
    }

    fn fail(&self, detail: String) -> KernelError {
        comm_err(self.rank, detail)
    }
}

fn comm_err(rank: usize, detail: String) -> KernelError {
    KernelError::Comm { rank, detail }
}

/// Blocking streams with `timeout` on every read and write, and no Nagle
/// delay (the exchanges are small request/answer messages).
pub(super) fn configure(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    let timeout = timeout.max(Duration::from_millis(1));
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))
}

/// A rank's hello on a freshly accepted stream: `(rank, world)`, or `None`
/// when the bytes are not a foldmoe hello (or do not come before the
/// deadline, at most a few seconds: a silent stray must not stall the rest).
fn read_hello(stream: &TcpStream, deadline: Instant) -> Option<(usize, usize)> {
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), Duration::from_secs(2));
    configure(stream, wait).ok()?;
    let mut buf = [0u8; 24];
    (&*stream).read_exact(&mut buf).ok()?;
    if &buf[..8] != RDV_MAGIC {
        return None;
    }
    let rank = u64::from_le_bytes(buf[8..16].try_into().ok()?);
    let world = u64::from_le_bytes(buf[16..24].try_into().ok()?);
    Some((usize::try_from(rank).ok()?, usize::try_from(world).ok()?))
}

/// One rendezvous frame as read.
enum FrameIn {
    Data(Vec<u8>),
    /// The peer failed and says why.
    Error(String),
}

/// `tag`, then the length (u64 little-endian), then the bytes.
fn write_frame(w: &mut impl Write, tag: u8, body: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = tag;
    head[1..].copy_from_slice(&(body.len() as u64).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(body)?;
    w.flush()
}

/// Tells every stream's peer that this exchange failed, and why (best
/// effort: the peer may be gone already).
fn tell_error<'a>(streams: impl IntoIterator<Item = &'a TcpStream>, why: &str) {
    for s in streams {
        let mut w = s;
        let _ = write_frame(&mut w, TAG_ERROR, why.as_bytes());
    }
}

fn read_frame(s: &TcpStream, peer: usize, what: &str) -> std::result::Result<FrameIn, String> {
    let mut tag = [0u8; 1];
    read_exact(s, &mut tag, peer, what)?;
    let body = read_body(s, peer, what)?;
    match tag[0] {
        TAG_DATA => Ok(FrameIn::Data(body)),
        TAG_ERROR => Ok(FrameIn::Error(String::from_utf8_lossy(&body).into_owned())),
        other => Err(format!(
            "rank {peer} sent byte {other:#04x} where a frame starts (protocol error)"
        )),
    }
}

/// A length-prefixed body (the length checked against [`MAX_BLOB`]).
fn read_body(s: &TcpStream, peer: usize, what: &str) -> std::result::Result<Vec<u8>, String> {
    let mut len = [0u8; 8];
    read_exact(s, &mut len, peer, what)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_BLOB {
        return Err(format!(
            "rank {peer} announced a {len}-byte blob (more than {MAX_BLOB}; protocol error)"
        ));
    }
    let mut body = vec![0u8; len as usize];
    read_exact(s, &mut body, peer, what)?;
    Ok(body)
}

/// Fills `buf` from `s`, naming `peer` and the exchange when it disconnects
/// or stays silent past the stream's timeout.
fn read_exact(
    s: &TcpStream,
    buf: &mut [u8],
    peer: usize,
    what: &str,
) -> std::result::Result<(), String> {
    (&*s).read_exact(buf).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            let t = s.read_timeout().ok().flatten().unwrap_or_default();
            format!("rank {peer} sent nothing for {what} within {t:?}")
        }
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
            format!("rank {peer} disconnected during {what} (its process exited or was killed?)")
        }
        _ => format!("reading from rank {peer} during {what}: {e}"),
    })
}

/// Blobs as a count then length-prefixed entries.
fn pack_blobs(blobs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = (blobs.len() as u64).to_le_bytes().to_vec();
    for b in blobs {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

fn unpack_blobs(mut bytes: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = bytes.split_at_checked(n)?;
        bytes = rest;
        Some(head)
    };
    let count = u64::from_le_bytes(take(8)?.try_into().ok()?);
    let mut out = Vec::new();
    for _ in 0..count {
        let len = u64::from_le_bytes(take(8)?.try_into().ok()?);
        out.push(take(usize::try_from(len).ok()?)?.to_vec());
    }
    Some(out)
}

/// Binds a listener for a rank's own connections on `ip`, any free port.
pub(super) fn listen_any(ip: IpAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind((ip, 0))?;
    let a = l.local_addr()?;
    Ok((l, a))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    fn env_error(pairs: &[(&str, &str)]) -> String {
        DistEnv::from_vars(vars(pairs)).unwrap_err().to_string()
    }

    const OK: [(&str, &str); 5] = [
        ("WORLD_SIZE", "4"),
        ("RANK", "2"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "node7"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn dist_env_reads_torchrun_variables() {
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        let env = DistEnv::from_vars(vars(&OK)).unwrap().unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 2,
                world: 4,
                local_rank: 0,
                master_addr: "node7".into(),
                master_port: 29500
            }
        );
        assert_eq!(env.master(), "node7:29500");
        // LOCAL_RANK defaults to RANK (one node).
        let env = DistEnv::from_vars(vars(&[OK[0], OK[1], OK[3], OK[4]]))
            .unwrap()
            .unwrap();
        assert_eq!(env.local_rank, 2);
        let v6 = DistEnv::from_vars(vars(&[OK[0], OK[1], ("MASTER_ADDR", "::1"), OK[4]]))
            .unwrap()
            .unwrap();
        assert_eq!(v6.master(), "[::1]:29500");
    }

    #[test]
    fn dist_env_errors_name_the_variable_and_value() {
        let with = |name: &str, value: &str| {
            let mut pairs = OK.to_vec();
            pairs.iter_mut().find(|(k, _)| *k == name).unwrap().1 = value;
            env_error(&pairs)
        };
        let e = with("WORLD_SIZE", "four");
        assert!(e.contains("WORLD_SIZE = \"four\""), "{e}");
        let e = with("WORLD_SIZE", "0");
        assert!(e.contains("WORLD_SIZE = \"0\": must be at least 1"), "{e}");
        let e = with("RANK", "-1");
        assert!(
            e.contains("RANK = \"-1\" is not a non-negative integer"),
            "{e}"
        );
        let e = with("RANK", "4");
        assert!(
            e.contains("RANK = \"4\" is not below WORLD_SIZE = 4"),
            "{e}"
        );
        let e = with("LOCAL_RANK", "x");
        assert!(e.contains("LOCAL_RANK = \"x\""), "{e}");
        let e = with("MASTER_PORT", "70000");
        assert!(e.contains("MASTER_PORT = \"70000\""), "{e}");
        let e = with("MASTER_PORT", "0");
        assert!(e.contains("MASTER_PORT = \"0\""), "{e}");
        let e = with("MASTER_ADDR", " ");
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = env_error(&[OK[0], OK[3], OK[4]]);
        assert!(e.contains("RANK is not"), "{e}");
        let e = env_error(&[OK[0], OK[1], OK[4]]);
        assert!(e.contains("MASTER_ADDR is not"), "{e}");
    }

    /// Runs `f` on a rendezvous of `n` ranks on loopback (rank 0 on a free
    /// port), each rank in a thread; results in rank order.
    fn with_ranks<T: Send>(
        n: usize,
        timeout: Duration,
        f: impl Fn(Rendezvous) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let f = &f;
        std::thread::scope(|scope| {
            let mut listener = Some(listener);
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let l = if rank == 0 { listener.take() } else { None };
                    scope.spawn(move || {
                        let r = match l {
                            Some(l) => Rendezvous::host(l, n, timeout),
                            None => Rendezvous::join("127.0.0.1", port, rank, n, timeout),
                        };
                        r.and_then(f)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn blobs_are_broadcast_and_gathered_in_rank_order() {
        for n in 1..=4 {
            let results = with_ranks(n, Duration::from_secs(10), |rdv| {
                let id: Vec<u8> = (0..128u8).collect();
                let got = rdv.broadcast_blob((rdv.rank() == 0).then_some(&id[..]))?;
                assert_eq!(got, id);
                let mine = format!("rank {}", rdv.rank()).into_bytes();
                let all = rdv.all_gather_blobs(&mine)?;
                rdv.barrier()?;
                Ok((rdv.token(), all))
            });
            let want: Vec<Vec<u8>> = (0..n).map(|r| format!("rank {r}").into_bytes()).collect();
            let token = results[0].as_ref().unwrap().0;
            for r in results {
                let (t, all) = r.unwrap();
                assert_eq!(all, want);
                assert_eq!(t, token, "every rank shares rank 0's token");
            }
        }
    }

    #[test]
    fn a_rank_that_never_connects_is_named_after_the_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let t = Duration::from_millis(600);
        let joiner = std::thread::spawn(move || Rendezvous::join("127.0.0.1", port, 2, 4, t));
        let start = Instant::now();
        let e = Rendezvous::host(listener, 4, t).unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            e.contains("ranks [1, 3]") && e.contains("never connected"),
            "{e}"
        );
        // Rank 2 connected, then rank 0 gave up and closed: its first
        // exchange fails instead of waiting.
        let rdv = joiner.join().unwrap().unwrap();
        let e = rdv.barrier().unwrap_err().to_string();
        assert!(e.contains("rank 0"), "{e}");
    }

    #[test]
    fn a_missing_rank_0_is_named_with_its_address() {
        // A port nobody listens on: bind, read it, release it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = Rendezvous::join("127.0.0.1", port, 1, 2, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("could not reach rank 0") && e.contains(&format!(":{port}")),
            "{e}"
        );
    }

    #[test]
    fn mismatched_world_sizes_and_duplicate_ranks_are_errors() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let t = Duration::from_secs(5);
        let joiner = std::thread::spawn(move || Rendezvous::join("127.0.0.1", port, 1, 3, t));
        let e = Rendezvous::host(listener, 2, t).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE = 3 but rank 0 has 2"), "{e}");
        let e = joiner.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("refused") && e.contains("WORLD_SIZE = 3"), "{e}");

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let a = std::thread::spawn(move || Rendezvous::join("127.0.0.1", port, 1, 3, t));
        let b = std::thread::spawn(move || Rendezvous::join("127.0.0.1", port, 1, 3, t));
        let e = Rendezvous::host(listener, 3, t).unwrap_err().to_string();
        assert!(e.contains("two processes connected as rank 1"), "{e}");
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        // One of them was refused at its hello; the other learns at its
        // first exchange.
        let refused = [&a, &b].iter().filter(|r| r.is_err()).count();
        assert_eq!(refused, 1);
        let ok = if a.is_ok() { a } else { b }.unwrap();
        let e = ok.barrier().unwrap_err().to_string();
        assert!(e.contains("two processes connected as rank 1"), "{e}");
    }

    #[test]
    fn a_peer_that_disconnects_mid_exchange_is_named() {
        let results = with_ranks(3, Duration::from_secs(10), |rdv| {
            if rdv.rank() == 2 {
                // Leaves without taking part.
                return Ok(String::new());
            }
            Ok(rdv.barrier().unwrap_err().to_string())
        });
        let e0 = results[0].as_ref().unwrap();
        assert!(e0.contains("rank 2 disconnected"), "{e0}");
        let e1 = results[1].as_ref().unwrap();
        assert!(
            e1.contains("rank 0 failed") && e1.contains("rank 2 disconnected"),
            "{e1}"
        );
    }

    #[test]
    fn a_silent_peer_times_out_naming_it() {
        let results = with_ranks(2, Duration::from_millis(400), |rdv| {
            if rdv.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(String::new());
            }
            let start = Instant::now();
            let e = rdv.barrier().unwrap_err().to_string();
            assert!(start.elapsed() < Duration::from_millis(1400));
            Ok(e)
        });
        let e = results[0].as_ref().unwrap();
        assert!(e.contains("rank 1 sent nothing"), "{e}");
    }

    #[test]
    fn stray_connections_are_ignored() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let t = Duration::from_secs(5);
        let stray = std::thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            // More than a hello's 24 bytes, so it is judged at once.
            s.write_all(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
                .unwrap();
            Rendezvous::join("127.0.0.1", port, 1, 2, t)
        });
        let host = Rendezvous::host(listener, 2, t).unwrap();
        let joined = stray.join().unwrap().unwrap();
        let h = std::thread::spawn(move || host.all_gather_blobs(b"a"));
        assert_eq!(
            joined.all_gather_blobs(b"b").unwrap(),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
        assert!(h.join().unwrap().is_ok());
    }
}
