//! Checks of the Megatron-LM lowering, of the strategy rules, and of the memory log.

use super::*;
use crate::schedule::{validate, ActionKind, ProgramSpec, ScheduleKind, ScheduleSpec, ZeroLevel};
use crate::viz::MemorySeries;

/// The lowered programs of `spec` at `zero` with the default buffers.
fn build_schedule(
    spec: &ScheduleSpec,
    zero: ZeroLevel,
    strategy: Strategy,
) -> Result<crate::schedule::PipelineSchedule, SimError> {
    build_program(&ProgramSpec::new(spec.clone(), zero), strategy).map(|p| p.lowered)
}

fn gpt_cfg(model: &str, dp: usize, zero: ZeroLevel) -> SimConfig {
    let mut cfg = SimConfig::new(
        ModelConfig::preset(model).unwrap(),
        HardwareConfig::preset("a100-80gb").unwrap(),
    );
    cfg.dp = dp;
    cfg.zero = zero;
    cfg
}

#[test]
fn megatron_lists_validate_with_collectives_at_the_step_boundary() {
    for (kind, v, m) in [
        (ScheduleKind::OneFOneB, 1, 6),
        (ScheduleKind::Interleaved, 2, 6),
        (ScheduleKind::Interleaved, 3, 9),
    ] {
        let spec = ScheduleSpec::new(kind, 3, v, m);
        let sched = build_schedule(&spec, ZeroLevel::Zero1, Strategy::Megatron).unwrap();
        validate(&sched).unwrap();
        for list in &sched.ranks {
            let first_compute = list.iter().position(|a| a.kind.is_compute()).unwrap();
            let last_compute = list.iter().rposition(|a| a.kind.is_compute()).unwrap();
            for (i, a) in list.iter().enumerate() {
                match a.kind {
                    ActionKind::Unshard => assert!(i < first_compute, "{kind}: {a} at {i}"),
                    ActionKind::ReduceGrad => assert!(i > last_compute, "{kind}: {a} at {i}"),
                    _ => {}
                }
            }
            let reduces = list
                .iter()
                .filter(|a| a.kind == ActionKind::ReduceGrad)
                .count();
            assert_eq!(reduces, v, "{kind}: one reduction per local stage");
        }
    }
}

/// Deferring every reduction to the end of the backward can only delay it, so Megatron-LM's
/// step is never shorter than the early-reduce lowering of the same schedule, and where the
/// reduction is slow (D = 32 over InfiniBand) and there are other stages' backwards to hide it
/// behind (V > 1), it is strictly longer with strictly more exposed data-parallel time.
#[test]
fn megatron_exposes_the_reduction_that_early_reduce_overlaps() {
    for (p, v, m, dp) in [(2, 2, 4, 4), (4, 2, 8, 32), (2, 4, 8, 32), (4, 1, 8, 32)] {
        let kind = if v == 1 {
            ScheduleKind::OneFOneB
        } else {
            ScheduleKind::Interleaved
        };
        let spec = ScheduleSpec::new(kind, p, v, m);
        let cfg = gpt_cfg("gpt-1.3b", dp, ZeroLevel::Zero1);
        let run = |strategy| {
            let sched = build_schedule(&spec, ZeroLevel::Zero1, strategy).unwrap();
            simulate(&sched, &cfg).unwrap()
        };
        let (bfpp, megatron) = (run(Strategy::Bfpp), run(Strategy::Megatron));
        let eps = 1e-9 * bfpp.step_time_s;
        assert!(
            megatron.step_time_s >= bfpp.step_time_s - eps,
            "P={p} V={v} D={dp}: megatron {} < bfpp {}",
            megatron.step_time_s,
            bfpp.step_time_s
        );
        assert!(megatron.exposed_dp_s >= bfpp.exposed_dp_s - eps);
        if v > 1 && dp == 32 {
            assert!(
                megatron.exposed_dp_s > bfpp.exposed_dp_s * 1.05
                    && megatron.step_time_s > bfpp.step_time_s,
                "P={p} V={v}: megatron exposed {} vs bfpp {}",
                megatron.exposed_dp_s,
                bfpp.exposed_dp_s
            );
        }
        // Same lists apart from where the collectives sit: the same memory and counts.
        assert_eq!(megatron.all_gathers, bfpp.all_gathers);
        assert_eq!(megatron.reduce_scatters, bfpp.reduce_scatters);
    }
}

#[test]
fn strategy_rules_name_the_fix() {
    let err = |spec: ScheduleSpec, zero| {
        build_schedule(&spec, zero, Strategy::Megatron)
            .unwrap_err()
            .to_string()
    };
    let bf = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 4);
    assert!(err(bf, ZeroLevel::Zero1).contains("--schedule interleaved"));
    let df = ScheduleSpec::new(ScheduleKind::Interleaved, 2, 2, 4);
    assert!(err(df, ZeroLevel::Zero3).contains("--zero 1"));
    let mut cfg = gpt_cfg("gpt-52b", 1, ZeroLevel::Zero1);
    cfg.tp = 16;
    let msg = Strategy::Megatron
        .check_config(&cfg)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("--tp 8"), "{msg}");
    assert!(Strategy::Bfpp.check_config(&cfg).is_ok());
    assert_eq!("Megatron".parse::<Strategy>().unwrap(), Strategy::Megatron);
    assert!("zero-bubble".parse::<Strategy>().is_err());
}

/// The exposed log reproduces the peak: its running maximum is `peak_memory_bytes`, and the
/// curve ends where it started (everything allocated during the step is freed).
#[test]
fn memory_log_reproduces_the_peak_and_returns_to_the_static_state() {
    for (kind, v, m, zero) in [
        (ScheduleKind::BreadthFirst, 2, 8, ZeroLevel::Zero3),
        (ScheduleKind::Interleaved, 2, 8, ZeroLevel::Zero2),
        (ScheduleKind::OneFOneB, 1, 8, ZeroLevel::Zero0),
    ] {
        let sched =
            build_schedule(&ScheduleSpec::new(kind, 4, v, m), zero, Strategy::Bfpp).unwrap();
        let r = simulate(&sched, &gpt_cfg("gpt-1.3b", 4, zero)).unwrap();
        let series = MemorySeries::from_sim(&r);
        assert_eq!(series.len(), 4);
        for (s, (log, &peak)) in series.iter().zip(r.memory.iter().zip(&r.peak_memory_bytes)) {
            assert_eq!(s.peak(), peak, "{kind} rank {}", s.rank);
            assert!(
                peak > log.static_bytes,
                "{kind}: activations add to the state"
            );
            assert_eq!(s.points.last().unwrap().1, log.static_bytes, "{kind}");
            assert!(log.changes.windows(2).all(|w| w[0].0 <= w[1].0));
        }
    }
}
