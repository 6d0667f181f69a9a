//! Analytic memory of the fused ops against Burn's composed path: what each path allocates
//! beyond its inputs, counted from the buffers it creates. The benchmarks print these beside
//! the measured figures (the workspace's `kernel_bench` example measures the CubeCL memory
//! pool), so the model is checked where a device can run the shape and quoted where none can.

/// Bytes the linear cross-entropy allocates over forward + backward beyond its inputs, as
/// `(materialised, fused)`, for `tokens × hidden` states, a `hidden × vocab` head and
/// `elem_bytes`-byte floats, with the fused op's default piece size
/// ([`crate::cube::DEFAULT_ROW_BLOCK`] × [`crate::cube::DEFAULT_VOCAB_CHUNK`]).
///
/// The materialised path (logits, then Burn's log-softmax) holds the logits and their gradient
/// (`2·n·V`). The fused one holds, at its peak in the backward, one logits piece (`r·c`, turned
/// into its gradient in place), that piece's contribution to `dh` (`r·hidden`) before it is
/// added, the chunk's `dW` columns and one more of that size (`2·hidden·c`: the matmul's
/// product and the transposed operand or running sum), and eight per-token 4-byte vectors
/// (running max and sum, target logit, loss term, log-sum-exp, validity, coefficient, i32
/// targets). Both produce `dh` and `dW`. Burn's log-softmax keeps further `n·V`
/// intermediates, so the materialised figure is a lower bound.
pub fn linear_cross_entropy_extra_bytes(
    tokens: u64,
    hidden: u64,
    vocab: u64,
    elem_bytes: u64,
) -> (u64, u64) {
    let grads = (tokens * hidden + hidden * vocab) * elem_bytes;
    let rows = tokens.min(crate::cube::DEFAULT_ROW_BLOCK as u64);
    let cols = vocab.min(crate::cube::DEFAULT_VOCAB_CHUNK as u64);
    let pieces = (rows * cols + rows * hidden + 2 * hidden * cols) * elem_bytes;
    (
        2 * tokens * vocab * elem_bytes + grads,
        pieces + 8 * tokens * 4 + grads,
    )
}

/// Bytes the MLP's first linear + GELU keeps alive between forward and backward beyond its
/// inputs, as `(composed, fused)`: Burn's composed path saves GELU's input `z = x·W + b`
/// (`n·m` values) for `gelu_backward`; the fused op saves only references to `x`, `W`, `b`
/// and recomputes `z`.
pub fn linear_gelu_saved_bytes(tokens: u64, d_out: u64, elem_bytes: u64) -> (u64, u64) {
    (tokens * d_out * elem_bytes, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpt2_head_needs_over_ten_times_less_with_the_fused_path() {
        // 8192 × 50304 × 1024, f32: 3.4 GB of logits and gradient against 72 MB of pieces and
        // vectors; the gradients (0.24 GB) are common to both.
        let (mat, fused) = linear_cross_entropy_extra_bytes(8192, 1024, 50304, 4);
        let pieces = (8192 * 1024 + 8192 * 1024 + 2 * 1024 * 1024) * 4;
        assert_eq!(
            fused,
            pieces + 8 * 8192 * 4 + (8192 * 1024 + 1024 * 50304) * 4
        );
        assert!(mat as f64 / fused as f64 > 10.0, "{mat} / {fused}");
    }

    #[test]
    fn mlp_fused_saves_nothing_between_passes() {
        assert_eq!(linear_gelu_saved_bytes(8, 16, 2), (256, 0));
    }
}
