//! A tiny seeded random number generator and a stateless seeded permutation.
//!
//! Both are written out here rather than taken from `rand` because the data a run trains on
//! must be a pure function of its seed *forever*: a checkpoint written today must resume on
//! the same samples after a dependency upgrade, and `rand`'s `StdRng` explicitly promises no
//! such stability. SplitMix64 is fixed by its published constants, passes BigCrush, and is
//! plenty for drawing Markov transitions and shuffling windows.

/// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit counter passed through a strong mixer.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

/// The SplitMix64 finalizer: a bijective avalanche mix of 64 bits.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for an independent sub-stream, e.g. one per purpose (`salt`) of one seed,
    /// so drawing more numbers for one purpose never shifts another's.
    pub fn derived(seed: u64, salt: u64) -> Self {
        Self::new(mix64(seed ^ mix64(salt.wrapping_add(GOLDEN_GAMMA))))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias (rejection sampling).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        // Reject the top partial block of 2^64 so every residue is equally likely.
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// An index drawn from the (not necessarily normalised) non-negative `weights`.
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut u = self.next_f64() * total;
        for (i, &w) in weights.iter().enumerate() {
            if u < w {
                return i;
            }
            u -= w;
        }
        // Rounding can leave `u` a hair above the last bucket: give it to the last non-zero one.
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
    }
}

/// A pseudo-random permutation of `0..n`, computed one index at a time in O(1) memory.
///
/// A balanced Feistel network over the smallest even-bit power of two `>= n` is a bijection
/// of that domain for any round function; "cycle walking" (re-applying it until the value
/// lands below `n`) turns it into a bijection of `0..n`, and since the domain is less than
/// `4n` that takes under four rounds on average. This lets the batcher ask "which window is
/// the i-th of epoch e" without materialising (or caching, or locking) a shuffled index list.
#[derive(Debug, Clone, Copy)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    key: u64,
}

/// Feistel rounds; four make a strong pseudo-random permutation (Luby–Rackoff).
const ROUNDS: u64 = 4;

impl Permutation {
    /// The permutation of `0..n` selected by `key`.
    pub fn new(n: u64, key: u64) -> Self {
        // Smallest h with 4^h >= n, so both halves have h bits.
        let mut half_bits = 0;
        while half_bits < 32 && (1u128 << (2 * half_bits)) < n as u128 {
            half_bits += 1;
        }
        Self { n, half_bits, key }
    }

    /// The image of `i` (`i < n`).
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        if self.half_bits == 0 {
            return i;
        }
        let mut x = i;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn feistel(&self, x: u64) -> u64 {
        let h = self.half_bits;
        let mask = (1u64 << h) - 1;
        let (mut left, mut right) = (x >> h, x & mask);
        for round in 0..ROUNDS {
            let f = mix64(right ^ mix64(self.key.wrapping_add(round.wrapping_mul(GOLDEN_GAMMA))));
            (left, right) = (right, left ^ (f & mask));
        }
        (left << h) | right
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_values() {
        // First outputs of the reference C implementation seeded with 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        assert_eq!(rng.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(rng.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn permutation_is_a_bijection_for_awkward_sizes() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            let p = Permutation::new(n, 42);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i);
                assert!(j < n && !seen[j as usize], "n={n}: {i} -> {j}");
                seen[j as usize] = true;
            }
        }
    }

    #[test]
    fn permutation_depends_on_key_and_actually_shuffles() {
        let a: Vec<u64> = (0..100)
            .map(|i| Permutation::new(100, 1).apply(i))
            .collect();
        let b: Vec<u64> = (0..100)
            .map(|i| Permutation::new(100, 2).apply(i))
            .collect();
        assert_ne!(a, b);
        let fixed = a
            .iter()
            .enumerate()
            .filter(|(i, &j)| *i as u64 == j)
            .count();
        assert!(fixed < 10, "{fixed} fixed points");
    }

    #[test]
    fn below_and_weighted_stay_in_range() {
        let mut rng = SplitMix64::new(7);
        for _ in 0..1000 {
            assert!(rng.below(3) < 3);
            assert_eq!(rng.weighted(&[0.0, 1.0, 0.0]), 1);
        }
    }
}
