//! Speed of the planner on 512 GPUs: gpt-52b on 512 A100-80GB for global batches of 512 and
//! 2048 samples (1 and 4 per GPU), top 10. Goal (issue 3): `bfpp plan` for 512 GPUs under
//! 10 s. Runs with the default limits (M ≤ 512, micro-batch size ≤ 16, one thread per core).

use std::hint::black_box;
use std::time::Duration;

use burn_bfpp::plan::{plan, PlanRequest};
use burn_bfpp::sim::{HardwareConfig, ModelConfig};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};

fn plan_512_gpus(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan");
    group.sampling_mode(SamplingMode::Flat);
    for batch in [512, 2048] {
        let req = PlanRequest::new(
            ModelConfig::preset("gpt-52b").expect("built-in preset"),
            HardwareConfig::preset("a100-80gb").expect("built-in preset"),
            512,
            batch,
        );
        let name = format!("gpt52b_512xa100_batch{batch}");
        group.bench_function(name.as_str(), |b| {
            b.iter(|| black_box(plan(&req, 10).expect("a layout fits")))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(20));
    targets = plan_512_gpus
}
criterion_main!(benches);
