//! The training engine: pipelined, sharded data-parallel training of any [`PipelineModel`].
//!
//! [`Trainer`] is the entry point: `Trainer::new(config).fit(model, data)` with a
//! [`TrainConfig`] and a [`DataSource`]. Every rank runs the same interpreter over its
//! lowered action list (see [`crate::schedule`]): the schedule decides the order, the engine
//! only carries it out. A rank holds its stages' modules, the shard of each stage's flat
//! parameters it owns, and the AdamW state of that shard; gradients are reduced over the
//! data-parallel group where the list says `REDUCE_GRAD`, and the update runs on the owned
//! shards after the list ends.

mod config;
mod data;
mod error;
mod executor;
mod master;
mod multiprocess;
mod nonfinite;
mod precision;
mod profile;
mod rank;
mod shapes;
mod shard;
mod snapshot;
mod stage;
mod summary;
mod thread_world;
mod timeline;
mod trainer;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use config::{LrConfig, TrainConfig};
pub use data::{infallible, DataSource, DataSourceError, Infallible};
pub use error::EngineError;
pub use nonfinite::{NonFinitePolicy, NonFiniteReport, SeenOn};
pub use precision::{LossScaling, Precision, ScalerState};
pub use profile::{collective_share, StepProfile};
pub use shard::ShardLayout;
pub use shard::StageState;
pub use snapshot::{CheckpointSink, Checkpointing, RankState, ResumeSource};
pub use trainer::{ProcessWorld, ThreadComms, Threads, ThreadsOn, Trainer};

pub use timeline::DEFAULT_TIMELINE_STEPS;

use crate::comm::{CommBytes, CommConfig};
use crate::model::ModelSplit;
use crate::optim::AdamWSettings;
use crate::schedule::{
    from_csv, with_file_lines, PipelineSchedule, Placement, Program, ProgramSpec, ScheduleKind,
    ScheduleSpec, TimedEvent, ZeroLevel,
};

/// What one rank's step cost besides its compute: the host synchronisations it made and the
/// bytes it sent. A [`TrainOutcome`] reports every rank's for the last step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCounts {
    /// Synchronising device-to-host reads of the engine and the optimizer in the step (the
    /// step's losses, gradient norm and non-finite flags are read together, once): a fixed
    /// number per step, independent of the micro-batch count.
    pub host_reads: u64,
    /// Device-to-host reads that were the payload of a host transport (a CPU rank's send or
    /// its part of a host collective), counted apart.
    pub host_transfer_reads: u64,
    /// Payload bytes the rank's action list sent (`SEND_*`, `UNSHARD`, `REDUCE_GRAD`; the
    /// step's control reduction of a few floats is not included), elements × the size of the
    /// dtype carried.
    pub comm_bytes: CommBytes,
}

/// A fault to inject, for testing that failures stop every rank (`BFPP_FAULT_INJECT`). Only
/// with the test-only feature `fault-injection`.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// World rank that fails.
    pub rank: usize,
    /// Optimizer step (1-based) at whose start it fails.
    pub step: usize,
    /// What goes wrong.
    pub kind: FaultKind,
}

/// What an injected [`Fault`] does to its rank.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Return [`EngineError::InjectedFault`] at the start of the step.
    Error,
    /// Panic at the start of the step.
    Panic,
    /// Make the rank's losses (if it holds the last stage) and its gradients NaN in that step,
    /// as a diverging or overflowing step would: exercises the [`NonFinitePolicy`].
    NonFinite,
    /// Sleep this long at the start of the step, then carry on: a rank slower than the
    /// communication timeout, which its peers must name when they give up.
    Sleep(Duration),
    /// End the whole process at once (`std::process::abort`), as a crash or a killed rank
    /// would: nothing is reported, so its peers (or its launcher) must notice.
    Abort,
}

/// The engine's flat view of a [`TrainConfig`], checked, with the learning rate of every step
/// computed and the fault to inject (tests, feature `fault-injection`).
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    /// Optimizer steps of the run (counting those before a resume).
    pub steps: usize,
    /// The last step to run now, when it is before `steps` ([`Trainer::stop_after`]).
    pub stop_after: Option<usize>,
    /// Pipeline ranks P.
    pub pp: usize,
    /// Stages per pipeline rank V.
    pub loops: usize,
    /// Data-parallel replicas D.
    pub dp: usize,
    /// Micro-batches per step and replica M.
    pub microbatches: usize,
    /// Breadth-first micro-batches K (hybrid schedule), breadth-first only.
    pub bf_microbatches: Option<usize>,
    /// Schedule family.
    pub schedule: ScheduleKind,
    /// Stage placement.
    pub placement: Placement,
    /// A schedule file to run instead of the generated schedule.
    pub schedule_file: Option<std::path::PathBuf>,
    /// ZeRO level.
    pub zero: ZeroLevel,
    /// Rotating full-size weight and gradient buffers per rank (ZeRO-2/3).
    pub buffers: usize,
    /// Keep only each stage's input and recompute its forward inside the backward.
    pub recompute: bool,
    /// How layers are divided into stages.
    pub split: ModelSplit,
    /// AdamW hyper-parameters (the learning rate comes from `lr`).
    pub adamw: AdamWSettings,
    /// Learning rate of step `s` (1-based) at index `s − 1`.
    pub lr: Vec<f64>,
    /// Global gradient-norm clipping threshold; 0 disables clipping.
    pub max_grad_norm: f64,
    /// Timeout of every blocking communication.
    pub comm_timeout: Duration,
    /// Whether data-parallel collectives overlap compute: each `UNSHARD` and `REDUCE_GRAD`
    /// returns once this rank's part is posted and is waited for only where its result is
    /// needed ([`crate::comm::pending`]). Results are bitwise the same; off is the baseline
    /// that waits where each collective starts.
    pub overlap_collectives: bool,
    /// What a step with a NaN or infinite loss or gradient norm does: stop or skip.
    pub on_nonfinite: NonFinitePolicy,
    /// The dtype the stages compute in; master weights, AdamW state and reductions stay
    /// fp32 (see [`Precision`]).
    pub precision: Precision,
    /// Dynamic loss scaling, used with [`Precision::F16`] only.
    pub loss_scaling: LossScaling,
    /// A fault to inject (tests).
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
}

impl EngineConfig {
    /// The communicator settings of this run's ranks.
    pub(crate) fn comm_config(&self) -> CommConfig {
        CommConfig {
            overlap_collectives: self.overlap_collectives,
            ..CommConfig::with_timeout(self.comm_timeout)
        }
    }

    /// The schedule this configuration asks for.
    pub(crate) fn spec(&self) -> ScheduleSpec {
        ScheduleSpec {
            kind: self.schedule,
            pp: self.pp,
            loops: self.loops,
            microbatches: self.microbatches,
            bf_microbatches: self.bf_microbatches,
            placement: self.placement,
        }
    }

    /// Generate, lower and validate the per-rank programs.
    pub(crate) fn program(&self) -> Result<PipelineSchedule, EngineError> {
        if self.dp == 0 {
            return Err(EngineError::Config(
                "dp must be at least 1 (data-parallel replicas); try --dp 1".into(),
            ));
        }
        if self.precision.scales_loss() {
            self.loss_scaling.validate()?;
        }
        let program = match &self.schedule_file {
            Some(path) => Program::lower(self.schedule_from_file(path)?, self.zero, self.buffers)
                .map_err(|e| {
                let e = with_file_lines(&e.to_string());
                EngineError::Config(format!("{}: {e}", path.display()))
            })?,
            None => ProgramSpec::new(self.spec(), self.zero)
                .with_buffers(self.buffers)
                .compile()?,
        };
        Ok(program.lowered)
    }

    /// The compute order of a schedule file, refused unless its layout is this run's.
    fn schedule_from_file(&self, path: &std::path::Path) -> Result<PipelineSchedule, EngineError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            EngineError::Config(format!(
                "cannot read the schedule file {}: {e}",
                path.display()
            ))
        })?;
        let order =
            from_csv(&text).map_err(|e| EngineError::Config(format!("{}: {e}", path.display())))?;
        let (pp, m) = (order.num_ranks(), order.microbatches);
        let loops = order.stages_per_rank().ok_or_else(|| {
            EngineError::Config(format!(
                "{} places {} stages on {pp} ranks; the engine needs the same number of \
                 stages on every rank",
                path.display(),
                order.num_stages()
            ))
        })?;
        for (name, here, file) in [
            ("pp", self.pp, pp),
            ("loops", self.loops, loops),
            ("microbatches", self.microbatches, m),
        ] {
            if here != file {
                return Err(EngineError::Config(format!(
                    "{} runs pp={pp}, loops={loops}, microbatches={m}, but the configuration \
                     has {name} = {here}: set pp, loops and microbatches to the file's (the \
                     command line takes them from the file)",
                    path.display()
                )));
            }
        }
        Ok(order)
    }
}

/// Progress of a run after one optimizer step, reported by the rank that holds the last
/// stage in data-parallel replica 0 (the rank that knows the loss).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Optimizer step just finished (1-based).
    pub step: usize,
    /// Its mean loss over the global batch.
    pub loss: f64,
    /// Its learning rate.
    pub lr: f64,
    /// Seconds since the run started.
    pub elapsed: f64,
    /// Whether the optimizer update of this step was skipped because its loss or gradient
    /// norm was not finite ([`NonFinitePolicy::Skip`]) or, in f16, its gradients overflowed
    /// the loss scale.
    pub skipped: bool,
}

/// What a run produced.
#[derive(Debug)]
pub struct TrainOutcome<M> {
    /// Mean loss of every optimizer step (over all micro-batches of all replicas).
    pub losses: Vec<f64>,
    /// The trained model: for [`Trainer::fit`], the model given, with its trained weights
    /// (the stages of data-parallel replica 0 put back together); for
    /// [`Trainer::fit_described`], the [`TrainedStages`].
    pub model: M,
    /// Every rank's actions of the last steps the run kept ([`Trainer::timeline_steps`]), by
    /// world rank, on one clock: seconds since the run started.
    pub timelines: Vec<Vec<TimedEvent>>,
    /// Seconds of every step: from the end of the step before on any rank (the start for the
    /// first) to the end of its own last action on any rank. A step's optimizer update falls
    /// into the next step's time.
    pub step_times: Vec<f64>,
    /// Each world rank's share of its action time, over the whole run, that went to its
    /// data-parallel collectives (see [`collective_share`]).
    pub collective_share: Vec<f64>,
    /// Highest bytes of parameter values each world rank held.
    pub peak_param_bytes: Vec<usize>,
    /// Each world rank's process's peak resident memory as the operating system reports it
    /// (`VmHWM`), read after the run: ranks that are threads of one process report the same
    /// figure. `None` where the system does not say (not Linux).
    pub peak_rss_bytes: Vec<Option<u64>>,
    /// The L2 norm of the trained parameters (fp32 master weights, over the whole model).
    pub param_norm: f64,
    /// Wall-clock time of the training steps.
    pub elapsed: Duration,
    /// Steps (1-based) whose update was skipped because their loss or gradient norm was not
    /// finite ([`NonFinitePolicy::Skip`]); their entry in `losses` may be NaN.
    pub skipped_steps: Vec<usize>,
    /// The loss scale after the last step (1 unless [`Precision::F16`]).
    pub loss_scale: f64,
    /// Every world rank's host reads and bytes sent in the last step.
    pub last_step: Vec<StepCounts>,
}

impl<M> TrainOutcome<M> {
    /// The same outcome with `f` applied to its model.
    pub(crate) fn try_map_model<N, E>(
        self,
        f: impl FnOnce(M) -> Result<N, E>,
    ) -> Result<TrainOutcome<N>, E> {
        Ok(TrainOutcome {
            losses: self.losses,
            model: f(self.model)?,
            timelines: self.timelines,
            step_times: self.step_times,
            collective_share: self.collective_share,
            peak_param_bytes: self.peak_param_bytes,
            peak_rss_bytes: self.peak_rss_bytes,
            param_norm: self.param_norm,
            elapsed: self.elapsed,
            skipped_steps: self.skipped_steps,
            loss_scale: self.loss_scale,
            last_step: self.last_step,
        })
    }
}

/// The trained stages of a [`Trainer::fit_described`] run, in stage order: every stage of
/// data-parallel replica 0 (fp32 master weights) when the ranks are threads of this process.
/// With ranks as processes the trained weights stay on their ranks, where a checkpoint
/// ([`Checkpointing`]) saves them, and this is empty: no process gathers a model that may be
/// larger than it can hold.
#[derive(Debug)]
pub struct TrainedStages<S> {
    /// The stages, by global stage index.
    pub stages: Vec<S>,
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), where the system
/// reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
