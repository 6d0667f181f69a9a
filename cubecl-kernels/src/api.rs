//! Checked entry points on Burn tensors: validate shapes, then call the backend's
//! [`FusedOps`] method. Shape problems come back as [`FusedError`] instead of a panic deep
//! inside a kernel launch.

use burn::tensor::{Bool, DType, Int, Tensor, TensorPrimitive};

use crate::{FusedError, FusedOps, MAX_HEAD_DIM};

fn mismatch(op: &'static str, what: &'static str, got: &[usize], expected: &[usize]) -> FusedError {
    FusedError::ShapeMismatch {
        op,
        what,
        got: got.to_vec(),
        expected: expected.to_vec(),
    }
}

fn float<B: FusedOps, const D: usize>(t: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The inputs of `op` share the first input's float type `dtype`, and `device` computes in
/// it. Checked before any launch: a kernel for a type the device cannot compute in would
/// otherwise fail deep inside the shader compiler.
fn check_dtypes<B: FusedOps>(
    op: &'static str,
    dtype: DType,
    device: &B::Device,
    others: &[(&'static str, DType)],
) -> Result<(), FusedError> {
    if let Some(&(what, got)) = others.iter().find(|(_, got)| *got != dtype) {
        return Err(FusedError::DTypeMismatch {
            op,
            what,
            got,
            expected: dtype,
        });
    }
    if !B::supports_dtype(device, dtype) {
        return Err(FusedError::UnsupportedDType { op, dtype });
    }
    Ok(())
}

/// Flash attention: `softmax(QKᵀ/√d)·V` and the per-row log-sum-exp, without materialising
/// the `[seq_q × seq_k]` scores on backends with kernels. See [`FusedOps`] for layouts; the
/// head dimension must be a multiple of 16, at most [`MAX_HEAD_DIM`].
///
/// `key_padding_mask` is `true` for padded keys; `causal` hides key `j` from query `i` when
/// `j > i`. Returns the output (shaped like `q`) and the log-sum-exp (`[batch, heads,
/// seq_q]`). Under `Autodiff` the backward gives gradients to `q`, `k` and `v`.
///
/// # Errors
///
/// [`FusedError`] when the shapes disagree, a dimension is zero, the head dimension is
/// unsupported, or the inputs' float types differ or the device cannot compute in theirs;
/// all checked before anything is launched.
pub fn flash_attention<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
    causal: bool,
) -> Result<(Tensor<B, 4>, Tensor<B, 3>), FusedError> {
    const OP: &str = "flash_attention";
    let [b, h, sq, d] = q.dims();
    let [kb, kh, sk, kd] = k.dims();
    if [kb, kh, kd] != [b, h, d] {
        return Err(mismatch(
            OP,
            "k [batch, heads, _, head_dim] vs q",
            &k.dims(),
            &[b, h, sk, d],
        ));
    }
    if v.dims() != [b, h, sk, d] {
        return Err(mismatch(OP, "v vs k", &v.dims(), &[b, h, sk, d]));
    }
    if let Some(m) = &key_padding_mask {
        if m.dims() != [b, sk] {
            return Err(mismatch(
                OP,
                "key_padding_mask [batch, seq_k]",
                &m.dims(),
                &[b, sk],
            ));
        }
    }
    if b * h * sq * sk == 0 {
        return Err(FusedError::Empty {
            op: OP,
            what: "batch, heads, seq_q and seq_k",
        });
    }
    if d == 0 || d % 16 != 0 || d > MAX_HEAD_DIM {
        return Err(FusedError::UnsupportedHeadDim(d));
    }
    check_dtypes::<B>(
        OP,
        q.dtype(),
        &q.device(),
        &[("k", k.dtype()), ("v", v.dtype())],
    )?;
    let (out, lse) = B::fused_flash_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        key_padding_mask.map(Tensor::into_primitive),
        causal,
    );
    Ok((float(out), float(lse)))
}

/// Fused `gelu(x·W + b)` (exact GELU); `x` `[tokens, d_in]`, `w` `[d_in, d_out]`, `b`
/// `[d_out]`, all of one float type the device supports (f32 everywhere; f16 and bf16 where
/// the device computes in them, accumulating in f32 on backends with kernels). Under
/// `Autodiff` the backward gives gradients to all three inputs; it recomputes `x·W + b`
/// instead of keeping it from the forward (see [`crate::memory::linear_gelu_saved_bytes`]).
///
/// # Errors
///
/// [`FusedError`] when the shapes disagree, a dimension is zero, or the inputs' float types
/// differ or the device cannot compute in theirs; all checked before anything is launched.
pub fn linear_gelu<B: FusedOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    b: Tensor<B, 1>,
) -> Result<Tensor<B, 2>, FusedError> {
    const OP: &str = "linear_gelu";
    let [n, din] = x.dims();
    let [wi, dout] = w.dims();
    if wi != din {
        return Err(mismatch(
            OP,
            "w [d_in, d_out] vs x [tokens, d_in]",
            &w.dims(),
            &[din, dout],
        ));
    }
    if b.dims() != [dout] {
        return Err(mismatch(OP, "b [d_out]", &b.dims(), &[dout]));
    }
    if n * din * dout == 0 {
        return Err(FusedError::Empty {
            op: OP,
            what: "tokens, d_in and d_out",
        });
    }
    check_dtypes::<B>(
        OP,
        x.dtype(),
        &x.device(),
        &[("w", w.dtype()), ("b", b.dtype())],
    )?;
    Ok(float(B::fused_linear_gelu(
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
        b.into_primitive().tensor(),
    )))
}

/// Fused language-model head loss: mean cross-entropy of `softmax(h·W)` against `targets`,
/// skipping tokens whose target is `ignore_index`; never materialises the `[tokens × vocab]`
/// logits on backends with kernels. `h` is `[tokens, hidden]`, `w` `[hidden, vocab]` and
/// `targets` `[tokens]`. Returns a one-element tensor (0 when every token is ignored). Under
/// `Autodiff` the backward gives gradients to `h` and `w`.
///
/// The target values must be class ids in `0..vocab` or `ignore_index`; they are not checked,
/// as that would read them back from the device.
///
/// # Errors
///
/// [`FusedError`] when the shapes disagree, a dimension is zero, or `h` and `w` differ in
/// float type or the device cannot compute in theirs; all checked before anything is
/// launched.
pub fn linear_cross_entropy<B: FusedOps>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore_index: i64,
) -> Result<Tensor<B, 1>, FusedError> {
    const OP: &str = "linear_cross_entropy";
    let [n, hidden] = h.dims();
    let [wh, vocab] = w.dims();
    if wh != hidden {
        return Err(mismatch(
            OP,
            "w [hidden, vocab] vs h [tokens, hidden]",
            &w.dims(),
            &[hidden, vocab],
        ));
    }
    if targets.dims() != [n] {
        return Err(mismatch(OP, "targets [tokens]", &targets.dims(), &[n]));
    }
    if n * hidden * vocab == 0 {
        return Err(FusedError::Empty {
            op: OP,
            what: "tokens, hidden and vocab",
        });
    }
    check_dtypes::<B>(OP, h.dtype(), &h.device(), &[("w", w.dtype())])?;
    let (loss, _lse) = B::fused_linear_cross_entropy(
        h.into_primitive().tensor(),
        w.into_primitive().tensor(),
        targets.into_primitive(),
        ignore_index,
    );
    Ok(float(loss))
}
