//! The tile flash-attention kernels (the tensor-core kernels' algorithm, forward and backward)
//! on lavapipe, which has no tensor cores: with `AttentionKernel::Tiles` their fragment
//! products are computed by the plane's lanes, and everything around them (staging, masking,
//! the online softmax, the rescaling of the output block, the log-sum-exp, the recomputed
//! probabilities and `dS`, the gradient accumulation) is checked against the float64 oracle.
//! Also cubek's f32 unit matmul inside the fused MLP and cross-entropy, which the default
//! runs only where Burn's matmul would round f32 to TF32 (CUDA): forced here, so its use by
//! the fused ops is checked on the CPU.
//!
//! Its own test binary, because the kernel choices are process-wide and must not change what
//! the other kernel tests run.
#![cfg(feature = "wgpu")]

mod common;

use burn::backend::wgpu::{Wgpu, WgpuRuntime};
use burn::tensor::backend::Backend;
use burn::tensor::DType;
use common::{
    attn_case, check_attention_dtype, check_linear_ce, check_linear_gelu_dtype, wgpu_cpu_device,
    Rng,
};
use cubecl_kernels::cube::{
    attention_accumulators, attention_tile_shapes, attention_uses_tensor_cores,
    set_attention_accumulators, set_attention_kernel, set_attention_tiles, set_f32_matmul,
    tiled_launches, unit_matmul_launches, AccumulatorPlace, AttentionKernel, F32Matmul, TileShape,
};

#[test]
fn tiled_attention_matches_f64_oracle() {
    let dev = wgpu_cpu_device();
    // The default keeps the portable kernel on a device without tensor cores...
    set_attention_kernel(AttentionKernel::Auto);
    assert!(!attention_uses_tensor_cores::<WgpuRuntime>(
        &dev,
        DType::F16,
        64
    ));
    // ...and the forced tile kernel computes its products with the lanes there, its
    // accumulators in the lanes' registers by default (the forced shapes below also run the
    // shared-memory place).
    set_attention_kernel(AttentionKernel::Tiles);
    assert_eq!(attention_accumulators(), AccumulatorPlace::Registers);
    assert!(
        !attention_uses_tensor_cores::<WgpuRuntime>(&dev, DType::F16, 64),
        "lavapipe reports tensor cores: this test would not exercise the lane-computed products"
    );
    let mut rng = Rng::fresh("wgpu tiled attention");
    // [batch, heads, seq_q, seq_k, head_dim]: lengths on, below and above the 16-row plane
    // block and the 16-key tile, causal with seq_q != seq_k, masks, every head dim the f32
    // tile fits in 32 KiB of shared memory.
    let mut cases = vec![
        (DType::F32, [1, 1, 1, 1, 16], false, false),
        (DType::F32, [2, 2, 33, 33, 16], true, false),
        (DType::F32, [1, 3, 45, 70, 32], false, true),
        (DType::F32, [2, 1, 64, 64, 64], true, true),
        (DType::F32, [1, 2, 31, 17, 48], true, true),
        (DType::F32, [1, 1, 70, 50, 32], true, false),
    ];
    if <Wgpu as Backend>::supports_dtype(&dev, DType::F16) {
        // Half inputs: P and dS are rounded to f16 before their products, as on tensor
        // cores. Head dim 128 fits only in half precision. With its accumulators in
        // registers (the default) the dK/dV kernel declares no f32 blocks for them, so it
        // fits lavapipe's 32 KiB at head dim 128 in f16 and at 64 in f32 too.
        cases.push((DType::F16, [1, 2, 21, 40, 32], true, true));
        cases.push((DType::F16, [1, 1, 37, 29, 128], true, true));
    }
    for (dtype, shape, causal, masked) in cases {
        let before = tiled_launches();
        let mut c = attn_case(&mut rng, shape, causal, masked);
        // Keys that grow along the sequence push each row's max up by far more than the
        // forward's rescale threshold several times per row, so the rescale runs after
        // tiles that already accumulated output, not only on the first.
        if shape[2] > 40 {
            c.key_ramp = 12.0;
        }
        let tol = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
        check_attention_dtype::<Wgpu>(&dev, &mut rng, &c, dtype, tol);
        let after = tiled_launches();
        let label = format!("{dtype:?} {shape:?}");
        assert!(
            after.forward > before.forward,
            "{label}: forward not on the tile kernel"
        );
        assert!(after.dq > before.dq, "{label}: dQ not on the tile kernel");
        let planned = attention_tile_shapes::<WgpuRuntime>(&dev, dtype, shape[4])[2];
        assert!(planned.is_some(), "{label}: dK/dV does not fit");
        assert!(
            after.dkdv > before.dkdv,
            "{label}: dK/dV not on the tile kernel"
        );
    }

    // Every cube shape the launchers may pick on a GPU, forced one at a time: planes and
    // streamed tiles of 16 to 64 rows, on lengths that are not multiples of any tile (so
    // partial streamed tiles, causal cut-offs inside a tile and masked keys all occur).
    // lavapipe's 32 KiB hold these only at small head dimensions, and the larger ones only
    // in f16; the shapes Hopper takes (4×32 and 2×32 rows at head dim 128) do not fit here,
    // but differ from these only in their comptime sizes. Every other shape keeps its
    // accumulators in shared memory instead of registers, so both places run both dtypes.
    // In this same test because the choices are process-wide.
    let mut shaped = vec![
        (DType::F32, (1, 2), [1, 2, 70, 50, 16], true, true),
        (DType::F32, (2, 1), [2, 1, 33, 97, 16], false, true),
        (DType::F32, (1, 3), [1, 1, 100, 100, 16], true, false),
        (DType::F32, (1, 2), [1, 1, 45, 61, 32], true, true),
    ];
    if <Wgpu as Backend>::supports_dtype(&dev, DType::F16) {
        shaped.push((DType::F16, (1, 4), [1, 2, 90, 75, 16], true, true));
        shaped.push((DType::F16, (2, 2), [1, 1, 81, 130, 16], false, true));
        shaped.push((DType::F16, (3, 1), [1, 1, 100, 100, 16], true, false));
        shaped.push((DType::F16, (1, 4), [1, 2, 81, 130, 32], false, true));
    }
    for (i, (dtype, (planes, frags), shape, causal, masked)) in shaped.into_iter().enumerate() {
        let forced = TileShape::new(planes, frags).expect("valid shape");
        set_attention_tiles(Some(forced));
        let place = if i % 2 == 0 {
            AccumulatorPlace::Registers
        } else {
            AccumulatorPlace::Shared
        };
        set_attention_accumulators(place);
        let label = format!("{dtype:?} {shape:?} forced {planes}×{frags}, {place:?}");
        assert_eq!(
            attention_tile_shapes::<WgpuRuntime>(&dev, dtype, shape[4]),
            [Some(forced); 3],
            "{label}: a kernel does not fit lavapipe's shared memory"
        );
        let before = tiled_launches();
        let mut c = attn_case(&mut rng, shape, causal, masked);
        c.key_ramp = 12.0;
        let tol = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
        check_attention_dtype::<Wgpu>(&dev, &mut rng, &c, dtype, tol);
        let after = tiled_launches();
        assert!(
            after.forward > before.forward && after.dq > before.dq && after.dkdv > before.dkdv,
            "{label}: not every kernel ran on the tiles ({before:?} → {after:?})"
        );
    }
    set_attention_tiles(None);
    set_attention_accumulators(AccumulatorPlace::default());
}

#[test]
fn f32_products_on_the_unit_routine_match_f64_oracle() {
    let dev = wgpu_cpu_device();
    let mut rng = Rng::fresh("wgpu f32 unit matmul");
    // lavapipe has no TF32: the default leaves f32 to Burn's (already exact) matmul...
    set_f32_matmul(F32Matmul::Auto);
    let before = unit_matmul_launches();
    check_linear_gelu_dtype::<Wgpu>(&dev, &mut rng, [33, 31, 65], DType::F32, 1e-4);
    assert_eq!(unit_matmul_launches(), before, "Auto used the unit routine");
    // ...and the forced unit routine carries every product of both ops, forward and backward.
    set_f32_matmul(F32Matmul::Unit);
    for shape in [[1, 1, 1], [33, 31, 65], [47, 129, 40]] {
        let before = unit_matmul_launches();
        check_linear_gelu_dtype::<Wgpu>(&dev, &mut rng, shape, DType::F32, 1e-4);
        // x·W in the forward; x·W again, dz·Wᵀ and xᵀ·dz in the backward.
        assert!(
            unit_matmul_launches() >= before + 4,
            "linear_gelu {shape:?}"
        );
    }
    for (shape, all_ignored) in [
        ([33, 40, 70], false),
        ([100, 64, 2500], false),
        ([9, 16, 10], true),
    ] {
        let before = unit_matmul_launches();
        check_linear_ce::<Wgpu>(&dev, &mut rng, shape, all_ignored, 1e-4);
        assert!(
            unit_matmul_launches() > before,
            "linear_cross_entropy {shape:?}"
        );
    }
    set_f32_matmul(F32Matmul::Auto);
}
