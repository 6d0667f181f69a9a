//! `bfpp`: train with breadth-first (and other) pipeline schedules, and generate, lower,
//! check and print those schedules.
//!
//! `bfpp train` is the main job: it trains a GPT with the engine and reports progress,
//! metrics and the timeline (see `cli::train` and `cli::config` for its configuration);
//! `bfpp schedule` runs the library's pass pipeline (generate → lower_p2p →
//! lower_data_parallel → validate) and prints the result in one of four formats;
//! `bfpp validate` checks a schedule CSV written by `bfpp` or by PyTorch's pipelining.

#![warn(missing_docs)]

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use burn_bfpp::schedule::{
    from_csv, render_actions, render_grid, to_csv, to_csv_with, validate, CsvNaming, Placement,
    ProgramSpec, ScheduleKind, ScheduleSpec, ZeroLevel,
};
use clap::{Args, Parser, Subcommand, ValueEnum};

use cli::{write_output, CliError};

#[derive(Debug, Parser)]
#[command(
    name = "bfpp",
    version,
    about = "Breadth-first pipeline parallelism for Burn: train, and generate, lower and check \
             pipeline schedules"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a GPT with pipeline and data parallelism on the CPU, wgpu or CUDA; with no
    /// flags, the built-in demonstration: pp 2, loops 2, dp 2, breadth-first, ZeRO-3.
    #[cfg(feature = "flex")]
    Train(Box<cli::args::TrainArgs>),
    /// Train (not built into this binary: rebuild with `--features flex`).
    #[cfg(not(feature = "flex"))]
    Train(NotBuilt),
    /// Export a checkpoint (not built into this binary: rebuild with `--features flex`).
    #[cfg(not(feature = "flex"))]
    Export(NotBuilt),
    /// Launch ranks as processes (not built into this binary: rebuild with `--features flex`).
    #[cfg(not(feature = "flex"))]
    Launch(NotBuilt),
    /// Write a checkpoint's consolidated weights as a Burn record of the plain
    /// single-device GPT (loadable with `Gpt::load_file` or `bfpp train --init`).
    #[cfg(feature = "flex")]
    Export(cli::checkpoint::ExportArgs),
    /// Generate a schedule, add transfers and data-parallel collectives, validate it, print it.
    Schedule(ScheduleArgs),
    /// Check a schedule CSV (one line per rank, as written by `bfpp` or PyTorch pipelining).
    Validate(ValidateArgs),
    /// Predict one optimizer step of a layout: step time, throughput, bubble, exposed
    /// communication, memory; optionally draw its timeline, trace and memory.
    Simulate(Box<cli::simulate::SimulateArgs>),
    /// Rank the layouts of a model on N GPUs for a global batch by simulated throughput, or
    /// explain one layout.
    Plan(Box<cli::plan::PlanArgs>),
    /// The best layout of each family: breadth-first, depth-first, 1f1b, gpipe, megatron, and
    /// the zero-bubble breadth-first-zb, interleaved-zb, zb-h1, zb-v, dualpipev.
    Compare(Box<cli::plan::CompareArgs>),
    /// Start N ranks of `bfpp train` as processes: under mpirun for CPU ranks (builds with
    /// --features mpi), one process per GPU with NCCL for `--backend cuda`:
    /// `bfpp launch --nproc 4 -- train --pp 2 --dp 2`.
    #[cfg(feature = "flex")]
    Launch(cli::launch::LaunchArgs),
}

/// The arguments of a command this binary was built without; they are not read, since the
/// command only says how to get it.
#[cfg(not(feature = "flex"))]
#[derive(Debug, Args)]
struct NotBuilt {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    args: Vec<String>,
}

/// The error of a command this binary was built without (`--no-default-features`).
#[cfg(not(feature = "flex"))]
fn not_built(command: &str) -> Result<(), CliError> {
    Err(CliError::NotBuilt(format!(
        "`bfpp {command}` is not built into this binary (it was built without default \
         features, so without Burn): rebuild with `cargo build --release --features flex` \
         (or wgpu/cuda for GPUs)"
    )))
}

#[derive(Debug, Args)]
struct ScheduleArgs {
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

#[derive(Debug, Args)]
struct ValidateArgs {
    /// The schedule CSV file.
    #[arg(value_name = "FILE.csv")]
    file: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PlacementArg {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
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

fn main() -> ExitCode {
    // Usage errors exit through clap (code 2), --help and --version with 0.
    let cli = Cli::parse();
    let result = match cli.command {
        #[cfg(feature = "flex")]
        Command::Train(args) => cli::train::run(&args),
        #[cfg(feature = "flex")]
        Command::Export(args) => cli::checkpoint::export(&args)
            .map(|files| {
                for file in files {
                    eprintln!("wrote {}", file.display());
                }
            })
            .map_err(CliError::from),
        Command::Schedule(args) => run_schedule(&args),
        Command::Validate(args) => run_validate(&args),
        Command::Simulate(args) => cli::simulate::run(&args),
        Command::Plan(args) => cli::plan::run_plan(&args),
        Command::Compare(args) => cli::plan::run_compare(&args),
        #[cfg(feature = "flex")]
        Command::Launch(args) => cli::launch::run(&args).map_err(CliError::from),
        #[cfg(not(feature = "flex"))]
        Command::Train(_) => not_built("train"),
        #[cfg(not(feature = "flex"))]
        Command::Export(_) => not_built("export"),
        #[cfg(not(feature = "flex"))]
        Command::Launch(_) => not_built("launch"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            cli::report_error(&err);
            ExitCode::FAILURE
        }
    }
}

fn run_schedule(args: &ScheduleArgs) -> Result<(), CliError> {
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
        Format::Json => cli::json_summary(
            &spec,
            args.zero,
            args.buffers,
            &program.lowered,
            &program.report,
        ),
    };
    write_output(args.output.as_deref(), &text)
}

fn run_validate(args: &ValidateArgs) -> Result<(), CliError> {
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
