//! The schedule IR: one representation of every pipeline schedule, the passes that lower it,
//! and the checks that prove it runs.
//!
//! A [`PipelineSchedule`] is data: one ordered list of [`Action`]s per rank plus the stage →
//! rank placement. Generators ([`ScheduleSpec::generate`]) emit compute-only lists; the pure
//! lowering passes ([`lower_p2p`], [`lower_data_parallel`]) add point-to-point transfers and
//! data-parallel collectives; [`validate`] checks the result and dry-runs it with blocking
//! semantics. The simulator and the executor both consume the lowered lists.

mod action;
mod csv;
mod dual_pipe;
mod generate;
mod grid;
mod lower_dp;
mod lower_p2p;
mod placement;
mod program;
mod replay;
mod validate;
mod zero_bubble;

pub use action::{Action, ActionKind, TimedEvent};
pub use csv::{from_csv, to_csv, to_csv_with, with_file_lines, CsvNaming};
pub use generate::{ScheduleKind, ScheduleSpec};
pub use grid::{render_actions, render_grid};
pub use lower_dp::{
    collective_counts, lower_data_parallel, CollectiveCounts, DataParallelLowering, ZeroLevel,
};
pub use lower_p2p::lower_p2p;
pub use placement::{rank_stages, split_layers, LayerSplit, Placement};
pub use program::{Program, ProgramSpec, DEFAULT_BUFFERS};
pub use replay::{replay, unit_cost, Blocked, ReplayOutcome, SendMode, TimedAction, Timeline};
pub use validate::{validate, ValidationReport};

/// Everything that can go wrong building, reading or checking a schedule.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// The requested layout or schedule parameters are not allowed; the text names the fix.
    #[error("invalid schedule configuration: {0}")]
    Config(String),
    /// An action string could not be parsed.
    #[error("cannot parse action `{text}`: {reason}")]
    ParseAction {
        /// The offending text.
        text: String,
        /// Why it was rejected and what the format is.
        reason: String,
    },
    /// A CSV schedule file is malformed at a given place.
    #[error("schedule CSV line {line}, column {column}: {source}")]
    Csv {
        /// 1-based line (= rank + 1).
        line: usize,
        /// 1-based cell index within the line.
        column: usize,
        /// The parse failure of that cell.
        #[source]
        source: Box<ScheduleError>,
    },
    /// The schedule is structurally wrong or deadlocks; `report` holds the problems and,
    /// for deadlocks, a time-step × rank grid with the blocked actions marked.
    #[error("invalid schedule:\n{report}")]
    Invalid {
        /// Human-readable diagnosis.
        report: String,
    },
}

/// A pipeline program: one ordered action list per rank, and where each stage lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSchedule {
    /// Rank owning each stage, indexed by global stage.
    pub stage_ranks: Vec<usize>,
    /// Micro-batches per optimizer step (per data-parallel replica).
    pub microbatches: usize,
    /// Each rank's actions in execution order.
    pub ranks: Vec<Vec<Action>>,
}

impl PipelineSchedule {
    /// Number of pipeline ranks.
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Number of stages (pp × loops for generated schedules).
    pub fn num_stages(&self) -> usize {
        self.stage_ranks.len()
    }

    /// Build a schedule from per-rank lists alone (as read from a CSV file), inferring the
    /// placement from which rank runs each stage and the micro-batch count from the indices.
    pub fn from_rank_lists(ranks: Vec<Vec<Action>>) -> Result<Self, ScheduleError> {
        let mut num_stages = 0;
        let mut microbatches = 0;
        for action in ranks.iter().flatten() {
            num_stages = num_stages.max(action.stage + 1);
            if let Some(mb) = action.microbatch {
                microbatches = microbatches.max(mb + 1);
            }
        }
        let mut stage_ranks: Vec<Option<usize>> = vec![None; num_stages];
        // Owners come from the single actions first, so that a pair half on the wrong rank
        // is the one the error names.
        let singles_then_pairs = [false, true].into_iter().flat_map(|paired| {
            ranks.iter().enumerate().flat_map(move |(rank, list)| {
                (0..list.len())
                    .filter(move |&i| pair_span(list, i).is_some() == paired)
                    .map(move |i| (rank, list, i))
            })
        });
        for (rank, list, i) in singles_then_pairs {
            let action = &list[i];
            match stage_ranks[action.stage] {
                None => stage_ranks[action.stage] = Some(rank),
                Some(owner) if owner != rank => {
                    let pair = pair_span(list, i)
                        .map(|(a, b)| (list[a], list[b]))
                        .map(|(a, b)| {
                            format!(
                                "; both halves of the {a} + {b} OVERLAP_F_B pair must be \
                                 stages of the rank that runs the pair"
                            )
                        })
                        .unwrap_or_default();
                    return Err(ScheduleError::Invalid {
                        report: format!(
                            "stage {} appears on rank {owner} and on rank {rank} (action {action}); \
                             every action of a stage must run on the rank that owns it{pair}",
                            action.stage
                        ),
                    });
                }
                Some(_) => {}
            }
        }
        let stage_ranks = stage_ranks
            .into_iter()
            .enumerate()
            .map(|(stage, owner)| {
                owner.ok_or_else(|| ScheduleError::Invalid {
                    report: format!(
                        "stage {stage} has no actions on any rank, but stages up to {} do; \
                         every stage needs its forward and backward",
                        num_stages - 1
                    ),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PipelineSchedule {
            stage_ranks,
            microbatches,
            ranks,
        })
    }

    /// The same schedule with only its compute actions (`F`, `B`, `I`, `W`).
    pub fn compute_only(&self) -> PipelineSchedule {
        PipelineSchedule {
            stage_ranks: self.stage_ranks.clone(),
            microbatches: self.microbatches,
            ranks: self
                .ranks
                .iter()
                .map(|list| {
                    list.iter()
                        .copied()
                        .filter(|a| a.kind.is_compute())
                        .collect()
                })
                .collect(),
        }
    }

    /// Stages per rank V when every rank holds the same number (as the engine needs), else
    /// `None`.
    pub fn stages_per_rank(&self) -> Option<usize> {
        let ranks = self.num_ranks();
        (ranks > 0 && self.num_stages() % ranks == 0).then(|| self.num_stages() / ranks)
    }

    /// True when some rank runs an overlapped forward/backward pair.
    pub fn has_pairs(&self) -> bool {
        self.ranks.iter().flatten().any(|a| a.overlaps_next)
    }

    /// True when the lists carry explicit point-to-point transfers.
    pub fn has_p2p(&self) -> bool {
        self.ranks.iter().flatten().any(|a| a.kind.is_p2p())
    }
}

/// The positions of the overlapped pair that the action at `i` of `list` belongs to, if any.
fn pair_span(list: &[Action], i: usize) -> Option<(usize, usize)> {
    if list[i].overlaps_next && i + 1 < list.len() {
        Some((i, i + 1))
    } else if i > 0 && list[i - 1].overlaps_next {
        Some((i - 1, i))
    } else {
        None
    }
}

/// The positions `list` runs as one unit with the action at `i`: both halves of its
/// overlapped pair, or the action alone.
fn unit_span(list: &[Action], i: usize) -> (usize, usize) {
    pair_span(list, i).unwrap_or((i, i))
}

/// `list` in the units it runs in: each action alone, or an overlapped pair's two halves
/// together (the second one `Some`).
fn units<'a>(list: impl IntoIterator<Item = &'a Action>) -> Vec<(&'a Action, Option<&'a Action>)> {
    let mut out = Vec::new();
    let mut rest = list.into_iter();
    while let Some(a) = rest.next() {
        let second = if a.overlaps_next { rest.next() } else { None };
        out.push((a, second));
    }
    out
}
