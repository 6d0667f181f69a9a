//! Lowering pass: the data-parallel collectives of ZeRO levels 0–3.
//!
//! - `UNSHARD s` all-gathers stage `s`'s parameter shards into a full buffer. ZeRO-3 keeps at
//!   most `weight_buffers` stages gathered; ZeRO-1/2 gather each stage once per step (the
//!   optimizer updated only the shards) and keep it. ZeRO-0 needs none.
//! - `RESHARD s` frees the gathered buffer (ZeRO-3 only).
//! - `REDUCE_GRAD s` reduces stage `s`'s accumulated gradients over the data-parallel group
//!   (all-reduce at ZeRO-0, reduce-scatter into the owned shard above). ZeRO-2/3 hold at most
//!   `grad_buffers` full-size gradient buffers, so a stage whose backward windows interleave
//!   with others' may be reduced several times (partial sums accumulate in the shard).
//!
//! Buffers are managed like a cache with perfect knowledge of the future (Belady): when a
//! buffer is needed and none is free, the stage used again furthest in the future gives its
//! up, right after its last use. A gather is issued one compute block ahead of its first use
//! (a block is a run of consecutive computes of one stage), so it overlaps that block; with a
//! single buffer there is nothing to overlap with and it is issued just before the use.
//!
//! For breadth-first each stage's compute forms one forward and one backward block, so ZeRO-3
//! needs at most 2·V gathers and exactly V reductions per rank and step, whatever M is.

use std::str::FromStr;

use super::{unit_span, Action, ActionKind, PipelineSchedule, ScheduleError};

/// ZeRO level: how much of the training state is sharded over the data-parallel group. In
/// configuration files: its number, 0 to 3.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Default,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(try_from = "u8", into = "u8")]
pub enum ZeroLevel {
    /// Replicated weights, gradients and optimizer state; gradients all-reduced.
    #[default]
    Zero0,
    /// Optimizer state sharded (gradients reduce-scattered, weights re-gathered each step).
    Zero1,
    /// Optimizer state and gradients sharded.
    Zero2,
    /// Optimizer state, gradients and weights sharded; weights gathered per window.
    Zero3,
}

impl ZeroLevel {
    /// The level as its number 0–3.
    pub fn number(self) -> u8 {
        match self {
            ZeroLevel::Zero0 => 0,
            ZeroLevel::Zero1 => 1,
            ZeroLevel::Zero2 => 2,
            ZeroLevel::Zero3 => 3,
        }
    }

    /// The level of a number 0–3.
    pub fn from_number(n: u8) -> Result<Self, ScheduleError> {
        match n {
            0 => Ok(ZeroLevel::Zero0),
            1 => Ok(ZeroLevel::Zero1),
            2 => Ok(ZeroLevel::Zero2),
            3 => Ok(ZeroLevel::Zero3),
            _ => Err(ScheduleError::Config(format!(
                "ZeRO level {n} does not exist; use 0, 1, 2 or 3"
            ))),
        }
    }
}

impl From<ZeroLevel> for u8 {
    fn from(level: ZeroLevel) -> u8 {
        level.number()
    }
}

impl TryFrom<u8> for ZeroLevel {
    type Error = ScheduleError;
    fn try_from(n: u8) -> Result<Self, Self::Error> {
        ZeroLevel::from_number(n)
    }
}

impl FromStr for ZeroLevel {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let n: u8 = s.trim().parse().map_err(|_| {
            ScheduleError::Config(format!(
                "ZeRO level `{s}` is not a number; use 0, 1, 2 or 3"
            ))
        })?;
        ZeroLevel::from_number(n)
    }
}

/// Settings of the data-parallel lowering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataParallelLowering {
    /// ZeRO level.
    pub zero: ZeroLevel,
    /// Full-size gathered weight buffers per rank (ZeRO-3); at least 1.
    pub weight_buffers: usize,
    /// Full-size gradient buffers per rank (ZeRO-2 and 3); at least 1.
    pub grad_buffers: usize,
}

impl DataParallelLowering {
    /// The given level with the default of two rotating buffers of each kind.
    pub fn new(zero: ZeroLevel) -> Self {
        DataParallelLowering {
            zero,
            weight_buffers: 2,
            grad_buffers: 2,
        }
    }
}

/// Number of each collective on one rank per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CollectiveCounts {
    /// `UNSHARD` actions (all-gathers).
    pub unshard: usize,
    /// `RESHARD` actions (buffer frees).
    pub reshard: usize,
    /// `REDUCE_GRAD` actions (reductions).
    pub reduce_grad: usize,
}

/// Count the collectives of every rank.
pub fn collective_counts(schedule: &PipelineSchedule) -> Vec<CollectiveCounts> {
    schedule
        .ranks
        .iter()
        .map(|list| {
            let mut c = CollectiveCounts::default();
            for a in list {
                match a.kind {
                    ActionKind::Unshard => c.unshard += 1,
                    ActionKind::Reshard => c.reshard += 1,
                    ActionKind::ReduceGrad => c.reduce_grad += 1,
                    _ => {}
                }
            }
            c
        })
        .collect()
}

/// A run of consecutive computes of one stage, as positions in the rank's list.
#[derive(Debug, Clone, Copy)]
struct Block {
    stage: usize,
    first: usize,
    last: usize,
}

/// Actions to insert before or after given positions of a rank's list.
struct Insertions {
    before: Vec<Vec<Action>>,
    after: Vec<Vec<Action>>,
}

/// Split the positions `pos` (computes of interest, in list order) into same-stage runs.
fn blocks(list: &[Action], positions: impl Iterator<Item = usize>) -> Vec<Block> {
    let mut out: Vec<Block> = Vec::new();
    for p in positions {
        let stage = list[p].stage;
        match out.last_mut() {
            Some(b) if b.stage == stage => b.last = p,
            _ => out.push(Block {
                stage,
                first: p,
                last: p,
            }),
        }
    }
    out
}

/// For each block, the index of the next block of the same stage (`usize::MAX` if none).
fn next_same_stage(blocks: &[Block]) -> Vec<usize> {
    let mut next = vec![usize::MAX; blocks.len()];
    let mut seen: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for (i, b) in blocks.iter().enumerate().rev() {
        if let Some(&j) = seen.get(&b.stage) {
            next[i] = j;
        }
        seen.insert(b.stage, i);
    }
    next
}

/// The stages of the unit at `p` (see [`unit_span`]: nothing may come between a pair's
/// halves) other than `stage`.
fn partners(list: &[Action], p: usize, stage: usize) -> Vec<usize> {
    let (first, last) = unit_span(list, p);
    [list[first].stage, list[last].stage]
        .into_iter()
        .filter(|&s| s != stage)
        .collect()
}

/// Pick the resident entry whose next use is furthest away, skipping the stages in `keep`.
fn furthest(resident: &[(usize, usize)], keep: &[usize]) -> Option<usize> {
    resident
        .iter()
        .enumerate()
        .filter(|(_, (stage, _))| !keep.contains(stage))
        .max_by_key(|(_, (stage, next))| (*next, *stage))
        .map(|(i, _)| i)
}

/// Place the gathers (and for ZeRO-3 the frees) of one rank.
fn place_weights(
    list: &[Action],
    cfg: &DataParallelLowering,
    ins: &mut Insertions,
    start_of: impl Fn(usize) -> usize,
    end_of: impl Fn(usize) -> usize,
) {
    let blocks = blocks(
        list,
        (0..list.len()).filter(|&p| list[p].kind.reads_weights()),
    );
    let next = next_same_stage(&blocks);
    // ZeRO-1/2 keep every gathered stage: as many buffers as stages.
    let capacity = if cfg.zero == ZeroLevel::Zero3 {
        cfg.weight_buffers
    } else {
        usize::MAX
    };
    let mut resident: Vec<(usize, usize)> = Vec::new(); // (stage, next block using it)
    let mut last_end: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for (i, b) in blocks.iter().enumerate() {
        if let Some(entry) = resident.iter_mut().find(|(s, _)| *s == b.stage) {
            entry.1 = next[i];
        } else {
            // Stages in use where the gather is issued: a prefetch overlaps the previous
            // block (and the pair it starts in); a gather just before the use must keep the
            // other half of a pair the block starts in.
            let own_unit = partners(list, b.first, b.stage);
            let prefetch = (capacity >= 2 && i > 0).then(|| {
                let prev = blocks[i - 1];
                let mut busy = partners(list, prev.first, prev.stage);
                busy.push(prev.stage);
                busy.extend(own_unit.iter().copied());
                (prev.first, busy)
            });
            // Both buffers held by a pair leave nothing to prefetch into.
            let prefetch = prefetch.filter(|(_, busy)| {
                resident.len() < capacity || furthest(&resident, busy).is_some()
            });
            let (at, in_use) = prefetch.unwrap_or((b.first, own_unit));
            if resident.len() >= capacity {
                if let Some(v) = furthest(&resident, &in_use) {
                    let (victim, _) = resident.swap_remove(v);
                    ins.after[end_of(last_end[&victim])]
                        .push(Action::collective(victim, ActionKind::Reshard));
                }
            }
            ins.before[start_of(at)].push(Action::collective(b.stage, ActionKind::Unshard));
            resident.push((b.stage, next[i]));
        }
        last_end.insert(b.stage, b.last);
    }
    if cfg.zero == ZeroLevel::Zero3 {
        // Gathered copies go stale at the optimizer step: free them after their last use.
        let mut rest: Vec<usize> = resident.into_iter().map(|(s, _)| s).collect();
        rest.sort_by_key(|s| last_end[s]);
        for s in rest {
            ins.after[end_of(last_end[&s])].push(Action::collective(s, ActionKind::Reshard));
        }
    }
}

/// Place the gradient reductions of one rank.
fn place_grads(
    list: &[Action],
    cfg: &DataParallelLowering,
    ins: &mut Insertions,
    end_of: impl Fn(usize) -> usize,
) {
    let blocks = blocks(
        list,
        (0..list.len()).filter(|&p| list[p].kind.produces_weight_grad()),
    );
    let next = next_same_stage(&blocks);
    let capacity = if cfg.zero >= ZeroLevel::Zero2 {
        cfg.grad_buffers
    } else {
        usize::MAX
    };
    let mut open: Vec<(usize, usize)> = Vec::new();
    let mut last_end: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for (i, b) in blocks.iter().enumerate() {
        if let Some(entry) = open.iter_mut().find(|(s, _)| *s == b.stage) {
            entry.1 = next[i];
        } else {
            if open.len() >= capacity {
                if let Some(v) = furthest(&open, &[]) {
                    let (victim, _) = open.swap_remove(v);
                    ins.after[end_of(last_end[&victim])]
                        .push(Action::collective(victim, ActionKind::ReduceGrad));
                }
            }
            open.push((b.stage, next[i]));
        }
        last_end.insert(b.stage, b.last);
    }
    let mut rest: Vec<usize> = open.into_iter().map(|(s, _)| s).collect();
    rest.sort_by_key(|s| last_end[s]);
    for s in rest {
        ins.after[end_of(last_end[&s])].push(Action::collective(s, ActionKind::ReduceGrad));
    }
}

/// Insert `UNSHARD`/`RESHARD`/`REDUCE_GRAD` into every rank's list for the given ZeRO level.
///
/// Works on compute-only and on p2p-lowered lists; a collective that follows a compute is
/// placed after that compute's own sends, so pipeline transfers are never held up by it.
/// Every rank of a data-parallel group runs the same list, so the collectives meet.
pub fn lower_data_parallel(
    schedule: &PipelineSchedule,
    cfg: &DataParallelLowering,
) -> Result<PipelineSchedule, ScheduleError> {
    if cfg.weight_buffers == 0 || cfg.grad_buffers == 0 {
        return Err(ScheduleError::Config(
            "buffers must be at least 1 (a stage in use needs its full weights and gradients); \
             try --buffers 2"
                .into(),
        ));
    }
    if cfg.zero == ZeroLevel::Zero3 && cfg.weight_buffers < 2 && schedule.has_pairs() {
        return Err(ScheduleError::Config(
            "an overlapped forward/backward pair reads the weights of both its stages at once, \
             so ZeRO-3 needs at least 2 weight buffers; use --buffers 2"
                .into(),
        ));
    }
    if let Some(a) = schedule
        .ranks
        .iter()
        .flatten()
        .find(|a| a.kind.is_collective())
    {
        return Err(ScheduleError::Config(format!(
            "the schedule already has data-parallel collectives ({a}); lower it only once"
        )));
    }
    let ranks = schedule
        .ranks
        .iter()
        .map(|list| {
            let n = list.len();
            let mut ins = Insertions {
                before: vec![Vec::new(); n],
                after: vec![Vec::new(); n],
            };
            let unit = |p: usize| unit_span(list, p);
            let in_unit = |(first, last): (usize, usize), a: &Action| {
                a.stage == list[first].stage || a.stage == list[last].stage
            };
            // After a compute at p, skip past the sends of that same unit that follow it.
            let end_of = |p: usize| {
                let u = unit(p);
                let mut q = u.1;
                while q + 1 < n
                    && matches!(
                        list[q + 1].kind,
                        ActionKind::SendForward | ActionKind::SendBackward
                    )
                    && in_unit(u, &list[q + 1])
                {
                    q += 1;
                }
                q
            };
            // Before a compute at p, also before the receives of that same unit leading to it,
            // so a gather is already under way while the input arrives.
            let start_of = |p: usize| {
                let u = unit(p);
                let mut q = u.0;
                while q > 0
                    && matches!(
                        list[q - 1].kind,
                        ActionKind::RecvForward | ActionKind::RecvBackward
                    )
                    && in_unit(u, &list[q - 1])
                {
                    q -= 1;
                }
                q
            };
            if cfg.zero != ZeroLevel::Zero0 {
                place_weights(list, cfg, &mut ins, start_of, end_of);
            }
            place_grads(list, cfg, &mut ins, end_of);
            let extra: usize = ins.before.iter().chain(&ins.after).map(Vec::len).sum();
            let mut out = Vec::with_capacity(n + extra);
            for (p, a) in list.iter().enumerate() {
                out.extend_from_slice(&ins.before[p]);
                out.push(*a);
                out.extend_from_slice(&ins.after[p]);
            }
            out
        })
        .collect();
    Ok(PipelineSchedule {
        stage_ranks: schedule.stage_ranks.clone(),
        microbatches: schedule.microbatches,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{lower_p2p, ScheduleKind, ScheduleSpec};

    fn line(list: &[Action]) -> String {
        list.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn lowered(
        kind: ScheduleKind,
        pp: usize,
        v: usize,
        m: usize,
        cfg: DataParallelLowering,
    ) -> PipelineSchedule {
        let s = ScheduleSpec::new(kind, pp, v, m).generate().unwrap();
        lower_data_parallel(&lower_p2p(&s).unwrap(), &cfg).unwrap()
    }

    #[test]
    fn zero3_breadth_first_prefetches_one_block_ahead_and_reduces_once_per_stage() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 1, 3, 2)
            .generate()
            .unwrap();
        let out = lower_data_parallel(&s, &DataParallelLowering::new(ZeroLevel::Zero3)).unwrap();
        assert_eq!(
            line(&out.ranks[0]),
            "0UNSHARD 1UNSHARD 0F0 0F1 0RESHARD 2UNSHARD 1F0 1F1 2F0 2F1 2B0 2B1 2RESHARD \
             2REDUCE_GRAD 0UNSHARD 1B0 1B1 1RESHARD 1REDUCE_GRAD 0B0 0B1 0RESHARD 0REDUCE_GRAD"
        );
    }

    #[test]
    fn zero0_only_reduces_after_each_stages_last_backward() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 2)
            .generate()
            .unwrap();
        let out = lower_data_parallel(&s, &DataParallelLowering::new(ZeroLevel::Zero0)).unwrap();
        assert_eq!(
            line(&out.ranks[1]),
            "1F0 1F1 3F0 3F1 3B0 3B1 3REDUCE_GRAD 1B0 1B1 1REDUCE_GRAD"
        );
    }

    #[test]
    fn collectives_wait_for_the_sends_of_the_compute_they_follow() {
        let out = lowered(
            ScheduleKind::GPipe,
            2,
            1,
            1,
            DataParallelLowering::new(ZeroLevel::Zero0),
        );
        assert_eq!(
            line(&out.ranks[1]),
            "1RECV_F0 1F0 1B0 1SEND_B0 1REDUCE_GRAD"
        );
    }

    #[test]
    fn zero1_and_2_gather_each_stage_once_and_keep_it() {
        for zero in [ZeroLevel::Zero1, ZeroLevel::Zero2] {
            let out = lowered(
                ScheduleKind::Interleaved,
                2,
                3,
                8,
                DataParallelLowering::new(zero),
            );
            for c in collective_counts(&out) {
                assert_eq!(c.unshard, 3);
                assert_eq!(c.reshard, 0);
                if zero == ZeroLevel::Zero1 {
                    assert_eq!(c.reduce_grad, 3);
                } else {
                    assert!(
                        c.reduce_grad > 3,
                        "2 buffers for 3 interleaved stages: {c:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn zero3_breadth_first_counts_do_not_depend_on_microbatches() {
        for m in [1, 4, 16, 64] {
            let out = lowered(
                ScheduleKind::BreadthFirst,
                4,
                4,
                m,
                DataParallelLowering::new(ZeroLevel::Zero3),
            );
            for c in collective_counts(&out) {
                assert!(c.unshard <= 8, "m={m}: {c:?}");
                assert_eq!(c.reduce_grad, 4, "m={m}: {c:?}");
                assert_eq!(c.unshard, c.reshard);
            }
        }
    }

    #[test]
    fn zero3_interleaved_counts_grow_with_m_unless_buffers_cover_every_stage() {
        let count = |m, buffers| {
            let cfg = DataParallelLowering {
                zero: ZeroLevel::Zero3,
                weight_buffers: buffers,
                grad_buffers: buffers,
            };
            collective_counts(&lowered(ScheduleKind::Interleaved, 2, 4, m, cfg))[0]
        };
        let (small, large) = (count(4, 2), count(16, 2));
        assert!(large.unshard > small.unshard && large.reduce_grad > small.reduce_grad);
        assert_eq!(
            count(16, 4),
            CollectiveCounts {
                unshard: 4,
                reshard: 4,
                reduce_grad: 4
            }
        );
    }

    #[test]
    fn zero_buffers_and_double_lowering_are_refused() {
        let s = ScheduleSpec::new(ScheduleKind::GPipe, 1, 1, 1)
            .generate()
            .unwrap();
        let bad = DataParallelLowering {
            zero: ZeroLevel::Zero3,
            weight_buffers: 0,
            grad_buffers: 2,
        };
        assert!(lower_data_parallel(&s, &bad).is_err());
        let once = lower_data_parallel(&s, &DataParallelLowering::new(ZeroLevel::Zero1)).unwrap();
        assert!(lower_data_parallel(&once, &DataParallelLowering::new(ZeroLevel::Zero1)).is_err());
        assert!("4".parse::<ZeroLevel>().is_err());
    }
}
