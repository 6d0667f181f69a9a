//! Where the time of one measured optimizer step went: the run's bubble, and the durations
//! of its actions in the form the simulator takes, so a measurement and a prediction from
//! the same durations can be laid side by side.

use super::TimedEvent;
use crate::schedule::ActionKind;
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
    /// Duration of every compute, `SEND_*`, `UNSHARD` and `REDUCE_GRAD` of data-parallel
    /// replica 0 (world ranks `0..pp`), the actions whose durations the simulator takes.
    /// Receives are left out: their measured time is mostly waiting, which the simulator
    /// derives from the sends.
    pub durations: ActionDurations,
}

impl StepProfile {
    /// Profile `step` of a run whose ranks recorded `timelines` (by world rank), `pp`
    /// pipeline ranks per replica. `None` when no rank recorded that step.
    pub fn measure(timelines: &[Vec<TimedEvent>], pp: usize, step: usize) -> Option<Self> {
        let mut first = f64::INFINITY;
        let mut last = f64::NEG_INFINITY;
        let mut compute = vec![0.0; timelines.len()];
        let mut durations = ActionDurations::new();
        for (rank, events) in timelines.iter().enumerate() {
            for e in events.iter().filter(|e| e.step == step) {
                first = first.min(e.start);
                last = last.max(e.end);
                let length = e.end - e.start;
                let kind = e.action.kind;
                if kind.is_compute() {
                    compute[rank] += length;
                }
                let timed = kind.is_compute()
                    || matches!(
                        kind,
                        ActionKind::SendForward
                            | ActionKind::SendBackward
                            | ActionKind::Unshard
                            | ActionKind::ReduceGrad
                    );
                if rank < pp && timed {
                    durations.insert(e.action, length);
                }
            }
        }
        if first > last {
            return None;
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
            durations,
        })
    }
}
