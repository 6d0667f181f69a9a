//! The composed reference ops on Flex (Burn's CPU backend), forward and gradients through
//! `Autodiff<Flex>`, against the float64 host oracle.

mod common;

use burn::backend::Flex;
use common::{attn_case, check_attention, check_linear_ce, check_linear_gelu, Rng};

const TOL: f64 = 1e-4;

#[test]
fn attention_matches_f64_oracle() {
    let mut rng = Rng::fresh("flex attention");
    let dev = Default::default();
    for (shape, causal, masked) in [
        ([1, 1, 5, 5, 16], false, false),
        ([2, 3, 17, 17, 32], true, false),
        ([2, 2, 9, 13, 16], false, true),
        ([1, 2, 19, 19, 64], true, true),
    ] {
        let c = attn_case(&mut rng, shape, causal, masked);
        check_attention::<Flex>(&dev, &mut rng, &c, TOL);
    }
}

#[test]
fn linear_gelu_matches_f64_oracle() {
    let mut rng = Rng::fresh("flex linear_gelu");
    for shape in [[1, 3, 5], [7, 16, 33], [33, 31, 65]] {
        check_linear_gelu::<Flex>(&Default::default(), &mut rng, shape, TOL);
    }
}

#[test]
fn linear_cross_entropy_matches_f64_oracle() {
    let mut rng = Rng::fresh("flex linear_cross_entropy");
    for (shape, all_ignored) in [
        ([6, 8, 11], false),
        ([13, 16, 70], false),
        ([4, 8, 9], true),
    ] {
        check_linear_ce::<Flex>(&Default::default(), &mut rng, shape, all_ignored, TOL);
    }
}

#[test]
fn shape_errors_are_reported_not_panicked() {
    use burn::tensor::{DType, Int, Tensor};
    use cubecl_kernels::FusedError;
    let dev = Default::default();
    let t4 = |s: [usize; 4]| Tensor::<Flex, 4>::zeros(s, &dev);
    let err = cubecl_kernels::flash_attention(
        t4([1, 2, 8, 24]),
        t4([1, 2, 8, 24]),
        t4([1, 2, 8, 24]),
        None,
        false,
    )
    .err();
    assert_eq!(err, Some(FusedError::UnsupportedHeadDim(24)));
    let err = cubecl_kernels::flash_attention(
        t4([1, 2, 8, 16]),
        t4([1, 2, 9, 16]),
        t4([1, 2, 8, 16]),
        None,
        true,
    )
    .err();
    assert!(
        matches!(err, Some(FusedError::ShapeMismatch { what: "v vs k", .. })),
        "{err:?}"
    );
    let err = cubecl_kernels::flash_attention(
        t4([1, 2, 0, 16]),
        t4([1, 2, 4, 16]),
        t4([1, 2, 4, 16]),
        None,
        true,
    )
    .err();
    assert!(matches!(err, Some(FusedError::Empty { .. })), "{err:?}");
    let h = Tensor::<Flex, 2>::zeros([4, 8], &dev);
    let w = Tensor::<Flex, 2>::zeros([7, 10], &dev);
    let t = Tensor::<Flex, 1, Int>::zeros([4], &dev);
    let err = cubecl_kernels::linear_cross_entropy(h, w, t, -100).err();
    assert!(
        matches!(
            err,
            Some(FusedError::ShapeMismatch {
                op: "linear_cross_entropy",
                ..
            })
        ),
        "{err:?}"
    );
    let x = Tensor::<Flex, 2>::zeros([4, 8], &dev);
    let w = Tensor::<Flex, 2>::zeros([8, 10], &dev);
    let b = Tensor::<Flex, 1>::zeros([9], &dev);
    let err = cubecl_kernels::linear_gelu(x, w, b).err();
    assert!(
        matches!(
            err,
            Some(FusedError::ShapeMismatch {
                what: "b [d_out]",
                ..
            })
        ),
        "{err:?}"
    );
    // Mixed float types would make a kernel misread a buffer: refused before any launch.
    let x = Tensor::<Flex, 2>::zeros([4, 8], &dev);
    let w = common::tensor_as::<Flex, 2>(vec![0.0; 80], [8, 10], DType::F16, &dev);
    let b = Tensor::<Flex, 1>::zeros([10], &dev);
    let err = cubecl_kernels::linear_gelu(x, w, b).err();
    assert_eq!(
        err,
        Some(FusedError::DTypeMismatch {
            op: "linear_gelu",
            what: "w",
            got: DType::F16,
            expected: DType::F32,
        })
    );
}
