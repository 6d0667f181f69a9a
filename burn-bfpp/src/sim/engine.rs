//! The event engine: walks every rank's lowered list once, in order, giving each action a
//! start and end on its stream (see the module docs of [`crate::sim`] for the rules).
//!
//! Why one pass in list order is exact: every dependency of an action is either on its own
//! rank and earlier in the list (a producer compute, the stage's `UNSHARD`, a `RESHARD`, a
//! `REDUCE_GRAD`), or the arrival of a message sent by another rank. Streams run their actions
//! in list order, so a stream's clock when an action is reached is the end of its
//! predecessor on that stream. A rank whose next action needs a message not yet sent waits
//! (in processing order, not in simulated time) until the sender's `SEND` is processed, as
//! the schedule replay does; sends never wait for receives, so a schedule that is deadlock
//! free under blocking sends (what the validator proves) completes here.

use std::collections::{HashMap, VecDeque};

use crate::schedule::{Action, ActionKind, PipelineSchedule, ZeroLevel};

use super::check::{check_costs, check_schedule};
use super::cost_table::CostTable;
use super::memory::Ledger;
use super::result::{Interval, RankTrace, SimResult, TraceItem};
use super::{Execution, SimConfig, SimError};

mod summary;

const UNKNOWN: f64 = f64::NAN;

/// One rank's streams and bookkeeping.
struct RankState {
    pos: usize,
    compute_free: f64,
    send_free: f64,
    dp_free: f64,
    /// End of the latest `UNSHARD` of each stage (NaN: none yet), indexed by global stage.
    unshard_end: Vec<f64>,
    /// End of the latest weight-gradient compute of each stage.
    wgrad_end: Vec<f64>,
    /// Whether each stage's gathered weights are held (ZeRO-3 memory accounting).
    gathered: Vec<bool>,
    /// Whether each stage holds an open full-size gradient buffer (ZeRO-2/3).
    grad_open: Vec<bool>,
    /// Times of `RESHARD`s not yet claimed by a later `UNSHARD`.
    reshards: VecDeque<f64>,
    /// Times at which gradient buffers became free, oldest first (ZeRO-2/3).
    grad_free: VecDeque<f64>,
    busy: f64,
    exposed_p2p: f64,
    exposed_dp: f64,
    memory: Ledger,
    /// Gathered full-size weights only (part of `memory`), for the parameter-bytes peak.
    weights: Ledger,
    activations: Ledger,
    gathers: usize,
    reductions: usize,
    trace: RankTrace,
}

enum Step {
    Ran,
    /// Waits for a message from another rank.
    Blocked,
}

struct Engine<'a> {
    sched: &'a PipelineSchedule,
    costs: &'a CostTable,
    /// Per-action durations that replace the table's per-stage figures.
    measured: Option<&'a ActionDurations>,
    zero: ZeroLevel,
    /// One stream per rank ([`Execution::Serial`]).
    serial: bool,
    elem: u64,
    mbs: usize,
    f_end: Vec<f64>,
    ig_end: Vec<f64>,
    /// Arrival at the next stage's rank of F(s, m)'s output, and when its send started.
    fwd_arrival: Vec<f64>,
    fwd_sent: Vec<f64>,
    /// Arrival at the previous stage's rank of B/I(s, m)'s input gradient.
    bwd_arrival: Vec<f64>,
    bwd_sent: Vec<f64>,
    ranks: Vec<RankState>,
}

/// The measured duration of `a` if there is one, else the table's figure `table`.
fn duration(measured: Option<&ActionDurations>, a: Action, table: f64) -> f64 {
    measured
        .and_then(|m| m.get(&a.alone()))
        .copied()
        .unwrap_or(table)
}

fn missing(rank: usize, a: Action, what: Action) -> SimError {
    SimError::Schedule(format!(
        "rank {rank} runs {a} before {what}, which it needs and must run itself first; \
         validate the schedule"
    ))
}

impl Engine<'_> {
    fn idx(&self, stage: usize, mb: usize) -> usize {
        stage * self.mbs + mb
    }

    fn local(&self, table: &[f64], rank: usize, a: Action, what: Action) -> Result<f64, SimError> {
        let t = table[self.idx(what.stage, what.mb())];
        if t.is_nan() {
            Err(missing(rank, a, what))
        } else {
            Ok(t)
        }
    }

    /// (produced, arrived) of a compute's inputs, or `None` while a message is not yet sent.
    fn inputs(&self, rank: usize, a: Action) -> Result<Option<(f64, f64)>, SimError> {
        let (s, m) = (a.stage, a.mb());
        let owner = &self.sched.stage_ranks;
        let last = self.sched.num_stages() - 1;
        match a.kind {
            ActionKind::Forward if s == 0 => Ok(Some((0.0, 0.0))),
            ActionKind::Forward if owner[s - 1] == rank => {
                let t = self.local(&self.f_end, rank, a, Action::forward(s - 1, m))?;
                Ok(Some((t, t)))
            }
            ActionKind::Forward => {
                let arrived = self.fwd_arrival[self.idx(s - 1, m)];
                Ok((!arrived.is_nan()).then(|| (self.f_end[self.idx(s - 1, m)], arrived)))
            }
            ActionKind::Backward | ActionKind::BackwardInput => {
                let own = self.local(&self.f_end, rank, a, Action::forward(s, m))?;
                let grad = if s == last {
                    Some((0.0, 0.0))
                } else if owner[s + 1] == rank {
                    let t = self.local(&self.ig_end, rank, a, Action::backward(s + 1, m))?;
                    Some((t, t))
                } else {
                    let arrived = self.bwd_arrival[self.idx(s + 1, m)];
                    (!arrived.is_nan()).then(|| (self.ig_end[self.idx(s + 1, m)], arrived))
                };
                Ok(grad.map(|(p, r)| (p.max(own), r.max(own))))
            }
            _ => {
                let what = Action::new(s, ActionKind::BackwardInput, m);
                let t = self.local(&self.ig_end, rank, a, what)?;
                Ok(Some((t, t)))
            }
        }
    }

    fn compute(&mut self, rank: usize, a: Action) -> Result<Step, SimError> {
        let Some((produced, arrived)) = self.inputs(rank, a)? else {
            return Ok(Step::Blocked);
        };
        let (s, m) = (a.stage, a.mb());
        let c = self.costs;
        let full_grad_bytes = c.parameters[s] * self.elem;
        let st = &mut self.ranks[rank];
        // A weight pass reads what its I kept, not the stage's weights.
        let mut dp_ready = if st.unshard_end[s].is_nan() || !a.kind.reads_weights() {
            0.0
        } else {
            st.unshard_end[s]
        };
        let opens_buffer =
            self.zero >= ZeroLevel::Zero2 && a.kind.produces_weight_grad() && !st.grad_open[s];
        if opens_buffer {
            let free = st.grad_free.pop_front().ok_or_else(|| {
                SimError::Schedule(format!(
                    "rank {rank}: {a} needs a gradient buffer but all are in use; set \
                     grad_buffers to the value the schedule was lowered with"
                ))
            })?;
            dp_ready = dp_ready.max(free);
            st.grad_open[s] = true;
        }
        let start = st.compute_free.max(arrived).max(dp_ready);
        st.exposed_p2p += (arrived - st.compute_free.max(produced)).max(0.0);
        st.exposed_dp += (start - st.compute_free.max(arrived)).max(0.0);
        let duration = duration(
            self.measured,
            a,
            match a.kind {
                ActionKind::Forward => c.forward[s],
                ActionKind::Backward => c.backward[s],
                ActionKind::BackwardInput => c.backward_input[s],
                _ => c.backward_weight[s],
            },
        );
        let end = start + duration;
        st.compute_free = end;
        st.busy += duration;
        if opens_buffer {
            st.memory.alloc(start, full_grad_bytes);
        }
        st.trace.compute.push(Interval {
            item: TraceItem::Action(a),
            start,
            end,
        });
        // A received message is consumed (copied into the stage's saved input, or used up
        // by the backward) when the compute starts.
        let owner = &self.sched.stage_ranks;
        match a.kind {
            ActionKind::Forward if s > 0 && owner[s - 1] != rank => {
                st.memory.free(start, c.message_bytes[s - 1])
            }
            ActionKind::Backward | ActionKind::BackwardInput
                if s + 1 < owner.len() && owner[s + 1] != rank =>
            {
                st.memory.free(start, c.message_bytes[s])
            }
            _ => {}
        }
        match a.kind {
            ActionKind::Forward => {
                st.memory.alloc(end, c.activation_bytes[s]);
                st.activations.alloc(end, 1);
            }
            ActionKind::Backward => {
                st.memory.free(end, c.activation_bytes[s]);
                st.activations.free(end, 1);
            }
            // A split backward frees all but what its W needs, and W the rest.
            // (`check_costs` holds `weight_grad_bytes` to at most `activation_bytes`.)
            ActionKind::BackwardInput => {
                st.memory
                    .free(end, c.activation_bytes[s] - c.weight_grad_bytes[s]);
            }
            ActionKind::BackwardWeight => {
                st.memory.free(end, c.weight_grad_bytes[s]);
                st.activations.free(end, 1);
            }
            _ => {}
        }
        if a.kind.produces_weight_grad() {
            st.wgrad_end[s] = end;
        }
        let i = self.idx(s, m);
        match a.kind {
            ActionKind::Forward => self.f_end[i] = end,
            ActionKind::Backward | ActionKind::BackwardInput => self.ig_end[i] = end,
            _ => {}
        }
        Ok(Step::Ran)
    }

    /// A send; returns the rank to wake.
    fn send(&mut self, rank: usize, a: Action) -> Result<usize, SimError> {
        let (s, m) = (a.stage, a.mb());
        let stages = self.sched.num_stages();
        let forward = a.kind == ActionKind::SendForward;
        let (boundary, peer_stage) = match forward {
            true if s + 1 < stages => (s, s + 1),
            false if s > 0 => (s - 1, s - 1),
            _ => {
                return Err(SimError::Schedule(format!(
                    "rank {rank} has {a}, which has no peer stage"
                )))
            }
        };
        let data = if forward {
            self.local(&self.f_end, rank, a, Action::forward(s, m))?
        } else {
            self.local(&self.ig_end, rank, a, Action::backward(s, m))?
        };
        let i = self.idx(s, m);
        let peer = self.sched.stage_ranks[peer_stage];
        let bytes = self.costs.message_bytes[boundary];
        let st = &mut self.ranks[rank];
        let start = st.send_free.max(data);
        let end = start + duration(self.measured, a, self.costs.transfer[boundary]);
        st.send_free = end;
        // The sender keeps the outgoing tensor until it is on the wire.
        st.memory.alloc(data, bytes);
        st.memory.free(end, bytes);
        st.trace.p2p.push(Interval {
            item: TraceItem::Action(a),
            start,
            end,
        });
        // The receiver's buffer is allocated when the transfer starts.
        self.ranks[peer].memory.alloc(start, bytes);
        if forward {
            self.fwd_arrival[i] = end;
            self.fwd_sent[i] = start;
        } else {
            self.bwd_arrival[i] = end;
            self.bwd_sent[i] = start;
        }
        Ok(peer)
    }

    fn recv(&mut self, rank: usize, a: Action) -> Result<Step, SimError> {
        let (s, m) = (a.stage, a.mb());
        let from = match a.kind {
            ActionKind::RecvForward => s.checked_sub(1),
            _ => Some(s + 1).filter(|&n| n < self.sched.num_stages()),
        };
        let Some(from) = from else {
            return Err(SimError::Schedule(format!(
                "rank {rank} has {a}, which has no peer stage"
            )));
        };
        let i = self.idx(from, m);
        let (arrived, sent) = if a.kind == ActionKind::RecvForward {
            (self.fwd_arrival[i], self.fwd_sent[i])
        } else {
            (self.bwd_arrival[i], self.bwd_sent[i])
        };
        if arrived.is_nan() {
            return Ok(Step::Blocked);
        }
        if self.serial {
            // The rank's one thread waits for the message, then unpacks it.
            let st = &mut self.ranks[rank];
            st.compute_free = st.compute_free.max(arrived) + duration(self.measured, a, 0.0);
        }
        self.ranks[rank].trace.p2p.push(Interval {
            item: TraceItem::Action(a),
            start: sent,
            end: arrived,
        });
        Ok(Step::Ran)
    }

    fn collective(&mut self, rank: usize, a: Action) {
        let s = a.stage;
        let c = self.costs;
        let weight_bytes = c.parameters[s] * self.elem;
        let zero3 = self.zero == ZeroLevel::Zero3;
        let zero2 = self.zero >= ZeroLevel::Zero2;
        let st = &mut self.ranks[rank];
        match a.kind {
            ActionKind::Unshard => {
                // Reuse the buffer of the oldest free not yet taken.
                let claim = st.reshards.pop_front().unwrap_or(0.0);
                let start = st.dp_free.max(claim);
                let end = start + duration(self.measured, a, c.gather[s]);
                st.dp_free = end;
                st.unshard_end[s] = end;
                st.gathers += 1;
                if zero3 && !st.gathered[s] {
                    st.memory.alloc(start, weight_bytes);
                    st.weights.alloc(start, weight_bytes);
                    st.gathered[s] = true;
                }
                st.trace.dp.push(Interval {
                    item: TraceItem::Action(a),
                    start,
                    end,
                });
            }
            ActionKind::Reshard => {
                let gathered = if st.unshard_end[s].is_nan() {
                    0.0
                } else {
                    st.unshard_end[s]
                };
                let t = st.compute_free.max(gathered);
                st.reshards.push_back(t);
                if st.gathered[s] {
                    st.memory.free(t, weight_bytes);
                    st.weights.free(t, weight_bytes);
                    st.gathered[s] = false;
                }
                st.trace.compute.push(Interval {
                    item: TraceItem::Action(a),
                    start: t,
                    end: t,
                });
            }
            _ => {
                // Issued in program order: after every compute before it in the list (in a
                // lowered list that is the stage's last weight-gradient compute; a deferred
                // reduction, Megatron-LM's way, waits for the whole backward).
                let ready = if st.wgrad_end[s].is_nan() {
                    st.compute_free
                } else {
                    st.wgrad_end[s].max(st.compute_free)
                };
                let start = st.dp_free.max(ready);
                let end = start + duration(self.measured, a, c.reduce[s]);
                st.dp_free = end;
                st.reductions += 1;
                if zero2 {
                    st.grad_free.push_back(end);
                    if st.grad_open[s] {
                        st.memory.free(end, weight_bytes);
                        st.grad_open[s] = false;
                    }
                }
                st.trace.dp.push(Interval {
                    item: TraceItem::Action(a),
                    start,
                    end,
                });
            }
        }
    }

    /// Run the head of `rank`'s list; `Some(peer)` when a send may have unblocked `peer`.
    fn step(&mut self, rank: usize, a: Action) -> Result<(Step, Option<usize>), SimError> {
        let outcome = self.run_action(rank, a)?;
        if self.serial && matches!(outcome.0, Step::Ran) {
            // Whatever stream the action used, the rank's next action starts after it.
            let st = &mut self.ranks[rank];
            let t = st.compute_free.max(st.send_free).max(st.dp_free);
            (st.compute_free, st.send_free, st.dp_free) = (t, t, t);
        }
        Ok(outcome)
    }

    fn run_action(&mut self, rank: usize, a: Action) -> Result<(Step, Option<usize>), SimError> {
        Ok(match a.kind {
            k if k.is_compute() => (self.compute(rank, a)?, None),
            ActionKind::SendForward | ActionKind::SendBackward => {
                (Step::Ran, Some(self.send(rank, a)?))
            }
            ActionKind::RecvForward | ActionKind::RecvBackward => (self.recv(rank, a)?, None),
            _ => {
                self.collective(rank, a);
                (Step::Ran, None)
            }
        })
    }
}

/// Simulate one optimizer step of a lowered schedule (see [`crate::sim`] for the semantics).
///
/// Fails on an invalid configuration, on a schedule that is not lowered for the
/// configuration's ZeRO level, and on one that deadlocks or runs a compute before its own
/// inputs.
pub fn simulate(schedule: &PipelineSchedule, cfg: &SimConfig) -> Result<SimResult, SimError> {
    cfg.check()?;
    let costs = CostTable::new(
        cfg,
        &schedule.stage_ranks,
        schedule.num_ranks(),
        schedule.microbatches,
    )?;
    simulate_costed(schedule, cfg, &costs, None)
}

/// Durations of individual actions (seconds), e.g. measured by the training engine, keyed
/// by the action outside any pair ([`Action::alone`]): a half of an overlapped pair takes the
/// duration recorded for its action, however the recorder spelled the pair.
pub type ActionDurations = HashMap<Action, f64>;

/// Simulate with an explicit cost table (sizes, and durations per stage) and, optionally,
/// per-action durations that take precedence over it: feeding a run's measured durations
/// replays that run under the simulator's stream and dependency rules.
///
/// `cfg` still supplies the ZeRO level, data-parallel size, element type and gradient
/// buffers; the table must have one entry per stage (and `optimizer` one per rank).
pub fn simulate_costed(
    schedule: &PipelineSchedule,
    cfg: &SimConfig,
    costs: &CostTable,
    measured: Option<&ActionDurations>,
) -> Result<SimResult, SimError> {
    cfg.check()?;
    check_schedule(schedule, cfg)?;
    let (n, stages, mbs) = (
        schedule.num_ranks(),
        schedule.num_stages(),
        schedule.microbatches,
    );
    check_costs(costs, stages, n)?;
    let slots = stages * mbs;
    let zero2 = cfg.zero >= ZeroLevel::Zero2;
    let mut engine = Engine {
        sched: schedule,
        costs,
        measured,
        zero: cfg.zero,
        serial: cfg.execution == Execution::Serial,
        elem: cfg.dtype.bytes(),
        mbs,
        f_end: vec![UNKNOWN; slots],
        ig_end: vec![UNKNOWN; slots],
        fwd_arrival: vec![UNKNOWN; slots],
        fwd_sent: vec![UNKNOWN; slots],
        bwd_arrival: vec![UNKNOWN; slots],
        bwd_sent: vec![UNKNOWN; slots],
        ranks: schedule
            .ranks
            .iter()
            .zip(&costs.start)
            .map(|(list, &start)| RankState {
                pos: 0,
                compute_free: start,
                send_free: start,
                dp_free: start,
                unshard_end: vec![UNKNOWN; stages],
                wgrad_end: vec![UNKNOWN; stages],
                gathered: vec![false; stages],
                grad_open: vec![false; stages],
                reshards: VecDeque::new(),
                grad_free: if zero2 {
                    vec![0.0; cfg.grad_buffers].into()
                } else {
                    VecDeque::new()
                },
                busy: 0.0,
                exposed_p2p: 0.0,
                exposed_dp: 0.0,
                memory: Ledger::default(),
                weights: Ledger::default(),
                activations: Ledger::default(),
                gathers: 0,
                reductions: 0,
                trace: RankTrace {
                    compute: Vec::with_capacity(list.len()),
                    p2p: Vec::new(),
                    dp: Vec::new(),
                },
            })
            .collect(),
    };
    let mut queue: VecDeque<usize> = (0..n).collect();
    let mut queued = vec![true; n];
    while let Some(rank) = queue.pop_front() {
        queued[rank] = false;
        let list = &schedule.ranks[rank];
        while let Some(&a) = list.get(engine.ranks[rank].pos) {
            let (step, wake) = engine.step(rank, a)?;
            if let Some(peer) = wake {
                if !queued[peer] && peer != rank {
                    queued[peer] = true;
                    queue.push_back(peer);
                }
            }
            match step {
                Step::Ran => engine.ranks[rank].pos += 1,
                Step::Blocked => break,
            }
        }
    }
    let stuck: Vec<String> = engine
        .ranks
        .iter()
        .enumerate()
        .filter_map(|(r, st)| {
            schedule.ranks[r]
                .get(st.pos)
                .map(|a| format!("rank {r} waits at {a} (position {})", st.pos))
        })
        .collect();
    if !stuck.is_empty() {
        return Err(SimError::Schedule(format!(
            "the schedule deadlocks (a receive whose send never comes): {}",
            stuck.join("; ")
        )));
    }
    Ok(summary::finish(engine.ranks, schedule, cfg, costs))
}
