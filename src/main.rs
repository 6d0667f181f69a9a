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

use std::process::ExitCode;

#[cfg(not(feature = "flex"))]
use clap::Args;
use clap::{Parser, Subcommand};

use cli::error::CliError;
use cli::schedule::{run_schedule, run_validate, ScheduleArgs, ValidateArgs};

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
            cli::output::report_error(&err);
            ExitCode::FAILURE
        }
    }
}
