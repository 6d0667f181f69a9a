//! CubeCL kernels and their `FusedOps` wiring for the CubeCL backends (wgpu, CUDA).
//!
//! The kernels are portable (plain shared memory and registers, f32 accumulation) so that
//! they run on every CubeCL runtime, Mesa's software Vulkan device included. The MLP and the
//! linear cross-entropy run their matmuls through Burn's own (CubeCL's tiled matmul, which
//! can pick tensor-core kernels on CUDA), except f32 products where that matmul would round
//! f32 to TF32 (see [`F32Matmul`]), and fuse everything around them. Attention has kernels of
//! its own: a portable one (one thread per query row), and for f16/bf16 on devices with
//! tensor cores tile kernels (forward and backward) whose matrix products are 16×16×16 `cmma`
//! fragments (see [`AttentionKernel`]).
//!
//! Training needs none of the functions here: the backends pick their kernels themselves.
//! The `set_*` functions are process-wide switches for forcing a kernel, the launch counters
//! ([`tiled_launches`], [`unit_matmul_launches`]) report what ran and the `attention_*`
//! queries what would run, so that tests and benchmarks can check which kernel they measured.

mod attention;
mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda_source;
mod flash_bwd;
mod flash_bwd_tiles;
mod flash_fwd;
mod flash_fwd_tiles;
mod linear_ce;
mod linear_gelu;
mod matmul;
mod mlp;
mod row_acc;
mod tiles;

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, full_device_dtype};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::{ComputeClient, InputScalar};

use crate::FusedOps;

/// The runtime of Burn's CUDA backend (which Burn does not re-export), for the functions here
/// that take a runtime type, such as [`attention_tile_shapes`].
#[cfg(feature = "cuda")]
pub use cubecl::cuda::CudaRuntime;
pub use linear_ce::{set_linear_ce_piece, DEFAULT_ROW_BLOCK, DEFAULT_VOCAB_CHUNK};
pub use matmul::{set_f32_matmul, unit_matmul_launches, F32Matmul};

static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);

/// Which kernels compute flash attention on CubeCL backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Tensor-core tile kernels where the device has 16×16×16 fragments of the input type
    /// with f32 accumulation (f16/bf16 on CUDA) and the head dimension is a multiple of 16;
    /// the portable scalar kernels everywhere else. The default.
    Auto,
    /// Always the portable scalar kernels (one thread per query or key row).
    Scalar,
    /// The tile kernels wherever the head dimension and shared memory allow, their fragment
    /// products on tensor cores where the device has them and computed by the plane's lanes
    /// elsewhere: the way to test the tile kernels' softmax, masking, staging and
    /// accumulation on devices without tensor cores. Slow there; not meant for training.
    Tiles,
}

static ATTENTION_KERNEL: AtomicU8 = AtomicU8::new(0);
/// Launches of the tile forward, dQ and dK/dV kernels, in that order.
pub(crate) static TILED_LAUNCHES: [AtomicUsize; 3] = [
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
];

/// Chooses the flash-attention kernels for the whole process (default
/// [`AttentionKernel::Auto`]); for tests and for comparing the kernels in benchmarks.
pub fn set_attention_kernel(choice: AttentionKernel) {
    let code = match choice {
        AttentionKernel::Auto => 0,
        AttentionKernel::Scalar => 1,
        AttentionKernel::Tiles => 2,
    };
    ATTENTION_KERNEL.store(code, Ordering::SeqCst);
}

/// The current [`set_attention_kernel`] choice.
pub fn attention_kernel() -> AttentionKernel {
    match ATTENTION_KERNEL.load(Ordering::SeqCst) {
        1 => AttentionKernel::Scalar,
        2 => AttentionKernel::Tiles,
        _ => AttentionKernel::Auto,
    }
}

/// A cube shape for the tile attention kernels: `planes` planes (warps) per cube, each owning
/// 16 output rows, and a streamed tile (keys for the forward and dQ, queries for dK/dV) of
/// `stream_frags × 16` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileShape {
    /// Planes per cube.
    pub planes: usize,
    /// Streamed rows per tile, in 16-row fragments.
    pub stream_frags: usize,
}

impl TileShape {
    /// Largest accepted `planes` and `stream_frags` (a cube of 8 planes of 32 lanes is 256
    /// threads; 8 fragments are 128 streamed rows).
    pub const MAX: usize = 8;

    /// The shape, or `None` when either count is 0 or above [`TileShape::MAX`].
    pub fn new(planes: usize, stream_frags: usize) -> Option<TileShape> {
        let ok = |n: usize| (1..=Self::MAX).contains(&n);
        (ok(planes) && ok(stream_frags)).then_some(TileShape {
            planes,
            stream_frags,
        })
    }
}

/// Where the tile attention kernels keep each plane's f32 accumulator blocks (the forward's
/// output, dQ, dK and dV) between streamed tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccumulatorPlace {
    /// In accumulator fragments (tensor cores) or the lanes' registers (elsewhere) for the
    /// whole loop, written to shared memory only for the forward's rare rescale and at the
    /// end. The default.
    #[default]
    Registers,
    /// In shared memory, loaded into fragments and stored back by every tile's product:
    /// fewer registers per thread, more shared-memory traffic. Kept to compare against on a
    /// GPU (`kernel_bench --attn-acc`).
    Shared,
}

static ACCUMULATOR_PLACE: AtomicU8 = AtomicU8::new(0);

/// Chooses where the tile attention kernels keep their accumulators for the whole process
/// (default [`AccumulatorPlace::Registers`]); for tests and for benchmarks.
pub fn set_attention_accumulators(place: AccumulatorPlace) {
    let code = match place {
        AccumulatorPlace::Registers => 0,
        AccumulatorPlace::Shared => 1,
    };
    ACCUMULATOR_PLACE.store(code, Ordering::SeqCst);
}

/// The current [`set_attention_accumulators`] choice.
pub fn attention_accumulators() -> AccumulatorPlace {
    match ACCUMULATOR_PLACE.load(Ordering::SeqCst) {
        1 => AccumulatorPlace::Shared,
        _ => AccumulatorPlace::Registers,
    }
}

/// `planes × 256 + stream_frags` of the forced shape, 0 for none.
static ATTENTION_TILES: AtomicUsize = AtomicUsize::new(0);

/// Forces the tile kernels' cube shape for the whole process (`None`, the default, lets each
/// kernel take the first of its preferred shapes that fits the device's shared memory). A
/// forced shape that does not fit makes the launchers use the portable kernels, which
/// [`tiled_launches`] shows. For tests and for tuning the shapes with benchmarks.
pub fn set_attention_tiles(shape: Option<TileShape>) {
    let code = shape.map_or(0, |s| s.planes * 256 + s.stream_frags);
    ATTENTION_TILES.store(code, Ordering::SeqCst);
}

/// The current [`set_attention_tiles`] choice.
pub(crate) fn attention_tiles() -> Option<TileShape> {
    match ATTENTION_TILES.load(Ordering::SeqCst) {
        0 => None,
        code => Some(TileShape {
            planes: code / 256,
            stream_frags: code % 256,
        }),
    }
}

/// The cube shapes the tile kernels (forward, dQ, dK/dV) take on `device` for `dtype` and
/// `head_dim` under the current choices, `None` for a kernel that runs the portable kernel
/// there; for benchmarks to report what they timed.
pub fn attention_tile_shapes<R: CubeRuntime>(
    device: &R::Device,
    dtype: DType,
    head_dim: usize,
) -> [Option<TileShape>; 3] {
    let client = R::client(device);
    [
        attention::TileKernel::Forward,
        attention::TileKernel::Dq,
        attention::TileKernel::DkDv,
    ]
    .map(|kernel| {
        attention::tiles_plan(&client, kernel, dtype, head_dim).map(|p| TileShape {
            planes: p.planes,
            stream_frags: p.stream_frags,
        })
    })
}

/// How many times each tile kernel ran in this process, so tests and benchmarks can tell
/// which kernels they measured instead of assuming it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TiledLaunches {
    /// Tile forward launches.
    pub forward: usize,
    /// Tile dQ launches (backward).
    pub dq: usize,
    /// Tile dK/dV launches (backward).
    pub dkdv: usize,
}

/// The tile kernels' launch counts so far.
pub fn tiled_launches() -> TiledLaunches {
    let n = |i: usize| TILED_LAUNCHES[i].load(Ordering::SeqCst);
    TiledLaunches {
        forward: n(0),
        dq: n(1),
        dkdv: n(2),
    }
}

/// Whether flash attention on `device` (forward and both backward kernels) would run on
/// tensor cores for inputs of `dtype` with head dimension `head_dim`, under the current
/// [`set_attention_kernel`] choice.
pub fn attention_uses_tensor_cores<R: CubeRuntime>(
    device: &R::Device,
    dtype: DType,
    head_dim: usize,
) -> bool {
    let client = R::client(device);
    attention::all_tiles_on_tensor_cores(|kernel| {
        attention::tiles_plan(&client, kernel, dtype, head_dim)
    })
}

/// Test hook: when on, every kernel output buffer is filled with NaN before the launch, so
/// an element a kernel forgets to write shows up as NaN instead of as stale memory that
/// happens to be right. Off by default (it costs one fill per output).
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(on, Ordering::SeqCst);
}

/// A compact contiguous output buffer (row-major, no padding), NaN-filled when
/// [`set_poison_outputs`] is on.
///
/// The kernels index their outputs as `[.., rows, cols]` with row stride `cols`, so the
/// buffer must be laid out that way. Burn's `empty_device_dtype` and `full_device_dtype` do
/// not promise it: on CUDA they pad each row to 256 bytes (a `[2, 2, 33]` f32 tensor gets
/// strides `[128, 64, 1]`), which lavapipe never does, so a kernel writing row-major there
/// leaves what Burn later reads as other rows unwritten.
pub(crate) fn output<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    let (client, device) = (like.client.clone(), like.device.clone());
    if POISON_OUTPUTS.load(Ordering::SeqCst) {
        contiguous_full(client, device, shape, f32::NAN, dtype)
    } else {
        empty_device_contiguous_dtype(client, device, shape, dtype)
    }
}

/// A compact contiguous tensor filled with `value` (see [`output`] for why the layout
/// matters): Burn's fill, copied into a compact buffer when Burn padded its rows.
pub(crate) fn contiguous_full<R: CubeRuntime>(
    client: ComputeClient<R>,
    device: R::Device,
    shape: Shape,
    value: f32,
    dtype: DType,
) -> CubeTensor<R> {
    into_contiguous(full_device_dtype(
        client,
        shape,
        device,
        InputScalar::new(value, dtype),
        dtype,
    ))
}

impl<R, F, I, BT> FusedOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_kernels() -> bool {
        true
    }

    fn fused_defaults() -> crate::FusedDefaults {
        // Measured per runtime (the table on `FusedDefaults`): on CUDA the MLP and the head;
        // on wgpu (measured on lavapipe only) none.
        #[cfg(feature = "cuda")]
        if std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::cuda::CudaRuntime>() {
            return crate::FusedDefaults {
                attention: false,
                mlp: true,
                head: true,
            };
        }
        crate::FusedDefaults::NONE
    }

    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::forward::<Self, R>(q, k, v, key_padding_mask, causal)
    }

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
        attention::backward::<Self, R>(q, k, v, out, lse, dout, key_padding_mask, causal)
    }

    fn fused_linear_gelu(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear_gelu::forward::<Self, R>(x, w, b)
    }

    fn fused_linear_gelu_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        linear_gelu::backward::<Self, R>(x, w, b, dy)
    }

    fn fused_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore_index: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        linear_ce::forward::<Self, R>(h, w, targets, ignore_index)
    }

    fn fused_linear_cross_entropy_backward(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore_index: i64,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        linear_ce::backward::<Self, R>(h, w, targets, ignore_index, lse, dloss)
    }
}
