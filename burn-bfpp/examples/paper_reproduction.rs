//! The paper's question, asked of the simulator: throughput per GPU against batch size per
//! GPU for the 52B GPT on 64 and on 512 A100-80GB GPUs, for the best breadth-first,
//! Megatron-LM and non-looped 1F1B layout the planner finds at each batch.
//!
//! ```text
//! cargo run --release -p burn-bfpp --no-default-features --example paper_reproduction -- docs
//! ```
//!
//! Writes `paper-reproduction.csv` (every family, every point) and `paper-reproduction.svg`
//! (the three families of the paper's comparison) into the given folder (default `docs`),
//! and prints a Markdown table of the results.

use std::error::Error;
use std::path::{Path, PathBuf};

use burn_bfpp::plan::{plan, Candidate, Family, PlanError, PlanRequest};
use burn_bfpp::sim::{HardwareConfig, ModelConfig, Strategy};
use plotters::prelude::*;

/// Batch sizes per GPU, samples (the paper's small-batch regime up to a few samples).
const PER_GPU: [f64; 6] = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0];
const CLUSTERS: [usize; 2] = [64, 512];
/// The families plotted, as the issue asks: the paper's method and its two baselines.
const PLOTTED: [Family; 3] = [Family::BreadthFirst, Family::Megatron, Family::OneFOneB];

struct Point {
    gpus: usize,
    per_gpu: f64,
    family: Family,
    best: Option<Candidate>,
}

fn layout_text(c: &Candidate) -> String {
    let l = &c.layout;
    format!(
        "tp={} pp={} V={} dp={} M={}{} mbs={} ZeRO-{}{}{}",
        l.tp,
        l.pp,
        l.loops,
        l.dp,
        l.microbatches,
        l.bf_microbatches
            .map_or(String::new(), |k| format!(" K={k}")),
        l.micro_batch_size,
        l.zero.number(),
        if l.recompute { " recompute" } else { "" },
        if l.strategy == Strategy::Megatron && l.loops > 1 {
            " interleaved"
        } else {
            ""
        }
    )
}

fn run(points: &mut Vec<Point>) -> Result<(), Box<dyn Error>> {
    let model = ModelConfig::preset("gpt-52b")?;
    let hardware = HardwareConfig::preset("a100-80gb")?;
    for gpus in CLUSTERS {
        for per_gpu in PER_GPU {
            let batch = (per_gpu * gpus as f64).round() as usize;
            let req = PlanRequest::new(model.clone(), hardware.clone(), gpus, batch);
            let found = match plan(&req, 1) {
                Ok(p) => p.best_per_family,
                Err(PlanError::NothingFits { .. }) => Default::default(),
                Err(e) => return Err(e.into()),
            };
            for family in Family::ALL {
                points.push(Point {
                    gpus,
                    per_gpu,
                    family,
                    best: found.get(&family).cloned(),
                });
            }
            eprintln!("{gpus} GPUs, {per_gpu} samples per GPU: done");
        }
    }
    Ok(())
}

fn per_gpu_rate(p: &Point) -> Option<f64> {
    p.best
        .as_ref()
        .map(|c| c.score.tokens_per_s / p.gpus as f64)
}

fn write_csv(points: &[Point], path: &Path) -> Result<(), Box<dyn Error>> {
    let mut out = String::from(
        "gpus,batch_per_gpu,family,tokens_per_s_per_gpu,tflops_per_gpu,mfu,bubble_fraction,\
         exposed_dp_s,exposed_p2p_s,step_time_s,peak_memory_gib,layout\n",
    );
    for p in points {
        match &p.best {
            Some(c) => {
                let s = &c.score;
                out.push_str(&format!(
                    "{},{},{},{:.1},{:.1},{:.4},{:.4},{:.4},{:.4},{:.4},{:.2},{}\n",
                    p.gpus,
                    p.per_gpu,
                    p.family,
                    s.tokens_per_s / p.gpus as f64,
                    s.tflops_per_gpu,
                    s.mfu,
                    s.bubble_fraction,
                    s.exposed_dp_s,
                    s.exposed_p2p_s,
                    s.step_time_s,
                    s.peak_memory_bytes as f64 / (1u64 << 30) as f64,
                    c.layout
                ));
            }
            None => out.push_str(&format!(
                "{},{},{},,,,,,,,,no layout fits\n",
                p.gpus, p.per_gpu, p.family
            )),
        }
    }
    std::fs::write(path, out)?;
    Ok(())
}

fn markdown(points: &[Point]) -> String {
    let mut out = String::new();
    for gpus in CLUSTERS {
        out.push_str(&format!(
            "\n### {gpus} GPUs — tokens/s per GPU (MFU), best layout\n\n| batch/GPU | breadth-first | megatron | 1f1b | bf ÷ megatron |\n|---|---|---|---|---|\n"
        ));
        for per_gpu in PER_GPU {
            let get = |f: Family| {
                points
                    .iter()
                    .find(|p| p.gpus == gpus && p.per_gpu == per_gpu && p.family == f)
            };
            let cell = |f: Family| match get(f).and_then(|p| p.best.as_ref()) {
                Some(c) => format!(
                    "{:.0} ({:.0} %) {}",
                    c.score.tokens_per_s / gpus as f64,
                    100.0 * c.score.mfu,
                    layout_text(c)
                ),
                None => "does not fit".into(),
            };
            let ratio = match (
                get(Family::BreadthFirst).and_then(per_gpu_rate),
                get(Family::Megatron).and_then(per_gpu_rate),
            ) {
                (Some(a), Some(b)) => format!("{:.2}", a / b),
                _ => "–".into(),
            };
            out.push_str(&format!(
                "| {per_gpu} | {} | {} | {} | {ratio} |\n",
                cell(Family::BreadthFirst),
                cell(Family::Megatron),
                cell(Family::OneFOneB)
            ));
        }
    }
    out.push_str(&split_backward_tables(points));
    out
}

/// The split-backward (zero-bubble) families against breadth-first: tokens/s per GPU and
/// bubble of each family's best layout, and breadth-first-zb ÷ breadth-first.
fn split_backward_tables(points: &[Point]) -> String {
    const FAMILIES: [Family; 5] = [
        Family::BreadthFirst,
        Family::BreadthFirstZeroBubble,
        Family::InterleavedZeroBubble,
        Family::ZeroBubbleH1,
        Family::ZeroBubbleV,
    ];
    let mut out = String::new();
    for gpus in CLUSTERS {
        out.push_str(&format!(
            "\n### {gpus} GPUs — split backwards: tokens/s per GPU (bubble)\n\n| batch/GPU |"
        ));
        for f in FAMILIES {
            out.push_str(&format!(" {f} |"));
        }
        out.push_str(" bf-zb ÷ bf |\n|---|---|---|---|---|---|---|\n");
        for per_gpu in PER_GPU {
            let get = |f: Family| {
                points
                    .iter()
                    .find(|p| p.gpus == gpus && p.per_gpu == per_gpu && p.family == f)
            };
            out.push_str(&format!("| {per_gpu} |"));
            for f in FAMILIES {
                let cell = match get(f).and_then(|p| p.best.as_ref()) {
                    Some(c) => format!(
                        "{:.0} ({:.3})",
                        c.score.tokens_per_s / gpus as f64,
                        c.score.bubble_fraction
                    ),
                    None => "does not fit".into(),
                };
                out.push_str(&format!(" {cell} |"));
            }
            let ratio = match (
                get(Family::BreadthFirstZeroBubble).and_then(per_gpu_rate),
                get(Family::BreadthFirst).and_then(per_gpu_rate),
            ) {
                (Some(a), Some(b)) => format!("{:.3}", a / b),
                _ => "–".into(),
            };
            out.push_str(&format!(" {ratio} |\n"));
        }
    }
    out
}

fn plot(points: &[Point], path: &Path) -> Result<(), Box<dyn Error>> {
    let root = SVGBackend::new(path, (1100, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.draw_text(
        "gpt-52b on A100-80GB (simulated): best layout per family at each batch size",
        &("sans-serif", 20).into_font().color(&BLACK),
        (20, 12),
    )?;
    let panels = body.split_evenly((1, 2));
    let y_max = points.iter().filter_map(per_gpu_rate).fold(0.0, f64::max) * 1.1;
    let colours = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x2c, 0xa0, 0x2c),
    ];
    for (panel, gpus) in panels.iter().zip(CLUSTERS) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{gpus} GPUs"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            // log2 of the batch per GPU on a linear axis, so every point gets its own label.
            .build_cartesian_2d(-3.5f64..2.5f64, 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_desc("batch size per GPU (samples, log scale)")
            .y_desc("tokens/s per GPU")
            .x_labels(7)
            .x_label_formatter(&|x| {
                let v = 2f64.powf(*x);
                if v >= 1.0 {
                    format!("{v:.0}")
                } else {
                    format!("1/{:.0}", 1.0 / v)
                }
            })
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(RGBColor(0xf0, 0xf0, 0xf0))
            .draw()?;
        for (family, colour) in PLOTTED.iter().zip(colours) {
            let series: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.gpus == gpus && p.family == *family)
                .filter_map(|p| per_gpu_rate(p).map(|r| (p.per_gpu.log2(), r)))
                .collect();
            chart
                .draw_series(LineSeries::new(series.clone(), colour.stroke_width(2)))?
                .label(family.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            chart.draw_series(
                series
                    .iter()
                    .map(|&(x, y)| Circle::new((x, y), 4, colour.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "docs".into()));
    std::fs::create_dir_all(&dir)?;
    let mut points = Vec::new();
    run(&mut points)?;
    write_csv(&points, &dir.join("paper-reproduction.csv"))?;
    plot(&points, &dir.join("paper-reproduction.svg"))?;
    println!("{}", markdown(&points));
    Ok(())
}
