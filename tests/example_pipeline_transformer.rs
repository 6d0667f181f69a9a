//! `examples/pipeline_transformer.rs`, the layer-stack adapter's example, run as a user runs
//! it: its JSON line must show the pipelined training equal to the plain Burn loop's within
//! 1e-5, and training that actually moved the model.

use std::path::PathBuf;
use std::process::Command;

mod common;
use common::output_text;

/// The example binary `cargo test` builds beside this test's own binary.
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join("pipeline_transformer");
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds examples; with a --test filter run \
         `cargo build --profile test --example pipeline_transformer` first",
        path.display()
    );
    path
}

#[test]
fn the_pipelined_transformer_trains_like_plain_burn() {
    let out = Command::new(example())
        .output()
        .expect("the example starts");
    assert!(out.status.success(), "{}", output_text(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not one JSON line ({e}): {}", output_text(&out)));
    let numbers = |key: &str| -> Vec<f64> {
        doc[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} is not an array: {doc}"))
            .iter()
            .map(|v| v.as_f64().expect("a number"))
            .collect()
    };
    let (piped, plain) = (numbers("losses"), numbers("plain_losses"));
    assert_eq!((piped.len(), plain.len()), (4, 4), "{doc}");
    // Training happened: the loss fell over the four steps.
    assert!(piped[3] < piped[0] - 0.1, "{doc}");
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    let norm = |key: &str| doc[key].as_f64().expect("a number");
    let mut worst = rel(norm("param_norm"), norm("plain_param_norm"));
    for (a, b) in piped.iter().zip(&plain) {
        worst = worst.max(rel(*a, *b));
    }
    let reported = doc["max_rel_diff"].as_f64().expect("max_rel_diff");
    assert!(
        rel(reported, worst) < 1e-9 || reported == worst,
        "{reported} vs {worst}"
    );
    assert!(
        reported <= 1e-5,
        "pipelined and plain Burn differ by {reported:e}: {doc}"
    );
}
