//! `bfpp train --plain-burn`: the same GPT, data, optimizer and steps as a plain Burn
//! training loop on one device, the baseline the engine's throughput is measured against.
//!
//! Each step sums the unsplit model's loss over every micro-batch of every replica (the
//! engine's global batch), runs one backward, and steps burn-optim's `AdamW` (the run's
//! `[train.adamw]`) at the run's learning rate. The model computes in `--precision` with its
//! parameters cast (no master weights, as a Burn user would train in bf16), and there is no
//! gradient clipping. It reports the same step times, throughput, and with `--hardware` MFU,
//! as the engine's run.

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_bfpp::data::{BatchLayout, Batcher};
use burn_bfpp::engine::{peak_rss_bytes, TrainConfig};
use burn_bfpp::model::{Gpt, PipelineModel};
use serde_json::json;

use super::args::TrainArgs;
use super::backend::CliBackend;
use super::config::BfppConfig;
use super::error::TrainError;
use super::predict::{MeasuredStep, Prediction};
use super::report::{rss_text, steady_step};

/// The model's float parameters in `dtype`, still requiring gradients.
fn cast<B: CliBackend>(model: Gpt<B>, dtype: DType) -> Gpt<B> {
    struct Cast(DType);
    impl<B: CliBackend> ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, value, mapper) = param.consume();
            let value = if value.dtype() == self.0 {
                value
            } else {
                value.detach().cast(self.0).require_grad()
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    model.map(&mut Cast(dtype))
}

/// Trains `train.steps` plain Burn steps on `device`; returns what to print.
pub fn run<B: CliBackend>(
    args: &TrainArgs,
    cfg: &BfppConfig,
    train: &TrainConfig,
    layout: &BatchLayout,
    batcher: &Batcher,
    device: B::Device,
    prediction: Option<Prediction>,
) -> Result<Option<String>, TrainError> {
    let rates = train.lr.rates(train.steps).map_err(TrainError::Config)?;
    let dtype = train.precision.dtype();
    let mut model = cast(cfg.model.init_seeded::<B>(cfg.run.seed, &device)?, dtype);
    let mut optim = train.adamw.init::<B, Gpt<B>>();
    let micro_batches = layout.dp * layout.microbatches;
    let tokens_per_step = layout.global_batch() * cfg.data.seq_len;
    let show = !(args.json || args.quiet);
    if show {
        println!(
            "plain Burn loop on one device ({} backend, {}): {} micro-batches of {} samples \
             per step, {} steps, no gradient clipping",
            B::CHOICE.name(),
            train.precision,
            micro_batches,
            layout.micro_batch_size,
            train.steps
        );
    }
    let mut losses = Vec::with_capacity(train.steps);
    let mut step_times = Vec::with_capacity(train.steps);
    let start = std::time::Instant::now();
    let mut previous = 0.0;
    for (index, &lr) in rates.iter().enumerate() {
        let mut total: Option<Tensor<B, 1>> = None;
        for dp_index in 0..layout.dp {
            for mb in 0..layout.microbatches {
                let batch =
                    batcher.micro_batch::<B>(index as u64, layout, dp_index, mb, &device)?;
                let loss = model.loss(&batch)?;
                total = Some(match total {
                    Some(t) => t + loss,
                    None => loss,
                });
            }
        }
        let Some(total) = total else {
            return Err(TrainError::Config("a step of no micro-batches".into()));
        };
        let loss = total / micro_batches as f64;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        // Reading the loss waits for the step's kernels, so each step's time is real.
        let value = loss.into_scalar().elem::<f64>();
        let now = start.elapsed().as_secs_f64();
        step_times.push(now - previous);
        previous = now;
        losses.push(value);
        if show {
            println!("step {:>4}  loss {value:.4}", index + 1);
        }
    }
    let measured = MeasuredStep {
        step_s: steady_step(&step_times),
        devices: 1,
    };
    let steady_tokens_per_s = tokens_per_step as f64 / measured.step_s;
    if args.json {
        let mut doc = json!({
            "plain_burn": true,
            "losses": losses,
            "step_times_s": step_times,
            "steady_tokens_per_s": steady_tokens_per_s,
            "peak_rss_bytes": [peak_rss_bytes()],
        });
        if let (Some(p), Some(fields)) = (&prediction, doc.as_object_mut()) {
            fields.insert("hardware".into(), p.json(measured));
        }
        return Ok(Some(format!("{doc}\n")));
    }
    if args.quiet {
        return Ok(None);
    }
    let mut out = format!(
        "final loss   {:.4} (plain Burn)\nthroughput   steady {steady_tokens_per_s:.0} \
         tokens/s ({:.3} s, the median step after the first)\npeak memory  {}\n",
        losses.last().copied().unwrap_or(f64::NAN),
        measured.step_s,
        rss_text(&[peak_rss_bytes()])
    );
    if let Some(p) = &prediction {
        out += &p.text(measured, tokens_per_step);
    }
    Ok(Some(out))
}
