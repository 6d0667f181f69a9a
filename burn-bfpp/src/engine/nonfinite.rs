//! What a step does when its loss or gradient is NaN or infinite, and how every rank comes to
//! the same decision.
//!
//! A rank sees only its own stages: the last stage's ranks see the loss, every rank the
//! gradients of the shards it owns. Each rank marks what it saw in a small vector with one
//! slot per (data-parallel replica, stage) — each slot is written by exactly one rank — and
//! the vector travels in the all-reduce that already sums the squared gradient norm for
//! clipping (pipeline group, then data-parallel group). After it every rank holds the same
//! vector and the same norm, so every rank takes the same decision: all stop, or all skip the
//! update. No rank can be left waiting in a collective the others have abandoned.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::comm::RankGrid;

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

/// Flag of a slot whose stage produced a non-finite loss.
pub(crate) const LOSS: f32 = 1.0;
/// Flag of a slot whose owned, reduced gradient has a non-finite norm.
pub(crate) const GRADIENT: f32 = 2.0;

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
    /// Every shard's gradient norm was finite but their sum was not (it overflowed).
    pub norm_overflow: bool,
}

impl NonFiniteReport {
    /// Decodes the reduced flag vector (`dp × num_stages` slots, replica-major).
    pub(crate) fn from_flags(
        flags: &[f32],
        grid: RankGrid,
        stage_ranks: &[usize],
        global_norm_finite: bool,
    ) -> Self {
        let stages = stage_ranks.len().max(1);
        let mut report = NonFiniteReport::default();
        for (slot, &flag) in flags.iter().enumerate() {
            let (dp_index, stage) = (slot / stages, slot % stages);
            let Some(&pp_index) = stage_ranks.get(stage) else {
                continue;
            };
            let seen = SeenOn {
                rank: grid.rank_of(pp_index, dp_index),
                stage,
            };
            // Flags are sums of LOSS and GRADIENT from the slot's single writer: 0 to 3.
            let bits = flag as u32;
            if bits & (LOSS as u32) != 0 {
                report.loss.push(seen);
            }
            if bits & (GRADIENT as u32) != 0 {
                report.gradient.push(seen);
            }
        }
        // Every shard was finite on its own and only their sum overflowed: no place to name,
        // but the norm is still not finite.
        report.norm_overflow = report.gradient.is_empty() && !global_norm_finite;
        report
    }

    /// Whether anything was not finite.
    pub fn any(&self) -> bool {
        !(self.loss.is_empty() && self.gradient.is_empty()) || self.norm_overflow
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
        if self.norm_overflow {
            let loss = if self.loss.is_empty() {
                String::new()
            } else {
                format!("non-finite loss on {}; ", list(&self.loss))
            };
            return write!(
                f,
                "{loss}the global gradient norm overflowed (every shard's norm was finite)"
            );
        }
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

    #[test]
    fn flags_decode_to_ranks_and_stages() {
        // pp 2 × dp 2, 4 stages looping: stages 0, 2 on pipeline rank 0; 1, 3 on rank 1.
        let grid = RankGrid::new(2, 2).unwrap();
        let stage_ranks = [0, 1, 0, 1];
        let mut flags = vec![0.0; 8];
        flags[3] = LOSS + GRADIENT; // replica 0, stage 3: world rank 1
        flags[4 + 2] = GRADIENT; // replica 1, stage 2: world rank 2
        let report = NonFiniteReport::from_flags(&flags, grid, &stage_ranks, false);
        assert_eq!(report.loss, vec![SeenOn { rank: 1, stage: 3 }]);
        assert_eq!(
            report.gradient,
            vec![SeenOn { rank: 1, stage: 3 }, SeenOn { rank: 2, stage: 2 }]
        );
        let text = report.to_string();
        assert!(
            text.contains("non-finite loss on rank 1 (stage 3)"),
            "{text}"
        );
        assert!(text.contains("rank 2 (stage 2)"), "{text}");

        let clean = NonFiniteReport::from_flags(&[0.0; 8], grid, &stage_ranks, true);
        assert!(!clean.any());
        let overflow = NonFiniteReport::from_flags(&[0.0; 8], grid, &stage_ranks, false);
        assert!(overflow.any());
        assert!(overflow.to_string().contains("overflowed"));
    }
}
