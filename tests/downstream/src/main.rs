//! A Burn user's program outside the burn-bfpp workspace, built against the published
//! burn-autodiff (no `[patch.crates-io]`): the layer-stack example's model (an embedding, six
//! burn-nn transformer layers and a linear head, described by `StackParts`), pipelined at
//! pp 2 × loops 2 × dp 2, breadth-first, ZeRO-3, against the same model trained by a plain
//! Burn loop with burn-optim's AdamW.
//!
//! `bfpp-downstream threads RUNS`: four thread ranks, `RUNS` times; one JSON line with every
//! run's `max_rel_diff` (over the losses and the final parameter norm), whether this build
//! has the patched autodiff, and the pipelined runs' seconds.
//! `mpirun -np 4 bfpp-downstream processes RUNS`: the same runs with the ranks as MPI
//! processes; world rank 0 prints the line.
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::comm::{CommConfig, MpiComm, RankGrid};
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::autodiff::PATCHED_AUTODIFF;
use burn_bfpp::model::{
    flatten_params, FusedOps, Inputs, LayerStack, MicroBatch, PipelineModel, StackParts, Targets,
};

type B = Autodiff<Flex>;
const WIDTH: usize = 32;
const SHAPE: [usize; 2] = [2, 16];
const STEPS: usize = 4;
const LR: f64 = 1e-3;
const PP: usize = 2;
const DP: usize = 2;
const MICROBATCHES: usize = 4;

struct Lm;

impl StackParts for Lm {
    type Input<D: FusedOps> = Embedding<D>;
    type Block<D: FusedOps> = TransformerEncoderLayer<D>;
    type Head<D: FusedOps> = Linear<D>;

    fn num_blocks(&self) -> usize {
        6
    }

    fn input<D: FusedOps>(&self, device: &D::Device) -> Embedding<D> {
        EmbeddingConfig::new(WIDTH, WIDTH).init(device)
    }

    fn block<D: FusedOps>(&self, _index: usize, device: &D::Device) -> TransformerEncoderLayer<D> {
        let config = TransformerEncoderConfig::new(WIDTH, 4 * WIDTH, 4, 1)
            .with_dropout(0.0)
            .with_norm_first(true);
        config.init::<D>(device).layers.remove(0)
    }

    fn head<D: FusedOps>(&self, device: &D::Device) -> Linear<D> {
        LinearConfig::new(WIDTH, WIDTH).init(device)
    }
}

type Whole = LayerStack<B, Embedding<B>, TransformerEncoderLayer<B>, Linear<B>>;

fn batch(step: usize, dp: usize, mb: usize) -> MicroBatch<B> {
    let start = step * 131 + dp * 17 + mb * 5;
    let ids = |shift: usize| {
        let v: Vec<i64> = (0..SHAPE[0] * SHAPE[1])
            .map(|i| ((start + i * i % 7 + i + shift) % WIDTH) as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, SHAPE), &Default::default())
    };
    MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(1)),
    }
}

fn config() -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(PP)
        .with_loops(2)
        .with_dp(DP)
        .with_microbatches(MICROBATCHES)
        .with_lr(LrConfig::Constant(LR))
}

/// Plain Burn: losses and final parameter norm of the same model on one device.
fn plain(seed: u64) -> Result<(Vec<f64>, f64), Box<dyn std::error::Error>> {
    let mut model: Whole = Lm.described(seed).build(&Default::default())?;
    let mut optim = AdamWConfig::new().init::<B, Whole>();
    let mut losses = Vec::new();
    for step in 1..=STEPS {
        let mut total = Tensor::<B, 1>::zeros([1], &Default::default());
        for (d, m) in (0..DP).flat_map(|d| (0..MICROBATCHES).map(move |m| (d, m))) {
            total = total + model.loss(&batch(step, d, m))?;
        }
        let loss = total / (DP * MICROBATCHES) as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    Ok((losses, norm(&model)?))
}

fn max_rel_diff(piped: &[f64], piped_norm: f64, plain: &[f64], plain_norm: f64) -> f64 {
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    let mut worst = rel(piped_norm, plain_norm);
    if piped.len() != plain.len() {
        return f64::INFINITY;
    }
    for (a, b) in piped.iter().zip(plain) {
        worst = worst.max(rel(*a, *b));
    }
    worst
}

/// The L2 norm of every parameter, summed in f64 as the engine's `param_norm` is (an f32 sum
/// over the model's 100k values would differ from it by about 1e-5 on its own).
fn norm(model: &Whole) -> Result<f64, Box<dyn std::error::Error>> {
    let values = flatten_params(model).into_data().convert::<f32>().into_vec::<f32>();
    let values = values.map_err(|e| format!("reading the parameters: {e:?}"))?;
    Ok(values.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "threads".into());
    let runs: u64 = args.next().map_or(Ok(1), |r| r.parse())?;
    let comm = match mode.as_str() {
        "threads" => None,
        "processes" => Some(MpiComm::<Flex>::init(
            RankGrid::new(PP, DP)?,
            Default::default(),
            CommConfig::default(),
        )?),
        other => return Err(format!("unknown mode `{other}`: threads or processes").into()),
    };
    let (mut diffs, mut seconds) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let seed = 7 + run;
        let model = Lm.described(seed);
        let started = Instant::now();
        let outcome = match &comm {
            None => Some(Trainer::new(config()).fit_described(&model, infallible(batch))?),
            Some(comm) => Trainer::new(config())
                .in_process(comm)
                .fit_described(&model, infallible(batch))?,
        };
        seconds.push(started.elapsed().as_secs_f64());
        // Only world rank 0 (every thread world) has the outcome to compare.
        if let Some(outcome) = outcome {
            let (losses, norm) = plain(seed)?;
            diffs.push(max_rel_diff(&outcome.losses, outcome.param_norm, &losses, norm));
        }
    }
    if !diffs.is_empty() {
        println!(
            "{}",
            serde_json::json!({
                "mode": mode,
                "patched_autodiff": PATCHED_AUTODIFF,
                "max_rel_diff": diffs,
                "seconds": seconds,
            })
        );
    }
    Ok(())
}
