//! `--explain`: why one layout is rejected, or where its step loses time against the best.

use std::fmt::Write as _;

use crate::schedule::{ScheduleKind, ZeroLevel};

use super::search::{bounds, evaluate, ScheduleCache, Simulated};
use super::{plan, Candidate, Layout, PlanError, PlanRequest, Score};

/// The planner's judgement of one layout.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// It breaks a rule; the text says which.
    NotAllowed(String),
    /// It cannot fit in device memory.
    OverMemory {
        /// Bytes the fullest rank needs (the simulated peak, or the lower bound).
        needed: u64,
        /// Device memory.
        limit: u64,
        /// Its static training state.
        static_bytes: u64,
        /// Activations it must hold at once.
        activation_bytes: u64,
        /// True when `needed` is a simulated peak, false for the lower bound.
        simulated: bool,
    },
    /// It runs; its score, and the best layout found (if any fits).
    Runs {
        /// The layout's simulation.
        score: Score,
        /// The planner's best (boxed: it is large and most verdicts do not carry one).
        best: Option<Box<Candidate>>,
    },
}

/// A layout, the verdict, and the verdict in words.
#[derive(Debug, Clone, PartialEq)]
pub struct Explanation {
    /// The layout read from the text.
    pub layout: Layout,
    /// The verdict.
    pub verdict: Verdict,
    /// Human-readable explanation.
    pub text: String,
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What would make an over-memory layout fit, from what it does not already use.
fn memory_fixes(l: &Layout) -> Vec<&'static str> {
    let mut fixes = Vec::new();
    if l.zero < ZeroLevel::Zero3 && l.dp > 1 && l.strategy == crate::sim::Strategy::Bfpp {
        fixes.push("a higher ZeRO level shards more of the training state over dp");
    }
    if !l.recompute {
        fixes.push("recompute=true keeps only each layer's input");
    }
    if (l.schedule.family().breadth_first || l.schedule == ScheduleKind::GPipe)
        && l.microbatches > 1
    {
        fixes.push(
            "breadth-first and GPipe hold every micro-batch's activations (of a sweep): fewer \
             breadth-first micro-batches per sweep (k), more dp, or a depth-first schedule hold \
             fewer",
        );
    }
    fixes.push("more pipeline ranks (pp) or tensor parallelism (tp) split the model further");
    fixes
}

/// The time components of a score: (name, seconds).
fn components(s: &Score) -> [(&'static str, f64); 5] {
    let idle = s.step_time_s - s.ideal_compute_s - s.optimizer_s - s.exposed_dp_s - s.exposed_p2p_s;
    [
        ("compute", s.ideal_compute_s),
        ("pipeline bubble and other waits", idle.max(0.0)),
        ("exposed data-parallel communication", s.exposed_dp_s),
        ("exposed pipeline communication", s.exposed_p2p_s),
        ("optimizer step", s.optimizer_s),
    ]
}

/// Why the largest component differs, in the layouts' own terms.
fn reason(component: &str, l: &Layout, best: &Layout) -> String {
    match component {
        "compute" if l.recompute && !best.recompute => {
            "recomputation re-runs every forward in the backward".into()
        }
        "compute" if l.tp > best.tp => {
            format!(
                "tp={} adds two all-reduces per layer in forward and backward",
                l.tp
            )
        }
        "compute" => "smaller or skinnier matrix multiplications run further from peak, or \
                      the busiest rank holds more layers"
            .into(),
        "pipeline bubble and other waits" => format!(
            "fill and drain of a {}-rank pipeline with {} loops over {} micro-batches (the \
             closed form is (P − 1)/(V·M) = {:.3} of the compute for looped schedules with \
             M ≥ P, (P − 1)/M for GPipe and 1F1B)",
            l.pp,
            l.loops,
            l.microbatches,
            (l.pp as f64 - 1.0) / (l.loops * l.microbatches) as f64
        ),
        "exposed data-parallel communication" => format!(
            "gathers and reductions over dp={} at ZeRO-{}{} are not hidden behind compute",
            l.dp,
            l.zero.number(),
            if l.strategy == crate::sim::Strategy::Megatron {
                ", all after the backward (megatron)"
            } else {
                ""
            }
        ),
        "exposed pipeline communication" => format!(
            "{} pipeline hops per micro-batch wait for messages in flight",
            l.pp * l.loops - 1
        ),
        _ => "Adam reads and writes the optimizer state of the rank's shard".into(),
    }
}

/// Explain the layout written in `text` (see [`Layout::parse`]) for `req`.
pub fn explain(req: &PlanRequest, text: &str) -> Result<Explanation, PlanError> {
    req.check()?;
    let layout = Layout::parse(text, req)?;
    let mut out = format!("layout: {layout} ({} family)\n", layout.family());
    if let Some(rule) = layout.rule_violation(req) {
        let _ = writeln!(out, "rejected: not allowed: {rule}");
        return Ok(Explanation {
            layout,
            verdict: Verdict::NotAllowed(rule),
            text: out,
        });
    }
    let b = bounds(&layout, req)?;
    let limit = req.hardware.memory_bytes;
    let over = |needed: u64, simulated: bool, out: &mut String| {
        let extra = needed.saturating_sub(b.static_bytes + b.activation_bytes);
        let _ = writeln!(
            out,
            "rejected: does not fit in memory: the fullest rank needs {}{} > {} of device \
             memory: {} of weights, gradients and optimizer state (ZeRO-{} over dp={}), {} of \
             activations ({} stage micro-batches live at once){}",
            if simulated { "" } else { "at least " },
            gib(needed),
            gib(limit),
            gib(b.static_bytes),
            layout.zero.number(),
            layout.dp,
            gib(b.activation_bytes),
            b.live_stage_activations,
            if simulated {
                format!(
                    ", {} of gathered weights, gradient buffers and messages",
                    gib(extra)
                )
            } else {
                String::new()
            }
        );
        let _ = writeln!(out, "to fit: {}", memory_fixes(&layout).join("; "));
        Verdict::OverMemory {
            needed,
            limit,
            static_bytes: b.static_bytes,
            activation_bytes: b.activation_bytes,
            simulated,
        }
    };
    if b.memory_bytes > limit {
        let verdict = over(b.memory_bytes, false, &mut out);
        return Ok(Explanation {
            layout,
            verdict,
            text: out,
        });
    }
    let sched = ScheduleCache::default().get(&layout, req.buffers)?;
    let score = match evaluate(&layout, &sched, req)? {
        Simulated::OverMemory(s) => {
            let verdict = over(s.peak_memory_bytes, true, &mut out);
            return Ok(Explanation {
                layout,
                verdict,
                text: out,
            });
        }
        Simulated::Fits(s) => s,
    };
    let best = match plan(req, 1) {
        Ok(p) => p.ranked.into_iter().next().map(Box::new),
        Err(PlanError::NothingFits { .. }) => None,
        Err(e) => return Err(e),
    };
    let _ = writeln!(
        out,
        "simulated: {:.0} tokens/s, step {:.4} s, MFU {:.1} %, peak memory {} of {}",
        score.tokens_per_s,
        score.step_time_s,
        100.0 * score.mfu,
        gib(score.peak_memory_bytes),
        gib(limit)
    );
    match &best {
        None => {
            let _ = writeln!(
                out,
                "no layout of the search space fits, so there is nothing to compare with"
            );
        }
        Some(bst) if bst.score.tokens_per_s <= score.tokens_per_s => {
            let _ = writeln!(
                out,
                "this is as fast as the best layout of the search space ({:.0} tokens/s, {})",
                bst.score.tokens_per_s, bst.layout
            );
        }
        Some(bst) => {
            let slower = 1.0 - score.tokens_per_s / bst.score.tokens_per_s;
            let _ = writeln!(
                out,
                "best:      {:.0} tokens/s, step {:.4} s: {}",
                bst.score.tokens_per_s, bst.score.step_time_s, bst.layout
            );
            let _ = writeln!(
                out,
                "{:.1} % slower: {:.4} s more per step (same tokens per step), made of",
                100.0 * slower,
                score.step_time_s - bst.score.step_time_s
            );
            let (mine, theirs) = (components(&score), components(&bst.score));
            let mut largest = ("compute", f64::NEG_INFINITY);
            for ((name, a), (_, b)) in mine.iter().zip(theirs.iter()) {
                let _ = writeln!(
                    out,
                    "  {name:<38} {a:>9.4} s vs {b:>9.4} s ({:+.4} s)",
                    a - b
                );
                if a - b > largest.1 {
                    largest = (name, a - b);
                }
            }
            let _ = writeln!(
                out,
                "mostly {}: {}",
                largest.0,
                reason(largest.0, &layout, &bst.layout)
            );
        }
    }
    Ok(Explanation {
        layout,
        verdict: Verdict::Runs { score, best },
        text: out,
    })
}
