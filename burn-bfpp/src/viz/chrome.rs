//! Chrome Trace Event Format (opens in Perfetto and `chrome://tracing`).
//!
//! Every span becomes one complete (`"ph": "X"`) event with `pid` = rank and `tid` = stream
//! index, so Perfetto shows one process per rank with a compute, a p2p and a data-parallel
//! thread — the same lanes as the SVG timeline. Metadata (`"ph": "M"`) events name the
//! processes `rank N` and the threads by stream, and order them by rank and stream.

use serde_json::{json, Value};

use super::trace::{Stream, TimeUnit, Trace};

/// Microseconds per time unit of a trace. Cost-model units are shown as milliseconds so
/// that Perfetto's zoom and labels work at a comfortable scale (1 unit = 1000 µs).
pub fn micros_per_unit(unit: TimeUnit) -> f64 {
    match unit {
        TimeUnit::Seconds => 1e6,
        TimeUnit::Units => 1e3,
    }
}

/// `trace` as a Chrome trace JSON document: `{"traceEvents": [...], "displayTimeUnit": "ms",
/// "otherData": {...}}`.
///
/// Events, in order: for every rank a `process_name` and `process_sort_index` event; for
/// every lane with spans a `thread_name` and `thread_sort_index` event; then one `X` event
/// per span with `ts`/`dur` in microseconds and `args` `{step, stage, microbatch}` (`null`
/// where the span has none). Spans with non-finite times are skipped.
pub fn chrome_trace_json(trace: &Trace) -> String {
    let scale = micros_per_unit(trace.time_unit);
    let mut events: Vec<Value> = Vec::with_capacity(trace.num_spans() + 2 * trace.lanes.len());
    let mut ranks: Vec<usize> = trace.lanes.iter().map(|l| l.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for &rank in &ranks {
        events.push(json!({
            "ph": "M", "name": "process_name", "pid": rank, "tid": 0,
            "args": {"name": format!("rank {rank}")}
        }));
        events.push(json!({
            "ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
            "args": {"sort_index": rank}
        }));
    }
    for lane in trace.lanes.iter().filter(|l| !l.spans.is_empty()) {
        let tid = lane.stream.index();
        events.push(json!({
            "ph": "M", "name": "thread_name", "pid": lane.rank, "tid": tid,
            "args": {"name": lane.stream.name()}
        }));
        events.push(json!({
            "ph": "M", "name": "thread_sort_index", "pid": lane.rank, "tid": tid,
            "args": {"sort_index": tid}
        }));
    }
    for lane in &trace.lanes {
        for span in &lane.spans {
            if !(span.start.is_finite() && span.end.is_finite()) {
                continue;
            }
            let action = span.action();
            events.push(json!({
                "ph": "X",
                "name": span.name(),
                "cat": category(lane.stream),
                "pid": lane.rank,
                "tid": lane.stream.index(),
                "ts": span.start * scale,
                "dur": ((span.end - span.start) * scale).max(0.0),
                "args": {
                    "step": span.step,
                    "stage": action.map(|a| a.stage),
                    "microbatch": action.and_then(|a| a.microbatch),
                }
            }));
        }
    }
    let unit = match trace.time_unit {
        TimeUnit::Seconds => "seconds",
        TimeUnit::Units => "cost-model units, shown as 1 unit = 1 ms",
    };
    let doc = json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"title": trace.title, "time_unit": unit},
    });
    doc.to_string()
}

/// Event category: lets Perfetto and `chrome://tracing` filter by stream.
fn category(stream: Stream) -> &'static str {
    match stream {
        Stream::Compute => "compute",
        Stream::P2p => "p2p",
        Stream::DataParallel => "dp",
    }
}
