//! Property tests of the schedule core over P ≤ 16, V ≤ 8, M ≤ 64: every generated schedule
//! validates, lowers without deadlock at every ZeRO level, round-trips through CSV, and its
//! unit-time replay has the makespan of the closed forms in the reference.

use burn_bfpp::schedule::{
    collective_counts, from_csv, lower_data_parallel, lower_p2p, replay, to_csv, unit_cost,
    validate, ActionKind, DataParallelLowering, Placement, ScheduleKind, ScheduleSpec, SendMode,
    ZeroLevel,
};
use proptest::prelude::*;

/// The makespan the reference's closed forms predict with stage forward 1 and backward 2
/// (split: I 1 and W 1); `None` where there is none (the zero-bubble hybrid).
fn expected_makespan(kind: ScheduleKind, p: usize, v: usize, m: usize, k: usize) -> Option<usize> {
    Some(match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => (m + p - 1) * 3,
        ScheduleKind::Interleaved => (v * m + p - 1) * 3,
        // Sweeps of k micro-batches run one after the other: rank 0 ends each sweep last.
        ScheduleKind::BreadthFirst if k >= p => (m / k) * (v * k + p - 1) * 3,
        ScheduleKind::BreadthFirst => (m / k) * (v * p + k - 1) * 3,
        // Only the forward chain costs: (P − 1)(F + I − W) (Qi et al. 2023); with M < P the
        // warm-up dominates.
        ScheduleKind::ZeroBubbleH1 => (3 * m + p - 1).max(2 * m + 2 * p - 1),
        // At M = P the warm-up runs every forward first: both chains cost.
        ScheduleKind::InterleavedZeroBubble if m == p => 3 * v * m + 2 * (p - 1),
        ScheduleKind::InterleavedZeroBubble => 3 * v * m + p - 1,
        // The forward and input-gradient chains both cost; only the weight passes fill.
        ScheduleKind::BreadthFirstZeroBubble if k == m => {
            (3 * v * m + 2 * (p - 1)).max(2 * (v * p + m - 1) + v * m)
        }
        ScheduleKind::BreadthFirstZeroBubble => return None,
        // Two half-size stages per rank: ZB-H1's chain over 2M micro-batch-stages.
        ScheduleKind::ZeroBubbleV => 3 * v * m + p - 1,
        // With its pairs run one half after the other, both chains cost, as for
        // interleaved zero-bubble at M = P.
        ScheduleKind::DualPipeV => 3 * v * m + 2 * (p - 1),
    })
}

/// A valid spec for a kind from raw (p, v, m, k-choice) draws.
fn spec(
    kind: ScheduleKind,
    p: usize,
    v: usize,
    m: usize,
    k_pick: usize,
    hybrid: bool,
) -> ScheduleSpec {
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 => {
            ScheduleSpec::new(kind, p, 1, m)
        }
        ScheduleKind::Interleaved | ScheduleKind::InterleavedZeroBubble => {
            ScheduleSpec::new(kind, p, v, m.div_ceil(p) * p)
        }
        ScheduleKind::ZeroBubbleV => ScheduleSpec::new(kind, p, 2, m.div_ceil(p) * p),
        ScheduleKind::DualPipeV => ScheduleSpec::new(kind, p, 2, m.max(2 * p)),
        ScheduleKind::BreadthFirst | ScheduleKind::BreadthFirstZeroBubble => {
            let s = ScheduleSpec::new(kind, p, v, m);
            if hybrid {
                let divisors: Vec<usize> = (1..=m).filter(|d| m % d == 0).collect();
                s.with_bf_microbatches(divisors[k_pick % divisors.len()])
            } else {
                s
            }
        }
    }
}

fn kinds() -> impl Strategy<Value = ScheduleKind> {
    prop::sample::select(ScheduleKind::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn generated_schedules_have_the_closed_form_makespan(
        kind in kinds(), p in 1usize..=16, v in 1usize..=8, m in 1usize..=64,
        k_pick in 0usize..64, hybrid in any::<bool>(),
    ) {
        let spec = spec(kind, p, v, m, k_pick, hybrid);
        let s = spec.generate().unwrap();
        let report = validate(&s).unwrap();
        let k = spec.bf_microbatches.unwrap_or(spec.microbatches);
        match expected_makespan(kind, spec.pp, spec.loops, spec.microbatches, k) {
            Some(want) => prop_assert_eq!(report.makespan, want as f64, "{:?}", spec),
            // The zero-bubble hybrid: never slower than the breadth-first hybrid it fills.
            None => {
                let bf = ScheduleSpec { kind: ScheduleKind::BreadthFirst, ..spec.clone() };
                let bf = validate(&bf.generate().unwrap()).unwrap().makespan;
                prop_assert!(report.makespan <= bf, "{:?}: {} > {bf}", spec, report.makespan);
            }
        }
        let replayed = replay(&s, SendMode::Eager, unit_cost).unwrap();
        prop_assert!(replayed.completed());
        prop_assert_eq!(replayed.timeline.makespan(), report.makespan);
    }

    #[test]
    fn every_zero_level_lowers_without_deadlock_and_round_trips_through_csv(
        kind in kinds(), p in 1usize..=16, v in 1usize..=8, m in 1usize..=64,
        k_pick in 0usize..64, hybrid in any::<bool>(), zero in 0u8..=3, buffers in 1usize..=3,
    ) {
        let spec = spec(kind, p, v, m, k_pick, hybrid);
        let s = spec.generate().unwrap();
        let p2p = lower_p2p(&s).unwrap();
        // Transfers placed by the pass must not delay any compute (with eager sends).
        prop_assert_eq!(validate(&p2p).unwrap().makespan, validate(&s).unwrap().makespan);
        let cfg = DataParallelLowering {
            zero: ZeroLevel::from_number(zero).unwrap(),
            weight_buffers: buffers,
            grad_buffers: buffers,
        };
        if s.has_pairs() && zero == 3 && buffers < 2 {
            // A pair reads both its stages' weights at once.
            let err = lower_data_parallel(&p2p, &cfg).unwrap_err().to_string();
            prop_assert!(err.contains("--buffers 2"), "{}", err);
            return Ok(());
        }
        let lowered = lower_data_parallel(&p2p, &cfg).unwrap();
        prop_assert_eq!(validate(&lowered).unwrap().makespan, validate(&s).unwrap().makespan);
        if zero == 3 {
            // Never more stages gathered at once than there are buffers.
            for list in &lowered.ranks {
                let mut gathered = 0usize;
                for a in list {
                    match a.kind {
                        ActionKind::Unshard => gathered += 1,
                        ActionKind::Reshard => gathered -= 1,
                        _ => {}
                    }
                    prop_assert!(gathered <= buffers, "{:?}: {} gathered", spec, gathered);
                }
            }
        }
        prop_assert_eq!(lowered.compute_only(), s.clone());
        prop_assert_eq!(from_csv(&to_csv(&lowered)).unwrap(), lowered);
        prop_assert_eq!(from_csv(&to_csv(&s)).unwrap(), s);
    }

    #[test]
    fn breadth_first_zero3_gathers_at_most_2v_and_reduces_exactly_v_times(
        p in 1usize..=16, v in 1usize..=8, m in 1usize..=64, buffers in 1usize..=3,
        split in any::<bool>(),
    ) {
        // With split backwards too: the weight passes fill the waits, and each stage's
        // gradients are still reduced once, after its last weight pass.
        let kind = if split { ScheduleKind::BreadthFirstZeroBubble } else { ScheduleKind::BreadthFirst };
        let s = ScheduleSpec::new(kind, p, v, m).generate().unwrap();
        let cfg = DataParallelLowering { zero: ZeroLevel::Zero3, weight_buffers: buffers, grad_buffers: buffers };
        let lowered = lower_data_parallel(&lower_p2p(&s).unwrap(), &cfg).unwrap();
        for c in collective_counts(&lowered) {
            prop_assert!(c.unshard <= 2 * v, "{:?}", c);
            prop_assert_eq!(c.reshard, c.unshard);
            prop_assert_eq!(c.reduce_grad, v);
        }
    }

    #[test]
    fn v_shape_breadth_first_is_valid(p in 1usize..=16, v in 1usize..=8, m in 1usize..=64) {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, p, v, m)
            .with_placement(Placement::VShape)
            .generate()
            .unwrap();
        let lowered = lower_data_parallel(&lower_p2p(&s).unwrap(), &DataParallelLowering::new(ZeroLevel::Zero3)).unwrap();
        validate(&lowered).unwrap();
    }
}

#[test]
fn interleaved_zero3_needs_more_collectives_as_m_grows_unless_buffers_cover_v() {
    let counts = |m: usize, buffers: usize| {
        let s = ScheduleSpec::new(ScheduleKind::Interleaved, 4, 4, m)
            .generate()
            .unwrap();
        let cfg = DataParallelLowering {
            zero: ZeroLevel::Zero3,
            weight_buffers: buffers,
            grad_buffers: buffers,
        };
        collective_counts(&lower_data_parallel(&lower_p2p(&s).unwrap(), &cfg).unwrap())
    };
    let (c8, c32) = (counts(8, 2), counts(32, 2));
    for r in 0..4 {
        assert!(
            c32[r].unshard > c8[r].unshard,
            "rank {r}: {:?} vs {:?}",
            c8[r],
            c32[r]
        );
        assert!(c32[r].reduce_grad > c8[r].reduce_grad, "rank {r}");
    }
    for c in counts(32, 4) {
        assert_eq!((c.unshard, c.reduce_grad), (4, 4));
    }
}
