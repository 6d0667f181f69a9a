//! The planner against brute force, the memory limit, and its explanations.

use super::search::{enumerate, evaluate, ScheduleCache, Simulated};
use super::*;
use crate::sim::{HardwareConfig, ModelConfig};

fn request(model: &str, gpus: usize, batch: usize) -> PlanRequest {
    let mut req = PlanRequest::new(
        ModelConfig::preset(model).unwrap(),
        HardwareConfig::preset("a100-80gb").unwrap(),
        gpus,
        batch,
    );
    // Keep the debug-build test small.
    req.limits.max_microbatches = 32;
    req
}

/// Simulate every enumerated layout that passes the memory bound: the bounds must hold for
/// each, and the pruned search must find the same best throughput per family.
#[test]
fn pruned_search_equals_brute_force_and_bounds_hold() {
    let req = request("gpt-1.3b", 8, 16);
    let plan = plan(&req, 5).unwrap();
    let mut cache = ScheduleCache::default();
    let mut brute: BTreeMap<Family, f64> = BTreeMap::new();
    let mut all = Vec::new();
    for l in enumerate(&req) {
        let b = bounds(&l, &req).unwrap();
        let sched = cache.get(&l, req.buffers).unwrap();
        let (score, fits) = match evaluate(&l, &sched, &req).unwrap() {
            Simulated::Fits(s) => (s, true),
            Simulated::OverMemory(s) => (s, false),
        };
        assert!(
            b.step_time_s <= score.step_time_s * (1.0 + 1e-9),
            "{l}: bound {} > simulated {}",
            b.step_time_s,
            score.step_time_s
        );
        assert!(
            b.memory_bytes <= score.peak_memory_bytes,
            "{l}: memory bound {} > simulated {}",
            b.memory_bytes,
            score.peak_memory_bytes
        );
        if fits {
            let e = brute.entry(l.family()).or_insert(0.0);
            *e = e.max(score.tokens_per_s);
            all.push(score.tokens_per_s);
        }
    }
    assert!(
        plan.stats.pruned > 0,
        "the bound pruned nothing: {:?}",
        plan.stats
    );
    for (family, tps) in &brute {
        let found = plan.best_per_family[family].score.tokens_per_s;
        assert!(
            (found - tps).abs() <= 1e-9 * tps,
            "{family}: {found} vs {tps}"
        );
    }
    all.sort_by(|a, b| b.total_cmp(a));
    let ranked: Vec<f64> = plan.ranked.iter().map(|c| c.score.tokens_per_s).collect();
    assert_eq!(ranked, all[..ranked.len()].to_vec());
}

#[test]
fn every_returned_layout_fits_and_the_ranking_is_by_throughput() {
    // 6.7B on 8 A100s: ZeRO-0 without pipelining needs 6.7e9 × 16 B ≈ 100 GiB, so the
    // memory limit has to reject layouts here.
    let req = request("gpt-6.7b", 8, 32);
    let plan = plan(&req, 10).unwrap();
    assert!(plan.stats.over_memory_bound + plan.stats.over_memory_simulated > 0);
    assert!(!plan.ranked.is_empty());
    for c in plan.ranked.iter().chain(plan.best_per_family.values()) {
        assert!(
            c.score.peak_memory_bytes <= req.hardware.memory_bytes,
            "{}",
            c.layout
        );
        assert_eq!(c.layout.gpus(), 8);
        assert_eq!(c.layout.global_batch(), 32);
        assert!(c.layout.rule_violation(&req).is_none());
    }
    assert!(plan
        .ranked
        .windows(2)
        .all(|w| w[0].score.tokens_per_s >= w[1].score.tokens_per_s));
    let family_best = plan
        .best_per_family
        .values()
        .map(|c| c.score.tokens_per_s)
        .fold(0.0, f64::max);
    assert_eq!(plan.ranked[0].score.tokens_per_s, family_best);
}

#[test]
fn a_model_too_big_for_any_layout_is_a_clear_error() {
    let req = request("gpt-52b", 2, 2);
    let err = plan(&req, 3).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, PlanError::NothingFits { .. }), "{text}");
    assert!(text.contains("GiB") && text.contains("more GPUs"), "{text}");
}

#[test]
fn explain_names_why_a_layout_is_rejected_or_slower() {
    let req = request("gpt-6.7b", 8, 32);
    // Pure data parallelism at ZeRO-0: every GPU holds the whole training state.
    let e = explain(&req, "pp=1,dp=8,zero=0,schedule=gpipe").unwrap();
    assert!(
        matches!(e.verdict, Verdict::OverMemory { .. }),
        "{}",
        e.text
    );
    assert!(e.text.contains("does not fit in memory"), "{}", e.text);
    assert!(e.text.contains("optimizer state"), "{}", e.text);

    let e = explain(&req, "pp=3,dp=2").unwrap();
    assert!(matches!(e.verdict, Verdict::NotAllowed(_)));
    assert!(e.text.contains("GPUs"), "{}", e.text);

    // A legal, fitting, slow layout: a two-rank 1F1B pipeline with recomputation.
    let e = explain(&req, "schedule=1f1b,pp=8,dp=1,mbs=4,recompute=true").unwrap();
    let Verdict::Runs { score, best } = &e.verdict else {
        panic!("{}", e.text)
    };
    let best = best.as_ref().unwrap();
    assert!(best.score.tokens_per_s > score.tokens_per_s, "{}", e.text);
    assert!(
        e.text.contains("slower") && e.text.contains("mostly"),
        "{}",
        e.text
    );

    let err = explain(&req, "pp=eight").unwrap_err().to_string();
    assert!(err.contains("whole number"), "{err}");
}

#[test]
fn layouts_read_back_their_text() {
    let req = request("gpt-1.3b", 8, 16);
    for l in enumerate(&req).into_iter().step_by(7) {
        assert_eq!(Layout::parse(&l.to_string(), &req).unwrap(), l);
    }
    let l = Layout::parse("pp=2,loops=3,family=megatron", &req).unwrap();
    assert_eq!((l.dp, l.microbatches), (4, 4));
    assert_eq!(l.family(), Family::Megatron);
    assert_eq!(l.schedule, crate::schedule::ScheduleKind::Interleaved);
}
