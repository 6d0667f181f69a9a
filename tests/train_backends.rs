//! `bfpp train`'s backends and its measurement flags: `--hardware` (MFU and the simulator's
//! prediction beside the measured step), `--plain-burn` (the plain Burn loop the engine is
//! measured against, which must train the same losses), the refusal of backends and flags a
//! build or backend does not have, and, in builds with `--features wgpu` (CI, on Mesa's
//! software Vulkan), the engine on wgpu against the same run on the CPU.
#![cfg(feature = "flex")]

use std::process::{Command, Output};

use serde_json::Value;

mod common;
use common::{json_of, losses, output_text, rel, scratch_dir, TINY};

/// A 3-step run of the TINY model, P=2 V=2 D=2 breadth-first ZeRO-3, fp32, no clipping (so
/// that the plain loop, which has none, trains the same function).
const RUN: &[&str] = &[
    "--pp",
    "2",
    "--loops",
    "2",
    "--dp",
    "2",
    "--microbatches",
    "2",
    "--steps",
    "3",
    "--max-grad-norm",
    "0",
    "--comm-timeout",
    "60",
];

/// `bfpp train TINY RUN args` in a folder of its own.
fn train(name: &str, args: &[&str]) -> Output {
    let dir = scratch_dir("backends", name);
    Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .arg("train")
        .args(TINY)
        .args(RUN)
        .args(args)
        .arg("--out-dir")
        .arg(dir.path())
        .env_remove("BFPP_FAULT_INJECT")
        .output()
        .expect("the bfpp binary runs")
}

/// Asserts `args` fail, naming `fix`.
fn assert_refused(name: &str, args: &[&str], fix: &str) {
    let out = train(name, args);
    let log = output_text(&out);
    assert!(!out.status.success(), "{args:?} ran:\n{log}");
    assert!(log.contains(fix), "{args:?}: `{fix}` not in:\n{log}");
}

fn number(doc: &Value, path: &[&str]) -> f64 {
    let mut v = doc;
    for key in path {
        v = &v[*key];
    }
    v.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {doc}"))
}

#[test]
fn hardware_reports_mfu_and_the_prediction_beside_the_measured_step() {
    // A preset other than the H200: the MFU's peak must follow it (A100: 312 TFLOP/s).
    let doc = json_of(&train("hardware", &["--hardware", "a100-80gb", "--json"]));
    assert_eq!(number(&doc, &["hardware", "peak_tflops"]), 312.0);
    let measured = number(&doc, &["hardware", "measured", "step_s"]);
    let times: Vec<f64> = doc["step_times_s"]
        .as_array()
        .expect("step times")
        .iter()
        .map(|t| t.as_f64().expect("seconds"))
        .collect();
    assert_eq!(times.len(), 3);
    assert!(times.iter().all(|t| *t > 0.0), "{times:?}");
    // The steady step is the median of the steps after the first.
    let mut rest = times[1..].to_vec();
    rest.sort_by(f64::total_cmp);
    assert_eq!(measured, rest[1]);
    let flops = number(&doc, &["hardware", "model_flops_per_step"]);
    let mfu = number(&doc, &["hardware", "measured", "mfu"]);
    assert!(
        rel(mfu, flops / measured / 312e12) < 1e-9,
        "{mfu} against {flops} FLOP in {measured} s"
    );
    for key in ["step_s", "tokens_per_s", "mfu", "bubble_fraction"] {
        let v = number(&doc, &["hardware", "predicted", key]);
        assert!(v.is_finite() && v > 0.0, "predicted {key} = {v}");
    }
    let text = train("hardware-text", &["--hardware", "a100-80gb"]);
    let log = output_text(&text);
    assert!(text.status.success(), "{log}");
    assert!(
        log.contains("simulated (a100-80gb/rank)") && log.contains("MFU against 312 TFLOP/s"),
        "{log}"
    );
}

#[test]
fn the_plain_burn_baseline_trains_the_engines_losses() {
    let engine = json_of(&train("engine", &["--json"]));
    let plain = json_of(&train("plain", &["--plain-burn", "--json"]));
    assert_eq!(plain["plain_burn"], Value::Bool(true));
    let (a, b) = (losses(&engine), losses(&plain));
    assert_eq!(a.len(), 3);
    // Same model, data, AdamW and learning rates in fp32: the engine is plain Burn's
    // training, within the equivalence tests' 1e-5.
    for (x, y) in a.iter().zip(&b) {
        assert!(rel(*x, *y) <= 1e-5, "engine {a:?}, plain {b:?}");
    }
    assert!(number(&plain, &["steady_tokens_per_s"]) > 0.0);
}

#[test]
fn backends_and_flags_this_build_or_backend_lacks_are_refused_with_the_fix() {
    if !cfg!(feature = "cuda") {
        assert_refused("no-cuda", &["--backend", "cuda"], "--features cuda");
    }
    if !cfg!(feature = "wgpu") {
        assert_refused("no-wgpu", &["--backend", "wgpu"], "--features wgpu");
    }
    assert_refused("gpus", &["--gpus", "2"], "applies to --backend cuda");
    assert_refused(
        "nccl",
        &["--comm", "nccl"],
        "--comm nccl needs --backend cuda",
    );
    // The error lists the presets.
    assert_refused("preset", &["--hardware", "tpu-v9"], "h100-80gb");
}

/// The engine on wgpu (lavapipe in CI) trains the CPU run's losses. Both compute in fp32 from
/// the same initial weights (drawn on the CPU for every backend) and data; they differ in
/// summation order (the CubeCL matmul's tiling against Flex's), so each op is off by a few
/// f32 roundings, and AdamW's normalised update can let that grow over steps. Tolerance 1e-5
/// relative on each of the 3 steps' losses, the equivalence tests' bound: measured 2026-12-06
/// at most 4.4e-8 (step 1 4.3e-8, step 2 0, step 3 4.4e-8); a wrong gradient, a lost step or
/// other initial weights move the losses by 1e-3 or more (4.7e-3 on step 1 when each backend
/// drew its own weights from the seed).
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_trains_the_losses_of_the_cpu_run() {
    let cpu = losses(&json_of(&train("flex", &["--json"])));
    let wgpu = losses(&json_of(&train(
        "wgpu",
        &["--backend", "wgpu", "--fused", "off", "--json"],
    )));
    assert_eq!(cpu.len(), wgpu.len());
    for (step, (c, g)) in cpu.iter().zip(&wgpu).enumerate() {
        eprintln!(
            "step {}: flex {c}, wgpu {g}, relative {:.2e}",
            step + 1,
            rel(*g, *c)
        );
        assert!(
            rel(*g, *c) <= 1e-5,
            "step {}: flex {cpu:?}, wgpu {wgpu:?}",
            step + 1
        );
    }
}
