//! Ranks as separate MPI processes (`mpirun -np 4`; feature `mpi`, the transport of CPU
//! processes): P=2, D=2, breadth-first and interleaved at ZeRO 1 and 3 and the split-backward
//! schedules (ZB-H1 at ZeRO 0, interleaved and breadth-first zero-bubble and ZB-V at ZeRO 3),
//! and a four-stage pipeline (P=4, D=1) of the four split-backward schedules. Three AdamW
//! steps must give the losses and final parameters of plain single-device Burn training within 1e-5
//! and bitwise those of the in-process run, and every rank's bytes sent must be the
//! simulator's formulas (as for threads); a failing rank must stop every process with an
//! error naming it. The rank processes also run the NCCL start-up exchange over their
//! communicator (GPUs per group, unique id), as `NcclComm::over_host` does.
//!
//! The tests start this test binary itself under `mpirun`, filtered to the ignored test
//! [`rank_process`], which reads its case from the environment. They need `mpirun` on PATH
//! (Debian/Ubuntu: `apt-get install openmpi-bin libopenmpi-dev`); without it they fail with
//! that hint instead of being skipped.
#![cfg(feature = "mpi")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use burn_bfpp::comm::testing::{agree_by_all_gather, setup_group, NCCL_ID_BYTES};
use burn_bfpp::comm::CommBytes;
use burn_bfpp::comm::{
    CommConfig, CommOp, Communicator, Group, ProcessComm, RankGrid, ReduceOp, Transport,
};
use burn_bfpp::engine::{infallible, Fault, FaultKind, TrainConfig, Trainer};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::bounded::{output_text, outputs_within, LAUNCH_DEADLINE};
use common::*;

/// The layouts run by the rank processes, in this order in every process.
const CASES: [(ScheduleKind, ZeroLevel); 9] = [
    (ScheduleKind::BreadthFirst, ZeroLevel::Zero1),
    (ScheduleKind::BreadthFirst, ZeroLevel::Zero3),
    (ScheduleKind::Interleaved, ZeroLevel::Zero1),
    (ScheduleKind::Interleaved, ZeroLevel::Zero3),
    // Split backwards (I/W) across processes.
    (ScheduleKind::ZeroBubbleH1, ZeroLevel::Zero0),
    (ScheduleKind::InterleavedZeroBubble, ZeroLevel::Zero3),
    (ScheduleKind::BreadthFirstZeroBubble, ZeroLevel::Zero3),
    (ScheduleKind::ZeroBubbleV, ZeroLevel::Zero3),
    // Overlapped forward/backward pairs.
    (ScheduleKind::DualPipeV, ZeroLevel::Zero3),
];

/// The split-backward layouts of a four-stage pipeline of four processes (P=4, D=1).
const CASES_PP4: [(ScheduleKind, ZeroLevel); 6] = [
    (ScheduleKind::ZeroBubbleH1, ZeroLevel::Zero0),
    (ScheduleKind::InterleavedZeroBubble, ZeroLevel::Zero0),
    (ScheduleKind::BreadthFirstZeroBubble, ZeroLevel::Zero3),
    (ScheduleKind::ZeroBubbleV, ZeroLevel::Zero3),
    (ScheduleKind::DualPipeV, ZeroLevel::Zero0),
    (ScheduleKind::DualPipeV, ZeroLevel::Zero3),
];

/// The pipeline size P of the rank processes' world of four (D = 4 / P); unset: 2.
const PP_ENV: &str = "BFPP_TEST_RANKS_PP";

/// The cases a world of four processes with pipeline size `pp` runs.
fn cases(pp: usize) -> &'static [(ScheduleKind, ZeroLevel)] {
    if pp == 4 {
        &CASES_PP4
    } else {
        &CASES
    }
}

/// Where a rank process writes its results (rank 0) — set by the parent test.
const OUT_ENV: &str = "BFPP_TEST_RANKS_OUT";
/// `rank=R,step=S`: the fault the rank processes inject (the fault test).
const FAULT_ENV: &str = "BFPP_TEST_RANKS_FAULT";

fn ranks_config(pp: usize, kind: ScheduleKind, zero: ZeroLevel) -> TrainConfig {
    config(kind, pp, kind.family().default_loops, 4 / pp, zero)
}

/// One line per case: the losses and every parameter value as bits, and every rank's bytes
/// sent in the last step (`data_parallel:pipeline`).
fn encode(losses: &[f64], params: &[Vec<f32>], bytes: &[CommBytes]) -> String {
    let l: Vec<String> = losses.iter().map(|x| x.to_bits().to_string()).collect();
    let p: Vec<String> = params
        .iter()
        .flatten()
        .map(|x| x.to_bits().to_string())
        .collect();
    let b: Vec<String> = bytes
        .iter()
        .map(|b| format!("{}:{}", b.data_parallel, b.pipeline))
        .collect();
    format!("{};{};{}", l.join(","), p.join(","), b.join(","))
}

/// The inner backend the rank processes communicate on.
type Inner = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;

/// One rank of a world of MPI processes; only meaningful when started by the tests below.
#[test]
#[ignore = "a rank process of the process_ranks tests, which start it"]
fn rank_process() {
    let out = std::env::var(OUT_ENV)
        .unwrap_or_else(|_| panic!("{OUT_ENV} is not set: this test is started by the others"));
    let fault = std::env::var(FAULT_ENV).ok().map(|text| {
        let nums: Vec<usize> = text
            .split(',')
            .map(|n| n.parse().expect("number"))
            .collect();
        Fault {
            rank: nums[0],
            step: nums[1],
            kind: FaultKind::Error,
        }
    });
    let pp: usize = std::env::var(PP_ENV).map_or(2, |v| v.parse().expect("a pipeline size"));
    let grid = RankGrid::new(pp, 4 / pp).expect("grid");
    let timeout = if fault.is_some() { 10 } else { 60 };
    let config = CommConfig::with_timeout(Duration::from_secs(timeout));
    let comm = burn_bfpp::comm::MpiComm::<Inner>::init(grid, Default::default(), config)
        .unwrap_or_else(|e| panic!("{e}"));
    run_cases(&comm, fault, &out);
}

/// Trains every case on this process's rank; rank 0 writes the results to `out`.
fn run_cases<T: Transport>(comm: &ProcessComm<Inner, T>, fault: Option<Fault>, out: &str) {
    let base = model();
    let mut lines = Vec::new();
    let pp = comm.grid().pp();
    for &(kind, zero) in cases(pp) {
        let config = ranks_config(pp, kind, zero);
        let microbatches = config.microbatches;
        let mut trainer = Trainer::new(config).in_process(comm);
        if let Some(fault) = fault {
            trainer = trainer.inject_fault(fault);
        }
        let outcome = trainer
            .fit(base.clone(), infallible(batch_of(microbatches)))
            .unwrap_or_else(|e| panic!("{e}"));
        if let Some(o) = outcome {
            let bytes: Vec<CommBytes> = o.last_step.iter().map(|c| c.comm_bytes).collect();
            lines.push(encode(&o.losses, &params(&o.model), &bytes));
        }
    }
    nccl_start_up(comm, comm.grid());
    if !lines.is_empty() {
        std::fs::write(out, lines.join("\n")).expect("results are writable");
    }
}

/// The start-up exchange and call agreement `NcclComm::over_host` runs over the host
/// communicator of process ranks (the NCCL calls themselves need GPUs): every process checks
/// what it received and panics otherwise, which fails the launch of the test.
fn nccl_start_up<C: Communicator<Inner>>(comm: &C, grid: RankGrid) {
    let rank = comm.rank();
    let id_of = |r: usize| -> [u8; NCCL_ID_BYTES] {
        std::array::from_fn(|i| ((i * 5 + r * 17) % 256) as u8)
    };
    // Every process "on its own GPU": the data-parallel group gets rank 0's id.
    let dp = setup_group(comm, Group::DataParallel, rank as i32, || Ok(id_of(rank)))
        .unwrap_or_else(|e| panic!("{e}"));
    let members = grid.group_members(rank, Group::DataParallel);
    let ordinals: Vec<i32> = members.iter().map(|&m| m as i32).collect();
    assert_eq!(dp.ordinals, ordinals, "rank {rank}");
    assert_eq!(dp.unique_id, Some(id_of(members[0])), "rank {rank}");
    // Pipeline stages "on one GPU": no communicator, and no id made.
    let pp = setup_group(comm, Group::Pipeline, 0, || {
        panic!("rank {rank}: an id was made for a group sharing a GPU")
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (pp.ordinals, pp.unique_id),
        (vec![0; grid.pp()], None),
        "rank {rank}"
    );
    let action = CommOp::AllReduce(Group::DataParallel, ReduceOp::Sum);
    agree_by_all_gather(comm, Group::DataParallel, action, &[3, 70_000])
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The arguments that make this test binary run [`rank_process`] only.
const RANK_PROCESS: [&str; 6] = [
    "--exact",
    "rank_process",
    "--ignored",
    "--nocapture",
    "--test-threads",
    "1",
];

/// Runs `np` rank processes of this binary under `mpirun` with `env`; returns whether all
/// succeeded, their output, and how long they ran.
fn launch(np: usize, env: &[(&str, &str)]) -> (bool, String, Duration) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new("mpirun");
    // Unbound, as the in-process run is: the ranks share the cores with each other.
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
    ])
    .arg(np.to_string());
    for (k, v) in env {
        cmd.env(k, v).arg("-x").arg(k);
    }
    cmd.arg(&exe).args(RANK_PROCESS);
    let launched = outputs_within(vec![cmd], LAUNCH_DEADLINE);
    (
        launched.outputs.iter().all(|o| o.status.success()),
        launched.outputs.iter().map(output_text).collect(),
        launched.took,
    )
}

fn out_file(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bfpp-ranks-{}-{name}.txt", std::process::id()))
}

fn read_results(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("rank 0 wrote no results to {}: {e}", path.display()))
        .lines()
        .map(str::to_string)
        .collect()
}

fn decode(line: &str) -> (Vec<f64>, Vec<f32>, Vec<CommBytes>) {
    let (line, b) = line.rsplit_once(';').expect("losses;params;bytes");
    let (l, p) = line.split_once(';').expect("losses;params");
    let bytes = b
        .split(',')
        .map(|r| {
            let (dp, pp) = r.split_once(':').expect("dp:pp");
            CommBytes {
                data_parallel: dp.parse().expect("a count"),
                pipeline: pp.parse().expect("a count"),
            }
        })
        .collect();
    let losses = l
        .split(',')
        .map(|x| f64::from_bits(x.parse().expect("bits")))
        .collect();
    let params = p
        .split(',')
        .map(|x| f32::from_bits(x.parse().expect("bits")))
        .collect();
    (losses, params, bytes)
}

/// Four MPI rank processes (P=2, D=2) match plain Burn and the in-process run, and send the
/// bytes the simulator's formulas predict.
#[test]
fn four_mpi_processes_match_single_device_burn_and_the_in_process_run() {
    check_world(2);
}

/// The same for a four-stage pipeline of four processes (P=4, D=1), split backwards only.
#[test]
fn a_four_process_pipeline_with_split_backwards_matches_single_device_burn() {
    check_world(4);
}

/// Runs [`cases`]`(pp)` on four MPI processes with pipeline size `pp` and checks each
/// against plain Burn, the in-process run and the simulator's bytes.
fn check_world(pp: usize) {
    let name = "mpi";
    let out = out_file(&format!("{name}-equivalence-pp{pp}"));
    let pp_text = pp.to_string();
    let env = [
        (OUT_ENV, out.to_str().expect("utf-8 temp path")),
        (PP_ENV, pp_text.as_str()),
    ];
    let (ok, log, took) = launch(4, &env);
    assert!(ok, "{log}\n^ the {name} launch failed (pp {pp})");
    let lines = read_results(&out);
    let _ = std::fs::remove_file(&out);
    let cases = cases(pp);
    assert_eq!(lines.len(), cases.len(), "one result per case:\n{log}");
    eprintln!(
        "{} layouts over {name} (pp {pp}) in {took:.1?}",
        cases.len()
    );

    let base = model();
    for (&(kind, zero), line) in cases.iter().zip(&lines) {
        let (want_losses, want_params) =
            reference_in(base.clone(), 4 / pp, microbatches_for(kind, pp));
        let (losses, flat, bytes) = decode(line);
        assert_eq!(
            bytes,
            predicted_comm_bytes(&ranks_config(pp, kind, zero)),
            "{kind} {zero:?}: bytes sent by the MPI ranks"
        );
        // The plain-Burn reference, parameter by parameter.
        let mut rest = flat.as_slice();
        let got: Vec<Vec<f32>> = want_params
            .iter()
            .map(|w| {
                let (head, tail) = rest.split_at(w.len());
                rest = tail;
                head.to_vec()
            })
            .collect();
        assert!(rest.is_empty(), "{kind} {zero:?}: extra parameter values");
        let loss_err = max_loss_err(&losses, &want_losses);
        let param_err = max_param_err(&got, &want_params);
        assert!(
            loss_err <= 1e-5 && param_err <= 1e-5,
            "{kind} {zero:?} over {name}: loss err {loss_err:.2e}, param err {param_err:.2e}"
        );
        // The same layout with ranks as threads: bitwise the same.
        let local = train(&base, &ranks_config(pp, kind, zero)).expect("in-process run");
        let local_flat: Vec<f32> = params(&local.model).into_iter().flatten().collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            local.losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{kind} {zero:?}: {name} and in-process losses differ"
        );
        assert!(
            bits(&flat) == bits(&local_flat),
            "{kind} {zero:?}: {name} and in-process parameters differ"
        );
    }
}

/// Rank 1 of four MPI processes fails; the others stop and name it.
#[test]
fn a_failing_mpi_process_stops_the_others_with_an_error_naming_it() {
    let name = "mpi";
    let out = out_file(&format!("{name}-fault"));
    let (ok, log, took) = launch(
        4,
        &[
            (OUT_ENV, out.to_str().expect("utf-8 temp path")),
            (FAULT_ENV, "1,2"),
        ],
    );
    assert!(!ok, "the {name} launch succeeded despite the fault:\n{log}");
    assert!(
        log.contains("injected fault on rank 1 at step 2"),
        "the failing rank's error is missing:\n{log}"
    );
    // Another rank stopped because of rank 1, well before its 10 s timeout.
    assert!(
        log.contains("because rank 1 failed"),
        "no other rank named rank 1:\n{log}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{log}");
    assert!(!out.exists(), "rank 0 reported results of a failed run");
}

/// Three MPI processes for a world of four are refused with the fix.
#[test]
fn an_mpi_world_of_the_wrong_size_is_refused_with_the_fix() {
    let name = "mpi";
    let out = out_file(&format!("{name}-size"));
    let (ok, log, _) = launch(3, &[(OUT_ENV, out.to_str().expect("utf-8 temp path"))]);
    assert!(!ok, "3 processes for pp 2 × dp 2 ran over {name}:\n{log}");
    assert!(
        log.contains("started 3 processes but pp 2 × dp 2 needs 4"),
        "no clear error:\n{log}"
    );
}
