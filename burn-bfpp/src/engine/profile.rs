//! Where the time of one measured optimizer step went: the run's bubble, and the durations
//! of its actions in the form the simulator takes, so a measurement and a prediction from
//! the same durations can be laid side by side.

use std::collections::HashMap;

use crate::schedule::{Action, ActionKind, TimedEvent};
use crate::sim::ActionDurations;

/// One optimizer step of a run, measured from its timelines.
#[derive(Debug, Clone, PartialEq)]
pub struct StepProfile {
    /// The optimizer step (1-based).
    pub step: usize,
    /// From the first action's start to the last action's end over all ranks, seconds. The
    /// optimizer update after each rank's list is not included.
    pub span: f64,
    /// Seconds of compute (`F`, `B`, `I`, `W`) of each world rank.
    pub compute: Vec<f64>,
    /// (span − busiest rank's compute) ÷ busiest rank's compute: the simulator's definition
    /// of the bubble fraction.
    pub bubble_fraction: f64,
    /// When each rank of data-parallel replica 0 (world ranks `0..pp`) began the step,
    /// seconds after the first action of the step on any rank: the ranks of a real run do
    /// not start together (the previous step ends at different times on each), and a replay
    /// (`CostTable::start`) must not pretend they do.
    pub start: Vec<f64>,
    /// What every action of replica 0 cost its rank, in the form the simulator takes (see
    /// [`StepProfile::measure`]).
    pub durations: ActionDurations,
}

impl StepProfile {
    /// Profile `step` of a run whose ranks recorded `timelines` (by world rank), `pp`
    /// pipeline ranks per replica. `None` when no rank recorded that step.
    ///
    /// An action is charged the time from the end of the rank's previous action to its own
    /// end, so the engine's bookkeeping between actions is carried by the action it prepares
    /// and a replay on one thread per rank (`sim::Execution::Serial`) accounts for every
    /// second of a rank's step. Two exceptions: a receive is charged from the later of its
    /// own start and the end of its matching send to its end — the message's latency and
    /// unpacking, not the wait for the sender, which the simulator derives from the send —
    /// and `RESHARD`, which the simulator takes as instantaneous, passes its time on to the
    /// next action. A collective that overlapped compute has two events, its start and its
    /// wait (see [`crate::comm::pending`]), and is charged both.
    pub fn measure(timelines: &[Vec<TimedEvent>], pp: usize, step: usize) -> Option<Self> {
        let of_step = |events: &'_ [TimedEvent]| -> Vec<TimedEvent> {
            events.iter().filter(|e| e.step == step).cloned().collect()
        };
        let first = timelines
            .iter()
            .flat_map(|events| events.iter().filter(|e| e.step == step))
            .map(|e| e.start)
            .fold(f64::INFINITY, f64::min);
        let last = timelines
            .iter()
            .flat_map(|events| events.iter().filter(|e| e.step == step))
            .map(|e| e.end)
            .fold(f64::NEG_INFINITY, f64::max);
        if first > last {
            return None;
        }
        // End of every send of replica 0, for the receives that wait for them.
        let sent: HashMap<Action, f64> = timelines
            .iter()
            .take(pp)
            .flat_map(|events| events.iter().filter(|e| e.step == step))
            .filter(|e| {
                matches!(
                    e.action.kind,
                    ActionKind::SendForward | ActionKind::SendBackward
                )
            })
            .map(|e| (e.action, e.end))
            .collect();
        let mut compute = vec![0.0; timelines.len()];
        let mut start = vec![0.0; pp.min(timelines.len())];
        let mut durations = ActionDurations::new();
        for (rank, events) in timelines.iter().enumerate() {
            let events = of_step(events);
            compute[rank] = events
                .iter()
                .filter(|e| e.action.kind.is_compute())
                .map(|e| e.end - e.start)
                .sum();
            if rank >= pp {
                continue;
            }
            let Some(head) = events.first() else {
                continue;
            };
            start[rank] = head.start - first;
            let mut previous_end = head.start;
            for e in &events {
                match e.action.kind {
                    ActionKind::RecvForward | ActionKind::RecvBackward => {
                        let ready = matching_send(e.action)
                            .and_then(|a| sent.get(&a))
                            .map_or(e.end, |&t| t.max(e.start));
                        durations.insert(e.action.alone(), (e.end - ready).max(0.0));
                        previous_end = e.end;
                    }
                    ActionKind::Reshard => {}
                    _ => {
                        // A collective finished after it started appears twice (its start,
                        // then its wait): the rank spent both on it.
                        *durations.entry(e.action.alone()).or_insert(0.0) += e.end - previous_end;
                        previous_end = e.end;
                    }
                }
            }
        }
        let span = last - first;
        let busiest = compute.iter().copied().fold(0.0, f64::max);
        Some(StepProfile {
            step,
            span,
            bubble_fraction: if busiest > 0.0 {
                (span - busiest) / busiest
            } else {
                0.0
            },
            compute,
            start,
            durations,
        })
    }
}

/// For each rank of `timelines`, the share of its time in list actions that went to its
/// data-parallel collectives (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`: their starts, and the waits
/// for those that overlapped compute): what overlapping them and a faster network can take
/// away. Receives are left out: their time is mostly the pipeline's bubble (waiting for the
/// sender), which [`StepProfile`] measures. 0 for a rank that recorded nothing.
pub fn collective_share(timelines: &[Vec<TimedEvent>]) -> Vec<f64> {
    timelines
        .iter()
        .map(|events| {
            let (mut collective, mut all) = (0.0, 0.0);
            for e in events {
                let took = (e.end - e.start).max(0.0);
                all += took;
                if e.action.kind.is_collective() {
                    collective += took;
                }
            }
            if all > 0.0 {
                collective / all
            } else {
                0.0
            }
        })
        .collect()
}

/// The send whose message the receive `a` takes, if `a` is a receive.
fn matching_send(a: Action) -> Option<Action> {
    let m = a.microbatch?;
    match a.kind {
        ActionKind::RecvForward => Some(Action::new(
            a.stage.checked_sub(1)?,
            ActionKind::SendForward,
            m,
        )),
        ActionKind::RecvBackward => Some(Action::new(a.stage + 1, ActionKind::SendBackward, m)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(step: usize, action: Action, start: f64, end: f64) -> TimedEvent {
        TimedEvent {
            step,
            action,
            start,
            end,
        }
    }

    #[test]
    fn actions_carry_the_gaps_before_them_and_receives_their_latency() {
        let recv = Action::new(1, ActionKind::RecvForward, 0);
        let timelines = vec![
            vec![
                // Step 1 must be ignored.
                event(1, Action::forward(0, 0), 0.0, 1.0),
                event(2, Action::forward(0, 0), 10.0, 11.0),
                event(2, Action::new(0, ActionKind::SendForward, 0), 11.5, 12.0),
                event(2, Action::collective(0, ActionKind::Reshard), 12.0, 12.5),
                event(2, Action::backward(0, 0), 13.0, 15.0),
            ],
            vec![
                event(2, recv, 10.5, 12.25),
                event(2, Action::forward(1, 0), 12.5, 13.5),
            ],
        ];
        let p = StepProfile::measure(&timelines, 2, 2).expect("step 2 ran");
        assert_eq!(p.span, 5.0);
        assert_eq!(p.start, vec![0.0, 0.5]);
        assert_eq!(p.compute, vec![3.0, 1.0]);
        assert_eq!(p.bubble_fraction, (5.0 - 3.0) / 3.0);
        let d = |a: Action| p.durations[&a];
        assert_eq!(d(Action::forward(0, 0)), 1.0);
        assert_eq!(d(Action::new(0, ActionKind::SendForward, 0)), 1.0);
        // The reshard's half second and the gap after it go to the backward.
        assert_eq!(d(Action::backward(0, 0)), 3.0);
        assert!(!p
            .durations
            .contains_key(&Action::collective(0, ActionKind::Reshard)));
        // Its message was sent at 12.0; the quarter second after that is latency.
        assert_eq!(d(recv), 0.25);
        assert_eq!(d(Action::forward(1, 0)), 1.25);
        assert!(StepProfile::measure(&timelines, 2, 3).is_none());
    }

    /// A collective that overlapped compute has a start and a wait event; the rank spent both.
    #[test]
    fn an_overlapped_collective_is_charged_its_start_and_its_wait() {
        let reduce = Action::collective(0, ActionKind::ReduceGrad);
        let timelines = vec![vec![
            event(1, Action::backward(0, 0), 0.0, 2.0),
            event(1, reduce, 2.0, 2.5),
            event(1, Action::backward(0, 1), 2.5, 4.5),
            event(1, Action::new(0, ActionKind::SendBackward, 1), 4.5, 4.75),
            event(1, reduce, 4.75, 5.5),
        ]];
        let p = StepProfile::measure(&timelines, 1, 1).expect("step 1 ran");
        assert_eq!(p.durations[&reduce], 0.5 + 0.75);
        assert_eq!(p.compute, vec![4.0]);
        // The send is not a data-parallel collective.
        assert_eq!(collective_share(&timelines), vec![1.25 / 5.5]);
        assert_eq!(collective_share(&[Vec::new()]), vec![0.0]);
    }
}
