//! Throughput of the schedule pipeline at a large layout: generate breadth-first with P = 64,
//! V = 8, M = 512 (524,288 compute actions), add transfers and ZeRO-3 collectives, validate.

use std::hint::black_box;
use std::time::Duration;

use burn_bfpp::schedule::{
    lower_data_parallel, lower_p2p, validate, DataParallelLowering, ScheduleKind, ScheduleSpec,
    ZeroLevel,
};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};

fn breadth_first_p64_v8_m512(c: &mut Criterion) {
    let spec = ScheduleSpec::new(ScheduleKind::BreadthFirst, 64, 8, 512);
    let dp = DataParallelLowering {
        zero: ZeroLevel::Zero3,
        weight_buffers: 2,
        grad_buffers: 2,
    };
    // One iteration takes about a second: flat sampling runs `sample_size` iterations instead
    // of criterion's default 1 + 2 + … + `sample_size`.
    let mut group = c.benchmark_group("schedule");
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function("breadth_first_p64_v8_m512", |b| {
        b.iter(|| {
            let compute = spec.generate().expect("valid spec");
            let p2p = lower_p2p(&compute).expect("lowers");
            let lowered = lower_data_parallel(&p2p, &dp).expect("lowers");
            black_box(validate(&lowered).expect("valid"))
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10));
    targets = breadth_first_p64_v8_m512
}
criterion_main!(benches);
