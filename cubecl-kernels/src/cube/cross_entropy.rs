//! Fused linear cross-entropy kernels: the `[tokens × vocab]` logits are produced 32 × 32 at
//! a time in shared memory and consumed at once (online log-sum-exp forward; recomputed in
//! the backward), so memory is `O(tokens + vocab·hidden)`, never `O(tokens·vocab)`.
//!
//! * `ce_fwd_kernel`: one thread per token; per-token loss, log-sum-exp and validity.
//! * `ce_dh_kernel`: one thread per token; `dhₜ = Σᵥ gₜᵥ W[:, v]`.
//! * `ce_dw_kernel`: one thread per vocabulary column; `dW[:, v] = Σₜ gₜᵥ hₜ`.
//!
//! with `gₜᵥ = (softmax(hₜW)ᵥ − [v = targetₜ]) · coefₜ`, `coefₜ = validₜ · dloss / count`.
//! Each thread owns its output row or column, so there are no atomics.

use cubecl::prelude::*;

use super::flash_fwd::HIDDEN;

/// Computes the `[T tokens × T columns]` logits tile starting at `(row0, v0)` into `prod_s`
/// (row-major, token-major), zero outside the matrix; tiles over the hidden dimension through
/// `h_s` / `w_s`. Ends with a barrier, so `prod_s` is readable by every thread.
#[cube]
#[allow(clippy::too_many_arguments)]
fn logits_tile<F: Float>(
    h: &Tensor<F>,
    w: &Tensor<F>,
    h_s: &mut SharedMemory<f32>,
    w_s: &mut SharedMemory<f32>,
    prod_s: &mut SharedMemory<f32>,
    row0: usize,
    v0: usize,
    n: usize,
    hidden: usize,
    vocab: usize,
    #[comptime] t: usize,
) {
    let tid = UNIT_POS_X as usize;
    let mut acc = Array::<f32>::new(t);
    for c in 0..t {
        acc[c] = f32::new(0.0);
    }
    let mut h0 = 0usize.runtime();
    while h0 < hidden {
        let mut idx = tid;
        while idx < t * t {
            let (r, c) = (idx / t, idx % t);
            let mut hx = f32::new(0.0);
            if row0 + r < n && h0 + c < hidden {
                hx = f32::cast_from(h[(row0 + r) * hidden + h0 + c]);
            }
            h_s[idx] = hx;
            let mut wx = f32::new(0.0);
            if h0 + r < hidden && v0 + c < vocab {
                wx = f32::cast_from(w[(h0 + r) * vocab + v0 + c]);
            }
            w_s[idx] = wx;
            idx += t;
        }
        sync_cube();
        for c in 0..t {
            let mut s = acc[c];
            for x in 0..t {
                s += h_s[tid * t + x] * w_s[x * t + c];
            }
            acc[c] = s;
        }
        sync_cube();
        h0 += t;
    }
    for c in 0..t {
        prod_s[tid * t + c] = acc[c];
    }
    sync_cube();
}

/// Forward: per token, `loss = lse − logit[target]` (0 when ignored), `lse` and `valid`
/// (1.0 or 0.0), all f32 `[tokens]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_fwd_kernel<F: Float>(
    h: &Tensor<F>,
    w: &Tensor<F>,
    targets: &Tensor<i32>,
    loss: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    valid: &mut Tensor<f32>,
    n: u32,
    hidden: u32,
    vocab: u32,
    ignore_index: i32,
    #[comptime] t: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, hidden, vocab) = (n as usize, hidden as usize, vocab as usize);
    let row0 = CUBE_POS_X as usize * t;
    let tid = UNIT_POS_X as usize;
    let row = row0 + tid;
    let mut h_s = SharedMemory::<f32>::new(t * t);
    let mut w_s = SharedMemory::<f32>::new(t * t);
    let mut prod_s = SharedMemory::<f32>::new(t * t);
    let mut target = ignore_index;
    if row < n {
        target = targets[row];
    }
    let mut m = f32::new(HIDDEN);
    let mut l = f32::new(0.0);
    let mut picked = f32::new(0.0);
    let mut v0 = 0usize.runtime();
    while v0 < vocab {
        logits_tile::<F>(
            h,
            w,
            &mut h_s,
            &mut w_s,
            &mut prod_s,
            row0,
            v0,
            n,
            hidden,
            vocab,
            t,
        );
        let mut tile_max = f32::new(HIDDEN);
        for c in 0..t {
            let z = prod_s[tid * t + c];
            if v0 + c < vocab && z > tile_max {
                tile_max = z;
            }
        }
        let m_new = if tile_max > m { tile_max } else { m };
        l *= (m - m_new).exp();
        for c in 0..t {
            let z = prod_s[tid * t + c];
            if v0 + c < vocab {
                l += (z - m_new).exp();
                if (v0 + c) as i32 == target {
                    picked = z;
                }
            }
        }
        m = m_new;
        // prod_s is rewritten by the next tile only after the barriers inside logits_tile.
        v0 += t;
    }
    if row < n {
        let row_lse = m + l.ln();
        lse[row] = row_lse;
        let mut row_loss = f32::new(0.0);
        let mut row_valid = f32::new(0.0);
        if target != ignore_index {
            row_loss = row_lse - picked;
            row_valid = f32::new(1.0);
        }
        loss[row] = row_loss;
        valid[row] = row_valid;
    }
}

/// `g` for logit `z` of column `v` of a token with log-sum-exp `row_lse`, target `target`
/// and coefficient `coef` (0 for ignored tokens).
#[cube]
fn grad_logit(z: f32, v: usize, row_lse: f32, target: i32, coef: f32) -> f32 {
    let mut g = (z - row_lse).exp();
    if v as i32 == target {
        g -= f32::new(1.0);
    }
    g * coef
}

/// Backward to the hidden states: `dh [tokens, hidden]`, each thread owning one token row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_dh_kernel<F: Float>(
    h: &Tensor<F>,
    w: &Tensor<F>,
    targets: &Tensor<i32>,
    lse: &Tensor<f32>,
    coef: &Tensor<f32>,
    dh: &mut Tensor<F>,
    n: u32,
    hidden: u32,
    vocab: u32,
    #[comptime] t: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, hidden, vocab) = (n as usize, hidden as usize, vocab as usize);
    let row0 = CUBE_POS_X as usize * t;
    let tid = UNIT_POS_X as usize;
    let row = row0 + tid;
    let row_ok = row < n;
    let mut h_s = SharedMemory::<f32>::new(t * t);
    let mut w_s = SharedMemory::<f32>::new(t * t);
    let mut prod_s = SharedMemory::<f32>::new(t * t);
    let mut g = Array::<f32>::new(t);
    let mut target = i32::new(-1);
    let mut row_lse = f32::new(0.0);
    let mut row_coef = f32::new(0.0);
    if row_ok {
        target = targets[row];
        row_lse = lse[row];
        row_coef = coef[row];
        // The row is accumulated in place, one read-modify-write per 32-column tile (it is
        // too long for registers); with f16/bf16 outputs this rounds once per tile.
        for i in 0..hidden {
            dh[row * hidden + i] = F::new(0.0);
        }
    }
    let mut v0 = 0usize.runtime();
    while v0 < vocab {
        logits_tile::<F>(
            h,
            w,
            &mut h_s,
            &mut w_s,
            &mut prod_s,
            row0,
            v0,
            n,
            hidden,
            vocab,
            t,
        );
        for c in 0..t {
            let mut gc = f32::new(0.0);
            if v0 + c < vocab {
                gc = grad_logit(prod_s[tid * t + c], v0 + c, row_lse, target, row_coef);
            }
            g[c] = gc;
        }
        if row_ok {
            for i in 0..hidden {
                let mut s = f32::cast_from(dh[row * hidden + i]);
                for c in 0..t {
                    if v0 + c < vocab {
                        s += g[c] * f32::cast_from(w[i * vocab + v0 + c]);
                    }
                }
                dh[row * hidden + i] = F::cast_from(s);
            }
        }
        v0 += t;
    }
}

/// Backward to the head weight: `dW [hidden, vocab]`, each thread owning one column.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ce_dw_kernel<F: Float>(
    h: &Tensor<F>,
    w: &Tensor<F>,
    targets: &Tensor<i32>,
    lse: &Tensor<f32>,
    coef: &Tensor<f32>,
    dw: &mut Tensor<F>,
    n: u32,
    hidden: u32,
    vocab: u32,
    #[comptime] t: usize,
    #[define(F)] _dtype: StorageType,
) {
    let (n, hidden, vocab) = (n as usize, hidden as usize, vocab as usize);
    let v0 = CUBE_POS_X as usize * t;
    let tid = UNIT_POS_X as usize;
    let col = v0 + tid;
    let col_ok = col < vocab;
    let mut h_s = SharedMemory::<f32>::new(t * t);
    let mut w_s = SharedMemory::<f32>::new(t * t);
    let mut prod_s = SharedMemory::<f32>::new(t * t);
    let mut g = Array::<f32>::new(t);
    if col_ok {
        for i in 0..hidden {
            dw[i * vocab + col] = F::new(0.0);
        }
    }
    let mut row0 = 0usize.runtime();
    while row0 < n {
        logits_tile::<F>(
            h,
            w,
            &mut h_s,
            &mut w_s,
            &mut prod_s,
            row0,
            v0,
            n,
            hidden,
            vocab,
            t,
        );
        for r in 0..t {
            let mut gr = f32::new(0.0);
            if row0 + r < n {
                let z = prod_s[r * t + tid];
                gr = grad_logit(z, col, lse[row0 + r], targets[row0 + r], coef[row0 + r]);
            }
            g[r] = gr;
        }
        if col_ok {
            for i in 0..hidden {
                let mut s = f32::cast_from(dw[i * vocab + col]);
                for r in 0..t {
                    if row0 + r < n {
                        s += g[r] * f32::cast_from(h[(row0 + r) * hidden + i]);
                    }
                }
                dw[i * vocab + col] = F::cast_from(s);
            }
        }
        row0 += t;
    }
}
