//! The learning rate per optimizer step: constant, or linear warm-up then cosine decay.
//!
//! A schedule is a pure function of the 1-based step, so every rank computes the same value
//! without communicating, and a single-device reference run passes the same `lr(step)` to
//! Burn's `Optimizer::step`.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use super::OptimError;

/// The learning rate as a function of the 1-based optimizer step.
///
/// # Formula
///
/// For [`LrSchedule::Constant`], `lr(s) = lr`. For [`LrSchedule::WarmupCosine`] with `W =
/// warmup_steps`, `T = total_steps`, all arithmetic in `f64` in the order written:
///
/// ```text
/// s ≤ W (and W > 0):  lr(s) = peak · s / W                         (peak/W, 2·peak/W, …, peak)
/// T ≤ W:              lr(s) = peak                                  (no decay phase)
/// otherwise:          p = min(s - W, T - W) / (T - W)
///                     lr(s) = min_lr + 0.5 · (peak - min_lr) · (1 + cos(p · π))
/// ```
///
/// The warm-up starts at `peak / W` rather than 0 so that the first step is not wasted, and
/// reaches `peak` at step `W`; the cosine then starts just below `peak` at step `W + 1` and
/// reaches `min_lr` exactly at step `T`, where it stays. `W = 0, T = 0` is the constant `peak`.
/// Step 0 is not an optimizer step; it gives 0 with a warm-up and `peak` without.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LrSchedule {
    /// The same learning rate every step.
    Constant {
        /// The learning rate.
        lr: f64,
    },
    /// Linear warm-up to `peak` over `warmup_steps`, then cosine decay to `min_lr` at
    /// `total_steps` (see the formula above).
    WarmupCosine {
        /// The learning rate at the end of the warm-up.
        peak: f64,
        /// The learning rate from `total_steps` on.
        min_lr: f64,
        /// Steps of linear warm-up (0: none).
        warmup_steps: usize,
        /// The step at which the decay reaches `min_lr` (≤ `warmup_steps`: no decay).
        total_steps: usize,
    },
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> Self {
        LrSchedule::Constant { lr }
    }

    /// Warm-up to `peak` over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`.
    pub fn warmup_cosine(peak: f64, min_lr: f64, warmup_steps: usize, total_steps: usize) -> Self {
        LrSchedule::WarmupCosine {
            peak,
            min_lr,
            warmup_steps,
            total_steps,
        }
    }

    /// The learning rate of the 1-based optimizer step `step`.
    pub fn lr(&self, step: usize) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine {
                peak,
                min_lr,
                warmup_steps,
                total_steps,
            } => {
                if warmup_steps > 0 && step <= warmup_steps {
                    peak * step as f64 / warmup_steps as f64
                } else if total_steps <= warmup_steps {
                    peak
                } else {
                    let decay_steps = total_steps - warmup_steps;
                    let done = step.saturating_sub(warmup_steps).min(decay_steps);
                    let progress = done as f64 / decay_steps as f64;
                    min_lr + 0.5 * (peak - min_lr) * (1.0 + (progress * PI).cos())
                }
            }
        }
    }

    /// Checks the ranges: learning rates finite and ≥ 0, and `min_lr ≤ peak`.
    pub fn validate(&self) -> Result<(), OptimError> {
        let finite_non_negative = |name: &str, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(OptimError::LearningRate(format!(
                    "{name} = {value} must be finite and >= 0"
                )))
            }
        };
        match *self {
            LrSchedule::Constant { lr } => finite_non_negative("lr", lr),
            LrSchedule::WarmupCosine { peak, min_lr, .. } => {
                finite_non_negative("peak", peak)?;
                finite_non_negative("min_lr", min_lr)?;
                if min_lr > peak {
                    return Err(OptimError::LearningRate(format!(
                        "min_lr = {min_lr} is above peak = {peak}; the cosine decays from peak \
                         to min_lr, so choose min_lr <= peak"
                    )));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn constant_is_constant() {
        let s = LrSchedule::constant(3e-4);
        assert!((0..10).all(|step| s.lr(step) == 3e-4));
        // Without warm-up and decay the cosine schedule is constant too.
        let s = LrSchedule::warmup_cosine(0.5, 0.0, 0, 0);
        assert!((1..10).all(|step| s.lr(step) == 0.5));
    }

    #[test]
    fn warmup_then_cosine_hand_computed() {
        let s = LrSchedule::warmup_cosine(1.0, 0.0, 4, 12);
        let expected = [
            (0, 0.0),
            (1, 0.25),
            (2, 0.5),
            (3, 0.75),
            (4, 1.0),
            // p = 1/8: 0.5·(1 + cos(π/8)) = 0.5·(1 + 0.9238795325112867)
            (5, 0.961_939_766_255_643_4),
            // p = 2/8: 0.5·(1 + √2/2)
            (6, 0.853_553_390_593_273_7),
            // p = 4/8: cos(π/2) = 0
            (8, 0.5),
            // p = 6/8: 0.5·(1 - √2/2)
            (10, 0.146_446_609_406_726_27),
            (12, 0.0),
            (100, 0.0),
        ];
        for (step, lr) in expected {
            assert!(close(s.lr(step), lr), "step {step}: {} vs {lr}", s.lr(step));
        }
    }

    #[test]
    fn cosine_respects_min_lr_without_warmup() {
        let s = LrSchedule::warmup_cosine(1.1, 0.1, 0, 10);
        // p = 1/10 at step 1: 0.1 + 0.5·1.0·(1 + cos(π/10)), cos(π/10) = 0.9510565162951535
        assert!(close(s.lr(1), 1.075_528_258_147_577));
        // p = 1/2 at step 5: 0.1 + 0.5 = 0.6
        assert!(close(s.lr(5), 0.6));
        assert!(close(s.lr(10), 0.1));
        assert!(close(s.lr(11), 0.1));
    }

    #[test]
    fn warmup_without_decay_stays_at_peak() {
        let s = LrSchedule::warmup_cosine(2.0, 0.0, 3, 0);
        let lrs: Vec<f64> = (1..=5).map(|step| s.lr(step)).collect();
        assert!(close(lrs[0], 2.0 / 3.0));
        assert!(close(lrs[1], 4.0 / 3.0));
        assert_eq!(&lrs[2..], &[2.0, 2.0, 2.0]);
    }

    #[test]
    fn serde_round_trip_and_format() {
        let s = LrSchedule::warmup_cosine(1e-3, 1e-5, 10, 100);
        let json = serde_json::to_string(&s).expect("serialize");
        assert_eq!(
            json,
            r#"{"kind":"warmup_cosine","peak":0.001,"min_lr":0.00001,"warmup_steps":10,"total_steps":100}"#
        );
        let back: LrSchedule = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, s);
        let c: LrSchedule = serde_json::from_str(r#"{"kind":"constant","lr":0.01}"#).expect("c");
        assert_eq!(c, LrSchedule::constant(0.01));
    }

    #[test]
    fn validation_names_the_field() {
        assert!(LrSchedule::constant(1e-3).validate().is_ok());
        let err = LrSchedule::constant(f64::NAN).validate().unwrap_err();
        assert!(err.to_string().contains("lr = NaN"), "{err}");
        let err = LrSchedule::warmup_cosine(1e-3, 1e-2, 0, 10)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("min_lr"), "{err}");
        let err = LrSchedule::warmup_cosine(-1.0, 0.0, 0, 10)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("peak"), "{err}");
    }
}
