//! What `bfpp train` tells the user: the header, the progress bar and metrics file, the
//! timeline files, and the final summary (text or `--json`).

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, IsTerminal, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::module::Module;
use burn::tensor::backend::Backend as BackendTrait;
use burn_bfpp::data::BatchLayout;
use burn_bfpp::engine::{StepCounts, StepReport, TrainConfig, TrainOutcome};
use burn_bfpp::model::param_shapes;
use burn_bfpp::schedule::TimedEvent;
use burn_bfpp::viz;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use super::args::TrainArgs;
use super::backend::BackendChoice;
use super::config::BfppConfig;
use super::error::TrainError;
use super::predict::{MeasuredStep, Prediction};

/// The metrics file in the output folder: one JSON object per optimizer step.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The Chrome trace in the output folder.
pub const TRACE_FILE: &str = "trace.json";
/// The timeline picture in the output folder.
pub const SVG_FILE: &str = "timeline.svg";

/// Steps averaged for the "mean of the last steps" figure of the summary: one step's loss is
/// a mean over one global batch and still noisy.
const TAIL_STEPS: usize = 10;

/// What the run is about to do, printed before the first step.
pub struct Header<'a> {
    /// The effective configuration.
    pub cfg: &'a BfppConfig,
    /// The engine's configuration.
    pub train: &'a TrainConfig,
    /// The batch layout.
    pub layout: &'a BatchLayout,
    /// The backend computing.
    pub backend: BackendChoice,
    /// Where the ranks are (`RankWorld::describe`).
    pub world: String,
    /// The corpus description.
    pub corpus: String,
    /// Parameters of the model.
    pub params: usize,
}

impl Header<'_> {
    /// Prints the header on standard output.
    pub fn print(&self) {
        let (m, l, t) = (&self.cfg.model, self.layout, self.train);
        let stages = t.pp * t.loops;
        let k = match t.bf_microbatches {
            Some(k) => format!(" (K = {k})"),
            None => String::new(),
        };
        println!(
            "model: GPT, {} layers ({} blocks, hidden {}, {} heads), {:.3}M parameters",
            m.num_layers(),
            m.layers,
            m.hidden,
            m.heads,
            self.params as f64 / 1e6
        );
        println!(
            "layout: {} ranks = pp {} × dp {}; {stages} stages (loops {}); {}{k}, ZeRO-{}{}; {}",
            t.world_size(),
            t.pp,
            t.dp,
            t.loops,
            t.schedule,
            t.zero as u8,
            if t.recompute { ", recompute" } else { "" },
            t.precision
        );
        println!("ranks: {} ({} backend)", self.world, self.backend.name());
        println!(
            "batch: {} samples × {} tokens per step = dp {} × {} micro-batches × {} samples; \
             {} steps",
            l.global_batch(),
            self.cfg.data.seq_len,
            l.dp,
            l.microbatches,
            l.micro_batch_size,
            t.steps
        );
        println!("data: {}", self.corpus);
    }
}

/// The progress bar and the metrics file, both fed from the engine's `on_step`.
///
/// `on_step` runs on a rank thread, so everything here is shared through `&self`: the bar is
/// `Sync` and the file sits behind a mutex. An I/O error is kept and reported after the run
/// rather than aborting training from inside a rank.
pub struct Progress {
    bar: ProgressBar,
    notices: bool,
    tokens_per_step: usize,
    path: PathBuf,
    state: Mutex<MetricsState>,
}

struct MetricsState {
    /// None on a process that does not learn the loss (MPI): it writes no metrics.
    file: Option<BufWriter<File>>,
    previous_elapsed: f64,
    error: Option<std::io::Error>,
}

/// The step of a metrics line, if it is one (a line cut short by a crash is not).
fn step_of(line: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()?
        .get("step")?
        .as_u64()
}

/// Opens the metrics file for appending after keeping only its lines up to step
/// `keep_through` (all of them in step order, up to the first line of a later step or a
/// line cut short): a resumed run continues the file of the run it resumes without
/// duplicate or stale steps. `keep_through = 0` starts a fresh file. The kept lines are
/// written to a temporary file that replaces the old one, so a crash leaves one or the other.
fn open_metrics(path: &Path, keep_through: usize) -> io::Result<File> {
    if keep_through == 0 {
        return File::create(path);
    }
    let kept: String = match std::fs::read_to_string(path) {
        Ok(text) => text
            .lines()
            .take_while(|line| step_of(line).is_some_and(|s| s <= keep_through as u64))
            .map(|line| format!("{line}\n"))
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept)?;
    std::fs::rename(&tmp, path)?;
    OpenOptions::new().append(true).open(path)
}

impl Progress {
    /// Opens the metrics file and creates the bar; the bar is hidden unless `show` and
    /// standard output is a terminal (CI logs get the summary only). `notices` prints the
    /// data-wrap notices on standard error when there is no bar to print them above.
    /// `metrics` is `None` on a process that writes no metrics (under MPI only the process
    /// that learns the loss does), else the step the run resumes after (0: a fresh run,
    /// which truncates the file; see [`open_metrics`]).
    pub fn new(
        steps: usize,
        tokens_per_step: usize,
        path: &Path,
        show: bool,
        notices: bool,
        metrics: Option<usize>,
    ) -> Result<Self, TrainError> {
        let file = metrics
            .map(|resumed| open_metrics(path, resumed).map(BufWriter::new))
            .transpose()
            .map_err(|source| TrainError::Write {
                path: path.to_path_buf(),
                source,
            })?;
        let bar = if show && std::io::stdout().is_terminal() {
            let bar =
                ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "step {pos}/{len} [{bar:30}] {msg} | {elapsed} elapsed, ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message("loss -");
            bar
        } else {
            ProgressBar::hidden()
        };
        Ok(Self {
            bar,
            notices,
            tokens_per_step,
            path: path.to_path_buf(),
            state: Mutex::new(MetricsState {
                file,
                previous_elapsed: 0.0,
                error: None,
            }),
        })
    }

    /// One line above the bar, or on standard error when there is no bar to print it above.
    fn notice(&self, line: &str) {
        if self.bar.is_hidden() {
            if self.notices {
                eprintln!("{line}");
            }
        } else {
            self.bar.println(line);
        }
    }

    /// Records step `r`: one metrics line, the bar, a notice when the data wrapped around
    /// and a warning when the step's update was skipped.
    pub fn step(&self, r: &StepReport, epochs_started: Range<u64>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let step_time = (r.elapsed - state.previous_elapsed).max(f64::MIN_POSITIVE);
        state.previous_elapsed = r.elapsed;
        let tokens_per_s = self.tokens_per_step as f64 / step_time;
        // Written by hand to keep the keys in this order (serde_json's map sorts them);
        // `tokens` counts the tokens trained so far, this step included.
        // `skipped`: the update of this step was skipped (non-finite loss or gradient).
        let line = format!(
            "{{\"step\":{},\"loss\":{},\"lr\":{},\"tokens\":{},\"tokens_per_s\":{},\"elapsed_s\":{},\"skipped\":{}}}",
            r.step,
            json!(r.loss),
            json!(r.lr),
            r.step * self.tokens_per_step,
            json!(tokens_per_s),
            json!(r.elapsed),
            r.skipped
        );
        let MetricsState { file, error, .. } = &mut *state;
        if let (Some(file), None) = (file.as_mut(), error.as_ref()) {
            // Flushed every step so a crashed or killed run still leaves its metrics.
            let written = writeln!(file, "{line}").and_then(|()| file.flush());
            if let Err(e) = written {
                *error = Some(e);
            }
        }
        drop(state);
        for epoch in epochs_started {
            // Epochs are 0-based inside, 1-based for people.
            let text = format!(
                "dataset exhausted at step {}: wrapping around, starting epoch {}",
                r.step,
                epoch + 1
            );
            tracing::info!(
                step = r.step,
                epoch = epoch + 1,
                "dataset exhausted; next epoch"
            );
            self.notice(&text);
        }
        if r.skipped {
            tracing::warn!(step = r.step, "non-finite loss or gradient; update skipped");
            let text = format!(
                "warning: step {}: the loss or the gradient norm is not finite (loss {}); its \
                 optimizer update was skipped (on_nonfinite = skip, or an f16 gradient overflow: \
                 the loss scale was halved)",
                r.step, r.loss
            );
            // A warning is printed even without a bar and under --json.
            if self.bar.is_hidden() {
                eprintln!("{text}");
            } else {
                self.bar.println(text);
            }
        }
        self.bar.set_position(r.step as u64);
        self.bar
            .set_message(format!("loss {:.4} | {:.0} tok/s", r.loss, tokens_per_s));
    }

    /// Removes the bar (the summary follows).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    /// The metrics file.
    pub fn metrics_path(&self) -> &Path {
        &self.path
    }

    /// The first error writing the metrics file, if any.
    pub fn take_error(&self) -> Result<(), TrainError> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match state.error.take() {
            Some(source) => Err(TrainError::Write {
                path: self.path.clone(),
                source,
            }),
            None => Ok(()),
        }
    }
}

/// The timeline files of a run.
#[derive(Debug, Clone)]
pub struct TimelineFiles {
    /// The timeline picture.
    pub svg: PathBuf,
    /// The Chrome trace (`chrome://tracing`, Perfetto).
    pub trace: PathBuf,
}

/// Renders the run's timelines with [`burn_bfpp::viz`] into `out_dir`: the SVG picture (one
/// lane per rank) and the Chrome trace.
pub fn write_timeline(
    out_dir: &Path,
    timelines: &[Vec<TimedEvent>],
) -> Result<TimelineFiles, TrainError> {
    let trace = viz::Trace::from_engine(timelines);
    let files = TimelineFiles {
        svg: out_dir.join(SVG_FILE),
        trace: out_dir.join(TRACE_FILE),
    };
    for (path, text) in [
        (&files.svg, viz::timeline_svg(&trace)),
        (&files.trace, viz::chrome_trace_json(&trace)),
    ] {
        std::fs::write(path, text).map_err(|source| TrainError::Write {
            path: path.clone(),
            source,
        })?;
    }
    Ok(files)
}

/// Number of float parameter values of `model`, read from the parameters' shapes: a model
/// whose parameters are not initialised yet stays so.
pub fn param_count<B: BackendTrait, M: Module<B>>(model: &M) -> usize {
    param_shapes(model)
        .iter()
        .map(|s| s.iter().product::<usize>())
        .sum()
}

/// The final report of a run.
#[derive(Debug, Clone)]
pub struct Summary {
    losses: Vec<f64>,
    param_l2_norm: f64,
    tokens_per_s: f64,
    step_time_s: f64,
    elapsed_s: f64,
    peak_param_bytes: Vec<usize>,
    /// Each rank's process's peak resident memory, from the operating system.
    peak_rss_bytes: Vec<Option<u64>>,
    /// Each rank's share of its list time in data-parallel collectives.
    collective_share: Vec<f64>,
    entropy_rate: Option<f64>,
    files: TimelineFiles,
    metrics: PathBuf,
    skipped_steps: Vec<usize>,
    /// Every rank's host reads and bytes sent in the last step.
    last_step: Vec<StepCounts>,
    /// Seconds of every step, from the end of the one before (the first from the start).
    step_times_s: Vec<f64>,
    /// Tokens one step trains.
    tokens_per_step: usize,
    /// What carried each kind of traffic between the ranks (the `transports` line).
    transports: String,
}

/// The median of the steps after the first (kernel compilation, autotuning and allocator
/// growth fall into the first), or the only step's time.
pub fn steady_step(step_times: &[f64]) -> f64 {
    let mut rest: Vec<f64> = step_times.iter().skip(1).copied().collect();
    if rest.is_empty() {
        return step_times.first().copied().unwrap_or(f64::NAN);
    }
    rest.sort_by(f64::total_cmp);
    rest[rest.len() / 2]
}

impl Summary {
    /// Gathers the figures of `outcome`.
    pub fn new<M>(
        outcome: &TrainOutcome<M>,
        tokens_per_step: usize,
        entropy_rate: Option<f64>,
        files: TimelineFiles,
        metrics: &Path,
        transports: String,
    ) -> Self {
        let steps = outcome.losses.len();
        let elapsed_s = outcome.elapsed.as_secs_f64();
        Self {
            losses: outcome.losses.clone(),
            param_l2_norm: outcome.param_norm,
            tokens_per_s: (steps * tokens_per_step) as f64 / elapsed_s.max(f64::MIN_POSITIVE),
            step_time_s: elapsed_s / steps.max(1) as f64,
            elapsed_s,
            peak_param_bytes: outcome.peak_param_bytes.clone(),
            peak_rss_bytes: outcome.peak_rss_bytes.clone(),
            collective_share: outcome.collective_share.clone(),
            entropy_rate,
            files,
            metrics: metrics.to_path_buf(),
            skipped_steps: outcome.skipped_steps.clone(),
            last_step: outcome.last_step.clone(),
            step_times_s: outcome.step_times.clone(),
            tokens_per_step,
            transports,
        }
    }

    /// Seconds of a steady step ([`steady_step`]).
    pub fn steady_step_s(&self) -> f64 {
        steady_step(&self.step_times_s)
    }

    /// The `--json` object: exactly `losses` (`null` for a step whose loss was not
    /// finite), `param_l2_norm`, `tokens_per_s`, `peak_param_bytes`, `peak_rss_bytes` (each
    /// rank's process's peak resident memory from the operating system, `null` where it
    /// does not say; threads of one process share one figure), `collective_share`
    /// (each rank's share of its list time in data-parallel collectives), `timeline_svg`,
    /// `trace_json`, `skipped_steps` (steps whose update was skipped, see `--on-nonfinite`),
    /// and for the last step, by world rank: `host_reads_per_step` (synchronising
    /// device-to-host reads of the engine and the optimizer), `host_transfer_reads` (reads
    /// that were a host transport's payload) and `comm_bytes` (`{"data_parallel": bytes,
    /// "pipeline": bytes}` the rank's action list sent); `step_times_s` (every step's
    /// seconds) and `steady_tokens_per_s` (tokens per step over the median step after the
    /// first: the throughput without start-up costs).
    pub fn json_value(&self) -> serde_json::Value {
        let reads: Vec<u64> = self.last_step.iter().map(|c| c.host_reads).collect();
        let transfers: Vec<u64> = self
            .last_step
            .iter()
            .map(|c| c.host_transfer_reads)
            .collect();
        let bytes: Vec<_> = self.last_step.iter().map(|c| c.comm_bytes).collect();
        let doc = json!({
            "losses": self.losses,
            "skipped_steps": self.skipped_steps,
            "param_l2_norm": self.param_l2_norm,
            "tokens_per_s": self.tokens_per_s,
            "peak_param_bytes": self.peak_param_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "collective_share": self.collective_share,
            "timeline_svg": self.files.svg.display().to_string(),
            "trace_json": self.files.trace.display().to_string(),
            "host_reads_per_step": reads,
            "host_transfer_reads": transfers,
            "comm_bytes": bytes,
            "step_times_s": self.step_times_s,
            "steady_tokens_per_s": self.tokens_per_step as f64 / self.steady_step_s(),
        });
        doc
    }

    /// The human summary.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let steps = self.losses.len();
        let last = self.losses.last().copied().unwrap_or(f64::NAN);
        let tail = &self.losses[steps.saturating_sub(TAIL_STEPS)..];
        let tail_mean = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
        out += &format!(
            "final loss   {last:.4} nats/token at step {steps} (mean of the last {}: {tail_mean:.4})\n",
            tail.len()
        );
        if let Some(h) = self.entropy_rate {
            out += &format!(
                "bound        {h:.4} nats/token (the corpus's entropy rate); final loss is {:.2} % \
                 above it\n",
                100.0 * (last - h) / h
            );
        }
        if !self.skipped_steps.is_empty() {
            let list: Vec<String> = self.skipped_steps.iter().map(ToString::to_string).collect();
            out += &format!(
                "skipped      {} step(s) with a non-finite loss or gradient: {}\n",
                list.len(),
                list.join(", ")
            );
        }
        out += &format!(
            "throughput   {:.0} tokens/s, {:.3} s/step ({steps} steps in {:.1} s); steady: {:.0} \
             tokens/s ({:.3} s, the median step after the first)\n",
            self.tokens_per_s,
            self.step_time_s,
            self.elapsed_s,
            self.tokens_per_step as f64 / self.steady_step_s(),
            self.steady_step_s()
        );
        let peaks: Vec<String> = self
            .peak_param_bytes
            .iter()
            .enumerate()
            .map(|(rank, &b)| format!("rank {rank} {:.1} KiB", b as f64 / 1024.0))
            .collect();
        out += &format!("peak params  {}\n", peaks.join(", "));
        out += &format!("peak memory  {}\n", rss_text(&self.peak_rss_bytes));
        let shares: Vec<String> = self
            .collective_share
            .iter()
            .enumerate()
            .map(|(rank, &f)| format!("rank {rank} {:.1} %", 100.0 * f))
            .collect();
        out += &format!(
            "collectives  {} of each rank's list time (gathers, reductions)\n",
            shares.join(", ")
        );
        out += &format!("transports   {}\n", self.transports);
        out += &format!(
            "param norm   {:.4} (L2 over all parameters)\n",
            self.param_l2_norm
        );
        out += &format!(
            "wrote        {}, {}, {}\n",
            self.metrics.display(),
            self.files.svg.display(),
            self.files.trace.display()
        );
        out
    }
}

/// Each rank's peak resident memory in MiB, folded into one figure where every rank shares a
/// process (threads), or "not reported" where the system does not say.
pub fn rss_text(peaks: &[Option<u64>]) -> String {
    let mib = |b: u64| format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0));
    match peaks.first() {
        None | Some(None) => "not reported by this system".into(),
        Some(Some(first)) if peaks.iter().all(|p| *p == Some(*first)) => {
            format!("{} resident at peak (every rank)", mib(*first))
        }
        _ => peaks
            .iter()
            .enumerate()
            .map(|(rank, p)| match p {
                Some(b) => format!("rank {rank} {}", mib(*b)),
                None => format!("rank {rank} ?"),
            })
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// The end of a run on standard output: the summary as text or JSON, with the measured
/// beside the predicted figures when `--hardware` was given; nothing under `--quiet`.
pub fn render(
    args: &TrainArgs,
    summary: &Summary,
    prediction: Option<&Prediction>,
    devices: usize,
    tokens_per_step: usize,
) -> Option<String> {
    let measured = MeasuredStep {
        step_s: summary.steady_step_s(),
        devices,
    };
    if args.json {
        let mut doc = summary.json_value();
        if let (Some(p), Some(fields)) = (prediction, doc.as_object_mut()) {
            fields.insert("hardware".into(), p.json(measured));
        }
        Some(format!("{doc}\n"))
    } else if args.quiet {
        None
    } else {
        let mut text = summary.text();
        if let Some(p) = prediction {
            text += &p.text(measured, tokens_per_step);
        }
        Some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resuming_keeps_the_metrics_up_to_the_checkpoint_and_drops_the_rest() {
        let dir = std::env::temp_dir().join(format!("bfpp-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("writable");
        let path = dir.join(METRICS_FILE);
        // Steps 1 to 3 and a line cut short by a crash.
        std::fs::write(&path, "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"st").expect("write");
        let mut file = open_metrics(&path, 2).expect("opens");
        writeln!(file, "{{\"step\":3,\"new\":true}}").expect("append");
        drop(file);
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            text,
            "{\"step\":1}\n{\"step\":2}\n{\"step\":3,\"new\":true}\n"
        );
        // A missing file is started afresh; a fresh run truncates.
        std::fs::remove_file(&path).expect("remove");
        drop(open_metrics(&path, 5).expect("creates"));
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "");
        std::fs::write(&path, "{\"step\":1}\n").expect("write");
        drop(open_metrics(&path, 0).expect("truncates"));
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
