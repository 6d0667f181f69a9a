//! The CubeCL kernels on the CUDA backend (run by `scripts/gpu-check.sh` on a GPU machine):
//! same oracle, shapes and NaN poisoning as the wgpu tests, plus the production shape class
//! (head dim 128, sequence 2048 is left to the benchmarks).
#![cfg(feature = "cuda")]

mod common;

use burn::backend::cuda::{Cuda, CudaDevice};
use burn::tensor::DType;
use common::{
    attn_case, check_attention, check_attention_dtype, check_linear_ce, check_linear_ce_dtype,
    check_linear_gelu_dtype, Rng,
};
use cubecl::cuda::CudaRuntime;
use cubecl_kernels::cube::{
    attention_tile_shapes, attention_uses_tensor_cores, set_attention_accumulators,
    set_attention_tiles, tiled_launches, AccumulatorPlace, TileShape,
};

/// f32 tolerance against the float64 oracle, for every op. The fused linear + GELU and linear
/// cross-entropy multiply f32 in f32 (`cube::matmul`), not through Burn's matmul, which rounds
/// f32 operands to TF32 on CUDA: with Burn's matmul these two ops missed it (2.8e-4 and 4.0e-4
/// on an H200).
const TOL: f64 = 1e-4;

fn device() -> CudaDevice {
    cubecl_kernels::cube::set_poison_outputs(true);
    CudaDevice::default()
}

#[test]
fn cuda_flash_attention_matches_f64_oracle() {
    let dev = device();
    let mut rng = Rng::fresh("cuda flash_attention");
    for (shape, causal, masked) in [
        ([2, 2, 33, 33, 16], true, false),
        ([1, 3, 45, 70, 32], false, true),
        ([2, 1, 64, 64, 64], true, true),
        ([1, 2, 200, 200, 128], true, false),
        ([1, 1, 19, 37, 128], false, true),
    ] {
        let c = attn_case(&mut rng, shape, causal, masked);
        check_attention::<Cuda>(&dev, &mut rng, &c, TOL);
    }
}

#[test]
fn cuda_linear_cross_entropy_matches_f64_oracle() {
    let dev = device();
    let mut rng = Rng::fresh("cuda linear_cross_entropy");
    for (shape, all_ignored) in [
        ([33, 40, 70], false),
        ([100, 64, 1000], false),
        // Three vocabulary chunks of the default piece, the last partial.
        ([100, 64, 2500], false),
        ([9, 16, 10], true),
    ] {
        check_linear_ce::<Cuda>(&dev, &mut rng, shape, all_ignored, TOL);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_linear_gelu_matches_f64_oracle() {
    let dev = device();
    let mut rng = Rng::fresh("cuda linear_gelu");
    // Odd and tile-multiple shapes, plus a GPT-2-small-like MLP slice (d_in 768 → 3072).
    for (dtype, tol) in [(DType::F32, TOL), (DType::F16, 1e-2), (DType::BF16, 1e-2)] {
        for shape in [
            [1, 1, 1],
            [33, 31, 65],
            [64, 96, 64],
            [47, 129, 40],
            [128, 768, 3072],
        ] {
            check_linear_gelu_dtype::<Cuda>(&dev, &mut rng, shape, dtype, tol);
        }
    }
}

/// Flash attention and the fused linear cross-entropy in f16 and bf16 on CUDA (the production
/// types; lavapipe refuses bf16, so this is where bf16 is checked). Attention of
/// these types runs on tensor cores here (the `cmma` tile kernels, forward and backward), the
/// one place they can run.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_attention_and_linear_ce_half_types_match_f64_oracle() {
    let dev = device();
    let mut rng = Rng::fresh("cuda attention/linear_ce f16/bf16");
    for dtype in [DType::F16, DType::BF16] {
        for (shape, causal, masked) in [
            ([1, 2, 33, 45, 16], true, true),
            ([2, 2, 130, 130, 128], true, false),
            ([1, 1, 64, 97, 64], false, true),
            ([1, 3, 200, 77, 32], true, true),
            ([1, 1, 1, 1, 48], false, false),
        ] {
            let head_dim = shape[4];
            assert!(
                attention_uses_tensor_cores::<CudaRuntime>(&dev, dtype, head_dim),
                "{dtype:?} head dim {head_dim}: attention should run on tensor cores"
            );
            let before = tiled_launches();
            let c = attn_case(&mut rng, shape, causal, masked);
            check_attention_dtype::<Cuda>(&dev, &mut rng, &c, dtype, 1e-2);
            let after = tiled_launches();
            assert!(
                after.forward > before.forward && after.dq > before.dq && after.dkdv > before.dkdv,
                "{dtype:?} {shape:?}: not every attention kernel ran on the tile kernels"
            );
        }
        check_linear_ce_dtype::<Cuda>(&dev, &mut rng, [33, 40, 70], false, dtype, 1e-2);
        check_linear_ce_dtype::<Cuda>(&dev, &mut rng, [100, 64, 1000], false, dtype, 1e-2);
    }
}

/// Every cube shape `gpu-check.sh` times, forced one at a time in bf16 on tensor cores, with
/// the accumulators in fragments for the whole loop (the default) and in shared memory on
/// alternate shapes (each variant is a kernel NVRTC compiles, which takes time from
/// `gpu-check.sh`'s correctness budget), at head dims 128 and 64 and lengths that are not
/// multiples of any streamed tile: what a shape the launchers may prefer computes must be
/// right before its speed matters. The CPU counterpart (products on the lanes, shapes that fit lavapipe) is `wgpu_tiles`.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_attention_tile_shapes_match_f64_oracle() {
    let dev = device();
    let mut rng = Rng::fresh("cuda attention tile shapes");
    let shapes = [(2, 1), (4, 1), (2, 2), (4, 2), (2, 4), (4, 4)];
    for (i, (planes, frags)) in shapes.into_iter().enumerate() {
        let place = if i % 2 == 0 {
            AccumulatorPlace::Shared
        } else {
            AccumulatorPlace::Registers
        };
        let forced = TileShape::new(planes, frags).expect("valid shape");
        set_attention_tiles(Some(forced));
        set_attention_accumulators(place);
        for (shape, causal, masked) in [
            ([1, 2, 150, 150, 128], true, true),
            ([1, 1, 77, 131, 64], false, true),
        ] {
            let label = format!("{planes}x{frags} {place:?} {shape:?}");
            let fits = attention_tile_shapes::<CudaRuntime>(&dev, DType::BF16, shape[4]);
            let before = tiled_launches();
            let mut c = attn_case(&mut rng, shape, causal, masked);
            // Growing keys: the forward's rescale runs after tiles with output in the block.
            c.key_ramp = 12.0;
            check_attention_dtype::<Cuda>(&dev, &mut rng, &c, DType::BF16, 1e-2);
            let after = tiled_launches();
            // A shape whose shared memory exceeds the cap runs the portable kernel (and is
            // checked above all the same); one that fits must have run on the tiles.
            for (i, (ran, planned)) in [
                after.forward > before.forward,
                after.dq > before.dq,
                after.dkdv > before.dkdv,
            ]
            .into_iter()
            .zip(fits)
            .enumerate()
            {
                assert_eq!(ran, planned == Some(forced), "{label}: kernel {i}");
            }
        }
    }
    set_attention_tiles(None);
    set_attention_accumulators(AccumulatorPlace::default());
}
