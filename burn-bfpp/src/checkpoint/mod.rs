//! Checkpoints: crash-safe saving of every rank's shards and optimizer state, verified
//! loading, and resharding to any other layout (P, V, D, ZeRO, split).
//!
//! See `docs/checkpoints.md` for the file layout and the guarantees. The engine knows nothing
//! about files: it hands each rank's [`RankState`] to a [`CheckpointSink`] ([`DirSink`] here)
//! and starts from resharded states ([`resume_states`]).

mod export;
mod format;
mod init;
mod reader;
mod reshard;
mod store;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;

pub use export::{export_safetensors, Sharding};
pub use format::{
    rank_file_name, FileEntry, Manifest, ParamEntry, SavedLayout, SavedStage, FORMAT_VERSION,
    MANIFEST,
};
pub use init::SafetensorsInit;
pub use reader::{CheckpointReader, DirResume, Vector};
pub use reshard::{check_model, consolidate, param_entries, shard_for, stage_numels, GlobalState};
pub use store::{
    list_checkpoints, load, resolve, step_dir_name, DataAt, DirSink, Loaded, CRASH_ENV,
};

use crate::engine::{RankState, TrainConfig};
use crate::model::{ModelError, PipelineModel};
use crate::schedule::PipelineSchedule;

#[cfg(doc)]
use crate::engine::CheckpointSink;

/// Everything that can go wrong saving or loading a checkpoint; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing a file failed.
    #[error("`{}`: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// No complete checkpoint at the path.
    #[error(
        "`{}` is neither a checkpoint directory (with {MANIFEST}) nor a run directory holding \
         a complete one",
        .0.display()
    )]
    NotFound(PathBuf),
    /// A rank file the manifest lists (or the layout needs) is missing.
    #[error("`{}` is missing; the checkpoint is incomplete and was not loaded", .0.display())]
    MissingFile(PathBuf),
    /// A file does not hold what the manifest says.
    #[error("`{}` is corrupt: {problem}; the checkpoint was not loaded", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// The checkpoint belongs to another model.
    #[error("`{}` is from another model: {problem}", path.display())]
    OtherModel {
        /// The manifest.
        path: PathBuf,
        /// What differs.
        problem: String,
    },
    /// A save would replace a complete checkpoint.
    #[error(
        "`{}` already holds a complete checkpoint; save into another directory or remove it",
        .0.display()
    )]
    WouldOverwrite(PathBuf),
    /// The checkpoint does not fit the requested layout or run.
    #[error("{0}")]
    Mismatch(String),
    /// Serialising failed.
    #[error("cannot encode the checkpoint: {0}")]
    Encode(String),
    /// The model could not be split for the new layout.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// The manifest fields fixed for a whole run (the step-dependent ones are filled at save).
#[allow(clippy::too_many_arguments)]
pub fn manifest_template(
    cfg: &TrainConfig,
    program: &PipelineSchedule,
    stage_numels: &[usize],
    model: serde_json::Value,
    params: Vec<ParamEntry>,
    lr_schedule: serde_json::Value,
    seed: u64,
) -> Manifest {
    Manifest {
        format_version: FORMAT_VERSION,
        step: 0,
        layout: SavedLayout {
            pp: cfg.pp,
            loops: cfg.loops,
            dp: cfg.dp,
            zero: cfg.zero.number(),
            schedule: format!("{:?}", cfg.schedule),
            stages: stage_numels
                .iter()
                .zip(&program.stage_ranks)
                .map(|(&numel, &pp_rank)| SavedStage { numel, pp_rank })
                .collect(),
        },
        model,
        params,
        optimizer_steps: 0,
        lr_schedule,
        data: None,
        seed,
        files: Vec::new(),
    }
}

/// Verify that `loaded` belongs to `model` (configuration `model_json`) and reshard it for
/// the layout `cfg`/`program`: the states to start every rank from, and the consolidated
/// state (whose `params` can be loaded into the model with [`crate::model::load_flat`]).
pub fn resume_states<B, M>(
    loaded: &Loaded,
    model: &M,
    model_json: &serde_json::Value,
    cfg: &TrainConfig,
    program: &PipelineSchedule,
) -> Result<(Vec<RankState>, GlobalState), CheckpointError>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
{
    check_model(
        &loaded.manifest,
        &loaded.dir,
        model_json,
        &param_entries(model),
    )?;
    let global = consolidate(loaded)?;
    let numels = stage_numels(model, cfg, program)?;
    let states = shard_for(&global, &numels, &program.stage_ranks, cfg)?;
    Ok((states, global))
}
