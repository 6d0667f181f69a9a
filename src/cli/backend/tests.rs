use super::*;

fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[test]
fn gpu_processes_under_mpirun_are_refused_naming_the_launchers() {
    let mpirun = [("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4")];
    let refusal = gpu_processes_without_rank_variables(env(&mpirun)).expect("refused");
    assert!(refusal.contains("rank 2 of 4"), "{refusal}");
    for launcher in ["bfpp launch --nproc 4", "torchrun", "srun"] {
        assert!(refusal.contains(launcher), "{refusal}");
    }
    let pmix = [("PMIX_RANK", "0"), ("PMIX_SIZE", "8")];
    assert!(gpu_processes_without_rank_variables(env(&pmix)).is_some());
}

#[test]
fn a_single_process_or_no_launcher_is_not_refused() {
    let alone = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")];
    assert!(gpu_processes_without_rank_variables(env(&alone)).is_none());
    assert!(gpu_processes_without_rank_variables(env(&[])).is_none());
    let garbled = [("PMI_RANK", "x"), ("PMI_SIZE", "4")];
    assert!(gpu_processes_without_rank_variables(env(&garbled)).is_none());
}

fn grid(pp: usize, dp: usize) -> RankGrid {
    RankGrid::new(pp, dp).expect("a valid grid")
}

#[test]
fn auto_takes_nccl_for_cuda_threads_wherever_it_can_carry_the_traffic() {
    let take = |comm, grid, gpus, loads: bool| {
        let loads = if loads {
            Ok(())
        } else {
            Err("libnccl.so not found".to_string())
        };
        threads_take_nccl(comm, grid, gpus, loads)
    };
    // One replica per GPU, or a pipeline over distinct GPUs: NCCL carries it.
    assert_eq!(take(CommMode::Auto, grid(1, 4), 4, true), Ok(()));
    assert_eq!(take(CommMode::Auto, grid(2, 2), 4, true), Ok(()));
    assert_eq!(take(CommMode::Auto, grid(4, 1), 4, true), Ok(()));
    // dp 2 over 2 GPUs at pp 2: ranks 0,2 (dp group of stage 0) on GPUs 0,0 -> not distinct.
    let why = take(CommMode::Auto, grid(2, 2), 2, true).expect_err("a shared GPU in a dp group");
    let why = why.expect("auto says why");
    assert!(
        why.starts_with("NCCL not used")
            && why.contains("distinct GPUs")
            && why.contains("--gpus 2"),
        "{why}"
    );
    // Everything on one GPU, or one rank: nothing for NCCL to carry.
    let one_gpu = take(CommMode::Auto, grid(4, 1), 1, true).expect_err("one GPU");
    assert!(one_gpu.is_some_and(|w| w.contains("one GPU")));
    assert!(take(CommMode::Auto, grid(1, 1), 1, true).is_err());
    // NCCL that does not load: host memory, saying why.
    let missing = take(CommMode::Auto, grid(1, 4), 4, false).expect_err("no NCCL");
    assert!(missing.is_some_and(|w| w.contains("libnccl.so")));
    // --comm local is the user's choice (no note); --comm nccl always asks for NCCL (its
    // own checks name what does not fit).
    assert_eq!(take(CommMode::Local, grid(1, 4), 4, true), Err(None));
    assert_eq!(take(CommMode::Nccl, grid(2, 2), 2, false), Ok(()));
}

#[test]
fn transports_name_each_kind_of_traffic() {
    use super::transports::{nccl_thread_transports, THROUGH_HOST};
    let all = nccl_thread_transports(grid(2, 2), 4).text();
    assert_eq!(
        all,
        "pipeline: NCCL (point to point, device buffers); data parallel: NCCL (device buffers)"
    );
    // pp 4 over 2 GPUs: each pipeline's stages share GPUs, so tensors are handed over.
    let shared = nccl_thread_transports(grid(4, 1), 2);
    assert!(shared.pipeline.contains("handed over"), "{shared:?}");
    assert_eq!(shared.data_parallel, "none (dp 1)");
    // pp 2 × dp 2 over 3 GPUs: replica 0's pipeline on GPUs 0,1, replica 1's on 2,0.
    let spread = nccl_thread_transports(grid(2, 2), 3);
    assert!(spread.pipeline.starts_with("NCCL"), "{spread:?}");
    let host = Transports::new(grid(1, 2), "x", THROUGH_HOST)
        .with_detail(Some("NCCL not used: why".into()))
        .text();
    assert_eq!(
        host,
        format!("pipeline: none (pp 1); data parallel: {THROUGH_HOST} (NCCL not used: why)")
    );
}
