//! Starting a run from the weights of a safetensors file (or a Hugging Face sharded set of
//! them) by name, stage by stage: each rank reads only its own stages' tensors.
//!
//! safetensors puts every tensor's byte range in the file's header, and burn-store maps the
//! file rather than reading it, so a tensor is read without the others: a rank of a model
//! larger than one process's memory loads its share and nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn_store::{ModuleStore, SafetensorsStore};
use serde::Deserialize;

use super::CheckpointError;
use crate::model::{fill_params, ModelDescription, ModelError, PipelineStage};

/// The index file of a sharded safetensors set, as Hugging Face writes it:
/// `{"metadata": {...}, "weight_map": {"tensor name": "file name", ...}}`.
#[derive(Debug, Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// Where every tensor of a weight file set lives.
#[derive(Debug, Clone)]
struct WeightFiles {
    /// The file named on the command line (a `.safetensors` file or an index).
    given: PathBuf,
    /// Tensor name → the safetensors file holding it.
    location: BTreeMap<String, PathBuf>,
    /// Tensor name → shape, from the files' headers.
    shapes: BTreeMap<String, Vec<usize>>,
}

fn unreadable(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.to_path_buf(),
        problem: format!("not a readable safetensors file: {e}"),
    }
}

/// Opens `path`: a missing file is reported as missing, not as corrupt.
fn must_exist(path: &Path) -> Result<(), CheckpointError> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(source) => Err(CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

impl WeightFiles {
    /// Reads the headers of `path` (a `.safetensors` file, or an index ending in `.json`
    /// naming the files beside it); no tensor data is read.
    fn open(path: &Path) -> Result<Self, CheckpointError> {
        must_exist(path)?;
        let is_index = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let mut location = BTreeMap::new();
        if is_index {
            let text = std::fs::read_to_string(path).map_err(|source| CheckpointError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            let index: ShardIndex =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
                    path: path.to_path_buf(),
                    problem: format!(
                        "not a sharded safetensors index (`{{\"weight_map\": {{name: file}}}}`): \
                         {e}"
                    ),
                })?;
            let dir = path.parent().unwrap_or(Path::new("."));
            for (name, file) in index.weight_map {
                location.insert(name, dir.join(file));
            }
        }
        let files: BTreeSet<PathBuf> = if is_index {
            location.values().cloned().collect()
        } else {
            [path.to_path_buf()].into()
        };
        let mut shapes = BTreeMap::new();
        for file in &files {
            must_exist(file)?;
            let mut store = SafetensorsStore::from_file(file);
            let snapshots = store.get_all_snapshots().map_err(|e| unreadable(file, e))?;
            for (name, snapshot) in snapshots {
                if is_index && location.get(name) != Some(file) {
                    // Listed under another file (or not at all): the index decides.
                    continue;
                }
                location.insert(name.clone(), file.clone());
                shapes.insert(name.clone(), snapshot.shape.to_vec());
            }
        }
        if let Some((name, file)) = location.iter().find(|(n, _)| !shapes.contains_key(*n)) {
            return Err(CheckpointError::Corrupt {
                path: path.to_path_buf(),
                problem: format!(
                    "the index places tensor `{name}` in `{}`, which does not hold it",
                    file.display()
                ),
            });
        }
        Ok(WeightFiles {
            given: path.to_path_buf(),
            location,
            shapes,
        })
    }
}

/// A description whose stages start from the weights of a file rather than from its seeded
/// draw: a safetensors file of the whole model, tensors named by the whole model's module
/// paths (what `bfpp export` and burn-store write), or the index of a sharded set
/// (`model.safetensors.index.json`). Each stage reads only its own tensors
/// ([`PipelineStage::param_paths`]), built on a lazy skeleton so nothing is drawn first.
///
/// [`SafetensorsInit::open`] checks, before any stage is built, that the file set holds
/// exactly the model's tensors with the model's shapes; a stage that then finds a tensor
/// missing names it and the file.
#[derive(Debug, Clone)]
pub struct SafetensorsInit<M> {
    model: M,
    files: WeightFiles,
}

impl<M> SafetensorsInit<M> {
    /// `model` started from the weights of `path`, refused (naming the first offending
    /// tensor, then `fix`: what the caller's user changes to match the file) unless the files
    /// hold exactly `names` (the whole model's parameter paths and shapes, e.g.
    /// [`crate::model::named_param_shapes`] of a lazily built model).
    pub fn open(
        model: M,
        path: &Path,
        names: &[(String, Vec<usize>)],
        fix: &str,
    ) -> Result<Self, CheckpointError> {
        let files = WeightFiles::open(path)?;
        let other = |problem: String| CheckpointError::OtherModel {
            path: path.to_path_buf(),
            problem: format!("{problem}; {fix}"),
        };
        for (name, shape) in names {
            match files.shapes.get(name) {
                None => {
                    let missing = names
                        .iter()
                        .filter(|(n, _)| !files.shapes.contains_key(n))
                        .count();
                    return Err(other(format!(
                        "tensor `{name}` of this model is missing from the file ({missing} of \
                         {} missing)",
                        names.len()
                    )));
                }
                Some(found) if found != shape => {
                    return Err(other(format!(
                        "tensor `{name}` has shape {found:?} but this model's is {shape:?}"
                    )))
                }
                Some(_) => {}
            }
        }
        let known: BTreeSet<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&String> = files
            .shapes
            .keys()
            .filter(|n| !known.contains(n.as_str()))
            .collect();
        if let Some(first) = extra.first() {
            return Err(other(format!(
                "the file's tensor `{first}` is not in this model ({} such)",
                extra.len()
            )));
        }
        Ok(SafetensorsInit { model, files })
    }

    /// The file the weights come from.
    pub fn path(&self) -> &Path {
        &self.files.given
    }
}

impl<B: Backend, M: ModelDescription<B>> ModelDescription<B> for SafetensorsInit<M> {
    type Stage = M::Stage;

    fn num_layers(&self) -> usize {
        self.model.num_layers()
    }

    fn layer_costs(&self) -> Vec<f64> {
        self.model.layer_costs()
    }

    fn build_stage(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError> {
        let skeleton = self.model.stage_skeleton(layers, device)?;
        let names = skeleton.param_paths()?;
        // One store per file, each mapped once for the stage; tensors are read one at a time.
        let mut stores: BTreeMap<PathBuf, SafetensorsStore> = BTreeMap::new();
        let mut names = names.into_iter();
        let given = self.files.given.clone();
        fill_params(skeleton, || {
            let name = names.next()?;
            let mut read = || -> Result<_, ModelError> {
                let file = self.files.location.get(&name).ok_or_else(|| {
                    ModelError::Params(format!(
                        "`{}` has no tensor `{name}`, which this rank's stage needs",
                        given.display()
                    ))
                })?;
                let store = stores
                    .entry(file.clone())
                    .or_insert_with(|| SafetensorsStore::from_file(file));
                let failed = |e: String| ModelError::Params(format!("`{}`: {e}", file.display()));
                let snapshot = store
                    .get_snapshot(&name)
                    .map_err(|e| failed(e.to_string()))?
                    .ok_or_else(|| failed(format!("no tensor `{name}`")))?;
                let data = snapshot
                    .to_data()
                    .map_err(|e| failed(format!("tensor `{name}`: {e:?}")))?;
                Ok(vec![data.convert::<f32>()])
            };
            Some(read())
        })
    }

    fn stage_skeleton(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError> {
        self.model.stage_skeleton(layers, device)
    }
}
