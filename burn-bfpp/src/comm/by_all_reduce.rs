//! All-gather, reduce-scatter and broadcast built from one all-reduce, for communicators whose
//! transport offers only that (CubeCL 0.10 drives NCCL's all-reduce on device buffers, not
//! its other collectives). Each costs one all-reduce of the full buffer instead of the
//! optimal collective, about twice the traffic of a reduce-scatter or all-gather; the results
//! are exact: the zero-padded sums add only exact zeros, and a reduce-scatter is a chunk of
//! the all-reduce.
//!
//! The functions take the all-reduce as a closure, so the same composition is tested on the
//! CPU over [`LocalComm`](super::LocalComm) and runs on GPUs over NCCL.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Concatenation of the `size` members' equal-length shards in group-rank order, given this
/// member's `shard`, its group rank `me` and a sum all-reduce over the group.
pub(crate) fn all_gather<B: Backend, E>(
    shard: Tensor<B, 1>,
    me: usize,
    size: usize,
    sum: impl FnOnce(Tensor<B, 1>) -> Result<Tensor<B, 1>, E>,
) -> Result<Tensor<B, 1>, E> {
    let len = shard.dims()[0];
    let placed = Tensor::<B, 1>::zeros([len * size], (&shard.device(), shard.dtype()))
        .slice_assign(me * len..(me + 1) * len, shard);
    sum(placed)
}

/// Chunk `me` (of `size` equal chunks) of the reduction of `tensor`, given the all-reduce
/// with the wanted operation. The length must be divisible by `size` (callers check it, to
/// name the problem in their own error type).
pub(crate) fn reduce_scatter<B: Backend, E>(
    tensor: Tensor<B, 1>,
    me: usize,
    size: usize,
    all_reduce: impl FnOnce(Tensor<B, 1>) -> Result<Tensor<B, 1>, E>,
) -> Result<Tensor<B, 1>, E> {
    let chunk = tensor.dims()[0] / size.max(1);
    let full = all_reduce(tensor)?;
    let view = full.slice(me * chunk..(me + 1) * chunk);
    // Added into a fresh buffer, so the full-length result is freed rather than kept alive
    // by the view (Burn 0.21 has no explicit copy). Exact, except that −0 becomes +0.
    Ok(Tensor::zeros([chunk], (&view.device(), view.dtype())) + view)
}

/// The root's tensor on every member: the root contributes its tensor, the others zeros of
/// the same shape, and the sum is the root's values.
pub(crate) fn broadcast<B: Backend, const D: usize, E>(
    tensor: Tensor<B, D>,
    is_root: bool,
    sum: impl FnOnce(Tensor<B, D>) -> Result<Tensor<B, D>, E>,
) -> Result<Tensor<B, D>, E> {
    let contribution = if is_root { tensor } else { tensor.zeros_like() };
    sum(contribution)
}
