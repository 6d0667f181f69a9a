//! Helpers of the `bfpp` binary: its error type, output and the JSON summary, and the
//! `train` subcommand.

// Training, export and launch need Burn, so they exist only with the `flex` feature (on by
// default; `wgpu` and `cuda` imply it); the schedule tools need no backend.
#[cfg(feature = "flex")]
pub mod args;
#[cfg(feature = "flex")]
pub mod backend;
#[cfg(feature = "flex")]
pub mod baseline;
#[cfg(feature = "flex")]
pub mod checkpoint;
#[cfg(feature = "flex")]
pub mod config;
#[cfg(feature = "flex")]
pub mod launch;
pub mod plan;
#[cfg(feature = "flex")]
pub mod predict;
#[cfg(feature = "flex")]
pub mod report;
pub mod simulate;
#[cfg(feature = "flex")]
pub mod train;

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use burn_bfpp::schedule::{
    from_csv, with_file_lines, PipelineSchedule, ScheduleError, ScheduleSpec, ValidationReport,
};
use serde_json::json;

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
    Train(#[from] train::TrainError),
    /// `bfpp launch` failed.
    #[cfg(feature = "flex")]
    #[error(transparent)]
    Launch(#[from] launch::LaunchError),
    /// The command is not built into this binary; the message names the feature.
    #[cfg(not(feature = "flex"))]
    #[error("{0}")]
    NotBuilt(String),
    /// Standard output could not be written.
    #[error("cannot write to standard output: {0}")]
    Stdout(io::Error),
}

/// Print `error: ...` on standard error (ignoring a closed standard error).
pub fn report_error(err: &CliError) {
    // One write: standard error is unbuffered, and ranks that are processes share it, so a
    // line written in pieces would interleave with the other ranks' lines.
    let line = format!("error: {}\n", err.to_string().trim_end());
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// Write `text` to `path`, or to standard output when there is none. A reader that closes
/// the pipe early (`bfpp schedule | head`) is not an error.
pub fn write_output(path: Option<&Path>, text: &str) -> Result<(), CliError> {
    match path {
        Some(path) => std::fs::write(path, text).map_err(|source| CliError::Write {
            path: path.to_path_buf(),
            source,
        }),
        None => {
            let mut out = io::stdout().lock();
            match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(CliError::Stdout(e)),
                _ => Ok(()),
            }
        }
    }
}

/// The `--format json` document: the parameters, the unit-time makespan and bubble, the
/// lowered action lists and each rank's collective counts.
pub fn json_summary(
    spec: &ScheduleSpec,
    zero: u8,
    buffers: usize,
    lowered: &PipelineSchedule,
    report: &ValidationReport,
) -> String {
    let bf_microbatches = spec
        .kind
        .family()
        .breadth_first
        .then(|| spec.bf_microbatches.unwrap_or(spec.microbatches));
    let ranks: Vec<Vec<String>> = lowered
        .ranks
        .iter()
        .map(|list| list.iter().map(ToString::to_string).collect())
        .collect();
    let collectives: Vec<_> = report
        .collectives
        .iter()
        .map(|c| {
            json!({
                "unshard": c.unshard,
                "reshard": c.reshard,
                "reduce_grad": c.reduce_grad,
            })
        })
        .collect();
    let doc = json!({
        "schedule": spec.kind.name(),
        "pp": spec.pp,
        "loops": spec.loops,
        "microbatches": spec.microbatches,
        "bf_microbatches": bf_microbatches,
        "placement": spec.placement.name(),
        "zero": zero,
        "buffers": buffers,
        "makespan_units": report.makespan,
        "bubble_fraction": report.bubble_fraction,
        "ranks": ranks,
        "collectives": collectives,
    });
    format!("{doc:#}\n")
}

/// The compute order of a schedule file (`simulate` and `train --schedule-file`): the file
/// fixes pp, loops and microbatches, and a flag given with a different value is refused,
/// naming it.
pub(crate) fn read_schedule_file(
    path: &Path,
    pp: Option<usize>,
    loops: Option<usize>,
    microbatches: Option<usize>,
) -> Result<PipelineSchedule, CliError> {
    let text = std::fs::read_to_string(path).map_err(|source| CliError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let schedule = from_csv(&text).map_err(|source| CliError::InFile {
        path: path.to_path_buf(),
        source,
    })?;
    let (file_pp, stages, m) = (
        schedule.num_ranks(),
        schedule.num_stages(),
        schedule.microbatches,
    );
    let disagree = |flag: &str, given: usize, file: usize| {
        CliError::FileLayout(format!(
            "--{flag} {given} disagrees with {}, which has {flag} = {file}: drop --{flag} (the \
             file sets it)",
            path.display()
        ))
    };
    if let Some(given) = pp.filter(|&p| p != file_pp) {
        return Err(disagree("pp", given, file_pp));
    }
    if let Some(given) = microbatches.filter(|&g| g != m) {
        return Err(disagree("microbatches", given, m));
    }
    if let Some(given) = loops.filter(|&v| v * file_pp != stages) {
        return Err(disagree("loops", given, stages / file_pp.max(1)));
    }
    Ok(schedule)
}
