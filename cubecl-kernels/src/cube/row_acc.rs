//! A plane's `16 × head_dim` f32 accumulator block in the tile attention kernels (the
//! forward's output, dQ, dK and dV), and where it lives between streamed tiles.
//!
//! In shared memory ([`AccumulatorPlace::Shared`](super::AccumulatorPlace::Shared)) every
//! tile's product loads the block into accumulator fragments, adds the tile and stores it
//! back. In registers ([`AccumulatorPlace::Registers`](super::AccumulatorPlace::Registers))
//! the block stays in `head_dim / 16` accumulator fragments for the whole loop (on devices
//! without tensor cores: in the lanes' registers, laid out as the portable fragment products
//! lay out their elements) and reaches shared memory only when the kernel must see its
//! values: the forward's rare rescale, and the end, where the backward kernels round it to
//! the input type in their fragments and stage it in input rows they no longer need, so they
//! declare no f32 block for it. The kernels call the same functions for both places, so the
//! CPU tests run the control flow of each.

use cubecl::prelude::*;

use super::tiles::{
    accumulate_block_times_rows, accumulator_fragment, operand_fragment, sync_plane_data, FRAG,
    ROW_PAD,
};

/// The comptime facts every operation on one plane's accumulator block needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RowBlock {
    /// Row stride of the block's place in shared memory (head dim plus padding).
    pub(crate) stride: usize,
    /// Columns of the block.
    pub(crate) head_dim: usize,
    /// Lanes per plane.
    pub(crate) plane_dim: usize,
    /// Whether products run on tensor cores.
    pub(crate) use_cmma: bool,
    /// Whether the block stays in registers between tiles
    /// ([`AccumulatorPlace::Registers`](super::AccumulatorPlace::Registers)).
    pub(crate) in_regs: bool,
}

impl RowBlock {
    /// The block of a kernel with these comptime parameters; its place in shared memory has
    /// padded rows (see [`ROW_PAD`]).
    pub(crate) fn new(head_dim: usize, plane_dim: usize, use_cmma: bool, in_regs: bool) -> Self {
        RowBlock {
            stride: head_dim + ROW_PAD,
            head_dim,
            plane_dim,
            use_cmma,
            in_regs,
        }
    }
}

/// Elements of each 16×16 block that one lane holds without tensor cores.
fn elements_per_lane(plane_dim: usize) -> usize {
    (FRAG * FRAG).div_ceil(plane_dim)
}

/// One plane's accumulator block when it lives in registers: `frags` (one accumulator
/// fragment per 16 columns) on tensor cores, `regs` without (lane `ℓ` holds element
/// `ℓ + j·plane_dim` of the `f`-th 16×16 block at `regs[f · per_lane + j]`). Unused parts are
/// empty (or one element), so they cost nothing in the generated code.
#[derive(CubeType)]
pub(crate) struct RowBlockAcc {
    frags: Sequence<cmma::Matrix<f32>>,
    regs: Array<f32>,
}

/// A zeroed accumulator block. The block's place in shared memory, `c` from `c_off` with
/// row stride `block.stride`, is zeroed when it lives there and is otherwise only written by
/// [`row_block_acc_to_shared`] (the backward kernels, which never call that, then declare
/// one element for it). Every lane of the plane must call it.
#[cube]
pub(crate) fn row_block_acc_zeroed(
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] block: RowBlock,
) -> RowBlockAcc {
    let blocks = comptime!(block.head_dim / FRAG);
    let per_lane = comptime!(elements_per_lane(block.plane_dim));
    let regs_len = comptime!(if block.in_regs && !block.use_cmma {
        blocks * per_lane
    } else {
        1
    });
    let mut frags = Sequence::new();
    let mut regs = Array::<f32>::new(regs_len);
    if block.in_regs {
        if block.use_cmma {
            #[unroll]
            for _ in 0..blocks {
                let acc = accumulator_fragment();
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
        while e < FRAG * block.head_dim {
            c[c_off + (e / block.head_dim) * block.stride + e % block.head_dim] = 0.0f32;
            e += block.plane_dim;
        }
    }
    RowBlockAcc { frags, regs }
}

/// `C += A·B` on the plane's block: A is `16 × (frags·16)` at `a_off` with row stride
/// `a_stride`, B is `frags·16` rows of `head_dim` from element 0 with the block's row stride
/// (the operands of [`accumulate_block_times_rows`]); the block is `acc`, or `c` from
/// `c_off` when it lives in shared memory. Every lane of the plane must call it.
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
    #[comptime] block: RowBlock,
) {
    if !block.in_regs {
        accumulate_block_times_rows::<F>(
            a,
            a_off,
            a_stride,
            b,
            c,
            c_off,
            frags,
            block.head_dim,
            block.stride,
            block.plane_dim,
            block.use_cmma,
        );
    } else if block.use_cmma {
        // Each 16-column step of A is loaded once and multiplied into every output block,
        // where the shared-memory place reloads it per block.
        #[unroll]
        for kk in 0..frags {
            let fa = operand_fragment::<F>(
                a,
                a_off + kk * FRAG,
                a_stride,
                cmma::MatrixIdent::A,
                cmma::MatrixLayout::RowMajor,
            );
            #[unroll]
            for f in 0..block.head_dim / FRAG {
                let fb = operand_fragment::<F>(
                    b,
                    kk * FRAG * block.stride + f * FRAG,
                    block.stride,
                    cmma::MatrixIdent::B,
                    cmma::MatrixLayout::RowMajor,
                );
                let out = acc.frags.index(f);
                cmma::execute::<F, F, f32, f32>(&fa, &fb, out, out);
            }
        }
    } else {
        let lane = UNIT_POS_X as usize;
        let per_lane = comptime!(elements_per_lane(block.plane_dim));
        for f in 0..block.head_dim / FRAG {
            for j in 0..per_lane {
                let e = lane + j * block.plane_dim;
                if e < FRAG * FRAG {
                    let r = e / FRAG;
                    let col = f * FRAG + e % FRAG;
                    let mut sum = f32::new(0.0);
                    for x in 0..frags * FRAG {
                        sum += f32::cast_from(a[a_off + r * a_stride + x])
                            * f32::cast_from(b[x * block.stride + col]);
                    }
                    acc.regs[f * per_lane + j] += sum;
                }
            }
        }
    }
}

/// Writes a block that lives in registers to its place in shared memory (`c` from `c_off`);
/// nothing to do when it lives there already. Every lane of the plane must call it; the
/// plane's reads of `c` need a [`super::tiles::sync_plane_data`] after it.
#[cube]
pub(crate) fn row_block_acc_to_shared(
    acc: &RowBlockAcc,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] block: RowBlock,
) {
    if block.in_regs {
        store_block_as::<f32>(acc, c, c_off, block);
    }
}

/// Stores a block that lives in registers, rounded to `S`, to `dst` from `dst_off` with the
/// block's row stride.
#[cube]
fn store_block_as<S: Float>(
    acc: &RowBlockAcc,
    dst: &mut SharedMemory<S>,
    dst_off: usize,
    #[comptime] block: RowBlock,
) {
    if block.use_cmma {
        #[unroll]
        for f in 0..block.head_dim / FRAG {
            // The identity for `S = f32`.
            let rounded = cmma::cast::<f32, S>(acc.frags.index(f));
            cmma::store(
                &mut dst.slice_mut(dst_off + f * FRAG, dst.len()),
                &rounded,
                block.stride as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
    } else {
        let lane = UNIT_POS_X as usize;
        let per_lane = comptime!(elements_per_lane(block.plane_dim));
        for f in 0..block.head_dim / FRAG {
            for j in 0..per_lane {
                let e = lane + j * block.plane_dim;
                if e < FRAG * FRAG {
                    dst[dst_off + (e / FRAG) * block.stride + f * FRAG + e % FRAG] =
                        S::cast_from(acc.regs[f * per_lane + j]);
                }
            }
        }
    }
}

/// Writes the plane's finished block, rounded to `F`, to the row-major `head_dim`-wide rows
/// of `out`: block row `r` is row `row0 + r`, which starts at element
/// `out_base + (row0 + r) · head_dim`, and rows from `rows_end` on (past the sequence) are
/// left out. A block in shared memory is read from `c`. A block in registers is rounded to
/// `F` in its fragments and passes through `stage`, so that a kernel keeping its
/// accumulators in registers declares no f32 block of shared memory for them: it lends the
/// plane's own rows of an input tile, free once the streamed loop has ended. Both are the
/// plane's 16 rows from `off` with the block's row stride. Every lane of the plane must call
/// it, after the plane's last use of `stage` and its last change to `c`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_block_acc_write_rows<F: Float>(
    acc: &RowBlockAcc,
    c: &SharedMemory<f32>,
    stage: &mut SharedMemory<F>,
    off: usize,
    out: &mut Tensor<F>,
    out_base: usize,
    row0: usize,
    rows_end: usize,
    #[comptime] warp_sync: bool,
    #[comptime] block: RowBlock,
) {
    let head_dim = block.head_dim;
    if block.in_regs {
        store_block_as::<F>(acc, stage, off, block);
    }
    sync_plane_data(warp_sync);
    let mut e = UNIT_POS_X as usize;
    while e < FRAG * head_dim {
        let row = row0 + e / head_dim;
        if row < rows_end {
            let at = off + (e / head_dim) * block.stride + e % head_dim;
            let to = out_base + row * head_dim + e % head_dim;
            if block.in_regs {
                out[to] = stage[at];
            } else {
                out[to] = F::cast_from(c[at]);
            }
        }
        e += block.plane_dim;
    }
}

/// Reads a block that lives in registers back from its place in shared memory, after the
/// kernel changed it there (the forward's rescale); nothing to do when it lives there. The
/// plane's writes to `c` need a [`super::tiles::sync_plane_data`] before it.
#[cube]
pub(crate) fn row_block_acc_from_shared(
    acc: &mut RowBlockAcc,
    c: &SharedMemory<f32>,
    c_off: usize,
    #[comptime] block: RowBlock,
) {
    if block.in_regs {
        if block.use_cmma {
            #[unroll]
            for f in 0..block.head_dim / FRAG {
                cmma::load_with_layout(
                    acc.frags.index(f),
                    &c.slice(c_off + f * FRAG, c.len()),
                    block.stride as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
        } else {
            let lane = UNIT_POS_X as usize;
            let per_lane = comptime!(elements_per_lane(block.plane_dim));
            for f in 0..block.head_dim / FRAG {
                for j in 0..per_lane {
                    let e = lane + j * block.plane_dim;
                    if e < FRAG * FRAG {
                        acc.regs[f * per_lane + j] =
                            c[c_off + (e / FRAG) * block.stride + f * FRAG + e % FRAG];
                    }
                }
            }
        }
    }
}
