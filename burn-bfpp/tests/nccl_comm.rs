//! `NcclComm` on real GPUs: every collective of a group on NCCL against values computed on
//! the host, collectives started and finished later (compute and another communicator's call
//! in between), and pipeline transfers between GPUs (peer copies) and on one GPU (handoffs).
//! Needs an NVIDIA GPU and NCCL, so it is ignored by default;
//! `scripts/gpu-run.sh` runs it and trains with it end to end (`bfpp train --comm nccl`). The
//! CPU tests of the same logic are `comm::tests_nccl_checks` (the call agreement before each
//! NCCL call, which groups can be communicators), `comm::launched` (the bookkeeping of calls
//! in flight), `comm::tests_pending` and `LocalComm`'s collective tests (the values every
//! communicator must produce).
// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
#![cfg(feature = "cuda")]

use std::time::Duration;

use burn::backend::cuda::CudaDevice;
use burn::tensor::DType;
use burn::tensor::{Tensor, TensorData};
use burn_bfpp::comm::{
    run_ranks, Collective, CommConfig, CommError, Communicator, CudaBackend, Group, NcclComm,
    RankGrid, ReduceOp,
};

type B = CudaBackend<f32, i32, u8>;

/// Rank `r`'s contribution: `len` values, not all exactly representable.
fn contribution(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (rank as f32 + 1.0) * 0.1 - i as f32 * 0.37)
        .collect()
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

fn gpus() -> usize {
    let n = cudarc::driver::CudaContext::device_count().expect("CUDA driver") as usize;
    assert!(n >= 1, "no CUDA device");
    n
}

/// A 2-D shape whose rows (132 bytes in f32) Burn pads on CUDA.
const ROWS: [usize; 2] = [3, 33];

/// Runs all-reduce (sum, mean), reduce-scatter, all-gather and broadcast (and all-reduce and
/// broadcast of a [`ROWS`] tensor) over `group` on a world with rank `r` on GPU `gpu_of(r)`,
/// checks `group` is on NCCL exactly when `expect_nccl`, and compares every result with the
/// host computation.
fn check_group(grid: RankGrid, gpu_of: impl Fn(usize) -> usize, group: Group, expect_nccl: bool) {
    let size = grid.group_size(group);
    // Divisible by the group size, for the reduce-scatter.
    let len = 12 * size;
    let devices = (0..grid.world_size())
        .map(|r| CudaDevice::new(gpu_of(r)))
        .collect();
    let config = CommConfig::with_timeout(Duration::from_secs(120));
    let comms = NcclComm::<f32, i32, u8>::create(grid, devices, config).expect("NCCL world");
    let results = run_ranks(comms, |comm| {
        assert_eq!(comm.on_nccl(group), expect_nccl, "{group} on NCCL");
        let device = comm.device().clone();
        let t = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<B, 1>::from_data(TensorData::new(v, [n]), &device)
        };
        let read = |x: Tensor<B, 1>| x.into_data().to_vec::<f32>().expect("f32");
        // Rows of 33 f32 (132 bytes), which Burn's default CUDA allocation pads to 256: an
        // output buffer that is not compact reads back wrong here.
        let t2 = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, ROWS), &device);
        let read2 = |x: Tensor<B, 2>| x.into_data().to_vec::<f32>().expect("f32");
        let mine = contribution(comm.rank(), len);
        let mine2 = contribution(comm.rank(), ROWS[0] * ROWS[1]);
        let out = vec![
            read(comm.all_reduce(group, t(mine.clone()), ReduceOp::Sum)?),
            read(comm.all_reduce(group, t(mine.clone()), ReduceOp::Mean)?),
            read(comm.reduce_scatter(group, t(mine.clone()), ReduceOp::Sum)?),
            read(comm.all_gather(group, t(mine[..4].to_vec()))?),
            read(comm.broadcast(group, size - 1, t(mine))?),
            read2(comm.all_reduce(group, t2(mine2.clone()), ReduceOp::Sum)?),
            read2(comm.broadcast(group, size - 1, t2(mine2))?),
        ];
        comm.barrier(group)?;
        Ok::<_, CommError>(out)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, got) in results.iter().enumerate() {
        let members = grid.group_members(rank, group);
        let parts: Vec<Vec<f32>> = members.iter().map(|&m| contribution(m, len)).collect();
        let sum: Vec<f32> = (0..len).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
        let mean: Vec<f32> = sum.iter().map(|s| s / size as f32).collect();
        let me = grid.group_rank(rank, group);
        let chunk = len / size;
        let gathered: Vec<f32> = parts.iter().flat_map(|p| p[..4].to_vec()).collect();
        let what = |op: &str| format!("rank {rank} {group} {op}");
        close(&what("all-reduce sum"), &got[0], &sum);
        close(&what("all-reduce mean"), &got[1], &mean);
        close(
            &what("reduce-scatter"),
            &got[2],
            &sum[me * chunk..(me + 1) * chunk],
        );
        close(&what("all-gather"), &got[3], &gathered);
        close(&what("broadcast"), &got[4], &parts[size - 1]);
        let parts2: Vec<Vec<f32>> = members
            .iter()
            .map(|&m| contribution(m, ROWS[0] * ROWS[1]))
            .collect();
        let sum2: Vec<f32> = (0..ROWS[0] * ROWS[1])
            .map(|i| parts2.iter().map(|p| p[i]).sum())
            .collect();
        close(&what("all-reduce sum of [3, 33]"), &got[5], &sum2);
        close(&what("broadcast of [3, 33]"), &got[6], &parts2[size - 1]);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn data_parallel_collectives_on_nccl_match_host_values() {
    let dp = gpus();
    // One replica per GPU (a group of one on a single-GPU machine), two pipeline ranks each
    // on its replica's GPU: the data-parallel groups are NCCL communicators, the pipeline
    // groups (two ranks on one GPU) stay on the host path.
    let grid = RankGrid::new(2, dp).expect("grid");
    check_group(grid, |r| grid.dp_index(r), Group::DataParallel, true);
    check_group(grid, |r| grid.dp_index(r), Group::Pipeline, false);
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn pipeline_collectives_on_nccl_match_host_values() {
    let pp = gpus();
    // One pipeline rank per GPU: the pipeline group is an NCCL communicator (of one member
    // on a single-GPU machine).
    let grid = RankGrid::new(pp, 1).expect("grid");
    check_group(grid, |r| grid.pp_index(r), Group::Pipeline, true);
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn pipeline_transfers_between_gpus_arrive_intact() {
    let gpus = gpus();
    // One pipeline rank per GPU, two of them per GPU when there is only one: each rank sends
    // to the next (a ring, so every rank sends before it receives, the pattern of the looped
    // placement's wrap) a tensor on its own GPU; the receiver gets it on its GPU.
    let pp = gpus.max(2);
    let grid = RankGrid::new(pp, 1).expect("grid");
    let devices = (0..pp).map(|r| CudaDevice::new(r % gpus)).collect();
    let config = CommConfig::with_timeout(Duration::from_secs(120));
    let comms = NcclComm::<f32, i32, u8>::create(grid, devices, config).expect("NCCL world");
    // Rows of 33 f32 (132 bytes), which Burn pads on CUDA: a copy into a padded buffer
    // would arrive scrambled.
    let len = 330;
    let results = run_ranks(comms, |comm| {
        let device = comm.device().clone();
        let next = (comm.rank() + 1) % pp;
        let prev = (comm.rank() + pp - 1) % pp;
        let mine = contribution(comm.rank(), len);
        let t = Tensor::<B, 2>::from_data(TensorData::new(mine, [10, len / 10]), &device);
        comm.send(next, 7, t * 2.0)?;
        let got = comm.recv::<2>(prev, 7, [10, len / 10], DType::F32)?;
        assert_eq!(got.device(), device, "received on another device");
        Ok::<_, CommError>(got.into_data().to_vec::<f32>().expect("f32"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, got) in results.iter().enumerate() {
        let want: Vec<f32> = contribution((rank + pp - 1) % pp, len)
            .iter()
            .map(|v| v * 2.0)
            .collect();
        close(&format!("rank {rank} received"), got, &want);
    }
}

/// One data-parallel replica per GPU, one pipeline rank each, so both groups are NCCL
/// communicators (of one member on a single-GPU machine).
fn overlap_world() -> (RankGrid, Vec<NcclComm<f32, i32, u8>>) {
    let dp = gpus();
    let grid = RankGrid::new(1, dp).expect("grid");
    let devices = (0..dp).map(CudaDevice::new).collect();
    // Overlap is the default; said here because this test is about it.
    let config = CommConfig {
        overlap_collectives: true,
        ..CommConfig::with_timeout(Duration::from_secs(120))
    };
    let comms = NcclComm::<f32, i32, u8>::create(grid, devices, config).expect("NCCL world");
    (grid, comms)
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn started_collectives_stay_in_flight_across_compute_and_match_host_values() {
    let (grid, comms) = overlap_world();
    let size = grid.dp();
    let len = 12 * size;
    let results = run_ranks(comms, |comm| {
        assert!(comm.on_nccl(Group::DataParallel) && comm.on_nccl(Group::Pipeline));
        let device = comm.device().clone();
        let t = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<B, 1>::from_data(TensorData::new(v, [n]), &device)
        };
        let read = |x: Tensor<B, 1>| x.into_data().to_vec::<f32>().expect("f32");
        let mine = contribution(comm.rank(), len);
        let group = Group::DataParallel;
        let scattered = comm.start(Collective::ReduceScatter {
            group,
            tensor: t(mine.clone()),
            op: ReduceOp::Sum,
        })?;
        let gathered = comm.start(Collective::AllGather {
            group,
            shard: t(mine[..4].to_vec()),
        })?;
        assert!(
            scattered.in_flight() && gathered.in_flight(),
            "not left in flight"
        );
        // Compute on the rank's stream while the calls may still run...
        let x = Tensor::<B, 2>::ones([256, 256], &device);
        let product = x.clone().matmul(x).sum();
        // ...and a blocking call on the other communicator, which waits for them first.
        let piped = read(comm.all_reduce(Group::Pipeline, t(mine.clone()), ReduceOp::Sum)?);
        let scattered = read(comm.finish(scattered)?);
        let gathered = read(comm.finish(gathered)?);
        let product = product.into_data().to_vec::<f32>().expect("f32")[0];
        Ok::<_, CommError>((scattered, gathered, piped, product))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, (scattered, gathered, piped, product)) in results.iter().enumerate() {
        let members = grid.group_members(rank, Group::DataParallel);
        let parts: Vec<Vec<f32>> = members.iter().map(|&m| contribution(m, len)).collect();
        let sum: Vec<f32> = (0..len).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
        let chunk = len / size;
        let me = grid.group_rank(rank, Group::DataParallel);
        let want_gathered: Vec<f32> = parts.iter().flat_map(|p| p[..4].to_vec()).collect();
        close(
            &format!("rank {rank} started reduce-scatter"),
            scattered,
            &sum[me * chunk..(me + 1) * chunk],
        );
        close(
            &format!("rank {rank} started all-gather"),
            gathered,
            &want_gathered,
        );
        // The pipeline group has one member: its sum is the rank's own contribution.
        close(
            &format!("rank {rank} pipeline all-reduce"),
            piped,
            &contribution(rank, len),
        );
        assert_eq!(
            *product,
            256.0f32.powi(3),
            "rank {rank}: the compute in between"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn started_collectives_finished_out_of_order_are_refused_and_released() {
    let (_grid, comms) = overlap_world();
    let err = run_ranks(comms, |comm| {
        let device = comm.device().clone();
        let shard = |v: f32| Tensor::<B, 1>::from_data(TensorData::new(vec![v], [1]), &device);
        let group = Group::DataParallel;
        let first = comm.start(Collective::AllGather {
            group,
            shard: shard(1.0),
        })?;
        let second = comm.start(Collective::AllGather {
            group,
            shard: shard(2.0),
        })?;
        let late = comm.finish(second)?;
        // Not reached: the first stays in flight, and dropping the communicator with it
        // (the error path) must abort the call, not hang or crash.
        let early = comm.finish(first)?;
        Ok::<_, CommError>((early.into_data(), late.into_data()))
    })
    .expect_err("finished out of order");
    assert!(err.to_string().contains("order they started"), "{err}");
}
