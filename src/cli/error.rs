//! The errors of `bfpp`'s commands, at the bottom of the CLI's modules so that every command
//! can return them without importing another command: [`CliError`] for every command, with
//! [`TrainError`] for `train` and `export`.

use std::io;
use std::path::PathBuf;

#[cfg(feature = "flex")]
use burn_bfpp::checkpoint::CheckpointError;
#[cfg(feature = "flex")]
use burn_bfpp::data::DataError;
#[cfg(feature = "flex")]
use burn_bfpp::engine::EngineError;
#[cfg(feature = "flex")]
use burn_bfpp::model::ModelError;
use burn_bfpp::schedule::{with_file_lines, ScheduleError};

/// Everything a command can fail with; printed as `error: {this}` with exit code 1.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad parameters, or a schedule that does not lower or validate.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A schedule read from a file is malformed or invalid (each rank it names with its line).
    #[error("{}: {}", path.display(), with_file_lines(&source.to_string()))]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: ScheduleError,
    },
    /// A layout flag disagrees with the schedule file that sets it.
    #[error("{0}")]
    FileLayout(String),
    /// An input file could not be read.
    #[error("cannot read `{}`: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: io::Error,
    },
    /// The output file could not be written.
    #[error("cannot write `{}`: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        source: io::Error,
    },
    /// A simulator configuration is invalid, or the simulation failed.
    #[error(transparent)]
    Sim(#[from] burn_bfpp::sim::SimError),
    /// A model or hardware TOML file is invalid.
    #[error("{}: {source}", path.display())]
    SimFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: burn_bfpp::sim::SimError,
    },
    /// The planner failed, or nothing fits.
    #[error(transparent)]
    Plan(#[from] burn_bfpp::plan::PlanError),
    /// A picture could not be written.
    #[error(transparent)]
    Viz(#[from] burn_bfpp::viz::VizError),
    /// `bfpp train` failed.
    #[cfg(feature = "flex")]
    #[error(transparent)]
    Train(#[from] TrainError),
    /// `bfpp launch` failed.
    #[cfg(feature = "flex")]
    #[error(transparent)]
    Launch(#[from] super::launch::LaunchError),
    /// The command is not built into this binary; the message names the feature.
    #[cfg(not(feature = "flex"))]
    #[error("{0}")]
    NotBuilt(String),
    /// Standard output could not be written.
    #[error("cannot write to standard output: {0}")]
    Stdout(io::Error),
}

/// Everything `bfpp train` can fail with. Each message says what to change.
#[cfg(feature = "flex")]
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
    /// `BFPP_FAULT_INJECT` is malformed or names a rank that does not exist, or is set in a
    /// build without the test-only feature `fault-injection`.
    #[error("{0}")]
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
