//! [`DataSource`]: where a run's micro-batches come from.

use std::fmt;

use burn::tensor::backend::Backend;

use crate::model::MicroBatch;

/// What a data source reports when it cannot produce a micro-batch (a file that cannot be
/// read, a corrupt sample, …): any error, boxed.
pub type DataSourceError = Box<dyn std::error::Error + Send + Sync>;

/// Where the micro-batches of a run come from.
///
/// The engine asks each rank that holds the first or the last stage for micro-batch
/// `microbatch` (`0..microbatches`) of data-parallel replica `dp_index` (`0..dp`) at optimizer
/// step `step` (1-based). It must be a pure function of its arguments: every rank of a
/// replica that asks gets the same micro-batch (the first stage reads its inputs, the last
/// its targets), and any layout of the same global batch sees the same samples. Every
/// micro-batch must have the shape of the first one.
///
/// An error stops every rank of the run, naming the step, the rank and the micro-batch; a
/// checkpoint already written stays intact.
///
/// Closures `Fn(step, dp_index, microbatch) -> Result<MicroBatch<B>, E>` are data sources
/// (with `E` any error, or a `String`); [`infallible`] wraps one that cannot fail.
pub trait DataSource<B: Backend>: Sync {
    /// Micro-batch `microbatch` of replica `dp_index` at optimizer step `step` (1-based).
    fn micro_batch(
        &self,
        step: usize,
        dp_index: usize,
        microbatch: usize,
    ) -> Result<MicroBatch<B>, DataSourceError>;
}

impl<B, F, E> DataSource<B> for F
where
    B: Backend,
    F: Fn(usize, usize, usize) -> Result<MicroBatch<B>, E> + Sync,
    E: Into<DataSourceError>,
{
    fn micro_batch(
        &self,
        step: usize,
        dp_index: usize,
        microbatch: usize,
    ) -> Result<MicroBatch<B>, DataSourceError> {
        self(step, dp_index, microbatch).map_err(Into::into)
    }
}

/// A data source from a closure that cannot fail ([`infallible`]).
pub struct Infallible<F>(F);

impl<F> fmt::Debug for Infallible<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Infallible(..)")
    }
}

impl<B, F> DataSource<B> for Infallible<F>
where
    B: Backend,
    F: Fn(usize, usize, usize) -> MicroBatch<B> + Sync,
{
    fn micro_batch(
        &self,
        step: usize,
        dp_index: usize,
        microbatch: usize,
    ) -> Result<MicroBatch<B>, DataSourceError> {
        Ok((self.0)(step, dp_index, microbatch))
    }
}

/// A data source from a closure `Fn(step, dp_index, microbatch) -> MicroBatch<B>` that
/// cannot fail (synthetic data, an in-memory dataset).
pub fn infallible<B, F>(f: F) -> Infallible<F>
where
    B: Backend,
    F: Fn(usize, usize, usize) -> MicroBatch<B> + Sync,
{
    Infallible(f)
}
