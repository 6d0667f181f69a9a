//! FlashAttention-2 forward on tensor cores (CubeCL `cmma`), for f16/bf16 inputs with f32
//! accumulation, head dimension a multiple of 16.
//!
//! One cube per (query tile, batch·head); each plane (warp) of the cube owns 16 query rows.
//! Keys and values stream through shared memory in tiles of `kv_frags × 16` keys. Per tile the
//! plane computes its scores `S = Q·Kᵀ` as 16×16 matrix products, runs the online softmax on
//! them row by row, and adds `P·V` to its output block. The online softmax must rescale that
//! block row by row, which accumulator fragments (opaque layouts) cannot do in place, but
//! only when a row's max rises past a threshold (see `RESCALE_THRESHOLD`), which after the
//! first tiles is rare. So by default the block stays in accumulator fragments for the whole
//! loop and goes through shared memory only for a rescale and at the end
//! ([`super::AccumulatorPlace`], [`super::row_acc`]); in the other place each `P·V` product
//! loads it from shared memory, adds the tile's keys and stores it back.
//! Memory is `O(seq · head_dim)`: no `[seq_q × seq_k]` buffer exists anywhere.
//!
//! With `use_cmma = false` the two fragment products are computed by the plane's lanes from
//! the same shared-memory operands instead. Everything else (staging, masking, the online
//! softmax, the rescaling, the output) is the same code, so that half of the kernel is tested
//! on devices without tensor cores (Mesa's CPU Vulkan driver) where `cmma` cannot run.

use cubecl::prelude::*;

use super::flash_fwd::{visible, HIDDEN, HIDDEN_THRESHOLD};
use super::row_acc::{
    row_block_acc_add, row_block_acc_from_shared, row_block_acc_to_shared, row_block_acc_zeroed,
    RowBlock,
};
use super::tiles::{rows_dot_rows, stage_rows_unrolled, sync_plane_data, ALIGN, FRAG, ROW_PAD};

/// How far (in units of the scaled scores) a row's scores may rise above the max its
/// probabilities are taken against before that reference moves and the output block is
/// rescaled. Probabilities then reach at most e⁸ ≈ 2981, well inside f16 (65504) and bf16,
/// whose relative precision does not depend on magnitude; the row's sum and output carry the
/// same factor and it cancels in `O / l` and in `lse = m + ln l`. As in FlashAttention-4, this
/// turns the per-tile rescale of the whole block into a rare one: after the first tile a
/// row's max seldom rises that much.
const RESCALE_THRESHOLD: f32 = 8.0;

/// Most lanes that share one row of the softmax (bounds its scratch memory; lanes past
/// `16 × MAX_LANES_PER_ROW` in a plane, on planes wider than 64, idle in the softmax).
const MAX_LANES_PER_ROW: usize = 4;

/// Lanes per softmax row on planes of `plane_dim` lanes (see [`MAX_LANES_PER_ROW`]).
pub(crate) fn softmax_lanes_per_row(plane_dim: usize) -> usize {
    (plane_dim / FRAG).clamp(1, MAX_LANES_PER_ROW)
}

/// Shared memory the kernel declares, in bytes, for `planes` planes and key tiles of
/// `kv_frags × 16` keys (the launcher picks a plan that fits the device), at most: the
/// softmax scratch is counted for [`MAX_LANES_PER_ROW`].
pub(crate) fn shared_bytes(
    planes: usize,
    kv_frags: usize,
    head_dim: usize,
    elem_bytes: usize,
) -> usize {
    let block_kv = kv_frags * FRAG;
    let (hp, kvp) = (head_dim + ROW_PAD, block_kv + ROW_PAD);
    let halves = planes * FRAG * hp + 2 * block_kv * hp + planes * FRAG * kvp;
    let floats =
        planes * FRAG * kvp + planes * FRAG * hp + planes * FRAG * (1 + 2 * MAX_LANES_PER_ROW);
    halves * elem_bytes + floats * 4 + 8 * ALIGN
}

/// Forward kernel; same contract as [`super::flash_fwd::flash_fwd_kernel`]: contiguous
/// `[batch, heads, seq, head_dim]` inputs, `mask` `[batch, seq_k]` f32 (1.0 = padded key,
/// read only when `has_mask`), writes `out` (input dtype) and `lse` (f32 `[batch, heads,
/// seq_q]`). Launch with `CubeDim::new_2d(plane_dim, planes)`, one cube per `planes × 16` query
/// rows and batch·head.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_fwd_tiles_kernel<F: Float>(
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
    #[comptime] planes: usize,
    #[comptime] kv_frags: usize,
    #[comptime] plane_dim: usize,
    #[comptime] causal: bool,
    #[comptime] has_mask: bool,
    #[comptime] use_cmma: bool,
    #[comptime] warp_sync: bool,
    #[comptime] acc_in_regs: bool,
    #[define(F)] _dtype: StorageType,
) {
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let threads = planes * plane_dim;
    let block_q = planes * FRAG;
    let block_kv = kv_frags * FRAG;
    // Row strides of the shared-memory blocks, padded (see ROW_PAD).
    let hp = comptime!(head_dim + ROW_PAD);
    // How every accumulator block of this kernel lives (see `row_acc`).
    let block = comptime!(RowBlock::new(head_dim, plane_dim, use_cmma, acc_in_regs));
    let kvp = comptime!(block_kv + ROW_PAD);
    // The softmax's split of the plane's 16 rows over its lanes: several lanes per row on
    // planes wider than 16 lanes (CUDA's 32), each taking every `lanes_per_row`-th column,
    // so that no lane idles; several rows per lane on narrower planes.
    let lanes_per_row = comptime!(softmax_lanes_per_row(plane_dim));
    let rows_per_lane = comptime!(FRAG.div_ceil(plane_dim));
    let cols_per_lane = comptime!(block_kv / lanes_per_row);

    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let bh = CUBE_POS_Y as usize;
    let batch = bh / heads as usize;
    let tile = CUBE_POS_X as usize;
    let q0 = tile * block_q;
    let plane_row0 = q0 + plane * FRAG;
    // This lane's column class in the softmax, and its first row.
    let part = lane / FRAG;
    let row_in = lane % FRAG;
    let q_base = bh * seq_q * head_dim;
    let kv_base = bh * seq_k * head_dim;

    // Fragment loads and stores need 32-byte aligned addresses (CUDA's wmma); every
    // fragment offset below is a multiple of 16 elements, so aligned bases suffice.
    let mut q_s = SharedMemory::<F>::new_aligned(block_q * hp, ALIGN);
    let mut k_s = SharedMemory::<F>::new_aligned(block_kv * hp, ALIGN);
    let mut v_s = SharedMemory::<F>::new_aligned(block_kv * hp, ALIGN);
    let mut s_s = SharedMemory::<f32>::new_aligned(planes * FRAG * kvp, ALIGN);
    let mut p_s = SharedMemory::<F>::new_aligned(planes * FRAG * kvp, ALIGN);
    let mut o_s = SharedMemory::<f32>::new_aligned(planes * FRAG * hp, ALIGN);
    let mut row_s = SharedMemory::<f32>::new(planes * FRAG);
    // Each row's partial maxima and sums, one per lane of the row.
    let mut max_s = SharedMemory::<f32>::new(planes * FRAG * lanes_per_row);
    let mut sum_s = SharedMemory::<f32>::new(planes * FRAG * lanes_per_row);
    let red = plane * FRAG * lanes_per_row;

    stage_rows_unrolled::<F, F>(
        q, &mut q_s, 0usize, q_base, q0, seq_q, block_q, head_dim, hp, threads,
    );
    let o_off = plane * FRAG * hp;
    let mut acc = row_block_acc_zeroed(&mut o_s, o_off, block);
    // Every lane of a row keeps the row's running max and sum (the same values).
    let mut m = Array::<f32>::new(rows_per_lane);
    let mut l = Array::<f32>::new(rows_per_lane);
    let mut corr = Array::<f32>::new(rows_per_lane);
    for i in 0..rows_per_lane {
        m[i] = HIDDEN;
        l[i] = 0.0f32;
        corr[i] = 1.0f32;
    }
    sync_cube();

    // Causal: no row of this cube sees keys past its last row; the bound is uniform across
    // the cube, so the barriers inside the loop stay legal.
    let mut kv_end = seq_k;
    if causal {
        let last = q0 + block_q;
        if last < seq_k {
            kv_end = last;
        }
    }
    #[allow(clippy::manual_div_ceil)]
    let num_tiles = (kv_end + block_kv - 1) / block_kv;
    let s_off = plane * FRAG * kvp;

    for t in 0..num_tiles {
        let kv0 = t * block_kv;
        stage_rows_unrolled::<F, F>(
            k, &mut k_s, 0usize, kv_base, kv0, seq_k, block_kv, head_dim, hp, threads,
        );
        stage_rows_unrolled::<F, F>(
            v, &mut v_s, 0usize, kv_base, kv0, seq_k, block_kv, head_dim, hp, threads,
        );
        sync_cube();

        // S = Q·Kᵀ for the plane's 16 rows, 16 keys at a time (Kᵀ: the staged key rows read
        // column-major).
        rows_dot_rows::<F>(
            &q_s,
            plane * FRAG * hp,
            &k_s,
            &mut s_s,
            s_off,
            kv_frags,
            head_dim,
            hp,
            kvp,
            plane_dim,
            use_cmma,
        );
        sync_plane_data(warp_sync);

        // Online softmax in three steps, each lane over its columns of its rows: scaled
        // scores and partial maxima; the row max, probabilities and partial sums; the row
        // sum and the correction of the output block.
        for i in 0..rows_per_lane {
            let r = row_in + i * plane_dim;
            if r < FRAG && part < lanes_per_row {
                let row = plane_row0 + r;
                let mut part_max = f32::new(HIDDEN);
                for j in 0..cols_per_lane {
                    let c = part + j * lanes_per_row;
                    let mut s = f32::new(HIDDEN);
                    if visible(mask, batch, row, kv0 + c, seq_q, seq_k, causal, has_mask) {
                        s = s_s[s_off + r * kvp + c] * scale;
                        if s > part_max {
                            part_max = s;
                        }
                    }
                    s_s[s_off + r * kvp + c] = s;
                }
                max_s[red + r * lanes_per_row + part] = part_max;
            }
        }
        sync_plane_data(warp_sync);
        for i in 0..rows_per_lane {
            let r = row_in + i * plane_dim;
            if r < FRAG && part < lanes_per_row {
                let mut tile_max = f32::new(HIDDEN);
                for x in 0..lanes_per_row {
                    let y = max_s[red + r * lanes_per_row + x];
                    if y > tile_max {
                        tile_max = y;
                    }
                }
                // The reference max moves only when the tile's max passes it by more than
                // the threshold (see RESCALE_THRESHOLD), so most tiles leave the output
                // block as it is.
                let m_old = m[i];
                let mut m_new = m_old;
                if tile_max > m_old + RESCALE_THRESHOLD {
                    m_new = tile_max;
                }
                corr[i] = (m_old - m_new).exp();
                m[i] = m_new;
                let mut part_sum = f32::new(0.0);
                for j in 0..cols_per_lane {
                    let c = part + j * lanes_per_row;
                    let s = s_s[s_off + r * kvp + c];
                    let mut p = f32::new(0.0);
                    if s > HIDDEN_THRESHOLD {
                        p = (s - m_new).exp();
                    }
                    part_sum += p;
                    p_s[s_off + r * kvp + c] = F::cast_from(p);
                }
                sum_s[red + r * lanes_per_row + part] = part_sum;
            }
        }
        sync_plane_data(warp_sync);
        for i in 0..rows_per_lane {
            let r = row_in + i * plane_dim;
            if r < FRAG && part < lanes_per_row {
                let mut tile_sum = f32::new(0.0);
                for x in 0..lanes_per_row {
                    tile_sum += sum_s[red + r * lanes_per_row + x];
                }
                l[i] = l[i] * corr[i] + tile_sum;
                if part == 0 {
                    row_s[plane * FRAG + r] = corr[i];
                }
            }
        }
        sync_plane_data(warp_sync);

        // Rescale the output block by each row's correction, then O += P·V with the tile's
        // keys as the inner dimension. The rescale is skipped (by the whole plane alike) when
        // no row's reference max moved; it works on the block in shared memory, so a block
        // kept in registers goes there and back. The barriers stay outside the branches: on
        // devices without warp barriers they are cube barriers, which every plane must reach.
        let mut moved = false;
        for r in 0..FRAG {
            if row_s[plane * FRAG + r] != 1.0f32 {
                moved = true;
            }
        }
        if acc_in_regs {
            if moved {
                row_block_acc_to_shared(&acc, &mut o_s, o_off, block);
            }
            sync_plane_data(warp_sync);
        }
        if moved {
            let mut e = lane;
            while e < FRAG * head_dim {
                o_s[o_off + (e / head_dim) * hp + e % head_dim] *=
                    row_s[plane * FRAG + e / head_dim];
                e += plane_dim;
            }
        }
        sync_plane_data(warp_sync);
        // Back into the fragments (a no-op for a block that lives in shared memory).
        if moved {
            row_block_acc_from_shared(&mut acc, &o_s, o_off, block);
        }
        row_block_acc_add::<F>(
            &mut acc, &p_s, s_off, kvp, &v_s, &mut o_s, o_off, kv_frags, block,
        );
        // The next tile overwrites k_s / v_s / s_s / p_s: every plane must be done with them.
        sync_cube();
    }

    // The output block to shared memory; each row's 1/l (0 for a row that saw no key, which
    // outputs 0 with the sentinel log-sum-exp, as the portable kernel does); then the output
    // in the input dtype.
    row_block_acc_to_shared(&acc, &mut o_s, o_off, block);
    for i in 0..rows_per_lane {
        let r = row_in + i * plane_dim;
        if r < FRAG && part == 0 {
            let row = plane_row0 + r;
            let mut inv = f32::new(0.0);
            let mut row_lse = f32::new(HIDDEN);
            if l[i] > 0.0f32 {
                inv = 1.0f32 / l[i];
                row_lse = m[i] + l[i].ln();
            }
            row_s[plane * FRAG + r] = inv;
            if row < seq_q {
                lse[bh * seq_q + row] = row_lse;
            }
        }
    }
    sync_plane_data(warp_sync);
    let mut e = lane;
    while e < FRAG * head_dim {
        let r = e / head_dim;
        let row = plane_row0 + r;
        if row < seq_q {
            out[q_base + row * head_dim + e % head_dim] =
                F::cast_from(o_s[o_off + r * hp + e % head_dim] * row_s[plane * FRAG + r]);
        }
        e += plane_dim;
    }
}
