//! Equivalence with Burn: a small two-layer network trained by Burn's own `AdamW` on
//! `Autodiff<Flex>`, and the same parameters as one flat buffer, padded and split into shards,
//! each updated by a [`ShardOptimizer`] on `Flex`, agree after every step.
//!
//! Both sides see the same gradient sequence: the gradients of a loss at the reference
//! parameters, flattened for the shards with the engine's own [`flatten_grads`]. Since
//! [`ShardOptimizer::step`] runs Burn's tensor operations in Burn's order, the measured
//! difference is 0 (bit-identical); the tests allow a relative error of 1e-6.

use std::collections::HashSet;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use super::*;
use crate::host_read::{read, ReadPurpose};
use crate::model::autodiff::flatten_grads;
use crate::model::{flatten_params, load_flat};

type B = Autodiff<Flex>;
type Inner = Flex;

/// Relative errors are taken against `max(|expected|, FLOOR)` so that a parameter that
/// happens to pass near zero does not turn a rounding difference into a huge ratio.
const FLOOR: f32 = 1e-6;
const TOLERANCE: f32 = 1e-6;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
}

impl<B: Backend> Net<B> {
    /// 3 → 5 → 2 with biases: 20 + 12 = 32 parameters (so 3 shards pad 1, 5 shards pad 3).
    fn new(device: &B::Device) -> Self {
        let net = Net {
            first: LinearConfig::new(3, 5).init(device),
            second: LinearConfig::new(5, 2).init(device),
        };
        // Deterministic values instead of the random initialisation, so the measured
        // errors are reproducible.
        let n = net.num_params();
        let values: Vec<f32> = (0..n).map(|i| 0.5 * (0.7 * i as f32 + 0.3).sin()).collect();
        let flat = Tensor::from_data(TensorData::new(values, [n]), device);
        match load_flat(net, &flat) {
            Ok(net) => net,
            Err(e) => panic!("load_flat: {e}"),
        }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let hidden = self.first.forward(x).tanh();
        (self.second.forward(hidden) - y).square().mean()
    }
}

/// A batch of 4 rows that changes with the step, so every step has a different gradient.
fn batch<B: Backend>(step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let s = step as f32;
    let x: Vec<f32> = (0..12)
        .map(|i| (1.3 * (i / 3) as f32 + 0.7 * (i % 3) as f32 + 0.41 * s).sin())
        .collect();
    let y: Vec<f32> = (0..8)
        .map(|i| 2.0 * (0.9 * i as f32 - 0.23 * s).cos())
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [4, 3]), device),
        Tensor::from_data(TensorData::new(y, [4, 2]), device),
    )
}

fn host(t: &Tensor<Inner, 1>) -> Vec<f32> {
    t.to_data()
        .to_vec::<f32>()
        .unwrap_or_else(|e| panic!("reading a tensor back: {e:?}"))
}

/// Appends zeros up to `padded` elements, as the engine pads a stage's flat buffer.
fn pad(flat: Tensor<Inner, 1>, padded: usize) -> Tensor<Inner, 1> {
    let [n] = flat.dims();
    if padded == n {
        return flat;
    }
    let zeros = Tensor::zeros([padded - n], &flat.device());
    Tensor::cat(vec![flat, zeros], 0)
}

fn split(flat: &Tensor<Inner, 1>, shards: usize, len: usize) -> Vec<Tensor<Inner, 1>> {
    (0..shards)
        .map(|i| flat.clone().narrow(0, i * len, len))
        .collect()
}

struct Case {
    settings: AdamWSettings,
    schedule: LrSchedule,
    shards: usize,
    steps: usize,
    /// Global clipping threshold (0: off).
    max_norm: f64,
}

struct Outcome {
    max_rel: f32,
    /// How many steps actually clipped (coefficient < 1).
    clipped_steps: usize,
}

/// Trains the reference and the shards side by side, checking after every step.
fn run(case: &Case) -> Outcome {
    // Other tests of this binary record autodiff graphs on other threads; Burn 0.21's
    // registry is process-wide (see crate::model::autodiff).
    let device = Default::default();
    let mut model = Net::<B>::new(&device);
    let mut optim = case.settings.to_burn().init::<B, Net<B>>();

    let numel = model.num_params();
    let initial = host(&flatten_params(&model).inner());
    let len = numel.div_ceil(case.shards);
    let padded = len * case.shards;
    let mut owned = split(
        &pad(flatten_params(&model).inner(), padded),
        case.shards,
        len,
    );
    let mut optims: Vec<ShardOptimizer<Inner>> = (0..case.shards)
        .map(|_| ShardOptimizer::new(len, case.settings.clone(), &device))
        .collect();

    let mut outcome = Outcome {
        max_rel: 0.0,
        clipped_steps: 0,
    };
    for step in 1..=case.steps {
        let lr = case.schedule.lr(step);
        let (x, y) = batch::<B>(step, &device);
        let raw = model.loss(x, y).backward();
        let flat_grad = pad(flatten_grads(&model, &raw), padded);
        let grads = GradientsParams::from_grads(raw, &model);

        // Reference: global clipping by hand, then Burn's AdamW (no Burn clipping).
        let reference_c = clip_coefficient(reference_sq_norm(&model, &grads), case.max_norm);
        let grads = reference_clip(&model, grads, reference_c);
        model = optim.step(lr, model, grads);

        // Shards: partial sums of squares, "all-reduced" by summing, one coefficient.
        let grad_shards = split(&flat_grad, case.shards, len);
        let total: f64 = grad_shards.iter().map(sq_norm).sum();
        let c = clip_coefficient(total, case.max_norm);
        assert!(
            (c - reference_c).abs() <= 1e-12 * reference_c,
            "step {step}: sharded coefficient {c} vs reference {reference_c}"
        );
        if c < 1.0 {
            outcome.clipped_steps += 1;
        }
        for ((param, grad), opt) in owned.iter_mut().zip(grad_shards).zip(&mut optims) {
            *param = match opt.step(lr, param.clone(), clip_grad(grad, c)) {
                Ok(updated) => updated,
                Err(e) => panic!("step {step}: {e}"),
            };
            assert_eq!(opt.steps(), step);
        }

        let got = host(&Tensor::cat(owned.clone(), 0));
        let expected = host(&flatten_params(&model).inner());
        assert!(
            got[numel..].iter().all(|&p| p == 0.0),
            "step {step}: padding changed: {:?}",
            &got[numel..]
        );
        for (i, (&g, &e)) in got.iter().zip(&expected).enumerate() {
            let rel = (g - e).abs() / e.abs().max(FLOOR);
            assert!(
                rel <= TOLERANCE,
                "step {step}, element {i}: sharded {g} vs Burn {e} (relative error {rel})"
            );
            outcome.max_rel = outcome.max_rel.max(rel);
        }
        // The parameters must actually move, or the comparison would prove nothing.
        assert_ne!(
            got[..numel],
            initial[..],
            "step {step}: nothing was trained"
        );
    }
    eprintln!(
        "shards = {}, steps = {}: max relative error vs Burn AdamW = {:e}",
        case.shards, case.steps, outcome.max_rel
    );
    outcome
}

#[test]
fn matches_burn_adamw_with_default_settings() {
    for shards in [1, 2, 3, 5] {
        let outcome = run(&Case {
            settings: AdamWSettings::default(),
            schedule: LrSchedule::constant(1e-2),
            shards,
            steps: 3,
            max_norm: 0.0,
        });
        // Same backend, same operations in the same order: bit-identical. This is stricter
        // than the contract (1e-6) and catches reorderings whose effect would stay below it.
        assert_eq!(
            outcome.max_rel, 0.0,
            "{shards} shards: not bit-identical to Burn"
        );
    }
}

#[test]
fn matches_burn_adamw_with_weight_decay_and_a_changing_lr() {
    let settings = AdamWSettings {
        beta1: 0.8,
        beta2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
    // Warm-up over 2 steps, cosine to step 5: a different learning rate every step.
    let schedule = LrSchedule::warmup_cosine(0.05, 0.005, 2, 5);
    let lrs: Vec<f64> = (1..=5).map(|s| schedule.lr(s)).collect();
    assert!(lrs.windows(2).all(|w| w[0] != w[1]), "{lrs:?}");
    for shards in [2, 3] {
        run(&Case {
            settings: settings.clone(),
            schedule,
            shards,
            steps: 5,
            max_norm: 0.0,
        });
    }
}

#[test]
fn matches_burn_adamw_without_weight_decay() {
    // λ = 0 takes Burn's `decay_rate == 0.0` branch (no multiplication at all).
    let settings = AdamWSettings {
        weight_decay: 0.0,
        ..AdamWSettings::default()
    };
    run(&Case {
        settings,
        schedule: LrSchedule::constant(3e-3),
        shards: 3,
        steps: 3,
        max_norm: 0.0,
    });
}

#[test]
fn matches_burn_adamw_with_global_clipping() {
    let outcome = run(&Case {
        settings: AdamWSettings {
            weight_decay: 0.01,
            ..AdamWSettings::default()
        },
        schedule: LrSchedule::warmup_cosine(0.02, 0.0, 1, 4),
        shards: 3,
        steps: 4,
        max_norm: 0.05,
    });
    assert_eq!(outcome.clipped_steps, 4, "the threshold must actually clip");
}

#[test]
fn shard_sums_of_squares_equal_the_reference() {
    let device = Default::default();
    let model = Net::<B>::new(&device);
    let (x, y) = batch::<B>(1, &device);
    let raw = model.loss(x, y).backward();
    let flat = pad(flatten_grads(&model, &raw), 33);
    let grads = GradientsParams::from_grads(raw, &model);

    let reference = reference_sq_norm(&model, &grads);
    let on_host: f64 = host(&flat).iter().map(|&g| (g as f64) * (g as f64)).sum();
    let sharded: f64 = split(&flat, 3, 11).iter().map(sq_norm).sum();
    assert!(reference > 0.0);
    assert!((sharded - reference).abs() <= 1e-14 * reference);
    assert!((on_host - reference).abs() <= 1e-14 * reference);

    // Hand-computed: 3² + 4² + 0² = 25.
    let t = Tensor::<Inner, 1>::from_floats([3.0, 4.0, 0.0], &device);
    assert_eq!(sq_norm(&t), 25.0);

    // Clipping scales every reference gradient by the same factor.
    let c = 0.5;
    let clipped = reference_clip(&model, grads, c);
    let after = reference_sq_norm(&model, &clipped);
    assert!((after - 0.25 * reference).abs() <= 1e-6 * reference);
}

#[test]
fn padding_stays_zero_and_mismatches_are_errors() {
    let device = Default::default();
    let mut opt = ShardOptimizer::<Inner>::new(4, AdamWSettings::default(), &device);
    let mut param = Tensor::<Inner, 1>::from_floats([0.5, -0.25, 0.0, 0.0], &device);
    for step in 1..=3 {
        let grad = Tensor::<Inner, 1>::from_floats([0.1 * step as f32, -0.2, 0.0, 0.0], &device);
        param = match opt.step(1e-2, param, grad) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
    }
    let values = host(&param);
    assert_eq!(&values[2..], &[0.0, 0.0]);
    assert!(values[0] != 0.5 && values[1] != -0.25);
    assert_eq!(opt.steps(), 3);

    let wrong = Tensor::<Inner, 1>::zeros([5], &device);
    let err = opt
        .step(1e-2, wrong.clone(), Tensor::zeros([4], &device))
        .unwrap_err();
    assert_eq!(
        err,
        OptimError::ShardLength {
            what: "the parameter shard",
            expected: 4,
            got: 5
        }
    );
    let err = opt
        .step(1e-2, Tensor::zeros([4], &device), wrong)
        .unwrap_err();
    assert!(
        err.to_string().contains("gradient shard has 5 elements"),
        "{err}"
    );
    let err = opt
        .step(
            f64::NAN,
            Tensor::zeros([4], &device),
            Tensor::zeros([4], &device),
        )
        .unwrap_err();
    assert!(matches!(err, OptimError::LearningRate(_)));
    // Rejected steps do not advance the counter.
    assert_eq!(opt.steps(), 3);
}

#[test]
fn settings_default_to_burns_and_round_trip() {
    assert_eq!(
        burn::config::config_to_json(&AdamWSettings::default().to_burn()),
        burn::config::config_to_json(&AdamWConfig::new())
    );
    let settings = AdamWSettings {
        beta1: 0.85,
        weight_decay: 0.05,
        ..AdamWSettings::default()
    };
    let json = serde_json::to_string(&settings).expect("serialize");
    let back: AdamWSettings = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, settings);
    // Missing fields take Burn's defaults.
    let partial: AdamWSettings = serde_json::from_str(r#"{"weight_decay":0.0}"#).expect("partial");
    assert_eq!(
        partial,
        AdamWSettings {
            weight_decay: 0.0,
            ..AdamWSettings::default()
        }
    );
    assert!(AdamWSettings::default().validate().is_ok());
    for bad in [
        AdamWSettings {
            beta1: 1.0,
            ..AdamWSettings::default()
        },
        AdamWSettings {
            epsilon: 0.0,
            ..AdamWSettings::default()
        },
        AdamWSettings {
            weight_decay: -0.1,
            ..AdamWSettings::default()
        },
    ] {
        assert!(matches!(bad.validate(), Err(OptimError::Settings(_))));
    }
}

#[test]
fn restoring_from_state_continues_identically() {
    let device = Default::default();
    let settings = AdamWSettings::default();
    let grad = |step: usize| {
        Tensor::<Inner, 1>::from_floats([0.3 - 0.1 * step as f32, 0.05 * step as f32, 0.0], &device)
    };
    let mut opt = ShardOptimizer::<Inner>::new(3, settings.clone(), &device);
    let mut param = Tensor::<Inner, 1>::from_floats([1.0, -2.0, 0.0], &device);
    for step in 1..=2 {
        param = opt.step(1e-2, param, grad(step)).expect("step");
    }
    let mut restored = ShardOptimizer::from_state(
        settings.clone(),
        opt.first_moment().clone(),
        opt.second_moment().clone(),
        opt.steps(),
    )
    .expect("restore");
    let a = opt.step(5e-3, param.clone(), grad(3)).expect("step");
    let b = restored.step(5e-3, param, grad(3)).expect("step");
    assert_eq!(host(&a), host(&b));
    assert_eq!(restored.steps(), 3);

    let err = ShardOptimizer::<Inner>::from_state(
        settings,
        Tensor::zeros([3], &device),
        Tensor::zeros([4], &device),
        1,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        OptimError::ShardLength {
            expected: 3,
            got: 4,
            ..
        }
    ));
}

// The single-device reference of global gradient-norm clipping (see `clip`'s module
// documentation): Burn's own clipping is per parameter tensor, so the reference clips by hand.

/// The sum of the squares of a gradient shard's elements, accumulated in `f64` on the host in
/// element order (deterministic: it does not depend on a device's reduction order): the
/// single-device reference's norm.
///
/// Padding (zeros) contributes nothing. This reads the shard back to the host.
fn sq_norm<B: Backend>(shard: &Tensor<B, 1>) -> f64 {
    // A reference computation: a read failure is a broken device, not a user error.
    let data = read(shard.clone(), ReadPurpose::Sync).expect("the shard is readable");
    // Each `f32` square is exact in `f64` (48 significant bits), so only the additions round.
    data.iter::<f64>().map(|x| x * x).sum()
}

/// The single-device reference of the global squared gradient norm: the sum over all float
/// parameters of `module` (in visit order, each parameter once, even if shared) of
/// [`sq_norm`] of its gradient in `grads`; parameters without a gradient contribute 0.
fn reference_sq_norm<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &GradientsParams) -> f64 {
    struct SqNorm<'a> {
        grads: &'a GradientsParams,
        seen: HashSet<ParamId>,
        total: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for SqNorm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.seen.insert(param.id) {
                return;
            }
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                let n = grad.shape().num_elements();
                self.total += sq_norm(&grad.reshape([n]));
            }
        }
    }
    let mut visitor = SqNorm {
        grads,
        seen: HashSet::new(),
        total: 0.0,
    };
    module.visit(&mut visitor);
    visitor.total
}

/// The single-device reference of the clipping: every gradient of `module`'s parameters in
/// `grads` scaled by `coefficient` with [`clip_grad`] (each parameter once, even if shared).
///
fn reference_clip<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: GradientsParams,
    coefficient: f64,
) -> GradientsParams {
    if coefficient == 1.0 {
        return grads;
    }
    struct Clip {
        grads: GradientsParams,
        seen: HashSet<ParamId>,
        coefficient: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Clip {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.seen.insert(param.id) {
                return;
            }
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads
                    .register(param.id, clip_grad(grad, self.coefficient));
            }
        }
    }
    let mut visitor = Clip {
        grads,
        seen: HashSet::new(),
        coefficient,
    };
    module.visit(&mut visitor);
    visitor.grads
}
