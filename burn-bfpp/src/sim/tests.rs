//! Checks of the simulator against the closed forms of the reference, hand-computed memory,
//! and the JSON contract.

use proptest::prelude::*;

use super::*;
use crate::schedule::{
    lower_data_parallel, lower_p2p, ActionKind, DataParallelLowering, PipelineSchedule,
    ScheduleKind, ScheduleSpec, ZeroLevel,
};

fn lowered(kind: ScheduleKind, p: usize, v: usize, m: usize, zero: ZeroLevel) -> PipelineSchedule {
    let s = ScheduleSpec::new(kind, p, v, m).generate().unwrap();
    lower_data_parallel(&lower_p2p(&s).unwrap(), &DataParallelLowering::new(zero)).unwrap()
}

fn unit(backward_ratio: f64, zero: ZeroLevel) -> SimConfig {
    let mut cfg = SimConfig::unit();
    cfg.model = ModelConfig::Unit(UnitModel {
        backward_ratio,
        ..UnitModel::default()
    });
    cfg.zero = zero;
    cfg
}

/// The reference's bubble closed forms, zero latency. The zero-bubble schedules' are for the
/// cost model they are generated in (F = I = W = 1, backward ratio 2), from their makespans
/// over the 3·V·M units of work:
/// * ZB-H1: 3M + (P − 1) (Qi et al. 2023, §3: (P − 1)(F + I − W)); with M < P the warm-up
///   chain dominates, 2M + 2P − 1.
/// * interleaved zero-bubble: 3VM + (P − 1) for M ≥ 2P; at M = P, where its warm-up runs
///   every forward first, 3VM + 2(P − 1).
/// * ZB-V (two stages per rank, M a multiple of P): 3VM + (P − 1), V = 2.
/// * ZB-V (two stages per rank, M a multiple of P): 3VM + (P − 1), V = 2.
/// * breadth-first zero-bubble: the forward and input-gradient chains cost P − 1 each and only
///   the weight passes fill, 3VM + 2(P − 1); with M < P the chains over V·P stages dominate,
///   2(VP + M − 1) + VM.
fn expected_bubble(kind: ScheduleKind, p: usize, v: usize, m: usize) -> f64 {
    let (pf, vf, mf) = (p as f64, v as f64, m as f64);
    let work = 3.0 * vf * mf;
    match kind {
        ScheduleKind::ZeroBubbleH1 => {
            let makespan = (3.0 * mf + pf - 1.0).max(2.0 * mf + 2.0 * pf - 1.0);
            return makespan / work - 1.0;
        }
        ScheduleKind::InterleavedZeroBubble => {
            let chains = if m == p { 2.0 } else { 1.0 };
            return (work + chains * (pf - 1.0)) / work - 1.0;
        }
        ScheduleKind::BreadthFirstZeroBubble => {
            let makespan = (work + 2.0 * (pf - 1.0)).max(2.0 * (vf * pf + mf - 1.0) + vf * mf);
            return makespan / work - 1.0;
        }
        ScheduleKind::ZeroBubbleV => return (pf - 1.0) / work,
        // The simulator runs a pair's halves one after the other, as the engine does, so the
        // second half's input may arrive while the first runs: ZB-V's bubble. (The
        // validator's unit replay starts a pair only when both inputs are there: 2(P − 1).)
        ScheduleKind::DualPipeV => return (pf - 1.0) / work,
        _ => {}
    }
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => (pf - 1.0) / mf,
        ScheduleKind::BreadthFirst if m < p => {
            // step = (V·P + M − 1)·(t_f + t_b)/V, ideal = M·(t_f + t_b).
            (vf * pf + mf - 1.0) / (vf * mf) - 1.0
        }
        _ => (pf - 1.0) / (vf * mf),
    }
}

/// A valid (kind, P, V, M) for the generators, or `None`.
fn layout(kind: ScheduleKind, p: usize, v: usize, m: usize) -> Option<(usize, usize, usize)> {
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 => {
            Some((p, 1, m))
        }
        // Megatron-LM's interleaving needs M to be a multiple of P.
        ScheduleKind::Interleaved | ScheduleKind::InterleavedZeroBubble => {
            let m = (m.div_ceil(p) * p).min(32 / p * p);
            Some((p, v, m))
        }
        ScheduleKind::BreadthFirst | ScheduleKind::BreadthFirstZeroBubble => Some((p, v, m)),
        ScheduleKind::ZeroBubbleV => Some((p, 2, (m.div_ceil(p) * p).min(32 / p * p))),
        ScheduleKind::DualPipeV => Some((p, 2, m.max(2 * p))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn unit_bubble_matches_closed_forms_for_every_schedule(
        kind_index in 0usize..ScheduleKind::ALL.len(),
        p in 1usize..=8,
        v in 1usize..=4,
        m in 1usize..=32,
        ratio in prop::sample::select(vec![0.5, 1.0, 2.0, 3.0]),
        zero in prop::sample::select(vec![ZeroLevel::Zero0, ZeroLevel::Zero3]),
    ) {
        let kind = ScheduleKind::ALL[kind_index];
        let (p, v, m) = layout(kind, p, v, m).unwrap();
        // The split schedules' orders are made for F = I = W = 1.
        let ratio = if kind.splits_backward() { 2.0 } else { ratio };
        let sched = lowered(kind, p, v, m, zero);
        let r = simulate(&sched, &unit(ratio, zero)).unwrap();
        let want = expected_bubble(kind, p, v, m);
        prop_assert!(
            (r.bubble_fraction - want).abs() < 1e-9,
            "{kind} P={p} V={v} M={m} ratio={ratio}: simulated {} vs closed form {want}",
            r.bubble_fraction
        );
        // Unit communication is free: nothing is exposed.
        prop_assert_eq!(r.exposed_p2p_s, 0.0);
        prop_assert_eq!(r.exposed_dp_s, 0.0);
    }

    #[test]
    fn unit_peak_activations_match_closed_forms(
        kind_index in 0usize..ScheduleKind::ALL.len(),
        p in 1usize..=8,
        v in 1usize..=4,
        m in 1usize..=32,
    ) {
        let kind = ScheduleKind::ALL[kind_index];
        let (p, v, m) = layout(kind, p, v, m).unwrap();
        let r = simulate(&lowered(kind, p, v, m, ZeroLevel::Zero0), &unit(2.0, ZeroLevel::Zero0))
            .unwrap();
        let acts = &r.peak_activation_microbatches;
        match kind {
            ScheduleKind::GPipe => prop_assert!(acts.iter().all(|&a| a == m as f64), "{acts:?}"),
            ScheduleKind::OneFOneB => prop_assert_eq!(acts[0], m.min(p) as f64),
            ScheduleKind::BreadthFirst | ScheduleKind::BreadthFirstZeroBubble => {
                prop_assert!(acts.iter().all(|&a| a == m as f64), "{acts:?}")
            }
            // 1F1B's P − r plus at most r pending weight passes: 1F1B's peak, on every rank.
            ScheduleKind::ZeroBubbleH1 => {
                prop_assert!(acts.iter().all(|&a| a <= m.min(p) as f64), "{acts:?}");
                prop_assert_eq!(acts[0], m.min(p) as f64);
            }
            // At most P micro-batches enter each rank before their first stage's W: P per
            // stage, 2P in all.
            ScheduleKind::ZeroBubbleV => {
                prop_assert!(acts.iter().all(|&a| a <= 2.0 * p as f64), "{acts:?}")
            }
            ScheduleKind::Interleaved | ScheduleKind::InterleavedZeroBubble => {}
            // At its peak every rank holds 2P + 1 stage-activations of half a micro-batch
            // each, whatever M.
            ScheduleKind::DualPipeV => {
                prop_assert!(acts.iter().all(|&a| a == p as f64 + 0.5), "{acts:?}")
            }
        }
    }
}

#[test]
fn bubble_does_not_depend_on_the_backward_ratio() {
    // The split schedules place their weight passes for one ratio (F = I = W = 1), so their
    // bubble does depend on it.
    for kind in ScheduleKind::ALL
        .into_iter()
        .filter(|k| !k.splits_backward())
    {
        let (p, v, m) = layout(kind, 4, 3, 6).unwrap();
        let sched = lowered(kind, p, v, m, ZeroLevel::Zero3);
        let bubbles: Vec<f64> = [0.5, 1.0, 2.0, 3.5]
            .iter()
            .map(|&ratio| {
                simulate(&sched, &unit(ratio, ZeroLevel::Zero3))
                    .unwrap()
                    .bubble_fraction
            })
            .collect();
        assert!(
            bubbles.iter().all(|b| (b - bubbles[0]).abs() < 1e-12),
            "{kind}: {bubbles:?}"
        );
    }
}

/// One rank (P = 1) with two stages (V = 2) of 1000 parameters each, M = 2 breadth-first,
/// D = 4, bf16, 100 activation bytes per stage and micro-batch, two gradient buffers.
///
/// Static state with Ψ = 2000 parameters on the rank, shard = 1000/4 = 250 per stage
/// (500 on the rank), bytes per parameter 2 (weights) + 2 (grads) + 12 (Adam):
/// - ZeRO-0: 2000·(2 + 2 + 12) = 32 000.
/// - ZeRO-1: 2000·2 + 2000·2 + 500·12 = 4000 + 4000 + 6000 = 14 000.
/// - ZeRO-2: 2000·2 + 500·2 + 500·12 = 4000 + 1000 + 6000 = 11 000.
/// - ZeRO-3: 500·2 + 500·2 + 500·12 = 1000 + 1000 + 6000 = 8000.
///
/// Timeline (unit times): F(0,0) 0–1, F(0,1) 1–2, F(1,0) 2–3, F(1,1) 3–4, B(1,0) 4–6, …
/// At t = 4 all V·M = 4 activations are live (400 bytes). Dynamic peak at t = 4:
/// - ZeRO-0/1: activations only, 400.
/// - ZeRO-2: + stage 1's full gradient buffer opened by B(1,0), 1000·2 = 2000 → 2400.
/// - ZeRO-3: + both stages' gathered weights (two buffers, both stages stay resident),
///   2·1000·2 = 4000 → 6400.
#[test]
fn memory_by_zero_level_matches_hand_arithmetic() {
    let expected = [
        (ZeroLevel::Zero0, 32_000 + 400),
        (ZeroLevel::Zero1, 14_000 + 400),
        (ZeroLevel::Zero2, 11_000 + 2400),
        (ZeroLevel::Zero3, 8000 + 6400),
    ];
    for (zero, bytes) in expected {
        let mut cfg = unit(2.0, zero);
        cfg.dp = 4;
        cfg.model = ModelConfig::Unit(UnitModel {
            stage_parameters: 1000,
            stage_activation_bytes: 100,
            ..UnitModel::default()
        });
        let r = simulate(&lowered(ScheduleKind::BreadthFirst, 1, 2, 2, zero), &cfg).unwrap();
        assert_eq!(r.peak_memory_bytes, vec![bytes], "ZeRO-{}", zero.number());
    }
}

#[test]
fn json_has_exactly_the_documented_keys() {
    let r = simulate(
        &lowered(ScheduleKind::BreadthFirst, 2, 2, 4, ZeroLevel::Zero3),
        &unit(2.0, ZeroLevel::Zero3),
    )
    .unwrap();
    let text = r.to_json().to_string();
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut keys: Vec<&str> = parsed
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    let mut want = JSON_KEYS.to_vec();
    want.sort_unstable();
    assert_eq!(keys, want);
    for k in [
        "peak_memory_bytes",
        "peak_activation_microbatches",
        "all_gathers",
        "reduce_scatters",
    ] {
        assert_eq!(parsed[k].as_array().unwrap().len(), 2, "{k}");
    }
    // Two weight buffers hold both local stages: each is gathered once and kept.
    assert_eq!(parsed["all_gathers"][0], 2);
    assert_eq!(parsed["reduce_scatters"][0], 2);
}

#[test]
fn presets_load_and_unknown_names_list_the_valid_ones() {
    for name in MODEL_PRESETS {
        ModelConfig::preset(name).unwrap().check().unwrap();
    }
    for name in HARDWARE_PRESETS {
        HardwareConfig::preset(name).unwrap().check().unwrap();
    }
    let err = ModelConfig::preset("gpt-9t").unwrap_err().to_string();
    assert!(err.contains("gpt-52b") && err.contains("unit"), "{err}");
    let err = HardwareConfig::preset("tpu").unwrap_err().to_string();
    assert!(err.contains("h200-141gb"), "{err}");
}

#[test]
fn gpu_names_map_to_the_presets_of_their_parts_only() {
    // Names as `nvidia-smi --query-gpu=name` prints them.
    for (gpu, preset) in [
        ("NVIDIA H200", Some("h200-141gb")),
        ("NVIDIA H100 80GB HBM3", Some("h100-80gb")),
        ("NVIDIA A100-SXM4-80GB", Some("a100-80gb")),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA A100 80GB PCIe", None),
        ("NVIDIA GeForce RTX 4090", None),
    ] {
        assert_eq!(HardwareConfig::preset_for_gpu_name(gpu), preset, "{gpu}");
    }
}

#[test]
fn gpt_formulas_agree_with_each_other() {
    let ModelConfig::Gpt(g) = ModelConfig::preset("gpt-52b").unwrap() else {
        unreachable!()
    };
    // 12·L·h² ≈ 51.5 B plus embeddings.
    let params = g.layers as u64 * g.layer_parameters() + g.embedding_parameters();
    assert!((51.0e9..53.0e9).contains(&(params as f64)), "{params}");
    // Per-layer and head FLOPs, times 3 for forward + backward, give the step formula.
    let b = 4;
    let per_step = 3.0 * (g.layers as f64 * g.layer_forward_flops(b) + g.head_forward_flops(b));
    let formula = g.step_model_flops(b);
    assert!((per_step / formula - 1.0).abs() < 1e-12);
    // The GEMM list covers exactly the layer's FLOPs, for any tensor-parallel size.
    for t in [1, 2, 8] {
        let gemm: f64 = g
            .layer_gemms(b, t)
            .iter()
            .map(|&(m, n, k, batch)| 2.0 * (m * n * k * batch) as f64)
            .sum();
        assert!((gemm * t as f64 / g.layer_forward_flops(b) - 1.0).abs() < 1e-12);
    }
    // Korthikanti et al.: 34 + 5·a·s/h bytes per s·b·h at t = 1, 34 with flash attention.
    let sbh = (g.sequence * g.hidden) as f64;
    let full = g.layer_activation_bytes(1, 1, false, false) / sbh;
    let five_as_h = 5.0 * (g.heads * g.sequence) as f64 / g.hidden as f64;
    assert!((full - 34.0 - five_as_h).abs() < 1e-9);
    assert_eq!(g.layer_activation_bytes(1, 1, true, false) / sbh, 34.0);
    assert_eq!(g.layer_activation_bytes(1, 1, true, true) / sbh, 2.0);
}

#[test]
fn toml_configs_read_presets_and_inline_tables() {
    let cfg = SimConfig::from_toml_str(
        r#"
        model = "gpt-52b"
        hardware = "a100-80gb"
        dp = 8
        zero = 3
        recompute = true
        dtype = "bf16"
        "#,
    )
    .unwrap();
    assert_eq!(
        (cfg.dp, cfg.zero, cfg.recompute),
        (8, ZeroLevel::Zero3, true)
    );
    let cfg = SimConfig::from_toml_str(
        r#"
        hardware = "h100-80gb"
        [model]
        kind = "unit"
        backward_ratio = 3.0
        "#,
    )
    .unwrap();
    assert_eq!(
        cfg.model,
        ModelConfig::Unit(UnitModel {
            backward_ratio: 3.0,
            ..UnitModel::default()
        })
    );
    let model = ModelConfig::from_toml_str(
        "kind = \"gpt\"\nlayers = 2\nhidden = 64\nheads = 4\nsequence = 16\nvocabulary = 128\n",
    )
    .unwrap();
    assert!(matches!(
        model,
        ModelConfig::Gpt(GptShape { layers: 2, .. })
    ));
    for bad in [
        "model = \"gpt-9t\"\nhardware = \"h100-80gb\"",
        "model = \"unit\"\nhardware = \"h100-80gb\"\nzero = 4",
        "model = \"unit\"\nhardware = \"h100-80gb\"\ndp = 0",
        "model = \"unit\"\nhardware = \"h100-80gb\"\nbogus = 1",
    ] {
        assert!(SimConfig::from_toml_str(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_gpt_step_on_real_hardware_is_plausible() {
    let mut cfg = SimConfig::new(
        ModelConfig::preset("gpt-52b").unwrap(),
        HardwareConfig::preset("a100-80gb").unwrap(),
    );
    cfg.dp = 8;
    cfg.zero = ZeroLevel::Zero3;
    let sched = lowered(ScheduleKind::BreadthFirst, 8, 4, 16, ZeroLevel::Zero3);
    let r = simulate(&sched, &cfg).unwrap();
    assert!(r.step_time_s > 0.0 && r.step_time_s.is_finite());
    assert!(
        r.mfu > 0.0 && r.mfu < cfg.hardware.gemm_efficiency,
        "{}",
        r.mfu
    );
    assert!(r.bubble_fraction > 0.0);
    assert!(r.exposed_p2p_s >= 0.0 && r.exposed_dp_s >= 0.0);
    assert!(r.exposed_p2p_s + r.exposed_dp_s < r.step_time_s);
    assert!(r.peak_memory_bytes.iter().all(|&b| b > 0));
    // Breadth-first: at most 2·V gathers and exactly V reductions per rank.
    assert!(r.all_gathers.iter().all(|&g| g <= 8));
    assert!(r.reduce_scatters.iter().all(|&g| g == 4));
    // The trace covers every action once, plus the optimizer step.
    let traced: usize = r
        .trace
        .iter()
        .map(|t| t.compute.len() + t.p2p.len() + t.dp.len())
        .sum();
    let actions: usize = sched.ranks.iter().map(Vec::len).sum();
    assert_eq!(traced, actions + sched.num_ranks());
}

#[test]
fn unlowered_or_mismatched_schedules_are_refused() {
    let raw = ScheduleSpec::new(ScheduleKind::GPipe, 2, 1, 2)
        .generate()
        .unwrap();
    assert!(matches!(
        simulate(&raw, &unit(2.0, ZeroLevel::Zero0)),
        Err(SimError::Schedule(_))
    ));
    let z3 = lowered(ScheduleKind::GPipe, 2, 1, 2, ZeroLevel::Zero3);
    assert!(matches!(
        simulate(&z3, &unit(2.0, ZeroLevel::Zero0)),
        Err(SimError::Schedule(_))
    ));
    let mut too_few = unit(2.0, ZeroLevel::Zero3);
    too_few.grad_buffers = 1;
    // Interleaved keeps two stages' gradients open at once; one buffer cannot hold them.
    let interleaved = lowered(ScheduleKind::Interleaved, 2, 4, 4, ZeroLevel::Zero3);
    assert!(matches!(
        simulate(&interleaved, &too_few),
        Err(SimError::Schedule(_))
    ));
}

/// The acceptance size: P = 64, V = 8, M = 512, D = 8, ZeRO-3 must simulate in under 1 s in
/// release. Run with `cargo test --release -p burn-bfpp sim::tests::large -- --ignored --nocapture`.
#[test]
#[ignore]
fn large_schedule_simulates_quickly() {
    let sched = lowered(ScheduleKind::BreadthFirst, 64, 8, 512, ZeroLevel::Zero3);
    let model = ModelConfig::Gpt(GptShape {
        layers: 512,
        hidden: 8192,
        heads: 64,
        sequence: 2048,
        vocabulary: 51200,
    });
    let mut cfg = SimConfig::new(model, HardwareConfig::preset("h100-80gb").unwrap());
    cfg.dp = 8;
    cfg.zero = ZeroLevel::Zero3;
    let start = std::time::Instant::now();
    let r = simulate(&sched, &cfg).unwrap();
    let took = start.elapsed();
    println!(
        "P=64 V=8 M=512 D=8 ZeRO-3: simulated in {took:?}; step {:.3} s, MFU {:.3}",
        r.step_time_s, r.mfu
    );
    assert!(took.as_secs_f64() < 1.0, "{took:?}");
}

/// GPipe, P = 2, M = 2, unit forward 1 and backward 2, every transfer 0.5.
///
/// Overlapped (sends on their own stream): F(0,0) 0–1 and F(0,1) 1–2 on rank 0, arriving at
/// 1.5 and 2.5; rank 1 runs F 1.5–2.5 and 2.5–3.5, B(1,0) 3.5–5.5 and B(1,1) 5.5–7.5, whose
/// gradients arrive at 6 and 8; rank 0 runs B 6–8 and 8–10. Step: 10.
///
/// Serial (one thread per rank): rank 0's second forward waits for the first send, 1.5–2.5,
/// its send ends at 3; rank 1 runs F 1.5–2.5 and 3–4, B(1,0) 4–6, sends until 6.5, B(1,1)
/// 6.5–8.5, sends until 9; rank 0 runs B 6.5–8.5 and 9–11. Step: 11.
#[test]
fn serial_execution_puts_sends_on_the_compute_thread() {
    let sched = lowered(ScheduleKind::GPipe, 2, 1, 2, ZeroLevel::Zero0);
    let mut cfg = unit(2.0, ZeroLevel::Zero0);
    let mut costs = CostTable::new(&cfg, &sched.stage_ranks, 2, 2).unwrap();
    costs.transfer = vec![0.5; 2];
    let overlapped = simulate_costed(&sched, &cfg, &costs, None).unwrap();
    assert!(
        (overlapped.step_time_s - 10.0).abs() < 1e-12,
        "{}",
        overlapped.step_time_s
    );
    cfg.execution = Execution::Serial;
    let serial = simulate_costed(&sched, &cfg, &costs, None).unwrap();
    assert!(
        (serial.step_time_s - 11.0).abs() < 1e-12,
        "{}",
        serial.step_time_s
    );
    // A receive's own duration (unpacking the message) also holds the rank in serial mode:
    // 0.25 on each of rank 0's two gradient receives delays its backwards to 6.75–8.75 and
    // 9.25–11.25.
    let mut measured = ActionDurations::new();
    for list in &sched.ranks {
        for a in list.iter().filter(|a| a.kind == ActionKind::RecvBackward) {
            measured.insert(*a, 0.25);
        }
    }
    let unpacking = simulate_costed(&sched, &cfg, &costs, Some(&measured)).unwrap();
    assert!(
        (unpacking.step_time_s - 11.25).abs() < 1e-12,
        "{}",
        unpacking.step_time_s
    );
}

#[test]
fn ranks_start_when_the_cost_table_says() {
    let sched = lowered(ScheduleKind::GPipe, 2, 1, 2, ZeroLevel::Zero0);
    let cfg = unit(2.0, ZeroLevel::Zero0);
    let mut costs = CostTable::new(&cfg, &sched.stage_ranks, 2, 2).unwrap();
    let together = simulate_costed(&sched, &cfg, &costs, None).unwrap();
    // Rank 1 starting late changes nothing while it would only wait; rank 0 starting late
    // delays everything.
    costs.start = vec![0.0, 1.0];
    let late_receiver = simulate_costed(&sched, &cfg, &costs, None).unwrap();
    assert_eq!(late_receiver.step_time_s, together.step_time_s);
    costs.start = vec![3.0, 0.0];
    let late_sender = simulate_costed(&sched, &cfg, &costs, None).unwrap();
    assert!((late_sender.step_time_s - together.step_time_s - 3.0).abs() < 1e-12);
    costs.start = vec![0.0];
    let err = simulate_costed(&sched, &cfg, &costs, None).unwrap_err();
    assert!(err.to_string().contains("`start` has 1 entries"), "{err}");
    costs.start = vec![0.0, f64::NAN];
    let err = simulate_costed(&sched, &cfg, &costs, None).unwrap_err();
    assert!(err.to_string().contains("`start` of rank 1"), "{err}");
}

#[test]
fn a_split_backward_cannot_keep_more_than_the_stage_activations() {
    let sched = lowered(ScheduleKind::ZeroBubbleH1, 2, 1, 2, ZeroLevel::Zero0);
    let cfg = unit(2.0, ZeroLevel::Zero0);
    let mut costs = CostTable::new(&cfg, &sched.stage_ranks, 2, 2).unwrap();
    simulate_costed(&sched, &cfg, &costs, None).unwrap();
    costs.weight_grad_bytes[1] = costs.activation_bytes[1] + 1;
    let err = simulate_costed(&sched, &cfg, &costs, None).unwrap_err();
    assert!(
        err.to_string().contains("`weight_grad_bytes` of stage 1"),
        "{err}"
    );
}
