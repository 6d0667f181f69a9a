//! Generators: the compute order of every rank for GPipe, 1F1B, interleaved 1F1B (Megatron-LM's
//! depth-first order) and breadth-first (with the hybrid's breadth-first micro-batch count),
//! and their zero-bubble variants with split backwards (see [`super::zero_bubble`]).

use std::fmt;
use std::str::FromStr;

use super::dual_pipe::dual_pipe_v;
use super::placement::{rank_stages, Placement};
use super::zero_bubble::{fill_weight_passes, inputs_only, zb_v};
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
    /// ZB-H1: 1F1B with split backwards whose weight passes fill the cool-down; 1F1B's peak
    /// memory.
    ZeroBubbleH1,
    /// Interleaved 1F1B with split backwards and weight passes filling its waits.
    InterleavedZeroBubble,
    /// Breadth-first with split backwards whose weight passes fill its waits; each stage's
    /// gradients are still reduced once per step, after its last weight pass.
    BreadthFirstZeroBubble,
    /// ZB-V: two stages per rank in a V (the v-shape placement), split backwards, 1F1B's
    /// peak memory.
    ZeroBubbleV,
    /// DualPipeV: two stages per rank in a V whose steady state runs overlapped
    /// forward/backward pairs, with split backwards in its warm-up and drain.
    DualPipeV,
}

impl ScheduleKind {
    /// Every kind, in the order the command line lists them.
    pub const ALL: [ScheduleKind; 9] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::BreadthFirst,
        ScheduleKind::ZeroBubbleH1,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::BreadthFirstZeroBubble,
        ScheduleKind::ZeroBubbleV,
        ScheduleKind::DualPipeV,
    ];

    /// Whether the schedule splits backwards into `I` and `W` (the model must defer its
    /// weight gradients; see `PipelineStage::splits_weight_grads`).
    pub fn splits_backward(self) -> bool {
        self.family().split_backward
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        self.family().name
    }

    /// The family's entry in [`REGISTRY`]: its names, rules and generator.
    pub fn family(self) -> &'static ScheduleFamily {
        REGISTRY
            .iter()
            .find(|f| f.kind == self)
            .expect("every ScheduleKind has its entry in REGISTRY (tested)")
    }
}

/// A family's generator: the spec and every rank's local stages (in placement order) to
/// every rank's compute order.
pub type Generator = fn(&ScheduleSpec, &[Vec<usize>]) -> Vec<Vec<Action>>;

/// One schedule family: its names, the rules its layouts must follow beyond the common ones,
/// and its generator. [`REGISTRY`] lists them all; the command line, configuration files,
/// [`ScheduleSpec::check`] and [`ScheduleSpec::generate`] read nothing else, so a new family
/// is a [`ScheduleKind`] variant, one entry here and its generator with its tests.
#[derive(Debug)]
pub struct ScheduleFamily {
    /// The kind this entry describes.
    pub kind: ScheduleKind,
    /// The command-line and configuration name.
    pub name: &'static str,
    /// Other accepted spellings.
    pub aliases: &'static [&'static str],
    /// Stages per rank V when none is given.
    pub default_loops: usize,
    /// Whether the breadth-first micro-batch count K and the v-shape placement apply.
    pub breadth_first: bool,
    /// Whether the family always runs on the v-shape placement (whatever the spec says).
    pub v_shape: bool,
    /// Whether its backwards are split into `I` and `W` (a zero-bubble family).
    pub split_backward: bool,
    /// The family's own rules on a spec (the common ones already hold); the error names
    /// the fix.
    pub check: fn(&ScheduleSpec) -> Result<(), String>,
    /// The compute order of every rank, given the spec and each rank's local stages in
    /// placement order.
    pub generate: Generator,
}

/// Every schedule family, in the order the command line lists them.
pub static REGISTRY: [ScheduleFamily; 9] = [
    ScheduleFamily {
        kind: ScheduleKind::GPipe,
        name: "gpipe",
        aliases: &[],
        default_loops: 1,
        breadth_first: false,
        v_shape: false,
        split_backward: false,
        check: one_stage_per_rank,
        generate: |spec, local| per_rank(local, |_, stages| gpipe(stages[0], spec.microbatches)),
    },
    ScheduleFamily {
        kind: ScheduleKind::OneFOneB,
        name: "1f1b",
        aliases: &[],
        default_loops: 1,
        breadth_first: false,
        v_shape: false,
        split_backward: false,
        check: one_stage_per_rank,
        generate: |spec, local| {
            per_rank(local, |rank, stages| {
                one_f_one_b(stages[0], spec.pp, rank, spec.microbatches)
            })
        },
    },
    ScheduleFamily {
        kind: ScheduleKind::Interleaved,
        name: "interleaved",
        aliases: &["interleaved-1f1b", "depth-first"],
        default_loops: 2,
        breadth_first: false,
        v_shape: false,
        split_backward: false,
        check: microbatches_multiple_of_pp,
        generate: |spec, local| {
            per_rank(local, |rank, stages| {
                interleaved(stages, spec.pp, rank, spec.microbatches)
            })
        },
    },
    ScheduleFamily {
        kind: ScheduleKind::BreadthFirst,
        name: "breadth-first",
        aliases: &["bf", "bfpp"],
        default_loops: 2,
        breadth_first: true,
        v_shape: false,
        split_backward: false,
        check: |_| Ok(()),
        generate: |spec, local| {
            per_rank(local, |_, stages| {
                breadth_first(
                    stages,
                    spec.microbatches,
                    spec.bf_microbatches.unwrap_or(spec.microbatches),
                )
            })
        },
    },
    ScheduleFamily {
        kind: ScheduleKind::ZeroBubbleH1,
        name: "zb-h1",
        aliases: &["zbh1", "zero-bubble-h1"],
        default_loops: 1,
        breadth_first: false,
        v_shape: false,
        split_backward: true,
        check: one_stage_per_rank,
        generate: |spec, local| {
            // Rank r holds P − r micro-batches in 1F1B; r pending W's bring every rank to
            // rank 0's P, 1F1B's peak (ZB-H1's memory rule).
            let caps: Vec<usize> = (0..spec.pp).collect();
            split_and_fill(ScheduleKind::OneFOneB, spec, local, &caps)
        },
    },
    ScheduleFamily {
        kind: ScheduleKind::InterleavedZeroBubble,
        name: "interleaved-zb",
        aliases: &["interleaved-zero-bubble", "zb-interleaved"],
        default_loops: 2,
        breadth_first: false,
        v_shape: false,
        split_backward: true,
        check: microbatches_multiple_of_pp,
        generate: |spec, local| {
            let caps: Vec<usize> = (0..spec.pp).collect();
            split_and_fill(ScheduleKind::Interleaved, spec, local, &caps)
        },
    },
    ScheduleFamily {
        kind: ScheduleKind::BreadthFirstZeroBubble,
        name: "breadth-first-zb",
        aliases: &["bf-zb", "bfpp-zb"],
        default_loops: 2,
        breadth_first: true,
        v_shape: false,
        split_backward: true,
        check: |_| Ok(()),
        generate: |spec, local| {
            let k = spec.bf_microbatches.unwrap_or(spec.microbatches);
            // Breadth-first already keeps every micro-batch of a sweep alive until its
            // backward, and a pending W keeps less than that: no cap beyond the sweep.
            let caps = vec![k * spec.loops; spec.pp];
            split_and_fill(ScheduleKind::BreadthFirst, spec, local, &caps)
        },
    },
    ScheduleFamily {
        kind: ScheduleKind::ZeroBubbleV,
        name: "zb-v",
        aliases: &["zbv", "zero-bubble-v"],
        default_loops: 2,
        breadth_first: false,
        v_shape: true,
        split_backward: true,
        check: |spec| {
            two_stages_per_rank(spec)?;
            // Other counts leave the greedy order a bubble of several stages.
            microbatches_multiple_of_pp(spec)
        },
        generate: |spec, _| zb_v(&stage_ranks(spec), spec.pp, spec.microbatches),
    },
    ScheduleFamily {
        kind: ScheduleKind::DualPipeV,
        name: "dualpipev",
        aliases: &["dualpipe-v", "dual-pipe-v"],
        default_loops: 2,
        breadth_first: false,
        v_shape: true,
        split_backward: true,
        check: |spec| {
            two_stages_per_rank(spec)?;
            if spec.microbatches < 2 * spec.pp {
                return Err(format!(
                    "dualpipev fills its V with 2·pp micro-batches before its steady state, so \
                     it needs microbatches ≥ 2·pp = {} (got {}); use --microbatches {}",
                    2 * spec.pp,
                    spec.microbatches,
                    2 * spec.pp
                ));
            }
            Ok(())
        },
        generate: |spec, _| dual_pipe_v(spec.pp, spec.microbatches),
    },
];

/// The rule of the families that run two stages per rank in a V.
fn two_stages_per_rank(spec: &ScheduleSpec) -> Result<(), String> {
    if spec.loops != 2 {
        return Err(format!(
            "{} runs two stages per rank in a V, so it needs loops = 2 (got {}); use --loops 2",
            spec.kind.name(),
            spec.loops
        ));
    }
    Ok(())
}

/// A zero-bubble family's order: the `base` family's, with `I` for every `B` and the `W`s
/// placed by [`fill_weight_passes`] with at most `caps[r]` pending on rank r.
fn split_and_fill(
    base: ScheduleKind,
    spec: &ScheduleSpec,
    local: &[Vec<usize>],
    caps: &[usize],
) -> Vec<Vec<Action>> {
    let order = (base.family().generate)(spec, local)
        .into_iter()
        .map(inputs_only)
        .collect();
    fill_weight_passes(order, &stage_ranks(spec), spec.microbatches, caps)
}

/// Runs a one-rank generator for every rank.
fn per_rank(local: &[Vec<usize>], f: impl Fn(usize, &[usize]) -> Vec<Action>) -> Vec<Vec<Action>> {
    local
        .iter()
        .enumerate()
        .map(|(r, stages)| f(r, stages))
        .collect()
}

fn stage_ranks(spec: &ScheduleSpec) -> Vec<usize> {
    spec.effective_placement().stage_ranks(spec.pp, spec.loops)
}

/// The rule of the interleaved families.
fn microbatches_multiple_of_pp(spec: &ScheduleSpec) -> Result<(), String> {
    if spec.microbatches % spec.pp != 0 {
        let up = spec.microbatches.div_ceil(spec.pp) * spec.pp;
        return Err(format!(
            "{} needs microbatches to be a multiple of pp={}; try {up}",
            spec.kind.name(),
            spec.pp
        ));
    }
    Ok(())
}

/// The rule of the families that run one stage per rank.
fn one_stage_per_rank(spec: &ScheduleSpec) -> Result<(), String> {
    if spec.loops != 1 {
        return Err(format!(
            "{} runs one stage per rank, so it needs loops = 1 (got {}); use --loops 1, or \
             --schedule interleaved or breadth-first for a looped pipeline",
            spec.kind.name(),
            spec.loops
        ));
    }
    Ok(())
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
        let s = s.to_ascii_lowercase();
        REGISTRY
            .iter()
            .find(|f| f.name == s || f.aliases.contains(&s.as_str()))
            .map(|f| f.kind)
            .ok_or_else(|| {
                let names: Vec<&str> = REGISTRY.iter().map(|f| f.name).collect();
                ScheduleError::Config(format!(
                    "unknown schedule `{s}`; choose one of {}",
                    names.join(", ")
                ))
            })
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
        let family = self.kind.family();
        (family.check)(self).map_err(ScheduleError::Config)?;
        if let Some(k) = self.bf_microbatches {
            if !family.breadth_first {
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
        if self.placement == Placement::VShape && !(family.breadth_first || family.v_shape) {
            return err(format!(
                "the v-shape placement is generated for breadth-first only, not {name}; \
                 use --placement looping"
            ));
        }
        Ok(())
    }

    /// The placement the schedule runs on: the spec's, unless the family fixes it (ZB-V).
    pub fn effective_placement(&self) -> Placement {
        if self.kind.family().v_shape {
            Placement::VShape
        } else {
            self.placement
        }
    }

    /// Generate the compute-only schedule (no transfers or collectives yet).
    pub fn generate(&self) -> Result<PipelineSchedule, ScheduleError> {
        self.check()?;
        let stage_ranks = self.effective_placement().stage_ranks(self.pp, self.loops);
        let local = rank_stages(&stage_ranks, self.pp);
        let ranks = (self.kind.family().generate)(self, &local);
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
    fn every_kind_has_one_registry_entry_and_its_names_parse() {
        assert_eq!(REGISTRY.len(), ScheduleKind::ALL.len());
        for (family, kind) in REGISTRY.iter().zip(ScheduleKind::ALL) {
            assert_eq!(family.kind, kind, "REGISTRY lists the kinds in ALL's order");
            assert_eq!(kind.family().name, family.name);
            for name in std::iter::once(&family.name).chain(family.aliases) {
                assert_eq!(name.parse::<ScheduleKind>().unwrap(), kind, "{name}");
                assert_eq!(name.to_uppercase().parse::<ScheduleKind>().unwrap(), kind);
            }
            let spec = ScheduleSpec::new(kind, 2, family.default_loops, 4);
            let generated = spec.generate().expect("generates at its default loops");
            let split = generated
                .ranks
                .iter()
                .flatten()
                .any(|a| a.kind == super::super::ActionKind::BackwardInput);
            assert_eq!(
                split,
                kind.splits_backward(),
                "{kind}: split_backward says otherwise"
            );
        }
        let err = "zero-bubble"
            .parse::<ScheduleKind>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gpipe, 1f1b, interleaved, breadth-first"),
            "{err}"
        );
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
