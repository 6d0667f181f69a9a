//! What a step costs besides compute, counted exactly: the engine's synchronising host reads
//! are a fixed number per step whatever the micro-batch count, and the bytes every rank's
//! list sends are those the simulator's formulas predict, with bandwidth-optimal
//! collectives (a data-parallel group twice as large sends 1.5× as much per rank, not 3×).

mod common;

use burn_bfpp::engine::Precision;
use burn_bfpp::engine::{infallible, TrainConfig, TrainOutcome, Trainer};
use burn_bfpp::model::Gpt;
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;

fn run(cfg: &TrainConfig, steps: usize) -> TrainOutcome<Gpt<B>> {
    Trainer::new(cfg.clone())
        .stop_after(steps)
        .fit(model(), infallible(batch_any_m))
        .expect("training runs")
}

/// [`batch`] for any micro-batch index (the tests below run more than `M`).
fn batch_any_m(step: usize, dp_index: usize, microbatch: usize) -> burn_bfpp::model::MicroBatch<B> {
    batch(step, dp_index * 64 + microbatch / M, microbatch % M)
}

#[test]
fn host_reads_per_step_do_not_grow_with_the_micro_batch_count() {
    let reads = |microbatches: usize| {
        let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, 2, ZeroLevel::Zero3);
        cfg.microbatches = microbatches;
        run(&cfg, 2).last_step
    };
    let (four, sixteen) = (reads(4), reads(16));
    for (rank, (a, b)) in four.iter().zip(&sixteen).enumerate() {
        eprintln!("rank {rank}: M=4 {a:?}, M=16 {b:?}");
        assert_eq!(
            a.host_reads, b.host_reads,
            "rank {rank}: host reads per step differ between M=4 and M=16"
        );
        assert!(
            (1..=4).contains(&a.host_reads),
            "rank {rank}: {} host reads per step",
            a.host_reads
        );
        // Thread ranks on one device hand activations over as they are; what they read for
        // the host collectives is counted apart, and does grow with the list.
        assert!(a.host_transfer_reads > 0, "rank {rank}: no collective read");
    }
}

#[test]
fn every_rank_sends_the_bytes_the_simulator_predicts() {
    let cases = [
        (
            ScheduleKind::BreadthFirst,
            2,
            2,
            2,
            ZeroLevel::Zero3,
            Precision::Fp32,
        ),
        (
            ScheduleKind::BreadthFirst,
            2,
            2,
            2,
            ZeroLevel::Zero3,
            Precision::Bf16,
        ),
        (
            ScheduleKind::BreadthFirst,
            2,
            1,
            4,
            ZeroLevel::Zero0,
            Precision::Fp32,
        ),
        (
            ScheduleKind::Interleaved,
            2,
            2,
            2,
            ZeroLevel::Zero1,
            Precision::Fp32,
        ),
        (
            ScheduleKind::OneFOneB,
            3,
            1,
            2,
            ZeroLevel::Zero2,
            Precision::Bf16,
        ),
        (
            ScheduleKind::GPipe,
            1,
            1,
            4,
            ZeroLevel::Zero3,
            Precision::Fp32,
        ),
    ];
    for (kind, pp, loops, dp, zero, precision) in cases {
        let mut cfg = config(kind, pp, loops, dp, zero);
        cfg.precision = precision;
        let measured: Vec<_> = run(&cfg, 1)
            .last_step
            .iter()
            .map(|c| c.comm_bytes)
            .collect();
        let predicted = predicted_comm_bytes(&cfg);
        let layout = format!("{kind:?} pp {pp} loops {loops} dp {dp} {zero:?} {precision}");
        eprintln!("{layout}: measured {measured:?}");
        assert_eq!(
            measured, predicted,
            "{layout}: measured bytes ≠ the formulas'"
        );
        assert!(
            measured.iter().any(|b| b.data_parallel > 0),
            "{layout}: nothing reduced"
        );
        assert_eq!(
            measured.iter().any(|b| b.pipeline > 0),
            pp > 1,
            "{layout}: pipeline traffic where there is none, or none where there is"
        );
    }
}

#[test]
fn doubling_the_data_parallel_group_sends_one_and_a_half_times_the_bytes() {
    let per_rank = |dp: usize| {
        let cfg = config(ScheduleKind::GPipe, 1, 1, dp, ZeroLevel::Zero3);
        let bytes = run(&cfg, 1).last_step;
        let first = bytes[0].comm_bytes.data_parallel;
        assert!(bytes.iter().all(|b| b.comm_bytes.data_parallel == first));
        first as f64
    };
    let ratio = per_rank(4) / per_rank(2);
    // (4 − 1)/4 over (2 − 1)/2 of the same buffers: 1.5 up to the padding of one chunk.
    assert!(
        (ratio - 1.5).abs() < 1e-3,
        "dp 4 sends {ratio:.4}× the bytes of dp 2 per rank (a ring: 1.5; all to all: 3)"
    );
}
