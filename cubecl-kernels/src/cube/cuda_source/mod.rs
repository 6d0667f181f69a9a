//! The CUDA C++ of this crate's kernels for a given CUDA GPU, generated and compiled on a
//! machine without one (feature `cuda`).
//!
//! On a GPU, CubeCL turns each kernel into CUDA C++ and compiles it with NVRTC at its first
//! launch; a kernel that does not compile (a fragment type the code generator mishandles, a
//! header that is missing) fails only there. GPU time is scarce, so this module does the
//! same two steps ahead of time: [`cuda_sources`] generates every kernel variant the
//! launchers would pick on a [`CudaTarget`] — the tile kernels with their tensor-core
//! fragments where [`AttentionKernel::Auto`] uses them, the portable ones, the MLP epilogue
//! and the cross-entropy kernels — with the same plans and the same CubeCL code generator as
//! the CUDA runtime; [`compile_with_nvrtc`] compiles one to PTX for the target's
//! architecture with the same options CubeCL passes, and [`assemble_with_nvjitlink`]
//! assembles that PTX with ptxas, as the driver does when it loads it, and reports the
//! registers and spills.
//!
//! Defining a kernel needs a CubeCL client (the kernel builder reads its properties), so the
//! functions take one of any runtime; everything that depends on the GPU (plane width,
//! shared memory, tensor-core fragments, code generation options) comes from the target.

mod generate;
mod target;
mod toolchain;

use burn::tensor::DType;
use cubecl::prelude::*;

use super::attention::TileKernel;
use super::AttentionKernel;
use generate::{Attention, Generator};

pub use target::{CudaKernelSource, CudaSourceError, CudaTarget};
pub use toolchain::{assemble_with_nvjitlink, compile_with_nvrtc, SassResources};

/// Every kernel variant this crate launches on `target` for inputs of `dtype` with attention
/// head dimension `head_dim`: for attention, the variants [`AttentionKernel::Auto`] picks
/// (tile kernels on tensor cores where they apply) and the portable scalar kernels, both
/// causal with a key-padding mask and plain; then the MLP epilogue and the cross-entropy
/// kernels. `client` only lends the kernel builder its runtime (see the module docs).
pub fn cuda_sources<R: Runtime>(
    client: &ComputeClient<R>,
    target: &CudaTarget,
    dtype: DType,
    head_dim: usize,
) -> Result<Vec<CudaKernelSource>, CudaSourceError> {
    let generator = Generator { client, target };
    let mut sources = Vec::new();
    for (causal, has_mask) in [(true, true), (false, false)] {
        let variant = Attention {
            dtype,
            head_dim,
            causal,
            has_mask,
        };
        for kernel in [TileKernel::Forward, TileKernel::Dq, TileKernel::DkDv] {
            if let Some(plan) = target.plan(AttentionKernel::Auto, kernel, dtype, head_dim) {
                sources.push(generator.tiles(kernel, variant, plan)?);
            }
            sources.push(generator.scalar(kernel, variant)?);
        }
    }
    sources.extend(generator.epilogues(dtype)?);
    Ok(sources)
}
