//! [`NcclComm`] (feature `cuda`): ranks are threads of one process, each on a CUDA device,
//! and the group collectives run on NCCL directly on the device buffers of Burn's CUDA
//! tensors.
//!
//! Every group whose members are on distinct GPUs gets its own NCCL communicator (one per
//! data-parallel group, one per pipeline group), created with `ncclCommInitAll`; each rank
//! holds its member ([`super::nccl_group`]). All-reduce, all-gather, reduce-scatter and
//! broadcast are NCCL's own collectives: no host copy, and the traffic of the dedicated
//! collective. A pipeline group whose ranks share a GPU (several stages on one GPU) cannot be
//! an NCCL communicator (NCCL refuses two members on one device) and keeps the host path of
//! [`LocalComm`]; data-parallel groups must span distinct GPUs (checked at creation).
//!
//! Pipeline transfers, barriers and failure propagation are the [`LocalComm`] of the same
//! world: host memory between GPUs, the tensor itself between ranks sharing one. Before each
//! NCCL call the members check through it that they all issue the same collective on the
//! same shape, so a mismatched or failed peer is reported by rank and action instead of
//! hanging the device in NCCL; a peer that dies inside the call ends it at the timeout, with
//! the communicator aborted.
//!
//! NCCL sums are not taken in group-rank order, so results match [`LocalComm`] to rounding,
//! not bitwise.

use std::cell::RefCell;
use std::fmt;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;

use super::cuda_peer::move_to_device;
use super::nccl_group::{NcclFailure, NcclMember};
use super::threads::{ThreadRank, World};
use super::{CommConfig, CommError, CommOp, Communicator, Group, LocalComm, RankGrid, ReduceOp};

/// Burn's CUDA backend (the CubeCL one, without fusion) with the given element types.
pub type CudaBackend<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;

/// A rank of a world of threads on CUDA devices whose group collectives run on NCCL; see the
/// [module docs](self).
pub struct NcclComm<F: FloatElement, I: IntElement, BT: BoolElement> {
    local: LocalComm<CudaBackend<F, I, BT>>,
    /// This rank's member of its data-parallel group's communicator.
    dp: RefCell<NcclMember>,
    /// Its member of its pipeline group's communicator, when that group spans distinct GPUs.
    pp: Option<RefCell<NcclMember>>,
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> fmt::Debug for NcclComm<F, I, BT> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("local", &self.local)
            .field("dp", &self.dp)
            .field("pp", &self.pp)
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

/// Creates one communicator for each group of `group` whose members' devices are distinct,
/// and returns every world rank's member (`None` for ranks of a group sharing a GPU).
fn members_of(
    grid: RankGrid,
    ordinals: &[i32],
    group: Group,
) -> Result<Vec<Option<NcclMember>>, CommError> {
    super::group_wiring(grid, ordinals, group, |devices| {
        NcclMember::init_all(devices)
    })
    .map_err(|(members, reason)| CommError::Unavailable {
        what: format!("an NCCL communicator for the {group} of ranks {members:?}"),
        fix: format!("{reason}; check that NCCL and the GPUs work (nvidia-smi, NCCL_DEBUG=INFO)"),
    })
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> NcclComm<F, I, BT> {
    /// One communicator per world rank (index = world rank); rank `r` computes on
    /// `devices[r]`. Fails if NCCL cannot be loaded, if `devices` does not hold one device
    /// per rank, if two members of a data-parallel group share a GPU, or if NCCL cannot
    /// create a group's communicator.
    pub fn create(
        grid: RankGrid,
        devices: Vec<CudaDevice>,
        config: CommConfig,
    ) -> Result<Vec<Self>, CommError> {
        let ids: Vec<_> = devices.iter().map(|d| d.index).collect();
        super::check_distinct_devices(grid, &ids)?;
        nccl_available()?;
        let ordinals: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let dp = members_of(grid, &ordinals, Group::DataParallel)?;
        let pp = members_of(grid, &ordinals, Group::Pipeline)?;
        let mut locals = LocalComm::create_with_devices(grid, devices, config)?;
        for local in &mut locals {
            // Pipeline transfers between GPUs: handed over, then peer-copied by the receiver.
            local.hand_over_across_devices();
        }
        locals
            .into_iter()
            .zip(dp.into_iter().zip(pp))
            .map(|(local, (dp, pp))| {
                let dp = dp.ok_or_else(|| CommError::InvalidGrid {
                    pp: grid.pp(),
                    dp: grid.dp(),
                    reason: format!("rank {} has no data-parallel communicator", local.rank()),
                })?;
                Ok(NcclComm {
                    local,
                    dp: RefCell::new(dp),
                    pp: pp.map(RefCell::new),
                })
            })
            .collect()
    }

    /// The host-memory communicator of the same world (pipeline transfers, barriers).
    pub fn local(&self) -> &LocalComm<CudaBackend<F, I, BT>> {
        &self.local
    }

    /// Whether `group`'s collectives run on NCCL (otherwise on the host path).
    pub fn on_nccl(&self, group: Group) -> bool {
        match group {
            Group::DataParallel => true,
            Group::Pipeline => self.pp.is_some(),
        }
    }

    fn member(&self, group: Group) -> Option<&RefCell<NcclMember>> {
        match group {
            Group::DataParallel => Some(&self.dp),
            Group::Pipeline => self.pp.as_ref(),
        }
    }

    /// Runs `call` on `group`'s NCCL member after every member agreed on `action` and the
    /// input's shape; an NCCL failure aborts the world with an error naming this rank.
    fn nccl<const D: usize, const E: usize>(
        &self,
        group: Group,
        action: CommOp,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        call: impl FnOnce(
            &mut NcclMember,
            CubeTensor<CudaRuntime>,
        ) -> Result<CubeTensor<CudaRuntime>, NcclFailure>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, E>, CommError> {
        let member = self.member(group).ok_or_else(|| {
            self.local
                .invalid(action, format!("the {group} has no NCCL communicator"))
        })?;
        self.local.agree(group, action, &tensor.dims())?;
        let input = tensor.into_primitive().tensor();
        let output = call(&mut member.borrow_mut(), input).map_err(|reason| {
            self.local.fail(CommError::Nccl {
                rank: self.local.rank(),
                action,
                reason,
            })
        })?;
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
        let tensor = self.local.recv(peer, tag, shape)?;
        if tensor.device() == *self.device() {
            return Ok(tensor);
        }
        // Handed over from another GPU: copy it here, receiver-driven (see `cuda_peer`).
        let moved =
            move_to_device(tensor.into_primitive().tensor(), self.device()).map_err(|reason| {
                self.local.fail(CommError::Data {
                    rank: self.local.rank(),
                    action: CommOp::Recv { tag },
                    reason: format!("moving rank {peer}'s tensor to this GPU: {reason}"),
                })
            })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(moved)))
    }

    fn all_gather(
        &self,
        group: Group,
        shard: Tensor<CudaBackend<F, I, BT>, 1>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, CommError> {
        if !self.on_nccl(group) {
            return self.local.all_gather(group, shard);
        }
        let timeout = self.local.config().timeout;
        self.nccl(group, CommOp::AllGather(group), shard, |m, t| {
            m.all_gather(t, timeout)
        })
    }

    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<CudaBackend<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, CommError> {
        if !self.on_nccl(group) {
            return self.local.reduce_scatter(group, tensor, op);
        }
        let action = CommOp::ReduceScatter(group, op);
        let size = self.group_size(group);
        let len = tensor.dims()[0];
        if len % size != 0 {
            return Err(self.local.invalid(
                action,
                format!("length {len} is not divisible by the group size {size}"),
            ));
        }
        let timeout = self.local.config().timeout;
        self.nccl(group, action, tensor, |m, t| {
            m.reduce_scatter(t, op, timeout)
        })
    }

    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        if !self.on_nccl(group) {
            return self.local.all_reduce(group, tensor, op);
        }
        let timeout = self.local.config().timeout;
        self.nccl(group, CommOp::AllReduce(group, op), tensor, |m, t| {
            m.all_reduce(t, op, timeout)
        })
    }

    fn broadcast<const D: usize>(
        &self,
        group: Group,
        root: usize,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        if !self.on_nccl(group) || root >= self.group_size(group) {
            // The host path also reports an out-of-range root.
            return self.local.broadcast(group, root, tensor);
        }
        let timeout = self.local.config().timeout;
        self.nccl(group, CommOp::Broadcast(group, root), tensor, |m, t| {
            m.broadcast(t, root, timeout)
        })
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.local.barrier(group)
    }

    fn abort(&self, cause: &str) {
        self.local.abort(cause)
    }
}
