//! Engine overhead: the pipelined engine with one rank (P = D = 1, breadth-first, ZeRO-0)
//! against a plain Burn training loop of the same model, global batch and AdamW, in the same
//! run. Both do three optimizer steps per iteration; the ratio of their medians is the
//! engine's overhead (goal: ≤ 5 %).
//!
//! The machines drift by more than 5 % within a minute, so besides criterion's two benches
//! (plain first, then the engine) the run first times the two in interleaved pairs, in
//! alternating order (plain–engine, engine–plain, …), and prints the median of the pairs'
//! ratios: the figure that goes into docs/benchmarks.md.

// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
use std::hint::black_box;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::{Gpt, GptConfig, Inputs, MicroBatch, Targets};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use criterion::{criterion_group, Criterion, SamplingMode};

type B = Autodiff<Flex>;

const M: usize = 4;
const MBS: usize = 4;
const STEPS: usize = 3;

fn gpt() -> GptConfig {
    GptConfig {
        vocab_size: 256,
        seq_len: 64,
        hidden: 64,
        heads: 4,
        layers: 4,
        mlp_ratio: 4,
        ..GptConfig::default()
    }
}

fn batch(step: usize, microbatch: usize) -> MicroBatch<B> {
    let seq = gpt().seq_len;
    let ids = |salt: usize| {
        let v: Vec<i64> = (0..MBS * seq)
            .map(|i| ((step * 7919 + microbatch * 104_729 + i * 31 + salt) % 256) as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [MBS, seq]), &Default::default())
    };
    MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(1)),
    }
}

fn model() -> Gpt<B> {
    gpt()
        .init_seeded::<B>(1, &Default::default())
        .expect("valid config")
}

fn engine_run(model: &Gpt<B>) -> Vec<f64> {
    let cfg = TrainConfig::new(STEPS)
        .with_microbatches(M)
        .with_schedule(ScheduleKind::BreadthFirst)
        .with_zero(ZeroLevel::Zero0)
        .with_lr(LrConfig::Constant(1e-3));
    Trainer::new(cfg)
        .fit(model.clone(), infallible(|s, _, m| batch(s, m)))
        .expect("engine run")
        .losses
}

fn plain_run(model: &Gpt<B>) -> Vec<f64> {
    let mut model = model.clone();
    let mut optim = AdamWConfig::new().init::<B, Gpt<B>>();
    let ce = CrossEntropyLossConfig::new().init(&Default::default());
    let mut losses = Vec::new();
    for step in 1..=STEPS {
        let mut total: Option<Tensor<B, 1>> = None;
        for m in 0..M {
            let mb = batch(step, m);
            let (Inputs::Tokens(x), Targets::Tokens(y)) = (mb.inputs, mb.targets) else {
                unreachable!("token batches")
            };
            let logits = model.forward(x).expect("forward");
            let [b, s, v] = logits.dims();
            let loss = ce.forward(logits.reshape([b * s, v]), y.reshape([b * s]));
            total = Some(total.map_or(loss.clone(), |t| t + loss));
        }
        let loss = total.expect("micro-batches") / M as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
    }
    losses
}

fn overhead(c: &mut Criterion) {
    let model = model();
    let mut group = c.benchmark_group("engine_overhead");
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function("plain_burn_3_steps", |b| {
        b.iter(|| black_box(plain_run(&model)))
    });
    group.bench_function("engine_p1_d1_3_steps", |b| {
        b.iter(|| black_box(engine_run(&model)))
    });
    group.finish();
}

/// Pairs of interleaved runs in the ratio measurement.
const PAIRS: usize = 12;

/// Times plain Burn and the engine in interleaved pairs (alternating which goes first) and
/// prints the median of the pairs' engine / plain ratios.
fn interleaved_ratio() {
    let model = model();
    // Warm-up: allocator, code paths.
    black_box(plain_run(&model));
    black_box(engine_run(&model));
    let time = |f: &dyn Fn() -> Vec<f64>| {
        let start = std::time::Instant::now();
        black_box(f());
        start.elapsed().as_secs_f64()
    };
    let mut ratios = Vec::with_capacity(PAIRS);
    let (mut plain, mut engine) = (Vec::new(), Vec::new());
    for pair in 0..PAIRS {
        let (p, e) = if pair % 2 == 0 {
            let p = time(&|| plain_run(&model));
            (p, time(&|| engine_run(&model)))
        } else {
            let e = time(&|| engine_run(&model));
            (time(&|| plain_run(&model)), e)
        };
        ratios.push(e / p);
        plain.push(p);
        engine.push(e);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "engine_overhead/interleaved: {PAIRS} pairs, median engine / plain ratio {:.3} \
         (plain median {:.1} ms, engine median {:.1} ms)",
        median(&mut ratios),
        median(&mut plain) * 1e3,
        median(&mut engine) * 1e3
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(20));
    targets = overhead
}

fn main() {
    interleaved_ratio();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
