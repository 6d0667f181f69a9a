//! Planner: the fastest layouts of a model on N GPUs for a global batch, by simulation.
//!
//! A [`Layout`] is (TP, PP, V, DP, M, micro-batch size, ZeRO, schedule, recompute, strategy)
//! with GPUs = TP·PP·DP and global batch = DP·M·micro-batch size. [`plan`] enumerates the
//! layouts of a [`PlanRequest`], rejects those that break a rule or cannot fit in device
//! memory (saying why), simulates the rest with [`crate::sim`] and ranks them by simulated
//! tokens/s; [`explain`] says why one given layout is slower than the best or rejected.
//!
//! # Search space (what is enumerated)
//! - TP: divisors of N up to the GPUs per node that divide the heads and the vocabulary
//!   (tensor parallelism across nodes is never competitive and Megatron-LM forbids it);
//! - PP: divisors of N/TP with P·V dividing the layer count, so stages are even;
//! - micro-batch size: divisors of B/DP up to [`SearchLimits::max_micro_batch_size`], with
//!   M = B/(DP·mbs) at most [`SearchLimits::max_microbatches`];
//! - families ([`Family`]): gpipe and 1f1b (V = 1), depth-first = interleaved (V ≥ 2,
//!   M a multiple of P) and breadth-first (V ≥ 2, or any V when P = 1; pure, K = M, or
//!   Fast-LLM's hybrid with every proper divisor K of M as the sweep size), all with the bfpp
//!   overlap and ZeRO 0–3 (only 0 when DP = 1); megatron = 1F1B or interleaved with ZeRO-1
//!   and reductions at the end of the step;
//! - recompute off and on.
//!
//! # Pruning without changing the answer
//! Simulating every layout of 512 GPUs would take minutes, so each layout first gets two
//! cheap, provable bounds from its [`CostTable`](crate::sim::CostTable):
//! - a memory lower bound: the static training state of the fullest rank plus the
//!   activations its compute order must hold at once (every forward of a breadth-first or
//!   GPipe rank precedes its first backward; 1F1B rank r holds min(P − r, M)). A layout over
//!   device memory by this bound is rejected without simulating;
//! - a step-time lower bound: for every rank r, the forwards of stages 0..r before its first
//!   compute, all its own compute, and the backwards of stages r..0 after its last, plus the
//!   first gather, the last reduction and the optimizer step of rank 0 (for megatron every
//!   gather and reduction of rank 0, which nothing overlaps).
//!
//! Layouts are simulated in decreasing order of their throughput bound; one whose bound is
//! below both the K-th best simulated throughput and its family's best is skipped, since its
//! simulation cannot enter either list. So the ranking equals that of simulating everything.

mod explain;
mod layout;
mod search;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::schedule::ScheduleError;
use crate::sim::{HardwareConfig, ModelConfig, SimError, SimResult};

pub use explain::{explain, Explanation, Verdict};
pub use layout::{Family, Layout};
pub use search::{bounds, plan, Bounds};

/// Everything that can go wrong planning.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The request itself is unusable (no GPUs, no batch); the text names the fix.
    #[error("invalid plan request: {0}")]
    Request(String),
    /// A layout given as text (`--explain`) does not parse.
    #[error("cannot read layout `{text}`: {reason}")]
    Layout {
        /// The text given.
        text: String,
        /// What is wrong and the expected form.
        reason: String,
    },
    /// No enumerated layout fits in memory and follows the rules.
    #[error(
        "no layout of {model} on {gpus} × {hardware} for a global batch of {global_batch} fits: \
         {why}"
    )]
    NothingFits {
        /// The model's description.
        model: String,
        /// The hardware's name.
        hardware: String,
        /// N.
        gpus: usize,
        /// B.
        global_batch: usize,
        /// The closest miss and what would fix it.
        why: String,
    },
    /// A simulator configuration failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// A schedule could not be generated.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

/// Limits of the enumeration: they bound the cost of one simulation and the number of
/// layouts, and are part of what the planner's answer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchLimits {
    /// Largest micro-batch count M per step and replica.
    pub max_microbatches: usize,
    /// Largest micro-batch size, samples.
    pub max_micro_batch_size: usize,
    /// Threads simulating layouts at once (0: one per available core).
    pub threads: usize,
}

impl Default for SearchLimits {
    /// M ≤ 512 (a P = 64 breadth-first step then simulates in well under a second), micro-batch
    /// size ≤ 16 samples, one thread per core.
    fn default() -> Self {
        SearchLimits {
            max_microbatches: 512,
            max_micro_batch_size: 16,
            threads: 0,
        }
    }
}

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// The model.
    pub model: ModelConfig,
    /// The GPU type and its links.
    pub hardware: HardwareConfig,
    /// N, the GPUs to use (all of them).
    pub gpus: usize,
    /// B, samples per optimizer step over all replicas.
    pub global_batch: usize,
    /// Enumeration limits.
    pub limits: SearchLimits,
    /// Full-size gathered-weight and gradient buffers per rank (ZeRO-2/3) of every layout,
    /// as the engine's `buffers`.
    pub buffers: usize,
}

impl PlanRequest {
    /// A request with the default limits.
    pub fn new(
        model: ModelConfig,
        hardware: HardwareConfig,
        gpus: usize,
        global_batch: usize,
    ) -> Self {
        PlanRequest {
            model,
            hardware,
            gpus,
            global_batch,
            limits: SearchLimits::default(),
            buffers: crate::schedule::DEFAULT_BUFFERS,
        }
    }

    /// Reject a request nothing could satisfy.
    pub fn check(&self) -> Result<(), PlanError> {
        self.model.check()?;
        self.hardware.check()?;
        if self.gpus == 0 {
            return Err(PlanError::Request("--gpus must be at least 1".into()));
        }
        if self.global_batch == 0 {
            return Err(PlanError::Request(
                "--global-batch must be at least 1 sample".into(),
            ));
        }
        if self.buffers == 0 {
            return Err(PlanError::Request(
                "--buffers must be at least 1 (weight and gradient buffers per rank); try \
                 --buffers 2"
                    .into(),
            ));
        }
        if self.limits.max_microbatches == 0 || self.limits.max_micro_batch_size == 0 {
            return Err(PlanError::Request(
                "search limits must allow at least one micro-batch of one sample".into(),
            ));
        }
        Ok(())
    }

    /// A short description of the model for messages.
    pub fn model_name(&self) -> String {
        match &self.model {
            ModelConfig::Gpt(g) => format!(
                "GPT(layers {}, hidden {}, heads {}, seq {})",
                g.layers, g.hidden, g.heads, g.sequence
            ),
            ModelConfig::Unit(_) => "the unit model".into(),
        }
    }
}

/// The simulated outcome of a layout, without the per-action trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// Step time (seconds; units for the `unit` model).
    pub step_time_s: f64,
    /// Tokens per second over all replicas.
    pub tokens_per_s: f64,
    /// Model TFLOP/s per GPU.
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// (step − ideal compute) / ideal compute.
    pub bubble_fraction: f64,
    /// The busiest rank's compute time.
    pub ideal_compute_s: f64,
    /// The longest optimizer step over the ranks.
    pub optimizer_s: f64,
    /// Time compute waited for messages, maximum over ranks.
    pub exposed_p2p_s: f64,
    /// Time compute waited for data-parallel collectives, maximum over ranks.
    pub exposed_dp_s: f64,
    /// Peak memory of the fullest rank, bytes.
    pub peak_memory_bytes: u64,
    /// Static training state of the fullest rank, bytes.
    pub static_memory_bytes: u64,
}

impl Score {
    /// The summary of a simulation.
    pub fn of(r: &SimResult) -> Score {
        let max_f = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        Score {
            step_time_s: r.step_time_s,
            tokens_per_s: r.tokens_per_s,
            tflops_per_gpu: r.tflops_per_gpu,
            mfu: r.mfu,
            bubble_fraction: r.bubble_fraction,
            ideal_compute_s: r.ideal_compute_s,
            optimizer_s: max_f(&r.optimizer_s),
            exposed_p2p_s: r.exposed_p2p_s,
            exposed_dp_s: r.exposed_dp_s,
            peak_memory_bytes: r.peak_memory_bytes.iter().copied().max().unwrap_or(0),
            static_memory_bytes: r.memory.iter().map(|m| m.static_bytes).max().unwrap_or(0),
        }
    }
}

/// A layout and its simulated score.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The layout.
    pub layout: Layout,
    /// Its simulation.
    pub score: Score,
}

/// How much work a search did, to show that the pruning pruned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SearchStats {
    /// Layouts enumerated.
    pub enumerated: usize,
    /// Rejected by the memory lower bound, without simulating.
    pub over_memory_bound: usize,
    /// Simulated.
    pub simulated: usize,
    /// Simulated and then over device memory.
    pub over_memory_simulated: usize,
    /// Skipped because their throughput bound could not enter the ranking.
    pub pruned: usize,
}

/// The answer of [`plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The best layouts, fastest first (at most the requested count).
    pub ranked: Vec<Candidate>,
    /// The fastest layout of each family that has one that fits.
    pub best_per_family: BTreeMap<Family, Candidate>,
    /// Search effort.
    pub stats: SearchStats,
}
