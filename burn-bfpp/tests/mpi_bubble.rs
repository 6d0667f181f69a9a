//! The measured bubble of a P=2, V=2 breadth-first run with ranks as separate processes
//! (`mpirun -np 2`, feature `mpi`) against the simulator fed with that run's own measured
//! action durations (`engine::StepProfile` → `sim::simulate_costed`).
//!
//! Issue 4 asks for the two bubbles within 10 %; they are not yet (2026-12-03: measured
//! 0.30, replayed 0.12, see docs/benchmarks.md): the engine spends time between actions
//! (receives turning host data back into tensors, MPI polling) that no action's duration
//! carries. What this test holds is the direction: fed the run's own durations, the
//! simulator's step can only be shorter than the measured one, never longer, because every
//! dependency it models is one the engine also waits for.
//!
//! Ranks as threads of one process would not do: they share Burn 0.21's autodiff lock, so
//! their computes never overlap. The test starts `mpirun` on this test binary, filtered to
//! the ignored test [`bubble_rank_process`]; rank 0 writes the two figures to a file.
#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::comm::{CommConfig, MpiComm, RankGrid};
use burn_bfpp::engine::{train_mpi, EngineConfig, StepProfile};
use burn_bfpp::model::{autodiff_lock, Gpt, GptConfig, Inputs, MicroBatch, ModelSplit, Targets};
use burn_bfpp::optim::{AdamWSettings, LrSchedule};
use burn_bfpp::schedule::{Placement, ScheduleKind, ZeroLevel};
use burn_bfpp::sim::{simulate_costed, CostTable, Dtype, SimConfig};

type B = Autodiff<Flex>;

const M: usize = 4;
const MBS: usize = 4;
const STEPS: usize = 3;
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

fn config() -> EngineConfig {
    EngineConfig {
        pp: 2,
        loops: 2,
        dp: 1,
        microbatches: M,
        bf_microbatches: None,
        schedule: ScheduleKind::BreadthFirst,
        placement: Placement::Looping,
        zero: ZeroLevel::Zero0,
        buffers: 2,
        recompute: false,
        split: ModelSplit::Even,
        adamw: AdamWSettings::default(),
        lr: LrSchedule::constant(1e-3),
        max_grad_norm: 0.0,
        comm_timeout: Duration::from_secs(120),
        fault: None,
        on_nonfinite: Default::default(),
    }
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
        CommConfig::with_timeout(cfg.comm_timeout),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let model: Gpt<B> = {
        let _guard = autodiff_lock();
        gpt()
            .init_seeded::<B>(11, &Default::default())
            .expect("valid config")
    };
    let shape = [MBS, gpt().seq_len, gpt().hidden];
    let Some(outcome) = train_mpi::<B, _, _, _>(&comm, &model, &cfg, STEPS, shape, batch, |_| {})
        .unwrap_or_else(|e| panic!("{e}"))
    else {
        return;
    };
    let program = cfg.program().expect("valid layout");
    let mut sim = SimConfig::unit();
    sim.dtype = Dtype::Fp32;
    let mut table =
        CostTable::new(&sim, &program.stage_ranks, program.num_ranks(), M).expect("unit costs");
    // The measured span stops at the last action; the optimizer update is not in it.
    table.optimizer = vec![0.0; program.num_ranks()];
    let mut lines = Vec::new();
    // Step 1 warms allocators up; the later steps are measured.
    for step in 2..=STEPS {
        let profile = StepProfile::measure(&outcome.timelines, cfg.pp, step).expect("step ran");
        let replay =
            simulate_costed(&program, &sim, &table, Some(&profile.durations)).expect("simulates");
        lines.push(format!(
            "{step} {} {} {} {}",
            profile.span, profile.bubble_fraction, replay.step_time_s, replay.bubble_fraction
        ));
    }
    std::fs::write(out, lines.join("\n")).expect("writable");
}

#[test]
fn the_simulator_replaying_measured_durations_never_exceeds_the_measured_step() {
    let out = std::env::temp_dir().join(format!("bfpp-bubble-{}.txt", std::process::id()));
    let exe = std::env::current_exe().expect("test binary path");
    let run = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "2",
            "-x",
            OUT_ENV,
        ])
        .env(OUT_ENV, &out)
        .arg(exe)
        .args(["--exact", "bubble_rank_process", "--ignored", "--nocapture"])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run mpirun ({e}); apt-get install openmpi-bin libopenmpi-dev")
        });
    assert!(
        run.status.success(),
        "mpirun failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let text = std::fs::read_to_string(&out).expect("rank 0 wrote its figures");
    let _ = std::fs::remove_file(&out);
    for line in text.lines() {
        let v: Vec<f64> = line
            .split(' ')
            .map(|x| x.parse().expect("number"))
            .collect();
        let (span, measured, replayed_span, replayed) = (v[1], v[2], v[3], v[4]);
        eprintln!(
            "step {}: span {span:.4} s, bubble {measured:.3}; simulator {replayed_span:.4} s, \
             bubble {replayed:.3}",
            v[0]
        );
        assert!(
            replayed_span <= span * 1.02 && replayed <= measured + 0.02,
            "step {}: the simulator replays the run's own durations into a longer step \
             ({replayed_span:.4} s, bubble {replayed:.3}) than measured ({span:.4} s, bubble \
             {measured:.3}): it waits for something the engine does not",
            v[0]
        );
    }
}
