//! Where `bfpp train` computes (`--backend`) and where its ranks live (`--comm`, `--gpus`):
//! one [`CliBackend`] per Burn backend compiled in, each with the worlds of ranks it can run.
//!
//! * **flex** (Burn's CPU backend): ranks as threads of this process, or one MPI process each
//!   under `mpirun`/`srun` (`bfpp launch`, build with `--features mpi`).
//! * **wgpu** (`--features wgpu`): ranks as threads on the default adapter.
//! * **cuda** (`--features cuda`): ranks as threads, world rank `r` on GPU `r % --gpus`
//!   (collectives through host memory, or on NCCL with `--comm nccl`); or, started by
//!   `bfpp launch --nproc N -- train --backend cuda`, one process per GPU with NCCL for the
//!   data and a TCP control channel for the rest.

use burn::tensor::backend::AutodiffBackend;
use burn_bfpp::comm::{RankGrid, RendezvousEnv};
use burn_bfpp::engine::{
    DataSource, EngineError, TrainConfig, TrainOutcome, TrainedStages, Trainer,
};
use burn_bfpp::model::{GptStage, ModelDescription};
use clap::ValueEnum;
use cubecl_kernels::FusedOps;

use super::train::TrainError;

/// `--backend`: the Burn backend that trains.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// Burn's CPU backend (always built).
    #[default]
    Flex,
    /// Burn's wgpu backend: Vulkan, Metal or DX12 (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend: NVIDIA GPUs (build with `--features cuda`).
    Cuda,
}

impl BackendChoice {
    /// The name on the command line and the cargo feature that builds it in.
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Flex => "flex",
            BackendChoice::Wgpu => "wgpu",
            BackendChoice::Cuda => "cuda",
        }
    }

    /// The refusal of a backend this binary was built without, with the rebuild command.
    pub fn not_built(self) -> TrainError {
        let name = self.name();
        TrainError::Config(format!(
            "--backend {name} is not built into this bfpp; rebuild with `cargo build --release \
             --features {name}` (or `cargo run --release --features {name} -- train --backend \
             {name} …`)"
        ))
    }
}

/// `--comm`: where the ranks of `bfpp train` live and what carries their collectives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum CommMode {
    /// From the launch: MPI processes under `mpirun`/`srun`, one process per GPU under
    /// `bfpp launch … --backend cuda`, threads of this process otherwise.
    #[default]
    Auto,
    /// Threads of this process, collectives through host memory.
    Local,
    /// One MPI process per rank (CPU ranks; a build with `--features mpi`, started by
    /// `bfpp launch` or `mpirun -np pp×dp`).
    Mpi,
    /// CUDA only: collectives on NCCL (threads: each data-parallel group on distinct GPUs,
    /// see `--gpus`; processes: always).
    Nccl,
}

/// The settings that choose a world of ranks.
#[derive(Debug, Clone, Copy)]
pub struct WorldRequest {
    /// `--comm`.
    pub comm: CommMode,
    /// `--gpus`: GPUs the threads of a CUDA run are spread over.
    pub gpus: usize,
}

/// A backend `bfpp train` can train on.
pub trait CliBackend: AutodiffBackend + FusedOps {
    /// The world of ranks this backend runs, as seen from this process.
    type World: RankWorld<Self>;

    /// The `--backend` it answers to.
    const CHOICE: BackendChoice;

    /// Checks the backend can start here (its driver loads), then decides (and for
    /// processes, joins) the world of `train`'s `pp × dp` ranks.
    fn join(request: WorldRequest, train: &TrainConfig) -> Result<Self::World, TrainError>;

    /// The device a plain single-device run computes on (`--plain-burn`).
    fn plain_device(request: WorldRequest) -> Result<Self::Device, TrainError>;
}

/// The ranks of a run as seen from this process: where the model and the data are built, who
/// reports, and how the trainer runs them.
pub trait RankWorld<B: AutodiffBackend> {
    /// One line for the header: how many ranks, as what, on how many devices.
    fn describe(&self) -> String;
    /// This process's world rank when ranks are processes; `None` for threads.
    fn process_rank(&self) -> Option<usize>;
    /// The device the model and the data are built on.
    fn home_device(&self) -> B::Device;
    /// Devices the ranks compute on (the denominator of per-device throughput).
    fn devices_used(&self) -> usize;
    /// Runs `trainer` on this world, each rank building its own stages of `model`; world
    /// rank 0 (every thread world) gets the outcome.
    fn fit<M, D>(self, trainer: Trainer<'_>, model: &M, data: D) -> Fitted<B>
    where
        M: ModelDescription<B, Stage = GptStage<B>>,
        D: DataSource<B>;
}

/// What a world's run gives this process: world rank 0 (every thread world) the outcome.
pub type Fitted<B> = Result<Option<TrainOutcome<TrainedStages<GptStage<B>>>>, EngineError>;

/// Ranks as threads of this process, world rank `r` on `devices[r]`, collectives through
/// host memory.
pub struct ThreadWorld<B: AutodiffBackend> {
    devices: Vec<B::Device>,
}

impl<B: AutodiffBackend> ThreadWorld<B> {
    /// `world` ranks, rank `r` on `device_of(r)`.
    pub fn new(world: usize, device_of: impl Fn(usize) -> B::Device) -> Self {
        Self {
            devices: (0..world).map(device_of).collect(),
        }
    }
}

impl<B> RankWorld<B> for ThreadWorld<B>
where
    B: AutodiffBackend + FusedOps,
{
    fn describe(&self) -> String {
        format!(
            "{} ranks as threads on {} device(s)",
            self.devices.len(),
            self.devices_used()
        )
    }

    fn process_rank(&self) -> Option<usize> {
        None
    }

    fn home_device(&self) -> B::Device {
        self.devices.first().cloned().unwrap_or_default()
    }

    fn devices_used(&self) -> usize {
        let mut distinct: Vec<&B::Device> = Vec::new();
        for d in &self.devices {
            if !distinct.contains(&d) {
                distinct.push(d);
            }
        }
        distinct.len()
    }

    fn fit<M, D>(self, trainer: Trainer<'_>, model: &M, data: D) -> Fitted<B>
    where
        M: ModelDescription<B, Stage = GptStage<B>>,
        D: DataSource<B>,
    {
        trainer
            .on_devices(self.devices)
            .fit_described(model, data)
            .map(Some)
    }
}

/// Whether world rank `rank` holds the last stage of replica 0, so learns every step's loss.
pub fn holds_the_loss(rank: usize, train: &TrainConfig) -> Result<bool, TrainError> {
    let program = train.program()?;
    let last_pp = program.stage_ranks[program.num_stages() - 1];
    let grid = RankGrid::new(train.pp, train.dp).map_err(EngineError::from)?;
    Ok(rank == grid.rank_of(last_pp, 0))
}

/// The torchrun-style variables of a launch of several processes, if this is one.
fn process_launch() -> Result<Option<RendezvousEnv>, TrainError> {
    Ok(RendezvousEnv::from_env()
        .map_err(|e| TrainError::Config(format!("the launch's environment: {e}")))?
        .filter(|env| env.world_size > 1))
}

/// `(rank, size)` of an MPI launch (OpenMPI's, PMIx's or PMI's variables), read through
/// `lookup`: what `mpirun` or `srun --mpi` sets in every process it starts.
fn mpi_launch_from(lookup: impl Fn(&str) -> Option<String>) -> Option<(usize, usize)> {
    let pairs = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ];
    pairs.iter().find_map(|(r, s)| {
        let rank = lookup(r)?.parse().ok()?;
        let size = lookup(s)?.parse().ok()?;
        Some((rank, size))
    })
}

/// The refusal of GPU ranks in a process that an MPI launcher started among several but
/// that has no torchrun or Slurm rank variables: without it, every process would run a
/// whole world of thread ranks on its own.
#[cfg(any(feature = "cuda", test))]
fn gpu_processes_without_rank_variables(lookup: impl Fn(&str) -> Option<String>) -> Option<String> {
    let (rank, size) = mpi_launch_from(lookup).filter(|&(_, size)| size > 1)?;
    Some(format!(
        "this process is rank {rank} of {size} started by an MPI launcher (mpirun or srun \
         --mpi), which gives GPU ranks no rendezvous: every process would train a whole \
         world on its own; start GPU ranks with `bfpp launch --nproc {size} -- train \
         --backend cuda …`, with torchrun, or with srun (which sets SLURM_PROCID), one process \
         per GPU"
    ))
}

/// The refusal of a process launch for ranks that are not GPU ranks.
fn not_gpu_processes(env: &RendezvousEnv, backend: BackendChoice, world: usize) -> TrainError {
    TrainError::Config(format!(
        "this process is rank {} of {} started with torchrun's variables (RANK, WORLD_SIZE), \
         which start GPU ranks (one process per GPU, over NCCL: `--backend cuda`), not {} \
         ranks; CPU ranks as processes run under MPI: `bfpp launch --nproc {world} -- train …` \
         (mpirun), or as threads of one process: `bfpp train …` alone",
        env.rank,
        env.world_size,
        backend.name()
    ))
}

/// The refusal of `--comm nccl` off CUDA, and of `--gpus` above 1 off CUDA.
fn cuda_only(request: WorldRequest, backend: BackendChoice) -> Result<(), TrainError> {
    if request.comm == CommMode::Nccl {
        return Err(TrainError::Config(format!(
            "--comm nccl needs --backend cuda (NCCL runs on NVIDIA GPUs); with --backend {} \
             use --comm local or auto",
            backend.name()
        )));
    }
    if request.gpus != 1 {
        return Err(TrainError::Config(format!(
            "--gpus {} applies to --backend cuda; with --backend {} leave it at 1",
            request.gpus,
            backend.name()
        )));
    }
    Ok(())
}

#[cfg(feature = "flex")]
mod flex {
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

        fn fit<M, D>(self, trainer: Trainer<'_>, model: &M, data: D) -> Fitted<Autodiff<Flex>>
        where
            M: ModelDescription<Autodiff<Flex>, Stage = GptStage<Autodiff<Flex>>>,
            D: DataSource<Autodiff<Flex>>,
        {
            match self {
                FlexWorld::Threads(t) => t.fit(trainer, model, data),
                #[cfg(feature = "mpi")]
                FlexWorld::Mpi(comm) => {
                    trainer.in_process(comm.as_ref()).fit_described(model, data)
                }
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
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use burn::backend::{Autodiff, Wgpu};

    use super::*;

    impl CliBackend for Autodiff<Wgpu> {
        type World = ThreadWorld<Autodiff<Wgpu>>;
        const CHOICE: BackendChoice = BackendChoice::Wgpu;

        fn join(request: WorldRequest, train: &TrainConfig) -> Result<Self::World, TrainError> {
            cuda_only(request, Self::CHOICE)?;
            if let Some(env) = process_launch()? {
                return Err(not_gpu_processes(&env, Self::CHOICE, train.world_size()));
            }
            if request.comm == CommMode::Mpi {
                return Err(TrainError::Config(
                    "MPI ranks are CPU ranks (--backend flex); wgpu ranks run as threads of \
                     one process: leave --comm at auto or local"
                        .into(),
                ));
            }
            Ok(ThreadWorld::new(train.world_size(), |_| Default::default()))
        }

        fn plain_device(_request: WorldRequest) -> Result<Self::Device, TrainError> {
            Ok(Default::default())
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::backend::cuda::CudaDevice;
    use burn::backend::{Autodiff, Cuda};
    use burn_bfpp::comm::{cuda_driver_available, CommConfig, Communicator, ControlComm, NcclComm};

    use super::*;

    type Inner = <Autodiff<Cuda> as AutodiffBackend>::InnerBackend;

    /// The ranks of a CUDA run.
    pub enum CudaWorld {
        /// Threads, collectives through host memory.
        Threads(ThreadWorld<Autodiff<Cuda>>),
        /// Threads, collectives on NCCL (one communicator per rank, made at `fit`).
        NcclThreads(Vec<CudaDevice>, CommConfig),
        /// This process as one GPU rank of a launch (NCCL over the TCP control channel), on
        /// its GPU, in a world of this many ranks (boxed: the communicator is large).
        Process(Box<ProcessNccl>, CudaDevice, usize),
    }

    /// A GPU process rank's communicator: NCCL over the TCP control channel.
    type ProcessNccl = NcclComm<f32, i32, u8, ControlComm<Inner>>;

    fn comm_config(train: &TrainConfig) -> CommConfig {
        CommConfig {
            overlap_collectives: train.overlap_collectives,
            ..CommConfig::with_timeout(std::time::Duration::from_secs_f64(train.comm_timeout_secs))
        }
    }

    impl RankWorld<Autodiff<Cuda>> for CudaWorld {
        fn describe(&self) -> String {
            match self {
                CudaWorld::Threads(t) => RankWorld::<Autodiff<Cuda>>::describe(t),
                CudaWorld::NcclThreads(devices, _) => format!(
                    "{} ranks as threads on {} GPU(s), collectives on NCCL",
                    devices.len(),
                    distinct(devices)
                ),
                CudaWorld::Process(comm, device, world) => format!(
                    "{world} ranks as processes, one per GPU (this is rank {} on GPU {}), NCCL",
                    Communicator::<Inner>::rank(comm.as_ref()),
                    device.index
                ),
            }
        }

        fn process_rank(&self) -> Option<usize> {
            match self {
                CudaWorld::Process(comm, ..) => Some(Communicator::<Inner>::rank(comm.as_ref())),
                _ => None,
            }
        }

        fn home_device(&self) -> CudaDevice {
            match self {
                CudaWorld::Threads(t) => RankWorld::<Autodiff<Cuda>>::home_device(t),
                CudaWorld::NcclThreads(devices, _) => devices[0].clone(),
                CudaWorld::Process(_, device, _) => device.clone(),
            }
        }

        fn devices_used(&self) -> usize {
            match self {
                CudaWorld::Threads(t) => RankWorld::<Autodiff<Cuda>>::devices_used(t),
                CudaWorld::NcclThreads(devices, _) => distinct(devices),
                CudaWorld::Process(_, _, world) => *world,
            }
        }

        fn fit<M, D>(self, trainer: Trainer<'_>, model: &M, data: D) -> Fitted<Autodiff<Cuda>>
        where
            M: ModelDescription<Autodiff<Cuda>, Stage = GptStage<Autodiff<Cuda>>>,
            D: DataSource<Autodiff<Cuda>>,
        {
            match self {
                CudaWorld::Threads(t) => t.fit(trainer, model, data),
                CudaWorld::NcclThreads(devices, config) => {
                    let grid = RankGrid::new(trainer.config().pp, trainer.config().dp)?;
                    let comms = NcclComm::create(grid, devices, config)?;
                    trainer
                        .with_comms(comms)
                        .fit_described(model, data)
                        .map(Some)
                }
                CudaWorld::Process(comm, ..) => {
                    trainer.in_process(comm.as_ref()).fit_described(model, data)
                }
            }
        }
    }

    fn distinct(devices: &[CudaDevice]) -> usize {
        let mut ids: Vec<usize> = devices.iter().map(|d| d.index).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    impl CliBackend for Autodiff<Cuda> {
        type World = CudaWorld;
        const CHOICE: BackendChoice = BackendChoice::Cuda;

        fn join(request: WorldRequest, train: &TrainConfig) -> Result<CudaWorld, TrainError> {
            cuda_driver_available().map_err(EngineError::from)?;
            if request.gpus == 0 {
                return Err(TrainError::Config("--gpus 0: give at least one GPU".into()));
            }
            let world = train.world_size();
            let config = comm_config(train);
            if let Some(env) = process_launch()? {
                if matches!(request.comm, CommMode::Local | CommMode::Mpi) {
                    return Err(TrainError::Config(format!(
                        "GPU ranks that are processes (rank {} of {}) carry their data on NCCL; \
                         --comm {} does not apply: leave --comm at auto or nccl",
                        env.rank,
                        env.world_size,
                        if request.comm == CommMode::Local {
                            "local"
                        } else {
                            "mpi"
                        }
                    )));
                }
                if request.gpus != 1 {
                    return Err(TrainError::Config(format!(
                        "--gpus {} spreads ranks that are threads over GPUs; a launched GPU \
                         process (rank {}) computes on the GPU of its local rank ({}): leave \
                         --gpus out, and choose the GPUs with CUDA_VISIBLE_DEVICES",
                        request.gpus, env.rank, env.local_rank
                    )));
                }
                let grid = RankGrid::new(train.pp, train.dp).map_err(EngineError::from)?;
                // One process per GPU: local rank r computes on the node's GPU r.
                let device = CudaDevice::new(env.local_rank);
                let control = ControlComm::connect(&env, grid, device.clone(), config)
                    .map_err(EngineError::from)?;
                let comm = NcclComm::over_host(control).map_err(EngineError::from)?;
                return Ok(CudaWorld::Process(Box::new(comm), device, world));
            }
            if let Some(refusal) = gpu_processes_without_rank_variables(|k| std::env::var(k).ok()) {
                return Err(TrainError::Config(refusal));
            }
            if request.comm == CommMode::Mpi {
                return Err(TrainError::Config(
                    "GPU ranks as processes are started by `bfpp launch --nproc N -- train \
                     --backend cuda` (one per GPU, over NCCL), not under MPI"
                        .into(),
                ));
            }
            let devices: Vec<CudaDevice> = (0..world)
                .map(|r| CudaDevice::new(r % request.gpus))
                .collect();
            if request.comm == CommMode::Nccl {
                return Ok(CudaWorld::NcclThreads(devices, config));
            }
            Ok(CudaWorld::Threads(ThreadWorld::new(world, |r| {
                devices[r].clone()
            })))
        }

        fn plain_device(_request: WorldRequest) -> Result<Self::Device, TrainError> {
            cuda_driver_available().map_err(EngineError::from)?;
            Ok(CudaDevice::new(0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn gpu_processes_under_mpirun_are_refused_naming_the_launchers() {
        let mpirun = [("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4")];
        let refusal = gpu_processes_without_rank_variables(env(&mpirun)).expect("refused");
        assert!(refusal.contains("rank 2 of 4"), "{refusal}");
        for launcher in ["bfpp launch --nproc 4", "torchrun", "srun"] {
            assert!(refusal.contains(launcher), "{refusal}");
        }
        let pmix = [("PMIX_RANK", "0"), ("PMIX_SIZE", "8")];
        assert!(gpu_processes_without_rank_variables(env(&pmix)).is_some());
    }

    #[test]
    fn a_single_process_or_no_launcher_is_not_refused() {
        let alone = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")];
        assert!(gpu_processes_without_rank_variables(env(&alone)).is_none());
        assert!(gpu_processes_without_rank_variables(env(&[])).is_none());
        let garbled = [("PMI_RANK", "x"), ("PMI_SIZE", "4")];
        assert!(gpu_processes_without_rank_variables(env(&garbled)).is_none());
    }
}
