//! [`ControlComm`]: the control channel of ranks that are GPU processes without MPI — a
//! [`ProcessComm`] over TCP connections between the processes, for what moves besides the
//! data: the NCCL unique ids and the start-up exchanges, barriers, abort notices, the debug
//! checks of `BFPP_DEBUG_COLLECTIVES`, and the rank-0 gather of results. Never bulk data:
//! tensors of more than [`MAX_CONTROL_TENSOR_BYTES`] are refused (the data of GPU ranks moves
//! over NCCL, that of CPU processes over MPI, that of threads through memory).
//!
//! The ranks form a tree rooted at rank 0 ([`tree`]: four children per rank), and a message
//! travels the tree path from its sender to its receiver, passed on by the ranks between
//! ([`links`]). So each rank holds at most five connections and ten I/O threads whatever the
//! size of the world, where a full mesh would need a connection and two threads per other rank
//! (1,023 sockets and 2,046 threads at 1,024 GPUs). The control plane carries little (ids,
//! barriers, abort notices), so the extra hops cost nothing that matters.
//!
//! Start-up uses the launcher's environment ([`RendezvousEnv`]) and the job's
//! [`TcpStore`] (on `BFPP_STORE_PORT`, by default `MASTER_PORT + 1`): every rank with
//! children listens on a port of its own and publishes its address there, then each rank
//! connects to its parent and accepts its children. A connecting rank waits for the parent's
//! challenge (below), which comes once the parent accepts, after its own connection to its
//! parent: rank 0 accepts at once, so every level gets there in turn and start-up cannot
//! deadlock.
//!
//! Every connection to a rank's listener first answers a challenge with the job's secret
//! ([`JobSecret`](super::secret::JobSecret)), then greets with its rank; one that does not
//! is dropped and logged, and the ranks go on connecting.
//!
//! A rank publishes the address it reaches the store from (or `BFPP_ADVERTISE_ADDR`); if a
//! peer published a loopback address that this rank cannot reach, the error says why.
//!
//! A rank that is done (its transport dropped) tells every rank it posts nothing more, so a
//! wait on it fails at once, as when a process closes its connections; it stays until its
//! children are done too, forwarding for them (bounded by the communicator's timeout). A
//! connection that ends early (a process that crashed or was killed) cuts off the rank behind
//! it and every rank reached through it: waits on them fail at once, naming the rank that is
//! gone.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;

use super::process::{Incoming, ProcessComm, Transport};
use super::store::{RendezvousEnv, TcpStore};
use super::{CommConfig, CommError, RankGrid};

mod links;
mod tree;

use links::Router;
use tree::Tree;

/// The control channel of a rank of a world of GPU processes: a [`ProcessComm`] over
/// [`ControlTransport`], created by [`ControlComm::connect`], on which `NcclComm` is layered.
pub type ControlComm<B> = ProcessComm<B, ControlTransport>;

/// Largest tensor the control channel carries (descriptors, ids, checks): data goes over
/// NCCL. 64 KiB.
pub const MAX_CONTROL_TENSOR_BYTES: usize = 64 << 10;

/// First bytes of every connection, so a stray client is refused instead of misread.
const HELLO: &[u8; 8] = b"bfpp-ctl";

/// Control messages as length-prefixed frames, routed along a tree of TCP connections (see
/// the [module docs](self)).
pub struct ControlTransport {
    incoming: Receiver<Incoming>,
    /// Delivers, forwards and posts frames on this rank's connections.
    router: Arc<Router>,
    /// The connections, to shut them down when the transport is dropped.
    sockets: Vec<TcpStream>,
    /// How long a finished rank keeps forwarding for children that are not done.
    forward_limit: Duration,
    /// Whether the messages in flight were given up (see [`Transport::abandon`]).
    abandoned: bool,
    /// Kept alive until this rank is done: on world rank 0 it serves the store, which ranks
    /// still connecting may need.
    _store: TcpStore,
}

impl<B: Backend> ProcessComm<B, ControlTransport> {
    /// Joins the world described by `env` (the launcher's variables) as world rank
    /// `env.rank` of `grid`, computing on `device`: publishes this rank's address in the
    /// job's store and connects to its parent and children in the control tree (see the
    /// [module docs](self)). Every rank of the world calls it; it
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
    /// Connects this rank to its parent and children in the tree; see the
    /// [module docs](self).
    fn connect(env: &RendezvousEnv, timeout: Duration) -> Result<Self, String> {
        let deadline = Instant::now() + timeout;
        if u32::try_from(env.world_size).is_err() {
            return Err(format!("a world of {} ranks is too large", env.world_size));
        }
        let tree = Tree {
            rank: env.rank,
            size: env.world_size,
        };
        let store = TcpStore::connect(env, timeout).map_err(|e| e.to_string())?;
        // Peers reach this rank at the address it reaches the store from, unless told.
        let ip = match std::env::var(ADVERTISE_ENV) {
            Ok(text) => text
                .trim()
                .parse()
                .map_err(|e| format!("{ADVERTISE_ENV}=`{text}` is not an IP address ({e})"))?,
            Err(_) => store.local_ip().map_err(|e| e.to_string())?,
        };
        // Only a rank with children listens.
        let listener = if tree.children().is_empty() {
            None
        } else {
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
            Some((listener, own))
        };

        let mut links = Vec::new();
        if let Some(parent) = tree.parent() {
            links.push((parent, join_parent(&store, env.rank, parent, ip, deadline)?));
        }
        if let Some((listener, own)) = listener {
            accept_children(&store, &listener, own, tree, deadline, timeout, &mut links)?;
        }
        let (events, incoming) = mpsc::channel();
        let (router, sockets) = Router::start(tree, links, events)?;
        Ok(ControlTransport {
            incoming,
            router,
            sockets,
            forward_limit: timeout,
            abandoned: false,
            _store: store,
        })
    }
}

/// Connects to `parent` at the address it published, answers its challenge and greets it as
/// `rank`.
fn join_parent(
    store: &TcpStore,
    rank: usize,
    parent: usize,
    ip: std::net::IpAddr,
    deadline: Instant,
) -> Result<TcpStream, String> {
    let bytes = store.get(&address_key(parent)).map_err(|e| e.to_string())?;
    let addr: SocketAddr = String::from_utf8_lossy(&bytes)
        .parse()
        .map_err(|e| format!("rank {parent} published a malformed address: {e}"))?;
    let mut stream = connect_until(addr, deadline).map_err(|e| {
        format!(
            "cannot connect to rank {parent} at {addr}: {e}{}",
            loopback_hint(addr, ip)
        )
    })?;
    // The parent challenges once it accepts, after connecting to its own parent.
    let wait = deadline.saturating_duration_since(Instant::now());
    let answer = store
        .secret()
        .respond(&mut stream, CONTROL_PURPOSE, wait)
        .map_err(|e| format!("rank {parent} at {addr} sent no challenge: {e}"))?;
    stream
        .write_all(&[&answer[..], &hello(rank)].concat())
        .map_err(|e| format!("greeting rank {parent} at {addr}: {e}"))?;
    Ok(stream)
}

/// Accepts every child of `tree`'s rank on `listener` (published as `own`) until `deadline`,
/// appending them to `links`; connections that do not prove the job's secret, or claim a rank
/// that is not an expected child, are dropped and logged.
fn accept_children(
    store: &TcpStore,
    listener: &TcpListener,
    own: SocketAddr,
    tree: Tree,
    deadline: Instant,
    timeout: Duration,
    links: &mut Vec<(usize, TcpStream)>,
) -> Result<(), String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listening on {own}: {e}"))?;
    let rank = tree.rank;
    let waiting = |links: &Vec<(usize, TcpStream)>| -> Vec<usize> {
        tree.children()
            .filter(|c| !links.iter().any(|(n, _)| n == c))
            .collect()
    };
    while !waiting(links).is_empty() {
        match listener.accept() {
            Ok((mut stream, from)) => {
                // A stray client (a port scanner, a health check, another job, a program
                // without the job's secret) is dropped; the ranks that are expected still have
                // until the deadline.
                let proven = store.secret().challenge(&mut stream, CONTROL_PURPOSE);
                match proven.and_then(|()| greeted_by(&stream, deadline)) {
                    Ok(peer) if waiting(links).contains(&peer) => links.push((peer, stream)),
                    Ok(peer) => tracing::warn!(
                        %from, peer, rank,
                        "ignored a connection claiming an unexpected rank (two jobs on one \
                         MASTER_PORT?)"
                    ),
                    Err(reason) => tracing::warn!(
                        %from, %reason, rank,
                        "ignored a connection that is not a bfpp rank"
                    ),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "ranks {:?} did not connect to {own} within {timeout:?} (did they \
                         start? is the port reachable from their nodes?)",
                        waiting(links)
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accepting on {own}: {e}")),
        }
    }
    Ok(())
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

impl Transport for ControlTransport {
    fn post(&mut self, peer: usize, bytes: Vec<u8>) {
        // Callers check `peer` against the world size first.
        self.router.post(peer, bytes);
    }

    fn poll(&mut self) -> Option<Incoming> {
        self.incoming.try_recv().ok()
    }

    fn max_tensor_bytes(&self) -> Option<usize> {
        Some(MAX_CONTROL_TENSOR_BYTES)
    }

    fn sends_in_flight(&mut self) -> bool {
        self.router.in_flight() > 0
    }

    fn abandon(&mut self) {
        self.abandoned = true;
        // Closing the queues ends the writer threads once they are unblocked below.
        self.router.close();
        for socket in &self.sockets {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// Longest wait for this rank's last frames to leave once its children are done.
const LAST_FRAMES_WAIT: Duration = Duration::from_secs(5);

impl Drop for ControlTransport {
    fn drop(&mut self) {
        if !self.abandoned {
            // Every rank learns at once that this one posts nothing more; the ranks below it
            // may still be talking to the rest of the world through it.
            self.router.announce_finished();
            let start = Instant::now();
            while self.router.open_children() > 0 && start.elapsed() < self.forward_limit {
                std::thread::sleep(Duration::from_millis(2));
            }
            let start = Instant::now();
            while self.router.in_flight() > 0 && start.elapsed() < LAST_FRAMES_WAIT {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // Everything posted has been written (or abandoned): tell the peers this rank is done,
        // and leave the read side open so nothing in flight towards this rank is reset.
        self.router.close();
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
