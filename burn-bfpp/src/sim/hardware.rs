//! What the model is trained on: compute peak and achieved efficiency, memory, and the links
//! between GPUs, with the time formulas for matrix multiplications, point-to-point transfers
//! and ring collectives.

use serde::{Deserialize, Serialize};

use super::SimError;

/// One GPU type and the node it sits in. Bandwidths are per GPU and per direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareConfig {
    /// A name for reports.
    #[serde(default)]
    pub name: String,
    /// Dense bf16 tensor-core peak, FLOP/s.
    pub peak_flops: f64,
    /// Fraction of the peak a large, compute-bound GEMM reaches (the roofline's flat part).
    pub gemm_efficiency: f64,
    /// HBM bandwidth, bytes/s (the roofline's slope, and the optimizer step's speed).
    pub hbm_bandwidth: f64,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// GPUs per node (sharing the intra-node fabric).
    pub gpus_per_node: usize,
    /// Intra-node (NVLink) bandwidth per GPU per direction, bytes/s.
    pub intra_node_bandwidth: f64,
    /// Intra-node per-message latency, seconds.
    pub intra_node_latency: f64,
    /// Inter-node (NIC) bandwidth per GPU per direction, bytes/s.
    pub inter_node_bandwidth: f64,
    /// Inter-node per-message latency, seconds.
    pub inter_node_latency: f64,
}

/// Names accepted by [`HardwareConfig::preset`].
pub const HARDWARE_PRESETS: [&str; 3] = ["a100-80gb", "h100-80gb", "h200-141gb"];

// Shared by the presets.
//
// Large-GEMM efficiency: about 790 TFLOP/s measured for a large bf16 GEMM on an H200 against
// its 989 TFLOP/s dense peak (figure recorded in the project's reference notes) → 0.80.
const HOPPER_GEMM_EFFICIENCY: f64 = 790.0 / 989.0;
// Latency of one ring step, NCCL's own cost model (src/graph/tuning.cc, `hwLat`, Ring/Simple):
// 5.7 µs over NVLink, 6.6 µs over the network.
const NVLINK_LATENCY: f64 = 5.7e-6;
const NET_LATENCY: f64 = 6.6e-6;

impl HardwareConfig {
    /// A built-in GPU/node type. The error lists the valid names.
    pub fn preset(name: &str) -> Result<Self, SimError> {
        match name {
            "a100-80gb" => Ok(HardwareConfig {
                name: name.into(),
                // NVIDIA A100 datasheet: 312 TFLOP/s dense BF16 tensor core.
                peak_flops: 312e12,
                // No A100 GEMM measurement is at hand: assume the same fraction of peak as the
                // H200 measurement (same cuBLAS generation of kernels). Replace when measured.
                gemm_efficiency: HOPPER_GEMM_EFFICIENCY,
                // NVIDIA A100 80GB SXM datasheet: 2 039 GB/s HBM2e.
                hbm_bandwidth: 2039e9,
                // Datasheet: 80 GB.
                memory_bytes: 80_000_000_000,
                // DGX A100: 8 GPUs per node.
                gpus_per_node: 8,
                // Datasheet: NVLink 600 GB/s total, i.e. 300 GB/s per direction.
                intra_node_bandwidth: 300e9,
                intra_node_latency: NVLINK_LATENCY,
                // DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s per direction.
                inter_node_bandwidth: 25e9,
                inter_node_latency: NET_LATENCY,
            }),
            "h100-80gb" => Ok(HardwareConfig {
                name: name.into(),
                // NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16 (1 979 with sparsity).
                peak_flops: 989e12,
                // Same GH100 compute as the H200 on which the GEMM was measured.
                gemm_efficiency: HOPPER_GEMM_EFFICIENCY,
                // H100 SXM datasheet: 3.35 TB/s HBM3.
                hbm_bandwidth: 3.35e12,
                // Datasheet: 80 GB.
                memory_bytes: 80_000_000_000,
                // DGX H100: 8 GPUs per node.
                gpus_per_node: 8,
                // Datasheet: NVLink 900 GB/s total, 450 GB/s per direction.
                intra_node_bandwidth: 450e9,
                intra_node_latency: NVLINK_LATENCY,
                // DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s per direction.
                inter_node_bandwidth: 50e9,
                inter_node_latency: NET_LATENCY,
            }),
            "h200-141gb" => Ok(HardwareConfig {
                name: name.into(),
                // NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16.
                peak_flops: 989e12,
                // Measured: ~790 TFLOP/s for a large bf16 GEMM (see HOPPER_GEMM_EFFICIENCY).
                gemm_efficiency: HOPPER_GEMM_EFFICIENCY,
                // H200 SXM datasheet: 4.8 TB/s HBM3e.
                hbm_bandwidth: 4.8e12,
                // Datasheet: 141 GB.
                memory_bytes: 141_000_000_000,
                // DGX H200: 8 GPUs per node.
                gpus_per_node: 8,
                // Datasheet: NVLink 900 GB/s total, 450 GB/s per direction.
                intra_node_bandwidth: 450e9,
                intra_node_latency: NVLINK_LATENCY,
                // DGX H200: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s per direction.
                inter_node_bandwidth: 50e9,
                inter_node_latency: NET_LATENCY,
            }),
            other => Err(SimError::UnknownPreset {
                what: "hardware",
                name: other.to_string(),
                valid: HARDWARE_PRESETS.join(", "),
            }),
        }
    }

    /// The preset describing a GPU that `nvidia-smi --query-gpu=name` calls `gpu_name`, if one
    /// does. The presets hold the SXM parts' figures; the PCIe and NVL boards and the GH200
    /// carry the same chips at lower clocks, power or bandwidth, so they match no preset rather
    /// than borrow figures that would overstate their peak (and understate MFU).
    pub fn preset_for_gpu_name(gpu_name: &str) -> Option<&'static str> {
        let name = gpu_name.to_ascii_uppercase();
        if ["PCIE", "NVL", "GH200"].iter().any(|v| name.contains(v)) {
            return None;
        }
        if name.contains("H200") {
            Some("h200-141gb")
        } else if name.contains("H100") {
            Some("h100-80gb")
        } else if name.contains("A100") && name.contains("80GB") {
            Some("a100-80gb")
        } else {
            None
        }
    }

    /// Parse a hardware description from TOML (every field but `name` required).
    pub fn from_toml_str(text: &str) -> Result<Self, SimError> {
        let hw: HardwareConfig = toml::from_str(text)?;
        hw.check()?;
        Ok(hw)
    }

    /// Reject non-positive rates and sizes.
    pub fn check(&self) -> Result<(), SimError> {
        let positive = [
            ("peak_flops", self.peak_flops),
            ("hbm_bandwidth", self.hbm_bandwidth),
            ("intra_node_bandwidth", self.intra_node_bandwidth),
            ("inter_node_bandwidth", self.inter_node_bandwidth),
        ];
        for (field, v) in positive {
            if !(v > 0.0 && v.is_finite()) {
                return Err(SimError::Config(format!(
                    "hardware {field} must be positive and finite (got {v})"
                )));
            }
        }
        if !(self.gemm_efficiency > 0.0 && self.gemm_efficiency <= 1.0) {
            return Err(SimError::Config(format!(
                "hardware gemm_efficiency is a fraction of peak in (0, 1] (got {})",
                self.gemm_efficiency
            )));
        }
        for (field, v) in [
            ("intra_node_latency", self.intra_node_latency),
            ("inter_node_latency", self.inter_node_latency),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(SimError::Config(format!(
                    "hardware {field} must be zero or positive (got {v})"
                )));
            }
        }
        if self.gpus_per_node == 0 || self.memory_bytes == 0 {
            return Err(SimError::Config(
                "hardware gpus_per_node and memory_bytes must be positive".into(),
            ));
        }
        Ok(())
    }

    /// Time of a batched `m×k · k×n` matrix multiplication with `elem` bytes per element, by
    /// the roofline model (Williams et al. 2009): the larger of its FLOPs at the efficient
    /// peak and its minimal HBM traffic (read both inputs, write the output once) at the HBM
    /// bandwidth. So efficiency falls for small or skinny matrices, with no fitted constant.
    pub fn gemm_time(&self, (m, n, k, batch): (usize, usize, usize, usize), elem: u64) -> f64 {
        let (m, n, k, batch) = (m as f64, n as f64, k as f64, batch as f64);
        let flops = 2.0 * m * n * k * batch;
        let bytes = (m * k + k * n + m * n) * batch * elem as f64;
        (flops / (self.peak_flops * self.gemm_efficiency)).max(bytes / self.hbm_bandwidth)
    }

    /// Bandwidth and latency of the link class: intra-node when `same_node`.
    pub fn link(&self, same_node: bool) -> (f64, f64) {
        if same_node {
            (self.intra_node_bandwidth, self.intra_node_latency)
        } else {
            (self.inter_node_bandwidth, self.inter_node_latency)
        }
    }

    /// A point-to-point message of `bytes`: latency + bytes / bandwidth.
    pub fn p2p_time(&self, bytes: f64, same_node: bool) -> f64 {
        let (bw, lat) = self.link(same_node);
        lat + bytes / bw
    }

    /// A bandwidth-optimal collective in which each member sends `bytes` in total (see
    /// [`super::collective_bytes`]) over `steps` rounds, each paying the link's latency: a ring
    /// over n members takes n − 1 steps for an all-gather or a reduce-scatter, twice that for
    /// an all-reduce.
    pub fn collective_time(&self, bytes: u64, steps: usize, same_node: bool) -> f64 {
        if steps == 0 {
            return 0.0;
        }
        let (bw, lat) = self.link(same_node);
        steps as f64 * lat + bytes as f64 / bw
    }

    /// Ring all-gather (or reduce-scatter: same traffic) of a `bytes`-sized full buffer over
    /// `n` ranks: n − 1 steps, each moving one 1/n chunk over the slowest link of the ring
    /// (Patarasuk & Yuan 2009; NCCL's ring algorithm). Zero for n = 1.
    pub fn ring_gather_time(&self, bytes: f64, n: usize, same_node: bool) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let (bw, lat) = self.link(same_node);
        (n - 1) as f64 * (lat + bytes / n as f64 / bw)
    }

    /// Ring all-reduce: a reduce-scatter followed by an all-gather, twice the ring gather.
    pub fn ring_all_reduce_time(&self, bytes: f64, n: usize, same_node: bool) -> f64 {
        2.0 * self.ring_gather_time(bytes, n, same_node)
    }
}
