//! The two ways of running data parallelism around a pipeline that the paper compares, as
//! lowering choices over the same schedule IR (see the module docs of [`crate::sim`]).

use std::fmt;
use std::str::FromStr;

use crate::schedule::{
    Action, ActionKind, PipelineSchedule, Program, ProgramSpec, ScheduleKind, ZeroLevel,
};

use super::{simulate, SimConfig, SimError, SimResult};

/// How the data-parallel collectives are placed around the pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// The reference's way: any ZeRO level; each stage's weights are gathered one compute
    /// block ahead of their use (prefetch) and its gradients reduced right after its last
    /// backward (early reduce), both overlapping the compute of other stages.
    #[default]
    Bfpp,
    /// Megatron-LM's way (as of the paper): tensor parallelism inside a node, a non-looped
    /// 1F1B or looped depth-first (interleaved) pipeline, the distributed optimizer (ZeRO-1),
    /// every gradient reduced after the last backward of the step and every weight gathered
    /// after the optimizer step, before the next step's first forward: nothing overlaps.
    Megatron,
}

impl Strategy {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Bfpp => "bfpp",
            Strategy::Megatron => "megatron",
        }
    }

    /// Check that a schedule family and ZeRO level are the strategy's; the error names the fix.
    pub fn check(self, kind: ScheduleKind, zero: ZeroLevel) -> Result<(), SimError> {
        if self == Strategy::Bfpp {
            return Ok(());
        }
        if !matches!(kind, ScheduleKind::OneFOneB | ScheduleKind::Interleaved) {
            return Err(SimError::Config(format!(
                "--strategy megatron runs a non-looped 1F1B or a looped depth-first pipeline, not \
                 {kind}; use --schedule 1f1b (loops 1) or --schedule interleaved"
            )));
        }
        if zero > ZeroLevel::Zero1 {
            return Err(SimError::Config(format!(
                "--strategy megatron uses Megatron-LM's distributed optimizer, ZeRO-1, not ZeRO-{}; \
                 use --zero 1 (or --strategy bfpp for ZeRO-2/3)",
                zero.number()
            )));
        }
        Ok(())
    }

    /// Check the parts of a simulator configuration the strategy constrains: Megatron-LM
    /// keeps a tensor-parallel group inside one node.
    pub fn check_config(self, cfg: &SimConfig) -> Result<(), SimError> {
        if self == Strategy::Megatron && cfg.tp > cfg.hardware.gpus_per_node {
            return Err(SimError::Config(format!(
                "--strategy megatron keeps tensor parallelism inside a node: tp={} exceeds the \
                 {} GPUs per node; use --tp {} or less",
                cfg.tp, cfg.hardware.gpus_per_node, cfg.hardware.gpus_per_node
            )));
        }
        Ok(())
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bfpp" => Ok(Strategy::Bfpp),
            "megatron" | "megatron-lm" => Ok(Strategy::Megatron),
            other => Err(SimError::Config(format!(
                "unknown strategy `{other}`; choose bfpp or megatron"
            ))),
        }
    }
}

/// Compile `spec` on the one compile path ([`ProgramSpec::compile`]) and, for Megatron-LM,
/// move the collectives to the step boundary: the programs the simulator runs (the engine
/// runs the same ones, without the Megatron-LM pass). The report is the validator's on the
/// programs before that pass.
pub fn build_program(spec: &ProgramSpec, strategy: Strategy) -> Result<Program, SimError> {
    strategy.check(spec.schedule.kind, spec.zero)?;
    let mut program = spec.compile()?;
    if strategy == Strategy::Megatron {
        program.lowered = megatron_collectives(&program.lowered)?;
    }
    Ok(program)
}

/// Simulate one step of a compiled program: the ZeRO level and the gradient buffers are the
/// program's own (the configuration's are replaced), so the simulator cannot assume other
/// buffers than the lowering placed its collectives for.
pub fn simulate_program(program: &Program, cfg: &SimConfig) -> Result<SimResult, SimError> {
    let cfg = SimConfig {
        zero: program.zero,
        grad_buffers: program.buffers,
        ..cfg.clone()
    };
    simulate(&program.lowered, &cfg)
}

/// Megatron-LM's step boundary as a pass over a ZeRO-0/1 lowered schedule: every
/// `REDUCE_GRAD` moves after the rank's last action (so, issued in program order, it waits for
/// the whole backward), and every `UNSHARD` before the first, the stage used first gathered
/// last, so the first forward waits for all of them — as after Megatron-LM's single all-gather
/// of the parameter buffer that follows its optimizer step (the same point of the steady-state
/// cycle as the start of the step).
pub fn megatron_collectives(schedule: &PipelineSchedule) -> Result<PipelineSchedule, SimError> {
    let ranks = schedule
        .ranks
        .iter()
        .enumerate()
        .map(|(rank, list)| {
            let mut gathers: Vec<usize> = Vec::new();
            let mut reduces: Vec<usize> = Vec::new();
            let mut body: Vec<Action> = Vec::with_capacity(list.len());
            for &a in list {
                match a.kind {
                    ActionKind::Unshard => gathers.push(a.stage),
                    ActionKind::ReduceGrad if reduces.contains(&a.stage) => {
                        return Err(SimError::Config(format!(
                            "rank {rank} reduces stage {} twice (ZeRO-2/3 gradient buffers); \
                             Megatron-LM's distributed optimizer is ZeRO-1: lower with --zero 1",
                            a.stage
                        )))
                    }
                    ActionKind::ReduceGrad => reduces.push(a.stage),
                    ActionKind::Reshard => {
                        return Err(SimError::Config(format!(
                            "rank {rank} frees gathered weights ({a}, ZeRO-3); Megatron-LM keeps \
                             them: lower with --zero 1"
                        )))
                    }
                    _ => body.push(a),
                }
            }
            let first_use = |s: usize| {
                body.iter()
                    .position(|a| a.stage == s && a.kind.reads_weights())
            };
            // Gathered last ⇒ finishes last on the in-order data-parallel stream.
            gathers.sort_by_key(|&s| std::cmp::Reverse(first_use(s)));
            let last_grad = |s: usize| {
                body.iter()
                    .rposition(|a| a.stage == s && a.kind.produces_weight_grad())
            };
            reduces.sort_by_key(|&s| last_grad(s));
            let mut out = Vec::with_capacity(list.len());
            out.extend(
                gathers
                    .into_iter()
                    .map(|s| Action::collective(s, ActionKind::Unshard)),
            );
            out.extend(body);
            out.extend(
                reduces
                    .into_iter()
                    .map(|s| Action::collective(s, ActionKind::ReduceGrad)),
            );
            Ok(out)
        })
        .collect::<Result<Vec<_>, SimError>>()?;
    Ok(PipelineSchedule {
        stage_ranks: schedule.stage_ranks.clone(),
        microbatches: schedule.microbatches,
        ranks,
    })
}
