//! `examples/gpu_run/`, the program behind `scripts/gpu-run.sh`, run on the CPU backend: the
//! same code path as on a GPU (pipelined training with ranks sharing one device, measured
//! figures, simulator prediction, timelines) minus the CUDA device.

use std::path::PathBuf;
use std::process::{Command, Output};

use burn_bfpp::comm::RendezvousEnv;

/// The example binary `cargo test` builds beside this test's own binary.
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join("gpu_run");
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds examples; with a --test filter run \
         `cargo build --profile test --example gpu_run` first",
        path.display()
    );
    path
}

/// A tiny run: P=2, V=2 on a 4-block GPT of width 32, three steps.
const TINY_RUN: &[&str] = &[
    "--backend",
    "flex",
    "--pp",
    "2",
    "--loops",
    "2",
    "--microbatches",
    "4",
    "--micro-batch-size",
    "2",
    "--layers",
    "4",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--steps",
    "3",
    "--warmup",
    "1",
];

fn run(args: &[&str]) -> Output {
    Command::new(example())
        .args(args)
        .output()
        .expect("the example starts")
}

#[test]
fn trains_on_flex_and_reports_measured_beside_simulated() {
    let out = std::env::temp_dir().join(format!("bfpp-gpu-run-{}", std::process::id()));
    let out_arg = out.display().to_string();
    // A preset other than the default: the MFU's peak must follow it (A100: 312 TFLOP/s).
    let result = run(&[TINY_RUN, &["--out", &out_arg, "--hardware", "a100-80gb"]].concat());
    let stdout = String::from_utf8_lossy(&result.stdout);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{stdout}\n{stderr}");
    for row in [
        "step time (s)",
        "tokens/s",
        "model TFLOP/s per GPU",
        "MFU",
        "bubble",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(row))
            .unwrap_or_else(|| panic!("no `{row}` row in:\n{stdout}"));
        let numbers: Vec<f64> = line[row.len()..]
            .split_whitespace()
            .filter_map(|w| w.trim_end_matches('%').parse().ok())
            .collect();
        assert_eq!(numbers.len(), 2, "measured and simulated in `{line}`");
        assert!(numbers.iter().all(|n| n.is_finite() && *n >= 0.0), "{line}");
    }
    assert!(
        stdout.contains("one a100-80gb per rank. MFU against 312 TFLOP/s"),
        "{stdout}"
    );
    let tokens: Vec<f64> = stdout
        .lines()
        .find(|l| l.starts_with("tokens/s"))
        .into_iter()
        .flat_map(|l| l.split_whitespace().filter_map(|w| w.parse().ok()))
        .collect();
    assert!(
        tokens[0] > 0.0,
        "measured tokens/s must be positive: {stdout}"
    );
    for file in [
        "timeline-measured.svg",
        "timeline-simulated.svg",
        "trace-measured.json",
    ] {
        let text = std::fs::read_to_string(out.join(file)).expect(file);
        assert!(text.len() > 100, "{file} is nearly empty");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Runs with `args`, which must fail with an error that names `fix`.
fn assert_refused(args: &[&str], fix: &str) {
    let result = run(args);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(!result.status.success(), "{args:?} ran: {stderr}");
    assert!(stderr.contains(fix), "{args:?}: `{fix}` not in: {stderr}");
}

#[test]
fn refuses_bad_settings_with_the_fix() {
    let flex = |extra: &[&'static str]| [&["--backend", "flex"][..], extra].concat();
    assert_refused(&flex(&["--steps", "2", "--warmup", "2"]), "raise --steps");
    // The error lists the valid presets.
    assert_refused(&flex(&["--hardware", "tpu-v9"]), "h100-80gb");
    assert_refused(&flex(&["--peak-tflops", "0"]), "--peak-tflops 0");
    assert_refused(&flex(&["--gpus", "2"]), "--backend cuda only");
    assert_refused(
        &flex(&["--comm", "nccl"]),
        "--comm nccl needs --backend cuda",
    );
    if !cfg!(feature = "cuda") {
        assert_refused(&["--backend", "cuda"], "--features cuda");
    }
}

/// Ranks that are processes are GPU ranks on NCCL; a CPU rank started with torchrun's
/// variables is refused, saying so, before any training.
#[test]
fn cpu_ranks_as_processes_are_refused_with_where_they_run() {
    let args = [TINY_RUN, &["--dp", "2"][..]].concat();
    let out = Command::new(example())
        .args(&args)
        .envs(RendezvousEnv::on_this_machine(1, 4, 29_501).vars())
        .output()
        .expect("the example runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "a CPU process rank trained:\n{text}");
    assert!(
        text.contains("rank 1 of 4 processes") && text.contains("--backend cuda --comm nccl"),
        "{text}"
    );
}

/// `--baseline`: the plain Burn loop of the same model and data, with the same figure lines
/// as the engine's run (what scripts/gpu-run.sh divides), starting at the same loss.
#[test]
fn the_plain_burn_baseline_reports_the_figures_the_script_compares() {
    let out = run(&[TINY_RUN, &["--baseline", "--precision", "fp32"][..]].concat());
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("plain Burn loop"), "{text}");
    for line in ["tokens/s", "model TFLOP/s per GPU", "MFU"] {
        let value = text
            .lines()
            .find(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no `{line}` line:\n{text}"))
            .split_whitespace()
            .last()
            .map(|v| v.trim_end_matches('%').parse::<f64>());
        assert!(
            matches!(value, Some(Ok(v)) if v > 0.0),
            "`{line}` is not a positive number:\n{text}"
        );
    }
    // Same seed, data and first step as the engine's runs.
    let engine = run(&[TINY_RUN, &["--precision", "fp32"][..]].concat());
    let engine = String::from_utf8_lossy(&engine.stdout).into_owned();
    let first = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("step   1"))
            .and_then(|l| l.split_whitespace().nth(3))
            .map(str::to_string)
    };
    assert!(first(&text).is_some(), "{text}");
    assert_eq!(first(&text), first(&engine), "{text}\n{engine}");
}
