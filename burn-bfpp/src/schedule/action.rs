//! One step of a rank's pipeline program, and its textual form.
//!
//! The text format is `{stage}{KIND}{microbatch}` for compute and point-to-point actions and
//! `{stage}{KIND}` for per-stage collectives (`0F1`, `3B0`, `1SEND_F0`, `4UNSHARD`), the same
//! strings PyTorch's `torch.distributed.pipelining` writes into its schedule CSV files, so
//! schedules can be exchanged with it.

use std::fmt;
use std::str::FromStr;

use super::ScheduleError;

/// What an [`Action`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Forward of one micro-batch through one stage (`F`).
    Forward,
    /// Full backward (input and weight gradients) of one micro-batch through one stage (`B`).
    Backward,
    /// Backward for the input gradient only (`I`); zero-bubble schedules split `B` into `I` + `W`.
    BackwardInput,
    /// Backward for the weight gradient only (`W`); must follow the matching `I`.
    BackwardWeight,
    /// Send this stage's forward output of a micro-batch to the next stage's rank (`SEND_F`).
    SendForward,
    /// Receive this stage's forward input of a micro-batch from the previous stage's rank (`RECV_F`).
    RecvForward,
    /// Send this stage's input gradient of a micro-batch to the previous stage's rank (`SEND_B`).
    SendBackward,
    /// Receive this stage's output gradient of a micro-batch from the next stage's rank (`RECV_B`).
    RecvBackward,
    /// All-gather the stage's sharded parameters into a full buffer (`UNSHARD`).
    Unshard,
    /// Free the stage's gathered parameter buffer (`RESHARD`).
    Reshard,
    /// Reduce(-scatter) the stage's accumulated gradients over the data-parallel group (`REDUCE_GRAD`).
    ReduceGrad,
}

impl ActionKind {
    /// Every kind, in a fixed order (handy for tests and tables).
    pub const ALL: [ActionKind; 11] = [
        ActionKind::Forward,
        ActionKind::Backward,
        ActionKind::BackwardInput,
        ActionKind::BackwardWeight,
        ActionKind::SendForward,
        ActionKind::RecvForward,
        ActionKind::SendBackward,
        ActionKind::RecvBackward,
        ActionKind::Unshard,
        ActionKind::Reshard,
        ActionKind::ReduceGrad,
    ];

    /// The kind's token in the action-string format.
    pub fn token(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendForward => "SEND_F",
            ActionKind::RecvForward => "RECV_F",
            ActionKind::SendBackward => "SEND_B",
            ActionKind::RecvBackward => "RECV_B",
            ActionKind::Unshard => "UNSHARD",
            ActionKind::Reshard => "RESHARD",
            ActionKind::ReduceGrad => "REDUCE_GRAD",
        }
    }

    /// True for the compute kinds `F`, `B`, `I`, `W`.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }

    /// True for the computes that read the stage's weights (`F`, `B`, `I`): `W` computes
    /// `xᵀ·dy` from what its `I` kept, so a sharded stage need not be gathered for it.
    pub fn reads_weights(self) -> bool {
        matches!(
            self,
            ActionKind::Forward | ActionKind::Backward | ActionKind::BackwardInput
        )
    }

    /// True for the backward kinds that produce weight gradients (`B`, `W`).
    pub fn produces_weight_grad(self) -> bool {
        matches!(self, ActionKind::Backward | ActionKind::BackwardWeight)
    }

    /// True for the backward kinds that produce the input gradient sent upstream (`B`, `I`).
    pub fn produces_input_grad(self) -> bool {
        matches!(self, ActionKind::Backward | ActionKind::BackwardInput)
    }

    /// True for point-to-point pipeline transfers.
    pub fn is_p2p(self) -> bool {
        matches!(
            self,
            ActionKind::SendForward
                | ActionKind::RecvForward
                | ActionKind::SendBackward
                | ActionKind::RecvBackward
        )
    }

    /// True for the per-stage data-parallel collectives, which carry no micro-batch index.
    pub fn is_collective(self) -> bool {
        matches!(
            self,
            ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad
        )
    }
}

/// One step of a rank's program: what to do, to which stage, for which micro-batch.
///
/// Every action naming stage `s` runs on the rank that owns stage `s`; a `RECV_F` of stage `s`
/// receives the input of stage `s`, a `SEND_B` of stage `s` sends the gradient of its input.
///
/// Two computes can form one overlapped pair (PyTorch's `(…;…)OVERLAP_F_B`, which DualPipeV
/// uses): the first carries [`Action::overlaps_next`] and the second follows it directly in
/// the rank's list. A pair runs as one unit: both halves' inputs arrive before it and both
/// outputs leave after it, so a runtime may run its halves concurrently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// Global stage index (0 is the first stage of the model).
    pub stage: usize,
    /// What to do.
    pub kind: ActionKind,
    /// Micro-batch index within the optimizer step; `None` exactly for collectives.
    pub microbatch: Option<usize>,
    /// True on the first half of an overlapped forward/backward pair: the next action in the
    /// rank's list is the other half. Kept with the action so that lowering passes keep the
    /// pair together and schedule files round-trip.
    pub overlaps_next: bool,
}

impl Action {
    /// A compute or point-to-point action on one micro-batch.
    ///
    /// # Panics
    /// If `kind` is a collective (collectives carry no micro-batch; use [`Action::collective`]).
    pub fn new(stage: usize, kind: ActionKind, microbatch: usize) -> Self {
        assert!(
            !kind.is_collective(),
            "{kind:?} is a per-stage collective; build it with Action::collective"
        );
        Action {
            stage,
            kind,
            microbatch: Some(microbatch),
            overlaps_next: false,
        }
    }

    /// A per-stage collective (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`).
    ///
    /// # Panics
    /// If `kind` is not a collective.
    pub fn collective(stage: usize, kind: ActionKind) -> Self {
        assert!(
            kind.is_collective(),
            "{kind:?} needs a micro-batch; build it with Action::new"
        );
        Action {
            stage,
            kind,
            microbatch: None,
            overlaps_next: false,
        }
    }

    /// Forward of `microbatch` through `stage`.
    pub fn forward(stage: usize, microbatch: usize) -> Self {
        Action::new(stage, ActionKind::Forward, microbatch)
    }

    /// Full backward of `microbatch` through `stage`.
    pub fn backward(stage: usize, microbatch: usize) -> Self {
        Action::new(stage, ActionKind::Backward, microbatch)
    }

    /// This compute as the first half of an overlapped pair whose second half is the next
    /// action of its rank (see [`Action::overlaps_next`]).
    pub fn overlapping_next(mut self) -> Self {
        self.overlaps_next = true;
        self
    }

    /// The same action outside any pair.
    pub fn alone(mut self) -> Self {
        self.overlaps_next = false;
        self
    }

    /// The micro-batch of a non-collective action (0 for collectives, which have none).
    pub fn mb(&self) -> usize {
        self.microbatch.unwrap_or(0)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.microbatch {
            Some(mb) => write!(f, "{}{}{}", self.stage, self.kind.token(), mb),
            None => write!(f, "{}{}", self.stage, self.kind.token()),
        }
    }
}

impl FromStr for Action {
    type Err = ScheduleError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| ScheduleError::ParseAction {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let s = text.trim();
        let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        if digits_end == 0 {
            return Err(bad("expected a stage number first, as in `0F1`"));
        }
        let stage: usize = s[..digits_end]
            .parse()
            .map_err(|_| bad("stage number does not fit in an integer"))?;
        let rest = &s[digits_end..];
        let kind_end = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let token = &rest[..kind_end];
        let kind = ActionKind::ALL
            .into_iter()
            .find(|k| k.token() == token)
            .ok_or_else(|| {
                bad("unknown action kind; expected one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD")
            })?;
        let mb_text = &rest[kind_end..];
        if kind.is_collective() {
            if !mb_text.is_empty() {
                return Err(bad("collectives take no micro-batch, as in `4UNSHARD`"));
            }
            return Ok(Action::collective(stage, kind));
        }
        if mb_text.is_empty() {
            return Err(bad("missing micro-batch number, as in `0F1`"));
        }
        if !mb_text.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad("micro-batch must be a number"));
        }
        let mb: usize = mb_text
            .parse()
            .map_err(|_| bad("micro-batch number does not fit in an integer"))?;
        Ok(Action::new(stage, kind, mb))
    }
}

/// One executed action, with wall-clock times in seconds since the run started: what the
/// engine records and what the timeline pictures and step profiles read. It lives beside
/// [`Action`] so that the pictures build without the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedEvent {
    /// Optimizer step (1-based).
    pub step: usize,
    /// The action.
    pub action: Action,
    /// Start, seconds since the run started.
    pub start: f64,
    /// End, seconds since the run started.
    pub end: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_through_text() {
        for kind in ActionKind::ALL {
            let action = if kind.is_collective() {
                Action::collective(12, kind)
            } else {
                Action::new(12, kind, 345)
            };
            let text = action.to_string();
            assert_eq!(text.parse::<Action>().unwrap(), action, "{text}");
        }
    }

    #[test]
    fn reference_examples_parse() {
        assert_eq!("0F1".parse::<Action>().unwrap(), Action::forward(0, 1));
        assert_eq!("3B0".parse::<Action>().unwrap(), Action::backward(3, 0));
        assert_eq!(
            "1SEND_F0".parse::<Action>().unwrap(),
            Action::new(1, ActionKind::SendForward, 0)
        );
        assert_eq!(
            "4REDUCE_GRAD".parse::<Action>().unwrap(),
            Action::collective(4, ActionKind::ReduceGrad)
        );
    }

    #[test]
    fn malformed_actions_are_rejected_with_a_reason() {
        for bad in ["", "F1", "0X1", "0F", "0UNSHARD3", "0F1x", "0SEND1", "-1F0"] {
            let err = bad.parse::<Action>().unwrap_err();
            assert!(matches!(err, ScheduleError::ParseAction { .. }), "{bad}");
        }
    }
}
