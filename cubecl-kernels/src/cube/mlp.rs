//! The MLP's fused bias + GELU epilogues, applied to `z = x·W` computed by Burn's own matmul
//! (CubeCL's, tiled and vectorised; on CUDA it can select tensor-core (`cmma`) kernels, which
//! no GPU has verified for this project yet):
//!
//! * `bias_gelu_fwd_kernel`: `y = gelu(z + b)` in one pass, in place over `z`.
//! * `bias_gelu_dz_kernel`: `dz = dy ∘ gelu'(z + b)` in place over `z`, plus per-tile column
//!   partial sums of `dz` (the bias gradient's first reduction stage), in one pass.
//!
//! Working in place keeps the memory of the fully fused design: one `[n, m]` buffer in the
//! forward (the output) and one in the backward (`dz`). Each element is read and written by
//! the same thread, so the pass is race-free.
//!
//! Layout: one cube per `TILE × TILE` block of `[n, m]`, `TILE` threads across the columns and
//! `row_threads` down the rows; each thread handles `TILE / row_threads` rows of one column.
//! Any shape works, not only multiples of the tile. Values are widened to f32 for the GELU
//! and its derivative, whatever the stored float type.

use cubecl::prelude::*;

/// `1/√2`, for `Φ(z) = ½(1 + erf(z/√2))`.
const FRAC_1_SQRT_2: f32 = core::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`, the standard normal density's constant.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `Φ(z)`, the standard normal CDF, through the exact erf.
#[cube]
fn normal_cdf(z: f32) -> f32 {
    0.5f32 * (1.0f32 + Erf::erf(z * f32::new(FRAC_1_SQRT_2)))
}

/// Forward: `z ← gelu(z + b)` with `z` `[n, m]` (= `x·W` on entry, the output on return) and
/// `b` `[m]`, contiguous and of the same float type.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn bias_gelu_fwd_kernel<F: Float>(
    z: &mut Tensor<F>,
    b: &Tensor<F>,
    n: u32,
    m: u32,
    #[comptime] tile: usize,
    #[comptime] row_threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, m) = (n as usize, m as usize);
    let row0 = CUBE_POS_Y as usize * tile;
    let col = CUBE_POS_X as usize * tile + UNIT_POS_X as usize;
    if col < m {
        let bias = f32::cast_from(b[col]);
        for i in 0..tile / row_threads {
            let row = row0 + UNIT_POS_Y as usize + i * row_threads;
            if row < n {
                let v = f32::cast_from(z[row * m + col]) + bias;
                z[row * m + col] = F::cast_from(v * normal_cdf(v));
            }
        }
    }
}

/// Backward epilogue: overwrites the recomputed `z = x·W` with `dz = dy ∘ gelu'(z + b)`
/// (`[n, m]`, input float type), with `gelu'(v) = Φ(v) + v·φ(v)`; also writes
/// `db_partial[tile_row, col] = Σ dz` over the tile's (up to `tile`) rows, in f32, so the
/// bias gradient is a short reduction of `[⌈n/tile⌉, m]` instead of `[n, m]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn bias_gelu_dz_kernel<F: Float>(
    z: &mut Tensor<F>,
    b: &Tensor<F>,
    dy: &Tensor<F>,
    db_partial: &mut Tensor<f32>,
    n: u32,
    m: u32,
    #[comptime] tile: usize,
    #[comptime] row_threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, m) = (n as usize, m as usize);
    let row0 = CUBE_POS_Y as usize * tile;
    let col0 = CUBE_POS_X as usize * tile;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let mut sums = SharedMemory::<f32>::new(tile * row_threads);
    let col = col0 + tx;
    let mut col_sum = f32::new(0.0);
    if col < m {
        let bias = f32::cast_from(b[col]);
        for i in 0..tile / row_threads {
            let row = row0 + ty + i * row_threads;
            if row < n {
                let v = f32::cast_from(z[row * m + col]) + bias;
                let pdf = (v * v * f32::new(-0.5)).exp() * f32::new(FRAC_1_SQRT_2PI);
                let g = f32::cast_from(dy[row * m + col]) * (normal_cdf(v) + v * pdf);
                let g_stored = F::cast_from(g);
                z[row * m + col] = g_stored;
                // Sum what was stored, so db is exactly the column sum of the dz that dx
                // and dW are computed from.
                col_sum += f32::cast_from(g_stored);
            }
        }
    }
    // Combine the row groups' sums through shared memory; the barrier sits outside every
    // branch.
    sums[ty * tile + tx] = col_sum;
    sync_cube();
    if ty == 0 && col < m {
        let mut s = f32::new(0.0);
        for g in 0..row_threads {
            s += sums[g * tile + tx];
        }
        db_partial[CUBE_POS_Y as usize * m + col] = s;
    }
}
