//! CubeCL kernels and their `FusedOps` wiring for the CubeCL backends (wgpu, CUDA).
//!
//! The kernels are portable (plain shared memory and registers, f32 accumulation) so that
//! they run on every CubeCL runtime, Mesa's software Vulkan device included. The MLP and the
//! linear cross-entropy run their matmuls through Burn's own (CubeCL's tiled matmul, which
//! can pick tensor-core kernels on CUDA) and fuse everything around them; attention is one
//! kernel of its own.

mod attention;
mod cross_entropy;
mod flash_bwd;
mod flash_fwd;
mod linear_ce;
mod linear_gelu;
mod mlp;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::{empty_device_dtype, full_device_dtype};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::InputScalar;

use crate::FusedOps;

pub use linear_ce::{linear_ce_piece, set_linear_ce_piece, DEFAULT_ROW_BLOCK, DEFAULT_VOCAB_CHUNK};

static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);

/// Test hook: when on, every kernel output buffer is filled with NaN before the launch, so
/// an element a kernel forgets to write shows up as NaN instead of as stale memory that
/// happens to be right. Off by default (it costs one fill per output).
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(on, Ordering::SeqCst);
}

/// A contiguous output buffer, NaN-filled when [`set_poison_outputs`] is on.
pub(crate) fn output<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    let (client, device) = (like.client.clone(), like.device.clone());
    if POISON_OUTPUTS.load(Ordering::SeqCst) {
        full_device_dtype(
            client,
            shape,
            device,
            InputScalar::new(f32::NAN, dtype),
            dtype,
        )
    } else {
        empty_device_dtype(client, device, shape, dtype)
    }
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
