//! Enumeration, the two bounds, and the bounded best-first simulation of [`plan`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::schedule::{Program, ScheduleKind, ZeroLevel};
use crate::sim::{build_program, simulate_program, static_bytes, CostTable, ModelConfig, Strategy};

use super::{Candidate, Family, Layout, Plan, PlanError, PlanRequest, Score, SearchStats};

/// Cheap, provable bounds of one layout (see the module docs of [`crate::plan`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// No rank of the layout can peak below this many bytes.
    pub memory_bytes: u64,
    /// Static training state of the rank that attains `memory_bytes`.
    pub static_bytes: u64,
    /// Activation bytes that rank must hold at once.
    pub activation_bytes: u64,
    /// Activations that rank holds at once, in stage-micro-batches.
    pub live_stage_activations: usize,
    /// No step of the layout can be shorter.
    pub step_time_s: f64,
    /// Hence no higher throughput than this.
    pub tokens_per_s: f64,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// Stage-activations rank `r` must hold at once, from its compute order (the generators'),
/// and whether they are all of its stages' (true) or of stages not known in advance (false:
/// count them at the smallest).
fn live_activations(l: &Layout, r: usize) -> (usize, bool) {
    let (p, v, m) = (l.pp, l.loops, l.microbatches);
    match l.schedule {
        // Every forward of the rank (of the sweep, for the hybrid) precedes its first
        // backward: all V·M (V·K) are live then.
        ScheduleKind::GPipe => (v * m, true),
        ScheduleKind::BreadthFirst | ScheduleKind::BreadthFirstZeroBubble => {
            (v * l.bf_microbatches.unwrap_or(m), true)
        }
        // Warm-up P − r − 1 forwards, then one more forward before the first backward. The
        // split schedules hold their base order's full activations; a pending weight pass
        // holds less (its matrices' inputs and output gradients), left out of the bound.
        ScheduleKind::OneFOneB | ScheduleKind::ZeroBubbleH1 => ((p - r).min(m), false),
        // A greedy order (see schedule::zero_bubble): only one live stage-micro-batch is
        // certain.
        ScheduleKind::ZeroBubbleV => (1, false),
        // 2·(P − r − 1) + 2·(r + 1) forwards of both stages before the first backward.
        ScheduleKind::DualPipeV => ((2 * p).min(v * m), false),
        ScheduleKind::Interleaved | ScheduleKind::InterleavedZeroBubble => {
            let total = m * v;
            let warmup = if m == p {
                total
            } else {
                (2 * (p - r - 1) + (v - 1) * p).min(total)
            };
            ((warmup + 1).min(total), false)
        }
    }
}

/// The bounds of a layout; `Err` when the simulator refuses its configuration.
pub fn bounds(l: &Layout, req: &PlanRequest) -> Result<Bounds, PlanError> {
    let cfg = l.sim_config(req)?;
    let stage_ranks = l.spec().effective_placement().stage_ranks(l.pp, l.loops);
    let c = CostTable::new(&cfg, &stage_ranks, l.pp, l.microbatches)?;
    let stages_of = |r: usize| -> Vec<usize> {
        (0..stage_ranks.len())
            .filter(|&s| stage_ranks[s] == r)
            .collect()
    };
    let m = l.microbatches as f64;
    let megatron = l.strategy == Strategy::Megatron;

    let mut worst = (0u64, 0u64, 0u64, 0usize);
    let mut core: f64 = 0.0;
    let (mut head, mut tail) = (0.0, 0.0);
    let mut split_end: f64 = 0.0;
    for r in 0..l.pp {
        let stages = stages_of(r);
        let fixed = static_bytes(
            stages.iter().map(|&s| c.parameters[s]),
            cfg.zero,
            cfg.dp,
            cfg.dtype,
        );
        let (count, all_stages) = live_activations(l, r);
        let act = if all_stages {
            let per_stage = (count / stages.len().max(1)) as u64;
            stages.iter().map(|&s| c.activation_bytes[s]).sum::<u64>() * per_stage
        } else {
            let smallest = stages
                .iter()
                .map(|&s| c.activation_bytes[s])
                .min()
                .unwrap_or(0);
            smallest * count as u64
        };
        if fixed + act > worst.0 {
            worst = (fixed + act, fixed, act, count);
        }
        let compute: f64 = stages
            .iter()
            .map(|&s| m * (c.forward[s] + c.backward[s]))
            .sum();
        // head/tail: forwards of stages 0..r before this rank can start, backwards after.
        core = core.max(head + compute + tail);
        // A split schedule's rank may end on weight passes beside the other ranks'
        // input-gradient chain, so its own end is what is certain: its last weight pass
        // is followed by that stage's reduction and the rank's optimizer step.
        let reduce = stages
            .iter()
            .map(|&s| c.reduce[s])
            .fold(f64::INFINITY, f64::min);
        split_end = split_end.max(head + compute + reduce + c.optimizer[r]);
        head += c.forward[r];
        tail += c.backward[r];
    }
    let rank0 = stages_of(0);
    let (lead, trail) = if megatron {
        (
            rank0.iter().map(|&s| c.gather[s]).sum::<f64>(),
            rank0.iter().map(|&s| c.reduce[s]).sum::<f64>(),
        )
    } else {
        let lead = if l.zero >= ZeroLevel::Zero1 {
            c.gather[0]
        } else {
            0.0
        };
        (lead, c.reduce[0])
    };
    let step = if l.schedule.splits_backward() {
        lead + split_end
    } else {
        lead + core + trail + c.optimizer[0]
    };
    Ok(Bounds {
        memory_bytes: worst.0,
        static_bytes: worst.1,
        activation_bytes: worst.2,
        live_stage_activations: worst.3,
        step_time_s: step,
        tokens_per_s: c.tokens_per_step * l.dp as f64 / step,
    })
}

/// Every layout of the search space (see [`crate::plan`]), in a fixed order.
pub(super) fn enumerate(req: &PlanRequest) -> Vec<Layout> {
    let (n, b) = (req.gpus, req.global_batch);
    let (layers, tp_ok): (Option<usize>, Box<dyn Fn(usize) -> bool>) = match &req.model {
        ModelConfig::Gpt(g) => {
            let (heads, vocab) = (g.heads, g.vocabulary);
            (
                Some(g.layers),
                Box::new(move |t| heads % t == 0 && vocab % t == 0),
            )
        }
        ModelConfig::Unit(_) => (None, Box::new(|t| t == 1)),
    };
    // Stage counts P·V that split the layers evenly (the unit model: V ≤ 8).
    let stages_ok = |p: usize, v: usize| match layers {
        Some(layers) => layers % (p * v) == 0,
        None => v <= 8,
    };
    let mut out = Vec::new();
    for tp in divisors(n) {
        if tp > req.hardware.gpus_per_node || !tp_ok(tp) {
            continue;
        }
        for pp in divisors(n / tp) {
            let dp = n / tp / pp;
            if b % dp != 0 || !stages_ok(pp, 1) {
                continue;
            }
            let per_replica = b / dp;
            let zeros: &[ZeroLevel] = if dp == 1 {
                &[ZeroLevel::Zero0]
            } else {
                &[
                    ZeroLevel::Zero0,
                    ZeroLevel::Zero1,
                    ZeroLevel::Zero2,
                    ZeroLevel::Zero3,
                ]
            };
            let loop_counts: Vec<usize> = (1..=layers.map_or(8, |l| l / pp))
                .filter(|&v| stages_ok(pp, v))
                .collect();
            for mbs in divisors(per_replica) {
                let m = per_replica / mbs;
                if mbs > req.limits.max_micro_batch_size || m > req.limits.max_microbatches {
                    continue;
                }
                let mut push = |strategy, schedule, loops, zero, bf_microbatches| {
                    for recompute in [false, true] {
                        out.push(Layout {
                            strategy,
                            schedule,
                            tp,
                            pp,
                            loops,
                            dp,
                            microbatches: m,
                            bf_microbatches,
                            micro_batch_size: mbs,
                            zero,
                            recompute,
                        });
                    }
                };
                for &v in &loop_counts {
                    let interleaved_ok = v >= 2 && m % pp == 0;
                    for &zero in zeros {
                        if v == 1 {
                            push(Strategy::Bfpp, ScheduleKind::GPipe, 1, zero, None);
                            push(Strategy::Bfpp, ScheduleKind::OneFOneB, 1, zero, None);
                            push(Strategy::Bfpp, ScheduleKind::ZeroBubbleH1, 1, zero, None);
                        }
                        if v >= 2 || pp == 1 {
                            // K = M (pure), and the hybrid's proper divisors K of M.
                            let ks = divisors(m).into_iter().filter(|&k| k < m).map(Some);
                            for k in std::iter::once(None).chain(ks) {
                                push(Strategy::Bfpp, ScheduleKind::BreadthFirst, v, zero, k);
                                push(
                                    Strategy::Bfpp,
                                    ScheduleKind::BreadthFirstZeroBubble,
                                    v,
                                    zero,
                                    k,
                                );
                            }
                        }
                        if interleaved_ok {
                            push(Strategy::Bfpp, ScheduleKind::Interleaved, v, zero, None);
                            let izb = ScheduleKind::InterleavedZeroBubble;
                            push(Strategy::Bfpp, izb, v, zero, None);
                        }
                        if v == 2 && m % pp == 0 {
                            push(Strategy::Bfpp, ScheduleKind::ZeroBubbleV, 2, zero, None);
                        }
                        // Its pairs read both stages' weights at once: two ZeRO-3 buffers.
                        let pairs_fit = zero != ZeroLevel::Zero3 || req.buffers >= 2;
                        if v == 2 && m >= 2 * pp && pairs_fit {
                            push(Strategy::Bfpp, ScheduleKind::DualPipeV, 2, zero, None);
                        }
                    }
                    let z1 = ZeroLevel::Zero1;
                    if v == 1 {
                        push(Strategy::Megatron, ScheduleKind::OneFOneB, 1, z1, None);
                    } else if interleaved_ok {
                        push(Strategy::Megatron, ScheduleKind::Interleaved, v, z1, None);
                    }
                }
            }
        }
    }
    out
}

/// What simulating one layout gave.
pub(super) enum Simulated {
    /// It fits.
    Fits(Score),
    /// Its simulated peak is over device memory.
    OverMemory(Score),
}

type ScheduleKey = (
    Strategy,
    ScheduleKind,
    usize,
    usize,
    usize,
    Option<usize>,
    ZeroLevel,
);

/// Compiled programs shared by layouts that differ only in TP, micro-batch size or recompute
/// (the buffers are the request's, the same for every layout).
#[derive(Default)]
pub(super) struct ScheduleCache {
    map: HashMap<ScheduleKey, Arc<Program>>,
}

impl ScheduleCache {
    /// At most this many schedules are kept (a P = 64, M = 512 one is several MiB).
    const CAPACITY: usize = 64;

    pub(super) fn get(&mut self, l: &Layout, buffers: usize) -> Result<Arc<Program>, PlanError> {
        let key = (
            l.strategy,
            l.schedule,
            l.pp,
            l.loops,
            l.microbatches,
            l.bf_microbatches,
            l.zero,
        );
        if let Some(s) = self.map.get(&key) {
            return Ok(Arc::clone(s));
        }
        let s = Arc::new(build_program(&l.program(buffers), l.strategy)?);
        if self.map.len() >= Self::CAPACITY {
            self.map.clear();
        }
        self.map.insert(key, Arc::clone(&s));
        Ok(s)
    }
}

/// Simulate one layout on its compiled program.
pub(super) fn evaluate(
    l: &Layout,
    program: &Program,
    req: &PlanRequest,
) -> Result<Simulated, PlanError> {
    let r = simulate_program(program, &l.sim_config(req)?)?;
    let score = Score::of(&r);
    Ok(if score.peak_memory_bytes > req.hardware.memory_bytes {
        Simulated::OverMemory(score)
    } else {
        Simulated::Fits(score)
    })
}

fn thread_count(req: &PlanRequest) -> usize {
    match req.limits.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        t => t,
    }
}

/// Rank the layouts of `req` by simulated tokens/s and keep the `top` best, plus the best
/// of each family. Fails with [`PlanError::NothingFits`] naming the closest miss when no
/// layout fits.
pub fn plan(req: &PlanRequest, top: usize) -> Result<Plan, PlanError> {
    req.check()?;
    let top = top.max(1);
    let mut stats = SearchStats::default();
    let layouts = enumerate(req);
    stats.enumerated = layouts.len();
    // Smallest memory lower bound seen, for the error when nothing fits.
    let mut closest: Option<(u64, Layout, Bounds)> = None;
    let mut queue: Vec<(Layout, Bounds)> = Vec::with_capacity(layouts.len());
    for l in layouts {
        let b = bounds(&l, req)?;
        if b.memory_bytes > req.hardware.memory_bytes {
            stats.over_memory_bound += 1;
            if closest.as_ref().is_none_or(|c| b.memory_bytes < c.0) {
                closest = Some((b.memory_bytes, l, b));
            }
            continue;
        }
        queue.push((l, b));
    }
    // Best bound first; ties in a fixed order so the answer does not depend on hashing.
    queue.sort_by(|a, b| b.1.tokens_per_s.total_cmp(&a.1.tokens_per_s));

    let mut ranked: Vec<Candidate> = Vec::new();
    let mut best: BTreeMap<Family, Candidate> = BTreeMap::new();
    let mut closest_sim: Option<(u64, Layout)> = None;
    let mut cache = ScheduleCache::default();
    let threads = thread_count(req);
    let mut next = 0;
    while next < queue.len() {
        // Take the next layouts whose bound could still enter the ranking or a family's best.
        let mut batch: Vec<(Layout, Arc<Program>)> = Vec::new();
        while next < queue.len() && batch.len() < threads {
            let (l, b) = queue[next];
            next += 1;
            let kth = if ranked.len() >= top {
                ranked[top - 1].score.tokens_per_s
            } else {
                0.0
            };
            let fam = best.get(&l.family()).map_or(0.0, |c| c.score.tokens_per_s);
            if b.tokens_per_s <= kth && b.tokens_per_s <= fam {
                stats.pruned += 1;
                continue;
            }
            batch.push((l, cache.get(&l, req.buffers)?));
        }
        let results: Vec<Result<Simulated, PlanError>> = if batch.len() <= 1 {
            batch.iter().map(|(l, s)| evaluate(l, s, req)).collect()
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = batch
                    .iter()
                    .map(|(l, s)| scope.spawn(move || evaluate(l, s, req)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(PlanError::Request("a simulation thread panicked".into()))
                        })
                    })
                    .collect()
            })
        };
        for ((l, _), outcome) in batch.into_iter().zip(results) {
            stats.simulated += 1;
            match outcome? {
                Simulated::OverMemory(s) => {
                    stats.over_memory_simulated += 1;
                    if closest_sim
                        .as_ref()
                        .is_none_or(|c| s.peak_memory_bytes < c.0)
                    {
                        closest_sim = Some((s.peak_memory_bytes, l));
                    }
                }
                Simulated::Fits(score) => {
                    let cand = Candidate { layout: l, score };
                    let fam = l.family();
                    if best
                        .get(&fam)
                        .is_none_or(|c| cand.score.tokens_per_s > c.score.tokens_per_s)
                    {
                        best.insert(fam, cand.clone());
                    }
                    let at = ranked
                        .iter()
                        .position(|c| c.score.tokens_per_s < cand.score.tokens_per_s)
                        .unwrap_or(ranked.len());
                    if at < top {
                        ranked.insert(at, cand);
                        ranked.truncate(top);
                    }
                }
            }
        }
    }
    if ranked.is_empty() {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let limit = gib(req.hardware.memory_bytes);
        let why = match (closest_sim, closest) {
            (Some((peak, l)), _) => format!(
                "the closest, {l}, peaks at {:.1} GiB in simulation against {limit:.1} GiB of \
                 device memory; use more GPUs, a smaller model or a GPU with more memory",
                gib(peak)
            ),
            (None, Some((_, l, b))) => format!(
                "the smallest, {l}, needs at least {:.1} GiB ({:.1} GiB of weights, gradients and \
                 optimizer state, {:.1} GiB of activations) against {limit:.1} GiB of device \
                 memory; use more GPUs, a smaller model or a GPU with more memory",
                gib(b.memory_bytes),
                gib(b.static_bytes),
                gib(b.activation_bytes)
            ),
            (None, None) => "no layout follows the rules: the global batch must be divisible \
                             by a data-parallel size, and GPUs ÷ (tp × dp) must divide the layers"
                .into(),
        };
        return Err(PlanError::NothingFits {
            model: req.model_name(),
            hardware: req.hardware.name.clone(),
            gpus: req.gpus,
            global_batch: req.global_batch,
            why,
        });
    }
    Ok(Plan {
        ranked,
        best_per_family: best,
        stats,
    })
}
