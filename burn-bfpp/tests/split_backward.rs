//! Split backwards (`I`/`W`) on models of one's own: a `LayerStack` whose blocks and head are
//! `SplitLinear`s trains under the zero-bubble schedules exactly like plain single-device
//! Burn; a stack of burn-nn layers is refused for them with the fix named; recomputation
//! composes with the split.
#![allow(clippy::disallowed_methods)]

mod common;

use burn::module::Module;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{EmbeddingConfig, Gelu, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use burn_bfpp::engine::{infallible, TrainConfig, Trainer};
use burn_bfpp::model::{LayerStack, PipelineModel, SplitLinear, StackBlock};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;
use cubecl_kernels::FusedOps;

/// A residual MLP block of two `SplitLinear`s: what a user writes to train with I/W.
#[derive(Module, Debug)]
struct MlpBlock<B: Backend> {
    fc: SplitLinear<B>,
    proj: SplitLinear<B>,
    gelu: Gelu,
}

impl<B: FusedOps> StackBlock<B> for MlpBlock<B> {
    fn apply(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        x.clone() + self.proj.forward(self.gelu.forward(self.fc.forward(x)))
    }

    fn splits_weight_grads(&self) -> bool {
        true
    }
}

type Stack = LayerStack<B, burn::nn::Embedding<B>, MlpBlock<B>, SplitLinear<B>>;

/// Held by every test of this file for its whole run. The burn-nn layers built here draw from
/// Burn's process-wide generator without the lock `GptConfig::init_seeded` takes, so a draw
/// of one test between another's seeding and drawing would change that test's model (seen:
/// the seeded GPT's first loss changed from run to run). Holding one lock keeps the draws
/// apart.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn split_stack() -> Stack {
    let device = Default::default();
    let vocab = gpt_config().vocab_size;
    let blocks = (0..4)
        .map(|_| MlpBlock {
            fc: LinearConfig::new(8, 16).init(&device).into(),
            proj: LinearConfig::new(16, 8).init(&device).into(),
            gelu: Gelu::new(),
        })
        .collect();
    LayerStack::new(
        EmbeddingConfig::new(vocab, 8).init(&device),
        blocks,
        LinearConfig::new(8, vocab).init(&device).into(),
    )
    .expect("alike blocks")
}

/// Plain Burn on the whole model: the mean of the model's own losses over the global batch,
/// Burn's AdamW.
fn reference(model: Stack) -> (Vec<f64>, Vec<Vec<f32>>) {
    let mut model = model;
    let mut optim = adamw().init::<B, Stack>();
    let mut losses = Vec::new();
    for step in 1..=STEPS {
        let total = (0..M)
            .map(|m| model.loss(&batch(step, 0, m)).expect("loss"))
            .reduce(|a, b| a + b)
            .expect("micro-batches");
        let loss = total / M as f64;
        losses.push(f64::from(loss.clone().into_scalar()));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr_at(step), model, grads);
    }
    (losses, params(&model))
}

fn stack_config(kind: ScheduleKind, pp: usize, loops: usize, zero: ZeroLevel) -> TrainConfig {
    config(kind, pp, loops, 1, zero)
}

#[test]
fn a_layer_stack_of_split_linears_trains_like_plain_burn_under_zero_bubble_schedules() {
    let _serial = serial();
    let model = split_stack();
    let (want_losses, want_params) = reference(model.clone());
    let mut failures = Vec::new();
    for (kind, pp, loops) in [
        (ScheduleKind::ZeroBubbleH1, 2, 1),
        (ScheduleKind::ZeroBubbleH1, 4, 1),
        (ScheduleKind::InterleavedZeroBubble, 2, 2),
        (ScheduleKind::BreadthFirstZeroBubble, 2, 2),
        (ScheduleKind::BreadthFirstZeroBubble, 3, 2),
        (ScheduleKind::ZeroBubbleV, 2, 2),
        (ScheduleKind::DualPipeV, 2, 2),
    ] {
        for zero in [ZeroLevel::Zero0, ZeroLevel::Zero3] {
            let outcome = Trainer::new(stack_config(kind, pp, loops, zero))
                .fit(model.clone(), infallible(batch))
                .unwrap_or_else(|e| panic!("{kind} pp={pp} {zero:?}: {e}"));
            let loss_err = max_loss_err(&outcome.losses, &want_losses);
            let param_err = max_param_err(&params(&outcome.model), &want_params);
            if !(loss_err <= 1e-5 && param_err <= 1e-5) {
                failures.push(format!(
                    "{kind} pp={pp} v={loops} {zero:?}: loss err {loss_err:.2e}, param err \
                     {param_err:.2e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn burn_nn_layers_are_refused_for_split_schedules_with_the_fix() {
    let _serial = serial();
    let device = Default::default();
    let vocab = gpt_config().vocab_size;
    let blocks = (0..2)
        .map(|_| {
            TransformerEncoderConfig::new(8, 16, 2, 1)
                .with_dropout(0.0)
                .init::<B>(&device)
                .layers
                .remove(0)
        })
        .collect();
    let model = LayerStack::new(
        EmbeddingConfig::new(vocab, 8).init(&device),
        blocks,
        LinearConfig::new(8, vocab).init(&device),
    )
    .expect("alike blocks");
    let run = |kind| {
        Trainer::new(stack_config(kind, 2, 1, ZeroLevel::Zero0))
            .fit(model.clone(), infallible(batch))
    };
    let err = match run(ScheduleKind::ZeroBubbleH1) {
        Ok(_) => panic!("a stack of burn-nn layers trained under zb-h1"),
        Err(e) => e.to_string(),
    };
    // Both ranks check their own stage at once: either may be the first failure reported.
    assert!(
        (err.contains("stage 0 (layers") || err.contains("stage 1 (layers"))
            && err.contains("SplitLinear")
            && err.contains("splits_weight_grads")
            && err.contains("1f1b"),
        "{err}"
    );
    // The same model with a full backward trains.
    assert!(run(ScheduleKind::OneFOneB).is_ok());
}

#[test]
fn recomputation_composes_with_the_split_backward() {
    let _serial = serial();
    let (want_losses, want_params) = common::reference(1);
    let base = model();
    for kind in [
        ScheduleKind::ZeroBubbleH1,
        ScheduleKind::BreadthFirstZeroBubble,
    ] {
        let loops = kind.family().default_loops;
        let mut cfg = config(kind, 2, loops, 1, ZeroLevel::Zero3);
        cfg.recompute = true;
        let outcome = train(&base, &cfg).unwrap_or_else(|e| panic!("{kind}: {e}"));
        let loss_err = max_loss_err(&outcome.losses, &want_losses);
        let param_err = max_param_err(&params(&outcome.model), &want_params);
        assert!(
            loss_err <= 1e-5 && param_err <= 1e-5,
            "{kind} with recomputation: loss err {loss_err:.2e}, param err {param_err:.2e}"
        );
    }
}

/// `TrainConfig::schedule_file` trains a file's order exactly like the schedule it was written
/// from, and a configuration whose layout differs from the file's is refused naming both.
#[test]
fn a_schedule_file_in_the_configuration_trains_like_its_schedule() {
    let _serial = serial();
    use burn_bfpp::schedule::{to_csv, ScheduleSpec};
    let kind = ScheduleKind::ZeroBubbleH1;
    let dir = std::env::temp_dir().join(format!("bfpp-split-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("zb-h1.csv");
    let order = ScheduleSpec::new(kind, 2, 1, M)
        .generate()
        .expect("generates");
    std::fs::write(&path, to_csv(&order)).expect("writable");

    let generated = train(&model(), &config(kind, 2, 1, 1, ZeroLevel::Zero3)).expect("trains");
    let mut from_file = config(ScheduleKind::BreadthFirst, 2, 1, 1, ZeroLevel::Zero3);
    from_file.schedule_file = Some(path.clone());
    let outcome = train(&model(), &from_file).expect("trains from the file");
    assert_eq!(outcome.losses, generated.losses);

    from_file.pp = 4;
    let err = train(&model(), &from_file).err().map(|e| e.to_string());
    let _ = std::fs::remove_dir_all(&dir);
    let err = err.expect("a pp the file does not have is refused");
    assert!(err.contains("zb-h1.csv") && err.contains("pp = 4"), "{err}");
}
