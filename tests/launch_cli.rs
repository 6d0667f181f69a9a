//! `bfpp launch --nproc 4 -- train …`: four processes give the in-process run's `--json`
//! report bit for bit, and a failing rank is named by the others; with the processes
//! connected over TCP (`--via tcp`, every build with `flex`) and over MPI (`--via mpirun`,
//! builds with the `mpi` feature).
//!
//! The MPI tests need `mpirun` on PATH (Debian/Ubuntu: `apt-get install openmpi-bin
//! libopenmpi-dev`); without it `bfpp launch` fails with that hint and so do they.
#![cfg(feature = "flex")]

use std::process::{Command, Output};
use std::time::{Duration, Instant};
use tempfile::TempDir;

mod common;
use common::bounded::{output_within, outputs_within, LAUNCH_DEADLINE};
use common::{json_of, output_text, scratch_dir, TINY};

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

/// `bfpp [launch --via VIA --nproc N --] train RUN --out-dir DIR` with `env`: its output, its
/// folder and how long it ran.
fn bfpp(
    launch: Option<(&str, usize)>,
    name: &str,
    env: &[(&str, &str)],
) -> (Output, TempDir, Duration) {
    let dir = scratch_dir("launch-cli", name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    if let Some((via, n)) = launch {
        cmd.args(["launch", "--via", via, "--nproc", &n.to_string(), "--"]);
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

/// Four processes started `via` report what the in-process run reports.
fn four_processes_report_what_the_in_process_run_reports(via: &str) {
    let (launched, launched_dir, _) = bfpp(Some((via, 4)), via, &[]);
    let (local, _, _) = bfpp(None, &format!("{via}-local"), &[]);
    let (m, l) = (json_of(&launched), json_of(&local));
    // Identical values print identically, so the text comparison is a bitwise one.
    for key in ["losses", "param_l2_norm", "peak_param_bytes"] {
        assert_eq!(m[key].to_string(), l[key].to_string(), "{key} differs");
    }
    assert_eq!(m["losses"].as_array().map(Vec::len), Some(3));
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

/// Rank 1 of four processes started `via` fails; the others stop and name it.
fn a_failing_rank_stops_the_launch_and_is_named(via: &str) {
    let name = format!("{via}-fault");
    let (out, _, took) = bfpp(
        Some((via, 4)),
        &name,
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

#[test]
fn four_tcp_processes_report_what_the_in_process_run_reports() {
    four_processes_report_what_the_in_process_run_reports("tcp");
}

#[test]
fn a_failing_tcp_rank_stops_the_launch_and_is_named() {
    a_failing_rank_stops_the_launch_and_is_named("tcp");
}

#[cfg(feature = "mpi")]
#[test]
fn four_mpi_processes_report_what_the_in_process_run_reports() {
    four_processes_report_what_the_in_process_run_reports("mpirun");
}

#[cfg(feature = "mpi")]
#[test]
fn a_failing_mpi_rank_stops_the_launch_and_is_named() {
    a_failing_rank_stops_the_launch_and_is_named("mpirun");
}

#[test]
fn two_tcp_launchers_as_two_nodes_report_what_the_in_process_run_reports() {
    let port = burn_bfpp::comm::free_local_port()
        .expect("a free port")
        .to_string();
    let dir = scratch_dir("launch-cli", "two-nodes");
    // Two `bfpp launch` of two processes each, as on two machines: node 0 serves the store.
    let node = |rank: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
        cmd.args(["launch", "--via", "tcp", "--nproc", "2", "--nnodes", "2"])
            .args(["--node-rank", rank, "--master-addr", "127.0.0.1"])
            .args(["--master-port", &port, "--", "train"])
            .args(TINY)
            .args(RUN)
            .arg("--out-dir")
            .arg(dir.path())
            .env_remove("BFPP_FAULT_INJECT");
        cmd
    };
    let mut nodes = outputs_within(vec![node("0"), node("1")], LAUNCH_DEADLINE).outputs;
    let (first, second) = (nodes.remove(0), nodes.remove(0));
    assert!(second.status.success(), "node 1:\n{}", output_text(&second));
    let (local, _, _) = bfpp(None, "two-nodes-local", &[]);
    // World rank 0 runs on node 0 and reports; node 1's ranks print nothing.
    let (n, l) = (json_of(&first), json_of(&local));
    for key in ["losses", "param_l2_norm", "peak_param_bytes"] {
        assert_eq!(n[key].to_string(), l[key].to_string(), "{key} differs");
    }
    assert!(
        second.stdout.is_empty(),
        "node 1 printed:\n{}",
        output_text(&second)
    );
}

#[test]
fn a_killed_tcp_rank_is_named_by_the_others_well_before_the_timeout() {
    let port = burn_bfpp::comm::free_local_port().expect("a free port");
    let dir = scratch_dir("launch-cli", "killed");
    // Rank 1 stalls at step 2 (as a hung or swapping process would), and is then killed.
    let mut ranks: Vec<_> = (0..4)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_bfpp"))
                .arg("train")
                .args(TINY)
                .args(RUN)
                .arg("--out-dir")
                .arg(dir.path())
                .envs(burn_bfpp::comm::RendezvousEnv::on_this_machine(rank, 4, port).vars())
                .env("BFPP_FAULT_INJECT", "rank=1,step=2,kind=sleep,secs=120")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("the bfpp binary runs")
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    let start = Instant::now();
    ranks[1].kill().expect("rank 1 can be killed");
    let outputs: Vec<Output> = ranks
        .into_iter()
        .map(|r| r.wait_with_output().expect("a rank ends"))
        .collect();
    let took = start.elapsed();
    for (rank, out) in outputs.iter().enumerate().filter(|(r, _)| *r != 1) {
        let log = output_text(out);
        assert!(!out.status.success(), "rank {rank} succeeded:\n{log}");
        assert!(
            log.contains("the connection to rank 1 ended"),
            "rank {rank} does not name rank 1:\n{log}"
        );
    }
    // The others stop on the closed connections, not at RUN's 10 s timeout (which would say
    // "timed out" and come about 7 s after the kill).
    assert!(took < Duration::from_secs(4), "took {took:?}");
}

#[test]
fn comm_tcp_without_a_launcher_says_how_to_start_the_processes() {
    let out = Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .arg("train")
        .args(TINY)
        .args(RUN)
        .args(["--comm", "tcp"])
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .expect("the bfpp binary runs");
    let log = output_text(&out);
    assert!(!out.status.success(), "it ran:\n{log}");
    assert!(
        log.contains("needs the launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (or")
            && log.contains("bfpp launch --nproc 4 -- train"),
        "{log}"
    );
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
