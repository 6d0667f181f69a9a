//! `bfpp train`: configure, check, train on `Autodiff<Flex>`, report.
//!
//! The order matters for failing fast: the configuration is resolved and fully validated
//! (including the schedule, which is generated and dry-run) before the corpus is loaded, and
//! the corpus before the model is built, so a bad config or `--data` path is reported within
//! milliseconds and before anything is written.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn_bfpp::checkpoint::CheckpointError;
use burn_bfpp::data::{load_corpus, Batcher, DataError};
use burn_bfpp::engine::{CheckpointSink, Checkpointing, EngineError, Fault, FaultKind};
use burn_bfpp::model::ModelError;
use burn_bfpp::schedule::ScheduleError;

use super::args::TrainArgs;
use super::checkpoint::{prepare, Prepared};
use super::config::Plan;
use super::report::{self, Header, Progress};
use super::write_output;

/// The backend of `bfpp train`: Burn's CPU backend with autodiff.
pub type Backend = Autodiff<Flex>;

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
    let fault = fault_from_env()?;
    let Plan {
        engine,
        layout,
        batch,
    } = cfg.plan(fault)?;
    let corpus = load_corpus(cfg.data.path.as_deref(), &cfg.data.markov.to_markov())?;
    let batcher = Batcher::new(corpus.as_ref(), batch)?;
    let device = Default::default();
    let model = {
        // Seeding and drawing use the backend's global random state: no other thread may draw
        // while this runs, and the lock is what the engine's threads take too.
        cfg.model.init_seeded::<Backend>(cfg.run.seed, &device)?
    };
    let steps = cfg.run.steps;
    let Prepared {
        model,
        resume,
        sink,
    } = prepare(
        &args.ckpt,
        &cfg.model,
        cfg.run.seed,
        steps,
        &engine,
        model,
        &batcher,
    )?;
    let out_dir = &cfg.run.out_dir;
    std::fs::create_dir_all(out_dir).map_err(|source| TrainError::Write {
        path: out_dir.clone(),
        source,
    })?;
    let tokens_per_step = layout.global_batch() * batch.seq_len;
    // Under MPI only world rank 0 prints the header and summary, and only the rank that
    // learns the loss draws the progress bar.
    let ranks = super::multiprocess::Ranks::join(args.comm, &engine)?;
    let root = ranks.is_root();
    let show = !(args.json || args.quiet) && root;
    let header = Header {
        cfg: &cfg,
        plan_layout: &layout,
        engine: &engine,
        corpus: corpus.describe(),
        params: report::param_count(&model),
    };
    if show {
        header.print();
    }
    // Only the process that learns the loss writes metrics (every rank thread of a local
    // run is in this process); a resumed run keeps the lines up to its checkpoint's step.
    let reports_loss = ranks.reports_loss(&engine)?;
    let resumed_at = resume.first().map_or(0, |state| state.step);
    let progress = Progress::new(
        steps,
        tokens_per_step,
        &out_dir.join(report::METRICS_FILE),
        !(args.json || args.quiet) && reports_loss,
        !args.quiet,
        reports_loss.then_some(resumed_at),
    )?;
    let activation = [layout.micro_batch_size, batch.seq_len, cfg.model.hidden];
    // The engine numbers steps from 1, the batcher from 0. `plan` checked the layout against
    // the batcher's global batch, so the only remaining failure would be a bug: the engine's
    // closure cannot return an error, so it panics and the engine reports the rank.
    let batch_of = |step: usize, dp_index: usize, microbatch: usize| {
        batcher
            .micro_batch::<Backend>((step - 1) as u64, &layout, dp_index, microbatch, &device)
            .unwrap_or_else(|e| panic!("micro-batch of step {step}: {e}"))
    };
    let on_step = |r: &burn_bfpp::engine::StepReport| {
        let epochs = batcher.epochs_started((r.step - 1) as u64);
        progress.step(r, epochs);
    };
    let checkpointing = Checkpointing {
        resume: &resume,
        every: args.ckpt.save_every.unwrap_or(0),
        at_end: sink.is_some(),
        sink: sink.as_ref().map(|s| s as &dyn CheckpointSink),
    };
    let outcome = ranks.train(
        &model,
        &engine,
        steps,
        activation,
        batch_of,
        on_step,
        checkpointing,
    );
    progress.finish();
    let Some(outcome) = outcome? else {
        // Another MPI rank than 0: rank 0 reports the run.
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
    Ok(if args.json {
        Some(summary.json())
    } else if args.quiet {
        None
    } else {
        Some(summary.text())
    })
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
