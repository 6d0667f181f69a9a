//! [`NcclComm`] (feature `cuda`): ranks on CUDA devices whose group collectives run on NCCL
//! directly on the device buffers of Burn's CUDA tensors, layered on a host communicator for
//! everything else: [`LocalComm`] when the ranks are threads of one process
//! ([`NcclComm::create`]), `MpiComm` when they are processes ([`NcclComm::over_host`]).
//!
//! Every group whose members are on distinct GPUs gets its own NCCL communicator (one per
//! data-parallel group, one per pipeline group): created together with `ncclCommInitAll` for
//! threads, or with `ncclCommInitRank` from a unique id that the group's rank 0 makes and
//! sends through the host communicator for processes ([`super::nccl_host`]). Each rank holds
//! its member ([`super::nccl_group`]). All-reduce, all-gather, reduce-scatter and broadcast
//! are NCCL's own collectives: no host copy, and the traffic of the dedicated collective. A
//! pipeline group whose ranks share a GPU (several stages on one GPU) cannot be an NCCL
//! communicator (NCCL refuses two members on one device) and keeps the host path;
//! data-parallel groups must span distinct GPUs (checked at creation).
//!
//! Pipeline transfers, barriers and failure propagation are the host communicator's. Between
//! threads on different GPUs the tensor is handed over and peer-copied by the receiver
//! ([`super::cuda_peer`]); between threads on one GPU it is handed over as it is. Before each
//! NCCL call the members check through the host communicator that they all issue the same
//! collective on the same shape, so a mismatched or failed peer is reported by rank and
//! action instead of hanging the device in NCCL; a peer that dies inside the call ends it at
//! the timeout, with the communicator aborted.
//!
//! [`Communicator::start`] launches a collective on NCCL and returns without waiting for it
//! (with [`CommConfig::overlap_collectives`](super::CommConfig::overlap_collectives) on, the
//! default): the communicator keeps the call and its buffers, the [`Pending`] carries a
//! ticket, and [`Communicator::finish`] waits for the call, so the transfer runs beside the
//! compute issued in between. Dropped with calls in
//! flight (an error path), the communicator aborts their NCCL communicators before it
//! releases their buffers.
//!
//! NCCL sums are not taken in group-rank order, so results match [`LocalComm`] to rounding,
//! not bitwise.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;

mod setup;

pub use setup::{cuda_driver_available, nccl_available};

use super::cuda_peer::move_to_device;
use super::launched::LaunchedCalls;
use super::nccl_group::{Launched, NcclFailure, NcclMember};
use super::nccl_host::NcclHost;
use super::pending::{Ticket, Unfinished};
use super::threads::{ThreadRank, World};
use super::{
    Collective, CommError, CommOp, Communicator, Group, LocalComm, Pending, ProcessRank, RankGrid,
    ReduceOp,
};

/// Burn's CUDA backend (the CubeCL one, without fusion) with the given element types.
pub type CudaBackend<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;

/// A rank whose group collectives run on NCCL, layered on a host communicator `H` for
/// everything else; see the [module docs](self). `H` is [`LocalComm`] for ranks that are
/// threads of one process ([`NcclComm::create`]) and `MpiComm` for ranks that are processes
/// ([`NcclComm::over_host`]).
pub struct NcclComm<
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    H = LocalComm<CudaBackend<F, I, BT>>,
> {
    host: H,
    /// This rank's member of its data-parallel group's communicator.
    dp: RefCell<NcclMember>,
    /// Its member of its pipeline group's communicator, when that group spans distinct GPUs.
    pp: Option<RefCell<NcclMember>>,
    /// Collectives [`Communicator::start`] launched and [`Communicator::finish`] has not
    /// handed back (see [`super::launched`]).
    launched: RefCell<LaunchedCalls<Launched>>,
    _elements: PhantomData<CudaBackend<F, I, BT>>,
}

impl<F: FloatElement, I: IntElement, BT: BoolElement, H: fmt::Debug> fmt::Debug
    for NcclComm<F, I, BT, H>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("host", &self.host)
            .field("dp", &self.dp)
            .field("pp", &self.pp)
            .finish()
    }
}

impl<F, I, BT, H> NcclComm<F, I, BT, H>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    H: NcclHost<CudaBackend<F, I, BT>>,
{
    /// The communicator this one is layered on.
    pub fn host(&self) -> &H {
        &self.host
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

    /// Launches `call` on `group`'s NCCL member after every member agreed on `action` and the
    /// input's shape, and once the calls in flight on this rank's other communicator finished
    /// (so no two of its communicators have calls in flight at once; see
    /// [`super::nccl_group`]). An NCCL failure aborts the world with an error naming this rank.
    fn launch<const D: usize>(
        &self,
        group: Group,
        action: CommOp,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        call: impl FnOnce(&mut NcclMember, CubeTensor<CudaRuntime>) -> Result<Launched, NcclFailure>,
    ) -> Result<Launched, CommError> {
        let member = self.nccl_member(group, action)?;
        self.host.agree(group, action, &tensor.dims())?;
        let other = match group {
            Group::DataParallel => Group::Pipeline,
            Group::Pipeline => Group::DataParallel,
        };
        self.wait_for_newest(other, action)?;
        let input = tensor.into_primitive().tensor();
        call(&mut member.borrow_mut(), input).map_err(|reason| self.nccl_failed(action, reason))
    }

    /// Waits until the calls in flight on `group`'s communicator finished (`action` is the
    /// call that waits, as errors name it).
    fn wait_for_newest(&self, group: Group, action: CommOp) -> Result<(), CommError> {
        let launched = self.launched.borrow();
        let (Some(newest), Some(member)) = (launched.newest(group), self.member(group)) else {
            return Ok(());
        };
        let timeout = self.host.config().timeout;
        member
            .borrow_mut()
            .wait_for(newest, timeout)
            .map_err(|reason| self.nccl_failed(action, reason))
    }

    /// Waits for a call `group`'s member launched and returns its output as a tensor.
    fn wait_for<const E: usize>(
        &self,
        group: Group,
        action: CommOp,
        call: Launched,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, E>, CommError> {
        let timeout = self.host.config().timeout;
        self.nccl_member(group, action)?
            .borrow_mut()
            .wait_for(&call, timeout)
            .map_err(|reason| self.nccl_failed(action, reason))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(
            call.into_output(),
        )))
    }

    /// `group`'s NCCL member, or (aborting the world) an error naming `action` when the group
    /// runs on the host path.
    fn nccl_member(&self, group: Group, action: CommOp) -> Result<&RefCell<NcclMember>, CommError> {
        self.member(group).ok_or_else(|| {
            self.host.fail(CommError::InvalidArgument {
                rank: self.host.rank(),
                action,
                reason: format!("the {group} has no NCCL communicator"),
            })
        })
    }

    /// Launches `call` and waits for it: a blocking collective.
    fn nccl<const D: usize, const E: usize>(
        &self,
        group: Group,
        action: CommOp,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        call: impl FnOnce(&mut NcclMember, CubeTensor<CudaRuntime>) -> Result<Launched, NcclFailure>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, E>, CommError> {
        let launched = self.launch(group, action, tensor, call)?;
        self.wait_for(group, action, launched)
    }

    /// An NCCL failure of this rank in `action`, recorded so that every rank stops.
    fn nccl_failed(&self, action: CommOp, reason: NcclFailure) -> CommError {
        self.host.fail(CommError::Nccl {
            rank: self.host.rank(),
            action,
            reason,
        })
    }

    /// Fails (aborting the world) when a reduce-scatter's input cannot be split over `group`.
    fn check_divisible(&self, group: Group, action: CommOp, len: usize) -> Result<(), CommError> {
        let size = self.group_size(group);
        if len % size == 0 {
            return Ok(());
        }
        Err(self.host.fail(CommError::InvalidArgument {
            rank: self.rank(),
            action,
            reason: format!("length {len} is not divisible by the group size {size}"),
        }))
    }

    /// Launches `collective` on its group's NCCL member without waiting for it.
    fn launch_collective(
        &self,
        collective: Collective<CudaBackend<F, I, BT>>,
    ) -> Result<Launched, CommError> {
        let action = collective.op();
        match collective {
            Collective::AllGather { group, shard } => {
                self.launch(group, action, shard, |m, t| m.all_gather(t))
            }
            Collective::ReduceScatter { group, tensor, op } => {
                self.check_divisible(group, action, tensor.dims()[0])?;
                self.launch(group, action, tensor, |m, t| m.reduce_scatter(t, op))
            }
            Collective::AllReduce { group, tensor, op } => {
                self.launch(group, action, tensor, |m, t| m.all_reduce(t, op))
            }
        }
    }
}

/// Calls still in flight when the communicator goes away (an error path dropped their
/// pending handles) would write into buffers that are released with them: the members are
/// aborted first, which ends the calls.
impl<F: FloatElement, I: IntElement, BT: BoolElement, H> Drop for NcclComm<F, I, BT, H> {
    fn drop(&mut self) {
        let launched = self.launched.get_mut();
        if launched.is_empty() {
            return;
        }
        for (group, _call) in launched.drain() {
            let member = match group {
                Group::DataParallel => Some(&mut self.dp),
                Group::Pipeline => self.pp.as_mut(),
            };
            if let Some(member) = member {
                member.get_mut().abort_unfinished();
            }
        }
    }
}

/// Process ranks train over an `NcclComm` layered on their process communicator: result
/// gathering goes through the host.
impl<F, I, BT, H> ProcessRank<CudaBackend<F, I, BT>> for NcclComm<F, I, BT, H>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    H: NcclHost<CudaBackend<F, I, BT>> + ProcessRank<CudaBackend<F, I, BT>>,
{
    fn send_bytes(&self, peer: usize, tag: u64, bytes: Vec<u8>) -> Result<(), CommError> {
        self.host.send_bytes(peer, tag, bytes)
    }
    fn recv_bytes(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CommError> {
        self.host.recv_bytes(peer, tag)
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> ThreadRank for NcclComm<F, I, BT> {
    fn world_rank(&self) -> usize {
        self.host.world_rank()
    }
    fn world(&self) -> World {
        self.host.world()
    }
}

impl<F, I, BT, H> Communicator<CudaBackend<F, I, BT>> for NcclComm<F, I, BT, H>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    H: NcclHost<CudaBackend<F, I, BT>>,
{
    fn grid(&self) -> RankGrid {
        self.host.grid()
    }

    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn device(&self) -> &CudaDevice {
        self.host.device()
    }

    fn send<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
    ) -> Result<(), CommError> {
        self.host.send(peer, tag, tensor)
    }

    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        let tensor = self.host.recv(peer, tag, shape)?;
        if tensor.device() == *self.device() {
            return Ok(tensor);
        }
        // Handed over from another GPU: copy it here, receiver-driven (see `cuda_peer`).
        let moved =
            move_to_device(tensor.into_primitive().tensor(), self.device()).map_err(|reason| {
                self.host.fail(CommError::Data {
                    rank: self.host.rank(),
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
            return self.host.all_gather(group, shard);
        }
        self.nccl(group, CommOp::AllGather(group), shard, |m, t| {
            m.all_gather(t)
        })
    }

    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<CudaBackend<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, CommError> {
        if !self.on_nccl(group) {
            return self.host.reduce_scatter(group, tensor, op);
        }
        let action = CommOp::ReduceScatter(group, op);
        self.check_divisible(group, action, tensor.dims()[0])?;
        self.nccl(group, action, tensor, |m, t| m.reduce_scatter(t, op))
    }

    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        if !self.on_nccl(group) {
            return self.host.all_reduce(group, tensor, op);
        }
        self.nccl(group, CommOp::AllReduce(group, op), tensor, |m, t| {
            m.all_reduce(t, op)
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
            return self.host.broadcast(group, root, tensor);
        }
        self.nccl(group, CommOp::Broadcast(group, root), tensor, |m, t| {
            m.broadcast(t, root)
        })
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.host.barrier(group)
    }

    /// On an NCCL group with
    /// [`CommConfig::overlap_collectives`](super::CommConfig::overlap_collectives) on,
    /// launches the call on the member's stream and returns: the rank computes while the
    /// transfer runs, and [`Communicator::finish`] waits for it. Otherwise completes it here
    /// (the host path overlaps as its communicator does).
    fn start(
        &self,
        collective: Collective<CudaBackend<F, I, BT>>,
    ) -> Result<Pending<CudaBackend<F, I, BT>>, CommError> {
        let group = collective.group();
        if !self.on_nccl(group) {
            return self.host.start(collective);
        }
        let action = collective.op();
        let launched = self.launch_collective(collective)?;
        if !self.host.config().overlap_collectives {
            return self.wait_for(group, action, launched).map(Pending::done);
        }
        let id = self.launched.borrow_mut().push(group, launched);
        Ok(Pending::launched(Ticket {
            rank: self.rank(),
            group,
            action,
            id,
        }))
    }

    fn finish(
        &self,
        pending: Pending<CudaBackend<F, I, BT>>,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, 1>, CommError> {
        let ticket = match pending.into_state() {
            Ok(result) => return Ok(result),
            Err(Unfinished::Launched(ticket)) if ticket.rank == self.rank() => ticket,
            // The host's own collectives, and its error for anything started elsewhere.
            Err(other) => return self.host.finish(Pending::from(other)),
        };
        let taken = self.launched.borrow_mut().take(ticket.id, ticket.group);
        let call = taken.map_err(|reason| {
            self.host.fail(CommError::InvalidArgument {
                rank: self.rank(),
                action: ticket.action,
                reason,
            })
        })?;
        self.wait_for(ticket.group, ticket.action, call)
    }

    fn abort(&self, cause: &str) {
        self.host.abort(cause)
    }
}
