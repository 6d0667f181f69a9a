//! Checkpoints on a small GPT: resume equals an uninterrupted run (same and other layouts),
//! refusals name the file, and a crash between two shard writes keeps the previous one.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Int, Tensor, TensorData};

use super::*;
use burn::optim::AdamWConfig;

use crate::engine::{
    infallible, Checkpointing, LrConfig, ResumeSource, TrainConfig, TrainOutcome, Trainer,
};
use crate::model::{flatten_params, Gpt, GptConfig, Inputs, MicroBatch, Targets};
use crate::schedule::ZeroLevel;

type B = Autodiff<Flex>;

const MBS: usize = 2;
/// Samples per step: every layout below forms the same global batch (dp · M · MBS = 16).
const GLOBAL_MBS: usize = 8;
const STEPS: usize = 4;

fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        seq_len: 4,
        hidden: 8,
        heads: 2,
        layers: 4,
        mlp_ratio: 2,
        ..GptConfig::default()
    }
}

fn model() -> Gpt<B> {
    gpt_config()
        .init_seeded::<B>(7, &Default::default())
        .expect("valid config")
}

fn model_json() -> serde_json::Value {
    serde_json::to_value(gpt_config()).expect("serialisable")
}

/// A token from its coordinates, independent of the layout.
fn token(step: usize, sample: usize, pos: usize, salt: usize) -> i64 {
    let mut x = (step * 1_000_003 + sample * 10_007 + pos * 101 + salt * 7) as u64;
    x ^= x >> 13;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    (x % gpt_config().vocab_size as u64) as i64
}

/// Micro-batch `mb` of replica `d` at `step` with `m` micro-batches per replica.
fn batch(m: usize) -> impl Fn(usize, usize, usize) -> MicroBatch<B> + Sync {
    move |step, d, mb| {
        let seq = gpt_config().seq_len;
        let first = (d * m + mb) * MBS;
        let ids = |salt| {
            let v: Vec<i64> = (0..MBS)
                .flat_map(|j| (0..seq).map(move |p| token(step, first + j, p, salt)))
                .collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [MBS, seq]), &Default::default())
        };
        MicroBatch {
            inputs: Inputs::Tokens(ids(0)),
            targets: Targets::Tokens(ids(1)),
        }
    }
}

fn config(pp: usize, loops: usize, dp: usize, zero: ZeroLevel) -> TrainConfig {
    TrainConfig::new(STEPS)
        .with_pp(pp)
        .with_loops(loops)
        .with_dp(dp)
        .with_microbatches(GLOBAL_MBS / dp)
        .with_zero(zero)
        .with_adamw(AdamWConfig::new().with_weight_decay(0.1))
        .with_lr(LrConfig::WarmupCosine {
            peak: 2e-2,
            min_lr: 1e-3,
            warmup_steps: 1,
        })
        .with_max_grad_norm(1.0)
        .with_comm_timeout_secs(60.0)
}

/// A fresh, empty directory under the system's temporary directory, removed when the guard
/// drops (also when the test fails).
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("bfpp-ckpt-{name}-"))
        .tempdir()
        .expect("temp dir")
}

fn sink_for(dir: &Path, cfg: &TrainConfig, base: &Gpt<B>, keep: usize) -> DirSink<'static> {
    let program = cfg.program().expect("valid layout");
    let numels = stage_numels(base, cfg, &program).expect("split");
    let template = manifest_template(
        cfg,
        &program,
        &numels,
        model_json(),
        param_entries(base),
        serde_json::to_value(&cfg.lr).expect("serialisable"),
        7,
    );
    DirSink::new(dir, template, None, keep).expect("sink")
}

/// Trains `base` one step under `cfg` and saves that step into `dir`.
fn save_one_step(base: &Gpt<B>, cfg: &TrainConfig, dir: &Path) {
    let sink = sink_for(dir, cfg, base, 0);
    let ck = Checkpointing {
        at_end: true,
        sink: Some(&sink),
        ..Checkpointing::default()
    };
    run(base, cfg, 1, ck).expect("one step, saved");
}

fn run(
    base: &Gpt<B>,
    cfg: &TrainConfig,
    steps: usize,
    ck: Checkpointing<'_>,
) -> Result<TrainOutcome<Gpt<B>>, crate::engine::EngineError> {
    let data = infallible(batch(cfg.microbatches));
    Trainer::new(cfg.clone())
        .stop_after(steps)
        .checkpointing(ck)
        .fit(base.clone(), data)
}

fn flat(model: &Gpt<B>) -> Vec<f32> {
    flatten_params(model)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Resume `loaded` under `cfg` and train up to `STEPS`.
fn resume(loaded: &Loaded, base: &Gpt<B>, cfg: &TrainConfig) -> TrainOutcome<Gpt<B>> {
    let program = cfg.program().expect("valid layout");
    let (states, _) =
        resume_states(loaded, base, &model_json(), cfg, &program).expect("reshardable");
    let ck = Checkpointing {
        resume: &states,
        ..Checkpointing::default()
    };
    run(base, cfg, STEPS, ck).expect("resumed run")
}

#[test]
fn stage_vectors_concatenate_to_the_models_order() {
    let base = model();
    let cfg = config(2, 2, 1, ZeroLevel::Zero0);
    let program = cfg.program().expect("valid");
    let ranges = crate::model::split_model(&base, program.num_stages(), &cfg.split).expect("split");
    let stages = crate::model::PipelineModel::stages(&base, &ranges).expect("stages");
    let joined: Vec<f32> = stages
        .iter()
        .flat_map(|s| flatten_params(s).into_data().to_vec::<f32>().expect("f32"))
        .collect();
    assert_eq!(joined, flat(&base), "stage order must be the model's order");
    let names = param_entries(&base);
    assert!(names.iter().any(|p| p.name.contains("blocks")), "{names:?}");
    let stage_names: Vec<_> = stages.iter().flat_map(param_entries).collect();
    let shapes = |v: &[ParamEntry]| v.iter().map(|p| p.shape.clone()).collect::<Vec<_>>();
    assert_eq!(shapes(&stage_names), shapes(&names));
}

#[test]
fn resume_same_and_other_layouts_matches_an_uninterrupted_run() {
    let base = model();
    let saved_cfg = config(2, 2, 2, ZeroLevel::Zero3);
    let full = run(&base, &saved_cfg, STEPS, Checkpointing::default()).expect("full run");

    let scratch_dir = scratch("resume");
    let dir = scratch_dir.path().to_path_buf();
    let sink = sink_for(&dir, &saved_cfg, &base, 0);
    let ck = Checkpointing {
        at_end: true,
        sink: Some(&sink),
        ..Checkpointing::default()
    };
    let first = run(&base, &saved_cfg, 2, ck).expect("first half");
    assert_eq!(first.losses, full.losses[..2]);
    let loaded = load(&dir).expect("complete checkpoint");
    assert_eq!(loaded.manifest.step, 2);
    assert_eq!(loaded.manifest.optimizer_steps, 2);
    assert_eq!(loaded.ranks.len(), 4);

    // The same layout: the continuation is the uninterrupted run, bit for bit.
    let same = resume(&loaded, &base, &saved_cfg);
    assert_eq!(same.losses, full.losses[2..], "same-layout losses");
    assert_eq!(
        flat(&same.model),
        flat(&full.model),
        "same-layout parameters"
    );

    // Other layouts: resharded on load, equal up to the reduction order.
    for cfg in [
        config(1, 2, 1, ZeroLevel::Zero0),
        config(4, 1, 2, ZeroLevel::Zero1),
    ] {
        let other = resume(&loaded, &base, &cfg);
        assert_eq!(other.losses.len(), 2);
        for (got, want) in other.losses.iter().zip(&full.losses[2..]) {
            assert!(
                ((got - want) / want).abs() <= 1e-5,
                "pp={} dp={}: {:?} vs {:?}",
                cfg.pp,
                cfg.dp,
                other.losses,
                &full.losses[2..]
            );
        }
        let err = max_abs_diff(&flat(&other.model), &flat(&full.model));
        assert!(
            err <= 1e-5,
            "pp={} dp={}: parameter error {err}",
            cfg.pp,
            cfg.dp
        );
    }
}

#[test]
fn damaged_checkpoints_are_refused_naming_the_file() {
    let base = model();
    let cfg = config(2, 1, 1, ZeroLevel::Zero0);
    let scratch_dir = scratch("damaged");
    let dir = scratch_dir.path().to_path_buf();
    save_one_step(&base, &cfg, &dir);
    let step = dir.join(step_dir_name(1));
    let rank1 = step.join(rank_file_name(1));
    let good = std::fs::read(&rank1).expect("rank file");

    // One flipped byte in the values.
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x40;
    std::fs::write(&rank1, &bad).expect("write");
    let err = load(&dir).expect_err("corrupt shard").to_string();
    assert!(
        err.contains("rank-00001.bin") && err.contains("checksum"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&rank1).expect("read"),
        bad,
        "loading wrote nothing"
    );

    // A missing rank file.
    std::fs::remove_file(&rank1).expect("remove");
    let err = load(&dir).expect_err("missing file").to_string();
    assert!(
        err.contains("rank-00001.bin") && err.contains("missing"),
        "{err}"
    );
    std::fs::write(&rank1, &good).expect("restore");
    let loaded = load(&dir).expect("intact again");

    // A manifest from another model.
    let mut other = gpt_config();
    other.hidden = 12;
    let other_json = serde_json::to_value(other).expect("serialisable");
    let program = cfg.program().expect("valid");
    let err = resume_states(&loaded, &base, &other_json, &cfg, &program)
        .expect_err("another model")
        .to_string();
    assert!(
        err.contains("manifest.json") && err.contains("another model"),
        "{err}"
    );

    // Saving the same step again would overwrite a complete checkpoint: refused up front.
    let sink = sink_for(&dir, &cfg, &base, 0);
    let err = sink.check_free([1]).expect_err("exists").to_string();
    assert!(err.contains("step-00000001"), "{err}");
}

#[test]
fn a_crash_between_shard_writes_keeps_the_previous_checkpoint() {
    let base = model();
    let cfg = config(2, 1, 2, ZeroLevel::Zero2);
    let full = run(&base, &cfg, STEPS, Checkpointing::default()).expect("full run");
    let scratch_dir = scratch("crash");
    let dir = scratch_dir.path().to_path_buf();
    // Step 2 is saved (4 rank files); the save of step 4 dies after its first rank file.
    let sink = sink_for(&dir, &cfg, &base, 1).with_crash_after(Some(5));
    let ck = Checkpointing {
        every: 2,
        at_end: true,
        sink: Some(&sink),
        ..Checkpointing::default()
    };
    let err = run(&base, &cfg, STEPS, ck).expect_err("the save of step 4 crashed");
    assert!(err.to_string().contains("injected crash"), "{err}");
    let complete = list_checkpoints(&dir).expect("list");
    assert_eq!(
        complete.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![2]
    );
    assert!(dir.join("step-00000004.partial").is_dir());
    let loaded = load(&dir).expect("the step-2 checkpoint still loads");
    let resumed = resume(&loaded, &base, &cfg);
    assert_eq!(resumed.losses, full.losses[2..]);
    assert_eq!(flat(&resumed.model), flat(&full.model));
}

#[test]
fn keep_prunes_only_after_a_complete_save() {
    let base = model();
    let cfg = config(1, 2, 1, ZeroLevel::Zero0);
    let scratch_dir = scratch("keep");
    let dir = scratch_dir.path().to_path_buf();
    let sink = sink_for(&dir, &cfg, &base, 2);
    let ck = Checkpointing {
        every: 1,
        at_end: true,
        sink: Some(&sink),
        ..Checkpointing::default()
    };
    run(&base, &cfg, STEPS, ck).expect("run");
    let steps: Vec<usize> = list_checkpoints(&dir)
        .expect("list")
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![3, 4]);
    assert_eq!(resolve(&dir).expect("newest"), dir.join(step_dir_name(4)));
}

/// An f16 run's loss scale is part of its checkpoint. The initial scale overflows at first
/// (each such step skipped, the scale halved), so at the save after step 2 the scale is
/// below its initial value; the resumed run must continue with it and match the
/// uninterrupted run exactly, while a resume that forgot it would start over from the
/// initial scale and skip steps the uninterrupted run did not.
#[test]
fn an_f16_run_resumes_with_its_loss_scale() {
    use crate::engine::{LossScaling, Precision};
    let base = model();
    let mut cfg = config(2, 2, 1, ZeroLevel::Zero1);
    cfg.precision = Precision::F16;
    let initial = 2f64.powi(17);
    cfg.loss_scaling = LossScaling {
        initial_scale: initial,
        growth_interval: 1000,
    };
    let full = run(&base, &cfg, STEPS, Checkpointing::default()).expect("full run");
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();

    let scratch_dir = scratch("f16-scale");
    let dir = scratch_dir.path().to_path_buf();
    let sink = sink_for(&dir, &cfg, &base, 0);
    let ck = Checkpointing {
        at_end: true,
        sink: Some(&sink),
        ..Checkpointing::default()
    };
    let first = run(&base, &cfg, 2, ck).expect("first half");
    assert!(
        first.loss_scale < initial,
        "the test needs an overflow in steps 1-2 (scale {}, skipped {:?})",
        first.loss_scale,
        first.skipped_steps
    );
    let loaded = load(&dir).expect("complete checkpoint");
    for r in &loaded.ranks {
        assert_eq!(r.scaler.map(|s| s.scale), Some(first.loss_scale));
    }
    let resumed = resume(&loaded, &base, &cfg);
    assert_eq!(bits(&resumed.losses), bits(&full.losses[2..]));
    assert_eq!(resumed.loss_scale, full.loss_scale);
    let later: Vec<usize> = full
        .skipped_steps
        .iter()
        .copied()
        .filter(|&s| s > 2)
        .collect();
    assert_eq!(resumed.skipped_steps, later);
    assert_eq!(flat(&resumed.model), flat(&full.model));

    // A checkpoint without the scale (written before it was recorded) restarts from the
    // initial scale, which overflows again: the continuation differs.
    let mut forgot = loaded.clone();
    for r in &mut forgot.ranks {
        r.scaler = None;
    }
    let restarted = resume(&forgot, &base, &cfg);
    assert_ne!(
        restarted.skipped_steps, later,
        "{:?}",
        restarted.skipped_steps
    );
}

#[test]
fn each_rank_reads_exactly_its_resharded_state_by_range() {
    // Saved at P=2 V=2 D=2 ZeRO-3 (and at ZeRO-0), read back by range for layouts that cut
    // stages and shards differently: every rank's state equals the consolidated reshard.
    let base = model();
    for saved_cfg in [
        config(2, 2, 2, ZeroLevel::Zero3),
        config(2, 1, 2, ZeroLevel::Zero0),
    ] {
        let scratch_dir = scratch("by-range");
        let dir = scratch_dir.path().to_path_buf();
        save_one_step(&base, &saved_cfg, &dir);
        let loaded = load(&dir).expect("complete");
        for cfg in [
            config(1, 1, 1, ZeroLevel::Zero0),
            config(1, 2, 3, ZeroLevel::Zero3),
            config(4, 1, 2, ZeroLevel::Zero1),
            config(2, 2, 2, ZeroLevel::Zero3),
            config(3, 1, 1, ZeroLevel::Zero2),
        ] {
            let program = cfg.program().expect("valid layout");
            let (want, _) =
                resume_states(&loaded, &base, &model_json(), &cfg, &program).expect("reshards");
            let numels = stage_numels(&base, &cfg, &program).expect("split");
            let by_range = DirResume::new(CheckpointReader::open(&dir).expect("opens"), &numels)
                .expect("fits");
            assert_eq!(by_range.step(), want[0].step);
            for (rank, state) in want.iter().enumerate() {
                let held: Vec<_> = state.stages.iter().map(|s| (s.stage, s.layout)).collect();
                let got = by_range.rank_state(rank, &held).expect("reads");
                assert_eq!(&got, state, "pp={} dp={} rank {rank}", cfg.pp, cfg.dp);
            }
        }
        // Another model's stage sizes are refused before any value is read.
        let err = DirResume::new(CheckpointReader::open(&dir).expect("opens"), &[1, 2, 3])
            .expect_err("another model");
        assert!(err.to_string().contains("hold 6 values"), "{err}");
    }
}

#[test]
fn a_damaged_rank_file_is_named_by_the_rank_that_reads_it() {
    let base = model();
    let cfg = config(2, 1, 1, ZeroLevel::Zero0);
    let scratch_dir = scratch("damaged-range");
    let dir = scratch_dir.path().to_path_buf();
    save_one_step(&base, &cfg, &dir);
    let step_dir = resolve(&dir).expect("complete");
    let victim = step_dir.join(rank_file_name(1));
    let mut bytes = std::fs::read(&victim).expect("reads");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&victim, bytes).expect("writes");
    let program = cfg.program().expect("valid");
    let numels = stage_numels(&base, &cfg, &program).expect("split");
    let resume = DirResume::new(CheckpointReader::open(&dir).expect("opens"), &numels)
        .expect("sizes still match");
    let layout = |s: usize| crate::engine::ShardLayout::new(numels[s], 1, 0, ZeroLevel::Zero0);
    // Rank 0's own file is intact: it reads its state.
    resume
        .rank_state(0, &[(0, layout(0))])
        .expect("rank 0 reads");
    let err = resume
        .rank_state(1, &[(1, layout(1))])
        .expect_err("damaged");
    assert!(
        err.contains(&victim.display().to_string()) && err.contains("checksum"),
        "{err}"
    );
}
