//! [`MpiComm`]: one rank per process, over MPI (feature `mpi`, OpenMPI's `mpirun`/`srun`).
//!
//! The semantics are exactly those of [`LocalComm`](super::LocalComm), and so are the results:
//! tensors travel as host values (see [`wire`](super::wire)), collectives are one exchange
//! round among the group's members and reductions run on the host in group-rank order
//! ([`host`](super::host)), so a multi-process run is bitwise the in-process run.
//!
//! Nothing here blocks inside MPI: sends are non-blocking (their buffers stay alive until MPI
//! reports them complete), and every wait polls a non-blocking matched probe against a
//! deadline, so every call honours [`CommConfig::timeout`]. Every incoming message is drained
//! into a local inbox keyed by `(source, stream)`, which gives tag matching in any order and
//! lets an abort notice overtake data the rank is not waiting for yet.
//!
//! Fail-stop: the first error a rank meets (or [`Communicator::abort`]) is recorded and sent to
//! every other rank as an abort notice; they fail their current or next call with
//! [`CommError::PeerFailed`] naming it. MPI's error handler on the world is set to return
//! errors, so an MPI failure does not kill the process before it can report.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::raw::AsRaw;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};

use super::host::{self, HostBuf};
use super::wire::{self, Message, Payload, Stream};
use super::{CommConfig, CommError, CommOp, Communicator, Group, RankGrid, ReduceOp};

/// The one MPI tag all messages use: streams are told apart by the message header.
const MPI_TAG: i32 = 17;

/// Longest sleep between two polls of a waiting receive (see [`MpiComm::wait`]).
const MAX_NAP: Duration = Duration::from_micros(200);

/// Polls a waiting receive makes, yielding the core in between, before it starts sleeping.
const YIELDING_POLLS: u32 = 32;

/// How long a dropped communicator waits for its last sends (abort notices above all) to
/// leave before giving up on them.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// A non-blocking send in flight and the buffer MPI reads from.
struct PendingSend {
    request: Request<'static, [u8], StaticScope>,
    /// Leaked by [`MpiComm::post`] so the request may outlive any borrow; freed once the
    /// request completes.
    buf: *mut [u8],
}

/// Mutable state: the calls take `&self` like every [`Communicator`].
#[derive(Default)]
struct State {
    inbox: HashMap<(usize, Stream), VecDeque<(CommOp, Payload)>>,
    pending: Vec<PendingSend>,
    /// Next collective number of the pipeline and data-parallel groups.
    seq: [u64; 2],
    /// The world's first failure this rank knows of, as `(rank, cause)`.
    failure: Option<(usize, String)>,
}

/// A rank of a world whose ranks are MPI processes (feature `mpi`).
///
/// Created once per process by [`MpiComm::init`], which initialises MPI; dropping it waits
/// briefly for outstanding sends and finalises MPI. Like [`LocalComm`](super::LocalComm) it is
/// used from one thread.
pub struct MpiComm<B: Backend> {
    grid: RankGrid,
    rank: usize,
    device: B::Device,
    config: CommConfig,
    world: SimpleCommunicator,
    state: RefCell<State>,
    /// Dropped last: finalises MPI after the state's requests are settled.
    _universe: Universe,
}

impl<B: Backend> fmt::Debug for MpiComm<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("grid", &self.grid)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The world size and rank of an MPI launch, from the launcher's environment, without
/// initialising MPI: `Some((rank, size))` under OpenMPI's `mpirun` or a PMI/PMIx launcher
/// (`srun --mpi=pmix`).
pub fn mpi_launch_env() -> Option<(usize, usize)> {
    let pairs = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ];
    pairs.iter().find_map(|(r, s)| {
        let rank = std::env::var(r).ok()?.parse().ok()?;
        let size = std::env::var(s).ok()?.parse().ok()?;
        Some((rank, size))
    })
}

impl<B: Backend> MpiComm<B> {
    /// Initialises MPI and joins the world as one rank of `grid`, computing on `device`.
    ///
    /// Fails if MPI was already initialised in this process or if the world started by the
    /// launcher does not have `grid.world_size()` processes.
    pub fn init(grid: RankGrid, device: B::Device, config: CommConfig) -> Result<Self, CommError> {
        let invalid = |reason: String| CommError::InvalidGrid {
            pp: grid.pp(),
            dp: grid.dp(),
            reason,
        };
        let universe = mpi::initialize()
            .ok_or_else(|| invalid("MPI is already initialised in this process".into()))?;
        let world = universe.world();
        // SAFETY: the world communicator is valid between initialisation and finalisation,
        // and both handles are MPI's own constants.
        unsafe {
            mpi::ffi::MPI_Comm_set_errhandler(world.as_raw(), mpi::ffi::RSMPI_ERRORS_RETURN);
        }
        let size = usize::try_from(world.size()).unwrap_or(0);
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        if size != grid.world_size() {
            return Err(invalid(format!(
                "MPI started {size} processes but pp {} × dp {} needs {}; run \
                 `mpirun -np {}` or change --pp/--dp",
                grid.pp(),
                grid.dp(),
                grid.world_size(),
                grid.world_size()
            )));
        }
        Ok(MpiComm {
            grid,
            rank,
            device,
            config,
            world,
            state: RefCell::new(State::default()),
            _universe: universe,
        })
    }

    /// The configuration this rank was created with.
    pub fn config(&self) -> CommConfig {
        self.config
    }

    /// The world's first failure this rank knows of, as `(rank, cause)`.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.state.borrow().failure.clone()
    }

    /// Sends opaque bytes to world rank `peer` on stream `tag` (result gathering); does not
    /// block.
    pub fn send_bytes(&self, peer: usize, tag: u64, bytes: Vec<u8>) -> Result<(), CommError> {
        let action = CommOp::Send { tag };
        self.check(action, &[bytes.len()])?;
        self.check_peer(peer, action)?;
        self.post_data(peer, Stream::Bytes(tag), action, &Payload::Bytes(bytes))
    }

    /// Receives the oldest bytes world rank `peer` sent on stream `tag`.
    pub fn recv_bytes(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CommError> {
        let action = CommOp::Recv { tag };
        self.check(action, &[])?;
        self.check_peer(peer, action)?;
        match self.wait(peer, Stream::Bytes(tag), action, &[])? {
            Payload::Bytes(b) => Ok(b),
            _ => Err(self.fail(self.data(action, format!("rank {peer} sent no bytes")))),
        }
    }

    fn data(&self, action: CommOp, reason: String) -> CommError {
        CommError::Data {
            rank: self.rank,
            action,
            reason,
        }
    }

    /// Records `err` as this world's failure (unless one is known already, whose consequence
    /// `err` then is) and tells every other rank; returns `err`.
    fn fail(&self, err: CommError) -> CommError {
        if !matches!(err, CommError::PeerFailed { .. }) {
            self.abort(&err.to_string());
        }
        err
    }

    /// Fails with [`CommError::PeerFailed`] once any rank is known to have failed.
    fn check(&self, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        self.progress();
        match &self.state.borrow().failure {
            Some((failed_rank, cause)) => Err(CommError::PeerFailed {
                rank: self.rank,
                action,
                shape: shape.to_vec(),
                failed_rank: *failed_rank,
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    fn check_peer(&self, peer: usize, action: CommOp) -> Result<(), CommError> {
        if peer < self.grid.world_size() {
            return Ok(());
        }
        Err(self.fail(CommError::InvalidArgument {
            rank: self.rank,
            action,
            reason: format!(
                "peer {peer} is not a rank of a world of {}",
                self.grid.world_size()
            ),
        }))
    }

    /// Starts a non-blocking send of `bytes` to world rank `peer`.
    fn post(&self, peer: usize, bytes: Vec<u8>) {
        let buf: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let raw: *mut [u8] = buf;
        // SAFETY: `raw` points to a leaked allocation that is only freed in `reap`/`drop` after
        // MPI has reported the request complete, and is never written meanwhile.
        let shared: &'static [u8] = unsafe { &*raw };
        let dest = i32::try_from(peer).unwrap_or(i32::MAX);
        let request =
            self.world
                .process_at_rank(dest)
                .immediate_send_with_tag(StaticScope, shared, MPI_TAG);
        self.state
            .borrow_mut()
            .pending
            .push(PendingSend { request, buf: raw });
    }

    fn post_data(
        &self,
        peer: usize,
        stream: Stream,
        op: CommOp,
        payload: &Payload,
    ) -> Result<(), CommError> {
        let bytes =
            wire::encode_data(stream, op, payload).map_err(|r| self.fail(self.data(op, r)))?;
        self.post(peer, bytes);
        Ok(())
    }

    /// Frees the buffers of completed sends.
    fn reap(&self) {
        let mut state = self.state.borrow_mut();
        let pending = std::mem::take(&mut state.pending);
        for p in pending {
            match p.request.test() {
                Ok(_) => {
                    // SAFETY: MPI is done with the buffer, leaked in `post` and freed once.
                    drop(unsafe { Box::from_raw(p.buf) });
                }
                Err(request) => state.pending.push(PendingSend {
                    request,
                    buf: p.buf,
                }),
            }
        }
    }

    /// Drains every message that has arrived into the inbox and completes finished sends.
    fn progress(&self) {
        self.reap();
        while let Some(found) = self
            .world
            .any_process()
            .immediate_matched_probe_with_tag(MPI_TAG)
        {
            let (bytes, status) = found.matched_receive_vec::<u8>();
            let src = usize::try_from(status.source_rank()).unwrap_or(usize::MAX);
            let mut state = self.state.borrow_mut();
            match wire::decode(&bytes) {
                Ok(Message::Data {
                    stream,
                    op,
                    payload,
                }) => state
                    .inbox
                    .entry((src, stream))
                    .or_default()
                    .push_back((op, payload)),
                Ok(Message::Abort { rank, cause }) => {
                    state.failure.get_or_insert((rank, cause));
                }
                Err(reason) => {
                    state.failure.get_or_insert((
                        src,
                        format!("rank {} received a malformed message: {reason}", self.rank),
                    ));
                }
            }
        }
    }

    /// Waits for the oldest message from `peer` on `stream`, until the timeout.
    fn wait(
        &self,
        peer: usize,
        stream: Stream,
        action: CommOp,
        shape: &[usize],
    ) -> Result<Payload, CommError> {
        let start = Instant::now();
        // Yield a little, then back off to short sleeps: messages usually arrive within
        // microseconds, but ranks share cores with compute, so a waiting rank must not spin
        // for long. The naps stay short because a message noticed late is pipeline time
        // lost: on the critical path every receive would add up to one nap.
        let mut polls = 0u32;
        let mut nap = Duration::from_micros(20);
        let max_nap = self.config.poll_interval.min(MAX_NAP);
        loop {
            self.check(action, shape)?;
            let found = self
                .state
                .borrow_mut()
                .inbox
                .get_mut(&(peer, stream))
                .and_then(VecDeque::pop_front);
            if let Some((op, payload)) = found {
                if let (Stream::Collective(_, seq), false) = (stream, op == action) {
                    return Err(self.fail(CommError::CollectiveMismatch {
                        rank: self.rank,
                        peer,
                        action,
                        peer_action: op,
                        seq,
                        peer_seq: seq,
                    }));
                }
                return Ok(payload);
            }
            let after = start.elapsed();
            if after >= self.config.timeout {
                return Err(self.fail(CommError::Timeout {
                    rank: self.rank,
                    peer,
                    action,
                    shape: shape.to_vec(),
                    after,
                    // A process cannot see what its peers are waiting on.
                    stalled: None,
                }));
            }
            polls += 1;
            if polls <= YIELDING_POLLS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(max_nap);
            }
        }
    }

    fn next_seq(&self, group: Group) -> u64 {
        let i = match group {
            Group::Pipeline => 0,
            Group::DataParallel => 1,
        };
        let mut state = self.state.borrow_mut();
        let seq = state.seq[i];
        state.seq[i] += 1;
        seq
    }

    fn read_host<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<HostBuf, CommError> {
        let data = tensor
            .try_into_data()
            .map_err(|e| self.fail(self.data(action, e.to_string())))?;
        HostBuf::from_data(data).map_err(|r| self.fail(self.data(action, r)))
    }

    fn build_tensor<const D: usize>(&self, data: TensorData) -> Tensor<B, D> {
        let dtype = data.dtype;
        Tensor::from_data(data, (&self.device, dtype))
    }

    fn expect_tensor(
        &self,
        payload: Payload,
        peer: usize,
        action: CommOp,
        shape: &[usize],
    ) -> Result<HostBuf, CommError> {
        let Payload::Tensor(buf) = payload else {
            return Err(self.fail(self.data(action, format!("rank {peer} sent no tensor"))));
        };
        if buf.shape != shape {
            return Err(self.fail(CommError::ShapeMismatch {
                rank: self.rank,
                peer,
                action,
                expected: shape.to_vec(),
                actual: buf.shape.clone(),
            }));
        }
        Ok(buf)
    }

    /// Sends this rank's contribution to every other member of `group` and returns all
    /// contributions in group-rank order with the members' world ranks.
    fn gather_contributions(
        &self,
        group: Group,
        action: CommOp,
        shape: &[usize],
        mine: HostBuf,
    ) -> Result<(Vec<HostBuf>, Vec<usize>), CommError> {
        let stream = Stream::Collective(group, self.next_seq(group));
        let members = self.group_members(group);
        let mine = Payload::Tensor(mine);
        for &m in members.iter().filter(|&&m| m != self.rank) {
            self.post_data(m, stream, action, &mine)?;
        }
        let Payload::Tensor(mine) = mine else {
            return Err(self.data(action, "own contribution lost".into()));
        };
        let mut parts = Vec::with_capacity(members.len());
        for &m in &members {
            if m == self.rank {
                parts.push(mine.clone());
            } else {
                let payload = self.wait(m, stream, action, shape)?;
                parts.push(self.expect_tensor(payload, m, action, shape)?);
            }
        }
        Ok((parts, members))
    }

    fn reduce<const D: usize, const DO: usize>(
        &self,
        group: Group,
        action: CommOp,
        tensor: Tensor<B, D>,
        op: ReduceOp,
        range: std::ops::Range<usize>,
        out_shape: Vec<usize>,
    ) -> Result<Tensor<B, DO>, CommError> {
        let shape = tensor.dims().to_vec();
        let mine = self.read_host(tensor, action)?;
        let (parts, members) = self.gather_contributions(group, action, &shape, mine)?;
        let refs: Vec<&HostBuf> = parts.iter().collect();
        let out = host::reduce(&refs, range, op, out_shape).map_err(|(i, reason)| {
            self.fail(self.data(action, format!("rank {}: {reason}", members[i])))
        })?;
        Ok(self.build_tensor(out.into_data()))
    }
}

impl<B: Backend> Communicator<B> for MpiComm<B> {
    fn grid(&self) -> RankGrid {
        self.grid
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn device(&self) -> &B::Device {
        &self.device
    }

    fn send<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        tensor: Tensor<B, D>,
    ) -> Result<(), CommError> {
        let action = CommOp::Send { tag };
        let shape = tensor.dims().to_vec();
        self.check(action, &shape)?;
        self.check_peer(peer, action)?;
        let buf = self.read_host(tensor, action)?;
        self.post_data(peer, Stream::P2p(tag), action, &Payload::Tensor(buf))
    }

    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
    ) -> Result<Tensor<B, D>, CommError> {
        let action = CommOp::Recv { tag };
        self.check(action, &shape)?;
        self.check_peer(peer, action)?;
        // A message's `op` is the sender's `Send`; p2p streams are matched by tag alone.
        let payload = self.wait(peer, Stream::P2p(tag), action, &shape)?;
        let buf = self.expect_tensor(payload, peer, action, &shape)?;
        Ok(self.build_tensor(buf.into_data()))
    }

    fn all_gather(&self, group: Group, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let action = CommOp::AllGather(group);
        let shape = shard.dims().to_vec();
        self.check(action, &shape)?;
        if self.group_size(group) == 1 {
            self.next_seq(group);
            return Ok(shard);
        }
        let mine = self.read_host(shard, action)?;
        let (parts, members) = self.gather_contributions(group, action, &shape, mine)?;
        let refs: Vec<&HostBuf> = parts.iter().collect();
        let out = host::concat(&refs).map_err(|(i, reason)| {
            self.fail(self.data(action, format!("rank {}: {reason}", members[i])))
        })?;
        Ok(self.build_tensor(out.into_data()))
    }

    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let action = CommOp::ReduceScatter(group, op);
        let [len] = tensor.dims();
        self.check(action, &[len])?;
        let size = self.group_size(group);
        if len % size != 0 {
            return Err(self.fail(CommError::InvalidArgument {
                rank: self.rank,
                action,
                reason: format!("length {len} is not divisible by the group size {size}"),
            }));
        }
        if size == 1 {
            self.next_seq(group);
            return Ok(tensor);
        }
        let chunk = len / size;
        let start = self.group_rank(group) * chunk;
        self.reduce(group, action, tensor, op, start..start + chunk, vec![chunk])
    }

    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError> {
        let action = CommOp::AllReduce(group, op);
        let shape = tensor.dims().to_vec();
        self.check(action, &shape)?;
        if self.group_size(group) == 1 {
            self.next_seq(group);
            return Ok(tensor);
        }
        let len = shape.iter().product();
        self.reduce(group, action, tensor, op, 0..len, shape)
    }

    fn broadcast<const D: usize>(
        &self,
        group: Group,
        root: usize,
        tensor: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, CommError> {
        let action = CommOp::Broadcast(group, root);
        let shape = tensor.dims().to_vec();
        self.check(action, &shape)?;
        let members = self.group_members(group);
        let Some(&root_rank) = members.get(root) else {
            return Err(self.fail(CommError::InvalidArgument {
                rank: self.rank,
                action,
                reason: format!(
                    "root {root} is not a member of a group of {}",
                    members.len()
                ),
            }));
        };
        let stream = Stream::Collective(group, self.next_seq(group));
        if root_rank == self.rank {
            if members.len() > 1 {
                let mine = Payload::Tensor(self.read_host(tensor.clone(), action)?);
                for &m in members.iter().filter(|&&m| m != self.rank) {
                    self.post_data(m, stream, action, &mine)?;
                }
            }
            return Ok(tensor);
        }
        let payload = self.wait(root_rank, stream, action, &shape)?;
        let buf = self.expect_tensor(payload, root_rank, action, &shape)?;
        Ok(self.build_tensor(buf.into_data()))
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        let action = CommOp::Barrier(group);
        self.check(action, &[])?;
        let stream = Stream::Collective(group, self.next_seq(group));
        let others: Vec<usize> = self
            .group_members(group)
            .into_iter()
            .filter(|&r| r != self.rank)
            .collect();
        for &m in &others {
            self.post_data(m, stream, action, &Payload::Empty)?;
        }
        for &m in &others {
            self.wait(m, stream, action, &[])?;
        }
        Ok(())
    }

    fn abort(&self, cause: &str) {
        {
            let mut state = self.state.borrow_mut();
            if state.failure.is_some() {
                return;
            }
            state.failure = Some((self.rank, cause.to_string()));
        }
        for peer in (0..self.grid.world_size()).filter(|&p| p != self.rank) {
            self.post(peer, wire::encode_abort(self.rank, cause));
        }
    }
}

impl<B: Backend> Drop for MpiComm<B> {
    fn drop(&mut self) {
        // Abort notices must leave before this process exits, and MPI must not be finalised
        // (nor a request dropped, which aborts the process) while sends are in flight.
        let start = Instant::now();
        while !self.state.borrow().pending.is_empty() && start.elapsed() < FLUSH_LIMIT {
            self.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
        // Sends no peer ever took (it died): leak them rather than abort the process.
        for p in std::mem::take(&mut self.state.borrow_mut().pending) {
            std::mem::forget(p.request);
        }
    }
}

/// Process ranks can layer `NcclComm` on an `MpiComm` (`NcclComm::over_host`): the call
/// agreement before each NCCL call is a small all-gather over MPI.
#[cfg(feature = "cuda")]
impl<B: Backend> super::NcclHost<B> for MpiComm<B> {
    fn agree(&self, group: Group, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        super::agree_by_all_gather(self, group, action, shape)
    }
    fn fail(&self, err: CommError) -> CommError {
        MpiComm::fail(self, err)
    }
    fn config(&self) -> CommConfig {
        MpiComm::config(self)
    }
}
