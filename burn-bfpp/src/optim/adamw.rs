//! AdamW on one flat shard, reproducing Burn 0.21's `AdamW` operation for operation.
//!
//! # The formula (as Burn 0.21 computes it)
//!
//! From `burn-optim-0.21.0/src/optim/adamw.rs` (`AdamW::step`, lines 70–107, and
//! `AdaptiveMomentumW::transform`, lines 153–221). `β1, β2, ε, λ` are `f32`, the learning rate
//! `lr` is `f64` and passed to every step (Burn's `Optimizer::step(lr, ..)` takes the value the
//! LR scheduler returned for that step). `t` is the 1-based step count of the parameter. Each
//! line is one tensor operation, in Burn's order; scalars are converted to the tensor's
//! element type by the backend:
//!
//! ```text
//! f1 = 1.0f32 - β1                      f2 = 1.0f32 - β2              (f32, lines 158–159)
//! t == 1:  m = g · f1                   v = g² · f2                    (lines 188–191)
//! t > 1:   m = m · β1 + g · f1          v = v · β2 + g² · f2           (lines 163–172)
//! m̂ = m / (1f32 - β1.powi(t))           v̂ = v / (1f32 - β2.powi(t))   (f32 powi, lines 204–215)
//! δ = m̂ / (sqrt(v̂) + ε)                                                (lines 217–218)
//! d = lr · (λ as f64)                                                   (f64, line 83)
//! θ' = θ                  if d == 0.0                                   (lines 85–86)
//! θ' = θ · (1.0 - d)      otherwise (1.0 - d in f64)                    (line 97)
//! θ  = θ' - δ · lr                                                      (line 100)
//! ```
//!
//! So the weight decay is decoupled and multiplied by the learning rate (`θ·(1 - lr·λ)`), it is
//! applied to the parameters *before* the Adam update is subtracted (from the pre-update value,
//! not from the updated one), ε is added to `sqrt(v̂)` after bias correction, and the bias
//! corrections use `f32` powers. Defaults (`AdamWConfig`, lines 16–42): `β1 = 0.9`,
//! `β2 = 0.999`, `ε = 1e-5`, `λ = 1e-4`, no AMSGrad, no cautious weight decay, no gradient
//! clipping. [`ShardOptimizer`] implements exactly this (neither AMSGrad nor cautious weight
//! decay, which are off by default).
//!
//! # Padding
//!
//! The padded tail of a shard holds zeros with zero gradients: `m = v = 0`, `δ = 0 / (0 + ε)
//! = 0` and `0 · (1 - d) - 0 = 0`, so padding stays exactly zero as long as `ε > 0` (which
//! [`AdamWSettings::validate`] requires; with `ε = 0` the padding would become `0/0 = NaN`).
//! Elementwise arithmetic means padding can never affect real elements in any case.

use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::OptimError;

/// The learning-rate-independent AdamW hyper-parameters, with Burn's `AdamWConfig` defaults.
///
/// The types are Burn's (`f32`) so that the scalars entering the arithmetic are exactly the
/// ones Burn uses; the learning rate comes per step from an [`super::LrSchedule`].
// Not `Copy`: the engine holds it in its configuration and clones it for each stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWSettings {
    /// Exponential decay of the first moment (Burn's `beta_1`, default 0.9).
    pub beta1: f32,
    /// Exponential decay of the second moment (Burn's `beta_2`, default 0.999).
    pub beta2: f32,
    /// Added to `sqrt(v̂)` for numerical stability (Burn's `epsilon`, default 1e-5).
    pub epsilon: f32,
    /// Decoupled weight decay, multiplied by the learning rate (default 1e-4).
    pub weight_decay: f32,
}

impl Default for AdamWSettings {
    /// Burn 0.21's `AdamWConfig::new()` defaults.
    fn default() -> Self {
        AdamWSettings {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-5,
            weight_decay: 1e-4,
        }
    }
}

impl AdamWSettings {
    /// Checks the ranges: `β1, β2 ∈ [0, 1)`, `ε > 0` (finite) and `λ ≥ 0` (finite).
    ///
    /// `ε > 0` is stricter than Burn, which accepts 0: with 0, any element whose gradient has
    /// always been zero (the padding, an unused parameter) would become `NaN`.
    pub fn validate(&self) -> Result<(), OptimError> {
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(OptimError::Settings(format!(
                    "{name} = {beta} must be in [0, 1) (Burn's default: beta1 = 0.9, beta2 = 0.999)"
                )));
            }
        }
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(OptimError::Settings(format!(
                "epsilon = {} must be finite and > 0 (Burn's default: 1e-5)",
                self.epsilon
            )));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(OptimError::Settings(format!(
                "weight_decay = {} must be finite and >= 0 (0 disables it)",
                self.weight_decay
            )));
        }
        Ok(())
    }

    /// The settings of burn-optim's `AdamWConfig`, whose fields are private: read through its
    /// serde form. β1, β2, ε and the weight decay map one to one; what the flat optimizer
    /// does not implement is refused, naming the equivalent: AMSGrad, cautious weight decay,
    /// and per-parameter gradient clipping (`grad_clipping`; clip the global norm with
    /// `TrainConfig::max_grad_norm` instead).
    pub fn from_burn(config: &AdamWConfig) -> Result<Self, String> {
        let value = serde_json::to_value(config)
            .map_err(|e| format!("burn-optim's AdamWConfig did not serialise: {e}"))?;
        let field = |name: &str| {
            value
                .get(name)
                .ok_or_else(|| format!("burn-optim's AdamWConfig has no `{name}` (a newer Burn?)"))
        };
        let number = |name: &str| -> Result<f32, String> {
            field(name)?
                .as_f64()
                .map(|v| v as f32)
                .ok_or_else(|| format!("AdamWConfig's `{name}` is not a number"))
        };
        if field("amsgrad")?.as_bool() == Some(true) {
            return Err(
                "AdamWConfig with AMSGrad (`with_amsgrad(true)`): the sharded \
                        flat-buffer AdamW implements plain AdamW only; leave amsgrad off"
                    .into(),
            );
        }
        if field("cautious_weight_decay")?.as_bool() == Some(true) {
            return Err("AdamWConfig with cautious weight decay \
                        (`with_cautious_weight_decay(true)`): the sharded flat-buffer AdamW \
                        applies plain decoupled weight decay; leave it off"
                .into());
        }
        if !field("grad_clipping")?.is_null() {
            return Err(
                "AdamWConfig with gradient clipping (`with_grad_clipping`): Burn clips \
                        each parameter tensor on its own, which the sharded optimizer cannot \
                        (a shard holds parts of many tensors); clip the global gradient norm \
                        over every stage and shard with TrainConfig's `max_grad_norm` instead"
                    .into(),
            );
        }
        let settings = AdamWSettings {
            beta1: number("beta_1")?,
            beta2: number("beta_2")?,
            epsilon: number("epsilon")?,
            weight_decay: number("weight_decay")?,
        };
        settings.validate().map_err(|e| e.to_string())?;
        Ok(settings)
    }

    /// The equivalent Burn configuration, for single-device reference runs
    /// (`settings.to_burn().init()`); it has no gradient clipping (see [`super`] on why global
    /// clipping is done by hand).
    pub fn to_burn(&self) -> AdamWConfig {
        AdamWConfig::new()
            .with_beta_1(self.beta1)
            .with_beta_2(self.beta2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay)
    }
}

/// AdamW state and update for one flat shard of a stage's parameters.
///
/// Holds the two moment buffers of the shard (the ZeRO-1 optimizer state) and the number of
/// steps taken; all parameters of the shard share one step counter, as they all receive a
/// gradient every step. Works on plain backend tensors (no autodiff). The moments are
/// allocated by the first step, as Burn's optimizer allocates its state, so a run's memory
/// before its first update is the parameters' and the gradients' alone.
#[derive(Debug, Clone)]
pub struct ShardOptimizer<B: Backend> {
    settings: AdamWSettings,
    len: usize,
    device: B::Device,
    /// `(m, v)`, from the first step on.
    moments: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    steps: usize,
}

impl<B: Backend> ShardOptimizer<B> {
    /// An optimizer for a shard of `len` elements with zero moments, on `device`.
    ///
    /// The settings are not validated here (call [`AdamWSettings::validate`] where the run's
    /// configuration is read), so the optimizer accepts everything Burn accepts.
    pub fn new(len: usize, settings: AdamWSettings, device: &B::Device) -> Self {
        ShardOptimizer {
            settings,
            len,
            device: device.clone(),
            moments: None,
            steps: 0,
        }
    }

    /// Restores an optimizer from saved moments and step count (a checkpoint).
    ///
    /// With `steps == 0` the moments are ignored: the first step initialises them from the
    /// gradient, as Burn does.
    pub fn from_state(
        settings: AdamWSettings,
        moment_1: Tensor<B, 1>,
        moment_2: Tensor<B, 1>,
        steps: usize,
    ) -> Result<Self, OptimError> {
        let [len] = moment_1.dims();
        check_len("the second moment", len, &moment_2)?;
        Ok(ShardOptimizer {
            settings,
            len,
            device: moment_1.device(),
            moments: (steps > 0).then_some((moment_1, moment_2)),
            steps,
        })
    }

    /// Number of steps taken so far (the `t` of the bias correction of the next step is this
    /// plus one).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The first moment `m` (zeros before the first step).
    pub fn first_moment(&self) -> Tensor<B, 1> {
        match &self.moments {
            Some((m, _)) => m.clone(),
            None => crate::model::zeros_flat(self.len, &self.device),
        }
    }

    /// The second moment `v` (zeros before the first step).
    pub fn second_moment(&self) -> Tensor<B, 1> {
        match &self.moments {
            Some((_, v)) => v.clone(),
            None => crate::model::zeros_flat(self.len, &self.device),
        }
    }

    /// [`Self::step_clipped`] without clipping (coefficient 1): the tests' step.
    #[cfg(all(test, feature = "flex"))]
    pub(crate) fn step(
        &mut self,
        lr: f64,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
    ) -> Result<Tensor<B, 1>, OptimError> {
        self.step_clipped(lr, param, grad, 1.0)
    }

    /// One AdamW step with learning rate `lr` (this step's value from the schedule), the
    /// gradient first scaled by `coefficient` (the global-norm clipping factor,
    /// [`super::clip_grad`]'s operation): returns the updated shard and advances the step
    /// counter. `param` and `grad` are this rank's shard of the padded flat parameters and of
    /// the (already averaged) gradient. The arithmetic is Burn 0.21's, operation for operation
    /// (see the [module documentation](self)). Every operation consumes the
    /// buffer it writes where nothing else holds it (the parameters, the moments, the
    /// gradient), so a backend that updates such buffers in place (Burn's CPU backend does)
    /// allocates only the two bias-corrected moments.
    pub fn step_clipped(
        &mut self,
        lr: f64,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        coefficient: f64,
    ) -> Result<Tensor<B, 1>, OptimError> {
        check_len("the parameter shard", self.len, &param)?;
        check_len("the gradient shard", self.len, &grad)?;
        if !lr.is_finite() {
            return Err(OptimError::LearningRate(format!(
                "lr = {lr} must be finite; check the schedule's peak and min_lr"
            )));
        }
        let AdamWSettings {
            beta1,
            beta2,
            epsilon,
            weight_decay,
        } = self.settings;
        let grad = super::clip_grad(grad, coefficient);

        // Moments (transform, adamw.rs:158–199). The first step uses Burn's initialising
        // branch rather than `0·β + g·f`, which is the same value but not the same operations.
        let factor_1 = 1.0 - beta1;
        let factor_2 = 1.0 - beta2;
        let (moment_1, moment_2) = match self.moments.take() {
            Some((m, v)) if self.steps > 0 => (
                m.mul_scalar(beta1).add(grad.clone().mul_scalar(factor_1)),
                v.mul_scalar(beta2).add(grad.square().mul_scalar(factor_2)),
            ),
            _ => (
                grad.clone().mul_scalar(factor_1),
                grad.square().mul_scalar(factor_2),
            ),
        };
        self.steps += 1;
        // Burn converts its `usize` counter with `as i32`; beyond i32::MAX steps the powers
        // are 0 either way.
        let time = i32::try_from(self.steps).unwrap_or(i32::MAX);

        // Bias correction with f32 powers and the update direction (adamw.rs:204–218).
        let moment_1_corrected = moment_1.clone().div_scalar(1f32 - beta1.powi(time));
        let moment_2_corrected = moment_2.clone().div_scalar(1f32 - beta2.powi(time));
        let update_delta = moment_1_corrected.div(moment_2_corrected.sqrt().add_scalar(epsilon));
        self.moments = Some((moment_1, moment_2));

        // Decoupled weight decay on the pre-update parameters, then the update (adamw.rs:83–100).
        let decay_rate = lr * (weight_decay as f64);
        let decayed = if decay_rate == 0.0 {
            param
        } else {
            param.mul_scalar(1.0 - decay_rate)
        };
        Ok(decayed - update_delta.mul_scalar(lr))
    }
}

/// Checks that a 1-D tensor has the shard length.
fn check_len<B: Backend>(
    what: &'static str,
    expected: usize,
    tensor: &Tensor<B, 1>,
) -> Result<(), OptimError> {
    let [got] = tensor.dims();
    if got == expected {
        Ok(())
    } else {
        Err(OptimError::ShardLength {
            what,
            expected,
            got,
        })
    }
}
