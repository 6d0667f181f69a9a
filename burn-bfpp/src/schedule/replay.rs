//! Dependency-driven replay of a schedule with blocking semantics: each rank runs its list in
//! order; a compute waits for its data, a send and its receive complete together (they must
//! meet). Given a duration per action it yields start/end times; when ranks stop making
//! progress it reports each blocked rank and what it waits for (a deadlock).
//!
//! The validator, the send/recv lowering pass, the grid printer and the simulator all use this
//! one engine, so "valid", "deadlock-free" and "what the timeline looks like" cannot disagree.

use std::collections::VecDeque;

use super::{Action, ActionKind, PipelineSchedule, ScheduleError};

/// One action with the times the replay gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedAction {
    /// The action.
    pub action: Action,
    /// When it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// The replayed actions of every rank, in each rank's execution order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    /// One list per rank.
    pub ranks: Vec<Vec<TimedAction>>,
}

impl Timeline {
    /// End of the last action on any rank.
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .filter_map(|r| r.last())
            .map(|t| t.end)
            .fold(0.0, f64::max)
    }
}

/// A rank that could not finish: where it stopped and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// The rank.
    pub rank: usize,
    /// Index of the blocked action in the rank's list.
    pub position: usize,
    /// The blocked action.
    pub action: Action,
    /// What it waits for, in words.
    pub waits_for: String,
}

/// What a replay produced: the (possibly partial) timeline, and the blocked ranks if it deadlocked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayOutcome {
    /// Times of every action that ran.
    pub timeline: Timeline,
    /// Ranks that stopped before the end of their list; empty when the schedule completed.
    pub blocked: Vec<Blocked>,
}

impl ReplayOutcome {
    /// True when every rank finished its list.
    pub fn completed(&self) -> bool {
        self.blocked.is_empty()
    }
}

/// How a send behaves in a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendMode {
    /// A send blocks until its receive is posted, and both complete together (rendezvous).
    /// The strictest semantics: a schedule that completes under it completes under any
    /// buffering, so the validator uses it to prove deadlock freedom.
    Blocking,
    /// A send completes when issued; its data reaches the receiver after the send's cost, and
    /// the receive completes once the data is there. This is how the executor and the
    /// simulator move activations, so timings (makespan, bubble) come from this mode.
    Eager,
}

/// The unit cost model of the closed forms: a stage forward takes 1, a full backward 2, the
/// split halves `I` and `W` 1 each; transfers and collectives are free.
pub fn unit_cost(_rank: usize, action: &Action) -> f64 {
    match action.kind {
        ActionKind::Forward => 1.0,
        ActionKind::Backward => 2.0,
        ActionKind::BackwardInput | ActionKind::BackwardWeight => 1.0,
        _ => 0.0,
    }
}

const NOT_DONE: f64 = f64::NAN;

/// Completion times of the facts ranks wait on, one slot per (stage, micro-batch).
struct Facts {
    mbs: usize,
    forward: Vec<f64>,
    input_grad: Vec<f64>,
    recv_forward: Vec<f64>,
    recv_backward: Vec<f64>,
    /// Eager mode: arrival time of the data a stage's `RECV_F` / `RECV_B` waits for.
    arrived_forward: Vec<f64>,
    arrived_backward: Vec<f64>,
}

impl Facts {
    fn new(stages: usize, mbs: usize) -> Self {
        let n = stages * mbs;
        Facts {
            mbs,
            forward: vec![NOT_DONE; n],
            input_grad: vec![NOT_DONE; n],
            recv_forward: vec![NOT_DONE; n],
            recv_backward: vec![NOT_DONE; n],
            arrived_forward: vec![NOT_DONE; n],
            arrived_backward: vec![NOT_DONE; n],
        }
    }
    fn idx(&self, stage: usize, mb: usize) -> usize {
        stage * self.mbs + mb
    }
}

enum Step {
    /// The action ran; `partner` is a rank that also advanced (a rendezvous).
    Ran {
        partner: Option<usize>,
    },
    Blocked(String),
}

struct Replayer<'a, C: Fn(usize, &Action) -> f64> {
    sched: &'a PipelineSchedule,
    cost: C,
    explicit_p2p: bool,
    mode: SendMode,
    /// Whether blocked steps explain themselves; off in the hot loop, where formatting a
    /// message for every wait would cost more than the replay itself.
    explain: bool,
    pos: Vec<usize>,
    clock: Vec<f64>,
    facts: Facts,
    timeline: Vec<Vec<TimedAction>>,
}

impl<C: Fn(usize, &Action) -> f64> Replayer<'_, C> {
    fn head(&self, rank: usize) -> Option<&Action> {
        self.sched.ranks[rank].get(self.pos[rank])
    }

    /// The matching receive of a send, and the rank that must run it.
    fn partner_of(&self, a: &Action) -> Option<(Action, usize)> {
        let mb = a.mb();
        let (stage, kind) = match a.kind {
            ActionKind::SendForward => (a.stage + 1, ActionKind::RecvForward),
            ActionKind::RecvForward => (a.stage.checked_sub(1)?, ActionKind::SendForward),
            ActionKind::SendBackward => (a.stage.checked_sub(1)?, ActionKind::RecvBackward),
            ActionKind::RecvBackward => (a.stage + 1, ActionKind::SendBackward),
            _ => return None,
        };
        let rank = *self.sched.stage_ranks.get(stage)?;
        Some((Action::new(stage, kind, mb), rank))
    }

    /// The reason for a wait, built only when explanations are on.
    fn why(&self, reason: impl FnOnce() -> String) -> String {
        if self.explain {
            reason()
        } else {
            String::new()
        }
    }

    fn describe_rank(&self, rank: usize) -> String {
        match self.head(rank) {
            Some(a) => format!("its next action is {a}"),
            None => "it has finished its list".into(),
        }
    }

    /// Time at which `stage`'s input for `mb` is available to `rank`, if it is.
    fn forward_input(&self, rank: usize, stage: usize, mb: usize) -> Result<f64, String> {
        if stage == 0 {
            return Ok(0.0);
        }
        let prev_rank = self.sched.stage_ranks[stage - 1];
        let (t, what) = if self.explicit_p2p && prev_rank != rank {
            (
                self.facts.recv_forward[self.facts.idx(stage, mb)],
                Action::new(stage, ActionKind::RecvForward, mb),
            )
        } else {
            (
                self.facts.forward[self.facts.idx(stage - 1, mb)],
                Action::forward(stage - 1, mb),
            )
        };
        if t.is_nan() {
            let owner = self.sched.stage_ranks[what.stage];
            Err(self.why(|| {
                format!(
                    "waits for {what} on rank {owner} ({})",
                    self.describe_rank(owner)
                )
            }))
        } else {
            Ok(t)
        }
    }

    /// Time at which the gradient of `stage`'s output for `mb` is available to `rank`.
    fn output_grad(&self, rank: usize, stage: usize, mb: usize) -> Result<f64, String> {
        if stage + 1 == self.sched.num_stages() {
            return Ok(0.0);
        }
        let next_rank = self.sched.stage_ranks[stage + 1];
        let (t, what) = if self.explicit_p2p && next_rank != rank {
            (
                self.facts.recv_backward[self.facts.idx(stage, mb)],
                Action::new(stage, ActionKind::RecvBackward, mb),
            )
        } else {
            (
                self.facts.input_grad[self.facts.idx(stage + 1, mb)],
                Action::backward(stage + 1, mb),
            )
        };
        if t.is_nan() {
            let owner = self.sched.stage_ranks[what.stage];
            Err(self.why(|| {
                format!(
                    "waits for {what} (or its I) on rank {owner} ({})",
                    self.describe_rank(owner)
                )
            }))
        } else {
            Ok(t)
        }
    }

    fn own_fact(
        &self,
        table: &[f64],
        what: Action,
        stage: usize,
        mb: usize,
    ) -> Result<f64, String> {
        let t = table[self.facts.idx(stage, mb)];
        if t.is_nan() {
            Err(self.why(|| format!("waits for {what}, which this rank has not run before it")))
        } else {
            Ok(t)
        }
    }

    /// When the inputs of compute `a` on `rank` are there, or what it waits for.
    fn compute_ready(&self, rank: usize, a: Action) -> Result<f64, String> {
        let (s, mb) = (a.stage, a.mb());
        match a.kind {
            ActionKind::Forward => self.forward_input(rank, s, mb),
            ActionKind::Backward | ActionKind::BackwardInput => self
                .own_fact(&self.facts.forward, Action::forward(s, mb), s, mb)
                .and_then(|t| Ok(t.max(self.output_grad(rank, s, mb)?))),
            ActionKind::BackwardWeight => self.own_fact(
                &self.facts.input_grad,
                Action::new(s, ActionKind::BackwardInput, mb),
                s,
                mb,
            ),
            _ => Err(self.why(|| format!("{a} is not a compute"))),
        }
    }

    /// An overlapped pair runs as one unit: it starts once both halves' inputs are there, and
    /// both outputs count as produced when the pair ends, since they leave after it.
    fn try_pair(&mut self, rank: usize, first: Action) -> Step {
        let second = match self.sched.ranks[rank].get(self.pos[rank] + 1) {
            Some(&b) if b.kind.is_compute() => b,
            other => {
                return Step::Blocked(self.why(|| {
                    let found = other.map_or("the end of the list".to_string(), |b| b.to_string());
                    format!(
                        "{first} opens an OVERLAP_F_B pair, but {found} follows it instead of \
                         a compute"
                    )
                }))
            }
        };
        let ready = match self
            .compute_ready(rank, first)
            .and_then(|t| Ok(t.max(self.compute_ready(rank, second)?)))
        {
            Ok(t) => t.max(self.clock[rank]),
            Err(why) => return Step::Blocked(why),
        };
        let middle = ready + (self.cost)(rank, &first);
        let end = middle + (self.cost)(rank, &second);
        self.record(rank, first, ready, middle, end);
        self.record(rank, second, middle, end, end);
        Step::Ran { partner: None }
    }

    fn try_step(&mut self, rank: usize) -> Step {
        let Some(&a) = self.head(rank) else {
            return Step::Blocked(String::new());
        };
        if a.overlaps_next {
            return self.try_pair(rank, a);
        }
        let (s, mb) = (a.stage, a.mb());
        let ready = match a.kind {
            k if k.is_compute() => self.compute_ready(rank, a),
            ActionKind::SendForward => {
                self.own_fact(&self.facts.forward, Action::forward(s, mb), s, mb)
            }
            ActionKind::SendBackward => {
                self.own_fact(&self.facts.input_grad, Action::backward(s, mb), s, mb)
            }
            _ => Ok(0.0),
        };
        let ready = match ready {
            Ok(t) => t.max(self.clock[rank]),
            Err(why) => return Step::Blocked(why),
        };
        if a.kind.is_p2p() {
            let Some((want, peer)) = self.partner_of(&a) else {
                return Step::Blocked(
                    self.why(|| format!("{a} has no peer stage; nothing can match it")),
                );
            };
            if self.mode == SendMode::Eager {
                return self.eager_p2p(rank, a, want, peer, ready);
            }
            if self.head(peer) != Some(&want) {
                return Step::Blocked(self.why(|| {
                    format!(
                        "waits for rank {peer} to reach {want} ({})",
                        self.describe_rank(peer)
                    )
                }));
            }
            // The peer's side of a receive has no data precondition; a send's does.
            let peer_ready = if want.kind == ActionKind::SendForward {
                match self.own_fact(
                    &self.facts.forward,
                    Action::forward(want.stage, mb),
                    want.stage,
                    mb,
                ) {
                    Ok(t) => t,
                    Err(why) => {
                        return Step::Blocked(self.why(|| format!("its peer rank {peer} {why}")))
                    }
                }
            } else if want.kind == ActionKind::SendBackward {
                match self.own_fact(
                    &self.facts.input_grad,
                    Action::backward(want.stage, mb),
                    want.stage,
                    mb,
                ) {
                    Ok(t) => t,
                    Err(why) => {
                        return Step::Blocked(self.why(|| format!("its peer rank {peer} {why}")))
                    }
                }
            } else {
                0.0
            };
            let start = ready.max(peer_ready).max(self.clock[peer]);
            let end = start + (self.cost)(rank, &a).max((self.cost)(peer, &want));
            self.finish(peer, want, start, end);
            self.finish(rank, a, start, end);
            return Step::Ran {
                partner: Some(peer),
            };
        }
        let end = ready + (self.cost)(rank, &a);
        self.finish(rank, a, ready, end);
        Step::Ran { partner: None }
    }

    /// A transfer under [`SendMode::Eager`]: sends never wait; receives wait for the data.
    fn eager_p2p(&mut self, rank: usize, a: Action, want: Action, peer: usize, ready: f64) -> Step {
        let cost = (self.cost)(rank, &a);
        let is_send = matches!(a.kind, ActionKind::SendForward | ActionKind::SendBackward);
        if is_send {
            let slot = self.facts.idx(want.stage, want.mb());
            let table = if a.kind == ActionKind::SendForward {
                &mut self.facts.arrived_forward
            } else {
                &mut self.facts.arrived_backward
            };
            table[slot] = ready + cost;
            self.finish(rank, a, ready, ready + cost);
            return Step::Ran {
                partner: Some(peer),
            };
        }
        let slot = self.facts.idx(a.stage, a.mb());
        let arrived = if a.kind == ActionKind::RecvForward {
            self.facts.arrived_forward[slot]
        } else {
            self.facts.arrived_backward[slot]
        };
        if arrived.is_nan() {
            return Step::Blocked(self.why(|| {
                format!(
                    "waits for {want} on rank {peer} ({})",
                    self.describe_rank(peer)
                )
            }));
        }
        let start = ready.max(arrived);
        self.finish(rank, a, start, start);
        Step::Ran { partner: None }
    }

    fn finish(&mut self, rank: usize, a: Action, start: f64, end: f64) {
        self.record(rank, a, start, end, end);
    }

    /// Record `a` as run from `start` to `end`, its output available from `produced`.
    fn record(&mut self, rank: usize, a: Action, start: f64, end: f64, produced: f64) {
        let i = self.facts.idx(a.stage, a.mb());
        match a.kind {
            ActionKind::Forward => self.facts.forward[i] = produced,
            ActionKind::Backward | ActionKind::BackwardInput => self.facts.input_grad[i] = produced,
            ActionKind::RecvForward => self.facts.recv_forward[i] = produced,
            ActionKind::RecvBackward => self.facts.recv_backward[i] = produced,
            _ => {}
        }
        self.timeline[rank].push(TimedAction {
            action: a,
            start,
            end,
        });
        self.clock[rank] = end;
        self.pos[rank] += 1;
    }
}

/// Replay `schedule` with `cost(rank, action)` as each action's duration and `mode` for sends.
///
/// Fails only when an action names a stage or micro-batch outside the schedule; a deadlock is
/// a successful replay whose [`ReplayOutcome::blocked`] is non-empty.
pub fn replay(
    schedule: &PipelineSchedule,
    mode: SendMode,
    cost: impl Fn(usize, &Action) -> f64,
) -> Result<ReplayOutcome, ScheduleError> {
    let (stages, mbs) = (schedule.num_stages(), schedule.microbatches);
    for (rank, list) in schedule.ranks.iter().enumerate() {
        for a in list {
            if a.stage >= stages || a.microbatch.is_some_and(|m| m >= mbs) {
                return Err(ScheduleError::Invalid {
                    report: format!(
                        "rank {rank} has {a}, outside the schedule's {stages} stages × {mbs} micro-batches"
                    ),
                });
            }
        }
    }
    let n = schedule.num_ranks();
    let mut r = Replayer {
        sched: schedule,
        cost,
        explicit_p2p: schedule.has_p2p(),
        mode,
        explain: false,
        pos: vec![0; n],
        clock: vec![0.0; n],
        facts: Facts::new(stages, mbs),
        timeline: schedule
            .ranks
            .iter()
            .map(|l| Vec::with_capacity(l.len()))
            .collect(),
    };
    // Ranks whose head may have become runnable. A completion on stage s can only unblock the
    // ranks of stages s-1 and s+1 (and the rank itself, which keeps running).
    let mut queue: VecDeque<usize> = (0..n).collect();
    let mut queued = vec![true; n];
    let wake = |rank: usize, queue: &mut VecDeque<usize>, queued: &mut Vec<bool>| {
        if !queued[rank] {
            queued[rank] = true;
            queue.push_back(rank);
        }
    };
    while let Some(rank) = queue.pop_front() {
        queued[rank] = false;
        while r.pos[rank] < r.sched.ranks[rank].len() {
            let list = &r.sched.ranks[rank];
            let head = list[r.pos[rank]];
            // A pair's second half touches its own stage's neighbours too.
            let second = head
                .overlaps_next
                .then(|| list.get(r.pos[rank] + 1).map(|a| a.stage))
                .flatten();
            match r.try_step(rank) {
                Step::Ran { partner, .. } => {
                    if let Some(p) = partner {
                        wake(p, &mut queue, &mut queued);
                    }
                    for stage in std::iter::once(head.stage).chain(second) {
                        if stage > 0 {
                            wake(r.sched.stage_ranks[stage - 1], &mut queue, &mut queued);
                        }
                        if stage + 1 < stages {
                            wake(r.sched.stage_ranks[stage + 1], &mut queue, &mut queued);
                        }
                    }
                }
                Step::Blocked(_) => break,
            }
        }
    }
    let mut blocked = Vec::new();
    r.explain = true;
    for rank in 0..n {
        if let Some(&action) = r.head(rank) {
            let waits_for = match r.try_step(rank) {
                Step::Blocked(why) => why,
                // Cannot happen: the queue empties only when no rank can advance.
                Step::Ran { .. } => "was runnable when the replay stopped (replay bug)".into(),
            };
            blocked.push(Blocked {
                rank,
                position: r.pos[rank],
                action,
                waits_for,
            });
        }
    }
    Ok(ReplayOutcome {
        timeline: Timeline { ranks: r.timeline },
        blocked,
    })
}
