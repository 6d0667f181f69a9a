//! End-to-end tests of `bfpp simulate`, `bfpp plan` and `bfpp compare`: the JSON contracts,
//! the pictures, and error messages that name the fix.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn bfpp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bfpp"))
        .args(args)
        .output()
        .expect("the bfpp binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ok(args: &[&str]) -> String {
    let out = bfpp(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed: {err}");
    stdout(&out)
}

fn json(args: &[&str]) -> Value {
    let text = ok(args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {text}"))
}

fn assert_fails_with(args: &[&str], needles: &[&str]) {
    let out = bfpp(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail; stderr: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{args:?}: `{needle}` not in: {err}");
    }
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bfpp-sim-cli-{}-{name}", std::process::id()))
}

const KEYS: [&str; 12] = [
    "all_gathers",
    "bubble_fraction",
    "comm_bytes",
    "exposed_dp_s",
    "exposed_p2p_s",
    "mfu",
    "peak_activation_microbatches",
    "peak_memory_bytes",
    "reduce_scatters",
    "step_time_s",
    "tflops_per_gpu",
    "tokens_per_s",
];

#[test]
fn simulate_json_has_exactly_the_issue_keys() {
    let doc = json(&[
        "simulate",
        "--model",
        "gpt-1.3b",
        "--hardware",
        "h100-80gb",
        "--schedule",
        "breadth-first",
        "--pp",
        "4",
        "--loops",
        "2",
        "--dp",
        "2",
        "--microbatches",
        "8",
        "--zero",
        "3",
        "--json",
    ]);
    let mut keys: Vec<&str> = doc
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, KEYS);
    for k in [
        "peak_memory_bytes",
        "all_gathers",
        "reduce_scatters",
        "comm_bytes",
    ] {
        assert_eq!(doc[k].as_array().unwrap().len(), 4, "{k}: one per rank");
    }
    // Every rank gathers, reduces and passes activations on.
    for bytes in doc["comm_bytes"].as_array().unwrap() {
        assert!(bytes["data_parallel"].as_u64().unwrap() > 0, "{bytes}");
        assert!(bytes["pipeline"].as_u64().unwrap() > 0, "{bytes}");
    }
    assert!(doc["step_time_s"].as_f64().unwrap() > 0.0);
    assert!(doc["mfu"].as_f64().unwrap() > 0.0 && doc["mfu"].as_f64().unwrap() < 1.0);
}

/// The unit model gives the reference's closed forms on the command line too, and says its
/// times are units.
#[test]
fn simulate_unit_model_reports_units_and_the_closed_form_bubble() {
    for (schedule, loops, want) in [("1f1b", "1", 3.0 / 8.0), ("breadth-first", "2", 3.0 / 16.0)] {
        let doc = json(&[
            "simulate",
            "--model",
            "unit",
            "--schedule",
            schedule,
            "--pp",
            "4",
            "--loops",
            loops,
            "--microbatches",
            "8",
            "--backward-ratio",
            "3",
            "--json",
        ]);
        let bubble = doc["bubble_fraction"].as_f64().unwrap();
        assert!(
            (bubble - want).abs() < 1e-12,
            "{schedule}: {bubble} vs {want}"
        );
    }
    let text = ok(&[
        "simulate",
        "--model",
        "unit",
        "--pp",
        "2",
        "--microbatches",
        "4",
    ]);
    assert!(text.contains("units"), "{text}");
}

#[test]
fn simulate_draws_the_timeline_trace_and_memory() {
    let (svg, trace, mem) = (temp("t.svg"), temp("t.json"), temp("m.svg"));
    ok(&[
        "simulate",
        "--model",
        "gpt-1.3b",
        "--pp",
        "2",
        "--dp",
        "2",
        "--zero",
        "3",
        "--microbatches",
        "4",
        "--svg",
        svg.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
        "--memory-svg",
        mem.to_str().unwrap(),
    ]);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("rank 1"));
    let trace_doc: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert!(!trace_doc["traceEvents"].as_array().unwrap().is_empty());
    let mem_text = std::fs::read_to_string(&mem).unwrap();
    assert_eq!(mem_text.matches("<path").count(), 2, "one curve per rank");
    for p in [svg, trace, mem] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn simulate_errors_name_the_fix() {
    assert_fails_with(
        &["simulate", "--model", "gpt-9t"],
        &["gpt-52b", "TOML file"],
    );
    assert_fails_with(&["simulate", "--hardware", "tpu-v9"], &["a100-80gb"]);
    assert_fails_with(
        &[
            "simulate",
            "--schedule",
            "interleaved",
            "--pp",
            "4",
            "--microbatches",
            "6",
        ],
        &["multiple of pp=4", "try 8"],
    );
    assert_fails_with(
        &["simulate", "--pp", "64", "--loops", "2"],
        &["lower pp or loops"],
    );
    assert_fails_with(
        &[
            "simulate",
            "--strategy",
            "megatron",
            "--schedule",
            "breadth-first",
        ],
        &["--schedule interleaved"],
    );
    assert_fails_with(
        &[
            "simulate",
            "--strategy",
            "megatron",
            "--schedule",
            "1f1b",
            "--loops",
            "1",
            "--zero",
            "3",
        ],
        &["--zero 1"],
    );
    assert_fails_with(&["simulate", "--backward-ratio", "3"], &["--model unit"]);
}

#[test]
fn plan_json_layouts_fit_and_are_ranked() {
    let doc = json(&[
        "plan",
        "--model",
        "gpt-6.7b",
        "--gpus",
        "8",
        "--global-batch",
        "16",
        "--top",
        "4",
        "--json",
    ]);
    let layouts = doc["layouts"].as_array().unwrap();
    assert_eq!(layouts.len(), 4);
    let limit = 80e9;
    let mut last = f64::INFINITY;
    for l in layouts {
        let tps = l["tokens_per_s"].as_f64().unwrap();
        assert!(tps <= last, "ranked by throughput");
        last = tps;
        assert!(l["peak_memory_bytes"].as_f64().unwrap() <= limit);
        let layout = &l["layout"];
        let gpus = ["tp", "pp", "dp"]
            .iter()
            .map(|k| layout[k].as_u64().unwrap())
            .product::<u64>();
        assert_eq!(gpus, 8);
    }
}

#[test]
fn compare_reports_every_family() {
    let doc = json(&[
        "compare",
        "--model",
        "gpt-6.7b",
        "--gpus",
        "8",
        "--global-batch",
        "16",
        "--json",
    ]);
    let families = doc["families"].as_object().unwrap();
    let mut names: Vec<&str> = families.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "1f1b",
            "breadth-first",
            "breadth-first-zb",
            "depth-first",
            "dualpipev",
            "gpipe",
            "interleaved-zb",
            "megatron",
            "zb-h1",
            "zb-v"
        ]
    );
    for (name, f) in families {
        assert!(f["tokens_per_s"].as_f64().unwrap() > 0.0, "{name}");
        assert!(f["layout"]["pp"].as_u64().is_some(), "{name}");
    }
    assert_eq!(families["megatron"]["layout"]["strategy"], "megatron");
}

#[test]
fn plan_explains_and_fails_clearly() {
    let text = ok(&[
        "plan",
        "--model",
        "gpt-6.7b",
        "--gpus",
        "8",
        "--global-batch",
        "16",
        "--explain",
        "pp=1,dp=8,zero=0,schedule=gpipe",
    ]);
    assert!(text.contains("does not fit in memory"), "{text}");
    assert_fails_with(
        &[
            "plan",
            "--model",
            "gpt-52b",
            "--gpus",
            "1",
            "--global-batch",
            "1",
        ],
        &["fits", "more GPUs"],
    );
    assert_fails_with(
        &[
            "plan",
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--explain",
            "pp=two",
        ],
        &["whole number"],
    );
}

#[test]
fn simulate_reads_model_files_and_names_a_bad_one() {
    let good = temp("model.toml");
    std::fs::write(
        &good,
        "kind = \"gpt\"\nlayers = 8\nhidden = 512\nheads = 8\nsequence = 256\nvocabulary = 1024\n",
    )
    .unwrap();
    let doc = json(&[
        "simulate",
        "--model",
        good.to_str().unwrap(),
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--json",
    ]);
    assert!(doc["step_time_s"].as_f64().unwrap() > 0.0);
    let bad = temp("bad.toml");
    std::fs::write(&bad, "kind = \"gpt\"\nlayers = 8\n").unwrap();
    assert_fails_with(
        &["simulate", "--model", bad.to_str().unwrap()],
        &[bad.to_str().unwrap(), "TOML"],
    );
    for p in [good, bad] {
        let _ = std::fs::remove_file(p);
    }
}

/// `--buffers` reaches the lowering and the simulator alike: at ZeRO-3 one weight buffer
/// gathers a rank's stages again for their backward and holds one at a time, three keep both
/// stages resident, so the peak differs; `plan` and `compare` take the flag too.
#[test]
fn buffers_change_the_simulated_program_and_its_memory() {
    let run = |buffers: &str| {
        json(&[
            "simulate",
            "--model",
            "gpt-1.3b",
            "--schedule",
            "breadth-first",
            "--pp",
            "4",
            "--dp",
            "2",
            "--zero",
            "3",
            "--buffers",
            buffers,
            "--json",
        ])
    };
    let (one, three) = (run("1"), run("3"));
    let peaks = |v: &Value| v["peak_memory_bytes"].clone();
    assert_ne!(peaks(&one), peaks(&three), "{one} vs {three}");
    let total = |v: &Value| -> u64 {
        v["all_gathers"]
            .as_array()
            .expect("all_gathers is a list")
            .iter()
            .map(|n| n.as_u64().expect("a count"))
            .sum()
    };
    assert!(total(&one) > total(&three), "{one} vs {three}");
    assert_fails_with(&["simulate", "--zero", "3", "--buffers", "0"], &["buffers"]);
    let request = [
        "--gpus",
        "8",
        "--global-batch",
        "16",
        "--max-microbatches",
        "16",
    ];
    for command in ["plan", "compare"] {
        let mut args = vec![command, "--model", "gpt-1.3b", "--buffers", "1", "--json"];
        args.extend(request);
        json(&args);
        let mut args = vec![command, "--buffers", "0"];
        args.extend(request);
        assert_fails_with(&args, &["--buffers must be at least 1"]);
    }
}

/// `--schedule-file` simulates a schedule CSV as the generated schedule it was written from
/// (in either PyTorch naming), takes the layout from the file, and refuses a layout flag
/// that disagrees with it.
#[test]
fn a_schedule_file_simulates_like_the_schedule_it_was_written_from() {
    let layout = [
        "--pp",
        "2",
        "--loops",
        "2",
        "--microbatches",
        "4",
        "--zero",
        "3",
    ];
    // dualpipev's file holds overlapped (F;B)OVERLAP_F_B pairs.
    for schedule in ["breadth-first", "dualpipev"] {
        let generated = json(
            &[
                &[
                    "simulate",
                    "--model",
                    "unit",
                    "--schedule",
                    schedule,
                    "--json",
                ][..],
                &layout,
            ]
            .concat(),
        );
        for format in ["csv", "csv-legacy"] {
            let path = temp(&format!("file-{schedule}-{format}.csv"));
            let file = path.to_str().expect("a UTF-8 temporary path");
            ok(&[
                &["schedule", "--schedule", schedule, "--format", format][..],
                &["--output", file],
                &layout,
            ]
            .concat());
            let text = std::fs::read_to_string(&path).expect("written");
            assert_eq!(text.contains("OVERLAP_F_B"), schedule == "dualpipev");
            let from_file = json(&[
                "simulate",
                "--model",
                "unit",
                "--zero",
                "3",
                "--schedule-file",
                file,
                "--json",
            ]);
            assert_eq!(from_file, generated, "{schedule} {format}");
            assert_fails_with(
                &["simulate", "--schedule-file", file, "--pp", "3"],
                &["--pp 3 disagrees", "drop --pp"],
            );
            let _ = std::fs::remove_file(&path);
        }
    }
    // A compute-only file with PyTorch's idle cells.
    let path = temp("idle.csv");
    std::fs::write(&path, "0F0,0F1,,,0B0,0B1\n,1F0,1F1,1B0,1B1,\n").expect("writable");
    let file = path.to_str().expect("a UTF-8 temporary path");
    let doc = json(&[
        "simulate",
        "--model",
        "unit",
        "--schedule-file",
        file,
        "--json",
    ]);
    let _ = std::fs::remove_file(&path);
    assert!(
        doc["step_time_s"].as_f64().is_some_and(|t| t > 0.0),
        "{doc}"
    );
}
