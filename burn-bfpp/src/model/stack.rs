//! [`LayerStack`]: pipelining a Burn model made of an input part, a `Vec` of identical blocks
//! and a head, without writing [`PipelineModel`] or [`PipelineStage`].
//!
//! The model is `input → blocks[0] → … → blocks[n−1] → head`, layers `0..n + 2` (the input
//! part is layer 0, block `i` layer `i + 1`, the head layer `n + 1`), and a stage holds a
//! contiguous run of them. Each part says how it runs through a small trait:
//!
//! * [`StackInput`]: inputs → activations `[batch, seq, hidden]` (implemented here for
//!   burn-nn's [`Embedding`]);
//! * [`StackBlock`]: activations → activations of the same shape (implemented here for
//!   burn-nn's [`TransformerEncoderLayer`], with a causal mask);
//! * [`StackHead`]: activations and targets → the micro-batch's mean loss (implemented here
//!   for burn-nn's [`Linear`]: a projection to classes with the cross-entropy against
//!   token targets, or to outputs with the mean squared error against value targets), and
//!   for [`SplitLinear`], the same head whose weight gradient split-backward schedules defer.
//!
//! Zero-bubble schedules (`I`/`W` actions) need every part to report
//! [`PipelineStage::splits_weight_grads`]: build blocks and head from [`SplitLinear`] and
//! return true from the traits' `splits_weight_grads`. burn-nn's transformer layer and
//! `Linear` compute their weight gradients in the backward itself and are refused there.
//!
//! A part of one's own (an embedding with positions, a head with a final norm) is a Burn
//! module of one's own crate, so it implements these traits directly; burn-nn's layers, which
//! Rust's orphan rule keeps a user from implementing our traits on, are covered above.
//!
//! The stack comes in two forms:
//!
//! * **Described** ([`StackParts`] → [`StackDescription`]): constructors of the input part,
//!   of block `i` and of the head. The engine builds each rank's stages on the rank's device
//!   from them and draws every layer's initial values from its own seed, so no process ever
//!   holds a stage it does not run. This is the form for models of any size.
//! * **Built** ([`LayerStack::new`]): the parts already built, cut into stages by cloning.
//!   Every process holds the whole model first, so this form is for small models (and for
//!   models whose parts come from elsewhere, e.g. a loaded record).
//!
//! What the adapter cannot give, and why the reference [`Gpt`](super::Gpt) has its own stage
//! code: a head that shares a weight with the input part (a tied embedding cannot be split
//! across stages), layer costs that differ by layer kind (for [`ModelSplit::Balanced`]; here
//! every block costs the same and the input part and head are costed by parameters), and the
//! fused kernels' per-backend choice inside a block.
//!
//! [`ModelSplit::Balanced`]: super::ModelSplit::Balanced

use std::ops::Range;

use burn::backend::Flex;
use burn::module::{Module, ModuleDisplay};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::{CrossEntropyLossConfig, MseLoss, Reduction};
use burn::nn::transformer::TransformerEncoderLayer;
use burn::nn::{Embedding, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use cubecl_kernels::FusedOps;

use super::describe::{build_seeded, draw_layer, ModelDescription};
use super::split_linear::SplitLinear;
use super::{
    check_range, materialize, model_paths, param_shapes, Inputs, ModelError, PipelineModel,
    PipelineStage, StageInput, StageOutput, Targets,
};

/// The first part of a [`LayerStack`]: turns a micro-batch's inputs into activations
/// `[batch, seq, hidden]`.
pub trait StackInput<B: Backend>: Module<B> + ModuleDisplay {
    /// The activations of `inputs`.
    fn embed(&self, inputs: &Inputs<B>) -> Result<Tensor<B, 3>, ModelError>;

    /// See [`PipelineStage::splits_weight_grads`]; false by default.
    fn splits_weight_grads(&self) -> bool {
        false
    }
}

/// One block of a [`LayerStack`]: activations `[batch, seq, hidden]` to activations of the
/// same shape.
pub trait StackBlock<B: Backend>: Module<B> + ModuleDisplay {
    /// The block's output.
    fn apply(&self, x: Tensor<B, 3>) -> Tensor<B, 3>;

    /// See [`PipelineStage::splits_weight_grads`]; false by default. A block whose matrix
    /// products all go through [`SplitLinear`] returns true.
    fn splits_weight_grads(&self) -> bool {
        false
    }
}

/// The last part of a [`LayerStack`]: activations and the micro-batch's targets to its loss,
/// the mean over its samples (and tokens), shape `[1]`.
pub trait StackHead<B: Backend>: Module<B> + ModuleDisplay {
    /// The micro-batch's mean loss.
    fn loss(&self, x: Tensor<B, 3>, targets: &Targets<B>) -> Result<Tensor<B, 1>, ModelError>;

    /// The classes token targets must lie in (see [`PipelineStage::target_classes`]); `None`
    /// (the default): not checked.
    fn classes(&self) -> Option<usize> {
        None
    }

    /// See [`PipelineStage::splits_weight_grads`]; false by default.
    fn splits_weight_grads(&self) -> bool {
        false
    }
}

/// burn-nn's embedding of token ids `[batch, seq]`.
impl<B: Backend> StackInput<B> for Embedding<B> {
    fn embed(&self, inputs: &Inputs<B>) -> Result<Tensor<B, 3>, ModelError> {
        match inputs {
            Inputs::Tokens(ids) => Ok(self.forward(ids.clone())),
            Inputs::Features(_) => Err(ModelError::Split(
                "an Embedding input part takes token ids (Inputs::Tokens), not features".into(),
            )),
        }
    }

    /// An embedding's gradient is a scatter of the output gradient, computed in `I`.
    fn splits_weight_grads(&self) -> bool {
        true
    }
}

/// burn-nn's transformer layer as a decoder block: self-attention under a causal mask
/// (`generate_autoregressive_mask`), so position `t` sees positions `≤ t` only, as a language
/// model needs. For bidirectional attention, wrap the layer in a module of one's own.
impl<B: Backend> StackBlock<B> for TransformerEncoderLayer<B> {
    fn apply(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let mask = generate_autoregressive_mask::<B>(batch, seq, &x.device());
        self.forward(x, None, Some(mask))
    }
}

/// burn-nn's linear layer as a head: logits against token targets `[batch, seq]` with the
/// mean cross-entropy, or outputs against value targets `[batch, outputs]` (from activations
/// `[batch, 1, hidden]`) with the mean squared error.
impl<B: Backend> StackHead<B> for Linear<B> {
    fn classes(&self) -> Option<usize> {
        Some(self.weight.dims()[1])
    }

    fn loss(&self, x: Tensor<B, 3>, targets: &Targets<B>) -> Result<Tensor<B, 1>, ModelError> {
        head_loss(self.forward(x), targets)
    }
}

/// [`SplitLinear`] as a head, like burn-nn's `Linear`, with its weight gradient deferred by
/// split-backward schedules.
impl<B: FusedOps> StackHead<B> for SplitLinear<B> {
    fn classes(&self) -> Option<usize> {
        Some(self.weight.dims()[1])
    }

    fn loss(&self, x: Tensor<B, 3>, targets: &Targets<B>) -> Result<Tensor<B, 1>, ModelError> {
        head_loss(self.forward(x), targets)
    }

    fn splits_weight_grads(&self) -> bool {
        true
    }
}

/// The loss of a linear head's outputs `out` `[batch, seq, width]`: the mean cross-entropy
/// against token targets, or the mean squared error against value targets `[batch, width]`
/// (with `seq` 1).
fn head_loss<B: Backend>(
    out: Tensor<B, 3>,
    targets: &Targets<B>,
) -> Result<Tensor<B, 1>, ModelError> {
    let [batch, seq, width] = out.dims();
    match targets {
        Targets::Tokens(ids) => {
            if ids.dims() != [batch, seq] {
                return Err(ModelError::shape(
                    "token targets of the head".to_string(),
                    format!("[{batch}, {seq}]"),
                    format!("{:?}", ids.dims()),
                ));
            }
            let ce = CrossEntropyLossConfig::new().init(&out.device());
            Ok(ce.forward(
                out.reshape([batch * seq, width]),
                ids.clone().reshape([batch * seq]),
            ))
        }
        Targets::Values(values) => {
            if seq != 1 || values.dims() != [batch, width] {
                return Err(ModelError::shape(
                    "value targets of the head".to_string(),
                    format!("[{batch}, {width}] from activations [{batch}, 1, hidden]"),
                    format!(
                        "{:?} from activations [{batch}, {seq}, hidden]",
                        values.dims()
                    ),
                ));
            }
            Ok(MseLoss::new()
                .forward(out.reshape([batch, width]), values.clone(), Reduction::Mean)
                .reshape([1]))
        }
    }
}

/// A model of an input part, a stack of identical blocks and a head, cut into pipeline stages
/// by the adapter (see the [module docs](self)).
///
/// ```
/// use burn::backend::{Autodiff, Flex};
/// use burn::nn::transformer::TransformerEncoderConfig;
/// use burn::nn::{EmbeddingConfig, LinearConfig};
/// use burn_bfpp::model::{LayerStack, PipelineModel};
///
/// type B = Autodiff<Flex>;
/// let device = Default::default();
/// let block = TransformerEncoderConfig::new(16, 32, 2, 1).with_dropout(0.0);
/// let model = LayerStack::<B, _, _, _>::new(
///     EmbeddingConfig::new(64, 16).init(&device),
///     (0..4).map(|_| block.clone().init::<B>(&device).layers.remove(0)).collect(),
///     LinearConfig::new(16, 64).init(&device),
/// )
/// .unwrap();
/// assert_eq!(model.num_layers(), 6);
/// ```
#[derive(Module, Debug)]
pub struct LayerStack<B: Backend, I: Module<B>, L: Module<B>, H: Module<B>> {
    /// The input part (layer 0).
    pub input: I,
    /// The blocks (layers `1..=n`).
    pub blocks: Vec<L>,
    /// The head (layer `n + 1`).
    pub head: H,
    _backend: std::marker::PhantomData<B>,
}

impl<B, I, L, H> LayerStack<B, I, L, H>
where
    B: Backend,
    I: StackInput<B>,
    L: StackBlock<B>,
    H: StackHead<B>,
{
    /// The model `input → blocks → head`. Its parameters are initialised now (stages share
    /// them). Refuses an empty stack, and blocks whose parameters differ in shape from the
    /// first block's (the adapter's blocks are one layer repeated; a model of unlike blocks
    /// implements [`PipelineModel`] itself).
    pub fn new(input: I, blocks: Vec<L>, head: H) -> Result<Self, ModelError> {
        let Some(first) = blocks.first() else {
            return Err(ModelError::Split(
                "a layer stack needs at least one block between its input part and its head".into(),
            ));
        };
        let shapes = param_shapes(first);
        if let Some((i, other)) = blocks
            .iter()
            .enumerate()
            .skip(1)
            .map(|(i, b)| (i, param_shapes(b)))
            .find(|(_, s)| *s != shapes)
        {
            return Err(ModelError::Split(format!(
                "block {i} of the layer stack has parameters of shapes {other:?}, block 0 \
                 {shapes:?}: the adapter cuts a stack of identical blocks; build every block \
                 from one configuration, or implement PipelineModel for a model of unlike \
                 blocks"
            )));
        }
        let model = LayerStack {
            input,
            blocks,
            head,
            _backend: std::marker::PhantomData,
        };
        materialize(&model);
        Ok(model)
    }
}

impl<B, I, L, H> PipelineModel<B> for LayerStack<B, I, L, H>
where
    B: Backend,
    I: StackInput<B>,
    L: StackBlock<B>,
    H: StackHead<B>,
{
    type Stage = StackStage<B, I, L, H>;

    fn num_layers(&self) -> usize {
        self.blocks.len() + 2
    }

    /// Parameters per layer (blocks all alike): the input part and the head are costed by
    /// their size relative to a block's, at least a tenth of one.
    fn layer_costs(&self) -> Vec<f64> {
        let block = self
            .blocks
            .first()
            .map_or(1, Module::<B>::num_params)
            .max(1) as f64;
        let part = |n: usize| (n as f64 / block).max(0.1);
        let mut costs = vec![part(Module::<B>::num_params(&self.input))];
        costs.extend(std::iter::repeat_n(1.0, self.blocks.len()));
        costs.push(part(Module::<B>::num_params(&self.head)));
        costs
    }

    fn stage(&self, layers: Range<usize>) -> Result<Self::Stage, ModelError> {
        let n = self.num_layers();
        check_range(&layers, n)?;
        let head_layer = n - 1;
        let blocks = layers.start.max(1) - 1..layers.end.min(head_layer) - 1;
        Ok(StackStage {
            input: layers.contains(&0).then(|| self.input.clone()),
            blocks: self.blocks[blocks].to_vec(),
            head: layers.contains(&head_layer).then(|| self.head.clone()),
            start: layers.start,
            end: layers.end,
            num_layers: n,
            _backend: std::marker::PhantomData,
        })
    }
}

/// A contiguous run of a [`LayerStack`]'s layers: the module one rank holds for one stage.
#[derive(Module, Debug)]
pub struct StackStage<B: Backend, I: Module<B>, L: Module<B>, H: Module<B>> {
    input: Option<I>,
    blocks: Vec<L>,
    head: Option<H>,
    start: usize,
    end: usize,
    num_layers: usize,
    _backend: std::marker::PhantomData<B>,
}

impl<B, I, L, H> PipelineStage<B> for StackStage<B, I, L, H>
where
    B: Backend,
    I: StackInput<B>,
    L: StackBlock<B>,
    H: StackHead<B>,
{
    fn layers(&self) -> Range<usize> {
        self.start..self.end
    }

    fn is_last(&self) -> bool {
        self.end == self.num_layers
    }

    fn target_classes(&self) -> Option<usize> {
        self.head.as_ref().and_then(StackHead::classes)
    }

    fn param_paths(&self) -> Result<Vec<String>, ModelError> {
        Ok(model_paths(self, self.start.max(1) - 1))
    }

    fn splits_weight_grads(&self) -> bool {
        self.input
            .as_ref()
            .is_none_or(StackInput::splits_weight_grads)
            && self.blocks.iter().all(StackBlock::splits_weight_grads)
            && self
                .head
                .as_ref()
                .is_none_or(StackHead::splits_weight_grads)
    }

    fn forward(
        &self,
        input: StageInput<B>,
        targets: Option<&Targets<B>>,
    ) -> Result<StageOutput<B>, ModelError> {
        let mut x = match (input, &self.input) {
            (StageInput::Data(inputs), Some(part)) => part.embed(&inputs)?,
            (StageInput::Hidden(h), None) => h,
            (StageInput::Data(_), None) => {
                return Err(ModelError::Split(format!(
                    "stage of layers {:?} got the micro-batch's inputs, but only the stage of \
                     layer 0 reads them",
                    self.layers()
                )))
            }
            (StageInput::Hidden(_), Some(_)) => {
                return Err(ModelError::Split(
                    "the stage of layer 0 got activations instead of the micro-batch's inputs"
                        .into(),
                ))
            }
        };
        for block in &self.blocks {
            x = block.apply(x);
        }
        match (&self.head, targets) {
            (Some(head), Some(targets)) => Ok(StageOutput::Loss(head.loss(x, targets)?)),
            (Some(_), None) => Err(ModelError::Split(
                "the stage holding the head needs the micro-batch's targets".into(),
            )),
            (None, _) => Ok(StageOutput::Hidden(x)),
        }
    }
}

/// The parts of a [`LayerStack`] as constructors: the description form of the stack (see the
/// [module docs](self)). Each constructor builds its part on the device it is given, for any
/// backend; Burn's `Config::init` does exactly that, and leaves the parameters lazy, so
/// building a stage's parts allocates nothing before their values are filled in.
///
/// ```
/// use burn::backend::{Autodiff, Flex};
/// use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
/// use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
/// use burn_bfpp::model::{FusedOps, ModelDescription, StackParts};
///
/// struct Tiny;
/// impl StackParts for Tiny {
///     type Input<B: FusedOps> = Embedding<B>;
///     type Block<B: FusedOps> = TransformerEncoderLayer<B>;
///     type Head<B: FusedOps> = Linear<B>;
///     fn num_blocks(&self) -> usize {
///         4
///     }
///     fn input<B: FusedOps>(&self, device: &B::Device) -> Embedding<B> {
///         EmbeddingConfig::new(64, 16).init(device)
///     }
///     fn block<B: FusedOps>(&self, _index: usize, device: &B::Device) -> TransformerEncoderLayer<B> {
///         let config = TransformerEncoderConfig::new(16, 32, 2, 1).with_dropout(0.0);
///         config.init::<B>(device).layers.remove(0)
///     }
///     fn head<B: FusedOps>(&self, device: &B::Device) -> Linear<B> {
///         LinearConfig::new(16, 64).init(device)
///     }
/// }
///
/// type B = Autodiff<Flex>;
/// let model = Tiny.described(7);
/// assert_eq!(ModelDescription::<B>::num_layers(&model), 6);
/// // The stage of layers 2..4 (blocks 1 and 2), built alone:
/// let stage = ModelDescription::<B>::build_stage(&model, 2..4, &Default::default()).unwrap();
/// ```
pub trait StackParts {
    /// The input part (layer 0).
    type Input<B: FusedOps>: StackInput<B>;
    /// A block (layers `1..=num_blocks`).
    type Block<B: FusedOps>: StackBlock<B>;
    /// The head (the last layer).
    type Head<B: FusedOps>: StackHead<B>;

    /// How many blocks the stack has (at least one).
    fn num_blocks(&self) -> usize;

    /// Builds the input part on `device`.
    fn input<B: FusedOps>(&self, device: &B::Device) -> Self::Input<B>;

    /// Builds block `index` (`0..num_blocks`) on `device`.
    fn block<B: FusedOps>(&self, index: usize, device: &B::Device) -> Self::Block<B>;

    /// Builds the head on `device`.
    fn head<B: FusedOps>(&self, device: &B::Device) -> Self::Head<B>;

    /// The stack described by these parts, its initial values drawn from `seed` (see
    /// [`StackDescription`]).
    fn described(self, seed: u64) -> StackDescription<Self>
    where
        Self: Sized,
    {
        StackDescription { parts: self, seed }
    }
}

/// The built [`LayerStack`] of the parts `P` on backend `B`.
pub type StackOf<B, P> = LayerStack<
    B,
    <P as StackParts>::Input<B>,
    <P as StackParts>::Block<B>,
    <P as StackParts>::Head<B>,
>;

/// A [`LayerStack`] described by its [`StackParts`]: the engine builds each rank's stages on
/// the rank's device. Layer `l` (the input part is layer 0, block `i` layer `i + 1`, the head
/// the last) takes its initial values from a draw on the CPU seeded by
/// [`layer_seed`](super::layer_seed)`(seed, l)`, so every layout, backend and rank mode starts
/// from the same model, the one [`StackDescription::build`] returns whole.
#[derive(Debug, Clone)]
pub struct StackDescription<P> {
    /// The constructors of the parts.
    pub parts: P,
    /// The seed of the initial values.
    pub seed: u64,
}

impl<P: StackParts> StackDescription<P> {
    fn checked_blocks(&self) -> Result<usize, ModelError> {
        match self.parts.num_blocks() {
            0 => Err(ModelError::Split(
                "a layer stack needs at least one block between its input part and its head;                  make num_blocks return at least 1"
                    .into(),
            )),
            n => Ok(n),
        }
    }

    /// The initial values of layer `layer`, drawn on the CPU from its own seed.
    fn draw(&self, layer: usize) -> Result<Vec<burn::tensor::TensorData>, ModelError> {
        let head = self.checked_blocks()? + 1;
        let parts = &self.parts;
        match layer {
            0 => draw_layer(self.seed, layer, |cpu| Ok(parts.input::<Flex>(cpu))),
            l if l == head => draw_layer(self.seed, layer, |cpu| Ok(parts.head::<Flex>(cpu))),
            l if l < head => {
                draw_layer(self.seed, layer, |cpu| Ok(parts.block::<Flex>(l - 1, cpu)))
            }
            _ => Err(ModelError::Split(format!(
                "layer {layer} is outside the stack's layers 0..{}",
                head + 1
            ))),
        }
    }

    /// The whole stack, built on `device` with the initial values every stage of the
    /// description starts from: the single-device model of the same run (plain Burn, or the
    /// reference a pipelined run is compared with). It holds the whole model, as any built
    /// [`LayerStack`] does.
    pub fn build<B: FusedOps>(&self, device: &B::Device) -> Result<StackOf<B, P>, ModelError> {
        let n = self.checked_blocks()?;
        let skeleton = LayerStack {
            input: self.parts.input::<B>(device),
            blocks: (0..n).map(|i| self.parts.block::<B>(i, device)).collect(),
            head: self.parts.head::<B>(device),
            _backend: std::marker::PhantomData,
        };
        build_seeded(0..n + 2, skeleton, |layer| self.draw(layer))
    }
}

impl<B: FusedOps, P: StackParts> ModelDescription<B> for StackDescription<P> {
    type Stage = StackStage<B, P::Input<B>, P::Block<B>, P::Head<B>>;

    fn num_layers(&self) -> usize {
        self.parts.num_blocks() + 2
    }

    /// Parameters per layer, counted on parts built with lazy parameters (nothing drawn):
    /// each block by its own count, the input part and the head at least a tenth of the
    /// first block's.
    fn layer_costs(&self) -> Vec<f64> {
        let cpu = Default::default();
        let count = |shapes: Vec<Vec<usize>>| -> usize {
            shapes.iter().map(|s| s.iter().product::<usize>()).sum()
        };
        let blocks: Vec<f64> = (0..self.parts.num_blocks())
            .map(|i| count(param_shapes(&self.parts.block::<Flex>(i, &cpu))) as f64)
            .collect();
        let unit = blocks.first().copied().unwrap_or(1.0).max(1.0);
        let part = |n: usize| (n as f64 / unit).max(0.1);
        let mut costs = vec![part(count(param_shapes(&self.parts.input::<Flex>(&cpu))))];
        costs.extend(blocks.iter().map(|&b| b / unit));
        costs.push(part(count(param_shapes(&self.parts.head::<Flex>(&cpu)))));
        costs
    }

    fn build_stage(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError> {
        let skeleton = self.stage_skeleton(layers.clone(), device)?;
        build_seeded(layers, skeleton, |layer| self.draw(layer))
    }

    fn stage_skeleton(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError> {
        let n = self.checked_blocks()? + 2;
        check_range(&layers, n)?;
        let head_layer = n - 1;
        let blocks = layers.start.max(1) - 1..layers.end.min(head_layer) - 1;
        Ok(StackStage {
            input: layers.contains(&0).then(|| self.parts.input::<B>(device)),
            blocks: blocks.map(|i| self.parts.block::<B>(i, device)).collect(),
            head: layers
                .contains(&head_layer)
                .then(|| self.parts.head::<B>(device)),
            start: layers.start,
            end: layers.end,
            num_layers: n,
            _backend: std::marker::PhantomData,
        })
    }
}
