//! Train the reference GPT with the looped breadth-first pipeline on one accelerator and lay the
//! measurement beside the simulator's prediction for the same layout: the program behind
//! `scripts/gpu-run.sh`.
//!
//! ```sh
//! cargo run --release --features cuda --example gpu_run -- --backend cuda     # an NVIDIA GPU
//! cargo run --release --example gpu_run -- --backend flex --steps 3 --layers 4 # the CPU
//! ```
//!
//! Every pipeline and data-parallel rank is a thread of this process and all of them share the
//! one device (`--gpus N` spreads them over N GPUs; `--comm nccl` runs the group
//! collectives on NCCL instead of host memory). Started as one process per rank with
//! torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`;
//! `--backend cuda --comm nccl`), each process runs its own rank on GPU `LOCAL_RANK % gpus`,
//! its data on NCCL (`NcclComm`) over a TCP control channel (`ControlComm`), and world rank 0
//! reports. On one GPU the run shows the schedule, the sharding and the engine's overheads on
//! real kernels, not multi-GPU scaling. It reports tokens/s, model TFLOP/s and MFU against
//! `--peak-tflops` (by default the bf16 peak of the `--hardware` preset, which `auto` picks
//! from the GPU's name), the bubble of the measured step, and the simulator's step time, bubble
//! and MFU for the same layout with one GPU of `--hardware` per rank. It writes the measured
//! and the simulated timelines (SVG) and the measured Chrome trace to `--out`.

mod baseline;
mod report;

use std::path::PathBuf;
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_bfpp::comm::{
    CommConfig, CommError, Communicator, ControlComm, LocalComm, ProcessRank, RankGrid,
    RendezvousEnv, ThreadRank,
};
use burn_bfpp::data::{BatchConfig, BatchLayout, Batcher, MarkovConfig, MarkovCorpus};
use burn_bfpp::engine::{
    train_local_with_comms, train_processes, Checkpointing, EngineConfig, EngineError, StepProfile,
    StepReport, TrainOutcome,
};
use burn_bfpp::model::{Gpt, GptConfig, MicroBatch, ModelSplit};
use burn_bfpp::optim::{AdamWSettings, LrSchedule};
use burn_bfpp::schedule::{Placement, ScheduleKind, ZeroLevel};
use burn_bfpp::sim::{simulate, GptShape, HardwareConfig, ModelConfig, SimConfig};
use burn_bfpp::viz::{chrome_trace_json, timeline_svg, write_file, Trace};
use clap::{Parser, ValueEnum};
use report::{auto_hardware, Measured};

/// Which Burn backend trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendChoice {
    /// Burn's CPU backend (always built).
    Flex,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
}

/// Which communicator the ranks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CommChoice {
    /// `LocalComm`: collectives through host memory; pipeline transfers handed over on the
    /// device between ranks that share a GPU, through host memory between GPUs.
    Local,
    /// `NcclComm` (CUDA only): the collectives of every group on distinct GPUs as NCCL
    /// collectives on the device buffers (pipeline groups whose stages share a GPU keep the
    /// host path); pipeline transfers as with `local`. Each data-parallel group needs
    /// distinct GPUs (`--dp` ≤ `--gpus`, or `--dp 1`: groups of one rank).
    Nccl,
}

/// Which attention kernels the fused path uses (`cubecl_kernels::cube::AttentionKernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum AttentionChoice {
    /// Tensor-core tile kernels for bf16/f16 where the device has them, else portable.
    Auto,
    /// The portable kernels everywhere (to compare with, or to rule the tile kernels out).
    Scalar,
}

/// Command-line settings of the run.
#[derive(Debug, Parser)]
#[command(about = "Train the reference GPT pipelined on one device; measured vs simulated")]
struct Args {
    /// Backend to train on.
    #[arg(long, value_enum, default_value = "cuda")]
    backend: BackendChoice,
    /// Communicator of the ranks.
    #[arg(long, value_enum, default_value = "local")]
    comm: CommChoice,
    /// Pipeline ranks P.
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Stages per pipeline rank V.
    #[arg(long, default_value_t = 2)]
    loops: usize,
    /// Data-parallel replicas D.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Micro-batches per step and replica M.
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 8)]
    micro_batch_size: usize,
    /// Transformer blocks (at least pp × loops − 2, so every stage has a layer).
    #[arg(long, default_value_t = 16)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Vocabulary, at least the 256 byte-level tokens of the data.
    #[arg(long, default_value_t = 256)]
    vocab: usize,
    /// Optimizer steps; the first `warmup` are not timed.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Untimed steps at the start (kernel compilation, autotuning, allocator growth).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// GPUs to spread the ranks over (CUDA only): world rank `r` runs on GPU `r % gpus`.
    /// Activations cross GPUs through host memory, and so do collectives unless `--comm
    /// nccl`: a correctness check of multi-GPU placement, not a scaling measurement.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Attention kernels of the fused path.
    #[arg(long, value_enum, default_value = "auto")]
    attention: AttentionChoice,
    /// Compute precision of the stages: fp32, bf16 (the default: what the MFU's bf16 peak
    /// counts) or f16 (with dynamic loss scaling). Master weights and optimizer state stay fp32.
    #[arg(long, default_value = "bf16")]
    precision: burn_bfpp::engine::Precision,
    /// ZeRO level 0–3.
    #[arg(long, default_value_t = 3)]
    zero: u8,
    /// Peak dense TFLOP/s of the device, the denominator of MFU (default: the bf16 peak of the
    /// `--hardware` preset, 989 for an H100 or H200 SXM).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Simulator hardware preset for the prediction (a100-80gb, h100-80gb, h200-141gb), or
    /// `auto`: the preset of the GPU that `nvidia-smi` names under `--backend cuda`, h200-141gb
    /// on other backends or a GPU no preset describes (with a warning saying so).
    #[arg(long, default_value = "auto")]
    hardware: String,
    /// Folder for the timelines and the trace.
    #[arg(long, default_value = "gpu-run-out")]
    out: PathBuf,
    /// Train the same GPT, data and steps with a plain Burn loop on one device instead of the
    /// engine (the baseline the engine's tokens/s is measured against; `--pp`, `--loops` and
    /// `--zero` do not apply).
    #[arg(long)]
    baseline: bool,
}

/// Any failure of the run, shown to the user by its message.
type Error = Box<dyn std::error::Error>;

fn main() -> std::process::ExitCode {
    match start(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The message, not `Result`'s debug form: it names the problem and the fix.
            eprintln!("gpu_run: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Checks the settings, then trains with ranks as threads or, under a launcher, as processes.
fn start(mut args: Args) -> Result<(), Error> {
    use cubecl_kernels::cube::{set_attention_kernel, AttentionKernel};
    set_attention_kernel(match args.attention {
        AttentionChoice::Auto => AttentionKernel::Auto,
        AttentionChoice::Scalar => AttentionKernel::Scalar,
    });
    if args.gpus == 0 {
        return Err("--gpus 0: give at least one GPU".into());
    }
    if args.gpus != 1 && args.backend != BackendChoice::Cuda {
        return Err(format!(
            "--gpus {} applies to --backend cuda only; use --gpus 1 with {:?}",
            args.gpus, args.backend
        )
        .into());
    }
    if args.comm == CommChoice::Nccl && args.backend != BackendChoice::Cuda {
        return Err("--comm nccl needs --backend cuda".into());
    }
    if let Some(peak) = args.peak_tflops.filter(|p| !(p.is_finite() && *p > 0.0)) {
        return Err(format!("--peak-tflops {peak}: give the device's positive peak").into());
    }
    #[cfg(feature = "cuda")]
    if args.backend == BackendChoice::Cuda {
        burn_bfpp::comm::cuda_driver_available()?;
    }
    if args.hardware == "auto" {
        args.hardware = auto_hardware(args.backend);
    }
    HardwareConfig::preset(&args.hardware)?;
    if args.baseline {
        return run_baseline(&args);
    }
    // One process per rank when a launcher set torchrun's variables, threads otherwise.
    let process = RendezvousEnv::from_env()?.filter(|env| env.world_size > 1);
    match (args.backend, args.comm, process) {
        (BackendChoice::Flex, _, None) => {
            threads::<burn::backend::Autodiff<burn::backend::Flex>, _>(
                &args,
                |_| Default::default(),
                LocalComm::create_with_devices,
            )
        }
        #[cfg(feature = "wgpu")]
        (BackendChoice::Wgpu, _, None) => {
            threads::<burn::backend::Autodiff<burn::backend::Wgpu>, _>(
                &args,
                |_| burn::backend::wgpu::WgpuDevice::default(),
                LocalComm::create_with_devices,
            )
        }
        #[cfg(feature = "cuda")]
        (BackendChoice::Cuda, CommChoice::Local, None) => {
            threads::<burn::backend::Autodiff<burn::backend::Cuda>, _>(
                &args,
                burn::backend::cuda::CudaDevice::new,
                LocalComm::create_with_devices,
            )
        }
        #[cfg(feature = "cuda")]
        (BackendChoice::Cuda, CommChoice::Nccl, None) => {
            threads::<burn::backend::Autodiff<burn::backend::Cuda>, _>(
                &args,
                burn::backend::cuda::CudaDevice::new,
                burn_bfpp::comm::NcclComm::create,
            )
        }
        #[cfg(feature = "cuda")]
        (BackendChoice::Cuda, CommChoice::Nccl, Some(env)) => {
            processes::<burn::backend::Autodiff<burn::backend::Cuda>, _>(
                &args,
                &env,
                burn::backend::cuda::CudaDevice::new,
                burn_bfpp::comm::NcclComm::over_host,
            )
        }
        (backend, comm, Some(env))
            if !matches!((backend, comm), (BackendChoice::Cuda, CommChoice::Nccl)) =>
        {
            Err(format!(
                "this is rank {} of {} processes, but ranks that are processes are GPU ranks \
                 with NCCL (--backend cuda --comm nccl; their data moves over NCCL, a TCP \
                 control channel carries the rest); run the {backend:?} ranks as threads of \
                 one process (without the launcher's RANK/WORLD_SIZE)",
                env.rank, env.world_size
            )
            .into())
        }
        #[allow(unreachable_patterns)]
        (other, _, _) => Err(format!(
            "backend {other:?} is not built into this binary: rebuild with `--features {}`",
            format!("{other:?}").to_lowercase()
        )
        .into()),
    }
}

/// The plain Burn loop on the backend's first device (`--baseline`).
fn run_baseline(args: &Args) -> Result<(), Error> {
    let peak = match args.peak_tflops {
        Some(p) => p,
        None => HardwareConfig::preset(&args.hardware)?.peak_flops / 1e12,
    };
    match args.backend {
        BackendChoice::Flex => baseline::plain_burn::<burn::backend::Autodiff<burn::backend::Flex>>(
            args,
            Default::default(),
            peak,
        ),
        #[cfg(feature = "wgpu")]
        BackendChoice::Wgpu => baseline::plain_burn::<burn::backend::Autodiff<burn::backend::Wgpu>>(
            args,
            burn::backend::wgpu::WgpuDevice::default(),
            peak,
        ),
        #[cfg(feature = "cuda")]
        BackendChoice::Cuda => baseline::plain_burn::<burn::backend::Autodiff<burn::backend::Cuda>>(
            args,
            burn::backend::cuda::CudaDevice::new(0),
            peak,
        ),
        #[allow(unreachable_patterns)]
        other => Err(format!(
            "backend {other:?} is not built into this binary: rebuild with `--features {}`",
            format!("{other:?}").to_lowercase()
        )
        .into()),
    }
}

/// Ranks as threads of this process: world rank `r` on `device_of(r % args.gpus)`, over the
/// communicators `make_comms` creates; the model and the data start on `device_of(0)`.
fn threads<B, C>(
    args: &Args,
    device_of: impl Fn(usize) -> B::Device,
    make_comms: impl FnOnce(RankGrid, Vec<B::Device>, CommConfig) -> Result<Vec<C>, CommError>,
) -> Result<(), Error>
where
    B: AutodiffBackend + cubecl_kernels::FusedOps,
    C: ThreadRank + Communicator<B::InnerBackend>,
{
    let world = args.pp * args.dp;
    let devices: Vec<B::Device> = (0..world).map(|r| device_of(r % args.gpus)).collect();
    let ranks = format!("{world} ranks as threads");
    run::<B>(
        args,
        device_of(0),
        &ranks,
        |model, cfg, activation, batch, on_step| {
            let comms = make_comms(RankGrid::new(cfg.pp, cfg.dp)?, devices, cfg.comm_config())?;
            train_local_with_comms(
                model,
                cfg,
                comms,
                args.steps,
                activation,
                batch,
                on_step,
                Checkpointing::default(),
            )
            .map(Some)
        },
    )
}

/// This process is world rank `env.rank`, on `device_of(env.local_rank % args.gpus)`,
/// joined to the other processes by the TCP control channel, with `layer` putting its data
/// communicator (NCCL) on top.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn processes<B, C>(
    args: &Args,
    env: &RendezvousEnv,
    device_of: impl Fn(usize) -> B::Device,
    layer: impl FnOnce(ControlComm<B::InnerBackend>) -> Result<C, CommError>,
) -> Result<(), Error>
where
    B: AutodiffBackend + cubecl_kernels::FusedOps,
    C: ProcessRank<B::InnerBackend>,
{
    let device = device_of(env.local_rank % args.gpus);
    let ranks = format!(
        "{} ranks as processes (this is rank {})",
        env.world_size, env.rank
    );
    run::<B>(
        args,
        device.clone(),
        &ranks,
        |model, cfg, activation, batch, on_step| {
            let grid = RankGrid::new(cfg.pp, cfg.dp)?;
            let config = cfg.comm_config();
            let comm = layer(ControlComm::connect(env, grid, device, config)?)?;
            train_processes::<B, _, _, _, _>(
                &comm, model, cfg, args.steps, activation, batch, on_step,
            )
        },
    )
}

/// Model FLOPs of one step by the simulator's formula, so measured and predicted MFU count the
/// same work.
fn shape(args: &Args) -> GptShape {
    GptShape {
        layers: args.layers,
        hidden: args.hidden,
        heads: args.heads,
        sequence: args.seq_len,
        vocabulary: args.vocab,
    }
}

/// Builds the model and the data on `device`, predicts the layout with the simulator, trains
/// with `train` (whose ranks are described by `ranks`) and reports measured beside simulated.
fn run<B>(
    args: &Args,
    device: B::Device,
    ranks: &str,
    train: impl FnOnce(
        &Gpt<B>,
        &EngineConfig,
        [usize; 3],
        &(dyn Fn(usize, usize, usize) -> MicroBatch<B> + Sync),
        &(dyn Fn(&StepReport) + Sync),
    ) -> Result<Option<TrainOutcome<Gpt<B>>>, EngineError>,
) -> Result<(), Error>
where
    B: AutodiffBackend + cubecl_kernels::FusedOps,
{
    let world = args.pp * args.dp;
    // Devices the ranks actually run on (a world smaller than --gpus leaves some idle).
    let gpus_used = args.gpus.min(world);
    if args.warmup >= args.steps {
        return Err(format!(
            "--warmup {} leaves no timed step of --steps {}: raise --steps",
            args.warmup, args.steps
        )
        .into());
    }
    let zero = ZeroLevel::from_number(args.zero)?;
    let gpt = GptConfig {
        vocab_size: args.vocab,
        seq_len: args.seq_len,
        hidden: args.hidden,
        heads: args.heads,
        layers: args.layers,
        ..GptConfig::default()
    };
    let model: Gpt<B> = { gpt.init_seeded::<B>(0, &device)? };
    let layout = BatchLayout {
        dp: args.dp,
        microbatches: args.microbatches,
        micro_batch_size: args.micro_batch_size,
    };
    let cfg = EngineConfig {
        pp: args.pp,
        loops: args.loops,
        dp: args.dp,
        microbatches: args.microbatches,
        bf_microbatches: None,
        schedule: ScheduleKind::BreadthFirst,
        placement: Placement::Looping,
        zero,
        buffers: 2,
        recompute: false,
        split: ModelSplit::Even,
        adamw: AdamWSettings::default(),
        lr: LrSchedule::constant(1e-4),
        max_grad_norm: 1.0,
        comm_timeout: Duration::from_secs(600),
        overlap_collectives: true,
        fault: None,
        on_nonfinite: Default::default(),
        precision: args.precision,
        loss_scaling: Default::default(),
    };
    let program = cfg.program()?;
    // Predict first: a layout the simulator cannot cost is refused before any training.
    let hardware = HardwareConfig::preset(&args.hardware)?;
    let peak_tflops = args.peak_tflops.unwrap_or(hardware.peak_flops / 1e12);
    let mut sim_cfg = SimConfig::new(ModelConfig::Gpt(shape(args)), hardware);
    sim_cfg.dp = args.dp;
    sim_cfg.micro_batch_size = args.micro_batch_size;
    sim_cfg.zero = zero;
    let predicted = simulate(&program, &sim_cfg)?;

    if args.vocab < 256 {
        return Err(format!(
            "--vocab {} is below the 256 byte-level tokens of the data: use --vocab 256 or more",
            args.vocab
        )
        .into());
    }
    let corpus = MarkovCorpus::new(MarkovConfig::default())?;
    let samples = layout.dp * layout.microbatches * layout.micro_batch_size;
    let batcher = Batcher::new(&corpus, BatchConfig::new(gpt.seq_len, samples, 0))?;
    let batch = |step: usize, dp_index, mb| {
        batcher
            .micro_batch::<B>((step - 1) as u64, &layout, dp_index, mb, &device)
            .expect("the layout was checked when the batcher was built")
    };

    // Burn's matmul routine matters on the CubeCL backends only (Flex has its own).
    let matmul = match args.backend {
        BackendChoice::Flex => String::new(),
        _ => format!(" ({} matmul)", cubecl_kernels::BURN_MATMUL),
    };
    println!(
        "gpu-run: {:?} backend{matmul}; GPT {} blocks, hidden {}, {} heads, seq {}, vocab {}",
        args.backend, args.layers, args.hidden, args.heads, args.seq_len, args.vocab
    );
    println!(
        "layout: breadth-first pp={} loops={} dp={} M={} mbs={} ZeRO-{}, {}; {ranks} on {} \
         device(s), {:?} communicator",
        args.pp,
        args.loops,
        args.dp,
        args.microbatches,
        args.micro_batch_size,
        args.zero,
        args.precision,
        gpus_used,
        args.comm
    );
    let activation = [args.micro_batch_size, gpt.seq_len, gpt.hidden];
    let on_step = |r: &StepReport| {
        println!(
            "step {:>3}  loss {:.4}  at {:.2} s",
            r.step, r.loss, r.elapsed
        );
    };
    let Some(outcome) = train(&model, &cfg, activation, &batch, &on_step)? else {
        // Another process reports.
        return Ok(());
    };
    // Reading the parameters waits for every queued kernel, so the last step's time is real.
    let norm = param_l2_norm(&outcome.model);
    let step_s = report::timed_step_seconds(&outcome.timelines, args.steps, args.warmup)?;
    let tokens = (samples * args.seq_len) as f64;
    let flops = shape(args).step_model_flops(samples);
    // Per GPU: the step's model FLOPs shared by the devices the ranks ran on.
    let tflops = flops / step_s / 1e12 / gpus_used as f64;

    let profile = StepProfile::measure(&outcome.timelines, args.pp, args.steps);

    std::fs::create_dir_all(&args.out)?;
    let measured_trace = Trace::from_engine(&outcome.timelines).with_title("measured");
    let simulated_trace = Trace::from_sim(&predicted)
        .with_title(format!("simulated, one {} per rank", args.hardware));
    let measured_svg = args.out.join("timeline-measured.svg");
    let simulated_svg = args.out.join("timeline-simulated.svg");
    let trace_json = args.out.join("trace-measured.json");
    write_file(&measured_svg, &timeline_svg(&measured_trace))?;
    write_file(&simulated_svg, &timeline_svg(&simulated_trace))?;
    write_file(&trace_json, &chrome_trace_json(&measured_trace))?;

    println!(
        "\nfinal loss {:.4}, parameter L2 norm {norm:.4}",
        outcome.losses.last().copied().unwrap_or(f64::NAN)
    );
    report::print_comparison(
        &Measured {
            step_s,
            tokens,
            tflops_per_gpu: tflops,
            peak_tflops,
            bubble: profile.as_ref().map_or(f64::NAN, |p| p.bubble_fraction),
        },
        &predicted,
    );
    println!(
        "measured: {ranks} on {} device(s) (ranks sharing a device take turns); simulated: \
         one {} per rank. MFU against {:.0} TFLOP/s.",
        gpus_used, args.hardware, peak_tflops
    );
    println!(
        "wrote {}, {}, {}",
        measured_svg.display(),
        simulated_svg.display(),
        trace_json.display()
    );
    Ok(())
}

/// L2 norm of every parameter; reading them back synchronises the device.
fn param_l2_norm<B: AutodiffBackend>(model: &Gpt<B>) -> f64 {
    struct SumSquares(f64);
    impl<B: AutodiffBackend> ModuleVisitor<B> for SumSquares {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let v = param.val().powi_scalar(2).sum().into_scalar();
            self.0 += burn::tensor::ElementConversion::elem::<f64>(v);
        }
    }
    let mut s = SumSquares(0.0);
    model.visit(&mut s);
    s.0.sqrt()
}
