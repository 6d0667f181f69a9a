//! Launchers for the fused linear + bias + GELU kernels on CubeCL backends.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::matmul::matmul;
use super::mlp::{bias_gelu_dz_kernel, bias_gelu_fwd_kernel};
use super::output;

/// Edge of the `[n, m]` block one cube handles; also the cube's width.
pub(crate) const TILE: usize = 32;
/// Threads down a block's rows: 32 × 4 = 128 threads per cube, the most Vulkan guarantees,
/// each handling 8 elements.
pub(crate) const ROW_THREADS: usize = 4;

fn launch_grid(n: usize, m: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(m.div_ceil(TILE) as u32, n.div_ceil(TILE) as u32, 1),
        CubeDim::new_2d(TILE as u32, ROW_THREADS as u32),
    )
}

/// `gelu(x·W + b)` on a CubeCL backend, in the inputs' float type: `x·W` through
/// [`matmul`] (Burn's tensor-core matmul for f16/bf16, cubek's f32 routine for f32), then bias
/// and GELU in one pass. `z = x·W` lives only until that pass: nothing of `[tokens × d_out]` is
/// kept for the backward, which recomputes it.
pub(crate) fn forward<B, R>(x: CubeTensor<R>, w: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let [n, _] = x.shape().dims::<2>();
    let m = w.shape().dims::<2>()[1];
    let dtype = x.dtype;
    // A fresh matmul output, owned here alone: the epilogue overwrites it with the result.
    let out = into_contiguous(matmul::<B, R>(x, w));
    let b = into_contiguous(b);
    let (count, dim) = launch_grid(n, m);
    bias_gelu_fwd_kernel::launch::<R>(
        &out.client.clone(),
        count,
        dim,
        out.clone().into_tensor_arg(),
        b.into_tensor_arg(),
        n as u32,
        m as u32,
        TILE,
        ROW_THREADS,
        dtype.into(),
    );
    out
}

/// `(dx, dW, db)` of `gelu(x·W + b)` for the output gradient `dy`.
///
/// The pre-activation `z = x·W` is recomputed ([`matmul`]) rather than saved by the
/// forward: saving it would keep an extra `[tokens × d_out]` tensor per MLP alive from the
/// forward to the backward (with `d_out = 4·hidden`, as large as the block's largest
/// activation, and a pipeline keeps many micro-batches in flight), while recomputing costs
/// one extra `x·W` in the backward, which already does two matmuls of that size. `z` lives
/// on as `dz` (overwritten in place) until `dx` and `dW` are formed.
pub(crate) fn backward<B, R>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    b: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let [n, _] = x.shape().dims::<2>();
    let m = w.shape().dims::<2>()[1];
    let dtype = x.dtype;
    let b = into_contiguous(b);
    // The gradient normally arrives in the output's (= the inputs') float type; a caller that
    // upcast it gets it converted rather than misread by the kernel.
    let dy = if dy.dtype == dtype {
        into_contiguous(dy)
    } else {
        into_contiguous(B::float_cast(dy, FloatDType::from(dtype)))
    };
    // The recomputed `z`, overwritten with `dz` by the epilogue.
    let dz = into_contiguous(matmul::<B, R>(x.clone(), w.clone()));
    let db_partial = output(&dz, Shape::new([n.div_ceil(TILE), m]), DType::F32);
    let (count, dim) = launch_grid(n, m);
    bias_gelu_dz_kernel::launch::<R>(
        &dz.client.clone(),
        count,
        dim,
        dz.clone().into_tensor_arg(),
        b.into_tensor_arg(),
        dy.into_tensor_arg(),
        db_partial.clone().into_tensor_arg(),
        n as u32,
        m as u32,
        TILE,
        ROW_THREADS,
        dtype.into(),
    );
    let dx = matmul::<B, R>(dz.clone(), B::float_transpose(w));
    let dw = matmul::<B, R>(B::float_transpose(x), dz);
    let db = B::float_reshape(B::float_sum_dim(db_partial, 0), Shape::new([m]));
    let db = B::float_cast(db, FloatDType::from(dtype));
    (dx, dw, db)
}
