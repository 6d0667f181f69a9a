//! `bfpp train`: configure, check, train on the chosen backend, report.
//!
//! The order matters for failing fast: the configuration is resolved and fully validated
//! (including the schedule, which is generated and dry-run) before the corpus is loaded, and
//! the corpus before the model is built, so a bad config or `--data` path is reported within
//! milliseconds and before anything is written.

use burn_bfpp::comm::RankGrid;
use burn_bfpp::data::{load_corpus, Batcher};
use burn_bfpp::engine::{
    CheckpointSink, Checkpointing, EngineError, ResumeSource, StepReport, Trainer,
};

use super::args::TrainArgs;
use super::backend::{BackendChoice, CliBackend, RankWorld, WorldRequest};
use super::checkpoint::{prepare, Prepared};
use super::config::{BfppConfig, Plan};
use super::error::{CliError, TrainError};
use super::fault::{self, fault_from_env};
use super::output::write_output;
use super::predict::{predict, resolve_hardware};
use super::report::{self, render, Header, Progress};

/// Runs `bfpp train`.
pub fn run(args: &TrainArgs) -> Result<(), CliError> {
    match execute(args)? {
        Some(text) => write_output(None, &text),
        None => Ok(()),
    }
}

/// Trains; returns what to print on standard output at the end, if anything.
fn execute(args: &TrainArgs) -> Result<Option<String>, TrainError> {
    let cfg = args.resolve()?;
    if args.print_config {
        return Ok(Some(cfg.to_toml()));
    }
    match args.backend {
        #[cfg(feature = "flex")]
        BackendChoice::Flex => train_on::<burn::backend::Autodiff<burn::backend::Flex>>(args, &cfg),
        #[cfg(feature = "wgpu")]
        BackendChoice::Wgpu => train_on::<burn::backend::Autodiff<burn::backend::Wgpu>>(args, &cfg),
        #[cfg(feature = "cuda")]
        BackendChoice::Cuda => train_on::<burn::backend::Autodiff<burn::backend::Cuda>>(args, &cfg),
        #[allow(unreachable_patterns)]
        other => Err(other.not_built()),
    }
}

/// Trains `cfg` on backend `B`.
fn train_on<B: CliBackend>(
    args: &TrainArgs,
    cfg: &BfppConfig,
) -> Result<Option<String>, TrainError> {
    let Plan {
        train,
        layout,
        batch,
    } = cfg.plan()?;
    let fault = fault_from_env(train.world_size())?;
    // Predict first: a layout the simulator cannot cost is refused before any training.
    let prediction = match &args.hardware {
        Some(name) => Some(predict(
            &cfg.model,
            &train,
            &layout,
            &resolve_hardware(name, B::CHOICE),
        )?),
        None => None,
    };
    let corpus = load_corpus(cfg.data.path.as_deref(), &cfg.data.markov.to_markov())?;
    let batcher = Batcher::new(corpus.as_ref(), batch)?;
    let request = WorldRequest {
        comm: args.comm,
        gpus: args.gpus,
    };
    if args.plain_burn {
        let device = B::plain_device(request)?;
        return super::baseline::run::<B>(args, cfg, &train, &layout, &batcher, device, prediction);
    }
    let world = B::join(request, &train)?;
    let device = world.home_device();
    let steps = train.steps;
    // The model is described, not built: each rank builds its own stages.
    let Prepared {
        model,
        resume,
        sink,
    } = prepare::<B>(
        &args.ckpt,
        &cfg.model,
        cfg.run.seed,
        &train,
        &device,
        &batcher,
    )?;
    let out_dir = &cfg.run.out_dir;
    std::fs::create_dir_all(out_dir).map_err(|source| TrainError::Write {
        path: out_dir.clone(),
        source,
    })?;
    let tokens_per_step = layout.global_batch() * batch.seq_len;
    // With ranks as processes only world rank 0 prints the header and summary, and only
    // the rank that learns the loss draws the progress bar and writes metrics.
    let root = world.process_rank().is_none_or(|r| r == 0);
    let reports_loss = match world.process_rank() {
        None => true,
        Some(rank) => super::backend::holds_the_loss(rank, &train)?,
    };
    let show = !(args.json || args.quiet) && root;
    if show {
        Header {
            cfg,
            train: &train,
            layout: &layout,
            backend: B::CHOICE,
            world: world.describe(),
            corpus: corpus.describe(),
            params: report::param_count(&cfg.model.skeleton::<B>(&device)?),
        }
        .print();
    }
    let fresh: Vec<burn_bfpp::engine::RankState> = Vec::new();
    let resume_from: &dyn ResumeSource = match &resume {
        Some(dir) => dir,
        None => &fresh,
    };
    let resumed_at = resume_from.step();
    let progress = Progress::new(
        steps,
        tokens_per_step,
        &out_dir.join(report::METRICS_FILE),
        !(args.json || args.quiet) && reports_loss,
        !args.quiet,
        reports_loss.then_some(resumed_at),
    )?;
    // The engine numbers steps from 1, the batcher from 0; an error stops every rank, naming
    // the step, the rank and the micro-batch.
    let data = |step: usize, dp_index: usize, microbatch: usize| {
        batcher.micro_batch::<B>((step - 1) as u64, &layout, dp_index, microbatch, &device)
    };
    let on_step = |r: &StepReport| {
        let epochs = batcher.epochs_started((r.step - 1) as u64);
        progress.step(r, epochs);
    };
    let trainer = Trainer::new(train.clone())
        .on_step(on_step)
        .checkpointing(Checkpointing {
            resume: resume_from,
            every: args.ckpt.save_every.unwrap_or(0),
            at_end: sink.is_some(),
            sink: sink.as_ref().map(|s| s as &dyn CheckpointSink),
        });
    let trainer = fault::inject(trainer, fault);
    let devices = world.devices_used();
    let transports =
        world.transports(RankGrid::new(train.pp, train.dp).map_err(EngineError::from)?);
    let outcome = world.fit(trainer, &model, data);
    progress.finish();
    let Some(outcome) = outcome? else {
        // Another process than world rank 0: rank 0 reports the run.
        return Ok(None);
    };
    progress.take_error()?;
    let files = report::write_timeline(out_dir, &outcome.timelines)?;
    let summary = report::Summary::new(
        &outcome,
        tokens_per_step,
        corpus.entropy_rate(),
        files,
        progress.metrics_path(),
        transports.text(),
    );
    Ok(Some(render(
        args,
        &summary,
        prediction.as_ref(),
        devices,
        tokens_per_step,
    ))
    .flatten())
}
