//! A Burn user's program outside the burn-bfpp workspace, built against the published
//! burn-autodiff (no `[patch.crates-io]`): the layer-stack example's model (an embedding, six
//! burn-nn transformer layers and a linear head, described by `StackParts`), pipelined at
//! pp 2 × loops 2 × dp 2, breadth-first, ZeRO-3, against the same model trained by a plain
//! Burn loop with burn-optim's AdamW.
//!
//! `bfpp-downstream threads RUNS`: four thread ranks, `RUNS` times; one JSON line with every
//! run's `max_rel_diff` (over the losses and the final parameter norm), whether this build
//! has the patched autodiff, and the pipelined runs' seconds.
//! `mpirun -np 4 bfpp-downstream processes RUNS`: the same runs with the ranks as MPI
//! processes; world rank 0 prints the line.
use std::time::Instant;

use burn::backend::Flex;
use burn_bfpp::comm::{CommConfig, MpiComm, RankGrid};
use burn_bfpp::engine::{infallible, LrConfig, TrainConfig, Trainer};
use burn_bfpp::model::autodiff::PATCHED_AUTODIFF;
use burn_bfpp::model::StackParts;

// The repository's layer-stack example model, data and plain-Burn loop, as a user would
// have written them in their own crate.
#[path = "../../../examples/shared/layer_stack_lm.rs"]
mod layer_stack_lm;
use layer_stack_lm::{batch, max_rel_diff, plain_burn, Lm};

const STEPS: usize = 4;
const LR: f64 = 1e-3;
const PP: usize = 2;
const DP: usize = 2;
const MICROBATCHES: usize = 4;

fn config() -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(PP)
        .with_loops(2)
        .with_dp(DP)
        .with_microbatches(MICROBATCHES)
        .with_lr(LrConfig::Constant(LR))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "threads".into());
    let runs: u64 = args.next().map_or(Ok(1), |r| r.parse())?;
    let comm = match mode.as_str() {
        "threads" => None,
        "processes" => Some(MpiComm::<Flex>::init(
            RankGrid::new(PP, DP)?,
            Default::default(),
            CommConfig::default(),
        )?),
        other => return Err(format!("unknown mode `{other}`: threads or processes").into()),
    };
    let (mut diffs, mut seconds) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let seed = 7 + run;
        let model = Lm.described(seed);
        let started = Instant::now();
        let outcome = match &comm {
            None => Some(Trainer::new(config()).fit_described(&model, infallible(batch))?),
            Some(comm) => Trainer::new(config())
                .in_process(comm)
                .fit_described(&model, infallible(batch))?,
        };
        seconds.push(started.elapsed().as_secs_f64());
        // Only world rank 0 (every thread world) has the outcome to compare.
        if let Some(outcome) = outcome {
            let whole = model.build(&Default::default())?;
            let (losses, norm) = plain_burn(whole, STEPS, DP, MICROBATCHES, LR)?;
            diffs.push(max_rel_diff(
                &outcome.losses,
                outcome.param_norm,
                &losses,
                norm,
            ));
        }
    }
    if !diffs.is_empty() {
        println!(
            "{}",
            serde_json::json!({
                "mode": mode,
                "patched_autodiff": PATCHED_AUTODIFF,
                "max_rel_diff": diffs,
                "seconds": seconds,
            })
        );
    }
    Ok(())
}
