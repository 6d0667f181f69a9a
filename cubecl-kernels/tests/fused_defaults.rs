//! `FusedOps::fused_defaults`: which fused ops `--fused auto` (the model's `FusedMode::Auto`)
//! turns on per backend. The table on `FusedDefaults` records why; these tests hold each
//! backend to it, `Autodiff` over a backend answering as the backend itself. Nothing here
//! launches a kernel, so the CUDA check runs on machines without a GPU (CI builds it with
//! `--features cuda`).

use burn::backend::{Autodiff, Flex};
use cubecl_kernels::{FusedDefaults, FusedOps};

#[test]
fn flex_takes_no_fused_op_by_default() {
    assert_eq!(Flex::fused_defaults(), FusedDefaults::NONE);
    assert_eq!(Autodiff::<Flex>::fused_defaults(), FusedDefaults::NONE);
}

/// Every fused op was measured slower than Burn's own path on lavapipe, the only wgpu
/// device measured.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_takes_no_fused_op_by_default() {
    use burn::backend::Wgpu;
    assert_eq!(<Wgpu>::fused_defaults(), FusedDefaults::NONE);
    assert_eq!(Autodiff::<Wgpu>::fused_defaults(), FusedDefaults::NONE);
}

/// On an H200 fused attention ran at 0.30× Burn's materialised attention, so it stays off;
/// the MLP (1.33×) and the head (6–16× less memory; not yet timed on a GPU) are on.
#[cfg(feature = "cuda")]
#[test]
fn cuda_takes_the_mlp_and_the_head_but_not_attention() {
    use burn::backend::Cuda;
    let expected = FusedDefaults {
        attention: false,
        mlp: true,
        head: true,
    };
    assert_eq!(<Cuda>::fused_defaults(), expected);
    assert_eq!(Autodiff::<Cuda>::fused_defaults(), expected);
}
