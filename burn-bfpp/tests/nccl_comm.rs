//! `NcclComm` on real GPUs: its data-parallel collectives against values computed on the host.
//! Needs an NVIDIA GPU and NCCL, so it is ignored by default; `scripts/gpu-run.sh` trains with
//! it end to end (`gpu_run --comm nccl`). The composition of all-gather, reduce-scatter and
//! broadcast from the all-reduce is tested on the CPU (`comm::tests_by_all_reduce`, against
//! `LocalComm`'s direct collectives), and so is the call agreement before each NCCL call.
#![cfg(feature = "cuda")]

use std::time::Duration;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Tensor, TensorData};
use burn_bfpp::comm::{
    run_ranks, CommConfig, CommError, Communicator, CudaBackend, Group, NcclComm, RankGrid,
    ReduceOp,
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

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn nccl_collectives_match_host_values_on_every_gpu() {
    let gpus = cudarc::driver::CudaContext::device_count().expect("CUDA driver") as usize;
    assert!(gpus >= 1, "no CUDA device");
    // One replica per GPU (a group of one on a single-GPU machine), two pipeline ranks each:
    // pipeline rank r of replica d runs on GPU d.
    let (pp, dp) = (2, gpus);
    // Divisible by the group size, for the reduce-scatter.
    let len = 12 * dp;
    let grid = RankGrid::new(pp, dp).expect("grid");
    let devices = (0..pp * dp)
        .map(|r| CudaDevice::new(grid.dp_index(r)))
        .collect();
    let config = CommConfig::with_timeout(Duration::from_secs(120));
    let comms = NcclComm::<f32, i32, u8>::create(grid, devices, config).expect("NCCL world");
    let results = run_ranks(comms, |comm| {
        let device = comm.device().clone();
        let t = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<B, 1>::from_data(TensorData::new(v, [n]), &device)
        };
        let read = |x: Tensor<B, 1>| x.into_data().to_vec::<f32>().expect("f32");
        let mine = contribution(comm.rank(), len);
        let g = Group::DataParallel;
        let mut out = vec![
            read(comm.all_reduce(g, t(mine.clone()), ReduceOp::Sum)?),
            read(comm.all_reduce(g, t(mine.clone()), ReduceOp::Mean)?),
            read(comm.reduce_scatter(g, t(mine.clone()), ReduceOp::Sum)?),
            read(comm.all_gather(g, t(mine[..4].to_vec()))?),
            read(comm.broadcast(g, dp - 1, t(mine.clone()))?),
        ];
        // The pipeline group stays on the host path.
        out.push(read(comm.all_reduce(
            Group::Pipeline,
            t(mine),
            ReduceOp::Sum,
        )?));
        comm.barrier(g)?;
        Ok::<_, CommError>(out)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, got) in results.iter().enumerate() {
        let members = grid.group_members(rank, Group::DataParallel);
        let parts: Vec<Vec<f32>> = members.iter().map(|&m| contribution(m, len)).collect();
        let sum: Vec<f32> = (0..len).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
        let mean: Vec<f32> = sum.iter().map(|s| s / dp as f32).collect();
        let me = grid.dp_index(rank);
        let chunk = len / dp;
        let gathered: Vec<f32> = parts.iter().flat_map(|p| p[..4].to_vec()).collect();
        let pipe: Vec<f32> = (0..len)
            .map(|i| {
                grid.group_members(rank, Group::Pipeline)
                    .iter()
                    .map(|&m| contribution(m, len)[i])
                    .sum()
            })
            .collect();
        close(
            "reduce-scatter",
            &got[2],
            &sum[me * chunk..(me + 1) * chunk],
        );
        close("all-reduce sum", &got[0], &sum);
        close("all-reduce mean", &got[1], &mean);
        close("all-gather", &got[3], &gathered);
        close("broadcast", &got[4], &parts[dp - 1]);
        close("pipeline all-reduce", &got[5], &pipe);
    }
}
