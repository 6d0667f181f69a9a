//! The message layer under [`LocalComm`](super::LocalComm): one inbox per rank, the
//! world's shared abort record, and blocking waits that always end.
//!
//! Every rank owns one inbox (an mpsc channel) and a sender to every rank's inbox. A receiver
//! matches messages by (source, stream), where a stream is a point-to-point tag or a group's
//! collectives; messages it does not want yet are parked in a per-rank stash, which lets
//! pipeline transfers and collectives interleave freely. Waits poll in short slices so that an
//! abort or an exited peer is noticed within one poll interval.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use super::host::HostBuf;
use super::{CommConfig, CommError, CommOp, Group};

/// State shared by all ranks of one world: the abort record and who has exited.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Fast check for "somebody failed", read on every poll.
    aborted: AtomicBool,
    /// The first failure: (rank, cause). Later aborts keep it, so it stays the root cause.
    failure: Mutex<Option<(usize, String)>>,
    /// `departed[r]` is set when rank `r` drops its communicator.
    departed: Vec<AtomicBool>,
    /// `waiting_on[r]` is the rank that rank `r` is blocked on right now, or [`NOT_WAITING`]:
    /// the waits-for graph, followed on a timeout to name the rank holding everybody up.
    waiting_on: Vec<AtomicUsize>,
}

/// `waiting_on` value of a rank that is not inside a blocking call.
const NOT_WAITING: usize = usize::MAX;

impl Shared {
    /// Records `(rank, cause)` unless a failure is already recorded, and raises the flag.
    pub(crate) fn abort(&self, rank: usize, cause: String) {
        // A poisoned lock only means another thread panicked while holding it; the
        // `Option` inside is always valid, so recovering it is safe.
        let mut slot = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some((rank, cause));
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    /// The first recorded failure, if any.
    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        if !self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The rank at the end of the waits-for chain that starts at `peer`: the first rank on
    /// it that is not blocked on anybody (computing, stalled or slow). `None` if the chain
    /// runs into a cycle (a deadlock), where no single rank is to blame.
    ///
    /// The graph is read while it changes, so the answer is a snapshot; a rank that keeps
    /// a whole world waiting past the timeout stays at the end of the chain, which is the
    /// case this is for.
    pub(crate) fn stalled_rank(&self, peer: usize) -> Option<usize> {
        let mut at = peer;
        // A chain without a cycle visits every rank at most once.
        for _ in 0..self.waiting_on.len() {
            match self.waiting_on.get(at)?.load(Ordering::SeqCst) {
                NOT_WAITING => return Some(at),
                next => at = next,
            }
        }
        None
    }
}

/// Marks a rank as blocked on a peer for as long as it lives.
struct Waiting<'a> {
    slot: &'a AtomicUsize,
}

impl<'a> Waiting<'a> {
    fn on(slot: &'a AtomicUsize, peer: usize) -> Self {
        slot.store(peer, Ordering::SeqCst);
        Waiting { slot }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.slot.store(NOT_WAITING, Ordering::SeqCst);
    }
}

/// Which sequence of messages between two ranks an envelope belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Stream {
    /// Point-to-point messages with one tag.
    P2p(u64),
    /// Round `round` of collective number `seq` on one group kind.
    Collective(Group, u64, u8),
}

/// A point-to-point tensor handed over as it is (sender and receiver share a device): the
/// backend's `Tensor<B, D>`, boxed because the message layer is backend-agnostic, taken once
/// by the receiver.
#[derive(Clone)]
pub(crate) struct Handoff(Arc<Mutex<Option<Box<dyn Any + Send>>>>);

impl Handoff {
    pub(crate) fn new<T: Any + Send>(value: T) -> Self {
        Handoff(Arc::new(Mutex::new(Some(Box::new(value)))))
    }

    /// The value, if it is a `T` and was not taken before.
    pub(crate) fn take<T: Any>(&self) -> Option<T> {
        let boxed = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        boxed.downcast::<T>().ok().map(|b| *b)
    }
}

impl fmt::Debug for Handoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Handoff(..)")
    }
}

/// What a message carries.
#[derive(Debug, Clone)]
pub(crate) enum Payload {
    /// A point-to-point tensor as host data, moved to its single receiver.
    Tensor(TensorData),
    /// A point-to-point tensor left on the device both ranks share.
    Handoff(Handoff),
    /// Elements `range` of a collective contribution, shared by all receivers (threads share
    /// memory: only the range is read); `shape` is the sender's input shape.
    Part {
        shape: Vec<usize>,
        buf: Arc<HostBuf>,
        range: std::ops::Range<usize>,
    },
    /// No data (barriers, non-root broadcast members never send).
    Empty,
}

/// One message between ranks.
#[derive(Debug)]
pub(crate) struct Envelope {
    pub(crate) src: usize,
    pub(crate) stream: Stream,
    /// Index of the collective on that group at the sender (0 for point-to-point).
    pub(crate) seq: u64,
    /// The sender's call, checked against the receiver's for collectives.
    pub(crate) op: CommOp,
    pub(crate) payload: Payload,
}

/// One rank's end of the message layer.
///
/// Dropping it marks the rank as exited, so peers waiting on it fail with
/// [`CommError::PeerExited`] instead of timing out; dropping it while panicking also aborts
/// the world (the panic message is not available here; [`run_ranks`](super::run_ranks)
/// records it before the drop).
#[derive(Debug)]
pub(crate) struct Mailbox {
    rank: usize,
    config: CommConfig,
    shared: Arc<Shared>,
    outboxes: Vec<Sender<Envelope>>,
    inbox: Receiver<Envelope>,
    stash: RefCell<HashMap<(usize, Stream), VecDeque<Envelope>>>,
    /// Collectives issued so far on the pipeline and the data-parallel group.
    seq: [Cell<u64>; 2],
}

impl Mailbox {
    /// One connected mailbox per rank of a world of `world` ranks (index = rank).
    pub(crate) fn world(world: usize, config: CommConfig) -> Vec<Mailbox> {
        let shared = Arc::new(Shared {
            aborted: AtomicBool::new(false),
            failure: Mutex::new(None),
            departed: (0..world).map(|_| AtomicBool::new(false)).collect(),
            waiting_on: (0..world).map(|_| AtomicUsize::new(NOT_WAITING)).collect(),
        });
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..world).map(|_| mpsc::channel()).unzip();
        receivers
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| Mailbox {
                rank,
                config,
                shared: Arc::clone(&shared),
                outboxes: senders.clone(),
                inbox,
                stash: RefCell::new(HashMap::new()),
                seq: [Cell::new(0), Cell::new(0)],
            })
            .collect()
    }

    /// This mailbox's rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The world's shared abort record.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Makes every error fatal for the world: records it as this rank's failure (unless it is
    /// itself the consequence of another rank's failure) and hands it back.
    pub(crate) fn fail(&self, err: CommError) -> CommError {
        if !matches!(err, CommError::PeerFailed { .. }) {
            self.shared.abort(self.rank, err.to_string());
        }
        err
    }

    /// Fails with [`CommError::PeerFailed`] once any rank of the world has failed.
    pub(crate) fn check_abort(&self, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        match self.shared.failure() {
            Some((failed_rank, cause)) => Err(CommError::PeerFailed {
                rank: self.rank,
                action,
                shape: shape.to_vec(),
                failed_rank,
                cause,
            }),
            None => Ok(()),
        }
    }

    /// Queues `env` in `dst`'s inbox; never blocks.
    pub(crate) fn post(&self, dst: usize, env: Envelope, shape: &[usize]) -> Result<(), CommError> {
        let action = env.op;
        // A send fails only when the receiving rank's communicator is gone.
        self.outboxes[dst].send(env).map_err(|_| {
            self.fail(CommError::PeerExited {
                rank: self.rank,
                peer: dst,
                action,
                shape: shape.to_vec(),
            })
        })
    }

    fn take_stashed(&self, key: (usize, Stream)) -> Option<Envelope> {
        let mut stash = self.stash.borrow_mut();
        let queue = stash.get_mut(&key)?;
        let env = queue.pop_front();
        // Every collective has a stream of its own: an emptied queue left in the map would
        // grow it by one entry per collective for the whole run.
        if queue.is_empty() {
            stash.remove(&key);
        }
        env
    }

    fn park(&self, env: Envelope) {
        self.stash
            .borrow_mut()
            .entry((env.src, env.stream))
            .or_default()
            .push_back(env);
    }

    /// Waits for the oldest message from `src` on `stream`, at most until `started + timeout`.
    ///
    /// Wakes up every poll interval to notice an abort or that `src` has exited.
    pub(crate) fn wait(
        &self,
        src: usize,
        stream: Stream,
        action: CommOp,
        shape: &[usize],
        started: Instant,
    ) -> Result<Envelope, CommError> {
        let deadline = started + self.config.timeout;
        let _waiting = Waiting::on(&self.shared.waiting_on[self.rank], src);
        loop {
            if let Some(env) = self.take_stashed((src, stream)) {
                return Ok(env);
            }
            self.check_abort(action, shape)?;
            // Read the exit flag *before* draining: anything `src` sent before exiting is
            // then guaranteed to be in the channel already.
            let gone = self.shared.departed[src].load(Ordering::SeqCst);
            while let Ok(env) = self.inbox.try_recv() {
                self.park(env);
            }
            if let Some(env) = self.take_stashed((src, stream)) {
                return Ok(env);
            }
            if gone {
                return Err(self.fail(CommError::PeerExited {
                    rank: self.rank,
                    peer: src,
                    action,
                    shape: shape.to_vec(),
                }));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.fail(CommError::Timeout {
                    rank: self.rank,
                    peer: src,
                    action,
                    shape: shape.to_vec(),
                    after: now - started,
                    stalled: self.shared.stalled_rank(src),
                }));
            }
            // At least 1 ms, so that a zero poll interval cannot turn this into a spin loop.
            let slice = self
                .config
                .poll_interval
                .max(Duration::from_millis(1))
                .min(deadline - now);
            match self.inbox.recv_timeout(slice) {
                Ok(env) => self.park(env),
                // Cannot happen while this rank holds a sender to its own inbox; treat it
                // like a timeout slice and let the checks above decide.
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
            }
        }
    }

    /// The next collective index on `group` (every member counts the same way).
    pub(crate) fn next_seq(&self, group: Group) -> u64 {
        let cell = match group {
            Group::Pipeline => &self.seq[0],
            Group::DataParallel => &self.seq[1],
        };
        let seq = cell.get();
        cell.set(seq + 1);
        seq
    }

    /// One collective round on `group`: posts `payload` to `send_to`, then waits for one
    /// message from each of `recv_from` ([`Self::post_collective`] then [`Self::collect`]).
    pub(crate) fn exchange(
        &self,
        group: Group,
        action: CommOp,
        shape: &[usize],
        payload: Payload,
        send_to: &[usize],
        recv_from: &[usize],
    ) -> Result<Vec<Payload>, CommError> {
        let seq = self.post_collective(group, action, shape, payload, send_to)?;
        self.collect(group, action, shape, seq, recv_from)
    }

    /// Posts `payload` to `send_to` as this rank's part of the next collective on `group`
    /// and returns that collective's index; never blocks.
    pub(crate) fn post_collective(
        &self,
        group: Group,
        action: CommOp,
        shape: &[usize],
        payload: Payload,
        send_to: &[usize],
    ) -> Result<u64, CommError> {
        let seq = self.next_seq(group);
        for &dst in send_to {
            self.post_part(dst, group, seq, 0, action, shape, payload.clone())?;
        }
        Ok(seq)
    }

    /// Posts `payload` to `dst` as round `round` of collective `seq` on `group`; never blocks.
    #[allow(clippy::too_many_arguments)] // the message's key, spelled out
    pub(crate) fn post_part(
        &self,
        dst: usize,
        group: Group,
        seq: u64,
        round: u8,
        action: CommOp,
        shape: &[usize],
        payload: Payload,
    ) -> Result<(), CommError> {
        let env = Envelope {
            src: self.rank,
            stream: Stream::Collective(group, seq, round),
            seq,
            op: action,
            payload,
        };
        self.post(dst, env, shape)
    }

    /// Waits for round `round` of collective `seq` on `group` from `src`; fails if `src`
    /// issued another collective as its `seq`-th on the group.
    pub(crate) fn wait_part(
        &self,
        src: usize,
        group: Group,
        seq: u64,
        round: u8,
        action: CommOp,
        shape: &[usize],
    ) -> Result<Envelope, CommError> {
        let stream = Stream::Collective(group, seq, round);
        let env = self.wait(src, stream, action, shape, Instant::now())?;
        if env.op != action {
            return Err(self.fail(CommError::CollectiveMismatch {
                rank: self.rank,
                peer: src,
                action,
                peer_action: env.op,
                seq,
                peer_seq: env.seq,
            }));
        }
        Ok(env)
    }

    /// Waits for the parts of collective `seq` on `group` from each of `recv_from`, in that
    /// order.
    pub(crate) fn collect(
        &self,
        group: Group,
        action: CommOp,
        shape: &[usize],
        seq: u64,
        recv_from: &[usize],
    ) -> Result<Vec<Payload>, CommError> {
        let started = Instant::now();
        let stream = Stream::Collective(group, seq, 0);
        let mut received = Vec::with_capacity(recv_from.len());
        for &src in recv_from {
            let env = self.wait(src, stream, action, shape, started)?;
            if env.op != action {
                return Err(self.fail(CommError::CollectiveMismatch {
                    rank: self.rank,
                    peer: src,
                    action,
                    peer_action: env.op,
                    seq,
                    peer_seq: env.seq,
                }));
            }
            received.push(env.payload);
        }
        Ok(received)
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared
                .abort(self.rank, format!("rank {} panicked", self.rank));
        }
        self.shared.departed[self.rank].store(true, Ordering::SeqCst);
    }
}
