//! Building blocks of the tile attention kernels (forward and backward): operands staged in
//! shared memory, and one plane's 16×16 block products, on tensor cores (`cmma`) or, where a
//! device has none, computed by the plane's lanes from the same operands, so that everything
//! around the products is tested on devices without tensor cores.

use cubecl::prelude::*;

/// Rows and columns of every matrix fragment (the 16×16×16 shape tensor cores of all vendors
/// offer for f16/bf16 with f32 accumulation).
pub(crate) const FRAG: usize = 16;

/// Byte alignment of the shared-memory operands of fragment loads and stores (CUDA's wmma
/// needs 32 bytes). Every fragment offset the kernels use is a multiple of 16 elements, so
/// aligned array bases suffice.
pub(crate) const ALIGN: usize = 32;

/// Most elements per thread for which [`stage_rows_unrolled`] unrolls (64: a 64-row tile of head
/// dimension 128 over 128 threads).
const MAX_UNROLLED_STAGING: usize = 64;

/// Elements added to every row of the tile kernels' shared-memory blocks. Unpadded, a row of
/// 64 or 128 half-precision values (128 or 256 bytes) starts on the same bank as the next, so
/// the eight rows a tensor-core fragment load reads at once all hit one bank group (an 8-way
/// conflict); 8 more elements shift each row by 16 bytes (32 for f32) and spread them. A
/// multiple of 8 keeps every fragment's address 32-byte aligned and its leading dimension a
/// multiple of 16 bytes, as wmma requires.
pub(crate) const ROW_PAD: usize = 8;

/// Copies rows `[row0, row0 + rows)` of a `[.., seq, head_dim]` slab starting at `base` into
/// `dst` from element `dst_off` with row stride `dst_stride`, converted to the shared memory's type `S` (the input type for
/// fragment operands, f32 for the portable kernels), zeros past `seq` (padded rows stay finite
/// and fragment loads never read out of bounds), all threads of the cube cooperating.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows<F: Float, S: Float>(
    src: &Tensor<F>,
    dst: &mut SharedMemory<S>,
    dst_off: usize,
    base: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] dst_stride: usize,
    #[comptime] threads: usize,
) {
    let mut idx = UNIT_POS as usize;
    while idx < rows * head_dim {
        stage_element::<F, S>(
            src, dst, dst_off, base, row0, seq, idx, head_dim, dst_stride,
        );
        idx += threads;
    }
}

/// [`stage_rows`] as straight-line code where each thread's share is a whole number of at
/// most [`MAX_UNROLLED_STAGING`] elements: the compiler can then issue all of a thread's
/// loads before its first store (the inputs are `restrict`) instead of waiting out each
/// load's latency in turn. For the tile kernels; the portable kernels, which hold whole rows
/// in registers, keep the loop (unrolled, the f32 forward spilled five times more on sm_90).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows_unrolled<F: Float, S: Float>(
    src: &Tensor<F>,
    dst: &mut SharedMemory<S>,
    dst_off: usize,
    base: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] dst_stride: usize,
    #[comptime] threads: usize,
) {
    let total = comptime!(rows * head_dim);
    if comptime!(total % threads == 0 && total / threads <= MAX_UNROLLED_STAGING) {
        #[unroll]
        for j in 0..total / threads {
            let idx = UNIT_POS as usize + j * threads;
            stage_element::<F, S>(
                src, dst, dst_off, base, row0, seq, idx, head_dim, dst_stride,
            );
        }
    } else {
        stage_rows::<F, S>(
            src, dst, dst_off, base, row0, seq, rows, head_dim, dst_stride, threads,
        );
    }
}

/// Element `idx` of [`stage_rows`]'s copy.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_element<F: Float, S: Float>(
    src: &Tensor<F>,
    dst: &mut SharedMemory<S>,
    dst_off: usize,
    base: usize,
    row0: usize,
    seq: usize,
    idx: usize,
    #[comptime] head_dim: usize,
    #[comptime] dst_stride: usize,
) {
    let r = idx / head_dim;
    let c = idx % head_dim;
    let mut x = S::new(0.0);
    if row0 + r < seq {
        x = S::cast_from(src[base + (row0 + r) * head_dim + c]);
    }
    dst[dst_off + r * dst_stride + c] = x;
}

/// Copies `rows` f32 values per row starting at `row0` of a `[.., seq]` vector into `dst`
/// (zeros past `seq`), all threads of the cube cooperating.
#[cube]
pub(crate) fn stage_values(
    src: &Tensor<f32>,
    dst: &mut SharedMemory<f32>,
    base: usize,
    row0: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] threads: usize,
) {
    let mut idx = UNIT_POS as usize;
    while idx < rows {
        let r = row0 + idx;
        let mut x = f32::new(0.0);
        if r < seq {
            x = src[base + r];
        }
        dst[idx] = x;
        idx += threads;
    }
}

/// An f32 accumulator fragment of one plane, its contents undefined until filled or loaded.
#[cube]
pub(crate) fn accumulator_fragment() -> cmma::Matrix<f32> {
    unsafe {
        cmma::Matrix::<f32>::uninitialized(
            cmma::MatrixIdent::Accumulator,
            FRAG,
            FRAG,
            FRAG,
            cmma::MatrixLayout::Undefined,
        )
    }
}

/// One plane's 16×16 operand fragment (`ident` A or B) read from shared memory at `off`
/// with row stride `stride`, stored as `layout` says.
#[cube]
pub(crate) fn operand_fragment<F: Float>(
    s: &SharedMemory<F>,
    off: usize,
    #[comptime] stride: usize,
    #[comptime] ident: cmma::MatrixIdent,
    #[comptime] layout: cmma::MatrixLayout,
) -> cmma::Matrix<F> {
    cmma::Matrix::<F>::from_slice(
        ident,
        FRAG,
        FRAG,
        FRAG,
        layout,
        &s.slice(off, s.len()),
        stride as u32,
    )
}

/// One plane's 16×16 block `C (=|+=) Σₖ Aₖ·Bₖ` over `k_frags` 16-wide steps of the inner
/// dimension. `A` is row-major with row stride `a_stride`, its k-th fragment at
/// `a_off + k·a_step`; `B`'s k-th fragment is at `b_off + k·b_step`, row-major (`[k][n]`) or,
/// with `b_col_major`, stored as `[n][k]` rows (a transposed operand read in place). `C` is
/// f32, row-major with row stride `c_stride` at `c_off`; with `accumulate` it is added to.
/// Every lane of the plane must call it (the fragment operations are plane-wide).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_product<F: Float>(
    a: &SharedMemory<F>,
    a_off: usize,
    #[comptime] a_stride: usize,
    #[comptime] a_step: usize,
    b: &SharedMemory<F>,
    b_off: usize,
    #[comptime] b_stride: usize,
    #[comptime] b_step: usize,
    #[comptime] b_col_major: bool,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] c_stride: usize,
    #[comptime] k_frags: usize,
    #[comptime] accumulate: bool,
    #[comptime] plane_dim: usize,
    #[comptime] use_cmma: bool,
) {
    if use_cmma {
        let acc = accumulator_fragment();
        if accumulate {
            cmma::load_with_layout(
                &acc,
                &c.slice(c_off, c.len()),
                c_stride as u32,
                cmma::MatrixLayout::RowMajor,
            );
        } else {
            cmma::fill(&acc, 0.0f32);
        }
        let b_layout = if b_col_major {
            cmma::MatrixLayout::ColMajor
        } else {
            cmma::MatrixLayout::RowMajor
        };
        #[unroll]
        for kk in 0..k_frags {
            let fa = operand_fragment::<F>(
                a,
                a_off + kk * a_step,
                a_stride,
                cmma::MatrixIdent::A,
                cmma::MatrixLayout::RowMajor,
            );
            let fb = operand_fragment::<F>(
                b,
                b_off + kk * b_step,
                b_stride,
                cmma::MatrixIdent::B,
                b_layout,
            );
            cmma::execute::<F, F, f32, f32>(&fa, &fb, &acc, &acc);
        }
        cmma::store(
            &mut c.slice_mut(c_off, c.len()),
            &acc,
            c_stride as u32,
            cmma::MatrixLayout::RowMajor,
        );
    } else {
        let mut e = UNIT_POS_X as usize;
        while e < FRAG * FRAG {
            let r = e / FRAG;
            let col = e % FRAG;
            let mut sum = f32::new(0.0);
            if accumulate {
                sum = c[c_off + r * c_stride + col];
            }
            for kk in 0..k_frags {
                let a0 = a_off + kk * a_step + r * a_stride;
                let b0 = b_off + kk * b_step;
                for x in 0..FRAG {
                    let bv = if b_col_major {
                        b[b0 + col * b_stride + x]
                    } else {
                        b[b0 + x * b_stride + col]
                    };
                    sum += f32::cast_from(a[a0 + x]) * f32::cast_from(bv);
                }
            }
            c[c_off + r * c_stride + col] = sum;
            e += plane_dim;
        }
    }
}

/// Orders the shared-memory accesses of one plane's lanes, for data only that plane writes
/// and reads (its score, probability and accumulator blocks): CUDA's warp barrier where
/// `warp_sync` (it orders shared memory among the warp's threads, and leaves the other warps
/// of the cube running), else a cube barrier. Not a plane barrier elsewhere: WGSL has none,
/// and SPIR-V's is emitted with relaxed memory semantics, which order nothing.
#[cube]
pub(crate) fn sync_plane_data(#[comptime] warp_sync: bool) {
    if warp_sync {
        sync_plane();
    } else {
        sync_cube();
    }
}

/// One plane's `16 × (frags·16)` f32 block `C = A·Bᵀ` of row dot products: A's 16 rows start
/// at `a_off`, B's `frags·16` rows at element 0, all `head_dim` long with row stride
/// `stride`; C is at `c_off` with row stride `c_stride`. The tile kernels' scores (`Q·Kᵀ`,
/// `dO·Vᵀ`, and in dK/dV their transposes), 16 of B's rows at a time.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows_dot_rows<F: Float>(
    a: &SharedMemory<F>,
    a_off: usize,
    b: &SharedMemory<F>,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] frags: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
    #[comptime] c_stride: usize,
    #[comptime] plane_dim: usize,
    #[comptime] use_cmma: bool,
) {
    #[unroll]
    for n in 0..frags {
        block_product::<F>(
            a,
            a_off,
            stride,
            FRAG,
            b,
            n * FRAG * stride,
            stride,
            FRAG,
            true,
            c,
            c_off + n * FRAG,
            c_stride,
            head_dim / FRAG,
            false,
            plane_dim,
            use_cmma,
        );
    }
}

/// One plane's `16 × head_dim` f32 block `C += A·B`: A is `16 × (frags·16)` at `a_off` with
/// row stride `a_stride`, B is `frags·16` rows of `head_dim` from element 0 and C is at
/// `c_off`, both with row stride `stride`. The tile kernels' accumulations (`P·V`, `dS·K`,
/// `Pᵀ·dO`, `dSᵀ·Q`), one 16-column block of C at a time with the whole streamed tile as the
/// inner dimension.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_block_times_rows<F: Float>(
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
) {
    #[unroll]
    for f in 0..head_dim / FRAG {
        block_product::<F>(
            a,
            a_off,
            a_stride,
            FRAG,
            b,
            f * FRAG,
            stride,
            FRAG * stride,
            false,
            c,
            c_off + f * FRAG,
            stride,
            frags,
            true,
            plane_dim,
            use_cmma,
        );
    }
}
