//! Errors of the fused ops' public entry points.

use burn::tensor::DType;
use thiserror::Error;

/// Why a fused op rejected its inputs. Every variant is a caller-side shape or argument
/// problem detected before anything is launched, so nothing has been computed when it is
/// returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FusedError {
    /// Two inputs disagree on a dimension they must share.
    #[error("{op}: {what} (got {got:?}, expected {expected:?})")]
    ShapeMismatch {
        /// The op that rejected its inputs.
        op: &'static str,
        /// Which dimension or tensor disagrees.
        what: &'static str,
        /// The offending shape.
        got: Vec<usize>,
        /// The shape the op needed.
        expected: Vec<usize>,
    },
    /// The attention head dimension is not supported by the kernels.
    #[error(
        "flash_attention: head dimension {0} is not supported (must be a multiple of 16, at most {max})",
        max = crate::MAX_HEAD_DIM
    )]
    UnsupportedHeadDim(usize),
    /// A dimension that must be non-zero is zero.
    #[error("{op}: {what} must be non-zero")]
    Empty {
        /// The op that rejected its inputs.
        op: &'static str,
        /// Which dimension is empty.
        what: &'static str,
    },
    /// Inputs that must share a float type do not.
    #[error(
        "{op}: {what} has dtype {got:?}, expected {expected:?} (cast the inputs to one float type)"
    )]
    DTypeMismatch {
        /// The op that rejected its inputs.
        op: &'static str,
        /// Which tensor disagrees.
        what: &'static str,
        /// Its float type.
        got: DType,
        /// The float type of the first input.
        expected: DType,
    },
    /// The device cannot compute in the inputs' float type (for example bf16 on a Vulkan
    /// device without the bfloat16 shader extension, such as Mesa's lavapipe).
    #[error("{op}: dtype {dtype:?} is unsupported on this device (no arithmetic support for it); use f32, or f16 where the device supports it")]
    UnsupportedDType {
        /// The op that rejected its inputs.
        op: &'static str,
        /// The inputs' float type.
        dtype: DType,
    },
}
