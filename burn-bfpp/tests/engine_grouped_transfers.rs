//! The engine's grouped pipeline transfers, on the CPU: a communicator that wants its
//! transfers posted together (as NCCL's sends and receives must be,
//! `Communicator::groups_transfers`) gets each run of a rank's consecutive transfers as one
//! `exchange`, and training is bit for bit what one-at-a-time transfers give. The stand-in
//! here is `LocalComm` that records the groups; `NcclComm` posts them as NCCL groups.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::{DType, Tensor};
use burn_bfpp::comm::Collective;
use burn_bfpp::comm::{
    CommBytes, CommConfig, CommError, Communicator, Group, LocalComm, Pending, RankGrid, ReduceOp,
    ThreadRank, World,
};
use burn_bfpp::engine::{infallible, Trainer};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;

type Inner = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;

/// `LocalComm` that asks for grouped transfers and records each group as (sends, receives).
struct Grouping {
    inner: LocalComm<Inner>,
    groups: Arc<Mutex<Vec<(usize, usize)>>>,
}

impl ThreadRank for Grouping {
    fn world_rank(&self) -> usize {
        self.inner.world_rank()
    }
    fn world(&self) -> World {
        self.inner.world()
    }
}

impl Communicator<Inner> for Grouping {
    fn grid(&self) -> RankGrid {
        self.inner.grid()
    }
    fn rank(&self) -> usize {
        Communicator::<Inner>::rank(&self.inner)
    }
    fn device(&self) -> &burn::tensor::Device<Inner> {
        self.inner.device()
    }
    fn send<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        tensor: Tensor<Inner, D>,
    ) -> Result<(), CommError> {
        self.inner.send(peer, tag, tensor)
    }
    fn recv<const D: usize>(
        &self,
        peer: usize,
        tag: u64,
        shape: [usize; D],
        dtype: DType,
    ) -> Result<Tensor<Inner, D>, CommError> {
        self.inner.recv(peer, tag, shape, dtype)
    }
    fn groups_transfers(&self) -> bool {
        true
    }
    fn exchange<const D: usize>(
        &self,
        sends: Vec<(usize, u64, Tensor<Inner, D>)>,
        recvs: &[(usize, u64, [usize; D], DType)],
    ) -> Result<Vec<Tensor<Inner, D>>, CommError> {
        if let Ok(mut groups) = self.groups.lock() {
            groups.push((sends.len(), recvs.len()));
        }
        self.inner.exchange(sends, recvs)
    }
    fn all_gather(
        &self,
        group: Group,
        shard: Tensor<Inner, 1>,
    ) -> Result<Tensor<Inner, 1>, CommError> {
        self.inner.all_gather(group, shard)
    }
    fn reduce_scatter(
        &self,
        group: Group,
        tensor: Tensor<Inner, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<Inner, 1>, CommError> {
        self.inner.reduce_scatter(group, tensor, op)
    }
    fn all_reduce<const D: usize>(
        &self,
        group: Group,
        tensor: Tensor<Inner, D>,
        op: ReduceOp,
    ) -> Result<Tensor<Inner, D>, CommError> {
        self.inner.all_reduce(group, tensor, op)
    }
    fn broadcast<const D: usize>(
        &self,
        group: Group,
        root: usize,
        tensor: Tensor<Inner, D>,
    ) -> Result<Tensor<Inner, D>, CommError> {
        self.inner.broadcast(group, root, tensor)
    }
    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.inner.barrier(group)
    }
    fn start(&self, collective: Collective<Inner>) -> Result<Pending<Inner>, CommError> {
        self.inner.start(collective)
    }
    fn finish(&self, pending: Pending<Inner>) -> Result<Tensor<Inner, 1>, CommError> {
        self.inner.finish(pending)
    }
    fn bytes_sent(&self) -> CommBytes {
        self.inner.bytes_sent()
    }
    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }
}

#[test]
fn grouped_transfers_train_bit_for_bit_like_single_ones() {
    for kind in [ScheduleKind::BreadthFirst, ScheduleKind::Interleaved] {
        let cfg = config(kind, 2, 2, 2, ZeroLevel::Zero3);
        let single =
            train(&model(), &cfg).unwrap_or_else(|e| panic!("{kind:?}, one at a time: {e}"));
        let groups = Arc::new(Mutex::new(Vec::new()));
        let grid = RankGrid::new(2, 2).expect("grid");
        let comms: Vec<Grouping> =
            LocalComm::create(grid, CommConfig::with_timeout(Duration::from_secs(60)))
                .into_iter()
                .map(|inner| Grouping {
                    inner,
                    groups: Arc::clone(&groups),
                })
                .collect();
        let grouped = Trainer::new(cfg.clone())
            .with_comms(comms)
            .fit(model(), infallible(batch))
            .unwrap_or_else(|e| panic!("{kind:?}, grouped: {e}"));
        assert_eq!(grouped.losses, single.losses, "{kind:?}: losses");
        assert_eq!(
            params(&grouped.model),
            params(&single.model),
            "{kind:?}: parameters"
        );
        let groups = groups.lock().expect("the groups were recorded").clone();
        // Every transfer of every rank and step went through a group: 2 transfers per
        // boundary crossing, M micro-batches, forward and backward.
        let transfers: usize = groups.iter().map(|(s, r)| s + r).sum();
        let crossings = cfg.pp * cfg.loops - 1;
        assert_eq!(
            transfers,
            STEPS * cfg.dp * crossings * M * 2 * 2,
            "{kind:?}"
        );
        assert!(
            groups.iter().any(|&(s, r)| s + r > 1),
            "{kind:?}: no two transfers were ever posted together: {groups:?}"
        );
    }
}
