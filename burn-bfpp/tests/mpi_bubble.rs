//! The measured bubble of runs with ranks as separate processes (`mpirun`, feature `mpi`)
//! against the simulator fed with that run's own measured action durations
//! (`engine::StepProfile` → `sim::simulate_costed`), within 10 %: a P=2, V=2 breadth-first
//! run, and on four processes 1F1B, ZB-H1, breadth-first and breadth-first zero-bubble (the
//! split-backward schedules against their full-backward bases).
//!
//! The replay is the simulator's one-thread-per-rank model (`sim::Execution::Serial`), as the
//! CPU engine runs sends and receives on the thread that computes, with each rank starting
//! when it started in the run (`CostTable::start`). Each process computes on one core
//! (`RAYON_NUM_THREADS=1`), as a GPU rank computes on its own device.
//!
//! Ranks as threads of one process would not do: they would share one process's cores and
//! thread pool, which stretches each other's actions. The test starts `mpirun` on this test binary, filtered to
//! the ignored test [`bubble_rank_process`]; rank 0 writes the figures to a file.
#![cfg(feature = "mpi")]

mod common;
use common::bounded::{output_text, output_within, LAUNCH_DEADLINE};

use std::process::Command;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::comm::{CommConfig, MpiComm, RankGrid};
use burn_bfpp::engine::{infallible, LrConfig, StepProfile, TrainConfig, Trainer};
use burn_bfpp::model::{Gpt, GptConfig, Inputs, MicroBatch, Targets};
use burn_bfpp::schedule::{Action, ScheduleKind, ZeroLevel};
use burn_bfpp::sim::{simulate_costed, CostTable, Dtype, Execution, SimConfig};

type B = Autodiff<Flex>;

const M: usize = 4;
const MBS: usize = 4;
const STEPS: usize = 4;
const OUT_ENV: &str = "BFPP_TEST_BUBBLE_OUT";
/// `schedule,pp,microbatches`: the run a rank process makes.
const CASE_ENV: &str = "BFPP_TEST_BUBBLE_CASE";

fn gpt() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        seq_len: 64,
        hidden: 64,
        heads: 4,
        layers: 8,
        mlp_ratio: 4,
        ..GptConfig::default()
    }
}

fn batch(step: usize, dp_index: usize, microbatch: usize) -> MicroBatch<B> {
    let (seq, vocab) = (gpt().seq_len, gpt().vocab_size);
    let ids = |salt: usize| {
        let v: Vec<i64> = (0..MBS * seq)
            .map(|i| ((step * 31 + dp_index * 17 + microbatch * 7 + i * 3 + salt) % vocab) as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [MBS, seq]), &Default::default())
    };
    MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(1)),
    }
}

fn config(kind: ScheduleKind, pp: usize, microbatches: usize) -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(pp)
        .with_loops(kind.family().default_loops)
        .with_microbatches(microbatches)
        .with_schedule(kind)
        .with_zero(ZeroLevel::Zero0)
        .with_lr(LrConfig::Constant(1e-3))
        .with_comm_timeout_secs(120.0)
}

/// One rank; only meaningful when started by the test below.
#[test]
#[ignore = "a rank process of mpi_bubble, which starts it under mpirun"]
fn bubble_rank_process() {
    let out = std::env::var(OUT_ENV)
        .unwrap_or_else(|_| panic!("{OUT_ENV} is not set: this test is started by mpirun"));
    let case = std::env::var(CASE_ENV).unwrap_or_else(|_| panic!("{CASE_ENV} is not set"));
    let fields: Vec<&str> = case.split(',').collect();
    let kind: ScheduleKind = fields[0].parse().expect("a schedule name");
    let number = |i: usize| -> usize { fields[i].parse().expect("a number") };
    let (pp, microbatches) = (number(1), number(2));
    let cfg = config(kind, pp, microbatches);
    let comm = MpiComm::<<B as AutodiffBackend>::InnerBackend>::init(
        RankGrid::new(cfg.pp, cfg.dp).expect("grid"),
        Default::default(),
        CommConfig::with_timeout(Duration::from_secs_f64(cfg.comm_timeout_secs)),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let model: Gpt<B> = {
        gpt()
            .init_seeded::<B>(11, &Default::default())
            .expect("valid config")
    };
    let Some(outcome) = Trainer::new(cfg.clone())
        .in_process(&comm)
        .fit(model, infallible(batch))
        .unwrap_or_else(|e| panic!("{e}"))
    else {
        return;
    };
    let program = cfg.program().expect("valid layout");
    // Rank 0 holds every rank's timeline as the ranks reported it: each ran its program's
    // computes in order, overlapped pairs marked as such.
    for (rank, list) in program.ranks.iter().enumerate() {
        let ran: Vec<Action> = outcome.timelines[rank]
            .iter()
            .filter(|e| e.step == 2 && e.action.kind.is_compute())
            .map(|e| e.action)
            .collect();
        let want: Vec<Action> = list
            .iter()
            .copied()
            .filter(|a| a.kind.is_compute())
            .collect();
        assert_eq!(ran, want, "{kind}: rank {rank}'s reported step 2");
    }
    let mut sim = SimConfig::unit();
    sim.dtype = Dtype::Fp32;
    sim.execution = Execution::Serial;
    let mut table = CostTable::new(
        &sim,
        &program.stage_ranks,
        program.num_ranks(),
        microbatches,
    )
    .expect("unit costs");
    // The measured span stops at the last action; the optimizer update is not in it.
    table.optimizer = vec![0.0; program.num_ranks()];
    let mut overlapped = sim.clone();
    overlapped.execution = Execution::Overlapped;
    let mut lines = Vec::new();
    // Step 1 warms allocators up; the later steps are measured.
    for step in 2..=STEPS {
        let profile = StepProfile::measure(&outcome.timelines, cfg.pp, step).expect("step ran");
        table.start = profile.start.clone();
        let serial =
            simulate_costed(&program, &sim, &table, Some(&profile.durations)).expect("simulates");
        let parallel = simulate_costed(&program, &overlapped, &table, Some(&profile.durations))
            .expect("simulates");
        lines.push(format!(
            "{step} {} {} {} {} {} {}",
            profile.span,
            profile.bubble_fraction,
            serial.step_time_s,
            serial.bubble_fraction,
            parallel.step_time_s,
            parallel.bubble_fraction
        ));
    }
    std::fs::write(out, lines.join("\n")).expect("writable");
}

/// One run under `mpirun`: per measured step, (step, measured span, measured bubble,
/// serial replay span, serial replay bubble, overlapped replay span, overlapped bubble).
fn measure(kind: ScheduleKind, pp: usize, microbatches: usize) -> Vec<Vec<f64>> {
    let out = std::env::temp_dir().join(format!(
        "bfpp-bubble-{}-{kind}-{pp}.txt",
        std::process::id()
    ));
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &pp.to_string(),
        "-x",
        OUT_ENV,
        "-x",
        CASE_ENV,
        "-x",
        "RAYON_NUM_THREADS",
    ])
    .env(OUT_ENV, &out)
    .env(CASE_ENV, format!("{kind},{pp},{microbatches}"))
    .env("RAYON_NUM_THREADS", "1")
    .arg(exe)
    .args(["--exact", "bubble_rank_process", "--ignored", "--nocapture"]);
    let run = output_within(cmd, LAUNCH_DEADLINE);
    assert!(
        run.status.success(),
        "{}\n^ mpirun failed ({kind}, {pp} processes)",
        output_text(&run)
    );
    let text = std::fs::read_to_string(&out).expect("rank 0 wrote its figures");
    let _ = std::fs::remove_file(&out);
    let rows: Vec<Vec<f64>> = text
        .lines()
        .map(|line| {
            line.split(' ')
                .map(|x| x.parse().expect("number"))
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), STEPS - 1, "{text}");
    rows
}

/// Checks every measured step of `kind` against the simulator and returns the mean measured
/// and replayed bubbles.
fn check(kind: ScheduleKind, pp: usize, microbatches: usize) -> (f64, f64) {
    let rows = measure(kind, pp, microbatches);
    for v in &rows {
        let (step, span, bubble, replayed_span, replayed) = (v[0], v[1], v[2], v[3], v[4]);
        let (overlapped_span, overlapped) = (v[5], v[6]);
        eprintln!(
            "{kind} P={pp} M={microbatches} step {step}: measured {span:.4} s, bubble \
             {bubble:.3}; simulator (serial) {replayed_span:.4} s, bubble {replayed:.3}; \
             simulator (overlapped) {overlapped_span:.4} s, bubble {overlapped:.3}"
        );
        let err = (replayed - bubble).abs() / bubble;
        assert!(
            err <= 0.10,
            "{kind} step {step}: the simulator replaying the run's own durations finds a \
             bubble of {replayed:.3}, the run measured {bubble:.3}: {:.1} % apart, more than \
             10 %",
            err * 100.0
        );
        // Taking sends and receives off the compute thread can only shorten the step.
        assert!(
            overlapped_span <= replayed_span * (1.0 + 1e-9),
            "{kind} step {step}: overlapped {overlapped_span} s > serial {replayed_span} s"
        );
    }
    let mean = |i: usize| rows.iter().map(|v| v[i]).sum::<f64>() / rows.len() as f64;
    (mean(2), mean(4))
}

#[test]
fn the_measured_bubble_is_the_simulators_within_ten_percent() {
    check(ScheduleKind::BreadthFirst, 2, M);
}

/// Runs `split` and `base` on `pp` processes (M = 8), each checked by [`check`], and prints
/// their measured and replayed bubbles side by side.
fn compare(base: ScheduleKind, split: ScheduleKind, pp: usize) {
    let (base_measured, base_replayed) = check(base, pp, 8);
    let (split_measured, split_replayed) = check(split, pp, 8);
    eprintln!(
        "{split} against {base}, P={pp} M=8: measured bubble {split_measured:.3} vs \
         {base_measured:.3} (ratio {:.2}); simulator {split_replayed:.3} vs \
         {base_replayed:.3} (ratio {:.2})",
        split_measured / base_measured,
        split_replayed / base_replayed
    );
}

/// Issue 36's measurement: each split-backward schedule against its base on four processes.
/// The figures (with `--nocapture`) go to docs/benchmarks.md.
#[test]
fn zero_bubble_bubbles_on_four_processes_are_the_simulators_within_ten_percent() {
    compare(ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1, 4);
    compare(
        ScheduleKind::BreadthFirst,
        ScheduleKind::BreadthFirstZeroBubble,
        4,
    );
}

/// DualPipeV's overlapped pairs, run half after half, against ZB-V on the same V placement:
/// the simulator replays the run's own durations of every pair's halves.
#[test]
fn dualpipev_bubble_on_four_processes_is_the_simulators_within_ten_percent() {
    compare(ScheduleKind::ZeroBubbleV, ScheduleKind::DualPipeV, 4);
}

/// The same comparisons on two processes, a core each on the 2-core machines: the bubble the
/// schedules differ in is not drowned by four processes sharing two cores.
#[test]
fn split_backwards_on_two_processes_with_a_core_each_are_the_simulators_within_ten_percent() {
    compare(ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1, 2);
    compare(
        ScheduleKind::BreadthFirst,
        ScheduleKind::BreadthFirstZeroBubble,
        2,
    );
    compare(ScheduleKind::ZeroBubbleV, ScheduleKind::DualPipeV, 2);
}
