//! Reference implementations composed from standard Burn tensor ops.
//!
//! These are the `FusedOps` defaults, so every backend (Flex, the CPU backend, in particular)
//! gets correct results; they materialise the `[seq × seq]` scores and the `[tokens × vocab]`
//! logits, which is exactly the memory the CubeCL kernels avoid.
//!
//! The forwards are public so that benchmarks can time Burn's composed path against the
//! kernels; like the [`FusedOps`](crate::FusedOps) methods they take primitives and assume
//! validated shapes. [`EMPTY_ROW_LSE`] is public because `FusedOps` promises it to callers.

use burn::tensor::activation::{gelu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{Bool, Int, Tensor, TensorPrimitive};

/// Log-sum-exp given to rows that see no key at all (every key masked). A finite value
/// rather than `-inf` because WGSL cannot reliably produce infinities, and the kernels and
/// this reference must agree.
pub const EMPTY_ROW_LSE: f64 = -1.0e30;

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `true` where query row `i` may not see key `j`: after the causal limit (`j > i`, queries
/// and keys aligned at position 0) or a padded key. `None` when nothing is hidden.
pub(crate) fn hidden_mask<B: Backend>(
    key_padding_mask: Option<BoolTensor<B>>,
    causal: bool,
    [b, h, sq, sk]: [usize; 4],
    device: &B::Device,
) -> Option<Tensor<B, 4, Bool>> {
    let causal_mask = causal.then(|| {
        let rows = Tensor::<B, 1, Int>::arange(0..sq as i64, device)
            .reshape([sq, 1])
            .expand([sq, sk]);
        let cols = Tensor::<B, 1, Int>::arange(0..sk as i64, device)
            .reshape([1, sk])
            .expand([sq, sk]);
        cols.greater(rows)
            .reshape([1, 1, sq, sk])
            .expand([b, h, sq, sk])
    });
    let pad_mask = key_padding_mask.map(|m| {
        Tensor::<B, 2, Bool>::from_primitive(m)
            .reshape([b, 1, 1, sk])
            .expand([b, h, sq, sk])
    });
    match (causal_mask, pad_mask) {
        (Some(c), Some(p)) => Some(c.bool_or(p)),
        (c, p) => c.or(p),
    }
}

/// Probabilities `P = softmax(scale·QKᵀ)` with hidden entries exactly zero, and the per-row
/// log-sum-exp (`EMPTY_ROW_LSE` for rows that see no key).
fn attention_probs<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    key_padding_mask: Option<BoolTensor<B>>,
    causal: bool,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [b, h, sq, d] = q.dims();
    let sk = k.dims()[2];
    let device = q.device();
    let scale = 1.0 / (d as f64).sqrt();
    let mut scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let hidden = hidden_mask::<B>(key_padding_mask, causal, [b, h, sq, sk], &device);
    if let Some(hidden) = &hidden {
        scores = scores.mask_fill(hidden.clone(), EMPTY_ROW_LSE);
    }
    let max = scores.clone().max_dim(3);
    let mut p = (scores - max.clone()).exp();
    if let Some(hidden) = hidden {
        // A row whose keys are all hidden has max = EMPTY_ROW_LSE and would otherwise
        // average every key uniformly; zero it so such rows output 0.
        p = p.mask_fill(hidden, 0.0);
    }
    let l = p.clone().sum_dim(3);
    let empty = l.clone().equal_elem(0.0);
    let l = l.mask_fill(empty, 1.0);
    let lse = (max + l.clone().log()).reshape([b, h, sq]);
    (p / l, lse)
}

/// Reference attention forward: `(softmax(QKᵀ/√d)·V, log-sum-exp per row)`.
pub fn flash_attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    key_padding_mask: Option<BoolTensor<B>>,
    causal: bool,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (p, lse) = attention_probs::<B>(float(q), float(k), key_padding_mask, causal);
    (prim(p.matmul(float::<B, 4>(v))), prim(lse))
}

/// Reference attention backward: `(dQ, dK, dV)` from the output gradient, by the standard
/// identities `dV = PᵀdO`, `dS = P∘(dO·Vᵀ − rowsum(dO∘O))`, `dQ = dS·K/√d`, `dK = dSᵀ·Q/√d`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_attention_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    dout: FloatTensor<B>,
    key_padding_mask: Option<BoolTensor<B>>,
    causal: bool,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let (out, dout) = (float::<B, 4>(out), float::<B, 4>(dout));
    let scale = 1.0 / (q.dims()[3] as f64).sqrt();
    let (p, _) = attention_probs::<B>(q.clone(), k.clone(), key_padding_mask, causal);
    let dv = p.clone().swap_dims(2, 3).matmul(dout.clone());
    let dp = dout.clone().matmul(v.swap_dims(2, 3));
    let delta = (dout * out).sum_dim(3);
    let ds = p * (dp - delta);
    let dq = ds.clone().matmul(k) * scale;
    let dk = ds.swap_dims(2, 3).matmul(q) * scale;
    (prim(dq), prim(dk), prim(dv))
}

/// Reference `gelu(x·W + b)` (exact, erf-based GELU, as Burn's `gelu`).
pub fn linear_gelu<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: FloatTensor<B>,
) -> FloatTensor<B> {
    let z = float::<B, 2>(x).matmul(float(w)) + float::<B, 1>(b).unsqueeze_dim(0);
    prim(gelu(z))
}

/// Reference backward of `gelu(x·W + b)`: `(dx, dW, db)`.
pub(crate) fn linear_gelu_backward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (x, w) = (float::<B, 2>(x), float::<B, 2>(w));
    let z = x.clone().matmul(w.clone()) + float::<B, 1>(b).unsqueeze_dim(0);
    // gelu'(z) = Φ(z) + z·φ(z), Φ the normal CDF and φ its density.
    let cdf = ((z.clone() * core::f64::consts::FRAC_1_SQRT_2).erf() + 1.0) * 0.5;
    let pdf = (z.clone().powi_scalar(2) * -0.5).exp()
        * (0.5 * core::f64::consts::FRAC_2_SQRT_PI * core::f64::consts::FRAC_1_SQRT_2);
    let dz = float::<B, 2>(dy) * (cdf + z * pdf);
    let dx = dz.clone().matmul(w.transpose());
    let dw = x.transpose().matmul(dz.clone());
    let db = dz.sum_dim(0).reshape([-1]);
    (prim(dx), prim(dw), prim(db))
}

/// Per-token validity (1 for counted targets, 0 for `ignore_index`) and the divisor of the
/// mean (the number of counted targets, at least 1 so an all-ignored batch gives loss 0).
fn ce_weights<B: Backend>(
    targets: &Tensor<B, 1, Int>,
    ignore_index: i64,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let valid = targets.clone().not_equal_elem(ignore_index).float();
    // Kept as a tensor (no host read-back) so the reference never synchronises the device.
    let count = valid.clone().sum().clamp_min(1.0);
    (valid, count)
}

/// Targets with ignored entries replaced by class 0, so that `gather` stays in range; their
/// contribution is removed by the validity weights.
fn safe_targets<B: Backend>(targets: Tensor<B, 1, Int>, ignore_index: i64) -> Tensor<B, 1, Int> {
    let ignored = targets.clone().equal_elem(ignore_index);
    targets.mask_fill(ignored, 0)
}

/// Reference mean cross-entropy of `softmax(h·W)` against `targets`, skipping `ignore_index`.
/// Returns a one-element tensor.
pub fn linear_cross_entropy<B: Backend>(
    h: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
    ignore_index: i64,
) -> FloatTensor<B> {
    linear_cross_entropy_with_lse::<B>(h, w, targets, ignore_index).0
}

/// [`linear_cross_entropy`] and the per-token log-sum-exp of the logits (`[tokens]`).
pub(crate) fn linear_cross_entropy_with_lse<B: Backend>(
    h: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
    ignore_index: i64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let logits = float::<B, 2>(h).matmul(float(w));
    let max = logits.clone().max_dim(1);
    let lse = ((logits.clone() - max.clone()).exp().sum_dim(1).log() + max).reshape([-1]);
    let (valid, count) = ce_weights(&targets, ignore_index);
    let picked = logits
        .gather(1, safe_targets(targets, ignore_index).unsqueeze_dim(1))
        .reshape([-1]);
    (
        prim(((lse.clone() - picked) * valid).sum() / count),
        prim(lse),
    )
}

/// Reference backward of [`linear_cross_entropy`]: `(dh, dW)` scaled by the loss gradient
/// `dloss` (a one-element tensor).
pub(crate) fn linear_cross_entropy_backward<B: Backend>(
    h: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
    ignore_index: i64,
    dloss: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let (h, w) = (float::<B, 2>(h), float::<B, 2>(w));
    let vocab = w.dims()[1];
    let probs = softmax(h.clone().matmul(w.clone()), 1);
    let (valid, count) = ce_weights(&targets, ignore_index);
    let onehot = safe_targets(targets, ignore_index)
        .one_hot::<2>(vocab)
        .float();
    let scale = (valid / count).unsqueeze_dim::<2>(1) * float::<B, 1>(dloss).unsqueeze_dim(0);
    let dlogits = (probs - onehot) * scale;
    let dh = dlogits.clone().matmul(w.transpose());
    let dw = h.transpose().matmul(dlogits);
    (prim(dh), prim(dw))
}
