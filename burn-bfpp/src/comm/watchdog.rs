//! The watchdog over calls a device runs on its own (`NcclComm`'s NCCL calls): a rank waits
//! for such a call by polling it, and a call that fails, or does not finish within the
//! world's timeout because a peer died or stalled, has its communicator aborted (PyTorch's
//! `ncclCommAbort` after its watchdog timeout) and ends the whole world with an error naming
//! this rank and the call.
//!
//! The logic is generic over what is watched, so it runs on the CPU with a stand-in call in
//! the tests; `NcclMember` implements [`WatchedCall`] over a CUDA event and NCCL's
//! asynchronous error state.

use std::time::{Duration, Instant};

use super::{CommError, CommOp};

/// What a watched call reports when polled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallState {
    /// It finished; its outputs may be used.
    Done,
    /// Still running (waiting for a peer, or moving data).
    Running,
    /// The device or the library reported an error.
    Failed(String),
}

/// A call in flight on a device, as the watchdog sees it.
pub(crate) trait WatchedCall {
    /// Polls the call; never blocks.
    fn state(&mut self) -> CallState;
    /// Aborts the call's communicator, which ends the call (and every other call on that
    /// communicator); returns `reason` with what the abort did.
    fn abort(&mut self, reason: String) -> String;
}

/// Longest pause between two polls: a finished call is noticed within this.
const MAX_PAUSE: Duration = Duration::from_millis(1);

/// Waits for `call` until it finished, failed, or `timeout` passed; on failure or timeout the
/// call's communicator is aborted and the reason returned, so the caller never hangs on a
/// dead peer.
pub(crate) fn watch(call: &mut impl WatchedCall, timeout: Duration) -> Result<(), String> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(5);
    loop {
        match call.state() {
            CallState::Done => return Ok(()),
            CallState::Failed(reason) => return Err(call.abort(reason)),
            CallState::Running => {}
        }
        let waited = start.elapsed();
        if waited > timeout {
            return Err(call.abort(format!(
                "did not complete within {timeout:?} (a member stalled or died)"
            )));
        }
        std::thread::sleep(pause.min(timeout.saturating_sub(waited)));
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// What the watchdog needs from the rank's host communicator: the world's timeout, and the
/// fail-stop that tells every other rank.
pub(crate) trait FailStop {
    /// This rank's world rank.
    fn world_rank(&self) -> usize;
    /// Longest wait for any call.
    fn call_timeout(&self) -> Duration;
    /// Records `err` as this rank's failure, which stops every rank, and returns it.
    fn fail_world(&self, err: CommError) -> CommError;
}

/// [`watch`] on behalf of `action` of the rank of `host`: a failure or timeout aborts the
/// call's communicator and the world, with an error naming the rank and `action`.
pub(crate) fn await_call(
    host: &impl FailStop,
    action: CommOp,
    call: &mut impl WatchedCall,
) -> Result<(), CommError> {
    watch(call, host.call_timeout()).map_err(|reason| {
        host.fail_world(CommError::Nccl {
            rank: host.world_rank(),
            action,
            reason,
        })
    })
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;

    use super::super::tests::world;
    use super::super::{run_ranks, Communicator, Group, ReduceOp};
    use super::*;

    /// A stand-in device call: finishes after `polls` polls, fails with `error` at once, or
    /// never finishes (`polls` = `usize::MAX`); counts its aborts.
    struct StandIn {
        polls: usize,
        error: Option<String>,
        aborts: usize,
    }

    impl WatchedCall for StandIn {
        fn state(&mut self) -> CallState {
            if let Some(e) = &self.error {
                return CallState::Failed(e.clone());
            }
            if self.polls == 0 {
                return CallState::Done;
            }
            self.polls = self.polls.saturating_sub(1);
            CallState::Running
        }
        fn abort(&mut self, reason: String) -> String {
            self.aborts += 1;
            format!("{reason}; communicator aborted")
        }
    }

    fn stand_in(polls: usize, error: Option<&str>) -> StandIn {
        StandIn {
            polls,
            error: error.map(str::to_string),
            aborts: 0,
        }
    }

    #[test]
    fn a_finished_call_is_waited_for_and_not_aborted() {
        let mut call = stand_in(5, None);
        watch(&mut call, Duration::from_secs(5)).expect("finishes");
        assert_eq!(call.aborts, 0);
    }

    #[test]
    fn a_failed_or_stalled_call_aborts_its_communicator_once() {
        let mut failed = stand_in(0, Some("ncclRemoteError"));
        let err = watch(&mut failed, Duration::from_secs(5)).expect_err("failed");
        assert_eq!(failed.aborts, 1);
        assert!(
            err.contains("ncclRemoteError; communicator aborted"),
            "{err}"
        );

        let mut stalled = stand_in(usize::MAX, None);
        let start = Instant::now();
        let err = watch(&mut stalled, Duration::from_millis(50)).expect_err("stalled");
        assert!(start.elapsed() < Duration::from_secs(2), "the timeout held");
        assert_eq!(stalled.aborts, 1);
        assert!(err.contains("did not complete within 50ms"), "{err}");
    }

    /// Rank 0's device call stalls; its watchdog aborts it and the world, and rank 1, waiting
    /// in a collective for rank 0, fails naming rank 0 and the call, within the timeout.
    #[test]
    fn a_stalled_call_ends_every_rank_naming_the_rank_and_the_call() {
        let timeout = Duration::from_millis(300);
        let start = Instant::now();
        let err = run_ranks(world(1, 2, Duration::from_secs(20)), |comm| {
            if comm.rank() == 0 {
                let mut call = stand_in(usize::MAX, None);
                let action = CommOp::ReduceScatter(Group::DataParallel, ReduceOp::Mean);
                let host = Timed(comm, timeout);
                await_call(&host, action, &mut call)?;
                Ok(())
            } else {
                let t = burn::tensor::Tensor::<_, 1>::from_data(
                    burn::tensor::TensorData::new(vec![1.0f32, 2.0], [2]),
                    (comm.device(), DType::F32),
                );
                comm.all_reduce(Group::DataParallel, t, ReduceOp::Sum)
                    .map(|_| ())
            }
        })
        .expect_err("the stalled call must end the world");
        assert!(start.elapsed() < Duration::from_secs(10), "ended promptly");
        let msg = err.to_string();
        assert!(
            msg.contains("rank 0")
                && msg.contains("reduce-scatter (mean) on the data-parallel group")
                && msg.contains("did not complete within"),
            "{msg}"
        );
    }

    /// A host communicator with a shorter call timeout than its world's.
    struct Timed<'a, C>(&'a C, Duration);

    impl<C: FailStop> FailStop for Timed<'_, C> {
        fn world_rank(&self) -> usize {
            self.0.world_rank()
        }
        fn call_timeout(&self) -> Duration {
            self.1
        }
        fn fail_world(&self, err: CommError) -> CommError {
            self.0.fail_world(err)
        }
    }
}
