//! Bad input to `Trainer::fit` is refused before training or ends every rank with an error
//! naming the step, the rank and the micro-batch, quickly and without losing a checkpoint
//! already written: a data source error, a micro-batch of another shape, a target outside the
//! vocabulary. The layer-stack adapter refuses models it cannot cut, naming the fix.
// The test reads values directly; the library's own reads go through `host_read`.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{EmbeddingConfig, LinearConfig};
use burn::tensor::{Int, Tensor, TensorData};
use burn_bfpp::engine::{CheckpointSink, Checkpointing, RankState, Trainer};
use burn_bfpp::model::{
    run_stages, split_model, Inputs, LayerStack, MicroBatch, ModelSplit, PipelineModel, Targets,
};
use burn_bfpp::schedule::{ScheduleKind, ZeroLevel};
use common::*;

/// Keeps what every rank saved, and the steps committed.
#[derive(Default)]
struct MemorySink {
    saved: Mutex<Vec<(usize, usize)>>,
    committed: Mutex<Vec<usize>>,
}

impl CheckpointSink for MemorySink {
    fn write_rank(&self, rank: usize, state: &RankState) -> Result<(), String> {
        self.saved
            .lock()
            .map_err(|e| e.to_string())?
            .push((rank, state.step));
        Ok(())
    }

    fn commit(&self, step: usize) -> Result<(), String> {
        self.committed.lock().map_err(|e| e.to_string())?.push(step);
        Ok(())
    }
}

/// Trains the tiny GPT (P=2, V=2, D=2, ZeRO-3) on `data`, saving after every step, and
/// returns the error, how long it took to come, and the steps committed before it.
fn failing_run<D>(data: D) -> (String, Duration, Vec<usize>)
where
    D: burn_bfpp::engine::DataSource<B>,
{
    let cfg =
        config(ScheduleKind::BreadthFirst, 2, 2, 2, ZeroLevel::Zero3).with_comm_timeout_secs(30.0);
    let sink = MemorySink::default();
    let start = Instant::now();
    let err = Trainer::new(cfg)
        .checkpointing(Checkpointing {
            every: 1,
            sink: Some(&sink),
            ..Checkpointing::default()
        })
        .fit(model(), data)
        .expect_err("the run must fail");
    let committed = sink.committed.into_inner().expect("lock");
    (err.to_string(), start.elapsed(), committed)
}

#[test]
fn a_data_source_error_stops_every_rank_naming_step_rank_and_micro_batch() {
    let data = |step: usize, dp: usize, mb: usize| -> Result<MicroBatch<B>, String> {
        if (step, dp, mb) == (2, 1, 3) {
            return Err("shard 17 is unreadable".into());
        }
        Ok(batch(step, dp, mb))
    };
    let (msg, took, committed) = failing_run(data);
    // Replica 1's ranks are world ranks 2 and 3; either asks for the micro-batch.
    assert!(
        msg.contains("step 2") && msg.contains("micro-batch 3") && msg.contains("shard 17"),
        "{msg}"
    );
    assert!(msg.contains("rank 2") || msg.contains("rank 3"), "{msg}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(
        committed,
        vec![1],
        "step 1's checkpoint stays, step 2's never commits"
    );
}

#[test]
fn a_micro_batch_of_another_shape_is_named() {
    let data = |step: usize, dp: usize, mb: usize| -> Result<MicroBatch<B>, String> {
        let b = batch(step, dp, mb);
        if (step, dp, mb) != (2, 0, 1) {
            return Ok(b);
        }
        // One sample fewer than every other micro-batch.
        let (Inputs::Tokens(x), Targets::Tokens(y)) = (b.inputs, b.targets) else {
            unreachable!("token batches")
        };
        Ok(MicroBatch {
            inputs: Inputs::Tokens(x.slice(0..1)),
            targets: Targets::Tokens(y.slice(0..1)),
        })
    };
    let (msg, took, committed) = failing_run(data);
    assert!(
        msg.contains("step 2") && msg.contains("micro-batch 1") && msg.contains("one shape"),
        "{msg}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(committed, vec![1]);
}

#[test]
fn a_target_outside_the_vocabulary_is_named_before_the_update() {
    let vocab = gpt_config().vocab_size as i64;
    let data = move |step: usize, dp: usize, mb: usize| -> MicroBatch<B> {
        let b = batch(step, dp, mb);
        if (step, dp, mb) != (2, 1, 2) {
            return b;
        }
        let Targets::Tokens(y) = b.targets else {
            unreachable!("token batches")
        };
        let dims = y.dims();
        let mut ids: Vec<i64> = y.into_data().convert::<i64>().to_vec().expect("ids");
        ids[3] = vocab;
        MicroBatch {
            inputs: b.inputs,
            targets: Targets::Tokens(Tensor::<B, 2, Int>::from_data(
                TensorData::new(ids, dims),
                &Default::default(),
            )),
        }
    };
    let (msg, took, committed) = failing_run(burn_bfpp::engine::infallible(data));
    // The last stage (3) of replica 1 is on world rank 3.
    assert!(
        msg.contains("rank 3")
            && msg.contains("step 2")
            && msg.contains("micro-batch 2")
            && msg.contains(&format!("0..{vocab}")),
        "{msg}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(committed, vec![1]);
}

/// Four blocks of width 16; `widths` overrides some blocks' feed-forward width.
fn stack(widths: &[(usize, usize)]) -> Result<impl PipelineModel<B>, burn_bfpp::model::ModelError> {
    let device = Default::default();
    let blocks = (0..4)
        .map(|i| {
            let ff = widths.iter().find(|(b, _)| *b == i).map_or(32, |(_, w)| *w);
            TransformerEncoderConfig::new(16, ff, 2, 1)
                .with_dropout(0.0)
                .init::<B>(&device)
                .layers
                .remove(0)
        })
        .collect();
    LayerStack::new(
        EmbeddingConfig::new(16, 16).init(&device),
        blocks,
        LinearConfig::new(16, 16).init(&device),
    )
}

#[test]
fn the_layer_stack_refuses_unlike_blocks_and_more_stages_than_layers() {
    let err = stack(&[(2, 64)]).expect_err("unlike blocks").to_string();
    assert!(
        err.contains("block 2") && err.contains("PipelineModel"),
        "{err}"
    );

    let model = stack(&[]).expect("alike blocks");
    assert_eq!(model.num_layers(), 6);
    let err = split_model(&model, 8, &ModelSplit::Even)
        .expect_err("8 stages of 6 layers")
        .to_string();
    assert!(
        err.contains("6 layers") && err.contains("8 stages"),
        "{err}"
    );
}

/// The stages of any split compose to the unsplit model's loss.
#[test]
fn layer_stack_stages_compose_to_the_whole_model() {
    let model = stack(&[]).expect("alike blocks");
    let ids = |shift: i64| {
        let v: Vec<i64> = (0..16).map(|i| (i * 5 + shift) % 16).collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [2, 8]), &Default::default())
    };
    let mb = MicroBatch {
        inputs: Inputs::Tokens(ids(0)),
        targets: Targets::Tokens(ids(1)),
    };
    let whole: f32 = model.loss(&mb).expect("loss").into_scalar();
    for stages in [1, 2, 3, 6] {
        let ranges = split_model(&model, stages, &ModelSplit::Even).expect("splits");
        let parts = model.stages(&ranges).expect("stages");
        let piped: f32 = run_stages(&parts, &mb).expect("runs").into_scalar();
        assert!(
            ((piped - whole) / whole).abs() <= 1e-6,
            "{stages} stages: {piped} vs {whole}"
        );
    }
}
