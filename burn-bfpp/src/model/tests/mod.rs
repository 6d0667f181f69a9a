//! Tests of model splitting on `Autodiff<Flex>`: the pipelined stage-by-stage backward gives
//! the single-device gradients, for the reference GPT and for a deep MLP regressor written
//! here against the same trait (to show it is not GPT-specific).

use std::ops::Range;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use super::autodiff::flatten_grads;
use super::*;

type B = Autodiff<Flex>;
type Inner = Flex;

mod mlp_regressor;
use mlp_regressor::Mlp;

// ---------------------------------------------------------------------------------------------
// Data and the two ways of computing gradients.

/// Deterministic pseudo-random numbers in [0, 1).
fn lcg(state: &mut u64) -> f64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*state >> 11) as f64 / (1u64 << 53) as f64
}

fn tokens(batch: usize, seq: usize, vocab: usize, state: &mut u64) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = (0..batch * seq)
        .map(|_| (lcg(state) * vocab as f64) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq]), &Default::default())
}

fn values(rows: usize, cols: usize, state: &mut u64) -> Tensor<B, 2> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| lcg(state) as f32 * 2.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(v, [rows, cols]), &Default::default())
}

fn gpt_batches(config: &GptConfig, count: usize, batch: usize) -> Vec<MicroBatch<B>> {
    let mut state = 7;
    (0..count)
        .map(|_| MicroBatch {
            inputs: Inputs::Tokens(tokens(batch, config.seq_len, config.vocab_size, &mut state)),
            targets: Targets::Tokens(tokens(batch, config.seq_len, config.vocab_size, &mut state)),
        })
        .collect()
}

fn mlp_batches(count: usize, batch: usize, inputs: usize, outputs: usize) -> Vec<MicroBatch<B>> {
    let mut state = 11;
    (0..count)
        .map(|_| MicroBatch {
            inputs: Inputs::Features(values(batch, inputs, &mut state)),
            targets: Targets::Values(values(batch, outputs, &mut state)),
        })
        .collect()
}

/// Runs the micro-batches through the stages breadth-first (every forward of a stage, then,
/// stages in reverse, every backward with micro-batches in reverse order), each stage and
/// micro-batch on its own graph joined by the recipe of [`super::autodiff`]. Returns the mean
/// loss and each stage's flat gradient summed over micro-batches.
fn pipelined<M: PipelineModel<B>>(
    model: &M,
    ranges: &[Range<usize>],
    batches: &[MicroBatch<B>],
) -> (f64, Vec<Tensor<Inner, 1>>) {
    let stages = model.stages(ranges).unwrap();
    let m = batches.len();
    let mut inputs: Vec<StageInput<B>> = batches
        .iter()
        .map(|b| StageInput::Data(b.inputs.clone()))
        .collect();
    // Per stage, per micro-batch: the stage's fresh-leaf copy, the input leaf (if any) and
    // the output.
    type Saved<S> = (S, Option<Tensor<B, 3>>, StageOutput<B>);
    let mut saved: Vec<Vec<Saved<M::Stage>>> = Vec::new();
    for stage in &stages {
        let mut outputs = Vec::new();
        let mut next = Vec::new();
        for (input, batch) in inputs.into_iter().zip(batches) {
            let copy = fresh_leaves(stage);
            let (leaf, input) = match input {
                StageInput::Hidden(h) => {
                    let leaf = input_leaf(h);
                    (Some(leaf.clone()), StageInput::Hidden(leaf))
                }
                data => (None, data),
            };
            let targets = stage.is_last().then_some(&batch.targets);
            let out = copy.forward(input, targets).unwrap();
            if let StageOutput::Hidden(h) = &out {
                next.push(StageInput::Hidden(h.clone()));
            }
            outputs.push((copy, leaf, out));
        }
        inputs = next;
        saved.push(outputs);
    }

    let mut grad_out: Vec<Option<Tensor<Inner, 3>>> = vec![None; m];
    let mut flats = vec![None; stages.len()];
    let mut loss_sum = 0.0;
    for s in (0..stages.len()).rev() {
        let mut acc: Option<Tensor<Inner, 1>> = None;
        for i in (0..m).rev() {
            let (copy, leaf, out) = &saved[s][i];
            let grads = match out {
                StageOutput::Loss(loss) => {
                    loss_sum += loss.clone().into_scalar().elem::<f64>();
                    loss_backward(loss, 1.0 / m as f64)
                }
                StageOutput::Hidden(h) => {
                    let g = grad_out[i].take().unwrap();
                    stage_backward(h, g).unwrap()
                }
            };
            if let Some(leaf) = leaf {
                grad_out[i] = Some(input_grad(leaf, &grads));
            }
            let g = flatten_grads(copy, &grads);
            acc = Some(match acc {
                None => g,
                Some(a) => a + g,
            });
        }
        flats[s] = acc;
    }
    let flats = flats.into_iter().map(Option::unwrap).collect();
    (loss_sum / m as f64, flats)
}

/// The unsplit model on one device: `mean(losses).backward()`.
fn single_device<M: PipelineModel<B>>(
    model: &M,
    batches: &[MicroBatch<B>],
) -> (f64, Tensor<Inner, 1>) {
    let (loss, grads) = {
        let losses: Vec<Tensor<B, 1>> = batches.iter().map(|b| model.loss(b).unwrap()).collect();
        let loss = Tensor::cat(losses, 0).mean();
        let grads = loss.backward();
        (loss, grads)
    };
    (
        loss.into_scalar().elem::<f64>(),
        flatten_grads(model, &grads),
    )
}

/// Element count of every float parameter, in visit order.
fn param_sizes<M: Module<B>>(module: &M) -> Vec<usize> {
    struct Sizes(Vec<usize>);
    impl ModuleVisitor<B> for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.shape().num_elements());
        }
    }
    let mut sizes = Sizes(Vec::new());
    module.visit(&mut sizes);
    sizes.0
}

fn to_vec(t: Tensor<Inner, 1>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// Largest relative error over parameters: per parameter, max |a − b| / max |b|.
fn max_rel_err(got: &[f32], want: &[f32], sizes: &[usize]) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut offset = 0;
    let mut worst = 0.0f64;
    for &n in sizes {
        let (g, w) = (&got[offset..offset + n], &want[offset..offset + n]);
        let scale = w.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
        let diff = g
            .iter()
            .zip(w)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
        assert!(scale > 0.0, "a parameter got no gradient at all");
        worst = worst.max(diff / scale);
        offset += n;
    }
    worst
}

/// Pipelined vs single-device: losses and every parameter gradient within `1e-5`.
fn check_equivalence<M: PipelineModel<B>>(
    model: &M,
    ranges: &[Range<usize>],
    batches: &[MicroBatch<B>],
) {
    let (loss, stage_grads) = pipelined(model, ranges, batches);
    let (want_loss, want_grads) = single_device(model, batches);
    let got = to_vec(Tensor::cat(stage_grads, 0));
    let err = max_rel_err(&got, &to_vec(want_grads), &param_sizes(model));
    let loss_err = (loss - want_loss).abs() / want_loss.abs();
    eprintln!("split {ranges:?}: max relative gradient error {err:.2e}, loss error {loss_err:.2e}");
    assert!(err <= 1e-5, "gradient relative error {err}");
    assert!(loss_err <= 1e-5, "loss {loss} vs {want_loss}");
    // Negative control: the comparison does see a gradient that misses micro-batches.
    let (_, partial) = single_device(model, &batches[..1]);
    assert!(max_rel_err(&got, &to_vec(partial), &param_sizes(model)) > 1e-2);
}

fn small_gpt() -> GptConfig {
    GptConfig {
        vocab_size: 32,
        seq_len: 8,
        hidden: 16,
        heads: 2,
        layers: 4,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn gpt_pipelined_gradients_match_single_device() {
    let config = small_gpt();
    let model = config.init_seeded::<B>(1, &Default::default()).unwrap();
    let batches = gpt_batches(&config, 3, 2);
    check_equivalence(&model, &[0..2, 2..4, 4..6], &batches);
    let balanced = split_model(&model, 4, &ModelSplit::Balanced).unwrap();
    check_equivalence(&model, &balanced, &batches);
}

#[test]
fn mlp_pipelined_gradients_match_single_device() {
    let model = Mlp::<B>::new(5, 16, 6, 3, &Default::default());
    let batches = mlp_batches(4, 3, 5, 3);
    check_equivalence(&model, &[0..1, 1..4, 4..7, 7..8], &batches);
    check_equivalence(&model, &[0..5, 5..8], &batches);
}

#[test]
fn stage_buffers_concatenate_to_the_model_buffer_and_recombine() {
    let config = small_gpt();
    let model = config.init::<B>(&Default::default()).unwrap();
    let stages = model.stages(&[0..1, 1..4, 4..6]).unwrap();
    let whole = to_vec(flatten_params(&model).inner());
    let parts: Vec<Tensor<B, 1>> = stages.iter().map(flatten_params).collect();
    assert_eq!(to_vec(Tensor::cat(parts.clone(), 0).inner()), whole);
    assert_eq!(whole.len(), model.num_params());

    // Change every stage through its flat buffer, then put the stages back into the model.
    let changed: Vec<GptStage<B>> = stages
        .into_iter()
        .zip(&parts)
        .map(|(stage, flat)| load_flat(stage, &flat.clone().mul_scalar(2.0)).unwrap())
        .collect();
    let recombined = recombine(model.clone(), &changed).unwrap();
    let doubled: Vec<f32> = whole.iter().map(|x| x * 2.0).collect();
    assert_eq!(to_vec(flatten_params(&recombined).inner()), doubled);
    // The loaded parameters are trainable leaves: the recombined model still gets gradients.
    let batch = &gpt_batches(&config, 1, 1)[0];
    let grads = recombined.loss(batch).unwrap().backward();
    assert!(to_vec(flatten_grads(&recombined, &grads))
        .iter()
        .any(|g| *g != 0.0));
}

#[test]
fn buffers_and_recombination_reject_mismatches() {
    let (a, b) = {
        let device = Default::default();
        (
            Mlp::<B>::new(2, 4, 1, 1, &device),
            Mlp::<B>::new(2, 4, 1, 1, &device),
        )
    };
    let stage = a.stage(0..2).unwrap();
    let short = Tensor::<B, 1>::zeros([3], &Default::default());
    assert!(matches!(
        load_flat(stage, &short),
        Err(ModelError::Shape { .. })
    ));
    // Stages of another model do not hold this model's parameters.
    let foreign = b.stages(&[0..1, 1..3]).unwrap();
    assert!(matches!(
        recombine(a.clone(), &foreign),
        Err(ModelError::Params(_))
    ));
    // An incomplete set of stages leaves parameters unmatched.
    let partial = a.stages(&[0..1, 1..3]).unwrap();
    assert!(matches!(
        recombine(a, &partial[..1]),
        Err(ModelError::Params(_))
    ));
}

#[test]
fn same_seed_same_model() {
    let config = small_gpt();
    let (x, y, z) = {
        let device = Default::default();
        (
            config.init_seeded::<B>(5, &device).unwrap(),
            config.init_seeded::<B>(5, &device).unwrap(),
            config.init_seeded::<B>(6, &device).unwrap(),
        )
    };
    let flat = |m: &Gpt<B>| to_vec(flatten_params(m).inner());
    assert_eq!(flat(&x), flat(&y));
    assert_ne!(flat(&x), flat(&z));
}

#[test]
fn attention_is_causal_and_stages_compose_to_the_model() {
    let config = small_gpt();
    let model = config.init::<B>(&Default::default()).unwrap();
    let mut state = 3;
    let a = tokens(1, 8, 32, &mut state);
    // Same prefix, different last token.
    let last =
        Tensor::<B, 2, Int>::from_data(TensorData::new(vec![31i64], [1, 1]), &Default::default());
    let b = Tensor::cat(vec![a.clone().narrow(1, 0, 7), last], 1);
    let la = model.forward(a.clone()).unwrap();
    let lb = model.forward(b).unwrap();
    let part = |t: &Tensor<B, 3>, start, len| {
        let values = t.clone().narrow(1, start, len).inner().into_data();
        values.to_vec::<f32>().unwrap()
    };
    assert_eq!(part(&la, 0, 7), part(&lb, 0, 7));
    assert_ne!(part(&la, 7, 1), part(&lb, 7, 1));

    let batch = &gpt_batches(&config, 1, 2)[0];
    let stages = model.stages(&[0..3, 3..4, 4..6]).unwrap();
    let composed = run_stages(&stages, batch)
        .unwrap()
        .into_scalar()
        .elem::<f64>();
    let whole = model.loss(batch).unwrap().into_scalar().elem::<f64>();
    assert!((composed - whole).abs() <= 1e-6 * whole.abs());
    // An untrained byte-level model predicts about uniformly: loss ≈ ln(vocab).
    assert!((whole - (32f64).ln()).abs() < 0.5, "loss {whole}");
}

#[test]
fn tied_head_runs_unsplit_and_refuses_to_split() {
    let config = GptConfig {
        tied_head: true,
        ..small_gpt()
    };
    let model = config.init::<B>(&Default::default()).unwrap();
    let batch = &gpt_batches(&config, 1, 1)[0];
    assert!(model.loss(batch).is_ok());
    let err = model.stages(&[0..3, 3..6]).unwrap_err();
    assert!(matches!(err, ModelError::TiedHeadAcrossStages { .. }));
    assert!(err.to_string().contains("tied_head = false"));
    // Stages holding neither the embedding nor the head are fine.
    assert!(model.stage(1..3).is_ok());
}

#[test]
fn stages_reject_wrong_inputs() {
    let config = small_gpt();
    let model = config.init::<B>(&Default::default()).unwrap();
    let stages = model.stages(&[0..2, 2..6]).unwrap();
    let batch = &gpt_batches(&config, 1, 2)[0];
    let hidden = Tensor::<B, 3>::zeros([2, 8, 16], &Default::default());
    let data = || StageInput::Data(batch.inputs.clone());
    let input_err =
        |r: Result<StageOutput<B>, ModelError>| matches!(r, Err(ModelError::StageInput { .. }));
    assert!(input_err(
        stages[0].forward(StageInput::Hidden(hidden.clone()), None)
    ));
    assert!(input_err(stages[1].forward(data(), Some(&batch.targets))));
    assert!(input_err(
        stages[1].forward(StageInput::Hidden(hidden.clone()), None)
    ));
    let narrow = Tensor::<B, 3>::zeros([2, 8, 15], &Default::default());
    assert!(matches!(
        stages[1].forward(StageInput::Hidden(narrow), Some(&batch.targets)),
        Err(ModelError::Shape { .. })
    ));
    let mut state = 1;
    let long = Inputs::Tokens(tokens(1, 9, 32, &mut state));
    assert!(matches!(
        stages[0].forward(StageInput::Data(long), None),
        Err(ModelError::Shape { .. })
    ));
    let g = Tensor::<Inner, 3>::zeros([2, 8, 4], &Default::default());
    assert!(matches!(
        stage_backward(&hidden, g),
        Err(ModelError::Shape { .. })
    ));
    assert!(matches!(model.stage(3..9), Err(ModelError::Split(_))));
    assert!(matches!(
        model.stages(&[0..2, 3..6]),
        Err(ModelError::Split(_))
    ));
}

#[test]
fn default_config_serde_and_validation() {
    let config: GptConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(config, GptConfig::default());
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<GptConfig>(&json).unwrap(), config);
    assert!(serde_json::from_str::<GptConfig>(r#"{"layerz": 3}"#).is_err());
    // The default model splits into at least 8 stages, even or cost-balanced.
    assert!(config.num_layers() >= 8);
    let costs = config.layer_costs();
    assert_eq!(balanced_split(&costs, 8).unwrap().len(), 8);
    let bad = GptConfig {
        heads: 5,
        ..GptConfig::default()
    };
    assert!(matches!(bad.validate(), Err(ModelError::Config(_))));
    let bad = GptConfig {
        dropout: 1.0,
        ..GptConfig::default()
    };
    assert!(matches!(
        bad.init::<Inner>(&Default::default()),
        Err(ModelError::Config(_))
    ));
}

/// Two threads driving stages of one shared model at the same time, with no lock, as
/// ranks-as-threads do: every run must be exact (with the published burn-autodiff 0.21.0 this
/// lost gradients; see [`super::autodiff`]).
#[test]
fn concurrent_threads_get_exact_gradients() {
    let config = small_gpt();
    let model = config.init::<B>(&Default::default()).unwrap();
    let batches = gpt_batches(&config, 3, 2);
    let (_, want) = single_device(&model, &batches);
    let want = to_vec(want);
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (model, batches, want) = (model.clone(), batches.clone(), want.clone());
            std::thread::spawn(move || {
                (0..3)
                    .map(|_| {
                        let (_, grads) = pipelined(&model, &[0..2, 2..4, 4..6], &batches);
                        let got = to_vec(Tensor::cat(grads, 0));
                        max_rel_err(&got, &want, &param_sizes(&model))
                    })
                    .fold(0.0, f64::max)
            })
        })
        .collect();
    for thread in threads {
        let err = thread.join().unwrap();
        assert!(
            err <= 1e-5,
            "relative gradient error {err} with concurrent threads"
        );
    }
}

#[test]
fn fresh_leaves_share_values_and_ids_but_not_gradients() {
    let model = Mlp::<B>::new(2, 4, 1, 1, &Default::default());
    let copy = fresh_leaves(&model);
    let ids = |m: &Mlp<B>| m.layers.iter().map(|l| l.weight.id).collect::<Vec<_>>();
    assert_eq!(ids(&model), ids(&copy));
    let flat = |m: &Mlp<B>| to_vec(flatten_params(m).inner());
    assert_eq!(flat(&model), flat(&copy));
    // Gradients of a forward through the copy belong to the copy's leaves only.
    let batch = &mlp_batches(1, 2, 2, 1)[0];
    let grads = copy.loss(batch).unwrap().backward();
    assert!(to_vec(flatten_grads(&copy, &grads))
        .iter()
        .any(|g| *g != 0.0));
    assert!(to_vec(flatten_grads(&model, &grads))
        .iter()
        .all(|g| *g == 0.0));
}

#[test]
fn the_workspace_builds_the_patched_autodiff() {
    // The workspace's [patch.crates-io] brings vendor/burn-autodiff, whose `links` metadata
    // reaches build.rs: thread ranks here must not take turns (a project without the patch
    // gets `false`, tests/downstream).
    assert!(super::autodiff::serial_autodiff(true).is_none());
}
