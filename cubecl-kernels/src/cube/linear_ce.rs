//! Launchers for the chunked linear cross-entropy on CubeCL backends.
//!
//! The logits exist one `[row block × vocabulary chunk]` piece at a time: each piece is one
//! Burn matmul (CubeCL's tiled kernels, which can pick tensor-core variants on CUDA) followed
//! by a kernel that folds it into per-token statistics (forward) or turns it into its
//! gradient in place (backward), after which two more matmuls carry that gradient into `dh`
//! and `dW`. Memory beyond the inputs and gradients is one piece plus a few `[tokens]`
//! vectors, whatever the vocabulary size; the matmuls do the arithmetic at the speed of
//! Burn's own, instead of the portable scalar tiles an all-in-one kernel would need.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, IntDType, Shape, Slice, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::cross_entropy::{
    ce_chunk_grad_kernel, ce_chunk_stats_kernel, ce_finish_kernel, ce_valid_kernel,
};
use super::flash_fwd::HIDDEN;
use super::matmul::matmul;
use super::{contiguous_full, output};

/// Vocabulary columns per chunk by default. At 8192 tokens a chunk is 32 MiB in f32 (16 MiB
/// in bf16) against 1.6 GiB for the full GPT-2 logits, and a `[8192 × 1024] · [1024 × 1024]`
/// matmul is large enough to run near a GPU's matmul peak.
pub const DEFAULT_VOCAB_CHUNK: usize = 1024;
/// Tokens per row block by default: bounds a chunk to 64 MiB (f32) however many tokens a
/// micro-batch has, and keeps the per-row launch within every runtime's grid limits.
pub const DEFAULT_ROW_BLOCK: usize = 16384;

static VOCAB_CHUNK: AtomicUsize = AtomicUsize::new(DEFAULT_VOCAB_CHUNK);
static ROW_BLOCK: AtomicUsize = AtomicUsize::new(DEFAULT_ROW_BLOCK);

/// Sets the piece size of the chunked linear cross-entropy: `rows` tokens × `cols`
/// vocabulary columns (each at least 1). Smaller pieces use less memory and launch more,
/// smaller matmuls. Meant for tests and tuning; the defaults suit training shapes.
pub fn set_linear_ce_piece(rows: usize, cols: usize) {
    ROW_BLOCK.store(rows.max(1), Ordering::SeqCst);
    VOCAB_CHUNK.store(cols.max(1), Ordering::SeqCst);
}

/// The current `(rows, cols)` piece size of the chunked linear cross-entropy.
fn linear_ce_piece() -> (usize, usize) {
    (
        ROW_BLOCK.load(Ordering::SeqCst),
        VOCAB_CHUNK.load(Ordering::SeqCst),
    )
}

/// Threads per row in the statistics kernel.
pub(crate) const STATS_THREADS: usize = 64;
/// Threads per cube of the per-token kernel.
pub(crate) const FINISH_THREADS: usize = 64;
/// Edge of the block one cube of the gradient kernel handles, and the cube's width.
pub(crate) const GRAD_TILE: usize = 32;
/// Threads down a gradient block's rows (32 × 4 = 128 per cube, Vulkan's guaranteed minimum).
pub(crate) const GRAD_ROW_THREADS: usize = 4;

/// `0..len` cut into consecutive ranges of at most `step`.
fn blocks(len: usize, step: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len)
        .step_by(step.max(1))
        .map(move |s| s..(s + step).min(len))
}

/// `t[rows, cols]` as a view (a no-op when the ranges cover `t`).
fn piece<B, R>(t: &CubeTensor<R>, rows: Range<usize>, cols: Range<usize>) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let [r, c] = t.shape().dims::<2>();
    if rows == (0..r) && cols == (0..c) {
        t.clone()
    } else {
        B::float_slice(t.clone(), &[Slice::from(rows), Slice::from(cols)])
    }
}

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

fn filled<R: CubeRuntime>(like: &CubeTensor<R>, n: usize, value: f32) -> CubeTensor<R> {
    contiguous_full(
        like.client.clone(),
        like.device.clone(),
        Shape::new([n]),
        value,
        DType::F32,
    )
}

/// The forward pass over all pieces: per-token log-sum-exp, loss term and validity.
fn rows<B, R>(h: &CubeTensor<R>, w: &CubeTensor<R>, targets: &CubeTensor<R>, ignore: i32) -> Rows<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let [n, hidden] = h.shape().dims::<2>();
    let vocab = w.shape().dims::<2>()[1];
    let (row_block, vocab_chunk) = linear_ce_piece();
    let run_max = filled(h, n, HIDDEN);
    let run_sum = filled(h, n, 0.0);
    // Stays 0 for a target outside the vocabulary: such targets are a caller error that the
    // API cannot check without reading the targets back, and the loss term is then `lse`.
    let target_logit = filled(h, n, 0.0);
    let client = h.client.clone();
    for r in blocks(n, row_block) {
        let h_rows = piece::<B, R>(h, r.clone(), 0..hidden);
        for c in blocks(vocab, vocab_chunk) {
            let w_cols = piece::<B, R>(w, 0..hidden, c.clone());
            let logits = into_contiguous(matmul::<B, R>(h_rows.clone(), w_cols));
            ce_chunk_stats_kernel::launch::<R>(
                &client,
                CubeCount::Static(r.len() as u32, 1, 1),
                CubeDim::new_1d(STATS_THREADS as u32),
                logits.clone().into_tensor_arg(),
                targets.clone().into_tensor_arg(),
                run_max.clone().into_tensor_arg(),
                run_sum.clone().into_tensor_arg(),
                target_logit.clone().into_tensor_arg(),
                r.start as u32,
                c.start as u32,
                c.len() as u32,
                STATS_THREADS,
                logits.dtype.into(),
            );
        }
    }
    let out = Rows {
        loss: output(h, Shape::new([n]), DType::F32),
        lse: output(h, Shape::new([n]), DType::F32),
        valid: output(h, Shape::new([n]), DType::F32),
    };
    ce_finish_kernel::launch::<R>(
        &client,
        CubeCount::Static(n.div_ceil(FINISH_THREADS) as u32, 1, 1),
        CubeDim::new_1d(FINISH_THREADS as u32),
        run_max.into_tensor_arg(),
        run_sum.into_tensor_arg(),
        target_logit.into_tensor_arg(),
        targets.clone().into_tensor_arg(),
        out.loss.clone().into_tensor_arg(),
        out.lse.clone().into_tensor_arg(),
        out.valid.clone().into_tensor_arg(),
        n as u32,
        ignore,
    );
    out
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

/// Mean loss (one element, input dtype) of the fused linear cross-entropy and the per-token
/// log-sum-exp (f32 `[tokens]`) for the backward.
pub(crate) fn forward<B, R>(
    h: CubeTensor<R>,
    w: CubeTensor<R>,
    targets: CubeTensor<R>,
    ignore_index: i64,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>, IntTensorPrimitive = CubeTensor<R>>,
{
    let dtype = h.dtype;
    let (h, w) = (into_contiguous(h), into_contiguous(w));
    let targets = i32_targets::<B, R>(targets);
    let r = rows::<B, R>(&h, &w, &targets, ignore_i32(ignore_index));
    let loss = B::float_div(B::float_sum(r.loss), count::<B, R>(r.valid));
    (B::float_cast(loss, FloatDType::from(dtype)), r.lse)
}

/// Adds `part` (`[rows.len(), hidden]`) into rows `rows` of `acc` (`[n, hidden]`), creating
/// `acc` on first use. With a single row block this is a plain (in-place) add.
fn add_rows<B, R>(
    acc: Option<CubeTensor<R>>,
    n: usize,
    rows: Range<usize>,
    part: CubeTensor<R>,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let hidden = part.shape().dims::<2>()[1];
    let all = rows == (0..n);
    match acc {
        None if all => part,
        Some(acc) if all => B::float_add(acc, part),
        acc => {
            let acc = acc.unwrap_or_else(|| {
                contiguous_full(
                    part.client.clone(),
                    part.device.clone(),
                    Shape::new([n, hidden]),
                    0.0,
                    part.dtype,
                )
            });
            let slices = [Slice::from(rows), Slice::from(0..hidden)];
            // The view is consumed by the add before the assignment, so `acc` is uniquely
            // owned again and updated in place.
            let sum = B::float_add(B::float_slice(acc.clone(), &slices), part);
            B::float_slice_assign(acc, &slices, sum)
        }
    }
}

/// `(dh, dW)` of the fused linear cross-entropy for the one-element loss gradient `dloss`,
/// given the forward's per-token log-sum-exp `lse`.
///
/// Each piece of logits is recomputed (one matmul) and turned into its gradient in place,
/// then multiplied into `dh` and `dW` (two matmuls): with the forward's one, four matmuls of
/// the head's size in all, against three for the materialised path, which pays for them in
/// `[tokens × vocab]` memory.
pub(crate) fn backward<B, R>(
    h: CubeTensor<R>,
    w: CubeTensor<R>,
    targets: CubeTensor<R>,
    ignore_index: i64,
    lse: CubeTensor<R>,
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
    // A caller passing another float type gets it converted rather than misread.
    let lse = into_contiguous(B::float_cast(lse, FloatDType::F32));
    let valid = output(&h, Shape::new([n]), DType::F32);
    ce_valid_kernel::launch::<R>(
        &h.client,
        CubeCount::Static(n.div_ceil(FINISH_THREADS) as u32, 1, 1),
        CubeDim::new_1d(FINISH_THREADS as u32),
        targets.clone().into_tensor_arg(),
        valid.clone().into_tensor_arg(),
        n as u32,
        ignore_i32(ignore_index),
    );
    let dloss = B::float_cast(dloss, FloatDType::F32);
    let scale = B::float_div(dloss, count::<B, R>(valid.clone()));
    let coef = into_contiguous(B::float_mul(valid, scale));
    let (row_block, vocab_chunk) = linear_ce_piece();
    let client = h.client.clone();
    let mut dh = None;
    let mut dw = None;
    for c in blocks(vocab, vocab_chunk) {
        let w_cols = piece::<B, R>(&w, 0..hidden, c.clone());
        let mut dw_cols: Option<CubeTensor<R>> = None;
        for rr in blocks(n, row_block) {
            let h_rows = piece::<B, R>(&h, rr.clone(), 0..hidden);
            // The recomputed logits piece, overwritten with its gradient.
            let g = into_contiguous(matmul::<B, R>(h_rows.clone(), w_cols.clone()));
            ce_chunk_grad_kernel::launch::<R>(
                &client,
                CubeCount::Static(
                    c.len().div_ceil(GRAD_TILE) as u32,
                    rr.len().div_ceil(GRAD_TILE) as u32,
                    1,
                ),
                CubeDim::new_2d(GRAD_TILE as u32, GRAD_ROW_THREADS as u32),
                g.clone().into_tensor_arg(),
                targets.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                coef.clone().into_tensor_arg(),
                rr.start as u32,
                c.start as u32,
                rr.len() as u32,
                c.len() as u32,
                GRAD_TILE,
                GRAD_ROW_THREADS,
                dtype.into(),
            );
            let dh_part = matmul::<B, R>(g.clone(), B::float_transpose(w_cols.clone()));
            dh = Some(add_rows::<B, R>(dh, n, rr, dh_part));
            let dw_part = matmul::<B, R>(B::float_transpose(h_rows), g);
            dw_cols = Some(match dw_cols {
                None => dw_part,
                Some(acc) => B::float_add(acc, dw_part),
            });
        }
        if let Some(part) = dw_cols {
            dw = Some(if c == (0..vocab) {
                part
            } else {
                // Every column belongs to exactly one chunk, so the buffer needs no zeroing.
                let all = dw.unwrap_or_else(|| output(&h, Shape::new([hidden, vocab]), dtype));
                B::float_slice_assign(all, &[Slice::from(0..hidden), Slice::from(c)], part)
            });
        }
    }
    // Empty only for zero tokens or vocabulary, which the API refuses; kept total anyway.
    let dh = dh.unwrap_or_else(|| output(&h, Shape::new([n, hidden]), dtype));
    let dw = dw.unwrap_or_else(|| output(&h, Shape::new([hidden, vocab]), dtype));
    (dh, dw)
}
