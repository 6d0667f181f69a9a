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
    pub(crate) fn plan(self, grid: RankGrid, rank: usize) -> Result<Exchange<B>, String> {
        let group = self.group();
        let size = grid.group_size(group);
        let (tensor, combine) = match self {
            Collective::AllGather { shard, .. } => (shard, Combine::Concat),
            Collective::ReduceScatter { tensor, op, .. } => {
                let [len] = tensor.dims();
                if len % size != 0 {
                    return Err(format!(
                        "length {len} is not divisible by the group size {size}"
                    ));
                }
                let chunk = len / size;
                let start = grid.group_rank(rank, group) * chunk;
                let combine = Combine::Reduce {
                    op,
                    range: start..start + chunk,
                    out_shape: vec![chunk],
                };
                (tensor, combine)
            }
            Collective::AllReduce { tensor, op, .. } => {
                let [len] = tensor.dims();
                let combine = Combine::Reduce {
                    op,
                    range: 0..len,
                    out_shape: vec![len],
                };
                (tensor, combine)
            }
        };
        // One member: a gather or a sum of one is the input, and x / 1 == x exactly.
        Ok(if size == 1 {
            Exchange::Trivial(tensor)
        } else {
            Exchange::Members(tensor, combine)
        })
    }
}

/// What [`Collective::plan`] found a member has to do.
pub(crate) enum Exchange<B: Backend> {
    /// Nothing: the group has one member, whose input is the result.
    Trivial(Tensor<B, 1>),
    /// Exchange the tensor with the other members and combine the contributions so.
    Members(Tensor<B, 1>, Combine),
}

/// How the members' contributions become this member's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Combine {
    /// Concatenated in group-rank order.
    Concat,
    /// Reduced element-wise in group-rank order; only elements `range` are kept, in
    /// `out_shape`.
    Reduce {
        op: ReduceOp,
        range: Range<usize>,
        out_shape: Vec<usize>,
    },
}

impl Combine {
    /// Combines `parts` (group-rank order); on failure, the index of the part at fault.
    pub(crate) fn apply(&self, parts: &[&HostBuf]) -> Result<HostBuf, (usize, String)> {
        match self {
            Combine::Concat => host::concat(parts),
            Combine::Reduce {
                op,
                range,
                out_shape,
            } => host::reduce(parts, range.clone(), *op, out_shape.clone()),
        }
    }
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
    pub(crate) combine: Combine,
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
    /// Counts a collective that needs no messages, so that the members stay in step.
    fn skip_seq(&self, group: Group);
    /// Records `err` as this rank's failure (aborting the world) and returns it.
    fn fail_call(&self, err: CommError) -> CommError;
    /// Reads a contribution into host memory.
    fn read_part<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        action: CommOp,
    ) -> Result<Arc<HostBuf>, CommError>;
    /// Sends `mine` to the other members of `group` as this rank's part of the group's next
    /// collective; returns that collective's index. Never blocks.
    fn send_part(
        &self,
        group: Group,
        action: CommOp,
        shape: &[usize],
        mine: &Arc<HostBuf>,
    ) -> Result<u64, CommError>;
    /// Waits for the other members' parts of `posted`; returns them in group-rank order, each
    /// with the world rank it came from.
    fn receive_parts(&self, posted: &Posted) -> Result<Vec<(usize, Arc<HostBuf>)>, CommError>;
}

/// Posts `tensor` as this rank's part of the next collective on `group`.
fn post<B: Backend, C: PostAndCollect<B>, const D: usize>(
    comm: &C,
    group: Group,
    action: CommOp,
    tensor: Tensor<B, D>,
    combine: Combine,
) -> Result<Posted, CommError> {
    let shape = tensor.dims().to_vec();
    let mine = comm.read_part(tensor, action)?;
    let seq = comm.send_part(group, action, &shape, &mine)?;
    Ok(Posted {
        rank: comm.rank(),
        group,
        action,
        shape,
        seq,
        mine,
        combine,
    })
}

/// Waits for the other members' parts of `posted` and combines all parts in group-rank order.
fn complete<B: Backend, C: PostAndCollect<B>, const D: usize>(
    comm: &C,
    posted: Posted,
) -> Result<Tensor<B, D>, CommError> {
    let (rank, action) = (comm.rank(), posted.action);
    let data_error = |reason: String| {
        comm.fail_call(CommError::Data {
            rank,
            action,
            reason,
        })
    };
    let members = comm.group_members(posted.group);
    let mut theirs = comm.receive_parts(&posted)?.into_iter();
    let mut parts = Vec::with_capacity(members.len());
    for &member in &members {
        let part = if member == rank {
            Arc::clone(&posted.mine)
        } else {
            match theirs.next() {
                Some((src, part)) if src == member => part,
                _ => return Err(data_error(format!("no contribution from rank {member}"))),
            }
        };
        // Every collective combines element-wise or concatenates equal shards.
        if part.shape != posted.shape {
            return Err(comm.fail_call(CommError::ShapeMismatch {
                rank,
                peer: member,
                action,
                expected: posted.shape.clone(),
                actual: part.shape.clone(),
            }));
        }
        parts.push(part);
    }
    let refs: Vec<&HostBuf> = parts.iter().map(|p| p.as_ref()).collect();
    let out = posted
        .combine
        .apply(&refs)
        .map_err(|(i, reason)| data_error(format!("rank {}: {reason}", members[i])))?
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
    match collective.plan(comm.grid(), comm.rank()) {
        Err(reason) => Err(comm.fail_call(CommError::InvalidArgument {
            rank: comm.rank(),
            action,
            reason,
        })),
        Ok(Exchange::Trivial(result)) => {
            comm.skip_seq(group);
            Ok(Pending::done(result))
        }
        Ok(Exchange::Members(tensor, combine)) => {
            Ok(Pending::posted(post(comm, group, action, tensor, combine)?))
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
        Err(Unfinished::Posted(posted)) if posted.rank == comm.rank() => complete(comm, posted),
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
    if comm.group_size(group) == 1 {
        comm.skip_seq(group);
        return Ok(tensor);
    }
    let combine = Combine::Reduce {
        op,
        range: 0..shape.iter().product(),
        out_shape: shape,
    };
    complete(comm, post(comm, group, action, tensor, combine)?)
}
