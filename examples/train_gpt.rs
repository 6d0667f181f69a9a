//! Train a Burn model with a looped breadth-first pipeline and ZeRO-3, in ~30 lines.
//!
//! Run: `cargo run --release --example train_gpt`
//!
//! Ranks are threads of this process (pp × dp of them); the same program runs on every
//! layout, and any layout with the same global batch gives the same losses.

use burn::backend::{Autodiff, Flex};
use burn_bfpp::data::{BatchConfig, BatchLayout, Batcher, MarkovConfig, MarkovCorpus};
use burn_bfpp::engine::{LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::GptConfig;

type B = Autodiff<Flex>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The model is described, not built: each rank builds only its own stages. Any
    // `ModelDescription` works; the reference GPT's configuration gives one.
    let gpt = GptConfig {
        seq_len: 32,
        layers: 4,
        ..GptConfig::default()
    };
    let model = gpt.described(0);

    // 2 pipeline ranks × 2 loops = 4 stages, 2 data-parallel replicas, 4 micro-batches of 4;
    // breadth-first and ZeRO-3 are the defaults.
    let config = TrainConfig::new(30)
        .with_pp(2)
        .with_loops(2)
        .with_dp(2)
        .with_microbatches(4)
        .with_lr(LrConfig::WarmupCosine {
            peak: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 5,
        })
        .with_max_grad_norm(1.0);

    // Samples depend only on (step, replica, micro-batch), never on the layout.
    let layout = BatchLayout {
        dp: 2,
        microbatches: 4,
        micro_batch_size: 4,
    };
    let corpus = MarkovCorpus::new(MarkovConfig::default())?;
    let batcher = Batcher::new(
        &corpus,
        BatchConfig::new(gpt.seq_len, layout.global_batch(), 0),
    )?;
    let data = |step: usize, dp_index, mb| {
        batcher.micro_batch::<B>(
            (step - 1) as u64,
            &layout,
            dp_index,
            mb,
            &Default::default(),
        )
    };

    let outcome = Trainer::new(config)
        .on_step(|r| println!("step {:>3}  loss {:.4}  lr {:.2e}", r.step, r.loss, r.lr))
        .fit_described::<B, _, _>(&model, data)?;
    println!(
        "trained in {:.1} s; peak parameter bytes per rank: {:?}; peak resident memory: {:?}",
        outcome.elapsed.as_secs_f64(),
        outcome.peak_param_bytes,
        outcome.peak_rss_bytes
    );
    Ok(())
}
