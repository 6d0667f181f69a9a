//! End-to-end tests of the `bfpp` binary: bad input fails cleanly with a helpful message,
//! good input prints what the README shows.

use std::path::PathBuf;
use std::process::{Command, Output};

fn bfpp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .args(args)
        .output()
        .expect("the bfpp binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts a failed run: non-zero exit, no panic, and every `needle` in standard error.
fn assert_fails_with(args: &[&str], needles: &[&str]) -> String {
    let out = bfpp(args);
    let err = stderr(&out);
    assert!(!out.status.success(), "{args:?} should fail; stderr: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains("error"), "{args:?}: no error message: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{args:?}: `{needle}` not in: {err}");
    }
    err
}

/// A file under the temporary directory, unique to this test process.
fn temp_file(name: &str, contents: Option<&str>) -> PathBuf {
    let path = std::env::temp_dir().join(format!("bfpp-cli-{}-{name}", std::process::id()));
    if let Some(text) = contents {
        std::fs::write(&path, text).expect("temp file is writable");
    }
    path
}

#[test]
fn unknown_schedule_lists_the_choices() {
    assert_fails_with(
        &["schedule", "--schedule", "zigzag"],
        &["zigzag", "gpipe", "1f1b", "interleaved", "breadth-first"],
    );
}

#[test]
fn zero_microbatches_is_rejected() {
    let out = bfpp(&["schedule", "--microbatches", "0"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_fails_with(&["schedule", "--microbatches", "0"], &["--microbatches 1"]);
}

#[test]
fn zero_pipeline_ranks_is_rejected() {
    assert_fails_with(&["schedule", "--pp", "0"], &["--pp 1"]);
}

#[test]
fn gpipe_with_loops_is_rejected() {
    assert_fails_with(
        &["schedule", "--schedule", "gpipe", "--loops", "2"],
        &["loops", "--loops 1"],
    );
}

#[test]
fn interleaved_needs_a_multiple_of_pp() {
    assert_fails_with(
        &[
            "schedule",
            "--schedule",
            "interleaved",
            "--pp",
            "4",
            "--microbatches",
            "6",
        ],
        &["multiple of pp=4", "try 8"],
    );
}

#[test]
fn out_of_range_zero_level_is_a_usage_error() {
    let out = bfpp(&["schedule", "--zero", "4"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_fails_with(&["schedule", "--zero", "4"], &["--zero"]);
}

#[test]
fn validate_names_the_malformed_line() {
    let path = temp_file("malformed.csv", Some("0F0,0B0\n1F0,1X0,1B0\n"));
    let err = assert_fails_with(
        &["validate", path.to_str().unwrap()],
        &["line 2", "column 2", "1X0"],
    );
    let _ = std::fs::remove_file(&path);
    assert!(err.starts_with("error: "), "{err}");
}

#[test]
fn validate_of_a_missing_file() {
    let path = temp_file("does-not-exist.csv", None);
    assert_fails_with(
        &["validate", path.to_str().unwrap()],
        &["cannot read", "does-not-exist.csv"],
    );
}

#[test]
fn validate_of_an_empty_file() {
    let path = temp_file("empty.csv", Some(""));
    assert_fails_with(&["validate", path.to_str().unwrap()], &["no actions"]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn validate_names_the_blocked_rank_of_a_deadlock() {
    let path = temp_file("deadlock.csv", Some("0F0,0B0\n1B0,1F0\n"));
    assert_fails_with(&["validate", path.to_str().unwrap()], &["rank 1", "1B0"]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn actions_format_prints_one_line_per_rank() {
    let out = bfpp(&["schedule", "--pp", "4", "--format", "actions"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    for (rank, line) in lines.iter().enumerate() {
        assert!(line.starts_with(&format!("rank {rank}: ")), "{line}");
        assert!(
            !line.contains("SEND") && !line.contains("UNSHARD"),
            "{line}"
        );
    }
    // Breadth-first, P = 4, V = 2, M = 8: rank 0 opens with stage 0's eight forwards.
    assert!(lines[0].starts_with("rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 4F0"));
}

#[test]
fn grid_is_the_default_format() {
    let out = bfpp(&["schedule"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with("step | rank 0 | rank 1 | rank 2 | rank 3"),
        "{text}"
    );
    assert!(text.contains("makespan 57 units"), "{text}");
}

#[test]
fn csv_output_round_trips_through_validate() {
    let path = temp_file("roundtrip.csv", None);
    let file = path.to_str().unwrap();
    let out = bfpp(&[
        "schedule",
        "--schedule",
        "breadth-first",
        "--pp",
        "4",
        "--loops",
        "2",
        "--microbatches",
        "8",
        "--zero",
        "3",
        "--format",
        "csv",
        "--output",
        file,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).is_empty(), "--output writes nothing to stdout");
    let csv = std::fs::read_to_string(&path).unwrap();
    assert_eq!(csv.lines().count(), 4);
    assert!(csv.contains("SEND_F") && csv.contains("UNSHARD"), "{csv}");
    let out = bfpp(&["validate", file]);
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.starts_with("valid: 4 ranks, 8 stages, 8 micro-batches, makespan 57 units"),
        "{text}"
    );
}

/// PyTorch's earlier naming (`BW` for a full backward) reads back as the same schedule.
#[test]
fn legacy_csv_output_validates_like_the_current_one() {
    let validate = |format: &str| {
        let path = temp_file(&format!("naming-{format}.csv"), None);
        let file = path.to_str().unwrap();
        let args = [
            "schedule",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--format",
            format,
        ];
        let out = bfpp(&[&args[..], &["--output", file]].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        let csv = std::fs::read_to_string(&path).unwrap();
        let out = bfpp(&["validate", file]);
        let _ = std::fs::remove_file(&path);
        assert!(out.status.success(), "{format}: {}", stderr(&out));
        (csv, stdout(&out))
    };
    let (current, current_report) = validate("csv");
    let (legacy, legacy_report) = validate("csv-legacy");
    assert!(legacy.contains("BW") && !current.contains("BW"), "{legacy}");
    assert_eq!(legacy.replace("BW", "B"), current);
    assert_eq!(legacy_report, current_report);
}

#[test]
fn json_summary_has_the_documented_keys() {
    let out = bfpp(&[
        "schedule",
        "--pp",
        "2",
        "--loops",
        "2",
        "--microbatches",
        "4",
        "--zero",
        "3",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(doc["schedule"], "breadth-first");
    assert_eq!(doc["pp"], 2);
    assert_eq!(doc["zero"], 3);
    assert_eq!(doc["buffers"], 2);
    assert_eq!(doc["ranks"].as_array().unwrap().len(), 2);
    assert_eq!(doc["collectives"].as_array().unwrap().len(), 2);
    assert!(doc["collectives"][0]["unshard"].as_u64().unwrap() > 0);
    // β = (P − 1)/(V·M) = 1/8 when M ≥ P.
    assert!((doc["bubble_fraction"].as_f64().unwrap() - 0.125).abs() < 1e-9);
    assert!(doc["makespan_units"].as_f64().is_some());
}

#[test]
fn huge_layouts_are_refused_instead_of_overflowing() {
    for args in [
        &["schedule", "--pp", "18446744073709551615"][..],
        &["schedule", "--pp", "4", "--loops", "9223372036854775807"],
        &["schedule", "--microbatches", "18446744073709551615"],
        &["schedule", "--pp", "100000", "--microbatches", "100000"],
    ] {
        assert_fails_with(args, &["lower pp, loops or microbatches"]);
    }
}

#[test]
fn validate_draws_the_grid_of_a_deadlock() {
    // Structurally complete, but rank 1 wants micro-batch 1 first while rank 0 only sends it
    // after micro-batch 0's backward, which needs rank 1.
    let path = temp_file(
        "deadlock-grid.csv",
        Some("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"),
    );
    assert_fails_with(
        &["validate", path.to_str().unwrap()],
        &[
            "deadlock",
            "step | rank 0 | rank 1",
            "blocked | [0B0]  | [1F1]",
            // Each rank named with its line of the file.
            "rank 0 (line 1) blocked at 0B0 (position 1)",
            "rank 1 (line 2) blocked at 1F1 (position 0)",
        ],
    );
    let _ = std::fs::remove_file(&path);
}
