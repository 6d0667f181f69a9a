//! Rendezvous without MPI: the torchrun / Slurm environment and a minimal TCP key-value store,
//! through which GPU ranks exchange their control channel's addresses (and with them the
//! NCCL unique ids) at start-up.
//!
//! World rank 0 serves the store (in a background thread) and is also a client of it; every
//! rank [`set`](TcpStore::set)s and [`get`](TcpStore::get)s byte values by key, `get` waiting
//! until the key exists or the timeout passes. Nothing is persistent. Every connection must
//! answer a challenge with the job's secret first ([`super::secret`]); one that does not, or
//! that sends a malformed frame, is dropped and logged, and the store goes on serving the
//! job's ranks.
//!
//! The store listens on `BFPP_STORE_PORT` of `MASTER_ADDR`, by default `MASTER_PORT + 1`,
//! never on `MASTER_PORT` itself: under torchrun, that port is its agent's own store
//! (`TORCHELASTIC_USE_AGENT_STORE`), which its workers join as clients.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::secret::{JobSecret, HANDSHAKE_WAIT, JOB_SECRET_ENV};

/// What a store connection's challenge is for (see [`JobSecret`]).
const STORE_PURPOSE: &[u8] = b"bfpp store";

/// Why a rendezvous failed; every message names the variable, address or key involved.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A launcher variable is missing or not a number.
    #[error("rendezvous: {0}")]
    Env(String),
    /// The store could not be served or reached.
    #[error("rendezvous store at {addr}: {source}")]
    Io {
        /// `host:port` of the store.
        addr: String,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// A key did not appear in time.
    #[error(
        "rendezvous store at {addr}: key `{key}` not set within {after:?} (did rank 0 start?)"
    )]
    Timeout {
        /// `host:port` of the store.
        addr: String,
        /// The key waited for.
        key: String,
        /// How long this rank waited.
        after: Duration,
    },
}

/// This process's place in a job, from the launcher's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// World rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes of this node (selects the GPU).
    pub local_rank: usize,
    /// Host of the store (world rank 0's node).
    pub master_addr: String,
    /// The launcher's `MASTER_PORT` (torchrun's own store listens there; this crate does not).
    pub master_port: u16,
    /// Port of this crate's store on `master_addr`: `BFPP_STORE_PORT`, by default
    /// `master_port + 1`.
    pub store_port: u16,
    /// The job's secret (`BFPP_JOB_SECRET`), which every connection to the store and to the
    /// ranks' control listeners must prove it knows; joining fails without it.
    pub secret: Option<JobSecret>,
}

/// The port of the store (see the [module docs](self)); default `MASTER_PORT + 1`.
pub const STORE_PORT_ENV: &str = "BFPP_STORE_PORT";

impl RendezvousEnv {
    /// Reads torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or
    /// Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (with `MASTER_ADDR` and
    /// `MASTER_PORT` exported by the batch script); `None` when neither launcher set them.
    pub fn from_env() -> Result<Option<Self>, StoreError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) over any variable lookup (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, StoreError> {
        let (rank_var, size_var, local_var) = if get("RANK").is_some() {
            ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else if get("SLURM_PROCID").is_some() {
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        } else {
            return Ok(None);
        };
        let number = |var: &str| -> Result<usize, StoreError> {
            let text = get(var)
                .ok_or_else(|| StoreError::Env(format!("{rank_var} is set but {var} is not")))?;
            text.trim()
                .parse()
                .map_err(|_| StoreError::Env(format!("{var}=`{text}` is not a number")))
        };
        let rank = number(rank_var)?;
        let world_size = number(size_var)?;
        if rank >= world_size {
            return Err(StoreError::Env(format!(
                "{rank_var}={rank} is not below {size_var}={world_size}"
            )));
        }
        let local_rank = if get(local_var).is_some() {
            number(local_var)?
        } else {
            0
        };
        let master_addr = get("MASTER_ADDR")
            .ok_or_else(|| StoreError::Env("MASTER_ADDR is not set (the host of rank 0)".into()))?;
        let port = |var: &str| -> Result<u16, StoreError> {
            let port = number(var)?;
            u16::try_from(port)
                .map_err(|_| StoreError::Env(format!("{var}={port} is not a TCP port")))
        };
        let master_port = port("MASTER_PORT")?;
        let store_port = if get(STORE_PORT_ENV).is_some() {
            port(STORE_PORT_ENV)?
        } else {
            master_port.checked_add(1).ok_or_else(|| {
                StoreError::Env(format!(
                    "MASTER_PORT={master_port} leaves no port above it for the store; set \
                     {STORE_PORT_ENV}"
                ))
            })?
        };
        let secret = match get(JOB_SECRET_ENV) {
            Some(text) => Some(JobSecret::from_text(&text).map_err(StoreError::Env)?),
            None => None,
        };
        Ok(Some(RendezvousEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            store_port,
            secret,
        }))
    }
}

impl RendezvousEnv {
    /// World rank `rank` of `world_size` processes on this machine (local rank = rank), whose
    /// store is on `127.0.0.1:store_port` (`MASTER_PORT` one below it).
    pub fn on_this_machine(rank: usize, world_size: usize, store_port: u16) -> Self {
        RendezvousEnv {
            rank,
            world_size,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: store_port.saturating_sub(1),
            store_port,
            secret: None,
        }
    }

    /// The same place in a job whose secret is `secret`.
    pub fn with_secret(mut self, secret: JobSecret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// The torchrun variables that describe this place in the job, the store's port and the
    /// job's secret, for starting a process there ([`from_env`](Self::from_env) reads them
    /// back).
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            (STORE_PORT_ENV, self.store_port.to_string()),
        ];
        if let Some(secret) = &self.secret {
            vars.push((JOB_SECRET_ENV, secret.to_text()));
        }
        vars
    }
}

/// A TCP port on this machine that nothing listens on right now (for a job's store; another
/// program could take it before the store binds it, which then fails with its address).
pub fn free_local_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

type Table = Arc<Mutex<HashMap<String, Vec<u8>>>>;

/// A client of the job's store; on world rank 0 also its server.
pub struct TcpStore {
    addr: String,
    timeout: Duration,
    secret: JobSecret,
    server: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("serving", &self.server.is_some())
            .finish()
    }
}

/// What a client asks the store.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Request {
    /// Store `value` under `key`; answered with [`Response::Stored`].
    Set { key: String, value: Vec<u8> },
    /// The value under `key`, if any; answered with [`Response::Value`].
    Get { key: String },
}

/// What the store answers.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Response {
    Stored,
    Value(Option<Vec<u8>>),
}

/// Largest store message (keys and values are addresses and ids, a few bytes).
const MAX_STORE_MESSAGE: u32 = 1 << 20;

/// Writes `message` as a length-prefixed postcard frame.
fn send_frame<T: serde::Serialize>(s: &mut TcpStream, message: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(message).map_err(std::io::Error::other)?;
    let len = u32::try_from(bytes.len()).map_err(std::io::Error::other)?;
    s.write_all(&len.to_le_bytes())?;
    s.write_all(&bytes)
}

/// Reads a frame written by [`send_frame`].
fn read_frame<T: serde::de::DeserializeOwned>(s: &mut TcpStream) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len > MAX_STORE_MESSAGE {
        return Err(std::io::Error::other(format!(
            "a store message of {len} bytes (not a bfpp store?)"
        )));
    }
    let mut bytes = vec![0u8; len as usize];
    s.read_exact(&mut bytes)?;
    postcard::from_bytes(&bytes).map_err(std::io::Error::other)
}

/// A connection the store closed on a client: what a client without the job's secret meets.
fn explain_closed(e: std::io::Error) -> std::io::Error {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    if matches!(
        e.kind(),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
    ) {
        std::io::Error::new(
            e.kind(),
            format!(
                "the store closed the connection ({e}): does this process have the job's \
                 {JOB_SECRET_ENV}?"
            ),
        )
    } else {
        e
    }
}

/// Serves one connection: the challenge, then a sequence of requests, each answered. A
/// connection that fails the challenge or sends a malformed frame is dropped and logged.
fn serve(mut s: TcpStream, from: std::net::SocketAddr, table: Table, secret: JobSecret) {
    if let Err(reason) = secret.challenge(&mut s, STORE_PURPOSE) {
        tracing::warn!(%from, %reason, "the rendezvous store dropped a connection");
        return;
    }
    if let Err(e) = answer_requests(&mut s, &table) {
        tracing::warn!(%from, reason = %e, "the rendezvous store dropped a connection");
    }
}

/// Answers a connection's requests until it closes.
fn answer_requests(s: &mut TcpStream, table: &Table) -> std::io::Result<()> {
    loop {
        let request = match read_frame::<Request>(s) {
            Ok(request) => request,
            // The client closed the connection between requests.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(std::io::Error::other(format!("a malformed frame: {e}"))),
        };
        let response = {
            let mut table = table.lock().unwrap_or_else(|p| p.into_inner());
            match request {
                Request::Set { key, value } => {
                    table.insert(key, value);
                    Response::Stored
                }
                Request::Get { key } => Response::Value(table.get(&key).cloned()),
            }
        };
        send_frame(s, &response)?;
    }
}

impl TcpStore {
    /// Joins the store of `env`'s job: rank 0 starts serving on `0.0.0.0:store_port` first.
    /// Every later call waits at most `timeout`. Fails without the job's secret.
    pub fn connect(env: &RendezvousEnv, timeout: Duration) -> Result<Self, StoreError> {
        let secret = env.secret.clone().ok_or_else(|| {
            StoreError::Env(format!(
                "{JOB_SECRET_ENV} is not set: every process of the job needs the same secret to \
                 join its rendezvous; `bfpp launch` makes one, and under torchrun or srun the \
                 job script exports it (`export {JOB_SECRET_ENV}=$(openssl rand -hex 32)`)"
            ))
        })?;
        let addr = format!("{}:{}", env.master_addr, env.store_port);
        let server = if env.rank == 0 {
            Some(Self::serve_on(
                &format!("0.0.0.0:{}", env.store_port),
                &addr,
                secret.clone(),
            )?)
        } else {
            None
        };
        Ok(TcpStore {
            addr,
            timeout,
            secret,
            server,
        })
    }

    /// The job's secret, for the ranks' own listeners.
    pub(crate) fn secret(&self) -> &JobSecret {
        &self.secret
    }

    fn serve_on(
        bind: &str,
        addr: &str,
        secret: JobSecret,
    ) -> Result<(Arc<AtomicBool>, JoinHandle<()>), StoreError> {
        let io = |source| StoreError::Io {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(bind).map_err(io)?;
        // Non-blocking accept, so that dropping the store stops the thread.
        listener.set_nonblocking(true).map_err(io)?;
        let stop = Arc::new(AtomicBool::new(false));
        let table: Table = Arc::default();
        let flag = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, from)) => {
                        let (table, secret) = (Arc::clone(&table), secret.clone());
                        // Connections block; a broken or foreign one only ends its own thread.
                        let _ = s.set_nonblocking(false);
                        std::thread::spawn(move || serve(s, from, table, secret));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok((stop, handle))
    }

    /// Opens a connection, retrying until the server is up or the timeout passes.
    fn open(&self, key: &str) -> Result<TcpStream, StoreError> {
        let start = Instant::now();
        loop {
            let addrs = self
                .addr
                .to_socket_addrs()
                .map_err(|source| StoreError::Io {
                    addr: self.addr.clone(),
                    source,
                })?;
            let mut last = None;
            for a in addrs {
                match TcpStream::connect_timeout(&a, Duration::from_secs(1))
                    .and_then(|s| self.prove(s))
                {
                    Ok(s) => return Ok(s),
                    Err(e) => last = Some(e),
                }
            }
            if start.elapsed() >= self.timeout {
                return Err(match last {
                    Some(source) => StoreError::Io {
                        addr: self.addr.clone(),
                        source,
                    },
                    None => StoreError::Timeout {
                        addr: self.addr.clone(),
                        key: key.to_string(),
                        after: start.elapsed(),
                    },
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Answers the store's challenge on a new connection.
    fn prove(&self, mut s: TcpStream) -> std::io::Result<TcpStream> {
        let answer = self.secret.respond(&mut s, STORE_PURPOSE, HANDSHAKE_WAIT)?;
        s.write_all(&answer)?;
        Ok(s)
    }

    /// The address of this machine on the route to the store: where ranks on other nodes can
    /// reach this one (used to publish a rank's own listening address).
    pub fn local_ip(&self) -> Result<std::net::IpAddr, StoreError> {
        let s = self.open("(local address)")?;
        s.local_addr()
            .map(|a| a.ip())
            .map_err(|source| StoreError::Io {
                addr: self.addr.clone(),
                source,
            })
    }

    /// Stores `value` under `key` (replacing an earlier value).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let io = |source| StoreError::Io {
            addr: self.addr.clone(),
            source: explain_closed(source),
        };
        let mut s = self.open(key)?;
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        send_frame(&mut s, &request).map_err(io)?;
        match read_frame(&mut s).map_err(io)? {
            Response::Stored => Ok(()),
            Response::Value(_) => Err(io(std::io::Error::other(
                "the store answered a set with a value",
            ))),
        }
    }

    /// The value under `key`, waiting until some rank has set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let io = |source| StoreError::Io {
            addr: self.addr.clone(),
            source: explain_closed(source),
        };
        let start = Instant::now();
        let mut s = self.open(key)?;
        loop {
            let request = Request::Get {
                key: key.to_string(),
            };
            send_frame(&mut s, &request).map_err(io)?;
            if let Response::Value(Some(value)) = read_frame(&mut s).map_err(io)? {
                return Ok(value);
            }
            if start.elapsed() >= self.timeout {
                return Err(StoreError::Timeout {
                    addr: self.addr.clone(),
                    key: key.to_string(),
                    after: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.server.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<RendezvousEnv>, StoreError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RendezvousEnv::from_lookup(|k| vars.get(k).cloned())
    }

    #[test]
    fn torchrun_and_slurm_variables_are_read_and_checked() {
        let master = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")];
        let torch = env(&[
            &master[..],
            &[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")],
        ]
        .concat())
        .expect("valid")
        .expect("present");
        assert_eq!((torch.rank, torch.world_size, torch.local_rank), (3, 8, 1));
        assert_eq!(
            (torch.master_addr.as_str(), torch.master_port),
            ("node0", 29500)
        );
        // The store keeps off torchrun's own port unless told where to listen.
        assert_eq!(torch.store_port, 29501);
        let told = env(&[
            &master[..],
            &[("RANK", "0"), ("WORLD_SIZE", "2")],
            &[(STORE_PORT_ENV, "31000")],
        ]
        .concat())
        .expect("valid")
        .expect("present");
        assert_eq!(told.store_port, 31000);
        let slurm = env(&[
            &master[..],
            &[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "16")],
        ]
        .concat())
        .expect("valid")
        .expect("present");
        assert_eq!((slurm.rank, slurm.world_size, slurm.local_rank), (5, 16, 0));
        assert!(env(&[]).expect("no launcher is not an error").is_none());
        for (bad, why) in [
            (vec![("RANK", "8"), ("WORLD_SIZE", "8")], "not below"),
            (vec![("RANK", "x"), ("WORLD_SIZE", "8")], "not a number"),
            (vec![("RANK", "0")], "WORLD_SIZE is not"),
        ] {
            let err = env(&[&master[..], &bad[..]].concat())
                .expect_err(why)
                .to_string();
            assert!(err.contains(why), "{err}");
        }
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
            .expect_err("no address")
            .to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn the_variables_of_a_place_read_back_as_that_place() {
        let place = RendezvousEnv {
            rank: 5,
            world_size: 8,
            local_rank: 1,
            master_addr: "node0".into(),
            master_port: 29_500,
            store_port: 29_501,
            secret: Some(JobSecret::for_tests()),
        };
        let vars: HashMap<&str, String> = place.vars().into_iter().collect();
        let read = RendezvousEnv::from_lookup(|k| vars.get(k).cloned());
        assert_eq!(read.expect("valid").expect("present"), place);
    }

    /// torchrun's agent store holds MASTER_PORT when its workers start: with the variables
    /// torchrun sets, the ranks meet on their own store and never touch that port.
    #[test]
    fn under_torchrun_the_store_leaves_master_port_to_the_agent() {
        // torchrun's agent store, on two free ports in a row.
        let (agent, master_port) = loop {
            let agent = TcpListener::bind("127.0.0.1:0").expect("a free port");
            let port = agent.local_addr().expect("bound").port();
            if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
                break (agent, port);
            }
        };
        agent.set_nonblocking(true).expect("non-blocking");
        let vars = |rank: usize| {
            let vars: HashMap<String, String> = [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", "2".to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("LOCAL_WORLD_SIZE", "2".to_string()),
                ("GROUP_RANK", "0".to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", master_port.to_string()),
                ("TORCHELASTIC_RUN_ID", "none".to_string()),
                ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
                (JOB_SECRET_ENV, JobSecret::for_tests().to_text()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            RendezvousEnv::from_lookup(|k| vars.get(k).cloned())
                .expect("valid")
                .expect("present")
        };
        let timeout = Duration::from_secs(5);
        let server = TcpStore::connect(&vars(0), timeout).expect("rank 0 serves the store");
        let client = TcpStore::connect(&vars(1), timeout).expect("rank 1 joins");
        client.set("address/1", b"10.0.0.2:4000").expect("set");
        assert_eq!(server.get("address/1").expect("get"), b"10.0.0.2:4000");
        match agent.accept() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("something connected to torchrun's MASTER_PORT: {other:?}"),
        }
    }

    #[test]
    fn ranks_exchange_values_through_the_store_on_loopback() {
        // Port 0 is not usable by clients; find a free port first.
        let port = free_local_port().expect("a free port");
        let at = |rank| {
            RendezvousEnv::on_this_machine(rank, 3, port).with_secret(JobSecret::for_tests())
        };
        let timeout = Duration::from_secs(5);
        // Clients start before the server exists and wait for it.
        let clients: Vec<_> = (1..3)
            .map(|rank| {
                let e = at(rank);
                std::thread::spawn(move || {
                    let store = TcpStore::connect(&e, timeout).expect("client");
                    store
                        .set(&format!("hello/{rank}"), &[rank as u8])
                        .expect("set");
                    store.get("nccl-id").expect("rank 0 publishes the id")
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let server = TcpStore::connect(&at(0), timeout).expect("server");
        server.set("nccl-id", b"0123456789").expect("set");
        for rank in 1..3 {
            assert_eq!(
                server.get(&format!("hello/{rank}")).expect("get"),
                vec![rank as u8]
            );
        }
        for c in clients {
            assert_eq!(c.join().expect("client thread"), b"0123456789".to_vec());
        }
        let short = TcpStore::connect(&at(1), Duration::from_millis(200)).expect("client");
        let err = short.get("never").expect_err("missing key").to_string();
        assert!(err.contains("`never` not set"), "{err}");
    }

    /// What `s` receives until the other side closes or resets it; a connection still open
    /// after `timeout` fails the test.
    fn until_hung_up(s: &mut TcpStream, timeout: Duration) -> Vec<u8> {
        s.set_read_timeout(Some(timeout)).expect("timeout");
        let (mut got, mut buf) = (Vec::new(), [0u8; 256]);
        loop {
            match s.read(&mut buf) {
                Ok(0) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
                Err(e) => panic!("the store did not hang up: {e}"),
            }
        }
    }

    #[test]
    fn the_store_drops_connections_without_the_secret_and_keeps_serving() {
        let port = free_local_port().expect("a free port");
        let at = |rank| {
            RendezvousEnv::on_this_machine(rank, 2, port).with_secret(JobSecret::for_tests())
        };
        let timeout = Duration::from_secs(5);
        let server = TcpStore::connect(&at(0), timeout).expect("server");
        let addr = ("127.0.0.1", port);
        // A client that skips the challenge and sends a request straight away.
        let mut bold = TcpStream::connect(addr).expect("connects");
        let set = Request::Set {
            key: "bfpp/control/address/1".into(),
            value: b"6.6.6.6:1".to_vec(),
        };
        send_frame(&mut bold, &set).expect("sent");
        // The store sends its 16-byte challenge, reads the frame as a wrong answer and hangs
        // up (a store that kept the connection open would fail the read by its timeout).
        let rest = until_hung_up(&mut bold, timeout);
        assert!(
            rest.len() <= 16,
            "the store answered a client without the secret"
        );
        // One with the wrong secret, and one that sends garbage after a right answer.
        let other = JobSecret::generate().expect("random");
        let wrong = TcpStore::connect(
            &RendezvousEnv::on_this_machine(1, 2, port).with_secret(other),
            Duration::from_millis(500),
        )
        .expect("joins: the secret is checked per connection");
        let err = wrong.set("bfpp/x", b"1").expect_err("refused").to_string();
        assert!(err.contains(JOB_SECRET_ENV), "{err}");
        let client = TcpStore::connect(&at(1), timeout).expect("client");
        let mut garbled = client.open("garbage").expect("a proven connection");
        garbled.write_all(&[0xff; 64]).expect("sent");
        let answer = until_hung_up(&mut garbled, timeout);
        assert!(answer.is_empty(), "the store answered a malformed frame");
        // The job goes on: nothing the intruders sent was stored.
        client.set("bfpp/x", b"ok").expect("set");
        assert_eq!(server.get("bfpp/x").expect("get"), b"ok");
        let short = TcpStore::connect(&at(1), Duration::from_millis(200)).expect("client");
        let missing = short
            .get("bfpp/control/address/1")
            .expect_err("never stored");
        assert!(missing.to_string().contains("not set"), "{missing}");
        // Without a secret at all, joining is refused naming the variable and the fix.
        let none = TcpStore::connect(&RendezvousEnv::on_this_machine(1, 2, port), timeout)
            .expect_err("no secret")
            .to_string();
        assert!(
            none.contains(JOB_SECRET_ENV) && none.contains("openssl rand"),
            "{none}"
        );
    }
}
