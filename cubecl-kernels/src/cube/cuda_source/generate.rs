//! Building each kernel variant with the arguments its launcher passes, and generating its
//! CUDA C++ with CubeCL's CUDA compiler.

use burn::tensor::DType;
use cubecl::cuda::CudaCompiler;
use cubecl::prelude::*;
use cubecl::CubeTask;

use super::super::attention::{block_k, tile_shared_bytes, TileKernel, TilePlan, BLOCK_Q};
use super::super::cross_entropy::{
    ce_chunk_grad_kernel, ce_chunk_stats_kernel, ce_finish_kernel, ce_valid_kernel,
};
use super::super::flash_bwd::{flash_dkdv_kernel, flash_dq_kernel};
use super::super::flash_bwd_tiles::{flash_dkdv_tiles_kernel, flash_dq_tiles_kernel};
use super::super::flash_fwd::flash_fwd_kernel;
use super::super::flash_fwd_tiles::flash_fwd_tiles_kernel;
use super::super::linear_ce::{FINISH_THREADS, GRAD_ROW_THREADS, GRAD_TILE, STATS_THREADS};
use super::super::linear_gelu::{ROW_THREADS, TILE};
use super::super::mlp::{bias_gelu_dz_kernel, bias_gelu_fwd_kernel};
use super::target::{CudaKernelSource, CudaSourceError, CudaTarget};

/// One attention variant's static choices.
#[derive(Debug, Clone, Copy)]
pub(super) struct Attention {
    pub(super) dtype: DType,
    pub(super) head_dim: usize,
    pub(super) causal: bool,
    pub(super) has_mask: bool,
}

impl Attention {
    fn label(&self, kernel: TileKernel, tiles: &str) -> String {
        format!(
            "{kernel:?} {tiles} ({:?}, head_dim {}, causal {}, mask {})",
            self.dtype, self.head_dim, self.causal, self.has_mask
        )
    }
}

pub(super) struct Generator<'a, R: Runtime> {
    pub(super) client: &'a ComputeClient<R>,
    pub(super) target: &'a CudaTarget,
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

    pub(super) fn tiles(
        &self,
        kernel: TileKernel,
        a: Attention,
        plan: TilePlan,
    ) -> Result<CudaKernelSource, CudaSourceError> {
        let d = a.head_dim;
        let TilePlan {
            planes,
            stream_frags,
            plane_dim,
            use_cmma,
            warp_sync,
            acc_in_regs,
        } = plan;
        let settings = Self::settings(plan.cube_dim());
        let client = self.client.clone();
        let dtype: StorageType = a.dtype.into();
        let name = a.label(
            kernel,
            &format!(
                "tiles, {planes} planes × {stream_frags} streamed, cmma {use_cmma}, warp sync \
                 {warp_sync}, accumulators in registers {acc_in_regs}"
            ),
        );
        let planned = Some(tile_shared_bytes(
            kernel,
            planes,
            stream_frags,
            d,
            a.dtype.size(),
            acc_in_regs,
        ));
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
                    stream_frags,
                    plane_dim,
                    c,
                    m,
                    use_cmma,
                    warp_sync,
                    acc_in_regs,
                    dtype,
                ),
                planned,
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
                    stream_frags,
                    plane_dim,
                    c,
                    m,
                    use_cmma,
                    warp_sync,
                    acc_in_regs,
                    dtype,
                ),
                planned,
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
                    stream_frags,
                    plane_dim,
                    c,
                    m,
                    use_cmma,
                    warp_sync,
                    acc_in_regs,
                    dtype,
                ),
                planned,
                use_cmma,
            ),
        }
    }

    pub(super) fn scalar(
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
    pub(super) fn epilogues(&self, dtype: DType) -> Result<Vec<CudaKernelSource>, CudaSourceError> {
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
