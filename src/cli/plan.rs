//! `bfpp plan` and `bfpp compare`: the planner's ranking, explanations and the best layout of
//! each family.

use std::fmt::Write as _;

use burn_bfpp::plan::{explain, plan, Candidate, Family, Plan, PlanRequest};
use clap::Args;
use serde_json::{json, Map, Value};

use super::error::CliError;
use super::output::write_output;
use super::simulate::{gib, load_hardware, load_model};

/// The flags `plan` and `compare` share.
#[derive(Debug, Clone, Args)]
pub struct RequestArgs {
    /// A model preset (gpt-1.3b, gpt-6.7b, gpt-52b) or a TOML file.
    #[arg(long, default_value = "gpt-52b", value_name = "NAME|FILE")]
    pub model: String,
    /// A hardware preset (a100-80gb, h100-80gb, h200-141gb) or a TOML file.
    #[arg(long, default_value = "a100-80gb", value_name = "NAME|FILE")]
    pub hardware: String,
    /// GPUs N (all are used: N = tp × pp × dp).
    #[arg(long)]
    pub gpus: usize,
    /// Samples per optimizer step B (B = dp × microbatches × micro-batch size).
    #[arg(long)]
    pub global_batch: usize,
    /// Largest micro-batch count M the search considers.
    #[arg(long, default_value_t = 512)]
    pub max_microbatches: usize,
    /// Full-size gathered-weight and gradient buffers per rank (ZeRO-2/3) of every layout,
    /// as `bfpp train --buffers`.
    #[arg(long, default_value_t = burn_bfpp::schedule::DEFAULT_BUFFERS, value_name = "N")]
    pub buffers: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl RequestArgs {
    fn request(&self) -> Result<PlanRequest, CliError> {
        let mut req = PlanRequest::new(
            load_model(&self.model)?,
            load_hardware(&self.hardware)?,
            self.gpus,
            self.global_batch,
        );
        req.limits.max_microbatches = self.max_microbatches;
        req.buffers = self.buffers;
        Ok(req)
    }
}

/// `bfpp plan [FLAGS]`.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// Model, hardware, GPUs and batch.
    #[command(flatten)]
    pub request: RequestArgs,
    /// Layouts to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Explain one layout instead, e.g. "pp=8,loops=4,dp=8,zero=3,schedule=breadth-first":
    /// why it is rejected, or where it loses time against the best.
    #[arg(long, value_name = "LAYOUT")]
    pub explain: Option<String>,
}

/// `bfpp compare [FLAGS]`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Model, hardware, GPUs and batch.
    #[command(flatten)]
    pub request: RequestArgs,
}

fn candidate_json(c: &Candidate) -> Value {
    let s = &c.score;
    json!({
        "tokens_per_s": s.tokens_per_s,
        "step_time_s": s.step_time_s,
        "tflops_per_gpu": s.tflops_per_gpu,
        "mfu": s.mfu,
        "bubble_fraction": s.bubble_fraction,
        "exposed_p2p_s": s.exposed_p2p_s,
        "exposed_dp_s": s.exposed_dp_s,
        "peak_memory_bytes": s.peak_memory_bytes,
        "layout": c.layout.to_json(),
    })
}

const HEADER: &str =
    "  family             tokens/s  tok/s/GPU    MFU  bubble  exp.dp s  peak GiB  layout";

fn row(out: &mut String, label: &str, c: &Candidate, gpus: usize) {
    let s = &c.score;
    let l = &c.layout;
    let _ = writeln!(
        out,
        "  {label:<16} {:>10.0} {:>10.1} {:>5.1}% {:>7.3} {:>9.4} {:>9} {}",
        s.tokens_per_s,
        s.tokens_per_s / gpus as f64,
        100.0 * s.mfu,
        s.bubble_fraction,
        s.exposed_dp_s,
        gib(s.peak_memory_bytes).trim_end_matches(" GiB"),
        format_args!(
            "tp={} pp={} loops={} dp={} M={}{} mbs={} ZeRO-{} {}{}{}",
            l.tp,
            l.pp,
            l.loops,
            l.dp,
            l.microbatches,
            l.bf_microbatches
                .map_or(String::new(), |k| format!(" K={k}")),
            l.micro_batch_size,
            l.zero.number(),
            l.schedule,
            if l.recompute { " recompute" } else { "" },
            if l.strategy == burn_bfpp::sim::Strategy::Megatron {
                " (megatron)"
            } else {
                ""
            }
        )
    );
}

fn heading(req: &PlanRequest, args: &RequestArgs, plan: &Plan) -> String {
    format!(
        "{} on {} × {}, global batch {} ({:.3} samples per GPU): {} layouts enumerated, {} over \
         memory by bound, {} simulated ({} over memory), {} pruned by the throughput bound\n",
        args.model,
        req.gpus,
        args.hardware,
        req.global_batch,
        req.global_batch as f64 / req.gpus as f64,
        plan.stats.enumerated,
        plan.stats.over_memory_bound,
        plan.stats.simulated,
        plan.stats.over_memory_simulated,
        plan.stats.pruned,
    )
}

/// Run `bfpp plan`.
pub fn run_plan(args: &PlanArgs) -> Result<(), CliError> {
    let req = args.request.request()?;
    if let Some(text) = &args.explain {
        let e = explain(&req, text)?;
        return write_output(None, &e.text);
    }
    let plan = plan(&req, args.top)?;
    let text = if args.request.json {
        let doc = json!({
            "layouts": plan.ranked.iter().map(candidate_json).collect::<Vec<_>>(),
        });
        format!("{doc:#}\n")
    } else {
        let mut out = heading(&req, &args.request, &plan);
        let _ = writeln!(out, "{}", HEADER.replacen("family", "rank  ", 1));
        for (i, c) in plan.ranked.iter().enumerate() {
            row(
                &mut out,
                &format!("{:<2} {}", i + 1, c.layout.family()),
                c,
                req.gpus,
            );
        }
        out
    };
    write_output(None, &text)
}

/// Run `bfpp compare`.
pub fn run_compare(args: &CompareArgs) -> Result<(), CliError> {
    let req = args.request.request()?;
    let plan = plan(&req, 1)?;
    let text = if args.request.json {
        let mut families = Map::new();
        for f in Family::ALL {
            let v = plan
                .best_per_family
                .get(&f)
                .map_or(Value::Null, candidate_json);
            families.insert(f.name().to_string(), v);
        }
        format!("{:#}\n", json!({ "families": families }))
    } else {
        let mut out = heading(&req, &args.request, &plan);
        let _ = writeln!(out, "{HEADER}");
        for f in Family::ALL {
            match plan.best_per_family.get(&f) {
                Some(c) => row(&mut out, f.name(), c, req.gpus),
                None => {
                    let _ = writeln!(out, "  {:<16} no layout fits in memory", f.name());
                }
            }
        }
        out
    };
    write_output(None, &text)
}
