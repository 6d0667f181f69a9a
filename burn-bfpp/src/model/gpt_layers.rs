//! The layers of the reference GPT ([`super::gpt::Gpt`]): embedding, causal self-attention,
//! pre-LayerNorm block and head with its loss, each usable on its own as a Burn [`Module`].

use burn::module::Module;
use burn::nn::{Dropout, Embedding, Gelu, LayerNorm};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};
use cubecl_kernels::FusedOps;

use super::split_linear::SplitLinear;
use super::ModelError;

/// Which parts of the forward take the fused path, decided once per forward.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fused {
    pub(super) attention: bool,
    pub(super) mlp: bool,
    pub(super) head: bool,
}

/// Layer 0: token embedding plus learned position embedding.
#[derive(Module, Debug)]
pub struct GptEmbedding<B: Backend> {
    pub(super) tokens: Embedding<B>,
    pub(super) positions: Embedding<B>,
    pub(super) dropout: Dropout,
}

impl<B: Backend> GptEmbedding<B> {
    pub(super) fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [_, seq] = tokens.dims();
        let positions =
            Tensor::<B, 1, Int>::arange(0..seq as i64, &tokens.device()).reshape([1, seq]);
        // [batch, seq, hidden] + [1, seq, hidden]: the positions broadcast over the batch.
        let x = self.tokens.forward(tokens) + self.positions.forward(positions);
        self.dropout.forward(x)
    }
}

/// Multi-head causal self-attention written out (matmul, mask, softmax) rather than Burn's
/// attention op, so every step is visible and differentiable on any backend.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    pub(super) query: SplitLinear<B>,
    pub(super) key: SplitLinear<B>,
    pub(super) value: SplitLinear<B>,
    pub(super) output: SplitLinear<B>,
    pub(super) heads: usize,
}

impl<B: FusedOps> CausalSelfAttention<B> {
    pub(super) fn forward(&self, x: Tensor<B, 3>, fused: bool) -> Result<Tensor<B, 3>, ModelError> {
        let [batch, seq, hidden] = x.dims();
        let (heads, head_dim) = (self.heads, hidden / self.heads);
        // [batch, seq, hidden] → [batch, heads, seq, head_dim]
        let split = |t: Tensor<B, 3>| t.reshape([batch, seq, heads, head_dim]).swap_dims(1, 2);
        let q = split(self.query.forward(x.clone()));
        let k = split(self.key.forward(x.clone()));
        let v = split(self.value.forward(x));
        if fused {
            // Never materialises the [seq × seq] scores on backends with kernels.
            let (y, _log_sum_exp) = cubecl_kernels::flash_attention(q, k, v, None, true)?;
            return Ok(self
                .output
                .forward(y.swap_dims(1, 2).reshape([batch, seq, hidden])));
        }
        let scores = q.matmul(k.transpose()).div_scalar((head_dim as f64).sqrt());
        // `tril_mask` is true above the diagonal: the future positions a token may not see.
        let future = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &scores.device())
            .reshape([1, 1, seq, seq])
            .expand([batch, heads, seq, seq]);
        let weights = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        let y = weights
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([batch, seq, hidden]);
        Ok(self.output.forward(y))
    }
}

/// One pre-LayerNorm transformer block: `x + attn(ln(x))`, then `x + mlp(ln(x))`.
#[derive(Module, Debug)]
pub struct GptBlock<B: Backend> {
    pub(super) norm1: LayerNorm<B>,
    pub(super) attention: CausalSelfAttention<B>,
    pub(super) norm2: LayerNorm<B>,
    pub(super) fc: SplitLinear<B>,
    pub(super) gelu: Gelu,
    pub(super) proj: SplitLinear<B>,
    pub(super) dropout: Dropout,
}

impl<B: FusedOps> GptBlock<B> {
    pub(super) fn forward(
        &self,
        x: Tensor<B, 3>,
        fused: Fused,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let attended = self
            .attention
            .forward(self.norm1.forward(x.clone()), fused.attention)?;
        let x = x + self.dropout.forward(attended);
        let normed = self.norm2.forward(x.clone());
        let activated = if fused.mlp {
            let [batch, seq, hidden] = normed.dims();
            let width = self.fc.weight.dims()[1];
            let bias = match &self.fc.bias {
                Some(b) => b.val(),
                None => Tensor::zeros([width], &normed.device()),
            };
            cubecl_kernels::linear_gelu(
                normed.reshape([batch * seq, hidden]),
                self.fc.weight.val(),
                bias,
            )?
            .reshape([batch, seq, width])
        } else {
            self.gelu.forward(self.fc.forward(normed))
        };
        let mlp = self.proj.forward(activated);
        Ok(x + self.dropout.forward(mlp))
    }
}

/// The last layer: final LayerNorm and the projection to the vocabulary (its own matrix, or
/// the token embedding's when tied).
#[derive(Module, Debug)]
pub struct GptHead<B: Backend> {
    pub(super) norm: LayerNorm<B>,
    pub(super) output: Option<SplitLinear<B>>,
}

impl<B: FusedOps> GptHead<B> {
    pub(super) fn logits(
        &self,
        x: Tensor<B, 3>,
        embed: Option<&GptEmbedding<B>>,
    ) -> Result<Tensor<B, 3>, ModelError> {
        let [batch, seq, hidden] = x.dims();
        let x = self.norm.forward(x);
        match (&self.output, embed) {
            (Some(output), _) => Ok(output.forward(x)),
            (None, Some(embed)) => {
                // Tied: logits = x · Eᵀ with E the [vocab, hidden] token embedding.
                let weight = embed.tokens.weight.val();
                let [vocab, _] = weight.dims();
                let flat = x.reshape([batch * seq, hidden]).matmul(weight.transpose());
                Ok(flat.reshape([batch, seq, vocab]))
            }
            (None, None) => Err(ModelError::Config(
                "the tied head needs the token embedding in its stage; set tied_head = false \
                 to split the model"
                    .into(),
            )),
        }
    }

    /// Mean next-token cross-entropy of the head's logits against `targets`; fused, the
    /// `[tokens × vocab]` logits are never materialised on backends with kernels.
    pub(super) fn loss(
        &self,
        x: Tensor<B, 3>,
        embed: Option<&GptEmbedding<B>>,
        targets: Tensor<B, 2, Int>,
        fused: bool,
    ) -> Result<Tensor<B, 1>, ModelError> {
        match (&self.output, fused) {
            (Some(output), true) => {
                let [batch, seq, hidden] = x.dims();
                let h = self.norm.forward(x).reshape([batch * seq, hidden]);
                // No target is ignored: every position has a next token.
                Ok(cubecl_kernels::linear_cross_entropy(
                    h,
                    output.weight.val(),
                    targets.reshape([batch * seq]),
                    -1,
                )?)
            }
            _ => Ok(cross_entropy(self.logits(x, embed)?, targets)),
        }
    }
}

/// Whether flash attention takes heads of this dimension.
pub(super) fn flash_head_dim(head_dim: usize) -> bool {
    head_dim % 16 == 0 && head_dim <= cubecl_kernels::MAX_HEAD_DIM
}

/// Mean next-token cross-entropy over all `batch · seq` positions.
pub(super) fn cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [batch, seq, vocab] = logits.dims();
    let log_probs = log_softmax(logits.reshape([batch * seq, vocab]), 1);
    log_probs
        .gather(1, targets.reshape([batch * seq, 1]))
        .mean()
        .neg()
}
