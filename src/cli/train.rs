//! `bfpp train`: configure, check, train on the chosen backend, report.
//!
//! The order matters for failing fast: the configuration is resolved and fully validated
//! (including the schedule, which is generated and dry-run) before the corpus is loaded, and
//! the corpus before the model is built, so a bad config or `--data` path is reported within
//! milliseconds and before anything is written.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use burn_bfpp::checkpoint::CheckpointError;
use burn_bfpp::data::{load_corpus, Batcher, DataError};
use burn_bfpp::engine::{
    CheckpointSink, Checkpointing, EngineError, Fault, FaultKind, ResumeSource, StepReport, Trainer,
};
use burn_bfpp::model::ModelError;
use burn_bfpp::schedule::ScheduleError;

use super::args::TrainArgs;
use super::backend::{BackendChoice, CliBackend, RankWorld, WorldRequest};
use super::checkpoint::{prepare, Prepared};
use super::config::{BfppConfig, Plan};
use super::predict::{predict, resolve_hardware, MeasuredStep, Prediction};
use super::report::{self, Header, Progress};
use super::write_output;

/// The environment variable that injects a fault:
/// `rank=R,step=S[,kind=error|panic|nan|sleep|abort][,secs=T]` (`secs` goes with `kind=sleep`).
pub const FAULT_ENV: &str = "BFPP_FAULT_INJECT";

/// Everything `bfpp train` can fail with. Each message says what to change.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration is inconsistent or out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The `--config` file is not valid TOML for a `BfppConfig`.
    #[error(
        "{}: {message}\n(run `bfpp train --print-config` for the format of every section)",
        path.display()
    )]
    ConfigFile {
        /// The file.
        path: PathBuf,
        /// The parser's message (line, column, key).
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read `{}`: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: io::Error,
    },
    /// `BFPP_FAULT_INJECT` is malformed or names a rank that does not exist.
    #[error("{FAULT_ENV}: {0}")]
    Fault(String),
    /// The schedule cannot be built for this layout.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The model cannot be built or split.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The data cannot be read or batched.
    #[error(transparent)]
    Data(#[from] DataError),
    /// Training failed (a rank failed, panicked or timed out).
    #[error("training failed: {0}")]
    Engine(#[from] EngineError),
    /// `--hardware` names no preset, or the simulator cannot cost the layout.
    #[error(transparent)]
    Sim(#[from] burn_bfpp::sim::SimError),
    /// A checkpoint could not be saved, loaded or resharded.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// An output file could not be written.
    #[error("cannot write `{}`: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: io::Error,
    },
}

/// Parses `rank=R,step=S[,kind=error|panic|nan|sleep|abort][,secs=T]` (the step is 1-based, like
/// the engine's; `kind` defaults to `error`; `sleep` needs `secs`, the others refuse it).
pub fn parse_fault(text: &str) -> Result<Fault, TrainError> {
    const FORMAT: &str =
        "expected `rank=R,step=S[,kind=error|panic|nan|sleep|abort][,secs=T]` with \
                          S >= 1 (secs only with kind=sleep), e.g. `rank=1,step=2,kind=panic` \
                          or `rank=1,step=2,kind=sleep,secs=5`";
    let bad = |why: String| TrainError::Fault(format!("{why}; {FORMAT}"));
    let (mut rank, mut step, mut kind, mut secs) = (None, None, "error", None);
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
        let value = value.trim();
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| bad(format!("{key} = `{value}` is not a non-negative integer")))
        };
        match key.trim() {
            "rank" => rank = Some(number()?),
            "step" => step = Some(number()?),
            "kind" => {
                kind = match value {
                    "error" | "panic" | "nan" | "sleep" | "abort" => value,
                    other => return Err(bad(format!("unknown kind `{other}`"))),
                }
            }
            "secs" => match value.parse::<f64>() {
                Ok(t) if t.is_finite() && t >= 0.0 => secs = Some(t),
                _ => return Err(bad(format!("secs = `{value}` is not a number of seconds"))),
            },
            other => return Err(bad(format!("unknown key `{other}`"))),
        }
    }
    let kind = match (kind, secs) {
        ("sleep", Some(t)) => FaultKind::Sleep(Duration::from_secs_f64(t)),
        ("sleep", None) => return Err(bad("kind=sleep needs secs=T".into())),
        (other, Some(_)) => return Err(bad(format!("secs goes with kind=sleep, not {other}"))),
        ("panic", None) => FaultKind::Panic,
        ("nan", None) => FaultKind::NonFinite,
        ("abort", None) => FaultKind::Abort,
        _ => FaultKind::Error,
    };
    match (rank, step) {
        (Some(rank), Some(step)) if step >= 1 => Ok(Fault { rank, step, kind }),
        (Some(_), Some(_)) => Err(bad("step 0 is not an optimizer step".into())),
        _ => Err(bad(format!("`{text}` lacks rank or step"))),
    }
}

/// The fault from the environment, if the variable is set (and not empty).
fn fault_from_env() -> Result<Option<Fault>, TrainError> {
    match std::env::var(FAULT_ENV) {
        Ok(text) if !text.trim().is_empty() => parse_fault(&text).map(Some),
        Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(TrainError::Fault("the value is not valid UTF-8".into()))
        }
    }
}

/// Runs `bfpp train`.
pub fn run(args: &TrainArgs) -> Result<(), super::CliError> {
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
    let fault = fault_from_env()?;
    let Plan {
        train,
        layout,
        batch,
    } = cfg.plan(fault)?;
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
    let mut trainer = Trainer::new(train.clone())
        .on_step(on_step)
        .checkpointing(Checkpointing {
            resume: resume_from,
            every: args.ckpt.save_every.unwrap_or(0),
            at_end: sink.is_some(),
            sink: sink.as_ref().map(|s| s as &dyn CheckpointSink),
        });
    if let Some(fault) = fault {
        trainer = trainer.inject_fault(fault);
    }
    let devices = world.devices_used();
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

/// The end of a run on standard output: the summary as text or JSON, with the measured
/// beside the predicted figures when `--hardware` was given; nothing under `--quiet`.
pub fn render(
    args: &TrainArgs,
    summary: &report::Summary,
    prediction: Option<&Prediction>,
    devices: usize,
    tokens_per_step: usize,
) -> Option<String> {
    let measured = MeasuredStep {
        step_s: summary.steady_step_s(),
        devices,
    };
    if args.json {
        let mut doc = summary.json_value();
        if let (Some(p), Some(fields)) = (prediction, doc.as_object_mut()) {
            fields.insert("hardware".into(), p.json(measured));
        }
        Some(format!("{doc}\n"))
    } else if args.quiet {
        None
    } else {
        let mut text = summary.text();
        if let Some(p) = prediction {
            text += &p.text(measured, tokens_per_step);
        }
        Some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse() {
        let f = parse_fault("rank=1,step=3").expect("valid");
        assert_eq!((f.rank, f.step, f.kind), (1, 3, FaultKind::Error));
        let kind = |text: &str| parse_fault(text).expect(text).kind;
        assert_eq!(kind(" rank = 0 , step=1, kind=panic "), FaultKind::Panic);
        assert_eq!(kind("rank=0,step=1,kind=nan"), FaultKind::NonFinite);
        assert_eq!(
            kind("rank=0,step=1,kind=sleep,secs=2.5"),
            FaultKind::Sleep(Duration::from_millis(2500))
        );
        for bad in [
            "",
            "rank=1",
            "rank=1,step=0",
            "rank=x,step=1",
            "rank=1,step=1,kind=boom",
            "rank=1,step=1,when=now",
            "rank1,step=1",
            "rank=1,step=1,kind=sleep",
            "rank=1,step=1,kind=nan,secs=1",
            "rank=1,step=1,kind=sleep,secs=-1",
            "rank=1,step=1,kind=sleep,secs=soon",
        ] {
            let err = parse_fault(bad).expect_err(bad).to_string();
            assert!(err.contains("rank=R,step=S"), "{bad}: {err}");
        }
    }
}
