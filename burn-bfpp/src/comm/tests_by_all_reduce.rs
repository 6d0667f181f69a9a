//! The all-reduce compositions that `NcclComm` runs on GPUs ([`super::by_all_reduce`]),
//! checked on the CPU over [`LocalComm`]'s own all-reduce against [`LocalComm`]'s direct
//! collectives, and the call agreement `NcclComm` checks before each NCCL call.

use std::time::Duration;

use super::tests::{tensor1, values, world, B};
use super::*;

/// Rank `r`'s contribution: 12 distinct values (divisible by group sizes 1, 2, 3), some
/// negative and some not exactly representable, so sums depend on the order of addition.
fn contribution(rank: usize) -> Vec<f32> {
    (0..12)
        .map(|i| (rank as f32 + 1.0) * 0.1 - i as f32 * 0.37)
        .collect()
}

#[test]
fn all_reduce_compositions_equal_the_direct_collectives() {
    for (pp, dp) in [(1, 3), (2, 2), (3, 1)] {
        let results = run_ranks(world(pp, dp, Duration::from_secs(10)), |comm| {
            let device = *comm.device();
            let mine = || tensor1(contribution(comm.rank()), &device);
            let group = Group::DataParallel;
            let (me, size) = (comm.group_rank(group), comm.group_size(group));
            let sum = |t: Tensor<B, 1>| comm.all_reduce(group, t, ReduceOp::Sum);
            let mut pairs = Vec::new();
            let shard = tensor1(contribution(comm.rank())[..4].to_vec(), &device);
            pairs.push((
                values(by_all_reduce::all_gather(shard.clone(), me, size, sum)?),
                values(comm.all_gather(group, shard)?),
            ));
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                let reduce = |t: Tensor<B, 1>| comm.all_reduce(group, t, op);
                pairs.push((
                    values(by_all_reduce::reduce_scatter(mine(), me, size, reduce)?),
                    values(comm.reduce_scatter(group, mine(), op)?),
                ));
            }
            let root = size - 1;
            let two_d = |t: Tensor<B, 1>| t.reshape([3, 4]);
            let sum2 = |t: Tensor<B, 2>| comm.all_reduce(group, t, ReduceOp::Sum);
            pairs.push((
                values(by_all_reduce::broadcast(two_d(mine()), me == root, sum2)?),
                values(comm.broadcast(group, root, two_d(mine()))?),
            ));
            Ok::<_, CommError>(pairs)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        for (rank, pairs) in results.iter().enumerate() {
            for (i, (composed, direct)) in pairs.iter().enumerate() {
                assert!(!direct.is_empty());
                assert_eq!(composed, direct, "pp={pp} dp={dp} rank {rank} case {i}");
            }
        }
    }
}

#[test]
fn agreement_reports_a_different_collective_or_shape() {
    let group = Group::DataParallel;
    let op = CommOp::AllReduce(group, ReduceOp::Sum);
    // Same call and shape everywhere: passes.
    run_ranks(world(1, 3, Duration::from_secs(10)), |comm| {
        comm.agree(group, op, &[4, 5])
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // Rank 1 issues another collective.
    let err = run_ranks(world(1, 2, Duration::from_secs(10)), |comm| {
        let action = if comm.rank() == 1 {
            CommOp::AllGather(group)
        } else {
            op
        };
        comm.agree(group, action, &[4])
    })
    .expect_err("different collectives must fail");
    assert!(err.to_string().contains("all-gather"), "{err}");
    // Rank 1 passes another shape: a shape mismatch naming both shapes.
    let err = run_ranks(world(1, 2, Duration::from_secs(10)), |comm| {
        let shape: &[usize] = if comm.rank() == 1 { &[4, 6] } else { &[4, 5] };
        comm.agree(group, op, shape)
    })
    .expect_err("different shapes must fail");
    let text = err.to_string();
    assert!(text.contains("[4, 6]") && text.contains("[4, 5]"), "{text}");
}

#[test]
fn nccl_groups_must_span_distinct_devices() {
    let grid = RankGrid::new(2, 2).unwrap();
    // Replica d on device d: both data-parallel groups span devices 0 and 1.
    assert!(check_distinct_devices(grid, &[0, 0, 1, 1]).is_ok());
    // Pipeline rank 1's replicas (world ranks 1 and 3) share device 1.
    let err = check_distinct_devices(grid, &[0, 1, 2, 1])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ranks 1 and 3") && err.contains("distinct GPUs"),
        "{err}"
    );
    assert!(check_distinct_devices(grid, &[0, 1, 2]).is_err());
    // Groups of one rank never conflict, whatever the devices.
    assert!(check_distinct_devices(RankGrid::new(4, 1).unwrap(), &[0, 0, 0, 0]).is_ok());
}
