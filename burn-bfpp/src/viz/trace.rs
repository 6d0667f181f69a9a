//! The neutral data model every picture is drawn from: lanes of timed spans per rank and
//! stream, and memory series per rank.
//!
//! The executor, the schedule replay and the simulator each record times in their own type;
//! converting all three into one [`Trace`] is what makes measured and simulated pictures
//! directly comparable (same lanes, same colours, same Chrome trace layout).

use crate::schedule::TimedEvent;
use crate::schedule::{Action, ActionKind, Timeline};
use crate::sim::{Interval, SimResult, TraceItem};

/// What the numbers on a trace's time axis mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeUnit {
    /// Seconds (measured runs, simulations of a real model).
    Seconds,
    /// Abstract units of a cost model (the unit replay, the simulator's `unit` model).
    Units,
}

/// Which of a rank's three streams a span ran on.
///
/// Ordered as drawn: compute lane on top, then the thinner communication lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stream {
    /// `F`, `B`, `I`, `W` and the optimizer step.
    Compute,
    /// Point-to-point pipeline transfers (`SEND_*`, `RECV_*`).
    P2p,
    /// Data-parallel collectives (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`).
    DataParallel,
}

impl Stream {
    /// Every stream, in drawing order.
    pub const ALL: [Stream; 3] = [Stream::Compute, Stream::P2p, Stream::DataParallel];

    /// The stream an action runs on when the recorder does not say (executor, replay).
    pub fn of(kind: ActionKind) -> Stream {
        if kind.is_compute() {
            Stream::Compute
        } else if kind.is_p2p() {
            Stream::P2p
        } else {
            Stream::DataParallel
        }
    }

    /// Human-readable name: `compute`, `p2p`, `data-parallel` (Chrome trace thread names).
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::P2p => "p2p",
            Stream::DataParallel => "data-parallel",
        }
    }

    /// Stable small index (the Chrome trace `tid`).
    pub fn index(self) -> usize {
        match self {
            Stream::Compute => 0,
            Stream::P2p => 1,
            Stream::DataParallel => 2,
        }
    }
}

/// One busy interval of one stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// Start time, in the trace's [`TimeUnit`].
    pub start: f64,
    /// End time (equal to `start` for instantaneous actions such as a simulated `RESHARD`).
    pub end: f64,
    /// What ran. The simulator's optimizer step is not an [`Action`], so this reuses the
    /// simulator's [`TraceItem`] rather than inventing a parallel enum.
    pub item: TraceItem,
    /// Optimizer step the span belongs to (measured runs span several; `None` otherwise).
    pub step: Option<usize>,
}

impl Span {
    /// The action of the span, `None` for the optimizer step.
    pub fn action(&self) -> Option<Action> {
        match self.item {
            TraceItem::Action(a) => Some(a),
            TraceItem::OptimizerStep => None,
        }
    }

    /// The span's text: the action string (`4F1`, `2UNSHARD`) or `optimizer`.
    pub fn name(&self) -> String {
        match self.item {
            TraceItem::Action(a) => a.to_string(),
            TraceItem::OptimizerStep => "optimizer".to_string(),
        }
    }
}

/// The spans of one stream of one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Lane {
    /// Rank (world rank for measured runs, pipeline rank for replays and simulations).
    pub rank: usize,
    /// Which stream.
    pub stream: Stream,
    /// Busy intervals, in any order.
    pub spans: Vec<Span>,
}

/// Timed spans of every rank and stream, with what the times mean.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// Title drawn above the timeline and stored in the Chrome trace.
    pub title: String,
    /// Unit of every span's times.
    pub time_unit: TimeUnit,
    /// Lanes, ordered by rank then stream; renderers omit empty communication lanes.
    pub lanes: Vec<Lane>,
}

impl Trace {
    /// Three empty lanes for each of `ranks` ranks.
    fn empty(title: &str, time_unit: TimeUnit, ranks: usize) -> Trace {
        let lanes = (0..ranks)
            .flat_map(|rank| {
                Stream::ALL.into_iter().map(move |stream| Lane {
                    rank,
                    stream,
                    spans: Vec::new(),
                })
            })
            .collect();
        Trace {
            title: title.to_string(),
            time_unit,
            lanes,
        }
    }

    /// Add a span to a lane of [`Trace::empty`]'s layout.
    fn push(&mut self, rank: usize, stream: Stream, span: Span) {
        self.lanes[rank * Stream::ALL.len() + stream.index()]
            .spans
            .push(span);
    }

    /// The executor's measured actions, one list per world rank, in seconds. The stream of
    /// each action follows from its kind (the executor records no stream).
    pub fn from_engine(timelines: &[Vec<TimedEvent>]) -> Trace {
        let mut trace = Trace::empty("measured run", TimeUnit::Seconds, timelines.len());
        for (rank, events) in timelines.iter().enumerate() {
            for e in events {
                let span = Span {
                    start: e.start,
                    end: e.end,
                    item: TraceItem::Action(e.action),
                    step: Some(e.step),
                };
                trace.push(rank, Stream::of(e.action.kind), span);
            }
        }
        trace
    }

    /// A schedule replay's timeline, in cost-model units. The replay runs every action of a
    /// rank on one clock, so communication never overlaps compute here; it still gets its own
    /// lanes so the picture has the same layout as measured and simulated ones.
    pub fn from_replay(timeline: &Timeline) -> Trace {
        let mut trace = Trace::empty("schedule replay", TimeUnit::Units, timeline.ranks.len());
        for (rank, actions) in timeline.ranks.iter().enumerate() {
            for t in actions {
                let span = Span {
                    start: t.start,
                    end: t.end,
                    item: TraceItem::Action(t.action),
                    step: None,
                };
                trace.push(rank, Stream::of(t.action.kind), span);
            }
        }
        trace
    }

    /// A simulation's per-rank, per-stream intervals, kept on the streams the simulator put
    /// them on (its zero-length `RESHARD`s sit on the compute stream).
    pub fn from_sim(result: &SimResult) -> Trace {
        let unit = if result.unit_time {
            TimeUnit::Units
        } else {
            TimeUnit::Seconds
        };
        let mut trace = Trace::empty("simulated step", unit, result.trace.len());
        for (rank, streams) in result.trace.iter().enumerate() {
            let lists: [(Stream, &[Interval]); 3] = [
                (Stream::Compute, &streams.compute),
                (Stream::P2p, &streams.p2p),
                (Stream::DataParallel, &streams.dp),
            ];
            for (stream, list) in lists {
                for iv in list {
                    let span = Span {
                        start: iv.start,
                        end: iv.end,
                        item: iv.item,
                        step: None,
                    };
                    trace.push(rank, stream, span);
                }
            }
        }
        trace
    }

    /// The same trace with another title.
    pub fn with_title(mut self, title: impl Into<String>) -> Trace {
        self.title = title.into();
        self
    }

    /// Number of ranks (highest rank with a lane, plus one).
    pub fn num_ranks(&self) -> usize {
        self.lanes.iter().map(|l| l.rank + 1).max().unwrap_or(0)
    }

    /// Number of spans over all lanes.
    pub fn num_spans(&self) -> usize {
        self.lanes.iter().map(|l| l.spans.len()).sum()
    }

    /// Earliest start and latest end over all spans; `None` for a trace without spans.
    /// Non-finite times (a failed measurement) are ignored rather than poisoning the axis.
    pub fn time_range(&self) -> Option<(f64, f64)> {
        let mut range: Option<(f64, f64)> = None;
        for s in self.lanes.iter().flat_map(|l| &l.spans) {
            if !(s.start.is_finite() && s.end.is_finite()) {
                continue;
            }
            let (lo, hi) = range.unwrap_or((s.start, s.end));
            range = Some((lo.min(s.start), hi.max(s.end)));
        }
        range
    }

    /// Live activations over time estimated from the compute lanes, `bytes_per_activation`
    /// per (stage, micro-batch): allocated when a forward ends, freed when the backward
    /// that produces the weight gradient (`B` or `W`) ends.
    ///
    /// An estimate for schedules whose recorder keeps no memory log (replays, measured runs):
    /// it shows the shape of the activation curve — the difference between breadth-first and
    /// depth-first — not the static state or communication buffers.
    pub fn activation_memory(&self, bytes_per_activation: u64) -> Vec<MemorySeries> {
        let amount = i64::try_from(bytes_per_activation).unwrap_or(i64::MAX);
        // Every curve starts at the trace's start, holding nothing.
        let origin = self.time_range().map_or(0.0, |r| r.0);
        self.lanes
            .iter()
            .filter(|l| l.stream == Stream::Compute)
            .map(|lane| {
                let deltas: Vec<(f64, i64)> = std::iter::once((origin, 0))
                    .chain(lane.spans.iter().filter_map(|s| match s.action()?.kind {
                        ActionKind::Forward => Some((s.end, amount)),
                        ActionKind::Backward | ActionKind::BackwardWeight => Some((s.end, -amount)),
                        _ => None,
                    }))
                    .collect();
                MemorySeries::from_deltas(lane.rank, 0, &deltas)
            })
            .collect()
    }
}

/// Memory held by one rank over time: a step function given by its change points.
#[derive(Debug, Clone, PartialEq)]
pub struct MemorySeries {
    /// Rank.
    pub rank: usize,
    /// `(time, bytes)`: from `time` on, the rank holds `bytes`, until the next point.
    /// Sorted by time.
    pub points: Vec<(f64, u64)>,
}

impl MemorySeries {
    /// The running sum of `deltas` (time, signed bytes) on top of `base` bytes held all along.
    ///
    /// At equal times frees are applied before allocations, the simulator's convention (a
    /// caching allocator reuses memory released at the same instant), so the curve's maximum
    /// is the simulator's peak. A sum that would go negative (an unmatched free) is clamped
    /// to zero instead of wrapping.
    pub fn from_deltas(rank: usize, base: u64, deltas: &[(f64, i64)]) -> MemorySeries {
        let mut sorted: Vec<(f64, i64)> = deltas
            .iter()
            .copied()
            .filter(|(t, _)| t.is_finite())
            .collect();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut live = i128::from(base);
        let mut points: Vec<(f64, u64)> = Vec::with_capacity(sorted.len() + 1);
        if let Some(&(t0, _)) = sorted.first() {
            points.push((t0, base));
        }
        for (t, delta) in sorted {
            live = (live + i128::from(delta)).max(0);
            let bytes = u64::try_from(live).unwrap_or(u64::MAX);
            // Collapse several changes at one instant into the last value.
            match points.last_mut() {
                Some(last) if last.0 == t => last.1 = bytes,
                _ => points.push((t, bytes)),
            }
        }
        MemorySeries { rank, points }
    }

    /// Every rank's memory over a simulated step: the static training state plus the
    /// simulator's allocation log, from time 0; each curve's maximum is the rank's
    /// `peak_memory_bytes`.
    pub fn from_sim(result: &SimResult) -> Vec<MemorySeries> {
        result
            .memory
            .iter()
            .enumerate()
            .map(|(rank, log)| {
                let mut changes = Vec::with_capacity(log.changes.len() + 1);
                changes.push((0.0, 0));
                changes.extend_from_slice(&log.changes);
                MemorySeries::from_deltas(rank, log.static_bytes, &changes)
            })
            .collect()
    }

    /// The highest value of the series (0 when empty).
    pub fn peak(&self) -> u64 {
        self.points.iter().map(|p| p.1).max().unwrap_or(0)
    }
}
