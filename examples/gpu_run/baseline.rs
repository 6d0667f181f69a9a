//! `gpu_run --baseline`: the same GPT, data and optimizer steps as a plain Burn training loop
//! on one device — the unsplit model's loss over each micro-batch, one backward per step of
//! the summed losses, Burn's AdamW — to measure the engine's tokens/s against. The model
//! computes in `--precision` (its parameters cast, as a Burn user without master weights
//! would train in bf16); no clipping. It reports the same step time, tokens/s, TFLOP/s and
//! MFU lines as the engine's runs, so scripts/gpu-run.sh can divide one by the other.

use std::time::Instant;

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use burn_bfpp::data::{BatchConfig, BatchLayout, Batcher, MarkovConfig, MarkovCorpus};
use burn_bfpp::model::{Gpt, GptConfig, PipelineModel};
use burn_bfpp::optim::AdamWSettings;

use super::{shape, Args, Error};

/// The model's float parameters in `dtype`, still requiring gradients.
fn cast<B: AutodiffBackend>(model: Gpt<B>, dtype: DType) -> Gpt<B> {
    struct Cast(DType);
    impl<B: AutodiffBackend> ModuleMapper<B> for Cast {
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

/// Trains `args.steps` plain Burn steps on `device` and prints the timed steps' figures.
pub fn plain_burn<B>(args: &Args, device: B::Device, peak_tflops: f64) -> Result<(), Error>
where
    B: AutodiffBackend + cubecl_kernels::FusedOps,
{
    if args.warmup >= args.steps {
        return Err(format!(
            "--warmup {} leaves no timed step of --steps {}: raise --steps",
            args.warmup, args.steps
        )
        .into());
    }
    let gpt = GptConfig {
        vocab_size: args.vocab,
        seq_len: args.seq_len,
        hidden: args.hidden,
        heads: args.heads,
        layers: args.layers,
        ..GptConfig::default()
    };
    let mut model = cast(gpt.init_seeded::<B>(0, &device)?, args.precision.dtype());
    // The engine's batch of one step: every replica's micro-batches, here all on one device.
    let layout = BatchLayout {
        dp: args.dp,
        microbatches: args.microbatches,
        micro_batch_size: args.micro_batch_size,
    };
    let corpus = MarkovCorpus::new(MarkovConfig::default())?;
    let samples = layout.dp * layout.microbatches * layout.micro_batch_size;
    let batcher = Batcher::new(&corpus, BatchConfig::new(gpt.seq_len, samples, 0))?;
    let mut optim = AdamWSettings::default().to_burn().init::<B, Gpt<B>>();
    println!(
        "gpu-run baseline: plain Burn loop, {:?} backend, {}; GPT {} blocks, hidden {}, {} \
         heads, seq {}; {} micro-batches of {} per step",
        args.backend,
        args.precision,
        args.layers,
        args.hidden,
        args.heads,
        args.seq_len,
        layout.dp * layout.microbatches,
        layout.micro_batch_size
    );
    let mut timed_from = None;
    let mut last_loss = f64::NAN;
    for step in 1..=args.steps {
        if step == args.warmup + 1 {
            timed_from = Some(Instant::now());
        }
        let mut total: Option<Tensor<B, 1>> = None;
        for dp_index in 0..layout.dp {
            for mb in 0..layout.microbatches {
                let batch =
                    batcher.micro_batch::<B>((step - 1) as u64, &layout, dp_index, mb, &device)?;
                let loss = model.loss(&batch)?;
                total = Some(match total {
                    Some(t) => t + loss,
                    None => loss,
                });
            }
        }
        let loss = total.ok_or("no micro-batch in a step")?
            / (layout.dp * layout.microbatches) as f64;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-4, model, grads);
        // Reading the loss waits for the step's kernels, so each step's time is real.
        last_loss = burn::tensor::ElementConversion::elem::<f64>(loss.into_scalar());
        println!("step {step:>3}  loss {last_loss:.4}");
    }
    let elapsed = timed_from.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let step_s = elapsed / (args.steps - args.warmup) as f64;
    let tokens = (samples * args.seq_len) as f64;
    let tflops = shape(args).step_model_flops(samples) / step_s / 1e12;
    println!("\nfinal loss {last_loss:.4} (plain Burn)");
    println!("{:<28} {:>14.4}", "step time (s)", step_s);
    println!("{:<28} {:>14.0}", "tokens/s", tokens / step_s);
    println!("{:<28} {:>14.4}", "model TFLOP/s per GPU", tflops);
    println!("{:<28} {:>13.4}%", "MFU", 100.0 * tflops / peak_tflops);
    Ok(())
}
