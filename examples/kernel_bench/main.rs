//! Timings and measured peak memory of the fused kernels against Burn 0.21's own path on one
//! device, written as JSON for `scripts/gpu-check.sh` (which adds PyTorch's timings and prints
//! the ratio table).
//!
//! With `--features cuda` it runs on CUDA device 0 at the production shapes (attention at
//! batch 4, 16 heads, sequence 2048, head dim 128, bf16; the MLP's 8192 × 1024 → 4096 bf16;
//! the head's 8192 tokens × hidden 1024 × vocabulary 50304, f32). Without it, on the wgpu
//! CPU adapter, `--small` shrinks every shape so the whole program can be checked here.
//!
//! Peak memory is measured, not computed ([`bench::peak_memory`]): each op's two paths run in
//! a child process each (this binary, `--mem-child OP PATH`), and the figure is the growth of the CubeCL
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
//! cargo run --release --features cuda --example kernel_bench -- --attn-only --attn-tiles 4x4,2x1
//! ```
//!
//! `--attn-tiles PxF,…` also times the attention tile kernels under each forced cube shape
//! (`P` planes, streamed tiles of `F` 16-row fragments; [`bench::tile_sweep`]), with the
//! accumulators in each place `--attn-acc registers,shared` names (default: registers), and
//! `--attn-only` skips the MLP, the cross-entropy and the memory measurements.
//!
//! The last one measures the cross-entropy memory at the production shape on the CPU Vulkan
//! adapter (minutes: the two paths' forward and backward are about 5 TFLOP).
//!
//! It lives in the root package beside `bfpp` so that the GPU scripts' builds compile both
//! with one feature set.

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod bench {
    pub(crate) mod peak_memory;
    pub(crate) mod tile_sweep;

    use std::time::Instant;

    use burn::backend::Autodiff;
    use burn::tensor::backend::Backend;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{activation, DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
    use cubecl_kernels::cube::{
        set_attention_kernel, set_f32_matmul, tiled_launches, unit_matmul_launches,
        AttentionKernel, F32Matmul, TiledLaunches,
    };
    use cubecl_kernels::{memory, reference, BURN_MATMUL};
    use peak_memory::{measure_all, memory_child, mib};

    #[cfg(feature = "cuda")]
    mod dev {
        pub type B = burn::backend::cuda::Cuda;
        pub type R = cubecl_kernels::cube::CudaRuntime;
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
        pub type R = burn::backend::wgpu::WgpuRuntime;
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
    pub(crate) fn time_ms(device: &Device, reps: usize, mut f: impl FnMut()) -> f64 {
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

    /// The three fused ops, as named on the command line and in the JSON.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Op {
        Attention,
        Mlp,
        Ce,
    }

    const OPS: [Op; 3] = [Op::Attention, Op::Mlp, Op::Ce];

    impl Op {
        fn name(self) -> &'static str {
            match self {
                Op::Attention => "attention",
                Op::Mlp => "mlp",
                Op::Ce => "ce",
            }
        }
        fn parse(text: &str) -> Option<Op> {
            OPS.into_iter().find(|op| op.name() == text)
        }
    }

    /// Burn's attention options for the benchmarks' causal attention (default scale).
    const CAUSAL: AttentionModuleOptions = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };

    /// One op's inputs under autodiff, made before a memory measurement starts.
    pub(crate) enum OpInputs {
        /// q, k, v `[batch, heads, seq, head_dim]`, causal.
        Attention([Tensor<A, 4>; 3]),
        /// x `[n, d_in]`, W `[d_in, d_out]`, b `[d_out]`.
        Mlp(Tensor<A, 2>, Tensor<A, 2>, Tensor<A, 1>),
        /// Hidden states, head weight (f32) and targets (every 7th the ignore index).
        Ce(Tensor<A, 2>, Tensor<A, 2>, Tensor<A, 1, Int>),
    }

    fn op_inputs(op: Op, device: &Device, s: &Shapes, half: DType) -> OpInputs {
        match op {
            Op::Attention => {
                let dims = s.attn;
                OpInputs::Attention([0; 3].map(|_| random::<A, 4>(dims, 1.0, half, device)))
            }
            Op::Mlp => {
                let [n, din, dout] = s.mlp;
                OpInputs::Mlp(
                    random::<A, 2>([n, din], 1.0, half, device),
                    random::<A, 2>([din, dout], 0.05, half, device),
                    random::<A, 1>([dout], 0.05, half, device),
                )
            }
            Op::Ce => {
                let [n, hidden, vocab] = s.ce;
                let t: Vec<i64> = (0..n as i64)
                    .map(|i| {
                        if i % 7 == 6 {
                            -100
                        } else {
                            (i * 7919) % vocab as i64
                        }
                    })
                    .collect();
                OpInputs::Ce(
                    random::<A, 2>([n, hidden], 1.0, DType::F32, device),
                    random::<A, 2>([hidden, vocab], 0.05, DType::F32, device),
                    Tensor::from_data(TensorData::new(t, [n]), device),
                )
            }
        }
    }

    /// Forward and backward of one op: the fused kernel, or Burn's own path (its attention op
    /// under autodiff; matmul, bias add and GELU; materialised logits and log-softmax).
    pub(crate) fn fwd_bwd(inputs: &OpInputs, fused: bool) {
        match inputs {
            OpInputs::Attention([q, k, v]) => {
                let [q, k, v] = [q, k, v].map(|t| t.clone().require_grad());
                let out = if fused {
                    cubecl_kernels::flash_attention(q.clone(), k.clone(), v.clone(), None, true)
                        .expect("attention shapes")
                        .0
                } else {
                    attention(q.clone(), k.clone(), v.clone(), None, None, CAUSAL)
                };
                let grads = out.sum().backward();
                let _ = (q.grad(&grads), k.grad(&grads), v.grad(&grads));
            }
            OpInputs::Mlp(x, w, b) => {
                let (x, w, b) = (
                    x.clone().require_grad(),
                    w.clone().require_grad(),
                    b.clone().require_grad(),
                );
                let y = if fused {
                    cubecl_kernels::linear_gelu(x.clone(), w.clone(), b.clone()).expect("shapes")
                } else {
                    activation::gelu(x.clone().matmul(w.clone()) + b.clone().unsqueeze_dim(0))
                };
                let grads = y.sum().backward();
                let _ = (x.grad(&grads), w.grad(&grads), b.grad(&grads));
            }
            OpInputs::Ce(h, w, t) => {
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
        }
    }

    /// Which attention kernels ran between two launch counts (the default's fwd+bwd is
    /// `time_op(Op::Attention)`'s fused timing; this names its kernels).
    fn attention_kernels_ran(before: TiledLaunches, after: TiledLaunches) -> String {
        let name = |tiles: bool| {
            if tiles {
                "tensor-core tiles"
            } else {
                "portable scalar"
            }
        };
        format!(
            "forward {}, dQ {}, dK/dV {}",
            name(after.forward > before.forward),
            name(after.dq > before.dq),
            name(after.dkdv > before.dkdv)
        )
    }

    /// The attention forward alone under the default kernels and with the portable kernels
    /// forced, and the portable kernels' forward + backward, in milliseconds.
    fn attention_kernels_ms(device: &Device, inputs: &OpInputs, reps: usize) -> serde_json::Value {
        let OpInputs::Attention([q, k, v]) = inputs else {
            unreachable!("attention inputs")
        };
        let forward = || {
            let _ = cubecl_kernels::flash_attention(q.clone(), k.clone(), v.clone(), None, true)
                .expect("attention shapes");
        };
        set_attention_kernel(AttentionKernel::Scalar);
        let fwd_scalar = time_ms(device, reps, forward);
        let fwd_bwd_scalar = time_ms(device, reps, || fwd_bwd(inputs, true));
        set_attention_kernel(AttentionKernel::Auto);
        let fwd_default = time_ms(device, reps, forward);
        // Burn's own attention op outside autodiff: its fused forward kernel (cubek's flash
        // attention), the fastest forward Burn 0.21 has. It returns no log-sum-exp, so it
        // cannot serve training; it is the yardstick for our forward on the same device.
        let [qi, ki, vi] = [q, k, v].map(|t| t.clone().inner());
        let fwd_burn = time_ms(device, reps, || {
            let _ = attention(qi.clone(), ki.clone(), vi.clone(), None, None, CAUSAL);
        });
        eprintln!(
            "attention fwd: default {fwd_default:.3} ms, portable scalar {fwd_scalar:.3} ms, \
             Burn's fused forward (no autodiff) {fwd_burn:.3} ms; portable fwd+bwd \
             {fwd_bwd_scalar:.3} ms"
        );
        serde_json::json!({
            "fwd": { "default": fwd_default, "scalar": fwd_scalar, "burn": fwd_burn },
            "fwd_bwd": { "scalar": fwd_bwd_scalar },
        })
    }

    /// The MLP's first linear + bias + GELU forward alone (what PyTorch's cuBLAS matmul plus a
    /// separate epilogue is compared with), fused and Burn's, in milliseconds.
    fn mlp_forward_ms(device: &Device, s: &Shapes, half: DType) -> (f64, f64) {
        let [n, din, dout] = s.mlp;
        let x = random::<B, 2>([n, din], 1.0, half, device);
        let w = random::<B, 2>([din, dout], 0.05, half, device);
        let bias = random::<B, 1>([dout], 0.05, half, device);
        let fused = time_ms(device, s.reps, || {
            let _ =
                cubecl_kernels::linear_gelu(x.clone(), w.clone(), bias.clone()).expect("shapes");
        });
        let burn = time_ms(device, s.reps, || {
            let _ = activation::gelu(x.clone().matmul(w.clone()) + bias.clone().unsqueeze_dim(0));
        });
        (fused, burn)
    }

    /// bf16 where the device computes in it (CUDA), else f32 (lavapipe has no bf16).
    fn half_type(device: &Device) -> DType {
        if B::supports_dtype(device, DType::BF16) {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// `--NAME a,b,c` as exactly `N` positive numbers, or exit naming the expected form.
    fn parse_dims<const N: usize>(flag: &str, text: &str, form: &str) -> [usize; N] {
        let dims: Vec<usize> = text
            .split(',')
            .filter_map(|d| d.trim().parse().ok())
            .collect();
        match <[usize; N]>::try_from(dims) {
            Ok(d) if d.iter().all(|&x| x > 0) => d,
            _ => {
                eprintln!("{flag} {text}: expected {form}");
                std::process::exit(2);
            }
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let value_of = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1).cloned())
        };
        if args.iter().any(|a| a == "--help" || a == "-h") {
            println!(
                "kernel_bench [--small] [--attn-shape B,H,S,D] [--mlp-shape N,DIN,DOUT] \
                 [--ce-shape N,HIDDEN,VOCAB] [--reps N] [--memory-only] [--attn-only] \
                 [--attn-tiles PxF,...] [--attn-acc registers,shared] [--json PATH]: the fused kernels against Burn's path on {}",
                dev::NAME
            );
            return;
        }
        let small = args.iter().any(|a| a == "--small");
        let mut shapes = if small { SMALL } else { FULL };
        let mut shape_args: Vec<String> = Vec::new();
        if small {
            shape_args.push("--small".into());
        }
        if let Some(text) = value_of("--attn-shape") {
            shapes.attn = parse_dims("--attn-shape", &text, "BATCH,HEADS,SEQ,HEAD_DIM");
            shape_args.extend(["--attn-shape".into(), text]);
        }
        if let Some(text) = value_of("--mlp-shape") {
            shapes.mlp = parse_dims("--mlp-shape", &text, "TOKENS,D_IN,D_OUT");
            shape_args.extend(["--mlp-shape".into(), text]);
        }
        if let Some(text) = value_of("--ce-shape") {
            shapes.ce = parse_dims("--ce-shape", &text, "TOKENS,HIDDEN,VOCAB");
            shape_args.extend(["--ce-shape".into(), text]);
        }
        if let Some(text) = value_of("--reps") {
            shapes.reps = parse_dims::<1>("--reps", &text, "a positive number of timed runs")[0];
        }
        let tile_shapes = match value_of("--attn-tiles") {
            Some(text) => tile_sweep::parse_shapes(&text).unwrap_or_else(|e| {
                eprintln!("{e}");
                std::process::exit(2);
            }),
            None => Vec::new(),
        };
        let tile_places = match value_of("--attn-acc") {
            Some(text) => tile_sweep::parse_places(&text).unwrap_or_else(|e| {
                eprintln!("{e}");
                std::process::exit(2);
            }),
            None => vec![Default::default()],
        };
        let attn_only = args.iter().any(|a| a == "--attn-only");
        let shapes = &shapes;
        if let Some(i) = args.iter().position(|a| a == "--mem-child") {
            let op = args.get(i + 1).and_then(|o| Op::parse(o));
            let fused = args.get(i + 2).map(|p| p == "fused");
            match (op, fused) {
                (Some(op), Some(fused)) => memory_child(op, fused, shapes),
                _ => {
                    eprintln!("--mem-child OP PATH: OP is attention|mlp|ce, PATH fused|burn");
                    std::process::exit(2);
                }
            }
            return;
        }
        let device = dev::device();
        let half = half_type(&device);
        eprintln!(
            "kernel_bench on {}: attention and MLP in {half:?}, cross-entropy in F32",
            dev::NAME
        );
        if args.iter().any(|a| a == "--memory-only") {
            // Only the measured memory (each path in its own process): what a CPU adapter can
            // afford at shapes where the timings would take hours.
            let [n, h, v] = shapes.ce.map(|d| d as u64);
            let (ce_model_burn, ce_model_fused) =
                memory::linear_cross_entropy_extra_bytes(n, h, v, 4);
            println!("| op | shape | fused MiB | Burn MiB | Burn / fused |");
            println!("|---|---|---|---|---|");
            for (op, fused, burn) in measure_all(&shape_args) {
                let shape = match op {
                    Op::Attention => format!("{:?} causal, {half:?}", shapes.attn),
                    Op::Mlp => format!("{:?}, {half:?}", shapes.mlp),
                    Op::Ce => format!("{:?}, F32", shapes.ce),
                };
                println!(
                    "| {} | {shape} | {:.1} | {:.1} | {:.1}x |",
                    op.name(),
                    mib(fused),
                    mib(burn),
                    burn as f64 / fused.max(1) as f64
                );
            }
            println!(
                "cross-entropy analytic model: fused {:.1} MiB, materialised {:.1} MiB (a lower bound)",
                mib(ce_model_fused),
                mib(ce_model_burn)
            );
            return;
        }

        let time_op = |op: Op, reps: usize| {
            let inputs = op_inputs(op, &device, shapes, half);
            let fused = time_ms(&device, reps, || fwd_bwd(&inputs, true));
            let burn = time_ms(&device, reps, || fwd_bwd(&inputs, false));
            eprintln!(
                "{} fwd+bwd: fused {fused:.3} ms, Burn {burn:.3} ms",
                op.name()
            );
            serde_json::json!({ "fused": fused, "burn": burn })
        };
        let before = tiled_launches();
        let attn = time_op(Op::Attention, shapes.reps);
        let kernels = attention_kernels_ran(before, tiled_launches());
        eprintln!("attention kernels of the default: {kernels}");
        let mut attn_kernels = attention_kernels_ms(
            &device,
            &op_inputs(Op::Attention, &device, shapes, half),
            shapes.reps,
        );
        attn_kernels["default_kernels"] = kernels.into();
        let attn_inputs = op_inputs(Op::Attention, &device, shapes, half);
        attn_kernels["default_tile_shapes"] =
            tile_sweep::shapes_json(&device, half, shapes.attn[3]);
        let mut json = if attn_only {
            serde_json::json!({
                "backend": dev::NAME,
                "burn_matmul": BURN_MATMUL,
                "dtype": format!("{half:?}"),
                "attn_shape": shapes.attn,
                "attn_fwd_bwd_ms": attn,
                "attn_kernels_ms": attn_kernels,
            })
        } else {
            let (mlp_fused_fwd, mlp_burn_fwd) = mlp_forward_ms(&device, shapes, half);
            eprintln!("mlp fwd: fused {mlp_fused_fwd:.3} ms, Burn {mlp_burn_fwd:.3} ms");
            let mlp = time_op(Op::Mlp, shapes.reps);
            let units_before = unit_matmul_launches();
            let ce = time_op(Op::Ce, shapes.reps.min(3));
            let ce_default = if unit_matmul_launches() > units_before {
                "unit"
            } else {
                "burn_matmul"
            };
            // The head is f32, and the default picks its f32 routine by device (the exact unit
            // routine where Burn's matmul would round to TF32): both, timed on the same inputs.
            let ce_inputs = op_inputs(Op::Ce, &device, shapes, half);
            let mut ce_f32 = serde_json::json!({ "default": ce_default });
            for (name, choice) in [("unit", F32Matmul::Unit), ("burn_matmul", F32Matmul::Burn)] {
                set_f32_matmul(choice);
                let ms = time_ms(&device, shapes.reps.min(3), || fwd_bwd(&ce_inputs, true));
                eprintln!("ce fwd+bwd, fused, f32 products on {name}: {ms:.3} ms");
                ce_f32[name] = ms.into();
            }
            set_f32_matmul(F32Matmul::Auto);
            eprintln!("ce fwd+bwd: the default ran its f32 products on {ce_default}");
            let peak: serde_json::Map<String, serde_json::Value> = measure_all(&shape_args)
                .into_iter()
                .map(|(op, fused, burn)| {
                    (
                        op.name().to_string(),
                        serde_json::json!({ "fused": fused, "burn": burn }),
                    )
                })
                .collect();
            serde_json::json!({
                "backend": dev::NAME,
                "burn_matmul": BURN_MATMUL,
                "dtype": format!("{half:?}"),
                "attn_shape": shapes.attn,
                "mlp_shape": shapes.mlp,
                "ce_shape": shapes.ce,
                "attn_fwd_bwd_ms": attn,
                "attn_kernels_ms": attn_kernels,
                "mlp_fwd_ms": { "fused": mlp_fused_fwd, "burn": mlp_burn_fwd },
                "mlp_fwd_bwd_ms": mlp,
                "ce_fwd_bwd_ms": ce,
                "ce_f32_matmul_ms": ce_f32,
                "peak_bytes": peak,
            })
        };
        // The tile sweep runs last, after the results so far are on disk: a run cut short
        // by a time limit (gpu-check.sh's BENCH_S) keeps every other figure.
        let path = value_of("--json");
        if path.is_some() && !tile_shapes.is_empty() {
            write_json(path.clone(), &json);
        }
        json["attn_kernels_ms"]["tile_sweep"] = tile_sweep::sweep(
            &device,
            &attn_inputs,
            shapes.reps,
            &tile_shapes,
            &tile_places,
            half,
        );
        write_json(path, &json);
    }

    /// The results to `path`, or to standard output without one.
    fn write_json(path: Option<String>, json: &serde_json::Value) {
        match path {
            Some(path) => std::fs::write(&path, json.to_string()).expect("write the JSON results"),
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
