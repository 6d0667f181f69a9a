//! Errors of the communication layer and of [`run_ranks`](super::run_ranks).

use std::time::Duration;

use super::CommOp;

/// Why a communication call failed. Every variant names the rank that reports it and, where
/// one is involved, the peer, the call and the tensor shape, so a log line alone locates the
/// problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// A peer did not take part in the call within [`CommConfig::timeout`](super::CommConfig).
    #[error(
        "rank {rank}: {action} timed out after {after:?} waiting for rank {peer} (shape {shape:?}){}",
        stalled_note(*peer, *stalled)
    )]
    Timeout {
        /// The rank that gave up waiting.
        rank: usize,
        /// The world rank it was waiting for.
        peer: usize,
        /// The call that timed out.
        action: CommOp,
        /// Shape of this rank's tensor in the call (expected shape for a receive).
        shape: Vec<usize>,
        /// How long it waited.
        after: Duration,
        /// The rank holding everybody up, where the communicator can tell: the end of the
        /// waits-for chain that starts at `peer` (`peer` itself when it was not waiting on
        /// anybody: computing, stalled or slow). `None` when unknown (a communicator that
        /// cannot see its peers' waits) or when the chain is a cycle (a deadlock).
        stalled: Option<usize>,
    },
    /// Another rank failed (or aborted) first; this call stopped instead of waiting forever.
    #[error(
        "rank {rank}: {action} (shape {shape:?}) stopped because rank {failed_rank} failed: {cause}"
    )]
    PeerFailed {
        /// The rank reporting the failure.
        rank: usize,
        /// The call that was stopped.
        action: CommOp,
        /// Shape of this rank's tensor in that call.
        shape: Vec<usize>,
        /// The rank that failed first.
        failed_rank: usize,
        /// Its error or panic message.
        cause: String,
    },
    /// The peer dropped its communicator (its thread finished) without sending what this call
    /// waits for, so the call can never complete.
    #[error(
        "rank {rank}: {action} (shape {shape:?}) cannot complete: rank {peer} has exited without taking part"
    )]
    PeerExited {
        /// The rank that was waiting.
        rank: usize,
        /// The rank that exited.
        peer: usize,
        /// The call that cannot complete.
        action: CommOp,
        /// Shape of this rank's tensor in the call.
        shape: Vec<usize>,
    },
    /// The connection to a peer process ended before the call could complete: the peer's
    /// process exited (or crashed), or the network between the two failed.
    #[error(
        "rank {rank}: {action} (shape {shape:?}) cannot complete: the connection to rank {peer} \
         ended ({reason}); rank {peer}'s process exited or the network between them failed"
    )]
    ConnectionLost {
        /// The rank that was waiting.
        rank: usize,
        /// The rank at the other end of the connection.
        peer: usize,
        /// The call that cannot complete.
        action: CommOp,
        /// Shape of this rank's tensor in the call.
        shape: Vec<usize>,
        /// What the transport saw (end of stream, a read error).
        reason: String,
    },
    /// A peer contributed a tensor whose shape differs from this rank's.
    #[error(
        "rank {rank}: {action}: rank {peer} sent shape {actual:?} but this rank expects {expected:?}"
    )]
    ShapeMismatch {
        /// The rank that noticed.
        rank: usize,
        /// The rank whose tensor has the wrong shape.
        peer: usize,
        /// The call.
        action: CommOp,
        /// The shape this rank expected.
        expected: Vec<usize>,
        /// The shape the peer sent.
        actual: Vec<usize>,
    },
    /// Members of a group issued different collectives at the same point of their programs.
    #[error(
        "rank {rank}: collective #{seq} is {action} but rank {peer} called {peer_action} as its collective #{peer_seq}"
    )]
    CollectiveMismatch {
        /// The rank that noticed.
        rank: usize,
        /// The member that disagrees.
        peer: usize,
        /// This rank's call.
        action: CommOp,
        /// The peer's call.
        peer_action: CommOp,
        /// Index of this rank's collective on that group (0-based).
        seq: u64,
        /// Index of the peer's collective on that group.
        peer_seq: u64,
    },
    /// The call's arguments are invalid (peer out of range, length not divisible, …).
    #[error("rank {rank}: {action}: {reason}")]
    InvalidArgument {
        /// The rank that made the call.
        rank: usize,
        /// The call.
        action: CommOp,
        /// What is wrong and what is allowed.
        reason: String,
    },
    /// Tensor data could not be read from the device or is not float data of a kind the
    /// members agree on.
    #[error("rank {rank}: {action}: tensor data error: {reason}")]
    Data {
        /// The rank that made the call.
        rank: usize,
        /// The call.
        action: CommOp,
        /// What went wrong.
        reason: String,
    },
    /// An NCCL call failed, or did not finish within the timeout (its communicator was then
    /// aborted, so the rank does not hang on a dead peer).
    #[error("rank {rank}: {action}: NCCL: {reason}")]
    Nccl {
        /// The rank that made the call.
        rank: usize,
        /// The call.
        action: CommOp,
        /// What NCCL or CUDA reported.
        reason: String,
    },
    /// The requested world cannot be built.
    #[error("invalid rank grid pp={pp} × dp={dp}: {reason}")]
    InvalidGrid {
        /// Requested pipeline size.
        pp: usize,
        /// Requested data-parallel size.
        dp: usize,
        /// What is wrong.
        reason: String,
    },
    /// The processes of a world could not find or connect to each other at start-up.
    #[error("rank {rank}: connecting the ranks' processes: {reason}")]
    Rendezvous {
        /// The rank that could not connect.
        rank: usize,
        /// What failed, with the address or variable involved.
        reason: String,
    },
    /// A library the communicator needs cannot be loaded (NCCL, CUDA).
    #[error("{what} is not available: {fix}")]
    Unavailable {
        /// The missing library.
        what: String,
        /// How to make it available.
        fix: String,
    },
}

/// The part of a timeout message that names the rank holding the run up.
fn stalled_note(peer: usize, stalled: Option<usize>) -> String {
    match stalled {
        Some(s) if s == peer => {
            format!(
                "; rank {peer} is not waiting on anybody: it is stalled or slower than the timeout"
            )
        }
        Some(s) => format!(
            "; rank {peer} is itself waiting, and the chain of waiting ranks ends at rank {s}, \
             which is stalled or slower than the timeout"
        ),
        None => String::new(),
    }
}

/// The root cause of a failed [`run_ranks`](super::run_ranks): the first rank that failed,
/// panicked or aborted. Errors of the other ranks are consequences (usually
/// [`CommError::PeerFailed`]) and are not reported.
#[derive(Debug, thiserror::Error)]
pub enum RankError<E> {
    /// The rank's closure returned an error.
    #[error("rank {rank} failed: {error}")]
    Failed {
        /// The failing rank.
        rank: usize,
        /// Its error.
        error: E,
    },
    /// The rank's closure panicked.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The panicking rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// The rank aborted the world (or its communication failed) but its closure did not
    /// return an error, or its thread could not be started.
    #[error("rank {rank} aborted the run: {cause}")]
    Aborted {
        /// The aborting rank.
        rank: usize,
        /// The recorded cause.
        cause: String,
    },
}

impl<E> RankError<E> {
    /// The rank that caused the failure.
    pub fn rank(&self) -> usize {
        match self {
            RankError::Failed { rank, .. }
            | RankError::Panicked { rank, .. }
            | RankError::Aborted { rank, .. } => *rank,
        }
    }
}
