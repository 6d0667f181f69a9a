//! Internals that the crate's integration tests drive from outside (feature `fault-injection`,
//! for tests only; hidden from the documentation and not part of the crate's API): the
//! start-up exchanges of an NCCL group, which `tests/process_ranks.rs` runs on CPU ranks that
//! are MPI processes, as `NcclComm::over_host` runs them on GPU processes.

pub use super::nccl_host::{agree_by_all_gather, setup_group, GroupSetup, NCCL_ID_BYTES};
