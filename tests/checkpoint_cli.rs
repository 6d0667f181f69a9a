//! End-to-end tests of `bfpp train --save/--resume/--init` and `bfpp export`: a resumed run
//! continues the uninterrupted one (same and other layouts), refusals name the file, and the
//! exported record (.mpk or .safetensors) loads into the plain single-device GPT with the
//! checkpoint's weights.
#![cfg(feature = "flex")]

use std::path::Path;
use std::process::{Command, Output};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn_bfpp::checkpoint::{consolidate, load, param_entries};
use burn_bfpp::model::{flatten_params, Gpt, GptConfig};
use burn_store::{ModuleSnapshot, SafetensorsStore};
use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::{json_of, losses, norm, rel, scratch_dir, P2_V2_D2_ZERO3, TINY};

type B = Autodiff<Flex>;

/// Every run's communication timeout: short, so a hang fails the test quickly.
const COMM_TIMEOUT: &[&str] = &["--comm-timeout", "20"];

fn temp_dir(name: &str) -> TempDir {
    scratch_dir("ckpt-cli", name)
}

fn bfpp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .args(args)
        .env_remove("BFPP_FAULT_INJECT")
        .env_remove("BFPP_CKPT_CRASH_AFTER_FILES")
        .output()
        .expect("the bfpp binary runs")
}

/// `bfpp train --json` with the tiny model, `args` and its own output folder.
fn train(dir: &Path, args: &[&str]) -> Output {
    let out = dir.join("out");
    let mut all = vec!["train", "--json", "--out-dir", out.to_str().expect("utf-8")];
    // A flag in `args` replaces TINY's or the timeout (clap refuses a flag given twice).
    for pair in [TINY, COMM_TIMEOUT].concat().chunks(2) {
        if !args.contains(&pair[0]) {
            all.extend_from_slice(pair);
        }
    }
    all.extend_from_slice(args);
    bfpp(&all)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn resume_continues_the_run_in_any_layout_and_export_loads_into_plain_burn() {
    let scratch = temp_dir("resume");
    let dir = scratch.path();
    let run = dir.join("run");
    let run_s = run.to_str().expect("utf-8");
    let mut first = P2_V2_D2_ZERO3.to_vec();
    first.extend(["--steps", "4", "--save", run_s, "--save-every", "2"]);
    let full = json_of(&train(dir, &first));
    let full_losses = losses(&full);
    assert_eq!(full_losses.len(), 4);
    let step2 = run.join("step-00000002");
    assert!(step2.join("manifest.json").is_file() && run.join("step-00000004").is_dir());

    // Same layout from the step-2 directory: steps 3 and 4, as in the uninterrupted run.
    let step2_s = step2.to_str().expect("utf-8");
    let mut same = P2_V2_D2_ZERO3.to_vec();
    same.extend(["--steps", "4", "--resume", step2_s]);
    let resumed = json_of(&train(dir, &same));
    let got = losses(&resumed);
    assert_eq!(got.len(), 2, "only steps 3 and 4 run");
    for (g, w) in got.iter().zip(&full_losses[2..]) {
        assert!(rel(*g, *w) <= 1e-6, "{got:?} vs {:?}", &full_losses[2..]);
    }
    assert!(rel(norm(&resumed), norm(&full)) <= 1e-6);
    // metrics.jsonl continues the saved run's: its steps 1 and 2, then the resumed 3 and 4,
    // neither duplicated nor left over from the first run's steps 3 and 4.
    let metrics = std::fs::read_to_string(dir.join("out").join("metrics.jsonl")).expect("metrics");
    let lines: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let steps: Vec<u64> = lines
        .iter()
        .map(|l| l["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(steps, [1, 2, 3, 4], "{metrics}");
    assert_eq!(lines[0]["loss"].as_f64(), Some(full_losses[0]));
    assert_eq!(lines[2]["loss"].as_f64(), Some(got[0]));

    // Another layout: resharded on load.
    let other = [
        "--pp",
        "1",
        "--loops",
        "2",
        "--dp",
        "1",
        "--zero",
        "0",
        "--microbatches",
        "4",
        "--steps",
        "4",
        "--resume",
        step2_s,
    ];
    let moved = json_of(&train(dir, &other));
    for (g, w) in losses(&moved).iter().zip(&full_losses[2..]) {
        assert!(
            rel(*g, *w) <= 1e-5,
            "{:?} vs {:?}",
            losses(&moved),
            &full_losses[2..]
        );
    }
    assert!(rel(norm(&moved), norm(&full)) <= 1e-5);

    // Export the newest checkpoint (step 4, the run directory) and load it into plain Burn.
    let record = dir.join("weights.mpk");
    let out = bfpp(&[
        "export",
        "--checkpoint",
        run_s,
        "--out",
        record.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "export failed: {}", stderr(&out));
    let loaded = load(&run).expect("newest checkpoint");
    assert_eq!(loaded.manifest.step, 4);
    let want = consolidate(&loaded).expect("consolidates").params;
    let config: GptConfig = serde_json::from_value(loaded.manifest.model.clone()).expect("gpt");
    let plain = {
        // A different seed: every value must come from the file.
        let fresh = config
            .init_seeded::<B>(12345, &Default::default())
            .expect("model");
        fresh
            .load_file(
                record.clone(),
                &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
                &Default::default(),
            )
            .expect("the record loads into the plain GPT")
    };
    let got: Vec<f32> = flatten_params::<B, Gpt<B>>(&plain)
        .into_data()
        .to_vec::<f32>()
        .expect("f32");
    assert_eq!(got, want, "exported weights equal the checkpoint's");
    // Its L2 norm is what the uninterrupted run reported at its end.
    let l2 = want
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt();
    assert!(rel(l2, norm(&full)) <= 1e-6, "{l2} vs {}", norm(&full));

    // --init starts pipelined training from the exported weights: step 1 of a run from them
    // has a different loss than step 1 from the seeded initialisation.
    let record_s = record.to_str().expect("utf-8");
    let init = json_of(&train(dir, &["--steps", "1", "--init", record_s]));
    let fresh = json_of(&train(dir, &["--steps", "1"]));
    assert!(
        losses(&init)[0] < losses(&fresh)[0] - 1e-3,
        "{init} vs {fresh}"
    );
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_and_nothing_is_overwritten() {
    let scratch = temp_dir("refuse");
    let dir = scratch.path();
    let run = dir.join("run");
    let run_s = run.to_str().expect("utf-8");
    json_of(&train(dir, &["--pp", "2", "--steps", "1", "--save", run_s]));
    let step1 = run.join("step-00000001");
    let rank1 = step1.join("rank-00001.bin");
    let good = std::fs::read(&rank1).expect("rank file");

    // Saving step 1 again into the same run directory: refused before training.
    let out = train(dir, &["--pp", "2", "--steps", "1", "--save", run_s]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("step-00000001"), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&rank1).expect("read"),
        good,
        "nothing overwritten"
    );

    // Another model.
    let out = train(dir, &["--steps", "2", "--layers", "2", "--resume", run_s]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("manifest.json") && err.contains("another model"),
        "{err}"
    );

    // A flipped byte.
    let mut bad = good.clone();
    bad[good.len() / 2] ^= 1;
    std::fs::write(&rank1, &bad).expect("write");
    let out = train(dir, &["--steps", "2", "--resume", run_s]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("rank-00001.bin") && err.contains("corrupt"),
        "{err}"
    );
}

#[test]
fn safetensors_export_loads_into_plain_burn_inits_like_the_record_and_refuses_other_models() {
    let scratch = temp_dir("safetensors");
    let dir = scratch.path();
    let run = dir.join("run");
    let run_s = run.to_str().expect("utf-8");
    json_of(&train(dir, &["--pp", "2", "--steps", "2", "--save", run_s]));
    let record = dir.join("weights.mpk");
    let tensors = dir.join("weights.safetensors");
    for file in [&record, &tensors] {
        let out = bfpp(&[
            "export",
            "--checkpoint",
            run_s,
            "--out",
            file.to_str().expect("utf-8"),
        ]);
        assert!(out.status.success(), "export failed: {}", stderr(&out));
        assert!(file.is_file(), "{} written", file.display());
    }
    // --format overrides the extension (which then becomes .safetensors).
    let out = bfpp(&[
        "export",
        "--checkpoint",
        run_s,
        "--format",
        "safetensors",
        "--out",
        dir.join("explicit.bin").to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "export failed: {}", stderr(&out));
    // (The header's metadata order varies, so compare contents, not bytes, below.)
    let explicit = dir.join("explicit.safetensors");
    assert!(
        explicit.is_file(),
        "--format safetensors wrote .safetensors"
    );

    let loaded = load(&run).expect("newest checkpoint");
    let want = consolidate(&loaded).expect("consolidates").params;
    let config: GptConfig = serde_json::from_value(loaded.manifest.model.clone()).expect("gpt");
    let (from_record, from_tensors) = {
        // Other seeds than the run's: every value must come from the files.
        let from_record = config
            .init_seeded::<B>(12345, &Default::default())
            .expect("model")
            .load_file(
                record.clone(),
                &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
                &Default::default(),
            )
            .expect("the record loads into the plain GPT");
        let mut from_tensors = config
            .init_seeded::<B>(54321, &Default::default())
            .expect("model");
        let result = from_tensors
            .load_from(&mut SafetensorsStore::from_file(&tensors))
            .expect("the safetensors file loads into the plain GPT with burn-store");
        // Names are the plain model's module paths, one to one.
        assert!(
            result.errors.is_empty() && result.missing.is_empty() && result.unused.is_empty(),
            "{result}"
        );
        let mut names: Vec<String> = param_entries(&from_tensors)
            .into_iter()
            .map(|p| p.name)
            .collect();
        names.sort();
        let mut applied = result.applied.clone();
        applied.sort();
        assert_eq!(applied, names, "every parameter, by module path");
        (from_record, from_tensors)
    };
    let flat = |m: &Gpt<B>| -> Vec<f32> {
        flatten_params::<B, Gpt<B>>(m)
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    };
    assert_eq!(
        flat(&from_tensors),
        want,
        "safetensors weights equal the checkpoint's"
    );
    assert_eq!(flat(&from_tensors), flat(&from_record), "and the record's");
    let from_explicit = {
        let mut model = config
            .init_seeded::<B>(999, &Default::default())
            .expect("model");
        model
            .load_from(&mut SafetensorsStore::from_file(&explicit))
            .expect("loads");
        model
    };
    assert!(
        flat(&from_explicit) == want,
        "--format safetensors writes the same weights"
    );

    // --init from either file runs the same training (a fresh start would differ).
    let init = |file: &Path| {
        json_of(&train(
            dir,
            &["--steps", "2", "--init", file.to_str().expect("utf-8")],
        ))
    };
    let (a, b) = (init(&record), init(&tensors));
    for (x, y) in losses(&a).iter().zip(&losses(&b)) {
        assert!(rel(*x, *y) <= 1e-6, "{a} vs {b}");
    }
    assert_eq!(losses(&b).len(), 2);

    // A safetensors file of another model is refused before training, naming the tensor.
    for (field, value, problem) in [("layers", 2, "missing"), ("hidden", 8, "has shape")] {
        let mut json = loaded.manifest.model.clone();
        json[field] = value.into();
        let other: GptConfig = serde_json::from_value(json).expect("gpt");
        let file = dir.join(format!("other-{field}.safetensors"));
        {
            let model = other
                .init_seeded::<B>(7, &Default::default())
                .expect("model");
            model
                .save_into(&mut SafetensorsStore::from_file(&file))
                .expect("writes");
        }
        let out = train(
            dir,
            &["--steps", "1", "--init", file.to_str().expect("utf-8")],
        );
        assert!(!out.status.success(), "{field}: accepted");
        let err = stderr(&out);
        assert!(
            err.contains(&format!("other-{field}.safetensors"))
                && err.contains("another model")
                && err.contains("tensor `")
                && err.contains(problem)
                && err.contains("--layers"),
            "{err}"
        );
    }
}

#[test]
fn a_per_stage_export_loads_into_plain_burn_and_inits_a_run_like_one_file() {
    // Saved at pp=2 loops=2 (4 stages): four files and their index.
    let scratch = temp_dir("per-stage");
    let dir = scratch.path();
    let run = dir.join("run");
    let run_s = run.to_str().expect("utf-8");
    json_of(&train(
        dir,
        &["--pp", "2", "--loops", "2", "--steps", "2", "--save", run_s],
    ));
    let one = dir.join("one.safetensors");
    let sharded = dir.join("sharded").join("model.safetensors");
    std::fs::create_dir_all(sharded.parent().expect("a folder")).expect("creates");
    for (file, extra) in [(&one, None), (&sharded, Some("--per-stage"))] {
        let mut args = vec![
            "export",
            "--checkpoint",
            run_s,
            "--out",
            file.to_str().expect("utf-8"),
        ];
        args.extend(extra);
        let out = bfpp(&args);
        assert!(out.status.success(), "export failed: {}", stderr(&out));
    }
    let folder = sharded.parent().expect("a folder");
    let index = folder.join("model.safetensors.index.json");
    let shards: Vec<_> = (1..=4)
        .map(|i| folder.join(format!("model-{i:05}-of-00004.safetensors")))
        .collect();
    assert!(index.is_file() && shards.iter().all(|s| s.is_file()));
    let map: Value = serde_json::from_str(&std::fs::read_to_string(&index).expect("reads"))
        .expect("the index is JSON");
    let weight_map = map["weight_map"].as_object().expect("a weight map");

    // Plain Burn loads the shards by name, each file a part; together they are the model.
    let loaded = load(&run).expect("newest checkpoint");
    let config: GptConfig = serde_json::from_value(loaded.manifest.model.clone()).expect("gpt");
    let mut model = config
        .init_seeded::<B>(999, &Default::default())
        .expect("model");
    let mut applied = Vec::new();
    for shard in &shards {
        let mut store = SafetensorsStore::from_file(shard).allow_partial(true);
        let result = model.load_from(&mut store).expect("loads");
        assert!(
            result.errors.is_empty() && result.unused.is_empty(),
            "{result}"
        );
        let name = shard.file_name().and_then(|n| n.to_str()).expect("utf-8");
        for tensor in &result.applied {
            assert_eq!(weight_map[tensor].as_str(), Some(name), "{tensor}");
        }
        applied.extend(result.applied);
    }
    applied.sort();
    let mut names: Vec<String> = param_entries(&model).into_iter().map(|p| p.name).collect();
    names.sort();
    assert_eq!(applied, names, "every parameter in exactly one shard");
    assert_eq!(weight_map.len(), names.len());
    let flat = flatten_params::<B, Gpt<B>>(&model)
        .into_data()
        .to_vec::<f32>()
        .expect("f32");
    assert_eq!(flat, consolidate(&loaded).expect("consolidates").params);

    // --init from the index trains exactly as --init from the one file.
    let init = |file: &Path| {
        json_of(&train(
            dir,
            &["--steps", "2", "--init", file.to_str().expect("utf-8")],
        ))
    };
    let (a, b) = (init(&one), init(&index));
    assert_eq!(losses(&a), losses(&b));
    // A shard gone from the set is named before training.
    std::fs::remove_file(&shards[2]).expect("removes");
    let out = train(
        dir,
        &["--steps", "1", "--init", index.to_str().expect("utf-8")],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("model-00003-of-00004.safetensors"), "{err}");
}
