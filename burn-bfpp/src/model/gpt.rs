//! The reference GPT: learned token and position embeddings, pre-LayerNorm blocks with causal
//! self-attention and a GELU MLP, a final LayerNorm and a linear (or tied) head with
//! cross-entropy — built from `burn::nn` parts.
//!
//! As a [`PipelineModel`] its layers are `[embedding] + blocks + [final norm, head, loss]`, so
//! a model with `L` blocks has `L + 2` layers and splits into up to `L + 2` stages.

use std::ops::Range;

use burn::backend::Flex;
use burn::module::{Initializer, Module};
use burn::nn::{DropoutConfig, EmbeddingConfig, Gelu, LayerNormConfig, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use cubecl_kernels::FusedOps;
use serde::{Deserialize, Serialize};

use super::describe::{build_seeded, draw_layer, ModelDescription};
use super::gpt_layers::{
    flash_head_dim, CausalSelfAttention, Fused, GptBlock, GptEmbedding, GptHead,
};
use super::Inputs;
use super::{
    check_range, materialize, model_paths, random_init_lock, ModelError, PipelineModel,
    PipelineStage, StageInput, StageOutput, Targets,
};

/// The shape of a [`Gpt`]. Deserialises from JSON with every field optional (defaults below).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size (default 256: byte-level tokens).
    pub vocab_size: usize,
    /// Longest sequence, the number of learned positions (default 64).
    pub seq_len: usize,
    /// Width of the residual stream (default 64).
    pub hidden: usize,
    /// Attention heads; must divide `hidden` (default 4).
    pub heads: usize,
    /// Transformer blocks (default 8, so the model has 10 layers).
    pub layers: usize,
    /// MLP width as a multiple of `hidden` (default 4).
    pub mlp_ratio: usize,
    /// Use the token embedding matrix as the output head (default false). A tied head puts
    /// one weight in the first and the last layer, so such a model cannot be split.
    pub tied_head: bool,
    /// Dropout probability on embeddings and residual branches (default 0). Anything above 0
    /// draws random masks, so pipelined and single-device runs no longer match exactly.
    pub dropout: f64,
    /// Standard deviation of the normal initialisation of weights (default 0.02); the
    /// residual output projections use `init_std / sqrt(2 · layers)`, as in GPT-2.
    pub init_std: f64,
    /// Whether attention, the MLP's first linear + GELU and the head's loss run as the fused
    /// ops of `cubecl_kernels` (default `auto`: each where the backend runs it as a kernel
    /// not measured slower than Burn's own path). An execution choice, not part of the
    /// model: the parameters are the same either way.
    pub fused: FusedMode,
}

/// When the reference GPT uses the fused ops of `cubecl_kernels` ([`GptConfig::fused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FusedMode {
    /// Each op fused where the backend runs it as a kernel not measured slower than Burn's
    /// own path ([`cubecl_kernels::FusedDefaults`]: on CUDA the MLP and the head, attention
    /// not; nothing on wgpu or Flex); the written-out ops elsewhere.
    #[default]
    Auto,
    /// Always fused: on backends without kernels (Flex) the composed implementations, with
    /// their own backward, run instead of the written-out ops.
    On,
    /// Never: attention, MLP and loss written out of standard Burn ops.
    Off,
}

impl std::str::FromStr for FusedMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(FusedMode::Auto),
            "on" => Ok(FusedMode::On),
            "off" => Ok(FusedMode::Off),
            other => Err(format!(
                "unknown fused mode `{other}`; expected `auto`, `on` or `off`"
            )),
        }
    }
}

impl Default for GptConfig {
    fn default() -> Self {
        Self {
            vocab_size: 256,
            seq_len: 64,
            hidden: 64,
            heads: 4,
            layers: 8,
            mlp_ratio: 4,
            tied_head: false,
            dropout: 0.0,
            init_std: 0.02,
            fused: FusedMode::Auto,
        }
    }
}

impl GptConfig {
    /// Checks every field; the error names the field and the fix.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("seq_len", self.seq_len),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("layers", self.layers),
            ("mlp_ratio", self.mlp_ratio),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ModelError::Config(format!("`{name}` must be at least 1")));
        }
        if self.hidden % self.heads != 0 {
            return Err(ModelError::Config(format!(
                "`hidden` ({}) must be a multiple of `heads` ({})",
                self.hidden, self.heads
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ModelError::Config(format!(
                "`dropout` is {}; it must be in [0, 1)",
                self.dropout
            )));
        }
        let head_dim = self.hidden / self.heads;
        if self.fused == FusedMode::On && !flash_head_dim(head_dim) {
            return Err(ModelError::Config(format!(
                "`fused = \"on\"` needs a head dimension (hidden / heads = {head_dim}) that is a \
                 multiple of 16 and at most {}; change hidden or heads, or set fused = \"auto\" \
                 (written-out attention where it does not fit)",
                cubecl_kernels::MAX_HEAD_DIM
            )));
        }
        if !self.init_std.is_finite() || self.init_std < 0.0 {
            return Err(ModelError::Config(format!(
                "`init_std` is {}; it must be finite and non-negative",
                self.init_std
            )));
        }
        Ok(())
    }

    /// What takes the fused path on backend `B`. A tied head stays written out: its weight
    /// is the transposed embedding, a view the head kernel does not take.
    fn fused<B: FusedOps>(&self) -> Fused {
        let all = |on| cubecl_kernels::FusedDefaults {
            attention: on,
            mlp: on,
            head: on,
        };
        let ops = match self.fused {
            FusedMode::On => all(true),
            FusedMode::Auto => B::fused_defaults(),
            FusedMode::Off => all(false),
        };
        Fused {
            attention: ops.attention && flash_head_dim(self.hidden / self.heads),
            mlp: ops.mlp,
            head: ops.head && !self.tied_head,
        }
    }

    /// Layers as a pipeline model: embedding, blocks, head.
    pub fn num_layers(&self) -> usize {
        self.layers + 2
    }

    /// Forward FLOPs per token of each layer (the standard matmul counts; backward is about
    /// twice that for every layer, so the ratios hold for training too).
    pub fn layer_costs(&self) -> Vec<f64> {
        let (h, s, v) = (
            self.hidden as f64,
            self.seq_len as f64,
            self.vocab_size as f64,
        );
        let r = self.mlp_ratio as f64;
        // Q, K, V and output projections, the MLP, and QKᵀ plus the weighted sum of V.
        let block = 8.0 * h * h + 4.0 * r * h * h + 4.0 * s * h;
        let mut costs = vec![h]; // the embedding only adds the position vector
        costs.extend(std::iter::repeat_n(block, self.layers));
        costs.push(2.0 * h * v);
        costs
    }

    /// Builds the model with parameters drawn from the backend's current random state, and
    /// materialises them (see [`materialize`]) so that stages cut from it share its values.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<Gpt<B>, ModelError> {
        let _draws = random_init_lock();
        let model = self.skeleton(device)?;
        materialize(&model);
        Ok(model)
    }

    /// The whole model with its parameters not yet initialised (Burn's lazy parameters):
    /// nothing is drawn or allocated, so its parameter names, shapes and count
    /// ([`super::named_param_shapes`], [`super::param_shapes`]) cost nothing. A parameter
    /// read from it initialises from the backend's current random state.
    pub fn skeleton<B: Backend>(&self, device: &B::Device) -> Result<Gpt<B>, ModelError> {
        self.validate()?;
        Ok(Gpt {
            embed: self.embedding(device),
            blocks: (0..self.layers).map(|_| self.block(device)).collect(),
            head: self.head(device),
            config: self.clone(),
        })
    }

    /// Layer 0 (lazy parameters).
    fn embedding<B: Backend>(&self, device: &B::Device) -> GptEmbedding<B> {
        let normal = Initializer::Normal {
            mean: 0.0,
            std: self.init_std,
        };
        GptEmbedding {
            tokens: EmbeddingConfig::new(self.vocab_size, self.hidden)
                .with_initializer(normal.clone())
                .init(device),
            positions: EmbeddingConfig::new(self.seq_len, self.hidden)
                .with_initializer(normal)
                .init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }

    /// One transformer block, layers `1..=layers` (lazy parameters).
    fn block<B: Backend>(&self, device: &B::Device) -> GptBlock<B> {
        let normal = |std: f64| Initializer::Normal { mean: 0.0, std };
        let residual_std = self.init_std / (2.0 * self.layers as f64).sqrt();
        let linear = |d_in: usize, d_out: usize, std: f64| {
            LinearConfig::new(d_in, d_out)
                .with_initializer(normal(std))
                .init(device)
                .into()
        };
        let norm = || LayerNormConfig::new(self.hidden).init(device);
        let (h, mlp) = (self.hidden, self.hidden * self.mlp_ratio);
        GptBlock {
            norm1: norm(),
            attention: CausalSelfAttention {
                query: linear(h, h, self.init_std),
                // No key bias: it adds `q · b` to every score of a query's row, which the
                // softmax cancels, so its gradient is identically zero.
                key: LinearConfig::new(h, h)
                    .with_bias(false)
                    .with_initializer(normal(self.init_std))
                    .init(device)
                    .into(),
                value: linear(h, h, self.init_std),
                output: linear(h, h, residual_std),
                heads: self.heads,
            },
            norm2: norm(),
            fc: linear(h, mlp, self.init_std),
            gelu: Gelu::new(),
            proj: linear(mlp, h, residual_std),
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }

    /// The last layer: final norm and (untied) output projection (lazy parameters).
    fn head<B: Backend>(&self, device: &B::Device) -> GptHead<B> {
        GptHead {
            norm: LayerNormConfig::new(self.hidden).init(device),
            output: (!self.tied_head).then(|| {
                LinearConfig::new(self.hidden, self.vocab_size)
                    .with_bias(false)
                    .with_initializer(Initializer::Normal {
                        mean: 0.0,
                        std: self.init_std,
                    })
                    .init(device)
                    .into()
            }),
        }
    }

    /// The stage of `layers` with its parameters still lazy; refuses a range that holds one
    /// of a tied head's two uses.
    fn stage_skeleton<B: Backend>(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<GptStage<B>, ModelError> {
        self.validate()?;
        let n = self.num_layers();
        check_range(&layers, n)?;
        let head_layer = n - 1;
        let (has_embed, has_head) = (layers.contains(&0), layers.contains(&head_layer));
        if self.tied_head && has_embed != has_head {
            return Err(ModelError::TiedHeadAcrossStages {
                layers,
                head: head_layer,
            });
        }
        let blocks = layers.start.max(1) - 1..layers.end.min(head_layer) - 1;
        Ok(GptStage {
            embed: has_embed.then(|| self.embedding(device)),
            blocks: blocks.map(|_| self.block(device)).collect(),
            head: has_head.then(|| self.head(device)),
            start: layers.start,
            end: layers.end,
            num_layers: n,
            config: self.clone(),
        })
    }

    /// The initial values of layer `layer` of the model seeded with `seed`, drawn on the CPU
    /// from that layer's own seed ([`super::layer_seed`]).
    fn draw_layer(&self, seed: u64, layer: usize) -> Result<Vec<TensorData>, ModelError> {
        self.validate()?;
        let head = self.num_layers() - 1;
        match layer {
            0 => draw_layer(seed, layer, |cpu| Ok(self.embedding::<Flex>(cpu))),
            l if l == head => draw_layer(seed, layer, |cpu| Ok(self.head::<Flex>(cpu))),
            l if l < head => draw_layer(seed, layer, |cpu| Ok(self.block::<Flex>(cpu))),
            _ => Err(ModelError::Split(format!(
                "layer {layer} is outside the model's layers 0..{}",
                head + 1
            ))),
        }
    }

    /// [`init`](Self::init) with the weights `seed` gives: layer `l` is drawn on the CPU
    /// (Burn's Flex backend) from its own seed, a function of `seed` and `l` alone
    /// ([`super::layer_seed`]), and copied to `device`. So the model is the same on every
    /// backend, its layers are those [`described`](Self::described) builds for any stage,
    /// and no more than one layer is ever drawn at a time.
    pub fn init_seeded<B: Backend>(
        &self,
        seed: u64,
        device: &B::Device,
    ) -> Result<Gpt<B>, ModelError> {
        let skeleton = self.skeleton(device)?;
        build_seeded(0..self.num_layers(), skeleton, |layer| {
            self.draw_layer(seed, layer)
        })
    }

    /// The model as a description ([`ModelDescription`]): each rank builds only its own
    /// stages, with the initial values [`init_seeded`](Self::init_seeded) gives the whole
    /// model for `seed`.
    pub fn described(&self, seed: u64) -> GptDescription {
        GptDescription {
            config: self.clone(),
            seed,
        }
    }
}

/// A [`Gpt`] described, not built ([`GptConfig::described`]): the engine builds each rank's
/// stages on the rank's device, drawing their layers' initial values one layer at a time.
#[derive(Debug, Clone, PartialEq)]
pub struct GptDescription {
    /// The model's shape.
    pub config: GptConfig,
    /// The seed of the initial values (see [`GptConfig::init_seeded`]).
    pub seed: u64,
}

impl<B: FusedOps> ModelDescription<B> for GptDescription {
    type Stage = GptStage<B>;

    fn num_layers(&self) -> usize {
        self.config.num_layers()
    }

    fn layer_costs(&self) -> Vec<f64> {
        self.config.layer_costs()
    }

    fn build_stage(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<GptStage<B>, ModelError> {
        let skeleton = self.config.stage_skeleton(layers.clone(), device)?;
        build_seeded(layers, skeleton, |layer| {
            self.config.draw_layer(self.seed, layer)
        })
    }

    fn stage_skeleton(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<GptStage<B>, ModelError> {
        self.config.stage_skeleton(layers, device)
    }
}

/// The reference GPT; build it with [`GptConfig::init`] and split it with
/// [`PipelineModel::stage`].
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    embed: GptEmbedding<B>,
    blocks: Vec<GptBlock<B>>,
    head: GptHead<B>,
    config: GptConfig,
}

impl<B: Backend> Gpt<B> {
    /// The configuration the model was built from.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The same parameters with another [`FusedMode`]: e.g. a written-out reference to check
    /// the fused path against. Fails like [`GptConfig::validate`] when the mode does not fit
    /// the shape.
    pub fn with_fused(mut self, fused: FusedMode) -> Result<Self, ModelError> {
        let config = GptConfig {
            fused,
            ..self.config.clone()
        };
        config.validate()?;
        self.config = config;
        Ok(self)
    }
}

impl<B: FusedOps> Gpt<B> {
    /// Next-token logits `[batch, seq, vocab]` for token ids `[batch, seq]`. The logits are
    /// materialised, so the head's loss is not fused here (attention and MLP are, per
    /// [`GptConfig::fused`]).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, ModelError> {
        check_tokens(&self.config, &tokens, &(0..self.num_layers()))?;
        let fused = self.config.fused::<B>();
        let mut x = self.embed.forward(tokens);
        for block in &self.blocks {
            x = block.forward(x, fused)?;
        }
        self.head.logits(x, Some(&self.embed))
    }
}

impl<B: FusedOps> PipelineModel<B> for Gpt<B> {
    type Stage = GptStage<B>;

    fn num_layers(&self) -> usize {
        self.blocks.len() + 2
    }

    fn layer_costs(&self) -> Vec<f64> {
        self.config.layer_costs()
    }

    fn stage(&self, layers: Range<usize>) -> Result<GptStage<B>, ModelError> {
        let n = self.num_layers();
        check_range(&layers, n)?;
        let head_layer = n - 1;
        let (has_embed, has_head) = (layers.contains(&0), layers.contains(&head_layer));
        if self.config.tied_head && has_embed != has_head {
            return Err(ModelError::TiedHeadAcrossStages {
                layers,
                head: head_layer,
            });
        }
        // Block i is layer i + 1.
        let blocks = layers.start.max(1) - 1..layers.end.min(head_layer) - 1;
        Ok(GptStage {
            embed: has_embed.then(|| self.embed.clone()),
            blocks: self.blocks[blocks].to_vec(),
            head: has_head.then(|| self.head.clone()),
            start: layers.start,
            end: layers.end,
            num_layers: n,
            config: self.config.clone(),
        })
    }
}

/// A contiguous range of a [`Gpt`]'s layers, holding only their parameters.
#[derive(Module, Debug)]
pub struct GptStage<B: Backend> {
    embed: Option<GptEmbedding<B>>,
    blocks: Vec<GptBlock<B>>,
    head: Option<GptHead<B>>,
    start: usize,
    end: usize,
    num_layers: usize,
    config: GptConfig,
}

impl<B: FusedOps> PipelineStage<B> for GptStage<B> {
    fn layers(&self) -> Range<usize> {
        self.start..self.end
    }

    fn is_last(&self) -> bool {
        self.end == self.num_layers
    }

    fn target_classes(&self) -> Option<usize> {
        Some(self.config.vocab_size)
    }

    /// Every projection is a [`super::SplitLinear`]. Two exceptions compute their weight
    /// gradient in `I` all the same, because their kernels produce it with the input
    /// gradient: the fused MLP's first matrix and the fused head; the tied head's matrix is
    /// the token embedding's, whose gradient `I` computes anyway.
    fn splits_weight_grads(&self) -> bool {
        true
    }

    fn param_paths(&self) -> Result<Vec<String>, ModelError> {
        Ok(model_paths(self, self.start.max(1) - 1))
    }

    fn forward(
        &self,
        input: StageInput<B>,
        targets: Option<&Targets<B>>,
    ) -> Result<StageOutput<B>, ModelError> {
        let layers = self.layers();
        let wrong = |reason: &str| ModelError::StageInput {
            layers: layers.clone(),
            reason: reason.into(),
        };
        let mut x = match (input, &self.embed) {
            (StageInput::Data(Inputs::Tokens(tokens)), Some(embed)) => {
                check_tokens(&self.config, &tokens, &layers)?;
                embed.forward(tokens)
            }
            (StageInput::Data(Inputs::Features(_)), Some(_)) => {
                return Err(wrong("the GPT reads token ids, not feature vectors"))
            }
            (StageInput::Data(_), None) => {
                return Err(wrong(
                    "this stage starts after the embedding and expects the previous stage's \
                     hidden states, not the micro-batch's inputs",
                ))
            }
            (StageInput::Hidden(_), Some(_)) => {
                return Err(wrong(
                    "this stage holds the embedding and expects token ids",
                ))
            }
            (StageInput::Hidden(hidden), None) => {
                let [_, seq, width] = hidden.dims();
                if width != self.config.hidden || seq > self.config.seq_len {
                    return Err(ModelError::shape(
                        format!("hidden states entering stage {layers:?}"),
                        format!(
                            "[batch, seq ≤ {}, {}]",
                            self.config.seq_len, self.config.hidden
                        ),
                        format!("{:?}", hidden.dims()),
                    ));
                }
                hidden
            }
        };
        let fused = self.config.fused::<B>();
        for block in &self.blocks {
            x = block.forward(x, fused)?;
        }
        let Some(head) = &self.head else {
            return Ok(StageOutput::Hidden(x));
        };
        let targets = match targets {
            Some(Targets::Tokens(t)) => t.clone(),
            Some(Targets::Values(_)) => return Err(wrong("the GPT's targets are token ids")),
            None => return Err(wrong("the last stage needs the micro-batch's targets")),
        };
        let [batch, seq, _] = x.dims();
        if targets.dims() != [batch, seq] {
            return Err(ModelError::shape(
                "target token ids",
                format!("[{batch}, {seq}] (the inputs' shape)"),
                format!("{:?}", targets.dims()),
            ));
        }
        Ok(StageOutput::Loss(head.loss(
            x,
            self.embed.as_ref(),
            targets,
            fused.head,
        )?))
    }
}

/// Token ids must be `[batch ≥ 1, 1 ≤ seq ≤ seq_len]`.
fn check_tokens<B: Backend>(
    config: &GptConfig,
    tokens: &Tensor<B, 2, Int>,
    layers: &Range<usize>,
) -> Result<(), ModelError> {
    let [batch, seq] = tokens.dims();
    if batch == 0 || seq == 0 || seq > config.seq_len {
        return Err(ModelError::shape(
            format!("token ids entering stage {layers:?}"),
            format!("[batch ≥ 1, 1 ≤ seq ≤ {}]", config.seq_len),
            format!("{:?}", tokens.dims()),
        ));
    }
    Ok(())
}
