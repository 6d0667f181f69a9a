//! The backend extension trait: fused ops every backend provides, with composed defaults.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};

use crate::reference;

/// Which fused ops a model takes by default on a backend ([`FusedOps::fused_defaults`]): each
/// is on only where it runs as a kernel and was not measured slower than Burn's own path
/// (docs/benchmarks.md). Memory alone does not turn an op on: a user short of memory forces
/// every op with the model's own switch.
///
/// | backend | attention | MLP (linear + GELU) | head (linear cross-entropy) |
/// |---|---|---|---|
/// | CUDA | off: 0.30× Burn's materialised path, forward + backward on an H200 | on: 1.33× | on: not yet timed on a GPU; 6–16× less memory |
/// | wgpu | off: 3.2× slower on lavapipe | off: 1.15× slower on lavapipe | off: 1.16× slower on lavapipe |
/// | others (Flex) | off: no kernels | off | off |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedDefaults {
    /// Flash attention.
    pub attention: bool,
    /// Linear + bias + GELU.
    pub mlp: bool,
    /// Linear projection to the vocabulary fused with the cross-entropy.
    pub head: bool,
}

impl FusedDefaults {
    /// No fused op.
    pub const NONE: FusedDefaults = FusedDefaults {
        attention: false,
        mlp: false,
        head: false,
    };
}

/// Fused attention, MLP and language-model-head ops as a Burn backend extension.
///
/// Every method has a default made of standard tensor ops ([`crate::reference`]), so any
/// backend can implement the trait with an empty `impl`; the CubeCL backends override them
/// with kernels that never materialise `[seq × seq]` scores or `[tokens × vocab]` logits, and
/// `Autodiff<B>` overrides the forwards to register the backward methods as gradients.
///
/// The methods take primitives and assume validated shapes; call them through the checked
/// functions [`crate::flash_attention`], [`crate::linear_gelu`] and
/// [`crate::linear_cross_entropy`].
///
/// Layouts: `q` is `[batch, heads, seq_q, head_dim]`, `k` and `v` `[batch, heads, seq_k,
/// head_dim]`, `key_padding_mask` `[batch, seq_k]` with `true` for padded (hidden) keys, the
/// log-sum-exp `[batch, heads, seq_q]`. `x` is `[tokens, d_in]`, `w` `[d_in, d_out]` (Burn's
/// `Linear` layout), `b` `[d_out]`; `h` is `[tokens, hidden]`, the head `[hidden, vocab]`,
/// `targets` `[tokens]`.
pub trait FusedOps: Backend {
    /// Whether this backend runs the ops as real fused kernels (the CubeCL backends and
    /// `Autodiff` over them) rather than the composed defaults.
    fn fused_kernels() -> bool {
        false
    }

    /// The fused ops a model should take on this backend unless told otherwise: those run as
    /// kernels here and not measured slower than Burn's own path of the same computation
    /// (see [`FusedDefaults`]). None on backends without kernels.
    fn fused_defaults() -> FusedDefaults {
        FusedDefaults::NONE
    }

    /// Attention forward, `softmax(QKᵀ/√d)·V`, with queries and keys aligned at position 0
    /// for `causal`. Returns the output and the per-row log-sum-exp of the scaled scores
    /// (rows that see no key output 0 and get [`reference::EMPTY_ROW_LSE`]).
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::flash_attention::<Self>(q, k, v, key_padding_mask, causal)
    }

    /// Attention backward: `(dQ, dK, dV)` given the forward's output, log-sum-exp and the
    /// output gradient `dout`.
    #[allow(clippy::too_many_arguments)]
    fn fused_flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // The composed path recomputes the probabilities itself; the log-sum-exp is only
        // what lets the kernels avoid storing them.
        let _ = lse;
        reference::flash_attention_backward::<Self>(q, k, v, out, dout, key_padding_mask, causal)
    }

    /// `gelu(x·W + b)` with the exact (erf) GELU.
    fn fused_linear_gelu(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::linear_gelu::<Self>(x, w, b)
    }

    /// `x · w` for `x` `[tokens, d_in]`, `w` `[d_in, d_out]`, whose weight gradient the
    /// autodiff backend defers inside [`crate::defer_weight_grads`] (see
    /// [`crate::split_linear`]); `tag` names the weight. Without autodiff it is a matmul.
    fn deferrable_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        tag: u64,
    ) -> FloatTensor<Self> {
        let _ = tag;
        Self::float_matmul(x, w)
    }

    /// Backward of [`FusedOps::fused_linear_gelu`]: `(dx, dW, db)` from the output gradient.
    fn fused_linear_gelu_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::linear_gelu_backward::<Self>(x, w, b, dy)
    }

    /// Mean cross-entropy of `softmax(h·W)` against `targets`, tokens whose target equals
    /// `ignore_index` excluded from both sum and count (loss 0 when every token is ignored).
    /// Returns the one-element loss and the per-token log-sum-exp of the logits (`[tokens]`;
    /// f32 from the kernels, the input type from the composed default), which the backward
    /// takes so it need not recompute it.
    fn fused_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore_index: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::linear_cross_entropy_with_lse::<Self>(h, w, targets, ignore_index)
    }

    /// Backward of [`FusedOps::fused_linear_cross_entropy`]: `(dh, dW)` scaled by the
    /// one-element loss gradient `dloss`, given the forward's log-sum-exp `lse`.
    fn fused_linear_cross_entropy_backward(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore_index: i64,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // The composed path recomputes the softmax itself, as for attention.
        let _ = lse;
        reference::linear_cross_entropy_backward::<Self>(h, w, targets, ignore_index, dloss)
    }
}

/// Flex (Burn's CPU backend) uses the composed reference implementations.
impl FusedOps for burn::backend::Flex {}
