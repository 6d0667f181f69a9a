//! Lowering pass: insert the point-to-point transfers (`SEND_F`/`RECV_F`, `SEND_B`/`RECV_B`)
//! for every stage boundary that crosses ranks, in an order that cannot deadlock when a send
//! blocks until its receive is posted.
//!
//! Why it cannot deadlock: the pass replays the compute order with unit times and gives every
//! event a key in one global total order — a compute by its start time, a transfer by the end
//! time of the compute that produced its data (transfers before computes at equal times, ties
//! broken by a fixed key: the producing stage, descending). Every rank's lowered list is sorted by that key. Then the globally
//! first unfinished event has all its predecessors on each participating rank finished, so its
//! participants are all at it: a compute can run and a send meets its receive. By induction
//! every event runs. The sender sends right after producing; the receiver receives as soon as
//! the data exists in the unit-time replay, which is never after the compute that needs it.
//!
//! An overlapped forward/backward pair ([`Action::overlaps_next`]) is one event of that
//! order: the replay starts it once both halves' inputs are there and publishes both outputs
//! at its end, so both halves' receives come before the pair and both sends after it, and the
//! argument above holds with the pair as one compute.

use std::cmp::Ordering;

use super::grid::deadlock_report;
use super::{replay, unit_cost, Action, ActionKind, PipelineSchedule, ScheduleError, SendMode};

/// Position of an event in the global order; see the module docs.
#[derive(Debug, Clone, Copy)]
struct Key {
    time: f64,
    /// 0 for transfers, 1 for computes: a transfer at time t precedes a compute starting at t.
    class: u8,
    /// Unique among events of the same time and class.
    tiebreak: (usize, usize, usize),
}

impl Key {
    fn cmp(&self, other: &Key) -> Ordering {
        self.time
            .total_cmp(&other.time)
            .then(self.class.cmp(&other.class))
            .then(self.tiebreak.cmp(&other.tiebreak))
    }
}

/// Add `SEND_*`/`RECV_*` actions for every stage boundary that crosses ranks.
///
/// The input must be compute-only (as generated) and must not deadlock by itself; the error
/// otherwise carries the diagnosis grid. Boundaries between stages on the same rank need no
/// transfer (the activation stays in memory).
pub fn lower_p2p(schedule: &PipelineSchedule) -> Result<PipelineSchedule, ScheduleError> {
    if let Some(a) = schedule
        .ranks
        .iter()
        .flatten()
        .find(|a| !a.kind.is_compute())
    {
        return Err(ScheduleError::Config(format!(
            "lower_p2p expects a compute-only schedule but found {a}; lower a freshly generated \
             schedule, or strip it with PipelineSchedule::compute_only first"
        )));
    }
    let outcome = replay(schedule, SendMode::Blocking, unit_cost)?;
    if !outcome.completed() {
        return Err(ScheduleError::Invalid {
            report: deadlock_report(schedule, &outcome),
        });
    }
    let last_stage = schedule.num_stages().saturating_sub(1);
    let owner = &schedule.stage_ranks;
    let mut events: Vec<Vec<(Key, Action)>> = schedule
        .ranks
        .iter()
        .map(|l| Vec::with_capacity(l.len() * 2))
        .collect();
    for (rank, timed) in outcome.timeline.ranks.iter().enumerate() {
        for (pos, t) in timed.iter().enumerate() {
            let a = t.action;
            // An overlapped pair is one event: its second half takes the first's key (and
            // sorts right after it), and its outputs leave when the whole pair has ended.
            let opened_by = pos
                .checked_sub(1)
                .map(|p| &timed[p])
                .filter(|prev| prev.action.overlaps_next);
            let key = match opened_by {
                Some(first) => Key {
                    time: first.start,
                    class: 1,
                    tiebreak: (rank, pos - 1, 1),
                },
                None => Key {
                    time: t.start,
                    class: 1,
                    tiebreak: (rank, pos, 0),
                },
            };
            events[rank].push((key, a));
            let produced = match timed.get(pos + 1) {
                Some(second) if a.overlaps_next => second.end,
                _ => t.end,
            };
            let (s, mb) = (a.stage, a.mb());
            let transfer = match a.kind {
                ActionKind::Forward if s < last_stage && owner[s + 1] != rank => Some((
                    Action::new(s, ActionKind::SendForward, mb),
                    Action::new(s + 1, ActionKind::RecvForward, mb),
                    owner[s + 1],
                    0,
                )),
                ActionKind::Backward | ActionKind::BackwardInput
                    if s > 0 && owner[s - 1] != rank =>
                {
                    Some((
                        Action::new(s, ActionKind::SendBackward, mb),
                        Action::new(s - 1, ActionKind::RecvBackward, mb),
                        owner[s - 1],
                        1,
                    ))
                }
                _ => None,
            };
            if let Some((send, recv, peer, direction)) = transfer {
                let key = Key {
                    time: produced,
                    class: 0,
                    // Later producer stages first: at equal times this puts a rank's own
                    // send before the receive of its upstream neighbour's next output.
                    tiebreak: (usize::MAX - s, mb, direction),
                };
                events[rank].push((key, send));
                events[peer].push((key, recv));
            }
        }
    }
    let ranks = events
        .into_iter()
        .map(|mut list| {
            list.sort_by(|a, b| a.0.cmp(&b.0));
            list.into_iter().map(|(_, a)| a).collect()
        })
        .collect();
    Ok(PipelineSchedule {
        stage_ranks: schedule.stage_ranks.clone(),
        microbatches: schedule.microbatches,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{ScheduleKind, ScheduleSpec};

    fn line(list: &[Action]) -> String {
        list.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn gpipe_two_ranks_sends_after_producing_and_receives_before_consuming() {
        let s = ScheduleSpec::new(ScheduleKind::GPipe, 2, 1, 2)
            .generate()
            .unwrap();
        let lowered = lower_p2p(&s).unwrap();
        assert_eq!(
            line(&lowered.ranks[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
        );
        assert_eq!(
            line(&lowered.ranks[1]),
            "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"
        );
    }

    #[test]
    fn same_rank_boundaries_get_no_transfer() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 1, 3, 2)
            .generate()
            .unwrap();
        assert_eq!(lower_p2p(&s).unwrap(), s);
    }

    #[test]
    fn lowered_input_is_refused() {
        let s = ScheduleSpec::new(ScheduleKind::GPipe, 2, 1, 1)
            .generate()
            .unwrap();
        let lowered = lower_p2p(&s).unwrap();
        assert!(matches!(lower_p2p(&lowered), Err(ScheduleError::Config(_))));
    }
}
