//! Speed of the event simulator at the acceptance size: breadth-first, P = 64, V = 8,
//! M = 512, D = 8, ZeRO-3 (524,288 compute actions plus their transfers and collectives).
//! Goal (issue 3): under 1 s. Only `simulate` is timed; the schedule is built once.

use std::hint::black_box;
use std::time::Duration;

use burn_bfpp::schedule::{ProgramSpec, ScheduleKind, ScheduleSpec, ZeroLevel};
use burn_bfpp::sim::{
    build_program, simulate, GptShape, HardwareConfig, ModelConfig, SimConfig, Strategy,
};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};

fn simulate_p64_v8_m512_d8_zero3(c: &mut Criterion) {
    let spec = ScheduleSpec::new(ScheduleKind::BreadthFirst, 64, 8, 512);
    let sched = build_program(&ProgramSpec::new(spec, ZeroLevel::Zero3), Strategy::Bfpp)
        .expect("valid layout")
        .lowered;
    // 512 stages need 512 layers: the 52B model's width at 512 layers, so every stage has one.
    let model = ModelConfig::Gpt(GptShape {
        layers: 512,
        hidden: 8192,
        heads: 64,
        sequence: 2048,
        vocabulary: 51200,
    });
    let hardware = HardwareConfig::preset("a100-80gb").expect("built-in preset");
    let mut cfg = SimConfig::new(model, hardware);
    cfg.dp = 8;
    cfg.zero = ZeroLevel::Zero3;
    let mut group = c.benchmark_group("sim");
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function("simulate_p64_v8_m512_d8_zero3", |b| {
        b.iter(|| black_box(simulate(&sched, &cfg).expect("simulates")))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    targets = simulate_p64_v8_m512_d8_zero3
}
criterion_main!(benches);
