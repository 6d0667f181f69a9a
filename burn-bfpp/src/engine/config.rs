//! [`TrainConfig`]: everything a run needs besides the model and the data, with defaults,
//! built in code (`TrainConfig::new(steps).with_pp(2)…`, Burn's `Config` derive) or read from
//! TOML ([`TrainConfig::from_toml_str`], every key optional), and the optimizer's settings as
//! Burn users write them: burn-optim's [`AdamWConfig`] and its learning-rate schedulers.

use std::time::Duration;

use burn::config::Config;
use burn::lr_scheduler::composed::ComposedLrSchedulerConfig;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::lr_scheduler::noam::NoamLrSchedulerConfig;
use burn::lr_scheduler::step::StepLrSchedulerConfig;
use burn::lr_scheduler::LrScheduler;
use burn::optim::AdamWConfig;

use super::{EngineConfig, EngineError, LossScaling, NonFinitePolicy, Precision};
use crate::model::ModelSplit;
use crate::optim::{AdamWSettings, LrSchedule};
use crate::schedule::{PipelineSchedule, Placement, ScheduleKind, ZeroLevel};

/// How to train a model: the parallel layout, the optimizer and the run's settings.
///
/// Every field but `steps` has a default: one rank, 4 micro-batches per step, breadth-first,
/// ZeRO-3 (whatever `dp`: with one replica nothing is sharded), Burn's `AdamWConfig::new()`
/// at a constant learning rate of 1e-3, no gradient clipping, fp32. The model is cut into
/// `pp × loops` stages; the global batch of a step is `dp × microbatches` micro-batches.
///
/// ```
/// use burn::optim::AdamWConfig;
/// use burn_bfpp::engine::{LrConfig, TrainConfig};
/// use burn_bfpp::schedule::ZeroLevel;
///
/// let config = TrainConfig::new(100)
///     .with_pp(2)
///     .with_loops(2)
///     .with_dp(2)
///     .with_zero(ZeroLevel::Zero3)
///     .with_adamw(AdamWConfig::new().with_weight_decay(0.1))
///     .with_lr(LrConfig::WarmupCosine { peak: 3e-4, min_lr: 3e-5, warmup_steps: 10 })
///     .with_max_grad_norm(1.0);
/// assert_eq!(config.world_size(), 4);
/// let again = TrainConfig::from_toml_str(&config.to_toml()).unwrap();
/// assert_eq!(again.dp, 2);
/// ```
#[derive(Config, Debug)]
pub struct TrainConfig {
    /// Optimizer steps to run (with a checkpoint to resume from: the total, counting the
    /// steps before it).
    pub steps: usize,
    /// Pipeline ranks P.
    #[config(default = 1)]
    pub pp: usize,
    /// Stages per pipeline rank V; the model is cut into `pp × loops` stages.
    #[config(default = 1)]
    pub loops: usize,
    /// Data-parallel replicas D; the world is `pp × dp` ranks.
    #[config(default = 1)]
    pub dp: usize,
    /// Micro-batches per step and replica M.
    #[config(default = 4)]
    pub microbatches: usize,
    /// Breadth-first micro-batches per sweep K (breadth-first only; must divide M); none: M.
    pub bf_microbatches: Option<usize>,
    /// The schedule: breadth-first, interleaved (Megatron's depth-first), 1F1B or GPipe.
    #[config(default = "ScheduleKind::BreadthFirst")]
    pub schedule: ScheduleKind,
    /// Stage → rank placement.
    #[config(default = "Placement::Looping")]
    pub placement: Placement,
    /// A schedule file (PyTorch's action CSV, either naming generation, or `bfpp schedule
    /// --format csv`) whose compute order runs instead of the generated `schedule`; its
    /// placement replaces `placement`. `pp`, `loops` and `microbatches` must be the file's
    /// (the command line takes them from it); the transfers and collectives are placed again
    /// for this run's ZeRO level and buffers.
    pub schedule_file: Option<std::path::PathBuf>,
    /// ZeRO level over the data-parallel group.
    #[config(default = "ZeroLevel::Zero3")]
    pub zero: ZeroLevel,
    /// Rotating full-size weight and gradient buffers per rank (ZeRO-2/3).
    #[config(default = 2)]
    pub buffers: usize,
    /// Keep only each stage's input and recompute its forward inside the backward.
    #[config(default = false)]
    pub recompute: bool,
    /// How the model's layers are divided into stages.
    #[config(default = "ModelSplit::Even")]
    pub split: ModelSplit,
    /// AdamW's settings, burn-optim's own config: β1, β2, ε and weight decay are used;
    /// AMSGrad, cautious weight decay and per-parameter clipping are refused (the sharded
    /// flat-buffer optimizer does not implement them; see [`AdamWSettings::from_burn`]).
    #[config(default = "AdamWConfig::new()")]
    pub adamw: AdamWConfig,
    /// The learning rate per step.
    #[config(default = "LrConfig::Constant(1e-3)")]
    pub lr: LrConfig,
    /// Clip the global gradient norm (over every stage and shard) to this; 0 disables it.
    #[config(default = 0.0)]
    pub max_grad_norm: f64,
    /// Seconds any blocking communication waits for its peers before the run fails.
    #[config(default = 300.0)]
    pub comm_timeout_secs: f64,
    /// Overlap the data-parallel collectives with compute; off waits where each starts
    /// (bitwise the same results).
    #[config(default = true)]
    pub overlap_collectives: bool,
    /// What a step with a NaN or infinite loss or gradient norm does.
    #[config(default = "NonFinitePolicy::Stop")]
    pub on_nonfinite: NonFinitePolicy,
    /// The dtype the stages compute in; master weights, AdamW state and reductions stay
    /// fp32.
    #[config(default = "Precision::Fp32")]
    pub precision: Precision,
    /// Dynamic loss scaling, used with [`Precision::F16`] only.
    #[config(default = "LossScaling::default()")]
    pub loss_scaling: LossScaling,
}

/// The learning rate per optimizer step: a constant, warm-up + cosine, or one of burn-optim's
/// schedulers (stepped once per optimizer step, from step 1).
#[derive(Config, Debug)]
pub enum LrConfig {
    /// The same learning rate every step.
    Constant(f64),
    /// Linear warm-up to `peak` over `warmup_steps`, then cosine decay to `min_lr` at the
    /// run's last step.
    WarmupCosine {
        /// The learning rate at the end of the warm-up.
        peak: f64,
        /// The learning rate at the last step.
        min_lr: f64,
        /// Steps of linear warm-up (0: none).
        warmup_steps: usize,
    },
    /// burn-optim's linear scheduler.
    Linear(LinearLrSchedulerConfig),
    /// burn-optim's cosine-annealing scheduler.
    Cosine(CosineAnnealingLrSchedulerConfig),
    /// burn-optim's exponential scheduler.
    Exponential(ExponentialLrSchedulerConfig),
    /// burn-optim's Noam scheduler.
    Noam(NoamLrSchedulerConfig),
    /// burn-optim's step scheduler.
    Step(StepLrSchedulerConfig),
    /// burn-optim's composition of schedulers.
    Composed(ComposedLrSchedulerConfig),
}

impl LrConfig {
    /// The learning rate of steps `1..=steps`, by index `step − 1`: burn-optim's schedulers
    /// are stepped once per optimizer step, every rank alike. Fails with the scheduler's own
    /// message when its configuration is invalid.
    pub fn rates(&self, steps: usize) -> Result<Vec<f64>, String> {
        fn run<S: LrScheduler>(mut scheduler: S, steps: usize) -> Vec<f64> {
            (0..steps).map(|_| scheduler.step()).collect()
        }
        let ours = |schedule: LrSchedule| -> Result<Vec<f64>, String> {
            schedule.validate().map_err(|e| e.to_string())?;
            Ok((1..=steps).map(|step| schedule.lr(step)).collect())
        };
        match self {
            LrConfig::Constant(lr) => ours(LrSchedule::constant(*lr)),
            LrConfig::WarmupCosine {
                peak,
                min_lr,
                warmup_steps,
            } => ours(LrSchedule::warmup_cosine(
                *peak,
                *min_lr,
                *warmup_steps,
                steps,
            )),
            LrConfig::Linear(c) => Ok(run(c.init()?, steps)),
            LrConfig::Cosine(c) => Ok(run(c.init()?, steps)),
            LrConfig::Exponential(c) => Ok(run(c.init()?, steps)),
            LrConfig::Noam(c) => Ok(run(c.init()?, steps)),
            LrConfig::Step(c) => Ok(run(c.init()?, steps)),
            LrConfig::Composed(c) => Ok(run(c.init()?, steps)),
        }
    }
}

impl TrainConfig {
    /// The same configuration for another number of steps (`steps` is the one setting
    /// without a default, so Burn's `Config` derive gives it no `with_` method).
    pub fn with_steps(mut self, steps: usize) -> Self {
        self.steps = steps;
        self
    }

    /// Ranks the run needs: `pp × dp`.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp
    }

    /// The configuration as TOML, every field written out.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot print: {e}\n"))
    }

    /// Reads a configuration from TOML, every key optional except `steps`: the keys given
    /// replace the defaults of [`TrainConfig::new`]. An unknown key, or a value of the wrong
    /// type, is an error naming it.
    pub fn from_toml_str(text: &str) -> Result<Self, EngineError> {
        let given = parse_table(text)?;
        let steps = match given.get("steps").map(toml::Value::as_integer) {
            Some(Some(n)) if n >= 0 => n as usize,
            Some(_) => {
                return Err(EngineError::Config(
                    "`steps` must be a non-negative integer".into(),
                ))
            }
            None => {
                return Err(EngineError::Config(
                    "the configuration needs `steps`, the number of optimizer steps".into(),
                ))
            }
        };
        TrainConfig::new(steps).overridden_by(given)
    }

    /// This configuration with the keys of the TOML `text` replacing its values (every key
    /// optional): how a configuration file refines defaults of one's own. An unknown key, or
    /// a value of the wrong type, is an error naming it.
    pub fn overridden_by_toml(&self, text: &str) -> Result<Self, EngineError> {
        self.overridden_by(parse_table(text)?)
    }

    fn overridden_by(&self, given: toml::Table) -> Result<Self, EngineError> {
        let mut merged = toml::Table::try_from(self).map_err(|e| {
            EngineError::Config(format!("the configuration does not serialise: {e}"))
        })?;
        merge(&mut merged, given, "")?;
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e| EngineError::Config(format!("in the configuration: {e}")))
    }

    /// Generates, lowers and validates the per-rank programs of this layout: the schedule the
    /// engine runs, for a look at it before training.
    pub fn program(&self) -> Result<PipelineSchedule, EngineError> {
        self.engine()?.program()
    }

    /// Checks every value and builds the engine's flat configuration; every error names the
    /// setting and the fix.
    pub(crate) fn engine(&self) -> Result<EngineConfig, EngineError> {
        let bad = |message: String| Err(EngineError::Config(message));
        for (name, value) in [
            ("steps", self.steps),
            ("pp", self.pp),
            ("loops", self.loops),
            ("dp", self.dp),
            ("microbatches", self.microbatches),
            ("buffers", self.buffers),
        ] {
            if value == 0 {
                return bad(format!(
                    "{name} must be at least 1: e.g. `.with_{name}(1)` in code, `--{} 1` on \
                     the command line",
                    name.replace('_', "-")
                ));
            }
        }
        if !(self.comm_timeout_secs.is_finite() && self.comm_timeout_secs > 0.0) {
            return bad(format!(
                "comm_timeout_secs is {}; it must be a positive number of seconds, e.g. 300",
                self.comm_timeout_secs
            ));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return bad(format!(
                "max_grad_norm is {}; it must be >= 0 (0 disables clipping)",
                self.max_grad_norm
            ));
        }
        let adamw = AdamWSettings::from_burn(&self.adamw).map_err(EngineError::Config)?;
        let rates = self
            .lr
            .rates(self.steps)
            .map_err(|e| EngineError::Config(format!("the learning rate: {e}")))?;
        if let Some((step, lr)) = rates
            .iter()
            .enumerate()
            .find(|(_, lr)| !(lr.is_finite() && **lr >= 0.0))
        {
            return bad(format!(
                "the learning rate of step {} is {lr}; it must be finite and >= 0",
                step + 1
            ));
        }
        Ok(EngineConfig {
            steps: self.steps,
            stop_after: None,
            pp: self.pp,
            loops: self.loops,
            dp: self.dp,
            microbatches: self.microbatches,
            bf_microbatches: self.bf_microbatches,
            schedule: self.schedule,
            placement: self.placement,
            schedule_file: self.schedule_file.clone(),
            zero: self.zero,
            buffers: self.buffers,
            recompute: self.recompute,
            split: self.split.clone(),
            adamw,
            lr: rates,
            max_grad_norm: self.max_grad_norm,
            comm_timeout: Duration::from_secs_f64(self.comm_timeout_secs),
            overlap_collectives: self.overlap_collectives,
            #[cfg(feature = "fault-injection")]
            fault: None,
            on_nonfinite: self.on_nonfinite,
            precision: self.precision,
            loss_scaling: self.loss_scaling,
        })
    }
}

/// `text` as a TOML table.
fn parse_table(text: &str) -> Result<toml::Table, EngineError> {
    toml::from_str(text)
        .map_err(|e| EngineError::Config(format!("the configuration is not TOML: {e}")))
}

/// Replaces the values of `into` by those of `given`, recursively for tables; a key `into`
/// does not have is an error naming it (its full path).
fn merge(into: &mut toml::Table, given: toml::Table, path: &str) -> Result<(), EngineError> {
    for (key, value) in given {
        let full = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        match (into.get_mut(&key), value) {
            // The learning rate is one variant of an enum: a new one replaces it whole.
            (Some(old), new) if full == "lr" => *old = new,
            (Some(toml::Value::Table(old)), toml::Value::Table(new)) => merge(old, new, &full)?,
            (Some(old), new) => *old = new,
            // Optional fields are left out of the serialised defaults.
            (None, new) if OPTIONAL_KEYS.contains(&full.as_str()) => {
                into.insert(key, new);
            }
            (None, _) => {
                return Err(EngineError::Config(format!(
                    "unknown key `{full}` in the configuration; `TrainConfig::new(steps)\
                     .to_toml()` (`bfpp train --print-config`) lists every key"
                )))
            }
        }
    }
    Ok(())
}

/// Keys of optional values, absent from the defaults' TOML when unset.
const OPTIONAL_KEYS: [&str; 2] = ["bf_microbatches", "adamw.grad_clipping"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_keys_override_the_defaults_and_unknown_keys_are_named() {
        let config = TrainConfig::from_toml_str(
            "steps = 12\npp = 2\nschedule = \"1f1b\"\nzero = 1\nbf_microbatches = 2\n\
             [adamw]\nbeta_2 = 0.95\n",
        )
        .expect("valid");
        assert_eq!((config.steps, config.pp, config.dp), (12, 2, 1));
        assert_eq!(config.schedule, ScheduleKind::OneFOneB);
        assert_eq!(config.zero, ZeroLevel::Zero1);
        assert_eq!(config.bf_microbatches, Some(2));
        let adamw = AdamWSettings::from_burn(&config.adamw).expect("plain AdamW");
        assert_eq!((adamw.beta1, adamw.beta2), (0.9, 0.95));
        for (text, needle) in [
            ("steps = 1\nppp = 2", "unknown key `ppp`"),
            (
                "steps = 1\n[adamw]\nbeta2 = 0.9",
                "unknown key `adamw.beta2`",
            ),
            ("pp = 2", "needs `steps`"),
            ("steps = 1\nzero = 7", "ZeRO level 7"),
        ] {
            let err = TrainConfig::from_toml_str(text)
                .expect_err(text)
                .to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
        // What it writes, it reads back.
        let again = TrainConfig::from_toml_str(&config.to_toml()).expect("round trip");
        assert_eq!(again.to_toml(), config.to_toml());
    }

    #[test]
    fn burn_schedulers_are_stepped_once_per_optimizer_step() {
        let linear = LrConfig::Linear(LinearLrSchedulerConfig::new(1.0, 0.5, 4));
        let rates = linear.rates(5).expect("valid");
        assert_eq!(rates.len(), 5);
        assert!(rates.windows(2).all(|w| w[1] <= w[0]), "{rates:?}");
        assert_eq!(LrConfig::Constant(0.25).rates(3), Ok(vec![0.25; 3]));
        let bad = LrConfig::Cosine(CosineAnnealingLrSchedulerConfig::new(-1.0, 10));
        assert!(bad.rates(3).is_err());
    }

    #[test]
    fn bad_values_are_refused_naming_the_setting() {
        for (config, needle) in [
            (TrainConfig::new(0), "steps must be at least 1"),
            (TrainConfig::new(5).with_dp(0), "dp must be at least 1"),
            (
                TrainConfig::new(5).with_max_grad_norm(-1.0),
                "max_grad_norm is -1",
            ),
            (
                TrainConfig::new(5).with_adamw(AdamWConfig::new().with_amsgrad(true)),
                "AMSGrad",
            ),
            (
                TrainConfig::new(5).with_lr(LrConfig::Constant(-0.1)),
                "learning rate",
            ),
        ] {
            let err = config.engine().expect_err(needle).to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
