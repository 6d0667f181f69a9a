//! Fused CubeCL kernels for burn-bfpp: flash attention, fused linear + bias + GELU and fused
//! linear cross-entropy, exposed to Burn through the backend-extension trait [`FusedOps`].
//!
//! * Every backend gets the ops through composed defaults ([`reference`](mod@reference));
//!   Flex (the CPU backend) uses them as they are.
//! * The CubeCL backends (wgpu, CUDA) override the ops with kernels ([`cube`]).
//! * `Autodiff<B>` registers the backward methods as gradients, so training uses them.
//!
//! Call the ops through the shape-checked functions [`flash_attention`], [`linear_gelu`] and
//! [`linear_cross_entropy`].

#![warn(missing_docs)]

mod api;
mod autodiff;
pub mod cube;
mod deferred;
mod error;
pub mod memory;
mod ops;
pub mod reference;

pub use api::{flash_attention, linear_cross_entropy, linear_gelu};
pub use deferred::{defer_weight_grads, split_linear, DeferredWeightGrad};
pub use error::FusedError;
pub use ops::{FusedDefaults, FusedOps};

/// Which routine Burn's matmul runs on CubeCL backends in this build, for reports that
/// depend on it: `"autotuned"` with the `autotune` feature (implied by `cuda`), else `"fixed"`
/// (Burn 0.21 then runs one cubek tensor-core routine for every shape). Both Burn's own
/// products and the fused ops' f16/bf16 products go through it.
pub const BURN_MATMUL: &str = if cfg!(feature = "autotune") {
    "autotuned"
} else {
    "fixed"
};

/// Largest attention head dimension the kernels support (each thread keeps a query or key
/// row and its accumulator in registers sized at compile time).
pub const MAX_HEAD_DIM: usize = 128;
