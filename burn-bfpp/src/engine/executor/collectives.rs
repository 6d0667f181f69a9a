//! The data-parallel collectives of a rank's list: `UNSHARD` and `REDUCE_GRAD` start them
//! (see [`crate::comm::pending`]), and the executor finishes each only where its result is
//! needed, so the wait for the other replicas overlaps compute.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use super::super::master::Reduced;
use super::super::EngineError;
use super::{InFlight, Inner, RankExecutor};
use crate::comm::{Collective, Communicator, Group, Pending, ReduceOp};
use crate::model::PipelineStage;
use crate::schedule::{Action, ActionKind};

impl<B, S, C> RankExecutor<'_, B, S, C>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<Inner<B>>,
{
    /// Starts the all-gather of the stage's shards; [`Self::finish_collectives`] puts the
    /// result into its module before the stage computes. The shards travel in the compute
    /// dtype (bf16 as bf16): the module holds them so anyway, and narrowing before the gather
    /// is bitwise the same as after it.
    pub(super) fn unshard(&mut self, s: usize) -> Result<(), EngineError> {
        let comm = self.comm;
        let shard = self.stage_mut(s)?.shard_to_gather()?;
        let pending = comm.start(Collective::AllGather {
            group: Group::DataParallel,
            shard,
        })?;
        self.started(Action::collective(s, ActionKind::Unshard), pending)
    }

    /// Starts the reduction of the gradients accumulated since the last reduction:
    /// all-reduce at ZeRO-0, reduce-scatter into the owned shard above; the mean over the
    /// data-parallel group. An unsharded stage without data-parallel peers keeps its
    /// gradients as they are, one per parameter: the mean over one rank is the identity.
    pub(super) fn reduce_grad(&mut self, s: usize) -> Result<(), EngineError> {
        let comm = self.comm;
        let stage = self.stage_mut(s)?;
        if !stage.layout.sharded && stage.layout.dp == 1 {
            let own = stage.take_window_params();
            return stage.add_reduced(own);
        }
        let tensor = stage.take_window_flat();
        let (group, op) = (Group::DataParallel, ReduceOp::Mean);
        let pending = comm.start(if stage.layout.sharded {
            Collective::ReduceScatter { group, tensor, op }
        } else {
            Collective::AllReduce { group, tensor, op }
        })?;
        self.started(Action::collective(s, ActionKind::ReduceGrad), pending)
    }

    /// Uses the result of a collective that completed as it started, or keeps it in flight.
    fn started(&mut self, action: Action, pending: Pending<Inner<B>>) -> Result<(), EngineError> {
        if pending.in_flight() {
            self.in_flight.push_back(InFlight { action, pending });
            Ok(())
        } else {
            let result = self.comm.finish(pending)?;
            self.use_result(action, result)
        }
    }

    /// Puts a finished collective's result where it belongs: an all-gather's into the
    /// stage's module, a reduction's into the stage's reduced gradients.
    fn use_result(
        &mut self,
        action: Action,
        result: Tensor<Inner<B>, 1>,
    ) -> Result<(), EngineError> {
        let turn = (action.kind == ActionKind::Unshard)
            .then(|| self.autodiff_turn())
            .flatten();
        let stage = self.stage_mut(action.stage)?;
        if action.kind == ActionKind::Unshard {
            stage.refill(result)?;
            drop(turn);
            stage.gathered = true;
            self.note_memory();
        } else {
            stage.add_reduced(Reduced::Flat(result))?;
        }
        Ok(())
    }

    /// Finishes the collectives `action` needs before it runs: a stage's all-gather before
    /// the stage computes or frees its weights, and the previous reduction before the next
    /// one starts (so at most one full gradient buffer waits on its peers).
    pub(super) fn finish_needed_by(
        &mut self,
        step: usize,
        action: Action,
    ) -> Result<(), EngineError> {
        let needs = |started: &Action| match action.kind {
            ActionKind::ReduceGrad => started.kind == ActionKind::ReduceGrad,
            kind if kind.reads_weights() || kind == ActionKind::Reshard => {
                started.kind == ActionKind::Unshard && started.stage == action.stage
            }
            _ => false,
        };
        match self.in_flight.iter().rposition(|f| needs(&f.action)) {
            Some(last) => self.finish_collectives(step, last + 1),
            None => Ok(()),
        }
    }

    /// Finishes the `count` oldest collectives in flight, in the order they started (as every
    /// member must), recording each wait under the action that started it.
    pub(super) fn finish_collectives(
        &mut self,
        step: usize,
        count: usize,
    ) -> Result<(), EngineError> {
        for _ in 0..count {
            let Some(InFlight { action, pending }) = self.in_flight.pop_front() else {
                break;
            };
            self.timed(step, action, |exec| {
                let result = exec.comm.finish(pending)?;
                exec.use_result(action, result)
            })?;
        }
        Ok(())
    }
}
