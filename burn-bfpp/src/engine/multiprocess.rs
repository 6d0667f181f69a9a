//! Training with one rank per process over a [`ProcessRank`] communicator (MPI for CPU ranks,
//! NCCL over the TCP control channel for GPU ranks): this process runs its own rank with
//! [`train_rank`], then the results are gathered to world rank 0, which assembles the same
//! [`TrainOutcome`] as the thread ranks of [`super::Trainer::fit`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

use burn::module::Module;

use super::data::DataSource;
use super::rank::{build_rank_stages, train_rank_with, RankPlan};
use super::snapshot::Checkpointing;
use super::timeline::step_times;
use super::{peak_rss_bytes, EngineConfig, EngineError, StepCounts, StepReport, TrainOutcome};
use crate::comm::{CommError, Group, ProcessRank};
use crate::model::{flatten_params, load_flat, recombine, ModelDescription};
use crate::schedule::TimedEvent;
use crate::schedule::{Action, PipelineSchedule};

/// Point-to-point tags of the gathered stage parameters (`PARAM_TAG + stage`): far above the
/// tags the executor uses for activations and gradients.
const PARAM_TAG: u64 = 1 << 62;
/// The byte stream of the per-rank reports.
const REPORT_TAG: u64 = 1;

/// What every rank sends to rank 0 after training. Floats travel as bits so they arrive
/// exactly.
#[derive(Debug, Serialize, Deserialize)]
struct RankReport {
    losses: Vec<Option<u64>>,
    /// `(step, start bits, end bits, action, opens an overlapped pair)`: the action's text
    /// does not carry the pair mark.
    events: Vec<(usize, u64, u64, String, bool)>,
    /// The end of every step, as bits, on the rank's own clock.
    step_ends: Vec<u64>,
    /// The share of the rank's action time in data-parallel collectives.
    collective_share: f64,
    peak_param_bytes: usize,
    /// The process's peak resident memory after the run.
    peak_rss_bytes: Option<u64>,
    /// See [`super::executor::Finished::param_sq`].
    param_sq: f64,
    /// The rank's time zero on the system clock, nanoseconds since the Unix epoch: rank 0
    /// moves every rank's events onto its own time zero with it.
    epoch_unix_ns: u64,
    /// Host reads and bytes sent in the last step.
    last_step: StepCounts,
}

/// Now on the system clock, nanoseconds since the Unix epoch (0 on a clock set before it).
fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn comm_err(e: CommError) -> EngineError {
    EngineError::Comm(e)
}

/// Trains this process's rank of a world of processes (the body of [`super::Trainer::fit`]
/// for a process world); returns the outcome on world rank 0 and `None` on the others.
///
/// Every process must call this with the same `model` description and configuration: each
/// builds its own stages from it, so no weights are sent at start-up. With `whole` (a model
/// every process holds), rank 0 receives the trained stages of replica 0 and returns them
/// put back into a copy of it; without, the trained weights stay on their ranks.
/// Timelines are measured from an instant every rank takes right after a world barrier.
/// If this rank fails or panics, every other rank is told and fails naming it. With
/// checkpointing, every process passes the same `checkpointing`: `resume` holds the state of
/// every world rank (this process restores its own), and the sink must write into a
/// directory all processes share. Each process writes its own rank's files; world rank 0
/// commits (writes the manifest, prunes) only after every rank reported its files durably
/// written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_processes<B, M, W, C, D>(
    comm: &C,
    model: &M,
    whole: Option<&W>,
    cfg: &EngineConfig,
    program: PipelineSchedule,
    data: &D,
    on_step: &(dyn Fn(&StepReport) + Sync),
    checkpointing: Checkpointing<'_>,
    timeline_steps: usize,
) -> Result<Option<TrainOutcome<Option<W>>>, EngineError>
where
    B: AutodiffBackend,
    M: ModelDescription<B>,
    W: Module<B> + Clone,
    C: ProcessRank<B::InnerBackend>,
    D: DataSource<B>,
{
    let result = catch_unwind(AssertUnwindSafe(|| {
        run(
            comm,
            model,
            whole,
            cfg,
            program,
            data,
            on_step,
            checkpointing,
            timeline_steps,
        )
    }));
    let rank = comm.rank();
    let result = match result {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(EngineError::RankFailure(format!(
                "rank {rank} panicked: {msg}"
            )))
        }
    };
    if let Err(e) = &result {
        // A communication error has already told the others; anything else (an injected
        // fault, a model error, a panic) is told here. Only the first abort counts.
        comm.abort(&e.to_string());
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn run<B, M, W, C, D>(
    comm: &C,
    model: &M,
    whole: Option<&W>,
    cfg: &EngineConfig,
    program: PipelineSchedule,
    data: &D,
    on_step: &(dyn Fn(&StepReport) + Sync),
    checkpointing: Checkpointing<'_>,
    timeline_steps: usize,
) -> Result<Option<TrainOutcome<Option<W>>>, EngineError>
where
    B: AutodiffBackend,
    M: ModelDescription<B>,
    W: Module<B> + Clone,
    C: ProcessRank<B::InnerBackend>,
    D: DataSource<B>,
{
    let grid = comm.grid();
    let rank = comm.rank();
    let stages = build_rank_stages(model, cfg, &program, grid.pp_index(rank), comm.device())?;
    // A world barrier (pipeline, then data-parallel) so that the ranks start together. Their
    // time zeros still differ by the barrier's latency; the system clock, read together with
    // the monotonic one, lets rank 0 put every timeline on one axis (exactly on one machine,
    // to the clocks' synchronisation across machines).
    comm.barrier(Group::Pipeline).map_err(comm_err)?;
    comm.barrier(Group::DataParallel).map_err(comm_err)?;
    let epoch = Instant::now();
    let epoch_unix_ns = unix_ns();
    let plan = RankPlan {
        cfg,
        program: &program,
        epoch,
        timeline_steps,
        hand_back: whole.is_some(),
        threads: false,
    };
    let outcome = train_rank_with(comm, &plan, stages, data, on_step, checkpointing)?;
    let elapsed = epoch.elapsed();
    // Every rank took the same skip decisions (they follow a world-wide reduction).
    let skipped_steps = outcome.skipped_steps.clone();
    let loss_scale = outcome.loss_scale;

    let report = RankReport {
        losses: outcome.losses.iter().map(|l| l.map(f64::to_bits)).collect(),
        events: outcome
            .events
            .iter()
            .map(|e| {
                (
                    e.step,
                    e.start.to_bits(),
                    e.end.to_bits(),
                    e.action.to_string(),
                    e.action.overlaps_next,
                )
            })
            .collect(),
        step_ends: outcome.step_ends.iter().map(|e| e.to_bits()).collect(),
        collective_share: outcome.collective_share,
        peak_param_bytes: outcome.peak_param_bytes,
        peak_rss_bytes: peak_rss_bytes(),
        param_sq: outcome.param_sq,
        epoch_unix_ns,
        last_step: outcome.last_step,
    };
    let bytes = serde_json::to_vec(&report)
        .map_err(|e| EngineError::RankFailure(format!("rank {rank}: report: {e}")))?;
    if whole.is_some() && grid.dp_index(rank) == 0 && rank != 0 {
        for (s, module) in &outcome.stages {
            // The trained stages are handed back in fp32, whatever the compute dtype.
            let flat = flatten_params(module).inner();
            let flat = if flat.dtype() == DType::F32 {
                flat
            } else {
                flat.cast(DType::F32)
            };
            comm.send(0, PARAM_TAG + *s as u64, flat)
                .map_err(comm_err)?;
        }
    }
    if rank != 0 {
        comm.send_bytes(0, REPORT_TAG, bytes).map_err(comm_err)?;
        return Ok(None);
    }

    // World rank 0: every rank's report, folded in one at a time, and the trained stages of
    // replica 0 when the model is assembled.
    let last_pp = program.stage_ranks[program.num_stages() - 1];
    let mut fold = ReportFold::new(grid.rank_of(last_pp, 0), epoch_unix_ns);
    fold.add(0, report)?;
    for peer in 1..grid.world_size() {
        let bytes = comm.recv_bytes(peer, REPORT_TAG).map_err(comm_err)?;
        let r: RankReport = serde_json::from_slice(&bytes).map_err(|e| {
            EngineError::RankFailure(format!("rank 0: report of rank {peer} is malformed: {e}"))
        })?;
        fold.add(peer, r)?;
    }
    let model = match whole {
        Some(whole) => Some(assemble(comm, model, whole, cfg, &program, outcome.stages)?),
        None => None,
    };
    Ok(Some(TrainOutcome {
        losses: fold.losses,
        model,
        timelines: fold.timelines,
        step_times: step_times(&[fold.step_ends]),
        collective_share: fold.collective_share,
        peak_param_bytes: fold.peak_param_bytes,
        peak_rss_bytes: fold.peak_rss_bytes,
        param_norm: fold.param_sq.sqrt(),
        elapsed,
        skipped_steps,
        loss_scale,
        last_step: fold.last_step,
    }))
}

/// The ranks' reports as rank 0 folds them in, in world-rank order: each report is dropped
/// once folded, so rank 0 never holds every rank's step times at once.
struct ReportFold {
    /// The rank whose losses are the run's (the last stage's, replica 0).
    loss_rank: usize,
    /// Rank 0's time zero on the system clock.
    epoch_unix_ns: u64,
    losses: Vec<f64>,
    timelines: Vec<Vec<TimedEvent>>,
    /// The latest end of every step on any rank so far, on rank 0's clock.
    step_ends: Vec<f64>,
    collective_share: Vec<f64>,
    peak_param_bytes: Vec<usize>,
    peak_rss_bytes: Vec<Option<u64>>,
    param_sq: f64,
    last_step: Vec<StepCounts>,
}

impl ReportFold {
    fn new(loss_rank: usize, epoch_unix_ns: u64) -> Self {
        ReportFold {
            loss_rank,
            epoch_unix_ns,
            losses: Vec::new(),
            timelines: Vec::new(),
            step_ends: Vec::new(),
            collective_share: Vec::new(),
            peak_param_bytes: Vec::new(),
            peak_rss_bytes: Vec::new(),
            param_sq: 0.0,
            last_step: Vec::new(),
        }
    }

    fn add(&mut self, peer: usize, r: RankReport) -> Result<(), EngineError> {
        if peer == self.loss_rank {
            self.losses = r
                .losses
                .iter()
                .map(|l| l.map(f64::from_bits).unwrap_or(f64::NAN))
                .collect();
        }
        // Seconds from rank 0's time zero to this rank's.
        let shift = (r.epoch_unix_ns as f64 - self.epoch_unix_ns as f64) * 1e-9;
        let events = r
            .events
            .into_iter()
            .map(|(step, start, end, action, opens_pair)| {
                let mut action: Action = action.parse().map_err(|e| {
                    EngineError::RankFailure(format!(
                        "rank 0: action `{action}` of rank {peer} does not parse: {e}"
                    ))
                })?;
                action.overlaps_next = opens_pair;
                Ok(TimedEvent {
                    step,
                    action,
                    start: f64::from_bits(start) + shift,
                    end: f64::from_bits(end) + shift,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        self.timelines.push(events);
        if self.step_ends.len() < r.step_ends.len() {
            self.step_ends.resize(r.step_ends.len(), 0.0);
        }
        for (end, bits) in self.step_ends.iter_mut().zip(r.step_ends) {
            *end = end.max(f64::from_bits(bits) + shift);
        }
        self.collective_share.push(r.collective_share);
        self.peak_param_bytes.push(r.peak_param_bytes);
        self.peak_rss_bytes.push(r.peak_rss_bytes);
        self.param_sq += r.param_sq;
        self.last_step.push(r.last_step);
        Ok(())
    }
}

/// Rank 0's part of assembling the trained model: its own stages of replica 0 and those the
/// other ranks of replica 0 send, loaded into stage templates cut from `whole` and put back
/// into a copy of it.
fn assemble<B, M, W, C>(
    comm: &C,
    model: &M,
    whole: &W,
    cfg: &EngineConfig,
    program: &PipelineSchedule,
    own_stages: Vec<(usize, M::Stage)>,
) -> Result<W, EngineError>
where
    B: AutodiffBackend,
    M: ModelDescription<B>,
    W: Module<B> + Clone,
    C: ProcessRank<B::InnerBackend>,
{
    let grid = comm.grid();
    let mut own: Vec<Option<M::Stage>> = Vec::new();
    for (s, module) in own_stages {
        if own.len() <= s {
            own.resize_with(s + 1, || None);
        }
        own[s] = Some(module);
    }
    let device = comm.device().clone();
    let mut stages: Vec<(usize, M::Stage)> = Vec::new();
    for p in 0..grid.pp() {
        // Templates of the stage layout (only their shapes and ids are used).
        for (s, template) in build_rank_stages(model, cfg, program, p, &device)? {
            if p == 0 {
                if let Some(m) = own.get_mut(s).and_then(Option::take) {
                    stages.push((s, m));
                    continue;
                }
            }
            let numel: usize = crate::model::param_shapes(&template)
                .iter()
                .map(|shape| shape.iter().product::<usize>())
                .sum();
            let peer = grid.rank_of(p, 0);
            let flat = comm
                .recv(peer, PARAM_TAG + s as u64, [numel], DType::F32)
                .map_err(comm_err)?;
            let module = load_flat(template, &Tensor::from_inner(flat))?;
            stages.push((s, module));
        }
    }
    stages.sort_by_key(|(s, _)| *s);
    let stages: Vec<M::Stage> = stages.into_iter().map(|(_, s)| s).collect();
    Ok(recombine(whole.clone(), &stages)?)
}
