//! The types every part of the CUDA source generation shares: the GPU generated for
//! ([`CudaTarget`]), a kernel variant's source ([`CudaKernelSource`]) and the errors
//! ([`CudaSourceError`]).

use burn::tensor::DType;
use cubecl::features::MmaConfig;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures, DialectWmmaCompiler};

use super::super::attention::{
    all_tiles_on_tensor_cores, has_tile_fragments, plan_tiles, TileKernel, TilePlan,
};
use super::super::{attention_accumulators, attention_tiles, AttentionKernel};

/// A CUDA GPU to generate kernels for: the facts the launchers read off a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaTarget {
    /// Compute capability as `major * 10 + minor` (90 for Hopper).
    pub arch: u32,
    /// Shared memory a block may use after opting in, in bytes.
    pub max_shared_bytes: usize,
}

impl CudaTarget {
    /// NVIDIA H100/H200 (Hopper, sm_90): 227 KiB of shared memory per block after opt-in.
    pub const HOPPER: CudaTarget = CudaTarget {
        arch: 90,
        max_shared_bytes: 227 * 1024,
    };

    /// CUDA's warp width, the plane width of every CUDA GPU.
    const WARP: usize = 32;

    /// The tensor-core fragments CubeCL's CUDA runtime registers for this architecture.
    fn fragments(&self) -> Vec<MmaConfig> {
        CudaWmmaCompiler::supported_wmma_combinations(&CudaArchitecture { version: self.arch })
    }

    /// Whether [`AttentionKernel::Auto`] runs the tensor-core tile kernels on this GPU for
    /// `dtype` and `head_dim` (all three of forward, dQ and dK/dV).
    pub fn attention_uses_tensor_cores(&self, dtype: DType, head_dim: usize) -> bool {
        all_tiles_on_tensor_cores(|kernel| {
            self.plan(AttentionKernel::Auto, kernel, dtype, head_dim)
        })
    }

    /// The plan the launchers would make on this GPU under the process's current choices
    /// ([`super::set_attention_tiles`], [`super::set_attention_accumulators`]).
    pub(super) fn plan(
        &self,
        choice: AttentionKernel,
        kernel: TileKernel,
        dtype: DType,
        head_dim: usize,
    ) -> Option<TilePlan> {
        let fragments = self.fragments();
        plan_tiles(
            choice,
            attention_tiles(),
            attention_accumulators(),
            has_tile_fragments(fragments.iter(), dtype),
            true,
            Self::WARP,
            self.max_shared_bytes,
            kernel,
            dtype,
            head_dim,
        )
    }

    /// The code generation options CubeCL's CUDA runtime sets for this architecture.
    pub(super) fn options(&self) -> CompilationOptions {
        CompilationOptions {
            warp_size: Self::WARP as u32,
            supports_features: CppSupportedFeatures {
                fast_math: true,
                grid_constants: self.arch >= 70,
                fast_tanh: self.arch >= 75,
                clusters: self.arch >= 90,
                elect_sync: self.arch >= 90,
            },
        }
    }

    /// The architecture name NVRTC and ptxas take, as CubeCL's CUDA runtime writes it:
    /// `sm_90a` on Hopper (the `a` unlocks its architecture-specific instructions).
    pub(super) fn sm(&self) -> String {
        let suffix = if self.arch >= 90 { "a" } else { "" };
        format!("sm_{}{suffix}", self.arch)
    }
}

/// One kernel variant's CUDA C++.
#[derive(Debug, Clone)]
pub struct CudaKernelSource {
    /// A readable name: the kernel, its plan and, in parentheses, its static choices.
    pub name: String,
    /// The CUDA C++ CubeCL generated.
    pub source: String,
    /// Shared memory the kernel declares, in bytes.
    pub shared_bytes: usize,
    /// For the attention tile kernels, the shared memory their launcher budgets for the plan
    /// (the kernel must not declare more); `None` for the others.
    pub planned_shared_bytes: Option<usize>,
    /// Whether the variant multiplies with tensor-core fragments.
    pub tensor_cores: bool,
}

/// Why a kernel could not be generated or compiled.
#[derive(Debug, thiserror::Error)]
pub enum CudaSourceError {
    /// CubeCL's CUDA code generator rejected the kernel.
    #[error("generating CUDA C++ for {kernel}: {reason}")]
    Generate {
        /// The kernel variant.
        kernel: String,
        /// CubeCL's message.
        reason: String,
    },
    /// NVRTC could not be loaded.
    #[error(
        "NVRTC (libnvrtc.so.13) could not be loaded; install it (`scripts/nvrtc-wheels.sh DIR` \
         fetches CUDA 13.0's NVRTC and headers from PyPI) and put its lib folder on \
         LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    /// The CUDA headers the generated code includes are not in the include folder.
    #[error(
        "no CUDA headers in {dir} (cuda_runtime.h and mma.h are needed); point the include \
         folder at a CUDA toolkit's include/ or at the one `scripts/nvrtc-wheels.sh` fills"
    )]
    HeadersMissing {
        /// The folder given.
        dir: String,
    },
    /// nvJitLink (CUDA's library form of ptxas) could not be loaded.
    #[error(
        "nvJitLink (libnvJitLink.so.13) could not be loaded: {reason}; `scripts/nvrtc-wheels.sh \
         DIR` fetches it with NVRTC, put its lib folder on LD_LIBRARY_PATH"
    )]
    NvJitLinkMissing {
        /// The loader's message.
        reason: String,
    },
    /// ptxas (through nvJitLink) rejected the PTX.
    #[error("ptxas could not assemble {kernel} (nvJitLink error {code}):\n{log}")]
    Assemble {
        /// The kernel variant.
        kernel: String,
        /// nvJitLink's result code.
        code: i32,
        /// nvJitLink's error log.
        log: String,
    },
    /// NVRTC rejected the source.
    #[error("NVRTC could not compile {kernel}:\n{log}")]
    Compile {
        /// The kernel variant.
        kernel: String,
        /// NVRTC's log.
        log: String,
    },
}
