//! `--backend cuda`: Burn's CUDA backend, ranks as threads (collectives on NCCL or through
//! host memory) or one process per GPU (NCCL over the TCP control channel).

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn_bfpp::comm::{
    cuda_driver_available, nccl_available, CommConfig, Communicator, ControlComm, NcclComm,
};

use super::transports::nccl_thread_transports;
use super::*;

type Inner = <Autodiff<Cuda> as AutodiffBackend>::InnerBackend;

/// The ranks of a CUDA run.
pub enum CudaWorld {
    /// Threads, collectives through host memory.
    Threads(ThreadWorld<Autodiff<Cuda>>),
    /// Threads, collectives on NCCL (one communicator per rank, made at `fit`), with what
    /// carries their pipeline transfers.
    NcclThreads(Vec<CudaDevice>, CommConfig, Transports),
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
            CudaWorld::NcclThreads(devices, ..) => format!(
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
            CudaWorld::NcclThreads(devices, ..) => devices[0].clone(),
            CudaWorld::Process(_, device, _) => device.clone(),
        }
    }

    fn devices_used(&self) -> usize {
        match self {
            CudaWorld::Threads(t) => RankWorld::<Autodiff<Cuda>>::devices_used(t),
            CudaWorld::NcclThreads(devices, ..) => distinct(devices),
            CudaWorld::Process(_, _, world) => *world,
        }
    }

    fn transports(&self, grid: RankGrid) -> Transports {
        match self {
            CudaWorld::Threads(t) => RankWorld::<Autodiff<Cuda>>::transports(t, grid),
            CudaWorld::NcclThreads(.., transports) => transports.clone(),
            CudaWorld::Process(..) => Transports::new(
                grid,
                "NCCL (point to point, device buffers)",
                "NCCL (device buffers)",
            )
            .with_detail(Some(
                "barriers and failure notices over the TCP control channel".into(),
            )),
        }
    }

    fn fit<M, D>(self, trainer: Trainer<'_>, model: &M, data: D) -> Fitted<Autodiff<Cuda>>
    where
        M: ModelDescription<Autodiff<Cuda>, Stage = GptStage<Autodiff<Cuda>>>,
        D: DataSource<Autodiff<Cuda>>,
    {
        match self {
            CudaWorld::Threads(t) => t.fit(trainer, model, data),
            CudaWorld::NcclThreads(devices, config, _) => {
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
        let grid = RankGrid::new(train.pp, train.dp).map_err(EngineError::from)?;
        let nccl = nccl_available().map_err(|e| e.to_string());
        let why_not = match threads_take_nccl(request.comm, grid, request.gpus, nccl) {
            Ok(()) => {
                let transports = nccl_thread_transports(grid, request.gpus);
                return Ok(CudaWorld::NcclThreads(devices, config, transports));
            }
            Err(why_not) => why_not,
        };
        Ok(CudaWorld::Threads(
            ThreadWorld::new(world, |r| devices[r].clone()).through_host(why_not),
        ))
    }

    fn plain_device(_request: WorldRequest) -> Result<Self::Device, TrainError> {
        cuda_driver_available().map_err(EngineError::from)?;
        Ok(CudaDevice::new(0))
    }
}
