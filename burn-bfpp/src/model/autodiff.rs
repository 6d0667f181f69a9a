//! The backward pass of one stage on its own, and its gradients as one flat buffer.
//!
//! # The stage-backward recipe
//!
//! A pipelined model never builds one autodiff graph for the whole model: each stage's graph
//! starts at its input and ends at its output, and the graphs are joined by hand.
//!
//! 1. **Forward.** Take [`fresh_leaves`] of the stage (its parameters as new autodiff leaves;
//!    no data is copied). A stage that does not start the model makes the received
//!    activation a leaf with [`input_leaf`] (cutting it from whatever graph produced it,
//!    e.g. the previous stage on the same rank). Run [`super::PipelineStage::forward`] of
//!    the fresh copy; keep the copy, the input leaf and the output until the backward.
//! 2. **Backward of the last stage.** [`loss_backward`] on the loss, scaled by
//!    `1 / micro-batches` so that the accumulated gradient is that of the mean loss.
//! 3. **Backward of any other stage.** [`stage_backward`] with the gradient of the output
//!    received from the next stage. It differentiates `(output · g).sum()`, whose gradient
//!    with respect to `output` is exactly `g`, so by the chain rule every gradient it yields
//!    is the one the unsplit model would have.
//! 4. **Hand-off.** [`input_grad`] reads the gradient of the stage's input leaf: that is the
//!    `g` the previous stage needs. The parameters' gradients are read *from the fresh
//!    copy* (the engine takes each out of the gradients into its stage's flat buffer, in the
//!    layout of [`super::flatten_params`]; the tests' `flatten_grads` reads them the same
//!    way); summing those over the micro-batches gives the step's gradient.
//!
//! Micro-batches may then run in any order, e.g. breadth-first: every forward of a stage,
//! then every backward.
//!
//! # Why fresh leaves per micro-batch
//!
//! Breadth-first keeps the graphs of all micro-batches of a stage alive at once. If they
//! share the parameter leaves, Burn 0.21 merges them into one graph, and a parameter leaf
//! that has never been through a backward (new parameters, or parameters just reloaded
//! with [`super::load_flat`] after an optimiser step) still has its root step recorded; the
//! first backward consumes it and later backwards of the merged graph sometimes drop steps
//! of the micro-batches still waiting, depending on hash-map order. We measured wrong
//! gradients in 5–9% of fresh processes (MLP, 4 stages, 4 micro-batches, one thread);
//! with one leaf copy per micro-batch, 0 of 200. Depth-first orders (each micro-batch's
//! backward right after its forward) are not affected.
//!
//! # Threads: no lock
//!
//! Burn 0.21's autodiff keeps every graph of the process in one global registry, and each
//! `backward()` ends with a sweep over *all* graphs that frees steps it believes unused. In
//! the published 0.21.0 that sweep could free steps another thread had just recorded but not
//! yet linked to the op consuming them (tracel-ai/burn#5573): the other thread's gradients
//! silently missed contributions. Ranks that are threads therefore used to serialise every
//! forward and backward under one process-wide lock. The workspace now builds a patched
//! burn-autodiff (`vendor/burn-autodiff`, see its README) in which an operation keeps its
//! inputs marked as used until its own step is registered; `tests/autodiff_threads.rs`
//! fails without the patch. So thread ranks record and run their graphs concurrently.
//!
//! A `[patch.crates-io]` applies only to the workspace that declares it: a project that
//! depends on burn-bfpp compiles the published burn-autodiff unless it declares the same
//! patch. The build knows which it got ([`PATCHED_AUTODIFF`]: the patched crate tells
//! burn-bfpp's build script through its `links` metadata). Without the patch, ranks that are
//! threads of one process take turns at every step that records, runs or drops an autodiff
//! graph ([`serial_autodiff`]), exactly as before the patch, and the first such run says so
//! once (a `tracing` warning naming the lines to add). Correct either way; with the patch the
//! ranks run at the speed of separate processes.
//!
//! What remains to respect: threads must not share autodiff nodes. Burn locks a graph and
//! then its registry in a backward, and the registry and then graphs when an op joins two
//! graphs, so two threads recording on one graph could deadlock. The engine never shares a
//! node between ranks: each rank's stages start from [`fresh_leaves`] over detached values,
//! received activations become new leaves ([`input_leaf`]), and everything that crosses
//! threads is an inner-backend tensor without a graph.

#[cfg(all(test, feature = "flex"))]
use burn::module::ModuleVisitor;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

use super::ModelError;

/// Whether the burn-autodiff this crate was built against carries the workspace's fix of
/// tracel-ai/burn#5573 (`vendor/burn-autodiff`, used through `[patch.crates-io]`): only then
/// do thread ranks drive Burn's autodiff at once. A project that depends on burn-bfpp gets it
/// by adding to its own `Cargo.toml`
///
/// ```toml
/// [patch.crates-io]
/// burn-autodiff = { path = "PATH/TO/burn-bfpp-repository/vendor/burn-autodiff" }
/// ```
///
/// (or the `git` form of the same); without it, thread ranks take turns (see the module
/// docs).
pub const PATCHED_AUTODIFF: bool = cfg!(bfpp_autodiff_patched);

/// The lines that give a project the patched burn-autodiff, for notices.
pub(crate) const PATCH_HINT: &str = "add `[patch.crates-io] burn-autodiff = { path = \
     \"<burn-bfpp checkout>/vendor/burn-autodiff\" }` to your project's Cargo.toml \
     (see burn-bfpp's docs/user-guide.md, \"Your own project\")";

/// Held by a rank that shares this process with other thread ranks while it records, runs or
/// drops autodiff graphs, where Burn's autodiff is the published 0.21.0, whose backward can
/// free the steps of a graph another thread is building (tracel-ai/burn#5573). `None` (no
/// turns taken) with the patched crate, or for a rank that has its process to itself.
pub(crate) fn serial_autodiff(threads: bool) -> Option<std::sync::MutexGuard<'static, ()>> {
    static TURNS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if PATCHED_AUTODIFF || !threads {
        return None;
    }
    // The lock guards no data; a panic while holding it leaves nothing inconsistent.
    Some(
        TURNS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

/// Says once per process that thread ranks take turns for want of the patched autodiff.
pub(crate) fn notice_serial_autodiff(ranks: usize) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if PATCHED_AUTODIFF || ranks < 2 {
        return;
    }
    ONCE.call_once(|| {
        tracing::warn!(
            ranks,
            "this build uses the published burn-autodiff 0.21.0, which can lose gradients \
             when threads run backward passes at once (tracel-ai/burn#5573): the {ranks} \
             thread ranks take turns at autodiff work, which is correct but slower than \
             separate processes. For full speed, {PATCH_HINT}"
        );
    });
}

/// A copy of `module` whose float parameters are new autodiff leaves with the same values
/// (the data is shared, not copied), the same [`burn::module::ParamId`]s and the same
/// `require_grad` flags. Run each micro-batch's forward on its own copy and read that
/// micro-batch's parameter gradients from it (see the module docs for why).
pub(crate) fn fresh_leaves<B: Backend, M: Module<B>>(module: &M) -> M {
    struct Releaf;
    impl<B: Backend> ModuleMapper<B> for Releaf {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, value, mapper) = param.consume();
            let require_grad = value.is_require_grad();
            Param::from_mapped_value(id, value.detach().set_require_grad(require_grad), mapper)
        }
    }
    module.clone().map(&mut Releaf)
}

/// Makes a received activation the leaf a stage's graph starts from (`detach().require_grad()`).
pub(crate) fn input_leaf<B: AutodiffBackend>(hidden: Tensor<B, 3>) -> Tensor<B, 3> {
    hidden.detach().require_grad()
}

/// Backward of a non-last stage from the gradient `grad_output` of its `output`.
///
/// Computes the gradients of `(output · grad_output).sum()`; `grad_output` is used as a
/// constant (it lives on the inner backend, so it carries no graph). Fails without running
/// anything if the shapes differ.
pub(crate) fn stage_backward<B: AutodiffBackend>(
    output: &Tensor<B, 3>,
    grad_output: Tensor<B::InnerBackend, 3>,
) -> Result<B::Gradients, ModelError> {
    if output.dims() != grad_output.dims() {
        return Err(ModelError::shape(
            "gradient of the stage output",
            format!("{:?} (the output's shape)", output.dims()),
            format!("{:?}", grad_output.dims()),
        ));
    }
    let grad = Tensor::<B, 3>::from_inner(grad_output).to_device(&output.device());
    Ok((output.clone() * grad).sum().backward())
}

/// Backward of the last stage from its loss, scaled by `scale` (use `1 / micro-batches` so
/// the gradients summed over micro-batches are those of the mean loss).
pub(crate) fn loss_backward<B: AutodiffBackend>(loss: &Tensor<B, 1>, scale: f64) -> B::Gradients {
    loss.clone().mul_scalar(scale).backward()
}

/// The gradient of a stage's input leaf (made by [`input_leaf`]); zeros if the stage did not
/// use its input, which is the correct gradient in that case.
pub(crate) fn input_grad<B: AutodiffBackend>(
    leaf: &Tensor<B, 3>,
    grads: &B::Gradients,
) -> Tensor<B::InnerBackend, 3> {
    leaf.grad(grads)
        .unwrap_or_else(|| Tensor::zeros(leaf.dims(), &leaf.device()))
}

/// The gradients of all float parameters of `module`, flattened and concatenated in the
/// layout of [`super::flatten_params`]; a parameter without a gradient (unused, or not
/// requiring one) contributes zeros so the layout never shifts. The tests' reader of a stage's
/// gradients.
#[cfg(all(test, feature = "flex"))]
pub(crate) fn flatten_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &B::Gradients,
) -> Tensor<B::InnerBackend, 1> {
    struct Flatten<'a, B: AutodiffBackend> {
        grads: &'a B::Gradients,
        parts: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let n = value.shape().num_elements();
            let part = match value.grad(self.grads) {
                Some(grad) => grad.reshape([n]),
                // In the parameter's dtype, as its gradient would be (the parts are
                // concatenated; a split backward's deferred weights have none here).
                None => {
                    let zeros = Tensor::<B::InnerBackend, 1>::zeros([n], &value.device());
                    if zeros.dtype() == value.dtype() {
                        zeros
                    } else {
                        zeros.cast(value.dtype())
                    }
                }
            };
            self.parts.push(part);
        }
    }
    let mut visitor = Flatten {
        grads,
        parts: Vec::new(),
    };
    module.visit(&mut visitor);
    if visitor.parts.is_empty() {
        // No parameters: an empty buffer on the module's device (the inner backend shares it).
        let device = module.devices().into_iter().next().unwrap_or_default();
        return super::params::no_elements(&device);
    }
    Tensor::cat(visitor.parts, 0)
}
