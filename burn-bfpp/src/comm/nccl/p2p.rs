//! Pipeline transfers over NCCL: a rank's batch of consecutive sends and receives, posted as
//! one NCCL group on its pipeline member, straight from and into device buffers in the
//! tensors' own dtype.
//!
//! NCCL matches a send with the peer's receive by order, not by tag, so both sides must post
//! a pair's transfers in the same order. The lowered lists guarantee it: every transfer has
//! one place in a global order and every rank's list follows it (`schedule::lower_p2p`), and
//! the validator replays the lists with blocking sends, which is how NCCL's transfers behave
//! on the device. With `BFPP_DEBUG_COLLECTIVES=1` each transfer also sends its tag and its
//! number among this pair's transfers over the host communicator, and the receiver checks
//! them: a mismatched order is then an error naming both tags instead of wrong data.
//!
//! Sends that no receive of the same batch waits for stay in flight (their buffers kept by
//! the communicator) while the rank computes; the next call on either NCCL member waits for
//! them first, as for collectives (see [`super::super::nccl_group`]).

use burn::tensor::{DType, Shape, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::{BoolElement, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;
use cubecl::Runtime;

use super::super::nccl_host::NcclHost;
use super::super::{CommError, CommOp, Communicator, Group};
use super::{CudaBackend, NcclComm};
use crate::host_read::{read, ReadPurpose};

/// Host tags of the debug checks: far above the executor's and the result gathering's.
const CHECK_TAG: u64 = 3 << 61;

impl<F, I, BT, H> NcclComm<F, I, BT, H>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    H: NcclHost<CudaBackend<F, I, BT>>,
{
    /// The group rank of `peer` in this rank's pipeline group when transfers with it go over
    /// NCCL: the group has an NCCL member and `peer` is another rank of it.
    pub(super) fn nccl_peer(&self, peer: usize) -> Option<usize> {
        let grid = self.grid();
        let same_pipeline = grid.dp_index(peer) == grid.dp_index(self.rank());
        (self.pp.is_some() && same_pipeline && peer != self.rank() && peer < grid.world_size())
            .then(|| grid.pp_index(peer))
    }

    /// Posts `sends` and `recvs` (peers all reachable over NCCL) as one NCCL group; waits
    /// for the group when it receives anything, and returns the received tensors in order.
    #[allow(clippy::type_complexity)] // the lists of `Communicator::exchange`
    pub(super) fn transfer<const D: usize>(
        &self,
        sends: Vec<(usize, u64, Tensor<CudaBackend<F, I, BT>, D>)>,
        recvs: &[(usize, u64, [usize; D], DType)],
    ) -> Result<Vec<Tensor<CudaBackend<F, I, BT>, D>>, CommError> {
        let action = match (sends.first(), recvs.first()) {
            (_, Some(&(_, tag, ..))) => CommOp::Recv { tag },
            (Some(&(_, tag, _)), None) => CommOp::Send { tag },
            (None, None) => return Ok(Vec::new()),
        };
        let member = self.nccl_member(Group::Pipeline, action)?;
        self.reap_sends();
        // No two NCCL members of a rank have calls in flight at once.
        self.wait_for_newest(Group::DataParallel, action)?;
        if self.debug_calls {
            self.check_order(&sends, recvs)?;
        }
        let group_rank = |peer: usize| self.grid().pp_index(peer);
        let mut posted = Vec::with_capacity(sends.len());
        for (peer, _, tensor) in sends {
            self.sent.add(
                Group::Pipeline,
                tensor.shape().num_elements(),
                tensor.dtype(),
            );
            posted.push((tensor.into_primitive().tensor(), group_rank(peer)));
        }
        let wanted: Vec<(Shape, DType, usize)> = recvs
            .iter()
            .map(|&(peer, _, shape, dtype)| (Shape::from(shape.to_vec()), dtype, group_rank(peer)))
            .collect();
        let client = CudaRuntime::client(self.device());
        let launched = member
            .borrow_mut()
            .p2p(posted, &wanted, &client, self.device())
            .map_err(|reason| self.nccl_failed(action, reason))?;
        if recvs.is_empty() {
            self.sends.borrow_mut().push(launched);
            return Ok(Vec::new());
        }
        self.await_launched(member, action, &launched)?;
        Ok(launched
            .into_outputs()
            .into_iter()
            .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
            .collect())
    }

    /// Drops the groups of sends that have finished (their buffers go back to the pool).
    fn reap_sends(&self) {
        self.sends.borrow_mut().retain(|call| !call.finished());
    }

    /// `BFPP_DEBUG_COLLECTIVES`: tells each receiver the tag and the number of each send over
    /// the host, and checks what each sender said against this rank's receives.
    #[allow(clippy::type_complexity)] // the lists of `Communicator::exchange`
    fn check_order<const D: usize>(
        &self,
        sends: &[(usize, u64, Tensor<CudaBackend<F, I, BT>, D>)],
        recvs: &[(usize, u64, [usize; D], DType)],
    ) -> Result<(), CommError> {
        let next = |peer: usize, sending: bool| {
            let mut counts = self.transfers.borrow_mut();
            let n = counts.entry((peer, sending)).or_insert(0);
            *n += 1;
            *n - 1
        };
        let device = self.device();
        for (peer, tag, tensor) in sends {
            let seq = next(*peer, true);
            let what = describe(*tag, seq, &tensor.dims());
            let what = Tensor::<CudaBackend<F, I, BT>, 1>::from_data(what, device);
            self.host.send(*peer, CHECK_TAG + seq, what)?;
        }
        for &(peer, tag, shape, dtype) in recvs {
            let seq = next(peer, false);
            let action = CommOp::Recv { tag };
            let want = describe(tag, seq, &shape);
            let len = want.shape.num_elements();
            let said = self.host.recv(peer, CHECK_TAG + seq, [len], DType::F32)?;
            let said = read(said, ReadPurpose::Transfer)
                .map_err(|e| self.host.fail(self.data_error(action, format!("{e:?}"))))?;
            if said != want {
                let reason = format!(
                    "transfer number {seq} from rank {peer}: this rank receives tag {tag} of \
                     shape {shape:?} ({dtype:?}), the sender posted {:?} (tag, number, shape): \
                     the two lists order their transfers differently",
                    said.to_vec::<f32>().unwrap_or_default()
                );
                return Err(self.host.fail(self.data_error(action, reason)));
            }
        }
        Ok(())
    }

    fn data_error(&self, action: CommOp, reason: String) -> CommError {
        CommError::Data {
            rank: self.rank(),
            action,
            reason,
        }
    }
}

/// A transfer's tag, number and shape as exact f32 values (16-bit halves), for the checks.
fn describe(tag: u64, seq: u64, dims: &[usize]) -> TensorData {
    let halves = |v: u64| (0..4).rev().map(move |i| ((v >> (16 * i)) & 0xffff) as f32);
    let mut values: Vec<f32> = halves(tag).chain(halves(seq)).collect();
    values.extend(dims.iter().flat_map(|&d| halves(d as u64)));
    let len = values.len();
    TensorData::new(values, [len])
}
