//! [`ControlComm`]: the control channel of ranks that are GPU processes without MPI — a
//! [`ProcessComm`] over TCP connections between the processes, for what moves besides the
//! data: the NCCL unique ids and the start-up exchanges, barriers, abort notices, the debug
//! checks of `BFPP_DEBUG_COLLECTIVES`, and the rank-0 gather of results. Never bulk data:
//! tensors of more than [`MAX_CONTROL_TENSOR_BYTES`] are refused (the data of GPU ranks moves
//! over NCCL, that of CPU processes over MPI, that of threads through memory).
//!
//! Start-up uses the launcher's environment ([`RendezvousEnv`]) and the job's
//! [`TcpStore`] (on `BFPP_STORE_PORT`, by default `MASTER_PORT + 1`): every rank listens on a
//! port of its own and publishes its address there, then connects to every lower rank and
//! accepts every higher one, so each pair of ranks shares one connection. A connecting rank
//! waits for the peer's challenge (below), which comes once the peer accepts, after its own
//! connections to lower ranks: rank 0 accepts at once, so every rank gets there in turn and
//! the mesh cannot deadlock.
//!
//! Every connection to a rank's listener first answers a challenge with the job's secret
//! ([`JobSecret`](super::secret::JobSecret)), then greets with its rank; one that does not
//! is dropped and logged, and the ranks go on connecting.
//!
//! A rank publishes the address it reaches the store from (or `BFPP_ADVERTISE_ADDR`); if a
//! peer published a loopback address that this rank cannot reach, the error says why.
//!
//! Each connection has a reader thread, which turns the length-prefixed frames into
//! [`Incoming`] messages (and the end of the connection into [`Incoming::Lost`], so a wait on
//! a process that died fails at once), and a writer thread, so that posting never blocks on a
//! slow peer.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;

use super::process::{Incoming, ProcessComm, Transport};
use super::store::{RendezvousEnv, TcpStore};
use super::{CommConfig, CommError, RankGrid};

/// The control channel of a rank of a world of GPU processes: a [`ProcessComm`] over
/// [`ControlTransport`], created by [`ControlComm::connect`], on which `NcclComm` is layered.
pub type ControlComm<B> = ProcessComm<B, ControlTransport>;

/// Largest tensor the control channel carries (descriptors, ids, checks): data goes over
/// NCCL. 64 KiB.
pub const MAX_CONTROL_TENSOR_BYTES: usize = 64 << 10;

/// First bytes of every connection, so a stray client is refused instead of misread.
const HELLO: &[u8; 8] = b"bfpp-ctl";

/// Largest frame accepted (a corrupted length must not allocate the machine's memory).
const MAX_FRAME: u64 = 1 << 40;

/// Control messages as length-prefixed frames on one TCP connection per pair of ranks.
pub struct ControlTransport {
    incoming: Receiver<Incoming>,
    /// Messages to this rank itself go straight to its own inbox.
    to_self: Sender<Incoming>,
    rank: usize,
    /// One writer queue per world rank (`None` for this rank).
    outgoing: Vec<Option<Sender<Vec<u8>>>>,
    /// Messages posted and not yet written to their socket.
    in_flight: Arc<AtomicUsize>,
    /// The connections, to shut them down when the transport is dropped.
    sockets: Vec<TcpStream>,
    /// Kept alive until this rank is done: on world rank 0 it serves the store, which ranks
    /// still connecting may need.
    _store: TcpStore,
}

impl<B: Backend> ProcessComm<B, ControlTransport> {
    /// Joins the world described by `env` (the launcher's variables) as world rank
    /// `env.rank` of `grid`, computing on `device`: publishes this rank's address in the
    /// job's store and connects to every other rank. Every rank of the world calls it; it
    /// waits at most `config.timeout` for the others.
    ///
    /// Fails if the launcher started a world of another size than `grid`, or if the store or
    /// a peer cannot be reached in time.
    pub fn connect(
        env: &RendezvousEnv,
        grid: RankGrid,
        device: B::Device,
        config: CommConfig,
    ) -> Result<Self, CommError> {
        if env.world_size != grid.world_size() {
            return Err(CommError::InvalidGrid {
                pp: grid.pp(),
                dp: grid.dp(),
                reason: format!(
                    "the launcher started {} processes but pp {} × dp {} needs {}; start {} \
                     processes (one per GPU, e.g. `bfpp launch --nproc {}`) or change \
                     --pp/--dp",
                    env.world_size,
                    grid.pp(),
                    grid.dp(),
                    grid.world_size(),
                    grid.world_size(),
                    grid.world_size()
                ),
            });
        }
        let transport = ControlTransport::connect(env, config.timeout).map_err(|reason| {
            CommError::Rendezvous {
                rank: env.rank,
                reason,
            }
        })?;
        Ok(ProcessComm::new(grid, env.rank, device, config, transport))
    }
}

/// The store key under which `rank` publishes its listening address.
fn address_key(rank: usize) -> String {
    format!("bfpp/control/address/{rank}")
}

impl ControlTransport {
    /// Builds the mesh of connections; see the [module docs](self).
    fn connect(env: &RendezvousEnv, timeout: Duration) -> Result<Self, String> {
        let deadline = Instant::now() + timeout;
        let store = TcpStore::connect(env, timeout).map_err(|e| e.to_string())?;
        // Peers reach this rank at the address it reaches the store from, unless told.
        let ip = match std::env::var(ADVERTISE_ENV) {
            Ok(text) => text
                .trim()
                .parse()
                .map_err(|e| format!("{ADVERTISE_ENV}=`{text}` is not an IP address ({e})"))?,
            Err(_) => store.local_ip().map_err(|e| e.to_string())?,
        };
        let any: std::net::IpAddr = if ip.is_ipv4() {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        let listener = TcpListener::bind(SocketAddr::new(any, 0))
            .map_err(|e| format!("cannot listen on a port of {any}: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("cannot read the listening address: {e}"))?
            .port();
        let own = SocketAddr::new(ip, port);
        store
            .set(&address_key(env.rank), own.to_string().as_bytes())
            .map_err(|e| e.to_string())?;

        let mut streams: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
        for (peer, slot) in streams.iter_mut().enumerate().take(env.rank) {
            let bytes = store.get(&address_key(peer)).map_err(|e| e.to_string())?;
            let addr: SocketAddr = String::from_utf8_lossy(&bytes)
                .parse()
                .map_err(|e| format!("rank {peer} published a malformed address: {e}"))?;
            let mut stream = connect_until(addr, deadline).map_err(|e| {
                format!(
                    "cannot connect to rank {peer} at {addr}: {e}{}",
                    loopback_hint(addr, ip)
                )
            })?;
            // The peer challenges once it accepts, after connecting to its own lower ranks.
            let wait = deadline.saturating_duration_since(Instant::now());
            let answer = store
                .secret()
                .respond(&mut stream, CONTROL_PURPOSE, wait)
                .map_err(|e| format!("rank {peer} at {addr} sent no challenge: {e}"))?;
            stream
                .write_all(&[&answer[..], &hello(env.rank)].concat())
                .map_err(|e| format!("greeting rank {peer} at {addr}: {e}"))?;
            *slot = Some(stream);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("listening on {own}: {e}"))?;
        let mut missing = env.world_size - 1 - env.rank;
        while missing > 0 {
            match listener.accept() {
                Ok((mut stream, from)) => {
                    // A stray client (a port scanner, a health check, another job, a program
                    // without the job's secret) is dropped; the ranks that are expected still
                    // have until the deadline.
                    let expected = |peer: usize| {
                        peer > env.rank && peer < env.world_size && streams[peer].is_none()
                    };
                    let proven = store.secret().challenge(&mut stream, CONTROL_PURPOSE);
                    match proven.and_then(|()| greeted_by(&stream, deadline)) {
                        Ok(peer) if expected(peer) => {
                            streams[peer] = Some(stream);
                            missing -= 1;
                        }
                        Ok(peer) => tracing::warn!(
                            %from, peer, rank = env.rank,
                            "ignored a connection claiming an unexpected rank (two jobs on one \
                             MASTER_PORT?)"
                        ),
                        Err(reason) => tracing::warn!(
                            %from, %reason, rank = env.rank,
                            "ignored a connection that is not a bfpp rank"
                        ),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let waiting: Vec<usize> = (env.rank + 1..env.world_size)
                            .filter(|&p| streams[p].is_none())
                            .collect();
                        return Err(format!(
                            "ranks {waiting:?} did not connect to {own} within {timeout:?} \
                             (did they start? is the port reachable from their nodes?)"
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(format!("accepting on {own}: {e}")),
            }
        }
        Self::start(env.rank, streams, store)
    }

    /// Starts a reader and a writer thread for every connection.
    fn start(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        store: TcpStore,
    ) -> Result<Self, String> {
        let (to_self, incoming) = mpsc::channel();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let mut outgoing = Vec::with_capacity(streams.len());
        let mut sockets = Vec::new();
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                outgoing.push(None);
                continue;
            };
            let clone = |s: &TcpStream| {
                s.try_clone()
                    .map_err(|e| format!("connection to rank {peer}: {e}"))
            };
            // Frames are small and latency-bound (barriers, abort notices).
            stream
                .set_nodelay(true)
                .and_then(|()| stream.set_nonblocking(false))
                .and_then(|()| stream.set_read_timeout(None))
                .map_err(|e| format!("connection to rank {peer}: {e}"))?;
            let (reader, writer) = (clone(&stream)?, clone(&stream)?);
            sockets.push(stream);
            let events = to_self.clone();
            std::thread::spawn(move || read_frames(peer, reader, events));
            let (queue, frames) = mpsc::channel::<Vec<u8>>();
            let count = Arc::clone(&in_flight);
            std::thread::spawn(move || write_frames(writer, frames, count));
            outgoing.push(Some(queue));
        }
        Ok(ControlTransport {
            incoming,
            to_self,
            rank,
            outgoing,
            in_flight,
            sockets,
            _store: store,
        })
    }
}

/// Overrides the address a rank publishes for its peers (its own IP address as they can reach
/// it), for machines where the route to `MASTER_ADDR` does not give it.
pub const ADVERTISE_ENV: &str = "BFPP_ADVERTISE_ADDR";

/// Why a peer that published a loopback address may be out of reach from this rank.
fn loopback_hint(peer: SocketAddr, own: std::net::IpAddr) -> String {
    if peer.ip().is_loopback() && !own.is_loopback() {
        format!(
            " (that is a loopback address, reachable only on its own machine: MASTER_ADDR \
             probably resolves to a loopback address there, e.g. through /etc/hosts; set \
             MASTER_ADDR to the routable address of rank 0's node, or {ADVERTISE_ENV} on each \
             rank)"
        )
    } else {
        String::new()
    }
}

/// Connects to `addr`, retrying refused attempts until `deadline`.
fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// What a control connection's challenge is for (see [`JobSecret`](super::secret::JobSecret)).
pub(super) const CONTROL_PURPOSE: &[u8] = b"bfpp control";

/// The greeting a connecting rank sends: [`HELLO`] and its world rank.
pub(super) fn hello(rank: usize) -> Vec<u8> {
    let mut bytes = HELLO.to_vec();
    bytes.extend_from_slice(&(rank as u64).to_le_bytes());
    bytes
}

/// Longest wait for a new connection's greeting: a rank sends it right after connecting.
const GREETING_WAIT: Duration = Duration::from_secs(5);

/// Reads a greeting, waiting until `deadline` (at most [`GREETING_WAIT`]); returns the
/// peer's world rank.
fn greeted_by(stream: &TcpStream, deadline: Instant) -> Result<usize, String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), GREETING_WAIT);
    let mut stream = stream;
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(left)))
        .map_err(|e| e.to_string())?;
    let mut greeting = [0u8; 16];
    stream
        .read_exact(&mut greeting)
        .map_err(|e| format!("no greeting: {e}"))?;
    if &greeting[..8] != HELLO {
        return Err("not a bfpp rank (wrong greeting)".into());
    }
    let mut rank = [0u8; 8];
    rank.copy_from_slice(&greeting[8..]);
    usize::try_from(u64::from_le_bytes(rank)).map_err(|e| e.to_string())
}

/// Reader thread: every frame from `peer` becomes an [`Incoming::Message`]; the end of the
/// connection becomes one [`Incoming::Lost`].
fn read_frames(peer: usize, stream: TcpStream, events: Sender<Incoming>) {
    let mut reader = BufReader::new(stream);
    let reason = loop {
        let mut len = [0u8; 8];
        if let Err(e) = reader.read_exact(&mut len) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "its process closed the connection".to_string()
            } else {
                format!("reading from its connection: {e}")
            };
        }
        let len = u64::from_le_bytes(len);
        if len > MAX_FRAME {
            break format!("it sent a frame of {len} bytes (corrupted stream?)");
        }
        let mut bytes = vec![0u8; len as usize];
        if let Err(e) = reader.read_exact(&mut bytes) {
            break format!("its connection ended inside a message: {e}");
        }
        if events
            .send(Incoming::Message { from: peer, bytes })
            .is_err()
        {
            return; // this rank's transport is gone
        }
    };
    let _ = events.send(Incoming::Lost { from: peer, reason });
}

/// Writer thread: writes the queued frames in order. After a write error (the peer is gone)
/// the rest are dropped; the peer's reader side reports the loss.
fn write_frames(stream: TcpStream, frames: Receiver<Vec<u8>>, in_flight: Arc<AtomicUsize>) {
    let mut writer = BufWriter::new(stream);
    let mut broken = false;
    while let Ok(bytes) = frames.recv() {
        if !broken {
            let len = (bytes.len() as u64).to_le_bytes();
            let written = writer
                .write_all(&len)
                .and_then(|()| writer.write_all(&bytes))
                .and_then(|()| writer.flush());
            broken = written.is_err();
        }
        in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Transport for ControlTransport {
    fn post(&mut self, peer: usize, bytes: Vec<u8>) {
        if peer == self.rank {
            let _ = self.to_self.send(Incoming::Message { from: peer, bytes });
            return;
        }
        // Callers check `peer` against the world size first.
        if let Some(Some(queue)) = self.outgoing.get(peer) {
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            if queue.send(bytes).is_err() {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    fn poll(&mut self) -> Option<Incoming> {
        self.incoming.try_recv().ok()
    }

    fn max_tensor_bytes(&self) -> Option<usize> {
        Some(MAX_CONTROL_TENSOR_BYTES)
    }

    fn sends_in_flight(&mut self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    fn abandon(&mut self) {
        // Closing the queues ends the writer threads once they are unblocked below.
        self.outgoing.clear();
        for socket in &self.sockets {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for ControlTransport {
    fn drop(&mut self) {
        // Everything posted has been written (or abandoned): tell the peers this rank is done,
        // and leave the read side open so nothing in flight towards this rank is reset.
        self.outgoing.clear();
        for socket in &self.sockets {
            let _ = socket.shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_address_from_another_machine_is_explained() {
        let peer: SocketAddr = "127.0.1.1:4000".parse().expect("address");
        let remote: std::net::IpAddr = "10.0.0.7".parse().expect("address");
        let hint = loopback_hint(peer, remote);
        assert!(
            hint.contains("MASTER_ADDR") && hint.contains(ADVERTISE_ENV),
            "{hint}"
        );
        // On one machine, loopback is fine, and a routable peer needs no hint.
        assert!(loopback_hint(peer, "127.0.0.1".parse().expect("address")).is_empty());
        assert!(loopback_hint("10.0.0.8:4000".parse().expect("address"), remote).is_empty());
    }
}
