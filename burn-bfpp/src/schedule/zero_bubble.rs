//! Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): every backward
//! is split into `I` (the input gradient, on the critical path between ranks) and `W` (the
//! weight gradients, which nothing waits for), and the `W`s are moved into the time a rank
//! would otherwise spend waiting.
//!
//! Each schedule here is a base order of forwards and `I`s (1F1B, interleaved 1F1B or
//! breadth-first with every `B` replaced by its `I`) and one pass, [`fill_weight_passes`],
//! that places the `W`s by replaying the base order in the unit cost model (F, I and W 1 each,
//! transfers free): a rank whose next compute would wait runs its oldest pending `W` instead,
//! provided the `W` ends before the wait would; a rank holding its cap of pending `W`s runs the
//! oldest one straight after its `I`; whatever is left runs at the end of the rank's list.
//! The cap bounds memory: a pending `W` keeps its micro-batch's saved inputs and output
//! gradients alive.

use super::Action;
use super::ActionKind;

/// `list` with every full backward `B` replaced by its input-gradient half `I`.
pub(super) fn inputs_only(list: Vec<Action>) -> Vec<Action> {
    list.into_iter()
        .map(|a| match a.kind {
            ActionKind::Backward => Action::new(a.stage, ActionKind::BackwardInput, a.mb()),
            _ => a,
        })
        .collect()
}

/// Places the `W` of every `I` in `base` (per rank: forwards and `I`s only, a valid order)
/// as the module docs describe. `stage_ranks` is the placement, `caps[r]` the most `W`s rank
/// `r` may leave pending after an `I`.
///
/// The replay is event-ordered: the rank whose next action can start earliest goes first, so
/// when a rank fills a wait with a `W` every dependency still unknown will end after it.
pub(super) fn fill_weight_passes(
    base: Vec<Vec<Action>>,
    stage_ranks: &[usize],
    microbatches: usize,
    caps: &[usize],
) -> Vec<Vec<Action>> {
    let stages = stage_ranks.len();
    let slot = |s: usize, m: usize| s * microbatches + m;
    let mut forward_end = vec![f64::NAN; stages * microbatches];
    let mut input_end = vec![f64::NAN; stages * microbatches];
    let ranks = base.len();
    let mut clock = vec![0.0_f64; ranks];
    let mut next = vec![0usize; ranks];
    let mut pending: Vec<std::collections::VecDeque<Action>> = vec![Default::default(); ranks];
    let mut out: Vec<Vec<Action>> = base
        .iter()
        .map(|list| Vec::with_capacity(list.len() * 3 / 2))
        .collect();
    // When `a` may start, if its inputs are known yet.
    let ready = |a: &Action, forward_end: &[f64], input_end: &[f64]| -> Option<f64> {
        let (s, m) = (a.stage, a.mb());
        let t = match a.kind {
            ActionKind::Forward if s == 0 => 0.0,
            ActionKind::Forward => forward_end[slot(s - 1, m)],
            _ => {
                let own = forward_end[slot(s, m)];
                if s + 1 == stages {
                    own
                } else {
                    own.max(input_end[slot(s + 1, m)])
                }
            }
        };
        (!t.is_nan()).then_some(t)
    };
    loop {
        // Each rank's candidate: (start, runs a pending W instead of its next action).
        let mut best: Option<(f64, usize, bool)> = None;
        for r in 0..ranks {
            let now = clock[r];
            let candidate = match base[r].get(next[r]) {
                Some(a) => {
                    let must_drain = pending[r].len() > caps[r];
                    match ready(a, &forward_end, &input_end) {
                        _ if must_drain => Some((now, true)),
                        Some(t) if t >= now + 1.0 && !pending[r].is_empty() => Some((now, true)),
                        Some(t) => Some((t.max(now), false)),
                        None if !pending[r].is_empty() => Some((now, true)),
                        None => None,
                    }
                }
                None => (!pending[r].is_empty()).then_some((now, true)),
            };
            if let Some((start, fill)) = candidate {
                if best.is_none_or(|(b, _, _)| start < b) {
                    best = Some((start, r, fill));
                }
            }
        }
        let Some((start, r, fill)) = best else {
            break;
        };
        let end = start + 1.0;
        clock[r] = end;
        if fill {
            let w = pending[r]
                .pop_front()
                .expect("a fill candidate has a pending W");
            out[r].push(w);
            continue;
        }
        let a = base[r][next[r]];
        next[r] += 1;
        out[r].push(a);
        let i = slot(a.stage, a.mb());
        match a.kind {
            ActionKind::Forward => forward_end[i] = end,
            _ => {
                input_end[i] = end;
                pending[r].push_back(Action::new(a.stage, ActionKind::BackwardWeight, a.mb()));
            }
        }
    }
    // A base order that cannot complete (never the case for the generated ones) keeps its
    // unplaced actions in order, so the validator reports where it stops.
    for r in 0..ranks {
        out[r].extend(base[r][next[r]..].iter().copied());
        out[r].extend(pending[r].drain(..));
    }
    out
}

/// ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): two stages per
/// rank on the V-shape placement (rank r holds stages r and 2P − 1 − r, so the first and the
/// last stage share rank 0), ordered by a greedy list scheduler in the unit cost model. At
/// each moment a rank runs, among what is ready, an `I` (the deeper stage first) before a
/// forward (the deeper stage first) before a `W`, and it fills any wait with a pending `W`
/// that fits. It starts a new micro-batch (a forward of its first stage) only while fewer
/// than P have entered and not finished their first stage's `W`: at most P micro-batches
/// per stage are live, 2P half-size stages, 1F1B's peak.
pub(super) fn zb_v(stage_ranks: &[usize], pp: usize, microbatches: usize) -> Vec<Vec<Action>> {
    let stages = stage_ranks.len();
    let m = microbatches;
    let slot = |s: usize, mb: usize| s * m + mb;
    let mut forward_end = vec![f64::NAN; stages * m];
    let mut input_end = vec![f64::NAN; stages * m];
    let mut next_forward = vec![0usize; stages];
    let mut next_input = vec![0usize; stages];
    // Each rank's stages, deepest first (the priority order of its I's and forwards).
    let mut local: Vec<Vec<usize>> = vec![Vec::new(); pp];
    for (s, &r) in stage_ranks.iter().enumerate() {
        local[r].push(s);
    }
    for list in &mut local {
        list.sort_unstable_by(|a, b| b.cmp(a));
    }
    let mut clock = vec![0.0_f64; pp];
    let mut entered = vec![0usize; pp];
    let mut pending: Vec<std::collections::VecDeque<Action>> = vec![Default::default(); pp];
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); pp];
    loop {
        // The earliest start over all ranks: (start, rank, action).
        let mut best: Option<(f64, usize, Action)> = None;
        for r in 0..pp {
            let now = clock[r];
            let mut pick: Option<(f64, Action)> = None;
            let mut consider = |start: f64, a: Action| {
                if pick.is_none_or(|(b, _)| start < b) {
                    pick = Some((start, a));
                }
            };
            for &s in &local[r] {
                let mb = next_input[s];
                if mb < next_forward[s] {
                    let own = forward_end[slot(s, mb)];
                    let grad = if s + 1 == stages {
                        own
                    } else {
                        input_end[slot(s + 1, mb)]
                    };
                    if !grad.is_nan() {
                        consider(
                            own.max(grad).max(now),
                            Action::new(s, ActionKind::BackwardInput, mb),
                        );
                    }
                }
            }
            for &s in &local[r] {
                let mb = next_forward[s];
                let first = s == *local[r].last().expect("every rank holds a stage");
                if mb >= m || (first && entered[r] >= pp) {
                    continue;
                }
                let ready = if s == 0 {
                    0.0
                } else {
                    forward_end[slot(s - 1, mb)]
                };
                if !ready.is_nan() {
                    consider(ready.max(now), Action::forward(s, mb));
                }
            }
            let fill = pending[r].front().copied();
            let candidate = match (pick, fill) {
                (Some((start, _)), Some(w)) if start >= now + 1.0 => Some((now, w)),
                (Some(p), _) => Some(p),
                (None, Some(w)) => Some((now, w)),
                (None, None) => None,
            };
            if let Some((start, a)) = candidate {
                if best.is_none_or(|(b, _, _)| start < b) {
                    best = Some((start, r, a));
                }
            }
        }
        let Some((start, r, a)) = best else {
            break;
        };
        let end = start + 1.0;
        clock[r] = end;
        out[r].push(a);
        let (s, mb) = (a.stage, a.mb());
        let first = s == *local[r].last().expect("every rank holds a stage");
        match a.kind {
            ActionKind::Forward => {
                forward_end[slot(s, mb)] = end;
                next_forward[s] += 1;
                if first {
                    entered[r] += 1;
                }
            }
            ActionKind::BackwardInput => {
                input_end[slot(s, mb)] = end;
                next_input[s] += 1;
                pending[r].push_back(Action::new(s, ActionKind::BackwardWeight, mb));
            }
            _ => {
                pending[r].pop_front();
                if first {
                    entered[r] -= 1;
                }
            }
        }
    }
    out
}
