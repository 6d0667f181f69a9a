//! What a simulation reports: the summary numbers, their JSON form, and the per-stream
//! intervals that timeline renderers consume.

use serde_json::{json, Value};

use crate::schedule::Action;

/// What occupied a stream during an [`Interval`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceItem {
    /// An action of the rank's list.
    Action(Action),
    /// The optimizer step at the end of the step (compute stream).
    OptimizerStep,
}

/// One busy interval of one stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// What ran.
    pub item: TraceItem,
    /// Start time (seconds, or units for the `unit` model).
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// The three streams of one rank, each in start order.
///
/// `RESHARD` appears on the compute stream with zero length (a free, issued when the last
/// compute using the buffer ends); a `RECV_*` on the p2p stream spans from its send's start to
/// the data's arrival, so it may overlap the rank's own sends (links are full duplex).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankTrace {
    /// `F`, `B`, `I`, `W`, `RESHARD`, and the optimizer step.
    pub compute: Vec<Interval>,
    /// `SEND_*` and `RECV_*`.
    pub p2p: Vec<Interval>,
    /// `UNSHARD` and `REDUCE_GRAD`.
    pub dp: Vec<Interval>,
}

/// Memory one rank holds over the step: a constant part and a log of changes on top of it.
///
/// The bytes held at time `t` are `static_bytes` plus the sum of the changes at or before `t`
/// (at equal times frees count first, as in the peak), so the running maximum of that step
/// function is the rank's `peak_memory_bytes`. `viz::MemorySeries::from_deltas` turns it into
/// a curve.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryLog {
    /// Training state held all step: weights, gradients and optimizer state by ZeRO level.
    pub static_bytes: u64,
    /// `(time, signed bytes)`: gathered weights, gradient buffers, activations and messages
    /// allocated (positive) or freed (negative) at `time`, sorted by time, frees first.
    pub changes: Vec<(f64, i64)>,
}

/// The outcome of simulating one optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    /// True when times are in units of the `unit` model rather than seconds.
    pub unit_time: bool,
    /// Time of one step, optimizer included.
    pub step_time_s: f64,
    /// Tokens (samples × sequence; samples for `unit`) per unit of time, all replicas.
    pub tokens_per_s: f64,
    /// Model FLOP/s per GPU in TFLOP/s (no recomputation counted; 0 for `unit`).
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilisation: `tflops_per_gpu` ÷ the hardware's bf16 peak (0 for `unit`).
    pub mfu: f64,
    /// (step time − ideal compute) / ideal compute, ideal compute being the busiest rank's
    /// total compute time without waits.
    pub bubble_fraction: f64,
    /// The ideal compute time of the bubble fraction.
    pub ideal_compute_s: f64,
    /// Time compute waited for messages in flight, maximum over ranks (see module docs).
    pub exposed_p2p_s: f64,
    /// Time compute waited for data-parallel collectives, maximum over ranks.
    pub exposed_dp_s: f64,
    /// Exposed p2p time of each rank.
    pub exposed_p2p_per_rank: Vec<f64>,
    /// Exposed data-parallel time of each rank.
    pub exposed_dp_per_rank: Vec<f64>,
    /// Optimizer step duration of each rank.
    pub optimizer_s: Vec<f64>,
    /// Peak memory of each rank, bytes: static training state plus the maximum over time of
    /// gathered weights, gradient buffers, live activations and in-flight messages.
    pub peak_memory_bytes: Vec<u64>,
    /// Peak bytes of weights each rank holds: its static weights (shards at ZeRO-3) plus the
    /// gathered full-size copies live at the same time. Part of `peak_memory_bytes`; the
    /// quantity the training engine reports as `peak_param_bytes`.
    pub peak_weight_bytes: Vec<u64>,
    /// Device memory of the hardware, to compare with `peak_memory_bytes`.
    pub device_memory_bytes: u64,
    /// Maximum over time of the rank's live stage activations ÷ its stage count, in units of
    /// one micro-batch through the rank's whole layer share.
    pub peak_activation_microbatches: Vec<f64>,
    /// `UNSHARD`s (all-gathers) per rank per step.
    pub all_gathers: Vec<usize>,
    /// `REDUCE_GRAD`s per rank per step: reduce-scatters at ZeRO ≥ 1, all-reduces (a
    /// reduce-scatter plus an all-gather) at ZeRO-0.
    pub reduce_scatters: Vec<usize>,
    /// Payload bytes each rank sends per step (`SEND_*`, `UNSHARD`, `REDUCE_GRAD`; see
    /// [`super::step_comm_bytes`]): what the training engine reports as `comm_bytes`.
    pub comm_bytes: Vec<super::CommBytes>,
    /// Per-rank, per-stream busy intervals.
    pub trace: Vec<RankTrace>,
    /// Per-rank memory over time.
    pub memory: Vec<MemoryLog>,
}

/// The keys of [`SimResult::to_json`], in order.
pub const JSON_KEYS: [&str; 12] = [
    "step_time_s",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "bubble_fraction",
    "exposed_p2p_s",
    "exposed_dp_s",
    "peak_memory_bytes",
    "peak_activation_microbatches",
    "all_gathers",
    "reduce_scatters",
    "comm_bytes",
];

impl SimResult {
    /// The summary as one JSON object with exactly the keys of [`JSON_KEYS`] (times in units
    /// for the `unit` model). Non-finite numbers become `null`.
    pub fn to_json(&self) -> Value {
        json!({
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "exposed_p2p_s": self.exposed_p2p_s,
            "exposed_dp_s": self.exposed_dp_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_activation_microbatches": self.peak_activation_microbatches,
            "all_gathers": self.all_gathers,
            "reduce_scatters": self.reduce_scatters,
            "comm_bytes": self.comm_bytes,
        })
    }
}
