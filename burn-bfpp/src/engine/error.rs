//! Errors of the training engine.

use super::NonFiniteReport;
use crate::comm::CommError;
use crate::model::ModelError;
use crate::schedule::{Action, ScheduleError};

/// Everything that can stop a pipelined training run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The configuration is not usable; the text names the fix.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The schedule could not be generated or lowered.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The model could not be split or a stage failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A rank's action failed.
    #[error("rank {rank}, step {step}, action {action}: {source}")]
    Action {
        /// World rank.
        rank: usize,
        /// Optimizer step (1-based).
        step: usize,
        /// The action that failed.
        action: Action,
        /// Why.
        #[source]
        source: Box<EngineError>,
    },
    /// Communication with a peer failed (timeout, peer failure, mismatch).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The lowered program asked for data that no earlier action produced; a bug in the
    /// schedule that the validator should have caught.
    #[error("{what} of stage {stage}, micro-batch {microbatch} is not available")]
    Missing {
        /// What was missing (input activation, output gradient, …).
        what: &'static str,
        /// Stage.
        stage: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// The data source failed, or gave a micro-batch of another shape than the first one.
    #[error("rank {rank}: the data of step {step}, micro-batch {microbatch}: {reason}")]
    Data {
        /// World rank that asked.
        rank: usize,
        /// Optimizer step (1-based).
        step: usize,
        /// Micro-batch index of the replica.
        microbatch: usize,
        /// What the data source reported, or what was wrong with its micro-batch.
        reason: String,
    },
    /// An injected fault (`BFPP_FAULT_INJECT`), for testing failure handling. Only a build
    /// with the test-only feature `fault-injection` injects faults; the variant is there in
    /// every build so that the enum is the same whatever the features (Cargo features add,
    /// and a user's exhaustive `match` must not break when some crate turns one on).
    #[error("injected fault on rank {rank} at step {step}")]
    InjectedFault {
        /// World rank.
        rank: usize,
        /// Optimizer step (1-based).
        step: usize,
    },
    /// A rank panicked or was aborted; the text names the rank and the cause.
    #[error("{0}")]
    RankFailure(String),
    /// The optimizer rejected its inputs.
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// A step's loss or global gradient norm was NaN or infinite and the policy is
    /// [`NonFinitePolicy::Stop`](super::NonFinitePolicy::Stop). Every rank returns this for
    /// the same step (the decision follows a reduction every rank takes part in).
    #[error(
        "step {step}: {report} (reported by rank {rank}); the run stops because on_nonfinite \
         is `stop`: look for a too-high learning rate or bad data, or set on_nonfinite = \
         `skip` (--on-nonfinite skip) to skip such steps' updates"
    )]
    NonFinite {
        /// Optimizer step (1-based).
        step: usize,
        /// The world rank returning the error.
        rank: usize,
        /// Where the non-finite values were seen.
        report: NonFiniteReport,
    },
    /// A checkpoint could not be written or restored; the text names the file and problem.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
}
