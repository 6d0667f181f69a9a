//! FlashAttention-2 backward, split in two kernels that each own their output rows, so no
//! atomics are needed (float atomics are not portable to wgpu):
//!
//! * `flash_dq_kernel`: one thread per query row, key/value tiles streamed through shared
//!   memory, `dQᵢ = scale · Σⱼ dSᵢⱼ Kⱼ`;
//! * `flash_dkdv_kernel`: one thread per key row, query/output-gradient tiles streamed,
//!   `dVⱼ = Σᵢ Pᵢⱼ dOᵢ` and `dKⱼ = scale · Σᵢ dSᵢⱼ Qᵢ`.
//!
//! Both recompute `Pᵢⱼ = exp(scale·Qᵢ·Kⱼ − lseᵢ)` tile by tile from the forward's log-sum-exp
//! and use `dSᵢⱼ = Pᵢⱼ (dOᵢ·Vⱼ − Δᵢ)` with `Δᵢ = dOᵢ·Oᵢ` precomputed; nothing of size
//! `[seq_q × seq_k]` is stored.

use cubecl::prelude::*;

use super::flash_fwd::visible;
use super::tiles::stage_rows;

/// dQ kernel: inputs contiguous `[batch, heads, seq, head_dim]`, `lse` and `delta` f32
/// `[batch, heads, seq_q]`, mask f32 `[batch, seq_k]` (1.0 = padded).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_dq_kernel<F: Float>(
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
    let mut do_reg = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut row_lse = f32::new(0.0);
    let mut row_delta = f32::new(0.0);
    if row_ok {
        row_lse = lse[bh * seq_q + row];
        row_delta = delta[bh * seq_q + row];
    }
    for c in 0..head_dim {
        let mut qx = f32::new(0.0);
        let mut dx = f32::new(0.0);
        if row_ok {
            qx = f32::cast_from(q[q_base + c]) * scale;
            dx = f32::cast_from(dout[q_base + c]);
        }
        q_reg[c] = qx;
        do_reg[c] = dx;
        acc[c] = f32::new(0.0);
    }

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
        for c in 0..block_k {
            if visible(mask, batch, row, kv0 + c, seq_q, seq_k, causal, has_mask) {
                let mut s = f32::new(0.0);
                let mut dp = f32::new(0.0);
                for x in 0..head_dim {
                    s += q_reg[x] * k_s[c * head_dim + x];
                    dp += do_reg[x] * v_s[c * head_dim + x];
                }
                let ds = (s - row_lse).exp() * (dp - row_delta);
                for x in 0..head_dim {
                    acc[x] += ds * k_s[c * head_dim + x];
                }
            }
        }
        sync_cube();
    }
    if row_ok {
        for x in 0..head_dim {
            dq[q_base + x] = F::cast_from(acc[x] * scale);
        }
    }
}

/// dK/dV kernel: one cube per (key tile, batch·head), one thread per key row; layouts as
/// [`flash_dq_kernel`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_dkdv_kernel<F: Float>(
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
    #[comptime] block_kv: usize,
    #[comptime] block_q: usize,
    #[comptime] causal: bool,
    #[comptime] has_mask: bool,
    #[define(F)] _dtype: StorageType,
) {
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let bh = CUBE_POS_Y as usize;
    let batch = bh / heads as usize;
    let tile = CUBE_POS_X as usize;
    let j = tile * block_kv + UNIT_POS_X as usize;
    let j_ok = j < seq_k;
    let kv_row = (bh * seq_k + j) * head_dim;
    let q_base = bh * seq_q * head_dim;

    let mut q_s = SharedMemory::<f32>::new(block_q * head_dim);
    let mut do_s = SharedMemory::<f32>::new(block_q * head_dim);
    let mut k_reg = Array::<f32>::new(head_dim);
    let mut v_reg = Array::<f32>::new(head_dim);
    let mut dk_acc = Array::<f32>::new(head_dim);
    let mut dv_acc = Array::<f32>::new(head_dim);
    for c in 0..head_dim {
        let mut kx = f32::new(0.0);
        let mut vx = f32::new(0.0);
        if j_ok {
            // Scale folded into k once: s = scale·q·k. dK gets its own factor at the end.
            kx = f32::cast_from(k[kv_row + c]) * scale;
            vx = f32::cast_from(v[kv_row + c]);
        }
        k_reg[c] = kx;
        v_reg[c] = vx;
        dk_acc[c] = f32::new(0.0);
        dv_acc[c] = f32::new(0.0);
    }

    // Causal: query rows before this key tile's first key see none of its keys, so start at
    // the query tile holding that row (uniform across the cube).
    let mut q0 = (tile * block_kv / block_q) * block_q;
    if !causal {
        q0 = 0;
    }
    while q0 < seq_q {
        stage_rows::<F, f32>(
            q, &mut q_s, 0usize, q_base, q0, seq_q, block_q, head_dim, head_dim, block_kv,
        );
        stage_rows::<F, f32>(
            dout, &mut do_s, 0usize, q_base, q0, seq_q, block_q, head_dim, head_dim, block_kv,
        );
        sync_cube();
        for r in 0..block_q {
            let i = q0 + r;
            let mut ok = j_ok;
            if ok {
                ok = visible(mask, batch, i, j, seq_q, seq_k, causal, has_mask);
            }
            if ok {
                let mut s = f32::new(0.0);
                let mut dp = f32::new(0.0);
                for x in 0..head_dim {
                    s += q_s[r * head_dim + x] * k_reg[x];
                    dp += do_s[r * head_dim + x] * v_reg[x];
                }
                // `ok` implies i < seq_q, so the row statistics are in range.
                let p = (s - lse[bh * seq_q + i]).exp();
                let ds = p * (dp - delta[bh * seq_q + i]);
                for x in 0..head_dim {
                    dv_acc[x] += p * do_s[r * head_dim + x];
                    dk_acc[x] += ds * q_s[r * head_dim + x];
                }
            }
        }
        sync_cube();
        q0 += block_q;
    }
    if j_ok {
        for x in 0..head_dim {
            dk[kv_row + x] = F::cast_from(dk_acc[x] * scale);
            dv[kv_row + x] = F::cast_from(dv_acc[x]);
        }
    }
}
