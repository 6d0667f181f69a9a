//! Small pieces shared by the SVG renderers: colours, text escaping, axis ticks.
//!
//! Both pictures are written by hand rather than with `plotters`: the timeline needs tens of
//! thousands of rectangles merged and classed to stay small at 64 ranks, hatch patterns and
//! text fitted inside spans, none of which plotters' chart model offers; its SVG backend also
//! needs a font backend (`ttf`/`ab_glyph`, system font libraries) to lay out axis labels.
//! Writing SVG directly keeps the output deterministic, dependency free and identical in
//! style between the timeline and the memory chart.

use std::fmt::Write;

use super::trace::TimeUnit;

/// Qualitative palette for stages: Tableau 10 without its grey, which is kept for
/// communication so a stage is never mistaken for a transfer.
pub const STAGE_PALETTE: [&str; 9] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f",
];

/// Colour of a stage: the palette cycles, so stage `s` and `s + 9` share a colour.
pub fn stage_colour(stage: usize) -> &'static str {
    STAGE_PALETTE[stage % STAGE_PALETTE.len()]
}

fn parse_hex(colour: &str) -> (f64, f64, f64) {
    let c = colour.trim_start_matches('#');
    let channel = |i: usize| {
        c.get(i..i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .map_or(0.0, f64::from)
    };
    (channel(0), channel(2), channel(4))
}

fn to_hex((r, g, b): (f64, f64, f64)) -> String {
    let c = |v: f64| v.round().clamp(0.0, 255.0) as u8;
    format!("#{:02x}{:02x}{:02x}", c(r), c(g), c(b))
}

/// `colour` darkened: each channel times `factor` (< 1).
pub fn shade(colour: &str, factor: f64) -> String {
    let (r, g, b) = parse_hex(colour);
    to_hex((r * factor, g * factor, b * factor))
}

/// `colour` mixed with white: `amount` 0 keeps it, 1 gives white.
pub fn tint(colour: &str, amount: f64) -> String {
    let (r, g, b) = parse_hex(colour);
    let mix = |v: f64| v + (255.0 - v) * amount;
    to_hex((mix(r), mix(g), mix(b)))
}

/// Black or white, whichever reads better on `colour` (relative luminance threshold).
pub fn text_colour_on(colour: &str) -> &'static str {
    let (r, g, b) = parse_hex(colour);
    if 0.299 * r + 0.587 * g + 0.114 * b > 150.0 {
        "#000"
    } else {
        "#fff"
    }
}

/// `text` with the five XML special characters escaped.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

/// Approximate width in pixels of `text` in the sans-serif font at `size` px. SVG cannot
/// measure text before rendering, so labels are fitted with this conservative estimate.
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.62
}

/// A "nice" step (1, 2 or 5 times a power of ten) giving about `target` steps over `range`.
pub fn nice_step(range: f64, target: usize) -> f64 {
    if !(range.is_finite() && range > 0.0) {
        return 1.0;
    }
    let raw = range / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let m = raw / magnitude;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// Tick positions `k·step` inside `[lo, hi]`.
pub fn ticks(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut k = (lo / step).ceil();
    // A bound on the count protects against a degenerate step.
    while k * step <= hi + step * 1e-9 && out.len() < 1000 {
        out.push(k * step);
        k += 1.0;
    }
    out
}

/// Decimals needed to print multiples of `step` exactly enough.
pub fn decimals_for(step: f64) -> usize {
    if step >= 1.0 || step <= 0.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    }
}

/// How a time axis prints values: a divisor and the unit's name. Seconds are shown in
/// s, ms or µs so tick labels stay short; cost-model units are shown as they are.
pub fn time_scale(unit: TimeUnit, max: f64) -> (f64, &'static str) {
    match unit {
        TimeUnit::Units => (1.0, "units"),
        TimeUnit::Seconds if max >= 1.0 => (1.0, "s"),
        TimeUnit::Seconds if max >= 1e-3 => (1e-3, "ms"),
        TimeUnit::Seconds => (1e-6, "µs"),
    }
}

/// A coloured legend swatch followed by its text at (`x`, `y`); returns the x after it.
pub fn legend_item(out: &mut String, x: f64, y: f64, fill: &str, extra: &str, text: &str) -> f64 {
    let _ = write!(
        out,
        r##"<rect x="{x:.1}" y="{:.1}" width="14" height="10" fill="{fill}" stroke="#555" stroke-width="0.5"/>"##,
        y - 9.0
    );
    if !extra.is_empty() {
        let _ = write!(
            out,
            r#"<rect x="{x:.1}" y="{:.1}" width="14" height="10" fill="{extra}"/>"#,
            y - 9.0
        );
    }
    let _ = write!(
        out,
        r#"<text x="{:.1}" y="{y:.1}" class="lg">{}</text>"#,
        x + 18.0,
        escape(text)
    );
    x + 18.0 + text_width(text, 11.0) + 14.0
}
