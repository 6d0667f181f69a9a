//! Mixed precision: the dtype the stages compute in, and dynamic loss scaling for f16.
//!
//! Whatever the compute dtype, the owned shards (master weights), their AdamW moments and
//! every reduction stay fp32: UNSHARD casts the gathered fp32 parameters to the compute dtype
//! as it loads them into the stage module, each backward casts the parameter gradients back
//! to fp32 before they are accumulated and reduce-scattered. Activations and their gradients
//! travel between stages in the compute dtype (bf16 as 2 bytes a value): the receiving stage
//! would narrow a widened value back anyway, so the half dtype on the wire loses nothing and
//! halves the pipeline's bytes.

use std::fmt;
use std::str::FromStr;

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use super::EngineError;

/// The floating-point type the stages compute in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything fp32.
    #[default]
    Fp32,
    /// bfloat16 compute (fp32's range, 8-bit mantissa): no loss scaling needed.
    Bf16,
    /// IEEE half compute (range ±65504): gradients are protected by dynamic loss scaling.
    F16,
}

impl Precision {
    /// The name used on the command line and in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// The Burn dtype of the stage computation.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// Whether this precision uses dynamic loss scaling (f16 only: bf16 has fp32's range).
    pub fn scales_loss(self) -> bool {
        self == Precision::F16
    }

    /// Refuses a precision the backend cannot compute in, before any work; `supported` says
    /// whether the backend fully supports a dtype on the run's device (Burn's
    /// `Backend::supports_dtype`).
    pub fn require(
        self,
        backend: &str,
        supported: impl Fn(DType) -> bool,
    ) -> Result<(), EngineError> {
        if supported(self.dtype()) {
            return Ok(());
        }
        Err(EngineError::Config(format!(
            "precision {self}: the backend {backend} cannot compute in {:?} on this device; \
             use --precision fp32 or a backend with {self} support (Flex on CPU, or a GPU \
             with {self} arithmetic)",
            self.dtype()
        )))
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "f16" | "fp16" => Ok(Precision::F16),
            other => Err(format!(
                "unknown precision `{other}`; expected `fp32`, `bf16` or `f16`"
            )),
        }
    }
}

/// Dynamic loss scaling settings (used with [`Precision::F16`] only).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossScaling {
    /// Scale of the first step; a power of two keeps scaling and unscaling exact.
    pub initial_scale: f64,
    /// Good (finite) steps in a row after which the scale doubles.
    pub growth_interval: usize,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            initial_scale: 65536.0,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    /// Refuses settings that cannot work.
    pub fn validate(&self) -> Result<(), EngineError> {
        if !(self.initial_scale.is_finite() && self.initial_scale >= 1.0) {
            return Err(EngineError::Config(format!(
                "loss scaling: initial scale {} must be finite and at least 1; try 65536",
                self.initial_scale
            )));
        }
        if self.growth_interval == 0 {
            return Err(EngineError::Config(
                "loss scaling: growth interval must be at least 1 step; try 2000".into(),
            ));
        }
        Ok(())
    }
}

/// The dynamic loss scale of an f16 run where it stands after a step: saved in checkpoints so
/// that a resumed run continues with the scale the uninterrupted run would have used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerState {
    /// The loss scale.
    pub scale: f64,
    /// Finite steps in a row since the scale last changed.
    pub good_steps: usize,
}

/// The current loss scale and the good steps since it last changed; every rank holds the
/// same, because every rank takes the same overflow decision (see [`super::nonfinite`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LossScaler {
    settings: LossScaling,
    /// Scale applied to the loss before backward; 1 without scaling.
    pub(crate) scale: f64,
    good_steps: usize,
    enabled: bool,
}

impl LossScaler {
    /// The scaler of a run in `precision` (disabled, scale 1, unless f16).
    pub(crate) fn new(precision: Precision, settings: LossScaling) -> Self {
        let enabled = precision.scales_loss();
        LossScaler {
            settings,
            scale: if enabled { settings.initial_scale } else { 1.0 },
            good_steps: 0,
            enabled,
        }
    }

    /// Where the scale stands, for a checkpoint; `None` without loss scaling.
    pub(crate) fn state(&self) -> Option<ScalerState> {
        self.enabled.then_some(ScalerState {
            scale: self.scale,
            good_steps: self.good_steps,
        })
    }

    /// Continue from a checkpoint's scale (ignored without loss scaling, e.g. an f16
    /// checkpoint resumed in bf16).
    pub(crate) fn restore(&mut self, state: ScalerState) {
        if self.enabled {
            self.scale = state.scale;
            self.good_steps = state.good_steps;
        }
    }

    /// Whether overflowing gradients are handled by lowering the scale.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// A step whose gradients overflowed: halve the scale (not below 1).
    pub(crate) fn overflow(&mut self) {
        self.scale = (self.scale / 2.0).max(1.0);
        self.good_steps = 0;
    }

    /// A finite step: double the scale after `growth_interval` of them in a row.
    pub(crate) fn good(&mut self) {
        if !self.enabled {
            return;
        }
        self.good_steps += 1;
        if self.good_steps >= self.settings.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_and_print() {
        for p in [Precision::Fp32, Precision::Bf16, Precision::F16] {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
        }
        assert!("fp8".parse::<Precision>().unwrap_err().contains("`bf16`"));
    }

    #[test]
    fn unsupported_dtype_is_refused_with_the_fix() {
        let err = Precision::Bf16
            .require("TestBackend", |d| d == DType::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot compute in BF16"), "{err}");
        assert!(err.contains("--precision fp32"), "{err}");
        assert!(Precision::Fp32
            .require("TestBackend", |d| d == DType::F32)
            .is_ok());
    }

    #[test]
    fn scale_halves_on_overflow_and_doubles_after_the_interval() {
        let settings = LossScaling {
            initial_scale: 1024.0,
            growth_interval: 2,
        };
        let mut s = LossScaler::new(Precision::F16, settings);
        s.overflow();
        assert_eq!(s.scale, 512.0);
        s.good();
        assert_eq!(s.scale, 512.0);
        s.good();
        assert_eq!(s.scale, 1024.0);
        let mut bf = LossScaler::new(Precision::Bf16, settings);
        bf.good();
        bf.good();
        assert_eq!(bf.scale, 1.0);
        assert!(!bf.enabled());
    }
}
