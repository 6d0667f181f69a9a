//! Training data: a byte-level tokenizer, corpora, and layout-independent batching.
//!
//! - [`ByteTokenizer`]: every byte is a token (vocabulary 256), so any file can be read.
//! - [`TextCorpus`]: `--data PATH`, a text file or a folder of them, read in a fixed order.
//! - [`MarkovCorpus`]: the built-in synthetic corpus, a seeded order-k Markov source whose
//!   exact entropy rate ([`Corpus::entropy_rate`]) is the loss a perfect model reaches, so a
//!   run can report how far above that floor it ended.
//! - [`Batcher`]: step `t`'s global batch is a fixed list of samples whatever the parallel
//!   layout; [`Batcher::micro_batch`] hands each (replica, micro-batch) its part as Burn
//!   tensors. Datasets wrap to the next epoch when exhausted ([`Batcher::epochs_started`]),
//!   and [`DataPosition`] records where a run stands for checkpoints.
//!
//! Nothing here draws from a global or OS random source: all randomness comes from a
//! hand-written SplitMix64 seeded by the run's seed, whose output cannot change under a
//! dependency upgrade.

mod batch;
mod error;
mod markov;
pub(crate) mod rng;
#[cfg(feature = "engine")]
mod tensor;
mod text;
mod tokenizer;

use std::path::Path;
use std::sync::Arc;

pub use batch::{BatchConfig, BatchLayout, Batcher, DataPosition, Sample};
pub use error::DataError;
pub use markov::{
    MarkovChain, MarkovConfig, MarkovCorpus, STATIONARY_MAX_ITERATIONS, STATIONARY_TOLERANCE,
};
#[cfg(feature = "engine")]
pub use tensor::to_micro_batch;
pub use text::TextCorpus;
pub use tokenizer::{ByteTokenizer, VOCAB_SIZE};

/// A token stream to train on.
pub trait Corpus {
    /// All tokens, in stream order (shared, not copied).
    fn tokens(&self) -> Arc<[u32]>;

    /// A one-line description for logs and error messages.
    fn describe(&self) -> String;

    /// The source's entropy rate in nats per token, when known: the cross-entropy loss a
    /// perfect model converges to. `None` for real text.
    fn entropy_rate(&self) -> Option<f64> {
        None
    }
}

/// The corpus of a run: the text at `data` if given (`--data PATH`), otherwise the synthetic
/// Markov source drawn from `synthetic`.
pub fn load_corpus(
    data: Option<&Path>,
    synthetic: &MarkovConfig,
) -> Result<Box<dyn Corpus + Send + Sync>, DataError> {
    Ok(match data {
        Some(path) => Box::new(TextCorpus::from_path(path)?),
        None => Box::new(MarkovCorpus::new(synthetic.clone())?),
    })
}
