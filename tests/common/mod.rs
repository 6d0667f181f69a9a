//! What the CLI integration tests share (each test file is a crate of its own).
#![allow(dead_code)]

pub mod bounded;

pub use bounded::output_text;

use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;

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

/// An empty folder `bfpp-{prefix}-{pid}-{name}` under the system's temporary folder (emptied
/// if an earlier run left it).
pub fn fresh_dir(prefix: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bfpp-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
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
