//! Breadth-first pipeline parallelism for Burn.
//!
//! The crate is built as a pipeline of its own: the [`schedule`] IR describes what every rank
//! does, pure lowering passes add communication, the validator proves the result runs, and the
//! simulator and the executor consume the same lowered per-rank action lists.
#![warn(missing_docs)]
// Tests read values freely; the library's own reads go through `host_read` (clippy.toml).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod engine;
pub mod host_read;
pub mod model;
pub mod optim;
pub mod plan;
pub mod schedule;
pub mod sim;
pub mod viz;
