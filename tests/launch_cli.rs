//! `bfpp launch --nproc 4 -- train …`: CPU ranks are MPI processes under `mpirun`. Four of them
//! give the in-process run's `--json` report bit for bit, a failing rank is named by the
//! others, and a crashed one ends the launch at once (builds with the `mpi` feature). A build
//! without MPI, a machine without `mpirun`, and CPU ranks started with torchrun's variables
//! are refused with the fix.
//!
//! The MPI tests need `mpirun` on PATH (Debian/Ubuntu: `apt-get install openmpi-bin
//! libopenmpi-dev`); without it `bfpp launch` fails with that hint and so do they.
#![cfg(feature = "flex")]

use std::process::{Command, Output};
use std::time::{Duration, Instant};
use tempfile::TempDir;

mod common;
use common::bounded::{output_within, outputs_within, LAUNCH_DEADLINE};
#[cfg(feature = "mpi")]
use common::json_of;
use common::{output_text, scratch_dir, TINY};

/// With the TINY model: P=2 V=2 D=2 ZeRO-3 breadth-first, three steps.
const RUN: &[&str] = &[
    "--pp",
    "2",
    "--loops",
    "2",
    "--dp",
    "2",
    "--zero",
    "3",
    "--steps",
    "3",
    "--comm-timeout",
    "10",
    "--json",
];

/// `bfpp [launch --nproc N --] train RUN --out-dir DIR` with `env`: its output, its folder and
/// how long it ran.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn bfpp(launch: Option<usize>, name: &str, env: &[(&str, &str)]) -> (Output, TempDir, Duration) {
    let dir = scratch_dir("launch-cli", name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    if let Some(n) = launch {
        cmd.args(["launch", "--nproc", &n.to_string(), "--"]);
    }
    cmd.arg("train")
        .args(TINY)
        .args(RUN)
        .arg("--out-dir")
        .arg(dir.path())
        .env_remove("BFPP_FAULT_INJECT");
    if launch.is_none() {
        cmd.args(["--comm", "local"]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut launched = outputs_within(vec![cmd], LAUNCH_DEADLINE);
    (launched.outputs.remove(0), dir, launched.took)
}

#[cfg(feature = "mpi")]
#[test]
fn four_mpi_processes_report_what_the_in_process_run_reports() {
    let (launched, launched_dir, _) = bfpp(Some(4), "mpi", &[]);
    let (local, _, _) = bfpp(None, "mpi-local", &[]);
    let (m, l) = (json_of(&launched), json_of(&local));
    // Identical values print identically, so the text comparison is a bitwise one.
    for key in ["losses", "param_l2_norm", "peak_param_bytes", "comm_bytes"] {
        assert_eq!(m[key].to_string(), l[key].to_string(), "{key} differs");
    }
    assert_eq!(m["losses"].as_array().map(Vec::len), Some(3));
    // One synchronising read per step on every rank, whatever the transport.
    assert_eq!(m["host_reads_per_step"], serde_json::json!([1, 1, 1, 1]));
    // Rank 0 wrote every rank's timeline.
    let trace =
        std::fs::read_to_string(launched_dir.path().join("trace.json")).expect("trace.json");
    for rank in 0..4 {
        assert!(
            trace.contains(&format!("rank {rank}")),
            "rank {rank} missing from the trace"
        );
    }
}

#[cfg(feature = "mpi")]
#[test]
fn a_failing_mpi_rank_stops_the_launch_and_is_named() {
    let (out, _, took) = bfpp(
        Some(4),
        "mpi-fault",
        &[("BFPP_FAULT_INJECT", "rank=1,step=2")],
    );
    let log = output_text(&out);
    assert!(!out.status.success(), "the launch succeeded:\n{log}");
    assert!(
        log.contains("because rank 1 failed: injected fault on rank 1 at step 2"),
        "no rank named rank 1:\n{log}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}:\n{log}");
}

/// A rank whose process dies without a word (a crash, a kill) ends the launch at once, and
/// mpirun names it: well before the ranks' 10 s communication timeout.
#[cfg(feature = "mpi")]
#[test]
fn a_crashed_mpi_rank_ends_the_launch_at_once_and_is_named() {
    let start = Instant::now();
    let (out, _, _) = bfpp(
        Some(4),
        "mpi-crash",
        &[("BFPP_FAULT_INJECT", "rank=1,step=2,kind=abort")],
    );
    let took = start.elapsed();
    let log = output_text(&out);
    assert!(!out.status.success(), "the launch succeeded:\n{log}");
    assert!(log.contains("injected abort at step 2"), "{log}");
    assert!(
        log.contains("rank 1"),
        "neither mpirun nor a rank named rank 1:\n{log}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{log}");
}

/// Without MPI there is no multi-process CPU run: the launch says how to get MPI, or to run
/// the ranks as threads.
#[test]
fn a_cpu_launch_without_mpi_says_how_to_get_it_or_to_use_threads() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    cmd.args(["launch", "--nproc", "4", "--", "train"])
        .args(TINY);
    // A build with MPI on a machine without it: no mpirun on PATH.
    if cfg!(feature = "mpi") {
        cmd.env("PATH", "");
    }
    let out = output_within(cmd, Duration::from_secs(60));
    let log = output_text(&out);
    assert!(!out.status.success(), "it ran:\n{log}");
    let install = if cfg!(feature = "mpi") {
        "apt-get install openmpi-bin libopenmpi-dev"
    } else {
        "--features mpi"
    };
    assert!(
        log.contains(install) && log.contains("as threads of one process"),
        "{log}"
    );
}

/// CPU ranks started with torchrun's variables are refused: those start GPU ranks.
#[test]
fn cpu_ranks_started_like_gpu_ranks_say_how_to_start_them() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    cmd.arg("train")
        .args(TINY)
        .args(RUN)
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .env_remove("OMPI_COMM_WORLD_SIZE");
    let out = output_within(cmd, Duration::from_secs(60));
    let log = output_text(&out);
    assert!(!out.status.success(), "it ran:\n{log}");
    assert!(
        log.contains("CPU ranks as processes run under MPI")
            && log.contains("bfpp launch --nproc 4 -- train"),
        "{log}"
    );
}

/// GPU ranks from a build or a machine that cannot run them (no CUDA backend built in, or
/// no CUDA driver / NCCL loadable) fail before training, every rank with the fix, and
/// quickly: nothing waits for a peer that never comes.
#[test]
fn gpu_ranks_that_cannot_start_fail_before_training_with_the_fix() {
    let dir = scratch_dir("launch-cli", "no-cuda");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    cmd.args(["launch", "--nproc", "2", "--", "train", "--backend", "cuda"])
        .args(TINY)
        .args(["--pp", "2", "--dp", "1", "--loops", "1", "--steps", "2"])
        .arg("--out-dir")
        .arg(dir.path());
    let start = Instant::now();
    let out = output_within(cmd, Duration::from_secs(60));
    let log = output_text(&out);
    assert!(!out.status.success(), "it ran:\n{log}");
    let fix = if cfg!(feature = "cuda") {
        // A CUDA build on a machine without a GPU stack: the driver library is named.
        "CUDA driver"
    } else {
        "--features cuda"
    };
    assert!(log.contains(fix), "`{fix}` not in:\n{log}");
    assert!(
        !dir.path().join("metrics.jsonl").exists(),
        "a rank started training:\n{log}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// The multi-machine flags are for GPU ranks; CPU ranks spread over machines through MPI.
#[test]
fn multi_node_flags_for_cpu_ranks_point_to_mpi() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    cmd.args(["launch", "--nproc", "2", "--nnodes", "2", "--", "train"])
        .args(TINY);
    let out = output_within(cmd, Duration::from_secs(60));
    let log = output_text(&out);
    assert!(!out.status.success(), "it ran:\n{log}");
    assert!(log.contains("hostfile") && log.contains("srun"), "{log}");
}

#[test]
fn a_hung_launch_is_killed_at_its_deadline_with_what_it_printed() {
    let dir = scratch_dir("launch-cli", "hung");
    let pid_file = dir.path().join("background.pid");
    // A launcher that leaves a process of its own behind and never ends, as a hung mpirun.
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg("sleep 600 & echo $! > \"$1\"; echo started; wait")
        .arg("hung")
        .arg(&pid_file);
    let start = Instant::now();
    let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        output_within(cmd, Duration::from_secs(1))
    }))
    .expect_err("a launch past its deadline fails");
    let message = failure
        .downcast_ref::<String>()
        .expect("the failure is a message");
    assert!(
        message.contains("started") && message.contains("which hung"),
        "{message}"
    );
    // Killed at its 1 s deadline plus the 5 s grace, not after its 600 s; the bound leaves room
    // for waiting on this binary's other launches, which run one at a time.
    assert!(
        start.elapsed() < Duration::from_secs(120),
        "{:?}",
        start.elapsed()
    );
    // The process it left behind went with it (gone, or a zombie nobody has reaped).
    let pid = std::fs::read_to_string(&pid_file).expect("the launcher wrote its child's pid");
    let state = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    let alive = state
        .rsplit(") ")
        .next()
        .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('Z'));
    assert!(!alive, "the launcher's child survived: {state}");
}
