//! Launchers for the fused linear cross-entropy kernels on CubeCL backends.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, IntDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::cross_entropy::{ce_dh_kernel, ce_dw_kernel, ce_fwd_kernel};
use super::output;

/// Tokens (and vocabulary columns) per tile; also the cube size.
const TILE: usize = 32;

/// Per-token statistics of the forward: loss terms, log-sum-exp, validity (all f32 `[n]`).
struct Rows<R: CubeRuntime> {
    loss: CubeTensor<R>,
    lse: CubeTensor<R>,
    valid: CubeTensor<R>,
}

fn i32_targets<B, R>(targets: CubeTensor<R>) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<IntTensorPrimitive = CubeTensor<R>>,
{
    into_contiguous(B::int_cast(targets, IntDType::I32))
}

fn rows<R: CubeRuntime>(
    h: &CubeTensor<R>,
    w: &CubeTensor<R>,
    targets: &CubeTensor<R>,
    ignore: i32,
) -> Rows<R> {
    let [n, hidden] = h.shape().dims::<2>();
    let vocab = w.shape().dims::<2>()[1];
    let rows = Rows {
        loss: output(h, Shape::new([n]), DType::F32),
        lse: output(h, Shape::new([n]), DType::F32),
        valid: output(h, Shape::new([n]), DType::F32),
    };
    ce_fwd_kernel::launch::<R>(
        &h.client,
        CubeCount::Static(n.div_ceil(TILE) as u32, 1, 1),
        CubeDim::new_1d(TILE as u32),
        h.clone().into_tensor_arg(),
        w.clone().into_tensor_arg(),
        targets.clone().into_tensor_arg(),
        rows.loss.clone().into_tensor_arg(),
        rows.lse.clone().into_tensor_arg(),
        rows.valid.clone().into_tensor_arg(),
        n as u32,
        hidden as u32,
        vocab as u32,
        ignore,
        TILE,
        h.dtype.into(),
    );
    rows
}

/// Number of counted tokens, at least 1, as a one-element f32 tensor (stays on the device).
fn count<B, R>(valid: CubeTensor<R>) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    B::float_clamp_min(B::float_sum(valid), 1.0.into())
}

/// `ignore_index` as the kernels' i32; one outside i32 cannot equal an i32 target, so any
/// out-of-range value maps to one no target takes (targets are class ids ≥ 0).
fn ignore_i32(ignore_index: i64) -> i32 {
    i32::try_from(ignore_index).unwrap_or(i32::MIN)
}

/// Mean loss (one element, input dtype) of the fused linear cross-entropy.
pub(crate) fn forward<B, R>(
    h: CubeTensor<R>,
    w: CubeTensor<R>,
    targets: CubeTensor<R>,
    ignore_index: i64,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>, IntTensorPrimitive = CubeTensor<R>>,
{
    let dtype = h.dtype;
    let (h, w) = (into_contiguous(h), into_contiguous(w));
    let targets = i32_targets::<B, R>(targets);
    let r = rows(&h, &w, &targets, ignore_i32(ignore_index));
    let loss = B::float_div(B::float_sum(r.loss), count::<B, R>(r.valid));
    B::float_cast(loss, FloatDType::from(dtype))
}

/// `(dh, dW)` of the fused linear cross-entropy for the one-element loss gradient `dloss`.
pub(crate) fn backward<B, R>(
    h: CubeTensor<R>,
    w: CubeTensor<R>,
    targets: CubeTensor<R>,
    ignore_index: i64,
    dloss: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>, IntTensorPrimitive = CubeTensor<R>>,
{
    let [n, hidden] = h.shape().dims::<2>();
    let vocab = w.shape().dims::<2>()[1];
    let dtype = h.dtype;
    let (h, w) = (into_contiguous(h), into_contiguous(w));
    let targets = i32_targets::<B, R>(targets);
    // The forward's per-token log-sum-exp is recomputed (one more pass over the vocabulary)
    // rather than saved, so the Autodiff state stays the op's inputs.
    let r = rows(&h, &w, &targets, ignore_i32(ignore_index));
    let dloss = B::float_cast(dloss, FloatDType::F32);
    let scale = B::float_div(dloss, count::<B, R>(r.valid.clone()));
    let coef = into_contiguous(B::float_mul(r.valid, scale));
    let dh = output(&h, Shape::new([n, hidden]), dtype);
    let dw = output(&h, Shape::new([hidden, vocab]), dtype);
    let client = h.client.clone();
    ce_dh_kernel::launch::<R>(
        &client,
        CubeCount::Static(n.div_ceil(TILE) as u32, 1, 1),
        CubeDim::new_1d(TILE as u32),
        h.clone().into_tensor_arg(),
        w.clone().into_tensor_arg(),
        targets.clone().into_tensor_arg(),
        r.lse.clone().into_tensor_arg(),
        coef.clone().into_tensor_arg(),
        dh.clone().into_tensor_arg(),
        n as u32,
        hidden as u32,
        vocab as u32,
        TILE,
        dtype.into(),
    );
    ce_dw_kernel::launch::<R>(
        &client,
        CubeCount::Static(vocab.div_ceil(TILE) as u32, 1, 1),
        CubeDim::new_1d(TILE as u32),
        h.into_tensor_arg(),
        w.into_tensor_arg(),
        targets.into_tensor_arg(),
        r.lse.into_tensor_arg(),
        coef.into_tensor_arg(),
        dw.clone().into_tensor_arg(),
        n as u32,
        hidden as u32,
        vocab as u32,
        TILE,
        dtype.into(),
    );
    (dh, dw)
}
