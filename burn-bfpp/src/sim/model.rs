//! What is being trained: a GPT shape with the public FLOP, parameter and activation formulas,
//! or the `unit` model whose stage times are exact small numbers for checking closed forms.

use serde::{Deserialize, Serialize};

use super::SimError;

/// Element type of weights, gradients and activations (mixed precision keeps an fp32 master
/// copy in the optimizer state for the 16-bit types).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16 (the default; what the hardware peaks are quoted for).
    #[default]
    Bf16,
    /// IEEE half precision.
    Fp16,
    /// IEEE single precision (no separate master copy).
    Fp32,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }

    /// Optimizer-state bytes per parameter for Adam: fp32 master weights, first and second
    /// moments (4 + 4 + 4 = 12) for 16-bit training, as in the reference's 2 + 2 + 12 count
    /// (Rajbhandari et al. 2020, "ZeRO", §3.1); fp32 training needs no master copy (4 + 4).
    pub fn optimizer_bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 12,
            Dtype::Fp32 => 8,
        }
    }
}

/// A decoder-only transformer (GPT) shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptShape {
    /// Transformer blocks L.
    pub layers: usize,
    /// Hidden size h.
    pub hidden: usize,
    /// Attention heads a (must divide h, and be divisible by the tensor-parallel size).
    pub heads: usize,
    /// Sequence length s.
    pub sequence: usize,
    /// Vocabulary size (padded, as Megatron-LM pads it to a multiple of 128·T).
    pub vocabulary: usize,
}

/// The exact-check model: every stage's forward takes `forward_time`, its backward
/// `forward_time · backward_ratio`; communication and collectives are free.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitModel {
    /// Duration of one stage forward (time units).
    #[serde(default = "one")]
    pub forward_time: f64,
    /// Backward duration ÷ forward duration (2 for a transformer: two GEMMs per forward GEMM).
    #[serde(default = "two")]
    pub backward_ratio: f64,
    /// Parameters per stage, so memory accounting can be checked by hand (default 0).
    #[serde(default)]
    pub stage_parameters: u64,
    /// Activation bytes one micro-batch leaves alive in one stage (default 0).
    #[serde(default)]
    pub stage_activation_bytes: u64,
}

fn one() -> f64 {
    1.0
}
fn two() -> f64 {
    2.0
}

impl Default for UnitModel {
    fn default() -> Self {
        UnitModel {
            forward_time: 1.0,
            backward_ratio: 2.0,
            stage_parameters: 0,
            stage_activation_bytes: 0,
        }
    }
}

/// The model being simulated. In TOML: `kind = "gpt"` with the [`GptShape`] fields, or
/// `kind = "unit"` with the [`UnitModel`] fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelConfig {
    /// A GPT shape costed with the public formulas.
    Gpt(GptShape),
    /// Unit stage times, free communication.
    Unit(UnitModel),
}

/// Names accepted by [`ModelConfig::preset`].
pub const MODEL_PRESETS: [&str; 4] = ["gpt-1.3b", "gpt-6.7b", "gpt-52b", "unit"];

impl ModelConfig {
    /// A built-in model. The error lists the valid names.
    pub fn preset(name: &str) -> Result<Self, SimError> {
        let gpt = |layers, hidden, heads| {
            ModelConfig::Gpt(GptShape {
                layers,
                hidden,
                heads,
                // GPT-3's context length (Brown et al. 2020, §2.1).
                sequence: 2048,
                // GPT-2's 50 257 tokens padded to a multiple of 1024, as Megatron-LM does.
                vocabulary: 51200,
            })
        };
        match name {
            // GPT-3 XL (Brown et al. 2020, Table 2.1: 24 layers, d_model 2048); 16 heads of 128
            // so the head count divides the hidden size. 12·L·h² + embeddings ≈ 1.3 B.
            "gpt-1.3b" => Ok(gpt(24, 2048, 16)),
            // GPT-3 6.7B (Brown et al. 2020, Table 2.1: 32 layers, d_model 4096, 32 heads).
            "gpt-6.7b" => Ok(gpt(32, 4096, 32)),
            // The reference's ~52 B shape (12·64·8192² ≈ 51.5 B; an assumption, not the paper's).
            "gpt-52b" => Ok(gpt(64, 8192, 64)),
            "unit" => Ok(ModelConfig::Unit(UnitModel::default())),
            other => Err(SimError::UnknownPreset {
                what: "model",
                name: other.to_string(),
                valid: MODEL_PRESETS.join(", "),
            }),
        }
    }

    /// Parse a model from TOML (a `kind` key and the variant's fields).
    pub fn from_toml_str(text: &str) -> Result<Self, SimError> {
        let model: ModelConfig = toml::from_str(text)?;
        model.check()?;
        Ok(model)
    }

    /// Reject shapes the formulas cannot cost.
    pub fn check(&self) -> Result<(), SimError> {
        match self {
            ModelConfig::Gpt(g) => {
                if [g.layers, g.hidden, g.heads, g.sequence, g.vocabulary].contains(&0) {
                    return Err(SimError::Config(
                        "every GPT dimension (layers, hidden, heads, sequence, vocabulary) must be positive"
                            .into(),
                    ));
                }
                if g.hidden % g.heads != 0 {
                    return Err(SimError::Config(format!(
                        "heads={} must divide hidden={}",
                        g.heads, g.hidden
                    )));
                }
                Ok(())
            }
            ModelConfig::Unit(u) => {
                let positive = |x: f64| x > 0.0 && x.is_finite();
                if !positive(u.forward_time) || !positive(u.backward_ratio) {
                    return Err(SimError::Config(
                        "unit model: forward_time and backward_ratio must be positive and finite"
                            .into(),
                    ));
                }
                Ok(())
            }
        }
    }
}

impl GptShape {
    /// Forward FLOPs of one transformer block for `b` samples: 24·b·s·h² + 4·b·s²·h
    /// (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    /// Using Megatron-LM", §5.1; only the matrix multiplications are counted).
    pub fn layer_forward_flops(&self, b: usize) -> f64 {
        let (b, s, h) = (b as f64, self.sequence as f64, self.hidden as f64);
        24.0 * b * s * h * h + 4.0 * b * s * s * h
    }

    /// Forward FLOPs of the output projection onto the vocabulary: 2·b·s·h·vocab (same source).
    pub fn head_forward_flops(&self, b: usize) -> f64 {
        2.0 * b as f64 * self.sequence as f64 * self.hidden as f64 * self.vocabulary as f64
    }

    /// Model FLOPs of one training step over `samples` sequences, without recomputation:
    /// 72·B·s·L·h²·(1 + s/(6h) + vocab/(12·L·h)) (Narayanan et al. 2021, eq. 3). With full
    /// recomputation the hardware does 96/72 of this, but model FLOPs (what MFU counts,
    /// Chowdhery et al. 2022, "PaLM", App. B) stay the same.
    pub fn step_model_flops(&self, samples: usize) -> f64 {
        let (b, s, l, h, v) = (
            samples as f64,
            self.sequence as f64,
            self.layers as f64,
            self.hidden as f64,
            self.vocabulary as f64,
        );
        72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
    }

    /// Parameters of one block: 12·h² weights + 13·h biases and layer-norm gains
    /// (Narayanan et al. 2021, §5.1).
    pub fn layer_parameters(&self) -> u64 {
        let h = self.hidden as u64;
        12 * h * h + 13 * h
    }

    /// Parameters of the token and position embeddings (first stage): vocab·h + s·h.
    pub fn embedding_parameters(&self) -> u64 {
        (self.vocabulary as u64 + self.sequence as u64) * self.hidden as u64
    }

    /// Parameters of the head (last stage): the output projection vocab·h — tied to the token
    /// embedding, but a pipeline keeps a copy on the last stage as Megatron-LM does — plus the
    /// final layer norm (2·h).
    pub fn head_parameters(&self) -> u64 {
        (self.vocabulary as u64 + 2) * self.hidden as u64
    }

    /// Bytes of activations one block keeps for the backward of one micro-batch of `b` samples
    /// with tensor-parallel size `t` (no sequence parallelism): s·b·h·(10 + 24/t + 5·a·s/(h·t))
    /// (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    /// Models", eq. 2; 34 + 5·a·s/h at t = 1). Flash attention never stores the a·s² score
    /// and softmax tensors, which removes the 5·a·s/(h·t) term. With full recomputation only
    /// the block's 16-bit input, 2·s·b·h bytes, is kept (same paper, §4.1).
    pub fn layer_activation_bytes(&self, b: usize, t: usize, flash: bool, recompute: bool) -> f64 {
        let (s, b, h, a, t) = (
            self.sequence as f64,
            b as f64,
            self.hidden as f64,
            self.heads as f64,
            t as f64,
        );
        if recompute {
            return 2.0 * s * b * h;
        }
        let attention = if flash { 0.0 } else { 5.0 * a * s / (h * t) };
        s * b * h * (10.0 + 24.0 / t + attention)
    }

    /// Bytes one block keeps from a split backward's `I` to its `W`, in `elem`-byte values:
    /// the input and the output gradient of each of its matrices, per token 7·h inputs (the
    /// normed input shared by Q, K and V, the attention output, the second normed input,
    /// the 4·h MLP activation) and 9·h output gradients (Q, K, V, output, 4·h, h), the
    /// matrices split over `t` tensor-parallel ranks.
    pub fn layer_weight_grad_bytes(&self, b: usize, t: usize, elem: u64) -> f64 {
        let (s, b, h) = (self.sequence as f64, b as f64, self.hidden as f64);
        16.0 * s * b * h * elem as f64 / t as f64
    }

    /// The head's share of [`Self::layer_weight_grad_bytes`]: its input and the gradient of
    /// the logits, s·b·(h + vocab/t) values.
    pub fn head_weight_grad_bytes(&self, b: usize, t: usize, elem: u64) -> f64 {
        let (s, b, h) = (self.sequence as f64, b as f64, self.hidden as f64);
        s * b * (h + self.vocabulary as f64 / t as f64) * elem as f64
    }

    /// Bytes the last stage keeps for the loss: fp32 logits, 4·s·b·vocab/t
    /// (Korthikanti et al. 2022, §4.3).
    pub fn loss_activation_bytes(&self, b: usize, t: usize) -> f64 {
        4.0 * self.sequence as f64 * b as f64 * self.vocabulary as f64 / t as f64
    }

    /// Elements of one pipeline message: micro-batch · s · h (a stage's output activation, or
    /// the gradient of its input).
    pub fn boundary_elements(&self, b: usize) -> u64 {
        (b * self.sequence * self.hidden) as u64
    }

    /// The matrix multiplications of one block's forward on one tensor-parallel rank, as
    /// `(m, n, k, batch)`: QKV projection, attention scores, scores × values, output
    /// projection, and the two MLP matrices (4·h wide). Their FLOPs sum to
    /// [`GptShape::layer_forward_flops`] ÷ t.
    pub fn layer_gemms(&self, b: usize, t: usize) -> [(usize, usize, usize, usize); 6] {
        let (s, h) = (self.sequence, self.hidden);
        let d = h / self.heads;
        let tokens = b * s;
        let local_heads = b * self.heads / t;
        [
            (tokens, 3 * h / t, h, 1),
            (s, s, d, local_heads),
            (s, d, s, local_heads),
            (tokens, h, h / t, 1),
            (tokens, 4 * h / t, h, 1),
            (tokens, h, 4 * h / t, 1),
        ]
    }
}
