//! `bfpp schedule` and `bfpp validate`: the library's pass pipeline (generate → lower_p2p →
//! lower_data_parallel → validate) printed in one of five formats, and a schedule CSV checked;
//! also the reading of a schedule file that `simulate` and `train --schedule-file` share.

use std::path::{Path, PathBuf};

use burn_bfpp::schedule::{
    from_csv, render_actions, render_grid, to_csv, to_csv_with, validate, CsvNaming,
    PipelineSchedule, Placement, ProgramSpec, ScheduleKind, ScheduleSpec, ValidationReport,
    ZeroLevel,
};
use clap::{Args, ValueEnum};
use serde_json::json;

use super::error::CliError;
use super::output::write_output;

/// `bfpp schedule`: generate, lower and check a schedule, and print it.
#[derive(Debug, Args)]
pub struct ScheduleArgs {
    /// Schedule family: gpipe, 1f1b, interleaved (alias depth-first), breadth-first (alias
    /// bf), or with split backwards zb-h1, interleaved-zb, zb-v, breadth-first-zb,
    /// dualpipev (overlapped forward/backward pairs).
    #[arg(long, default_value = "breadth-first", value_name = "NAME")]
    schedule: ScheduleKind,
    /// Pipeline ranks P.
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Stages per rank V [default: 2; 1 for gpipe and 1f1b].
    #[arg(long)]
    loops: Option<usize>,
    /// Micro-batches per optimizer step M.
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Breadth-first micro-batches per sweep K (must divide M) [default: M].
    #[arg(long)]
    bf_microbatches: Option<usize>,
    /// Stage → rank placement.
    #[arg(long, value_enum, default_value_t = PlacementArg::Looping)]
    placement: PlacementArg,
    /// ZeRO level of the data-parallel lowering: 0, 1, 2 or 3.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// Rotating full-size weight and gradient buffers per rank.
    #[arg(long, default_value_t = 2)]
    buffers: usize,
    /// Output format: per-rank compute order, time-step grid, lowered CSV, or a JSON summary.
    #[arg(long, value_enum, default_value_t = Format::Grid)]
    format: Format,
    /// Write to FILE instead of standard output.
    #[arg(long, short, value_name = "FILE")]
    output: Option<PathBuf>,
}

/// `bfpp validate`: check a schedule CSV written by `bfpp` or by PyTorch's pipelining.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The schedule CSV file.
    #[arg(value_name = "FILE.csv")]
    file: PathBuf,
}

/// `--placement`: which rank each stage runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    /// Stage s on rank s mod P.
    Looping,
    /// Odd loops run the ranks backwards.
    VShape,
}

impl From<PlacementArg> for Placement {
    fn from(arg: PlacementArg) -> Self {
        match arg {
            PlacementArg::Looping => Placement::Looping,
            PlacementArg::VShape => Placement::VShape,
        }
    }
}

/// `--format`: how `bfpp schedule` prints the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// `rank R: ` and the rank's compute actions, one line per rank.
    Actions,
    /// Time-step × rank table of the unit-time replay.
    Grid,
    /// The lowered schedule, one CSV line per rank (PyTorch pipelining's layout).
    Csv,
    /// The same in PyTorch's earlier naming (`B` input-only backward, `BW` full backward),
    /// for tools that read only that one.
    CsvLegacy,
    /// Parameters, timing, lowered action lists and collective counts.
    Json,
}

/// Runs `bfpp schedule`.
pub fn run_schedule(args: &ScheduleArgs) -> Result<(), CliError> {
    let kind = args.schedule;
    let default_loops = kind.family().default_loops;
    let spec = ScheduleSpec {
        kind,
        pp: args.pp,
        loops: args.loops.unwrap_or(default_loops),
        microbatches: args.microbatches,
        bf_microbatches: args.bf_microbatches,
        placement: args.placement.into(),
    };
    let zero = ZeroLevel::from_number(args.zero)?;
    let program = ProgramSpec::new(spec.clone(), zero)
        .with_buffers(args.buffers)
        .compile()?;
    let text = match args.format {
        Format::Actions => render_actions(&program.compute),
        Format::Grid => render_grid(&program.compute)?,
        Format::Csv => to_csv(&program.lowered),
        Format::CsvLegacy => to_csv_with(&program.lowered, CsvNaming::Legacy),
        Format::Json => json_summary(
            &spec,
            args.zero,
            args.buffers,
            &program.lowered,
            &program.report,
        ),
    };
    write_output(args.output.as_deref(), &text)
}

/// Runs `bfpp validate`.
pub fn run_validate(args: &ValidateArgs) -> Result<(), CliError> {
    let path = &args.file;
    let text = std::fs::read_to_string(path).map_err(|source| CliError::Read {
        path: path.clone(),
        source,
    })?;
    let in_file = |source| CliError::InFile {
        path: path.clone(),
        source,
    };
    let schedule = from_csv(&text).map_err(in_file)?;
    let report = validate(&schedule).map_err(in_file)?;
    let line = format!(
        "valid: {} ranks, {} stages, {} micro-batches, makespan {} units (forward 1, backward 2), \
         bubble {:.4}\n",
        schedule.num_ranks(),
        schedule.num_stages(),
        schedule.microbatches,
        report.makespan,
        report.bubble_fraction,
    );
    write_output(None, &line)
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
