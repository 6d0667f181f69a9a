//! The engine on a CubeCL backend: pipelined, sharded training on `Autodiff<Wgpu>` matches
//! plain single-device Burn training on the same backend. Runs on any Vulkan/Metal/DX12
//! adapter; on a machine without a GPU, Mesa's software Vulkan driver (lavapipe) provides
//! one (`apt-get install mesa-vulkan-drivers libvulkan1`). Build with `--features wgpu`.
// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
#![cfg(feature = "wgpu")]

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::{FusedMode, Gpt, GptConfig, Inputs, MicroBatch, PipelineModel, Targets};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use cubecl_kernels::FusedOps;

type B = Autodiff<Wgpu>;

const M: usize = 4;
const MBS: usize = 2;
const STEPS: usize = 2;

fn gpt() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        seq_len: 4,
        hidden: 8,
        heads: 2,
        layers: 4,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

fn model() -> Gpt<B> {
    gpt()
        .init_seeded::<B>(5, &Default::default())
        .expect("valid config")
}

fn batch(step: usize, dp_index: usize, microbatch: usize) -> MicroBatch<B> {
    let (seq, vocab) = (gpt().seq_len, gpt().vocab_size);
    let ids = |salt: usize| {
        let v: Vec<i64> = (0..MBS * seq)
            .map(|i| ((step * 13 + dp_index * 11 + microbatch * 5 + i * 7 + salt) % vocab) as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [MBS, seq]), &Default::default())
    };
    MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(3)),
    }
}

fn params(module: &Gpt<B>) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let v = param.val().into_data().convert::<f32>();
            self.0.extend(v.to_vec::<f32>().expect("f32 data"));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

const LR: f64 = 1e-2;

/// The unsplit model's own forward, Burn's cross-entropy and Burn's AdamW, on the same
/// global batch (D replicas × M micro-batches), on the same backend.
/// With `fused_head` the loss is the unsplit model's own (`PipelineModel::loss`, the fused
/// head), as the engine's last stage computes it.
fn reference(dp: usize, model: Gpt<B>, fused_head: bool) -> (Vec<f64>, Vec<f32>) {
    let mut model = model;
    let mut optim = AdamWConfig::new().init::<B, Gpt<B>>();
    let ce = CrossEntropyLossConfig::new().init(&Default::default());
    let mut losses = Vec::new();
    for step in 1..=STEPS {
        let mut total: Option<Tensor<B, 1>> = None;
        for d in 0..dp {
            for m in 0..M {
                let mb = batch(step, d, m);
                if fused_head {
                    let loss = model.loss(&mb).expect("loss");
                    total = Some(total.map_or(loss.clone(), |t| t + loss));
                    continue;
                }
                let (Inputs::Tokens(x), Targets::Tokens(y)) = (mb.inputs, mb.targets) else {
                    unreachable!("GPT batches are tokens")
                };
                let logits = model.forward(x).expect("forward");
                let [b, s, v] = logits.dims();
                let loss = ce.forward(logits.reshape([b * s, v]), y.reshape([b * s]));
                total = Some(total.map_or(loss.clone(), |t| t + loss));
            }
        }
        let loss = total.expect("non-empty batch") / (dp * M) as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, params(&model))
}

fn engine_config(dp: usize, schedule: ScheduleKind) -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(2)
        .with_loops(schedule.family().default_loops)
        .with_dp(dp)
        .with_microbatches(M)
        .with_schedule(schedule)
        .with_zero(ZeroLevel::Zero3)
        .with_lr(LrConfig::Constant(LR))
        .with_comm_timeout_secs(120.0)
}

/// Trains `model` with the engine (breadth-first, P = 2, V = 2, D = 2, ZeRO-3) and checks it
/// against [`reference`]: losses within 1e-5, parameters within `param_tol` relative.
fn check_against_single_device(model: &Gpt<B>, fused_head: bool, param_tol: f32) {
    check_on_devices(
        model,
        fused_head,
        param_tol,
        None,
        ScheduleKind::BreadthFirst,
    );
}

/// [`check_against_single_device`] with world rank `r` on `devices[r]` when given.
fn check_on_devices(
    model: &Gpt<B>,
    fused_head: bool,
    param_tol: f32,
    devices: Option<Vec<WgpuDevice>>,
    schedule: ScheduleKind,
) {
    let dp = 2;
    let cfg = engine_config(dp, schedule);
    let trainer = Trainer::new(cfg);
    let outcome = match devices {
        None => trainer.fit(model.clone(), infallible(batch)),
        Some(devices) => trainer
            .on_devices(devices)
            .fit(model.clone(), infallible(batch)),
    }
    .expect("trains");
    let home = model.devices();
    assert!(
        outcome.model.devices().iter().all(|d| home.contains(d)),
        "the trained model comes back on the device of the model passed in"
    );
    let (want_losses, want_params) = reference(dp, model.clone(), fused_head);
    for (got, want) in outcome.losses.iter().zip(&want_losses) {
        assert!(
            ((got - want) / want).abs() <= 1e-5,
            "losses {:?} vs {want_losses:?}",
            outcome.losses
        );
    }
    let got = params(&outcome.model);
    assert_eq!(got.len(), want_params.len());
    let scale = want_params
        .iter()
        .fold(f32::MIN_POSITIVE, |a, b| a.max(b.abs()));
    let diff = got
        .iter()
        .zip(&want_params)
        .fold(0.0f32, |a, (g, w)| a.max((g - w).abs()));
    assert!(
        diff / scale <= param_tol,
        "parameters differ by {:.2e} relative",
        diff / scale
    );
    // The run must actually have trained: the parameters moved from their initial values.
    let initial = params(model);
    assert!(initial.iter().zip(&got).any(|(a, b)| a != b));
}

#[test]
fn breadth_first_zero3_on_wgpu_matches_single_device() {
    let written_out = model().with_fused(FusedMode::Off).expect("valid");
    check_against_single_device(&written_out, false, 1e-5);
}

/// The same with the CubeCL kernels in the model (`fused = "on"`; `auto` takes none on wgpu,
/// where they were measured slower than Burn's path): flash attention
/// (heads of 16), fused linear + GELU and fused linear cross-entropy, forward and backward,
/// inside the pipeline. Parameters within 3e-5 as in the Flex fused equivalence test
/// (engine_equivalence.rs explains why not 1e-5).
#[test]
fn breadth_first_zero3_with_fused_kernels_matches_single_device() {
    assert!(
        <B as FusedOps>::fused_kernels(),
        "Autodiff<Wgpu> must run the fused ops as kernels"
    );
    let wide = GptConfig {
        hidden: 32,
        ..gpt()
    };
    let model = {
        wide.init_seeded::<B>(5, &Default::default())
            .expect("valid config")
    };
    assert_eq!(
        <B as FusedOps>::fused_defaults(),
        cubecl_kernels::FusedDefaults::NONE,
        "auto takes no fused op on wgpu"
    );
    let model = model.with_fused(FusedMode::On).expect("heads of 16 fit");
    check_against_single_device(&model, true, 3e-5);
}

/// Ranks on different devices: the four ranks alternate between two wgpu devices (the CPU
/// adapter under two device ids, so two CubeCL servers whose buffers cannot be mixed, as two
/// GPUs), while the model and the batches are built on the default one. Each rank must move
/// its stages and micro-batches to its own device; the result equals single-device training.
#[test]
fn ranks_on_two_devices_match_single_device() {
    let written_out = model().with_fused(FusedMode::Off).expect("valid");
    let devices = vec![
        WgpuDevice::Cpu,
        WgpuDevice::DefaultDevice,
        WgpuDevice::DefaultDevice,
        WgpuDevice::Cpu,
    ];
    check_on_devices(
        &written_out,
        false,
        1e-5,
        Some(devices),
        ScheduleKind::BreadthFirst,
    );
}

/// Split backwards on wgpu: `I` defers every `SplitLinear`'s weight gradient through the
/// autodiff of a CubeCL backend, `W` computes it later on the inner backend.
#[test]
fn zero_bubble_schedules_on_wgpu_match_single_device() {
    let written_out = model().with_fused(FusedMode::Off).expect("valid");
    for schedule in [
        ScheduleKind::ZeroBubbleH1,
        ScheduleKind::BreadthFirstZeroBubble,
    ] {
        check_on_devices(&written_out, false, 1e-5, None, schedule);
    }
}

/// A seed gives the same weights on every backend (they are drawn on the CPU and copied), so
/// a wgpu run starts where the same run on Flex does; each backend's own generator would
/// draw other values from the seed.
#[test]
fn a_seeded_model_has_the_weights_of_the_same_seed_on_the_cpu() {
    use burn::backend::Flex;
    let on_cpu = gpt()
        .init_seeded::<Flex>(5, &Default::default())
        .expect("valid config");
    let cpu = burn_bfpp::model::flatten_params(&on_cpu)
        .into_data()
        .to_vec::<f32>()
        .expect("f32");
    assert_eq!(params(&model()), cpu);
}
