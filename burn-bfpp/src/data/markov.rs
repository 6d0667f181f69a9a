//! The built-in synthetic corpus: a seeded order-k Markov source with a known entropy rate.
//!
//! Real text has no known loss floor, so a falling loss curve says little about how close a
//! run got. A stationary Markov source does: the cross-entropy of the best possible model —
//! the source's own transition probabilities — converges to the source's entropy rate
//! `H = Σ_c π(c) · H(next | c)`, with `π` the stationary distribution over the length-k
//! contexts. The trainer prints the loss against that bound.

use std::sync::Arc;

use super::rng::SplitMix64;
use super::{Corpus, DataError};

/// How the synthetic source is drawn. [`Default`]: 16 symbols, order 2 (256 contexts), 4 likely
/// successors per context. A small GPT needs attention to one token back to learn order 2,
/// which took more than 300 steps on 2 CPU cores; `bfpp train` defaults to order 1 instead
/// (see `src/cli/config.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct MarkovConfig {
    /// Number of symbols `A` (1..=256).
    pub alphabet: usize,
    /// Context length `k`: the next symbol depends on the previous `k` (`A^k` contexts).
    pub order: usize,
    /// Likely successors per context (1..=alphabet). Fewer means lower entropy: each
    /// context's distribution is a uniform draw from the simplex (Dirichlet(1)) over a random
    /// `branching`-subset of the alphabet, so the entropy sits clearly below `ln A`.
    pub branching: usize,
    /// Probability mass spread evenly over the whole alphabet in every context, in `(0, 1]`.
    /// It makes every symbol possible after every context, so the chain is irreducible and
    /// aperiodic: its stationary distribution is unique and a generated stream's statistics
    /// converge to it, which is what makes the entropy rate the loss floor.
    pub smoothing: f64,
    /// Byte value of symbol 0; symbols are the bytes `first_byte .. first_byte + alphabet`
    /// (default `b'a'`, so the stream prints as letters).
    pub first_byte: u8,
    /// Tokens to generate.
    pub length: usize,
    /// Seed of both the transition probabilities and the generated stream.
    pub seed: u64,
}

impl Default for MarkovConfig {
    fn default() -> Self {
        Self {
            alphabet: 16,
            order: 2,
            branching: 4,
            smoothing: 0.01,
            first_byte: b'a',
            length: 1 << 20,
            seed: 0,
        }
    }
}

/// Upper bound on `A^k`: beyond it the transition table no longer fits comfortably in memory.
const MAX_CONTEXTS: usize = 1 << 20;

/// The stationary iteration stops once the L1 change of `π` in one step is below this.
pub const STATIONARY_TOLERANCE: f64 = 1e-13;

/// The stationary iteration gives up (with [`DataError::NotConverged`]) after this many steps.
pub const STATIONARY_MAX_ITERATIONS: usize = 200_000;

/// An order-k Markov chain over symbols `0..A`: its transition table, stationary distribution
/// and entropy rate.
#[derive(Debug, Clone)]
pub struct MarkovChain {
    alphabet: usize,
    order: usize,
    /// Row `c` (`A` entries) is `P(next | context c)`.
    probs: Vec<f64>,
    stationary: Vec<f64>,
    entropy_rate: f64,
}

impl MarkovChain {
    /// Draws a chain from `config` (only its alphabet, order, branching, smoothing and seed
    /// matter).
    pub fn random(config: &MarkovConfig) -> Result<Self, DataError> {
        let (a, contexts) = check_shape(config.alphabet, config.order)?;
        if config.branching == 0 || config.branching > a {
            return Err(DataError::Config(format!(
                "Markov branching is {} but must be between 1 and the alphabet size {a}",
                config.branching
            )));
        }
        if !(config.smoothing > 0.0 && config.smoothing <= 1.0) {
            return Err(DataError::Config(format!(
                "Markov smoothing is {} but must be in (0, 1]: without it the chain may be \
                 reducible and its entropy rate would not be the loss floor",
                config.smoothing
            )));
        }
        // A sub-stream of its own, so the stream's draws never shift the table's.
        let mut rng = SplitMix64::derived(config.seed, 1);
        let mut probs = vec![config.smoothing / a as f64; contexts * a];
        let mut symbols: Vec<usize> = (0..a).collect();
        for row in probs.chunks_mut(a) {
            // Partial Fisher–Yates: the first `branching` entries become a random subset.
            for i in 0..config.branching {
                let j = i + rng.below((a - i) as u64) as usize;
                symbols.swap(i, j);
            }
            // Normalised Exp(1) draws are uniform on the simplex (Dirichlet(1, …, 1)).
            let weights: Vec<f64> = (0..config.branching)
                .map(|_| -(1.0 - rng.next_f64()).ln())
                .collect();
            let total: f64 = weights.iter().sum();
            for (&s, w) in symbols.iter().zip(&weights) {
                row[s] += (1.0 - config.smoothing) * w / total;
            }
        }
        Self::from_transitions(a, config.order, probs)
    }

    /// A chain from an explicit table: row `c` of `probs` (`A^k` rows of `A` entries) is the
    /// distribution of the next symbol after context `c` (see [`context_index`]). Rows must
    /// be non-negative and sum to 1. For the entropy rate to be the loss floor the chain
    /// should be irreducible; for a reducible one the stationary distribution found is the
    /// limit from uniformly distributed contexts.
    ///
    /// [`context_index`]: Self::context_index
    pub fn from_transitions(
        alphabet: usize,
        order: usize,
        probs: Vec<f64>,
    ) -> Result<Self, DataError> {
        let (a, contexts) = check_shape(alphabet, order)?;
        if probs.len() != contexts * a {
            return Err(DataError::Config(format!(
                "a transition table of order {order} over {a} symbols has {contexts} rows of \
                 {a}, i.e. {} entries, but {} were given",
                contexts * a,
                probs.len()
            )));
        }
        for (c, row) in probs.chunks(a).enumerate() {
            let sum: f64 = row.iter().sum();
            if row.iter().any(|p| !(p.is_finite() && *p >= 0.0)) || (sum - 1.0).abs() > 1e-9 {
                return Err(DataError::Config(format!(
                    "transition row {c} must be non-negative and sum to 1, but sums to {sum}"
                )));
            }
        }
        let stationary = stationary_distribution(a, &probs)?;
        let entropy_rate = probs
            .chunks(a)
            .zip(&stationary)
            .map(|(row, &pi)| pi * entropy(row))
            .sum();
        Ok(Self {
            alphabet: a,
            order,
            probs,
            stationary,
            entropy_rate,
        })
    }

    /// Number of symbols `A`.
    pub fn alphabet(&self) -> usize {
        self.alphabet
    }

    /// Context length `k`.
    pub fn order(&self) -> usize {
        self.order
    }

    /// Number of contexts `A^k`.
    pub fn num_contexts(&self) -> usize {
        self.stationary.len()
    }

    /// The index of the context `symbols` (length `k`, oldest first): the symbols read as a
    /// base-`A` number, most significant first.
    pub fn context_index(&self, symbols: &[usize]) -> usize {
        symbols.iter().fold(0, |c, &s| c * self.alphabet + s)
    }

    /// `P(next | context)` for every next symbol.
    pub fn transition(&self, context: usize) -> &[f64] {
        &self.probs[context * self.alphabet..(context + 1) * self.alphabet]
    }

    /// The stationary distribution `π` over contexts.
    pub fn stationary(&self) -> &[f64] {
        &self.stationary
    }

    /// The entropy rate in nats per symbol: the cross-entropy a perfect model converges to.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    /// `length` symbols drawn from the chain with `seed`. The first `k` are a context drawn
    /// from `π`, so the stream is stationary from its first symbol (no burn-in to discard).
    pub fn generate(&self, length: usize, seed: u64) -> Vec<usize> {
        let (a, k) = (self.alphabet, self.order);
        let contexts = self.num_contexts();
        let mut rng = SplitMix64::derived(seed, 2);
        let mut out = Vec::with_capacity(length);
        let mut context = rng.weighted(&self.stationary);
        // Spell out the initial context, oldest symbol first.
        let mut digits = Vec::with_capacity(k);
        let mut c = context;
        for _ in 0..k {
            digits.push(c % a);
            c /= a;
        }
        out.extend(digits.iter().rev().take(length));
        while out.len() < length {
            let next = rng.weighted(self.transition(context));
            out.push(next);
            context = (context * a + next) % contexts;
        }
        out
    }

    /// Mean negative log-likelihood (nats) of `symbols[k..]`, each given its `k` predecessors,
    /// under this chain: the loss of the perfect model on that stream. `None` if the stream
    /// has no more than `k` symbols or holds a symbol outside the alphabet.
    pub fn nll(&self, symbols: &[usize]) -> Option<f64> {
        let (a, k) = (self.alphabet, self.order);
        if symbols.len() <= k || symbols.iter().any(|&s| s >= a) {
            return None;
        }
        let contexts = self.num_contexts();
        let mut context = self.context_index(&symbols[..k]);
        let mut total = 0.0;
        for &s in &symbols[k..] {
            total -= self.transition(context)[s].ln();
            context = (context * a + s) % contexts;
        }
        Some(total / (symbols.len() - k) as f64)
    }
}

/// Checks the alphabet and order, returning `(A, A^k)`.
fn check_shape(alphabet: usize, order: usize) -> Result<(usize, usize), DataError> {
    if alphabet == 0 || alphabet > 256 {
        return Err(DataError::Config(format!(
            "Markov alphabet has {alphabet} symbols but must have 1 to 256 (they are bytes)"
        )));
    }
    let contexts = u32::try_from(order)
        .ok()
        .and_then(|k| alphabet.checked_pow(k))
        .filter(|&c| c <= MAX_CONTEXTS)
        .ok_or_else(|| {
            DataError::Config(format!(
                "a Markov source of order {order} over {alphabet} symbols has alphabet^order \
                 contexts, more than the {MAX_CONTEXTS} supported; lower the order or alphabet"
            ))
        })?;
    Ok((alphabet, contexts))
}

/// Shannon entropy (nats) of one distribution; `0 · ln 0 = 0`.
fn entropy(p: &[f64]) -> f64 {
    p.iter().filter(|&&x| x > 0.0).map(|&x| -x * x.ln()).sum()
}

/// The stationary distribution of the context chain, by power iteration.
///
/// The iteration is the *lazy* chain `π ← (π + πP) / 2`, which has the same stationary
/// distributions as `P` but is aperiodic, so it converges even for hand-built periodic chains
/// (a deterministic cycle would make plain `π ← πP` oscillate forever). It starts from the
/// uniform distribution and stops when one step changes `π` by less than
/// [`STATIONARY_TOLERANCE`] in L1 norm.
fn stationary_distribution(alphabet: usize, probs: &[f64]) -> Result<Vec<f64>, DataError> {
    let contexts = probs.len() / alphabet;
    let mut pi = vec![1.0 / contexts as f64; contexts];
    let mut next = vec![0.0; contexts];
    let mut change = f64::INFINITY;
    for _ in 0..STATIONARY_MAX_ITERATIONS {
        next.iter_mut().zip(&pi).for_each(|(n, &p)| *n = 0.5 * p);
        for (c, row) in probs.chunks(alphabet).enumerate() {
            let base = (c * alphabet) % contexts;
            let mass = 0.5 * pi[c];
            for (s, &p) in row.iter().enumerate() {
                // Context c followed by symbol s is context (c·A + s) mod A^k.
                next[(base + s) % contexts] += mass * p;
            }
        }
        // Renormalise so rounding cannot make the mass drift over many iterations.
        let total: f64 = next.iter().sum();
        next.iter_mut().for_each(|x| *x /= total);
        change = pi.iter().zip(&next).map(|(a, b)| (a - b).abs()).sum();
        std::mem::swap(&mut pi, &mut next);
        if change < STATIONARY_TOLERANCE {
            return Ok(pi);
        }
    }
    Err(DataError::NotConverged {
        iterations: STATIONARY_MAX_ITERATIONS,
        residual: change,
    })
}

/// The synthetic corpus: a stream generated by a seeded [`MarkovChain`], as byte tokens.
#[derive(Debug, Clone)]
pub struct MarkovCorpus {
    config: MarkovConfig,
    chain: MarkovChain,
    tokens: Arc<[u32]>,
}

impl MarkovCorpus {
    /// Draws the chain and generates `config.length` tokens, all determined by `config.seed`.
    pub fn new(config: MarkovConfig) -> Result<Self, DataError> {
        if usize::from(config.first_byte) + config.alphabet > 256 {
            return Err(DataError::Config(format!(
                "Markov symbols are the bytes {} .. {} + {}, past 255; lower first_byte or the \
                 alphabet size",
                config.first_byte, config.first_byte, config.alphabet
            )));
        }
        if config.length <= config.order {
            return Err(DataError::Config(format!(
                "a Markov corpus of order {} needs more than {} tokens, but length is {}",
                config.order, config.order, config.length
            )));
        }
        let chain = MarkovChain::random(&config)?;
        let first = u32::from(config.first_byte);
        let tokens = chain
            .generate(config.length, config.seed)
            .into_iter()
            .map(|s| first + s as u32)
            .collect();
        Ok(Self {
            config,
            chain,
            tokens,
        })
    }

    /// The configuration the corpus was drawn from.
    pub fn config(&self) -> &MarkovConfig {
        &self.config
    }

    /// The source chain.
    pub fn chain(&self) -> &MarkovChain {
        &self.chain
    }

    /// Mean negative log-likelihood of a token stream under the true source (see
    /// [`MarkovChain::nll`]); `None` if a token is outside the source's bytes or the stream
    /// is not longer than the order.
    pub fn nll(&self, tokens: &[u32]) -> Option<f64> {
        let first = u32::from(self.config.first_byte);
        let symbols: Option<Vec<usize>> = tokens
            .iter()
            .map(|&t| t.checked_sub(first).map(|s| s as usize))
            .collect();
        self.chain.nll(&symbols?)
    }
}

impl Corpus for MarkovCorpus {
    fn tokens(&self) -> Arc<[u32]> {
        Arc::clone(&self.tokens)
    }

    fn describe(&self) -> String {
        let c = &self.config;
        let last = usize::from(c.first_byte) + c.alphabet - 1;
        format!(
            "synthetic order-{} Markov source over {} symbols ({:?}..={:?}), branching {}, \
             seed {}, {} tokens, entropy rate {:.4} nats/token",
            c.order,
            c.alphabet,
            char::from(c.first_byte),
            char::from(last as u8),
            c.branching,
            c.seed,
            self.tokens.len(),
            self.chain.entropy_rate
        )
    }

    fn entropy_rate(&self) -> Option<f64> {
        Some(self.chain.entropy_rate)
    }
}

#[cfg(test)]
#[path = "markov_tests.rs"]
mod tests;
