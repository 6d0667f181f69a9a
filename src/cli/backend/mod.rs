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

use super::error::TrainError;

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
    /// `bfpp launch … --backend cuda`, threads of this process otherwise; CUDA threads
    /// take NCCL wherever it loads and can carry their traffic (each data-parallel group
    /// on distinct GPUs, see `--gpus`), host memory elsewhere.
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
    /// What carries each kind of traffic between the ranks of `grid`.
    fn transports(&self, grid: RankGrid) -> Transports;
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
    /// What carries pipeline and data-parallel traffic, and why not something faster.
    carriers: (&'static str, &'static str, Option<String>),
}

impl<B: AutodiffBackend> ThreadWorld<B> {
    /// `world` ranks, rank `r` on `device_of(r)`, their tensors handed over in memory.
    pub fn new(world: usize, device_of: impl Fn(usize) -> B::Device) -> Self {
        Self {
            devices: (0..world).map(device_of).collect(),
            carriers: (transports::IN_PROCESS, transports::IN_PROCESS, None),
        }
    }

    /// The same ranks on a device backend: collectives through host memory, and `detail` on
    /// why not on the device (NCCL), if known.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    pub fn through_host(mut self, detail: Option<String>) -> Self {
        self.carriers = (transports::IN_PROCESS, transports::THROUGH_HOST, detail);
        self
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

    fn transports(&self, grid: RankGrid) -> Transports {
        let (pipeline, data_parallel, detail) = &self.carriers;
        Transports::new(grid, pipeline, data_parallel).with_detail(detail.clone())
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
mod flex;

#[cfg(feature = "wgpu")]
mod wgpu;

#[cfg(feature = "cuda")]
mod cuda;

#[cfg(test)]
mod tests;
mod transports;

pub use transports::Transports;

/// Whether CUDA ranks that are threads take NCCL for their traffic: always with `--comm nccl`
/// (whose checks then name what does not fit), never with `--comm local`, and with
/// `--comm auto` wherever NCCL loads (`nccl_loads`, else why not) and can carry it
/// ([`transports::nccl_cannot_carry`]). `Err` holds the summary's note on why `--comm auto`
/// left NCCL aside (`None` where the user chose).
#[cfg(any(feature = "cuda", test))]
pub fn threads_take_nccl(
    comm: CommMode,
    grid: RankGrid,
    gpus: usize,
    nccl_loads: Result<(), String>,
) -> Result<(), Option<String>> {
    match comm {
        CommMode::Nccl => Ok(()),
        CommMode::Auto => {
            let why_not = nccl_loads
                .err()
                .or_else(|| transports::nccl_cannot_carry(grid, gpus));
            match why_not {
                Some(why) => Err(Some(format!("NCCL not used: {why}"))),
                None => Ok(()),
            }
        }
        CommMode::Local | CommMode::Mpi => Err(None),
    }
}
