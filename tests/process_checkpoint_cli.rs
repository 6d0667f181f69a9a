//! Checkpoints with ranks as MPI processes (`bfpp launch --nproc 4 -- train --save/--resume`,
//! feature `mpi`): every process writes its own rank's files and world rank 0 the manifest; a resumed multi-process run continues the uninterrupted run exactly; checkpoints
//! move between multi-process and in-process runs in other layouts; a rank that cannot write
//! stops every rank, is named with its file, and leaves the previous checkpoint intact.
//!
//! The MPI tests need `mpirun` on PATH (see tests/launch_cli.rs).
#![cfg(all(feature = "flex", feature = "mpi"))]

use std::path::Path;
use std::process::{Command, Output};

use burn_bfpp::checkpoint::{list_checkpoints, load};
use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::bounded::{output_within, LAUNCH_DEADLINE};
use common::{json_of, losses, norm, output_text, rel, scratch_dir, P2_V2_D2_ZERO3, TINY};

/// Another layout, run in one process: P=4 V=1 D=1 ZeRO-1.
const OTHER_LAYOUT: &[&str] = &[
    "--pp",
    "4",
    "--loops",
    "1",
    "--dp",
    "1",
    "--zero",
    "1",
    "--microbatches",
    "4",
];

fn temp_dir(name: &str) -> TempDir {
    scratch_dir("process-ckpt", name)
}

/// `bfpp [launch --nproc 4 --] train --json TINY args` (four MPI processes when `via` is
/// `Some`), with its own output folder; in one process when `via` is `None`.
fn train(via: Option<&str>, out: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    if via.is_some() {
        cmd.args(["launch", "--nproc", "4", "--"]);
    }
    cmd.args(["train", "--json", "--out-dir"])
        .arg(out)
        .args(TINY)
        .args(["--comm-timeout", "20"])
        .args(args)
        .env_remove("BFPP_FAULT_INJECT")
        .env_remove("BFPP_CKPT_CRASH_AFTER_FILES");
    if via.is_none() {
        cmd.args(["--comm", "local"]);
    }
    output_within(cmd, LAUNCH_DEADLINE)
}

/// Steps 3 and 4 of `resumed` and its final norm against the uninterrupted `full` run.
fn assert_continues(what: &str, resumed: &Value, full: &Value, tolerance: f64) {
    let got = losses(resumed);
    let want = &losses(full)[2..];
    assert_eq!(got.len(), 2, "{what}: only steps 3 and 4 run");
    for (g, w) in got.iter().zip(want) {
        assert!(rel(*g, *w) <= tolerance, "{what}: {got:?} vs {want:?}");
    }
    let (g, w) = (norm(resumed), norm(full));
    assert!(rel(g, w) <= tolerance, "{what}: norm {g} vs {w}");
}

fn with<'a>(layout: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    layout.iter().chain(more).copied().collect()
}

/// Processes started `via` save, resume exactly, and exchange checkpoints with in-process
/// runs in another layout.
fn multi_process_checkpoints_resume_exactly_and_move_between_process_layouts(via: &str) {
    let scratch = temp_dir(&format!("{via}-resume"));
    let dir = scratch.path();
    let path = |name: &str| dir.join(name).to_str().expect("utf-8").to_string();
    let (process_run, local_run) = (path("process-run"), path("local-run"));

    // The uninterrupted reference: four steps in the multi-process layout, in one process
    // (multi-process runs are bitwise the in-process run, see tests/launch_cli.rs).
    let full = json_of(&train(
        None,
        &dir.join("full"),
        &with(P2_V2_D2_ZERO3, &["--steps", "4"]),
    ));

    // Four processes save after every step, keeping one: rank 0 prunes step 1 after step 2.
    let saved = train(
        Some(via),
        &dir.join("process-save"),
        &with(
            P2_V2_D2_ZERO3,
            &[
                "--steps",
                "2",
                "--save",
                &process_run,
                "--save-every",
                "1",
                "--keep",
                "1",
            ],
        ),
    );
    json_of(&saved);
    let kept = list_checkpoints(Path::new(&process_run)).expect("run directory lists");
    assert_eq!(
        kept.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![2],
        "--keep 1"
    );
    let names: Vec<_> = std::fs::read_dir(&process_run)
        .expect("run directory")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names.len(), 1, "nothing but step-00000002: {names:?}");
    // Every rank's file, verified against the manifest's sizes and checksums.
    let loaded = load(Path::new(&process_run)).expect("the checkpoint loads and verifies");
    assert_eq!(loaded.manifest.files.len(), 4);
    assert_eq!(loaded.ranks.len(), 4);

    // Four processes resume it: steps 3 and 4 as in the uninterrupted run.
    let resumed = json_of(&train(
        Some(via),
        &dir.join("process-resume"),
        &with(P2_V2_D2_ZERO3, &["--steps", "4", "--resume", &process_run]),
    ));
    assert_continues("multi-process resume", &resumed, &full, 1e-6);

    // One process in another layout resumes the multi-process checkpoint.
    let local = json_of(&train(
        None,
        &dir.join("local-resume"),
        &with(OTHER_LAYOUT, &["--steps", "4", "--resume", &process_run]),
    ));
    assert_continues(
        "in-process resume of a multi-process checkpoint",
        &local,
        &full,
        1e-5,
    );

    // And the reverse: a checkpoint of one process in another layout, resumed by four.
    json_of(&train(
        None,
        &dir.join("local-save"),
        &with(OTHER_LAYOUT, &["--steps", "2", "--save", &local_run]),
    ));
    let back = json_of(&train(
        Some(via),
        &dir.join("process-resume-local"),
        &with(P2_V2_D2_ZERO3, &["--steps", "4", "--resume", &local_run]),
    ));
    assert_continues(
        "multi-process resume of an in-process checkpoint",
        &back,
        &full,
        1e-5,
    );
}

/// Rank 3 of processes started `via` cannot write: all stop naming it, the previous
/// checkpoint stays.
fn a_rank_that_cannot_write_stops_all_and_the_previous_checkpoint_stays(via: &str) {
    let scratch = temp_dir(&format!("{via}-fail"));
    let dir = scratch.path();
    let run = dir.join("run");
    // A directory where rank 3's step-2 file must go: only that rank's rename fails.
    let blocker = run.join("step-00000002.partial").join("rank-00003.bin");
    std::fs::create_dir_all(blocker.join("x")).expect("blocker");
    let run_s = run.to_str().expect("utf-8");
    let out = train(
        Some(via),
        &dir.join("out"),
        &with(
            P2_V2_D2_ZERO3,
            &["--steps", "3", "--save", run_s, "--save-every", "1"],
        ),
    );
    let log = output_text(&out);
    assert!(!out.status.success(), "the run succeeded:\n{log}");
    assert!(
        log.contains("rank 3 failed to write its part of the step-2 checkpoint")
            && log.contains("rank-00003.bin"),
        "rank 3 and its file are not named:\n{log}"
    );
    // The processes that got to print (a launcher may kill the rest once one exits) all stop
    // naming rank 3 and its file, rather than waiting for it.
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("error: training failed"))
        .collect();
    assert!(!errors.is_empty(), "no process reported an error:\n{log}");
    for e in errors {
        assert!(
            e.contains("rank 3 failed to write") && e.contains("rank-00003.bin"),
            "a process did not name rank 3 and its file: {e}"
        );
    }
    let kept = list_checkpoints(&run).expect("run directory lists");
    assert_eq!(kept.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![1]);
    load(&run).expect("the step-1 checkpoint is intact");
}

#[test]
fn mpi_process_checkpoints_resume_exactly_and_move_between_layouts() {
    multi_process_checkpoints_resume_exactly_and_move_between_process_layouts("mpirun");
}

#[test]
fn an_mpi_rank_that_cannot_write_stops_all_and_the_previous_checkpoint_stays() {
    a_rank_that_cannot_write_stops_all_and_the_previous_checkpoint_stays("mpirun");
}
