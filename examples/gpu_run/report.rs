//! What `gpu_run` tells the user: which simulator preset stands for the GPU, how long a timed
//! step took, and the table of measured beside simulated figures. Kept apart from the training
//! set-up so each part stays readable.

use burn_bfpp::engine::TimedEvent;
use burn_bfpp::sim::{HardwareConfig, SimResult};

use crate::{BackendChoice, Error};

/// The preset `--hardware auto` stands for: GPU 0's, as `nvidia-smi` names it, on CUDA. The
/// fallback keeps the run going (its measured figures do not depend on it) and says what it
/// assumed, so an MFU against the wrong peak is never reported silently.
pub fn auto_hardware(backend: BackendChoice) -> String {
    const FALLBACK: &str = "h200-141gb";
    if backend != BackendChoice::Cuda {
        return FALLBACK.into();
    }
    let query = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "-i", "0"])
        .output();
    let gpu = match query {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_string(),
        Ok(out) => format!(
            "unknown (nvidia-smi: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => format!("unknown (nvidia-smi: {e})"),
    };
    match HardwareConfig::preset_for_gpu_name(&gpu) {
        Some(preset) => preset.into(),
        None => {
            eprintln!(
                "gpu_run: warning: no hardware preset describes GPU {gpu}; simulating \
                 {FALLBACK} and taking its peak for MFU. Pass --hardware and --peak-tflops to \
                 set them."
            );
            FALLBACK.into()
        }
    }
}

/// Mean seconds of the steps after the first `warmup` of `steps`. A step ends with its last
/// action on any rank, on the timelines' common time axis, so the mean covers every rank's work.
pub fn timed_step_seconds(
    timelines: &[Vec<TimedEvent>],
    steps: usize,
    warmup: usize,
) -> Result<f64, Error> {
    let mut ends = vec![0f64; steps];
    for event in timelines.iter().flatten() {
        if let Some(end) = event.step.checked_sub(1).and_then(|i| ends.get_mut(i)) {
            *end = end.max(event.end);
        }
    }
    let timed = steps.saturating_sub(warmup);
    if timed == 0 {
        return Err(format!("--warmup {warmup} leaves no timed step of --steps {steps}").into());
    }
    match (ends.get(warmup.wrapping_sub(1)), ends.last()) {
        (Some(start), Some(end)) if warmup > 0 => Ok((end - start) / timed as f64),
        (_, Some(end)) => Ok(end / timed as f64),
        _ => Err("no step reported its time".into()),
    }
}

/// Figures of the measured run, in the units of the simulator's `SimResult`.
pub struct Measured {
    /// Mean seconds of a timed step.
    pub step_s: f64,
    /// Tokens one step trains.
    pub tokens: f64,
    /// Model TFLOP/s per GPU the ranks ran on.
    pub tflops_per_gpu: f64,
    /// Peak TFLOP/s that MFU is measured against.
    pub peak_tflops: f64,
    /// Bubble of the last step: (step time − the busiest rank's compute) ÷ that compute, the
    /// simulator's definition, so it exceeds 1 where waits outlast the work (NaN when the
    /// profile could not be taken).
    pub bubble: f64,
}

/// Prints the measured figures beside the simulator's for the same layout, one row each.
pub fn print_comparison(measured: &Measured, predicted: &SimResult) {
    println!(
        "{:<28} {:>14} {:>22}",
        "", "measured", "simulated (1 GPU/rank)"
    );
    println!(
        "{:<28} {:>14.4} {:>22.4}",
        "step time (s)", measured.step_s, predicted.step_time_s
    );
    println!(
        "{:<28} {:>14.0} {:>22.0}",
        "tokens/s",
        measured.tokens / measured.step_s,
        predicted.tokens_per_s
    );
    println!(
        "{:<28} {:>14.4} {:>22.4}",
        "model TFLOP/s per GPU", measured.tflops_per_gpu, predicted.tflops_per_gpu
    );
    println!(
        "{:<28} {:>13.4}% {:>21.4}%",
        "MFU",
        100.0 * measured.tflops_per_gpu / measured.peak_tflops,
        100.0 * predicted.mfu
    );
    println!(
        "{:<28} {:>14.3} {:>22.3}",
        "bubble/compute (last step)", measured.bubble, predicted.bubble_fraction
    );
}
