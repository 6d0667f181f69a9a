//! Fused CubeCL kernels for burn-bfpp: flash attention, fused matmul epilogues and fused
//! linear cross-entropy, exposed to Burn through backend-extension ops with autodiff.
//!
//! This crate is a skeleton until the kernels issue lands: it pins CubeCL (`=0.10.0`, the
//! version Burn 0.21 uses) and carries the `wgpu` and `cuda` features so the workspace's
//! feature matrix and CI already build it.
