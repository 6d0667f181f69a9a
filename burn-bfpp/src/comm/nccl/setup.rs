//! Creating [`NcclComm`]s: the start-up checks for the CUDA and NCCL libraries, one
//! communicator per group of threads ([`NcclComm::create`]), and a process's members joined
//! through its host communicator ([`NcclComm::over_host`]).

use std::cell::RefCell;
use std::marker::PhantomData;

use burn::backend::cuda::CudaDevice;
use burn_cubecl::{BoolElement, FloatElement, IntElement};

use super::super::nccl_group::{nccl_unique_id, NcclMember};
use super::super::nccl_host::{setup_group, NcclHost};
use super::super::{ByteCounter, CommConfig, CommError, Communicator, Group, LocalComm, RankGrid};
use super::{CudaBackend, NcclComm};

/// What to look at when NCCL cannot create a communicator.
const CHECK_NCCL: &str = "check that NCCL and the GPUs work (nvidia-smi, NCCL_DEBUG=INFO)";

/// `Ok` when a shared library was found, else [`CommError::Unavailable`] naming it and the fix.
fn loadable(present: bool, what: &str, fix: &str) -> Result<(), CommError> {
    if present {
        return Ok(());
    }
    Err(CommError::Unavailable {
        what: what.into(),
        fix: fix.into(),
    })
}

/// Whether the CUDA driver library can be loaded: without it Burn's CUDA backend panics
/// inside its device thread at the first tensor, so programs check this first and report the
/// fix instead.
pub fn cuda_driver_available() -> Result<(), CommError> {
    loadable(
        // SAFETY: only tries to load the shared library and reports whether it was found.
        unsafe { cudarc::driver::sys::is_culib_present() },
        "the CUDA driver (libcuda.so.1)",
        "run on a machine with an NVIDIA GPU and its driver installed (nvidia-smi must work), \
         with libcuda.so.1 on the loader's path",
    )
}

/// Whether the NCCL library can be loaded; a missing one is a start-up error naming the fix
/// rather than a panic inside the first collective.
pub fn nccl_available() -> Result<(), CommError> {
    loadable(
        // SAFETY: only tries to load the shared library and reports whether it was found.
        unsafe { cudarc::nccl::sys::is_culib_present() },
        "NCCL",
        "install NCCL (libnccl.so.2) and make `libnccl.so` loadable: e.g. \
         `ln -s …/nvidia/nccl/lib/libnccl.so.2 libnccl.so` in a directory on LD_LIBRARY_PATH \
         (PyTorch's wheel ships it)",
    )
}

/// Creates one communicator for each group of `group` whose members' devices are distinct,
/// and returns every world rank's member (`None` for ranks of a group sharing a GPU).
fn members_of(
    grid: RankGrid,
    ordinals: &[i32],
    group: Group,
) -> Result<Vec<Option<NcclMember>>, CommError> {
    super::super::group_wiring(grid, ordinals, group, |devices| {
        NcclMember::init_all(devices)
    })
    .map_err(|(members, reason)| CommError::Unavailable {
        what: format!("an NCCL communicator for the {group} of ranks {members:?}"),
        fix: format!("{reason}; {CHECK_NCCL}"),
    })
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> NcclComm<F, I, BT> {
    /// One communicator per world rank (index = world rank); rank `r` computes on
    /// `devices[r]`. Fails if NCCL cannot be loaded, if `devices` does not hold one device
    /// per rank, if two members of a data-parallel group share a GPU, or if NCCL cannot
    /// create a group's communicator.
    pub fn create(
        grid: RankGrid,
        devices: Vec<CudaDevice>,
        config: CommConfig,
    ) -> Result<Vec<Self>, CommError> {
        let ids: Vec<_> = devices.iter().map(|d| d.index).collect();
        super::super::check_distinct_devices(grid, &ids)?;
        nccl_available()?;
        let ordinals: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let dp = members_of(grid, &ordinals, Group::DataParallel)?;
        let pp = members_of(grid, &ordinals, Group::Pipeline)?;
        let mut locals = LocalComm::create_with_devices(grid, devices, config)?;
        for local in &mut locals {
            // Pipeline transfers between GPUs: handed over, then peer-copied by the receiver.
            local.hand_over_across_devices();
        }
        locals
            .into_iter()
            .zip(dp.into_iter().zip(pp))
            .map(|(local, (dp, pp))| {
                let dp = dp.ok_or_else(|| CommError::InvalidGrid {
                    pp: grid.pp(),
                    dp: grid.dp(),
                    reason: format!("rank {} has no data-parallel communicator", local.rank()),
                })?;
                Ok(NcclComm {
                    host: local,
                    dp: RefCell::new(dp),
                    pp: pp.map(RefCell::new),
                    launched: RefCell::default(),
                    sends: RefCell::default(),
                    transfers: RefCell::default(),
                    sent: ByteCounter::default(),
                    debug_calls: super::debug_collectives(),
                    timeout: config.timeout,
                    _elements: PhantomData,
                })
            })
            .collect()
    }

    /// The host-memory communicator of the same world (pipeline transfers, barriers).
    pub fn local(&self) -> &LocalComm<CudaBackend<F, I, BT>> {
        &self.host
    }
}

impl<F, I, BT, H> NcclComm<F, I, BT, H>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    H: NcclHost<CudaBackend<F, I, BT>>,
{
    /// This rank's NCCL communicator over `host`, for ranks that are processes (one per GPU,
    /// `host` an `MpiComm` on the rank's CUDA device): every rank of the world calls it. The
    /// members of each group exchange their GPUs through `host`; a group on distinct GPUs gets
    /// an NCCL communicator, whose unique id its group rank 0 creates and sends to the others
    /// through `host`. Fails if NCCL cannot be loaded, if two members of the data-parallel
    /// group (or of the pipeline group: processes move their transfers over NCCL too) share a
    /// GPU, or if NCCL cannot create a communicator. Blocks until every member of each group
    /// has joined.
    pub fn over_host(host: H) -> Result<Self, CommError> {
        nccl_available().map_err(|e| host.fail(e))?;
        let ordinal = host.device().index as i32;
        let dp = setup_group(&host, Group::DataParallel, ordinal, nccl_unique_id)?;
        let Some(dp_id) = dp.unique_id else {
            return Err(host.fail(CommError::InvalidGrid {
                pp: host.grid().pp(),
                dp: host.grid().dp(),
                reason: format!(
                    "rank {}'s data-parallel group is on GPUs {:?}: NCCL needs each \
                     data-parallel group on distinct GPUs (one process per GPU)",
                    host.rank(),
                    dp.ordinals
                ),
            }));
        };
        let dp = Self::join(&host, Group::DataParallel, dp_id, ordinal)?;
        let pipeline = setup_group(&host, Group::Pipeline, ordinal, nccl_unique_id)?;
        if pipeline.unique_id.is_none() {
            // Its transfers would have to take the host path: not a data transport here.
            return Err(host.fail(CommError::InvalidGrid {
                pp: host.grid().pp(),
                dp: host.grid().dp(),
                reason: format!(
                    "rank {}'s pipeline group is on GPUs {:?}: ranks that are processes need \
                     a GPU each (their transfers move over NCCL, which refuses two members on \
                     one GPU); run ranks that share a GPU as threads of one process",
                    host.rank(),
                    pipeline.ordinals
                ),
            }));
        }
        let pp = pipeline
            .unique_id
            .map(|id| Self::join(&host, Group::Pipeline, id, ordinal))
            .transpose()?;
        let timeout = host.config().timeout;
        Ok(NcclComm {
            host,
            dp: RefCell::new(dp),
            pp: pp.map(RefCell::new),
            launched: RefCell::default(),
            sends: RefCell::default(),
            transfers: RefCell::default(),
            sent: ByteCounter::default(),
            debug_calls: super::debug_collectives(),
            timeout,
            _elements: PhantomData,
        })
    }

    /// This process's member of `group`'s communicator named by `id`.
    fn join(host: &H, group: Group, id: [u8; 128], ordinal: i32) -> Result<NcclMember, CommError> {
        let (size, rank) = (host.group_size(group), host.group_rank(group));
        NcclMember::init_rank(id, size, rank, ordinal).map_err(|reason| {
            host.fail(CommError::Unavailable {
                what: format!("an NCCL communicator for rank {}'s {group}", host.rank()),
                fix: format!("{reason}; {CHECK_NCCL}"),
            })
        })
    }
}
