//! Collectives in two halves ([`Communicator::start`] / [`Communicator::finish`]): a rank
//! works between them, results are bitwise those of the blocking calls, over threads and TCP,
//! and misuse is an error.

use std::time::Duration;

use super::tests::{tensor1, values, world, B};
use super::tests_control::over_control;
use super::*;

const REDUCE_TAG: u64 = 5;

/// Rank `r`'s contribution: values whose sums round differently in different orders.
fn part(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((rank * 13 + i) as f32).cos() * 10f32.powi((i % 4) as i32 - 1))
        .collect()
}

/// Two data-parallel replicas. Rank 0 starts a reduce-scatter and an all-gather, and only then
/// sends rank 1 the message rank 1 waits for before it joins them: with blocking collectives
/// rank 0 would wait in the reduce-scatter for a rank waiting on it. Returns what each rank
/// got from the reduce-scatter then the all-gather.
fn work_between_start_and_finish<C: Communicator<B>>(comm: &C) -> Result<Vec<f32>, CommError> {
    let device = *comm.device();
    let rank = comm.rank();
    let group = Group::DataParallel;
    let reduce = || Collective::ReduceScatter {
        group,
        tensor: tensor1(part(rank, 8), &device),
        op: ReduceOp::Sum,
    };
    let gather = || Collective::AllGather {
        group,
        shard: tensor1(part(rank + 2, 3), &device),
    };
    let (reduced, gathered) = if rank == 0 {
        let r = comm.start(reduce())?;
        let g = comm.start(gather())?;
        assert!(
            r.in_flight() && g.in_flight(),
            "rank 0's collectives completed at start"
        );
        comm.send(1, REDUCE_TAG, tensor1(vec![1.0], &device))?;
        (comm.finish(r)?, comm.finish(g)?)
    } else {
        comm.recv::<1>(0, REDUCE_TAG, [1], DType::F32)?;
        let r = comm.start(reduce())?;
        let g = comm.start(gather())?;
        (comm.finish(r)?, comm.finish(g)?)
    };
    let mut out = values(reduced);
    out.extend(values(gathered));
    Ok(out)
}

/// What the blocking calls give on the same inputs.
fn blocking<C: Communicator<B>>(comm: &C) -> Result<Vec<f32>, CommError> {
    let device = *comm.device();
    let rank = comm.rank();
    let group = Group::DataParallel;
    let reduced = comm.reduce_scatter(group, tensor1(part(rank, 8), &device), ReduceOp::Sum)?;
    let gathered = comm.all_gather(group, tensor1(part(rank + 2, 3), &device))?;
    let mut out = values(reduced);
    out.extend(values(gathered));
    Ok(out)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_rank_works_between_start_and_finish_and_gets_the_blocking_results_bit_for_bit() {
    let timeout = Duration::from_secs(20);
    let overlapped = run_ranks(world(1, 2, timeout), work_between_start_and_finish)
        .unwrap_or_else(|e| panic!("{e}"));
    let reference = run_ranks(world(1, 2, timeout), blocking).unwrap_or_else(|e| panic!("{e}"));
    let control: Vec<Vec<f32>> = over_control(1, 2, timeout, work_between_start_and_finish)
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    for rank in 0..2 {
        assert_eq!(
            bits(&overlapped[rank]),
            bits(&reference[rank]),
            "rank {rank}"
        );
        assert_eq!(
            bits(&control[rank]),
            bits(&reference[rank]),
            "rank {rank} over TCP"
        );
    }
    // Against values computed here: rank 1 holds the second half of the sum, in rank order.
    let (a, b) = (part(0, 8), part(1, 8));
    let sum: Vec<f32> = (4..8).map(|i| a[i] + b[i]).collect();
    assert_eq!(bits(&overlapped[1][..4]), bits(&sum));
    let gathered: Vec<f32> = [part(2, 3), part(3, 3)].concat();
    assert_eq!(bits(&overlapped[1][4..]), bits(&gathered));
}

#[test]
fn without_overlap_a_start_waits_for_its_peers() {
    let grid = RankGrid::new(1, 2).expect("valid grid");
    let config = CommConfig {
        overlap_collectives: false,
        ..CommConfig::with_timeout(Duration::from_millis(500))
    };
    let err = run_ranks(
        LocalComm::<B>::create(grid, config),
        work_between_start_and_finish,
    )
    .expect_err("rank 0 waits in its reduce-scatter for a rank that waits on it");
    let msg = err.to_string();
    // Rank 0 in its reduce-scatter or rank 1 in its receive, whichever gives up first.
    assert!(
        msg.contains("timed out") && (msg.contains("reduce-scatter") || msg.contains("recv")),
        "the error is a timeout of one of the two waiting calls: {msg}"
    );
}

#[test]
fn a_group_of_one_completes_at_start() {
    let comms = world(1, 1, Duration::from_secs(5));
    let comm = &comms[0];
    let t = tensor1(part(0, 4), comm.device());
    let pending = comm
        .start(Collective::AllGather {
            group: Group::DataParallel,
            shard: t,
        })
        .expect("starts");
    assert!(!pending.in_flight());
    assert_eq!(
        bits(&values(comm.finish(pending).expect("finishes"))),
        bits(&part(0, 4))
    );
}

/// Both ranks start two all-gathers; each finishes the second first, which the collective's
/// order forbids (NCCL would hang): an error naming both collectives' indices.
#[test]
fn finishing_out_of_order_is_refused() {
    let err = run_ranks(world(1, 2, Duration::from_secs(5)), |comm| {
        let device = *comm.device();
        let first = comm.start(Collective::AllGather {
            group: Group::DataParallel,
            shard: tensor1(vec![1.0], &device),
        })?;
        let second = comm.start(Collective::AllGather {
            group: Group::DataParallel,
            shard: tensor1(vec![2.0], &device),
        })?;
        let late = comm.finish(second)?;
        let early = comm.finish(first)?;
        Ok::<_, CommError>((values(early), values(late)))
    })
    .expect_err("finished out of order");
    let msg = err.to_string();
    assert!(
        msg.contains("collective #1 on the data-parallel group is finished before collective #0"),
        "{msg}"
    );
}

#[test]
fn a_collective_is_finished_only_where_it_started() {
    let err = run_ranks(world(1, 2, Duration::from_secs(5)), |comm| {
        // Each rank makes a second world's communicator just to try finishing there.
        let other = world(1, 2, Duration::from_secs(5));
        let device = *comm.device();
        let pending = comm.start(Collective::AllGather {
            group: Group::DataParallel,
            shard: tensor1(vec![1.0], &device),
        })?;
        let stranger = &other[1 - comm.rank()];
        stranger.finish(pending).map(values)
    })
    .expect_err("finished on a communicator of another rank");
    assert!(
        err.to_string()
            .contains("finish it on the communicator that started it"),
        "{err}"
    );
}

/// A collective launched by a device communicator (`NcclComm`, which keeps the call and hands
/// out a ticket) cannot be finished by a host communicator: an error naming where it started.
#[test]
fn a_host_communicator_refuses_a_device_call() {
    let err = run_ranks(world(1, 1, Duration::from_secs(5)), |comm| {
        let ticket = pending::Ticket {
            rank: comm.rank(),
            group: Group::DataParallel,
            action: CommOp::AllGather(Group::DataParallel),
            id: 0,
        };
        let pending = Pending::launched(ticket);
        assert!(pending.in_flight(), "a launched call is in flight");
        comm.finish(pending).map(values)
    })
    .expect_err("a host communicator finished a device call");
    let msg = err.to_string();
    assert!(
        msg.contains("device (NCCL) communicator") && msg.contains("all-gather"),
        "{msg}"
    );
}
