//! Train a Burn model with a looped breadth-first pipeline and ZeRO-3, in ~40 lines.
//!
//! Run: `cargo run --release --example train_gpt`
//!
//! Ranks are threads of this process (pp × dp of them); the same program runs on every
//! layout, and any layout with the same global batch gives the same losses.

use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn_bfpp::data::{BatchConfig, BatchLayout, Batcher, MarkovConfig, MarkovCorpus};
use burn_bfpp::engine::{train_local, EngineConfig};
use burn_bfpp::model::{GptConfig, ModelSplit};
use burn_bfpp::optim::{AdamWSettings, LrSchedule};
use burn_bfpp::schedule::{Placement, ScheduleKind, ZeroLevel};

type B = Autodiff<Flex>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Any model implementing `PipelineModel` works; the reference GPT is one.
    let gpt = GptConfig {
        seq_len: 32,
        layers: 4,
        ..GptConfig::default()
    };
    let model = gpt.init_seeded::<B>(0, &Default::default())?;

    // 2 pipeline ranks × 2 loops = 4 stages, 2 data-parallel replicas, 4 micro-batches of 4.
    let layout = BatchLayout {
        dp: 2,
        microbatches: 4,
        micro_batch_size: 4,
    };
    let cfg = EngineConfig {
        pp: 2,
        loops: 2,
        dp: layout.dp,
        microbatches: layout.microbatches,
        bf_microbatches: None,
        schedule: ScheduleKind::BreadthFirst,
        placement: Placement::Looping,
        zero: ZeroLevel::Zero3,
        buffers: 2,
        recompute: false,
        split: ModelSplit::Even,
        adamw: AdamWSettings::default(),
        lr: LrSchedule::warmup_cosine(3e-3, 3e-4, 5, 30),
        max_grad_norm: 1.0,
        comm_timeout: Duration::from_secs(300),
        overlap_collectives: true,
        fault: None,
        on_nonfinite: Default::default(),
        precision: Default::default(),
        loss_scaling: Default::default(),
    };

    // Samples depend only on (step, replica, micro-batch), never on the layout.
    let corpus = MarkovCorpus::new(MarkovConfig::default())?;
    let global_batch = layout.dp * layout.microbatches * layout.micro_batch_size;
    let batcher = Batcher::new(&corpus, BatchConfig::new(gpt.seq_len, global_batch, 0))?;
    let batch = |step: usize, dp_index, mb| {
        batcher
            .micro_batch::<B>(
                (step - 1) as u64,
                &layout,
                dp_index,
                mb,
                &Default::default(),
            )
            .expect("the layout was checked when the batcher was built")
    };

    let shape = [layout.micro_batch_size, gpt.seq_len, gpt.hidden];
    let outcome = train_local(&model, &cfg, 30, shape, batch, |r| {
        println!("step {:>3}  loss {:.4}  lr {:.2e}", r.step, r.loss, r.lr);
    })?;
    println!(
        "trained in {:.1} s; peak parameter bytes per rank: {:?}",
        outcome.elapsed.as_secs_f64(),
        outcome.peak_param_bytes
    );
    Ok(())
}
