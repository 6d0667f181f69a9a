//! One rank's share of a run, independent of how ranks are started: threads of one process
//! ([`super::Trainer::fit`]) or one process per rank over any other [`Communicator`].

use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};

use super::data::DataSource;
use super::executor::{ExecutorSettings, RankExecutor};
use super::shapes::{find_shapes, BatchShapes};
use super::snapshot::{restore_rank, save_rank, Checkpointing};
use super::stage::LocalStage;
use super::timeline::Recorder;
#[cfg(feature = "fault-injection")]
use super::FaultKind;
use super::{EngineConfig, EngineError, StepCounts, StepReport};
use crate::comm::{Communicator, Group};
use crate::model::autodiff::serial_autodiff;
use crate::model::{module_to_device, split_described, ModelDescription, PipelineStage};
use crate::schedule::PipelineSchedule;
use crate::schedule::TimedEvent;

/// What every rank of a run shares besides its communicator, stages and data.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankPlan<'a> {
    /// Layout and optimization settings (the same on every rank).
    pub(crate) cfg: &'a EngineConfig,
    /// The lowered per-rank programs, from [`EngineConfig::program`].
    pub(crate) program: &'a PipelineSchedule,
    /// Time zero of the recorded timeline.
    pub(crate) epoch: Instant,
    /// Steps whose actions the timeline keeps (the last ones).
    pub(crate) timeline_steps: usize,
    /// Whether the rank hands its trained stages back (gathered, fp32) at the end.
    pub(crate) hand_back: bool,
    /// Whether the ranks are several threads of this process (see
    /// [`crate::model::autodiff::serial_autodiff`]).
    pub(crate) threads: bool,
}

/// What one rank produced.
#[derive(Debug)]
pub(crate) struct RankOutcome<S> {
    /// The step's mean loss over the global batch, on ranks that hold the last stage.
    pub(crate) losses: Vec<Option<f64>>,
    /// The rank's stages, by global index, with their final (gathered) weights; empty
    /// without [`RankPlan::hand_back`].
    pub(crate) stages: Vec<(usize, S)>,
    /// The actions of the last steps the timeline keeps.
    pub(crate) events: Vec<TimedEvent>,
    /// The end of every step's last action, seconds since the epoch.
    pub(crate) step_ends: Vec<f64>,
    /// The share of the rank's action time in data-parallel collectives.
    pub(crate) collective_share: f64,
    /// Highest bytes of parameter values the rank held.
    pub(crate) peak_param_bytes: usize,
    /// The sum of squares of the final parameters this rank keeps (see
    /// [`super::executor::Finished::param_sq`]).
    pub(crate) param_sq: f64,
    /// Steps whose update was skipped (non-finite loss or gradient norm); the same on every
    /// rank.
    pub(crate) skipped_steps: Vec<usize>,
    /// The loss scale after the last step (1 unless f16); the same on every rank.
    pub(crate) loss_scale: f64,
    /// The rank's host reads and bytes sent in its last step.
    pub(crate) last_step: StepCounts,
}

/// Builds the stages pipeline rank `pp_index` holds under `program` on `device`, and only
/// those: the model is never built whole.
pub(crate) fn build_rank_stages<B, M>(
    model: &M,
    cfg: &EngineConfig,
    program: &PipelineSchedule,
    pp_index: usize,
    device: &B::Device,
) -> Result<Vec<(usize, M::Stage)>, EngineError>
where
    B: Backend,
    M: ModelDescription<B>,
{
    let ranges = split_described(model, program.num_stages(), &cfg.split)?;
    ranges
        .into_iter()
        .enumerate()
        .filter(|&(s, _)| program.stage_ranks[s] == pp_index)
        .map(|(s, layers)| Ok((s, model.build_stage(layers, device)?)))
        .collect()
}

/// Runs this rank's program over `comm` from `checkpointing.start_step() + 1` to the run's
/// last step, so the learning rate and the data continue where a saved run stopped; the
/// returned losses are those of the steps that ran. `stages` are the rank's stages (see
/// [`build_rank_stages`]); the rank first learns the run's shapes from them
/// ([`find_shapes`]). `on_step` is called on the rank that holds the last stage in replica 0
/// after every step.
pub(crate) fn train_rank_with<B, S, C, D>(
    comm: &C,
    plan: &RankPlan<'_>,
    stages: Vec<(usize, S)>,
    data: &D,
    on_step: &(dyn Fn(&StepReport) + Sync),
    checkpointing: Checkpointing<'_>,
) -> Result<RankOutcome<S>, EngineError>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<B::InnerBackend>,
    D: DataSource<B>,
{
    let cfg = plan.cfg;
    let rank = comm.rank();
    let grid = comm.grid();
    if grid.pp() != cfg.pp || grid.dp() != cfg.dp {
        return Err(EngineError::Config(format!(
            "rank {rank}: the communicator's grid is pp={} dp={} but the configuration says \
             pp={} dp={}; start pp × dp ranks",
            grid.pp(),
            grid.dp(),
            cfg.pp,
            cfg.dp
        )));
    }
    // A dtype the backend cannot compute in is refused before any work, on every rank alike.
    cfg.precision
        .require(std::any::type_name::<B::InnerBackend>(), |dtype| {
            <B::InnerBackend as Backend>::supports_dtype(comm.device(), dtype)
        })?;
    let dp_index = comm.group_rank(Group::DataParallel);
    let pp_index = comm.group_rank(Group::Pipeline);
    // The rank computes on its communicator's device (received tensors arrive there); stages
    // built elsewhere move first, as leaves with their own autodiff graph.
    let device = comm.device().clone();
    let turn = serial_autodiff(plan.threads);
    let stages: Vec<(usize, S)> = stages
        .into_iter()
        .map(|(s, module)| (s, module_to_device(module, &device)))
        .collect();
    drop(turn);
    let start = checkpointing.start_step();
    let shapes = find_shapes(comm, plan.program, &stages, data, start + 1, plan.threads)?;
    let turn = serial_autodiff(plan.threads);
    let mut local: Vec<_> = stages
        .into_iter()
        .map(|(s, module)| {
            LocalStage::new(
                s,
                module,
                cfg.dp,
                dp_index,
                cfg.zero,
                &cfg.adamw,
                cfg.precision.dtype(),
            )
        })
        .collect::<Result<_, _>>()?;
    drop(turn);
    let mut saved_scaler = None;
    if start > 0 {
        // Each rank reads its own files first; the refill takes its turn.
        saved_scaler = restore_rank(rank, &mut local, checkpointing.resume, plan.threads)?;
    }
    let settings = ExecutorSettings {
        zero: cfg.zero,
        recompute: cfg.recompute,
        microbatches: cfg.microbatches,
        num_stages: plan.program.num_stages(),
        stage_ranks: plan.program.stage_ranks.clone(),
        activation_shapes: shapes.activations.clone(),
        max_grad_norm: cfg.max_grad_norm,
        on_nonfinite: cfg.on_nonfinite,
        precision: cfg.precision,
        loss_scaling: cfg.loss_scaling,
        target_classes: shapes.target_classes,
        threads: plan.threads,
    };
    let list = plan.program.ranks[pp_index].clone();
    let recorder = Recorder::new(plan.timeline_steps, start);
    let mut exec = RankExecutor::new(comm, settings, list, local, plan.epoch, recorder);
    let batch_shapes = BatchShapes::default();
    if let Some(scaler) = saved_scaler {
        exec.restore_scaler(scaler);
    }
    // The run's length shapes the learning rate; a stop before its end only ends this call.
    let steps = cfg.stop_after.map_or(cfg.steps, |stop| stop.min(cfg.steps));
    let mut losses = Vec::with_capacity(steps.saturating_sub(start));
    let mut skipped_steps = Vec::new();
    let mut last_step = StepCounts::default();
    for step in start + 1..=steps {
        #[cfg(feature = "fault-injection")]
        {
            let fault = cfg.fault.filter(|f| f.rank == rank && f.step == step);
            match fault.map(|f| f.kind) {
                Some(FaultKind::Panic) => panic!("injected panic on rank {rank} at step {step}"),
                Some(FaultKind::Error) => return Err(EngineError::InjectedFault { rank, step }),
                Some(FaultKind::Sleep(pause)) => std::thread::sleep(pause),
                Some(FaultKind::Abort) => {
                    eprintln!("rank {rank}: injected abort at step {step}");
                    std::process::abort()
                }
                Some(FaultKind::NonFinite) | None => {}
            }
            exec.poison = fault.is_some_and(|f| f.kind == FaultKind::NonFinite);
        }
        let lr = cfg.lr.get(step - 1).copied().unwrap_or(0.0);
        let batch = |dp_index: usize, microbatch: usize| {
            let failed = |reason: String| EngineError::Data {
                rank,
                step,
                microbatch,
                reason,
            };
            let batch = data
                .micro_batch(step, dp_index, microbatch)
                .map_err(|e| failed(format!("the data source failed: {e}")))?;
            batch_shapes.check(&batch).map_err(failed)?;
            Ok(batch.to_device(&device))
        };
        let outcome = exec.step(step, lr, &batch)?;
        last_step = outcome.counts;
        if outcome.skipped {
            skipped_steps.push(step);
        }
        if let (Some(loss), 0) = (outcome.loss, dp_index) {
            on_step(&StepReport {
                step,
                loss,
                lr,
                elapsed: plan.epoch.elapsed().as_secs_f64(),
                skipped: outcome.skipped,
            });
        }
        losses.push(outcome.loss);
        if checkpointing.due(step, steps) {
            save_rank(comm, &exec, step, checkpointing)?;
        }
    }
    let loss_scale = exec.loss_scale();
    let finished = exec.finish(plan.hand_back)?;
    // The stages leave this thread (the trained model is assembled by the caller): their last
    // updates may still be queued on this thread's stream, which another thread's reads do
    // not wait for on CubeCL backends.
    B::InnerBackend::sync(comm.device()).map_err(|e| {
        EngineError::RankFailure(format!(
            "rank {rank}: the device failed while finishing the last step's kernels: {e:?}"
        ))
    })?;
    Ok(RankOutcome {
        losses,
        stages: finished.stages,
        events: finished.recorder.events(),
        step_ends: finished.recorder.step_ends().to_vec(),
        collective_share: finished.recorder.collective_share(),
        peak_param_bytes: finished.peak_param_bytes,
        param_sq: finished.param_sq,
        skipped_steps,
        loss_scale,
        last_step,
    })
}
