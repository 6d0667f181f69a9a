//! The validator: structural checks (ownership, one forward and one backward per stage and
//! micro-batch, matched transfers, consistent collectives) followed by a dry run with blocking
//! semantics that finds deadlocks and unmet data dependencies.

use super::grid::deadlock_report;
use super::lower_dp::{collective_counts, CollectiveCounts};
use super::{replay, unit_cost, Action, ActionKind, PipelineSchedule, ScheduleError, SendMode};

/// At most this many structural problems are listed; the rest are counted.
const MAX_LISTED: usize = 20;

/// What a valid schedule looks like under the unit cost model (forward 1, backward 2), with
/// eager sends.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationReport {
    /// Unit-time makespan of the step.
    pub makespan: f64,
    /// (makespan − busiest rank's compute time) / busiest rank's compute time.
    pub bubble_fraction: f64,
    /// Collectives per rank.
    pub collectives: Vec<CollectiveCounts>,
}

/// Collects problems and renders them as one report.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, p: String) {
        self.0.push(p);
    }

    fn into_result(self) -> Result<(), ScheduleError> {
        if self.0.is_empty() {
            return Ok(());
        }
        let total = self.0.len();
        let mut report: Vec<String> = self.0.into_iter().take(MAX_LISTED).collect();
        if total > MAX_LISTED {
            report.push(format!("… and {} more problems", total - MAX_LISTED));
        }
        Err(ScheduleError::Invalid {
            report: report.join("\n"),
        })
    }
}

/// How often, and first where, each per-micro-batch action occurs: dense tables indexed by
/// (kind, stage, micro-batch), since hashing millions of actions would dominate validation.
struct Tally {
    stages: usize,
    mbs: usize,
    count: Vec<u32>,
    first: Vec<u32>,
}

impl Tally {
    /// Slot of a non-collective action; `None` for collectives.
    fn slot(&self, a: Action) -> Option<usize> {
        let kind = ActionKind::ALL.iter().position(|&k| k == a.kind)?;
        let mb = a.microbatch?;
        (a.stage < self.stages && mb < self.mbs)
            .then(|| (kind * self.stages + a.stage) * self.mbs + mb)
    }

    fn new(schedule: &PipelineSchedule) -> Self {
        let (stages, mbs) = (schedule.num_stages(), schedule.microbatches);
        let slots = 8 * stages * mbs;
        let mut t = Tally {
            stages,
            mbs,
            count: vec![0; slots],
            first: vec![u32::MAX; slots],
        };
        for list in &schedule.ranks {
            for (i, a) in list.iter().enumerate() {
                if let Some(slot) = t.slot(*a) {
                    t.count[slot] += 1;
                    t.first[slot] = t.first[slot].min(i as u32);
                }
            }
        }
        t
    }

    fn count(&self, a: Action) -> usize {
        self.slot(a).map_or(0, |s| self.count[s] as usize)
    }

    fn first_pos(&self, a: Action) -> Option<usize> {
        self.slot(a)
            .map(|s| self.first[s])
            .filter(|&p| p != u32::MAX)
            .map(|p| p as usize)
    }
}

fn check_ownership(schedule: &PipelineSchedule, problems: &mut Problems) {
    let (stages, mbs) = (schedule.num_stages(), schedule.microbatches);
    if let Some(&bad) = schedule
        .stage_ranks
        .iter()
        .find(|&&r| r >= schedule.num_ranks())
    {
        problems.push(format!(
            "the placement names rank {bad} but the schedule has {} ranks",
            schedule.num_ranks()
        ));
        return;
    }
    for (rank, list) in schedule.ranks.iter().enumerate() {
        for a in list {
            if a.stage >= stages || a.microbatch.is_some_and(|m| m >= mbs) {
                problems.push(format!(
                    "rank {rank} runs {a}, outside the schedule's {stages} stages × {mbs} micro-batches"
                ));
            } else if schedule.stage_ranks[a.stage] != rank {
                problems.push(format!(
                    "rank {rank} runs {a}, but stage {} lives on rank {}; move it there",
                    a.stage, schedule.stage_ranks[a.stage]
                ));
            }
        }
    }
}

/// Every overlapped pair holds one forward and one backward (`B` or `I`) of different
/// micro-batches, its second half directly after its first.
fn check_pairs(schedule: &PipelineSchedule, problems: &mut Problems) {
    for (rank, list) in schedule.ranks.iter().enumerate() {
        for (i, a) in list.iter().enumerate().filter(|(_, a)| a.overlaps_next) {
            let b = match list.get(i + 1) {
                Some(b) if b.kind.is_compute() => *b,
                other => {
                    let found = other.map_or("the end of its list".to_string(), |b| b.to_string());
                    problems.push(format!(
                        "rank {rank}: {a} opens an OVERLAP_F_B pair but {found} follows it; the \
                         pair's second half must come right after it"
                    ));
                    continue;
                }
            };
            let pair = format!("({a};{b})OVERLAP_F_B");
            let is_backward = |k: ActionKind| k.produces_input_grad();
            let one_of_each = (a.kind == ActionKind::Forward && is_backward(b.kind))
                || (b.kind == ActionKind::Forward && is_backward(a.kind));
            if b.overlaps_next {
                problems.push(format!(
                    "rank {rank}: {b} closes the pair {pair} and opens another; a pair holds \
                     exactly two actions"
                ));
            } else if !one_of_each {
                problems.push(format!(
                    "rank {rank}: the pair {pair} must hold one forward (F) and one backward \
                     (B or I)"
                ));
            } else if a.mb() == b.mb() {
                problems.push(format!(
                    "rank {rank}: both halves of {pair} are micro-batch {}; a backward needs \
                     its micro-batch's forward through every stage first, so the two cannot \
                     run as one unit: pair different micro-batches",
                    a.mb()
                ));
            }
        }
    }
}

fn check_compute(schedule: &PipelineSchedule, pos: &Tally, problems: &mut Problems) {
    for s in 0..schedule.num_stages() {
        for m in 0..schedule.microbatches {
            let f = Action::forward(s, m);
            let b = Action::backward(s, m);
            let i = Action::new(s, ActionKind::BackwardInput, m);
            let w = Action::new(s, ActionKind::BackwardWeight, m);
            let (nf, nb, ni, nw) = (pos.count(f), pos.count(b), pos.count(i), pos.count(w));
            if nf != 1 {
                problems.push(format!(
                    "{f} appears {nf} times; it must appear exactly once"
                ));
            }
            let split = ni > 0 || nw > 0;
            if !((nb == 1 && !split) || (nb == 0 && ni == 1 && nw == 1)) {
                problems.push(format!(
                    "stage {s} micro-batch {m} has {nb}× {b}, {ni}× {i}, {nw}× {w}; it needs \
                     exactly one {b}, or one {i} and one {w}"
                ));
                continue;
            }
            let backward = if split { i } else { b };
            if let (Some(pf), Some(pb)) = (pos.first_pos(f), pos.first_pos(backward)) {
                if pb < pf {
                    problems.push(format!(
                        "{backward} runs before {f} on rank {}",
                        schedule.stage_ranks[s]
                    ));
                }
            }
            if let (true, Some(pi), Some(pw)) = (split, pos.first_pos(i), pos.first_pos(w)) {
                if pw < pi {
                    problems.push(format!(
                        "{w} runs before {i} on rank {}; W must follow I",
                        schedule.stage_ranks[s]
                    ));
                }
            }
        }
    }
}

fn check_p2p(schedule: &PipelineSchedule, pos: &Tally, problems: &mut Problems) {
    let owner = &schedule.stage_ranks;
    let stages = schedule.num_stages();
    for s in 0..stages {
        for m in 0..schedule.microbatches {
            // Forward boundary s → s+1 and backward boundary s+1 → s.
            let pairs = [
                (
                    Action::new(s, ActionKind::SendForward, m),
                    Action::new(s + 1, ActionKind::RecvForward, m),
                ),
                (
                    Action::new(s + 1, ActionKind::SendBackward, m),
                    Action::new(s, ActionKind::RecvBackward, m),
                ),
            ];
            for (send, recv) in pairs {
                let crosses = s + 1 < stages && owner[s] != owner[s + 1];
                let want = usize::from(crosses);
                for a in [send, recv] {
                    let n = pos.count(a);
                    if n != want {
                        let why = if crosses {
                            format!(
                                "stages {s} and {} live on ranks {} and {}, so every micro-batch \
                                 needs exactly one {send} and one {recv}",
                                s + 1,
                                owner[s],
                                owner[s + 1]
                            )
                        } else if s + 1 < stages {
                            format!(
                                "stages {s} and {} share rank {}: no transfer is needed",
                                s + 1,
                                owner[s]
                            )
                        } else {
                            format!("stage {s} is the last stage: nothing follows it")
                        };
                        problems.push(format!("{a} appears {n} times; {why}"));
                    }
                }
            }
        }
    }
    // A stage-0 forward receive or a stage-0 backward send has no peer at all.
    for a in schedule.ranks.iter().flatten() {
        if a.stage == 0 && matches!(a.kind, ActionKind::RecvForward | ActionKind::SendBackward) {
            problems.push(format!("{a} has no peer: stage 0 is the first stage"));
        }
    }
}

fn check_collectives(schedule: &PipelineSchedule, problems: &mut Problems) {
    let any_reduce = schedule
        .ranks
        .iter()
        .flatten()
        .any(|a| a.kind == ActionKind::ReduceGrad);
    for (rank, list) in schedule.ranks.iter().enumerate() {
        // Per-stage state in dense vectors: this loop sees every action of the schedule.
        let stages = schedule.num_stages();
        let mut gathered = vec![true; stages];
        for a in list.iter().filter(|a| a.kind == ActionKind::Unshard) {
            gathered[a.stage] = false; // a stage that is ever gathered starts sharded
        }
        let mut pending_grad = vec![false; stages];
        for a in list {
            let s = a.stage;
            match a.kind {
                ActionKind::Unshard if gathered[s] => problems.push(format!(
                    "rank {rank}: {a} while stage {s} is already gathered; RESHARD it first or drop this UNSHARD"
                )),
                ActionKind::Unshard => gathered[s] = true,
                ActionKind::Reshard if !gathered[s] => problems.push(format!(
                    "rank {rank}: {a} while stage {s} is not gathered"
                )),
                ActionKind::Reshard => gathered[s] = false,
                ActionKind::ReduceGrad if !pending_grad[s] => problems.push(format!(
                    "rank {rank}: {a} with no gradient of stage {s} accumulated since the last reduction"
                )),
                ActionKind::ReduceGrad => pending_grad[s] = false,
                k if k.reads_weights() && !gathered[s] => problems.push(format!(
                    "rank {rank}: {a} runs while stage {s}'s weights are sharded; put a {s}UNSHARD before it"
                )),
                k if k.produces_weight_grad() => pending_grad[s] = true,
                _ => {}
            }
        }
        if any_reduce {
            for s in (0..stages).filter(|&s| pending_grad[s]) {
                problems.push(format!(
                    "rank {rank}: stage {s}'s gradients are never reduced after its last backward; \
                     add {s}REDUCE_GRAD after it"
                ));
            }
        }
    }
}

/// The structural checks of overlapped pairs alone: what the lowering passes need before
/// they can keep each pair together.
pub(super) fn validate_pairs(schedule: &PipelineSchedule) -> Result<(), ScheduleError> {
    let mut problems = Problems::default();
    check_pairs(schedule, &mut problems);
    problems.into_result()
}

/// Check `schedule` and dry-run it with blocking semantics.
///
/// On failure the error lists every structural problem found (up to 20), or for a deadlock
/// the time-step × rank grid with each blocked rank's action and what it waits for.
pub fn validate(schedule: &PipelineSchedule) -> Result<ValidationReport, ScheduleError> {
    if schedule.num_ranks() == 0 || schedule.num_stages() == 0 || schedule.microbatches == 0 {
        return Err(ScheduleError::Invalid {
            report: "the schedule is empty: it needs at least one rank, stage and micro-batch"
                .into(),
        });
    }
    // The later checks index by stage and micro-batch: stop here if those are out of range.
    let mut problems = Problems::default();
    check_ownership(schedule, &mut problems);
    problems.into_result()?;
    let mut problems = Problems::default();
    let pos = Tally::new(schedule);
    check_pairs(schedule, &mut problems);
    check_compute(schedule, &pos, &mut problems);
    if schedule.has_p2p() {
        check_p2p(schedule, &pos, &mut problems);
    }
    check_collectives(schedule, &mut problems);
    problems.into_result()?;

    // Blocking sends are the strictest semantics: completing under them proves the schedule
    // completes under any buffering. Timings come from eager sends, as the executor runs them.
    let blocking = replay(schedule, SendMode::Blocking, unit_cost)?;
    if !blocking.completed() {
        return Err(ScheduleError::Invalid {
            report: deadlock_report(schedule, &blocking),
        });
    }
    let outcome = replay(schedule, SendMode::Eager, unit_cost)?;
    let makespan = outcome.timeline.makespan();
    let busiest = outcome
        .timeline
        .ranks
        .iter()
        .map(|r| r.iter().map(|t| t.end - t.start).sum::<f64>())
        .fold(0.0, f64::max);
    Ok(ValidationReport {
        makespan,
        bubble_fraction: if busiest > 0.0 {
            (makespan - busiest) / busiest
        } else {
            0.0
        },
        collectives: collective_counts(schedule),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{
        lower_data_parallel, lower_p2p, DataParallelLowering, ScheduleKind, ScheduleSpec, ZeroLevel,
    };

    fn parse(rows: &[&str]) -> PipelineSchedule {
        let ranks = rows
            .iter()
            .map(|r| r.split_whitespace().map(|a| a.parse().unwrap()).collect())
            .collect();
        PipelineSchedule::from_rank_lists(ranks).unwrap()
    }

    fn problem(rows: &[&str]) -> String {
        validate(&parse(rows)).unwrap_err().to_string()
    }

    #[test]
    fn generated_and_lowered_schedules_are_valid() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 3)
            .generate()
            .unwrap();
        let lowered = lower_data_parallel(
            &lower_p2p(&s).unwrap(),
            &DataParallelLowering::new(ZeroLevel::Zero3),
        )
        .unwrap();
        let report = validate(&lowered).unwrap();
        assert_eq!(report.makespan, validate(&s).unwrap().makespan);
        assert_eq!(report.collectives.len(), 2);
    }

    #[test]
    fn a_missing_backward_is_named() {
        let p = problem(&["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"]);
        assert!(p.contains("0B1"), "{p}");
    }

    #[test]
    fn a_duplicate_forward_is_named() {
        let p = problem(&["0F0 0F0 0B0", "1F0 1B0"]);
        assert!(p.contains("0F0 appears 2 times"), "{p}");
    }

    #[test]
    fn w_before_i_is_rejected() {
        let p = problem(&["0F0 0W0 0I0"]);
        assert!(p.contains("W must follow I"), "{p}");
    }

    #[test]
    fn an_unmatched_send_is_named() {
        let p = problem(&["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"]);
        assert!(p.contains("1RECV_F0 appears 0 times"), "{p}");
    }

    #[test]
    fn crossed_blocking_sends_deadlock_and_are_diagnosed() {
        // Both ranks send before they receive: with blocking sends neither can proceed.
        let p = problem(&[
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        ]);
        assert!(p.contains("rank 0 blocked at 0SEND_F1"), "{p}");
        assert!(p.contains("rank 1 blocked at 1SEND_B0"), "{p}");
    }

    #[test]
    fn a_dependency_cycle_is_a_deadlock() {
        let p = problem(&["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]);
        assert!(p.contains("rank 0 blocked at 0B0"), "{p}");
        assert!(p.contains("rank 1 blocked at 1F1"), "{p}");
    }

    #[test]
    fn compute_on_sharded_weights_and_missing_reductions_are_named() {
        let p = problem(&["0F0 0UNSHARD 0B0 0REDUCE_GRAD"]);
        assert!(p.contains("sharded"), "{p}");
        let p = problem(&["0F0 0B0 0REDUCE_GRAD", "1F0 1B0"]);
        assert!(p.contains("stage 1's gradients are never reduced"), "{p}");
    }
}
