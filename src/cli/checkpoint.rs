//! Checkpoint flags of `bfpp train` (`--save`, `--save-every`, `--keep`, `--resume`,
//! `--init`) and `bfpp export`.
//!
//! The library does the work (`burn_bfpp::checkpoint`); this file turns flags into a
//! [`DirSink`], resharded resume states, or a weight file of the plain model: a Burn record
//! (`.mpk`) or safetensors (`.safetensors`, through `burn-store`, keyed by module path).

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::{Tensor, TensorData};
use burn_bfpp::checkpoint::{
    self, export_safetensors, manifest_template, param_entries, stage_numels, CheckpointError,
    CheckpointReader, DirResume, DirSink, SafetensorsInit, Sharding, Vector,
};
use burn_bfpp::data::{Batcher, DataError};
use burn_bfpp::engine::TrainConfig;
use burn_bfpp::model::{
    load_flat, named_param_shapes, Gpt, GptConfig, GptDescription, GptStage, ModelDescription,
    ModelError, Whole,
};
use burn_bfpp::schedule::PipelineSchedule;

use clap::Args;

use super::backend::CliBackend;
use super::error::TrainError;

/// The backend `bfpp export` consolidates on: Burn's CPU backend.
type Backend = burn::backend::Autodiff<burn::backend::Flex>;

/// The checkpoint flags of `bfpp train`.
#[derive(Debug, Clone, Default, Args)]
pub struct CheckpointArgs {
    /// Write a checkpoint into this run directory at the end of the run (and with
    /// --save-every also in between); each is a `step-NNNNNNNN/` folder.
    #[arg(long, value_name = "DIR", help_heading = "Checkpoints")]
    pub save: Option<PathBuf>,
    /// Also save after every N-th step (needs --save).
    #[arg(
        long,
        value_name = "N",
        requires = "save",
        help_heading = "Checkpoints"
    )]
    pub save_every: Option<usize>,
    /// Keep only the newest K complete checkpoints (older ones are deleted after a new one
    /// is complete); default: keep all.
    #[arg(
        long,
        value_name = "K",
        requires = "save",
        help_heading = "Checkpoints"
    )]
    pub keep: Option<usize>,
    /// Continue from a checkpoint: a step directory, or a run directory (its newest complete
    /// checkpoint). Any layout may differ from the saved one; --steps counts total steps.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "init",
        help_heading = "Checkpoints"
    )]
    pub resume: Option<PathBuf>,
    /// Start from the weights of a file written by `bfpp export`: a Burn record (.mpk) or,
    /// by its extension, safetensors (.safetensors, or a sharded set's
    /// `.safetensors.index.json`) with the model's module paths as names; from safetensors
    /// each rank reads only its own stages' tensors.
    #[arg(long, value_name = "FILE", help_heading = "Checkpoints")]
    pub init: Option<PathBuf>,
}

/// What the checkpoint flags add to a run.
pub struct Prepared<'a, B: CliBackend> {
    /// The model to train, described: every rank builds its own stages from it.
    pub model: CliModel<B>,
    /// The checkpoint to continue from, resharded for this run as each rank reads its own
    /// shards (`None`: a fresh start).
    pub resume: Option<DirResume>,
    /// Where to save, if anywhere.
    pub sink: Option<DirSink<'a>>,
}

/// Where the model `bfpp train` trains starts from, as a description each rank builds its
/// own stages from.
pub enum CliModel<B: CliBackend> {
    /// The seeded initial values (`--seed`), drawn layer by layer.
    Seeded(GptDescription),
    /// `--init FILE.safetensors` (or a sharded set's index): each rank reads its own tensors.
    Safetensors(SafetensorsInit<GptDescription>),
    /// `--init FILE.mpk`: a Burn record is read whole, so every process holds the whole model
    /// while its stages are cut (use safetensors for models larger than one process).
    Record(Box<Whole<Gpt<B>>>),
}

impl<B: CliBackend> ModelDescription<B> for CliModel<B> {
    type Stage = GptStage<B>;

    fn num_layers(&self) -> usize {
        match self {
            CliModel::Seeded(m) => ModelDescription::<B>::num_layers(m),
            CliModel::Safetensors(m) => ModelDescription::<B>::num_layers(m),
            CliModel::Record(m) => m.num_layers(),
        }
    }

    fn layer_costs(&self) -> Vec<f64> {
        match self {
            CliModel::Seeded(m) => ModelDescription::<B>::layer_costs(m),
            CliModel::Safetensors(m) => ModelDescription::<B>::layer_costs(m),
            CliModel::Record(m) => m.layer_costs(),
        }
    }

    fn build_stage(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<GptStage<B>, ModelError> {
        match self {
            CliModel::Seeded(m) => m.build_stage(layers, device),
            CliModel::Safetensors(m) => m.build_stage(layers, device),
            CliModel::Record(m) => m.build_stage(layers, device),
        }
    }
}

/// The model configuration as the manifest records it: the model's shape. `fused` is how
/// it is computed, not what it is, so a run may resume with another setting.
fn model_json(model: &GptConfig) -> Result<serde_json::Value, TrainError> {
    let mut json = serde_json::to_value(model).map_err(|e| TrainError::Config(e.to_string()))?;
    if let Some(fields) = json.as_object_mut() {
        fields.remove("fused");
    }
    Ok(json)
}

/// Apply `--init`, `--resume` and `--save` to a run about to start on `device`. Nothing here
/// builds the model: names, shapes and counts come from a model whose parameters are never
/// initialised ([`GptConfig::skeleton`]).
pub fn prepare<'a, B: CliBackend>(
    args: &CheckpointArgs,
    model_cfg: &GptConfig,
    seed: u64,
    train: &TrainConfig,
    device: &B::Device,
    batcher: &'a Batcher,
) -> Result<Prepared<'a, B>, TrainError> {
    let steps = train.steps;
    let program: PipelineSchedule = train.program()?;
    let json = model_json(model_cfg)?;
    let skeleton = model_cfg.skeleton::<B>(device)?;
    let mut model = CliModel::Seeded(model_cfg.described(seed));
    if let Some(file) = &args.init {
        model = match WeightFormat::of_path(file) {
            WeightFormat::Mpk => {
                // The recorder reads the name with the `.mpk` extension: a missing file is
                // reported as missing, not as a record of another model.
                let read = file.with_extension("mpk");
                if let Err(source) = std::fs::metadata(&read) {
                    return Err(TrainError::Read { path: read, source });
                }
                let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
                let whole = model_cfg
                    .skeleton::<B>(device)?
                    .load_file(file.clone(), &recorder, device)
                    .map_err(|e| {
                        TrainError::Checkpoint(CheckpointError::Corrupt {
                            path: file.clone(),
                            problem: format!("not a Burn record of this model: {e}"),
                        })
                    })?;
                CliModel::Record(Box::new(Whole(whole)))
            }
            WeightFormat::Safetensors => CliModel::Safetensors(SafetensorsInit::open(
                model_cfg.described(seed),
                file,
                &named_param_shapes(&skeleton),
                "export the weights of a model with the same --layers, --hidden, --heads, \
                 --mlp-ratio, --seq-len and vocabulary, or set those flags to the file's model",
            )?),
        };
    }
    let mut resume = None;
    let mut start = 0;
    if let Some(path) = &args.resume {
        // Only the manifest is read here; each rank reads its own shards when it starts.
        let reader = CheckpointReader::open(path)?;
        let manifest = reader.manifest();
        if let Some(saved) = &manifest.data {
            let next = batcher.resume(saved)?;
            if next != manifest.step as u64 {
                return Err(TrainError::Data(DataError::Resume {
                    field: "next step",
                    saved: next.to_string(),
                    current: manifest.step.to_string(),
                    hint: "the manifest is inconsistent; resume from another checkpoint",
                }));
            }
        }
        start = manifest.step;
        if start >= steps {
            return Err(TrainError::Config(format!(
                "`{}` is at step {start} and --steps is {steps}: nothing to run; --steps \
                 counts total steps, so raise it",
                reader.dir().display()
            )));
        }
        checkpoint::check_model(manifest, reader.dir(), &json, &param_entries(&skeleton))?;
        let numels = stage_numels(&skeleton, train, &program)?;
        resume = Some(DirResume::new(reader, &numels)?);
    }
    let sink = match &args.save {
        None => None,
        Some(dir) => {
            let numels = stage_numels(&skeleton, train, &program)?;
            let lr =
                serde_json::to_value(&train.lr).map_err(|e| TrainError::Config(e.to_string()))?;
            let template = manifest_template(
                train,
                &program,
                &numels,
                json,
                param_entries(&skeleton),
                lr,
                seed,
            );
            let data_at: checkpoint::DataAt<'a> = Box::new(move |s| batcher.position(s));
            let sink = DirSink::new(dir, template, Some(data_at), args.keep.unwrap_or(0))?;
            let every = args.save_every.unwrap_or(0);
            let due = (start + 1..=steps).filter(|&s| (every > 0 && s % every == 0) || s == steps);
            sink.check_free(due)?;
            Some(sink)
        }
    };
    Ok(Prepared {
        model,
        resume,
        sink,
    })
}

/// `bfpp export --checkpoint DIR --out FILE`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// A step directory, or a run directory (its newest complete checkpoint).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// The weight file to write. A `.safetensors` name (or --format safetensors) writes
    /// safetensors named by the model's module paths (load it with `burn-store`'s
    /// `SafetensorsStore`); anything else a Burn record (`NamedMpkFileRecorder`, full
    /// precision; the extension becomes `.mpk`; load it with `Gpt::load_file`). Either works
    /// with `bfpp train --init`.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// The file format; default: from the extension of --out.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub format: Option<WeightFormat>,
    /// safetensors only: one file per pipeline stage of the checkpoint
    /// (`NAME-00001-of-0000N.safetensors` beside --out) and the Hugging Face index
    /// `NAME.safetensors.index.json`, which `bfpp train --init` also takes.
    #[arg(long)]
    pub per_stage: bool,
}

/// The weight-file formats of `bfpp export` and `bfpp train --init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightFormat {
    /// A Burn record (`NamedMpkFileRecorder`, full precision): plain Burn's own format.
    Mpk,
    /// safetensors through `burn-store`, one f32 tensor per parameter named by its module
    /// path (`blocks.0.attention.query.weight`): readable outside Burn.
    Safetensors,
}

impl WeightFormat {
    /// The format a file name says: `.safetensors` is safetensors, and so is `.json` (the
    /// index of a sharded set, `model.safetensors.index.json`); anything else a record.
    pub fn of_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(ext) if ext.eq_ignore_ascii_case("safetensors") => Self::Safetensors,
            Some(ext) if ext.eq_ignore_ascii_case("json") => Self::Safetensors,
            _ => Self::Mpk,
        }
    }
}

/// Write a checkpoint's trained weights as the plain model's: safetensors stage by stage, one
/// tensor in memory at a time (so a model larger than this process's memory exports), or a
/// Burn record, which holds the whole model in memory. Returns the files written.
pub fn export(args: &ExportArgs) -> Result<Vec<PathBuf>, TrainError> {
    let reader = CheckpointReader::open(&args.checkpoint)?;
    let manifest = reader.manifest();
    let config: GptConfig = serde_json::from_value(manifest.model.clone()).map_err(|e| {
        TrainError::Checkpoint(CheckpointError::OtherModel {
            path: reader.dir().join(checkpoint::MANIFEST),
            problem: format!("its model is not a GPT configuration: {e}"),
        })
    })?;
    // The model's names and shapes, from a model whose parameters are never initialised.
    let skeleton = config.skeleton::<Backend>(&Default::default())?;
    checkpoint::check_model(
        manifest,
        reader.dir(),
        &model_json(&config)?,
        &param_entries(&skeleton),
    )?;
    let format = args
        .format
        .unwrap_or_else(|| WeightFormat::of_path(&args.out));
    let out = out_path(&args.out, format);
    match format {
        WeightFormat::Safetensors => {
            let sharding = if args.per_stage {
                Sharding::PerStage
            } else {
                Sharding::OneFile
            };
            Ok(export_safetensors(&reader, &out, sharding)?)
        }
        WeightFormat::Mpk => {
            if args.per_stage {
                return Err(TrainError::Config(
                    "--per-stage writes safetensors; a Burn record is one file of the whole \
                     model: drop --per-stage, or export to a .safetensors name"
                        .into(),
                ));
            }
            let values = reader.read(Vector::Params, 0..manifest.numel())?;
            let flat = Tensor::<Backend, 1>::from_data(
                TensorData::new(values, [manifest.numel()]),
                &Default::default(),
            );
            let model = load_flat(skeleton, &flat)?;
            let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
            model
                .save_file(out.clone(), &recorder)
                .map_err(|e| TrainError::Write {
                    path: out.clone(),
                    source: std::io::Error::other(e.to_string()),
                })?;
            Ok(vec![out])
        }
    }
}

/// The file written: the recorder sets the extension to `.mpk` (replacing any other); a
/// safetensors file gets `.safetensors`, so that `--init` recognises it.
fn out_path(path: &Path, format: WeightFormat) -> PathBuf {
    match format {
        WeightFormat::Mpk => path.with_extension("mpk"),
        WeightFormat::Safetensors => path.with_extension("safetensors"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extension_picks_the_weight_format_and_the_written_name() {
        assert_eq!(
            WeightFormat::of_path(Path::new("w.safetensors")),
            WeightFormat::Safetensors
        );
        assert_eq!(
            WeightFormat::of_path(Path::new("W.SafeTensors")),
            WeightFormat::Safetensors
        );
        for name in ["w.mpk", "w", "w.bin", "safetensors"] {
            assert_eq!(WeightFormat::of_path(Path::new(name)), WeightFormat::Mpk);
        }
        assert_eq!(
            out_path(Path::new("w.bin"), WeightFormat::Safetensors),
            PathBuf::from("w.safetensors")
        );
        assert_eq!(
            out_path(Path::new("w.safetensors"), WeightFormat::Mpk),
            PathBuf::from("w.mpk")
        );
    }
}
