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
    use super::transports::nccl_cannot_carry;
    // One replica per GPU, or a pipeline over distinct GPUs: NCCL carries it.
    assert!(threads_take_nccl(CommMode::Auto, grid(1, 4), 4, true));
    assert!(threads_take_nccl(CommMode::Auto, grid(2, 2), 4, true));
    assert!(threads_take_nccl(CommMode::Auto, grid(4, 1), 4, true));
    // dp 2 over 2 GPUs at pp 2: ranks 0,2 (dp group of stage 0) on GPUs 0,0 -> not distinct.
    let why = nccl_cannot_carry(grid(2, 2), 2).expect("a shared GPU in a dp group");
    assert!(
        why.contains("distinct GPUs") && why.contains("--gpus 2"),
        "{why}"
    );
    assert!(!threads_take_nccl(CommMode::Auto, grid(2, 2), 2, true));
    // Everything on one GPU, or one rank: nothing for NCCL to carry.
    assert!(!threads_take_nccl(CommMode::Auto, grid(4, 1), 1, true));
    assert!(nccl_cannot_carry(grid(4, 1), 1).is_some_and(|w| w.contains("one GPU")));
    assert!(!threads_take_nccl(CommMode::Auto, grid(1, 1), 1, true));
    // NCCL that does not load, or --comm local: host memory.
    assert!(!threads_take_nccl(CommMode::Auto, grid(1, 4), 4, false));
    assert!(!threads_take_nccl(CommMode::Local, grid(1, 4), 4, true));
    // --comm nccl always asks for it (its own checks name what does not fit).
    assert!(threads_take_nccl(CommMode::Nccl, grid(2, 2), 2, true));
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
