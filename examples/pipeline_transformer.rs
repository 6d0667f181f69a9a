//! Pipeline a Burn language model built from burn-nn's `TransformerEncoderLayer`s: 2 pipeline
//! ranks × 2 loops (4 stages) × 2 data-parallel replicas, breadth-first, ZeRO-3, ranks as
//! threads on the CPU, each rank building only its own stages from the model's description.
//! The same model is trained by a plain Burn loop with burn-optim's AdamW,
//! and one JSON line compares the two: `max_rel_diff` over the losses and the final parameter
//! norm (≤ 1e-5). Run: `cargo run --release --example pipeline_transformer`
use burn::backend::{Autodiff, Flex};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::{
    flatten_params, FusedOps, Inputs, LayerStack, MicroBatch, PipelineModel, StackParts, Targets,
};

type B = Autodiff<Flex>;
const WIDTH: usize = 32; // vocabulary and hidden size
const SHAPE: [usize; 2] = [2, 16]; // samples × tokens of a micro-batch

/// The model, described: embedding → 6 causal transformer layers (dropout 0) → linear head
/// with cross-entropy. Each rank builds only its own stages from these constructors.
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

/// Micro-batch `mb` of replica `dp` at `step`: next-token prediction on a patterned sequence.
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

/// The L2 norm of every parameter, summed in f64 as the engine's `param_norm` is (an f32 sum
/// over the model's 100k values would differ from it by about 1e-5 on its own).
fn norm(model: &Whole) -> Result<f64, Box<dyn std::error::Error>> {
    let values = flatten_params(model)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>();
    let values = values.map_err(|e| format!("reading the parameters: {e:?}"))?;
    Ok(values
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dp, microbatches, steps, lr) = (2, 4, 4, 1e-3);
    let model = Lm.described(7);

    // The pipeline: breadth-first and ZeRO-3 are the defaults.
    let config = TrainConfig::new(steps)
        .with_pp(2)
        .with_loops(2)
        .with_dp(dp)
        .with_microbatches(microbatches)
        .with_lr(LrConfig::Constant(lr));
    let piped = Trainer::new(config).fit_described(&model, infallible(batch))?;

    // Plain Burn: the same model built whole on one device (the initial values every stage
    // of the pipeline started from), the mean loss over the same global batch.
    let (mut plain, mut losses): (Whole, _) = (model.build(&Default::default())?, Vec::new());
    let mut optim = AdamWConfig::new().init::<B, Whole>();
    for step in 1..=steps {
        let mut total = Tensor::<B, 1>::zeros([1], &Default::default());
        for (d, m) in (0..dp).flat_map(|d| (0..microbatches).map(move |m| (d, m))) {
            total = total + plain.loss(&batch(step, d, m))?;
        }
        let loss = total / (dp * microbatches) as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &plain);
        plain = optim.step(lr, plain, grads);
    }

    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    let plain_norm = norm(&plain)?;
    let norms = (piped.param_norm, plain_norm);
    let loss_diffs = piped.losses.iter().zip(&losses).map(|(a, b)| rel(*a, *b));
    let max_rel_diff = loss_diffs.fold(rel(norms.0, norms.1), f64::max);
    println!(
        "{{\"losses\":{:?},\"plain_losses\":{losses:?},\"param_norm\":{},\"plain_param_norm\":{},\"max_rel_diff\":{max_rel_diff:e}}}",
        piped.losses, norms.0, norms.1
    );
    Ok(())
}
