//! The engine overlaps its data-parallel collectives with compute (`UNSHARD` finished just
//! before the stage computes, each `REDUCE_GRAD` only when the next one starts or the step
//! ends) and still trains bit for bit like collectives that wait where they start, and like
//! single-device Burn.

mod common;

use burn_bfpp::engine::TrainOutcome;
use burn_bfpp::model::Gpt;
use burn_bfpp::schedule::TimedEvent;
use burn_bfpp::schedule::{ActionKind, ScheduleKind, ZeroLevel};
use common::*;

fn train_overlapping(zero: ZeroLevel, overlap: bool) -> TrainOutcome<Gpt<B>> {
    let cfg = config(ScheduleKind::BreadthFirst, 2, 2, 2, zero).with_overlap_collectives(overlap);
    train(&model(), &cfg).unwrap_or_else(|e| panic!("{zero:?}, overlap {overlap}: {e}"))
}

/// The collective events of one step of one rank whose action ran twice (start, then wait).
fn waited(events: &[TimedEvent], step: usize) -> Vec<TimedEvent> {
    let of_step: Vec<&TimedEvent> = events.iter().filter(|e| e.step == step).collect();
    of_step
        .iter()
        .filter(|e| e.action.kind.is_collective())
        .filter(|e| of_step.iter().filter(|o| o.action == e.action).count() == 2)
        .map(|&&e| e)
        .collect()
}

#[test]
fn overlapped_collectives_train_bit_for_bit_like_waiting_ones_and_like_one_device() {
    let (want_losses, want_params) = reference(2);
    for zero in [ZeroLevel::Zero1, ZeroLevel::Zero3] {
        let overlapped = train_overlapping(zero, true);
        let waiting = train_overlapping(zero, false);
        assert_eq!(overlapped.losses, waiting.losses, "{zero:?}: losses");
        assert_eq!(
            params(&overlapped.model),
            params(&waiting.model),
            "{zero:?}: parameters"
        );
        let loss_err = max_loss_err(&overlapped.losses, &want_losses);
        let param_err = max_param_err(&params(&overlapped.model), &want_params);
        assert!(
            loss_err <= 1e-5 && param_err <= 1e-5,
            "{zero:?}: loss err {loss_err:.2e}, param err {param_err:.2e} against one device"
        );

        for (rank, events) in overlapped.timelines.iter().enumerate() {
            let twice = waited(events, STEPS);
            let mut actions: Vec<_> = twice.iter().map(|e| e.action).collect();
            actions.sort_by_key(|a| (a.stage, a.kind.token()));
            actions.dedup();
            // Each of the rank's 2 stages reduces once per step, after its last backward.
            let reduces = actions
                .iter()
                .filter(|a| a.kind == ActionKind::ReduceGrad)
                .count();
            assert_eq!(
                reduces, 2,
                "{zero:?} rank {rank}: every reduction is started, then waited for apart"
            );
            let compute_between = actions.iter().any(|&action| {
                let mut pair = twice.iter().filter(|e| e.action == action);
                let (Some(started), Some(finished)) = (pair.next(), pair.next()) else {
                    return false;
                };
                events.iter().any(|e| {
                    e.action.kind.is_compute() && e.start >= started.end && e.end <= finished.start
                })
            });
            assert!(
                compute_between,
                "{zero:?} rank {rank}: no compute ran while a collective was in flight"
            );
        }
        for (rank, events) in waiting.timelines.iter().enumerate() {
            assert!(
                waited(events, STEPS).is_empty(),
                "{zero:?} rank {rank}: waiting collectives must run once each"
            );
        }
    }
}
