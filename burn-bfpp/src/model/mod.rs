//! Models as ordered lists of layers, cut into stages that run on different ranks.
//!
//! A Burn model made of an input part, a `Vec` of identical blocks and a head is pipelined
//! by the [`LayerStack`] adapter with no trait to write. Any other model implements
//! [`PipelineModel`]: it says how many layers it has (input
//! embedding, blocks, output head with loss), what each costs, and builds a [`PipelineStage`]
//! — an ordinary Burn [`Module`] holding only the parameters of a range of layers — for any
//! contiguous layer range. [`split_model`] chooses the ranges (even, cost-balanced or
//! explicit); [`crate::schedule::Placement`] then maps stages to ranks.
//!
//! Between stages, activations are float tensors `[batch, seq, hidden]` (a model without a
//! sequence axis uses `seq = 1`), so the engine can move them as float data. The first stage
//! takes the micro-batch's [`Inputs`], the last one also its [`Targets`] and returns the loss
//! (mean over the micro-batch's tokens or rows).
//!
//! Stages are cut from a model built once, so they share its parameter values and
//! [`ParamId`](burn::module::ParamId)s by construction: a pipelined run starts from exactly the
//! model a single-device run starts from, and the engine puts trained stages back into it.
//! [`flatten_params`] and [`load_flat`] move a stage's parameters to and from one 1-D buffer
//! for sharding (and its gradients go into one, see [`autodiff`]). The [`autodiff`] module
//! documents the per-stage backward recipe, including what any engine must follow with Burn
//! 0.21's autodiff: run each micro-batch's forward on [`autodiff::fresh_leaves`] of its
//! stage, and never share an autodiff node between threads. [`Gpt`] is the reference model.

pub mod autodiff;
mod describe;
mod error;
mod gpt;
mod gpt_layers;
mod params;
mod placement;
mod split;
mod split_linear;
mod stack;
#[cfg(all(test, feature = "flex"))]
mod tests;

use std::ops::Range;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

// The engine's autodiff and parameter plumbing: internal, the executor is their only user.
pub(crate) use autodiff::{fresh_leaves, input_grad, input_leaf, loss_backward, stage_backward};
pub use cubecl_kernels::FusedOps;
pub use describe::{draw_layer, fill_params, layer_seed, ModelDescription, Whole};
pub use error::ModelError;
pub use gpt::{FusedMode, Gpt, GptConfig, GptDescription, GptStage};
pub(crate) use params::model_paths;
pub(crate) use params::param_ids;
pub use params::{flatten_params, load_flat, materialize, named_param_shapes, param_shapes};
pub(crate) use params::{load_flat_shaped, recombine, release_params, zeros_flat};
pub(crate) use placement::{module_to_device, tensor_to_device};
pub use stack::{
    LayerStack, StackBlock, StackDescription, StackHead, StackInput, StackOf, StackParts,
    StackStage,
};

/// Held while a model draws its initial parameters. Burn backends keep one process-wide
/// random state (and [`GptConfig::init_seeded`] seeds it), so two threads building models at
/// once would take each other's draws and a seeded model would not be reproducible. This is
/// not about autodiff: thread ranks compute without a lock (see [`autodiff`]).
pub(crate) fn random_init_lock() -> std::sync::MutexGuard<'static, ()> {
    static DRAWS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // The lock guards no data; a panic while holding it leaves nothing inconsistent.
    DRAWS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
pub use split::{balanced_split, split_described, split_model, stage_costs, ModelSplit};
pub use split_linear::SplitLinear;

/// The inputs of a micro-batch, consumed by the first stage.
#[derive(Debug, Clone)]
pub enum Inputs<B: Backend> {
    /// Token ids `[batch, seq]` (language models).
    Tokens(Tensor<B, 2, Int>),
    /// Feature vectors `[batch, features]` (regressors, classifiers).
    Features(Tensor<B, 2>),
}

/// The targets of a micro-batch, consumed by the last stage's loss.
#[derive(Debug, Clone)]
pub enum Targets<B: Backend> {
    /// Target token ids `[batch, seq]` (next-token prediction).
    Tokens(Tensor<B, 2, Int>),
    /// Target values `[batch, outputs]` (regression).
    Values(Tensor<B, 2>),
}

/// One micro-batch of training data.
#[derive(Debug, Clone)]
pub struct MicroBatch<B: Backend> {
    /// What the first stage reads.
    pub inputs: Inputs<B>,
    /// What the last stage's loss compares against.
    pub targets: Targets<B>,
}

impl<B: Backend> MicroBatch<B> {
    /// The same micro-batch on `device`: the data closure builds batches wherever it likes,
    /// and each rank moves them to the device it computes on (a no-op where they are).
    /// Moves through host memory where needed (see [`tensor_to_device`]).
    pub fn to_device(self, device: &B::Device) -> Self {
        MicroBatch {
            inputs: match self.inputs {
                Inputs::Tokens(t) => Inputs::Tokens(tensor_to_device(t, device)),
                Inputs::Features(t) => Inputs::Features(tensor_to_device(t, device)),
            },
            targets: match self.targets {
                Targets::Tokens(t) => Targets::Tokens(tensor_to_device(t, device)),
                Targets::Values(t) => Targets::Values(tensor_to_device(t, device)),
            },
        }
    }
}

/// What a stage receives.
#[derive(Debug, Clone)]
pub enum StageInput<B: Backend> {
    /// The micro-batch's inputs: for the stage holding layer 0.
    Data(Inputs<B>),
    /// The previous stage's output `[batch, seq, hidden]`: for every other stage.
    Hidden(Tensor<B, 3>),
}

/// What a stage produces.
#[derive(Debug, Clone)]
pub enum StageOutput<B: Backend> {
    /// Activations `[batch, seq, hidden]` for the next stage.
    Hidden(Tensor<B, 3>),
    /// The loss of the micro-batch, shape `[1]`: from the stage holding the last layer.
    Loss(Tensor<B, 1>),
}

impl<B: Backend> StageOutput<B> {
    /// The activations, or an error if this was the last stage.
    pub fn into_hidden(self) -> Result<Tensor<B, 3>, ModelError> {
        match self {
            StageOutput::Hidden(h) => Ok(h),
            StageOutput::Loss(_) => Err(ModelError::Split(
                "expected activations but the stage returned the loss; only the last stage \
                 of the split may hold the head"
                    .into(),
            )),
        }
    }

    /// The loss, or an error if this was not the last stage.
    pub fn into_loss(self) -> Result<Tensor<B, 1>, ModelError> {
        match self {
            StageOutput::Loss(l) => Ok(l),
            StageOutput::Hidden(_) => Err(ModelError::Split(
                "expected the loss but the stage returned activations; the last stage of the \
                 split must hold the model's last layer"
                    .into(),
            )),
        }
    }
}

/// A model that can be cut into pipeline stages.
///
/// Layers are numbered `0..num_layers()` in the order data flows through them. Implementors
/// must [`materialize`] their parameters before [`stage`](Self::stage) is called (typically
/// in their `init`), because stages clone them.
pub trait PipelineModel<B: Backend>: Module<B> {
    /// The module type of one stage.
    type Stage: PipelineStage<B>;

    /// How many layers the model has (each stage gets at least one).
    fn num_layers(&self) -> usize;

    /// Relative cost of each layer (e.g. forward FLOPs per token), for [`ModelSplit::Balanced`].
    /// The default counts every layer as 1.
    fn layer_costs(&self) -> Vec<f64> {
        vec![1.0; self.num_layers()]
    }

    /// The stage holding `layers`, sharing this model's parameters (values and ids).
    fn stage(&self, layers: Range<usize>) -> Result<Self::Stage, ModelError>;

    /// All stages of a split; the ranges must be non-empty and cover `0..num_layers()` in order.
    fn stages(&self, ranges: &[Range<usize>]) -> Result<Vec<Self::Stage>, ModelError> {
        check_split(ranges, self.num_layers())?;
        ranges.iter().map(|r| self.stage(r.clone())).collect()
    }

    /// The loss of the unsplit model on one micro-batch (the model run as a single stage).
    fn loss(&self, batch: &MicroBatch<B>) -> Result<Tensor<B, 1>, ModelError> {
        let whole = self.stage(0..self.num_layers())?;
        whole
            .forward(StageInput::Data(batch.inputs.clone()), Some(&batch.targets))?
            .into_loss()
    }
}

/// One stage of a [`PipelineModel`]: a Burn module holding only its layers' parameters.
pub trait PipelineStage<B: Backend>: Module<B> {
    /// The model layers this stage runs.
    fn layers(&self) -> Range<usize>;

    /// Whether this stage holds the model's last layer (and so returns the loss).
    fn is_last(&self) -> bool;

    /// Whether this stage holds layer 0 (and so reads the micro-batch's inputs).
    fn is_first(&self) -> bool {
        self.layers().start == 0
    }

    /// For token targets: the classes the loss of the model's last stage takes them in
    /// (`0..classes`, the vocabulary of a language model). With it the engine checks every
    /// micro-batch's targets on the device, without a host read, and a step with a target
    /// outside stops the run naming the step, the rank and the micro-batch (the out-of-range
    /// ids are clamped for the step's computation, whose update is never applied). `None`
    /// (the default): not checked.
    fn target_classes(&self) -> Option<usize> {
        None
    }

    /// Whether a split backward defers every weight-matrix gradient of this stage: true when
    /// its matrix products go through [`SplitLinear`] (or [`cubecl_kernels::split_linear`])
    /// and its other parameters (embeddings, norms, biases) get their gradients in the
    /// input-gradient pass. Schedules with `I`/`W` actions (the zero-bubble family) are
    /// refused for stages that return false (the default), such as stages of burn-nn
    /// `Linear`s, whose weight gradients would all land in `I` and leave `W` nothing to
    /// fill the bubble with.
    fn splits_weight_grads(&self) -> bool {
        false
    }

    /// The module path, as the whole model names it, of every float parameter of this stage
    /// in visit order: the names a weight file of the whole model (safetensors, a Burn
    /// record) uses, by which a rank reads only its own stage's tensors. The stages of
    /// [`Gpt`] and [`LayerStack`] give them; the default refuses, naming the fix.
    fn param_paths(&self) -> Result<Vec<String>, ModelError> {
        Err(ModelError::Params(format!(
            "the stage of layers {:?} does not name its parameters as the whole model does; \
             implement PipelineStage::param_paths to load weight files by name",
            self.layers()
        )))
    }

    /// Runs the stage. The first stage takes [`StageInput::Data`], the others
    /// [`StageInput::Hidden`]; the last stage needs `targets` and returns
    /// [`StageOutput::Loss`], the others return [`StageOutput::Hidden`].
    fn forward(
        &self,
        input: StageInput<B>,
        targets: Option<&Targets<B>>,
    ) -> Result<StageOutput<B>, ModelError>;
}

/// Runs a micro-batch through `stages` in order on one device and returns the loss: the
/// full model as the composition of its stages.
pub fn run_stages<B: Backend, S: PipelineStage<B>>(
    stages: &[S],
    batch: &MicroBatch<B>,
) -> Result<Tensor<B, 1>, ModelError> {
    let mut input = StageInput::Data(batch.inputs.clone());
    for (i, stage) in stages.iter().enumerate() {
        let targets = stage.is_last().then_some(&batch.targets);
        let output = stage.forward(input, targets)?;
        if i + 1 == stages.len() {
            return output.into_loss();
        }
        input = StageInput::Hidden(output.into_hidden()?);
    }
    Err(ModelError::Split("no stages to run".into()))
}

/// Checks that `ranges` are non-empty, contiguous and cover exactly `0..num_layers`.
pub(crate) fn check_split(ranges: &[Range<usize>], num_layers: usize) -> Result<(), ModelError> {
    let mut next = 0;
    for (stage, r) in ranges.iter().enumerate() {
        if r.start != next || r.is_empty() {
            return Err(ModelError::Split(format!(
                "stage {stage} has layers {r:?}, but it must start at layer {next} and hold at \
                 least one layer; stages must be non-empty and contiguous"
            )));
        }
        next = r.end;
    }
    if next != num_layers || ranges.is_empty() {
        return Err(ModelError::Split(format!(
            "the stages cover layers 0..{next} but the model has {num_layers} layers"
        )));
    }
    Ok(())
}

/// Checks that `layers` is a non-empty range inside `0..num_layers` (for [`PipelineModel::stage`]).
pub(crate) fn check_range(layers: &Range<usize>, num_layers: usize) -> Result<(), ModelError> {
    if layers.is_empty() || layers.end > num_layers {
        return Err(ModelError::Split(format!(
            "layer range {layers:?} is empty or outside the model's layers 0..{num_layers}"
        )));
    }
    Ok(())
}
