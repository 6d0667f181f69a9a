//! What a rank keeps of its measured timeline: the events of a bounded window of recent steps,
//! and a few numbers per step, so a run's memory does not grow with its length.

use std::collections::VecDeque;

use crate::schedule::TimedEvent;

/// Steps whose every action a run keeps by default ([`crate::engine::Trainer::timeline_steps`]).
pub const DEFAULT_TIMELINE_STEPS: usize = 16;

/// One rank's recording: every action of the last `window` steps, each step's end, and the
/// running totals behind its collective share.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    window: usize,
    events: VecDeque<TimedEvent>,
    /// The first step recorded (the step after a resumed checkpoint's).
    first_step: usize,
    /// End of the last action of every step since `first_step`, seconds since the epoch.
    step_ends: Vec<f64>,
    /// Seconds of data-parallel collectives and of every action (see
    /// [`crate::engine::collective_share`]).
    collective: f64,
    busy: f64,
}

impl Recorder {
    /// A recording of the steps after `start_step`, keeping the actions of the last `window`.
    pub(crate) fn new(window: usize, start_step: usize) -> Self {
        Recorder {
            window,
            events: VecDeque::new(),
            first_step: start_step + 1,
            step_ends: Vec::new(),
            collective: 0.0,
            busy: 0.0,
        }
    }

    pub(crate) fn record(&mut self, event: TimedEvent) {
        let took = (event.end - event.start).max(0.0);
        self.busy += took;
        if event.action.kind.is_collective() {
            self.collective += took;
        }
        if let Some(i) = event.step.checked_sub(self.first_step) {
            if self.step_ends.len() <= i {
                self.step_ends.resize(i + 1, 0.0);
            }
            self.step_ends[i] = self.step_ends[i].max(event.end);
        }
        while self
            .events
            .front()
            .is_some_and(|e| e.step + self.window <= event.step)
        {
            self.events.pop_front();
        }
        if self.window > 0 {
            self.events.push_back(event);
        }
    }

    /// The kept events, oldest first.
    pub(crate) fn events(&self) -> Vec<TimedEvent> {
        self.events.iter().copied().collect()
    }

    /// The end of every recorded step, seconds since the epoch.
    pub(crate) fn step_ends(&self) -> &[f64] {
        &self.step_ends
    }

    /// The share of the rank's action time in data-parallel collectives (0 without actions).
    pub(crate) fn collective_share(&self) -> f64 {
        if self.busy > 0.0 {
            self.collective / self.busy
        } else {
            0.0
        }
    }
}

/// Seconds of every step from the per-rank step ends (on one clock): from the end of the step
/// before on any rank (0 for the first) to the step's own end on any rank.
pub(crate) fn step_times(ends_by_rank: &[Vec<f64>]) -> Vec<f64> {
    let steps = ends_by_rank.iter().map(Vec::len).max().unwrap_or(0);
    let mut ends = vec![0f64; steps];
    for rank in ends_by_rank {
        for (end, &e) in ends.iter_mut().zip(rank) {
            *end = end.max(e);
        }
    }
    let mut previous = 0.0;
    ends.into_iter()
        .map(|end| {
            let took = end - previous;
            previous = end;
            took
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Action, ActionKind};

    fn event(step: usize, kind: ActionKind, start: f64, end: f64) -> TimedEvent {
        TimedEvent {
            step,
            action: if kind.is_collective() {
                Action::collective(0, kind)
            } else {
                Action::new(0, kind, 0)
            },
            start,
            end,
        }
    }

    #[test]
    fn keeps_a_window_of_steps_and_every_steps_end() {
        let mut r = Recorder::new(2, 10);
        for step in 11..=15 {
            let t = step as f64;
            r.record(event(step, ActionKind::Forward, t, t + 0.5));
            r.record(event(step, ActionKind::Backward, t + 0.5, t + 0.75));
        }
        let steps: Vec<usize> = r.events().iter().map(|e| e.step).collect();
        assert_eq!(steps, vec![14, 14, 15, 15]);
        assert_eq!(r.step_ends(), &[11.75, 12.75, 13.75, 14.75, 15.75]);
        assert_eq!(Recorder::new(0, 0).events().len(), 0);
        assert_eq!(
            step_times(&[vec![1.0, 2.5], vec![1.5, 2.0]]),
            vec![1.5, 1.0]
        );
    }

    #[test]
    fn collective_share_counts_every_step() {
        let mut r = Recorder::new(1, 0);
        r.record(event(1, ActionKind::Forward, 0.0, 3.0));
        r.record(event(2, ActionKind::ReduceGrad, 3.0, 4.0));
        assert!((r.collective_share() - 0.25).abs() < 1e-12);
    }
}
