//! What can go wrong while loading data or cutting it into batches.

use std::path::PathBuf;

use thiserror::Error;

/// An error of the data pipeline. Every message names what was wrong and how to fix it.
#[derive(Debug, Error)]
pub enum DataError {
    /// `--data` names nothing.
    #[error(
        "data path {} does not exist; pass --data with a text file or a folder of text files, \
         or leave --data out to train on the built-in synthetic Markov corpus",
        path.display()
    )]
    NotFound {
        /// The path given.
        path: PathBuf,
    },

    /// A file or folder could not be read.
    #[error("cannot read {}: {source}; check that it exists and is readable", path.display())]
    Io {
        /// The file or folder being read.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// The path holds no data at all.
    #[error(
        "no data in {}: it is empty or holds no non-empty regular files (hidden files are \
         skipped); point --data at a non-empty text file or a folder containing some",
        path.display()
    )]
    Empty {
        /// The path given.
        path: PathBuf,
    },

    /// The corpus cannot fill even one sample.
    #[error(
        "corpus {source_name} has {tokens} tokens, but one sample of sequence length {seq_len} \
         needs seq_len + 1 = {} tokens (inputs plus the shifted targets); use a shorter \
         sequence length or more data",
        seq_len + 1
    )]
    TooShort {
        /// Where the corpus came from (a path or the synthetic source's description).
        source_name: String,
        /// Tokens in the corpus.
        tokens: usize,
        /// The requested sequence length.
        seq_len: usize,
    },

    /// A configuration value is out of range.
    #[error("invalid data configuration: {0}")]
    Config(String),

    /// A micro-batch request does not fit the parallel layout.
    #[error("invalid micro-batch request: {0}")]
    Layout(String),

    /// The stationary distribution of a Markov source did not converge.
    #[error(
        "the stationary distribution of the Markov source did not converge within {iterations} \
         iterations (last change {residual:e}); the chain is probably not irreducible — use \
         a positive smoothing"
    )]
    NotConverged {
        /// Iterations run.
        iterations: usize,
        /// L1 change of the distribution in the last iteration.
        residual: f64,
    },

    /// A saved data position does not match the data or batching of this run.
    #[error(
        "cannot resume the data stream: the checkpoint was written with {field} = {saved}, \
         this run has {current}; {hint}"
    )]
    Resume {
        /// The field that differs.
        field: &'static str,
        /// Its value in the checkpoint.
        saved: String,
        /// Its value in this run.
        current: String,
        /// How to fix it.
        hint: &'static str,
    },
}
