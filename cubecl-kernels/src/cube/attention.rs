//! Launchers for the flash-attention kernels on CubeCL backends.

use burn::tensor::backend::Backend;
use burn::tensor::ops::BoolTensor;
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::features::MmaConfig;
use cubecl::prelude::*;

use super::flash_bwd::{flash_dkdv_kernel, flash_dq_kernel};
use super::flash_bwd_tiles::{
    dkdv_shared_bytes, dq_shared_bytes, flash_dkdv_tiles_kernel, flash_dq_tiles_kernel,
};
use super::flash_fwd::flash_fwd_kernel;
use super::flash_fwd_tiles::{flash_fwd_tiles_kernel, shared_bytes};
use super::tiles::FRAG;
use super::{attention_kernel, output, AttentionKernel, TILED_LAUNCHES};

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

/// Shared memory the tile kernel may declare: what the device reports, at most the 48 KiB
/// CUDA gives a kernel without an opt-in attribute.
const TILES_SHARED_CAP: usize = 48 * 1024;

/// The tile kernels, for choosing how many planes fit in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileKernel {
    Forward,
    Dq,
    DkDv,
}

/// How a tile kernel runs on this device for `dtype` and `head_dim`: `(planes, plane_dim,
/// use_cmma)`, or `None` when it does not apply (see [`plan_tiles`]).
pub(crate) fn tiles_plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    kernel: TileKernel,
    dtype: DType,
    head_dim: usize,
) -> Option<(usize, usize, bool)> {
    let props = client.properties();
    let hw = &props.hardware;
    plan_tiles(
        attention_kernel(),
        has_tile_fragments(props.features.matmul.cmma.iter(), dtype),
        hw.plane_size_max.max(1) as usize,
        hw.max_shared_memory_size,
        kernel,
        dtype,
        head_dim,
    )
}

/// Whether all three tile kernels (forward, dQ, dK/dV) run on tensor cores under `plan`
/// (a device's or a target's [`plan_tiles`] for one dtype and head dimension).
pub(crate) fn all_tiles_on_tensor_cores(
    plan: impl Fn(TileKernel) -> Option<(usize, usize, bool)>,
) -> bool {
    [TileKernel::Forward, TileKernel::Dq, TileKernel::DkDv]
        .into_iter()
        .all(|kernel| matches!(plan(kernel), Some((_, _, true))))
}

/// Whether `cmma` (a device's fragment shapes) holds the 16×16×16 fragment of `dtype` with
/// f32 accumulation that the tile kernels multiply with (only f16 and bf16 qualify).
pub(crate) fn has_tile_fragments<'a>(
    mut cmma: impl Iterator<Item = &'a MmaConfig>,
    dtype: DType,
) -> bool {
    let elem: StorageType = dtype.into();
    let f32_: StorageType = DType::F32.into();
    let frag = FRAG as u32;
    matches!(dtype, DType::F16 | DType::BF16)
        && cmma.any(|c| {
            c.a_type == elem
                && c.b_type == elem
                && c.cd_type == f32_
                && (c.m, c.n, c.k) == (frag, frag, frag)
        })
}

/// The tile kernels' plan from the device facts it depends on: `(planes, plane_dim,
/// use_cmma)`, or `None` when they do not apply (the `choice` is
/// [`AttentionKernel::Scalar`], the head dimension is not a multiple of 16, no plane count
/// fits in shared memory, or, under [`AttentionKernel::Auto`], the device has no tensor-core
/// fragment of the input type). Fragments are plane-wide, so the cube's x dimension is the
/// hardware plane width `plane_dim`.
pub(crate) fn plan_tiles(
    choice: AttentionKernel,
    has_cmma: bool,
    plane_dim: usize,
    device_shared_bytes: usize,
    kernel: TileKernel,
    dtype: DType,
    head_dim: usize,
) -> Option<(usize, usize, bool)> {
    if choice == AttentionKernel::Scalar || head_dim % FRAG != 0 {
        return None;
    }
    if !has_cmma && choice == AttentionKernel::Auto {
        return None;
    }
    let budget = device_shared_bytes.min(TILES_SHARED_CAP);
    let planes = planes_that_fit(kernel, head_dim, dtype.size(), budget)?;
    Some((planes, plane_dim, has_cmma))
}

/// The most planes (4, 2 or 1) whose shared memory for `kernel` fits in `budget` bytes.
fn planes_that_fit(
    kernel: TileKernel,
    head_dim: usize,
    elem_bytes: usize,
    budget: usize,
) -> Option<usize> {
    let bytes = match kernel {
        TileKernel::Forward => shared_bytes,
        TileKernel::Dq => dq_shared_bytes,
        TileKernel::DkDv => dkdv_shared_bytes,
    };
    [4, 2, 1]
        .into_iter()
        .find(|&p| bytes(p, head_dim, elem_bytes) <= budget)
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
    if let Some((planes, plane_dim, use_cmma)) = tiles_plan(&client, TileKernel::Forward, dtype, d)
    {
        TILED_LAUNCHES[0].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        flash_fwd_tiles_kernel::launch::<R>(
            &client,
            CubeCount::Static(sq.div_ceil(planes * FRAG) as u32, (b * h) as u32, 1),
            CubeDim::new_2d(plane_dim as u32, planes as u32),
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
            planes,
            plane_dim,
            causal,
            has_mask,
            use_cmma,
            dtype.into(),
        );
        return (out, lse);
    }
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
    if let Some((planes, plane_dim, use_cmma)) = tiles_plan(&client, TileKernel::Dq, dtype, d) {
        TILED_LAUNCHES[1].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        flash_dq_tiles_kernel::launch::<R>(
            &client,
            CubeCount::Static(sq.div_ceil(planes * FRAG) as u32, (b * h) as u32, 1),
            CubeDim::new_2d(plane_dim as u32, planes as u32),
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
            planes,
            plane_dim,
            causal,
            has_mask,
            use_cmma,
            dtype.into(),
        );
    } else {
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
    }
    if let Some((planes, plane_dim, use_cmma)) = tiles_plan(&client, TileKernel::DkDv, dtype, d) {
        TILED_LAUNCHES[2].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        flash_dkdv_tiles_kernel::launch::<R>(
            &client,
            CubeCount::Static(sk.div_ceil(planes * FRAG) as u32, (b * h) as u32, 1),
            CubeDim::new_2d(plane_dim as u32, planes as u32),
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
            planes,
            plane_dim,
            causal,
            has_mask,
            use_cmma,
            dtype.into(),
        );
    } else {
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
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNELS: [TileKernel; 3] = [TileKernel::Forward, TileKernel::Dq, TileKernel::DkDv];

    /// On CUDA (48 KiB without an opt-in) every bf16/f16 head dimension the tile kernels
    /// accept, up to the 128 of the production models, gets at least one plane for all three
    /// kernels, so none of them silently falls back to the portable kernel there.
    #[test]
    fn every_half_head_dim_up_to_128_fits_cuda_shared_memory() {
        for head_dim in (FRAG..=128).step_by(FRAG) {
            for kernel in KERNELS {
                assert!(
                    planes_that_fit(kernel, head_dim, 2, TILES_SHARED_CAP).is_some(),
                    "{kernel:?} at head dim {head_dim} does not fit 48 KiB"
                );
            }
        }
    }

    /// More planes need more shared memory, and the choice is the most planes within the
    /// budget (none when even one plane does not fit).
    #[test]
    fn plane_choice_stays_within_the_budget_and_prefers_more_planes() {
        for kernel in KERNELS {
            let bytes = match kernel {
                TileKernel::Forward => shared_bytes,
                TileKernel::Dq => dq_shared_bytes,
                TileKernel::DkDv => dkdv_shared_bytes,
            };
            for budget in [16 * 1024, 32 * 1024, 48 * 1024] {
                for head_dim in (FRAG..=128).step_by(FRAG) {
                    for elem in [2, 4] {
                        assert!(bytes(2, head_dim, elem) > bytes(1, head_dim, elem));
                        match planes_that_fit(kernel, head_dim, elem, budget) {
                            Some(p) => {
                                assert!(bytes(p, head_dim, elem) <= budget);
                                if p < 4 {
                                    assert!(bytes(p * 2, head_dim, elem) > budget);
                                }
                            }
                            None => assert!(bytes(1, head_dim, elem) > budget),
                        }
                    }
                }
            }
        }
        // lavapipe's 32 KiB: the f16 forward at head dim 128 runs one plane, the f16 dK/dV
        // (two f32 accumulators) does not fit (the wgpu_tiles test relies on both).
        assert_eq!(
            planes_that_fit(TileKernel::Forward, 128, 2, 32 * 1024),
            Some(1)
        );
        assert_eq!(planes_that_fit(TileKernel::DkDv, 128, 2, 32 * 1024), None);
    }
}
