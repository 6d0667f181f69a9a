//! [`NcclComm`] (feature `cuda`): ranks are threads of one process, each on a CUDA device,
//! and the data-parallel collectives run as NCCL all-reduces directly on the device buffers
//! of Burn's CUDA tensors.
//!
//! The NCCL calls go through CubeCL 0.10's CUDA server, which owns the communicators (one per
//! set of devices, created on first use), reaches the buffers through its memory pools and
//! orders the call against its compute stream: the all-reduce waits on a fence of the stream
//! that produced the input, runs on the server's communication stream, and
//! `sync_collective` makes later compute wait for it. No host copy and no host
//! synchronisation. CubeCL exposes only the all-reduce, so all-gather, reduce-scatter and
//! broadcast are built from it ([`super::by_all_reduce`]), at about twice the traffic of the
//! dedicated collectives.
//!
//! Everything else — pipeline transfers, pipeline-group collectives, barriers, failure
//! propagation — is the [`LocalComm`] of the same world (host memory). Before each NCCL
//! call the members check through it that they all issue the same collective on the same
//! shape, so a mismatched or failed peer is reported by rank and action instead of hanging
//! the device in NCCL.
//!
//! Limits: NCCL refuses two members of one communicator on the same GPU, so every
//! data-parallel group must span distinct GPUs (checked at creation); an error inside
//! CubeCL's server thread (such as a failing NCCL call) panics there rather than returning
//! here; NCCL sums are not taken in group-rank order, so results match [`LocalComm`] to
//! rounding, not bitwise.

use std::fmt;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;
use cubecl::device::{Device as _, DeviceId};
use cubecl::ir::StorageType;
use cubecl::server::ReduceOperation;

use super::threads::{ThreadRank, World};
use super::{
    by_all_reduce, CommConfig, CommError, CommOp, Communicator, Group, LocalComm, RankGrid,
    ReduceOp,
};

/// Burn's CUDA backend (the CubeCL one, without fusion) with the given element types.
pub type CudaBackend<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;

/// A rank of a world of threads on CUDA devices whose data-parallel collectives run on NCCL;
/// see the [module docs](self).
pub struct NcclComm<F: FloatElement, I: IntElement, BT: BoolElement> {
    local: LocalComm<CudaBackend<F, I, BT>>,
    /// The CubeCL device ids of this rank's data-parallel group, in group-rank order.
    dp_devices: Vec<DeviceId>,
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> fmt::Debug for NcclComm<F, I, BT> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("local", &self.local)
            .field("dp_devices", &self.dp_devices)
            .finish()
    }
}

/// Whether the NCCL library can be loaded; a missing one is a start-up error naming the fix
/// rather than a panic inside the first collective.
pub fn nccl_available() -> Result<(), CommError> {
    // SAFETY: only tries to load the shared library and reports whether it was found.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CommError::Unavailable {
            what: "NCCL".into(),
            fix: "install NCCL (libnccl.so.2) and make `libnccl.so` loadable: e.g. \
                  `ln -s …/nvidia/nccl/lib/libnccl.so.2 libnccl.so` in a directory on \
                  LD_LIBRARY_PATH (PyTorch's wheel ships it)"
                .into(),
        })
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> NcclComm<F, I, BT> {
    /// One communicator per world rank (index = world rank); rank `r` computes on
    /// `devices[r]`. Fails if NCCL cannot be loaded, if `devices` does not hold one device
    /// per rank, or if two members of a data-parallel group share a GPU.
    pub fn create(
        grid: RankGrid,
        devices: Vec<CudaDevice>,
        config: CommConfig,
    ) -> Result<Vec<Self>, CommError> {
        let ids: Vec<DeviceId> = devices.iter().map(|d| d.to_id()).collect();
        super::check_distinct_devices(grid, &ids)?;
        nccl_available()?;
        let locals = LocalComm::create_with_devices(grid, devices, config)?;
        Ok(locals
            .into_iter()
            .enumerate()
            .map(|(rank, local)| NcclComm {
                local,
                dp_devices: grid
                    .group_members(rank, Group::DataParallel)
                    .into_iter()
                    .map(|r| ids[r])
                    .collect(),
            })
            .collect())
    }

    /// The host-memory communicator of the same world (pipeline transfers, barriers).
    pub fn local(&self) -> &LocalComm<CudaBackend<F, I, BT>> {
        &self.local
    }

    /// The NCCL all-reduce of `tensor` over the data-parallel group, after checking that
    /// every member issues `action` on the same shape.
    fn all_reduce_tensor<const D: usize>(
        &self,
        action: CommOp,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        self.local
            .agree(Group::DataParallel, action, &tensor.dims())?;
        let input = into_contiguous(tensor.into_primitive().tensor());
        let output = empty_device_dtype(
            input.client.clone(),
            input.device.clone(),
            input.meta.shape().clone(),
            input.dtype,
        );
        let op = match op {
            ReduceOp::Sum => ReduceOperation::Sum,
            ReduceOp::Mean => ReduceOperation::Mean,
        };
        let mut client = input.client.clone();
        client.all_reduce(
            input.handle.clone(),
            output.handle.clone(),
            StorageType::from(input.dtype).elem_type(),
            self.dp_devices.clone(),
            op,
        );
        // Later work on this stream waits for the communication stream; the host does not.
        client.sync_collective();
        Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> ThreadRank for NcclComm<F, I, BT> {
    fn world_rank(&self) -> usize {
        self.local.world_rank()
    }
    fn world(&self) -> World {
        self.local.world()
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> Communicator<CudaBackend<F, I, BT>>
    for NcclComm<F, I, BT>
{
    fn grid(&self) -> RankGrid {
        self.local.grid()
    }

    fn rank(&self) -> usize {
        self.local.rank()
    }

    fn device(&self) -> &CudaDevice {
        self.local.device()
    }

    fn send<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
    ) -> Result<(), CommError> {
        self.local.send(peer, tag, tensor)
    }

    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        self.local.recv(peer, tag, shape)
    }

    fn all_gather(
        &self,
        group: Group,
        shard: Tensor<CudaBackend<F, I, BT>, 1>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, CommError> {
        if group == Group::Pipeline {
            return self.local.all_gather(group, shard);
        }
        let (me, size) = (self.group_rank(group), self.group_size(group));
        by_all_reduce::all_gather(shard, me, size, |placed| {
            self.all_reduce_tensor(CommOp::AllGather(group), placed, ReduceOp::Sum)
        })
    }

    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<CudaBackend<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, CommError> {
        if group == Group::Pipeline {
            return self.local.reduce_scatter(group, tensor, op);
        }
        let action = CommOp::ReduceScatter(group, op);
        let (me, size) = (self.group_rank(group), self.group_size(group));
        let len = tensor.dims()[0];
        if len % size != 0 {
            return Err(self.local.invalid(
                action,
                format!("length {len} is not divisible by the group size {size}"),
            ));
        }
        by_all_reduce::reduce_scatter(tensor, me, size, |t| self.all_reduce_tensor(action, t, op))
    }

    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        if group == Group::Pipeline {
            return self.local.all_reduce(group, tensor, op);
        }
        self.all_reduce_tensor(CommOp::AllReduce(group, op), tensor, op)
    }

    fn broadcast<const D: usize>(
        &self,
        group: Group,
        root: usize,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        if group == Group::Pipeline || root >= self.group_size(group) {
            // The host path also reports an out-of-range root.
            return self.local.broadcast(group, root, tensor);
        }
        let is_root = self.group_rank(group) == root;
        by_all_reduce::broadcast(tensor, is_root, |t| {
            self.all_reduce_tensor(CommOp::Broadcast(group, root), t, ReduceOp::Sum)
        })
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.local.barrier(group)
    }

    fn abort(&self, cause: &str) {
        self.local.abort(cause)
    }
}
