//! The SVG chart of memory over time: one step line per rank on shared axes.
//!
//! Memory changes at discrete instants (an allocation, a free), so each series is drawn as a
//! step function rather than interpolated. With few ranks the lines take the stage palette;
//! with more, a hue ramp over the ranks, so neighbouring ranks get neighbouring colours and
//! the legend stays readable at 64 ranks.

use std::fmt::Write;

use super::svg::{decimals_for, escape, nice_step, ticks, time_scale, STAGE_PALETTE};
use super::trace::{MemorySeries, TimeUnit};

const LEFT: f64 = 78.0;
const TOP: f64 = 48.0;
const PLOT_W: f64 = 900.0;
const PLOT_H: f64 = 380.0;
const LEGEND_ROW: f64 = 14.0;

/// Colour of the `i`-th of `n` series.
fn series_colour(i: usize, n: usize) -> String {
    if n <= STAGE_PALETTE.len() {
        return STAGE_PALETTE[i].to_string();
    }
    // HSL with fixed saturation and lightness, hue over 0..300° (stopping short of red again).
    let h = 300.0 * i as f64 / (n - 1).max(1) as f64;
    let (s, l) = (0.65, 0.45);
    let c = (1.0 - (2.0 * l - 1.0f64).abs()) * s;
    let hp = h / 60.0;
    let x = c * (1.0 - (hp % 2.0 - 1.0).abs());
    let (r, g, b) = match hp as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let ch = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    format!("#{:02x}{:02x}{:02x}", ch(r), ch(g), ch(b))
}

/// The binary unit that keeps the largest value between 1 and 1024: (divisor, name).
fn byte_scale(max: u64) -> (f64, &'static str) {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut div = 1.0;
    let mut i = 0;
    while i + 1 < UNITS.len() && max as f64 >= div * 1024.0 {
        div *= 1024.0;
        i += 1;
    }
    (div, UNITS[i])
}

/// Memory over time of every series in `series` as an SVG document headed `title`;
/// `time_unit` is the unit of the series' times (the trace's unit when they come from one).
///
/// The time axis starts at 0 when every time is non-negative (all recorders count from the
/// start of the run or step), so curves of different runs line up.
pub fn memory_svg(title: &str, series: &[MemorySeries], time_unit: TimeUnit) -> String {
    let finite = series
        .iter()
        .flat_map(|s| &s.points)
        .filter(|p| p.0.is_finite());
    let (mut t0, mut t1) = (f64::INFINITY, f64::NEG_INFINITY);
    for p in finite {
        t0 = t0.min(p.0);
        t1 = t1.max(p.0);
    }
    if t0.is_finite() && t0 > 0.0 {
        t0 = 0.0;
    }
    if !(t0.is_finite() && t1 > t0) {
        (t0, t1) = if t0.is_finite() {
            (t0, t0 + 1.0)
        } else {
            (0.0, 1.0)
        };
    }
    let peak = series
        .iter()
        .map(MemorySeries::peak)
        .max()
        .unwrap_or(0)
        .max(1);
    let (ydiv, yname) = byte_scale(peak);
    let ystep = nice_step(peak as f64 / ydiv, 6) * ydiv;
    // Headroom, so a curve at its peak does not run along the frame.
    let ymax = (peak as f64 * 1.04 / ystep).ceil() * ystep;
    let x = |t: f64| LEFT + (t - t0) / (t1 - t0) * PLOT_W;
    let y = |b: f64| TOP + PLOT_H - b / ymax * PLOT_H;

    // Legend to the right of the plot, in as many columns as needed.
    let rows = ((PLOT_H / LEGEND_ROW).floor() as usize).max(1);
    let columns = series.len().div_ceil(rows).max(1);
    let col_w = 64.0;
    let total_w = LEFT + PLOT_W + 20.0 + columns as f64 * col_w + 10.0;
    let total_h = TOP + PLOT_H + 50.0;

    let mut out = String::new();
    let _ = write!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0}" height="{total_h:.0}" viewBox="0 0 {total_w:.0} {total_h:.0}"><style>text{{font-family:DejaVu Sans,Helvetica,Arial,sans-serif;font-size:10px}}.t{{font-size:15px;font-weight:bold}}</style><rect width="{total_w:.0}" height="{total_h:.0}" fill="#fff"/>"##
    );
    let _ = write!(
        out,
        r#"<text x="{LEFT}" y="22" class="t">{}</text>"#,
        escape(title)
    );
    // Axes and grid.
    let _ = write!(
        out,
        r##"<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#333"/>"##
    );
    let ydec = decimals_for(ystep / ydiv);
    for v in ticks(0.0, ymax, ystep) {
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="#ddd"/><text x="{2:.1}" y="{3:.1}" text-anchor="end">{4:.5$}</text>"##,
            y(v),
            LEFT + PLOT_W,
            LEFT - 6.0,
            y(v) + 3.5,
            v / ydiv,
            ydec
        );
    }
    let (tdiv, tname) = time_scale(time_unit, t1.abs().max(t0.abs()));
    let tstep = nice_step(t1 - t0, 10);
    let tdec = decimals_for(tstep / tdiv);
    for t in ticks(t0, t1, tstep) {
        let _ = write!(
            out,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="#eee"/><text x="{0:.1}" y="{2:.1}" text-anchor="middle">{3:.4$}</text>"##,
            x(t),
            TOP + PLOT_H,
            TOP + PLOT_H + 14.0,
            t / tdiv,
            tdec
        );
    }
    let _ = write!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time ({tname})</text>"#,
        LEFT + PLOT_W / 2.0,
        TOP + PLOT_H + 32.0
    );
    let _ = write!(
        out,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">memory ({yname})</text>"#,
        TOP + PLOT_H / 2.0
    );

    for (i, s) in series.iter().enumerate() {
        let colour = series_colour(i, series.len());
        // Step path: hold each value until the next change, and the last one to the end.
        let mut d = String::new();
        let pts: Vec<&(f64, u64)> = s.points.iter().filter(|p| p.0.is_finite()).collect();
        for (k, &&(t, b)) in pts.iter().enumerate() {
            let (px, py) = (x(t), y(b as f64));
            if k == 0 {
                let _ = write!(d, "M{px:.1} {py:.1}");
            } else {
                let _ = write!(d, "H{px:.1}V{py:.1}");
            }
        }
        if !pts.is_empty() {
            let _ = write!(d, "H{:.1}", x(t1));
        }
        let _ = write!(
            out,
            r#"<path d="{d}" fill="none" stroke="{colour}" stroke-width="1.4" stroke-opacity="0.85"><title>rank {} (peak {:.2} {yname})</title></path>"#,
            s.rank,
            s.peak() as f64 / ydiv
        );
        let (col, row) = (i / rows, i % rows);
        let lx = LEFT + PLOT_W + 20.0 + col as f64 * col_w;
        let ly = TOP + row as f64 * LEGEND_ROW;
        let text = format!("rank {}", s.rank);
        let _ = write!(
            out,
            r#"<line x1="{lx:.1}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="{colour}" stroke-width="3"/><text x="{2:.1}" y="{3:.1}">{4}</text>"#,
            ly + 6.0,
            lx + 12.0,
            lx + 16.0,
            ly + 9.5,
            escape(&text)
        );
    }
    out.push_str("</svg>\n");
    out
}
