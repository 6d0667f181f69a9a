//! [`LocalComm`]: ranks are threads of one process, each with its own Burn device.
//!
//! Tensors travel as host data through the [`Mailbox`] layer: a tensor leaves its device on
//! the sending thread and is rebuilt on the receiving rank's device. Point-to-point tensors
//! between ranks on the same device skip the host: the tensor itself is handed over
//! ([`CommConfig::same_device_handoff`]). Collectives are built from
//! one exchange round each; reductions happen on the host in group-rank order (see
//! [`host`]), which is what makes them deterministic.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use super::host::HostBuf;
use super::mailbox::{Envelope, Handoff, Mailbox, Payload, Shared, Stream};
use super::pending::{
    self, Collective, PartKey, Pending, PostAndCollect, ReceivedPart, StartOrder,
};
use super::{
    ByteCounter, CommBytes, CommConfig, CommError, CommOp, Communicator, Group, RankGrid, ReduceOp,
};
use crate::host_read::{read, ReadPurpose};

/// A rank of a world whose ranks are threads of this process.
///
/// Created only by [`LocalComm::create`] / [`LocalComm::create_with_devices`], which return
/// one communicator per rank to move into that rank's thread. The communicator is `Send` but
/// not `Sync`: it belongs to one thread. Dropping it tells the others this rank has exited, so
/// a peer still waiting on it fails with [`CommError::PeerExited`] instead of timing out;
/// dropping it while panicking aborts the world.
pub struct LocalComm<B: Backend> {
    grid: RankGrid,
    /// Every rank's device, by world rank (this rank's, and which peers share it).
    devices: Arc<[B::Device]>,
    config: CommConfig,
    mbox: Mailbox,
    /// Whether point-to-point tensors for ranks on other devices are handed over as they are
    /// too (the receiver then gets a tensor on the sender's device, and must move it); set
    /// only by communicators that move them device to device (`NcclComm`).
    cross_device_handoff: bool,
    /// Payload sent so far.
    sent: ByteCounter,
    /// Collectives started and not finished.
    started: StartOrder,
}

impl<B: Backend> fmt::Debug for LocalComm<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.mbox.rank())
            .field("grid", &self.grid)
            .field("device", self.device())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> LocalComm<B> {
    /// One communicator per world rank (index = world rank), all on the backend's default
    /// device.
    pub fn create(grid: RankGrid, config: CommConfig) -> Vec<Self> {
        let devices = vec![B::Device::default(); grid.world_size()];
        Self::build(grid, devices, config)
    }

    /// One communicator per world rank (index = world rank); rank `r` computes on
    /// `devices[r]`, so `devices` must hold exactly `grid.world_size()` devices.
    pub fn create_with_devices(
        grid: RankGrid,
        devices: Vec<B::Device>,
        config: CommConfig,
    ) -> Result<Vec<Self>, CommError> {
        if devices.len() != grid.world_size() {
            return Err(CommError::InvalidGrid {
                pp: grid.pp(),
                dp: grid.dp(),
                reason: format!(
                    "{} devices given for a world of {} ranks",
                    devices.len(),
                    grid.world_size()
                ),
            });
        }
        Ok(Self::build(grid, devices, config))
    }

    fn build(grid: RankGrid, devices: Vec<B::Device>, config: CommConfig) -> Vec<Self> {
        let all: Arc<[B::Device]> = devices.into();
        Mailbox::world(grid.world_size(), config)
            .into_iter()
            .map(|mbox| LocalComm {
                grid,
                devices: Arc::clone(&all),
                config,
                mbox,
                cross_device_handoff: false,
                sent: ByteCounter::default(),
                started: StartOrder::default(),
            })
            .collect()
    }

    /// Hands point-to-point tensors to ranks on other devices over as they are (after
    /// synchronising the sender's device, since the caller's copy reads outside CubeCL's
    /// ordering): [`Communicator::recv`] then returns them on the sender's device, and the
    /// caller moves them.
    #[cfg(feature = "cuda")]
    pub(crate) fn hand_over_across_devices(&mut self) {
        self.cross_device_handoff = true;
    }

    /// The configuration this world was created with.
    pub fn config(&self) -> CommConfig {
        self.config
    }

    /// The world's first recorded failure as `(rank, cause)`, if any rank has failed.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.mbox.shared().failure()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        self.mbox.shared()
    }

    /// Records `err` as this rank's failure (aborting the world, so every peer stops) and
    /// returns it, for communicators layered on this one.
    #[cfg(feature = "cuda")]
    pub(crate) fn fail(&self, err: CommError) -> CommError {
        self.mbox.fail(err)
    }

    pub(crate) fn invalid(&self, action: CommOp, reason: String) -> CommError {
        self.mbox.fail(CommError::InvalidArgument {
            rank: self.mbox.rank(),
            action,
            reason,
        })
    }

    fn data_error(&self, action: CommOp, reason: String) -> CommError {
        self.mbox.fail(CommError::Data {
            rank: self.mbox.rank(),
            action,
            reason,
        })
    }

    fn shape_mismatch(
        &self,
        peer: usize,
        action: CommOp,
        expected: &[usize],
        actual: &[usize],
    ) -> CommError {
        self.mbox.fail(CommError::ShapeMismatch {
            rank: self.mbox.rank(),
            peer,
            action,
            expected: expected.to_vec(),
            actual: actual.to_vec(),
        })
    }

    /// Returns once every member of `group` has called `agree` with the same `action` and
    /// `shape`, moving only the shapes: a barrier that also checks the members agree on the
    /// call.
    /// Fails like any collective (mismatch, abort, departed peer, timeout). Communicators
    /// that move the data elsewhere (NCCL) call it first, so that a mismatched or failed peer
    /// is reported here rather than hanging the device.
    pub(crate) fn agree(
        &self,
        group: Group,
        action: CommOp,
        shape: &[usize],
    ) -> Result<(), CommError> {
        self.mbox.check_abort(action, shape)?;
        let others: Vec<usize> = self
            .group_members(group)
            .into_iter()
            .filter(|&r| r != self.mbox.rank())
            .collect();
        let mine: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let payload = Payload::Tensor(TensorData::new(mine.clone(), [mine.len()]));
        let received = self
            .mbox
            .exchange(group, action, shape, payload, &others, &others)?;
        for (&peer, payload) in others.iter().zip(received) {
            let theirs = match payload {
                Payload::Tensor(data) => data.to_vec::<i64>().ok(),
                _ => None,
            };
            match theirs {
                Some(theirs) if theirs == mine => {}
                Some(theirs) => {
                    let theirs: Vec<usize> = theirs.iter().map(|&d| d as usize).collect();
                    return Err(self.shape_mismatch(peer, action, shape, &theirs));
                }
                None => {
                    return Err(self.data_error(action, format!("no shape from rank {peer}")));
                }
            }
        }
        Ok(())
    }

    /// A tensor handed over by a thread on this device, copied into memory of this thread.
    ///
    /// CubeCL gives each thread its own stream, and memory returns to the pool of the stream
    /// that allocated it once its last handle goes. Its CUDA runtime keeps memory shared
    /// between streams alive until the reading stream has passed an event; its wgpu runtime
    /// does not in 0.10 (fixed upstream later, tracel-ai/cubecl#1434). There the receiver's
    /// kernels that read the tensor may still wait in this thread's queue when the receiver
    /// drops it, and the sender's next allocation of that size writes into the same memory
    /// and may reach the device first: the wgpu engine test with fused kernels lost most of
    /// one micro-batch's gradient that way about one run in eight under CPU load
    /// (`tests/comm_wgpu.rs` builds the interleaving). So the receiver copies the tensor
    /// while the sender's handle is held, waits for its own queue (the copy included), and
    /// only then lets the sender's memory go.
    fn adopt<const D: usize>(
        &self,
        handed_over: Tensor<B, D>,
        action: CommOp,
    ) -> Result<Tensor<B, D>, CommError> {
        // The clone keeps the original alive, so the multiplication cannot run in place.
        let own = handed_over.clone().mul_scalar(1.0);
        B::sync(self.device()).map_err(|e| self.data_error(action, format!("{e:?}")))?;
        drop(handed_over);
        Ok(own)
    }

    /// Fails (aborting the world) when `peer` sent `got` where `want` was expected.
    fn check_dtype(
        &self,
        peer: usize,
        action: CommOp,
        want: DType,
        got: DType,
    ) -> Result<(), CommError> {
        if want == got {
            return Ok(());
        }
        Err(self.data_error(
            action,
            format!("rank {peer} sent {got:?} values where {want:?} was expected"),
        ))
    }

    /// Reads a tensor back to the host.
    fn read<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<TensorData, CommError> {
        read(tensor, ReadPurpose::Transfer).map_err(|e| self.data_error(action, e.to_string()))
    }

    /// Reads a tensor into a shareable collective contribution.
    fn read_host<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<Arc<HostBuf>, CommError> {
        let data = self.read(tensor, action)?;
        HostBuf::from_data(data)
            .map(Arc::new)
            .map_err(|reason| self.data_error(action, reason))
    }

    /// Puts host data on this rank's device with the sender's dtype.
    fn build_tensor<const D: usize>(&self, data: TensorData) -> Tensor<B, D> {
        let dtype = data.dtype;
        Tensor::from_data(data, (self.device(), dtype))
    }
}

#[cfg(any(feature = "cuda", test))]
impl<B: Backend> super::watchdog::FailStop for LocalComm<B> {
    fn world_rank(&self) -> usize {
        self.mbox.rank()
    }
    fn call_timeout(&self) -> std::time::Duration {
        self.config.timeout
    }
    fn fail_world(&self, err: CommError) -> CommError {
        self.mbox.fail(err)
    }
}

impl<B: Backend> PostAndCollect<B> for LocalComm<B> {
    fn overlaps(&self) -> bool {
        self.config.overlap_collectives
    }

    fn check_call(&self, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        self.mbox.check_abort(action, shape)
    }

    fn next_seq(&self, group: Group) -> u64 {
        self.mbox.next_seq(group)
    }

    fn fail_call(&self, err: CommError) -> CommError {
        self.mbox.fail(err)
    }

    fn read_part<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<Arc<HostBuf>, CommError> {
        self.read_host(tensor, action)
    }

    fn send_part(
        &self,
        peer: usize,
        key: &PartKey,
        mine: &Arc<HostBuf>,
        range: std::ops::Range<usize>,
    ) -> Result<(), CommError> {
        self.sent.add(key.group, range.len(), mine.dtype);
        let payload = Payload::Part {
            shape: key.shape.clone(),
            buf: Arc::clone(mine),
            range,
        };
        self.mbox.post_part(
            peer, key.group, key.seq, key.round, key.action, &key.shape, payload,
        )
    }

    fn start_order(&self) -> &StartOrder {
        &self.started
    }

    fn receive_part(&self, peer: usize, key: &PartKey) -> Result<ReceivedPart, CommError> {
        let env = self
            .mbox
            .wait_part(peer, key.group, key.seq, key.round, key.action, &key.shape)?;
        match env.payload {
            Payload::Part { shape, buf, range } => Ok(ReceivedPart { shape, buf, range }),
            _ => Err(self.data_error(key.action, format!("no contribution from rank {peer}"))),
        }
    }
}

impl<B: Backend> Communicator<B> for LocalComm<B> {
    fn grid(&self) -> RankGrid {
        self.grid
    }

    fn rank(&self) -> usize {
        self.mbox.rank()
    }

    fn device(&self) -> &B::Device {
        &self.devices[self.mbox.rank()]
    }

    fn send<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        tensor: Tensor<B, D>,
    ) -> Result<(), CommError> {
        let action = CommOp::Send { tag };
        let shape = tensor.dims().to_vec();
        self.mbox.check_abort(action, &shape)?;
        if peer >= self.world_size() {
            return Err(self.invalid(
                action,
                format!(
                    "peer {peer} is not a rank of a world of {}",
                    self.world_size()
                ),
            ));
        }
        let same_device = self.devices[peer] == *self.device();
        // What a network would carry, also when the tensor is handed over as it is.
        self.sent
            .add(Group::Pipeline, shape.iter().product(), tensor.dtype());
        let payload = if (same_device && self.config.same_device_handoff)
            || (!same_device && self.cross_device_handoff)
        {
            // The producing work may still be queued on this thread. On the same device the
            // receiver's copy (`adopt`) is a kernel that CubeCL orders after it (it submits
            // this thread's queue first); a peer's copy across devices (`cuda_peer`) reads
            // the memory outside CubeCL's ordering, so it needs the work done.
            if !same_device {
                B::sync(self.device()).map_err(|e| self.data_error(action, format!("{e:?}")))?;
            }
            Payload::Handoff(Handoff::new(tensor))
        } else {
            let data = self.read(tensor, action)?;
            if !data.dtype.is_float() {
                return Err(
                    self.data_error(action, format!("expected float data, got {:?}", data.dtype))
                );
            }
            Payload::Tensor(data)
        };
        let env = Envelope {
            src: self.mbox.rank(),
            stream: Stream::P2p(tag),
            seq: 0,
            op: action,
            payload,
        };
        self.mbox.post(peer, env, &shape)
    }

    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
        dtype: DType,
    ) -> Result<Tensor<B, D>, CommError> {
        let action = CommOp::Recv { tag };
        self.mbox.check_abort(action, &shape)?;
        if peer >= self.world_size() {
            return Err(self.invalid(
                action,
                format!(
                    "peer {peer} is not a rank of a world of {}",
                    self.world_size()
                ),
            ));
        }
        let env = self
            .mbox
            .wait(peer, Stream::P2p(tag), action, &shape, Instant::now())?;
        match env.payload {
            Payload::Tensor(data) => {
                if data.shape.as_slice() != shape.as_slice() {
                    return Err(self.shape_mismatch(peer, action, &shape, data.shape.as_slice()));
                }
                self.check_dtype(peer, action, dtype, data.dtype)?;
                Ok(self.build_tensor(data))
            }
            Payload::Handoff(cell) => {
                let tensor = cell.take::<Tensor<B, D>>().ok_or_else(|| {
                    self.data_error(
                        action,
                        format!(
                            "rank {peer} sent a tensor with another number of dimensions than {D}"
                        ),
                    )
                })?;
                if tensor.dims() != shape {
                    return Err(self.shape_mismatch(peer, action, &shape, &tensor.dims()));
                }
                self.check_dtype(peer, action, dtype, tensor.dtype())?;
                if self.devices[peer] == *self.device() {
                    return self.adopt(tensor, action);
                }
                Ok(tensor)
            }
            _ => Err(self.data_error(action, format!("rank {peer} sent no tensor"))),
        }
    }

    fn all_gather(&self, group: Group, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        pending::finish(
            self,
            pending::begin(self, Collective::AllGather { group, shard })?,
        )
    }

    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let collective = Collective::ReduceScatter { group, tensor, op };
        pending::finish(self, pending::begin(self, collective)?)
    }

    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError> {
        pending::all_reduce(self, group, tensor, op)
    }

    fn broadcast<const D: usize>(
        &self,
        group: Group,
        root: usize,
        tensor: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, CommError> {
        let action = CommOp::Broadcast(group, root);
        let shape = tensor.dims().to_vec();
        self.mbox.check_abort(action, &shape)?;
        let size = self.group_size(group);
        if root >= size {
            return Err(self.invalid(
                action,
                format!("root {root} is not a member of a group of {size}"),
            ));
        }
        let members = self.group_members(group);
        let root_rank = members[root];
        if root_rank == self.mbox.rank() {
            let others: Vec<usize> = members
                .into_iter()
                .filter(|&r| r != self.mbox.rank())
                .collect();
            if !others.is_empty() {
                let mine = self.read_host(tensor.clone(), action)?;
                let len = mine.len();
                self.sent.add(group, len * others.len(), mine.dtype);
                let payload = Payload::Part {
                    shape: shape.clone(),
                    buf: mine,
                    range: 0..len,
                };
                self.mbox
                    .exchange(group, action, &shape, payload, &others, &[])?;
            } else {
                self.mbox.next_seq(group);
            }
            return Ok(tensor);
        }
        let received =
            self.mbox
                .exchange(group, action, &shape, Payload::Empty, &[], &[root_rank])?;
        let Some(Payload::Part { buf, .. }) = received.into_iter().next() else {
            return Err(self.data_error(action, format!("rank {root_rank} sent no tensor")));
        };
        if buf.shape != shape {
            return Err(self.shape_mismatch(root_rank, action, &shape, &buf.shape));
        }
        Ok(self.build_tensor(HostBuf::clone(&buf).into_data()))
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.agree(group, CommOp::Barrier(group), &[])
    }

    fn start(&self, collective: Collective<B>) -> Result<Pending<B>, CommError> {
        pending::start(self, collective)
    }

    fn finish(&self, pending: Pending<B>) -> Result<Tensor<B, 1>, CommError> {
        pending::finish(self, pending)
    }

    fn bytes_sent(&self) -> CommBytes {
        self.sent.get()
    }

    fn abort(&self, cause: &str) {
        self.mbox
            .shared()
            .abort(self.mbox.rank(), cause.to_string());
    }
}
