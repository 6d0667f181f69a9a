//! Checks of the renderers on hand-built traces and on real lowered schedules.

use serde_json::Value;

use super::*;
use crate::schedule::TimedEvent;
use crate::schedule::{
    lower_data_parallel, lower_p2p, replay, unit_cost, Action, ActionKind, DataParallelLowering,
    PipelineSchedule, ScheduleKind, ScheduleSpec, SendMode, ZeroLevel,
};
use crate::sim::{simulate, SimConfig, TraceItem};

/// Tags open and closed in order (`<a>…</a>`, `<b/>`), ignoring `<?`/`<!` and text.
fn assert_balanced(svg: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = svg;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest.find('>').expect("unterminated tag");
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "mismatched </{name}>"
            );
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().unwrap_or_default();
            stack.push(name.to_string());
        }
        assert!(
            !stack.is_empty() || rest.trim().is_empty(),
            "content after </svg>"
        );
    }
    assert!(stack.is_empty(), "unclosed tags: {stack:?}");
}

/// Span rectangles: the only `<rect` elements with a `class` attribute.
fn span_rects(svg: &str) -> usize {
    svg.split("<rect ")
        .skip(1)
        .filter(|r| r.split("/>").next().is_some_and(|a| a.contains("class=")))
        .count()
}

fn span(start: f64, end: f64, action: Action) -> Span {
    Span {
        start,
        end,
        item: TraceItem::Action(action),
        step: Some(1),
    }
}

/// Two ranks, wide spans on every stream kind, an empty dp lane on rank 1.
fn small_trace() -> Trace {
    let lane = |rank, stream, spans| Lane {
        rank,
        stream,
        spans,
    };
    Trace {
        title: "small <test> & co".into(),
        time_unit: TimeUnit::Seconds,
        lanes: vec![
            lane(
                0,
                Stream::Compute,
                vec![
                    span(0.0, 1.0, Action::forward(0, 0)),
                    span(3.0, 5.0, Action::backward(0, 0)),
                ],
            ),
            lane(
                0,
                Stream::P2p,
                vec![span(1.0, 1.5, Action::new(0, ActionKind::SendForward, 0))],
            ),
            lane(
                0,
                Stream::DataParallel,
                vec![
                    span(0.0, 0.5, Action::collective(0, ActionKind::Unshard)),
                    span(5.0, 6.0, Action::collective(0, ActionKind::ReduceGrad)),
                ],
            ),
            lane(
                1,
                Stream::Compute,
                vec![span(1.5, 2.5, Action::forward(1, 0))],
            ),
            lane(
                1,
                Stream::P2p,
                vec![span(1.0, 1.5, Action::new(1, ActionKind::RecvForward, 0))],
            ),
            lane(1, Stream::DataParallel, vec![]),
        ],
    }
}

fn lowered(p: usize, v: usize, m: usize, zero: ZeroLevel) -> PipelineSchedule {
    let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, p, v, m)
        .generate()
        .unwrap();
    lower_data_parallel(&lower_p2p(&s).unwrap(), &DataParallelLowering::new(zero)).unwrap()
}

/// The unit cost model, plus small costs for transfers and collectives so their lanes show.
fn comm_cost(rank: usize, action: &Action) -> f64 {
    match action.kind {
        ActionKind::SendForward | ActionKind::SendBackward => 0.2,
        ActionKind::RecvForward | ActionKind::RecvBackward => 0.1,
        ActionKind::Unshard | ActionKind::ReduceGrad => 0.6,
        _ => unit_cost(rank, action),
    }
}

#[test]
fn timeline_svg_is_balanced_with_one_rect_per_span_and_a_legend() {
    let trace = small_trace();
    let svg = timeline_svg(&trace);
    assert!(svg.starts_with("<svg"));
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(svg.matches("</svg>").count(), 1);
    assert_balanced(&svg);
    assert_eq!(span_rects(&svg), trace.num_spans());
    for text in [
        "F forward",
        "B backward",
        "SEND/RECV_F",
        "UNSHARD",
        "REDUCE_GRAD",
        "idle",
        "stage 0",
        "stage 1",
        "rank 0",
        "rank 1",
        "time (s)",
        "small &lt;test&gt; &amp; co",
    ] {
        assert!(svg.contains(text), "missing {text}");
    }
    // Labels inside the wide compute spans; the empty dp lane of rank 1 is not drawn.
    assert!(svg.contains(">0F0</text>") && svg.contains(">0B0</text>"));
    assert_eq!(svg.matches(">dp</text>").count(), 1);
    assert_eq!(svg.matches(">p2p</text>").count(), 2);
}

#[test]
fn split_backward_is_hatched_and_in_the_legend() {
    let lane = Lane {
        rank: 0,
        stream: Stream::Compute,
        spans: vec![
            span(0.0, 1.0, Action::forward(3, 0)),
            span(1.0, 2.0, Action::new(3, ActionKind::BackwardInput, 0)),
            span(2.0, 3.0, Action::new(3, ActionKind::BackwardWeight, 0)),
            span(3.0, 4.0, Action::backward(3, 1)),
        ],
    };
    let trace = Trace {
        title: "split".into(),
        time_unit: TimeUnit::Units,
        lanes: vec![lane],
    };
    let svg = timeline_svg(&trace);
    assert_balanced(&svg);
    assert!(svg.contains("I input grad") && svg.contains("W weight grad"));
    // F, W and B each have their own fill; I shares B's shade and adds the hatch.
    assert!(svg.contains(r#"class="f3 k""#) && svg.contains(r#"class="w3 k""#));
    assert_eq!(svg.matches(r#"class="b3 k""#).count(), 2);
    assert!(
        svg.matches(r#"fill="url(#hatch)""#).count() >= 2,
        "span and legend swatch"
    );
}

#[test]
fn chrome_trace_has_exact_events_and_fields() {
    let trace = small_trace();
    let doc: Value = serde_json::from_str(&chrome_trace_json(&trace)).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let nonempty = trace.lanes.iter().filter(|l| !l.spans.is_empty()).count();
    assert_eq!(events.len(), trace.num_spans() + 2 * 2 + 2 * nonempty);
    let x: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(x.len(), trace.num_spans());
    let b = x.iter().find(|e| e["name"] == "0B0").unwrap();
    assert_eq!(b["pid"], 0);
    assert_eq!(b["tid"], Stream::Compute.index());
    assert_eq!(b["ts"].as_f64(), Some(3e6));
    assert_eq!(b["dur"].as_f64(), Some(2e6));
    assert_eq!(b["args"]["step"], 1);
    assert_eq!(b["args"]["stage"], 0);
    assert_eq!(b["args"]["microbatch"], 0);
    let rg = x.iter().find(|e| e["name"] == "0REDUCE_GRAD").unwrap();
    assert_eq!(rg["tid"], Stream::DataParallel.index());
    assert!(rg["args"]["microbatch"].is_null());
    let names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert_eq!(names, ["rank 0", "rank 1"]);
    let threads: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name" && e["pid"] == 0)
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert_eq!(threads, ["compute", "p2p", "data-parallel"]);
}

#[test]
fn memory_svg_draws_one_path_per_rank_and_the_simulators_peak() {
    // Same instant: the free goes first, so the peak is 300, not 400.
    let a = MemorySeries::from_deltas(0, 100, &[(0.0, 100), (1.0, 100), (1.0, -100), (2.0, -200)]);
    assert_eq!(a.peak(), 200);
    assert_eq!(a.points, vec![(0.0, 200), (1.0, 200), (2.0, 0)]);
    let b = MemorySeries::from_deltas(1, 0, &[(0.5, 3 << 30), (1.5, -(3 << 30))]);
    let c = MemorySeries::from_deltas(2, 0, &[(0.0, -5)]);
    assert_eq!(c.peak(), 0, "an unmatched free clamps at zero");
    let svg = memory_svg("memory & co", &[a, b, c], TimeUnit::Units);
    assert_balanced(&svg);
    assert_eq!(svg.matches("<path ").count(), 3);
    assert!(svg.contains("memory (GiB)") && svg.contains("rank 2"));
    assert!(svg.contains("memory &amp; co"));
}

#[test]
fn replay_of_a_lowered_zero3_schedule_renders() {
    let schedule = lowered(4, 2, 8, ZeroLevel::Zero3);
    let outcome = replay(&schedule, SendMode::Eager, comm_cost).unwrap();
    assert!(outcome.completed());
    let trace = Trace::from_replay(&outcome.timeline);
    assert_eq!(trace.num_ranks(), 4);
    assert_eq!(
        trace.num_spans(),
        schedule.ranks.iter().map(Vec::len).sum::<usize>()
    );
    for lane in &trace.lanes {
        for s in &lane.spans {
            assert_eq!(Stream::of(s.action().unwrap().kind), lane.stream);
        }
    }
    let svg = timeline_svg(&trace);
    assert_balanced(&svg);
    assert!(svg.contains(">0F0</text>"));
    let doc: Value = serde_json::from_str(&chrome_trace_json(&trace)).unwrap();
    let x = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    assert_eq!(x, trace.num_spans());
    let memory = trace.activation_memory(1 << 20);
    assert_eq!(memory.len(), 4);
    // Breadth-first with V = 2 holds all 8 micro-batches of both local stages at the turn.
    assert!(memory.iter().all(|m| m.peak() == 16 << 20));
    assert!(memory
        .iter()
        .all(|m| m.points.last().map(|p| p.1) == Some(0)));
}

#[test]
fn simulation_keeps_its_streams_and_the_optimizer_step() {
    let schedule = lowered(4, 2, 8, ZeroLevel::Zero3);
    let mut cfg = SimConfig::unit();
    cfg.zero = ZeroLevel::Zero3;
    let result = simulate(&schedule, &cfg).unwrap();
    let trace = Trace::from_sim(&result);
    assert_eq!(trace.time_unit, TimeUnit::Units);
    let intervals: usize = result
        .trace
        .iter()
        .map(|r| r.compute.len() + r.p2p.len() + r.dp.len())
        .sum();
    assert_eq!(trace.num_spans(), intervals);
    let svg = timeline_svg(&trace);
    assert_balanced(&svg);
    assert!(svg.contains("optimizer"));
}

#[test]
fn engine_events_go_to_the_stream_of_their_kind() {
    let ev = |action, start, end| TimedEvent {
        step: 2,
        action,
        start,
        end,
    };
    let timelines = vec![vec![
        ev(Action::collective(0, ActionKind::Unshard), 0.0, 0.1),
        ev(Action::forward(0, 0), 0.1, 0.2),
        ev(Action::new(0, ActionKind::SendForward, 0), 0.2, 0.25),
        ev(Action::collective(0, ActionKind::Reshard), 0.25, 0.25),
    ]];
    let trace = Trace::from_engine(&timelines);
    let count = |stream| {
        trace
            .lanes
            .iter()
            .filter(|l| l.stream == stream)
            .map(|l| l.spans.len())
            .sum::<usize>()
    };
    assert_eq!(
        [
            count(Stream::Compute),
            count(Stream::P2p),
            count(Stream::DataParallel)
        ],
        [1, 1, 2]
    );
    assert!(trace
        .lanes
        .iter()
        .flat_map(|l| &l.spans)
        .all(|s| s.step == Some(2)));
    let svg = timeline_svg(&trace);
    assert!(
        svg.contains("time (ms)"),
        "sub-second runs are labelled in ms"
    );
}

#[test]
fn sixty_four_ranks_stay_small_and_balanced() {
    let schedule = lowered(64, 2, 64, ZeroLevel::Zero3);
    let outcome = replay(&schedule, SendMode::Eager, comm_cost).unwrap();
    let trace = Trace::from_replay(&outcome.timeline);
    let svg = timeline_svg_with(
        &trace,
        &TimelineOptions {
            labels: false,
            ..TimelineOptions::default()
        },
    );
    assert_balanced(&svg);
    assert!(svg.len() < 2 << 20, "{} bytes", svg.len());
    assert!(svg.contains("rank 63") && svg.contains("stage 0+9k"));
}

#[test]
fn write_file_names_the_path_it_could_not_write() {
    let scratch_dir = tempfile::Builder::new()
        .prefix("bfpp-viz-")
        .tempdir()
        .expect("temp dir");
    let ok = scratch_dir.path().join("nested/out.svg");
    write_file(&ok, "<svg/>").unwrap();
    assert_eq!(std::fs::read_to_string(&ok).unwrap(), "<svg/>");
    // A file cannot be a folder.
    let bad = ok.join("below-a-file.svg");
    let err = write_file(&bad, "x").unwrap_err();
    assert!(err.to_string().contains("below-a-file.svg"), "{err}");
}

/// Writes the example pictures of the documentation into `$BFPP_VIZ_DOCS` (run with
/// `BFPP_VIZ_DOCS=$PWD/docs cargo test -p burn-bfpp viz::tests::render_docs -- --ignored`
/// from the workspace root; a relative path is taken from `burn-bfpp/`, where tests run).
#[test]
#[ignore = "writes files; run by hand to refresh docs/"]
fn render_docs_examples() {
    let Ok(dir) = std::env::var("BFPP_VIZ_DOCS") else {
        return;
    };
    let dir = std::path::Path::new(&dir);
    let small = lowered(4, 2, 8, ZeroLevel::Zero3);
    let outcome = replay(&small, SendMode::Eager, comm_cost).unwrap();
    let trace = Trace::from_replay(&outcome.timeline).with_title(
        "breadth-first P=4 V=2 M=8, ZeRO-3 (replay: F=1, B=2, send 0.2, UNSHARD/REDUCE_GRAD 0.6)",
    );
    write_file(dir.join("timeline-example.svg"), &timeline_svg(&trace)).unwrap();
    let memory = trace.activation_memory(256 << 20);
    write_file(
        dir.join("memory-example.svg"),
        &memory_svg(
            "Activation memory per rank, breadth-first P=4 V=2 M=8 (estimate: 256 MiB per stage micro-batch)",
            &memory,
            trace.time_unit,
        ),
    )
    .unwrap();

    let big = lowered(64, 2, 64, ZeroLevel::Zero3);
    let outcome = replay(&big, SendMode::Eager, comm_cost).unwrap();
    let trace = Trace::from_replay(&outcome.timeline)
        .with_title("breadth-first P=64 V=2 M=64, ZeRO-3 (replay)");
    let opts = TimelineOptions {
        labels: false,
        ..TimelineOptions::default()
    };
    write_file(
        dir.join("timeline-64-ranks.svg"),
        &timeline_svg_with(&trace, &opts),
    )
    .unwrap();
}
