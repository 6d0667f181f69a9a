//! Tests of the Markov source: exact entropy rates of hand-built chains, and the empirical
//! loss of the true model on generated streams against the computed rate.

use super::*;

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

#[test]
fn deterministic_chains_have_zero_entropy() {
    // Order 1 cycle 0 → 1 → 2 → 0: periodic, which the lazy power iteration must handle.
    let mut probs = vec![0.0; 9];
    for c in 0..3 {
        probs[c * 3 + (c + 1) % 3] = 1.0;
    }
    let chain = MarkovChain::from_transitions(3, 1, probs).expect("valid chain");
    assert!(close(chain.entropy_rate(), 0.0, 1e-15));
    for &p in chain.stationary() {
        assert!(close(p, 1.0 / 3.0, 1e-12));
    }
    let stream = chain.generate(30, 5);
    assert_eq!(chain.nll(&stream), Some(0.0));

    // Order 2, next = (a + b) mod 3: deterministic, whatever its classes.
    let mut probs = vec![0.0; 27];
    for a in 0..3 {
        for b in 0..3 {
            probs[(a * 3 + b) * 3 + (a + b) % 3] = 1.0;
        }
    }
    let chain = MarkovChain::from_transitions(3, 2, probs).expect("valid chain");
    assert!(close(chain.entropy_rate(), 0.0, 1e-15));
}

#[test]
fn uniform_iid_source_has_entropy_ln_alphabet() {
    for (a, k) in [(16, 0), (16, 1), (5, 2)] {
        let contexts = a_pow(a, k);
        let chain = MarkovChain::from_transitions(a, k, vec![1.0 / a as f64; contexts * a])
            .expect("valid chain");
        assert!(
            close(chain.entropy_rate(), (a as f64).ln(), 1e-12),
            "A={a} k={k}"
        );
    }
}

fn a_pow(a: usize, k: usize) -> usize {
    (0..k).fold(1, |x, _| x * a)
}

#[test]
fn two_state_chain_matches_closed_form() {
    // P = [[1-a, a], [b, 1-b]]: π = (b, a) / (a + b), H = π0 h(a) + π1 h(b).
    let (a, b) = (0.1, 0.4);
    let chain =
        MarkovChain::from_transitions(2, 1, vec![1.0 - a, a, b, 1.0 - b]).expect("valid chain");
    let h = |p: f64| -p * p.ln() - (1.0 - p) * (1.0 - p).ln();
    let pi0 = b / (a + b);
    assert!(close(chain.stationary()[0], pi0, 1e-12));
    let expected = pi0 * h(a) + (1.0 - pi0) * h(b);
    assert!(close(chain.entropy_rate(), expected, 1e-12));
}

#[test]
fn stationary_distribution_is_a_fixed_point() {
    let chain = MarkovChain::random(&MarkovConfig::default()).expect("default chain");
    let (a, contexts) = (chain.alphabet(), chain.num_contexts());
    let pi = chain.stationary();
    let mut next = vec![0.0; contexts];
    for (c, &p) in pi.iter().enumerate() {
        for (s, &q) in chain.transition(c).iter().enumerate() {
            next[(c * a + s) % contexts] += p * q;
        }
    }
    let residual: f64 = pi.iter().zip(&next).map(|(x, y)| (x - y).abs()).sum();
    assert!(residual < 1e-10, "‖πP − π‖₁ = {residual}");
    assert!(close(pi.iter().sum::<f64>(), 1.0, 1e-12));
}

#[test]
fn empirical_loss_of_true_model_converges_to_entropy_rate() {
    let configs = [
        MarkovConfig::default(),
        MarkovConfig {
            alphabet: 24,
            order: 1,
            branching: 3,
            smoothing: 0.05,
            seed: 9,
            ..MarkovConfig::default()
        },
        MarkovConfig {
            alphabet: 8,
            order: 3,
            branching: 8,
            seed: 3,
            ..MarkovConfig::default()
        },
    ];
    for config in configs {
        let corpus = MarkovCorpus::new(config.clone()).expect("corpus");
        let h = corpus.entropy_rate().expect("known rate");
        let nll = corpus.nll(&corpus.tokens()).expect("tokens in alphabet");
        assert!(
            close(nll, h, 4e-3),
            "{config:?}: empirical {nll:.5} vs entropy rate {h:.5}"
        );
        // Clearly below the uniform bound, so a learning model has something to learn.
        assert!(h < (config.alphabet as f64).ln() - 0.2, "{h}");
    }
}

#[test]
fn corpus_is_deterministic_in_its_seed() {
    let small = |seed| MarkovConfig {
        length: 10_000,
        seed,
        ..MarkovConfig::default()
    };
    let a = MarkovCorpus::new(small(1)).expect("corpus");
    let b = MarkovCorpus::new(small(1)).expect("corpus");
    let c = MarkovCorpus::new(small(2)).expect("corpus");
    assert_eq!(a.tokens(), b.tokens());
    assert_eq!(a.entropy_rate(), b.entropy_rate());
    assert_ne!(a.tokens(), c.tokens());
    assert_ne!(a.entropy_rate(), c.entropy_rate());
    assert!(a
        .tokens()
        .iter()
        .all(|&t| (u32::from(b'a')..=u32::from(b'p')).contains(&t)));
    assert!(a.describe().contains("entropy rate"), "{}", a.describe());
}

#[test]
fn bad_configurations_are_rejected() {
    let bad = [
        MarkovConfig {
            alphabet: 0,
            ..MarkovConfig::default()
        },
        MarkovConfig {
            branching: 17,
            ..MarkovConfig::default()
        },
        MarkovConfig {
            smoothing: 0.0,
            ..MarkovConfig::default()
        },
        MarkovConfig {
            order: 8,
            ..MarkovConfig::default()
        },
        MarkovConfig {
            first_byte: 250,
            ..MarkovConfig::default()
        },
        MarkovConfig {
            length: 2,
            ..MarkovConfig::default()
        },
    ];
    for config in bad {
        let err = MarkovCorpus::new(config.clone()).expect_err("invalid");
        assert!(matches!(err, DataError::Config(_)), "{config:?}: {err}");
    }
    let err = MarkovChain::from_transitions(2, 1, vec![0.5, 0.6, 1.0, 0.0]).expect_err("sum");
    assert!(err.to_string().contains("row 0"), "{err}");
}

#[test]
fn default_corpus_is_pinned() {
    // The default corpus must never change (checkpoints and recorded losses refer to it):
    // this fails if the generator, the chain construction or the defaults drift.
    let corpus = MarkovCorpus::new(MarkovConfig::default()).expect("default corpus");
    let h = corpus.entropy_rate().expect("known rate");
    assert!(close(h, 1.111_413_324_140, 1e-11), "entropy rate {h:.12}");
    let start = crate::data::ByteTokenizer.decode(&corpus.tokens()[..32]);
    assert_eq!(start, "kidijaekmlhcmmfeokdhajpgeiimjiim");
}
