//! `examples/gpu_run.rs`, the program behind `scripts/gpu-run.sh`, run on the CPU backend: the
//! same code path as on a GPU (pipelined training with ranks sharing one device, measured
//! figures, simulator prediction, timelines) minus the CUDA device.

use std::path::PathBuf;
use std::process::{Command, Output};

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
    let result = run(&[
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
        "--out",
        &out_arg,
    ]);
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

#[test]
fn refuses_bad_settings_with_the_fix() {
    let result = run(&["--backend", "flex", "--steps", "2", "--warmup", "2"]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(stderr.contains("raise --steps"), "{stderr}");

    let result = run(&["--backend", "flex", "--gpus", "2"]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(stderr.contains("--backend cuda only"), "{stderr}");

    let result = run(&["--backend", "flex", "--comm", "nccl"]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("--comm nccl needs --backend cuda"),
        "{stderr}"
    );

    if !cfg!(feature = "cuda") {
        let result = run(&["--backend", "cuda"]);
        assert!(!result.status.success());
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(stderr.contains("--features cuda"), "{stderr}");
    }
}
