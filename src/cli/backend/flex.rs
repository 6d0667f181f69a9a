//! `--backend flex`: Burn's CPU backend, ranks as threads of this process or one MPI process
//! each.

use burn::backend::{Autodiff, Flex};

use super::*;

/// The ranks of a CPU run: threads, or (with `--features mpi`) this process as one MPI rank.
pub enum FlexWorld {
    /// Threads of this process.
    Threads(ThreadWorld<Autodiff<Flex>>),
    /// One rank of a world of MPI processes (boxed: the communicator is large).
    #[cfg(feature = "mpi")]
    Mpi(Box<burn_bfpp::comm::MpiComm<Flex>>),
}

impl RankWorld<Autodiff<Flex>> for FlexWorld {
    fn describe(&self) -> String {
        match self {
            FlexWorld::Threads(t) => RankWorld::<Autodiff<Flex>>::describe(t),
            #[cfg(feature = "mpi")]
            FlexWorld::Mpi(comm) => {
                use burn_bfpp::comm::Communicator;
                format!(
                    "{} ranks as MPI processes (this is rank {})",
                    comm.grid().world_size(),
                    comm.rank()
                )
            }
        }
    }

    fn process_rank(&self) -> Option<usize> {
        match self {
            FlexWorld::Threads(_) => None,
            #[cfg(feature = "mpi")]
            FlexWorld::Mpi(comm) => Some(burn_bfpp::comm::Communicator::rank(comm.as_ref())),
        }
    }

    fn home_device(&self) -> burn::backend::flex::FlexDevice {
        Default::default()
    }

    fn devices_used(&self) -> usize {
        1
    }

    fn transports(&self, grid: RankGrid) -> Transports {
        match self {
            FlexWorld::Threads(t) => RankWorld::<Autodiff<Flex>>::transports(t, grid),
            #[cfg(feature = "mpi")]
            FlexWorld::Mpi(_) => Transports::new(grid, "MPI", "MPI"),
        }
    }

    fn fit<M, D>(self, trainer: Trainer<'_>, model: &M, data: D) -> Fitted<Autodiff<Flex>>
    where
        M: ModelDescription<Autodiff<Flex>, Stage = GptStage<Autodiff<Flex>>>,
        D: DataSource<Autodiff<Flex>>,
    {
        match self {
            FlexWorld::Threads(t) => t.fit(trainer, model, data),
            #[cfg(feature = "mpi")]
            FlexWorld::Mpi(comm) => trainer.in_process(comm.as_ref()).fit_described(model, data),
        }
    }
}

impl CliBackend for Autodiff<Flex> {
    type World = FlexWorld;
    const CHOICE: BackendChoice = BackendChoice::Flex;

    fn join(request: WorldRequest, train: &TrainConfig) -> Result<FlexWorld, TrainError> {
        cuda_only(request, Self::CHOICE)?;
        let world = train.world_size();
        let mpi_env = mpi_launch_env().is_some_and(|(_, size)| size > 1);
        let mpi = match request.comm {
            CommMode::Mpi => true,
            CommMode::Auto if mpi_env => true,
            CommMode::Auto => {
                if let Some(env) = process_launch()? {
                    return Err(not_gpu_processes(&env, Self::CHOICE, world));
                }
                false
            }
            _ => false,
        };
        if mpi {
            return join_mpi(train);
        }
        Ok(FlexWorld::Threads(ThreadWorld::new(world, |_| {
            Default::default()
        })))
    }

    fn plain_device(_request: WorldRequest) -> Result<Self::Device, TrainError> {
        Ok(Default::default())
    }
}

#[cfg(feature = "mpi")]
fn join_mpi(train: &TrainConfig) -> Result<FlexWorld, TrainError> {
    let grid = RankGrid::new(train.pp, train.dp).map_err(EngineError::from)?;
    let config = burn_bfpp::comm::CommConfig {
        overlap_collectives: train.overlap_collectives,
        ..burn_bfpp::comm::CommConfig::with_timeout(std::time::Duration::from_secs_f64(
            train.comm_timeout_secs,
        ))
    };
    let comm = burn_bfpp::comm::MpiComm::init(grid, Default::default(), config)
        .map_err(EngineError::from)?;
    Ok(FlexWorld::Mpi(Box::new(comm)))
}

#[cfg(not(feature = "mpi"))]
fn join_mpi(train: &TrainConfig) -> Result<FlexWorld, TrainError> {
    Err(TrainError::Config(format!(
        "MPI ranks were asked for (pp {} × dp {} processes) but this bfpp was built \
         without MPI; rebuild with `cargo build --release --features mpi` (needs OpenMPI \
         and libclang), or run the ranks as threads with --comm local",
        train.pp, train.dp
    )))
}

/// `(rank, size)` of an MPI launch, read from the launcher's environment.
fn mpi_launch_env() -> Option<(usize, usize)> {
    mpi_launch_from(|k| std::env::var(k).ok())
}
