//! Collectives in two halves: [`Communicator::start`] hands this rank's contribution to the
//! other members and returns at once; [`Communicator::finish`] waits for theirs and combines.
//!
//! Between the two the rank computes, so the wait for the slowest replica (and on a network,
//! the transfer) overlaps its own work instead of stalling it: the engine starts a stage's
//! all-gather where the lowered list says `UNSHARD` and finishes it before the stage's next
//! compute, and finishes each `REDUCE_GRAD` when the next one starts or, for the step's last,
//! before the optimizer step.
//!
//! Only *when* a rank waits changes: the contributions and the group-rank-ordered reduction
//! are the same, so results are bitwise those of the blocking calls. Finishing later never
//! deadlocks a program whose blocking form does not: every contribution is posted no later
//! than before, and a wait only moves further along the rank's own program.
//!
//! # Bandwidth
//!
//! The host collectives send what a ring would, and no more. With `d` members and an input
//! of `N` elements per member (a shard of `N / d` for the all-gather):
//!
//! * **all-gather**: each member sends its shard to every other member, `(d − 1)/d · N`;
//! * **reduce-scatter**: the input is cut into `d` chunks and each member sends chunk `j` to
//!   member `j` only, `(d − 1)/d · N`; member `j` sums chunk `j` of every member's input;
//! * **all-reduce**: a reduce-scatter, then an all-gather of the reduced chunks,
//!   `2 (d − 1)/d · N`.
//!
//! Unlike a ring, whose partial sums travel around the members, every chunk is summed where
//! it ends up, in group-rank order (`((x0 + x1) + x2) + …`): results are bitwise the same on
//! every member, in every run, and on every transport, as the whole-buffer exchange was.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::host::{self, HostBuf};
use super::{CommError, CommOp, Communicator, Group, RankGrid, ReduceOp};

/// A 1-D collective that can be started before its result is needed (see the
/// [module docs](self)): the data-parallel collectives of the engine.
#[derive(Debug, Clone)]
pub enum Collective<B: Backend> {
    /// [`Communicator::all_gather`] of `shard`.
    AllGather {
        /// The group it runs over.
        group: Group,
        /// This member's shard.
        shard: Tensor<B, 1>,
    },
    /// [`Communicator::reduce_scatter`] of `tensor`.
    ReduceScatter {
        /// The group it runs over.
        group: Group,
        /// This member's full-length contribution.
        tensor: Tensor<B, 1>,
        /// How contributions combine.
        op: ReduceOp,
    },
    /// [`Communicator::all_reduce`] of a 1-D `tensor`.
    AllReduce {
        /// The group it runs over.
        group: Group,
        /// This member's contribution.
        tensor: Tensor<B, 1>,
        /// How contributions combine.
        op: ReduceOp,
    },
}

impl<B: Backend> Collective<B> {
    /// The group it runs over.
    pub fn group(&self) -> Group {
        match self {
            Collective::AllGather { group, .. }
            | Collective::ReduceScatter { group, .. }
            | Collective::AllReduce { group, .. } => *group,
        }
    }

    /// The call, as errors name it.
    pub fn op(&self) -> CommOp {
        match self {
            Collective::AllGather { group, .. } => CommOp::AllGather(*group),
            Collective::ReduceScatter { group, op, .. } => CommOp::ReduceScatter(*group, *op),
            Collective::AllReduce { group, op, .. } => CommOp::AllReduce(*group, *op),
        }
    }

    /// Shape of this member's input.
    pub fn input_dims(&self) -> Vec<usize> {
        match self {
            Collective::AllGather { shard: t, .. }
            | Collective::ReduceScatter { tensor: t, .. }
            | Collective::AllReduce { tensor: t, .. } => t.dims().to_vec(),
        }
    }

    /// Runs it to completion with `comm`'s blocking call.
    pub fn run<C: Communicator<B> + ?Sized>(self, comm: &C) -> Result<Tensor<B, 1>, CommError> {
        match self {
            Collective::AllGather { group, shard } => comm.all_gather(group, shard),
            Collective::ReduceScatter { group, tensor, op } => {
                comm.reduce_scatter(group, tensor, op)
            }
            Collective::AllReduce { group, tensor, op } => comm.all_reduce(group, tensor, op),
        }
    }

    /// What a member of `rank`'s group exchanges and how it combines the contributions;
    /// [`Exchange::Trivial`] for a group of one. Fails with the reason when the input cannot
    /// be split over the group.
    pub(crate) fn plan(self, grid: RankGrid) -> Result<Exchange<B>, String> {
        let group = self.group();
        let size = grid.group_size(group);
        let (tensor, plan) = match self {
            Collective::AllGather { shard, .. } => (shard, Plan::Gather),
            Collective::ReduceScatter { tensor, op, .. } => {
                let [len] = tensor.dims();
                if len % size != 0 {
                    return Err(format!(
                        "length {len} is not divisible by the group size {size}"
                    ));
                }
                let plan = Plan::Scatter {
                    op,
                    bounds: chunk_bounds(len, size),
                    then_gather: false,
                };
                (tensor, plan)
            }
            Collective::AllReduce { tensor, op, .. } => {
                let [len] = tensor.dims();
                let plan = Plan::Scatter {
                    op,
                    bounds: chunk_bounds(len, size),
                    then_gather: true,
                };
                (tensor, plan)
            }
        };
        // One member: a gather or a sum of one is the input, and x / 1 == x exactly.
        Ok(if size == 1 {
            Exchange::Trivial(tensor)
        } else {
            Exchange::Members(tensor, plan)
        })
    }
}

/// What [`Collective::plan`] found a member has to do.
pub(crate) enum Exchange<B: Backend> {
    /// Nothing: the group has one member, whose input is the result.
    Trivial(Tensor<B, 1>),
    /// Exchange parts of the tensor with the other members as the plan says.
    Members(Tensor<B, 1>, Plan),
}

/// How the members of a host collective exchange their inputs (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Every member sends its whole input to every other; the result is the inputs
    /// concatenated in group-rank order.
    Gather,
    /// Member `j` receives elements `bounds[j]` of every member's input and reduces them in
    /// group-rank order; with `then_gather` the reduced chunks are then gathered, so that
    /// every member gets the whole reduction (an all-reduce).
    Scatter {
        op: ReduceOp,
        bounds: Vec<Range<usize>>,
        then_gather: bool,
    },
}

impl Plan {
    /// The elements of a member's `len`-element input that go to group member `j`.
    fn range_for(&self, j: usize, len: usize) -> Range<usize> {
        match self {
            Plan::Gather => 0..len,
            Plan::Scatter { bounds, .. } => bounds.get(j).cloned().unwrap_or(0..0),
        }
    }
}

/// `len` elements cut into `members` contiguous chunks in group-rank order: equal, the
/// first `len % members` one element longer.
pub(crate) fn chunk_bounds(len: usize, members: usize) -> Vec<Range<usize>> {
    let members = members.max(1);
    let (base, longer) = (len / members, len % members);
    let mut start = 0;
    (0..members)
        .map(|j| {
            let end = start + base + usize::from(j < longer);
            let range = start..end;
            start = end;
            range
        })
        .collect()
}

/// Which message of a host collective a part is: collective `seq` of `group` (`action`),
/// `round` 0 (the inputs' parts) or 1 (an all-reduce's reduced chunks), from a member whose
/// input had shape `shape`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PartKey {
    pub(crate) group: Group,
    pub(crate) action: CommOp,
    pub(crate) seq: u64,
    pub(crate) round: u8,
    pub(crate) shape: Vec<usize>,
}

/// A part received from another member: elements `range` of its contribution `buf`, whose
/// input had shape `shape`.
#[derive(Debug, Clone)]
pub(crate) struct ReceivedPart {
    pub(crate) shape: Vec<usize>,
    pub(crate) buf: Arc<HostBuf>,
    pub(crate) range: Range<usize>,
}

/// A collective this rank has posted its contribution to and not yet finished.
#[derive(Debug)]
pub(crate) struct Posted {
    /// World rank of the member that posted it.
    pub(crate) rank: usize,
    pub(crate) group: Group,
    pub(crate) action: CommOp,
    /// Shape of every member's contribution.
    pub(crate) shape: Vec<usize>,
    /// The collective's index on `group`.
    pub(crate) seq: u64,
    pub(crate) mine: Arc<HostBuf>,
    pub(crate) plan: Plan,
}

impl Posted {
    fn key(&self, round: u8) -> PartKey {
        PartKey {
            group: self.group,
            action: self.action,
            seq: self.seq,
            round,
            shape: self.shape.clone(),
        }
    }
}

/// A collective returned by [`Communicator::start`]; [`Communicator::finish`] on the same
/// communicator turns it into its result. Every member must finish the collectives it started
/// on a group in the order it started them.
#[must_use = "a started collective must be finished, or its peers' contributions wait forever"]
#[derive(Debug)]
pub struct Pending<B: Backend> {
    state: State<B>,
}

#[derive(Debug)]
enum State<B: Backend> {
    Done(Tensor<B, 1>),
    Posted(Posted),
    // Only the `cuda` feature's `NcclComm` launches calls.
    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
    Launched(Ticket),
}

/// A collective a device communicator launched on its own stream and keeps until it is
/// finished (`NcclComm`): the pending handle carries only which call it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    /// World rank of the member that launched it.
    pub(crate) rank: usize,
    pub(crate) group: Group,
    pub(crate) action: CommOp,
    /// The call's number among those its communicator launched.
    pub(crate) id: u64,
}

/// What a [`Pending`] that did not complete at start still waits for.
#[derive(Debug)]
pub(crate) enum Unfinished {
    /// Peers' parts of a host-side collective.
    Posted(Posted),
    /// A call on a device communicator's stream.
    Launched(Ticket),
}

impl Unfinished {
    /// World rank of the member that started it.
    pub(crate) fn rank(&self) -> usize {
        match self {
            Unfinished::Posted(p) => p.rank,
            Unfinished::Launched(t) => t.rank,
        }
    }

    /// The call, as errors name it.
    pub(crate) fn action(&self) -> CommOp {
        match self {
            Unfinished::Posted(p) => p.action,
            Unfinished::Launched(t) => t.action,
        }
    }
}

impl<B: Backend> Pending<B> {
    /// A collective that already completed with `result`.
    pub fn done(result: Tensor<B, 1>) -> Self {
        Pending {
            state: State::Done(result),
        }
    }

    pub(crate) fn posted(posted: Posted) -> Self {
        Pending {
            state: State::Posted(posted),
        }
    }

    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
    pub(crate) fn launched(ticket: Ticket) -> Self {
        Pending {
            state: State::Launched(ticket),
        }
    }

    /// Whether the result is still to be waited for (false when the call completed at start:
    /// a group of one, or a communicator that does not overlap).
    pub fn in_flight(&self) -> bool {
        !matches!(self.state, State::Done(_))
    }

    /// The result, or what is still to be waited for.
    pub(crate) fn into_state(self) -> Result<Tensor<B, 1>, Unfinished> {
        match self.state {
            State::Done(t) => Ok(t),
            State::Posted(p) => Err(Unfinished::Posted(p)),
            State::Launched(t) => Err(Unfinished::Launched(t)),
        }
    }
}

/// Hands an unfinished collective back as the handle it came from, so that a layered
/// communicator (`NcclComm`) can pass what is not its own to the communicator below.
impl<B: Backend> From<Unfinished> for Pending<B> {
    fn from(unfinished: Unfinished) -> Self {
        Pending {
            state: match unfinished {
                Unfinished::Posted(p) => State::Posted(p),
                Unfinished::Launched(t) => State::Launched(t),
            },
        }
    }
}

/// Why a collective started by another communicator (another rank's, or one of another
/// kind) cannot be finished here.
fn not_started_here(unfinished: &Unfinished) -> String {
    format!(
        "this collective was started by rank {}'s {} communicator; finish it on the \
         communicator that started it",
        unfinished.rank(),
        match unfinished {
            Unfinished::Posted(_) => "host",
            Unfinished::Launched(_) => "device (NCCL)",
        }
    )
}

/// The host-side communicators' transport of collective parts, from which [`begin`],
/// [`start`], [`finish`] and [`all_reduce`] build their collectives (`LocalComm` and
/// `ProcessComm` share them).
pub(crate) trait PostAndCollect<B: Backend>: Communicator<B> {
    /// Whether [`Communicator::start`] should return before the peers' parts arrive
    /// ([`super::CommConfig::overlap_collectives`]).
    fn overlaps(&self) -> bool;
    /// Fails when the world has failed (a call about to be made, with its input shape).
    fn check_call(&self, action: CommOp, shape: &[usize]) -> Result<(), CommError>;
    /// The index of the next collective on `group`; every member counts alike, also the
    /// collectives that need no messages.
    fn next_seq(&self, group: Group) -> u64;
    /// Records `err` as this rank's failure (aborting the world) and returns it.
    fn fail_call(&self, err: CommError) -> CommError;
    /// Reads a contribution into host memory.
    fn read_part<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<Arc<HostBuf>, CommError>;
    /// Sends elements `range` of `mine` to world rank `peer` as the part `key` names, and
    /// counts them among the bytes sent on `key.group`. Never blocks.
    fn send_part(
        &self,
        peer: usize,
        key: &PartKey,
        mine: &Arc<HostBuf>,
        range: Range<usize>,
    ) -> Result<(), CommError>;
    /// Waits for the part `key` names from world rank `peer`.
    fn receive_part(&self, peer: usize, key: &PartKey) -> Result<ReceivedPart, CommError>;
    /// The collectives started here and not finished yet.
    fn start_order(&self) -> &StartOrder;
}

/// The collectives a host communicator has started and not finished, per group, oldest
/// first: every member must finish a group's collectives in the order it started them (as
/// NCCL requires), and a host communicator refuses the same misuse a device one would.
#[derive(Debug, Default)]
pub(crate) struct StartOrder(std::cell::RefCell<[std::collections::VecDeque<u64>; 2]>);

impl StartOrder {
    fn slot(group: Group) -> usize {
        match group {
            Group::Pipeline => 0,
            Group::DataParallel => 1,
        }
    }

    /// Notes collective `seq` of `group` as started.
    fn started(&self, group: Group, seq: u64) {
        self.0.borrow_mut()[Self::slot(group)].push_back(seq);
    }

    /// Takes collective `seq` of `group` off the list; fails with the reason when an older
    /// collective of the group is still unfinished.
    fn finishing(&self, group: Group, seq: u64) -> Result<(), String> {
        let mut order = self.0.borrow_mut();
        let list = &mut order[Self::slot(group)];
        match list.front() {
            Some(&oldest) if oldest != seq => Err(format!(
                "collective #{seq} on the {group} is finished before collective #{oldest},                  which started first: finish a group's collectives in the order they started"
            )),
            Some(_) => {
                list.pop_front();
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// Posts `tensor` as this rank's part of the next collective on `group`: round 0 of `plan`.
fn post<B: Backend, C: PostAndCollect<B>, const D: usize>(
    comm: &C,
    group: Group,
    action: CommOp,
    tensor: Tensor<B, D>,
    plan: Plan,
) -> Result<Posted, CommError> {
    let shape = tensor.dims().to_vec();
    let mine = comm.read_part(tensor, action)?;
    let posted = Posted {
        rank: comm.rank(),
        group,
        action,
        shape,
        seq: comm.next_seq(group),
        mine,
        plan,
    };
    let key = posted.key(0);
    let len = posted.mine.len();
    for (j, member) in comm.group_members(group).into_iter().enumerate() {
        if member != posted.rank {
            let range = posted.plan.range_for(j, len);
            comm.send_part(member, &key, &posted.mine, range)?;
        }
    }
    Ok(posted)
}

/// Waits for the part of round `round` of `posted` from every other member and returns the
/// parts of every member in group-rank order, `own` standing for this member's.
fn gather_round<B: Backend, C: PostAndCollect<B>>(
    comm: &C,
    posted: &Posted,
    round: u8,
    own: ReceivedPart,
    expected_len: impl Fn(usize) -> usize,
) -> Result<Vec<ReceivedPart>, CommError> {
    let (rank, action) = (comm.rank(), posted.action);
    let key = posted.key(round);
    let mut own = Some(own);
    let mut parts = Vec::new();
    for (j, member) in comm.group_members(posted.group).into_iter().enumerate() {
        let part = if member == rank {
            own.take().ok_or_else(|| {
                comm.fail_call(CommError::Data {
                    rank,
                    action,
                    reason: "this rank appears twice in its group".into(),
                })
            })?
        } else {
            comm.receive_part(member, &key)?
        };
        // Every member's input has one shape: element-wise reductions and equal shards.
        if part.shape != posted.shape {
            return Err(comm.fail_call(CommError::ShapeMismatch {
                rank,
                peer: member,
                action,
                expected: posted.shape.clone(),
                actual: part.shape,
            }));
        }
        if part.range.len() != expected_len(j) || part.range.end > part.buf.len() {
            return Err(comm.fail_call(CommError::Data {
                rank,
                action,
                reason: format!(
                    "rank {member} sent {} elements where {} were expected",
                    part.range.len(),
                    expected_len(j)
                ),
            }));
        }
        parts.push(part);
    }
    Ok(parts)
}

/// Combines `parts` (group-rank order) with `combine`, naming the member at fault on error.
fn combine<B: Backend, C: PostAndCollect<B>>(
    comm: &C,
    posted: &Posted,
    parts: &[ReceivedPart],
    combine: impl FnOnce(&[host::Part<'_>]) -> Result<HostBuf, (usize, String)>,
) -> Result<HostBuf, CommError> {
    let views: Vec<host::Part<'_>> = parts
        .iter()
        .map(|p| host::Part {
            buf: &p.buf,
            range: &p.range,
        })
        .collect();
    let members = comm.group_members(posted.group);
    combine(&views).map_err(|(i, reason)| {
        comm.fail_call(CommError::Data {
            rank: comm.rank(),
            action: posted.action,
            reason: format!(
                "rank {}: {reason}",
                members.get(i).copied().unwrap_or(usize::MAX)
            ),
        })
    })
}

/// Waits for the other members' parts of `posted` and combines them as its plan says.
fn complete<B: Backend, C: PostAndCollect<B>, const D: usize>(
    comm: &C,
    posted: Posted,
) -> Result<Tensor<B, D>, CommError> {
    let len = posted.mine.len();
    let me = comm.group_rank(posted.group);
    let own = ReceivedPart {
        shape: posted.shape.clone(),
        buf: Arc::clone(&posted.mine),
        range: posted.plan.range_for(me, len),
    };
    let out = match &posted.plan {
        Plan::Gather => {
            let parts = gather_round(comm, &posted, 0, own, |_| len)?;
            let total = len * parts.len();
            combine(comm, &posted, &parts, |views| {
                host::concat(views, vec![total])
            })?
        }
        Plan::Scatter {
            op,
            bounds,
            then_gather,
        } => {
            let chunk = bounds.get(me).map_or(0, Range::len);
            let parts = gather_round(comm, &posted, 0, own, |_| chunk)?;
            let reduced = combine(comm, &posted, &parts, |views| {
                host::reduce(views, *op, vec![chunk])
            })?;
            if !*then_gather {
                reduced
            } else {
                // Round 1: every member's reduced chunk to every other member.
                let reduced = Arc::new(reduced);
                let key = posted.key(1);
                for member in comm.group_members(posted.group) {
                    if member != posted.rank {
                        comm.send_part(member, &key, &reduced, 0..chunk)?;
                    }
                }
                let own = ReceivedPart {
                    shape: posted.shape.clone(),
                    buf: reduced,
                    range: 0..chunk,
                };
                let parts = gather_round(comm, &posted, 1, own, |j| {
                    bounds.get(j).map_or(0, Range::len)
                })?;
                combine(comm, &posted, &parts, |views| {
                    host::concat(views, posted.shape.clone())
                })?
            }
        }
    }
    .into_data();
    let dtype = out.dtype;
    Ok(Tensor::from_data(out, (comm.device(), dtype)))
}

/// Posts this rank's part of `collective` (or completes it at once for a group of one).
pub(crate) fn begin<B: Backend, C: PostAndCollect<B>>(
    comm: &C,
    collective: Collective<B>,
) -> Result<Pending<B>, CommError> {
    let (group, action) = (collective.group(), collective.op());
    let shape = collective.input_dims();
    comm.check_call(action, &shape)?;
    match collective.plan(comm.grid()) {
        Err(reason) => Err(comm.fail_call(CommError::InvalidArgument {
            rank: comm.rank(),
            action,
            reason,
        })),
        Ok(Exchange::Trivial(result)) => {
            comm.next_seq(group);
            Ok(Pending::done(result))
        }
        Ok(Exchange::Members(tensor, plan)) => {
            let posted = post(comm, group, action, tensor, plan)?;
            comm.start_order().started(group, posted.seq);
            Ok(Pending::posted(posted))
        }
    }
}

/// [`Communicator::start`] of a host-side communicator: [`begin`], and the wait too unless
/// it overlaps.
pub(crate) fn start<B: Backend, C: PostAndCollect<B>>(
    comm: &C,
    collective: Collective<B>,
) -> Result<Pending<B>, CommError> {
    let pending = begin(comm, collective)?;
    if comm.overlaps() {
        Ok(pending)
    } else {
        finish(comm, pending).map(Pending::done)
    }
}

/// [`Communicator::finish`] of a host-side communicator.
pub(crate) fn finish<B: Backend, C: PostAndCollect<B>>(
    comm: &C,
    pending: Pending<B>,
) -> Result<Tensor<B, 1>, CommError> {
    match pending.into_state() {
        Ok(result) => Ok(result),
        Err(Unfinished::Posted(posted)) if posted.rank == comm.rank() => {
            let order = comm.start_order().finishing(posted.group, posted.seq);
            order.map_err(|reason| {
                comm.fail_call(CommError::InvalidArgument {
                    rank: comm.rank(),
                    action: posted.action,
                    reason,
                })
            })?;
            complete(comm, posted)
        }
        Err(other) => Err(comm.fail_call(CommError::InvalidArgument {
            rank: comm.rank(),
            action: other.action(),
            reason: not_started_here(&other),
        })),
    }
}

/// [`Communicator::all_reduce`] of a host-side communicator, for tensors of any rank.
pub(crate) fn all_reduce<B: Backend, C: PostAndCollect<B>, const D: usize>(
    comm: &C,
    group: Group,
    tensor: Tensor<B, D>,
    op: ReduceOp,
) -> Result<Tensor<B, D>, CommError> {
    let action = CommOp::AllReduce(group, op);
    let shape = tensor.dims().to_vec();
    comm.check_call(action, &shape)?;
    let size = comm.group_size(group);
    if size == 1 {
        comm.next_seq(group);
        return Ok(tensor);
    }
    let plan = Plan::Scatter {
        op,
        bounds: chunk_bounds(shape.iter().product(), size),
        then_gather: true,
    };
    complete(comm, post(comm, group, action, tensor, plan)?)
}

#[cfg(test)]
mod tests {
    use super::chunk_bounds;

    #[test]
    fn chunks_cover_the_buffer_in_order_and_differ_by_at_most_one() {
        assert_eq!(chunk_bounds(12, 3), vec![0..4, 4..8, 8..12]);
        assert_eq!(chunk_bounds(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(chunk_bounds(2, 3), vec![0..1, 1..2, 2..2]);
    }
}
