//! The SVG timeline: one lane per rank and stream, coloured by stage.
//!
//! Layout (top to bottom): title, legend, time axis, then per rank a compute lane (18 px) and
//! the non-empty communication lanes (9 px: point-to-point sends in the upper half, receives in
//! the lower half, since the simulator's receives overlap the rank's own sends), then a second
//! time axis. Lane heights are fixed, so the picture grows downwards with the rank count and
//! stays readable at 64 ranks. The grey lane background is idle time.
//!
//! Size: at 64 ranks a step has tens of thousands of spans. Colours live in CSS classes, and
//! touching spans of one class narrower than [`MERGE_PX`] are drawn as one rectangle (their
//! boundaries would be sub-pixel anyway) and the remaining narrow ones as subpaths of one
//! `<path>` per class, which keeps a 64-rank step well under a megabyte.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::svg::{
    decimals_for, escape, legend_item, nice_step, shade, stage_colour, text_colour_on, text_width,
    ticks, time_scale, tint, STAGE_PALETTE,
};
use super::trace::{Lane, Span, Stream, Trace};
use crate::schedule::ActionKind;
use crate::sim::TraceItem;

/// Spans narrower than this (px) may be merged with touching spans of the same class.
pub const MERGE_PX: f64 = 3.0;

const LEFT: f64 = 76.0;
const RIGHT: f64 = 24.0;
const COMPUTE_H: f64 = 18.0;
const COMM_H: f64 = 9.0;
const LANE_GAP: f64 = 1.0;
const RANK_GAP: f64 = 5.0;
const LABEL_SIZE: f64 = 9.0;
/// Every span is at least this wide, so zero-length transfers and frees stay visible.
const MIN_W: f64 = 1.0;

const FWD_TRANSFER: &str = "#8fa3b8";
const BWD_TRANSFER: &str = "#3f4c5a";
const UNSHARD: &str = "#c2c2c2";
const REDUCE_GRAD: &str = "#7a7a7a";
const RESHARD: &str = "#000000";
const OPTIMIZER: &str = "#2b2b2b";
const IDLE: &str = "#ebebeb";
const COMM_IDLE: &str = "#f5f5f5";

/// How a timeline is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineOptions {
    /// Width of the time axis in pixels (the SVG is this plus the margins).
    pub width: f64,
    /// Write action strings inside spans wide enough to hold them.
    pub labels: bool,
}

impl Default for TimelineOptions {
    fn default() -> Self {
        TimelineOptions {
            width: 1400.0,
            labels: true,
        }
    }
}

/// The timeline of `trace` as an SVG document, with [`TimelineOptions::default`].
pub fn timeline_svg(trace: &Trace) -> String {
    timeline_svg_with(trace, &TimelineOptions::default())
}

/// One rectangle to draw.
struct Rect {
    y: f64,
    h: f64,
    class: String,
    x0: f64,
    x1: f64,
    /// Draw the hatch pattern over it (split backward `I`).
    hatch: bool,
    label: Option<(String, &'static str)>,
}

/// The CSS class and fill of a span (and whether it is hatched).
fn style_of(span: &Span) -> (String, String, bool) {
    let action = match span.item {
        TraceItem::OptimizerStep => return ("op".into(), OPTIMIZER.into(), false),
        TraceItem::Action(a) => a,
    };
    let c = action.stage % STAGE_PALETTE.len();
    let base = stage_colour(action.stage);
    match action.kind {
        ActionKind::Forward => (format!("f{c}"), base.into(), false),
        ActionKind::Backward => (format!("b{c}"), shade(base, 0.62), false),
        ActionKind::BackwardInput => (format!("b{c}"), shade(base, 0.62), true),
        ActionKind::BackwardWeight => (format!("w{c}"), tint(base, 0.55), false),
        ActionKind::SendForward | ActionKind::RecvForward => {
            ("tf".into(), FWD_TRANSFER.into(), false)
        }
        ActionKind::SendBackward | ActionKind::RecvBackward => {
            ("tb".into(), BWD_TRANSFER.into(), false)
        }
        ActionKind::Unshard => ("un".into(), UNSHARD.into(), false),
        ActionKind::Reshard => ("rs".into(), RESHARD.into(), false),
        ActionKind::ReduceGrad => ("rg".into(), REDUCE_GRAD.into(), false),
    }
}

/// The CSS rules of every class: stage classes for the whole palette, so the stylesheet
/// does not depend on the trace.
fn stylesheet() -> String {
    let mut css = String::from(
        "text{font-family:DejaVu Sans,Helvetica,Arial,sans-serif}\
         .t{font-size:15px;font-weight:bold}.lg{font-size:11px}.ax{font-size:10px}\
         .rk{font-size:10px;text-anchor:end}.sl{font-size:7px;text-anchor:end;fill:#666}\
         .lb{font-size:9px;text-anchor:middle;pointer-events:none}\
         .k{stroke:#fff;stroke-width:0.4}.g{stroke:#bbb;stroke-width:0.5}",
    );
    for (c, base) in STAGE_PALETTE.iter().enumerate() {
        let _ = write!(
            css,
            ".f{c}{{fill:{base}}}.b{c}{{fill:{}}}.w{c}{{fill:{}}}",
            shade(base, 0.62),
            tint(base, 0.55)
        );
    }
    for (class, fill) in [
        ("tf", FWD_TRANSFER),
        ("tb", BWD_TRANSFER),
        ("un", UNSHARD),
        ("rs", RESHARD),
        ("rg", REDUCE_GRAD),
        ("op", OPTIMIZER),
    ] {
        let _ = write!(css, ".{class}{{fill:{fill}}}");
    }
    css
}

/// Draw `rects` (one lane), merging runs of narrow unlabelled rectangles of one class.
fn draw_rects(out: &mut String, mut rects: Vec<Rect>, compute: bool) {
    rects.sort_by(|a, b| {
        a.y.total_cmp(&b.y)
            .then_with(|| a.class.cmp(&b.class))
            .then_with(|| a.x0.total_cmp(&b.x0))
    });
    let mut merged: Vec<Rect> = Vec::with_capacity(rects.len());
    // Whether the last rectangle of `merged` ends in a narrow piece (so a narrow neighbour
    // may join it without hiding a boundary that would have been visible).
    let mut narrow_tail = false;
    for r in rects {
        let narrow = r.x1 - r.x0 < MERGE_PX && r.label.is_none();
        if let Some(last) = merged.last_mut() {
            if narrow
                && narrow_tail
                && last.y == r.y
                && last.class == r.class
                && last.hatch == r.hatch
                && r.x0 <= last.x1 + 0.5
            {
                last.x1 = last.x1.max(r.x1);
                continue;
            }
        }
        narrow_tail = narrow;
        merged.push(r);
    }
    let edge = if compute { " k" } else { "" };
    // Narrow unlabelled rectangles of one class become subpaths of a single `<path>`: at 64
    // ranks there are tens of thousands of transfer ticks, and a subpath costs a third of
    // the bytes of a `<rect>` element.
    let mut paths: BTreeMap<(&str, bool), String> = BTreeMap::new();
    for r in &merged {
        let w = (r.x1 - r.x0).max(MIN_W);
        if w < MERGE_PX && r.label.is_none() {
            let d = paths.entry((r.class.as_str(), r.hatch)).or_default();
            let _ = write!(d, "M{:.1} {:.1}h{w:.1}v{:.1}h-{w:.1}z", r.x0, r.y, r.h);
            continue;
        }
        let _ = write!(
            out,
            r#"<rect x="{:.1}" y="{:.1}" width="{w:.1}" height="{:.1}" class="{}{edge}"/>"#,
            r.x0, r.y, r.h, r.class
        );
        if r.hatch {
            let _ = write!(
                out,
                r#"<rect x="{:.1}" y="{:.1}" width="{w:.1}" height="{:.1}" fill="url(#hatch)"/>"#,
                r.x0, r.y, r.h
            );
        }
        if let Some((text, colour)) = &r.label {
            let _ = write!(
                out,
                r#"<text x="{:.1}" y="{:.1}" class="lb" fill="{colour}">{}</text>"#,
                (r.x0 + r.x1) / 2.0,
                r.y + r.h / 2.0 + LABEL_SIZE * 0.35,
                escape(text)
            );
        }
    }
    for ((class, hatch), d) in paths {
        let _ = write!(out, r#"<path d="{d}" class="{class}"/>"#);
        if hatch {
            let _ = write!(out, r#"<path d="{d}" fill="url(#hatch)"/>"#);
        }
    }
}

/// The legend rows; returns the y below them.
fn legend(out: &mut String, trace: &Trace, width: f64, y0: f64) -> f64 {
    let kinds: Vec<ActionKind> = trace
        .lanes
        .iter()
        .flat_map(|l| &l.spans)
        .filter_map(|s| s.action().map(|a| a.kind))
        .collect();
    let has = |k: ActionKind| kinds.contains(&k);
    let has_opt = trace
        .lanes
        .iter()
        .flat_map(|l| &l.spans)
        .any(|s| s.item == TraceItem::OptimizerStep);
    let max_stage = trace
        .lanes
        .iter()
        .flat_map(|l| &l.spans)
        .filter_map(|s| s.action().map(|a| a.stage))
        .max();
    let base = stage_colour(0);
    let (dark, light) = (shade(base, 0.62), tint(base, 0.55));
    let mut items: Vec<(String, &str, String)> = vec![
        (base.into(), "", "F forward".into()),
        (dark.clone(), "", "B backward".into()),
    ];
    if has(ActionKind::BackwardInput) {
        items.push((dark, "url(#hatch)", "I input grad".into()));
    }
    if has(ActionKind::BackwardWeight) {
        items.push((light, "", "W weight grad".into()));
    }
    items.extend([
        (FWD_TRANSFER.into(), "", "SEND/RECV_F".into()),
        (BWD_TRANSFER.into(), "", "SEND/RECV_B".into()),
        (UNSHARD.into(), "", "UNSHARD".into()),
        (REDUCE_GRAD.into(), "", "REDUCE_GRAD".into()),
        (RESHARD.into(), "", "RESHARD (tick)".into()),
    ]);
    if has_opt {
        items.push((OPTIMIZER.into(), "", "optimizer".into()));
    }
    items.push((IDLE.into(), "", "idle".into()));
    let (mut x, mut y) = (LEFT, y0);
    let place =
        |out: &mut String, x: &mut f64, y: &mut f64, fill: &str, extra: &str, text: &str| {
            let need = 18.0 + text_width(text, 11.0) + 14.0;
            if *x + need > LEFT + width && *x > LEFT {
                *x = LEFT;
                *y += 17.0;
            }
            *x = legend_item(out, *x, *y, fill, extra, text);
        };
    for (fill, extra, text) in &items {
        place(out, &mut x, &mut y, fill, extra, text);
    }
    // Stage colours on their own row. With more stages than colours, each swatch stands for
    // every stage congruent to it modulo the palette size.
    let stages = max_stage.map_or(0, |s| s + 1);
    let n = STAGE_PALETTE.len();
    if stages > 0 {
        x = LEFT;
        y += 17.0;
    }
    for (c, fill) in STAGE_PALETTE.iter().enumerate().take(stages) {
        let text = if stages > n {
            format!("stage {c}+{n}k")
        } else {
            format!("stage {c}")
        };
        place(out, &mut x, &mut y, fill, "", &text);
    }
    y += 15.0;
    let _ = write!(
        out,
        r##"<text x="{LEFT}" y="{y:.1}" class="ax" fill="#555">lanes per rank: compute, then p2p (sends above, receives below) and data-parallel when used; grey background = idle</text>"##
    );
    y + 8.0
}

/// Where tick marks go and how their labels are printed.
struct TimeAxis<'a> {
    ticks: &'a [f64],
    /// Divisor from trace time to the printed unit (s, ms, µs).
    div: f64,
    /// Decimals of the tick labels.
    dec: usize,
    width: f64,
}

impl TimeAxis<'_> {
    /// The axis line, ticks and tick labels at `y`; labels above the line when `above`.
    fn draw(&self, out: &mut String, y: f64, above: bool, x: &dyn Fn(f64) -> f64) {
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#333" stroke-width="1"/>"##,
            LEFT + self.width
        );
        let (tick_end, text_y) = if above {
            (y - 4.0, y - 6.0)
        } else {
            (y + 4.0, y + 14.0)
        };
        for &t in self.ticks {
            let _ = write!(
                out,
                r##"<line x1="{0:.1}" y1="{y:.1}" x2="{0:.1}" y2="{tick_end:.1}" stroke="#333"/><text x="{0:.1}" y="{text_y:.1}" class="ax" text-anchor="middle">{1:.2$}</text>"##,
                x(t),
                t / self.div,
                self.dec
            );
        }
    }
}

/// The timeline of `trace` as an SVG document.
pub fn timeline_svg_with(trace: &Trace, opts: &TimelineOptions) -> String {
    let width = if opts.width.is_finite() && opts.width >= 100.0 {
        opts.width
    } else {
        TimelineOptions::default().width
    };
    let (t0, t1) = trace.time_range().unwrap_or((0.0, 1.0));
    let span = if t1 > t0 { t1 - t0 } else { 1.0 };
    let x = move |t: f64| LEFT + (t - t0) / span * width;
    let (div, unit_name) = time_scale(trace.time_unit, t1.abs().max(t0.abs()));
    let step = nice_step(span, 12);
    let tick_list = ticks(t0, t1.max(t0 + span), step);
    let dec = decimals_for(step / div);

    let mut body = String::new();
    let _ = write!(
        body,
        r#"<text x="{LEFT}" y="22" class="t">{}</text>"#,
        escape(&trace.title)
    );
    let legend_end = legend(&mut body, trace, width, 44.0);
    let axis_top = legend_end + 22.0;

    // Lanes to draw, grouped by rank; empty communication lanes are dropped.
    let mut by_rank: BTreeMap<usize, Vec<&Lane>> = BTreeMap::new();
    for lane in &trace.lanes {
        let entry = by_rank.entry(lane.rank).or_default();
        if lane.stream == Stream::Compute || !lane.spans.is_empty() {
            entry.push(lane);
        }
    }
    let mut backgrounds = String::new();
    let mut spans = String::new();
    let mut y = axis_top + 6.0;
    for (rank, lanes) in &mut by_rank {
        lanes.sort_by_key(|l| l.stream);
        let mut first = true;
        for lane in lanes.iter() {
            let h = if lane.stream == Stream::Compute {
                COMPUTE_H
            } else {
                COMM_H
            };
            let fill = if lane.stream == Stream::Compute {
                IDLE
            } else {
                COMM_IDLE
            };
            let _ = write!(
                backgrounds,
                r#"<rect x="{LEFT}" y="{y:.1}" width="{width:.1}" height="{h}" fill="{fill}"/>"#
            );
            if first {
                let _ = write!(
                    backgrounds,
                    r#"<text x="{:.1}" y="{:.1}" class="rk">rank {rank}</text>"#,
                    LEFT - 6.0,
                    y + h / 2.0 + 3.5
                );
                first = false;
            }
            if lane.stream != Stream::Compute {
                let name = if lane.stream == Stream::P2p {
                    "p2p"
                } else {
                    "dp"
                };
                let _ = write!(
                    backgrounds,
                    r#"<text x="{:.1}" y="{:.1}" class="sl">{name}</text>"#,
                    LEFT - 6.0,
                    y + h / 2.0 + 2.5
                );
            }
            let rects = lane
                .spans
                .iter()
                .filter(|s| s.start.is_finite() && s.end.is_finite())
                .map(|s| {
                    let (class, fill, hatch) = style_of(s);
                    let (x0, x1) = (x(s.start), x(s.end));
                    // Point-to-point: receives in the lower half, sends in the upper half.
                    let (ry, rh) = match s.action().map(|a| a.kind) {
                        Some(ActionKind::RecvForward | ActionKind::RecvBackward) => {
                            (y + h / 2.0, h / 2.0)
                        }
                        Some(ActionKind::SendForward | ActionKind::SendBackward) => (y, h / 2.0),
                        _ => (y, h),
                    };
                    let mut label = None;
                    if opts.labels && lane.stream == Stream::Compute {
                        let text = match s.item {
                            TraceItem::OptimizerStep => "opt".to_string(),
                            TraceItem::Action(a) => a.to_string(),
                        };
                        if text_width(&text, LABEL_SIZE) + 3.0 <= x1 - x0 {
                            label = Some((text, text_colour_on(&fill)));
                        }
                    }
                    Rect {
                        y: ry,
                        h: rh,
                        class,
                        x0,
                        x1,
                        hatch,
                        label,
                    }
                })
                .collect();
            draw_rects(&mut spans, rects, lane.stream == Stream::Compute);
            y += h + LANE_GAP;
        }
        y += RANK_GAP;
    }
    let lanes_end = y;
    let axis_bottom = lanes_end + 2.0;
    let height = axis_bottom + 40.0;

    let mut grid = String::new();
    for &t in &tick_list {
        let _ = write!(
            grid,
            r#"<line x1="{0:.1}" y1="{axis_top:.1}" x2="{0:.1}" y2="{axis_bottom:.1}" class="g"/>"#,
            x(t)
        );
    }
    let mut axes = String::new();
    let time_axis = TimeAxis {
        ticks: &tick_list,
        div,
        dec,
        width,
    };
    time_axis.draw(&mut axes, axis_top, true, &x);
    time_axis.draw(&mut axes, axis_bottom, false, &x);
    let _ = write!(
        axes,
        r#"<text x="{:.1}" y="{:.1}" class="ax" text-anchor="middle">time ({unit_name})</text>"#,
        LEFT + width / 2.0,
        axis_bottom + 30.0
    );

    let total_w = LEFT + width + RIGHT;
    let mut out = String::with_capacity(body.len() + spans.len() + backgrounds.len() + 4096);
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0}" height="{height:.0}" viewBox="0 0 {total_w:.0} {height:.0}">"#
    );
    let _ = write!(
        out,
        r##"<defs><style>{}</style><pattern id="hatch" width="4" height="4" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="1.2" height="4" fill="#fff" fill-opacity="0.4"/></pattern></defs>"##,
        stylesheet()
    );
    let _ = write!(
        out,
        r##"<rect width="{total_w:.0}" height="{height:.0}" fill="#fff"/>"##
    );
    out.push_str(&body);
    out.push_str(&backgrounds);
    out.push_str(&grid);
    out.push_str(&spans);
    out.push_str(&axes);
    out.push_str("</svg>\n");
    out
}
