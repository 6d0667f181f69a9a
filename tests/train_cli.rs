//! End-to-end tests of `bfpp train`: the `--json` report, step-by-step equality of layouts with
//! the same global batch, injected faults, bad configurations and the `--config` file.
//!
//! Every run uses a tiny model (the `TINY` flags) so that each test takes seconds.
#![cfg(feature = "flex")]

use std::ops::Deref;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::{json_of, losses, scratch_dir, TINY};

/// A finished `bfpp train` run: its output and its `--out-dir`, which goes with the run.
struct Run {
    output: Output,
    dir: TempDir,
}

impl Deref for Run {
    type Target = Output;

    fn deref(&self) -> &Output {
        &self.output
    }
}

/// Runs `bfpp train` with the tiny model, `args`, an output folder of its own and `env`.
/// A short communication timeout, so that a rank waiting on a failed peer gives up quickly,
/// unless `args` sets one.
fn train(name: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    train_model(name, TINY, args, env)
}

/// [`train`] with the model flags `model` in place of [`TINY`].
fn train_model(name: &str, model: &[&str], args: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = scratch_dir("train", name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bfpp"));
    cmd.arg("train")
        .args(model)
        .args(args)
        .args(if args.contains(&"--comm-timeout") {
            &[][..]
        } else {
            &["--comm-timeout", "10"][..]
        })
        .arg("--out-dir")
        .arg(dir.path())
        .env_remove("BFPP_FAULT_INJECT");
    for (key, value) in env {
        cmd.env(key, value);
    }
    let output = cmd.output().expect("the bfpp binary runs");
    Run { output, dir }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts a quick, clean failure whose standard error names every `needle`.
fn assert_fails(name: &str, args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let start = Instant::now();
    let out = train(name, args, env);
    let err = stderr(&out);
    assert!(!out.status.success(), "{args:?} should fail; stderr: {err}");
    assert!(err.contains("error:"), "{args:?}: no `error:` line: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{args:?}: `{needle}` not in: {err}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{args:?} took {:?} to fail",
        start.elapsed()
    );
}

#[test]
fn json_report_has_exactly_the_documented_keys() {
    let out = train(
        "json",
        &["--steps", "2", "--microbatches", "2", "--json"],
        &[],
    );
    let doc = json_of(&out);
    let mut keys: Vec<&str> = doc
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "collective_share",
            "comm_bytes",
            "host_reads_per_step",
            "host_transfer_reads",
            "losses",
            "param_l2_norm",
            "peak_param_bytes",
            "peak_rss_bytes",
            "skipped_steps",
            "steady_tokens_per_s",
            "step_times_s",
            "timeline_svg",
            "tokens_per_s",
            "trace_json"
        ]
    );
    let losses = losses(&doc);
    assert_eq!(losses.len(), 2);
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    assert_eq!(doc["skipped_steps"], serde_json::json!([]));
    assert!(doc["param_l2_norm"].as_f64().expect("a number") > 0.0);
    assert!(doc["tokens_per_s"].as_f64().expect("a number") > 0.0);
    // The operating system's peak resident memory, one figure per rank (threads of one
    // process share it): more than the parameters, far less than this machine's memory.
    let rss = doc["peak_rss_bytes"].as_array().expect("an array");
    assert_eq!(rss.len(), 4, "{doc}");
    for r in rss {
        let bytes = r.as_u64().expect("Linux reports VmHWM");
        assert!((1 << 20..1 << 34).contains(&bytes), "{doc}");
        assert_eq!(r, &rss[0], "threads share one process: {doc}");
    }
    // The default layout has pp 2 × dp 2 = 4 ranks.
    let peaks = doc["peak_param_bytes"].as_array().expect("an array");
    assert_eq!(peaks.len(), 4);
    assert!(peaks.iter().all(|b| b.as_u64().is_some_and(|b| b > 0)));
    // Every rank of the default layout (dp 2, ZeRO-3) gathers and reduces, and computes too.
    let shares = doc["collective_share"].as_array().expect("an array");
    assert_eq!(shares.len(), 4);
    assert!(
        shares
            .iter()
            .all(|f| f.as_f64().is_some_and(|f| f > 0.0 && f < 1.0)),
        "{shares:?}"
    );
    let svg = std::fs::read_to_string(doc["timeline_svg"].as_str().expect("a path"))
        .expect("timeline written");
    assert!(svg.contains("<svg"), "not an SVG: {svg:.100}");
    let trace = doc["trace_json"].as_str().expect("a path");
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(trace).expect("trace written"))
            .expect("the trace is JSON");
    assert!(!trace["traceEvents"].as_array().expect("events").is_empty());
    let metrics_dir = PathBuf::from(doc["trace_json"].as_str().expect("a path"));
    let metrics = std::fs::read_to_string(metrics_dir.with_file_name("metrics.jsonl"))
        .expect("metrics written");
    let lines: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2);
    for key in [
        "step",
        "loss",
        "lr",
        "tokens",
        "tokens_per_s",
        "elapsed_s",
        "skipped",
    ] {
        assert!(
            lines[1].get(key).is_some(),
            "metrics line lacks {key}: {}",
            lines[1]
        );
    }
}

#[test]
fn layouts_with_the_same_global_batch_agree_step_by_step() {
    // Global batch 2 × 2 × 2 = 1 × 4 × 2 = 8 samples, the same seed: the same samples in
    // the same order, so the same losses whatever the pipeline and data-parallel split.
    let common = ["--steps", "3", "--seed", "5", "--json"];
    let pipelined = train(
        "layout-a",
        &[
            &common[..],
            &[
                "--pp",
                "2",
                "--loops",
                "2",
                "--dp",
                "2",
                "--microbatches",
                "2",
            ],
        ]
        .concat(),
        &[],
    );
    let plain = train(
        "layout-b",
        &[
            &common[..],
            &[
                "--pp",
                "1",
                "--loops",
                "1",
                "--dp",
                "1",
                "--microbatches",
                "4",
                "--schedule",
                "gpipe",
                "--zero",
                "0",
            ],
        ]
        .concat(),
        &[],
    );
    let (a, b) = (losses(&json_of(&pipelined)), losses(&json_of(&plain)));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!(((x - y) / y).abs() <= 1e-5, "{a:?} vs {b:?}");
    }
}

#[test]
fn an_injected_error_names_the_rank() {
    assert_fails(
        "fault-error",
        &["--steps", "3", "--comm-timeout", "5"],
        &[("BFPP_FAULT_INJECT", "rank=1,step=1")],
        &["rank 1"],
    );
}

#[test]
fn an_injected_panic_names_the_rank() {
    assert_fails(
        "fault-panic",
        &["--steps", "3", "--comm-timeout", "5"],
        &[("BFPP_FAULT_INJECT", "rank=1,step=2,kind=panic")],
        &["rank 1"],
    );
}

#[test]
fn a_malformed_fault_is_rejected() {
    assert_fails(
        "fault-bad",
        &["--steps", "1"],
        &[("BFPP_FAULT_INJECT", "rank=1")],
        &["BFPP_FAULT_INJECT", "rank=R,step=S"],
    );
    assert_fails(
        "fault-rank",
        &["--steps", "1"],
        &[("BFPP_FAULT_INJECT", "rank=9,step=1")],
        &["rank 9 does not exist"],
    );
}

#[test]
fn more_stages_than_layers_names_the_fix() {
    // 6 layers, 4 × 2 = 8 stages.
    assert_fails(
        "too-deep",
        &["--pp", "4", "--loops", "2"],
        &[],
        &["6 layers", "8 stages", "--layers 6"],
    );
}

#[test]
fn interleaved_needs_a_multiple_of_pp() {
    assert_fails(
        "interleaved",
        &["--schedule", "interleaved", "--microbatches", "3"],
        &[],
        &["multiple of pp=2", "try 4"],
    );
}

#[test]
fn unknown_schedule_lists_the_choices() {
    assert_fails(
        "schedule",
        &["--schedule", "zigzag"],
        &[],
        &["zigzag", "gpipe", "1f1b", "interleaved", "breadth-first"],
    );
}

#[test]
fn missing_data_path_names_the_fix() {
    assert_fails(
        "no-data",
        &["--data", "/nonexistent/bfpp/corpus.txt"],
        &[],
        &["does not exist", "--data"],
    );
}

#[test]
fn an_indivisible_global_batch_names_the_fix() {
    let out = Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .args([
            "train",
            "--global-batch",
            "10",
            "--dp",
            "2",
            "--microbatches",
            "4",
        ])
        .output()
        .expect("runs");
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("not divisible by dp × microbatches"), "{err}");
    assert!(err.contains("--global-batch 8"), "{err}");
}

#[test]
fn a_config_file_is_read_and_flags_override_it() {
    let dir = scratch_dir("train", "config");
    let file = dir.path().join("run.toml");
    std::fs::write(
        &file,
        "[train]\npp = 1\nloops = 1\ndp = 1\nmicrobatches = 2\nschedule = \"1f1b\"\nzero = 0\n\
         steps = 5\n",
    )
    .expect("writable");
    let file = file.to_str().expect("a UTF-8 path");
    // The file asks for 5 steps; the flag wins.
    let doc = json_of(&train(
        "config",
        &["--config", file, "--steps", "2", "--json"],
        &[],
    ));
    assert_eq!(losses(&doc).len(), 2);
    // The file's layout took effect: one rank.
    assert_eq!(doc["peak_param_bytes"].as_array().map(Vec::len), Some(1));

    for (name, text, key) in [
        ("typo-run", "[run]\nsede = 5\n", "sede"),
        ("typo-train", "[train]\nstesp = 5\n", "stesp"),
    ] {
        let typo = dir.path().join(format!("{name}.toml"));
        std::fs::write(&typo, text).expect("writable");
        assert_fails(
            name,
            &["--config", typo.to_str().expect("UTF-8")],
            &[],
            &[key, "--print-config"],
        );
    }
}

/// The metrics file of `run`.
fn metrics_lines(run: &Run) -> Vec<Value> {
    std::fs::read_to_string(run.dir.path().join("metrics.jsonl"))
        .expect("metrics written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn a_nan_step_stops_by_default_naming_the_step_and_the_rank() {
    // World rank 1 holds the last stage (3) of replica 0: its losses become NaN at step 2.
    assert_fails(
        "nan-stop",
        &["--steps", "3", "--microbatches", "2"],
        &[("BFPP_FAULT_INJECT", "rank=1,step=2,kind=nan")],
        &[
            "step 2",
            "non-finite loss on rank 1 (stage 3)",
            "--on-nonfinite skip",
        ],
    );
}

#[test]
fn a_nan_step_is_skipped_with_a_warning_under_the_skip_policy() {
    let dir = scratch_dir("train", "nan-skip-config");
    let file = dir.path().join("skip.toml");
    std::fs::write(&file, "[train]\non_nonfinite = \"skip\"\n").expect("writable");
    let file = file.to_str().expect("UTF-8");
    let args = [
        "--config",
        file,
        "--steps",
        "3",
        "--microbatches",
        "2",
        "--json",
    ];
    let fault = [("BFPP_FAULT_INJECT", "rank=1,step=2,kind=nan")];
    let out = train("nan-skip", &args, &fault);
    let doc = json_of(&out);
    assert_eq!(doc["skipped_steps"], serde_json::json!([2]));
    let losses = doc["losses"].as_array().expect("losses");
    assert_eq!(losses.len(), 3);
    // The poisoned loss is not a number (JSON null); the others are.
    assert!(losses[1].is_null(), "{doc}");
    assert!(losses[0].as_f64().is_some() && losses[2].as_f64().is_some());
    let err = stderr(&out);
    assert!(
        err.contains("warning: step 2") && err.contains("skipped"),
        "{err}"
    );
    let skipped: Vec<bool> = metrics_lines(&out)
        .iter()
        .map(|l| l["skipped"].as_bool().expect("skipped is a bool"))
        .collect();
    assert_eq!(skipped, [false, true, false]);

    // The flag beats the file.
    let mut stop = args.to_vec();
    stop.extend(["--on-nonfinite", "stop"]);
    assert_fails("nan-skip-flag", &stop, &fault, &["step 2", "non-finite"]);
}

#[test]
fn a_rank_slower_than_the_timeout_stops_the_run_naming_it() {
    let sleep = Duration::from_secs(4);
    let start = Instant::now();
    let out = train(
        "sleep",
        &["--steps", "3", "--microbatches", "2", "--comm-timeout", "1"],
        &[("BFPP_FAULT_INJECT", "rank=1,step=2,kind=sleep,secs=4")],
    );
    let took = start.elapsed();
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "a stalled rank must fail the run: {err}"
    );
    // The others give up after 1 s; the run ends when the sleeper wakes and is told.
    assert!(took < sleep + Duration::from_secs(10), "took {took:?}");
    assert!(err.contains("timed out"), "{err}");
    assert!(
        err.contains("rank 1 is not waiting on anybody") || err.contains("ends at rank 1,"),
        "the slow rank 1 is not named: {err}"
    );
}

#[test]
fn an_exhausted_dataset_wraps_to_the_next_epoch_and_says_so() {
    let dir = scratch_dir("train", "wrap-data");
    let corpus = dir.path().join("tiny.txt");
    // 100 bytes: (100 - 1) / 8 = 12 samples per epoch; 8 samples per step, so the data
    // runs out during step 2 and epoch 2 begins there.
    let text: String = "the quick brown fox jumps over the lazy dog. "
        .chars()
        .cycle()
        .take(100)
        .collect();
    std::fs::write(&corpus, text).expect("writable");
    let out = train(
        "wrap",
        &[
            "--data",
            corpus.to_str().expect("UTF-8"),
            "--steps",
            "4",
            "--microbatches",
            "2",
            "--json",
        ],
        &[],
    );
    let doc = json_of(&out);
    assert_eq!(losses(&doc).len(), 4);
    let err = stderr(&out);
    let notices: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("dataset exhausted"))
        .collect();
    // Steps 3 and 4 cover samples 16..32: epoch 3 starts at sample 24, in step 4.
    assert_eq!(
        notices,
        [
            "dataset exhausted at step 2: wrapping around, starting epoch 2",
            "dataset exhausted at step 4: wrapping around, starting epoch 3"
        ],
        "{err}"
    );
}

#[test]
fn fused_ops_train_the_same_model_and_refuse_heads_they_cannot_take() {
    // TINY with one head of 16, which flash attention takes. The fused ops (composed on the
    // CPU) compute the same function: the first step's loss, before any update, agrees
    // closely; later steps drift only by rounding.
    let mut model = TINY.to_vec();
    let heads = model
        .iter()
        .position(|&a| a == "--heads")
        .expect("TINY sets --heads");
    model[heads + 1] = "1";
    let common = ["--steps", "2", "--microbatches", "2", "--json"];
    let run = |name: &str, mode: &str| {
        train_model(
            name,
            &model,
            &[&common[..], &["--fused", mode]].concat(),
            &[],
        )
    };
    let (fused, plain) = (run("fused-on", "on"), run("fused-off", "off"));
    let (a, b) = (losses(&json_of(&fused)), losses(&json_of(&plain)));
    assert_eq!(a.len(), 2);
    assert!(((a[0] - b[0]) / b[0]).abs() <= 1e-6, "{a:?} vs {b:?}");
    assert!(((a[1] - b[1]) / b[1]).abs() <= 1e-4, "{a:?} vs {b:?}");
    // TINY's heads of 16 / 2 = 8 do not fit flash attention's multiples of 16.
    assert_fails(
        "fused-bad-heads",
        &["--fused", "on"],
        &[],
        &["head dimension", "fused = \"auto\""],
    );
    assert_fails("fused-bad-mode", &["--fused", "always"], &[], &["auto"]);
}

#[test]
fn precision_flags_and_file_keys_reach_the_engine() {
    let doc = json_of(&train(
        "bf16",
        &[
            "--steps",
            "2",
            "--microbatches",
            "2",
            "--precision",
            "bf16",
            "--json",
        ],
        &[],
    ));
    assert!(losses(&doc).iter().all(|l| l.is_finite()), "{doc}");

    // An initial scale far above f16's range overflows every step: each is skipped with a
    // warning and the scale halved, and the run ends normally although the policy is `stop`.
    let out = train(
        "f16-overflow",
        &[
            "--steps",
            "2",
            "--microbatches",
            "2",
            "--precision",
            "f16",
            "--loss-scale",
            "1e30",
            "--json",
        ],
        &[],
    );
    let doc = json_of(&out);
    assert_eq!(doc["skipped_steps"], serde_json::json!([1, 2]));
    let err = stderr(&out);
    assert!(err.contains("loss scale was halved"), "{err}");

    let printed = Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .args(["train", "--print-config", "--precision", "f16"])
        .args(["--loss-scale-growth-interval", "50"])
        .output()
        .expect("the bfpp binary runs");
    let text = String::from_utf8_lossy(&printed.stdout);
    assert!(text.contains("precision = \"f16\""), "{text}");
    assert!(text.contains("growth_interval = 50"), "{text}");

    assert_fails(
        "bad-precision",
        &["--precision", "fp8"],
        &[],
        &["fp8", "bf16"],
    );
}

/// `bfpp schedule --format FORMAT` of the zero-bubble ZB-H1 at pp 2, M 4, in `dir`.
fn zb_h1_file(dir: &std::path::Path, format: &str) -> PathBuf {
    schedule_file(dir, &["--schedule", "zb-h1", "--pp", "2"], format)
}

/// `bfpp schedule LAYOUT --microbatches 4 --format FORMAT`, written into `dir`.
fn schedule_file(dir: &std::path::Path, layout: &[&str], format: &str) -> PathBuf {
    let out = Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .arg("schedule")
        .args(layout)
        .args(["--microbatches", "4", "--format", format])
        .output()
        .expect("the bfpp binary runs");
    assert!(out.status.success(), "{}", stderr(&out));
    let path = dir.join(format!("{}-{format}.csv", layout.join("")));
    std::fs::write(&path, &out.stdout).expect("writable");
    path
}

#[test]
fn a_schedule_file_trains_exactly_like_the_schedule_it_was_written_from() {
    let dir = scratch_dir("train", "schedule-file-input");
    let common = ["--steps", "3", "--seed", "5", "--dp", "1", "--json"];
    let generated = train(
        "schedule-generated",
        &[
            &common[..],
            &["--schedule", "zb-h1", "--pp", "2", "--loops", "1"],
            &["--microbatches", "4"],
        ]
        .concat(),
        &[],
    );
    let want = losses(&json_of(&generated));
    assert_eq!(want.len(), 3);
    // Ours, and PyTorch's earlier naming (B/W for I/W), give the same program.
    for format in ["csv", "csv-legacy"] {
        let file = zb_h1_file(dir.path(), format);
        let from_file = train(
            &format!("schedule-file-{format}"),
            &[
                &common[..],
                &["--schedule-file", file.to_str().expect("utf-8")],
            ]
            .concat(),
            &[],
        );
        assert_eq!(losses(&json_of(&from_file)), want, "{format}");
    }
    let file = zb_h1_file(dir.path(), "csv");
    let file = file.to_str().expect("utf-8");
    assert_fails(
        "schedule-file-disagrees",
        &["--schedule-file", file, "--pp", "4"],
        &[],
        &["--pp 4 disagrees", "pp = 2", "drop --pp"],
    );
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "0F0,0X0\n1F0\n").expect("writable");
    assert_fails(
        "schedule-file-bad",
        &["--schedule-file", bad.to_str().expect("utf-8")],
        &[],
        &["bad.csv", "line 1"],
    );
}

#[test]
fn a_dualpipev_file_with_overlapped_pairs_trains_like_the_generated_schedule() {
    let dir = scratch_dir("train", "schedule-file-pairs");
    let common = ["--steps", "2", "--seed", "5", "--dp", "1", "--json"];
    let layout = ["--schedule", "dualpipev", "--pp", "2", "--loops", "2"];
    let generated = train(
        "dualpipev-generated",
        &[&common[..], &layout, &["--microbatches", "4"]].concat(),
        &[],
    );
    let want = losses(&json_of(&generated));
    assert_eq!(want.len(), 2);
    let file = schedule_file(dir.path(), &layout, "csv");
    let text = std::fs::read_to_string(&file).expect("readable");
    assert!(text.contains(")OVERLAP_F_B"), "{text}");
    let from_file = train(
        "dualpipev-file",
        &[
            &common[..],
            &["--schedule-file", file.to_str().expect("utf-8")],
        ]
        .concat(),
        &[],
    );
    assert_eq!(losses(&json_of(&from_file)), want);
    // A pair of one micro-batch's forward and backward cannot run as one unit.
    let bad = dir.path().join("same-microbatch-pair.csv");
    std::fs::write(&bad, "0F0,(0F1;0B1)OVERLAP_F_B,0B0\n").expect("writable");
    assert_fails(
        "schedule-file-bad-pair",
        &["--schedule-file", bad.to_str().expect("utf-8")],
        &[],
        &["rank 0 (line 1)", "pair different micro-batches"],
    );
}
