//! Breadth-first pipeline parallelism for Burn.
//!
//! The crate is built as a pipeline of its own: the [`schedule`] IR describes what every rank
//! does, pure lowering passes add communication, the validator proves the result runs, and the
//! simulator and the executor consume the same lowered per-rank action lists.
//!
//! The default feature `flex` (through `engine`) adds the training engine and everything that
//! holds tensors; without default features the crate is the schedule core alone and compiles
//! no Burn or CubeCL crate.
#![warn(missing_docs)]
// Tests read values freely; the library's own reads go through `host_read` (clippy.toml).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

#[cfg(feature = "engine")]
pub mod checkpoint;
#[cfg(feature = "engine")]
pub mod comm;
pub mod data;
#[cfg(feature = "engine")]
pub mod engine;
#[cfg(feature = "engine")]
pub mod host_read;
#[cfg(feature = "engine")]
pub mod model;
#[cfg(feature = "engine")]
pub mod optim;
pub mod plan;
pub mod schedule;
pub mod sim;
pub mod viz;
