//! Pictures of pipeline runs: an SVG timeline, a Chrome trace (Perfetto) and an SVG chart of
//! memory over time, drawn the same way for measured, replayed and simulated steps.
//!
//! Every source is first converted into the neutral [`Trace`] ([`Trace::from_engine`],
//! [`Trace::from_replay`], [`Trace::from_sim`]); the renderers only read a `Trace`, so a
//! measured run and its simulation come out with the same lanes, colours and trace layout and
//! can be compared side by side.
//!
//! ```
//! use burn_bfpp::schedule::{lower_p2p, replay, unit_cost, ScheduleKind, ScheduleSpec, SendMode};
//! use burn_bfpp::viz::{chrome_trace_json, timeline_svg, Trace};
//!
//! let schedule = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 4).generate().unwrap();
//! let lowered = lower_p2p(&schedule).unwrap();
//! let outcome = replay(&lowered, SendMode::Eager, unit_cost).unwrap();
//! let trace = Trace::from_replay(&outcome.timeline).with_title("breadth-first P=2 V=2 M=4");
//! assert!(timeline_svg(&trace).starts_with("<svg"));
//! assert!(chrome_trace_json(&trace).contains("traceEvents"));
//! ```

mod chrome;
mod memory;
mod svg;
#[cfg(test)]
mod tests;
mod timeline;
mod trace;

use std::path::{Path, PathBuf};

pub use chrome::{chrome_trace_json, micros_per_unit};
pub use memory::memory_svg;
pub use svg::STAGE_PALETTE;
pub use timeline::{timeline_svg, timeline_svg_with, TimelineOptions, MERGE_PX};
pub use trace::{Lane, MemorySeries, Span, Stream, TimeUnit, Trace};

/// What can go wrong saving a picture.
#[derive(Debug, thiserror::Error)]
pub enum VizError {
    /// The file (or its folder) could not be written.
    #[error("cannot write `{}`: {source}", path.display())]
    Write {
        /// The file that was being written.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
}

/// Write `contents` to `path`, creating missing parent folders (output folders such as
/// `runs/<name>/` usually do not exist yet). The error names the path.
pub fn write_file(path: impl AsRef<Path>, contents: &str) -> Result<(), VizError> {
    let path = path.as_ref();
    let fail = |source| VizError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(fail)?;
    }
    std::fs::write(path, contents).map_err(fail)
}
