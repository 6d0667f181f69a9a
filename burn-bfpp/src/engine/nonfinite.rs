//! What a step does when its loss or gradient is NaN or infinite, and how every rank comes to
//! the same decision.
//!
//! A rank sees only its own stages: the last stage's ranks see the loss, every rank the
//! gradients of the shards it owns. What each rank saw travels in the step's table (see
//! [`super::summary`]), which every rank reduces over its pipeline and data-parallel groups
//! and reads once: after it every rank holds the same squared norms and loss sums, finds the
//! same non-finite slots, and takes the same decision: all stop, or all skip the update. No
//! rank can be left waiting in a collective the others have abandoned.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What to do with a step whose loss or global gradient norm is not finite.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonFinitePolicy {
    /// Every rank stops with [`EngineError::NonFinite`](super::EngineError::NonFinite) naming
    /// the step: in fp32 a NaN is a bug or a divergence, and carrying on would hide it.
    #[default]
    Stop,
    /// Every rank skips the optimizer update of that step (weights, AdamW moments and step
    /// count stay as they were), warns, and carries on; the step is listed in
    /// [`TrainOutcome::skipped_steps`](super::TrainOutcome::skipped_steps). What dynamic loss
    /// scaling needs: an overflowing step is dropped and the scale lowered.
    Skip,
}

impl NonFinitePolicy {
    /// The name used on the command line and in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            NonFinitePolicy::Stop => "stop",
            NonFinitePolicy::Skip => "skip",
        }
    }
}

impl fmt::Display for NonFinitePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for NonFinitePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "stop" => Ok(NonFinitePolicy::Stop),
            "skip" => Ok(NonFinitePolicy::Skip),
            other => Err(format!(
                "unknown non-finite policy `{other}`; expected `stop` or `skip`"
            )),
        }
    }
}

/// Where a non-finite value was seen: a world rank and a stage it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenOn {
    /// World rank.
    pub rank: usize,
    /// Global stage index.
    pub stage: usize,
}

/// What made a step non-finite, as every rank knows it after the reduction.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NonFiniteReport {
    /// Stages (and their ranks) whose micro-batch losses were not finite.
    pub loss: Vec<SeenOn>,
    /// Stages (and their ranks) whose owned, reduced gradient had a non-finite norm. A NaN
    /// spreads through the data-parallel reduction, so this names where it was seen, which
    /// is not necessarily where it arose.
    pub gradient: Vec<SeenOn>,
}

impl NonFiniteReport {
    /// Whether anything was not finite.
    pub fn any(&self) -> bool {
        !(self.loss.is_empty() && self.gradient.is_empty())
    }
}

/// At most this many places are listed in a message; the rest are counted.
const LISTED: usize = 4;

fn list(seen: &[SeenOn]) -> String {
    let mut parts: Vec<String> = seen
        .iter()
        .take(LISTED)
        .map(|s| format!("rank {} (stage {})", s.rank, s.stage))
        .collect();
    if seen.len() > LISTED {
        parts.push(format!("and {} more", seen.len() - LISTED));
    }
    parts.join(", ")
}

impl fmt::Display for NonFiniteReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.loss.is_empty(), self.gradient.is_empty()) {
            (false, false) => write!(
                f,
                "non-finite loss on {}; non-finite gradient norm on {}",
                list(&self.loss),
                list(&self.gradient)
            ),
            (false, true) => write!(f, "non-finite loss on {}", list(&self.loss)),
            (true, false) => write!(f, "non-finite gradient norm on {}", list(&self.gradient)),
            (true, true) => f.write_str("all values finite"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_print() {
        for p in [NonFinitePolicy::Stop, NonFinitePolicy::Skip] {
            assert_eq!(p.name().parse::<NonFinitePolicy>(), Ok(p));
        }
        let err = "ignore".parse::<NonFinitePolicy>().unwrap_err();
        assert!(err.contains("`stop` or `skip`"), "{err}");
        assert_eq!(NonFinitePolicy::default(), NonFinitePolicy::Stop);
    }
}
