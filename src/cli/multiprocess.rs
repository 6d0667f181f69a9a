//! How `bfpp train` runs its ranks: as threads of this process, or as one MPI process each.
//!
//! Under `mpirun`/`srun` (detected from the launcher's environment, or asked for with
//! `--comm mpi`) every process runs one rank over MPI and trains with
//! [`train_processes_with`]; world rank 0 prints the header and the summary, and the rank
//! that knows the loss draws the progress bar. Without the `mpi` feature a request for MPI
//! ranks fails with the rebuild command. A torchrun-style launch (`RANK`, `WORLD_SIZE`, …)
//! is for GPU ranks, one process per GPU over NCCL; CPU ranks started that way are refused
//! with the command that starts them under MPI.

use burn::backend::Flex;
use burn_bfpp::comm::{CommConfig, Communicator, ProcessComm, RankGrid, RendezvousEnv, Transport};
#[cfg(feature = "mpi")]
use burn_bfpp::engine::train_processes_with;
use burn_bfpp::engine::{
    train_local_with, Checkpointing, EngineConfig, EngineError, StepReport, TrainOutcome,
};
use burn_bfpp::model::{Gpt, MicroBatch};
use clap::ValueEnum;

use super::train::{Backend, TrainError};

/// `--comm`: where the ranks of `bfpp train` live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum CommMode {
    /// MPI processes when started by `mpirun`/`srun`, threads of this process otherwise.
    #[default]
    Auto,
    /// Threads of this process.
    Local,
    /// One MPI process per rank (needs a build with `--features mpi` and `mpirun -np pp×dp`).
    Mpi,
}

/// The ranks of this run, as seen from this process.
pub enum Ranks {
    /// All ranks are threads of this process.
    Local,
    /// This process is one rank of an MPI world (boxed: the communicator is large and the
    /// `Local` variant empty).
    #[cfg(feature = "mpi")]
    Mpi(Box<burn_bfpp::comm::MpiComm<Flex>>),
}

impl Ranks {
    /// Decides (and for processes, joins) the world of this run; the world size must be
    /// pp × dp.
    pub fn join(mode: CommMode, engine: &EngineConfig) -> Result<Self, TrainError> {
        let grid = RankGrid::new(engine.pp, engine.dp).map_err(EngineError::from)?;
        let mode = match mode {
            CommMode::Auto if mpi_launch_env().is_some_and(|(_, size)| size > 1) => CommMode::Mpi,
            CommMode::Auto => {
                let torchrun = RendezvousEnv::from_env().ok().flatten();
                if let Some(env) = torchrun.filter(|env| env.world_size > 1) {
                    return Err(TrainError::Config(format!(
                        "this process is rank {} of {} started with torchrun's variables \
                         (RANK, WORLD_SIZE), which start GPU ranks (one process per GPU, over \
                         NCCL); CPU ranks as processes run under MPI: `bfpp launch --nproc {} \
                         -- train …` (mpirun), or as threads of one process: `bfpp train …` \
                         alone",
                        env.rank,
                        env.world_size,
                        grid.world_size()
                    )));
                }
                CommMode::Local
            }
            chosen => chosen,
        };
        match mode {
            CommMode::Mpi => Self::join_mpi(grid, engine.comm_config()),
            _ => Ok(Ranks::Local),
        }
    }

    #[cfg(feature = "mpi")]
    fn join_mpi(grid: RankGrid, config: CommConfig) -> Result<Self, TrainError> {
        let comm = burn_bfpp::comm::MpiComm::init(grid, Default::default(), config)
            .map_err(EngineError::from)?;
        Ok(Ranks::Mpi(Box::new(comm)))
    }

    #[cfg(not(feature = "mpi"))]
    fn join_mpi(grid: RankGrid, _config: CommConfig) -> Result<Self, TrainError> {
        Err(TrainError::Config(format!(
            "MPI ranks were asked for (pp {} × dp {} processes) but this bfpp was built \
             without MPI; rebuild with `cargo build --release --features mpi` (needs OpenMPI \
             and libclang), or run the ranks as threads with --comm local",
            grid.pp(),
            grid.dp()
        )))
    }

    /// Whether this process prints the header and the summary (world rank 0).
    pub fn is_root(&self) -> bool {
        match self {
            Ranks::Local => true,
            #[cfg(feature = "mpi")]
            Ranks::Mpi(comm) => comm.rank() == 0,
        }
    }

    /// Whether this process learns the loss of every step (it holds the last stage of
    /// replica 0), so its progress bar moves.
    #[cfg_attr(not(feature = "mpi"), allow(unused_variables))]
    pub fn reports_loss(&self, engine: &EngineConfig) -> Result<bool, TrainError> {
        match self {
            Ranks::Local => Ok(true),
            #[cfg(feature = "mpi")]
            Ranks::Mpi(comm) => holds_the_loss(comm.as_ref(), engine),
        }
    }

    /// Trains; the outcome is `None` on processes other than world rank 0.
    // The arguments of `train_local_with`, passed through one to one.
    #[allow(clippy::too_many_arguments)]
    pub fn train<F, P>(
        &self,
        model: &Gpt<Backend>,
        engine: &EngineConfig,
        steps: usize,
        activation: [usize; 3],
        batch: F,
        on_step: P,
        checkpointing: Checkpointing<'_>,
    ) -> Result<Option<TrainOutcome<Gpt<Backend>>>, EngineError>
    where
        F: Fn(usize, usize, usize) -> MicroBatch<Backend> + Sync,
        P: Fn(&StepReport) + Sync,
    {
        match self {
            Ranks::Local => train_local_with(
                model,
                engine,
                steps,
                activation,
                batch,
                on_step,
                checkpointing,
            )
            .map(Some),
            #[cfg(feature = "mpi")]
            Ranks::Mpi(comm) => train_processes_with::<Backend, _, _, _, _>(
                comm.as_ref(),
                model,
                engine,
                steps,
                activation,
                batch,
                on_step,
                checkpointing,
            ),
        }
    }
}

/// Whether `comm`'s rank holds the last stage of replica 0.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn holds_the_loss<T: Transport>(
    comm: &ProcessComm<Flex, T>,
    engine: &EngineConfig,
) -> Result<bool, TrainError> {
    let program = engine.program()?;
    let last_pp = program.stage_ranks[program.num_stages() - 1];
    Ok(comm.rank() == comm.grid().rank_of(last_pp, 0))
}

/// `(rank, size)` of an MPI launch, read from the launcher's environment.
fn mpi_launch_env() -> Option<(usize, usize)> {
    #[cfg(feature = "mpi")]
    {
        burn_bfpp::comm::mpi_launch_env()
    }
    #[cfg(not(feature = "mpi"))]
    {
        let rank = std::env::var("OMPI_COMM_WORLD_RANK").ok()?.parse().ok()?;
        let size = std::env::var("OMPI_COMM_WORLD_SIZE").ok()?.parse().ok()?;
        Some((rank, size))
    }
}
