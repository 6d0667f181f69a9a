//! The pipeline transfers of a rank's list (`SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`): one at a
//! time on host transports, and each run of consecutive transfers as one group where the
//! communicator needs them posted together (NCCL, see
//! [`Communicator::groups_transfers`]).

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use super::super::EngineError;
use super::{Inner, RankExecutor};
use crate::comm::Communicator;
use crate::model::PipelineStage;
use crate::schedule::TimedEvent;
use crate::schedule::{Action, ActionKind};

/// Tag of the transfer that leaves `stage` for micro-batch `mb` (`backward`: gradient).
pub(super) fn tag(stage: usize, mb: usize, backward: bool) -> u64 {
    ((stage as u64) << 33) | ((mb as u64) << 1) | u64::from(backward)
}

impl<B, S, C> RankExecutor<'_, B, S, C>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<Inner<B>>,
{
    /// The tensor a `SEND_*` action sends, with its peer and tag.
    fn outgoing(
        &mut self,
        action: Action,
    ) -> Result<(usize, u64, Tensor<Inner<B>, 3>), EngineError> {
        let (s, m) = (action.stage, action.mb());
        let forward = action.kind == ActionKind::SendForward;
        let (queue, what) = if forward {
            (&mut self.to_send_forward, "forward output")
        } else {
            (&mut self.to_send_backward, "input gradient")
        };
        let tensor = queue.remove(&(s, m)).ok_or(EngineError::Missing {
            what,
            stage: s,
            microbatch: m,
        })?;
        let peer = if forward {
            self.peer(s + 1)
        } else {
            self.peer(s - 1)
        };
        Ok((peer, tag(s, m, !forward), tensor))
    }

    /// The peer and tag a `RECV_*` action receives from.
    fn incoming(&self, action: Action) -> (usize, u64) {
        let (s, m) = (action.stage, action.mb());
        if action.kind == ActionKind::RecvForward {
            (self.peer(s - 1), tag(s - 1, m, false))
        } else {
            (self.peer(s + 1), tag(s + 1, m, true))
        }
    }

    /// The shape a `RECV_*` action receives: the activation entering its stage (`RECV_F`), or
    /// the gradient of the activation leaving it (`RECV_B`).
    fn incoming_shape(&self, action: Action) -> Result<[usize; 3], EngineError> {
        let boundary = if action.kind == ActionKind::RecvForward {
            action.stage.checked_sub(1)
        } else {
            Some(action.stage)
        };
        boundary
            .and_then(|b| self.settings.activation_shapes.get(b).copied())
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "{action}: no activation crosses that stage boundary (the program does not \
                     fit the model's split)"
                ))
            })
    }

    /// Puts what a `RECV_*` action received where its compute takes it.
    fn received(&mut self, action: Action, tensor: Tensor<Inner<B>, 3>) {
        let key = (action.stage, action.mb());
        if action.kind == ActionKind::RecvForward {
            self.inputs.insert(key, tensor);
        } else {
            self.out_grads.insert(key, tensor);
        }
    }

    /// One transfer action, on its own.
    pub(super) fn transfer(&mut self, action: Action) -> Result<(), EngineError> {
        if matches!(
            action.kind,
            ActionKind::SendForward | ActionKind::SendBackward
        ) {
            let (peer, tag, tensor) = self.outgoing(action)?;
            return Ok(self.comm.send(peer, tag, tensor)?);
        }
        let (peer, tag) = self.incoming(action);
        let shape = self.incoming_shape(action)?;
        let dtype = self.settings.precision.dtype();
        let tensor = self.comm.recv(peer, tag, shape, dtype)?;
        self.received(action, tensor);
        Ok(())
    }

    /// Consecutive transfer actions posted as one group ([`Communicator::exchange`]); each
    /// is recorded in the timeline with the group's interval.
    pub(super) fn transfer_group(
        &mut self,
        step: usize,
        actions: &[Action],
    ) -> Result<(), EngineError> {
        let start = self.epoch.elapsed().as_secs_f64();
        let rank = self.comm.rank();
        let failed = |action: Action, source: EngineError| EngineError::Action {
            rank,
            step,
            action,
            source: Box::new(source),
        };
        let dtype = self.settings.precision.dtype();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut receiving = Vec::new();
        for &action in actions {
            if matches!(
                action.kind,
                ActionKind::SendForward | ActionKind::SendBackward
            ) {
                sends.push(self.outgoing(action).map_err(|e| failed(action, e))?);
            } else {
                let (peer, tag) = self.incoming(action);
                let shape = self.incoming_shape(action).map_err(|e| failed(action, e))?;
                recvs.push((peer, tag, shape, dtype));
                receiving.push(action);
            }
        }
        let first = actions.first().copied();
        let got = self.comm.exchange(sends, &recvs).map_err(|e| match first {
            Some(action) => failed(action, e.into()),
            None => e.into(),
        })?;
        for (action, tensor) in receiving.into_iter().zip(got) {
            self.received(action, tensor);
        }
        let end = self.epoch.elapsed().as_secs_f64();
        for &action in actions {
            self.recorder.record(TimedEvent {
                step,
                action,
                start,
                end,
            });
        }
        Ok(())
    }
}
