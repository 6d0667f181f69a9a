//! Memory as the operating system reports it (`peak_rss_bytes` of `--json`, the process's
//! `VmHWM`), on a model that is not tiny: a GPT of 176 M parameters (705 MB in fp32).
//!
//! * One rank holds at most 1.3 × the memory of the same model trained by a plain Burn loop
//!   (`--plain-burn`), over steps that run the optimizer with moments already there.
//! * Four MPI processes (pp = 4, ZeRO-0) each hold at most 0.32 × the one-rank run: every
//!   process builds, draws, shapes and keeps only its own stages (`--features mpi`).
//! * A long run's memory stays flat: the tiny default layout's peak after 400 steps is within
//!   1.10 × its peak after 50.
//!
//! The big model runs one or two steps of four micro-batches of one 32-token sample, so each
//! run takes seconds to a minute on two cores.
#![cfg(feature = "flex")]

use std::process::Command;
use std::time::Duration;

mod common;
use common::bounded::output_within;
use common::{json_of, scratch_dir};

/// The model and batch of the memory checks: 14 blocks of width 1024 (176 M parameters).
const BIG: &[&str] = &[
    "--hidden",
    "1024",
    "--layers",
    "14",
    "--heads",
    "8",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "1",
    "--microbatches",
    "4",
    "--loops",
    "1",
    "--zero",
    "0",
];

/// A run's limit: the big model's runs take under a minute here, ten times that is a hang.
const LIMIT: Duration = Duration::from_secs(600);

/// Every rank's peak resident memory of `bfpp [launch --nproc N --] train ARGS --json`.
fn peak_rss(launch: Option<usize>, name: &str, args: &[&str]) -> Vec<u64> {
    let dir = scratch_dir("memory-cli", name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    if let Some(n) = launch {
        cmd.args(["launch", "--nproc", &n.to_string(), "--"]);
    }
    cmd.arg("train")
        .args(args)
        .args(["--json", "--out-dir"])
        .arg(dir.path())
        .env_remove("BFPP_FAULT_INJECT");
    let doc = json_of(&output_within(cmd, LIMIT));
    doc["peak_rss_bytes"]
        .as_array()
        .unwrap_or_else(|| panic!("no peak_rss_bytes: {doc}"))
        .iter()
        .map(|b| b.as_u64().expect("Linux reports VmHWM"))
        .collect()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[cfg(not(feature = "mpi"))]
#[test]
fn one_rank_holds_at_most_1_3_times_plain_burns_memory() {
    let steps = ["--steps", "2", "--pp", "1", "--dp", "1"];
    let args = |extra: &[&'static str]| -> Vec<&'static str> { [BIG, &steps[..], extra].concat() };
    let engine = peak_rss(None, "engine", &args(&[]))[0];
    let plain = peak_rss(None, "plain", &args(&["--plain-burn"]))[0];
    let ratio = engine as f64 / plain as f64;
    eprintln!(
        "peak RSS: engine {:.0} MiB, plain Burn {:.0} MiB, {ratio:.3}×",
        mib(engine),
        mib(plain)
    );
    // The model alone is 705 MB: both runs hold it, its gradients and AdamW's moments.
    assert!(plain > 2_000_000_000, "plain Burn {:.0} MiB", mib(plain));
    assert!(
        ratio <= 1.3,
        "the engine holds {ratio:.3}× plain Burn's memory"
    );
}

#[cfg(not(feature = "mpi"))]
#[test]
fn a_long_run_keeps_flat_memory() {
    // The tiny GPT in the default layout (4 thread ranks): what grows per step shows.
    let run = |steps: &'static str| {
        let args = [common::TINY, &["--steps", steps]].concat();
        peak_rss(None, &format!("steps-{steps}"), &args)[0]
    };
    let (short, long) = (run("50"), run("400"));
    let ratio = long as f64 / short as f64;
    eprintln!(
        "peak RSS: {:.1} MiB after 50 steps, {:.1} MiB after 400 ({ratio:.3}×)",
        mib(short),
        mib(long)
    );
    assert!(
        ratio <= 1.10,
        "memory grew {ratio:.3}× from 50 to 400 steps"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn four_processes_each_hold_at_most_0_32_of_one_rank() {
    let one: Vec<&str> = [BIG, &["--steps", "1", "--pp", "1", "--dp", "1"][..]].concat();
    let four: Vec<&str> = [BIG, &["--steps", "1", "--pp", "4", "--dp", "1"][..]].concat();
    let whole = peak_rss(None, "pp1", &[&one[..], &["--comm", "local"]].concat())[0];
    let ranks = peak_rss(Some(4), "pp4", &four);
    assert_eq!(ranks.len(), 4);
    let ratios: Vec<f64> = ranks.iter().map(|&r| r as f64 / whole as f64).collect();
    eprintln!(
        "peak RSS: pp=1 {:.0} MiB; pp=4 processes {:?} MiB, {ratios:.3?} of it",
        mib(whole),
        ranks.iter().map(|&r| mib(r).round()).collect::<Vec<_>>()
    );
    // Processes really are separate: their peaks differ (stage sizes differ) and each holds
    // at least its quarter's parameters (176 MB).
    assert!(ranks.iter().all(|&r| r > 176_000_000), "{ranks:?}");
    for (rank, ratio) in ratios.iter().enumerate() {
        assert!(
            *ratio <= 0.32,
            "rank {rank} holds {ratio:.3} × the one-rank run's memory"
        );
    }
}
