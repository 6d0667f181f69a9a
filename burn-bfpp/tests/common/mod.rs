//! What the equivalence tests share: the tiny GPT, its deterministic batches, the plain-Burn
//! reference training and the comparisons (used by `engine_equivalence` and `process_ranks`).

// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
// Each test crate that includes this module uses a different subset of it.
#![allow(dead_code)]

/// Launches of rank processes that run one at a time and cannot hang (shared with the root
/// crate's CLI tests).
#[path = "../../../tests/common/bounded.rs"]
pub mod bounded;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{infallible, EngineError, LrConfig, TrainConfig, TrainOutcome, Trainer};
use burn_bfpp::model::{Gpt, GptConfig, Inputs, MicroBatch, PipelineModel, Targets};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};

pub type B = Autodiff<Flex>;

pub const M: usize = 4;
pub const MBS: usize = 2;
pub const STEPS: usize = 3;

pub fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        seq_len: 4,
        hidden: 8,
        heads: 2,
        layers: 6,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

pub fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.1)
}

pub fn lr() -> LrConfig {
    LrConfig::WarmupCosine {
        peak: 2e-2,
        min_lr: 1e-3,
        warmup_steps: 1,
    }
}

/// The learning rate of `step` (1-based) in a run of [`STEPS`] steps.
pub fn lr_at(step: usize) -> f64 {
    lr().rates(STEPS).expect("a valid schedule")[step - 1]
}

/// A deterministic pseudo-random token from its coordinates: the same sample whatever the layout.
pub fn token(step: usize, sample: usize, pos: usize, salt: usize) -> i64 {
    let mut x = (step * 1_000_003 + sample * 10_007 + pos * 101 + salt * 7) as u64;
    x ^= x >> 13;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    (x % gpt_config().vocab_size as u64) as i64
}

/// Micro-batch `microbatch` of replica `dp_index` at `step` (1-based): samples
/// `(dp_index·M + microbatch)·MBS ..` of the step's global batch.
pub fn batch(step: usize, dp_index: usize, microbatch: usize) -> MicroBatch<B> {
    samples(step, (dp_index * M + microbatch) * MBS, MBS)
}

/// Samples per replica and step: [`M`] micro-batches of [`MBS`].
pub const SAMPLES: usize = M * MBS;

/// The micro-batches of a replica's [`SAMPLES`] cut into `m` (a divisor of them): the same
/// global batch as [`batch`] whatever `m`, so a layout that needs more micro-batches
/// (dualpipev: at least 2·pp) compares with the same reference.
pub fn batch_of(m: usize) -> impl Fn(usize, usize, usize) -> MicroBatch<B> + Sync {
    // Other counts only come from layouts the engine refuses before reading any data.
    let size = SAMPLES.checked_div(m).unwrap_or(0).max(1);
    move |step, dp_index, microbatch| samples(step, dp_index * SAMPLES + microbatch * size, size)
}

/// `count` samples of `step` from sample `first` on.
fn samples(step: usize, first: usize, count: usize) -> MicroBatch<B> {
    let seq = gpt_config().seq_len;
    let ids = |salt| {
        let v: Vec<i64> = (0..count)
            .flat_map(|j| (0..seq).map(move |p| token(step, first + j, p, salt)))
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [count, seq]), &Default::default())
    };
    MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(1)),
    }
}

/// Micro-batches per replica of a layout: [`M`], or the 2·pp dualpipev needs (the samples
/// are cut finer, see [`batch_of`]).
pub fn microbatches_for(kind: ScheduleKind, pp: usize) -> usize {
    if kind == ScheduleKind::DualPipeV {
        M.max(2 * pp)
    } else {
        M
    }
}

pub fn model() -> Gpt<B> {
    gpt_config()
        .init_seeded::<B>(7, &Default::default())
        .expect("valid config")
}

/// Plain Burn: the whole model on one device, mean loss over the global batch, Burn's AdamW.
pub fn reference(dp: usize) -> (Vec<f64>, Vec<Vec<f32>>) {
    reference_of(model(), dp)
}

/// [`reference`] from the given initial model. With `fused = "on"` its loss is the unsplit
/// model's own (`PipelineModel::loss`, whose head fuses the projection with the
/// cross-entropy); otherwise its `forward` followed by Burn's cross-entropy.
pub fn reference_of(model: Gpt<B>, dp: usize) -> (Vec<f64>, Vec<Vec<f32>>) {
    reference_in(model, dp, M)
}

/// [`reference`] with the replicas' samples cut into `m` micro-batches ([`batch_of`]), the
/// mean of their mean losses: the same global batch, summed as a run with `m` micro-batches
/// sums it.
pub fn reference_in(model: Gpt<B>, dp: usize, m: usize) -> (Vec<f64>, Vec<Vec<f32>>) {
    let batch = batch_of(m);
    let mut model = model;
    let fused_head = model.config().fused == burn_bfpp::model::FusedMode::On;
    let mut optim = adamw().init::<B, Gpt<B>>();
    let ce = CrossEntropyLossConfig::new().init(&Default::default());
    let mut losses = Vec::new();
    for step in 1..=STEPS {
        let mut total: Option<Tensor<B, 1>> = None;
        for d in 0..dp {
            for microbatch in 0..m {
                let mb = batch(step, d, microbatch);
                if fused_head {
                    let loss = model.loss(&mb).expect("loss");
                    total = Some(match total {
                        Some(t) => t + loss,
                        None => loss,
                    });
                    continue;
                }
                let (Inputs::Tokens(x), Targets::Tokens(y)) = (mb.inputs, mb.targets) else {
                    unreachable!("the GPT batches are tokens")
                };
                let logits = model.forward(x).expect("forward");
                let [b, s, v] = logits.dims();
                let loss = ce.forward(logits.reshape([b * s, v]), y.reshape([b * s]));
                total = Some(match total {
                    Some(t) => t + loss,
                    None => loss,
                });
            }
        }
        let loss = total.expect("non-empty batch") / (dp * m) as f64;
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr_at(step), model, grads);
    }
    (losses, params(&model))
}

pub fn params<M: Module<B>>(module: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let v = param.val().into_data().convert::<f32>().to_vec::<f32>();
            self.0.push(v.expect("f32 data"));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Largest relative difference between per-step losses.
pub fn max_loss_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "one loss per step");
    got.iter()
        .zip(want)
        .map(|(g, w)| ((g - w) / w).abs())
        .fold(0.0, f64::max)
}

/// Largest over parameters of ‖got − want‖∞ / ‖want‖∞.
pub fn max_param_err(got: &[Vec<f32>], want: &[Vec<f32>]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let diff = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let scale = w.iter().map(|b| b.abs()).fold(f32::MIN_POSITIVE, f32::max);
            f64::from(diff / scale)
        })
        .fold(0.0, f64::max)
}

/// The bytes every world rank's step list sends under `cfg`, by the simulator's formulas
/// ([`burn_bfpp::sim::step_comm_bytes`]) with this model's real stage sizes: messages of
/// `samples per micro-batch × seq × hidden` activations and weights gathered in the compute dtype, gradients
/// reduced in fp32 (what the engine does).
pub fn predicted_comm_bytes(cfg: &TrainConfig) -> Vec<burn_bfpp::comm::CommBytes> {
    use burn_bfpp::model::split_model;
    use burn_bfpp::sim::{step_comm_bytes, CostTable, SimConfig};
    let program = cfg.program().expect("valid layout");
    let mut sim = SimConfig::unit();
    sim.dp = cfg.dp;
    sim.zero = cfg.zero;
    let m = cfg.microbatches;
    let mut table =
        CostTable::new(&sim, &program.stage_ranks, program.num_ranks(), m).expect("unit costs");
    let base = model();
    let ranges = split_model(&base, program.num_stages(), &cfg.split).expect("split");
    table.parameters = base
        .stages(&ranges)
        .expect("stages")
        .iter()
        .map(|s| s.num_params() as u64)
        .collect();
    let elem = cfg.precision.dtype().size() as u64;
    let g = gpt_config();
    let samples = (SAMPLES / m * g.seq_len * g.hidden) as u64;
    table.message_bytes = vec![samples * elem; program.num_stages()];
    table.weight_elem_bytes = elem;
    table.grad_elem_bytes = 4;
    let per_pp = step_comm_bytes(&program, &table, cfg.dp, cfg.zero);
    (0..cfg.pp * cfg.dp).map(|r| per_pp[r % cfg.pp]).collect()
}

pub fn config(
    kind: ScheduleKind,
    pp: usize,
    loops: usize,
    dp: usize,
    zero: ZeroLevel,
) -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(pp)
        .with_loops(loops)
        .with_dp(dp)
        .with_microbatches(microbatches_for(kind, pp))
        .with_schedule(kind)
        .with_zero(zero)
        .with_adamw(adamw())
        .with_lr(lr())
        .with_comm_timeout_secs(60.0)
}

/// The tiny GPT trained under `cfg` on [`batch`], ranks as threads.
pub fn train(model: &Gpt<B>, cfg: &TrainConfig) -> Result<TrainOutcome<Gpt<B>>, EngineError> {
    Trainer::new(cfg.clone()).fit(model.clone(), infallible(batch_of(cfg.microbatches)))
}

/// [`train`] stopped after `steps` of the configuration's schedule.
pub fn train_for(
    model: &Gpt<B>,
    cfg: &TrainConfig,
    steps: usize,
) -> Result<TrainOutcome<Gpt<B>>, EngineError> {
    Trainer::new(cfg.clone())
        .stop_after(steps)
        .fit(model.clone(), infallible(batch_of(cfg.microbatches)))
}
