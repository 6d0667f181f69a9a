//! One parallel layout: its fields, its text form (`pp=8,loops=4,dp=8,...`), its family and
//! the rules it must follow.

use std::fmt;
use std::str::FromStr;

use serde_json::{json, Value};

use crate::schedule::{Placement, ProgramSpec, ScheduleKind, ScheduleSpec, ZeroLevel};
use crate::sim::{ModelConfig, SimConfig, SimError, Strategy};

use super::{PlanError, PlanRequest};

/// The families `bfpp compare` reports, each the best of its kind of layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// Looped breadth-first pipeline (the paper), any ZeRO level, bfpp overlap.
    BreadthFirst,
    /// Looped depth-first pipeline (interleaved 1F1B), any ZeRO level, bfpp overlap.
    DepthFirst,
    /// Non-looped 1F1B, any ZeRO level, bfpp overlap.
    OneFOneB,
    /// GPipe, any ZeRO level, bfpp overlap.
    GPipe,
    /// Megatron-LM: 1F1B or interleaved, ZeRO-1, reductions at the end of the step.
    Megatron,
    /// Breadth-first with split backwards whose weight passes fill the waits.
    BreadthFirstZeroBubble,
    /// Interleaved 1F1B with split backwards (interleaved zero-bubble).
    InterleavedZeroBubble,
    /// ZB-H1: 1F1B with split backwards at 1F1B's memory.
    ZeroBubbleH1,
    /// ZB-V: two stages per rank in a V, split backwards.
    ZeroBubbleV,
    /// DualPipeV: two stages per rank in a V, overlapped forward/backward pairs.
    DualPipeV,
}

impl Family {
    /// Every family, in the order `bfpp compare` prints them.
    pub const ALL: [Family; 10] = [
        Family::BreadthFirst,
        Family::BreadthFirstZeroBubble,
        Family::DepthFirst,
        Family::InterleavedZeroBubble,
        Family::OneFOneB,
        Family::ZeroBubbleH1,
        Family::ZeroBubbleV,
        Family::DualPipeV,
        Family::GPipe,
        Family::Megatron,
    ];

    /// The name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Family::BreadthFirst => "breadth-first",
            Family::DepthFirst => "depth-first",
            Family::OneFOneB => "1f1b",
            Family::GPipe => "gpipe",
            Family::Megatron => "megatron",
            Family::BreadthFirstZeroBubble => "breadth-first-zb",
            Family::InterleavedZeroBubble => "interleaved-zb",
            Family::ZeroBubbleH1 => "zb-h1",
            Family::ZeroBubbleV => "zb-v",
            Family::DualPipeV => "dualpipev",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A complete parallel layout of one training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    /// How data parallelism is run around the pipeline.
    pub strategy: Strategy,
    /// Schedule family of the pipeline.
    pub schedule: ScheduleKind,
    /// Tensor-parallel size T.
    pub tp: usize,
    /// Pipeline ranks P.
    pub pp: usize,
    /// Stages per pipeline rank V.
    pub loops: usize,
    /// Data-parallel replicas D.
    pub dp: usize,
    /// Micro-batches per step and replica M.
    pub microbatches: usize,
    /// Breadth-first micro-batches per sweep K of Fast-LLM's hybrid (breadth-first only; K
    /// divides M). `None`: K = M, the pure breadth-first schedule.
    pub bf_microbatches: Option<usize>,
    /// Samples per micro-batch.
    pub micro_batch_size: usize,
    /// ZeRO level.
    pub zero: ZeroLevel,
    /// Full activation recomputation.
    pub recompute: bool,
}

impl Layout {
    /// The family the layout belongs to.
    pub fn family(&self) -> Family {
        match (self.strategy, self.schedule) {
            (Strategy::Megatron, _) => Family::Megatron,
            (_, ScheduleKind::BreadthFirst) => Family::BreadthFirst,
            (_, ScheduleKind::Interleaved) => Family::DepthFirst,
            (_, ScheduleKind::OneFOneB) => Family::OneFOneB,
            (_, ScheduleKind::GPipe) => Family::GPipe,
            (_, ScheduleKind::ZeroBubbleH1) => Family::ZeroBubbleH1,
            (_, ScheduleKind::InterleavedZeroBubble) => Family::InterleavedZeroBubble,
            (_, ScheduleKind::BreadthFirstZeroBubble) => Family::BreadthFirstZeroBubble,
            (_, ScheduleKind::ZeroBubbleV) => Family::ZeroBubbleV,
            (_, ScheduleKind::DualPipeV) => Family::DualPipeV,
        }
    }

    /// GPUs used: T·P·D.
    pub fn gpus(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// Samples per step: D·M·micro-batch size.
    pub fn global_batch(&self) -> usize {
        self.dp * self.microbatches * self.micro_batch_size
    }

    /// The schedule to generate (looping placement, pure breadth-first micro-batching).
    pub fn spec(&self) -> ScheduleSpec {
        ScheduleSpec {
            kind: self.schedule,
            pp: self.pp,
            loops: self.loops,
            microbatches: self.microbatches,
            bf_microbatches: self.bf_microbatches,
            placement: Placement::Looping,
        }
    }

    /// The programs to compile: this layout's schedule at its ZeRO level with `buffers`.
    pub fn program(&self, buffers: usize) -> ProgramSpec {
        ProgramSpec::new(self.spec(), self.zero).with_buffers(buffers)
    }

    /// The simulator configuration of this layout on the request's model and hardware.
    pub fn sim_config(&self, req: &PlanRequest) -> Result<SimConfig, SimError> {
        let mut cfg = SimConfig::new(req.model.clone(), req.hardware.clone());
        cfg.dp = self.dp;
        cfg.tp = self.tp;
        cfg.micro_batch_size = self.micro_batch_size;
        cfg.zero = self.zero;
        cfg.recompute = self.recompute;
        cfg.check()?;
        Ok(cfg)
    }

    /// The layout as JSON (the `layout` object of `bfpp compare --json`).
    pub fn to_json(&self) -> Value {
        json!({
            "strategy": self.strategy.name(),
            "schedule": self.schedule.name(),
            "tp": self.tp,
            "pp": self.pp,
            "loops": self.loops,
            "dp": self.dp,
            "microbatches": self.microbatches,
            "bf_microbatches": self.bf_microbatches,
            "micro_batch_size": self.micro_batch_size,
            "zero": self.zero.number(),
            "recompute": self.recompute,
        })
    }

    /// Why the layout is not allowed for `req`, or `None`: GPU and batch arithmetic, the
    /// schedule's own rules, the strategy's, and the model's divisibility.
    pub fn rule_violation(&self, req: &PlanRequest) -> Option<String> {
        if self.gpus() != req.gpus {
            return Some(format!(
                "tp × pp × dp = {} × {} × {} = {} GPUs, but the request has {}",
                self.tp,
                self.pp,
                self.dp,
                self.gpus(),
                req.gpus
            ));
        }
        if self.global_batch() != req.global_batch {
            return Some(format!(
                "dp × microbatches × micro-batch size = {} × {} × {} = {} samples, but the \
                 global batch is {}",
                self.dp,
                self.microbatches,
                self.micro_batch_size,
                self.global_batch(),
                req.global_batch
            ));
        }
        if let Err(e) = self.spec().check() {
            return Some(e.to_string());
        }
        if let Err(e) = self.strategy.check(self.schedule, self.zero) {
            return Some(e.to_string());
        }
        match self.sim_config(req) {
            Err(e) => return Some(e.to_string()),
            Ok(cfg) => {
                if let Err(e) = self.strategy.check_config(&cfg) {
                    return Some(e.to_string());
                }
            }
        }
        if let ModelConfig::Gpt(g) = &req.model {
            if self.pp * self.loops > g.layers {
                return Some(format!(
                    "pp × loops = {} stages but the model has {} layers; every stage needs one",
                    self.pp * self.loops,
                    g.layers
                ));
            }
        }
        None
    }
}

impl fmt::Display for Layout {
    /// The text form `--explain` reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "schedule={},strategy={},tp={},pp={},loops={},dp={},microbatches={},mbs={},zero={},recompute={}",
            self.schedule,
            self.strategy,
            self.tp,
            self.pp,
            self.loops,
            self.dp,
            self.microbatches,
            self.micro_batch_size,
            self.zero.number(),
            self.recompute
        )?;
        match self.bf_microbatches {
            Some(k) => write!(f, ",k={k}"),
            None => Ok(()),
        }
    }
}

impl Layout {
    /// Read `key=value` pairs separated by commas. Keys: `schedule`, `strategy` (or
    /// `family=megatron`), `tp`, `pp`, `loops` (or `v`), `dp`, `microbatches` (or `m`), `k`
    /// (or `bf_microbatches`), `mbs` (or `micro_batch_size`), `zero`, `recompute`. Missing keys default to tp = 1,
    /// loops = 1, mbs = 1, ZeRO-1 for megatron and 0 otherwise, no recomputation, bfpp,
    /// breadth-first; a missing `dp` or `microbatches` follows from the request's GPUs and
    /// global batch.
    pub fn parse(text: &str, req: &PlanRequest) -> Result<Layout, PlanError> {
        let bad = |reason: String| PlanError::Layout {
            text: text.to_string(),
            reason,
        };
        let mut l = Layout {
            strategy: Strategy::Bfpp,
            schedule: ScheduleKind::BreadthFirst,
            tp: 1,
            pp: 1,
            loops: 1,
            dp: 0,
            microbatches: 0,
            bf_microbatches: None,
            micro_batch_size: 1,
            zero: ZeroLevel::Zero0,
            recompute: false,
        };
        let mut zero_given = false;
        let number = |key: &str, v: &str| {
            v.parse::<usize>()
                .map_err(|_| bad(format!("{key}={v}: expected a whole number")))
        };
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| bad(format!("`{pair}` is not key=value")))?;
            let (key, value) = (key.trim().to_ascii_lowercase(), value.trim());
            match key.as_str() {
                "schedule" => {
                    l.schedule = ScheduleKind::from_str(value).map_err(|e| bad(e.to_string()))?
                }
                "strategy" => {
                    l.strategy = Strategy::from_str(value).map_err(|e| bad(e.to_string()))?
                }
                "family" => match value {
                    "megatron" => l.strategy = Strategy::Megatron,
                    "breadth-first" | "depth-first" | "1f1b" | "gpipe" => {
                        l.strategy = Strategy::Bfpp;
                        l.schedule =
                            ScheduleKind::from_str(value).map_err(|e| bad(e.to_string()))?;
                    }
                    other => {
                        return Err(bad(format!(
                            "unknown family `{other}`; use breadth-first, depth-first, 1f1b, \
                             gpipe or megatron"
                        )))
                    }
                },
                "tp" => l.tp = number("tp", value)?,
                "pp" => l.pp = number("pp", value)?,
                "loops" | "v" => l.loops = number("loops", value)?,
                "dp" => l.dp = number("dp", value)?,
                "microbatches" | "m" => l.microbatches = number("microbatches", value)?,
                "k" | "bf_microbatches" | "bf-microbatches" => {
                    l.bf_microbatches = Some(number("k", value)?)
                }
                "mbs" | "micro_batch_size" | "micro-batch-size" => {
                    l.micro_batch_size = number("mbs", value)?
                }
                "zero" => {
                    l.zero = ZeroLevel::from_str(value).map_err(|e| bad(e.to_string()))?;
                    zero_given = true;
                }
                "recompute" => {
                    l.recompute = match value {
                        "true" | "1" | "yes" | "on" => true,
                        "false" | "0" | "no" | "off" => false,
                        other => return Err(bad(format!("recompute={other}: use true or false"))),
                    }
                }
                other => {
                    return Err(bad(format!(
                        "unknown key `{other}`; keys: schedule, strategy, family, tp, pp, loops, \
                         dp, microbatches, k, mbs, zero, recompute"
                    )))
                }
            }
        }
        if l.strategy == Strategy::Megatron {
            if !zero_given {
                l.zero = ZeroLevel::Zero1;
            }
            if l.schedule.family().breadth_first {
                l.schedule = if l.loops > 1 {
                    ScheduleKind::Interleaved
                } else {
                    ScheduleKind::OneFOneB
                };
            }
        }
        if l.tp == 0 || l.pp == 0 || l.micro_batch_size == 0 {
            return Err(bad("tp, pp and mbs must be at least 1".into()));
        }
        if l.dp == 0 {
            l.dp = req.gpus / (l.tp * l.pp).max(1);
        }
        if l.microbatches == 0 {
            l.microbatches = req.global_batch / (l.dp * l.micro_batch_size).max(1);
        }
        if l.dp == 0 || l.microbatches == 0 {
            return Err(bad(format!(
                "dp or microbatches would be 0 for {} GPUs and a global batch of {}; give them",
                req.gpus, req.global_batch
            )));
        }
        Ok(l)
    }
}
