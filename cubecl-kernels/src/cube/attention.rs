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
use super::{
    attention_accumulators, attention_kernel, attention_tiles, output, AccumulatorPlace,
    AttentionKernel, TileShape, TILED_LAUNCHES,
};

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

/// Shared memory a tile kernel may declare: what the device reports, at most this. CubeCL's
/// CUDA runtime opts every kernel into the shared memory it declares (past the 48 KiB CUDA
/// gives without the attribute), so the cap is a choice: 112 KiB keeps two cubes resident
/// per streaming multiprocessor on Hopper (228 KB) and one on Ampere (164 KB).
const TILES_SHARED_CAP: usize = 112 * 1024;

/// Lanes per plane of the tile kernels where their fragment products run on the lanes (no
/// tensor cores): those planes need no hardware subgroup (every barrier is a cube barrier),
/// so they take CUDA's warp width and run the index arithmetic of the GPU's kernels, for
/// example two lanes per softmax row, also on a CPU Vulkan device whose subgroups are 8 wide.
const EMULATED_PLANE: usize = 32;

/// The cube shapes a tile kernel may run with, `(planes, stream_frags)`, most preferred first:
/// the first that fits in shared memory is taken. A wider streamed tile means fewer barriers,
/// staging rounds and accumulator round trips per key; more planes share each staged tile
/// among more rows. Not yet tuned on a GPU: `kernel_bench --attn-tiles` times any of them,
/// and [`set_attention_tiles`] forces one.
const TILE_SHAPES: [(usize, usize); 9] = [
    (4, 4),
    (4, 2),
    (2, 4),
    (2, 2),
    (4, 1),
    (2, 1),
    (1, 4),
    (1, 2),
    (1, 1),
];

/// How one tile kernel runs on a device: its cube and whether its products use tensor cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TilePlan {
    /// Planes (warps) per cube, each owning 16 rows of the kernel's output.
    pub(crate) planes: usize,
    /// Rows of the streamed tile (keys for the forward and dQ, queries for dK/dV), in 16-row
    /// fragments.
    pub(crate) stream_frags: usize,
    /// Lanes per plane, the cube's x dimension (fragments are plane-wide).
    pub(crate) plane_dim: usize,
    /// Whether the fragment products run on tensor cores (`cmma`).
    pub(crate) use_cmma: bool,
    /// Whether a plane's own data is ordered with a warp barrier instead of a cube barrier
    /// (CUDA only; see [`super::tiles::sync_plane_data`]).
    pub(crate) warp_sync: bool,
    /// Whether the accumulator blocks stay in registers between streamed tiles
    /// ([`AccumulatorPlace::Registers`]) rather than in shared memory.
    pub(crate) acc_in_regs: bool,
}

impl TilePlan {
    /// The cube of one launch.
    pub(crate) fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.plane_dim as u32, self.planes as u32)
    }

    /// Cubes along the rows a cube owns (`rows` query rows, or key rows for dK/dV).
    pub(crate) fn cubes_for(&self, rows: usize) -> u32 {
        rows.div_ceil(self.planes * FRAG) as u32
    }
}

/// Shared memory `kernel` declares for a cube of `planes` planes streaming tiles of
/// `stream_frags` fragments, its accumulators in registers (`acc_in_regs`) or in shared
/// memory. The backward kernels declare no accumulator blocks when they keep them in
/// registers; the forward keeps its block for the rescale either way.
pub(crate) fn tile_shared_bytes(
    kernel: TileKernel,
    planes: usize,
    stream_frags: usize,
    head_dim: usize,
    elem_bytes: usize,
    acc_in_regs: bool,
) -> usize {
    match kernel {
        TileKernel::Forward => shared_bytes(planes, stream_frags, head_dim, elem_bytes),
        TileKernel::Dq => dq_shared_bytes(planes, stream_frags, head_dim, elem_bytes, acc_in_regs),
        TileKernel::DkDv => {
            dkdv_shared_bytes(planes, stream_frags, head_dim, elem_bytes, acc_in_regs)
        }
    }
}

/// The tile kernels, for choosing the cube shape each fits in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileKernel {
    Forward,
    Dq,
    DkDv,
}

/// How a tile kernel runs on this device for `dtype` and `head_dim`, or `None` when it does
/// not apply (see [`plan_tiles`]).
pub(crate) fn tiles_plan<R: CubeRuntime>(
    client: &ComputeClient<R>,
    kernel: TileKernel,
    dtype: DType,
    head_dim: usize,
) -> Option<TilePlan> {
    let props = client.properties();
    let hw = &props.hardware;
    plan_tiles(
        attention_kernel(),
        attention_tiles(),
        attention_accumulators(),
        has_tile_fragments(props.features.matmul.cmma.iter(), dtype),
        R::name(client) == "cuda",
        hw.plane_size_max.max(1) as usize,
        hw.max_shared_memory_size,
        kernel,
        dtype,
        head_dim,
    )
}

/// Whether all three tile kernels (forward, dQ, dK/dV) run on tensor cores under `plan`
/// (a device's or a target's [`plan_tiles`] for one dtype and head dimension).
pub(crate) fn all_tiles_on_tensor_cores(plan: impl Fn(TileKernel) -> Option<TilePlan>) -> bool {
    [TileKernel::Forward, TileKernel::Dq, TileKernel::DkDv]
        .into_iter()
        .all(|kernel| plan(kernel).is_some_and(|p| p.use_cmma))
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

/// The tile kernels' plan from the device facts it depends on, or `None` when they do not
/// apply (the `choice` is [`AttentionKernel::Scalar`], the head dimension is not a multiple
/// of 16, no cube shape fits in shared memory (or the `forced` one does not), or, under
/// [`AttentionKernel::Auto`], the device has no tensor-core fragment of the input type).
/// Fragments are plane-wide, so the cube's x dimension is the hardware plane width
/// `plane_dim` (or [`EMULATED_PLANE`] without tensor cores). `cuda` says whether the runtime
/// is CUDA's, whose warp barriers order shared memory. `accumulators` is where the kernels
/// keep their accumulator blocks (the process-wide choice, or the default for code generated
/// ahead of time).
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_tiles(
    choice: AttentionKernel,
    forced: Option<TileShape>,
    accumulators: AccumulatorPlace,
    has_cmma: bool,
    cuda: bool,
    plane_dim: usize,
    device_shared_bytes: usize,
    kernel: TileKernel,
    dtype: DType,
    head_dim: usize,
) -> Option<TilePlan> {
    if choice == AttentionKernel::Scalar || head_dim % FRAG != 0 {
        return None;
    }
    if !has_cmma && choice == AttentionKernel::Auto {
        return None;
    }
    let budget = device_shared_bytes.min(TILES_SHARED_CAP);
    let acc_in_regs = accumulators == AccumulatorPlace::Registers;
    let (planes, stream_frags) =
        shape_that_fits(forced, kernel, head_dim, dtype.size(), acc_in_regs, budget)?;
    Some(TilePlan {
        planes,
        stream_frags,
        plane_dim: if has_cmma { plane_dim } else { EMULATED_PLANE },
        use_cmma: has_cmma,
        warp_sync: cuda,
        acc_in_regs,
    })
}

/// The `forced` cube shape if it fits in `budget` bytes, else (none forced) the first of
/// [`TILE_SHAPES`] that does.
fn shape_that_fits(
    forced: Option<TileShape>,
    kernel: TileKernel,
    head_dim: usize,
    elem_bytes: usize,
    acc_in_regs: bool,
    budget: usize,
) -> Option<(usize, usize)> {
    let fits = |&(planes, frags): &(usize, usize)| {
        tile_shared_bytes(kernel, planes, frags, head_dim, elem_bytes, acc_in_regs) <= budget
    };
    match forced {
        Some(shape) => Some((shape.planes, shape.stream_frags)).filter(fits),
        None => TILE_SHAPES.into_iter().find(fits),
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
    if let Some(plan) = tiles_plan(&client, TileKernel::Forward, dtype, d) {
        TILED_LAUNCHES[0].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        flash_fwd_tiles_kernel::launch::<R>(
            &client,
            CubeCount::Static(plan.cubes_for(sq), (b * h) as u32, 1),
            plan.cube_dim(),
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
            plan.planes,
            plan.stream_frags,
            plan.plane_dim,
            causal,
            has_mask,
            plan.use_cmma,
            plan.warp_sync,
            plan.acc_in_regs,
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
    if let Some(plan) = tiles_plan(&client, TileKernel::Dq, dtype, d) {
        TILED_LAUNCHES[1].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        flash_dq_tiles_kernel::launch::<R>(
            &client,
            CubeCount::Static(plan.cubes_for(sq), (b * h) as u32, 1),
            plan.cube_dim(),
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
            plan.planes,
            plan.stream_frags,
            plan.plane_dim,
            causal,
            has_mask,
            plan.use_cmma,
            plan.warp_sync,
            plan.acc_in_regs,
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
    if let Some(plan) = tiles_plan(&client, TileKernel::DkDv, dtype, d) {
        TILED_LAUNCHES[2].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        flash_dkdv_tiles_kernel::launch::<R>(
            &client,
            CubeCount::Static(plan.cubes_for(sk), (b * h) as u32, 1),
            plan.cube_dim(),
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
            plan.planes,
            plan.stream_frags,
            plan.plane_dim,
            causal,
            has_mask,
            plan.use_cmma,
            plan.warp_sync,
            plan.acc_in_regs,
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
#[path = "attention_tests.rs"]
mod tests;
