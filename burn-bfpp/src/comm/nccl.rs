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
//! Pipeline transfers between ranks of a pipeline group on distinct GPUs are NCCL's
//! point-to-point sends and receives, straight from and into device buffers in the compute
//! dtype, each batch of a rank's consecutive transfers posted as one NCCL group
//! ([`Communicator::exchange`]; see `nccl/p2p.rs`). A pipeline group whose ranks share a GPU
//! keeps the host communicator's transfers: between threads on one GPU the tensor is handed
//! over as it is, between threads on different GPUs of such a group it is handed over and
//! peer-copied by the receiver ([`super::cuda_peer`]). Barriers and failure propagation are
//! the host communicator's.
//!
//! Every NCCL wait runs under the watchdog ([`super::watchdog`]): a call that fails, or does
//! not finish within the timeout because a peer died or stalled, has its communicator
//! aborted and ends every rank with an error naming this rank and the call. With
//! `BFPP_DEBUG_COLLECTIVES=1` the members also check through the host communicator, before
//! each NCCL call, that they all issue the same collective on the same shape (and the same
//! transfers in the same order), so a mismatch is reported by rank and action instead of
//! hanging until the watchdog fires; off by default, since it is a blocking host exchange
//! per call.
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
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;

mod p2p;
mod setup;

pub use setup::{cuda_driver_available, nccl_available};

use super::cuda_peer::move_to_device;
use super::launched::LaunchedCalls;
use super::nccl_group::{Launched, NcclFailure, NcclMember};
use super::nccl_host::NcclHost;
use super::pending::{Ticket, Unfinished};
use super::threads::{ThreadRank, World};
use super::watchdog::{await_call, watch};
use super::{
    ByteCounter, Collective, CommBytes, CommError, CommOp, Communicator, Group, LocalComm, Pending,
    ProcessRank, RankGrid, ReduceOp,
};
use crate::sim::{collective_bytes, CollectiveKind};

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
    /// Groups of point-to-point sends in flight on the pipeline member, oldest first: their
    /// buffers stay allocated until they finished.
    sends: RefCell<Vec<Launched>>,
    /// How many transfers this rank posted to and from each pipeline peer (by world rank),
    /// checked against the peer's under `BFPP_DEBUG_COLLECTIVES`.
    transfers: RefCell<std::collections::HashMap<(usize, bool), u64>>,
    /// Payload sent over NCCL so far (the host counts its own).
    sent: ByteCounter,
    /// `BFPP_DEBUG_COLLECTIVES=1`: check every NCCL call's agreement over the host first.
    debug_calls: bool,
    /// The world's timeout, for the sends still in flight when the communicator goes.
    timeout: std::time::Duration,
    _elements: PhantomData<CudaBackend<F, I, BT>>,
}

/// The environment variable that turns on the members' agreement check before every NCCL
/// call (see the [module docs](self)).
pub const DEBUG_COLLECTIVES_ENV: &str = "BFPP_DEBUG_COLLECTIVES";

/// Whether [`DEBUG_COLLECTIVES_ENV`] asks for the agreement check.
fn debug_collectives() -> bool {
    std::env::var(DEBUG_COLLECTIVES_ENV).is_ok_and(|v| v.trim() == "1")
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

    /// Launches `call` on `group`'s NCCL member once the calls in flight on this rank's other
    /// communicator finished (so no two of its communicators have calls in flight at once;
    /// see [`super::nccl_group`]), after every member agreed on `action` and the input's
    /// shape when [`DEBUG_COLLECTIVES_ENV`] asks for it. Counts the bytes the call sends. An
    /// NCCL failure aborts the world with an error naming this rank.
    fn launch<const D: usize>(
        &self,
        group: Group,
        action: CommOp,
        tensor: Tensor<CudaBackend<F, I, BT>, D>,
        call: impl FnOnce(&mut NcclMember, CubeTensor<CudaRuntime>) -> Result<Launched, NcclFailure>,
    ) -> Result<Launched, CommError> {
        let member = self.nccl_member(group, action)?;
        if self.debug_calls {
            self.host.agree(group, action, &tensor.dims())?;
        }
        let other = match group {
            Group::DataParallel => Group::Pipeline,
            Group::Pipeline => Group::DataParallel,
        };
        self.wait_for_newest(other, action)?;
        self.count_collective(group, action, &tensor.dims(), tensor.dtype());
        let input = tensor.into_primitive().tensor();
        call(&mut member.borrow_mut(), input).map_err(|reason| self.nccl_failed(action, reason))
    }

    /// Waits until the calls in flight on `group`'s communicator finished (`action` is the
    /// call that waits, as errors name it): its newest collective, and on the pipeline
    /// member its newest group of sends (calls of one member finish in launch order).
    fn wait_for_newest(&self, group: Group, action: CommOp) -> Result<(), CommError> {
        let Some(member) = self.member(group) else {
            return Ok(());
        };
        let wait = |call: &Launched| self.await_launched(member, action, call);
        if let Some(newest) = self.launched.borrow().newest(group) {
            wait(newest)?;
        }
        if group == Group::Pipeline {
            if let Some(newest) = self.sends.borrow().last() {
                wait(newest)?;
            }
            self.sends.borrow_mut().clear();
        }
        Ok(())
    }

    /// Counts what `action` on an input of `dims` and `dtype` sends from this member: NCCL's
    /// ring volumes ([`crate::sim::collective_bytes`]), the formulas the simulator uses.
    fn count_collective(&self, group: Group, action: CommOp, dims: &[usize], dtype: DType) {
        let d = self.group_size(group);
        let n: usize = dims.iter().product();
        let ring = |kind, elements: usize| collective_bytes(kind, elements as u64, 1, d) as usize;
        let elements = match action {
            CommOp::AllGather(_) => ring(CollectiveKind::AllGather, n * d),
            CommOp::ReduceScatter(..) => ring(CollectiveKind::ReduceScatter, n),
            CommOp::AllReduce(..) => ring(CollectiveKind::AllReduce, n),
            CommOp::Broadcast(_, root) if root == self.group_rank(group) => n * (d - 1),
            _ => 0,
        };
        self.sent.add(group, elements, dtype);
    }

    /// Waits for `call`, launched by `member`, under the watchdog ([`await_call`]): a
    /// failure or a timeout aborts the member's communicator and the world, naming this rank
    /// and `action`.
    fn await_launched(
        &self,
        member: &RefCell<NcclMember>,
        action: CommOp,
        call: &Launched,
    ) -> Result<(), CommError> {
        let mut member = member.borrow_mut();
        let mut watched = member
            .watched(call)
            .map_err(|reason| self.nccl_failed(action, reason))?;
        await_call(&self.host, action, &mut watched)
    }

    /// Waits for a call `group`'s member launched and returns its output as a tensor.
    fn wait_for<const E: usize>(
        &self,
        group: Group,
        action: CommOp,
        call: Launched,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, E>, CommError> {
        self.await_launched(self.nccl_member(group, action)?, action, &call)?;
        let output = call.into_outputs().pop().ok_or_else(|| {
            self.host.fail(CommError::Data {
                rank: self.host.rank(),
                action,
                reason: "the NCCL call returned no output".into(),
            })
        })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
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
        // Sends still in flight (the last results on their way to rank 0) are waited for, as
        // a host communicator flushes its sends; one that does not finish within the world's
        // timeout has its communicator aborted by the watchdog before its buffers go.
        let timeout = self.timeout;
        if let (Some(newest), Some(pp)) = (self.sends.get_mut().last(), self.pp.as_mut()) {
            if let Ok(mut call) = pp.get_mut().watched(newest) {
                let _ = watch(&mut call, timeout);
            }
        }
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
        if self.nccl_peer(peer).is_some() {
            return self.transfer(vec![(peer, tag, tensor)], &[]).map(drop);
        }
        self.host.send(peer, tag, tensor)
    }

    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
        dtype: DType,
    ) -> Result<Tensor<CudaBackend<F, I, BT>, D>, CommError> {
        if self.nccl_peer(peer).is_some() {
            let mut got = self.transfer(Vec::new(), &[(peer, tag, shape, dtype)])?;
            return got.pop().ok_or_else(|| {
                self.host.fail(CommError::Data {
                    rank: self.rank(),
                    action: CommOp::Recv { tag },
                    reason: format!("nothing received from rank {peer}"),
                })
            });
        }
        let tensor = self.host.recv(peer, tag, shape, dtype)?;
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

    fn groups_transfers(&self) -> bool {
        self.pp.is_some()
    }

    fn exchange<const D: usize>(
        &self,
        sends: Vec<(usize, u64, Tensor<CudaBackend<F, I, BT>, D>)>,
        recvs: &[(usize, u64, [usize; D], DType)],
    ) -> Result<Vec<Tensor<CudaBackend<F, I, BT>, D>>, CommError> {
        let on_nccl = sends.iter().map(|(peer, ..)| *peer);
        let on_nccl = on_nccl.chain(recvs.iter().map(|(peer, ..)| *peer));
        if self.pp.is_some() && on_nccl.clone().all(|peer| self.nccl_peer(peer).is_some()) {
            return self.transfer(sends, recvs);
        }
        for (peer, tag, tensor) in sends {
            self.send(peer, tag, tensor)?;
        }
        recvs
            .iter()
            .map(|&(peer, tag, shape, dtype)| self.recv(peer, tag, shape, dtype))
            .collect()
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

    fn bytes_sent(&self) -> CommBytes {
        let (host, own) = (self.host.bytes_sent(), self.sent.get());
        CommBytes {
            data_parallel: host.data_parallel + own.data_parallel,
            pipeline: host.pipeline + own.pipeline,
        }
    }

    fn abort(&self, cause: &str) {
        self.host.abort(cause)
    }
}
