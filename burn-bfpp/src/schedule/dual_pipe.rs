//! DualPipeV: DeepSeek-V3's DualPipe folded onto a V of two stages per rank, in the order
//! PyTorch's `ScheduleDualPipeV` gives each rank (arXiv 2412.19437; `torch.distributed.
//! pipelining`). Rank r holds stages r and 2P − 1 − r, so a micro-batch runs down the ranks
//! through the first stages and back up through the second ones.
//!
//! Each rank runs eight phases: forwards of its first stage to fill the pipe, forwards of
//! both stages, zero-bubble `I`/`W`/`F` steps on the second stage, then the steady state of
//! overlapped pairs — a forward of one stage with a full backward of the other, as one unit
//! ([`Action::overlaps_next`]) — and a drain that switches to split backwards half-way so that
//! its weight passes fill the cool-down. A pair (F of stage r; B of stage 2P − 1 − r) receives
//! both inputs from rank r − 1 and sends both outputs to rank r + 1, and the mirrored pair the
//! other way, which is what lets a runtime overlap one half's communication with the other's
//! compute.

use std::collections::VecDeque;

use super::{Action, ActionKind};

/// The compute order of every rank: `pp` ranks, two stages each on the v-shape placement,
/// `microbatches` ≥ 2·`pp` (checked by the family's rule).
pub(super) fn dual_pipe_v(pp: usize, microbatches: usize) -> Vec<Vec<Action>> {
    (0..pp)
        .map(|rank| rank_order(pp, rank, microbatches))
        .collect()
}

/// One rank's order under construction; local stage 0 is the rank's first stage (r), local
/// stage 1 its second (2P − 1 − r). Micro-batches are taken in order per stage and kind.
struct RankOrder {
    stages: [usize; 2],
    forwards: [usize; 2],
    backwards: [usize; 2],
    /// `W`s owed for `I`s already placed, oldest first.
    weights: VecDeque<Action>,
    out: Vec<Action>,
}

impl RankOrder {
    fn forward_action(&mut self, local: usize) -> Action {
        let mb = self.forwards[local];
        self.forwards[local] += 1;
        Action::forward(self.stages[local], mb)
    }

    fn forward(&mut self, local: usize) {
        let a = self.forward_action(local);
        self.out.push(a);
    }

    /// The next backward of `local`: a full `B`, or with `split` an `I` whose `W` is owed.
    fn backward(&mut self, local: usize, split: bool) {
        let (stage, mb) = (self.stages[local], self.backwards[local]);
        self.backwards[local] += 1;
        if split {
            self.out
                .push(Action::new(stage, ActionKind::BackwardInput, mb));
            self.weights
                .push_back(Action::new(stage, ActionKind::BackwardWeight, mb));
        } else {
            self.out.push(Action::backward(stage, mb));
        }
    }

    /// The oldest owed `W`, if any.
    fn weight(&mut self) {
        if let Some(w) = self.weights.pop_front() {
            self.out.push(w);
        }
    }

    /// An overlapped pair: the next forward of `forward` with the next full backward of the
    /// other local stage.
    fn pair(&mut self, forward: usize) {
        let f = self.forward_action(forward).overlapping_next();
        self.out.push(f);
        self.backward(1 - forward, false);
    }
}

fn rank_order(pp: usize, rank: usize, m: usize) -> Vec<Action> {
    let mut o = RankOrder {
        stages: [rank, 2 * pp - 1 - rank],
        forwards: [0; 2],
        backwards: [0; 2],
        weights: VecDeque::new(),
        out: Vec::with_capacity(4 * m),
    };
    let below = pp - rank - 1; // ranks after this one
                               // 1. Fill: first-stage forwards, two per rank below.
    for _ in 0..2 * below {
        o.forward(0);
    }
    // 2. Forwards of both stages.
    for _ in 0..=rank {
        o.forward(0);
        o.forward(1);
    }
    // 3. Zero-bubble steps on the second stage: I, its W, the next forward.
    for _ in 0..below {
        o.backward(1, true);
        o.weight();
        o.forward(1);
    }
    // 4. Steady state: (F0;B1) and (F1;B0) pairs. The last rank runs its first F0 and B1
    //    apart (as PyTorch does), so that F0 need not wait with a pair for B1's gradient.
    for i in 0..m + rank + 1 - 2 * pp {
        if i == 0 && rank == pp - 1 {
            o.forward(0);
            o.backward(1, false);
        } else {
            o.pair(0);
        }
        o.pair(1);
    }
    // 5. Second-stage backwards, each with an (F1;B0) pair.
    for _ in 0..below {
        o.backward(1, false);
        o.pair(1);
    }
    // 6. Backwards of both stages, split from half-way (odd ranks one backward earlier) so
    //    the weight passes fill the drain.
    let steps = rank + 1;
    let mut split = false;
    for i in 0..steps {
        if i == steps / 2 && rank % 2 == 1 {
            split = true;
        }
        o.backward(1, split);
        if i == steps / 2 && rank % 2 == 0 {
            split = true;
        }
        o.backward(0, split);
    }
    // 7. Owed weight passes, each with a first-stage backward.
    for _ in 0..below {
        o.weight();
        o.backward(0, split);
    }
    // 8. The remaining weight passes.
    while !o.weights.is_empty() {
        o.weight();
    }
    o.out
}

#[cfg(test)]
mod tests {
    use crate::schedule::{
        lower_data_parallel, lower_p2p, validate, Action, ActionKind, DataParallelLowering,
        PipelineSchedule, ScheduleKind, ScheduleSpec, ZeroLevel,
    };

    fn generate(p: usize, m: usize) -> PipelineSchedule {
        ScheduleSpec::new(ScheduleKind::DualPipeV, p, 2, m)
            .generate()
            .unwrap()
    }

    fn pairs(list: &[Action]) -> Vec<(usize, Action, Action)> {
        (0..list.len().saturating_sub(1))
            .filter(|&i| list[i].overlaps_next)
            .map(|i| (i, list[i], list[i + 1]))
            .collect()
    }

    #[test]
    fn steady_state_runs_in_pairs_and_the_drain_splits_backwards() {
        for p in 1..=6 {
            for m in 2 * p..=3 * p + 2 {
                let s = generate(p, m);
                validate(&s).unwrap_or_else(|e| panic!("P={p} M={m}: {e}"));
                for (r, list) in s.ranks.iter().enumerate() {
                    // Phase 4 runs two pairs per step (the last rank's first step one), phase
                    // 5 one per step.
                    let steady = m + r + 1 - 2 * p;
                    let want = 2 * steady - usize::from(r == p - 1) + (p - r - 1);
                    assert_eq!(pairs(list).len(), want, "P={p} M={m} rank {r}");
                    for (_, f, b) in pairs(list) {
                        assert_eq!(f.kind, ActionKind::Forward);
                        assert_eq!(b.kind, ActionKind::Backward);
                        assert_ne!(f.stage, b.stage, "a pair joins the rank's two stages");
                    }
                    let splits = list
                        .iter()
                        .filter(|a| a.kind == ActionKind::BackwardInput)
                        .count();
                    // Phase 3's I's, and phases 6 and 7 from half-way on.
                    assert_eq!(splits, 2 * (p - r - 1) + r + 1, "P={p} M={m} rank {r}");
                }
            }
        }
    }

    #[test]
    fn a_pair_receives_from_one_neighbour_and_sends_to_the_other() {
        let (p, m) = (4, 10);
        let lowered = lower_p2p(&generate(p, m)).unwrap();
        let owner = &lowered.stage_ranks;
        for (r, list) in lowered.ranks.iter().enumerate() {
            for (i, f, b) in pairs(list) {
                let from = [f.stage.checked_sub(1), Some(b.stage + 1)]
                    .map(|s| s.filter(|&s| s < 2 * p).map(|s| owner[s]));
                let to = [Some(f.stage + 1), b.stage.checked_sub(1)]
                    .map(|s| s.filter(|&s| s < 2 * p).map(|s| owner[s]));
                assert_eq!(
                    from[0], from[1],
                    "rank {r}: {f} and {b} receive from one rank"
                );
                assert_eq!(to[0], to[1], "rank {r}: {f} and {b} send to one rank");
                // Both inputs arrive before the pair and both outputs leave after it; where
                // the peer is this rank (the V's turn) there is no transfer at all.
                for (a, peer, before) in [
                    (
                        Action::new(f.stage, ActionKind::RecvForward, f.mb()),
                        from[0],
                        true,
                    ),
                    (
                        Action::new(b.stage, ActionKind::RecvBackward, b.mb()),
                        from[1],
                        true,
                    ),
                    (
                        Action::new(f.stage, ActionKind::SendForward, f.mb()),
                        to[0],
                        false,
                    ),
                    (
                        Action::new(b.stage, ActionKind::SendBackward, b.mb()),
                        to[1],
                        false,
                    ),
                ] {
                    let at = list.iter().position(|x| *x == a);
                    let crosses = peer.is_some_and(|peer| peer != r);
                    assert_eq!(at.is_some(), crosses, "rank {r}: {a} for the pair at {i}");
                    if let Some(at) = at {
                        assert_eq!(at < i, before, "rank {r}: {a} around the pair at {i}");
                    }
                }
            }
        }
    }

    /// Most stages whose weights a rank holds gathered at once.
    fn peak_gathered(list: &[Action]) -> usize {
        let (mut now, mut peak) = (0usize, 0);
        for a in list {
            match a.kind {
                ActionKind::Unshard => now += 1,
                ActionKind::Reshard => now -= 1,
                _ => {}
            }
            peak = peak.max(now);
        }
        peak
    }

    #[test]
    fn zero3_holds_both_stages_of_a_pair_within_two_buffers() {
        let s = lower_p2p(&generate(4, 12)).unwrap();
        let cfg = |buffers| DataParallelLowering {
            zero: ZeroLevel::Zero3,
            weight_buffers: buffers,
            grad_buffers: buffers,
        };
        let err = lower_data_parallel(&s, &cfg(1)).unwrap_err().to_string();
        assert!(err.contains("--buffers 2"), "{err}");
        let lowered = lower_data_parallel(&s, &cfg(2)).unwrap();
        validate(&lowered).unwrap();
        for list in &lowered.ranks {
            assert_eq!(peak_gathered(list), 2);
        }
    }

    #[test]
    fn run_half_after_half_the_second_half_may_wait_inside_the_pair() {
        // As one unit a pair waits for both inputs: 3VM + 2(P − 1). Its halves alone let the
        // forward start while the backward's gradient is on its way: ZB-V's 3VM + (P − 1).
        for (p, m) in [(2, 4), (3, 7), (4, 8), (5, 13)] {
            let s = generate(p, m);
            let alone = PipelineSchedule {
                ranks: s
                    .ranks
                    .iter()
                    .map(|l| l.iter().map(|a| a.alone()).collect())
                    .collect(),
                ..s.clone()
            };
            assert_eq!(validate(&s).unwrap().makespan, (6 * m + 2 * (p - 1)) as f64);
            assert_eq!(validate(&alone).unwrap().makespan, (6 * m + p - 1) as f64);
        }
    }

    #[test]
    fn malformed_pairs_are_refused_with_the_reason() {
        let f = Action::forward;
        let b = Action::backward;
        let w = |s, m| Action::new(s, ActionKind::BackwardWeight, m);
        let i = |s, m| Action::new(s, ActionKind::BackwardInput, m);
        let one_rank = |list: Vec<Action>| PipelineSchedule {
            stage_ranks: vec![0, 0],
            microbatches: 2,
            ranks: vec![list],
        };
        let cases = [
            (
                vec![
                    f(0, 0),
                    f(1, 0).overlapping_next(),
                    f(0, 1),
                    f(1, 1),
                    b(1, 0),
                ],
                "one forward (F) and one backward",
            ),
            (
                vec![f(0, 0), f(1, 0), f(0, 1).overlapping_next(), b(1, 1)],
                "pair different micro-batches",
            ),
            (
                vec![f(0, 0), f(1, 0), i(1, 0).overlapping_next(), w(1, 0)],
                "one forward (F) and one backward",
            ),
            (
                vec![f(0, 0), f(1, 0), f(0, 1), b(1, 0).overlapping_next()],
                "follows it",
            ),
            (
                vec![
                    f(0, 0),
                    f(1, 0),
                    f(0, 1).overlapping_next(),
                    b(1, 0).overlapping_next(),
                    f(1, 1),
                ],
                "exactly two actions",
            ),
        ];
        for (list, want) in cases {
            let msg = validate(&one_rank(list.clone())).unwrap_err().to_string();
            assert!(msg.contains(want), "{list:?}: {msg}");
            assert!(msg.contains("rank 0"), "{msg}");
        }
    }
}
