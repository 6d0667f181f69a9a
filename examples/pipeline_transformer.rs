//! Pipeline a Burn language model built from burn-nn's `TransformerEncoderLayer`s: 2 pipeline
//! ranks × 2 loops (4 stages) × 2 data-parallel replicas, breadth-first, ZeRO-3, ranks as
//! threads on the CPU, each rank building only its own stages from the model's description
//! (`shared/layer_stack_lm.rs`). The same model is trained by a plain Burn loop with
//! burn-optim's AdamW, and one JSON line compares the two: `max_rel_diff` over the losses and
//! the final parameter norm (≤ 1e-5). Run: `cargo run --release --example pipeline_transformer`
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::StackParts;

#[path = "shared/layer_stack_lm.rs"]
mod layer_stack_lm;
use layer_stack_lm::{batch, max_rel_diff, plain_burn, Lm};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dp, microbatches, steps, lr) = (2, 4, 4, 1e-3);
    let model = Lm.described(7);

    // The pipeline: breadth-first and ZeRO-3 are the defaults.
    let config = TrainConfig::new(steps)
        .with_pp(2)
        .with_loops(2)
        .with_dp(dp)
        .with_microbatches(microbatches)
        .with_lr(LrConfig::Constant(lr));
    let piped = Trainer::new(config).fit_described(&model, infallible(batch))?;

    // Plain Burn: the same model built whole on one device, from the initial values every
    // stage of the pipeline started from.
    let whole = model.build(&Default::default())?;
    let (losses, plain_norm) = plain_burn(whole, steps, dp, microbatches, lr)?;
    let diff = max_rel_diff(&piped.losses, piped.param_norm, &losses, plain_norm);
    println!(
        "{{\"losses\":{:?},\"plain_losses\":{losses:?},\"param_norm\":{},\"plain_param_norm\":{plain_norm},\"max_rel_diff\":{diff:e}}}",
        piped.losses, piped.param_norm
    );
    Ok(())
}
