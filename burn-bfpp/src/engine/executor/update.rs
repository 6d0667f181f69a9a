//! The end of a rank's step: the global gradient norm and non-finite flags in one reduction,
//! then the clipped update of every owned shard, or the step dropped (non-finite policy, f16
//! overflow), and the step's mean loss.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use super::super::nonfinite::{NonFinitePolicy, NonFiniteReport};
use super::super::summary::{StepSummary, TableLayout};
use super::super::EngineError;
use super::{Inner, RankExecutor};
use crate::comm::{Communicator, Group, ReduceOp};
use crate::host_read::{read, ReadPurpose};
use crate::model::PipelineStage;
use crate::optim::clip_coefficient;
use crate::schedule::ZeroLevel;

impl<B, S, C> RankExecutor<'_, B, S, C>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<Inner<B>>,
{
    /// Reduces the step's table (see [`super::super::summary`]) over the world and reads it:
    /// the step's one synchronising read of the device.
    pub(super) fn step_summary(&mut self) -> Result<StepSummary, EngineError> {
        let layout = TableLayout {
            dp: self.comm.grid().dp(),
            stages: self.settings.num_stages,
        };
        let device = self.comm.device().clone();
        let mut table = Tensor::<Inner<B>, 1>::zeros([layout.len()], &device);
        for stage in &self.stages {
            if let Some(grad) = &stage.reduced {
                let slot = layout.sq_slot(self.dp_index, stage.index);
                table = table.slice_assign(slot..slot + 1, grad.sq_norm(&device));
            }
        }
        if let Some(loss) = self.loss_sum.take() {
            let slot = layout.loss_slot(self.dp_index);
            table = table.slice_assign(slot..slot + 1, loss);
        }
        if let Some(mark) = self.bad_targets.take() {
            let slot = layout.bad_target_slot(self.dp_index);
            table = table.slice_assign(slot..slot + 1, mark);
        }
        table = self
            .comm
            .all_reduce(Group::Pipeline, table, ReduceOp::Sum)?;
        table = self
            .comm
            .all_reduce(Group::DataParallel, table, ReduceOp::Sum)?;
        let values = read(table, ReadPurpose::Sync)
            .map_err(|e| EngineError::Optimizer(format!("reading the step's table: {e:?}")))?
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| EngineError::Optimizer(format!("the step's table: {e:?}")))?;
        StepSummary::decode(
            &values,
            layout,
            self.comm.grid(),
            &self.settings.stage_ranks,
            self.settings.zero == ZeroLevel::Zero0,
            self.settings.microbatches,
        )
        .map_err(EngineError::Optimizer)
    }

    /// Clip by the global gradient norm and update every owned shard; returns whether the
    /// update was skipped.
    ///
    /// Every rank learns the same norm and the same non-finite places from the step's table,
    /// so every rank takes the same decision.
    pub(super) fn optimizer_step(
        &mut self,
        step: usize,
        lr: f64,
        summary: &StepSummary,
    ) -> Result<bool, EngineError> {
        let report = &summary.report;
        if report.any() {
            if self.scaler.enabled() && report.loss.is_empty() {
                return Ok(self.overflow_step(step, report.clone()));
            }
            return self.non_finite_step(step, report.clone());
        }
        self.scaler.good();
        let coefficient = clip_coefficient(summary.total_sq, self.settings.max_grad_norm);
        let _turn = self.autodiff_turn();
        for stage in &mut self.stages {
            stage.update(lr, coefficient)?;
        }
        Ok(false)
    }

    /// Carries out the non-finite policy for `step`, identically on every rank: stop with an
    /// error, or drop the step's gradients and report the update as skipped.
    fn non_finite_step(
        &mut self,
        step: usize,
        report: NonFiniteReport,
    ) -> Result<bool, EngineError> {
        let rank = self.comm.rank();
        match self.settings.on_nonfinite {
            NonFinitePolicy::Stop => Err(EngineError::NonFinite { step, rank, report }),
            NonFinitePolicy::Skip => {
                for stage in &mut self.stages {
                    stage.reduced = None;
                }
                // Every rank knows; one says it.
                if rank == 0 {
                    tracing::warn!(step, %report, "optimizer update skipped (on_nonfinite = skip)");
                }
                Ok(true)
            }
        }
    }

    /// An f16 step whose gradients overflowed the loss scale: every rank drops the step's
    /// gradients and halves the scale (whatever the non-finite policy: this is the normal
    /// working of dynamic loss scaling, not a divergence). Returns that the update was skipped.
    fn overflow_step(&mut self, step: usize, report: NonFiniteReport) -> bool {
        for stage in &mut self.stages {
            stage.reduced = None;
        }
        let old = self.scaler.scale;
        self.scaler.overflow();
        if self.comm.rank() == 0 {
            tracing::warn!(
                step,
                %report,
                old_scale = old,
                new_scale = self.scaler.scale,
                "f16 gradients overflowed: optimizer update skipped, loss scale halved"
            );
        }
        true
    }
}
