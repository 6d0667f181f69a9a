//! `FusedOps` for `Autodiff<B>`: the inner backend's forward, with its backward method
//! registered as the op's gradient so the fused kernels serve training too.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};

use crate::FusedOps;

/// Saved forward state of attention: inputs, output and log-sum-exp (never the scores).
type AttnState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<BoolTensor<B>>,
    bool,
);

#[derive(Debug)]
struct FlashAttentionBackward;

impl<B: FusedOps> Backward<B, 3> for FlashAttentionBackward {
    type State = AttnState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, mask, causal) = ops.state;
        let (dq, dk, dv) = B::fused_flash_attention_backward(q, k, v, out, lse, dout, mask, causal);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct LinearGeluBackward;

impl<B: FusedOps> Backward<B, 3> for LinearGeluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w, node_b] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, b) = ops.state;
        let (dx, dw, db) = B::fused_linear_gelu_backward(x, w, b, dy);
        for (node, grad) in [(node_x, dx), (node_w, dw), (node_b, db)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct LinearCrossEntropyBackward;

impl<B: FusedOps> Backward<B, 2> for LinearCrossEntropyBackward {
    /// Inputs, ignore index and the forward's per-token log-sum-exp (`[tokens]`, never logits).
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        i64,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_h, node_w] = ops.parents;
        let dloss = grads.consume::<B>(&ops.node);
        let (h, w, targets, ignore_index, lse) = ops.state;
        let (dh, dw) =
            B::fused_linear_cross_entropy_backward(h, w, targets, ignore_index, lse, dloss);
        for (node, grad) in [(node_h, dh), (node_w, dw)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn fused_kernels() -> bool {
        B::fused_kernels()
    }

    fn fused_defaults() -> crate::FusedDefaults {
        B::fused_defaults()
    }

    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let prep = FlashAttentionBackward
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful();
        let (qp, kp, vp) = (q.primitive, k.primitive, v.primitive);
        match prep {
            OpsKind::Tracked(prep) => {
                let (out, lse) = B::fused_flash_attention(
                    qp.clone(),
                    kp.clone(),
                    vp.clone(),
                    key_padding_mask.clone(),
                    causal,
                );
                let state = (
                    qp,
                    kp,
                    vp,
                    out.clone(),
                    lse.clone(),
                    key_padding_mask,
                    causal,
                );
                // The log-sum-exp is an auxiliary output: it carries no gradient.
                (prep.finish(state, out), FloatTensor::<Self>::new(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (out, lse) = B::fused_flash_attention(qp, kp, vp, key_padding_mask, causal);
                (prep.finish(out), FloatTensor::<Self>::new(lse))
            }
        }
    }

    fn deferrable_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        tag: u64,
    ) -> FloatTensor<Self> {
        crate::deferred::autodiff_deferrable_matmul::<B, C>(x, w, tag)
    }

    fn fused_linear_gelu(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let prep = LinearGeluBackward
            .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful();
        let (xp, wp, bp) = (x.primitive, w.primitive, b.primitive);
        match prep {
            OpsKind::Tracked(prep) => {
                let y = B::fused_linear_gelu(xp.clone(), wp.clone(), bp.clone());
                prep.finish((xp, wp, bp), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_linear_gelu(xp, wp, bp)),
        }
    }

    fn fused_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore_index: i64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let prep = LinearCrossEntropyBackward
            .prepare::<C>([h.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful();
        let (hp, wp) = (h.primitive, w.primitive);
        match prep {
            OpsKind::Tracked(prep) => {
                let (loss, lse) = B::fused_linear_cross_entropy(
                    hp.clone(),
                    wp.clone(),
                    targets.clone(),
                    ignore_index,
                );
                let state = (hp, wp, targets, ignore_index, lse.clone());
                // The log-sum-exp is an auxiliary output: it carries no gradient.
                (prep.finish(state, loss), FloatTensor::<Self>::new(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (loss, lse) = B::fused_linear_cross_entropy(hp, wp, targets, ignore_index);
                (prep.finish(loss), FloatTensor::<Self>::new(lse))
            }
        }
    }
}
