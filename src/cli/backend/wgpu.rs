//! `--backend wgpu`: Burn's wgpu backend, ranks as threads on the default adapter.

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
        Ok(ThreadWorld::new(train.world_size(), |_| Default::default()).through_host(None))
    }

    fn plain_device(_request: WorldRequest) -> Result<Self::Device, TrainError> {
        Ok(Default::default())
    }
}
