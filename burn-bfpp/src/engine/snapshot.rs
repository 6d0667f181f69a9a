//! What a rank's training state looks like outside the engine, and the hooks that let a run
//! start from such a state and hand it out after chosen steps (checkpoints).
//!
//! The engine itself knows nothing about files: it produces a [`RankState`] per rank after a
//! step, gives it to a [`CheckpointSink`], and agrees with every other rank that all of them
//! wrote it before the sink's `commit` runs on world rank 0. Restoring is the reverse: a
//! [`RankState`] per rank (already resharded for this layout by the caller) replaces the
//! freshly initialised shards and optimizer state, and training continues after its step.

use burn::tensor::backend::AutodiffBackend;

use super::executor::RankExecutor;
use super::precision::ScalerState;
use super::shard::{ShardLayout, StageState};
use super::stage::LocalStage;
use super::EngineError;
use crate::comm::{Communicator, Group};
use crate::model::PipelineStage;

/// A rank's whole training state after an optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct RankState {
    /// The optimizer step just finished (1-based; 0 before any step).
    pub step: usize,
    /// The rank's stages, in the order the rank holds them.
    pub stages: Vec<StageState>,
    /// The f16 loss scale after that step (`None` without loss scaling, or from a checkpoint
    /// that did not record it: the run then starts from the configured initial scale).
    pub scaler: Option<ScalerState>,
}

/// Where ranks put their state when a checkpoint is due.
///
/// `write_rank` runs on every rank (concurrently); `commit` runs once, on world rank 0, only
/// after every rank's `write_rank` succeeded. Errors are text because they cross rank
/// boundaries; they must name the file and the problem.
pub trait CheckpointSink: Sync {
    /// Persist world rank `rank`'s state after step `state.step`.
    fn write_rank(&self, rank: usize, state: &RankState) -> Result<(), String>;
    /// Make the checkpoint of `step` complete (e.g. write its manifest), after every rank
    /// wrote its part.
    fn commit(&self, step: usize) -> Result<(), String>;
}

/// Where a resumed run's ranks find their saved state, each asking only for its own.
///
/// [`crate::checkpoint::DirResume`] reads a checkpoint on disk, each rank only the values of
/// its own shards, resharded for the new layout. A `Vec<RankState>` (one state per world
/// rank, e.g. [`crate::checkpoint::resume_states`]) is a source too.
pub trait ResumeSource: Sync {
    /// The step the saved states are at: training continues with the step after it (0: no
    /// state, a fresh run).
    fn step(&self) -> usize;

    /// World rank `rank`'s state for the stages it holds in this run, `(global stage index,
    /// layout)` in the order it holds them. Errors are text (they cross rank boundaries) and
    /// name the file and the problem.
    fn rank_state(&self, rank: usize, stages: &[(usize, ShardLayout)])
        -> Result<RankState, String>;
}

/// Every world rank's state, by world rank; empty for a fresh run.
impl ResumeSource for Vec<RankState> {
    fn step(&self) -> usize {
        self.first().map_or(0, |s| s.step)
    }

    fn rank_state(
        &self,
        rank: usize,
        stages: &[(usize, ShardLayout)],
    ) -> Result<RankState, String> {
        let state = self.get(rank).ok_or_else(|| {
            format!(
                "the resume state has {} ranks but this is world rank {rank}; reshard the \
                 checkpoint for this layout",
                self.len()
            )
        })?;
        if self.iter().any(|s| s.step != state.step) || state.stages.len() != stages.len() {
            return Err(format!(
                "rank {rank}: the resume state is inconsistent (steps {:?}, {} stages for {} \
                 held here)",
                self.iter().map(|s| s.step).collect::<Vec<_>>(),
                state.stages.len(),
                stages.len()
            ));
        }
        Ok(state.clone())
    }
}

/// No saved state: a fresh run.
static FRESH: Vec<RankState> = Vec::new();

/// How a run starts and when it saves.
#[derive(Clone, Copy)]
pub struct Checkpointing<'a> {
    /// Where every rank's state to start from comes from ([`ResumeSource`]); a fresh run has
    /// none (the empty `Vec`, the default). Training continues with the step after its
    /// [`ResumeSource::step`].
    pub resume: &'a dyn ResumeSource,
    /// Save after every step that is a multiple of this (0: never in between).
    pub every: usize,
    /// Save after the last step.
    pub at_end: bool,
    /// Where to save; without one nothing is saved.
    pub sink: Option<&'a dyn CheckpointSink>,
}

impl Default for Checkpointing<'_> {
    fn default() -> Self {
        Checkpointing {
            resume: &FRESH,
            every: 0,
            at_end: false,
            sink: None,
        }
    }
}

impl std::fmt::Debug for Checkpointing<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointing")
            .field("resume_step", &self.resume.step())
            .field("every", &self.every)
            .field("at_end", &self.at_end)
            .field("sink", &self.sink.is_some())
            .finish()
    }
}

impl Checkpointing<'_> {
    /// The step training continues after (0 for a fresh run).
    pub fn start_step(&self) -> usize {
        self.resume.step()
    }

    /// Whether a checkpoint is due after `step` of a run of `steps` steps.
    pub fn due(&self, step: usize, steps: usize) -> bool {
        self.sink.is_some()
            && ((self.every > 0 && step % self.every == 0) || (self.at_end && step == steps))
    }
}

/// Put the saved states of this rank's stages in place of the fresh ones, asking `resume`
/// for exactly this rank's stages.
pub(super) fn restore_rank<B, S>(
    rank: usize,
    local: &mut [LocalStage<B, S>],
    resume: &dyn ResumeSource,
    threads: bool,
) -> Result<Option<ScalerState>, EngineError>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
{
    let held: Vec<(usize, ShardLayout)> = local.iter().map(|s| (s.index, s.layout)).collect();
    let state = resume.rank_state(rank, &held).map_err(|e| {
        EngineError::Checkpoint(format!("rank {rank} could not read its saved state: {e}"))
    })?;
    if state.stages.len() != local.len() {
        return Err(EngineError::Config(format!(
            "rank {rank}: the resume state has {} stages for {} held here; reshard the \
             checkpoint for this layout",
            state.stages.len(),
            local.len()
        )));
    }
    let _turn = crate::model::autodiff::serial_autodiff(threads);
    for (stage, saved) in local.iter_mut().zip(&state.stages) {
        stage.restore(saved)?;
    }
    Ok(state.scaler)
}

/// Hand this rank's state after `step` to the sink, agree with every rank that all writes
/// succeeded, then let world rank 0 commit. A rank whose write fails returns its error at
/// once; the runner aborts the world with it, so every other rank (waiting in the
/// agreement) stops naming that rank and its file instead of waiting.
pub(super) fn save_rank<B, S, C>(
    comm: &C,
    exec: &RankExecutor<'_, B, S, C>,
    step: usize,
    checkpointing: Checkpointing<'_>,
) -> Result<(), EngineError>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<B::InnerBackend>,
{
    let Some(sink) = checkpointing.sink else {
        return Ok(());
    };
    let rank = comm.rank();
    let written = exec
        .stages
        .iter()
        .map(LocalStage::snapshot)
        .collect::<Result<Vec<_>, _>>()
        .and_then(|stages| {
            sink.write_rank(
                rank,
                &RankState {
                    step,
                    stages,
                    scaler: exec.scaler_state(),
                },
            )
            .map_err(EngineError::Checkpoint)
        });
    // A rank that failed stops at once: its error (naming it and the file) aborts the world,
    // so every other rank, waiting in the agreement below, fails naming it too.
    if let Err(e) = written {
        return Err(EngineError::Checkpoint(format!(
            "rank {rank} failed to write its part of the step-{step} checkpoint: {e}; the \
             previous checkpoint is untouched"
        )));
    }
    world_barrier::<B, C>(comm)?;
    // Only now, with every rank's files durably written, does rank 0 write the manifest.
    if rank == 0 {
        sink.commit(step).map_err(|e| {
            EngineError::Checkpoint(format!(
                "rank 0 failed to complete the step-{step} checkpoint: {e}"
            ))
        })?;
    }
    // No rank goes on (or exits) before the checkpoint is complete.
    world_barrier::<B, C>(comm)
}

/// Wait for every world rank: a barrier of the pipeline group, then of the data-parallel
/// group (each rank passes the second only once all its data-parallel peers passed the
/// first, which needed all of theirs).
fn world_barrier<B, C>(comm: &C) -> Result<(), EngineError>
where
    B: AutodiffBackend,
    C: Communicator<B::InnerBackend>,
{
    comm.barrier(Group::Pipeline)?;
    comm.barrier(Group::DataParallel)?;
    Ok(())
}
