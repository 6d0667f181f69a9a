//! `split_linear` under `Autodiff<Flex>`: outside a capture it has Burn's matmul gradients;
//! inside one, the input gradient is registered, the weight gradient is not, and the deferred
//! operands give back the weight gradient Burn's own backward computes.
#![allow(clippy::disallowed_methods)]

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Tensor};
use cubecl_kernels::{defer_weight_grads, split_linear};

type B = Autodiff<Flex>;

fn max_abs_diff(a: Tensor<Flex, 2>, b: Tensor<Flex, 2>) -> f32 {
    (a - b).abs().max().into_scalar()
}

/// `x` [5, 4], `w` [4, 3], a second weight `v` [3, 2], all tracked; the loss goes through
/// both products and a nonlinearity so the output gradients are not constant.
fn operands() -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) {
    let dev = Default::default();
    let d = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<Flex, 2>::random([5, 4], d, &dev);
    let w = Tensor::<Flex, 2>::random([4, 3], d, &dev);
    let v = Tensor::<Flex, 2>::random([3, 2], d, &dev);
    (
        Tensor::from_inner(x).require_grad(),
        Tensor::from_inner(w).require_grad(),
        Tensor::from_inner(v).require_grad(),
    )
}

#[test]
fn undeferred_gradients_are_burns_matmul_gradients() {
    let (x, w, v) = operands();
    let ours = split_linear(split_linear(x.clone(), w.clone(), 1).tanh(), v.clone(), 2);
    let g = ours.powf_scalar(2.0).sum().backward();
    let (xr, wr, vr) = (
        x.clone().detach().require_grad(),
        w.clone().detach().require_grad(),
        v.clone().detach().require_grad(),
    );
    let burns = xr.clone().matmul(wr.clone()).tanh().matmul(vr.clone());
    let gr = burns.powf_scalar(2.0).sum().backward();
    for (a, b) in [(&x, &xr), (&w, &wr), (&v, &vr)] {
        let diff = max_abs_diff(a.grad(&g).unwrap(), b.grad(&gr).unwrap());
        assert!(diff < 1e-5, "gradient differs by {diff}");
    }
}

#[test]
fn deferred_weight_gradients_are_returned_not_registered() {
    let (x, w, v) = operands();
    let y = split_linear(split_linear(x.clone(), w.clone(), 1).tanh(), v.clone(), 2);
    let (g, deferred) = defer_weight_grads::<Flex, _>(|| y.powf_scalar(2.0).sum().backward());
    assert!(w.grad(&g).is_none(), "w's gradient was registered");
    assert!(v.grad(&g).is_none(), "v's gradient was registered");
    // The backward reaches the outer product first.
    let tags: Vec<u64> = deferred.iter().map(|d| d.tag).collect();
    assert_eq!(tags, vec![2, 1]);

    let (xr, wr, vr) = (
        x.clone().detach().require_grad(),
        w.clone().detach().require_grad(),
        v.clone().detach().require_grad(),
    );
    let gr = xr
        .clone()
        .matmul(wr.clone())
        .tanh()
        .matmul(vr.clone())
        .powf_scalar(2.0)
        .sum()
        .backward();
    let diff = max_abs_diff(x.grad(&g).unwrap(), xr.grad(&gr).unwrap());
    assert!(diff < 1e-5, "input gradient differs by {diff}");
    for d in deferred {
        let want = if d.tag == 1 { &wr } else { &vr };
        let diff = max_abs_diff(d.weight_grad(), want.grad(&gr).unwrap());
        assert!(diff < 1e-5, "deferred weight gradient differs by {diff}");
    }
    // The capture is over: the next backward registers weight gradients again.
    let y = split_linear(x, w.clone(), 1);
    let g = y.sum().backward();
    assert!(w.grad(&g).is_some());
}

#[test]
fn a_panicking_backward_disarms_the_capture() {
    let caught = std::panic::catch_unwind(|| {
        defer_weight_grads::<Flex, _>(|| panic!("backward failed"));
    });
    assert!(caught.is_err());
    let (x, w, _) = operands();
    let g = split_linear(x, w.clone(), 1).sum().backward();
    assert!(
        w.grad(&g).is_some(),
        "the capture stayed armed after a panic"
    );
}

#[test]
fn frozen_weights_defer_nothing() {
    let (x, w, _) = operands();
    // Burn's `detach` keeps `require_grad`: freezing takes it off explicitly.
    let frozen = w.detach().set_require_grad(false);
    let y = split_linear(x.clone(), frozen, 1);
    let (g, deferred) = defer_weight_grads::<Flex, _>(|| y.sum().backward());
    assert!(deferred.is_empty());
    assert!(x.grad(&g).is_some());
}

/// A capture armed for another backend's entries takes nothing: the weight gradient is
/// registered as usual rather than lost.
#[test]
fn a_capture_for_another_backend_loses_no_gradient() {
    let (x, w, _) = operands();
    let y = split_linear(x, w.clone(), 1);
    // `B` itself is not the inner backend the op's backward runs on.
    let (g, deferred) = defer_weight_grads::<B, _>(|| y.sum().backward());
    assert!(deferred.is_empty());
    assert!(w.grad(&g).is_some(), "the weight gradient was dropped");
}
