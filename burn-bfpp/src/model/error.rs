//! The errors of model splitting and stage execution.

use std::ops::Range;

/// Everything that can go wrong splitting a model into stages or running a stage.
///
/// Every message says what was wrong and, where there is one, what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// A fused op (`GptConfig::fused`) refused its inputs: an unsupported float type or
    /// shape on this backend; the text names the op and the fix.
    #[error("{0}")]
    Fused(#[from] cubecl_kernels::FusedError),
    /// The requested layer → stage split is impossible (too many stages, a bad explicit
    /// split, invalid costs, ranges that do not cover the model).
    #[error("invalid layer split: {0}")]
    Split(String),
    /// A model configuration is invalid; the text names the field and the fix.
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// A tied output head shares the embedding matrix, so its two uses must be in one stage.
    #[error(
        "the model ties its output head to the token embedding (tied_head = true), but stage \
         {layers:?} holds only one of the two uses (embedding = layer 0, head = layer {head}); \
         set tied_head = false to pipeline it, or keep the whole model in one stage"
    )]
    TiedHeadAcrossStages {
        /// The layer range of the offending stage.
        layers: Range<usize>,
        /// The index of the head layer (the last layer).
        head: usize,
    },
    /// A tensor does not have the shape the stage or buffer expects.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    Shape {
        /// Which tensor or buffer.
        what: String,
        /// The expected shape, in words or as dims.
        expected: String,
        /// The shape that was given.
        got: String,
    },
    /// A stage received the wrong kind of input (raw data vs hidden states, missing targets).
    #[error("stage {layers:?}: {reason}")]
    StageInput {
        /// The layer range of the stage.
        layers: Range<usize>,
        /// What was wrong and what the stage expects.
        reason: String,
    },
    /// Parameters could not be matched between modules (recombination of stages).
    #[error("parameter mismatch: {0}")]
    Params(String),
}

impl ModelError {
    /// Shorthand for a [`ModelError::Shape`] from anything printable.
    pub fn shape(what: impl Into<String>, expected: impl ToString, got: impl ToString) -> Self {
        ModelError::Shape {
            what: what.into(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }
}
