//! `bfpp train --hardware NAME`: the measured run beside the simulator's prediction for the
//! same model and layout on that hardware, one GPU per rank, and the run's model FLOP
//! utilisation (MFU) against the hardware's peak.

use burn_bfpp::data::BatchLayout;
use burn_bfpp::engine::{Precision, TrainConfig};
use burn_bfpp::model::GptConfig;
use burn_bfpp::sim::{
    simulate, Dtype, GptShape, HardwareConfig, ModelConfig, SimConfig, SimResult,
};
use serde_json::json;

use super::backend::BackendChoice;
use super::error::TrainError;

/// The simulator's shape of `model`: what the model FLOPs of a step are counted on, for the
/// measured and the predicted MFU alike.
pub fn gpt_shape(model: &GptConfig) -> GptShape {
    GptShape {
        layers: model.layers,
        hidden: model.hidden,
        heads: model.heads,
        sequence: model.seq_len,
        vocabulary: model.vocab_size,
    }
}

/// The hardware preset `--hardware auto` stands for: GPU 0's as `nvidia-smi` names it under
/// `--backend cuda`. Elsewhere, or for a GPU no preset describes, the H200's, with a warning
/// saying so (an MFU against an assumed peak is never reported silently).
pub fn resolve_hardware(name: &str, backend: BackendChoice) -> String {
    const FALLBACK: &str = "h200-141gb";
    if name != "auto" {
        return name.to_string();
    }
    let gpu = if backend == BackendChoice::Cuda {
        match std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader", "-i", "0"])
            .output()
        {
            Ok(out) if out.status.success() => {
                String::from_utf8_lossy(&out.stdout).trim().to_string()
            }
            Ok(out) => format!(
                "unknown (nvidia-smi: {})",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => format!("unknown (nvidia-smi: {e})"),
        }
    } else {
        format!("none (--backend {})", backend.name())
    };
    match HardwareConfig::preset_for_gpu_name(&gpu) {
        Some(preset) => preset.to_string(),
        None => {
            eprintln!(
                "warning: --hardware auto: no hardware preset describes GPU {gpu}; predicting \
                 {FALLBACK} and taking its peak for MFU (name a preset to choose)"
            );
            FALLBACK.to_string()
        }
    }
}

/// The simulator's view of a run, made before it trains.
#[derive(Debug, Clone)]
pub struct Prediction {
    /// The hardware preset predicted on.
    pub hardware: String,
    /// Its dense peak, TFLOP/s: the denominator of MFU.
    pub peak_tflops: f64,
    /// Model FLOPs of one optimizer step (the simulator's formula).
    pub step_flops: f64,
    /// The simulated step.
    pub result: SimResult,
}

/// Simulates one step of `train`'s layout with `model` on `hardware` (a preset name), one
/// device per rank. A layout the simulator cannot cost is refused before training.
pub fn predict(
    model: &GptConfig,
    train: &TrainConfig,
    layout: &BatchLayout,
    hardware: &str,
) -> Result<Prediction, TrainError> {
    let hw = HardwareConfig::preset(hardware)?;
    let shape = gpt_shape(model);
    let program = train.program()?;
    let mut sim = SimConfig::new(ModelConfig::Gpt(shape.clone()), hw.clone());
    sim.dp = train.dp;
    sim.micro_batch_size = layout.micro_batch_size;
    sim.zero = train.zero;
    sim.recompute = train.recompute;
    sim.grad_buffers = train.buffers;
    sim.dtype = match train.precision {
        Precision::Fp32 => Dtype::Fp32,
        Precision::Bf16 => Dtype::Bf16,
        Precision::F16 => Dtype::Fp16,
    };
    let result = simulate(&program, &sim)?;
    Ok(Prediction {
        hardware: hardware.to_string(),
        peak_tflops: hw.peak_flops / 1e12,
        step_flops: shape.step_model_flops(layout.global_batch()),
        result,
    })
}

/// The measured figures set against a [`Prediction`].
#[derive(Debug, Clone, Copy)]
pub struct MeasuredStep {
    /// Seconds of a steady step (the median after the first).
    pub step_s: f64,
    /// Devices the ranks computed on.
    pub devices: usize,
}

impl Prediction {
    /// Model TFLOP/s per device and MFU of a measured step.
    pub fn utilisation(&self, measured: MeasuredStep) -> (f64, f64) {
        let tflops = self.step_flops / measured.step_s / 1e12 / measured.devices.max(1) as f64;
        (tflops, tflops / self.peak_tflops)
    }

    /// The `--json` object: measured MFU and the prediction.
    pub fn json(&self, measured: MeasuredStep) -> serde_json::Value {
        let (tflops, mfu) = self.utilisation(measured);
        json!({
            "hardware": self.hardware,
            "peak_tflops": self.peak_tflops,
            "model_flops_per_step": self.step_flops,
            "measured": {
                "step_s": measured.step_s,
                "devices": measured.devices,
                "tflops_per_device": tflops,
                "mfu": mfu,
            },
            "predicted": {
                "step_s": self.result.step_time_s,
                "tokens_per_s": self.result.tokens_per_s,
                "tflops_per_gpu": self.result.tflops_per_gpu,
                "mfu": self.result.mfu,
                "bubble_fraction": self.result.bubble_fraction,
            },
        })
    }

    /// The table of measured beside predicted figures.
    pub fn text(&self, measured: MeasuredStep, tokens_per_step: usize) -> String {
        let (tflops, mfu) = self.utilisation(measured);
        let p = &self.result;
        let mut out = format!(
            "{:<13}{:>14} {:>28}\n",
            "",
            "measured",
            format!("simulated ({}/rank)", self.hardware)
        );
        out += &format!(
            "{:<13}{:>14.4} {:>28.4}\n",
            "step (s)", measured.step_s, p.step_time_s
        );
        out += &format!(
            "{:<13}{:>14.0} {:>28.0}\n",
            "tokens/s",
            tokens_per_step as f64 / measured.step_s,
            p.tokens_per_s
        );
        out += &format!(
            "{:<13}{:>14.3} {:>28.3}\n",
            "TFLOP/s/dev", tflops, p.tflops_per_gpu
        );
        out += &format!(
            "{:<13}{:>13.2}% {:>27.2}%\n",
            "MFU",
            100.0 * mfu,
            100.0 * p.mfu
        );
        out += &format!(
            "(measured on {} device(s), MFU against {:.0} TFLOP/s)\n",
            measured.devices, self.peak_tflops
        );
        out
    }
}
