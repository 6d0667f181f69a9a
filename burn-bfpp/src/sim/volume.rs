//! How many bytes each rank sends in one step: the formulas the simulator's collective and
//! transfer times are built on, and against which the training engine's measured
//! `comm_bytes` are tested (`tests/comm_bytes.rs`).
//!
//! Collectives are bandwidth-optimal (a ring, or the engine's direct exchange, which sends
//! the same): over `d` members a buffer of `N` elements is cut into `d` chunks of
//! `⌈N / d⌉` (the engine pads every stage's buffer to a multiple of `d`), and each member
//! sends `d − 1` chunks for an all-gather or a reduce-scatter and twice that for an
//! all-reduce. A pipeline transfer sends its message once.

use serde::{Deserialize, Serialize};

use super::cost_table::CostTable;
use crate::schedule::{ActionKind, PipelineSchedule, ZeroLevel};

/// Bytes of payload a rank sends, by the kind of traffic: elements × the size of the dtype
/// carried, counted alike on every transport (headers are not payload; between threads,
/// which share memory, what a network transport would carry).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommBytes {
    /// Collectives over the data-parallel group (`UNSHARD`, `REDUCE_GRAD`).
    pub data_parallel: u64,
    /// Point-to-point transfers between pipeline stages, and collectives over the pipeline
    /// group.
    pub pipeline: u64,
}

impl CommBytes {
    /// The bytes sent between `earlier` and `self` (two readings of one rank's counter).
    pub fn since(self, earlier: CommBytes) -> CommBytes {
        CommBytes {
            data_parallel: self.data_parallel.saturating_sub(earlier.data_parallel),
            pipeline: self.pipeline.saturating_sub(earlier.pipeline),
        }
    }
}

/// A bandwidth-optimal collective over a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveKind {
    /// Every member ends with every member's shard.
    AllGather,
    /// Every member ends with its chunk of the members' sum.
    ReduceScatter,
    /// Every member ends with the members' sum: a reduce-scatter, then an all-gather.
    AllReduce,
}

/// Bytes one of `members` sends in `kind` over a full buffer of `elements` elements of
/// `elem_bytes` each (for an all-gather, the gathered size: `members` × the shard).
pub fn collective_bytes(
    kind: CollectiveKind,
    elements: u64,
    elem_bytes: u64,
    members: usize,
) -> u64 {
    if members <= 1 {
        return 0;
    }
    let d = members as u64;
    let chunk = elements.div_ceil(d) * elem_bytes;
    let rounds = match kind {
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => 1,
        CollectiveKind::AllReduce => 2,
    };
    rounds * (d - 1) * chunk
}

/// The collective a stage's `REDUCE_GRAD` is at `zero`: an all-reduce at ZeRO-0, where every
/// replica keeps the whole gradient, a reduce-scatter above.
pub fn gradient_reduction(zero: ZeroLevel) -> CollectiveKind {
    if zero == ZeroLevel::Zero0 {
        CollectiveKind::AllReduce
    } else {
        CollectiveKind::ReduceScatter
    }
}

/// Bytes the all-gather of stage `s`'s weights sends from each data-parallel member.
pub(crate) fn gather_bytes(costs: &CostTable, s: usize, dp: usize) -> u64 {
    collective_bytes(
        CollectiveKind::AllGather,
        costs.parameters[s],
        costs.weight_elem_bytes,
        dp,
    )
}

/// Bytes stage `s`'s gradient reduction sends from each data-parallel member.
pub(crate) fn reduce_bytes(costs: &CostTable, s: usize, dp: usize, zero: ZeroLevel) -> u64 {
    collective_bytes(
        gradient_reduction(zero),
        costs.parameters[s],
        costs.grad_elem_bytes,
        dp,
    )
}

/// The bytes each pipeline rank's list sends in one step (every data-parallel replica of a
/// pipeline rank sends the same): its `SEND_*` messages (`costs.message_bytes` of the
/// boundary), its `UNSHARD`s and its `REDUCE_GRAD`s over `dp` replicas at `zero`.
pub fn step_comm_bytes(
    schedule: &PipelineSchedule,
    costs: &CostTable,
    dp: usize,
    zero: ZeroLevel,
) -> Vec<CommBytes> {
    schedule
        .ranks
        .iter()
        .map(|list| {
            let mut bytes = CommBytes::default();
            for action in list {
                let s = action.stage;
                match action.kind {
                    ActionKind::SendForward => bytes.pipeline += costs.message_bytes[s],
                    // The gradient of stage s's input crosses boundary s − 1 → s.
                    ActionKind::SendBackward => {
                        bytes.pipeline += costs.message_bytes[s.saturating_sub(1)]
                    }
                    ActionKind::Unshard => bytes.data_parallel += gather_bytes(costs, s, dp),
                    ActionKind::ReduceGrad => {
                        bytes.data_parallel += reduce_bytes(costs, s, dp, zero)
                    }
                    _ => {}
                }
            }
            bytes
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_volumes_are_d_minus_one_chunks() {
        use CollectiveKind::*;
        // 12 elements of 4 bytes: chunks of 3 over 4 members, 3 chunks sent.
        assert_eq!(collective_bytes(AllGather, 12, 4, 4), 36);
        assert_eq!(collective_bytes(ReduceScatter, 12, 4, 4), 36);
        assert_eq!(collective_bytes(AllReduce, 12, 4, 4), 72);
        // A group of one sends nothing; an uneven buffer is padded to whole chunks.
        assert_eq!(collective_bytes(AllReduce, 12, 4, 1), 0);
        assert_eq!(collective_bytes(ReduceScatter, 10, 2, 4), 3 * 3 * 2);
        // The ratio the issue pins: dp 4 over dp 2 on one buffer is 1.5, not 3.
        let (two, four) = (
            collective_bytes(ReduceScatter, 1 << 20, 4, 2),
            collective_bytes(ReduceScatter, 1 << 20, 4, 4),
        );
        assert_eq!(four * 2, two * 3);
    }
}
