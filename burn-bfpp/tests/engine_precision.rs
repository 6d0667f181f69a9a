//! Mixed precision: pipelined, sharded training in bf16 and f16 against an independent
//! single-device mixed-precision loop in plain Burn, and f16 dynamic loss scaling.
//!
//! The reference keeps fp32 master parameters, casts the whole model to the compute dtype
//! every step, runs each micro-batch's forward and backward in that dtype, casts the
//! gradients to fp32, sums them in fp32 and applies Burn's own AdamW to the fp32 parameters.
//! In f16 each micro-batch's loss is multiplied by `scale / M` before its backward — the
//! scaled mean loss of its replica, as each data-parallel replica scales its own loss — and
//! the fp32 gradients are divided by `scale · D`. (With `scale / (D·M)` instead, the f16
//! gradients would be half as large and the smallest of them would round differently in
//! f16's subnormal range: a different, equally valid, computation.)

// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
mod common;

use std::collections::HashMap;

use burn::backend::Flex;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{DType, Tensor};
use burn_bfpp::engine::{LossScaling, Precision};
use burn_bfpp::model::{Gpt, Inputs, Targets};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;

const DP: usize = 2;

/// The model with every float parameter cast to `dtype` (same parameter ids).
fn cast_model(model: &Gpt<B>, dtype: DType) -> Gpt<B> {
    struct Cast(DType);
    impl ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, value, _) = param.consume();
            let half = Tensor::<B, D>::from_inner(value.inner().cast(self.0)).require_grad();
            Param::initialized(id, half)
        }
    }
    model.clone().map(&mut Cast(dtype))
}

/// Gradients of `model`'s parameters in `grads`, as fp32 values divided by `scale`.
fn fp32_grads(
    model: &Gpt<B>,
    grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
    scale: f32,
) -> HashMap<ParamId, Vec<f32>> {
    struct Collect<'a>(
        &'a <B as burn::tensor::backend::AutodiffBackend>::Gradients,
        f32,
        HashMap<ParamId, Vec<f32>>,
    );
    impl ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = param.val().grad(self.0) {
                let v: Vec<f32> = g.cast(DType::F32).into_data().to_vec().expect("f32");
                self.2
                    .insert(param.id, v.into_iter().map(|x| x / self.1).collect());
            }
        }
    }
    let mut c = Collect(grads, scale, HashMap::new());
    model.visit(&mut c);
    c.2
}

/// Register the summed fp32 gradients for Burn's optimizer, shaped like the fp32 parameters.
fn gradients_params(master: &Gpt<B>, sums: &HashMap<ParamId, Vec<f32>>) -> GradientsParams {
    struct Register<'a>(&'a HashMap<ParamId, Vec<f32>>, GradientsParams);
    impl ModuleVisitor<B> for Register<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(v) = self.0.get(&param.id) {
                let shape = param.val().dims();
                let data = burn::tensor::TensorData::new(v.clone(), shape);
                let t = Tensor::<Flex, D>::from_data(data, &Default::default());
                self.1.register::<Flex, D>(param.id, t);
            }
        }
    }
    let mut r = Register(sums, GradientsParams::new());
    master.visit(&mut r);
    r.1
}

/// Plain-Burn mixed-precision training on one device: losses and final fp32 parameters.
fn reference(dtype: DType, loss_scale: f32) -> (Vec<f64>, Vec<Vec<f32>>) {
    let mut master = model();
    let mut optim = adamw().init::<B, Gpt<B>>();
    let ce = CrossEntropyLossConfig::new().init(&Default::default());
    let mut losses = Vec::new();
    let n = (DP * M) as f32;
    for step in 1..=STEPS {
        let half = cast_model(&master, dtype);
        let mut sums: HashMap<ParamId, Vec<f32>> = HashMap::new();
        let mut loss_sum = 0.0;
        for d in 0..DP {
            for m in 0..M {
                let mb = batch(step, d, m);
                let (Inputs::Tokens(x), Targets::Tokens(y)) = (mb.inputs, mb.targets) else {
                    unreachable!("the GPT batches are tokens")
                };
                let logits = half.forward(x).expect("forward");
                assert_eq!(logits.dtype(), dtype, "the reference computes in {dtype:?}");
                let [b, s, v] = logits.dims();
                let loss = ce.forward(logits.reshape([b * s, v]), y.reshape([b * s]));
                loss_sum += loss.clone().into_scalar() as f64;
                let grads = loss.mul_scalar(loss_scale / M as f32).backward();
                for (id, g) in fp32_grads(&half, &grads, loss_scale * DP as f32) {
                    match sums.get_mut(&id) {
                        Some(acc) => acc.iter_mut().zip(g).for_each(|(a, x)| *a += x),
                        None => {
                            sums.insert(id, g);
                        }
                    }
                }
            }
        }
        losses.push(loss_sum / n as f64);
        let grads = gradients_params(&master, &sums);
        master = optim.step(lr_at(step), master, grads);
    }
    (losses, params(&master))
}

/// Breadth-first P=2, V=2, D=2, ZeRO-3 in `precision` against the reference.
fn check(precision: Precision, loss_tol: f64, param_tol: f64) {
    let cfg = config(ScheduleKind::BreadthFirst, 2, 2, DP, ZeroLevel::Zero3);
    check_layout(cfg, precision, loss_tol, param_tol);
}

/// `cfg` run in `precision` against the reference.
fn check_layout(
    mut cfg: burn_bfpp::engine::TrainConfig,
    precision: Precision,
    loss_tol: f64,
    param_tol: f64,
) {
    cfg.precision = precision;
    // A scale whose gradients fit f16 from the first step (2^16, the default, overflows on
    // this model's first steps; the overflow test covers that path).
    cfg.loss_scaling.initial_scale = 1024.0;
    let outcome = train(&model(), &cfg).unwrap_or_else(|e| panic!("{precision}: {e}"));
    assert!(
        outcome.skipped_steps.is_empty(),
        "{precision}: no step overflows"
    );
    let scale = if precision == Precision::F16 {
        cfg.loss_scaling.initial_scale as f32
    } else {
        1.0
    };
    let (want_losses, want_params) = reference(precision.dtype(), scale);
    let got_params = params(&outcome.model);
    let loss_err = max_loss_err(&outcome.losses, &want_losses);
    let param_err = max_param_err(&got_params, &want_params);
    // How far the same training in fp32 is: the engine must be closer than that to the
    // reference of its own precision, or the comparison could not tell precisions apart.
    let (_, fp32_params) = common::reference(DP);
    let fp32_gap = max_param_err(&got_params, &fp32_params);
    println!(
        "{precision}: loss err {loss_err:.2e}, param err {param_err:.2e}, param gap to fp32 \
         training {fp32_gap:.2e}; losses {:?} vs {want_losses:?}",
        outcome.losses
    );
    assert!(
        param_err < fp32_gap,
        "{precision}: as close to fp32 training ({fp32_gap:.2e}) as to {precision} training"
    );
    assert!(
        loss_err <= loss_tol && param_err <= param_tol,
        "{precision}: loss err {loss_err:.2e} (tol {loss_tol:.0e}), param err {param_err:.2e} \
         (tol {param_tol:.0e})"
    );
    // Master weights come back fp32, not rounded to the compute dtype.
    let rounded = got_params
        .iter()
        .flatten()
        .any(|&w| (w - half_round(w, precision.dtype())).abs() > 0.0);
    assert!(
        rounded,
        "{precision}: the trained parameters are fp32 master weights"
    );
}

/// `w` rounded to `dtype` and back.
fn half_round(w: f32, dtype: DType) -> f32 {
    Tensor::<Flex, 1>::from_floats([w], &Default::default())
        .cast(dtype)
        .cast(DType::F32)
        .into_scalar()
}

#[test]
fn bf16_pipelined_training_matches_single_device_bf16() {
    check(Precision::Bf16, 1e-2, 1e-2);
}

/// ZeRO-0 keeps its module gathered (cast at start-up and after every update, not by
/// UNSHARD), and recomputation runs each forward twice in the compute dtype.
#[test]
fn bf16_zero0_with_recomputation_matches_single_device_bf16() {
    let mut cfg = config(ScheduleKind::OneFOneB, 2, 1, DP, ZeroLevel::Zero0);
    cfg.recompute = true;
    check_layout(cfg, Precision::Bf16, 1e-2, 1e-2);
}

/// Split backwards in half precision: a deferred weight gradient's operands keep the dtypes
/// the backward gave them (the head's output gradient is not the compute dtype), and `W`
/// accumulates in fp32 like `B`.
#[test]
fn split_backwards_in_half_precision_match_single_device() {
    for (kind, loops) in [
        (ScheduleKind::ZeroBubbleH1, 1),
        (ScheduleKind::BreadthFirstZeroBubble, 2),
    ] {
        let cfg = config(kind, 2, loops, DP, ZeroLevel::Zero3);
        check_layout(cfg.clone(), Precision::Bf16, 1e-2, 1e-2);
        check_layout(cfg, Precision::F16, 1e-3, 1e-3);
    }
}

#[test]
fn f16_pipelined_training_matches_single_device_f16() {
    check(Precision::F16, 1e-3, 1e-3);
}

#[test]
fn f16_overflow_skips_the_step_halves_the_scale_and_training_goes_on() {
    let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, DP, ZeroLevel::Zero3);
    cfg.precision = Precision::F16;
    // 2^18 / M = 2^16 as the f16 backward seed is above f16's largest value 65504: the
    // first step's gradients are infinite for sure. The scale must come down by halvings
    // (a few skipped steps) until the gradients fit, then training goes on.
    let initial = 262_144.0;
    cfg.loss_scaling = LossScaling {
        initial_scale: initial,
        growth_interval: 1000,
    };
    let steps = 7;
    cfg.steps = steps;
    let base = model();
    let outcome = train(&base, &cfg).expect("f16 run");
    let skipped = outcome.skipped_steps.clone();
    println!("skipped {skipped:?}, final scale {}", outcome.loss_scale);
    assert!(
        !skipped.is_empty() && skipped[0] == 1,
        "step 1 overflows: {skipped:?}"
    );
    let k = skipped.len();
    assert_eq!(
        skipped,
        (1..=k).collect::<Vec<_>>(),
        "once it fits, it keeps fitting"
    );
    assert!(
        k < steps,
        "training went on after the overflows: {skipped:?}"
    );
    assert_eq!(
        outcome.loss_scale,
        initial / f64::powi(2.0, k as i32),
        "halved once per skipped step"
    );
    assert!(
        outcome.losses.iter().all(|l| l.is_finite()),
        "{:?}",
        outcome.losses
    );
    assert_ne!(
        params(&base),
        params(&outcome.model),
        "the later steps updated the weights"
    );
}

#[test]
fn f16_scale_doubles_after_the_growth_interval() {
    let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, DP, ZeroLevel::Zero3);
    cfg.precision = Precision::F16;
    cfg.loss_scaling = LossScaling {
        initial_scale: 1024.0,
        growth_interval: 1,
    };
    let outcome = train(&model(), &cfg).expect("f16 run");
    assert!(outcome.skipped_steps.is_empty());
    assert_eq!(
        outcome.loss_scale,
        1024.0 * 8.0,
        "doubled after each of the 3 steps"
    );
}

#[test]
fn bad_loss_scaling_is_refused_at_start_up() {
    let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, DP, ZeroLevel::Zero3);
    cfg.precision = Precision::F16;
    cfg.loss_scaling.growth_interval = 0;
    let err = train(&model(), &cfg)
        .expect_err("growth interval 0")
        .to_string();
    assert!(err.contains("growth interval"), "{err}");
}

/// At ZeRO-3 a rank holds gathered weights in the compute dtype beside its fp32 shard: bf16
/// holds fewer parameter bytes than fp32 (half for the gathered copies).
#[test]
fn bf16_gathered_weights_take_fewer_bytes() {
    let peak = |precision| {
        let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, DP, ZeroLevel::Zero3);
        cfg.precision = precision;
        let outcome = train_for(&model(), &cfg, 1).expect("run");
        outcome
            .peak_param_bytes
            .iter()
            .copied()
            .max()
            .expect("ranks")
    };
    let (fp32, bf16) = (peak(Precision::Fp32), peak(Precision::Bf16));
    assert!(bf16 < fp32, "bf16 peak {bf16} B, fp32 peak {fp32} B");
}
