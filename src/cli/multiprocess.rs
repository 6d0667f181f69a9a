//! How `bfpp train` runs its ranks: as threads of this process, or as one process each.
//!
//! Under `mpirun`/`srun` (detected from the launcher's environment, or asked for with
//! `--comm mpi`) every process runs one rank over MPI; under torchrun, `bfpp launch` or any
//! launcher that sets `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` (or Slurm's
//! `SLURM_PROCID`/`SLURM_NTASKS`), or with `--comm tcp`, over TCP connections between the
//! processes. Either way each process trains with [`train_processes_with`]; world rank 0
//! prints the header and the summary, and the rank that knows the loss draws the progress
//! bar. Without the `mpi` feature a request for MPI ranks fails with the rebuild command.

use burn::backend::Flex;
use burn_bfpp::comm::{
    CommConfig, Communicator, ProcessComm, RankGrid, RendezvousEnv, TcpComm, Transport,
};
use burn_bfpp::engine::{
    train_local_with, train_processes_with, Checkpointing, EngineConfig, EngineError, StepReport,
    TrainOutcome,
};
use burn_bfpp::model::{Gpt, MicroBatch};
use clap::ValueEnum;

use super::train::{Backend, TrainError};

/// `--comm`: where the ranks of `bfpp train` live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum CommMode {
    /// MPI processes when started by `mpirun`/`srun`, TCP-connected processes when started by
    /// torchrun or `bfpp launch` (RANK/WORLD_SIZE set), threads of this process otherwise.
    #[default]
    Auto,
    /// Threads of this process.
    Local,
    /// One MPI process per rank (needs a build with `--features mpi` and `mpirun -np pp×dp`).
    Mpi,
    /// One process per rank, connected over TCP; the launcher sets RANK, WORLD_SIZE,
    /// MASTER_ADDR and MASTER_PORT (torchrun, `bfpp launch --via tcp`, or by hand).
    Tcp,
}

/// The ranks of this run, as seen from this process.
pub enum Ranks {
    /// All ranks are threads of this process.
    Local,
    /// This process is one rank of an MPI world (boxed: the communicator is large and the
    /// `Local` variant empty).
    #[cfg(feature = "mpi")]
    Mpi(Box<burn_bfpp::comm::MpiComm<Flex>>),
    /// This process is one rank of a world of processes connected over TCP.
    Tcp(Box<TcpComm<Flex>>),
}

impl Ranks {
    /// Decides (and for processes, joins) the world of this run; the world size must be
    /// pp × dp.
    pub fn join(mode: CommMode, engine: &EngineConfig) -> Result<Self, TrainError> {
        let rendezvous = || {
            RendezvousEnv::from_env().map_err(|e| {
                TrainError::Config(format!("{e}; unset the variable or set it correctly"))
            })
        };
        let mode = match mode {
            CommMode::Auto if mpi_launch_env().is_some_and(|(_, size)| size > 1) => CommMode::Mpi,
            CommMode::Auto if rendezvous()?.is_some_and(|env| env.world_size > 1) => CommMode::Tcp,
            CommMode::Auto => CommMode::Local,
            chosen => chosen,
        };
        if mode == CommMode::Local {
            return Ok(Ranks::Local);
        }
        let grid = RankGrid::new(engine.pp, engine.dp).map_err(EngineError::from)?;
        let config = engine.comm_config();
        if mode == CommMode::Mpi {
            return Self::join_mpi(grid, config);
        }
        let env = rendezvous()?.ok_or_else(|| {
            TrainError::Config(format!(
                "--comm tcp needs the launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT \
                 (or SLURM_PROCID and SLURM_NTASKS); start the {} processes with \
                 `bfpp launch --nproc {} -- train …` or torchrun, or run with --comm local",
                grid.world_size(),
                grid.world_size()
            ))
        })?;
        let comm =
            TcpComm::connect(&env, grid, Default::default(), config).map_err(EngineError::from)?;
        Ok(Ranks::Tcp(Box::new(comm)))
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
             and libclang), start the processes with `bfpp launch --via tcp` instead, or run \
             with --comm local",
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
            Ranks::Tcp(comm) => comm.rank() == 0,
        }
    }

    /// Whether this process learns the loss of every step (it holds the last stage of
    /// replica 0), so its progress bar moves.
    pub fn reports_loss(&self, engine: &EngineConfig) -> Result<bool, TrainError> {
        match self {
            Ranks::Local => Ok(true),
            #[cfg(feature = "mpi")]
            Ranks::Mpi(comm) => holds_the_loss(comm.as_ref(), engine),
            Ranks::Tcp(comm) => holds_the_loss(comm.as_ref(), engine),
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
            Ranks::Tcp(comm) => train_processes_with::<Backend, _, _, _, _>(
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
