//! Every rank of a run as a thread of this process ([`super::Trainer::fit`] and its thread
//! worlds): builds each pipeline rank's stages once, hands them to the ranks' threads, runs
//! them and gathers their results into one outcome.

use std::sync::Mutex;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;

use super::data::DataSource;
use super::rank::{build_rank_stages, train_rank_with, RankPlan};
use super::snapshot::Checkpointing;
use super::timeline::step_times;
use super::{peak_rss_bytes, EngineConfig, EngineError, StepReport, TrainOutcome, TrainedStages};
use crate::comm::{run_ranks, CommError, Communicator, RankError, RankGrid, ThreadRank};
use crate::model::ModelDescription;
use crate::schedule::PipelineSchedule;

/// A rank's stages, waiting for its thread to take them.
type RankSlot<S> = Mutex<Option<Vec<(usize, S)>>>;

/// What a run of every rank as a thread of this process gives: the outcome, its model the
/// trained stages (empty without `hand_back`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn train_world<B, M, C, D>(
    model: &M,
    cfg: &EngineConfig,
    program: PipelineSchedule,
    comms: Vec<C>,
    data: &D,
    on_step: &(dyn Fn(&StepReport) + Sync),
    checkpointing: Checkpointing<'_>,
    timeline_steps: usize,
) -> Result<TrainOutcome<TrainedStages<M::Stage>>, EngineError>
where
    B: AutodiffBackend,
    M: ModelDescription<B>,
    M::Stage: Send,
    C: ThreadRank + Communicator<B::InnerBackend>,
    D: DataSource<B>,
{
    let grid = RankGrid::new(cfg.pp, cfg.dp)?;
    if comms.len() != grid.world_size() || comms.iter().any(|c| c.grid() != grid) {
        return Err(EngineError::from(CommError::InvalidGrid {
            pp: cfg.pp,
            dp: cfg.dp,
            reason: format!(
                "{} communicators given for a world of {} ranks, or built for another grid; \
                 create them with the configuration's pp and dp",
                comms.len(),
                grid.world_size()
            ),
        }));
    }
    // Each pipeline rank's stages are built once, on the device of its first replica; the
    // other replicas take copies (each rank moves its own to its device).
    let mut built: Vec<Vec<(usize, M::Stage)>> = (0..cfg.pp)
        .map(|p| {
            let device = comms[grid.rank_of(p, 0)].device().clone();
            build_rank_stages(model, cfg, &program, p, &device)
        })
        .collect::<Result<_, _>>()?;
    let per_rank: Vec<RankSlot<M::Stage>> = (0..grid.world_size())
        .map(|rank| {
            let pp_index = grid.pp_index(rank);
            // The last replica takes the modules themselves, the others copies.
            let local = if grid.dp_index(rank) + 1 == cfg.dp {
                std::mem::take(&mut built[pp_index])
            } else {
                built[pp_index].clone()
            };
            Mutex::new(Some(local))
        })
        .collect();
    crate::model::autodiff::notice_serial_autodiff(grid.world_size());
    let epoch = Instant::now();
    let plan = RankPlan {
        cfg,
        program: &program,
        epoch,
        timeline_steps,
        hand_back: true,
        threads: grid.world_size() > 1,
    };
    let results = run_ranks(comms, |comm| {
        let stages = per_rank[comm.rank()]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .unwrap_or_default();
        train_rank_with(comm, &plan, stages, data, on_step, checkpointing)
    })
    .map_err(|e| match e {
        RankError::Failed { error, .. } => error,
        other => EngineError::RankFailure(other.to_string()),
    })?;
    let elapsed = epoch.elapsed();
    let last_pp = program.stage_ranks[program.num_stages() - 1];
    let losses = results[grid.rank_of(last_pp, 0)]
        .losses
        .iter()
        .map(|l| l.unwrap_or(f64::NAN))
        .collect();
    // Every rank took the same skip decisions; rank 0's list is everybody's.
    let skipped_steps = results[0].skipped_steps.clone();
    let loss_scale = results[0].loss_scale;
    let rss = peak_rss_bytes();
    let mut stages: Vec<(usize, M::Stage)> = Vec::new();
    let mut timelines = Vec::new();
    let mut step_ends = Vec::new();
    let mut collective = Vec::new();
    let mut peak_param_bytes = Vec::new();
    let mut last_step = Vec::new();
    let mut param_sq = 0.0;
    for (rank, r) in results.into_iter().enumerate() {
        if grid.dp_index(rank) == 0 {
            stages.extend(r.stages);
        }
        timelines.push(r.events);
        step_ends.push(r.step_ends);
        collective.push(r.collective_share);
        peak_param_bytes.push(r.peak_param_bytes);
        last_step.push(r.last_step);
        param_sq += r.param_sq;
    }
    stages.sort_by_key(|(s, _)| *s);
    Ok(TrainOutcome {
        losses,
        model: TrainedStages {
            stages: stages.into_iter().map(|(_, s)| s).collect(),
        },
        timelines,
        step_times: step_times(&step_ends),
        collective_share: collective,
        peak_param_bytes,
        peak_rss_bytes: vec![rss; grid.world_size()],
        param_norm: param_sq.sqrt(),
        elapsed,
        skipped_steps,
        loss_scale,
        last_step,
    })
}
