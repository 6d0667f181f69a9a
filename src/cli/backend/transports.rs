//! What carries each kind of a run's traffic ([`Transports`], the summary's `transports` line),
//! and for CUDA ranks that are threads, whether NCCL can carry it.

use burn_bfpp::comm::RankGrid;

/// Between thread ranks of one process: tensors change hands without a copy.
pub const IN_PROCESS: &str = "memory of this process (threads)";
/// Between thread ranks on a GPU through the host collectives.
#[cfg(any(feature = "wgpu", feature = "cuda", test))]
pub const THROUGH_HOST: &str = "host memory (read off the device, combined on the CPU)";

/// What carried each kind of a run's traffic, for the summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transports {
    /// Activations and their gradients between the stages of a pipeline.
    pub pipeline: String,
    /// Gradient reductions and weight gathers between data-parallel replicas.
    pub data_parallel: String,
    /// Anything else the user should know: why a faster transport was not taken, or what
    /// carries the control messages.
    pub detail: Option<String>,
}

impl Transports {
    /// Pipeline traffic on `pipeline` and data-parallel traffic on `data_parallel`, each
    /// "none" where the layout has no such traffic (pp 1, dp 1).
    pub fn new(grid: RankGrid, pipeline: &str, data_parallel: &str) -> Self {
        let carrier = |size: usize, what: &str, flag: &str| match size {
            1 => format!("none ({flag} 1)"),
            _ => what.to_string(),
        };
        Self {
            pipeline: carrier(grid.pp(), pipeline, "pp"),
            data_parallel: carrier(grid.dp(), data_parallel, "dp"),
            detail: None,
        }
    }

    /// The same with `detail` added.
    pub fn with_detail(mut self, detail: Option<String>) -> Self {
        self.detail = detail;
        self
    }

    /// The summary's line (without its label).
    pub fn text(&self) -> String {
        let mut text = format!(
            "pipeline: {}; data parallel: {}",
            self.pipeline, self.data_parallel
        );
        if let Some(detail) = &self.detail {
            text += &format!(" ({detail})");
        }
        text
    }
}

/// The GPU of world rank `rank` when thread ranks are spread over `gpus` GPUs.
#[cfg(any(feature = "cuda", test))]
fn gpu_of(rank: usize, gpus: usize) -> usize {
    rank % gpus.max(1)
}

/// Whether the given ranks are on pairwise different GPUs.
#[cfg(any(feature = "cuda", test))]
fn on_distinct_gpus(ranks: impl Iterator<Item = usize>, gpus: usize) -> bool {
    let mut seen = Vec::new();
    for gpu in ranks.map(|r| gpu_of(r, gpus)) {
        if seen.contains(&gpu) {
            return false;
        }
        seen.push(gpu);
    }
    true
}

/// Whether the pipeline groups span distinct GPUs, so NCCL carries their transfers (a group
/// sharing a GPU hands tensors over instead). Rank `r` on GPU `r % gpus` puts a pipeline's
/// consecutive ranks on distinct GPUs exactly when `pp <= gpus`, for every replica alike.
#[cfg(any(feature = "cuda", test))]
fn pipelines_on_nccl(grid: RankGrid, gpus: usize) -> bool {
    (0..grid.dp()).all(|d| on_distinct_gpus((0..grid.pp()).map(|p| grid.rank_of(p, d)), gpus))
}

/// Why NCCL cannot carry the traffic of thread ranks spread over `gpus` GPUs, or `None`
/// when it can: NCCL refuses two members of one communicator on one GPU, so every
/// data-parallel group must span distinct GPUs, and with every rank on one GPU there is
/// nothing for it to carry.
#[cfg(any(feature = "cuda", test))]
pub fn nccl_cannot_carry(grid: RankGrid, gpus: usize) -> Option<String> {
    if grid.world_size() == 1 {
        return Some("one rank: no traffic between ranks".into());
    }
    let dp_distinct =
        (0..grid.pp()).all(|p| on_distinct_gpus((0..grid.dp()).map(|d| grid.rank_of(p, d)), gpus));
    if !dp_distinct {
        return Some(format!(
            "NCCL needs each data-parallel group's {} ranks on distinct GPUs; --gpus {gpus} \
             puts some on one GPU (give --gpus a multiple of dp)",
            grid.dp()
        ));
    }
    let any_nccl_pipeline = grid.pp() > 1 && pipelines_on_nccl(grid, gpus);
    if grid.dp() == 1 && !any_nccl_pipeline {
        return Some(format!(
            "every rank on one GPU: nothing for NCCL to carry (--gpus {gpus})"
        ));
    }
    None
}

/// The transports of CUDA thread ranks on NCCL: data-parallel collectives on NCCL; pipeline
/// transfers on NCCL where each pipeline spans distinct GPUs, handed over on the GPU where
/// its stages share one.
#[cfg(any(feature = "cuda", test))]
pub fn nccl_thread_transports(grid: RankGrid, gpus: usize) -> Transports {
    let pipeline = if pipelines_on_nccl(grid, gpus) {
        "NCCL (point to point, device buffers)"
    } else {
        "handed over on the GPU (a pipeline's stages share GPUs)"
    };
    Transports::new(grid, pipeline, "NCCL (device buffers)")
}
