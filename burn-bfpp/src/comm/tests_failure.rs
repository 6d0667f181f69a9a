//! Failure tests of [`LocalComm`] and [`run_ranks`]: timeouts, error and panic propagation,
//! exited peers and argument mismatches. Every test bounds its wall time well under the
//! configured timeout, which is what "fails fast, never hangs" means.

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use super::tests::{tensor1, world, B};
use super::*;

const LONG: Duration = Duration::from_secs(30);
/// Failure propagation must be much faster than `LONG`.
const FAST: Duration = Duration::from_secs(3);

#[test]
fn recv_that_nobody_sends_times_out_naming_rank_peer_action_shape() {
    let comms = world(2, 1, Duration::from_millis(200));
    let start = Instant::now();
    // comms[0] stays alive but never sends.
    let err = comms[1].recv::<2>(0, 5, [2, 3], DType::F32).unwrap_err();
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(200) && elapsed < FAST,
        "{elapsed:?}"
    );
    match &err {
        CommError::Timeout {
            rank,
            peer,
            action,
            shape,
            ..
        } => {
            assert_eq!((*rank, *peer), (1, 0));
            assert_eq!(*action, CommOp::Recv { tag: 5 });
            assert_eq!(shape, &vec![2, 3]);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    let msg = err.to_string();
    for part in ["rank 1", "rank 0", "recv (tag 5)", "[2, 3]", "timed out"] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
    // The timeout aborted the world: rank 0 now fails at once, naming rank 1.
    let device = Default::default();
    let err = comms[0]
        .send(1, 0, tensor1(vec![1.0], &device))
        .unwrap_err();
    assert!(
        matches!(err, CommError::PeerFailed { failed_rank: 1, .. }),
        "{err}"
    );
}

#[test]
fn collective_with_an_absent_member_times_out_naming_it() {
    let comms = world(1, 3, Duration::from_millis(200));
    let device = Default::default();
    let err = comms[0]
        .all_reduce(
            Group::DataParallel,
            tensor1(vec![1.0; 6], &device),
            ReduceOp::Sum,
        )
        .unwrap_err();
    assert!(
        matches!(
            &err,
            CommError::Timeout { rank: 0, peer: 1, action: CommOp::AllReduce(Group::DataParallel, ReduceOp::Sum), shape, .. }
                if shape == &vec![6]
        ),
        "{err}"
    );
}

/// Runs a 2×2 world where rank `culprit` fails via `fail` after a short delay while every
/// other rank is blocked (in a recv or an all-reduce); returns the root error and the other
/// ranks' errors.
fn blocked_world_with_failing_rank(
    culprit: usize,
    fail: impl Fn() -> Result<(), String> + Sync,
) -> (RankError<String>, Vec<(usize, CommError)>) {
    let seen = Mutex::new(Vec::new());
    let start = Instant::now();
    let result = run_ranks(world(2, 2, LONG), |comm| {
        let device = *comm.device();
        let blocked = match comm.rank() {
            r if r == culprit => {
                thread::sleep(Duration::from_millis(100));
                return fail();
            }
            // Nobody sends to rank 0.
            0 => comm.recv::<2>(1, 0, [4, 4], DType::F32).map(|_| ()),
            // The pipeline group {0, 1}: rank 0 never joins.
            1 => comm
                .all_reduce(
                    Group::Pipeline,
                    tensor1(vec![1.0; 4], &device),
                    ReduceOp::Sum,
                )
                .map(|_| ()),
            // The data-parallel group {r - 2, r}: its partner never joins.
            _ => comm
                .all_reduce(
                    Group::DataParallel,
                    tensor1(vec![1.0; 4], &device),
                    ReduceOp::Mean,
                )
                .map(|_| ()),
        };
        match blocked {
            Ok(()) => Ok(()),
            Err(e) => {
                seen.lock().unwrap().push((comm.rank(), e.clone()));
                Err(e.to_string())
            }
        }
    });
    assert!(start.elapsed() < FAST, "took {:?}", start.elapsed());
    let Err(root) = result else {
        panic!("run_ranks should fail");
    };
    let mut seen = seen.into_inner().unwrap();
    seen.sort_by_key(|(r, _)| *r);
    (root, seen)
}

#[test]
fn a_failing_rank_stops_the_others_fast_with_its_cause() {
    let (root, others) = blocked_world_with_failing_rank(3, || Err("boom: loss is NaN".into()));
    assert!(
        matches!(&root, RankError::Failed { rank: 3, error } if error == "boom: loss is NaN"),
        "{root}"
    );
    assert_eq!(others.len(), 3);
    for (rank, err) in &others {
        match err {
            CommError::PeerFailed {
                rank: r,
                failed_rank,
                cause,
                ..
            } => {
                assert_eq!((r, *failed_rank), (rank, 3));
                assert!(cause.contains("boom: loss is NaN"), "{cause}");
                assert!(err.to_string().contains("rank 3 failed"), "{err}");
            }
            other => panic!("rank {rank}: expected PeerFailed, got {other}"),
        }
    }
}

#[test]
fn a_panicking_rank_stops_the_others_fast_with_its_message() {
    let (root, others) =
        blocked_world_with_failing_rank(2, || panic!("deliberate panic in rank 2"));
    assert!(
        matches!(&root, RankError::Panicked { rank: 2, message } if message == "deliberate panic in rank 2"),
        "{root}"
    );
    assert_eq!(root.rank(), 2);
    assert_eq!(others.len(), 3);
    for (rank, err) in &others {
        assert!(
            matches!(err, CommError::PeerFailed { failed_rank: 2, cause, .. }
                if cause.contains("deliberate panic in rank 2")),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn waiting_on_a_rank_that_exited_fails_fast() {
    let start = Instant::now();
    let result = run_ranks(world(2, 1, LONG), |comm| {
        if comm.rank() == 0 {
            return Ok(());
        }
        comm.recv::<1>(0, 0, [3], DType::F32).map(|_| ())
    });
    assert!(start.elapsed() < FAST);
    match result {
        Err(RankError::Failed {
            rank: 1,
            error: CommError::PeerExited {
                rank: 1, peer: 0, ..
            },
        }) => {}
        Err(other) => panic!("expected rank 1 to see rank 0 exit, got {other}"),
        Ok(_) => panic!("expected a failure"),
    }
}

#[test]
fn explicit_abort_is_reported_as_the_root_cause() {
    let result = run_ranks(world(1, 2, LONG), |comm| {
        if comm.rank() == 0 {
            comm.abort("operator requested stop");
            return Ok(());
        }
        comm.barrier(Group::DataParallel)
    });
    match result {
        Err(RankError::Aborted { rank: 0, cause }) => assert_eq!(cause, "operator requested stop"),
        Err(other) => panic!("expected an abort by rank 0, got {other}"),
        Ok(_) => panic!("expected a failure"),
    }
}

#[test]
fn panic_outside_run_ranks_still_aborts_the_world() {
    let mut comms = world(2, 1, LONG);
    let rank1 = comms.pop().unwrap();
    let rank0 = comms.pop().unwrap();
    let handle = thread::spawn(move || {
        let _comm = rank0;
        thread::sleep(Duration::from_millis(50));
        panic!("worker died");
    });
    let start = Instant::now();
    let err = rank1.recv::<1>(0, 0, [1], DType::F32).unwrap_err();
    assert!(start.elapsed() < FAST);
    assert!(handle.join().is_err());
    assert!(
        matches!(&err, CommError::PeerFailed { failed_rank: 0, cause, .. } if cause.contains("panicked")),
        "{err}"
    );
}

#[test]
fn mismatched_calls_are_reported_not_hung() {
    // Wrong receive shape.
    let result = run_ranks(world(2, 1, LONG), |comm| {
        let device = *comm.device();
        if comm.rank() == 0 {
            let t: Tensor<B, 2> = tensor1(vec![0.0; 6], &device).reshape([2, 3]);
            return comm.send(1, 0, t);
        }
        comm.recv::<2>(0, 0, [3, 2], DType::F32).map(|_| ())
    });
    assert!(
        matches!(&result, Err(RankError::Failed { rank: 1, error: CommError::ShapeMismatch { peer: 0, expected, actual, .. } })
            if expected == &vec![3, 2] && actual == &vec![2, 3]),
        "{:?}",
        result.err().map(|e| e.to_string())
    );

    // Different collectives at the same point.
    let result = run_ranks(world(1, 2, LONG), |comm| {
        let t = tensor1(vec![1.0, 2.0], comm.device());
        if comm.rank() == 0 {
            comm.all_reduce(Group::DataParallel, t, ReduceOp::Sum)
                .map(|_| ())
        } else {
            comm.all_gather(Group::DataParallel, t).map(|_| ())
        }
    });
    assert!(
        matches!(
            &result,
            Err(RankError::Failed {
                error: CommError::CollectiveMismatch { .. },
                ..
            })
        ),
        "{:?}",
        result.err().map(|e| e.to_string())
    );

    // Reduce-scatter of a length the group size does not divide.
    let result = run_ranks(world(1, 2, LONG), |comm| {
        let t = tensor1(vec![1.0; 3], comm.device());
        comm.reduce_scatter(Group::DataParallel, t, ReduceOp::Mean)
            .map(|_| ())
    });
    assert!(
        matches!(
            &result,
            Err(RankError::Failed {
                error: CommError::InvalidArgument { .. },
                ..
            })
        ),
        "{:?}",
        result.err().map(|e| e.to_string())
    );
}

#[test]
fn a_timeout_names_the_rank_at_the_end_of_the_waits_for_chain() {
    // Rank 0 waits on rank 1, which waits on rank 2, which never communicates: rank 0 times
    // out first (it started waiting first) and must blame rank 2, not rank 1.
    let timeout = Duration::from_millis(300);
    let mut comms = world(3, 1, timeout).into_iter();
    let (c0, c1, c2) = (
        comms.next().unwrap(),
        comms.next().unwrap(),
        comms.next().unwrap(),
    );
    let start = Instant::now();
    let (err0, err1) = thread::scope(|scope| {
        let h0 = scope.spawn(move || c0.recv::<1>(1, 0, [1], DType::F32).unwrap_err());
        thread::sleep(Duration::from_millis(100));
        let h1 = scope.spawn(move || c1.recv::<1>(2, 0, [1], DType::F32).unwrap_err());
        (h0.join().unwrap(), h1.join().unwrap())
    });
    assert!(start.elapsed() < FAST, "took {:?}", start.elapsed());
    assert!(
        matches!(
            err0,
            CommError::Timeout {
                rank: 0,
                peer: 1,
                stalled: Some(2),
                ..
            }
        ),
        "{err0}"
    );
    let msg = err0.to_string();
    assert!(
        msg.contains("chain of waiting ranks ends at rank 2"),
        "{msg}"
    );
    // Rank 1 is stopped by rank 0's timeout, whose message names rank 2.
    assert!(
        matches!(&err1, CommError::PeerFailed { failed_rank: 0, cause, .. } if cause.contains("rank 2")),
        "{err1}"
    );
    drop(c2);

    // Two ranks waiting on each other: a deadlock, no single rank to blame.
    let mut comms = world(2, 1, timeout).into_iter();
    let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
    let err = thread::scope(|scope| {
        let h0 = scope.spawn(move || c0.recv::<1>(1, 0, [1], DType::F32).unwrap_err());
        let h1 = scope.spawn(move || c1.recv::<1>(0, 0, [1], DType::F32).unwrap_err());
        let (a, b) = (h0.join().unwrap(), h1.join().unwrap());
        if matches!(a, CommError::Timeout { .. }) {
            a
        } else {
            b
        }
    });
    assert!(
        matches!(err, CommError::Timeout { stalled: None, .. }),
        "{err}"
    );
}
