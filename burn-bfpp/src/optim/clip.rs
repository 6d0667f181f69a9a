//! Global gradient-norm clipping across all stages and shards.
//!
//! The gradient of the whole model is scaled by one coefficient `c = max_norm / ‖g‖` when its
//! global L2 norm `‖g‖` exceeds `max_norm`. No rank holds the whole gradient, so each rank
//! sums the squares of the gradient shards it owns on the device ([`sq_norm_on_device`], so
//! that the norm needs no host read of its own), the engine reduces these partial sums over
//! the world in its step's table and every rank adds those of every distinct part of the
//! model (the pipeline, and the data-parallel group when the update is sharded) in `f64`, in
//! the same order, and turns the total into the coefficient with [`clip_coefficient`].
//!
//! **The coefficient must be computed identically on every rank**: from the same all-reduced
//! total (a collective that returns the same value everywhere, or a broadcast of one rank's
//! value), with the same `max_norm`. Otherwise replicas of a shard would diverge. The
//! coefficient is then applied to the owned gradient ([`clip_grad`]) by
//! [`super::ShardOptimizer::step_clipped`].
//!
//! # The single-device reference
//!
//! A single-device run computes the same quantity as the sum of the squares of all parameter
//! gradients (the tests' `reference_sq_norm`), gets the coefficient from the same
//! [`clip_coefficient`], scales every gradient with `reference_clip`, and only then calls
//! Burn's optimizer
//! (configured *without* Burn's gradient clipping, which is per parameter tensor). The two
//! totals are the same sum of squares grouped differently (per shard on the device in `f32`
//! vs per parameter on the host in `f64`), so they differ by about one `f32` rounding per
//! shard: a relative 1e-7 of the coefficient, far below the tests' 1e-5.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// The sum of the squares of a gradient shard's elements, as a one-element fp32 tensor on the
/// shard's device: what the engine puts into its step's table, so that the norm costs no
/// host read of its own. The summation order is the backend's (deterministic on the CPU
/// backend for a given length); it differs from the host sum in `f64` of the single-device
/// reference (the tests' `sq_norm`) in the last bits only.
pub fn sq_norm_on_device<B: Backend>(shard: &Tensor<B, 1>) -> Tensor<B, 1> {
    let shard = if shard.dtype() == DType::F32 {
        shard.clone()
    } else {
        shard.clone().cast(DType::F32)
    };
    (shard.clone() * shard).sum()
}

/// The factor by which to scale every gradient so that the global L2 norm is at most
/// `max_norm`, from the global sum of squares `total_sq_norm` (all stages, all shards).
///
/// * `1.0` when `max_norm <= 0` or `NaN` (clipping disabled) or `sqrt(total_sq_norm) <=
///   max_norm` (nothing to clip);
/// * `max_norm / sqrt(total_sq_norm)` otherwise, in `f64`. Unlike PyTorch's
///   `clip_grad_norm_` there is no `1e-6` in the denominator: the norm exceeds `max_norm > 0`
///   here, so it cannot be zero;
/// * an infinite total gives `0.0` and a `NaN` total gives `NaN` (the overflow shows in the
///   parameters rather than being hidden; check `total_sq_norm.is_finite()` first to skip such
///   a step instead).
///
/// Every rank must call this with the same all-reduced total and the same `max_norm` (see the
/// [module documentation](self)).
pub fn clip_coefficient(total_sq_norm: f64, max_norm: f64) -> f64 {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return 1.0;
    }
    // A negative total can only come from a buggy reduction; treat it as a zero norm. (Not
    // `f64::max`, which would turn a NaN total into 0 and hide it.)
    let norm = if total_sq_norm < 0.0 {
        0.0
    } else {
        total_sq_norm.sqrt()
    };
    if norm <= max_norm {
        1.0
    } else {
        // NaN compares false above and propagates here; +inf gives 0.
        max_norm / norm
    }
}

/// Scales a gradient by a clipping coefficient (unchanged, without an operation, when it is
/// exactly 1). The coefficient is converted to the element type once, so every rank and the
/// reference apply the same `f32` factor.
pub fn clip_grad<B: Backend, const D: usize>(grad: Tensor<B, D>, coefficient: f64) -> Tensor<B, D> {
    if coefficient == 1.0 {
        grad
    } else {
        grad.mul_scalar(coefficient)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_the_threshold_nothing_is_clipped() {
        assert_eq!(clip_coefficient(0.0, 1.0), 1.0);
        assert_eq!(clip_coefficient(0.81, 1.0), 1.0);
        // Exactly at the threshold: no clipping.
        assert_eq!(clip_coefficient(4.0, 2.0), 1.0);
    }

    #[test]
    fn above_the_threshold_the_norm_becomes_max_norm() {
        // ‖g‖ = 5 (3-4-5), max 1 → 0.2.
        assert_eq!(clip_coefficient(25.0, 1.0), 0.2);
        // ‖g‖ = 10, max 2.5 → 0.25.
        assert_eq!(clip_coefficient(100.0, 2.5), 0.25);
        let c = clip_coefficient(7.0, 1.5);
        assert!((c * 7f64.sqrt() - 1.5).abs() < 1e-15);
    }

    #[test]
    fn disabled_and_non_finite() {
        assert_eq!(clip_coefficient(1e12, 0.0), 1.0);
        assert_eq!(clip_coefficient(1e12, -1.0), 1.0);
        assert_eq!(clip_coefficient(1e12, f64::NAN), 1.0);
        assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
        assert!(clip_coefficient(f64::NAN, 1.0).is_nan());
    }
}
