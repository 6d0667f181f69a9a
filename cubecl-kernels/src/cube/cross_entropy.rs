//! Kernels of the chunked linear cross-entropy. The logits are produced one
//! `[rows × cols]` chunk at a time by Burn's own matmul (CubeCL's tiled kernels, tensor cores
//! where the runtime has them) and consumed at once by these kernels, so memory is one chunk,
//! never `[tokens × vocab]`:
//!
//! * `ce_chunk_stats_kernel`: folds a chunk into each token's running max and running sum of
//!   `exp` (the online log-sum-exp) and picks the target's logit when it falls in the chunk.
//! * `ce_finish_kernel`: per token, `lse = max + ln(sum)`, the loss term and the validity.
//! * `ce_valid_kernel`: per token, whether it counts (for the backward, which gets `lse` from
//!   the forward).
//! * `ce_chunk_grad_kernel`: overwrites a recomputed chunk with its gradient
//!   `g = coef · (softmax − onehot)`, which the launcher multiplies back through Burn's matmul.
//!
//! All arithmetic is f32 whatever the stored float type.

use cubecl::prelude::*;

use super::flash_fwd::HIDDEN;

/// One cube per row of the chunk, `threads` threads striding its columns. Running statistics
/// are `[tokens]` f32 and indexed by the global token `row0 + local row`; the chunk holds
/// vocabulary columns `col0 .. col0 + cols`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub(crate) fn ce_chunk_stats_kernel<F: Float>(
    logits: &Tensor<F>,
    targets: &Tensor<i32>,
    run_max: &mut Tensor<f32>,
    run_sum: &mut Tensor<f32>,
    target_logit: &mut Tensor<f32>,
    row0: u32,
    col0: u32,
    cols: u32,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let local = CUBE_POS_X as usize;
    let row = row0 as usize + local;
    let cols = cols as usize;
    let base = local * cols;
    let tid = UNIT_POS_X as usize;
    let target_col = targets[row] - col0 as i32;
    let mut red = SharedMemory::<f32>::new(threads);

    let mut m = f32::new(HIDDEN);
    let mut c = tid;
    while c < cols {
        let z = f32::cast_from(logits[base + c]);
        if z > m {
            m = z;
        }
        if c as i32 == target_col {
            target_logit[row] = z;
        }
        c += threads;
    }
    red[tid] = m;
    sync_cube();
    let mut stride = (threads / 2).runtime();
    while stride > 0 {
        // Nested, not `tid < stride && red[tid + stride] > …`: CubeCL evaluates both sides
        // of `&&`, and `red[tid + stride]` past the shared array is an illegal address on
        // CUDA (Vulkan drivers clamp it, which hid it on lavapipe).
        if tid < stride {
            if red[tid + stride] > red[tid] {
                red[tid] = red[tid + stride];
            }
        }
        sync_cube();
        stride /= 2;
    }
    let chunk_max = red[0];
    // Every thread has read the max before the buffer is reused for the sums.
    sync_cube();

    let mut s = f32::new(0.0);
    c = tid;
    while c < cols {
        s += (f32::cast_from(logits[base + c]) - chunk_max).exp();
        c += threads;
    }
    red[tid] = s;
    sync_cube();
    stride = threads / 2;
    while stride > 0 {
        if tid < stride {
            red[tid] += red[tid + stride];
        }
        sync_cube();
        stride /= 2;
    }
    if tid == 0 {
        let old_max = run_max[row];
        let new_max = if chunk_max > old_max {
            chunk_max
        } else {
            old_max
        };
        run_sum[row] =
            run_sum[row] * (old_max - new_max).exp() + red[0] * (chunk_max - new_max).exp();
        run_max[row] = new_max;
    }
}

/// One thread per token: `lse`, the loss term `lse − logit[target]` and `valid` (1.0, or 0.0
/// with loss 0 for `ignore_index`), all f32 `[tokens]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_finish_kernel(
    run_max: &Tensor<f32>,
    run_sum: &Tensor<f32>,
    target_logit: &Tensor<f32>,
    targets: &Tensor<i32>,
    loss: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    valid: &mut Tensor<f32>,
    n: u32,
    ignore_index: i32,
) {
    let row = ABSOLUTE_POS;
    if row < n as usize {
        let row_lse = run_max[row] + run_sum[row].ln();
        lse[row] = row_lse;
        let mut row_loss = f32::new(0.0);
        let mut row_valid = f32::new(0.0);
        if targets[row] != ignore_index {
            row_loss = row_lse - target_logit[row];
            row_valid = f32::new(1.0);
        }
        loss[row] = row_loss;
        valid[row] = row_valid;
    }
}

/// One thread per token: `valid` = 1.0, or 0.0 where the target is `ignore_index` (f32
/// `[tokens]`), for the backward's coefficients.
#[cube(launch)]
pub(crate) fn ce_valid_kernel(
    targets: &Tensor<i32>,
    valid: &mut Tensor<f32>,
    n: u32,
    ignore_index: i32,
) {
    let row = ABSOLUTE_POS;
    if row < n as usize {
        let mut v = f32::new(1.0);
        if targets[row] == ignore_index {
            v = f32::new(0.0);
        }
        valid[row] = v;
    }
}

/// Overwrites a recomputed `[rows × cols]` logits chunk with `coef · (exp(z − lse) − [v =
/// target])`. One cube per `tile × tile` block, `tile` threads across the columns and
/// `row_threads` down the rows; each element is read and written by the same thread.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_chunk_grad_kernel<F: Float>(
    logits: &mut Tensor<F>,
    targets: &Tensor<i32>,
    lse: &Tensor<f32>,
    coef: &Tensor<f32>,
    row0: u32,
    col0: u32,
    rows: u32,
    cols: u32,
    #[comptime] tile: usize,
    #[comptime] row_threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (rows, cols) = (rows as usize, cols as usize);
    let col = CUBE_POS_X as usize * tile + UNIT_POS_X as usize;
    if col < cols {
        let v = (col0 as usize + col) as i32;
        for i in 0..tile / row_threads {
            let local = CUBE_POS_Y as usize * tile + UNIT_POS_Y as usize + i * row_threads;
            if local < rows {
                let row = row0 as usize + local;
                let at = local * cols + col;
                let mut g = (f32::cast_from(logits[at]) - lse[row]).exp();
                if v == targets[row] {
                    g -= f32::new(1.0);
                }
                logits[at] = F::cast_from(g * coef[row]);
            }
        }
    }
}
