//! FlashAttention-2 backward on tensor cores (CubeCL `cmma`), the tile counterpart of
//! [`super::flash_bwd`]: the same split into a dQ kernel (each plane owns 16 query rows,
//! key/value tiles streamed) and a dK/dV kernel (each plane owns 16 key rows, query/output-
//! gradient tiles streamed), so every output row has one owner and no atomics are needed.
//!
//! The streamed tiles are `stream_frags × 16` rows wide. Per tile a plane recomputes its
//! scores and `dP = dO·Vᵀ` as 16×16 fragment products, forms `P = exp(scale·S − lse)` and
//! `dS = scale · P ∘ (dP − Δ)` with its lanes (rounded to the input type, as the products'
//! operands; the softmax scale is folded into dS so the blocks hold the gradients
//! themselves), and accumulates `dQ += dS·K`, or `dV += Pᵀ·dO` and `dK += dSᵀ·Q`, into f32
//! blocks, the whole tile as the inner dimension of one product per 16 output columns. The
//! blocks stay in accumulator fragments for the whole loop by default, else in shared memory
//! (see [`super::row_acc`]); no rescale is needed here, so they reach shared memory once, at
//! the end, rounded to the input type in the plane's own rows of Q (dQ) or K and V (dK, dV),
//! which the kernel no longer needs then. With
//! `use_cmma = false` the products are computed by the lanes from the same operands (see
//! [`super::tiles`]).

use cubecl::prelude::*;

use super::flash_fwd::visible;
use super::row_acc::{row_block_acc_add, row_block_acc_write_rows, row_block_acc_zeroed, RowBlock};
use super::tiles::{
    rows_dot_rows, stage_rows_unrolled, stage_values, sync_plane_data, ALIGN, FRAG, ROW_PAD,
};

/// Floats of one accumulator block's place in shared memory: `rows` padded rows, or, when
/// the block lives in registers, none (CubeCL drops the one-element array the kernels then
/// declare, which is counted anyway): the block reaches global memory through the plane's
/// own rows of an input tile (see [`row_block_acc_write_rows`]).
fn accumulator_floats(rows: usize, padded_row: usize, acc_in_regs: bool) -> usize {
    if acc_in_regs {
        1
    } else {
        rows * padded_row
    }
}

/// Shared memory the dQ kernel declares, in bytes, for `planes` planes and key tiles of
/// `kv_frags × 16` keys.
pub(crate) fn dq_shared_bytes(
    planes: usize,
    kv_frags: usize,
    head_dim: usize,
    elem_bytes: usize,
    acc_in_regs: bool,
) -> usize {
    let (rows, tile) = (planes * FRAG, kv_frags * FRAG);
    let (hp, tp) = (head_dim + ROW_PAD, tile + ROW_PAD);
    let halves = 2 * rows * hp + 2 * tile * hp + rows * tp;
    let floats = 2 * rows * tp + accumulator_floats(rows, hp, acc_in_regs) + 2 * rows;
    halves * elem_bytes + floats * 4 + 10 * ALIGN
}

/// Shared memory the dK/dV kernel declares, in bytes, for `planes` planes and query tiles of
/// `q_frags × 16` rows.
pub(crate) fn dkdv_shared_bytes(
    planes: usize,
    q_frags: usize,
    head_dim: usize,
    elem_bytes: usize,
    acc_in_regs: bool,
) -> usize {
    let (rows, tile) = (planes * FRAG, q_frags * FRAG);
    let (hp, tp) = (head_dim + ROW_PAD, tile + ROW_PAD);
    let halves = 2 * rows * hp + 2 * tile * hp + 2 * rows * tp;
    let floats = 2 * rows * tp + 2 * accumulator_floats(rows, hp, acc_in_regs) + 2 * tile;
    halves * elem_bytes + floats * 4 + 12 * ALIGN
}

/// dQ kernel: inputs contiguous `[batch, heads, seq, head_dim]`, `lse` and `delta` f32
/// `[batch, heads, seq_q]`, mask f32 `[batch, seq_k]` (1.0 = padded). Launch with
/// `CubeDim::new_2d(plane_dim, planes)`, one cube per `planes·16` query rows and batch·head;
/// keys and values stream in tiles of `kv_frags·16`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_dq_tiles_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    mask: &Tensor<f32>,
    dq: &mut Tensor<F>,
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] planes: usize,
    #[comptime] stream_frags: usize,
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
    let block_kv = stream_frags * FRAG;
    // Row strides of the shared-memory blocks, padded (see ROW_PAD).
    let hp = comptime!(head_dim + ROW_PAD);
    // How every accumulator block of this kernel lives (see `row_acc`).
    let block = comptime!(RowBlock::new(head_dim, plane_dim, use_cmma, acc_in_regs));
    let kvp = comptime!(block_kv + ROW_PAD);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let bh = CUBE_POS_Y as usize;
    let batch = bh / heads as usize;
    let q0 = CUBE_POS_X as usize * block_q;
    let q_base = bh * seq_q * head_dim;
    let kv_base = bh * seq_k * head_dim;
    let own = plane * FRAG * hp;
    let blk = plane * FRAG * kvp;

    let mut q_s = SharedMemory::<F>::new_aligned(block_q * hp, ALIGN);
    let mut do_s = SharedMemory::<F>::new_aligned(block_q * hp, ALIGN);
    let mut k_s = SharedMemory::<F>::new_aligned(block_kv * hp, ALIGN);
    let mut v_s = SharedMemory::<F>::new_aligned(block_kv * hp, ALIGN);
    let mut s_s = SharedMemory::<f32>::new_aligned(planes * FRAG * kvp, ALIGN);
    let mut dp_s = SharedMemory::<f32>::new_aligned(planes * FRAG * kvp, ALIGN);
    let mut ds_s = SharedMemory::<F>::new_aligned(planes * FRAG * kvp, ALIGN);
    // dQ's place in shared memory, needed only when it does not live in registers.
    let acc_len = comptime!(accumulator_floats(planes * FRAG, hp, acc_in_regs));
    let mut dq_s = SharedMemory::<f32>::new_aligned(acc_len, ALIGN);
    let mut lse_s = SharedMemory::<f32>::new(block_q);
    let mut delta_s = SharedMemory::<f32>::new(block_q);

    stage_rows_unrolled::<F, F>(
        q, &mut q_s, 0usize, q_base, q0, seq_q, block_q, head_dim, hp, threads,
    );
    stage_rows_unrolled::<F, F>(
        dout, &mut do_s, 0usize, q_base, q0, seq_q, block_q, head_dim, hp, threads,
    );
    stage_values(lse, &mut lse_s, bh * seq_q, q0, seq_q, block_q, threads);
    stage_values(delta, &mut delta_s, bh * seq_q, q0, seq_q, block_q, threads);
    let mut dq_acc = row_block_acc_zeroed(&mut dq_s, own, block);
    sync_cube();

    let mut kv_end = seq_k;
    if causal {
        let last = q0 + block_q;
        if last < seq_k {
            kv_end = last;
        }
    }
    #[allow(clippy::manual_div_ceil)]
    let num_tiles = (kv_end + block_kv - 1) / block_kv;
    for t in 0..num_tiles {
        let kv0 = t * block_kv;
        stage_rows_unrolled::<F, F>(
            k, &mut k_s, 0usize, kv_base, kv0, seq_k, block_kv, head_dim, hp, threads,
        );
        stage_rows_unrolled::<F, F>(
            v, &mut v_s, 0usize, kv_base, kv0, seq_k, block_kv, head_dim, hp, threads,
        );
        sync_cube();
        // S = Q·Kᵀ and dP = dO·Vᵀ for the plane's rows and this key tile, 16 keys at a time.
        rows_dot_rows::<F>(
            &q_s,
            own,
            &k_s,
            &mut s_s,
            blk,
            stream_frags,
            head_dim,
            hp,
            kvp,
            plane_dim,
            use_cmma,
        );
        rows_dot_rows::<F>(
            &do_s,
            own,
            &v_s,
            &mut dp_s,
            blk,
            stream_frags,
            head_dim,
            hp,
            kvp,
            plane_dim,
            use_cmma,
        );
        sync_plane_data(warp_sync);
        let mut e = lane;
        while e < FRAG * block_kv {
            let r = plane * FRAG + e / block_kv;
            let at = blk + (e / block_kv) * kvp + e % block_kv;
            let mut ds = f32::new(0.0);
            if visible(
                mask,
                batch,
                q0 + r,
                kv0 + e % block_kv,
                seq_q,
                seq_k,
                causal,
                has_mask,
            ) {
                let p = (s_s[at] * scale - lse_s[r]).exp();
                ds = p * (dp_s[at] - delta_s[r]) * scale;
            }
            ds_s[at] = F::cast_from(ds);
            e += plane_dim;
        }
        sync_plane_data(warp_sync);
        // dQ += dS·K, one 16-column block of the head dimension at a time, the tile's keys
        // as the inner dimension.
        row_block_acc_add::<F>(
            &mut dq_acc,
            &ds_s,
            blk,
            kvp,
            &k_s,
            &mut dq_s,
            own,
            stream_frags,
            block,
        );
        // The next tile overwrites k_s / v_s / s_s / dp_s / ds_s.
        sync_cube();
    }

    // The plane's own query rows are free now: they stage dQ when it lives in registers.
    row_block_acc_write_rows::<F>(
        &dq_acc,
        &dq_s,
        &mut q_s,
        own,
        dq,
        q_base,
        q0 + plane * FRAG,
        seq_q,
        warp_sync,
        block,
    );
}

/// dK/dV kernel: layouts as [`flash_dq_tiles_kernel`]; one cube per `planes·16` key rows and
/// batch·head, each plane owning 16 keys; queries and output gradients stream in tiles of
/// `stream_frags·16` rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_dkdv_tiles_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    mask: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] planes: usize,
    #[comptime] stream_frags: usize,
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
    let block_k = planes * FRAG;
    let block_q = stream_frags * FRAG;
    // Row strides of the shared-memory blocks, padded (see ROW_PAD).
    let hp = comptime!(head_dim + ROW_PAD);
    // How every accumulator block of this kernel lives (see `row_acc`).
    let block = comptime!(RowBlock::new(head_dim, plane_dim, use_cmma, acc_in_regs));
    let qp = comptime!(block_q + ROW_PAD);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let bh = CUBE_POS_Y as usize;
    let batch = bh / heads as usize;
    let k0 = CUBE_POS_X as usize * block_k;
    let q_base = bh * seq_q * head_dim;
    let kv_base = bh * seq_k * head_dim;
    let own = plane * FRAG * hp;
    let blk = plane * FRAG * qp;

    let mut k_s = SharedMemory::<F>::new_aligned(block_k * hp, ALIGN);
    let mut v_s = SharedMemory::<F>::new_aligned(block_k * hp, ALIGN);
    let mut q_s = SharedMemory::<F>::new_aligned(block_q * hp, ALIGN);
    let mut do_s = SharedMemory::<F>::new_aligned(block_q * hp, ALIGN);
    let mut s_s = SharedMemory::<f32>::new_aligned(planes * FRAG * qp, ALIGN);
    let mut dp_s = SharedMemory::<f32>::new_aligned(planes * FRAG * qp, ALIGN);
    let mut p_s = SharedMemory::<F>::new_aligned(planes * FRAG * qp, ALIGN);
    let mut ds_s = SharedMemory::<F>::new_aligned(planes * FRAG * qp, ALIGN);
    // dK's and dV's places in shared memory, needed only when they do not live in registers.
    let acc_len = comptime!(accumulator_floats(planes * FRAG, hp, acc_in_regs));
    let mut dk_s = SharedMemory::<f32>::new_aligned(acc_len, ALIGN);
    let mut dv_s = SharedMemory::<f32>::new_aligned(acc_len, ALIGN);
    let mut lse_s = SharedMemory::<f32>::new(block_q);
    let mut delta_s = SharedMemory::<f32>::new(block_q);

    stage_rows_unrolled::<F, F>(
        k, &mut k_s, 0usize, kv_base, k0, seq_k, block_k, head_dim, hp, threads,
    );
    stage_rows_unrolled::<F, F>(
        v, &mut v_s, 0usize, kv_base, k0, seq_k, block_k, head_dim, hp, threads,
    );
    let mut dk_acc = row_block_acc_zeroed(&mut dk_s, own, block);
    let mut dv_acc = row_block_acc_zeroed(&mut dv_s, own, block);

    // Causal: a query row before the cube's first key sees none of its keys, so the query
    // tiles start at the one holding row `k0` (uniform across the cube).
    let mut first = 0usize;
    if causal {
        first = k0 / block_q;
    }
    #[allow(clippy::manual_div_ceil)]
    let num_tiles = (seq_q + block_q - 1) / block_q;
    for t in first..num_tiles {
        let q0 = t * block_q;
        // The previous tile's last reads of q_s / do_s / lse_s / delta_s are behind the
        // barrier that ends it (or, for the first tile, nothing has read them yet).
        stage_rows_unrolled::<F, F>(
            q, &mut q_s, 0usize, q_base, q0, seq_q, block_q, head_dim, hp, threads,
        );
        stage_rows_unrolled::<F, F>(
            dout, &mut do_s, 0usize, q_base, q0, seq_q, block_q, head_dim, hp, threads,
        );
        stage_values(lse, &mut lse_s, bh * seq_q, q0, seq_q, block_q, threads);
        stage_values(delta, &mut delta_s, bh * seq_q, q0, seq_q, block_q, threads);
        sync_cube();
        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the plane's keys and this query tile, 16 queries at a
        // time.
        rows_dot_rows::<F>(
            &k_s,
            own,
            &q_s,
            &mut s_s,
            blk,
            stream_frags,
            head_dim,
            hp,
            qp,
            plane_dim,
            use_cmma,
        );
        rows_dot_rows::<F>(
            &v_s,
            own,
            &do_s,
            &mut dp_s,
            blk,
            stream_frags,
            head_dim,
            hp,
            qp,
            plane_dim,
            use_cmma,
        );
        sync_plane_data(warp_sync);
        let mut e = lane;
        while e < FRAG * block_q {
            let i = e % block_q;
            let key = k0 + plane * FRAG + e / block_q;
            let at = blk + (e / block_q) * qp + i;
            let mut p = f32::new(0.0);
            let mut ds = f32::new(0.0);
            if visible(mask, batch, q0 + i, key, seq_q, seq_k, causal, has_mask) {
                p = (s_s[at] * scale - lse_s[i]).exp();
                ds = p * (dp_s[at] - delta_s[i]) * scale;
            }
            p_s[at] = F::cast_from(p);
            ds_s[at] = F::cast_from(ds);
            e += plane_dim;
        }
        sync_plane_data(warp_sync);
        // dV += Pᵀ·dO and dK += dSᵀ·Q, one 16-column block of the head dimension at a time,
        // the tile's queries as the inner dimension.
        row_block_acc_add::<F>(
            &mut dv_acc,
            &p_s,
            blk,
            qp,
            &do_s,
            &mut dv_s,
            own,
            stream_frags,
            block,
        );
        row_block_acc_add::<F>(
            &mut dk_acc,
            &ds_s,
            blk,
            qp,
            &q_s,
            &mut dk_s,
            own,
            stream_frags,
            block,
        );
        sync_cube();
    }

    // The plane's own key and value rows are free now: they stage dK and dV when those
    // live in registers.
    let row0 = k0 + plane * FRAG;
    row_block_acc_write_rows::<F>(
        &dk_acc, &dk_s, &mut k_s, own, dk, kv_base, row0, seq_k, warp_sync, block,
    );
    row_block_acc_write_rows::<F>(
        &dv_acc, &dv_s, &mut v_s, own, dv, kv_base, row0, seq_k, warp_sync, block,
    );
}
