//! [`CostTable`]: what the simulator knows of each stage (durations and sizes), apart from
//! how it is computed (`cost.rs`), so that the byte counts of `volume.rs` can read it
//! without importing the code that builds it.

/// Durations and sizes, per stage unless said otherwise. Times are seconds, or units for the
/// `unit` model.
#[derive(Debug, Clone, PartialEq)]
pub struct CostTable {
    /// True for the `unit` model (times in units, no FLOPs).
    pub unit_time: bool,
    /// One micro-batch's forward through the stage.
    pub forward: Vec<f64>,
    /// One micro-batch's full backward (input and weight gradients).
    pub backward: Vec<f64>,
    /// The input-gradient half `I` of a split backward.
    pub backward_input: Vec<f64>,
    /// The weight-gradient half `W` of a split backward.
    pub backward_weight: Vec<f64>,
    /// Bytes of the message across boundary s → s+1 (activation forward, gradient backward).
    pub message_bytes: Vec<u64>,
    /// Bytes of one gathered weight (the compute dtype).
    pub weight_elem_bytes: u64,
    /// Bytes of one reduced gradient element.
    pub grad_elem_bytes: u64,
    /// Transfer time across boundary s → s+1 (either direction).
    pub transfer: Vec<f64>,
    /// All-gather of the stage's weights over the data-parallel group.
    pub gather: Vec<f64>,
    /// Gradient reduction of the stage (all-reduce at ZeRO-0, reduce-scatter above).
    pub reduce: Vec<f64>,
    /// Parameters of the stage held by one GPU before data-parallel sharding (÷ T).
    pub parameters: Vec<u64>,
    /// Activation bytes one micro-batch keeps alive in the stage until its backward.
    pub activation_bytes: Vec<u64>,
    /// Of those, the bytes a split backward keeps from its `I` until its `W`: each deferred
    /// matrix's input and output gradient (never more than `activation_bytes`; the unit
    /// model keeps everything until `W`).
    pub weight_grad_bytes: Vec<u64>,
    /// Optimizer step of each pipeline rank.
    pub optimizer: Vec<f64>,
    /// When each pipeline rank starts the step (0 for all by default): a measured run's
    /// ranks do not start together, and replaying it needs their real start times.
    pub start: Vec<f64>,
    /// Model FLOPs of one step of one replica (0 for `unit`).
    pub step_model_flops: f64,
    /// Tokens one replica processes per step.
    pub tokens_per_step: f64,
}
