//! Tests of the batcher: layout independence, epochs and wrap-around, resume checks.

use std::collections::HashSet;

use super::*;

/// A stream whose token at position p is p, so a sample shows where it was cut.
fn counting(n: u32) -> Arc<[u32]> {
    (0..n).collect()
}

fn batcher(n: u32, seq_len: usize, global_batch: usize, shuffle: bool) -> Batcher {
    let config = BatchConfig {
        shuffle,
        ..BatchConfig::new(seq_len, global_batch, 7)
    };
    Batcher::from_tokens(counting(n), "counting", config).expect("batcher")
}

#[test]
fn samples_are_windows_with_shifted_targets() {
    let b = batcher(101, 10, 4, false);
    assert_eq!(b.windows_per_epoch(), 10);
    let s = b.sample(0, 1).expect("in range");
    assert_eq!(s.inputs, &(10..20).collect::<Vec<u32>>()[..]);
    assert_eq!(s.targets, &(11..21).collect::<Vec<u32>>()[..]);
    assert_eq!(s.window, 1);
    // The last window's targets reach the last token.
    let last = b.global_sample(9);
    assert_eq!(last.targets.last(), Some(&100));
    assert!(b.sample(0, 4).is_err());
}

#[test]
fn an_epoch_visits_every_window_once_in_a_seeded_order() {
    let b = batcher(1001, 10, 8, true);
    let w = b.windows_per_epoch();
    for epoch in 0..3 {
        let windows: HashSet<u64> = (epoch * w..(epoch + 1) * w)
            .map(|g| b.global_sample(g).window)
            .collect();
        assert_eq!(windows.len() as u64, w, "epoch {epoch}");
    }
    let order = |epoch: u64| -> Vec<u64> {
        (epoch * w..(epoch + 1) * w)
            .map(|g| b.global_sample(g).window)
            .collect()
    };
    assert_ne!(order(0), order(1), "epochs must be shuffled differently");
    assert_ne!(order(0), (0..w).collect::<Vec<_>>(), "shuffled");
    // Same seed, same order; another seed, another order.
    assert_eq!(order(0), {
        let again = batcher(1001, 10, 8, true);
        (0..w)
            .map(|g| again.global_sample(g).window)
            .collect::<Vec<_>>()
    });
    let other = Batcher::from_tokens(counting(1001), "counting", BatchConfig::new(10, 8, 8))
        .expect("batcher");
    assert_ne!(
        order(0),
        (0..w)
            .map(|g| other.global_sample(g).window)
            .collect::<Vec<_>>()
    );
}

#[test]
fn micro_batches_do_not_depend_on_the_layout() {
    let b = batcher(5000, 16, 8, true);
    let layouts = [
        (2, 2, 2),
        (1, 4, 2),
        (1, 1, 8),
        (4, 1, 2),
        (2, 4, 1),
        (8, 1, 1),
    ];
    for step in [0u64, 1, 37] {
        let global = b.step_samples(step);
        assert_eq!(global.len(), 8);
        for (dp, m, mbs) in layouts {
            let layout = BatchLayout {
                dp,
                microbatches: m,
                micro_batch_size: mbs,
            };
            let mut concatenated = Vec::new();
            for d in 0..dp {
                for mb in 0..m {
                    let part = b
                        .micro_batch_samples(step, &layout, d, mb)
                        .expect("valid request");
                    assert_eq!(part.len(), mbs);
                    concatenated.extend(part);
                }
            }
            // Same order, hence also the same multiset.
            assert_eq!(concatenated, global, "step {step}, layout {layout:?}");
        }
    }
}

#[test]
fn layout_errors_are_reported() {
    let b = batcher(5000, 16, 8, true);
    let wrong = BatchLayout {
        dp: 2,
        microbatches: 2,
        micro_batch_size: 4,
    };
    let err = b.micro_batch_samples(0, &wrong, 0, 0).expect_err("16 != 8");
    assert!(err.to_string().contains("global batch of 8"), "{err}");
    let layout = BatchLayout {
        dp: 2,
        microbatches: 2,
        micro_batch_size: 2,
    };
    assert!(b.micro_batch_samples(0, &layout, 2, 0).is_err());
    assert!(b.micro_batch_samples(0, &layout, 0, 2).is_err());
}

#[test]
fn exhausted_dataset_wraps_to_the_next_epoch_and_says_so() {
    // 10 windows, 4 samples a step: epoch 1 starts inside step 2 (samples 8..12), epoch 2 at
    // the first sample of step 5 (samples 20..24).
    let b = batcher(101, 10, 4, true);
    let started: Vec<Vec<u64>> = (0..6).map(|t| b.epochs_started(t).collect()).collect();
    assert_eq!(started, [vec![], vec![], vec![1], vec![], vec![], vec![2]]);
    let epochs: Vec<u64> = b.step_samples(2).iter().map(|s| s.epoch).collect();
    assert_eq!(epochs, [0, 0, 1, 1]);
    assert_eq!(b.epoch_of_step(5), 2);
    // A corpus smaller than a global batch starts several epochs in one step.
    let tiny = batcher(31, 10, 8, false);
    assert_eq!(tiny.epochs_started(0), 1..3);
    assert_eq!(tiny.epochs_started(1), 3..6);
}

#[test]
fn too_short_corpus_names_source_and_fix() {
    let err = Batcher::from_tokens(counting(10), "tiny.txt", BatchConfig::new(10, 1, 0))
        .expect_err("needs 11 tokens");
    let msg = err.to_string();
    assert!(matches!(err, DataError::TooShort { .. }), "{msg}");
    assert!(
        msg.contains("tiny.txt") && msg.contains("shorter sequence length"),
        "{msg}"
    );
    assert!(Batcher::from_tokens(counting(11), "ok", BatchConfig::new(10, 1, 0)).is_ok());
    assert!(Batcher::from_tokens(counting(11), "zero", BatchConfig::new(0, 1, 0)).is_err());
}

#[test]
fn position_round_trips_through_json_and_guards_resume() {
    let b = batcher(1001, 10, 8, true);
    let pos = b.position(30);
    assert_eq!((pos.epoch, pos.sample_in_epoch), (2, 40));
    let json = serde_json::to_string(&pos).expect("serialize");
    let back: DataPosition = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, pos);
    assert_eq!(b.resume(&back).expect("same data"), 30);

    // A different split of the same global batch resumes; anything else is refused.
    let other_data = Batcher::from_tokens(counting(1002), "longer", *b.config()).expect("ok");
    let err = other_data.resume(&pos).expect_err("different corpus");
    assert!(err.to_string().contains("--data"), "{err}");
    let mut reordered = counting(1001).to_vec();
    reordered.swap(0, 1);
    let same_len = Batcher::from_tokens(reordered.into(), "edited", *b.config()).expect("ok");
    let err = same_len.resume(&pos).expect_err("different content");
    assert!(err.to_string().contains("fingerprint"), "{err}");
    let err = batcher(1001, 10, 16, true).resume(&pos).expect_err("batch");
    assert!(err.to_string().contains("dp × microbatches"), "{err}");
    let err = batcher(1001, 10, 8, false).resume(&pos).expect_err("order");
    assert!(err.to_string().contains("shuffle"), "{err}");
    let mut edited = pos.clone();
    edited.epoch += 1;
    assert!(b.resume(&edited).is_err());
}
