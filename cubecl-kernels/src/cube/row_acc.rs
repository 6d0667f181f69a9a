//! A plane's `16 × head_dim` f32 accumulator block in the tile attention kernels (the
//! forward's output, dQ, dK and dV), and where it lives between streamed tiles.
//!
//! In shared memory ([`AccumulatorPlace::Shared`](super::AccumulatorPlace::Shared)) every
//! tile's product loads the block into accumulator fragments, adds the tile and stores it
//! back. In registers ([`AccumulatorPlace::Registers`](super::AccumulatorPlace::Registers))
//! the block stays in `head_dim / 16` accumulator fragments for the whole loop (on devices
//! without tensor cores: in the lanes' registers, laid out as the portable fragment products
//! lay out their elements) and reaches shared memory only when the kernel must see its
//! values: the forward's rare rescale, and the end. The kernels call the same functions for
//! both places, so the CPU tests run the control flow of each.

use cubecl::prelude::*;

use super::tiles::{accumulate_block_times_rows, FRAG};

/// Elements of each 16×16 block that one lane holds without tensor cores.
fn elements_per_lane(plane_dim: usize) -> usize {
    (FRAG * FRAG).div_ceil(plane_dim)
}

/// One plane's accumulator block when it lives in registers: `frags` (one accumulator
/// fragment per 16 columns) on tensor cores, `regs` without (lane `ℓ` holds element
/// `ℓ + j·plane_dim` of each 16×16 block at `regs[block · per_lane + j]`). Unused parts are
/// empty (or one element), so they cost nothing in the generated code.
#[derive(CubeType)]
pub(crate) struct RowBlockAcc {
    frags: Sequence<cmma::Matrix<f32>>,
    regs: Array<f32>,
}

/// A zeroed accumulator block. The block's place in shared memory, `c` from `c_off` with row
/// stride `stride`, is zeroed when it lives there (`in_regs` false) and is otherwise only
/// written by [`row_block_acc_to_shared`]. Every lane of the plane must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_block_acc_zeroed(
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] stride: usize,
    #[comptime] head_dim: usize,
    #[comptime] plane_dim: usize,
    #[comptime] use_cmma: bool,
    #[comptime] in_regs: bool,
) -> RowBlockAcc {
    let blocks = comptime!(head_dim / FRAG);
    let per_lane = comptime!(elements_per_lane(plane_dim));
    let regs_len = comptime!(if in_regs && !use_cmma {
        blocks * per_lane
    } else {
        1
    });
    let mut frags = Sequence::new();
    let mut regs = Array::<f32>::new(regs_len);
    if in_regs {
        if use_cmma {
            #[unroll]
            for _ in 0..blocks {
                let acc = unsafe {
                    cmma::Matrix::<f32>::uninitialized(
                        cmma::MatrixIdent::Accumulator,
                        FRAG,
                        FRAG,
                        FRAG,
                        cmma::MatrixLayout::Undefined,
                    )
                };
                cmma::fill(&acc, 0.0f32);
                frags.push(acc);
            }
        } else {
            for i in 0..blocks * per_lane {
                regs[i] = 0.0f32;
            }
        }
    } else {
        let mut e = UNIT_POS_X as usize;
        while e < FRAG * head_dim {
            c[c_off + (e / head_dim) * stride + e % head_dim] = 0.0f32;
            e += plane_dim;
        }
    }
    RowBlockAcc { frags, regs }
}

/// `C += A·B` on the plane's block: A is `16 × (frags·16)` at `a_off` with row stride
/// `a_stride`, B is `frags·16` rows of `head_dim` from element 0 with row stride `stride`
/// (the operands of [`accumulate_block_times_rows`]); the block is `acc`, or `c` from
/// `c_off` with row stride `stride` when it lives in shared memory. Every lane of the plane
/// must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_block_acc_add<F: Float>(
    acc: &mut RowBlockAcc,
    a: &SharedMemory<F>,
    a_off: usize,
    #[comptime] a_stride: usize,
    b: &SharedMemory<F>,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] frags: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
    #[comptime] plane_dim: usize,
    #[comptime] use_cmma: bool,
    #[comptime] in_regs: bool,
) {
    if !in_regs {
        accumulate_block_times_rows::<F>(
            a, a_off, a_stride, b, c, c_off, frags, head_dim, stride, plane_dim, use_cmma,
        );
    } else if use_cmma {
        // Each 16-column step of A is loaded once and multiplied into every output block,
        // where the shared-memory place reloads it per block.
        #[unroll]
        for kk in 0..frags {
            let fa = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::A,
                FRAG,
                FRAG,
                FRAG,
                cmma::MatrixLayout::RowMajor,
                &a.slice(a_off + kk * FRAG, a.len()),
                a_stride as u32,
            );
            #[unroll]
            for f in 0..head_dim / FRAG {
                let fb = cmma::Matrix::<F>::from_slice(
                    cmma::MatrixIdent::B,
                    FRAG,
                    FRAG,
                    FRAG,
                    cmma::MatrixLayout::RowMajor,
                    &b.slice(kk * FRAG * stride + f * FRAG, b.len()),
                    stride as u32,
                );
                let out = acc.frags.index(f);
                cmma::execute::<F, F, f32, f32>(&fa, &fb, out, out);
            }
        }
    } else {
        let lane = UNIT_POS_X as usize;
        let per_lane = comptime!(elements_per_lane(plane_dim));
        for f in 0..head_dim / FRAG {
            for j in 0..per_lane {
                let e = lane + j * plane_dim;
                if e < FRAG * FRAG {
                    let r = e / FRAG;
                    let col = f * FRAG + e % FRAG;
                    let mut sum = f32::new(0.0);
                    for x in 0..frags * FRAG {
                        sum += f32::cast_from(a[a_off + r * a_stride + x])
                            * f32::cast_from(b[x * stride + col]);
                    }
                    acc.regs[f * per_lane + j] += sum;
                }
            }
        }
    }
}

/// Writes a block that lives in registers to its place in shared memory (`c` from `c_off`,
/// row stride `stride`); nothing to do when it lives there already. Every lane of the plane
/// must call it; the plane's reads of `c` need a [`super::tiles::sync_plane_data`] after it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_block_acc_to_shared(
    acc: &RowBlockAcc,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] stride: usize,
    #[comptime] head_dim: usize,
    #[comptime] plane_dim: usize,
    #[comptime] use_cmma: bool,
    #[comptime] in_regs: bool,
) {
    if in_regs {
        if use_cmma {
            #[unroll]
            for f in 0..head_dim / FRAG {
                cmma::store(
                    &mut c.slice_mut(c_off + f * FRAG, c.len()),
                    acc.frags.index(f),
                    stride as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
        } else {
            let lane = UNIT_POS_X as usize;
            let per_lane = comptime!(elements_per_lane(plane_dim));
            for f in 0..head_dim / FRAG {
                for j in 0..per_lane {
                    let e = lane + j * plane_dim;
                    if e < FRAG * FRAG {
                        c[c_off + (e / FRAG) * stride + f * FRAG + e % FRAG] =
                            acc.regs[f * per_lane + j];
                    }
                }
            }
        }
    }
}

/// Reads a block that lives in registers back from its place in shared memory, after the
/// kernel changed it there (the forward's rescale); nothing to do when it lives there. The
/// plane's writes to `c` need a [`super::tiles::sync_plane_data`] before it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_block_acc_from_shared(
    acc: &mut RowBlockAcc,
    c: &SharedMemory<f32>,
    c_off: usize,
    #[comptime] stride: usize,
    #[comptime] head_dim: usize,
    #[comptime] plane_dim: usize,
    #[comptime] use_cmma: bool,
    #[comptime] in_regs: bool,
) {
    if in_regs {
        if use_cmma {
            #[unroll]
            for f in 0..head_dim / FRAG {
                cmma::load_with_layout(
                    acc.frags.index(f),
                    &c.slice(c_off + f * FRAG, c.len()),
                    stride as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
        } else {
            let lane = UNIT_POS_X as usize;
            let per_lane = comptime!(elements_per_lane(plane_dim));
            for f in 0..head_dim / FRAG {
                for j in 0..per_lane {
                    let e = lane + j * plane_dim;
                    if e < FRAG * FRAG {
                        acc.regs[f * per_lane + j] =
                            c[c_off + (e / FRAG) * stride + f * FRAG + e % FRAG];
                    }
                }
            }
        }
    }
}
