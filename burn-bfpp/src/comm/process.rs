//! [`ProcessComm`]: one rank per process, exchanging messages over a [`Transport`]: MPI
//! (`MpiComm`, feature `mpi`, for `mpirun`/`srun`: CPU processes), or the TCP control
//! channel of GPU processes ([`ControlComm`](super::ControlComm), under `NcclComm`, which
//! moves their data).
//!
//! The semantics are exactly those of [`LocalComm`](super::LocalComm), and so are the results:
//! tensors travel as host values (see [`wire`](super::wire)), collectives are one exchange
//! round among the group's members and reductions run on the host in group-rank order
//! ([`host`](super::host)), so a multi-process run is bitwise the in-process run.
//!
//! Nothing here blocks inside the transport: sends are posted and return, and every wait
//! polls for arrived messages against a deadline, so every call honours
//! [`CommConfig::timeout`]. Every incoming message is drained into a local inbox keyed by
//! `(source, stream)`, which gives tag matching in any order and lets an abort notice overtake
//! data the rank is not waiting for yet.
//!
//! Fail-stop: the first error a rank meets (or [`Communicator::abort`]) is recorded and sent to
//! every other rank as an abort notice; they fail their current or next call with
//! [`CommError::PeerFailed`] naming it. A transport that sees a peer's process go away (TCP)
//! fails a wait on that peer at once with [`CommError::ConnectionLost`] instead of at the
//! timeout.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::host::HostBuf;
use super::pending::{PartKey, PostAndCollect, ReceivedPart, StartOrder};
use super::wire::{self, Message, Payload, Stream};
use super::{ByteCounter, CommConfig, CommError, CommOp, Communicator, Group, RankGrid};
use crate::host_read::{read, ReadPurpose};

/// Longest sleep between two polls of a waiting receive (see [`ProcessComm::wait`]).
const MAX_NAP: Duration = Duration::from_micros(200);

/// Polls a waiting receive makes, yielding the core in between, before it starts sleeping.
const YIELDING_POLLS: u32 = 32;

/// How long a dropped communicator waits for its last sends (abort notices above all) to
/// leave before giving up on them.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// How long the rank that failed first waits for its peers to pass the failure back.
const ACK_LIMIT: Duration = Duration::from_secs(10);

/// How long it stays after they all did: time for them to report before `mpirun` (which ends
/// the job when one process exits with an error) stops them.
const LINGER: Duration = Duration::from_millis(250);

mod ops;
pub use ops::ProcessRank;

/// What arrived from the transport.
pub enum Incoming {
    /// One message, as the peer posted it.
    Message {
        /// The sender's world rank.
        from: usize,
        /// The message.
        bytes: Vec<u8>,
    },
    /// The connection to a peer ended (its process exited or crashed); every message it sent
    /// before was delivered first.
    Lost {
        /// The peer's world rank.
        from: usize,
        /// What the transport saw.
        reason: String,
    },
}

/// How the messages of a [`ProcessComm`] travel between processes. A transport delivers each
/// message whole, and the messages from one peer in the order they were posted.
pub trait Transport {
    /// Starts sending `bytes` to world rank `peer`; never waits for the peer.
    fn post(&mut self, peer: usize, bytes: Vec<u8>);
    /// The next arrived message or event, if any; never blocks.
    fn poll(&mut self) -> Option<Incoming>;
    /// Whether posted messages have still not left (a dropped communicator waits for them,
    /// abort notices above all).
    fn sends_in_flight(&mut self) -> bool;
    /// Gives up on the messages still in flight (their peers stopped taking them).
    fn abandon(&mut self);
    /// The largest tensor payload this transport may carry, if it is limited (a control
    /// channel carries no bulk data); a larger one is refused with an error.
    fn max_tensor_bytes(&self) -> Option<usize> {
        None
    }
}

/// Mutable state: the calls take `&self` like every [`Communicator`].
#[derive(Default)]
struct State {
    inbox: HashMap<(usize, Stream), VecDeque<(CommOp, Payload)>>,
    /// Peers whose process has gone, with what the transport saw.
    lost: HashMap<usize, String>,
    /// Next collective number of the pipeline and data-parallel groups.
    seq: [u64; 2],
    /// The world's first failure this rank knows of, as `(rank, cause)`.
    failure: Option<(usize, String)>,
    /// Whether this rank passed a failure it learned from another rank on to the others.
    forwarded: bool,
    /// Ranks an abort notice arrived from: a rank that failed waits for every peer's notice
    /// (see [`ProcessComm`]'s `Drop`).
    heard_from: HashSet<usize>,
}

/// A rank of a world whose ranks are processes, exchanging messages over the transport `T`;
/// see the [module docs](self).
///
/// Like [`LocalComm`](super::LocalComm) it is used from one thread. Dropping it waits briefly
/// for outstanding sends.
pub struct ProcessComm<B: Backend, T: Transport> {
    grid: RankGrid,
    rank: usize,
    device: B::Device,
    config: CommConfig,
    state: RefCell<State>,
    /// Payload sent so far.
    sent: ByteCounter,
    /// Collectives started and not finished.
    started: StartOrder,
    /// Dropped after the state: MPI's transport finalises MPI when dropped.
    transport: RefCell<T>,
}

impl<B: Backend, T: Transport> fmt::Debug for ProcessComm<B, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessComm")
            .field("rank", &self.rank)
            .field("grid", &self.grid)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<B: Backend, T: Transport> ProcessComm<B, T> {
    /// World rank `rank` of `grid`, computing on `device`, over a transport that already
    /// reaches every other rank of the world.
    pub(crate) fn new(
        grid: RankGrid,
        rank: usize,
        device: B::Device,
        config: CommConfig,
        transport: T,
    ) -> Self {
        ProcessComm {
            grid,
            rank,
            device,
            config,
            state: RefCell::new(State::default()),
            sent: ByteCounter::default(),
            started: StartOrder::default(),
            transport: RefCell::new(transport),
        }
    }

    /// The configuration this rank was created with.
    pub fn config(&self) -> CommConfig {
        self.config
    }

    /// The world's first failure this rank knows of, as `(rank, cause)`.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.state.borrow().failure.clone()
    }

    fn data(&self, action: CommOp, reason: String) -> CommError {
        CommError::Data {
            rank: self.rank,
            action,
            reason,
        }
    }

    /// Records `err` as this world's failure (unless one is known already, whose consequence
    /// `err` then is) and tells every other rank; returns `err`.
    fn fail(&self, err: CommError) -> CommError {
        if !matches!(err, CommError::PeerFailed { .. }) {
            self.abort(&err.to_string());
        }
        err
    }

    /// Fails with [`CommError::PeerFailed`] once any rank is known to have failed.
    fn check(&self, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        self.progress();
        self.forward_failure();
        match &self.state.borrow().failure {
            Some((failed_rank, cause)) => Err(CommError::PeerFailed {
                rank: self.rank,
                action,
                shape: shape.to_vec(),
                failed_rank: *failed_rank,
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Passes a failure learned from another rank on to every other rank, once.
    ///
    /// This rank is about to stop, and its peers may notice that (its connection ending)
    /// before the failed rank's own notice reaches them; the copy sent here travels ahead of
    /// that on the same connection, so they report the root cause, not this rank's exit. The
    /// copy to the failed rank tells it this rank knows, so it can exit (see `Drop`).
    fn forward_failure(&self) {
        let notice = {
            let mut state = self.state.borrow_mut();
            let notice = match &state.failure {
                Some((failed, cause)) if *failed != self.rank && !state.forwarded => {
                    Some(wire::encode_abort(*failed, cause))
                }
                _ => None,
            };
            state.forwarded |= notice.is_some();
            notice
        };
        if let Some(bytes) = notice {
            for peer in (0..self.grid.world_size()).filter(|&p| p != self.rank) {
                self.post(peer, bytes.clone());
            }
        }
    }

    fn check_peer(&self, peer: usize, action: CommOp) -> Result<(), CommError> {
        if peer < self.grid.world_size() {
            return Ok(());
        }
        Err(self.fail(CommError::InvalidArgument {
            rank: self.rank,
            action,
            reason: format!(
                "peer {peer} is not a rank of a world of {}",
                self.grid.world_size()
            ),
        }))
    }

    /// Starts sending `bytes` to world rank `peer`.
    fn post(&self, peer: usize, bytes: Vec<u8>) {
        self.transport.borrow_mut().post(peer, bytes);
    }

    fn post_data(
        &self,
        peer: usize,
        stream: Stream,
        op: CommOp,
        payload: Payload,
    ) -> Result<(), CommError> {
        let tensor_bytes = match &payload {
            Payload::Tensor(data) | Payload::Part { data, .. } => data.bytes.len(),
            Payload::Empty | Payload::Bytes(_) => 0,
        };
        let limit = self.transport.borrow().max_tensor_bytes();
        if let Some(limit) = limit {
            if tensor_bytes > limit {
                let reason = format!(
                    "a tensor of {tensor_bytes} bytes on the control channel, which carries \
                     at most {limit} (start-up values, checks): data between GPU processes \
                     moves over NCCL (NcclComm), between CPU processes over MPI (MpiComm)"
                );
                return Err(self.fail(CommError::InvalidArgument {
                    rank: self.rank,
                    action: op,
                    reason,
                }));
            }
        }
        let bytes =
            wire::encode_data(stream, op, payload).map_err(|r| self.fail(self.data(op, r)))?;
        self.post(peer, bytes);
        Ok(())
    }

    /// Drains every message that has arrived into the inbox.
    fn progress(&self) {
        loop {
            let Some(incoming) = self.transport.borrow_mut().poll() else {
                return;
            };
            let mut state = self.state.borrow_mut();
            match incoming {
                Incoming::Lost { from, reason } => {
                    state.lost.insert(from, reason);
                }
                Incoming::Message { from, bytes } => match wire::decode(&bytes) {
                    Ok(Message::Data {
                        stream,
                        op,
                        payload,
                    }) => state
                        .inbox
                        .entry((from, stream))
                        .or_default()
                        .push_back((op, payload)),
                    Ok(Message::Abort { rank, cause }) => {
                        state.failure.get_or_insert((rank, cause));
                        state.heard_from.insert(from);
                    }
                    Err(reason) => {
                        state.failure.get_or_insert((
                            from,
                            format!("rank {} received a malformed message: {reason}", self.rank),
                        ));
                    }
                },
            }
        }
    }

    /// Waits for the oldest message from `peer` on `stream`, until the timeout.
    fn wait(
        &self,
        peer: usize,
        stream: Stream,
        action: CommOp,
        shape: &[usize],
    ) -> Result<Payload, CommError> {
        let start = Instant::now();
        // Yield a little, then back off to short sleeps: messages usually arrive within
        // microseconds, but ranks share cores with compute, so a waiting rank must not spin
        // for long. The naps stay short because a message noticed late is pipeline time
        // lost: on the critical path every receive would add up to one nap.
        let mut polls = 0u32;
        let mut nap = Duration::from_micros(20);
        let max_nap = self.config.poll_interval.min(MAX_NAP);
        loop {
            self.check(action, shape)?;
            let found = {
                let mut state = self.state.borrow_mut();
                let queue = state.inbox.get_mut(&(peer, stream));
                let found = queue.and_then(VecDeque::pop_front);
                // Every collective has a stream of its own: an emptied queue left in the map
                // would grow it by one entry per collective for the whole run.
                if state
                    .inbox
                    .get(&(peer, stream))
                    .is_some_and(VecDeque::is_empty)
                {
                    state.inbox.remove(&(peer, stream));
                }
                found
            };
            if let Some((op, payload)) = found {
                if let (Stream::Collective(_, seq, _), false) = (stream, op == action) {
                    return Err(self.fail(CommError::CollectiveMismatch {
                        rank: self.rank,
                        peer,
                        action,
                        peer_action: op,
                        seq,
                        peer_seq: seq,
                    }));
                }
                return Ok(payload);
            }
            let lost = self.state.borrow().lost.get(&peer).cloned();
            if let Some(reason) = lost {
                // Everything the peer sent arrived before its connection ended.
                return Err(self.fail(CommError::ConnectionLost {
                    rank: self.rank,
                    peer,
                    action,
                    shape: shape.to_vec(),
                    reason,
                }));
            }
            let after = start.elapsed();
            if after >= self.config.timeout {
                return Err(self.fail(CommError::Timeout {
                    rank: self.rank,
                    peer,
                    action,
                    shape: shape.to_vec(),
                    after,
                    // A process cannot see what its peers are waiting on.
                    stalled: None,
                }));
            }
            polls += 1;
            if polls <= YIELDING_POLLS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(max_nap);
            }
        }
    }

    fn next_seq(&self, group: Group) -> u64 {
        let i = match group {
            Group::Pipeline => 0,
            Group::DataParallel => 1,
        };
        let mut state = self.state.borrow_mut();
        let seq = state.seq[i];
        state.seq[i] += 1;
        seq
    }

    /// Reads a tensor to send; only float tensors travel.
    fn read_data<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<TensorData, CommError> {
        let data = read(tensor, ReadPurpose::Transfer)
            .map_err(|e| self.fail(self.data(action, e.to_string())))?;
        if !data.dtype.is_float() {
            let reason = format!("expected float data, got {:?}", data.dtype);
            return Err(self.fail(self.data(action, reason)));
        }
        Ok(data)
    }

    fn build_tensor<const D: usize>(&self, data: TensorData) -> Tensor<B, D> {
        let dtype = data.dtype;
        Tensor::from_data(data, (&self.device, dtype))
    }

    fn expect_tensor(
        &self,
        payload: Payload,
        peer: usize,
        action: CommOp,
        shape: &[usize],
    ) -> Result<TensorData, CommError> {
        let Payload::Tensor(data) = payload else {
            return Err(self.fail(self.data(action, format!("rank {peer} sent no tensor"))));
        };
        if data.shape.as_slice() != shape {
            return Err(self.fail(CommError::ShapeMismatch {
                rank: self.rank,
                peer,
                action,
                expected: shape.to_vec(),
                actual: data.shape.as_slice().to_vec(),
            }));
        }
        Ok(data)
    }
}

#[cfg(any(feature = "cuda", test))]
impl<B: Backend, T: Transport> super::watchdog::FailStop for ProcessComm<B, T> {
    fn world_rank(&self) -> usize {
        self.rank
    }
    fn call_timeout(&self) -> Duration {
        self.config.timeout
    }
    fn fail_world(&self, err: CommError) -> CommError {
        self.fail(err)
    }
}

impl<B: Backend, T: Transport> PostAndCollect<B> for ProcessComm<B, T> {
    fn overlaps(&self) -> bool {
        self.config.overlap_collectives
    }

    fn check_call(&self, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        self.check(action, shape)
    }

    fn next_seq(&self, group: Group) -> u64 {
        ProcessComm::next_seq(self, group)
    }

    fn fail_call(&self, err: CommError) -> CommError {
        self.fail(err)
    }

    fn read_part<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<Arc<HostBuf>, CommError> {
        let data = self.read_data(tensor, action)?;
        HostBuf::from_data(data)
            .map(Arc::new)
            .map_err(|r| self.fail(self.data(action, r)))
    }

    fn send_part(
        &self,
        peer: usize,
        key: &PartKey,
        mine: &Arc<HostBuf>,
        range: std::ops::Range<usize>,
    ) -> Result<(), CommError> {
        self.sent.add(key.group, range.len(), mine.dtype);
        let payload = Payload::Part {
            shape: key.shape.clone(),
            data: mine.slice_data(range),
        };
        let stream = Stream::Collective(key.group, key.seq, key.round);
        self.post_data(peer, stream, key.action, payload)
    }

    fn start_order(&self) -> &StartOrder {
        &self.started
    }

    fn receive_part(&self, peer: usize, key: &PartKey) -> Result<ReceivedPart, CommError> {
        let stream = Stream::Collective(key.group, key.seq, key.round);
        match self.wait(peer, stream, key.action, &key.shape)? {
            Payload::Part { shape, data } => {
                let buf =
                    HostBuf::from_data(data).map_err(|r| self.fail(self.data(key.action, r)))?;
                let range = 0..buf.len();
                Ok(ReceivedPart {
                    shape,
                    buf: Arc::new(buf),
                    range,
                })
            }
            _ => Err(self.fail(self.data(key.action, format!("rank {peer} sent no contribution")))),
        }
    }
}

impl<B: Backend, T: Transport> ProcessComm<B, T> {
    /// On the rank that failed first: waits (at most [`ACK_LIMIT`], or the timeout if shorter)
    /// until every peer has passed the failure back or is gone, then [`LINGER`] more.
    ///
    /// A peer learns of the failure only at its next communication call, and under `mpirun`
    /// this process's exit gets the others killed at once: leaving before they heard would
    /// take their own error (naming this rank) with them.
    fn wait_for_peers_to_hear(&self) {
        let failed_here = matches!(&self.state.borrow().failure, Some((r, _)) if *r == self.rank);
        if !failed_here || self.grid.world_size() == 1 {
            return;
        }
        let limit = self.config.timeout.min(ACK_LIMIT);
        let start = Instant::now();
        let all_heard = || {
            let state = self.state.borrow();
            (0..self.grid.world_size())
                .filter(|&p| p != self.rank)
                .all(|p| state.heard_from.contains(&p) || state.lost.contains_key(&p))
        };
        loop {
            self.progress();
            if all_heard() {
                std::thread::sleep(LINGER);
                return;
            }
            if start.elapsed() >= limit {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl<B: Backend, T: Transport> Drop for ProcessComm<B, T> {
    fn drop(&mut self) {
        // Abort notices must leave before this process exits.
        let start = Instant::now();
        while self.transport.get_mut().sends_in_flight() && start.elapsed() < FLUSH_LIMIT {
            self.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
        // Sends no peer ever took (it died).
        if self.transport.get_mut().sends_in_flight() {
            self.transport.get_mut().abandon();
        }
        self.wait_for_peers_to_hear();
    }
}

/// Process ranks can layer `NcclComm` on a `ProcessComm` (`NcclComm::over_host`): the call
/// agreement before each NCCL call is a small all-gather over the transport.
#[cfg(feature = "cuda")]
impl<B: Backend, T: Transport> super::NcclHost<B> for ProcessComm<B, T> {
    fn agree(&self, group: Group, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        super::agree_by_all_gather(self, group, action, shape)
    }
    fn fail(&self, err: CommError) -> CommError {
        ProcessComm::fail(self, err)
    }
    fn config(&self) -> CommConfig {
        ProcessComm::config(self)
    }
}
