//! The end of a rank's step: the global gradient norm and non-finite flags in one reduction,
//! then the clipped update of every owned shard, or the step dropped (non-finite policy, f16
//! overflow), and the step's mean loss.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData};

use super::super::nonfinite::{NonFinitePolicy, NonFiniteReport, GRADIENT, LOSS};
use super::super::EngineError;
use super::{Inner, RankExecutor};
use crate::comm::{Communicator, Group, ReduceOp};
use crate::model::PipelineStage;
use crate::optim::{clip_coefficient, clip_grad, sq_norm};
use crate::schedule::ZeroLevel;

impl<B, S, C> RankExecutor<'_, B, S, C>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<Inner<B>>,
{
    /// Clip by the global gradient norm and update every owned shard; returns whether the
    /// update was skipped.
    ///
    /// The squared norm travels with the non-finite flags (see [`super::super::nonfinite`])
    /// in one all-reduce per group, so every rank learns the same norm and the same flags and
    /// takes the same decision.
    pub(super) fn optimizer_step(&mut self, step: usize, lr: f64) -> Result<bool, EngineError> {
        let stage_sq: Vec<f64> = self
            .stages
            .iter()
            .map(|st| st.grad_owned.as_ref().map_or(0.0, sq_norm))
            .collect();
        let local_sq: f64 = stage_sq.iter().sum();
        let num_stages = self.settings.num_stages;
        let dp = self.comm.grid().dp();
        // Slot 0: the squared norm; then one flag per (replica, stage), written by its holder.
        let mut values = vec![0.0f32; 1 + dp * num_stages];
        values[0] = local_sq as f32;
        let last = num_stages - 1;
        let loss_bad = self.losses.iter().any(|l| !l.is_finite());
        for (st, sq) in self.stages.iter().zip(&stage_sq) {
            let slot = 1 + self.dp_index * num_stages + st.index;
            if !sq.is_finite() {
                values[slot] += GRADIENT;
            }
            if st.index == last && loss_bad {
                values[slot] += LOSS;
            }
        }
        // Every parameter value is owned once per pipeline replica at ZeRO-0 and once
        // globally above: sum the norm over the pipeline, and above ZeRO-0 over the replicas
        // too. At ZeRO-0 the replicas hold the same norm, so only replica 0 contributes it to
        // the data-parallel sum (x + 0 + … + 0 = x exactly), which the flags need anyway.
        let device = self.comm.device().clone();
        let len = values.len();
        let mut total = Tensor::<Inner<B>, 1>::from_data(TensorData::new(values, [len]), &device);
        total = self
            .comm
            .all_reduce(Group::Pipeline, total, ReduceOp::Sum)?;
        if self.settings.zero == ZeroLevel::Zero0 && self.dp_index != 0 {
            total = total.slice_fill(0..1, 0.0);
        }
        total = self
            .comm
            .all_reduce(Group::DataParallel, total, ReduceOp::Sum)?;
        let reduced = total
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| EngineError::Optimizer(format!("gradient norm: {e:?}")))?;
        let total_sq = f64::from(reduced[0]);
        let report = NonFiniteReport::from_flags(
            &reduced[1..],
            self.comm.grid(),
            &self.settings.stage_ranks,
            total_sq.is_finite(),
        );
        if report.any() {
            if self.scaler.enabled() && report.loss.is_empty() {
                return Ok(self.overflow_step(step, report));
            }
            return self.non_finite_step(step, report);
        }
        self.scaler.good();
        let coefficient = clip_coefficient(total_sq, self.settings.max_grad_norm);
        for stage in &mut self.stages {
            let grad = stage.grad_owned.take().ok_or(EngineError::Missing {
                what: "reduced gradient",
                stage: stage.index,
                microbatch: 0,
            })?;
            let grad = clip_grad(grad, coefficient);
            stage.owned = stage
                .optimizer
                .step(lr, stage.owned.clone(), grad)
                .map_err(|e| EngineError::Optimizer(e.to_string()))?;
            if !stage.layout.sharded {
                stage.refill(stage.owned.clone())?;
            }
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
                    stage.grad_owned = None;
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
            stage.grad_owned = None;
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

    /// The step's mean loss over every micro-batch of every replica, on last-stage ranks.
    pub(super) fn step_loss(&mut self) -> Result<Option<f64>, EngineError> {
        if !self.local(self.settings.num_stages - 1) {
            return Ok(None);
        }
        let mean = self.losses.iter().sum::<f64>() / self.losses.len().max(1) as f64;
        let device = self.comm.device().clone();
        let t = Tensor::<Inner<B>, 1>::from_floats([mean as f32], &device);
        let t = self
            .comm
            .all_reduce(Group::DataParallel, t, ReduceOp::Mean)?;
        Ok(Some(t.into_scalar().elem()))
    }
}
