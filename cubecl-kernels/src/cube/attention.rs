//! Launchers for the flash-attention kernels on CubeCL backends.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::flash_fwd::flash_fwd_kernel;
use super::output;
use crate::reference;

/// Query rows per cube (one thread each).
pub(crate) const BLOCK_Q: usize = 32;

/// Keys per shared-memory tile: K and V tiles together take 16 KiB of f32 whatever the head
/// dimension, within the 16 KiB Vulkan guarantees (lavapipe included).
pub(crate) fn block_k(head_dim: usize) -> usize {
    (2048 / head_dim).min(32)
}

/// The key-padding mask as a contiguous f32 `[batch, seq_k]` tensor (1.0 = padded), or, when
/// there is none, a one-element placeholder the kernel never reads.
fn mask_f32<B, R>(mask: Option<BoolTensor<B>>, like: &CubeTensor<R>) -> (CubeTensor<R>, bool)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    match mask {
        Some(m) => (
            into_contiguous(B::bool_into_float(m, FloatDType::F32)),
            true,
        ),
        None => (output(like, Shape::new([1]), DType::F32), false),
    }
}

/// Flash-attention forward on a CubeCL backend: `(out, lse)` with `lse` in f32.
pub(crate) fn forward<B, R>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    mask: Option<BoolTensor<B>>,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let [b, h, sq, d] = q.shape().dims::<4>();
    let sk = k.shape().dims::<4>()[2];
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let (mask, has_mask) = mask_f32::<B, R>(mask, &q);
    let dtype = q.dtype;
    let out = output(&q, Shape::new([b, h, sq, d]), dtype);
    let lse = output(&q, Shape::new([b, h, sq]), DType::F32);
    let client = q.client.clone();
    let count = CubeCount::Static(sq.div_ceil(BLOCK_Q) as u32, (b * h) as u32, 1);
    flash_fwd_kernel::launch::<R>(
        &client,
        count,
        CubeDim::new_1d(BLOCK_Q as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        mask.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        sq as u32,
        sk as u32,
        h as u32,
        1.0 / (d as f32).sqrt(),
        d,
        BLOCK_Q,
        block_k(d),
        causal,
        has_mask,
        dtype.into(),
    );
    (out, lse)
}

/// Flash-attention backward on a CubeCL backend (composed reference until the kernel lands).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    _lse: FloatTensor<B>,
    dout: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    causal: bool,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)
where
    B: Backend,
{
    reference::flash_attention_backward::<B>(q, k, v, out, dout, mask, causal)
}
