//! The step's table: everything a rank needs on the host at the end of a step, reduced over
//! the world on the device and read once.
//!
//! A step's host-side decisions (clip the gradients or not, skip a non-finite step, report
//! the loss) need three things from every rank: the squared norm of each gradient shard it
//! owns, whether its losses were finite, and their sum. Reading them as they arise would be one
//! host synchronisation per micro-batch; instead they stay on the device (the losses summed
//! as the micro-batches finish, the norms computed on the reduced shards) and each rank
//! writes them into its own slots of one small fp32 table:
//!
//! ```text
//! [ sq(replica 0, stage 0) … sq(0, S−1) | sq(1, 0) … | … sq(D−1, S−1) | loss(0) … loss(D−1)
//!   | bad(0) … bad(D−1) ]
//! ```
//!
//! `sq(r, s)` is the squared L2 norm of the reduced gradient that the rank of stage `s` in
//! replica `r` owns, `loss(r)` the sum of replica `r`'s micro-batch losses, `bad(r)` marks
//! replica `r`'s first micro-batch `m` with a token target outside the model's classes as
//! `M − m` (0: none; the largest mark is the first micro-batch). Every slot has
//! exactly one writer and zeros elsewhere, so the table's sum over the pipeline group and
//! then the data-parallel group is exact in any summation order (`x + 0 = x`), and every
//! rank holds the same table afterwards: one read, the same decisions everywhere.

use super::nonfinite::{NonFiniteReport, SeenOn};
use crate::comm::RankGrid;

/// Where each value sits in the step's table of a `dp`-replica, `stages`-stage run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableLayout {
    pub(crate) dp: usize,
    pub(crate) stages: usize,
}

impl TableLayout {
    /// Slots in the table.
    pub(crate) fn len(self) -> usize {
        self.dp * (self.stages + 2)
    }

    /// The slot of the squared norm of stage `stage`'s owned gradient in replica `dp_index`.
    pub(crate) fn sq_slot(self, dp_index: usize, stage: usize) -> usize {
        dp_index * self.stages + stage
    }

    /// The slot of replica `dp_index`'s loss sum.
    pub(crate) fn loss_slot(self, dp_index: usize) -> usize {
        self.dp * self.stages + dp_index
    }

    /// The slot of replica `dp_index`'s first micro-batch with an out-of-range target.
    pub(crate) fn bad_target_slot(self, dp_index: usize) -> usize {
        self.dp * (self.stages + 1) + dp_index
    }
}

/// Where a token target outside the model's classes was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BadTarget {
    /// World rank of the last stage that saw it.
    pub(crate) rank: usize,
    /// Its micro-batch index in the replica.
    pub(crate) microbatch: usize,
}

/// What every rank learns from the reduced table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepSummary {
    /// The global squared gradient norm, summed on the host in f64 in slot order (the same
    /// on every rank). Finite whenever every slot is: a sum of f32 values cannot overflow
    /// f64.
    pub(crate) total_sq: f64,
    /// The step's mean loss over every micro-batch of every replica.
    pub(crate) loss: f64,
    /// Where a loss or a gradient norm was not finite.
    pub(crate) report: NonFiniteReport,
    /// The first micro-batch (lowest replica first) with a target outside the classes.
    pub(crate) bad_targets: Option<BadTarget>,
}

impl StepSummary {
    /// Decodes a reduced table. `replicated_grads`: every replica holds the whole reduced
    /// gradient (ZeRO-0), so only replica 0's norms count towards the global norm; above
    /// ZeRO-0 the replicas own disjoint shards and all count. `microbatches` per replica.
    pub(crate) fn decode(
        values: &[f32],
        layout: TableLayout,
        grid: RankGrid,
        stage_ranks: &[usize],
        replicated_grads: bool,
        microbatches: usize,
    ) -> Result<Self, String> {
        if values.len() != layout.len() {
            return Err(format!(
                "the step's table has {} values, expected {} (dp {} × (stages {} + 2))",
                values.len(),
                layout.len(),
                layout.dp,
                layout.stages
            ));
        }
        let mut report = NonFiniteReport::default();
        let mut total_sq = 0.0f64;
        for dp_index in 0..layout.dp {
            for (stage, &pp_index) in stage_ranks.iter().enumerate().take(layout.stages) {
                let sq = values[layout.sq_slot(dp_index, stage)];
                if !sq.is_finite() {
                    report.gradient.push(SeenOn {
                        rank: grid.rank_of(pp_index, dp_index),
                        stage,
                    });
                }
                if dp_index == 0 || !replicated_grads {
                    total_sq += f64::from(sq);
                }
            }
        }
        let last = layout.stages.saturating_sub(1);
        let last_pp = stage_ranks.get(last).copied().unwrap_or(0);
        let mut loss_sum = 0.0f64;
        for dp_index in 0..layout.dp {
            let loss = values[layout.loss_slot(dp_index)];
            if !loss.is_finite() {
                report.loss.push(SeenOn {
                    rank: grid.rank_of(last_pp, dp_index),
                    stage: last,
                });
            }
            loss_sum += f64::from(loss);
        }
        let bad_targets = (0..layout.dp).find_map(|dp_index| {
            let mark = values[layout.bad_target_slot(dp_index)];
            (mark >= 1.0).then(|| BadTarget {
                rank: grid.rank_of(last_pp, dp_index),
                microbatch: microbatches.saturating_sub(mark as usize),
            })
        });
        Ok(StepSummary {
            total_sq,
            loss: loss_sum / (layout.dp * microbatches).max(1) as f64,
            report,
            bad_targets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pp 2 × dp 2, 4 stages looping: stages 0, 2 on pipeline rank 0; 1, 3 on rank 1.
    fn setup() -> (RankGrid, [usize; 4], TableLayout) {
        let grid = RankGrid::new(2, 2).expect("grid");
        (grid, [0, 1, 0, 1], TableLayout { dp: 2, stages: 4 })
    }

    #[test]
    fn a_clean_table_gives_the_norm_and_the_mean_loss() {
        let (grid, stage_ranks, layout) = setup();
        let mut values = vec![0.0f32; layout.len()];
        for dp_index in 0..2 {
            for stage in 0..4 {
                values[layout.sq_slot(dp_index, stage)] = (1 + stage + 10 * dp_index) as f32;
            }
            values[layout.loss_slot(dp_index)] = 3.0 * (dp_index + 1) as f32;
        }
        let sharded =
            StepSummary::decode(&values, layout, grid, &stage_ranks, false, 3).expect("decodable");
        assert_eq!(sharded.total_sq, (1 + 2 + 3 + 4 + 11 + 12 + 13 + 14) as f64);
        // (3 + 6) over 2 replicas × 3 micro-batches.
        assert_eq!(sharded.loss, 1.5);
        assert!(!sharded.report.any());
        assert_eq!(sharded.bad_targets, None);
        // ZeRO-0: replica 1 holds the same gradient as replica 0; counting it would double.
        let replicated =
            StepSummary::decode(&values, layout, grid, &stage_ranks, true, 3).expect("decodable");
        assert_eq!(replicated.total_sq, 10.0);
    }

    #[test]
    fn non_finite_slots_name_their_rank_and_stage() {
        let (grid, stage_ranks, layout) = setup();
        let mut values = vec![0.0f32; layout.len()];
        values[layout.sq_slot(0, 3)] = f32::NAN; // world rank 1
        values[layout.sq_slot(1, 2)] = f32::INFINITY; // world rank 2
        values[layout.loss_slot(0)] = f32::NAN; // stage 3 of replica 0: world rank 1
        let summary =
            StepSummary::decode(&values, layout, grid, &stage_ranks, false, 2).expect("decodable");
        let report = &summary.report;
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
    }

    #[test]
    fn the_first_bad_target_is_named_by_replica_then_micro_batch() {
        let (grid, stage_ranks, layout) = setup();
        let mut values = vec![0.0f32; layout.len()];
        // 3 micro-batches per replica: replica 1's micro-batch 1 (mark 3 − 1 = 2) and
        // replica 0's micro-batch 2 (mark 1); replica 0 is named first.
        values[layout.bad_target_slot(1)] = 2.0;
        values[layout.bad_target_slot(0)] = 1.0;
        let summary =
            StepSummary::decode(&values, layout, grid, &stage_ranks, false, 3).expect("decodable");
        // Stage 3 is on pipeline rank 1: world rank 1 in replica 0.
        assert_eq!(
            summary.bad_targets,
            Some(BadTarget {
                rank: 1,
                microbatch: 2
            })
        );
    }

    #[test]
    fn norms_that_would_overflow_f32_sum_in_f64_and_short_tables_are_refused() {
        let (grid, stage_ranks, layout) = setup();
        let mut values = vec![0.0f32; layout.len()];
        values[layout.sq_slot(0, 0)] = f32::MAX;
        values[layout.sq_slot(1, 0)] = f32::MAX;
        let summary =
            StepSummary::decode(&values, layout, grid, &stage_ranks, false, 1).expect("decodable");
        assert_eq!(summary.total_sq, 2.0 * f64::from(f32::MAX));
        assert!(!summary.report.any());
        let wrong = StepSummary::decode(&values[1..], layout, grid, &stage_ranks, false, 1);
        assert!(wrong.expect_err("short table").contains("expected 12"));
    }
}
