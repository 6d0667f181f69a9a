//! The end of a simulated step: each rank's optimizer step after its last reduction, and the
//! step's totals (time, bubble, exposed communication, throughput) and per-rank peaks.

use crate::schedule::PipelineSchedule;

use super::super::cost_table::CostTable;
use super::super::memory::{static_bytes, static_weight_elements};
use super::super::result::{Interval, MemoryLog, SimResult, TraceItem};
use super::super::volume::step_comm_bytes;
use super::super::SimConfig;
use super::RankState;

/// Optimizer step, totals and per-rank peaks.
pub(super) fn finish(
    ranks: Vec<RankState>,
    schedule: &PipelineSchedule,
    cfg: &SimConfig,
    costs: &CostTable,
) -> SimResult {
    let n = ranks.len();
    let mut local_stages: Vec<Vec<u64>> = vec![Vec::new(); n];
    for (s, &r) in schedule.stage_ranks.iter().enumerate() {
        local_stages[r].push(costs.parameters[s]);
    }
    let mut step_time: f64 = 0.0;
    let mut ideal: f64 = 0.0;
    let mut out = SimResult {
        unit_time: costs.unit_time,
        step_time_s: 0.0,
        tokens_per_s: 0.0,
        tflops_per_gpu: 0.0,
        mfu: 0.0,
        bubble_fraction: 0.0,
        ideal_compute_s: 0.0,
        exposed_p2p_s: 0.0,
        exposed_dp_s: 0.0,
        exposed_p2p_per_rank: Vec::with_capacity(n),
        exposed_dp_per_rank: Vec::with_capacity(n),
        optimizer_s: costs.optimizer.clone(),
        peak_memory_bytes: Vec::with_capacity(n),
        peak_weight_bytes: Vec::with_capacity(n),
        device_memory_bytes: cfg.hardware.memory_bytes,
        peak_activation_microbatches: Vec::with_capacity(n),
        all_gathers: Vec::with_capacity(n),
        reduce_scatters: Vec::with_capacity(n),
        comm_bytes: step_comm_bytes(schedule, costs, cfg.dp, cfg.zero),
        trace: Vec::with_capacity(n),
        memory: Vec::with_capacity(n),
    };
    for (r, mut st) in ranks.into_iter().enumerate() {
        // The optimizer waits for every reduction; that wait is exposed data-parallel time.
        st.exposed_dp += (st.dp_free - st.compute_free).max(0.0);
        let start = st.compute_free.max(st.dp_free);
        let end = start + costs.optimizer[r];
        st.trace.compute.push(Interval {
            item: TraceItem::OptimizerStep,
            start,
            end,
        });
        step_time = step_time.max(end).max(st.send_free);
        ideal = ideal.max(st.busy);
        let stages_here = local_stages[r].len().max(1) as f64;
        out.peak_activation_microbatches
            .push(st.activations.peak() as f64 / stages_here);
        let fixed = static_bytes(local_stages[r].iter().copied(), cfg.zero, cfg.dp, cfg.dtype);
        out.peak_memory_bytes.push(fixed + st.memory.peak());
        let weights = static_weight_elements(local_stages[r].iter().copied(), cfg.zero, cfg.dp);
        out.peak_weight_bytes
            .push(weights * cfg.dtype.bytes() + st.weights.peak());
        out.memory.push(MemoryLog {
            static_bytes: fixed,
            changes: st.memory.into_changes(),
        });
        out.exposed_p2p_per_rank.push(st.exposed_p2p);
        out.exposed_dp_per_rank.push(st.exposed_dp);
        out.all_gathers.push(st.gathers);
        out.reduce_scatters.push(st.reductions);
        out.trace.push(st.trace);
    }
    out.step_time_s = step_time;
    out.ideal_compute_s = ideal;
    out.bubble_fraction = if ideal > 0.0 {
        (step_time - ideal) / ideal
    } else {
        0.0
    };
    out.exposed_p2p_s = out.exposed_p2p_per_rank.iter().copied().fold(0.0, f64::max);
    out.exposed_dp_s = out.exposed_dp_per_rank.iter().copied().fold(0.0, f64::max);
    if step_time > 0.0 {
        out.tokens_per_s = costs.tokens_per_step * cfg.dp as f64 / step_time;
        let gpus_per_replica = (n * cfg.tp) as f64;
        out.tflops_per_gpu = costs.step_model_flops / gpus_per_replica / step_time / 1e12;
        out.mfu = out.tflops_per_gpu * 1e12 / cfg.hardware.peak_flops;
    }
    out
}
