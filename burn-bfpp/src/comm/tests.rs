//! Functional tests of [`LocalComm`]: results of every operation against values computed
//! directly, on Burn's Flex backend.

use std::time::Duration;

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};

use super::*;

pub(super) type B = Flex;

/// A world whose calls give up after `timeout` (tests keep it short so failures are fast).
pub(super) fn world(pp: usize, dp: usize, timeout: Duration) -> Vec<LocalComm<B>> {
    let grid = RankGrid::new(pp, dp).unwrap();
    LocalComm::create(grid, CommConfig::with_timeout(timeout))
}

/// Runs `f` on every rank and panics with the root cause if any rank fails.
fn run<T: Send>(
    pp: usize,
    dp: usize,
    f: impl Fn(&LocalComm<B>) -> Result<T, CommError> + Sync,
) -> Vec<T> {
    match run_ranks(world(pp, dp, Duration::from_secs(10)), f) {
        Ok(values) => values,
        Err(e) => panic!("{e}"),
    }
}

pub(super) fn tensor1(values: Vec<f32>, device: &burn::backend::flex::FlexDevice) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

pub(super) fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// Rank `r`'s contribution: 8 distinct, exactly representable values.
fn contribution(rank: usize) -> Vec<f32> {
    (0..8).map(|i| (rank * 100 + i) as f32 * 0.5).collect()
}

#[test]
fn grid_layout_is_dp_major() {
    let grid = RankGrid::new(3, 2).unwrap();
    assert_eq!(grid.world_size(), 6);
    assert_eq!(grid.rank_of(2, 1), 5);
    assert_eq!((grid.pp_index(4), grid.dp_index(4)), (1, 1));
    assert_eq!(grid.group_members(4, Group::Pipeline), vec![3, 4, 5]);
    assert_eq!(grid.group_members(4, Group::DataParallel), vec![1, 4]);
    assert_eq!(grid.group_rank(4, Group::Pipeline), 1);
    assert_eq!(grid.group_rank(4, Group::DataParallel), 1);
    assert!(RankGrid::new(0, 2).is_err());
    let devices = vec![Default::default(); 5];
    assert!(LocalComm::<B>::create_with_devices(grid, devices, CommConfig::default()).is_err());
}

/// Sends a 3-D tensor and a 1-D one with two tags; the receiver takes them in the other
/// order. Returns what rank 1 received, flattened.
fn send_recv_3d_and_tags_out_of_order(comms: Vec<LocalComm<B>>) -> Vec<f32> {
    let shape = [2, 3, 4];
    let expected: Vec<f32> = (0..24).map(|i| i as f32 - 7.25).collect();
    let got = run_ranks(comms, |comm| -> Result<Vec<f32>, CommError> {
        let device = *comm.device();
        if comm.rank() == 0 {
            let t: Tensor<B, 3> = tensor1(expected.clone(), &device).reshape(shape);
            comm.send(1, 7, t)?;
            comm.send(1, 8, tensor1(vec![42.0], &device))?;
            Ok(Vec::new())
        } else {
            // Tag 8 first: a receive must skip the older message with another tag.
            let small = comm.recv::<1>(0, 8, [1], DType::F32)?;
            let big = comm.recv::<3>(0, 7, shape, DType::F32)?;
            assert_eq!(big.dims(), shape);
            let mut out = values(small);
            out.extend(values(big));
            Ok(out)
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got[1][0], 42.0);
    assert_eq!(got[1][1..], expected[..]);
    got[1].clone()
}

#[test]
fn send_recv_3d_tensor_and_tags_out_of_order() {
    let grid = RankGrid::new(2, 1).unwrap();
    // Both ranks on Flex's one device: tensors are handed over (the default) or, with the
    // handoff off, go through host memory; the receiver must see the same values.
    let handed = send_recv_3d_and_tags_out_of_order(LocalComm::create(grid, CommConfig::default()));
    let config = CommConfig {
        same_device_handoff: false,
        ..CommConfig::default()
    };
    let hosted = send_recv_3d_and_tags_out_of_order(LocalComm::create(grid, config));
    assert_eq!(handed, hosted);
}

/// The error rank 1's receive of a `[2, 3]` tensor as `want` ends with (every error is fatal
/// for the world, so one world per case).
fn handed_over_recv_error<const D: usize>(want: [usize; D]) -> String {
    let outcome = run_ranks(world(2, 1, Duration::from_secs(10)), |comm| {
        let device = *comm.device();
        if comm.rank() == 0 {
            comm.send(1, 1, tensor1(vec![1.0; 6], &device).reshape([2, 3]))
        } else {
            comm.recv::<D>(0, 1, want, DType::F32).map(|_| ())
        }
    });
    match outcome {
        Err(e) => e.to_string(),
        Ok(_) => panic!("receiving a [2, 3] tensor as {want:?} succeeded"),
    }
}

#[test]
fn handed_over_tensor_with_other_dimensions_or_shape_is_an_error() {
    let dims = handed_over_recv_error([6]);
    assert!(
        dims.contains("another number of dimensions than 1"),
        "{dims}"
    );
    let shape = handed_over_recv_error([3, 2]);
    assert!(
        shape.contains("[2, 3]") && shape.contains("[3, 2]"),
        "{shape}"
    );
}

#[test]
fn collectives_on_both_groups_of_a_2x2_grid() {
    let grid = RankGrid::new(2, 2).unwrap();
    let results = run(2, 2, |comm| {
        let device = *comm.device();
        let mine = || tensor1(contribution(comm.rank()), &device);
        let mut out = Vec::new();
        for group in [Group::Pipeline, Group::DataParallel] {
            out.push(values(comm.all_gather(group, mine())?));
            out.push(values(comm.reduce_scatter(group, mine(), ReduceOp::Sum)?));
            out.push(values(comm.reduce_scatter(
                group,
                mine(),
                ReduceOp::Mean,
            )?));
            let m2: Tensor<B, 2> = mine().reshape([2, 4]);
            let sum = comm.all_reduce(group, m2, ReduceOp::Sum)?;
            assert_eq!(sum.dims(), [2, 4]);
            out.push(values(sum));
            out.push(values(comm.all_reduce(group, mine(), ReduceOp::Mean)?));
            out.push(values(comm.broadcast(group, 1, mine())?));
            comm.barrier(group)?;
        }
        Ok(out)
    });
    for (rank, got) in results.iter().enumerate() {
        let mut k = 0;
        for group in [Group::Pipeline, Group::DataParallel] {
            let members = grid.group_members(rank, group);
            let parts: Vec<Vec<f32>> = members.iter().map(|&m| contribution(m)).collect();
            let n = members.len() as f32;
            let sum: Vec<f32> = (0..8)
                .map(|i| parts.iter().fold(0.0f32, |acc, p| acc + p[i]))
                .collect();
            let mean: Vec<f32> = sum.iter().map(|s| s / n).collect();
            let me = grid.group_rank(rank, group);
            let chunk = 8 / members.len();
            let mine = me * chunk..(me + 1) * chunk;
            assert_eq!(got[k], parts.concat(), "all-gather, rank {rank}, {group}");
            assert_eq!(
                got[k + 1],
                sum[mine.clone()],
                "reduce-scatter sum, rank {rank}"
            );
            assert_eq!(got[k + 2], mean[mine], "reduce-scatter mean, rank {rank}");
            assert_eq!(got[k + 3], sum, "all-reduce sum, rank {rank}, {group}");
            assert_eq!(got[k + 4], mean, "all-reduce mean, rank {rank}, {group}");
            assert_eq!(got[k + 5], parts[1], "broadcast, rank {rank}, {group}");
            k += 6;
        }
    }
}

#[test]
fn collectives_interleave_with_pipeline_transfers() {
    // Rank 0 sends before the barrier, rank 1 receives after it: the transfer must be parked,
    // not mistaken for the barrier's message.
    let got = run(2, 1, |comm| {
        let device = *comm.device();
        if comm.rank() == 0 {
            comm.send(1, 0, tensor1(vec![1.0, 2.0], &device))?;
            comm.barrier(Group::Pipeline)?;
            Ok(vec![])
        } else {
            comm.barrier(Group::Pipeline)?;
            Ok(values(comm.recv::<1>(0, 0, [2], DType::F32)?))
        }
    });
    assert_eq!(got[1], vec![1.0, 2.0]);
}

#[test]
fn reductions_are_bitwise_identical_on_all_ranks_and_runs() {
    // Values with many significant bits, so any change of summation order shows.
    let contrib = |rank: usize| -> Vec<f32> {
        (0..64)
            .map(|i| ((rank * 64 + i) as f32 * 0.7311).sin() * 10f32.powi((i % 7) as i32 - 3))
            .collect()
    };
    let once = || {
        run(1, 4, |comm| {
            let device = *comm.device();
            let t = || tensor1(contrib(comm.rank()), &device);
            let all = values(comm.all_reduce(Group::DataParallel, t(), ReduceOp::Mean)?);
            let shard = comm.reduce_scatter(Group::DataParallel, t(), ReduceOp::Mean)?;
            let regathered = values(comm.all_gather(Group::DataParallel, shard)?);
            Ok((all, regathered))
        })
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let first = once();
    let second = once();
    let expected: Vec<f32> = (0..64)
        .map(|i| {
            let s = ((contrib(0)[i] + contrib(1)[i]) + contrib(2)[i]) + contrib(3)[i];
            s / 4.0
        })
        .collect();
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(
            bits(&a.0),
            bits(&expected),
            "all-reduce differs from the ordered sum"
        );
        assert_eq!(
            bits(&a.1),
            bits(&expected),
            "reduce-scatter + all-gather differs"
        );
        assert_eq!(bits(&a.0), bits(&b.0), "runs differ");
    }
}

#[test]
fn single_member_groups_return_the_input() {
    let got = run(1, 1, |comm| {
        let device = *comm.device();
        let t = || tensor1(vec![1.0, 3.0], &device);
        let mut out = values(comm.all_reduce(Group::Pipeline, t(), ReduceOp::Mean)?);
        out.extend(values(comm.all_gather(Group::DataParallel, t())?));
        out.extend(values(comm.reduce_scatter(
            Group::Pipeline,
            t(),
            ReduceOp::Sum,
        )?));
        out.extend(values(comm.broadcast(Group::DataParallel, 0, t())?));
        comm.barrier(Group::Pipeline)?;
        comm.send(0, 3, t())?;
        out.extend(values(comm.recv::<1>(0, 3, [2], DType::F32)?));
        Ok(out)
    });
    assert_eq!(got[0], [1.0, 3.0].repeat(5));
}
