//! Engine overhead: the pipelined engine with one rank (P = D = 1, breadth-first, ZeRO-0)
//! against a plain Burn training loop of the same model, global batch and AdamW, in the same
//! run; the ratio of their times is the engine's overhead (goal: ≤ 5 %). Two sizes of GPT:
//!
//! * `tiny` (hidden 64, 4 blocks, 4 micro-batches of 4 × 64 tokens, three steps per run),
//!   where the engine's own bookkeeping would show;
//! * `wide` (hidden 1024, 8 blocks, 8 heads, ~101 M parameters, 8 micro-batches of 2 × 64
//!   tokens, two steps per run: issue 42's run of `bfpp train --plain-burn`), where the
//!   parameter-sized work per micro-batch (gradient accumulation, copies) would show.
//!
//! The machines drift by more than 5 % within a minute, so the run times the two in
//! interleaved pairs, in alternating order (plain–engine, engine–plain, …), and prints the
//! median of the pairs' ratios per size, for whole runs and for their last step alone (steady
//! state, as `bfpp train`'s tokens/s): the figures that go into docs/benchmarks.md. Then
//! criterion's two benches of the tiny size (plain first, then the engine).
//! `BFPP_BENCH_SIZES=tiny` (or `wide`) limits the pairs to one size; the wide pairs take
//! about a minute each on a 2-core machine.

// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
use std::hint::black_box;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::{FusedMode, Gpt, GptConfig, Inputs, MicroBatch, Targets};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use criterion::{criterion_group, Criterion, SamplingMode};

type B = Autodiff<Flex>;

/// One model and batch size to compare at.
struct Size {
    name: &'static str,
    gpt: GptConfig,
    /// Micro-batches per step.
    microbatches: usize,
    /// Sequences per micro-batch.
    sequences: usize,
    /// Optimizer steps per timed run.
    steps: usize,
    /// Interleaved pairs timed.
    pairs: usize,
}

const TINY: Size = Size {
    name: "tiny",
    gpt: GptConfig {
        vocab_size: 256,
        seq_len: 64,
        hidden: 64,
        heads: 4,
        layers: 4,
        mlp_ratio: 4,
        tied_head: false,
        dropout: 0.0,
        init_std: 0.02,
        fused: FusedMode::Auto,
    },
    microbatches: 4,
    sequences: 4,
    steps: 3,
    pairs: 12,
};

const WIDE: Size = Size {
    name: "wide",
    gpt: GptConfig {
        hidden: 1024,
        heads: 8,
        layers: 8,
        ..TINY.gpt
    },
    microbatches: 8,
    sequences: 2,
    steps: 2,
    pairs: 3,
};

fn batch(size: &Size, step: usize, microbatch: usize) -> MicroBatch<B> {
    let (seq, rows) = (size.gpt.seq_len, size.sequences);
    let ids = |salt: usize| {
        let v: Vec<i64> = (0..rows * seq)
            .map(|i| ((step * 7919 + microbatch * 104_729 + i * 31 + salt) % 256) as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [rows, seq]), &Default::default())
    };
    MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(1)),
    }
}

fn model(size: &Size) -> Gpt<B> {
    size.gpt
        .clone()
        .init_seeded::<B>(1, &Default::default())
        .expect("valid config")
}

/// What a timed run gives: its losses and the seconds of its last step (steady state: the
/// first step of either includes one-off work).
struct Run {
    losses: Vec<f64>,
    last_step: f64,
}

fn engine_run(size: &Size, model: &Gpt<B>) -> Run {
    let cfg = TrainConfig::new(size.steps)
        .with_microbatches(size.microbatches)
        .with_schedule(ScheduleKind::BreadthFirst)
        .with_zero(ZeroLevel::Zero0)
        .with_lr(LrConfig::Constant(1e-3));
    let outcome = Trainer::new(cfg)
        .fit(model.clone(), infallible(|s, _, m| batch(size, s, m)))
        .expect("engine run");
    Run {
        last_step: outcome.step_times.last().copied().unwrap_or(0.0),
        losses: outcome.losses,
    }
}

fn plain_run(size: &Size, model: &Gpt<B>) -> Run {
    let mut model = model.clone();
    let mut optim = AdamWConfig::new().init::<B, Gpt<B>>();
    let ce = CrossEntropyLossConfig::new().init(&Default::default());
    let mut losses = Vec::new();
    let m_count = size.microbatches;
    let mut last_step = 0.0;
    for step in 1..=size.steps {
        let start = std::time::Instant::now();
        let mut total: Option<Tensor<B, 1>> = None;
        for m in 0..m_count {
            let mb = batch(size, step, m);
            let (Inputs::Tokens(x), Targets::Tokens(y)) = (mb.inputs, mb.targets) else {
                unreachable!("token batches")
            };
            let logits = model.forward(x).expect("forward");
            let [b, s, v] = logits.dims();
            let loss = ce.forward(logits.reshape([b * s, v]), y.reshape([b * s]));
            total = Some(total.map_or(loss.clone(), |t| t + loss));
        }
        let loss = total.expect("micro-batches") / m_count as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
        last_step = start.elapsed().as_secs_f64();
    }
    Run { losses, last_step }
}

fn overhead(c: &mut Criterion) {
    let model = model(&TINY);
    let mut group = c.benchmark_group("engine_overhead");
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function("plain_burn_3_steps", |b| {
        b.iter(|| black_box(plain_run(&TINY, &model).losses))
    });
    group.bench_function("engine_p1_d1_3_steps", |b| {
        b.iter(|| black_box(engine_run(&TINY, &model).losses))
    });
    group.finish();
}

/// Times plain Burn and the engine in interleaved pairs (alternating which goes first) and
/// prints the median of the pairs' engine / plain ratios; checks that both give the same
/// losses.
fn interleaved_ratio(size: &Size) {
    let model = model(size);
    // Warm-up: allocator, code paths; and the two must train alike.
    let plain_losses = plain_run(size, &model).losses;
    let engine_losses = engine_run(size, &model).losses;
    for (p, e) in plain_losses.iter().zip(&engine_losses) {
        assert!(
            (p - e).abs() <= 1e-4 * p.abs().max(1.0),
            "{}: plain Burn's losses {plain_losses:?}, the engine's {engine_losses:?}",
            size.name
        );
    }
    // Seconds of the whole run, and of its last step.
    let time = |f: &dyn Fn() -> Run| {
        let start = std::time::Instant::now();
        let run = black_box(f());
        (start.elapsed().as_secs_f64(), run.last_step)
    };
    let pairs = size.pairs;
    let mut ratios = Vec::with_capacity(pairs);
    let mut step_ratios = Vec::with_capacity(pairs);
    let (mut plain, mut engine) = (Vec::new(), Vec::new());
    for pair in 0..pairs {
        let (p, e) = if pair % 2 == 0 {
            let p = time(&|| plain_run(size, &model));
            (p, time(&|| engine_run(size, &model)))
        } else {
            let e = time(&|| engine_run(size, &model));
            (time(&|| plain_run(size, &model)), e)
        };
        ratios.push(e.0 / p.0);
        step_ratios.push(e.1 / p.1);
        plain.push(p.0);
        engine.push(e.0);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "engine_overhead/interleaved/{}: {pairs} pairs of {} steps, median engine / plain ratio \
         {:.3} (plain median {:.1} ms, engine median {:.1} ms; ratios {ratios:.3?}); last \
         step alone: median ratio {:.3} ({step_ratios:.3?})",
        size.name,
        size.steps,
        median(&mut ratios.clone()),
        median(&mut plain) * 1e3,
        median(&mut engine) * 1e3,
        median(&mut step_ratios.clone())
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
    let sizes = std::env::var("BFPP_BENCH_SIZES").unwrap_or_else(|_| "tiny,wide".into());
    for size in [&TINY, &WIDE] {
        if sizes.split(',').any(|s| s.trim() == size.name) {
            interleaved_ratio(size);
        }
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
