//! The measured bubble of a P=2, V=2 breadth-first run with ranks as separate processes
//! (`mpirun -np 2`, feature `mpi`) against the simulator fed with that run's own measured
//! action durations (`engine::StepProfile` → `sim::simulate_costed`): issue 4 asks for the
//! two within 10 %.
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
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use burn_bfpp::sim::{simulate_costed, CostTable, Dtype, Execution, SimConfig};

type B = Autodiff<Flex>;

const M: usize = 4;
const MBS: usize = 4;
const STEPS: usize = 4;
const OUT_ENV: &str = "BFPP_TEST_BUBBLE_OUT";

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

fn config() -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(2)
        .with_loops(2)
        .with_microbatches(M)
        .with_schedule(ScheduleKind::BreadthFirst)
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
    let cfg = config();
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
    let mut sim = SimConfig::unit();
    sim.dtype = Dtype::Fp32;
    sim.execution = Execution::Serial;
    let mut table =
        CostTable::new(&sim, &program.stage_ranks, program.num_ranks(), M).expect("unit costs");
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

#[test]
fn the_measured_bubble_is_the_simulators_within_ten_percent() {
    let out = std::env::temp_dir().join(format!("bfpp-bubble-{}.txt", std::process::id()));
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "-x",
        OUT_ENV,
        "-x",
        "RAYON_NUM_THREADS",
    ])
    .env(OUT_ENV, &out)
    .env("RAYON_NUM_THREADS", "1")
    .arg(exe)
    .args(["--exact", "bubble_rank_process", "--ignored", "--nocapture"]);
    let run = output_within(cmd, LAUNCH_DEADLINE);
    assert!(
        run.status.success(),
        "{}\n^ mpirun failed",
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
    for v in &rows {
        let (step, span, bubble, replayed_span, replayed) = (v[0], v[1], v[2], v[3], v[4]);
        let (overlapped_span, overlapped) = (v[5], v[6]);
        eprintln!(
            "step {step}: measured {span:.4} s, bubble {bubble:.3}; simulator (serial) \
             {replayed_span:.4} s, bubble {replayed:.3}; simulator (overlapped) \
             {overlapped_span:.4} s, bubble {overlapped:.3}"
        );
        let err = (replayed - bubble).abs() / bubble;
        assert!(
            err <= 0.10,
            "step {step}: the simulator replaying the run's own durations finds a bubble of \
             {replayed:.3}, the run measured {bubble:.3}: {:.1} % apart, more than 10 %",
            err * 100.0
        );
        // Taking sends and receives off the compute thread can only shorten the step.
        assert!(
            overlapped_span <= replayed_span * (1.0 + 1e-9),
            "step {step}: overlapped {overlapped_span} s > serial {replayed_span} s"
        );
    }
}
