//! Failure handling of the engine beyond errors and panics: a step whose loss or gradient is
//! NaN (both policies), and a rank slower than the communication timeout.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn_bfpp::engine::{
    infallible, CheckpointSink, Checkpointing, EngineError, Fault, FaultKind, NonFinitePolicy,
    RankState, SeenOn, Trainer,
};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;

/// Keeps every rank's saved state in memory.
#[derive(Default)]
struct MemorySink {
    states: Mutex<Vec<(usize, RankState)>>,
}

impl CheckpointSink for MemorySink {
    fn write_rank(&self, rank: usize, state: &RankState) -> Result<(), String> {
        self.states
            .lock()
            .map_err(|e| e.to_string())?
            .push((rank, state.clone()));
        Ok(())
    }

    fn commit(&self, _step: usize) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_skipped_step_leaves_weights_and_optimizer_state_untouched_on_every_rank() {
    let base = model();
    // ZeRO-0 with two replicas: the norm's data-parallel sum counts replica 0 only.
    for zero in [ZeroLevel::Zero0, ZeroLevel::Zero3] {
        let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, 2, zero);
        let clean = train_for(&base, &cfg, 1).expect("runs");

        // World rank 2 (pipeline rank 0 of replica 1) holds no last stage: only its
        // gradients are poisoned, and the data-parallel reduction spreads them.
        let fault = Fault {
            rank: 2,
            step: 2,
            kind: FaultKind::NonFinite,
        };
        cfg.on_nonfinite = NonFinitePolicy::Skip;
        let reported = Mutex::new(Vec::new());
        let sink = MemorySink::default();
        let saving = Checkpointing {
            every: 2,
            sink: Some(&sink),
            ..Checkpointing::default()
        };
        let skipped = Trainer::new(cfg)
            .stop_after(2)
            .inject_fault(fault)
            .on_step(|r| reported.lock().expect("lock").push((r.step, r.skipped)))
            .checkpointing(saving)
            .fit(base.clone(), infallible(batch))
            .expect("a skipped step does not stop the run");
        assert_eq!(skipped.skipped_steps, vec![2], "{zero:?}");
        assert_eq!(
            reported.into_inner().expect("lock"),
            vec![(1, false), (2, true)]
        );
        assert_eq!(skipped.losses[0].to_bits(), clean.losses[0].to_bits());
        // Only gradients were poisoned: the step's loss (of the step-1 weights) is finite.
        assert!(skipped.losses[1].is_finite(), "{:?}", skipped.losses);
        // Step 2 changed nothing: the weights are those after step 1, bit for bit ...
        assert_eq!(params(&skipped.model), params(&clean.model), "{zero:?}");
        // ... and no rank's AdamW advanced its step count past step 1.
        let states = sink.states.into_inner().expect("lock");
        assert_eq!(states.len(), 4, "every rank saved step 2");
        for (rank, state) in &states {
            for stage in &state.stages {
                assert_eq!(
                    stage.optimizer_steps, 1,
                    "rank {rank} stage {}",
                    stage.stage
                );
            }
        }
    }
}

#[test]
fn a_non_finite_loss_stops_every_rank_naming_the_step_and_the_rank() {
    let base = model();
    let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, 2, ZeroLevel::Zero1);
    cfg.comm_timeout_secs = 30.0;
    // World rank 3 holds the last stage (3) of replica 1: its losses become NaN.
    let fault = Fault {
        rank: 3,
        step: 2,
        kind: FaultKind::NonFinite,
    };
    let steps_seen = Mutex::new(Vec::new());
    let start = Instant::now();
    let err = Trainer::new(cfg)
        .inject_fault(fault)
        .on_step(|r| steps_seen.lock().expect("lock").push(r.step))
        .fit(base, infallible(batch))
        .expect_err("the default policy stops");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}: some rank waited for the timeout",
        start.elapsed()
    );
    match &err {
        EngineError::NonFinite { step, report, .. } => {
            assert_eq!(*step, 2);
            assert!(
                report.loss.contains(&SeenOn { rank: 3, stage: 3 }),
                "{report:?}"
            );
        }
        other => panic!("expected NonFinite, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("step 2") && msg.contains("rank 3 (stage 3)"),
        "{msg}"
    );
    assert_eq!(steps_seen.into_inner().expect("lock"), vec![1]);
}

#[test]
fn a_rank_slower_than_the_timeout_is_named_by_the_ranks_that_give_up() {
    let base = model();
    let mut cfg = config(ScheduleKind::BreadthFirst, 2, 2, 2, ZeroLevel::Zero3);
    cfg.comm_timeout_secs = 0.5;
    let sleep = Duration::from_secs(2);
    let fault = Fault {
        rank: 1,
        step: 2,
        kind: FaultKind::Sleep(sleep),
    };
    let start = Instant::now();
    let err = Trainer::new(cfg)
        .inject_fault(fault)
        .fit(base, infallible(batch))
        .expect_err("a stalled rank stops the run");
    let took = start.elapsed();
    // Every rank stops once the sleeper wakes (its next call fails at once).
    assert!(took < sleep + Duration::from_secs(5), "took {took:?}");
    let msg = err.to_string();
    assert!(msg.contains("timed out"), "{msg}");
    assert!(
        msg.contains("waiting for rank 1 (") && msg.contains("rank 1 is not waiting on anybody")
            || msg.contains("ends at rank 1,"),
        "the message must name rank 1 as the stalled one: {msg}"
    );
}

/// Communicators made by the caller (the path `NcclComm` takes) train exactly like the ones
/// the default thread world makes; communicators of another grid are refused with the layout
/// named.
#[test]
fn caller_made_communicators_train_like_the_default_world_and_must_match_the_grid() {
    use burn_bfpp::comm::{CommConfig, LocalComm, RankGrid};

    let base = model();
    let cfg = config(ScheduleKind::BreadthFirst, 2, 2, 2, ZeroLevel::Zero3).with_steps(2);
    let expected = train(&base, &cfg).expect("runs");
    let config = CommConfig::with_timeout(Duration::from_secs(30));
    let comms = LocalComm::create(RankGrid::new(2, 2).expect("grid"), config);
    let got = Trainer::new(cfg.clone())
        .with_comms(comms)
        .fit(base.clone(), infallible(batch))
        .expect("runs");
    assert_eq!(got.losses, expected.losses);
    assert_eq!(params(&got.model), params(&expected.model));

    let wrong = LocalComm::create(RankGrid::new(4, 1).expect("grid"), config);
    let refused = Trainer::new(cfg)
        .with_comms(wrong)
        .fit(base, infallible(batch));
    let Err(err) = refused else {
        panic!("a 4 × 1 world for a 2 × 2 layout must be refused");
    };
    assert!(err.to_string().contains("pp=2 × dp=2"), "{err}");
}
