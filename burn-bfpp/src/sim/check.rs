//! The simulator's input checks: a schedule lowered for the configuration, and a cost
//! table that fits it.

use crate::schedule::{ActionKind, PipelineSchedule, ZeroLevel};

use super::cost_table::CostTable;
use super::{SimConfig, SimError};

/// Check that the schedule is in range, lowered, and lowered for `cfg`'s ZeRO level.
pub(super) fn check_schedule(schedule: &PipelineSchedule, cfg: &SimConfig) -> Result<(), SimError> {
    let (n, stages, mbs) = (
        schedule.num_ranks(),
        schedule.num_stages(),
        schedule.microbatches,
    );
    let bad = |msg: String| Err(SimError::Schedule(msg));
    if n == 0 || stages == 0 || mbs == 0 {
        return bad("the schedule is empty (no ranks, stages or micro-batches)".into());
    }
    if let Some(&r) = schedule.stage_ranks.iter().find(|&&r| r >= n) {
        return bad(format!(
            "the placement names rank {r} but there are {n} ranks"
        ));
    }
    for (rank, list) in schedule.ranks.iter().enumerate() {
        for a in list {
            if a.stage >= stages || a.microbatch.is_some_and(|m| m >= mbs) {
                return bad(format!(
                    "rank {rank} has {a}, outside {stages} stages × {mbs} micro-batches"
                ));
            }
            if schedule.stage_ranks[a.stage] != rank {
                return bad(format!(
                    "rank {rank} has {a}, but stage {} lives on rank {}",
                    a.stage, schedule.stage_ranks[a.stage]
                ));
            }
        }
    }
    let crosses = schedule.stage_ranks.windows(2).any(|w| w[0] != w[1]);
    if crosses && !schedule.has_p2p() {
        return bad("the schedule has no SEND/RECV actions; lower it with lower_p2p first".into());
    }
    let all = || schedule.ranks.iter().flatten();
    let unshards = all().any(|a| a.kind == ActionKind::Unshard);
    let reduces = all().any(|a| a.kind == ActionKind::ReduceGrad);
    if (cfg.zero == ZeroLevel::Zero0) == unshards {
        return bad(format!(
            "the schedule {} UNSHARD actions but the configuration says ZeRO-{}; lower it with \
             lower_data_parallel at the same level",
            if unshards { "has" } else { "has no" },
            cfg.zero.number()
        ));
    }
    if !reduces && (cfg.dp > 1 || cfg.zero != ZeroLevel::Zero0) {
        return bad(
            "the schedule has no REDUCE_GRAD actions; lower it with lower_data_parallel".into(),
        );
    }
    Ok(())
}

/// Check that a cost table has one entry per stage (and per rank for the optimizer).
pub(super) fn check_costs(costs: &CostTable, stages: usize, n: usize) -> Result<(), SimError> {
    let per_stage = [
        ("forward", costs.forward.len()),
        ("backward", costs.backward.len()),
        ("backward_input", costs.backward_input.len()),
        ("backward_weight", costs.backward_weight.len()),
        ("message_bytes", costs.message_bytes.len()),
        ("transfer", costs.transfer.len()),
        ("gather", costs.gather.len()),
        ("reduce", costs.reduce.len()),
        ("parameters", costs.parameters.len()),
        ("activation_bytes", costs.activation_bytes.len()),
        ("weight_grad_bytes", costs.weight_grad_bytes.len()),
    ];
    if let Some((name, len)) = per_stage.iter().find(|&&(_, len)| len != stages) {
        return Err(SimError::Config(format!(
            "cost table field `{name}` has {len} entries but the schedule has {stages} stages"
        )));
    }
    for (name, len) in [
        ("optimizer", costs.optimizer.len()),
        ("start", costs.start.len()),
    ] {
        if len != n {
            return Err(SimError::Config(format!(
                "cost table field `{name}` has {len} entries but the schedule has {n} ranks"
            )));
        }
    }
    if let Some(s) = (0..stages).find(|&s| costs.weight_grad_bytes[s] > costs.activation_bytes[s]) {
        return Err(SimError::Config(format!(
            "cost table field `weight_grad_bytes` of stage {s} is {} bytes, more than the {} \
             `activation_bytes` it is part of; what a split backward keeps for its W is a part \
             of the stage's activations",
            costs.weight_grad_bytes[s], costs.activation_bytes[s]
        )));
    }
    if let Some(r) = costs.start.iter().position(|t| !t.is_finite() || *t < 0.0) {
        return Err(SimError::Config(format!(
            "cost table field `start` of rank {r} is {}; start times are finite and not \
             negative",
            costs.start[r]
        )));
    }
    Ok(())
}
