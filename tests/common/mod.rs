//! What the CLI integration tests share (each test file is a crate of its own).
#![allow(dead_code)]

pub mod bounded;

pub use bounded::output_text;

use std::process::Output;

use serde_json::Value;
use tempfile::TempDir;

/// Model flags of a 4-block (6-layer) GPT of width 16 on 8-token samples, two per
/// micro-batch: small enough that every `bfpp train` run of a test takes seconds.
pub const TINY: &[&str] = &[
    "--layers",
    "4",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--mlp-ratio",
    "2",
    "--seq-len",
    "8",
    "--micro-batch-size",
    "2",
];

/// The layout the checkpoint tests save in, in one process or four: P=2 V=2 D=2 ZeRO-3, two
/// micro-batches.
pub const P2_V2_D2_ZERO3: &[&str] = &[
    "--pp",
    "2",
    "--loops",
    "2",
    "--dp",
    "2",
    "--zero",
    "3",
    "--microbatches",
    "2",
];

/// An empty folder of its own under the system's temporary folder, named
/// `bfpp-{prefix}-{name}-` and a random suffix. It is removed when the guard drops, also when
/// the test fails; set `BFPP_KEEP_TEST_DIRS` to keep it for a look afterwards.
pub fn scratch_dir(prefix: &str, name: &str) -> TempDir {
    let mut dir = tempfile::Builder::new()
        .prefix(&format!("bfpp-{prefix}-{name}-"))
        .tempdir()
        .expect("the temporary folder is writable");
    dir.disable_cleanup(std::env::var_os("BFPP_KEEP_TEST_DIRS").is_some());
    dir
}

/// The `--json` object of a successful run.
pub fn json_of(out: &Output) -> Value {
    // The log comes first: a test's failure message is read from its end.
    assert!(out.status.success(), "{}\n^ bfpp failed", output_text(out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not one JSON object ({e}):\n{}", output_text(out)))
}

/// The per-step losses of a `--json` report.
pub fn losses(doc: &Value) -> Vec<f64> {
    doc["losses"]
        .as_array()
        .expect("losses is an array")
        .iter()
        .map(|l| l.as_f64().expect("a loss is a number"))
        .collect()
}

/// The final parameter L2 norm of a `--json` report.
pub fn norm(doc: &Value) -> f64 {
    doc["param_l2_norm"].as_f64().expect("param_l2_norm")
}

/// Relative difference of `a` from `b`.
pub fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}
