//! The simulator's accounting against what the training engine measures on the same
//! lowered programs: peak parameter bytes per rank, and a measured step's durations replayed
//! by the simulator.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{infallible, StepProfile, TrainConfig, TrainOutcome, Trainer};
use burn_bfpp::model::{split_model, Gpt, GptConfig, Inputs, MicroBatch, PipelineModel, Targets};
use burn_bfpp::schedule::ZeroLevel;
use burn_bfpp::sim::{simulate_costed, CostTable, Dtype, SimConfig};

type B = Autodiff<Flex>;

const M: usize = 4;
const MBS: usize = 2;

fn gpt() -> GptConfig {
    GptConfig {
        vocab_size: 32,
        seq_len: 8,
        hidden: 16,
        heads: 2,
        layers: 6,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

fn model() -> Gpt<B> {
    gpt()
        .init_seeded::<B>(3, &Default::default())
        .expect("valid config")
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

fn config(dp: usize, zero: ZeroLevel, steps: usize) -> TrainConfig {
    TrainConfig::new(steps)
        .with_pp(2)
        .with_loops(2)
        .with_dp(dp)
        .with_microbatches(M)
        .with_zero(zero)
        .with_comm_timeout_secs(60.0)
}

fn run(cfg: &TrainConfig) -> TrainOutcome<Gpt<B>> {
    Trainer::new(cfg.clone())
        .fit(model(), infallible(batch))
        .expect("training runs")
}

/// The simulator configured like `cfg` with the real stages' parameter counts, f32 weights,
/// and the unit model's (irrelevant here) durations.
fn sim_table(cfg: &TrainConfig) -> (SimConfig, CostTable) {
    let program = cfg.program().expect("valid layout");
    let mut sim = SimConfig::unit();
    sim.dp = cfg.dp;
    sim.zero = cfg.zero;
    sim.dtype = Dtype::Fp32;
    sim.grad_buffers = cfg.buffers;
    let mut table =
        CostTable::new(&sim, &program.stage_ranks, program.num_ranks(), M).expect("unit costs");
    let base = model();
    let ranges = split_model(&base, program.num_stages(), &cfg.split).expect("split");
    table.parameters = base
        .stages(&ranges)
        .expect("stages")
        .iter()
        .map(|s| s.num_params() as u64)
        .collect();
    (sim, table)
}

/// Peak parameter bytes per rank: the engine's measurement against the simulator's
/// accounting on the same lowered program, within 5%. The engine keeps a ZeRO-1/2 rank's
/// owned shard as a buffer separate from its full weights (the simulator counts an fp32
/// run's full weights as the master copy), so at those levels the comparison adds that shard.
#[test]
fn peak_parameter_bytes_match_the_simulator() {
    for zero in [
        ZeroLevel::Zero0,
        ZeroLevel::Zero1,
        ZeroLevel::Zero2,
        ZeroLevel::Zero3,
    ] {
        let cfg = config(2, zero, 1);
        let outcome = run(&cfg);
        let (sim, table) = sim_table(&cfg);
        let program = cfg.program().expect("valid layout");
        let predicted = simulate_costed(&program, &sim, &table, None).expect("simulates");
        for (world, &measured) in outcome.peak_param_bytes.iter().enumerate() {
            let pp_index = world % cfg.pp;
            let separate_shard: u64 = if matches!(zero, ZeroLevel::Zero1 | ZeroLevel::Zero2) {
                program
                    .stage_ranks
                    .iter()
                    .zip(&table.parameters)
                    .filter(|&(&r, _)| r == pp_index)
                    .map(|(_, &p)| p.div_ceil(cfg.dp as u64) * 4)
                    .sum()
            } else {
                0
            };
            let expected = predicted.peak_weight_bytes[pp_index] + separate_shard;
            let err = (measured as f64 - expected as f64).abs() / expected as f64;
            eprintln!("{zero:?} rank {world}: engine {measured} B, simulator {expected} B");
            assert!(
                err <= 0.05,
                "{zero:?} rank {world}: engine held {measured} B of parameters, the simulator \
                 accounts {expected} B ({:.1}% apart)",
                err * 100.0
            );
        }
    }
}

/// A measured step's own action durations, replayed by the simulator, give back the step's
/// span: the simulator's dependency rules are the engine's. Rank threads of one process share
/// this machine's few cores, which stretches each other's actions, so a single-rank run is the
/// case where measured and replayed timing must agree without modelling that contention.
#[test]
fn replayed_durations_reproduce_a_single_rank_step() {
    let cfg = config(1, ZeroLevel::Zero0, 3).with_pp(1);
    let outcome = run(&cfg);
    let profile = StepProfile::measure(&outcome.timelines, cfg.pp, 3).expect("step 3 ran");
    let (sim, mut table) = sim_table(&cfg);
    table.optimizer = vec![0.0; 1];
    let program = cfg.program().expect("valid layout");
    let replay =
        simulate_costed(&program, &sim, &table, Some(&profile.durations)).expect("simulates");
    let err = (replay.step_time_s - profile.span).abs() / profile.span;
    eprintln!(
        "measured span {:.4} s, replayed {:.4} s",
        profile.span, replay.step_time_s
    );
    assert!(
        err <= 0.10,
        "measured span {:.4} s, replayed {:.4} s ({:.1}% apart)",
        profile.span,
        replay.step_time_s,
        err * 100.0
    );
}
