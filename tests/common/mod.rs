//! What the CLI integration tests share (each test file is a crate of its own).
#![allow(dead_code)]

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
