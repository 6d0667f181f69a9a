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
