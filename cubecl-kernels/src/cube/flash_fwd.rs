//! FlashAttention-2 forward: one cube per (query tile, batch·head), one thread per query row.
//!
//! Keys and values stream through shared memory one tile at a time; each thread keeps its
//! query row, its output accumulator and its running max / sum in registers and rescales
//! the accumulator once per key tile (the online softmax). Memory is `O(seq · head_dim)`:
//! no `[seq_q × seq_k]` buffer exists, in global or shared memory.

use cubecl::prelude::*;

use super::tiles::stage_rows;

/// Score given to hidden (masked or out-of-range) keys in the per-tile score buffer, and the
/// initial running max. Finite because WGSL cannot reliably produce `-inf`; any real scaled
/// score is far above it.
pub(crate) const HIDDEN: f32 = -1.0e30;
/// Scores below this are hidden entries (real scores never come near `HIDDEN`).
pub(crate) const HIDDEN_THRESHOLD: f32 = -1.0e29;

/// Whether query row `row` may see key `j`: in range, not after the row when causal, and not
/// a padded key. The mask index is clamped so an out-of-range `j` never reads out of bounds.
#[cube]
pub(crate) fn visible(
    mask: &Tensor<f32>,
    batch: usize,
    row: usize,
    j: usize,
    seq_q: usize,
    seq_k: usize,
    #[comptime] causal: bool,
    #[comptime] has_mask: bool,
) -> bool {
    let mut ok = row < seq_q && j < seq_k;
    if causal {
        ok = ok && j <= row;
    }
    if has_mask {
        let jj = if j < seq_k { j } else { seq_k - 1 };
        // Not `ok && mask[..]`: CubeCL evaluates both operands of `&&`, so kernel code keeps
        // indexing out of it (the workspace's `tests/cuda_source_rules.rs`); this read is in
        // bounds anyway.
        if mask[batch * seq_k + jj] >= 0.5f32 {
            ok = false;
        }
    }
    ok
}

/// Forward kernel. Inputs contiguous `[batch, heads, seq, head_dim]`; `mask` is
/// `[batch, seq_k]` (f32) with 1.0 for padded keys (read only when `has_mask`); writes `out`
/// (same dtype as the inputs) and `lse` (f32, `[batch, heads, seq_q]`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_fwd_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[comptime] causal: bool,
    #[comptime] has_mask: bool,
    #[define(F)] _dtype: StorageType,
) {
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let bh = CUBE_POS_Y as usize;
    let batch = bh / heads as usize;
    let tile = CUBE_POS_X as usize;
    let row = tile * block_q + UNIT_POS_X as usize;
    let row_ok = row < seq_q;
    let q_base = (bh * seq_q + row) * head_dim;
    let kv_base = bh * seq_k * head_dim;

    let mut k_s = SharedMemory::<f32>::new(block_k * head_dim);
    let mut v_s = SharedMemory::<f32>::new(block_k * head_dim);
    let mut q_reg = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut s_loc = Array::<f32>::new(block_k);

    for c in 0..head_dim {
        let mut x = f32::new(0.0);
        if row_ok {
            // Fold the softmax scale into q once instead of into every score.
            x = f32::cast_from(q[q_base + c]) * scale;
        }
        q_reg[c] = x;
        acc[c] = 0.0f32;
    }
    let mut m = f32::new(HIDDEN);
    let mut l = f32::new(0.0);

    // Causal: no row of this tile sees keys past the tile's last row, so later key tiles
    // are skipped entirely (the loop bound is uniform across the cube, keeping syncs legal).
    let mut kv_end = seq_k;
    if causal {
        let last = (tile + 1) * block_q;
        if last < seq_k {
            kv_end = last;
        }
    }
    // Plain arithmetic: `div_ceil` has no CubeCL expansion.
    #[allow(clippy::manual_div_ceil)]
    let num_tiles = (kv_end + block_k - 1) / block_k;

    for t in 0..num_tiles {
        let kv0 = t * block_k;
        stage_rows::<F, f32>(
            k, &mut k_s, 0usize, kv_base, kv0, seq_k, block_k, head_dim, head_dim, block_q,
        );
        stage_rows::<F, f32>(
            v, &mut v_s, 0usize, kv_base, kv0, seq_k, block_k, head_dim, head_dim, block_q,
        );
        sync_cube();

        let mut tile_max = f32::new(HIDDEN);
        for c in 0..block_k {
            let j = kv0 + c;
            let mut s = f32::new(HIDDEN);
            if visible(mask, batch, row, j, seq_q, seq_k, causal, has_mask) {
                let mut dot = f32::new(0.0);
                for x in 0..head_dim {
                    dot += q_reg[x] * k_s[c * head_dim + x];
                }
                s = dot;
                if s > tile_max {
                    tile_max = s;
                }
            }
            s_loc[c] = s;
        }

        // Online softmax: rescale what was accumulated under the old max once per tile.
        let m_new = if tile_max > m { tile_max } else { m };
        let corr = (m - m_new).exp();
        l *= corr;
        for x in 0..head_dim {
            acc[x] *= corr;
        }
        for c in 0..block_k {
            let s = s_loc[c];
            if s > HIDDEN_THRESHOLD {
                let p = (s - m_new).exp();
                l += p;
                for x in 0..head_dim {
                    acc[x] += p * v_s[c * head_dim + x];
                }
            }
        }
        m = m_new;
        // The next tile's loads overwrite k_s / v_s: every thread must be done reading.
        sync_cube();
    }

    if row_ok {
        // A row that saw no key outputs 0 with the sentinel log-sum-exp (see `HIDDEN`).
        let mut inv = f32::new(0.0);
        let mut row_lse = f32::new(HIDDEN);
        if l > 0.0f32 {
            inv = 1.0f32 / l;
            row_lse = m + l.ln();
        }
        for x in 0..head_dim {
            out[q_base + x] = F::cast_from(acc[x] * inv);
        }
        lse[bh * seq_q + row] = row_lse;
    }
}
