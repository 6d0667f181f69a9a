//! The layer-stack example's model, data and plain-Burn baseline, shared by
//! `examples/pipeline_transformer.rs` and the user's-project check `tests/downstream`
//! (through `#[path]`): an embedding, six burn-nn transformer layers and a linear head,
//! described by its parts' constructors, and next-token prediction on a patterned sequence.

use burn::backend::{Autodiff, Flex};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::model::{
    flatten_params, FusedOps, Inputs, LayerStack, MicroBatch, PipelineModel, StackParts, Targets,
};

/// The backend both the pipeline and plain Burn train on.
pub type B = Autodiff<Flex>;
/// Vocabulary and hidden size.
pub const WIDTH: usize = 32;
/// Samples × tokens of a micro-batch.
pub const SHAPE: [usize; 2] = [2, 16];

/// The model, described: embedding → 6 causal transformer layers (dropout 0) → linear head
/// with cross-entropy. Each rank builds only its own stages from these constructors.
pub struct Lm;

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

/// The model built whole on one device (plain Burn's).
pub type Whole = LayerStack<B, Embedding<B>, TransformerEncoderLayer<B>, Linear<B>>;

/// Micro-batch `mb` of replica `dp` at `step`: next-token prediction on a patterned sequence.
pub fn batch(step: usize, dp: usize, mb: usize) -> MicroBatch<B> {
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

/// Plain Burn with burn-optim's AdamW: `model` trained for `steps` steps on the mean loss over
/// the same global batch the pipeline sees (`dp` replicas × `microbatches`); the losses and
/// the final parameter norm.
pub fn plain_burn(
    mut model: Whole,
    steps: usize,
    dp: usize,
    microbatches: usize,
    lr: f64,
) -> Result<(Vec<f64>, f64), Box<dyn std::error::Error>> {
    let mut optim = AdamWConfig::new().init::<B, Whole>();
    let mut losses = Vec::new();
    for step in 1..=steps {
        let mut total = Tensor::<B, 1>::zeros([1], &Default::default());
        for (d, m) in (0..dp).flat_map(|d| (0..microbatches).map(move |m| (d, m))) {
            total = total + model.loss(&batch(step, d, m))?;
        }
        let loss = total / (dp * microbatches) as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    Ok((losses, norm(&model)?))
}

/// The L2 norm of every parameter, summed in f64 as the engine's `param_norm` is (an f32 sum
/// over the model's 100k values would differ from it by about 1e-5 on its own).
fn norm(model: &Whole) -> Result<f64, Box<dyn std::error::Error>> {
    let values = flatten_params(model)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("reading the parameters: {e:?}"))?;
    Ok(values
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt())
}

/// The largest relative difference over the losses and the final parameter norm.
pub fn max_rel_diff(piped: &[f64], piped_norm: f64, plain: &[f64], plain_norm: f64) -> f64 {
    if piped.len() != plain.len() {
        return f64::INFINITY;
    }
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    piped
        .iter()
        .zip(plain)
        .map(|(a, b)| rel(*a, *b))
        .fold(rel(piped_norm, plain_norm), f64::max)
}
