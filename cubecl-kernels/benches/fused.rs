//! Fused kernels against the composed path Burn itself runs (matmul → softmax → matmul for
//! attention, which is what Burn 0.21's attention falls back to under autodiff; materialised
//! logits → log-softmax for the head; matmul → bias add → GELU for the MLP), forward +
//! backward under `Autodiff<Wgpu>` on the CPU Vulkan adapter. Also prints the analytic memory
//! comparisons for the GPT-2-sized head and MLP.

use burn::backend::wgpu::{Wgpu, WgpuDevice};
use burn::backend::Autodiff;
use burn::tensor::{Distribution, Int, Tensor, TensorData, TensorPrimitive};
use criterion::{criterion_group, criterion_main, Criterion};
use cubecl_kernels::{memory, reference};

type A = Autodiff<Wgpu>;

fn float<const D: usize>(t: burn::tensor::ops::FloatTensor<A>) -> Tensor<A, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn bench(c: &mut Criterion) {
    let dev = WgpuDevice::Cpu;
    let (n, hidden, vocab) = (8192u64, 1024u64, 50304u64);
    let (mat, fused) = memory::linear_cross_entropy_extra_bytes(n, hidden, vocab, 4);
    println!(
        "linear CE {n}x{hidden}->{vocab}, fwd+bwd extra memory (analytic, f32): materialised {:.1} MiB, fused {:.1} MiB, ratio {:.1}x",
        mat as f64 / 1048576.0,
        fused as f64 / 1048576.0,
        mat as f64 / fused as f64
    );

    let (n, din, dout) = (8192u64, 1024u64, 4096u64);
    let (composed, fused) = memory::linear_gelu_saved_bytes(n, dout, 4);
    println!(
        "linear+bias+GELU {n}x{din}->{dout}, f32 memory held from forward to backward beyond the inputs (analytic): Burn composed {:.1} MiB, fused {:.1} MiB",
        composed as f64 / 1048576.0,
        fused as f64 / 1048576.0,
    );

    let (b, h, s, d) = (1, 2, 128, 64);
    let rnd =
        |dims: [usize; 4]| Tensor::<A, 4>::random(dims, Distribution::Uniform(-1.0, 1.0), &dev);
    let (q, k, v) = (rnd([b, h, s, d]), rnd([b, h, s, d]), rnd([b, h, s, d]));
    let mut g = c.benchmark_group("attention_fwd_bwd_b1_h2_s128_d64_causal");
    g.sample_size(10);
    g.bench_function("fused", |bench| {
        bench.iter(|| {
            let (q, k, v) = (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone().require_grad(),
            );
            let (out, _) =
                cubecl_kernels::flash_attention(q.clone(), k, v, None, true).expect("shapes");
            let grads = out.sum().backward();
            q.grad(&grads).expect("dq").into_data()
        })
    });
    g.bench_function("burn_composed", |bench| {
        bench.iter(|| {
            let (q, k, v) = (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone().require_grad(),
            );
            let (out, _) = reference::flash_attention::<A>(
                q.clone().into_primitive().tensor(),
                k.into_primitive().tensor(),
                v.into_primitive().tensor(),
                None,
                true,
            );
            let grads = float::<4>(out).sum().backward();
            q.grad(&grads).expect("dq").into_data()
        })
    });
    g.finish();

    let (n, hidden, vocab) = (256, 64, 1024);
    let hs = Tensor::<A, 2>::random([n, hidden], Distribution::Uniform(-1.0, 1.0), &dev);
    let w = Tensor::<A, 2>::random([hidden, vocab], Distribution::Uniform(-0.2, 0.2), &dev);
    let t: Vec<i64> = (0..n as i64).map(|i| (i * 7919) % vocab as i64).collect();
    let targets = Tensor::<A, 1, Int>::from_data(TensorData::new(t, [n]), &dev);
    let mut g = c.benchmark_group("linear_ce_fwd_bwd_n256_h64_v1024");
    g.sample_size(10);
    g.bench_function("fused", |bench| {
        bench.iter(|| {
            let (hs, w) = (hs.clone().require_grad(), w.clone().require_grad());
            let loss = cubecl_kernels::linear_cross_entropy(hs.clone(), w, targets.clone(), -100)
                .expect("shapes");
            hs.grad(&loss.backward()).expect("dh").into_data()
        })
    });
    g.bench_function("burn_materialised", |bench| {
        bench.iter(|| {
            let (hs, w) = (hs.clone().require_grad(), w.clone().require_grad());
            let loss = reference::linear_cross_entropy::<A>(
                hs.clone().into_primitive().tensor(),
                w.into_primitive().tensor(),
                targets.clone().into_primitive(),
                -100,
            );
            hs.grad(&float::<1>(loss).backward())
                .expect("dh")
                .into_data()
        })
    });
    g.finish();
}

fn bench_mlp(c: &mut Criterion) {
    let dev = WgpuDevice::Cpu;
    let (n, din, dout) = (256, 256, 1024);
    let x = Tensor::<A, 2>::random([n, din], Distribution::Uniform(-1.0, 1.0), &dev);
    let w = Tensor::<A, 2>::random([din, dout], Distribution::Uniform(-0.1, 0.1), &dev);
    let b = Tensor::<A, 1>::random([dout], Distribution::Uniform(-0.1, 0.1), &dev);
    let mut g = c.benchmark_group("linear_gelu_fwd_bwd_n256_k256_m1024");
    g.sample_size(10);
    g.bench_function("fused", |bench| {
        bench.iter(|| {
            let (x, w, b) = (
                x.clone().require_grad(),
                w.clone().require_grad(),
                b.clone().require_grad(),
            );
            let y = cubecl_kernels::linear_gelu(x.clone(), w.clone(), b.clone()).expect("shapes");
            let grads = y.sum().backward();
            (
                x.grad(&grads).expect("dx").into_data(),
                w.grad(&grads).expect("dw").into_data(),
                b.grad(&grads).expect("db").into_data(),
            )
        })
    });
    // Burn's own path: matmul, broadcast bias add, `activation::gelu`, each with its
    // autodiff backward (the composed reference is exactly that sequence of Burn ops).
    g.bench_function("burn_composed", |bench| {
        bench.iter(|| {
            let (x, w, b) = (
                x.clone().require_grad(),
                w.clone().require_grad(),
                b.clone().require_grad(),
            );
            let y = reference::linear_gelu::<A>(
                x.clone().into_primitive().tensor(),
                w.clone().into_primitive().tensor(),
                b.clone().into_primitive().tensor(),
            );
            let grads = float::<2>(y).sum().backward();
            (
                x.grad(&grads).expect("dx").into_data(),
                w.grad(&grads).expect("dw").into_data(),
                b.grad(&grads).expect("db").into_data(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench, bench_mlp);
criterion_main!(benches);
