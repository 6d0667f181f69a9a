//! FlashAttention-2 backward kernels (placeholder).
