//! A linear product whose weight gradient can be deferred: the split backward of zero-bubble
//! pipeline schedules.
//!
//! Zero-bubble schedules split a stage's backward into `I` (the input gradient, which the
//! previous stage is waiting for) and `W` (the weight gradients, which nobody waits for and so
//! can fill a bubble later). [`split_linear`] is `x · W` with a backward that always produces
//! `dx = dy · Wᵀ`; for `dW = xᵀ · dy` it either registers the gradient as usual or, while
//! [`defer_weight_grads`] runs on the same thread, keeps `(x, dy)` and hands them to the caller
//! instead. The caller computes `dW` later with [`DeferredWeightGrad::weight_grad`], on the
//! inner backend: the autodiff graph was consumed by the first backward.
//!
//! Outside [`defer_weight_grads`] the op is an ordinary matmul with an ordinary backward, so a
//! model built on it trains unchanged by any schedule or without a pipeline.
//!
//! Burn's backward runs on the thread that calls `backward()`, which is why the capture can
//! be a thread-local: each pipeline rank's thread captures only its own gradients.

use std::any::{Any, TypeId};
use std::cell::RefCell;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::FusedOps;

/// An armed capture: the type of entry it takes (`DeferredWeightGrad` of one inner backend)
/// and the entries taken so far.
type Sink = (TypeId, Vec<Box<dyn Any>>);

thread_local! {
    /// The weight gradients deferred by the backward running on this thread, while armed.
    static SINK: RefCell<Option<Sink>> = const { RefCell::new(None) };
}

/// The saved operands of one deferred weight gradient: `dW = inputᵀ · grad_output`.
#[derive(Debug, Clone)]
pub struct DeferredWeightGrad<B: Backend> {
    /// The tag given to [`split_linear`]: which weight this gradient belongs to.
    pub tag: u64,
    /// The op's input `x`, `[tokens, d_in]`.
    pub input: Tensor<B, 2>,
    /// The gradient of the op's output, `[tokens, d_out]`.
    pub grad_output: Tensor<B, 2>,
}

impl<B: Backend> DeferredWeightGrad<B> {
    /// `dW = xᵀ · dy`, `[d_in, d_out]`: exactly what the undeferred backward registers.
    pub fn weight_grad(self) -> Tensor<B, 2> {
        self.input.transpose().matmul(self.grad_output)
    }
}

/// Disarms the sink even if the closure panics, so a later backward on the thread is not
/// silently deferred.
struct Armed {
    previous: Option<Sink>,
}

impl Drop for Armed {
    fn drop(&mut self) {
        let previous = self.previous.take();
        SINK.with(|sink| *sink.borrow_mut() = previous);
    }
}

/// Runs `backward` (a `backward()` call on an autodiff tensor over inner backend `B`) with
/// weight gradients deferred: every [`split_linear`] whose weight is tracked gives its `(x, dy)`
/// back here instead of registering `dW`, in the order the backward reached them. Every other
/// gradient (inputs, biases, norms, embeddings, fused ops) is registered as usual.
///
/// Calls nest: an inner call captures its own backward's gradients and leaves the outer
/// call's untouched.
pub fn defer_weight_grads<B: Backend, R>(
    backward: impl FnOnce() -> R,
) -> (R, Vec<DeferredWeightGrad<B>>) {
    let armed = (TypeId::of::<DeferredWeightGrad<B>>(), Vec::new());
    let previous = SINK.with(|sink| sink.borrow_mut().replace(armed));
    let guard = Armed { previous };
    let result = backward();
    let captured = SINK
        .with(|sink| sink.borrow_mut().take())
        .map_or_else(Vec::new, |(_, entries)| entries);
    drop(guard);
    // The sink took only entries of this type (see `defer`).
    let deferred = captured
        .into_iter()
        .filter_map(|entry| entry.downcast::<DeferredWeightGrad<B>>().ok())
        .map(|entry| *entry)
        .collect();
    (result, deferred)
}

/// Hands `entry` to the sink armed on this thread, or gives it back (to be registered as an
/// ordinary gradient) when none is armed or the armed one is for another backend's entries,
/// so a capture of the wrong type never loses a gradient.
fn defer<B: Backend>(entry: DeferredWeightGrad<B>) -> Option<DeferredWeightGrad<B>> {
    SINK.with(|sink| match sink.borrow_mut().as_mut() {
        Some((kind, list)) if *kind == TypeId::of::<DeferredWeightGrad<B>>() => {
            list.push(Box::new(entry));
            None
        }
        _ => Some(entry),
    })
}

/// `x · w` for `x` `[tokens, d_in]` and `w` `[d_in, d_out]` (Burn's `Linear` layout), whose
/// weight gradient is deferred inside [`defer_weight_grads`] and tagged `tag` (use the
/// weight's `ParamId` value). `w` must be the parameter itself, not a tracked expression of
/// it: a deferred gradient is never registered, and every tracked node between the parameter
/// and this op would be left waiting for one.
///
/// # Panics
/// If the inner dimensions differ (as Burn's matmul does); check shapes before calling.
pub fn split_linear<B: FusedOps>(x: Tensor<B, 2>, w: Tensor<B, 2>, tag: u64) -> Tensor<B, 2> {
    let y = B::deferrable_matmul(
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
        tag,
    );
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

#[derive(Debug)]
struct DeferrableMatmulBackward;

impl<B: FusedOps> Backward<B, 2> for DeferrableMatmulBackward {
    /// `x` (kept only when `w` needs a gradient), `w` (only when `x` does) and the tag.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>, u64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy =
            Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grads.consume::<B>(&ops.node)));
        let float = |t: FloatTensor<B>| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
        let (x, w, tag) = ops.state;
        if let (Some(node), Some(w)) = (node_x, w) {
            let dx = dy.clone().matmul(float(w).transpose());
            grads.register::<B>(node.id, dx.into_primitive().tensor());
        }
        if let (Some(node), Some(x)) = (node_w, x) {
            let entry = DeferredWeightGrad {
                tag,
                input: float(x),
                grad_output: dy,
            };
            if let Some(entry) = defer(entry) {
                grads.register::<B>(node.id, entry.weight_grad().into_primitive().tensor());
            }
        }
    }
}

/// The autodiff override of [`FusedOps::deferrable_matmul`].
pub(crate) fn autodiff_deferrable_matmul<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    tag: u64,
) -> FloatTensor<Autodiff<B, C>> {
    // Keep each operand only for the gradient that needs it.
    let x_needs_grad = !x.node.requirement.is_none();
    let w_needs_grad = !w.node.requirement.is_none();
    let prep = DeferrableMatmulBackward
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful();
    let (xp, wp) = (x.primitive, w.primitive);
    match prep {
        OpsKind::Tracked(prep) => {
            let y = B::float_matmul(xp.clone(), wp.clone());
            let keep_x = w_needs_grad.then_some(xp);
            let keep_w = x_needs_grad.then_some(wp);
            prep.finish((keep_x, keep_w, tag), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::float_matmul(xp, wp)),
    }
}
