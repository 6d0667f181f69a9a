//! Communication between ranks: point-to-point transfers for the pipeline dimension and
//! collectives for the data-parallel (sharded) dimension.
//!
//! # Rank grid
//!
//! The world is a `pp × dp` grid ([`RankGrid`]). A rank's coordinates are its *pipeline index*
//! (which pipeline rank it is, `0..pp`) and its *data-parallel index* (which replica of the
//! pipeline it belongs to, `0..dp`), and
//!
//! ```text
//! world rank = dp_index * pp + pp_index
//! ```
//!
//! so the ranks of one pipeline are contiguous. A rank belongs to two groups ([`Group`]):
//! its **pipeline group** (the `pp` ranks with its dp index, group rank = pp index) and its
//! **data-parallel group** (the `dp` ranks with its pp index, group rank = dp index).
//!
//! # Semantics every [`Communicator`] follows
//!
//! * **Point-to-point** transfers name the peer by *world* rank and carry a `tag`; a receive
//!   takes the oldest message from that peer with that tag, so transfers with different tags
//!   may be received in any order. Sends never block.
//! * **Collectives** are issued by every member of the group in the same order (as with NCCL
//!   or MPI); a member calling a different collective is detected and reported.
//! * **Deterministic reductions**: sums are taken element by element in group-rank order
//!   (`((x0 + x1) + x2) + …`, then `/ n` for [`ReduceOp::Mean`]), so every member gets bitwise
//!   identical results, runs are reproducible, and reduce-scatter followed by all-gather is
//!   bitwise identical to all-reduce.
//! * **Fail-stop**: every blocking call has a timeout ([`CommConfig::timeout`]); any error on
//!   any rank (including a timeout or a panic) aborts the whole world, and every other rank's
//!   next or current communication call fails promptly with [`CommError::PeerFailed`] naming
//!   the rank that failed first and its cause — never a hang.
//!
//! [`LocalComm`] implements the trait for ranks that are threads of one process, each with its
//! own Burn device; [`run_ranks`] runs one closure per rank on such a world and turns failures
//! and panics into one error naming the rank that caused them. [`ProcessComm`] implements it
//! for ranks that are CPU processes, with the same semantics and bitwise the same results,
//! over MPI (`MpiComm`, feature `mpi`, for `mpirun`/`srun`). Ranks that are GPU processes
//! (one per GPU, started by torchrun, Slurm or `bfpp launch`) move their data with `NcclComm`
//! (feature `cuda`) over a small TCP control channel ([`ControlComm`]) for start-up, barriers
//! and failures. One data transport per kind of rank: memory for threads, MPI for CPU
//! processes, NCCL for GPU processes.

mod control;
#[cfg(feature = "cuda")]
mod cuda_peer;
mod error;
mod host;
#[cfg(any(feature = "cuda", test))]
mod launched;
mod local;
mod mailbox;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_group;
// NCCL's start-up exchanges over a host communicator: for NCCL (feature `cuda`), and for the
// tests that run them on CPU ranks (`testing`, feature `fault-injection`).
#[cfg(any(feature = "cuda", feature = "fault-injection", test))]
mod nccl_host;
mod pending;
mod process;
mod secret;
mod store;
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod testing;
mod threads;
#[cfg(any(feature = "cuda", test))]
mod watchdog;
mod wire;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_control;
#[cfg(test)]
mod tests_failure;
#[cfg(test)]
mod tests_nccl_checks;
#[cfg(test)]
mod tests_pending;

use std::fmt;
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

#[cfg(feature = "mpi")]
pub use self::mpi::{mpi_launch_env, MpiComm, MpiTransport};
pub use crate::sim::CommBytes;
pub use control::{ControlComm, ControlTransport};
pub use error::{CommError, RankError};
pub use local::LocalComm;
#[cfg(feature = "cuda")]
pub use nccl::{cuda_driver_available, nccl_available, CudaBackend, NcclComm};
#[cfg(feature = "cuda")]
pub(crate) use nccl_host::agree_by_all_gather;
#[cfg(feature = "cuda")]
pub use nccl_host::NcclHost;
pub use pending::{Collective, Pending};
pub use process::{Incoming, ProcessComm, ProcessRank, Transport};
pub use secret::{JobSecret, JOB_SECRET_ENV};
pub use store::{free_local_port, RendezvousEnv, StoreError};
pub use threads::{run_ranks, ThreadRank, World};

/// Which of a rank's two groups a collective runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Group {
    /// The ranks of one pipeline: same data-parallel index, group rank = pipeline index.
    Pipeline,
    /// The replicas of one pipeline rank: same pipeline index, group rank = data-parallel index.
    DataParallel,
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Group::Pipeline => f.write_str("pipeline group"),
            Group::DataParallel => f.write_str("data-parallel group"),
        }
    }
}

/// How a reduction combines the members' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum, taken in group-rank order.
    Sum,
    /// The group-rank-ordered sum divided by the group size.
    Mean,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::Sum => f.write_str("sum"),
            ReduceOp::Mean => f.write_str("mean"),
        }
    }
}

/// One communication call, as named in errors and checked between collective members.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum CommOp {
    /// Point-to-point send with a tag.
    Send {
        /// The message tag.
        tag: u64,
    },
    /// Point-to-point receive with a tag.
    Recv {
        /// The message tag.
        tag: u64,
    },
    /// All-gather of 1-D shards over a group.
    AllGather(Group),
    /// Reduce-scatter of a 1-D tensor over a group.
    ReduceScatter(Group, ReduceOp),
    /// All-reduce over a group.
    AllReduce(Group, ReduceOp),
    /// Broadcast from the member with the given group rank.
    Broadcast(Group, usize),
    /// Barrier over a group.
    Barrier(Group),
}

impl fmt::Display for CommOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommOp::Send { tag } => write!(f, "send (tag {tag})"),
            CommOp::Recv { tag } => write!(f, "recv (tag {tag})"),
            CommOp::AllGather(g) => write!(f, "all-gather on the {g}"),
            CommOp::ReduceScatter(g, op) => write!(f, "reduce-scatter ({op}) on the {g}"),
            CommOp::AllReduce(g, op) => write!(f, "all-reduce ({op}) on the {g}"),
            CommOp::Broadcast(g, root) => write!(f, "broadcast from group rank {root} on the {g}"),
            CommOp::Barrier(g) => write!(f, "barrier on the {g}"),
        }
    }
}

/// A counter of [`CommBytes`] a communicator updates as it sends (from `&self`).
#[derive(Debug, Default)]
pub(crate) struct ByteCounter(std::cell::Cell<CommBytes>);

impl ByteCounter {
    /// Counts `elements` values of `dtype` sent on the traffic of `group`.
    pub(crate) fn add(&self, group: Group, elements: usize, dtype: burn::tensor::DType) {
        let mut bytes = self.0.get();
        let n = (elements * dtype.size()) as u64;
        match group {
            Group::DataParallel => bytes.data_parallel += n,
            Group::Pipeline => bytes.pipeline += n,
        }
        self.0.set(bytes);
    }

    /// Everything counted so far.
    pub(crate) fn get(&self) -> CommBytes {
        self.0.get()
    }
}

/// Settings shared by all ranks of a world.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommConfig {
    /// Longest time one blocking call may wait for its peers before failing with
    /// [`CommError::Timeout`]. Default 300 s: long enough for a slow first step (kernel
    /// compilation, autotuning), short enough that a lost message does not hang a job forever.
    pub timeout: Duration,
    /// How often a waiting rank wakes up to look for an abort or a departed peer. Bounds how
    /// quickly failures propagate; default 10 ms.
    pub poll_interval: Duration,
    /// Whether point-to-point tensors between ranks that compute on the same device (threads
    /// of one process) are handed over as they are instead of through host memory. Default
    /// on: on a GPU shared by several pipeline stages this removes a device-to-host and a
    /// host-to-device copy per transfer. Burn tensors are immutable values, but CubeCL queues
    /// work per thread: the receiver copies a handed-over tensor into its own memory (a
    /// kernel, which CubeCL orders after the sender's queued work) and synchronises before it
    /// lets the original go, because on wgpu the sender may otherwise reuse the memory while
    /// the receiver's reads are still queued (see `LocalComm`'s `recv`). Off only to exercise
    /// the host path on one device (tests).
    pub same_device_handoff: bool,
    /// Whether [`Communicator::start`] returns as soon as this rank's part is posted, so the
    /// rank computes while its peers catch up and their parts travel, and waits only in
    /// [`Communicator::finish`] (see [`pending`]). Default on; results are bitwise the same
    /// either way. Off makes every collective wait where it starts, as a measurement baseline.
    pub overlap_collectives: bool,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: Duration::from_secs(300),
            poll_interval: Duration::from_millis(10),
            same_device_handoff: true,
            overlap_collectives: true,
        }
    }
}

impl CommConfig {
    /// The default configuration with another timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        CommConfig {
            timeout,
            ..CommConfig::default()
        }
    }
}

/// The `pp × dp` arrangement of world ranks; see the [module docs](self) for the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RankGrid {
    pp: usize,
    dp: usize,
}

impl RankGrid {
    /// A grid of `pp` pipeline ranks times `dp` data-parallel replicas; both must be non-zero.
    pub fn new(pp: usize, dp: usize) -> Result<Self, CommError> {
        if pp == 0 || dp == 0 {
            return Err(CommError::InvalidGrid {
                pp,
                dp,
                reason: "both sizes must be at least 1".into(),
            });
        }
        if pp.checked_mul(dp).is_none() {
            return Err(CommError::InvalidGrid {
                pp,
                dp,
                reason: "the world size overflows".into(),
            });
        }
        Ok(RankGrid { pp, dp })
    }

    /// Number of pipeline ranks (size of every pipeline group).
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Number of data-parallel replicas (size of every data-parallel group).
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// Total number of ranks, `pp * dp`.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp
    }

    /// World rank of the given coordinates: `dp_index * pp + pp_index`.
    pub fn rank_of(&self, pp_index: usize, dp_index: usize) -> usize {
        dp_index * self.pp + pp_index
    }

    /// Pipeline index (`0..pp`) of a world rank.
    pub fn pp_index(&self, rank: usize) -> usize {
        rank % self.pp
    }

    /// Data-parallel index (`0..dp`) of a world rank.
    pub fn dp_index(&self, rank: usize) -> usize {
        rank / self.pp
    }

    /// Number of members of a group of the given kind.
    pub fn group_size(&self, group: Group) -> usize {
        match group {
            Group::Pipeline => self.pp,
            Group::DataParallel => self.dp,
        }
    }

    /// Position of `rank` within its group of the given kind.
    pub fn group_rank(&self, rank: usize, group: Group) -> usize {
        match group {
            Group::Pipeline => self.pp_index(rank),
            Group::DataParallel => self.dp_index(rank),
        }
    }

    /// World rank of the member with `group_rank` in `rank`'s group of the given kind.
    pub fn group_member(&self, rank: usize, group: Group, group_rank: usize) -> usize {
        match group {
            Group::Pipeline => self.rank_of(group_rank, self.dp_index(rank)),
            Group::DataParallel => self.rank_of(self.pp_index(rank), group_rank),
        }
    }

    /// World ranks of `rank`'s group of the given kind, in group-rank order.
    pub fn group_members(&self, rank: usize, group: Group) -> Vec<usize> {
        (0..self.group_size(group))
            .map(|g| self.group_member(rank, group, g))
            .collect()
    }
}

/// Fails unless `ids` holds one device per rank of `grid` and the members of every
/// data-parallel group are on distinct devices, which NCCL requires of a communicator's
/// members (it refuses two on one GPU). Generic over the device id so the rule is tested on
/// machines without GPUs.
pub fn check_distinct_devices<Id: PartialEq + fmt::Display>(
    grid: RankGrid,
    ids: &[Id],
) -> Result<(), CommError> {
    let invalid = |reason: String| CommError::InvalidGrid {
        pp: grid.pp(),
        dp: grid.dp(),
        reason,
    };
    if ids.len() != grid.world_size() {
        return Err(invalid(format!(
            "{} devices given for a world of {} ranks",
            ids.len(),
            grid.world_size()
        )));
    }
    for pp_index in 0..grid.pp() {
        let members = grid.group_members(pp_index, Group::DataParallel);
        if let Some((a, b)) = first_shared_device(&members, ids) {
            return Err(invalid(format!(
                "ranks {a} and {b} are replicas of one pipeline rank on the same device \
                 ({}); NCCL needs each data-parallel group on distinct GPUs: give every \
                 replica its own GPU (--gpus ≥ --dp), or use LocalComm for ranks sharing one",
                ids[a]
            )));
        }
    }
    Ok(())
}

/// Builds one communicator per group of kind `group` whose members are on distinct devices
/// (`ids`, by world rank), with `create` given the group's devices in group-rank order and
/// returning one member per device; returns every world rank's member, `None` for the ranks
/// of groups sharing a device. On failure, the group's world ranks and `create`'s error.
/// Generic over the member type so that the wiring is tested without GPUs.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn group_wiring<Id: PartialEq + Copy, M>(
    grid: RankGrid,
    ids: &[Id],
    group: Group,
    mut create: impl FnMut(&[Id]) -> Result<Vec<M>, String>,
) -> Result<Vec<Option<M>>, (Vec<usize>, String)> {
    let mut out: Vec<Option<M>> = (0..grid.world_size()).map(|_| None).collect();
    // One rank of each group: the group's first member.
    let firsts: Vec<usize> = match group {
        Group::DataParallel => (0..grid.pp()).map(|p| grid.rank_of(p, 0)).collect(),
        Group::Pipeline => (0..grid.dp()).map(|d| grid.rank_of(0, d)).collect(),
    };
    for first in firsts {
        let members = grid.group_members(first, group);
        if first_shared_device(&members, ids).is_some() {
            continue;
        }
        let devices: Vec<Id> = members.iter().map(|&r| ids[r]).collect();
        let created = create(&devices).map_err(|e| (members.clone(), e))?;
        if created.len() != members.len() {
            let reason = format!("{} members made for {} ranks", created.len(), members.len());
            return Err((members, reason));
        }
        for (rank, member) in members.into_iter().zip(created) {
            out[rank] = Some(member);
        }
    }
    Ok(out)
}

/// The first two of `members` (world ranks) whose devices in `ids` are the same, if any:
/// such a group cannot be one NCCL communicator.
pub(crate) fn first_shared_device<Id: PartialEq>(
    members: &[usize],
    ids: &[Id],
) -> Option<(usize, usize)> {
    members.iter().enumerate().find_map(|(i, &a)| {
        members[i + 1..]
            .iter()
            .find(|&&b| ids[b] == ids[a])
            .map(|&b| (a, b))
    })
}

/// One rank's handle on the world: point-to-point transfers and group collectives.
///
/// Every call blocks at most [`CommConfig::timeout`]; any error is fatal for the whole world
/// (see the [module docs](self)). Tensors cross ranks as host data and are rebuilt on the
/// receiving rank's [`device`](Communicator::device) with the sender's float dtype, except
/// point-to-point tensors between threads on one device, which are handed over as they are
/// (see [`CommConfig::same_device_handoff`]).
pub trait Communicator<B: Backend> {
    /// The grid this rank belongs to.
    fn grid(&self) -> RankGrid;

    /// This rank's world rank.
    fn rank(&self) -> usize;

    /// The device this rank computes on; received tensors are created here.
    fn device(&self) -> &B::Device;

    /// Number of ranks in the world.
    fn world_size(&self) -> usize {
        self.grid().world_size()
    }

    /// This rank's position within its group of the given kind.
    fn group_rank(&self, group: Group) -> usize {
        self.grid().group_rank(self.rank(), group)
    }

    /// Number of members of this rank's group of the given kind.
    fn group_size(&self, group: Group) -> usize {
        self.grid().group_size(group)
    }

    /// World ranks of this rank's group of the given kind, in group-rank order.
    fn group_members(&self, group: Group) -> Vec<usize> {
        self.grid().group_members(self.rank(), group)
    }

    /// Sends a float tensor of any shape to world rank `peer` (which may be this rank).
    /// Does not block.
    fn send<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        tensor: Tensor<B, D>,
    ) -> Result<(), CommError>;

    /// Receives the oldest tensor sent by world rank `peer` with `tag`; its shape must be
    /// `shape` and its dtype `dtype` (a device transport allocates the buffer before the data
    /// arrives), which is also what errors report while waiting.
    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
        dtype: DType,
    ) -> Result<Tensor<B, D>, CommError>;

    /// Whether this communicator moves pipeline transfers as device operations that must be
    /// issued together to be safe ([`Communicator::exchange`]): NCCL's sends and receives
    /// each wait on the device for their peer, so a rank that sends to and receives from one
    /// peer at once must post both in one group.
    fn groups_transfers(&self) -> bool {
        false
    }

    /// Point-to-point transfers issued together: every send of `sends` (`(peer, tag,
    /// tensor)`) and every receive of `recvs` (`(peer, tag, shape, dtype)`), as one group on
    /// transports that group them (NCCL), so that no order of the peers' own groups can
    /// deadlock. Returns the received tensors in the order of `recvs`. The default posts the
    /// sends, then waits for the receives.
    #[allow(clippy::type_complexity)] // the two lists spelled out are clearer than aliases
    fn exchange<const D: usize>(
        &self,
        sends: Vec<(usize, u64, Tensor<B, D>)>,
        recvs: &[(usize, u64, [usize; D], DType)],
    ) -> Result<Vec<Tensor<B, D>>, CommError> {
        for (peer, tag, tensor) in sends {
            self.send(peer, tag, tensor)?;
        }
        recvs
            .iter()
            .map(|&(peer, tag, shape, dtype)| self.recv(peer, tag, shape, dtype))
            .collect()
    }

    /// Concatenates the members' equal-length 1-D shards in group-rank order; every member
    /// gets the full buffer.
    fn all_gather(&self, group: Group, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError>;

    /// Reduces the members' equal-length 1-D tensors (length divisible by the group size) and
    /// returns chunk number `group_rank` of the result.
    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError>;

    /// Reduces the members' equal-shape tensors; every member gets the full result.
    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError>;

    /// Every member gets the tensor of the member with group rank `root`. Non-root members
    /// pass a tensor of the same shape; only its shape is used.
    fn broadcast<const D: usize>(
        &self,
        group: Group,
        root: usize,
        tensor: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, CommError>;

    /// Returns once every member of the group has entered the barrier.
    fn barrier(&self, group: Group) -> Result<(), CommError>;

    /// Starts a 1-D collective. Where the communicator can (see [`pending`] and
    /// [`CommConfig::overlap_collectives`]) it returns once this rank's part is posted, and
    /// [`Communicator::finish`] waits for the others'; collectives started on a group must be
    /// finished in the order they were started, and the group's other collectives issued
    /// after them. The default completes it at once with the blocking call.
    fn start(&self, collective: Collective<B>) -> Result<Pending<B>, CommError> {
        collective.run(self).map(Pending::done)
    }

    /// The result of a collective [`Communicator::start`] returned on this communicator,
    /// waiting for the other members' parts if they have not arrived.
    fn finish(&self, pending: Pending<B>) -> Result<Tensor<B, 1>, CommError> {
        pending
            .into_state()
            .map_err(|unfinished| CommError::InvalidArgument {
                rank: self.rank(),
                action: unfinished.action(),
                reason: "this communicator completes collectives where they start, so this \
                         one was started by another communicator; finish it there"
                    .into(),
            })
    }

    /// Payload bytes this rank has sent so far ([`CommBytes`]: elements × the dtype's size,
    /// whatever the transport adds).
    fn bytes_sent(&self) -> CommBytes;

    /// Stops the whole world: every rank's pending and later calls fail with
    /// [`CommError::PeerFailed`] naming this rank and `cause`. Only the first abort of a world
    /// is recorded, so the reported cause is the root cause.
    fn abort(&self, cause: &str);
}
