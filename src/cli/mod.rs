//! The commands of the `bfpp` binary, one module each, over the modules they share: `error`
//! (every command's error type) and `output` (where results go) at the bottom, then the
//! pieces of `train` (`args`, `config`, `backend`, `checkpoint`, `predict`, `report`,
//! `baseline`, `fault`). No module imports one that imports it back.

// Training, export and launch need Burn, so they exist only with the `flex` feature (on by
// default; `wgpu` and `cuda` imply it); the schedule tools need no backend.
#[cfg(feature = "flex")]
pub mod args;
#[cfg(feature = "flex")]
pub mod backend;
#[cfg(feature = "flex")]
pub mod baseline;
#[cfg(feature = "flex")]
pub mod checkpoint;
#[cfg(feature = "flex")]
pub mod config;
pub mod error;
#[cfg(feature = "flex")]
pub mod fault;
#[cfg(feature = "flex")]
pub mod launch;
pub mod output;
pub mod plan;
#[cfg(feature = "flex")]
pub mod predict;
#[cfg(feature = "flex")]
pub mod report;
pub mod schedule;
pub mod simulate;
#[cfg(feature = "flex")]
pub mod train;
