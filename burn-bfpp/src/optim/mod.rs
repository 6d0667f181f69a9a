//! The optimizer side of sharded training: AdamW on one flat shard, the learning-rate
//! schedule, and global gradient-norm clipping.
//!
//! The engine keeps each pipeline stage's parameters as one flat 1-D `f32` buffer, padded with
//! zeros to a multiple of the data-parallel size and split evenly, so every rank owns one
//! contiguous shard (ZeRO-1/2/3). After the gradients are reduce-scattered (mean over the
//! global batch) every rank clips and updates its own shard with a [`ShardOptimizer`], which
//! holds the AdamW moments of that shard only.
//!
//! The contract is equivalence: training sharded must give the parameters that plain
//! single-device Burn training with [`burn::optim::AdamWConfig`] gives. AdamW is elementwise,
//! so updating shards separately is the same as updating the whole buffer, provided every
//! element sees the same arithmetic. [`ShardOptimizer::step_clipped`] therefore runs exactly the
//! tensor operations of Burn 0.21's `AdamW` in the same order with the same scalar types (see
//! [`adamw`] for the formula and where it comes from); on the same backend the results are
//! bit-identical to Burn's (the tests measure a maximum relative error of 0).
//!
//! Per optimizer step (1-based `step`), every rank does:
//!
//! 1. `lr = schedule.lr(step)` with an [`LrSchedule`] (identical on every rank: it is a pure
//!    function of the step);
//! 2. the squared norm of each owned gradient shard, on the device ([`sq_norm_on_device`]),
//!    into its slot of the step's table;
//! 3. sum the table over the world and read it once: every rank adds the slots of every
//!    distinct part of the model in f64 (in the same order), giving the squared norm of the
//!    whole model's gradient;
//! 4. `c = clip_coefficient(total, max_norm)` ([`clip_coefficient`]);
//! 5. `owned = optimizer.step_clipped(lr, owned, grad, c)`, which scales the owned gradient
//!    by `c` ([`clip_grad`]) and updates.
//!
//! Two caveats for equivalence with Burn:
//!
//! * Burn's `OptimizerAdaptor` skips a parameter that has no gradient in a step (no moment
//!   update, no weight decay, its step counter does not advance), while a flat buffer has one
//!   counter and treats a missing gradient as zeros (the moments decay and weight decay still
//!   applies). The two agree only when every parameter receives a gradient every step, which
//!   is the case for any model whose parameters all take part in the loss.
//! * Burn's own [`burn::grad_clipping::GradientClippingConfig::Norm`] clips each parameter
//!   tensor by its *own* norm, not by the global norm. A single-device reference for global
//!   clipping must therefore not use it; it clips by hand (the optimizer tests'
//!   `reference_sq_norm` and `reference_clip`), then calls Burn's AdamW without gradient clipping.

pub mod adamw;
pub mod clip;
mod schedule;
#[cfg(all(test, feature = "flex"))]
mod tests;

pub use adamw::{AdamWSettings, ShardOptimizer};
pub use clip::{clip_coefficient, clip_grad, sq_norm_on_device};
pub use schedule::LrSchedule;

/// Everything that can go wrong configuring or running the shard optimizer.
///
/// Every message says what was wrong and what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    /// A tensor handed to the optimizer does not have the length of the shard it was built for.
    #[error(
        "{what} has {got} elements but the optimizer was built for a shard of {expected}; \
         pass this rank's owned shard of the stage's padded flat buffer"
    )]
    ShardLength {
        /// Which tensor (parameters, gradients, a moment).
        what: &'static str,
        /// The shard length the optimizer was built for.
        expected: usize,
        /// The length that was given.
        got: usize,
    },
    /// An AdamW setting is out of range; the text names the field and the allowed range.
    #[error("invalid AdamW setting: {0}")]
    Settings(String),
    /// A learning-rate schedule or a learning rate is out of range; the text names the field.
    #[error("invalid learning rate: {0}")]
    LearningRate(String),
}
