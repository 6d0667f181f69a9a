//! Per-rank memory over time: the static training state by ZeRO level, plus a log of
//! allocations and frees (gathered weights, gradient buffers, activations, messages) swept
//! for its peak.

use crate::schedule::ZeroLevel;

use super::Dtype;

/// Bytes a rank holds for the whole step for stages of `stage_parameters` parameters each
/// (already ÷ T), sharded over `dp` ranks by ZeRO level (Rajbhandari et al. 2020, "ZeRO"):
///
/// | level | weights | gradients | optimizer state |
/// |---|---|---|---|
/// | 0 | full | full | full |
/// | 1 | full | full | shard |
/// | 2 | full | shard | shard |
/// | 3 | shard | shard | shard |
///
/// A shard is ⌈parameters / D⌉ of each stage. The full-size gathered weights (ZeRO-3) and
/// gradient buffers (ZeRO-2/3) are not static; the engine logs them.
pub fn static_bytes(
    stage_parameters: impl IntoIterator<Item = u64>,
    zero: ZeroLevel,
    dp: usize,
    dtype: Dtype,
) -> u64 {
    let (w, o) = (dtype.bytes(), dtype.optimizer_bytes());
    stage_parameters
        .into_iter()
        .map(|p| {
            let shard = p.div_ceil(dp as u64);
            let weights = if zero >= ZeroLevel::Zero3 { shard } else { p };
            let grads = if zero >= ZeroLevel::Zero2 { shard } else { p };
            let state = if zero >= ZeroLevel::Zero1 { shard } else { p };
            weights * w + grads * w + state * o
        })
        .sum()
}

/// Weight elements (not bytes) a rank holds for the whole step (the weights column of
/// [`static_bytes`]'s table): shards at ZeRO-3, full copies below.
pub fn static_weight_elements(
    stage_parameters: impl IntoIterator<Item = u64>,
    zero: ZeroLevel,
    dp: usize,
) -> u64 {
    stage_parameters
        .into_iter()
        .map(|p| {
            if zero >= ZeroLevel::Zero3 {
                p.div_ceil(dp as u64)
            } else {
                p
            }
        })
        .sum()
}

/// A log of (time, signed amount) changes whose running sum is swept for its maximum.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    events: Vec<(f64, i64)>,
}

impl Ledger {
    /// `amount` becomes live at `time`.
    pub fn alloc(&mut self, time: f64, amount: u64) {
        if amount > 0 {
            self.events.push((time, amount as i64));
        }
    }

    /// `amount` is released at `time`.
    pub fn free(&mut self, time: f64, amount: u64) {
        if amount > 0 {
            self.events.push((time, -(amount as i64)));
        }
    }

    /// The maximum of the running sum. At equal times frees go first: memory released at t
    /// can be reused by an allocation at t (a caching allocator does exactly that). Sorts the
    /// log in that order, so [`Ledger::into_changes`] afterwards returns it sorted.
    pub fn peak(&mut self) -> u64 {
        self.events
            .sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut live, mut peak) = (0i64, 0i64);
        for &(_, delta) in &self.events {
            live += delta;
            peak = peak.max(live);
        }
        peak.max(0) as u64
    }

    /// The logged (time, signed amount) changes.
    pub fn into_changes(self) -> Vec<(f64, i64)> {
        self.events
    }
}
