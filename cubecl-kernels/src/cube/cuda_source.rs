//! The CUDA C++ of this crate's kernels for a given CUDA GPU, generated and compiled on a
//! machine without one (feature `cuda`).
//!
//! On a GPU, CubeCL turns each kernel into CUDA C++ and compiles it with NVRTC at its first
//! launch; a kernel that does not compile (a fragment type the code generator mishandles, a
//! header that is missing) fails only there. GPU time is scarce, so this module does the
//! same two steps ahead of time: [`cuda_sources`] generates every kernel variant the
//! launchers would pick on a [`CudaTarget`] — the tile kernels with their tensor-core
//! fragments where [`AttentionKernel::Auto`](super::AttentionKernel::Auto) uses them, the
//! portable ones, the MLP epilogue and the cross-entropy kernels — with the same plans and
//! the same CubeCL code generator as the CUDA runtime, and [`compile_with_nvrtc`] compiles
//! one to PTX for the target's architecture with the same options CubeCL passes.
//!
//! Defining a kernel needs a CubeCL client (the kernel builder reads its properties), so the
//! functions take one of any runtime; everything that depends on the GPU (plane width,
//! shared memory, tensor-core fragments, code generation options) comes from the target.

use std::ffi::{CStr, CString};
use std::path::Path;

use burn::tensor::DType;
use cubecl::cuda::CudaCompiler;
use cubecl::features::MmaConfig;
use cubecl::prelude::*;
use cubecl::CubeTask;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures, DialectWmmaCompiler};

use super::attention::{block_k, has_tile_fragments, plan_tiles, TileKernel, BLOCK_Q};
use super::cross_entropy::{
    ce_chunk_grad_kernel, ce_chunk_stats_kernel, ce_finish_kernel, ce_valid_kernel,
};
use super::flash_bwd::{flash_dkdv_kernel, flash_dq_kernel};
use super::flash_bwd_tiles::{
    dkdv_shared_bytes, dq_shared_bytes, flash_dkdv_tiles_kernel, flash_dq_tiles_kernel,
};
use super::flash_fwd::flash_fwd_kernel;
use super::flash_fwd_tiles::{flash_fwd_tiles_kernel, shared_bytes};
use super::linear_ce::{FINISH_THREADS, GRAD_ROW_THREADS, GRAD_TILE, STATS_THREADS};
use super::linear_gelu::{ROW_THREADS, TILE};
use super::mlp::{bias_gelu_dz_kernel, bias_gelu_fwd_kernel};
use super::AttentionKernel;

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
    pub const WARP: usize = 32;

    /// The tensor-core fragments CubeCL's CUDA runtime registers for this architecture.
    pub fn fragments(&self) -> Vec<MmaConfig> {
        CudaWmmaCompiler::supported_wmma_combinations(&CudaArchitecture { version: self.arch })
    }

    /// Whether [`AttentionKernel::Auto`] runs the tensor-core tile kernels on this GPU for
    /// `dtype` and `head_dim` (all three of forward, dQ and dK/dV).
    pub fn attention_uses_tensor_cores(&self, dtype: DType, head_dim: usize) -> bool {
        [TileKernel::Forward, TileKernel::Dq, TileKernel::DkDv]
            .into_iter()
            .all(|kernel| {
                matches!(
                    self.plan(AttentionKernel::Auto, kernel, dtype, head_dim),
                    Some((_, _, true))
                )
            })
    }

    fn plan(
        &self,
        choice: AttentionKernel,
        kernel: TileKernel,
        dtype: DType,
        head_dim: usize,
    ) -> Option<(usize, usize, bool)> {
        let fragments = self.fragments();
        plan_tiles(
            choice,
            has_tile_fragments(fragments.iter(), dtype),
            Self::WARP,
            self.max_shared_bytes,
            kernel,
            dtype,
            head_dim,
        )
    }

    /// The code generation options CubeCL's CUDA runtime sets for this architecture.
    fn options(&self) -> CompilationOptions {
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

    /// NVRTC's architecture option, as CubeCL's CUDA runtime writes it (`sm_90a` on Hopper).
    fn gpu_architecture(&self) -> String {
        let suffix = if self.arch >= 90 { "a" } else { "" };
        format!("--gpu-architecture=sm_{}{suffix}", self.arch)
    }
}

/// One kernel variant's CUDA C++.
#[derive(Debug, Clone)]
pub struct CudaKernelSource {
    /// The kernel's entry point, with the variant in parentheses.
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
    /// NVRTC rejected the source.
    #[error("NVRTC could not compile {kernel}:\n{log}")]
    Compile {
        /// The kernel variant.
        kernel: String,
        /// NVRTC's log.
        log: String,
    },
}

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

/// Compiles `kernel` to PTX for `target` with NVRTC, with the options CubeCL's CUDA runtime
/// passes (architecture, include folder, line info). `include_dir` is the folder holding
/// `cuda_runtime.h` and `mma.h` (a CUDA toolkit's `include/`). Returns the PTX.
pub fn compile_with_nvrtc(
    kernel: &CudaKernelSource,
    target: &CudaTarget,
    include_dir: &Path,
) -> Result<String, CudaSourceError> {
    if !["cuda_runtime.h", "mma.h"]
        .iter()
        .all(|h| include_dir.join(h).is_file())
    {
        return Err(CudaSourceError::HeadersMissing {
            dir: include_dir.display().to_string(),
        });
    }
    // SAFETY: only tries to load the shared library and reports whether it was found.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaSourceError::NvrtcMissing);
    }
    let fail = |log: String| CudaSourceError::Compile {
        kernel: kernel.name.clone(),
        log,
    };
    let source = CString::new(kernel.source.as_str()).map_err(|e| fail(e.to_string()))?;
    let arch = target.gpu_architecture();
    let include = format!("--include-path={}", include_dir.display());
    let options = [arch.as_str(), include.as_str(), "-lineinfo"];
    // SAFETY: NVRTC's C API on a program created here and destroyed before returning; the
    // source and option strings outlive the calls that read them.
    unsafe {
        use cudarc::nvrtc::result;
        let program =
            result::create_program(source.as_c_str(), None).map_err(|e| fail(format!("{e:?}")))?;
        let compiled = result::compile_program(program, &options);
        let outcome = match compiled {
            Ok(()) => result::get_ptx(program)
                .map_err(|e| fail(format!("{e:?}")))
                .map(|ptx| CStr::from_ptr(ptx.as_ptr()).to_string_lossy().into_owned()),
            Err(_) => Err(fail(match result::get_program_log(program) {
                Ok(log) => CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned(),
                Err(e) => format!("{e:?} (and no log)"),
            })),
        };
        let _ = result::destroy_program(program);
        outcome
    }
}

/// One attention variant's static choices.
#[derive(Debug, Clone, Copy)]
struct Attention {
    dtype: DType,
    head_dim: usize,
    causal: bool,
    has_mask: bool,
}

impl Attention {
    fn label(&self, kernel: TileKernel, tiles: &str) -> String {
        format!(
            "{kernel:?} {tiles} ({:?}, head_dim {}, causal {}, mask {})",
            self.dtype, self.head_dim, self.causal, self.has_mask
        )
    }
}

struct Generator<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    target: &'a CudaTarget,
}

/// The compilation argument of a tensor that is not written in place.
fn t() -> TensorCompilationArg {
    TensorCompilationArg { inplace: None }
}

impl<R: Runtime> Generator<'_, R> {
    fn settings(cube_dim: CubeDim) -> KernelSettings {
        KernelSettings::default().cube_dim(cube_dim)
    }

    fn compile<K: CubeKernel>(
        &self,
        name: String,
        kernel: K,
        planned_shared_bytes: Option<usize>,
        tensor_cores: bool,
    ) -> Result<CudaKernelSource, CudaSourceError> {
        let task = KernelTask::<CudaCompiler, K>::new(kernel);
        let address = u32::as_type_native_unchecked().storage_type();
        // A panic inside the code generator is a generation failure of this kernel, not of
        // the caller.
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            task.compile(
                &mut Default::default(),
                &self.target.options(),
                ExecutionMode::Checked,
                address,
            )
        }));
        let generate = |reason: String| CudaSourceError::Generate {
            kernel: name.clone(),
            reason,
        };
        let compiled = match compiled {
            Ok(Ok(compiled)) => compiled,
            Ok(Err(e)) => return Err(generate(e.to_string())),
            Err(panic) => return Err(generate(panic_message(panic))),
        };
        let shared_bytes = compiled
            .repr
            .as_ref()
            .map(|repr| repr.shared_memory_size())
            .unwrap_or(0);
        Ok(CudaKernelSource {
            name,
            source: compiled.source,
            shared_bytes,
            planned_shared_bytes,
            tensor_cores,
        })
    }

    fn tiles(
        &self,
        kernel: TileKernel,
        a: Attention,
        (planes, plane_dim, use_cmma): (usize, usize, bool),
    ) -> Result<CudaKernelSource, CudaSourceError> {
        let d = a.head_dim;
        let elem = a.dtype.size();
        let dim = CubeDim::new_2d(plane_dim as u32, planes as u32);
        let settings = Self::settings(dim);
        let client = self.client.clone();
        let dtype: StorageType = a.dtype.into();
        let name = a.label(kernel, &format!("tiles, {planes} planes, cmma {use_cmma}"));
        let (c, m) = (a.causal, a.has_mask);
        match kernel {
            TileKernel::Forward => self.compile(
                name,
                flash_fwd_tiles_kernel::FlashFwdTilesKernel::<R>::new(
                    settings,
                    client,
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    d,
                    planes,
                    plane_dim,
                    c,
                    m,
                    use_cmma,
                    dtype,
                ),
                Some(shared_bytes(planes, d, elem)),
                use_cmma,
            ),
            TileKernel::Dq => self.compile(
                name,
                flash_dq_tiles_kernel::FlashDqTilesKernel::<R>::new(
                    settings,
                    client,
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    d,
                    planes,
                    plane_dim,
                    c,
                    m,
                    use_cmma,
                    dtype,
                ),
                Some(dq_shared_bytes(planes, d, elem)),
                use_cmma,
            ),
            TileKernel::DkDv => self.compile(
                name,
                flash_dkdv_tiles_kernel::FlashDkdvTilesKernel::<R>::new(
                    settings,
                    client,
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    d,
                    planes,
                    plane_dim,
                    c,
                    m,
                    use_cmma,
                    dtype,
                ),
                Some(dkdv_shared_bytes(planes, d, elem)),
                use_cmma,
            ),
        }
    }

    fn scalar(
        &self,
        kernel: TileKernel,
        a: Attention,
    ) -> Result<CudaKernelSource, CudaSourceError> {
        let d = a.head_dim;
        let settings = Self::settings(CubeDim::new_1d(BLOCK_Q as u32));
        let client = self.client.clone();
        let dtype: StorageType = a.dtype.into();
        let name = a.label(kernel, "scalar");
        let (c, m, bk) = (a.causal, a.has_mask, block_k(d));
        match kernel {
            TileKernel::Forward => self.compile(
                name,
                flash_fwd_kernel::FlashFwdKernel::<R>::new(
                    settings,
                    client,
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    d,
                    BLOCK_Q,
                    bk,
                    c,
                    m,
                    dtype,
                ),
                None,
                false,
            ),
            TileKernel::Dq => self.compile(
                name,
                flash_dq_kernel::FlashDqKernel::<R>::new(
                    settings,
                    client,
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    d,
                    BLOCK_Q,
                    bk,
                    c,
                    m,
                    dtype,
                ),
                None,
                false,
            ),
            TileKernel::DkDv => self.compile(
                name,
                flash_dkdv_kernel::FlashDkdvKernel::<R>::new(
                    settings,
                    client,
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    d,
                    BLOCK_Q,
                    bk,
                    c,
                    m,
                    dtype,
                ),
                None,
                false,
            ),
        }
    }

    /// The MLP epilogue (bias + GELU forward and its backward) and the four cross-entropy
    /// kernels, with their launchers' block shapes.
    fn epilogues(&self, dtype: DType) -> Result<Vec<CudaKernelSource>, CudaSourceError> {
        let client = || self.client.clone();
        let ty: StorageType = dtype.into();
        let label = |kernel: &str| format!("{kernel} ({dtype:?})");
        let gelu_dim = CubeDim::new_2d(TILE as u32, ROW_THREADS as u32);
        let finish_dim = CubeDim::new_1d(FINISH_THREADS as u32);
        Ok(vec![
            self.compile(
                label("bias_gelu_fwd"),
                bias_gelu_fwd_kernel::BiasGeluFwdKernel::<R>::new(
                    Self::settings(gelu_dim),
                    client(),
                    t(),
                    t(),
                    (),
                    (),
                    TILE,
                    ROW_THREADS,
                    ty,
                ),
                None,
                false,
            )?,
            self.compile(
                label("bias_gelu_dz"),
                bias_gelu_dz_kernel::BiasGeluDzKernel::<R>::new(
                    Self::settings(gelu_dim),
                    client(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    TILE,
                    ROW_THREADS,
                    ty,
                ),
                None,
                false,
            )?,
            self.compile(
                label("ce_chunk_stats"),
                ce_chunk_stats_kernel::CeChunkStatsKernel::<R>::new(
                    Self::settings(CubeDim::new_1d(STATS_THREADS as u32)),
                    client(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    STATS_THREADS,
                    ty,
                ),
                None,
                false,
            )?,
            self.compile(
                label("ce_finish"),
                ce_finish_kernel::CeFinishKernel::<R>::new(
                    Self::settings(finish_dim),
                    client(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                ),
                None,
                false,
            )?,
            self.compile(
                label("ce_valid"),
                ce_valid_kernel::CeValidKernel::<R>::new(
                    Self::settings(finish_dim),
                    client(),
                    t(),
                    t(),
                    (),
                    (),
                ),
                None,
                false,
            )?,
            self.compile(
                label("ce_chunk_grad"),
                ce_chunk_grad_kernel::CeChunkGradKernel::<R>::new(
                    Self::settings(CubeDim::new_2d(GRAD_TILE as u32, GRAD_ROW_THREADS as u32)),
                    client(),
                    t(),
                    t(),
                    t(),
                    t(),
                    (),
                    (),
                    (),
                    (),
                    GRAD_TILE,
                    GRAD_ROW_THREADS,
                    ty,
                ),
                None,
                false,
            )?,
        ])
    }
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the code generator panicked".into())
}
