//! Models described rather than built ([`ModelDescription`]): every layout starts from the
//! same weights without the model existing whole, a rank builds only its own layers, and
//! training a description equals plain single-device Burn training of the same model.

// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]

mod common;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn_bfpp::engine::{infallible, Trainer};
use burn_bfpp::model::{
    flatten_params, split_described, FusedOps, GptConfig, ModelDescription, ModelSplit, StackBlock,
    StackParts,
};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;

/// Every stage's flat parameters, concatenated in stage order.
fn stitched<D: ModelDescription<B>>(model: &D, ranges: &[Range<usize>]) -> Vec<f32> {
    ranges
        .iter()
        .flat_map(|r| {
            let stage = model
                .build_stage(r.clone(), &Default::default())
                .expect("builds");
            flatten_params(&stage)
                .into_data()
                .to_vec::<f32>()
                .expect("f32")
        })
        .collect()
}

#[test]
fn every_split_starts_from_the_seeded_models_weights_bitwise() {
    let config = gpt_config();
    let whole: Vec<f32> = flatten_params(&config.init_seeded::<B>(7, &Default::default()).unwrap())
        .into_data()
        .to_vec()
        .expect("f32");
    let described = config.described(7);
    let n = config.num_layers();
    for stages in [1, 2, 4, n] {
        let ranges = split_described::<B, _>(&described, stages, &ModelSplit::Even).unwrap();
        assert_eq!(stitched(&described, &ranges), whole, "{stages} stages");
    }
    let ranges = split_described::<B, _>(&described, 3, &ModelSplit::Explicit(vec![1, 5, 2]))
        .expect("explicit split");
    assert_eq!(stitched(&described, &ranges), whole, "uneven split");
    // Another seed is another model.
    let other = stitched(&config.described(8), std::slice::from_ref(&(0..n)));
    assert_ne!(other, whole);
    // A layer's values depend on its seed and index alone: the embedding of a deeper model
    // (the same layer 0) is the same.
    let deeper = GptConfig {
        layers: config.layers + 3,
        ..config.clone()
    };
    let first = |c: &GptConfig| {
        let stage = c
            .described(7)
            .build_stage(0..1, &Default::default())
            .unwrap();
        flatten_params::<B, _>(&stage)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    assert_eq!(first(&config), first(&deeper));
}

/// A stack whose constructors count what they build, by backend and block index.
#[derive(Default)]
struct Counted {
    built: Mutex<BTreeMap<(&'static str, String), usize>>,
}

impl Counted {
    fn note<D: Backend>(&self, part: String) {
        let backend = if std::any::type_name::<D>().contains("Autodiff") {
            "device"
        } else {
            "cpu draw"
        };
        *self
            .built
            .lock()
            .unwrap()
            .entry((backend, part))
            .or_default() += 1;
    }

    fn take(&self) -> BTreeMap<(&'static str, String), usize> {
        std::mem::take(&mut self.built.lock().unwrap())
    }
}

/// A block of its own: one linear layer and a residual. (Burn's `derive(Module)` takes the
/// backend parameter to be the one named `B`.)
#[derive(Module, Debug)]
struct Residual<B: Backend> {
    linear: Linear<B>,
}

impl<B: Backend> StackBlock<B> for Residual<B> {
    fn apply(&self, x: burn::tensor::Tensor<B, 3>) -> burn::tensor::Tensor<B, 3> {
        x.clone() + self.linear.forward(x).tanh()
    }
}

impl StackParts for &Counted {
    type Input<D: FusedOps> = Embedding<D>;
    type Block<D: FusedOps> = Residual<D>;
    type Head<D: FusedOps> = Linear<D>;

    fn num_blocks(&self) -> usize {
        6
    }

    fn input<D: FusedOps>(&self, device: &D::Device) -> Embedding<D> {
        self.note::<D>("input".into());
        EmbeddingConfig::new(16, 8).init(device)
    }

    fn block<D: FusedOps>(&self, index: usize, device: &D::Device) -> Residual<D> {
        self.note::<D>(format!("block {index}"));
        Residual {
            linear: LinearConfig::new(8, 8).init(device),
        }
    }

    fn head<D: FusedOps>(&self, device: &D::Device) -> Linear<D> {
        self.note::<D>("head".into());
        LinearConfig::new(8, 16).init(device)
    }
}

#[test]
fn a_stage_builds_and_draws_only_its_own_layers() {
    let counted = Counted::default();
    let model = (&counted).described(3);
    // Layers 3..5 are blocks 2 and 3.
    let stage = ModelDescription::<B>::build_stage(&model, 3..5, &Default::default()).unwrap();
    let want: BTreeMap<_, _> = [
        (("cpu draw", "block 2".to_string()), 1),
        (("cpu draw", "block 3".to_string()), 1),
        (("device", "block 2".to_string()), 1),
        (("device", "block 3".to_string()), 1),
    ]
    .into();
    assert_eq!(counted.take(), want);
    assert_eq!(stage.num_params(), 2 * (8 * 8 + 8));

    // A pipelined run builds each stage once, on its rank, and never the whole model.
    let whole = model.build::<B>(&Default::default()).unwrap();
    counted.take();
    let cfg = config(ScheduleKind::BreadthFirst, 2, 2, 1, ZeroLevel::Zero0);
    let batch = |_step: usize, _dp: usize, mb: usize| {
        let ids = |shift: usize| {
            let v: Vec<i64> = (0..8).map(|i| ((i * 3 + mb + shift) % 16) as i64).collect();
            burn::tensor::Tensor::<B, 2, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(v, [2, 4]),
                &Default::default(),
            )
        };
        burn_bfpp::model::MicroBatch {
            inputs: burn_bfpp::model::Inputs::Tokens(ids(0)),
            targets: burn_bfpp::model::Targets::Tokens(ids(1)),
        }
    };
    let described = Trainer::new(cfg.clone())
        .fit_described(&model, infallible(batch))
        .expect("trains");
    let built = counted.take();
    let devices: usize = built
        .iter()
        .filter(|((b, _), _)| *b == "device")
        .map(|(_, n)| n)
        .sum();
    assert_eq!(devices, 8, "each of the 8 layers built once: {built:?}");
    assert!(
        built.values().all(|&n| n == 1),
        "no layer built twice: {built:?}"
    );
    // The same run of the model built whole is bitwise the same run.
    let cut = Trainer::new(cfg)
        .fit(whole, infallible(batch))
        .expect("trains");
    assert_eq!(described.losses, cut.losses);
    let trained: Vec<f32> = described
        .model
        .stages
        .iter()
        .flat_map(|s| flatten_params(s).into_data().to_vec::<f32>().unwrap())
        .collect();
    let cut: Vec<f32> = flatten_params(&cut.model).into_data().to_vec().unwrap();
    assert_eq!(trained, cut);
    assert!(
        (described.param_norm
            - cut
                .iter()
                .map(|&x| f64::from(x).powi(2))
                .sum::<f64>()
                .sqrt())
        .abs()
            < 1e-9
    );
}

#[test]
fn a_described_gpt_trains_like_plain_burn() {
    let described = gpt_config().described(7);
    let mut failures = Vec::new();
    for (pp, loops, dp, zero) in [
        (1, 1, 1, ZeroLevel::Zero0),
        (2, 2, 2, ZeroLevel::Zero3),
        (4, 1, 1, ZeroLevel::Zero1),
        (2, 1, 2, ZeroLevel::Zero2),
    ] {
        let (want_losses, want_params) = reference(dp);
        let cfg = config(ScheduleKind::BreadthFirst, pp, loops, dp, zero);
        let outcome = Trainer::new(cfg)
            .fit_described(&described, infallible(batch_of(M)))
            .unwrap_or_else(|e| panic!("pp={pp} v={loops} dp={dp} {zero:?}: {e}"));
        let got: Vec<Vec<f32>> = outcome.model.stages.iter().flat_map(params).collect();
        let (loss_err, param_err) = (
            max_loss_err(&outcome.losses, &want_losses),
            max_param_err(&got, &want_params),
        );
        if !(loss_err <= 1e-5 && param_err <= 1e-5) {
            failures.push(format!(
                "pp={pp} v={loops} dp={dp} {zero:?}: loss err {loss_err:.2e}, param err \
                 {param_err:.2e}"
            ));
        }
        let norm: f64 = want_params
            .iter()
            .flatten()
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            ((outcome.param_norm - norm) / norm).abs() <= 1e-5,
            "{} vs {norm}",
            outcome.param_norm
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_cpu_draw_is_the_same_whatever_the_backend_trains() {
    // The values come from Flex whatever backend builds the stage: the inner backend (no
    // autodiff) gets exactly the autodiff backend's values.
    let described = gpt_config().described(11);
    let on_autodiff = stitched(
        &described,
        std::slice::from_ref(&(0..gpt_config().num_layers())),
    );
    let stage = ModelDescription::<Flex>::build_stage(
        &described,
        0..gpt_config().num_layers(),
        &Default::default(),
    )
    .unwrap();
    let on_flex: Vec<f32> = flatten_params(&stage).into_data().to_vec().unwrap();
    assert_eq!(on_autodiff, on_flex);
}
