//! [`run_ranks`]: one thread per rank, with failures and panics turned into a world abort.

use std::any::Any;
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;

use burn::tensor::backend::Backend;

use super::mailbox::Shared;
use super::{Communicator, LocalComm, RankError};

/// A rank of a world whose ranks are threads of this process ([`LocalComm`], and `NcclComm`
/// with feature `cuda`): what [`run_ranks`] needs to run it and to stop the world on failure.
pub trait ThreadRank: Send {
    /// This rank's world rank.
    fn world_rank(&self) -> usize;
    /// The world's shared state (opaque outside this crate).
    fn world(&self) -> World;
}

/// Opaque handle on the shared state of a world of threads; see [`ThreadRank`].
#[derive(Clone)]
pub struct World(pub(crate) Arc<Shared>);

impl<B: Backend> ThreadRank for LocalComm<B> {
    fn world_rank(&self) -> usize {
        Communicator::<B>::rank(self)
    }
    fn world(&self) -> World {
        World(self.shared().clone())
    }
}

/// How one rank's closure ended.
enum Outcome<T, E> {
    Done(T),
    Failed(E),
    Panicked(String),
    /// The thread could not be started; the world was aborted with the reason.
    NotStarted,
}

/// The text of a panic payload (`panic!` produces `&str` or `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Runs `f` once per rank, each on its own (scoped) thread, and returns the per-rank results
/// in world-rank order, or the root cause of the first failure.
///
/// When a rank's closure returns an error or panics, the world is aborted at once with the
/// error's message (or the panic message) as cause, so the other ranks' blocked calls fail
/// promptly with [`CommError::PeerFailed`](super::CommError::PeerFailed) instead of waiting for
/// their timeout. The returned error is the one of the rank recorded first; the other ranks'
/// errors are its consequences and are dropped. Each communicator is dropped when its thread
/// finishes, so a peer waiting on a rank that returned early fails with
/// [`CommError::PeerExited`](super::CommError::PeerExited).
///
/// `f` borrows the communicator rather than owning it, so that a panic does not drop it before
/// the panic message has been recorded as the cause.
pub fn run_ranks<C, T, E, F>(comms: Vec<C>, f: F) -> Result<Vec<T>, RankError<E>>
where
    C: ThreadRank,
    T: Send,
    E: Display + Send,
    F: Fn(&C) -> Result<T, E> + Sync,
{
    let Some(World(shared)) = comms.first().map(|c| c.world()) else {
        return Ok(Vec::new());
    };
    let mut comms = comms;
    comms.sort_by_key(|c| c.world_rank());
    let ranks: Vec<usize> = comms.iter().map(|c| c.world_rank()).collect();

    let outcomes: Vec<Outcome<T, E>> = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(comms.len());
        for comm in comms {
            let rank = comm.world_rank();
            let f = &f;
            let world = Arc::clone(&shared);
            let spawned = thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || {
                    let outcome = match catch_unwind(AssertUnwindSafe(|| f(&comm))) {
                        Ok(Ok(value)) => Outcome::Done(value),
                        Ok(Err(error)) => {
                            world.abort(rank, error.to_string());
                            Outcome::Failed(error)
                        }
                        Err(payload) => {
                            let message = panic_message(payload.as_ref());
                            world.abort(rank, format!("panicked: {message}"));
                            Outcome::Panicked(message)
                        }
                    };
                    drop(comm);
                    outcome
                });
            match spawned {
                Ok(handle) => handles.push(Some(handle)),
                Err(e) => {
                    // The closure (and with it the communicator) was dropped, which marks the
                    // rank as exited; the abort makes everybody stop right away.
                    shared.abort(
                        rank,
                        format!("could not start the thread of rank {rank}: {e}"),
                    );
                    handles.push(None);
                }
            }
        }
        handles
            .into_iter()
            .map(|handle| match handle.map(|h| h.join()) {
                Some(Ok(outcome)) => outcome,
                Some(Err(payload)) => Outcome::Panicked(panic_message(payload.as_ref())),
                None => Outcome::NotStarted,
            })
            .collect()
    });

    let Some((failed_rank, cause)) = shared.failure() else {
        let mut values = Vec::with_capacity(outcomes.len());
        for (rank, outcome) in ranks.iter().zip(outcomes) {
            match outcome {
                Outcome::Done(value) => values.push(value),
                // Unreachable in practice: failures abort the world before returning.
                Outcome::Failed(error) => return Err(RankError::Failed { rank: *rank, error }),
                Outcome::Panicked(message) => {
                    return Err(RankError::Panicked {
                        rank: *rank,
                        message,
                    })
                }
                Outcome::NotStarted => {
                    return Err(RankError::Aborted {
                        rank: *rank,
                        cause: "thread not started".to_string(),
                    })
                }
            }
        }
        return Ok(values);
    };
    let root = ranks
        .iter()
        .zip(outcomes)
        .find(|(rank, _)| **rank == failed_rank)
        .map(|(_, outcome)| outcome);
    Err(match root {
        Some(Outcome::Failed(error)) => RankError::Failed {
            rank: failed_rank,
            error,
        },
        Some(Outcome::Panicked(message)) => RankError::Panicked {
            rank: failed_rank,
            message,
        },
        Some(Outcome::Done(_) | Outcome::NotStarted) | None => RankError::Aborted {
            rank: failed_rank,
            cause,
        },
    })
}
