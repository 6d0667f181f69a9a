//! Fused MLP kernels: a tiled matmul `z = x·W + b` whose epilogue applies the exact (erf)
//! GELU in the forward, or the GELU derivative in the backward, so the `[tokens × d_out]`
//! pre-activation `z` never exists in global memory.
//!
//! * `linear_gelu_fwd_kernel`: `y = gelu(x·W + b)`.
//! * `linear_gelu_dz_kernel`: recomputes `z` and writes `dz = dy ∘ gelu'(z)`, plus per-tile
//!   column partial sums of `dz` (the bias gradient's first reduction stage).
//!
//! Layout: one cube per `TILE × TILE` output tile, `TILE` threads across the columns and
//! `row_threads` down the rows; each thread accumulates `TILE / row_threads` outputs of one
//! column in f32 registers. `x` and `W` stream through shared memory in `TILE × TILE` K tiles
//! (8 KiB of f32, well within Vulkan's guaranteed 16 KiB), zero-padded past the matrix edges,
//! so any shape works, not only multiples of the tile. Inputs of any float type are widened
//! to f32 on load: f16/bf16 inputs accumulate in f32.

use cubecl::prelude::*;

/// `1/√2`, for `Φ(z) = ½(1 + erf(z/√2))`.
const FRAC_1_SQRT_2: f32 = core::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`, the standard normal density's constant.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// Accumulates the `tile × tile` block of `x·W` whose top-left output is `(row0, col0)`:
/// thread `(tx, ty)` gets rows `row0 + ty + i·row_threads` of column `col0 + tx` in `acc[i]`.
/// Ends after a barrier, so the shared buffers may be reused by the caller.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_tile<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    x_s: &mut SharedMemory<f32>,
    w_s: &mut SharedMemory<f32>,
    acc: &mut Array<f32>,
    row0: usize,
    col0: usize,
    n: usize,
    k: usize,
    m: usize,
    #[comptime] tile: usize,
    #[comptime] row_threads: usize,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let threads = tile * row_threads;
    let rows_per_thread = tile / row_threads;
    for i in 0..rows_per_thread {
        acc[i] = f32::new(0.0);
    }
    let mut k0 = 0usize.runtime();
    while k0 < k {
        // Cooperative, coalesced loads: consecutive threads take consecutive columns.
        let mut idx = ty * tile + tx;
        while idx < tile * tile {
            let (r, c) = (idx / tile, idx % tile);
            let mut xv = f32::new(0.0);
            if row0 + r < n && k0 + c < k {
                xv = f32::cast_from(x[(row0 + r) * k + k0 + c]);
            }
            x_s[idx] = xv;
            let mut wv = f32::new(0.0);
            if k0 + r < k && col0 + c < m {
                wv = f32::cast_from(w[(k0 + r) * m + col0 + c]);
            }
            w_s[idx] = wv;
            idx += threads;
        }
        sync_cube();
        // Threads of a row group read one x_s entry (a broadcast) and consecutive w_s
        // entries, so shared-memory reads are free of bank conflicts.
        for kk in 0..tile {
            let wv = w_s[kk * tile + tx];
            #[unroll]
            for i in 0..rows_per_thread {
                acc[i] += x_s[(ty + i * row_threads) * tile + kk] * wv;
            }
        }
        // The next K tile overwrites x_s / w_s: every thread must be done reading.
        sync_cube();
        k0 += tile;
    }
}

/// `Φ(z)`, the standard normal CDF, through the exact erf.
#[cube]
fn normal_cdf(z: f32) -> f32 {
    0.5f32 * (1.0f32 + Erf::erf(z * f32::new(FRAC_1_SQRT_2)))
}

/// Forward: `out = gelu(x·W + b)` with `x` `[n, k]`, `W` `[k, m]`, `b` `[m]`, `out` `[n, m]`,
/// all contiguous and of the same float type.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_gelu_fwd_kernel<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    b: &Tensor<F>,
    out: &mut Tensor<F>,
    n: u32,
    k: u32,
    m: u32,
    #[comptime] tile: usize,
    #[comptime] row_threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, k, m) = (n as usize, k as usize, m as usize);
    let row0 = CUBE_POS_Y as usize * tile;
    let col0 = CUBE_POS_X as usize * tile;
    let mut x_s = SharedMemory::<f32>::new(tile * tile);
    let mut w_s = SharedMemory::<f32>::new(tile * tile);
    let mut acc = Array::<f32>::new(tile / row_threads);
    accumulate_tile::<F>(
        x,
        w,
        &mut x_s,
        &mut w_s,
        &mut acc,
        row0,
        col0,
        n,
        k,
        m,
        tile,
        row_threads,
    );
    let col = col0 + UNIT_POS_X as usize;
    if col < m {
        let bias = f32::cast_from(b[col]);
        for i in 0..tile / row_threads {
            let row = row0 + UNIT_POS_Y as usize + i * row_threads;
            if row < n {
                let z = acc[i] + bias;
                out[row * m + col] = F::cast_from(z * normal_cdf(z));
            }
        }
    }
}

/// Backward epilogue: recomputes `z = x·W + b` and writes `dz = dy ∘ gelu'(z)` (`[n, m]`,
/// input float type), with `gelu'(z) = Φ(z) + z·φ(z)`; also writes
/// `db_partial[tile_row, col] = Σ dz` over the tile's (up to `tile`) rows, in f32, so the
/// bias gradient is a short reduction of `[⌈n/tile⌉, m]` instead of `[n, m]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_gelu_dz_kernel<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    b: &Tensor<F>,
    dy: &Tensor<F>,
    dz: &mut Tensor<F>,
    db_partial: &mut Tensor<f32>,
    n: u32,
    k: u32,
    m: u32,
    #[comptime] tile: usize,
    #[comptime] row_threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, k, m) = (n as usize, k as usize, m as usize);
    let row0 = CUBE_POS_Y as usize * tile;
    let col0 = CUBE_POS_X as usize * tile;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let mut x_s = SharedMemory::<f32>::new(tile * tile);
    let mut w_s = SharedMemory::<f32>::new(tile * tile);
    let mut acc = Array::<f32>::new(tile / row_threads);
    accumulate_tile::<F>(
        x,
        w,
        &mut x_s,
        &mut w_s,
        &mut acc,
        row0,
        col0,
        n,
        k,
        m,
        tile,
        row_threads,
    );
    let col = col0 + tx;
    let mut col_sum = f32::new(0.0);
    if col < m {
        let bias = f32::cast_from(b[col]);
        for i in 0..tile / row_threads {
            let row = row0 + ty + i * row_threads;
            if row < n {
                let z = acc[i] + bias;
                let pdf = (z * z * f32::new(-0.5)).exp() * f32::new(FRAC_1_SQRT_2PI);
                let g = f32::cast_from(dy[row * m + col]) * (normal_cdf(z) + z * pdf);
                let g_stored = F::cast_from(g);
                dz[row * m + col] = g_stored;
                // Sum what was stored, so db is exactly the column sum of the dz that dx
                // and dW are computed from.
                col_sum += f32::cast_from(g_stored);
            }
        }
    }
    // Combine the row groups' sums through shared memory (free again after
    // accumulate_tile's last barrier); the barrier sits outside every branch.
    x_s[ty * tile + tx] = col_sum;
    sync_cube();
    if ty == 0 && col < m {
        let mut s = f32::new(0.0);
        for g in 0..row_threads {
            s += x_s[g * tile + tx];
        }
        db_partial[CUBE_POS_Y as usize * m + col] = s;
    }
}
