//! Unit tests of the tile kernels' planning: cube shapes against shared-memory budgets and
//! the preference list.

use super::*;
use crate::cube::tiles::ROW_PAD;

const KERNELS: [TileKernel; 3] = [TileKernel::Forward, TileKernel::Dq, TileKernel::DkDv];

/// Hopper's shared memory after opt-in.
const HOPPER_SHARED: usize = 227 * 1024;

/// The plan on a CUDA device with tensor cores, 32-lane planes and `budget` bytes of shared
/// memory, for bf16 inputs.
fn plan_in(
    place: AccumulatorPlace,
    kernel: TileKernel,
    forced: Option<TileShape>,
    budget: usize,
    head_dim: usize,
) -> Option<TilePlan> {
    plan_tiles(
        AttentionKernel::Auto,
        forced,
        place,
        true,
        true,
        32,
        budget,
        kernel,
        DType::BF16,
        head_dim,
    )
}

/// [`plan_in`] with the default accumulator place.
fn plan(
    kernel: TileKernel,
    forced: Option<TileShape>,
    budget: usize,
    head_dim: usize,
) -> Option<TilePlan> {
    plan_in(
        AccumulatorPlace::default(),
        kernel,
        forced,
        budget,
        head_dim,
    )
}

/// On CUDA every bf16/f16 head dimension the tile kernels accept, up to the 128 of the
/// production models, gets a cube shape for all three kernels, so none of them silently
/// falls back to the portable kernel there; and every plan stays within the cap.
#[test]
fn every_half_head_dim_up_to_128_fits_cuda_shared_memory() {
    for head_dim in (FRAG..=128).step_by(FRAG) {
        for kernel in KERNELS {
            let p = plan(kernel, None, HOPPER_SHARED, head_dim)
                .unwrap_or_else(|| panic!("{kernel:?} at head dim {head_dim}: no plan"));
            let bytes =
                tile_shared_bytes(kernel, p.planes, p.stream_frags, head_dim, 2, p.acc_in_regs);
            assert!(
                bytes <= TILES_SHARED_CAP,
                "{kernel:?} {head_dim}: {bytes} B"
            );
        }
    }
}

/// Shared memory grows with planes and with the streamed tile, and the choice is the
/// first preferred shape within the budget (none when even the smallest does not fit).
#[test]
fn shape_choice_stays_within_the_budget_and_follows_the_preference() {
    for kernel in KERNELS {
        for budget in [16 * 1024, 32 * 1024, 48 * 1024, TILES_SHARED_CAP] {
            for head_dim in (FRAG..=128).step_by(FRAG) {
                for (elem, regs) in [(2, true), (2, false), (4, true), (4, false)] {
                    let bytes = |p, f| tile_shared_bytes(kernel, p, f, head_dim, elem, regs);
                    assert!(bytes(2, 1) > bytes(1, 1));
                    assert!(bytes(1, 2) > bytes(1, 1));
                    let chosen = shape_that_fits(None, kernel, head_dim, elem, regs, budget);
                    let first = TILE_SHAPES.iter().position(|&(p, f)| bytes(p, f) <= budget);
                    assert_eq!(chosen, first.map(|i| TILE_SHAPES[i]));
                    if let Some((p, f)) = chosen {
                        assert!(bytes(p, f) <= budget);
                    }
                }
            }
        }
    }
    // lavapipe's 32 KiB at head dim 128 in f16: the forward runs one plane with 16-key
    // tiles; so does dK/dV with its accumulators in registers, while its two f32 blocks in
    // shared memory do not fit (the wgpu_tiles test relies on all three).
    let lavapipe = |kernel, regs| shape_that_fits(None, kernel, 128, 2, regs, 32 * 1024);
    assert_eq!(lavapipe(TileKernel::Forward, true), Some((1, 1)));
    assert_eq!(lavapipe(TileKernel::DkDv, true), Some((1, 1)));
    assert_eq!(lavapipe(TileKernel::DkDv, false), None);
}

/// Keeping the accumulators in registers frees the backward kernels' f32 blocks (one
/// padded row per owned row and head column: dQ's, or dK's and dV's) and leaves the
/// forward's, which its rescale needs, in place.
#[test]
fn registers_free_the_backward_accumulator_blocks() {
    for head_dim in (FRAG..=128).step_by(FRAG) {
        for (planes, frags) in TILE_SHAPES {
            let bytes = |k, regs| tile_shared_bytes(k, planes, frags, head_dim, 2, regs);
            let block = planes * FRAG * (head_dim + ROW_PAD) * 4;
            // The formula still counts the one-element array the kernel declares instead.
            let freed = |blocks: usize| blocks * block - blocks * 4;
            assert_eq!(
                bytes(TileKernel::Forward, false),
                bytes(TileKernel::Forward, true)
            );
            assert_eq!(
                bytes(TileKernel::Dq, false) - bytes(TileKernel::Dq, true),
                freed(1)
            );
            assert_eq!(
                bytes(TileKernel::DkDv, false) - bytes(TileKernel::DkDv, true),
                freed(2)
            );
        }
    }
}

/// A forced shape is taken as it is where it fits, and refused (portable kernel) where it
/// does not, rather than replaced by another.
#[test]
fn a_forced_shape_is_used_or_refused() {
    let small = TileShape::new(1, 2);
    let p = plan(TileKernel::Forward, small, HOPPER_SHARED, 64).expect("fits");
    assert_eq!((p.planes, p.stream_frags), (1, 2));
    let huge = TileShape::new(8, 8);
    assert_eq!(plan(TileKernel::DkDv, huge, HOPPER_SHARED, 128), None);
    assert_eq!(TileShape::new(0, 1), None);
    assert_eq!(TileShape::new(1, TileShape::MAX + 1), None);
}

/// The shapes Hopper gets at the production head dimension, for both accumulator places,
/// printed for the record and pinned so that a change to the preference or the cap is a
/// visible decision.
#[test]
fn hopper_bf16_head_dim_128_shapes() {
    let shapes = |place| {
        KERNELS.map(|k| {
            let p = plan_in(place, k, None, HOPPER_SHARED, 128).expect("plan");
            let bytes = tile_shared_bytes(k, p.planes, p.stream_frags, 128, 2, p.acc_in_regs);
            println!(
                "{place:?} {k:?}: {} planes, {} streamed rows, {bytes} B",
                p.planes,
                p.stream_frags * FRAG
            );
            (p.planes, p.stream_frags)
        })
    };
    assert_eq!(
        shapes(AccumulatorPlace::Registers),
        [(4, 2), (4, 2), (4, 2)]
    );
    assert_eq!(shapes(AccumulatorPlace::Shared), [(4, 2), (4, 2), (2, 2)]);
}

/// The accumulators' place reaches the plan as asked, registers by default.
#[test]
fn the_accumulator_place_reaches_the_plan() {
    let in_regs = |place| {
        plan_in(place, TileKernel::Forward, None, HOPPER_SHARED, 128)
            .expect("plan")
            .acc_in_regs
    };
    assert!(in_regs(AccumulatorPlace::Registers));
    assert!(!in_regs(AccumulatorPlace::Shared));
    assert_eq!(AccumulatorPlace::default(), AccumulatorPlace::Registers);
}
