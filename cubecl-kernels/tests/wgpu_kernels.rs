//! The CubeCL kernels on the wgpu backend over Mesa's software Vulkan device (lavapipe):
//! fresh random inputs, outputs NaN-poisoned before every launch, forward and all gradients
//! against the float64 host oracle. Without a Vulkan adapter these tests fail (never skip).
#![cfg(feature = "wgpu")]

mod common;

use burn::backend::wgpu::Wgpu;
use burn::tensor::backend::Backend;
use burn::tensor::DType;
use common::{
    attn_case, check_attention, check_attention_and_linear_ce_refuse, check_attention_dtype,
    check_linear_ce, check_linear_ce_dtype, check_linear_gelu, check_linear_gelu_dtype,
    check_linear_gelu_refuses, wgpu_cpu_device, Rng,
};

const TOL: f64 = 1e-4;
/// Tolerance for f16/bf16 inputs (outputs and gradients stored in the half type).
const HALF_TOL: f64 = 1e-2;

#[test]
fn flash_attention_matches_f64_oracle() {
    let dev = wgpu_cpu_device();
    let mut rng = Rng::fresh("wgpu flash_attention");
    // [batch, heads, seq_q, seq_k, head_dim]: lengths on, below and above the 32-row query
    // tile and the 16/32-key tiles, square and not, every supported-size class of head dim.
    for (shape, causal, masked) in [
        ([1, 1, 1, 1, 16], false, false),
        ([2, 2, 33, 33, 16], true, false),
        ([1, 3, 45, 70, 32], false, true),
        ([2, 1, 64, 64, 64], true, true),
        ([1, 2, 31, 17, 48], false, false),
        ([1, 1, 50, 50, 128], true, false),
        ([1, 1, 19, 37, 128], false, true),
    ] {
        let c = attn_case(&mut rng, shape, causal, masked);
        check_attention::<Wgpu>(&dev, &mut rng, &c, TOL);
    }
}

#[test]
fn linear_cross_entropy_matches_f64_oracle() {
    let dev = wgpu_cpu_device();
    let mut rng = Rng::fresh("wgpu linear_cross_entropy");
    // The op runs in [row block × vocabulary chunk] pieces: small pieces, so that several row
    // blocks and chunks (the last ones partial) are folded together, then the defaults (one
    // piece, except the 2500-column vocabulary: three chunks, the last partial). Other tests
    // may run CE at the same time under either setting; every piece size gives the same
    // result, which is what this checks.
    for (piece, shapes) in [
        (
            (16, 32),
            vec![
                ([33, 40, 70], false),
                ([45, 17, 257], false),
                ([9, 16, 10], true),
            ],
        ),
        (
            (
                cubecl_kernels::cube::DEFAULT_ROW_BLOCK,
                cubecl_kernels::cube::DEFAULT_VOCAB_CHUNK,
            ),
            vec![
                ([33, 40, 70], false),
                ([20, 24, 2500], false),
                ([9, 16, 10], true),
            ],
        ),
    ] {
        cubecl_kernels::cube::set_linear_ce_piece(piece.0, piece.1);
        // [tokens, hidden, vocab]: none a multiple of the piece or kernel tile sizes.
        for (shape, all_ignored) in shapes {
            eprintln!("piece {piece:?}, shape {shape:?}");
            check_linear_ce::<Wgpu>(&dev, &mut rng, shape, all_ignored, TOL);
        }
    }
}

#[test]
fn linear_gelu_matches_f64_oracle() {
    let dev = wgpu_cpu_device();
    let mut rng = Rng::fresh("wgpu linear_gelu");
    // [tokens, d_in, d_out]: single elements, exact 32-multiples (one and several tiles in
    // every direction), one past / one short of a tile, and odd sizes, so the zero-padded
    // edges of the output and of the K tiles are all exercised.
    for shape in [
        [1, 1, 1],
        [32, 32, 32],
        [64, 96, 64],
        [33, 31, 65],
        [31, 33, 1],
        [5, 70, 17],
        [100, 48, 3],
        [47, 129, 40],
    ] {
        check_linear_gelu::<Wgpu>(&dev, &mut rng, shape, TOL);
    }
}

/// f16 and bf16: computed and checked against the oracle where the device supports the
/// type; otherwise the op must refuse it with the unsupported-dtype error (lavapipe has no
/// bf16 shader support), which this test then asserts instead of skipping.
#[test]
fn linear_gelu_half_types_match_oracle_or_are_refused() {
    let dev = wgpu_cpu_device();
    let mut rng = Rng::fresh("wgpu linear_gelu f16/bf16");
    for dtype in [DType::F16, DType::BF16] {
        if <Wgpu as Backend>::supports_dtype(&dev, dtype) {
            eprintln!("{dtype:?} is supported by this adapter: checking values");
            for shape in [[33, 31, 65], [64, 64, 32], [7, 100, 9]] {
                check_linear_gelu_dtype::<Wgpu>(&dev, &mut rng, shape, dtype, HALF_TOL);
            }
        } else {
            check_linear_gelu_refuses::<Wgpu>(&dev, dtype);
        }
    }
}

/// Flash attention and the fused linear cross-entropy in f16 and bf16, as for linear + GELU:
/// against the oracle where the adapter computes in the type, refused with the
/// unsupported-dtype error where it does not.
#[test]
fn attention_and_linear_ce_half_types_match_oracle_or_are_refused() {
    let dev = wgpu_cpu_device();
    let mut rng = Rng::fresh("wgpu attention/linear_ce f16/bf16");
    for dtype in [DType::F16, DType::BF16] {
        if !<Wgpu as Backend>::supports_dtype(&dev, dtype) {
            check_attention_and_linear_ce_refuse::<Wgpu>(&dev, dtype);
            continue;
        }
        eprintln!("{dtype:?} is supported by this adapter: checking values");
        // One shape: lengths off the tiles, causal and masked at once. lavapipe runs half
        // precision slowly (about 100 s for two attention shapes on 2 cores), and the f32
        // test above covers the shape classes.
        let c = attn_case(&mut rng, [1, 2, 33, 45, 16], true, true);
        check_attention_dtype::<Wgpu>(&dev, &mut rng, &c, dtype, HALF_TOL);
        check_linear_ce_dtype::<Wgpu>(&dev, &mut rng, [33, 40, 70], false, dtype, HALF_TOL);
    }
}
