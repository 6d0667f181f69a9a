//! Launchers for the flash-attention kernels on CubeCL backends.

use burn::tensor::backend::Backend;
use burn::tensor::ops::BoolTensor;
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::flash_bwd::{flash_dkdv_kernel, flash_dq_kernel};
use super::flash_fwd::flash_fwd_kernel;
use super::output;

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

/// Flash-attention backward on a CubeCL backend: `(dQ, dK, dV)`. `Δ = rowsum(dO∘O)` is a
/// small `[batch, heads, seq_q]` reduction done with standard ops; the two kernels then
/// recompute the probabilities tile by tile.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B, R>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    mask: Option<BoolTensor<B>>,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let [b, h, sq, d] = q.shape().dims::<4>();
    let sk = k.shape().dims::<4>()[2];
    let f32_ = |t: CubeTensor<R>| into_contiguous(B::float_cast(t, FloatDType::F32));
    let delta = {
        let prod = B::float_mul(f32_(dout.clone()), f32_(out));
        into_contiguous(B::float_reshape(
            B::float_sum_dim(prod, 3),
            Shape::new([b, h, sq]),
        ))
    };
    let lse = f32_(lse);
    let (q, k, v, dout) = (
        into_contiguous(q),
        into_contiguous(k),
        into_contiguous(v),
        into_contiguous(dout),
    );
    let (mask, has_mask) = mask_f32::<B, R>(mask, &q);
    let dtype = q.dtype;
    let dq = output(&q, Shape::new([b, h, sq, d]), dtype);
    let dk = output(&q, Shape::new([b, h, sk, d]), dtype);
    let dv = output(&q, Shape::new([b, h, sk, d]), dtype);
    let client = q.client.clone();
    let scale = 1.0 / (d as f32).sqrt();
    flash_dq_kernel::launch::<R>(
        &client,
        CubeCount::Static(sq.div_ceil(BLOCK_Q) as u32, (b * h) as u32, 1),
        CubeDim::new_1d(BLOCK_Q as u32),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        dout.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        mask.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        sq as u32,
        sk as u32,
        h as u32,
        scale,
        d,
        BLOCK_Q,
        block_k(d),
        causal,
        has_mask,
        dtype.into(),
    );
    // Roles swap: 32 key rows per cube (one thread each), query tiles of `block_k(d)` rows
    // streamed through the same 16 KiB of shared memory.
    flash_dkdv_kernel::launch::<R>(
        &client,
        CubeCount::Static(sk.div_ceil(BLOCK_Q) as u32, (b * h) as u32, 1),
        CubeDim::new_1d(BLOCK_Q as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        dout.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        mask.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        sq as u32,
        sk as u32,
        h as u32,
        scale,
        d,
        BLOCK_Q,
        block_k(d),
        causal,
        has_mask,
        dtype.into(),
    );
    (dq, dk, dv)
}
