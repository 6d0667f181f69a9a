//! [`MpiComm`]: one rank per process over MPI (feature `mpi`, OpenMPI's `mpirun`/`srun`), a
//! [`ProcessComm`] whose messages travel as MPI messages.
//!
//! Nothing blocks inside MPI: sends are non-blocking (their buffers stay alive until MPI
//! reports them complete), and arrivals are found with a non-blocking matched probe. MPI's
//! error handler on the world is set to return errors, so an MPI failure does not kill the
//! process before it can report.

use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::raw::AsRaw;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};

use burn::tensor::backend::Backend;

use super::process::{Incoming, ProcessComm, Transport};
use super::{CommConfig, CommError, RankGrid};

/// The one MPI tag all messages use: streams are told apart by the message header.
const MPI_TAG: i32 = 17;

/// A rank of a world whose ranks are MPI processes (feature `mpi`): a [`ProcessComm`] over
/// [`MpiTransport`].
///
/// Created once per process by [`MpiComm::init`], which initialises MPI; dropping it waits
/// briefly for outstanding sends and finalises MPI.
pub type MpiComm<B> = ProcessComm<B, MpiTransport>;

/// A non-blocking send in flight and the buffer MPI reads from.
struct PendingSend {
    request: Request<'static, [u8], StaticScope>,
    /// Leaked by [`MpiTransport::post`] so the request may outlive any borrow; freed once
    /// the request completes.
    buf: *mut [u8],
}

/// Messages as MPI messages on the world communicator.
pub struct MpiTransport {
    world: SimpleCommunicator,
    pending: Vec<PendingSend>,
    /// Dropped last: finalises MPI after the requests are settled.
    _universe: Universe,
}

/// The world size and rank of an MPI launch, from the launcher's environment, without
/// initialising MPI: `Some((rank, size))` under OpenMPI's `mpirun` or a PMI/PMIx launcher
/// (`srun --mpi=pmix`).
pub fn mpi_launch_env() -> Option<(usize, usize)> {
    let pairs = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ];
    pairs.iter().find_map(|(r, s)| {
        let rank = std::env::var(r).ok()?.parse().ok()?;
        let size = std::env::var(s).ok()?.parse().ok()?;
        Some((rank, size))
    })
}

impl<B: Backend> ProcessComm<B, MpiTransport> {
    /// Initialises MPI and joins the world as one rank of `grid`, computing on `device`.
    ///
    /// Fails if MPI was already initialised in this process or if the world started by the
    /// launcher does not have `grid.world_size()` processes.
    pub fn init(grid: RankGrid, device: B::Device, config: CommConfig) -> Result<Self, CommError> {
        let invalid = |reason: String| CommError::InvalidGrid {
            pp: grid.pp(),
            dp: grid.dp(),
            reason,
        };
        let universe = mpi::initialize()
            .ok_or_else(|| invalid("MPI is already initialised in this process".into()))?;
        let world = universe.world();
        // SAFETY: the world communicator is valid between initialisation and finalisation,
        // and both handles are MPI's own constants.
        unsafe {
            mpi::ffi::MPI_Comm_set_errhandler(world.as_raw(), mpi::ffi::RSMPI_ERRORS_RETURN);
        }
        let size = usize::try_from(world.size()).unwrap_or(0);
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        if size != grid.world_size() {
            return Err(invalid(format!(
                "MPI started {size} processes but pp {} × dp {} needs {}; run \
                 `mpirun -np {}` or change --pp/--dp",
                grid.pp(),
                grid.dp(),
                grid.world_size(),
                grid.world_size()
            )));
        }
        let transport = MpiTransport {
            world,
            pending: Vec::new(),
            _universe: universe,
        };
        Ok(ProcessComm::new(grid, rank, device, config, transport))
    }
}

impl MpiTransport {
    /// Frees the buffers of completed sends.
    fn reap(&mut self) {
        for p in std::mem::take(&mut self.pending) {
            match p.request.test() {
                Ok(_) => {
                    // SAFETY: MPI is done with the buffer, leaked in `post` and freed once.
                    drop(unsafe { Box::from_raw(p.buf) });
                }
                Err(request) => self.pending.push(PendingSend {
                    request,
                    buf: p.buf,
                }),
            }
        }
    }
}

impl Transport for MpiTransport {
    fn post(&mut self, peer: usize, bytes: Vec<u8>) {
        let buf: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let raw: *mut [u8] = buf;
        // SAFETY: `raw` points to a leaked allocation that is only freed in `reap` after MPI
        // has reported the request complete, and is never written meanwhile.
        let shared: &'static [u8] = unsafe { &*raw };
        let dest = i32::try_from(peer).unwrap_or(i32::MAX);
        let request =
            self.world
                .process_at_rank(dest)
                .immediate_send_with_tag(StaticScope, shared, MPI_TAG);
        self.pending.push(PendingSend { request, buf: raw });
    }

    fn poll(&mut self) -> Option<Incoming> {
        self.reap();
        let found = self
            .world
            .any_process()
            .immediate_matched_probe_with_tag(MPI_TAG)?;
        let (bytes, status) = found.matched_receive_vec::<u8>();
        let from = usize::try_from(status.source_rank()).unwrap_or(usize::MAX);
        Some(Incoming::Message { from, bytes })
    }

    fn sends_in_flight(&mut self) -> bool {
        self.reap();
        !self.pending.is_empty()
    }

    fn abandon(&mut self) {
        // Dropping a request in flight aborts the process, and MPI may still read the
        // buffer: leak both rather than abort.
        for p in std::mem::take(&mut self.pending) {
            std::mem::forget(p.request);
        }
    }
}
