//! Timings and measured peak memory of the fused kernels against Burn 0.21's own path on one
//! device, written as JSON for `scripts/gpu-check.sh` (which adds PyTorch's timings and prints
//! the ratio table).
//!
//! With `--features cuda` it runs on CUDA device 0 at the production shapes (attention at
//! batch 4, 16 heads, sequence 2048, head dim 128, bf16; the MLP's 8192 × 1024 → 4096 bf16;
//! the head's 8192 tokens × hidden 1024 × vocabulary 50304, f32). Without it, on the wgpu
//! CPU adapter, `--small` shrinks every shape so the whole program can be checked here.
//!
//! Peak memory is measured, not computed: each cross-entropy path runs in a child process of
//! its own (this binary, `--ce-memory PATH`), and the figure is the growth of the CubeCL
//! memory pool's reserved bytes from just after the inputs exist to just after forward and
//! backward. The pool keeps what it reserved for the whole step, so its reserve is a
//! high-water mark. On wgpu the children use exclusive pages (one page per allocation,
//! rounded up to a bucket size); CUDA's runtime only has its default pools, whose shared
//! pages can absorb small allocations next to the inputs. `--ce-shape` sets the
//! cross-entropy shape, and the analytic model (`cubecl_kernels::memory`) is printed beside
//! the measurement.
//!
//! ```text
//! cargo run --release --features cuda --example kernel_bench -- --json kernels.json
//! cargo run --features wgpu --example kernel_bench -- --small      # the CPU check
//! cargo run --features wgpu --example kernel_bench -- --ce-memory-only
//! ```
//!
//! The last one measures the cross-entropy memory at the production shape on the CPU Vulkan
//! adapter (minutes: the two paths' forward and backward are about 5 TFLOP).
//!
//! It lives in the root package beside `gpu_run` so that `scripts/gpu-check.sh build` compiles
//! both with one feature set.

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod bench {
    use std::process::Command;
    use std::time::Instant;

    use burn::backend::Autodiff;
    use burn::tensor::backend::Backend;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{activation, DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
    use cubecl_kernels::{memory, reference};

    #[cfg(feature = "cuda")]
    mod dev {
        pub type B = burn::backend::cuda::Cuda;
        pub fn device() -> burn::backend::cuda::CudaDevice {
            burn::backend::cuda::CudaDevice::default()
        }
        /// CubeCL 0.10's CUDA runtime always starts with its default (sub-slicing) pools.
        pub fn memory_device() -> burn::backend::cuda::CudaDevice {
            device()
        }
        pub const NAME: &str = "cuda";
    }
    #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
    mod dev {
        pub type B = burn::backend::wgpu::Wgpu;
        use burn::backend::wgpu::{graphics, init_setup, MemoryConfiguration, RuntimeOptions};
        pub fn device() -> burn::backend::wgpu::WgpuDevice {
            burn::backend::wgpu::WgpuDevice::Cpu
        }
        /// The device with one page per allocation (rounded up to one of CubeCL's geometric
        /// bucket sizes), so the pool's reserve follows what is allocated instead of the
        /// slack of shared pages. Must be the first use of the device in the process.
        pub fn memory_device() -> burn::backend::wgpu::WgpuDevice {
            let device = device();
            let options = RuntimeOptions {
                memory_config: MemoryConfiguration::ExclusivePages,
                ..RuntimeOptions::default()
            };
            init_setup::<graphics::AutoGraphicsApi>(&device, options);
            device
        }
        pub const NAME: &str = "wgpu-cpu";
    }

    type B = dev::B;
    type A = Autodiff<B>;
    type Device = burn::tensor::Device<B>;

    /// One shape set: production on CUDA, a small one for checking the program on a CPU.
    #[derive(Clone, Copy)]
    struct Shapes {
        attn: [usize; 4],
        mlp: [usize; 3],
        ce: [usize; 3],
        reps: usize,
    }

    const FULL: Shapes = Shapes {
        attn: [4, 16, 2048, 128],
        mlp: [8192, 1024, 4096],
        ce: [8192, 1024, 50304],
        reps: 10,
    };
    const SMALL: Shapes = Shapes {
        attn: [1, 2, 64, 32],
        mlp: [64, 32, 128],
        ce: [64, 32, 512],
        reps: 2,
    };

    fn sync(device: &Device) {
        B::sync(device).expect("device sync");
    }

    /// Mean milliseconds of `f` over `reps` runs after two warm-up runs, the device synchronised
    /// around the timed loop (launches are asynchronous).
    fn time_ms(device: &Device, reps: usize, mut f: impl FnMut()) -> f64 {
        for _ in 0..2 {
            f();
        }
        sync(device);
        let start = Instant::now();
        for _ in 0..reps {
            f();
        }
        sync(device);
        start.elapsed().as_secs_f64() * 1e3 / reps as f64
    }

    fn random<Bk: Backend, const D: usize>(
        dims: [usize; D],
        scale: f64,
        dtype: DType,
        device: &Bk::Device,
    ) -> Tensor<Bk, D> {
        Tensor::<Bk, D>::random(dims, Distribution::Uniform(-scale, scale), device).cast(dtype)
    }

    fn float<Bk: Backend, const D: usize>(t: burn::tensor::ops::FloatTensor<Bk>) -> Tensor<Bk, D> {
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }

    /// Attention forward + backward (bf16 where the device has it), fused against Burn's own
    /// attention op under autodiff.
    fn bench_attention(device: &Device, s: &Shapes, dtype: DType) -> (f64, f64) {
        let [b, h, n, d] = s.attn;
        let q = random::<A, 4>([b, h, n, d], 1.0, dtype, device);
        let k = random::<A, 4>([b, h, n, d], 1.0, dtype, device);
        let v = random::<A, 4>([b, h, n, d], 1.0, dtype, device);
        let fused = time_ms(device, s.reps, || {
            let (q, k, v) = (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone().require_grad(),
            );
            let (out, _) =
                cubecl_kernels::flash_attention(q.clone(), k.clone(), v.clone(), None, true)
                    .expect("attention shapes");
            let grads = out.sum().backward();
            let _ = (q.grad(&grads), k.grad(&grads), v.grad(&grads));
        });
        let burn = time_ms(device, s.reps, || {
            let (q, k, v) = (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone().require_grad(),
            );
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            };
            let out = attention(q.clone(), k.clone(), v.clone(), None, None, options);
            let grads = out.sum().backward();
            let _ = (q.grad(&grads), k.grad(&grads), v.grad(&grads));
        });
        (fused, burn)
    }

    /// The MLP's first linear + bias + GELU, forward only (what PyTorch's cuBLAS matmul plus a
    /// separate epilogue is compared with) and forward + backward, fused against Burn's matmul,
    /// bias add and GELU.
    fn bench_mlp(device: &Device, s: &Shapes, dtype: DType) -> [f64; 4] {
        let [n, din, dout] = s.mlp;
        let x = random::<B, 2>([n, din], 1.0, dtype, device);
        let w = random::<B, 2>([din, dout], 0.05, dtype, device);
        let bias = random::<B, 1>([dout], 0.05, dtype, device);
        let fused_fwd = time_ms(device, s.reps, || {
            let _ =
                cubecl_kernels::linear_gelu(x.clone(), w.clone(), bias.clone()).expect("shapes");
        });
        let burn_fwd = time_ms(device, s.reps, || {
            let _ = activation::gelu(x.clone().matmul(w.clone()) + bias.clone().unsqueeze_dim(0));
        });
        let (xa, wa, ba) = (
            Tensor::<A, 2>::from_inner(x),
            Tensor::<A, 2>::from_inner(w),
            Tensor::<A, 1>::from_inner(bias),
        );
        let fused_bwd = time_ms(device, s.reps, || {
            let (x, w, b) = (
                xa.clone().require_grad(),
                wa.clone().require_grad(),
                ba.clone().require_grad(),
            );
            let y = cubecl_kernels::linear_gelu(x.clone(), w.clone(), b.clone()).expect("shapes");
            let grads = y.sum().backward();
            let _ = (x.grad(&grads), w.grad(&grads), b.grad(&grads));
        });
        let burn_bwd = time_ms(device, s.reps, || {
            let (x, w, b) = (
                xa.clone().require_grad(),
                wa.clone().require_grad(),
                ba.clone().require_grad(),
            );
            let y = activation::gelu(x.clone().matmul(w.clone()) + b.clone().unsqueeze_dim(0));
            let grads = y.sum().backward();
            let _ = (x.grad(&grads), w.grad(&grads), b.grad(&grads));
        });
        [fused_fwd, burn_fwd, fused_bwd, burn_bwd]
    }

    /// Inputs of the head's cross-entropy: hidden states, head weight and targets (every 7th
    /// padded with the ignore index, as in a batch with padding).
    fn ce_inputs(device: &Device, s: &Shapes) -> (Tensor<A, 2>, Tensor<A, 2>, Tensor<A, 1, Int>) {
        let [n, hidden, vocab] = s.ce;
        let h = random::<A, 2>([n, hidden], 1.0, DType::F32, device);
        let w = random::<A, 2>([hidden, vocab], 0.05, DType::F32, device);
        let t: Vec<i64> = (0..n as i64)
            .map(|i| {
                if i % 7 == 6 {
                    -100
                } else {
                    (i * 7919) % vocab as i64
                }
            })
            .collect();
        (h, w, Tensor::from_data(TensorData::new(t, [n]), device))
    }

    /// Forward + backward of one cross-entropy path; `fused` picks the kernel, otherwise Burn's
    /// materialised logits followed by log-softmax.
    fn ce_step(h: &Tensor<A, 2>, w: &Tensor<A, 2>, t: &Tensor<A, 1, Int>, fused: bool) {
        let (h, w) = (h.clone().require_grad(), w.clone().require_grad());
        let loss = if fused {
            cubecl_kernels::linear_cross_entropy(h.clone(), w.clone(), t.clone(), -100)
                .expect("shapes")
        } else {
            float::<A, 1>(reference::linear_cross_entropy::<A>(
                h.clone().into_primitive().tensor(),
                w.clone().into_primitive().tensor(),
                t.clone().into_primitive(),
                -100,
            ))
        };
        let grads = loss.backward();
        let _ = (h.grad(&grads), w.grad(&grads));
    }

    /// Child process: one cross-entropy path's pool growth over a forward + backward, in bytes.
    fn ce_memory_child(device: &Device, s: &Shapes, fused: bool) {
        let client = Tensor::<B, 1>::zeros([1], device)
            .into_primitive()
            .tensor()
            .client;
        let reserved = || {
            client
                .memory_usage()
                .map(|u| u.bytes_reserved)
                .expect("the device's memory usage")
        };
        let (h, w, t) = ce_inputs(device, s);
        sync(device);
        let before = reserved();
        ce_step(&h, &w, &t, fused);
        sync(device);
        println!("{}", reserved().saturating_sub(before));
    }

    /// One cross-entropy path's measured pool growth, from a child process given the same
    /// shape flags (`shape_args`) as this one.
    fn ce_memory(shape_args: &[String], fused: bool) -> u64 {
        let exe = std::env::current_exe().expect("path of this binary");
        let mut cmd = Command::new(exe);
        cmd.args(["--ce-memory", if fused { "fused" } else { "materialised" }]);
        cmd.args(shape_args);
        let out = cmd.output().expect("start the memory child process");
        let text = String::from_utf8_lossy(&out.stdout);
        match text.trim().lines().last().map(str::parse::<u64>) {
            Some(Ok(bytes)) if out.status.success() => bytes,
            _ => panic!(
                "the cross-entropy memory child failed ({}): {}{}",
                out.status,
                text,
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let small = args.iter().any(|a| a == "--small");
        let value_of = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1).cloned())
        };
        if args.iter().any(|a| a == "--help" || a == "-h") {
            println!(
                "kernel_bench [--small] [--json PATH] [--ce-memory-only] [--ce-shape TOKENS,HIDDEN,VOCAB]: fused kernels against Burn's path on {}",
                dev::NAME
            );
            return;
        }
        let mut shapes = if small { SMALL } else { FULL };
        let mut shape_args: Vec<String> = Vec::new();
        if small {
            shape_args.push("--small".into());
        }
        if let Some(text) = value_of("--ce-shape") {
            let dims: Vec<usize> = text
                .split(',')
                .filter_map(|d| d.trim().parse().ok())
                .collect();
            match dims[..] {
                [n, h, v] if n * h * v > 0 => shapes.ce = [n, h, v],
                _ => {
                    eprintln!(
                        "--ce-shape {text}: expected TOKENS,HIDDEN,VOCAB, e.g. 2048,256,12288"
                    );
                    std::process::exit(2);
                }
            }
            shape_args.extend(["--ce-shape".into(), text]);
        }
        let shapes = &shapes;
        if let Some(which) = value_of("--ce-memory") {
            ce_memory_child(&dev::memory_device(), shapes, which == "fused");
            return;
        }
        let device = dev::device();
        if args.iter().any(|a| a == "--ce-memory-only") {
            // Only the measured memory figure (each path in its own process): what a CPU
            // adapter can afford at the production shape, where the timings would take hours.
            let (mem_fused, mem_burn) =
                (ce_memory(&shape_args, true), ce_memory(&shape_args, false));
            let [n, h, v] = shapes.ce.map(|d| d as u64);
            let (model_burn, model_fused) = memory::linear_cross_entropy_extra_bytes(n, h, v, 4);
            let mib = |b: u64| b as f64 / 1048576.0;
            println!(
                "linear CE {:?} f32 on {}, measured pool growth over forward + backward: fused {:.1} MiB, materialised {:.1} MiB, {:.1}x less; analytic model: fused {:.1} MiB, materialised {:.1} MiB (a lower bound), {:.1}x",
                shapes.ce,
                dev::NAME,
                mib(mem_fused),
                mib(mem_burn),
                mem_burn as f64 / mem_fused.max(1) as f64,
                mib(model_fused),
                mib(model_burn),
                model_burn as f64 / model_fused as f64
            );
            return;
        }
        // bf16 where the device computes in it (CUDA), else f32 (lavapipe has no bf16).
        let half = if B::supports_dtype(&device, DType::BF16) {
            DType::BF16
        } else {
            DType::F32
        };
        eprintln!(
            "kernel_bench on {}: attention and MLP in {half:?}",
            dev::NAME
        );

        let (attn_fused, attn_burn) = bench_attention(&device, shapes, half);
        eprintln!("attention fwd+bwd: fused {attn_fused:.3} ms, Burn {attn_burn:.3} ms");
        let [mlp_fused_fwd, mlp_burn_fwd, mlp_fused_bwd, mlp_burn_bwd] =
            bench_mlp(&device, shapes, half);
        eprintln!(
        "linear+bias+GELU fwd: fused {mlp_fused_fwd:.3} ms, Burn {mlp_burn_fwd:.3} ms; fwd+bwd: fused {mlp_fused_bwd:.3} ms, Burn {mlp_burn_bwd:.3} ms"
    );
        let (h, w, t) = ce_inputs(&device, shapes);
        let ce_fused = time_ms(&device, shapes.reps.min(3), || ce_step(&h, &w, &t, true));
        let ce_burn = time_ms(&device, shapes.reps.min(3), || ce_step(&h, &w, &t, false));
        drop((h, w, t));
        eprintln!("linear CE fwd+bwd: fused {ce_fused:.3} ms, Burn {ce_burn:.3} ms");
        let mem_fused = ce_memory(&shape_args, true);
        let mem_burn = ce_memory(&shape_args, false);
        eprintln!(
            "linear CE peak pool growth: fused {:.1} MiB, materialised {:.1} MiB, ratio {:.1}x",
            mem_fused as f64 / 1048576.0,
            mem_burn as f64 / 1048576.0,
            mem_burn as f64 / mem_fused.max(1) as f64
        );

        let json = format!(
        concat!(
            "{{\"backend\":\"{}\",\"dtype\":\"{:?}\",\"attn_shape\":{:?},\"mlp_shape\":{:?},",
            "\"ce_shape\":{:?},\"attn_fwd_bwd_ms\":{{\"fused\":{},\"burn\":{}}},",
            "\"mlp_fwd_ms\":{{\"fused\":{},\"burn\":{}}},\"mlp_fwd_bwd_ms\":{{\"fused\":{},\"burn\":{}}},",
            "\"ce_fwd_bwd_ms\":{{\"fused\":{},\"burn\":{}}},\"ce_peak_bytes\":{{\"fused\":{},\"burn\":{}}}}}"
        ),
        dev::NAME,
        half,
        shapes.attn,
        shapes.mlp,
        shapes.ce,
        attn_fused,
        attn_burn,
        mlp_fused_fwd,
        mlp_burn_fwd,
        mlp_fused_bwd,
        mlp_burn_bwd,
        ce_fused,
        ce_burn,
        mem_fused,
        mem_burn
    );
        match value_of("--json") {
            Some(path) => std::fs::write(&path, &json).expect("write the JSON results"),
            None => println!("{json}"),
        }
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn main() {
    bench::main();
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn main() {
    eprintln!("kernel_bench needs a CubeCL backend: build it with --features cuda (GPU) or --features wgpu (Vulkan, also the CPU adapter)");
    std::process::exit(2);
}
