//! Generators: the compute order of every rank for GPipe, 1F1B, interleaved 1F1B (Megatron-LM's
//! depth-first order) and breadth-first (with the hybrid's breadth-first micro-batch count).

use std::fmt;
use std::str::FromStr;

use super::placement::{rank_stages, Placement};
use super::{Action, PipelineSchedule, ScheduleError};

/// Largest schedule generated (2²⁴ compute actions, a few hundred MiB once lowered).
pub const MAX_COMPUTE_ACTIONS: usize = 1 << 24;

/// The schedule families this crate generates. In configuration files: its command-line name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ScheduleKind {
    /// All forwards, then all backwards; one stage per rank.
    GPipe,
    /// Warm-up forwards, then one forward / one backward; one stage per rank.
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B on a looped placement (depth-first).
    Interleaved,
    /// Breadth-first: each local stage runs all its micro-batches before the next.
    BreadthFirst,
}

impl ScheduleKind {
    /// Every kind, in the order the command line lists them.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::BreadthFirst,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::BreadthFirst => "breadth-first",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<ScheduleKind> for String {
    fn from(kind: ScheduleKind) -> String {
        kind.name().to_string()
    }
}

impl TryFrom<String> for ScheduleKind {
    type Error = ScheduleError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved-1f1b" | "depth-first" => Ok(ScheduleKind::Interleaved),
            "breadth-first" | "bf" | "bfpp" => Ok(ScheduleKind::BreadthFirst),
            other => Err(ScheduleError::Config(format!(
                "unknown schedule `{other}`; choose one of gpipe, 1f1b, interleaved, breadth-first"
            ))),
        }
    }
}

/// Everything needed to generate a schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleSpec {
    /// The schedule family.
    pub kind: ScheduleKind,
    /// Pipeline ranks P.
    pub pp: usize,
    /// Stages per rank V.
    pub loops: usize,
    /// Micro-batches per optimizer step M.
    pub microbatches: usize,
    /// Breadth-first micro-batches K (breadth-first only; must divide M; default M).
    pub bf_microbatches: Option<usize>,
    /// Stage → rank placement.
    pub placement: Placement,
}

impl ScheduleSpec {
    /// A spec with the looping placement and pure breadth-first micro-batching.
    pub fn new(kind: ScheduleKind, pp: usize, loops: usize, microbatches: usize) -> Self {
        ScheduleSpec {
            kind,
            pp,
            loops,
            microbatches,
            bf_microbatches: None,
            placement: Placement::Looping,
        }
    }

    /// Set the breadth-first micro-batch count K of the hybrid schedule.
    pub fn with_bf_microbatches(mut self, k: usize) -> Self {
        self.bf_microbatches = Some(k);
        self
    }

    /// Set the placement.
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Check the parameters; the error names the violated constraint and the nearest valid choice.
    pub fn check(&self) -> Result<(), ScheduleError> {
        let err = |msg: String| Err(ScheduleError::Config(msg));
        let name = self.kind.name();
        if self.pp == 0 {
            return err("pp must be at least 1 (the number of pipeline ranks); try --pp 1".into());
        }
        if self.loops == 0 {
            return err("loops must be at least 1 (stages per rank); try --loops 1".into());
        }
        if self.microbatches == 0 {
            return err("microbatches must be at least 1; try --microbatches 1".into());
        }
        // Two compute actions per (stage, micro-batch); refuse sizes that would overflow or
        // exhaust memory before anything is allocated.
        let computes = self
            .pp
            .checked_mul(self.loops)
            .and_then(|n| n.checked_mul(self.microbatches))
            .and_then(|n| n.checked_mul(2));
        if computes.is_none_or(|n| n > MAX_COMPUTE_ACTIONS) {
            return err(format!(
                "pp={} × loops={} × microbatches={} needs more than {MAX_COMPUTE_ACTIONS} compute \
                 actions; lower pp, loops or microbatches",
                self.pp, self.loops, self.microbatches
            ));
        }
        match self.kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB if self.loops != 1 => {
                return err(format!(
                    "{name} runs one stage per rank, so it needs loops = 1 (got {}); use --loops 1, \
                     or --schedule interleaved or breadth-first for a looped pipeline",
                    self.loops
                ));
            }
            ScheduleKind::Interleaved if self.microbatches % self.pp != 0 => {
                let up = self.microbatches.div_ceil(self.pp) * self.pp;
                return err(format!(
                    "interleaved needs microbatches to be a multiple of pp={}; try {up}",
                    self.pp
                ));
            }
            _ => {}
        }
        if let Some(k) = self.bf_microbatches {
            if self.kind != ScheduleKind::BreadthFirst {
                return err(format!(
                    "bf-microbatches applies to breadth-first only, not {name}; drop --bf-microbatches"
                ));
            }
            if k == 0 || self.microbatches % k != 0 {
                let divisors: Vec<usize> = (1..=self.microbatches)
                    .filter(|d| self.microbatches % d == 0)
                    .collect();
                let nearest = divisors
                    .iter()
                    .copied()
                    .min_by_key(|&d| (d.abs_diff(k), usize::MAX - d))
                    .unwrap_or(1);
                return err(format!(
                    "bf-microbatches must divide microbatches={} (got {k}); try {nearest}",
                    self.microbatches
                ));
            }
        }
        if self.placement == Placement::VShape && self.kind != ScheduleKind::BreadthFirst {
            return err(format!(
                "the v-shape placement is generated for breadth-first only, not {name}; \
                 use --placement looping"
            ));
        }
        Ok(())
    }

    /// Generate the compute-only schedule (no transfers or collectives yet).
    pub fn generate(&self) -> Result<PipelineSchedule, ScheduleError> {
        self.check()?;
        let stage_ranks = self.placement.stage_ranks(self.pp, self.loops);
        let local = rank_stages(&stage_ranks, self.pp);
        let ranks = (0..self.pp)
            .map(|rank| match self.kind {
                ScheduleKind::GPipe => gpipe(local[rank][0], self.microbatches),
                ScheduleKind::OneFOneB => {
                    one_f_one_b(local[rank][0], self.pp, rank, self.microbatches)
                }
                ScheduleKind::Interleaved => {
                    interleaved(&local[rank], self.pp, rank, self.microbatches)
                }
                ScheduleKind::BreadthFirst => breadth_first(
                    &local[rank],
                    self.microbatches,
                    self.bf_microbatches.unwrap_or(self.microbatches),
                ),
            })
            .collect();
        Ok(PipelineSchedule {
            stage_ranks,
            microbatches: self.microbatches,
            ranks,
        })
    }
}

fn gpipe(stage: usize, m: usize) -> Vec<Action> {
    let forwards = (0..m).map(|mb| Action::forward(stage, mb));
    let backwards = (0..m).map(|mb| Action::backward(stage, mb));
    forwards.chain(backwards).collect()
}

fn one_f_one_b(stage: usize, pp: usize, rank: usize, m: usize) -> Vec<Action> {
    let warmup = (pp - rank - 1).min(m);
    let mut out = Vec::with_capacity(2 * m);
    out.extend((0..warmup).map(|mb| Action::forward(stage, mb)));
    for i in 0..m - warmup {
        out.push(Action::forward(stage, warmup + i));
        out.push(Action::backward(stage, i));
    }
    out.extend((m - warmup..m).map(|mb| Action::backward(stage, mb)));
    out
}

/// Megatron-LM's interleaved order: virtual micro-batch k of a rank maps to a local stage
/// (chunk) and a micro-batch in groups of `pp`; warm-up `2·(pp−rank−1) + (V−1)·pp` forwards,
/// then one forward / one backward, then the cool-down backwards.
fn interleaved(stages: &[usize], pp: usize, rank: usize, m: usize) -> Vec<Action> {
    let v = stages.len();
    let total = m * v;
    let locate = |k: usize, backward: bool| {
        let (group, in_group) = (k / (pp * v), k % (pp * v));
        let chunk = in_group / pp;
        let chunk = if backward { v - 1 - chunk } else { chunk };
        (stages[chunk], group * pp + in_group % pp)
    };
    let warmup = if m == pp {
        total
    } else {
        ((pp - rank - 1) * 2 + (v - 1) * pp).min(total)
    };
    let fwd = |k| {
        let (s, mb) = locate(k, false);
        Action::forward(s, mb)
    };
    let bwd = |k| {
        let (s, mb) = locate(k, true);
        Action::backward(s, mb)
    };
    let mut out = Vec::with_capacity(2 * total);
    out.extend((0..warmup).map(fwd));
    for k in 0..total - warmup {
        out.push(fwd(warmup + k));
        out.push(bwd(k));
    }
    out.extend((total - warmup..total).map(bwd));
    out
}

/// Breadth-first in sweeps of `k` micro-batches: each sweep runs every local stage's forward
/// over the sweep's micro-batches, then every local stage's backward in reverse stage order.
fn breadth_first(stages: &[usize], m: usize, k: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(2 * m * stages.len());
    for sweep in 0..m / k {
        let mbs = sweep * k..(sweep + 1) * k;
        for &s in stages {
            out.extend(mbs.clone().map(|mb| Action::forward(s, mb)));
        }
        for &s in stages.iter().rev() {
            out.extend(mbs.clone().map(|mb| Action::backward(s, mb)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(list: &[Action]) -> String {
        list.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn one_f_one_b_warms_up_by_distance_to_the_last_rank() {
        let s = ScheduleSpec::new(ScheduleKind::OneFOneB, 3, 1, 4)
            .generate()
            .unwrap();
        assert_eq!(text(&s.ranks[0]), "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3");
        assert_eq!(text(&s.ranks[2]), "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3");
    }

    #[test]
    fn breadth_first_runs_each_local_stage_over_all_microbatches() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 3)
            .generate()
            .unwrap();
        assert_eq!(
            text(&s.ranks[1]),
            "1F0 1F1 1F2 3F0 3F1 3F2 3B0 3B1 3B2 1B0 1B1 1B2"
        );
    }

    #[test]
    fn hybrid_repeats_breadth_first_sweeps() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 4)
            .with_bf_microbatches(2)
            .generate()
            .unwrap();
        assert_eq!(
            text(&s.ranks[0]),
            "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0F2 0F3 2F2 2F3 2B2 2B3 0B2 0B3"
        );
    }

    #[test]
    fn interleaved_switches_local_stage_every_pp_microbatches() {
        let s = ScheduleSpec::new(ScheduleKind::Interleaved, 2, 2, 4)
            .generate()
            .unwrap();
        // Rank 0: warm-up 2·1 + 1·2 = 4 forwards, then alternate.
        assert_eq!(
            text(&s.ranks[0]),
            "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
        );
    }

    #[test]
    fn invalid_combinations_name_the_fix() {
        let msg = |spec: ScheduleSpec| spec.check().unwrap_err().to_string();
        assert!(msg(ScheduleSpec::new(ScheduleKind::Interleaved, 4, 2, 6))
            .contains("interleaved needs microbatches to be a multiple of pp=4; try 8"));
        assert!(msg(ScheduleSpec::new(ScheduleKind::GPipe, 4, 2, 4)).contains("--loops 1"));
        assert!(msg(ScheduleSpec::new(ScheduleKind::GPipe, 0, 1, 4)).contains("--pp 1"));
        assert!(msg(ScheduleSpec::new(
            ScheduleKind::BreadthFirst,
            usize::MAX,
            8,
            4
        ))
        .contains("lower pp, loops or microbatches"));
        assert!(msg(ScheduleSpec::new(ScheduleKind::GPipe, 2, 1, 0)).contains("--microbatches 1"));
        assert!(msg(
            ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 12).with_bf_microbatches(5)
        )
        .contains("try 6"));
        assert!(
            msg(ScheduleSpec::new(ScheduleKind::OneFOneB, 2, 1, 4).with_bf_microbatches(2))
                .contains("breadth-first only")
        );
    }
}
