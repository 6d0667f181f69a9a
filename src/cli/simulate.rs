//! `bfpp simulate`: predict one optimizer step of a layout with the event simulator, print a
//! summary (or the JSON object of `burn_bfpp::sim::JSON_KEYS`) and draw the pictures.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use burn_bfpp::schedule::{
    Placement, Program, ProgramSpec, ScheduleKind, ScheduleSpec, ZeroLevel, DEFAULT_BUFFERS,
};
use burn_bfpp::sim::{
    build_program, simulate_program, HardwareConfig, ModelConfig, SimConfig, SimError, SimResult,
    Strategy, UnitModel, HARDWARE_PRESETS, MODEL_PRESETS,
};
use burn_bfpp::viz::{
    chrome_trace_json, memory_svg, timeline_svg, write_file, MemorySeries, TimeUnit, Trace,
};
use clap::Args;

use super::error::CliError;
use super::output::write_output;
use super::schedule::read_schedule_file;

/// `bfpp simulate [FLAGS]`.
#[derive(Debug, Clone, Args)]
pub struct SimulateArgs {
    /// A model preset (gpt-1.3b, gpt-6.7b, gpt-52b, unit) or a TOML file.
    #[arg(long, default_value = "gpt-52b", value_name = "NAME|FILE")]
    pub model: String,
    /// A hardware preset (a100-80gb, h100-80gb, h200-141gb) or a TOML file.
    #[arg(long, default_value = "a100-80gb", value_name = "NAME|FILE")]
    pub hardware: String,
    /// Schedule: gpipe, 1f1b, interleaved (depth-first), breadth-first, or with split
    /// backwards zb-h1, interleaved-zb, zb-v, breadth-first-zb, dualpipev.
    #[arg(long, default_value = "breadth-first")]
    pub schedule: ScheduleKind,
    /// Pipeline ranks P [default: 4].
    #[arg(long)]
    pub pp: Option<usize>,
    /// Stages per pipeline rank V [default: 1 for gpipe and 1f1b, 2 otherwise].
    #[arg(long)]
    pub loops: Option<usize>,
    /// Data-parallel replicas D.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Tensor-parallel size T (simulated as a cost only).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Micro-batches per step and replica M [default: 8].
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Breadth-first micro-batches per sweep K (must divide M) [default: M].
    #[arg(long)]
    pub bf_microbatches: Option<usize>,
    /// Simulate this schedule CSV (written by `bfpp schedule` or by PyTorch's pipelining, in
    /// either naming) instead of a generated one: P, V and M come from the file, and a --pp,
    /// --loops or --microbatches that disagrees is refused; its transfers and collectives are
    /// placed again for --zero and --buffers.
    #[arg(
        long,
        value_name = "FILE.csv",
        conflicts_with_all = ["bf_microbatches", "strategy"]
    )]
    pub schedule_file: Option<PathBuf>,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub micro_batch_size: usize,
    /// ZeRO level 0–3 [default: 1 with --strategy megatron, 0 otherwise].
    #[arg(long)]
    pub zero: Option<ZeroLevel>,
    /// Full activation recomputation (the backward re-runs the forward).
    #[arg(long)]
    pub recompute: bool,
    /// Full-size gathered-weight and gradient buffers per rank (ZeRO-2/3), as `bfpp train
    /// --buffers`: fewer hold less memory, at the cost of gathering weights again.
    #[arg(long, default_value_t = DEFAULT_BUFFERS, value_name = "N")]
    pub buffers: usize,
    /// Backward time ÷ forward time of the `unit` model.
    #[arg(long, value_name = "R")]
    pub backward_ratio: Option<f64>,
    /// bfpp (prefetch and early reduce) or megatron (ZeRO-1, reductions after the backward).
    #[arg(long, default_value = "bfpp")]
    pub strategy: Strategy,
    /// Print one JSON object with the summary keys instead of the text summary.
    #[arg(long)]
    pub json: bool,
    /// Write the SVG timeline (one lane per rank and stream) to FILE.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Write a Chrome trace (open in Perfetto) to FILE.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write the SVG chart of memory over time per rank to FILE.
    #[arg(long, value_name = "FILE")]
    pub memory_svg: Option<PathBuf>,
}

/// A model preset, or a TOML file with `kind = "gpt"` or `kind = "unit"` and its fields.
pub fn load_model(name: &str) -> Result<ModelConfig, CliError> {
    if MODEL_PRESETS.contains(&name) {
        return Ok(ModelConfig::preset(name)?);
    }
    let text = read_named(name, "model", &MODEL_PRESETS)?;
    ModelConfig::from_toml_str(&text).map_err(|source| in_file(name, source))
}

/// A hardware preset, or a TOML file with the fields of `HardwareConfig`.
pub fn load_hardware(name: &str) -> Result<HardwareConfig, CliError> {
    if HARDWARE_PRESETS.contains(&name) {
        return Ok(HardwareConfig::preset(name)?);
    }
    let text = read_named(name, "hardware", &HARDWARE_PRESETS)?;
    HardwareConfig::from_toml_str(&text).map_err(|source| in_file(name, source))
}

fn in_file(path: &str, source: SimError) -> CliError {
    CliError::SimFile {
        path: PathBuf::from(path),
        source,
    }
}

/// The contents of `name` as a file; when there is no such file, an error listing the presets.
fn read_named(name: &str, what: &'static str, presets: &[&str]) -> Result<String, CliError> {
    let path = Path::new(name);
    if !path.is_file() {
        return Err(CliError::Sim(SimError::Config(format!(
            "unknown {what} `{name}`: not a preset ({}) and not a file; give a preset name or \
             the path of a TOML file",
            presets.join(", ")
        ))));
    }
    std::fs::read_to_string(path).map_err(|source| CliError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The simulator configuration of a model, hardware and layout (checked).
#[allow(clippy::too_many_arguments)]
pub fn sim_config(
    model: ModelConfig,
    hardware: HardwareConfig,
    dp: usize,
    tp: usize,
    micro_batch_size: usize,
    zero: ZeroLevel,
    recompute: bool,
) -> Result<SimConfig, SimError> {
    let mut cfg = SimConfig::new(model, hardware);
    cfg.dp = dp;
    cfg.tp = tp;
    cfg.micro_batch_size = micro_batch_size;
    cfg.zero = zero;
    cfg.recompute = recompute;
    cfg.check()?;
    Ok(cfg)
}

/// Run `bfpp simulate`.
pub fn run(args: &SimulateArgs) -> Result<(), CliError> {
    let mut model = load_model(&args.model)?;
    if let Some(ratio) = args.backward_ratio {
        match &mut model {
            ModelConfig::Unit(u) => {
                *u = UnitModel {
                    backward_ratio: ratio,
                    ..u.clone()
                }
            }
            ModelConfig::Gpt(_) => {
                return Err(CliError::Sim(SimError::Config(
                    "--backward-ratio sets the unit model's backward time; a GPT's backward \
                     comes from its FLOPs: drop --backward-ratio or use --model unit"
                        .into(),
                )))
            }
        }
    }
    let hardware = load_hardware(&args.hardware)?;
    let zero = args.zero.unwrap_or(match args.strategy {
        Strategy::Megatron => ZeroLevel::Zero1,
        Strategy::Bfpp => ZeroLevel::Zero0,
    });
    let cfg = sim_config(
        model,
        hardware,
        args.dp,
        args.tp,
        args.micro_batch_size,
        zero,
        args.recompute,
    )?;
    args.strategy.check_config(&cfg)?;
    let (program, pp, layout) = match &args.schedule_file {
        Some(path) => {
            let compute = read_schedule_file(path, args.pp, args.loops, args.microbatches)?;
            let pp = compute.num_ranks();
            let layout = format!(
                "{}: pp={pp} stages={} M={}",
                path.display(),
                compute.num_stages(),
                compute.microbatches
            );
            let program =
                Program::lower(compute, zero, args.buffers).map_err(|source| CliError::InFile {
                    path: path.clone(),
                    source,
                })?;
            (program, pp, layout)
        }
        None => {
            let kind = args.schedule;
            let loops = args.loops.unwrap_or(kind.family().default_loops);
            let spec = ScheduleSpec {
                kind,
                pp: args.pp.unwrap_or(4),
                loops,
                microbatches: args.microbatches.unwrap_or(8),
                bf_microbatches: args.bf_microbatches,
                placement: Placement::Looping,
            };
            let layout = format!(
                "{kind} pp={} loops={loops} M={}",
                spec.pp, spec.microbatches
            );
            let pp = spec.pp;
            let program = build_program(
                &ProgramSpec::new(spec, zero).with_buffers(args.buffers),
                args.strategy,
            )?;
            (program, pp, layout)
        }
    };
    let result = simulate_program(&program, &cfg)?;
    let title = format!(
        "{} on {}: {layout} dp={} tp={} mbs={} ZeRO-{} ({})",
        args.model,
        args.hardware,
        args.dp,
        args.tp,
        args.micro_batch_size,
        zero.number(),
        args.strategy
    );
    if let Some(path) = &args.svg {
        let trace = Trace::from_sim(&result).with_title(&title);
        write_file(path, &timeline_svg(&trace))?;
    }
    if let Some(path) = &args.trace {
        let trace = Trace::from_sim(&result).with_title(&title);
        write_file(path, &chrome_trace_json(&trace))?;
    }
    if let Some(path) = &args.memory_svg {
        let unit = if result.unit_time {
            TimeUnit::Units
        } else {
            TimeUnit::Seconds
        };
        let series = MemorySeries::from_sim(&result);
        write_file(
            path,
            &memory_svg(&format!("memory: {title}"), &series, unit),
        )?;
    }
    let text = if args.json {
        format!("{:#}\n", result.to_json())
    } else {
        summary(&title, &cfg, pp, &result)
    };
    write_output(None, &text)
}

/// Bytes as GiB with two decimals.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// A per-rank list, shortened to its extremes when long.
fn per_rank<T: Copy + PartialOrd + std::fmt::Display>(
    values: &[T],
    show: impl Fn(T) -> String,
) -> String {
    if values.len() <= 8 {
        return values
            .iter()
            .map(|&v| show(v))
            .collect::<Vec<_>>()
            .join(", ");
    }
    let (mut lo, mut hi) = (0, 0);
    for (i, v) in values.iter().enumerate() {
        if *v < values[lo] {
            lo = i;
        }
        if *v > values[hi] {
            hi = i;
        }
    }
    format!(
        "min {} (rank {lo}), max {} (rank {hi}) over {} ranks",
        show(values[lo]),
        show(values[hi]),
        values.len()
    )
}

/// The human summary.
fn summary(title: &str, cfg: &SimConfig, pp: usize, r: &SimResult) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{title}");
    let gpus = pp * cfg.dp * cfg.tp;
    let (t, rate) = if r.unit_time {
        let _ = writeln!(
            out,
            "unit model: times are in units (a stage forward takes 1), communication is free, \
             throughput counts samples per unit"
        );
        ("units", "samples/unit")
    } else {
        ("s", "tokens/s")
    };
    let _ = writeln!(
        out,
        "GPUs              {gpus} (pp {pp} × dp {} × tp {})",
        cfg.dp, cfg.tp
    );
    let _ = writeln!(out, "step time         {:.6} {t}", r.step_time_s);
    // Unit throughputs are small fractions (samples per unit); tokens/s are large numbers.
    let digits = if r.unit_time { 4 } else { 1 };
    let _ = writeln!(out, "throughput        {:.digits$} {rate}", r.tokens_per_s);
    if !r.unit_time {
        let _ = writeln!(
            out,
            "TFLOP/s per GPU   {:.1} (MFU {:.1} %)",
            r.tflops_per_gpu,
            100.0 * r.mfu
        );
    }
    let _ = writeln!(
        out,
        "bubble fraction   {:.4} (ideal compute {:.6} {t})",
        r.bubble_fraction, r.ideal_compute_s
    );
    let _ = writeln!(out, "exposed p2p       {:.6} {t}", r.exposed_p2p_s);
    let _ = writeln!(out, "exposed dp        {:.6} {t}", r.exposed_dp_s);
    if !r.unit_time || r.peak_memory_bytes.iter().any(|&b| b > 0) {
        let _ = writeln!(
            out,
            "peak memory       {}",
            per_rank(&r.peak_memory_bytes, gib)
        );
        let worst = r.peak_memory_bytes.iter().copied().max().unwrap_or(0);
        if worst > r.device_memory_bytes {
            let _ = writeln!(
                out,
                "DOES NOT FIT      peak {} > device memory {}: raise --zero, --pp or --tp, use \
                 --recompute, or lower --micro-batch-size or --microbatches",
                gib(worst),
                gib(r.device_memory_bytes)
            );
        }
    }
    let _ = writeln!(
        out,
        "peak activations  {} micro-batches",
        per_rank(&r.peak_activation_microbatches, |v| format!("{v:.2}"))
    );
    let _ = writeln!(
        out,
        "all-gathers       {}",
        per_rank(&r.all_gathers, |v| v.to_string())
    );
    let _ = writeln!(
        out,
        "reduce-scatters   {}",
        per_rank(&r.reduce_scatters, |v| v.to_string())
    );
    out
}
