//! The [`Communicator`] operations of a [`ProcessComm`], and [`ProcessRank`]: each call as
//! messages to the other members, waits on their messages, and reductions on the host in
//! group-rank order.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use super::super::pending::{self, Collective, Pending};
use super::super::wire::{self, Payload, Stream};
use super::super::{CommError, CommOp, Communicator, Group, RankGrid, ReduceOp};
use super::{ProcessComm, Transport};

/// A rank that is one process of its world ([`ProcessComm`], or an `NcclComm` layered on
/// one): besides tensors it ships opaque bytes, with which a process world
/// ([`crate::engine::Trainer::in_process`]) gathers every rank's results on world rank 0.
pub trait ProcessRank<B: Backend>: Communicator<B> {
    /// Sends opaque bytes to world rank `peer` on stream `tag`; does not block.
    fn send_bytes(&self, peer: usize, tag: u64, bytes: Vec<u8>) -> Result<(), CommError>;
    /// Receives the oldest bytes world rank `peer` sent on stream `tag`.
    fn recv_bytes(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CommError>;
}

impl<B: Backend, T: Transport> ProcessRank<B> for ProcessComm<B, T> {
    fn send_bytes(&self, peer: usize, tag: u64, bytes: Vec<u8>) -> Result<(), CommError> {
        let action = CommOp::Send { tag };
        self.check(action, &[bytes.len()])?;
        self.check_peer(peer, action)?;
        self.post_data(peer, Stream::Bytes(tag), action, Payload::Bytes(bytes))
    }

    fn recv_bytes(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CommError> {
        let action = CommOp::Recv { tag };
        self.check(action, &[])?;
        self.check_peer(peer, action)?;
        match self.wait(peer, Stream::Bytes(tag), action, &[])? {
            Payload::Bytes(b) => Ok(b),
            _ => Err(self.fail(self.data(action, format!("rank {peer} sent no bytes")))),
        }
    }
}

impl<B: Backend, T: Transport> Communicator<B> for ProcessComm<B, T> {
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
        let data = self.read_data(tensor, action)?;
        self.sent
            .add(Group::Pipeline, data.shape.num_elements(), data.dtype);
        self.post_data(peer, Stream::P2p(tag), action, Payload::Tensor(data))
    }

    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
        dtype: DType,
    ) -> Result<Tensor<B, D>, CommError> {
        let action = CommOp::Recv { tag };
        self.check(action, &shape)?;
        self.check_peer(peer, action)?;
        // A message's `op` is the sender's `Send`; p2p streams are matched by tag alone.
        let payload = self.wait(peer, Stream::P2p(tag), action, &shape)?;
        let data = self.expect_tensor(payload, peer, action, &shape)?;
        if data.dtype != dtype {
            let reason = format!(
                "rank {peer} sent {:?} values where {dtype:?} was expected",
                data.dtype
            );
            return Err(self.fail(self.data(action, reason)));
        }
        Ok(self.build_tensor(data))
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
        let stream = Stream::Collective(group, self.next_seq(group), 0);
        if root_rank == self.rank {
            if members.len() > 1 {
                let mine = self.read_data(tensor.clone(), action)?;
                for &m in members.iter().filter(|&&m| m != self.rank) {
                    self.sent.add(group, mine.shape.num_elements(), mine.dtype);
                    self.post_data(m, stream, action, Payload::Tensor(mine.clone()))?;
                }
            }
            return Ok(tensor);
        }
        let payload = self.wait(root_rank, stream, action, &shape)?;
        let data = self.expect_tensor(payload, root_rank, action, &shape)?;
        Ok(self.build_tensor(data))
    }

    fn barrier(&self, group: Group) -> Result<(), CommError> {
        let action = CommOp::Barrier(group);
        self.check(action, &[])?;
        let stream = Stream::Collective(group, self.next_seq(group), 0);
        let others: Vec<usize> = self
            .group_members(group)
            .into_iter()
            .filter(|&r| r != self.rank)
            .collect();
        for &m in &others {
            self.post_data(m, stream, action, Payload::Empty)?;
        }
        for &m in &others {
            self.wait(m, stream, action, &[])?;
        }
        Ok(())
    }

    fn start(&self, collective: Collective<B>) -> Result<Pending<B>, CommError> {
        pending::start(self, collective)
    }

    fn finish(&self, pending: Pending<B>) -> Result<Tensor<B, 1>, CommError> {
        pending::finish(self, pending)
    }

    fn bytes_sent(&self) -> super::super::CommBytes {
        self.sent.get()
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
