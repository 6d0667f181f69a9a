//! Cutting a token stream into training samples, independently of the parallel layout.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::rng::{mix64, Permutation};
use super::{Corpus, DataError};

/// What a [`Batcher`] cuts and in what order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchConfig {
    /// Tokens per sample (inputs and targets each).
    pub seq_len: usize,
    /// Samples per optimizer step, `B = dp × microbatches × micro_batch_size`.
    pub global_batch: usize,
    /// Seed of the per-epoch window permutations.
    pub seed: u64,
    /// Visit windows in a seeded random order per epoch (`true`) or in stream order.
    pub shuffle: bool,
}

impl BatchConfig {
    /// A shuffled configuration.
    pub fn new(seq_len: usize, global_batch: usize, seed: u64) -> Self {
        Self {
            seq_len,
            global_batch,
            seed,
            shuffle: true,
        }
    }
}

/// How a step's global batch is split over ranks and micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Data-parallel replicas D.
    pub dp: usize,
    /// Micro-batches per step and replica M.
    pub microbatches: usize,
    /// Samples per micro-batch.
    pub micro_batch_size: usize,
}

impl BatchLayout {
    /// `dp × microbatches × micro_batch_size`.
    pub fn global_batch(&self) -> usize {
        self.dp * self.microbatches * self.micro_batch_size
    }
}

/// One training sample: `seq_len` input tokens and the `seq_len` tokens that follow each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample<'a> {
    /// The epoch (0-based) this sample belongs to.
    pub epoch: u64,
    /// The window of the stream it was cut from.
    pub window: u64,
    /// Input token ids.
    pub inputs: &'a [u32],
    /// Target token ids: `inputs` shifted left by one token.
    pub targets: &'a [u32],
}

/// Where a run stands in its data stream, for checkpoint manifests.
///
/// Sampling is a pure function of the step, so `next_step` alone locates the stream; the
/// other fields are there to refuse resuming against different data or batching (see
/// [`Batcher::resume`]) and to make the manifest readable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The first optimizer step (0-based) not yet trained: the step to resume at.
    pub next_step: u64,
    /// Epoch (0-based) of the next sample.
    pub epoch: u64,
    /// Position of the next sample within its epoch.
    pub sample_in_epoch: u64,
    /// Samples consumed so far, `next_step × global_batch`.
    pub samples_consumed: u64,
    /// Windows (samples) per epoch.
    pub windows_per_epoch: u64,
    /// The batching configuration.
    pub batch: BatchConfig,
    /// Tokens in the corpus.
    pub corpus_tokens: u64,
    /// FNV-1a 64 hash of the token stream, as 16 hex digits (a string so JSON readers
    /// without 64-bit integers keep it exact).
    pub corpus_fingerprint: String,
}

/// Cuts a token stream into samples, steps and micro-batches.
///
/// # Sample order
///
/// The stream of `N` tokens is cut into `W = (N - 1) / seq_len` non-overlapping windows;
/// window `w` has inputs `tokens[w·L .. w·L + L]` and targets one token later (`L` =
/// `seq_len`; the last `(N - 1) mod L` tokens are never a target). An epoch visits every
/// window once, in the order of a permutation of `0..W` seeded by `(seed, epoch)` — or in
/// stream order with `shuffle = false`. Shuffling matters because consecutive windows of
/// text are strongly correlated; a fresh permutation per epoch keeps later epochs from
/// repeating the first one's batches.
///
/// Global sample `g = 0, 1, 2, …` is position `g mod W` of epoch `g / W`, so the stream of
/// samples runs through epoch after epoch without a gap: an exhausted dataset simply wraps to
/// the next epoch ([`Batcher::epochs_started`] says when). Optimizer step `t` (0-based)
/// consumes global samples `t·B .. (t+1)·B`, `B` the global batch. That depends on the seed,
/// `seq_len` and `B` only, never on how `B` is split — which is what makes runs with the same
/// global batch and seed comparable step by step.
///
/// # Micro-batches
///
/// With `B = dp × M × mbs` (data-parallel replicas × micro-batches per step and replica ×
/// micro-batch size), micro-batch `m` of replica `d` holds the step's samples
/// `i = (d·M + m)·mbs + j` for `j in 0..mbs`. The replicas' micro-batches are disjoint, their
/// union is the step's global batch, and listing them in `(d, m)` order gives the global
/// batch in order — so e.g. `dp=2, M=2` and `dp=1, M=4` (same `mbs`) form identical
/// micro-batches, just owned by different ranks.
#[derive(Debug, Clone)]
pub struct Batcher {
    tokens: Arc<[u32]>,
    source: String,
    config: BatchConfig,
    windows: u64,
    fingerprint: String,
}

impl Batcher {
    /// A batcher over `corpus`.
    pub fn new<C: Corpus + ?Sized>(corpus: &C, config: BatchConfig) -> Result<Self, DataError> {
        Self::from_tokens(corpus.tokens(), corpus.describe(), config)
    }

    /// A batcher over a token stream; `source` names it in error messages.
    pub fn from_tokens(
        tokens: Arc<[u32]>,
        source: impl Into<String>,
        config: BatchConfig,
    ) -> Result<Self, DataError> {
        let source = source.into();
        if config.seq_len == 0 || config.global_batch == 0 {
            return Err(DataError::Config(format!(
                "sequence length ({}) and global batch ({}) must both be at least 1",
                config.seq_len, config.global_batch
            )));
        }
        if tokens.len() <= config.seq_len {
            return Err(DataError::TooShort {
                source_name: source,
                tokens: tokens.len(),
                seq_len: config.seq_len,
            });
        }
        let windows = ((tokens.len() - 1) / config.seq_len) as u64;
        let fingerprint = format!("{:016x}", fnv1a(&tokens));
        Ok(Self {
            tokens,
            source,
            config,
            windows,
            fingerprint,
        })
    }

    /// The batching configuration.
    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// The corpus description given at construction.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Samples per epoch, `W = (tokens - 1) / seq_len`.
    pub fn windows_per_epoch(&self) -> u64 {
        self.windows
    }

    /// Optimizer steps per epoch (fractional when `W` is not a multiple of the global batch).
    pub fn steps_per_epoch(&self) -> f64 {
        self.windows as f64 / self.config.global_batch as f64
    }

    /// Global sample `g` (the `g`-th sample of the whole run, across epochs).
    pub fn global_sample(&self, g: u64) -> Sample<'_> {
        let epoch = g / self.windows;
        let position = g % self.windows;
        let window = if self.config.shuffle {
            // One key per (seed, epoch): every epoch is shuffled differently.
            Permutation::new(self.windows, mix64(self.config.seed ^ mix64(epoch))).apply(position)
        } else {
            position
        };
        // `window < W = (N - 1) / L`, so `start + L + 1 <= N` and both slices are in range.
        let start = window as usize * self.config.seq_len;
        let end = start + self.config.seq_len;
        Sample {
            epoch,
            window,
            inputs: &self.tokens[start..end],
            targets: &self.tokens[start + 1..end + 1],
        }
    }

    /// Sample `index` (`< global_batch`) of optimizer step `step` (0-based).
    pub fn sample(&self, step: u64, index: usize) -> Result<Sample<'_>, DataError> {
        let b = self.config.global_batch;
        if index >= b {
            return Err(DataError::Layout(format!(
                "sample {index} of a step, but the global batch has {b} samples"
            )));
        }
        Ok(self.global_sample(step * b as u64 + index as u64))
    }

    /// The global batch of optimizer step `step` (0-based), in order.
    pub fn step_samples(&self, step: u64) -> Vec<Sample<'_>> {
        let b = self.config.global_batch as u64;
        (step * b..(step + 1) * b)
            .map(|g| self.global_sample(g))
            .collect()
    }

    /// The epoch of step `step`'s first sample.
    pub fn epoch_of_step(&self, step: u64) -> u64 {
        step * self.config.global_batch as u64 / self.windows
    }

    /// The epochs (0-based, never 0) whose first sample is in step `step`: empty unless the
    /// dataset ran out during this step, usually one epoch `e`, for which the trainer prints
    /// "dataset exhausted: starting epoch {e + 1}". (Several only when the corpus holds fewer
    /// windows than a global batch.)
    pub fn epochs_started(&self, step: u64) -> Range<u64> {
        let b = self.config.global_batch as u64;
        let (first, last) = (step * b, step * b + b - 1);
        // Epoch e starts at global sample e·W; count the e >= 1 with first <= e·W <= last.
        let start = first.div_ceil(self.windows).max(1);
        let end = last / self.windows + 1;
        start..end.max(start)
    }

    /// The samples of micro-batch `microbatch` of data-parallel replica `dp_index` in step
    /// `step`: step samples `(dp_index · M + microbatch) · mbs + j`, `j in 0..mbs`.
    pub fn micro_batch_samples(
        &self,
        step: u64,
        layout: &BatchLayout,
        dp_index: usize,
        microbatch: usize,
    ) -> Result<Vec<Sample<'_>>, DataError> {
        if layout.global_batch() != self.config.global_batch {
            return Err(DataError::Layout(format!(
                "dp {} × microbatches {} × micro-batch size {} = {} samples, but the batcher \
                 was built for a global batch of {}; build it with the layout's global batch",
                layout.dp,
                layout.microbatches,
                layout.micro_batch_size,
                layout.global_batch(),
                self.config.global_batch
            )));
        }
        if dp_index >= layout.dp || microbatch >= layout.microbatches {
            return Err(DataError::Layout(format!(
                "micro-batch {microbatch} of replica {dp_index} requested, but there are {} \
                 replicas with {} micro-batches each",
                layout.dp, layout.microbatches
            )));
        }
        let mbs = layout.micro_batch_size as u64;
        let first = step * self.config.global_batch as u64
            + (dp_index * layout.microbatches + microbatch) as u64 * mbs;
        Ok((first..first + mbs)
            .map(|g| self.global_sample(g))
            .collect())
    }

    /// The data position after `next_step` steps, for a checkpoint manifest.
    pub fn position(&self, next_step: u64) -> DataPosition {
        let consumed = next_step * self.config.global_batch as u64;
        DataPosition {
            next_step,
            epoch: consumed / self.windows,
            sample_in_epoch: consumed % self.windows,
            samples_consumed: consumed,
            windows_per_epoch: self.windows,
            batch: self.config,
            corpus_tokens: self.tokens.len() as u64,
            corpus_fingerprint: self.fingerprint.clone(),
        }
    }

    /// Checks that a saved position belongs to this corpus and batching and returns the step
    /// to resume at. The parallel layout may differ; the global batch may not, since it
    /// decides which samples make up a step.
    pub fn resume(&self, saved: &DataPosition) -> Result<u64, DataError> {
        let current = self.position(saved.next_step);
        let mismatch = |field, saved: String, current: String, hint| {
            Err(DataError::Resume {
                field,
                saved,
                current,
                hint,
            })
        };
        const SAME_DATA: &str = "resume with the same --data (or synthetic corpus settings)";
        if saved.corpus_tokens != current.corpus_tokens {
            let (s, c) = (saved.corpus_tokens, current.corpus_tokens);
            return mismatch("corpus tokens", s.to_string(), c.to_string(), SAME_DATA);
        }
        if saved.corpus_fingerprint != current.corpus_fingerprint {
            let (s, c) = (&saved.corpus_fingerprint, &current.corpus_fingerprint);
            return mismatch("corpus fingerprint", s.clone(), c.clone(), SAME_DATA);
        }
        let (s, c) = (saved.batch, current.batch);
        if s.seq_len != c.seq_len {
            let hint = "resume with the checkpoint's sequence length";
            return mismatch(
                "seq_len",
                s.seq_len.to_string(),
                c.seq_len.to_string(),
                hint,
            );
        }
        if s.global_batch != c.global_batch {
            let hint = "keep dp × microbatches × micro-batch size equal to the checkpoint's \
                        global batch (how it is split may change)";
            let (sb, cb) = (s.global_batch.to_string(), c.global_batch.to_string());
            return mismatch("global batch", sb, cb, hint);
        }
        if s.seed != c.seed || s.shuffle != c.shuffle {
            let hint = "resume with the checkpoint's data seed and shuffle setting";
            let show = |b: BatchConfig| format!("seed {} shuffle {}", b.seed, b.shuffle);
            return mismatch("data order", show(s), show(c), hint);
        }
        if *saved != current {
            let hint = "the manifest's data position is inconsistent; it may have been edited";
            let show = |p: &DataPosition| format!("{p:?}");
            return mismatch("position", show(saved), show(&current), hint);
        }
        Ok(saved.next_step)
    }
}

/// FNV-1a 64 over the tokens' little-endian bytes: a cheap, stable corpus fingerprint.
fn fnv1a(tokens: &[u32]) -> u64 {
    tokens
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .fold(0xCBF2_9CE4_8422_2325, |h, byte| {
            (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01B3)
        })
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
