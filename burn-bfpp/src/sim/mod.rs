//! Event simulator: how long one optimizer step of a lowered pipeline schedule takes on a
//! given cluster, how much memory each rank needs, and where the time goes.
//!
//! Input: a lowered [`PipelineSchedule`](crate::schedule::PipelineSchedule) (generated, then
//! [`lower_p2p`](crate::schedule::lower_p2p), then
//! [`lower_data_parallel`](crate::schedule::lower_data_parallel)) and a [`SimConfig`]. Output:
//! a [`SimResult`]. Only one data-parallel replica is simulated: every replica runs the same
//! lists and their collectives synchronise them; each pipeline hop is costed on the slowest
//! link over the replicas.
//!
//! # Streams and semantics
//! Each rank has three streams, each running its actions in list order:
//! - **compute** (`F`, `B`, `I`, `W`, and the zero-time `RESHARD`): a compute starts when the
//!   stream is free, its data is there (the producer's end on the same rank, the message's
//!   arrival otherwise), the stage's latest `UNSHARD` has finished, and — ZeRO-2/3 — a
//!   gradient buffer is free (the `grad_buffers`-th preceding `REDUCE_GRAD` has finished).
//! - **p2p**: `SEND_*` in list order, each starting when its data is produced and the previous
//!   send has gone, taking latency + bytes/bandwidth. Sends never stall compute; a `RECV_*`
//!   only marks the arrival (links are full duplex, so receives do not queue behind sends).
//! - **dp**: `UNSHARD` and `REDUCE_GRAD` in list order. An `UNSHARD` may prefetch as soon as
//!   the stream is free, but not before the oldest unclaimed `RESHARD` preceding it in the list
//!   (the buffer it reuses must be free); a `REDUCE_GRAD` is issued in program order: it
//!   starts after every compute that precedes it in the list (for the lowering's placement,
//!   right after the stage's last backward, that is the stage's own gradients being ready).
//!
//! After the last compute and every `REDUCE_GRAD`, the optimizer step runs on the compute
//! stream for (2·optimizer state + gradient + weight bytes of the rank's shard) / HBM
//! bandwidth: Adam is memory bound, reading and writing its fp32 state once and reading the
//! gradient and writing the 16-bit weights once. With ZeRO-1/2 the list's `UNSHARD`s are the
//! all-gathers of the weights that optimizer step updated; they are simulated where the list
//! puts them, at the start of the step, which is the same point of the steady-state cycle.
//!
//! # Serial execution
//! [`Execution::Serial`] models an engine that runs everything on one thread per rank, as
//! the CPU engine over MPI does: every action of a rank's list, sends, receives and
//! collectives included, starts after the previous one has ended, and a `RECV_*` holds the
//! rank until its message has arrived (plus its own duration, if one is given). Fed with a
//! run's measured durations and per-rank start times ([`CostTable::start`]), it replays that
//! run.
//!
//! # Exposed communication
//! For every compute, with `free` the end of the previous compute, `produced` the time its
//! inputs were computed (on whichever rank), `arrived` the time they were on this rank and
//! `start` its start: exposed p2p adds `max(0, arrived − max(free, produced))` — waiting for
//! a message in flight — and exposed dp adds `max(0, start − max(free, arrived))` — waiting for
//! a gather or for a gradient buffer. The wait between the last compute and the last
//! `REDUCE_GRAD`'s end also counts as exposed dp. Reported values are the maximum over ranks.
//! The rest of a rank's idle time is pipeline bubble.
//!
//! # Memory over time
//! [`SimResult::memory`] holds, per rank, the static training state and the log of every
//! allocation and free the engine made (gathered weights, gradient buffers, activations,
//! messages); its running maximum is `peak_memory_bytes`, and `viz::memory_svg` draws it.
//!
//! # Strategies: bfpp against Megatron-LM
//! The paper compares two ways of running data parallelism around a pipeline; both are
//! lowering choices over the same lists ([`Strategy`], [`build_program`]), not special cases
//! in the engine:
//! - **bfpp**: the lowering of [`lower_data_parallel`](crate::schedule::lower_data_parallel)
//!   — each stage's gradients are reduced right after its last backward, overlapping the
//!   backward of the rank's other stages, and (ZeRO-3) its weights gathered one compute block
//!   ahead. With the breadth-first schedule only about 1/V of the reduction is exposed.
//! - **megatron**: Megatron-LM's distributed optimizer, ZeRO-1, with a 1F1B or interleaved
//!   schedule and tensor parallelism inside a node. [`megatron_collectives`] moves every
//!   `REDUCE_GRAD` after the rank's last backward — the engine issues collectives in program
//!   order, so the reductions then wait for the whole backward and are exposed — and every
//!   `UNSHARD` (the parameter all-gather after the optimizer step) before the first forward,
//!   in an order that makes that forward wait for all of them.
//!
//! Tensor parallelism exists only here, as a cost: compute and memory ÷ T plus two
//! all-reduces of the block output per layer in forward and in backward, on the NVLink ring
//! when the group fits in a node.

mod check;
mod cost;
mod cost_table;
mod engine;
mod hardware;
mod memory;
mod model;
mod result;
mod strategy;
#[cfg(test)]
mod strategy_tests;
#[cfg(test)]
mod tests;
mod volume;

use serde::Deserialize;

use crate::schedule::{ScheduleError, ZeroLevel};

pub use cost::Topology;
pub use cost_table::CostTable;
pub use engine::{simulate, simulate_costed, ActionDurations};
pub use hardware::{HardwareConfig, HARDWARE_PRESETS};
pub use memory::static_bytes;
pub use model::{Dtype, GptShape, ModelConfig, UnitModel, MODEL_PRESETS};
pub use result::{Interval, MemoryLog, RankTrace, SimResult, TraceItem, JSON_KEYS};
pub use strategy::{build_program, megatron_collectives, simulate_program, Strategy};
pub use volume::{
    collective_bytes, gradient_reduction, step_comm_bytes, CollectiveKind, CommBytes,
};

/// Everything that can go wrong configuring or running a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A preset name that does not exist.
    #[error("unknown {what} preset `{name}`; valid names: {valid}")]
    UnknownPreset {
        /// "model" or "hardware".
        what: &'static str,
        /// The name asked for.
        name: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// A configuration value out of range; the text names it and the fix.
    #[error("invalid simulator configuration: {0}")]
    Config(String),
    /// A TOML configuration that does not parse or has unknown fields.
    #[error("cannot read TOML configuration: {0}")]
    Toml(#[from] toml::de::Error),
    /// The schedule is not lowered, inconsistent with the configuration, or deadlocks.
    #[error("cannot simulate the schedule: {0}")]
    Schedule(String),
    /// An error from the schedule IR (layer split, ZeRO level parsing).
    #[error(transparent)]
    Ir(#[from] ScheduleError),
}

/// How a step is run: the model, the hardware and the parallel layout around the pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// The model.
    pub model: ModelConfig,
    /// The GPUs and their links.
    pub hardware: HardwareConfig,
    /// Data-parallel size D (replicas of the pipeline).
    pub dp: usize,
    /// Tensor-parallel size T; cost only: FLOPs, parameters and activations ÷ T plus the
    /// per-layer all-reduces, placed innermost (inside a node when T ≤ GPUs per node).
    pub tp: usize,
    /// Samples per micro-batch.
    pub micro_batch_size: usize,
    /// ZeRO level; must match the level the schedule was lowered with.
    pub zero: ZeroLevel,
    /// Full activation recomputation (backward re-runs the forward, keeps only block inputs).
    pub recompute: bool,
    /// Flash attention (no stored attention scores, no s×s HBM traffic).
    pub flash_attention: bool,
    /// Weight, gradient and activation element type.
    pub dtype: Dtype,
    /// Element type of the data-parallel gradient reduction; `None`: `dtype`. burn-bfpp's
    /// engine reduces in fp32 whatever the compute dtype: set `fp32` to model it.
    pub grad_reduce_dtype: Option<Dtype>,
    /// Full-size gradient buffers per rank at ZeRO-2/3; must match the lowering
    /// ([`simulate_program`] takes the program's own).
    pub grad_buffers: usize,
    /// Whether a rank's communication overlaps its compute (GPUs with their own copy
    /// engines and NCCL streams) or runs on the same thread (the CPU engine).
    pub execution: Execution,
}

/// How the actions of one rank share its time (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Execution {
    /// Three streams per rank: compute, point-to-point and data-parallel communication.
    #[default]
    Overlapped,
    /// One stream per rank: every action waits for the one before it in the list.
    Serial,
}

impl SimConfig {
    /// Defaults around a model and hardware: D = T = 1, one sample per micro-batch, ZeRO-0,
    /// no recomputation, flash attention, bf16, two gradient buffers (the lowering's default).
    pub fn new(model: ModelConfig, hardware: HardwareConfig) -> Self {
        SimConfig {
            model,
            hardware,
            dp: 1,
            tp: 1,
            micro_batch_size: 1,
            zero: ZeroLevel::Zero0,
            recompute: false,
            flash_attention: true,
            dtype: Dtype::Bf16,
            grad_reduce_dtype: None,
            grad_buffers: 2,
            execution: Execution::Overlapped,
        }
    }

    /// The `unit` model on any hardware (which it ignores): times come out in units.
    pub fn unit() -> Self {
        SimConfig::new(
            ModelConfig::Unit(UnitModel::default()),
            // The unit model never reads the hardware; any preset will do.
            HardwareConfig::preset("h100-80gb").expect("built-in preset"),
        )
    }

    /// Read a configuration from TOML. `model` and `hardware` are each a preset name or a
    /// table of fields; everything else is optional with [`SimConfig::new`]'s defaults:
    ///
    /// ```toml
    /// model = "gpt-52b"
    /// hardware = "a100-80gb"
    /// dp = 8
    /// tp = 1
    /// micro_batch_size = 1
    /// zero = 3
    /// recompute = false
    /// flash_attention = true
    /// dtype = "bf16"
    /// grad_reduce_dtype = "fp32"
    /// grad_buffers = 2
    /// ```
    pub fn from_toml_str(text: &str) -> Result<Self, SimError> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Named<T> {
            Preset(String),
            Inline(T),
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            model: Named<ModelConfig>,
            hardware: Named<HardwareConfig>,
            dp: Option<usize>,
            tp: Option<usize>,
            micro_batch_size: Option<usize>,
            zero: Option<u8>,
            recompute: Option<bool>,
            flash_attention: Option<bool>,
            dtype: Option<Dtype>,
            grad_reduce_dtype: Option<Dtype>,
            grad_buffers: Option<usize>,
            execution: Option<Execution>,
        }
        let raw: Raw = toml::from_str(text)?;
        let model = match raw.model {
            Named::Preset(name) => ModelConfig::preset(&name)?,
            Named::Inline(m) => m,
        };
        let hardware = match raw.hardware {
            Named::Preset(name) => HardwareConfig::preset(&name)?,
            Named::Inline(h) => h,
        };
        let mut cfg = SimConfig::new(model, hardware);
        cfg.dp = raw.dp.unwrap_or(cfg.dp);
        cfg.tp = raw.tp.unwrap_or(cfg.tp);
        cfg.micro_batch_size = raw.micro_batch_size.unwrap_or(cfg.micro_batch_size);
        if let Some(z) = raw.zero {
            cfg.zero = ZeroLevel::from_number(z)?;
        }
        cfg.recompute = raw.recompute.unwrap_or(cfg.recompute);
        cfg.flash_attention = raw.flash_attention.unwrap_or(cfg.flash_attention);
        cfg.dtype = raw.dtype.unwrap_or(cfg.dtype);
        cfg.grad_reduce_dtype = raw.grad_reduce_dtype.or(cfg.grad_reduce_dtype);
        cfg.grad_buffers = raw.grad_buffers.unwrap_or(cfg.grad_buffers);
        cfg.execution = raw.execution.unwrap_or(cfg.execution);
        cfg.check()?;
        Ok(cfg)
    }

    /// Check every value; the error names the field and the valid range.
    pub fn check(&self) -> Result<(), SimError> {
        self.model.check()?;
        self.hardware.check()?;
        for (field, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("micro_batch_size", self.micro_batch_size),
            ("grad_buffers", self.grad_buffers),
        ] {
            if v == 0 {
                return Err(SimError::Config(format!("{field} must be at least 1")));
            }
        }
        if let ModelConfig::Gpt(g) = &self.model {
            if g.heads % self.tp != 0 || g.vocabulary % self.tp != 0 {
                return Err(SimError::Config(format!(
                    "tp={} must divide heads={} and vocabulary={}",
                    self.tp, g.heads, g.vocabulary
                )));
            }
        }
        Ok(())
    }
}
