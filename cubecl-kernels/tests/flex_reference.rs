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
    for shape in [[1, 3, 5], [7, 16, 33]] {
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
