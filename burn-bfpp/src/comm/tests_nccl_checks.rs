//! The checks `NcclComm` relies on, on the CPU: the call agreement before each NCCL call, and
//! which groups can be NCCL communicators (members on distinct devices).

use std::time::Duration;

use std::sync::atomic::{AtomicUsize, Ordering};

use super::nccl_host::{agree_by_all_gather, setup_group, NCCL_ID_BYTES};
use super::tests::world;
use super::*;

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
    // Pipeline groups are checked member by member: NcclComm keeps a group whose members
    // share a GPU (stages on one GPU) on the host path.
    assert_eq!(first_shared_device(&[0, 1, 2, 3], &[0, 1, 2, 3]), None);
    assert_eq!(
        first_shared_device(&[0, 1, 2, 3], &[5, 6, 7, 6]),
        Some((1, 3))
    );
    assert_eq!(first_shared_device(&[2], &[0, 0, 0]), None);
}

#[test]
fn every_group_on_distinct_devices_gets_one_communicator_with_its_ranks_in_group_order() {
    // pp 2 × dp 3; world rank = dp_index · 2 + pp_index. Rank r on device 10 + r: every
    // group is on distinct devices.
    let grid = RankGrid::new(2, 3).unwrap();
    let ids: Vec<i32> = (0..6).map(|r| 10 + r).collect();
    let mut made = Vec::new();
    let members = group_wiring(grid, &ids, Group::DataParallel, |devices| {
        made.push(devices.to_vec());
        Ok(devices.iter().map(|&d| d * 100).collect())
    })
    .unwrap();
    // Data-parallel groups: pipeline rank 0 = world ranks 0, 2, 4; pipeline rank 1 = 1, 3, 5.
    assert_eq!(made, vec![vec![10, 12, 14], vec![11, 13, 15]]);
    let got: Vec<Option<i32>> = members;
    assert_eq!(got, ids.iter().map(|&d| Some(d * 100)).collect::<Vec<_>>());

    let mut made = Vec::new();
    let members = group_wiring(grid, &ids, Group::Pipeline, |devices| {
        made.push(devices.to_vec());
        Ok(devices.to_vec())
    })
    .unwrap();
    assert_eq!(made, vec![vec![10, 11], vec![12, 13], vec![14, 15]]);
    assert!(members.iter().all(Option::is_some));

    // Stages of one replica on one GPU (replica d on device d): no pipeline communicator,
    // data-parallel ones over devices 0, 1, 2.
    let ids = [0, 0, 1, 1, 2, 2];
    let mut made = Vec::new();
    let pipeline = group_wiring(grid, &ids, Group::Pipeline, |d| {
        made.push(d.to_vec());
        Ok(d.to_vec())
    })
    .unwrap();
    assert!(made.is_empty() && pipeline.iter().all(Option::is_none));
    let dp = group_wiring(grid, &ids, Group::DataParallel, |d| Ok(d.to_vec())).unwrap();
    assert_eq!(
        dp,
        vec![Some(0), Some(0), Some(1), Some(1), Some(2), Some(2)]
    );

    // A failing creation names the group's ranks.
    let (ranks, reason) = group_wiring(grid, &ids, Group::DataParallel, |_| {
        Err::<Vec<i32>, _>("no NCCL".to_string())
    })
    .unwrap_err();
    assert_eq!((ranks, reason.as_str()), (vec![0, 2, 4], "no NCCL"));
}

#[test]
fn agreement_by_all_gather_reports_a_different_collective_or_shape() {
    // The agreement process ranks (MpiComm) use, run here over LocalComm's all-gather.
    let group = Group::Pipeline;
    let op = CommOp::Broadcast(group, 1);
    run_ranks(world(3, 1, Duration::from_secs(10)), |comm| {
        agree_by_all_gather(comm, group, op, &[70_000, 3])
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let err = run_ranks(world(3, 1, Duration::from_secs(10)), |comm| {
        let action = if comm.rank() == 2 {
            CommOp::Broadcast(group, 0)
        } else {
            op
        };
        agree_by_all_gather(comm, group, action, &[4])
    })
    .expect_err("different collectives must fail");
    assert!(err.to_string().contains("another collective"), "{err}");
    // Shapes differing only above 2^16 (the descriptor splits dimensions in halves).
    let err = run_ranks(world(2, 1, Duration::from_secs(10)), |comm| {
        let shape: &[usize] = if comm.rank() == 1 { &[65_537] } else { &[1] };
        agree_by_all_gather(comm, group, op, shape)
    })
    .expect_err("different shapes must fail");
    let text = err.to_string();
    assert!(text.contains("[65537]") && text.contains("[1]"), "{text}");
}

#[test]
fn group_setup_shares_rank_zeros_unique_id_when_the_gpus_are_distinct() {
    // pp 2 × dp 3: data-parallel groups {0, 2, 4} and {1, 3, 5}. Rank r "is on" GPU r, except
    // that in the second scenario ranks 1 and 3 share GPU 1.
    let made = AtomicUsize::new(0);
    let id_of = |rank: usize| -> [u8; NCCL_ID_BYTES] {
        std::array::from_fn(|i| ((i * 7 + rank * 31) % 256) as u8)
    };
    for shared in [false, true] {
        made.store(0, Ordering::SeqCst);
        let setups = run_ranks(world(2, 3, Duration::from_secs(10)), |comm| {
            let rank = comm.rank();
            let ordinal = if shared && rank == 3 { 1 } else { rank as i32 };
            setup_group(comm, Group::DataParallel, ordinal, || {
                made.fetch_add(1, Ordering::SeqCst);
                Ok(id_of(rank))
            })
        })
        .unwrap_or_else(|e| panic!("{e}"));
        for (rank, setup) in setups.iter().enumerate() {
            let members = [[0, 2, 4], [1, 3, 5]][rank % 2];
            let ordinals: Vec<i32> = members
                .iter()
                .map(|&r| if shared && r == 3 { 1 } else { r as i32 })
                .collect();
            assert_eq!(setup.ordinals, ordinals, "rank {rank}");
            let expected = if shared && rank % 2 == 1 {
                None
            } else {
                Some(id_of(members[0]))
            };
            assert_eq!(setup.unique_id, expected, "rank {rank}");
        }
        // One id per group that can be a communicator, made by its rank 0 alone.
        assert_eq!(made.load(Ordering::SeqCst), if shared { 1 } else { 2 });
    }
}
