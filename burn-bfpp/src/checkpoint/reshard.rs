//! Resharding: from the shards of one layout to the shards of another.
//!
//! A stage's full flat vector is the concatenation of its data-parallel ranks' owned shards
//! (one copy at ZeRO-0) minus the padding; the model's global flat vector is the
//! concatenation of the stage vectors in stage order, which is the whole model's own
//! flattening order because stages are consecutive layer ranges (a test checks it). A new
//! layout cuts that vector at its own stage boundaries and shards each stage with its own
//! [`ShardLayout`]. AdamW moments are elementwise, so they are resharded exactly like the
//! weights; the padding gets zeros, which AdamW keeps at zero.

use std::collections::HashMap;

use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::format::{Manifest, ParamEntry, MANIFEST};
use super::store::Loaded;
use super::CheckpointError;
use crate::comm::RankGrid;
use crate::engine::{RankState, ScalerState, ShardLayout, StageState, TrainConfig};
use crate::model::{named_param_shapes, param_shapes, split_model, PipelineModel};
use crate::schedule::PipelineSchedule;

/// The consolidated (layout-free) training state of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalState {
    /// Steps completed.
    pub step: usize,
    /// Every parameter value, in the model's global flattening order.
    pub params: Vec<f32>,
    /// AdamW first moment, same order.
    pub moment_1: Vec<f32>,
    /// AdamW second moment, same order.
    pub moment_2: Vec<f32>,
    /// AdamW steps taken.
    pub optimizer_steps: usize,
    /// The f16 loss scale, the same on every rank (world rank 0's file is read for it).
    pub scaler: Option<ScalerState>,
}

/// Put a checkpoint's shards back together into the model's global vectors.
pub fn consolidate(loaded: &Loaded) -> Result<GlobalState, CheckpointError> {
    let manifest = &loaded.manifest;
    let corrupt = |problem: String| CheckpointError::Corrupt {
        path: loaded.dir.join(MANIFEST),
        problem,
    };
    // Every (stage, dp_index) shard, from whichever file holds it.
    let mut shards: HashMap<(usize, usize), &StageState> = HashMap::new();
    for rank in &loaded.ranks {
        for s in &rank.stages {
            shards.insert((s.stage, s.layout.dp_index), s);
        }
    }
    let numel = manifest.numel();
    let mut g = GlobalState {
        step: manifest.step,
        params: Vec::with_capacity(numel),
        moment_1: Vec::with_capacity(numel),
        moment_2: Vec::with_capacity(numel),
        optimizer_steps: manifest.optimizer_steps,
        scaler: loaded.ranks.first().and_then(|r| r.scaler),
    };
    for (index, saved) in manifest.layout.stages.iter().enumerate() {
        let first = shards
            .get(&(index, 0))
            .ok_or_else(|| corrupt(format!("no rank file holds stage {index}")))?;
        let parts: Vec<&StageState> = if first.layout.sharded {
            (0..first.layout.dp)
                .map(|d| {
                    shards.get(&(index, d)).copied().ok_or_else(|| {
                        corrupt(format!("no rank file holds shard {d} of stage {index}"))
                    })
                })
                .collect::<Result<_, _>>()?
        } else {
            vec![*first]
        };
        if first.layout.numel != saved.numel {
            return Err(corrupt(format!(
                "stage {index} has {} values in its rank files and {} in the manifest",
                first.layout.numel, saved.numel
            )));
        }
        for p in &parts {
            if p.optimizer_steps != manifest.optimizer_steps {
                return Err(corrupt(format!(
                    "stage {index} shard {} took {} optimizer steps, the manifest says {}",
                    p.layout.dp_index, p.optimizer_steps, manifest.optimizer_steps
                )));
            }
        }
        let join = |pick: fn(&StageState) -> &Vec<f32>| -> Vec<f32> {
            let mut v: Vec<f32> = parts.iter().flat_map(|p| pick(p).iter().copied()).collect();
            v.truncate(saved.numel);
            v
        };
        g.params.extend(join(|s| &s.owned));
        g.moment_1.extend(join(|s| &s.moment_1));
        g.moment_2.extend(join(|s| &s.moment_2));
    }
    Ok(g)
}

/// Cut the global state into every world rank's stage states for a layout: `stage_numels`
/// per global stage, `stage_ranks` the pipeline rank of every stage, `cfg` the layout.
pub fn shard_for(
    global: &GlobalState,
    stage_numels: &[usize],
    stage_ranks: &[usize],
    cfg: &TrainConfig,
) -> Result<Vec<RankState>, CheckpointError> {
    let total: usize = stage_numels.iter().sum();
    if total != global.params.len() {
        return Err(CheckpointError::Mismatch(format!(
            "the new layout's stages hold {total} values, the checkpoint {}",
            global.params.len()
        )));
    }
    let offsets: Vec<usize> = stage_numels
        .iter()
        .scan(0, |acc, n| {
            let start = *acc;
            *acc += n;
            Some(start)
        })
        .collect();
    let grid =
        RankGrid::new(cfg.pp, cfg.dp).map_err(|e| CheckpointError::Mismatch(e.to_string()))?;
    let mut ranks = Vec::with_capacity(grid.world_size());
    // In world-rank order, whatever numbering the grid uses.
    for rank in 0..grid.world_size() {
        let (pp_index, dp_index) = (grid.pp_index(rank), grid.dp_index(rank));
        {
            let stages = (0..stage_numels.len())
                .filter(|&s| stage_ranks[s] == pp_index)
                .map(|s| {
                    let layout = ShardLayout::new(stage_numels[s], cfg.dp, dp_index, cfg.zero);
                    let cut = |v: &[f32]| {
                        let mut padded = v[offsets[s]..offsets[s] + stage_numels[s]].to_vec();
                        padded.resize(layout.padded, 0.0);
                        let start = layout.owned_offset();
                        padded[start..start + layout.owned_len()].to_vec()
                    };
                    StageState {
                        stage: s,
                        layout,
                        owned: cut(&global.params),
                        moment_1: cut(&global.moment_1),
                        moment_2: cut(&global.moment_2),
                        optimizer_steps: global.optimizer_steps,
                    }
                })
                .collect();
            ranks.push(RankState {
                step: global.step,
                stages,
                scaler: global.scaler,
            });
        }
    }
    Ok(ranks)
}

/// Parameter values per stage of `model` split for `program` under `cfg`.
pub fn stage_numels<B, M>(
    model: &M,
    cfg: &TrainConfig,
    program: &PipelineSchedule,
) -> Result<Vec<usize>, CheckpointError>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
{
    let ranges = split_model(model, program.num_stages(), &cfg.split)?;
    Ok(model
        .stages(&ranges)?
        .iter()
        .map(|s| {
            param_shapes(s)
                .iter()
                .map(|shape| shape.iter().product::<usize>())
                .sum()
        })
        .collect())
}

/// Names, shapes and dtypes of every float parameter of `module`, in flattening order.
pub fn param_entries<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamEntry> {
    named_param_shapes(module)
        .into_iter()
        .map(|(name, shape)| ParamEntry {
            name,
            shape,
            dtype: "f32".into(),
        })
        .collect()
}

/// Refuse a checkpoint of another model: its configuration or its parameters differ.
/// `manifest` is the checkpoint's, read from the step directory `dir`.
pub fn check_model(
    manifest: &Manifest,
    dir: &std::path::Path,
    model: &serde_json::Value,
    params: &[ParamEntry],
) -> Result<(), CheckpointError> {
    let path = dir.join(MANIFEST);
    if &manifest.model != model {
        return Err(CheckpointError::OtherModel {
            path,
            problem: format!(
                "it was saved for model {} but this run builds {}",
                manifest.model, model
            ),
        });
    }
    if manifest.params != params {
        let first = manifest
            .params
            .iter()
            .zip(params)
            .position(|(a, b)| a != b)
            .unwrap_or(manifest.params.len().min(params.len()));
        return Err(CheckpointError::OtherModel {
            path,
            problem: format!(
                "its parameter list differs from the model's at entry {first} ({} saved \
                 parameters, {} in the model)",
                manifest.params.len(),
                params.len()
            ),
        });
    }
    Ok(())
}
