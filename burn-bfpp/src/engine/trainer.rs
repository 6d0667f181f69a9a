//! [`Trainer`]: the one entry point of training. `Trainer::new(config).fit(model, data)` runs
//! the ranks as threads of this process on the model's device; the world is chosen by value
//! before `fit` (ranks on given devices, ranks over given communicators, or this process as
//! one rank of a world of processes).

use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;

use super::data::DataSource;
use super::multiprocess::train_processes;
use super::{
    train_world, Checkpointing, EngineConfig, EngineError, Fault, StepReport, TrainConfig,
    TrainOutcome,
};
use crate::comm::{CommError, Communicator, LocalComm, ProcessRank, RankGrid, ThreadRank};
use crate::model::{
    split_model, MicroBatch, ModelError, PipelineModel, PipelineStage, StageInput, StageOutput,
};
use crate::schedule::{ActionKind, PipelineSchedule};

/// The ranks as threads of this process, all on the model's device (the default world).
#[derive(Debug, Clone, Copy, Default)]
pub struct Threads;

/// The ranks as threads of this process, world rank `r` on `devices[r]` (one GPU per rank, or
/// several ranks per GPU): [`Trainer::on_devices`].
#[derive(Debug, Clone)]
pub struct ThreadsOn<D>(Vec<D>);

/// The ranks as threads of this process over communicators the caller made, one per world
/// rank (`NcclComm::create` for NCCL between GPUs): [`Trainer::with_comms`].
#[derive(Debug)]
pub struct ThreadComms<C>(Vec<C>);

/// This process as one rank of a world of processes (an `MpiComm` for CPU ranks, an
/// `NcclComm` for GPU ranks): [`Trainer::in_process`].
#[derive(Debug)]
pub struct ProcessWorld<'c, C>(&'c C);

/// A training run: its configuration, its world of ranks, and what it reports or saves on
/// the way. See the [module docs](self).
///
/// ```
/// use burn::backend::{Autodiff, Flex};
/// use burn::tensor::{Int, Tensor};
/// use burn_bfpp::engine::{infallible, TrainConfig, Trainer};
/// use burn_bfpp::model::{GptConfig, Inputs, MicroBatch, Targets};
///
/// type B = Autodiff<Flex>;
/// let gpt = GptConfig { vocab_size: 16, seq_len: 8, hidden: 16, heads: 2, layers: 2, ..GptConfig::default() };
/// let model = gpt.init_seeded::<B>(0, &Default::default()).unwrap();
/// let tokens = |step: usize, mb: usize| {
///     let ids: Vec<i64> = (0..16).map(|i| ((step + mb + i) % 16) as i64).collect();
///     Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &Default::default()).reshape([2, 8])
/// };
/// let data = infallible(move |step, _dp, mb| MicroBatch {
///     inputs: Inputs::Tokens(tokens(step, mb)),
///     targets: Targets::Tokens(tokens(step + 1, mb)),
/// });
/// let config = TrainConfig::new(2).with_pp(2).with_microbatches(2);
/// let outcome = Trainer::new(config).fit(model, data).unwrap();
/// assert_eq!(outcome.losses.len(), 2);
/// ```
pub struct Trainer<'a, W = Threads> {
    config: TrainConfig,
    world: W,
    checkpointing: Checkpointing<'a>,
    on_step: Box<dyn Fn(&StepReport) + Sync + 'a>,
    fault: Option<Fault>,
    stop_after: Option<usize>,
}

impl std::fmt::Debug for Trainer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<'a> Trainer<'a, Threads> {
    /// A run of `config`, with the ranks as threads of this process on the model's device.
    pub fn new(config: TrainConfig) -> Self {
        Trainer {
            config,
            world: Threads,
            checkpointing: Checkpointing::default(),
            on_step: Box::new(|_| {}),
            fault: None,
            stop_after: None,
        }
    }
}

impl<'a, W> Trainer<'a, W> {
    /// The run's configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    fn with_world<V>(self, world: V) -> Trainer<'a, V> {
        Trainer {
            config: self.config,
            world,
            checkpointing: self.checkpointing,
            on_step: self.on_step,
            fault: self.fault,
            stop_after: self.stop_after,
        }
    }

    /// The ranks as threads, world rank `r` computing on `devices[r]`; `devices` must hold
    /// `pp × dp` devices. Activations cross devices through host memory.
    pub fn on_devices<D>(self, devices: Vec<D>) -> Trainer<'a, ThreadsOn<D>> {
        self.with_world(ThreadsOn(devices))
    }

    /// The ranks as threads over `comms`, one communicator per world rank of a `pp × dp`
    /// world (index = world rank); each rank computes on its communicator's device.
    pub fn with_comms<C>(self, comms: Vec<C>) -> Trainer<'a, ThreadComms<C>> {
        self.with_world(ThreadComms(comms))
    }

    /// This process as the rank of `comm` in a world of processes: every process of the world
    /// calls `fit` with an identically initialised model and the same configuration; world
    /// rank 0 gets the outcome. The communicator stays the caller's, for further runs.
    pub fn in_process<C>(self, comm: &'a C) -> Trainer<'a, ProcessWorld<'a, C>> {
        self.with_world(ProcessWorld(comm))
    }

    /// Calls `report` after every optimizer step on the rank that holds the last stage of
    /// replica 0 (progress bars, metrics files).
    pub fn on_step(mut self, report: impl Fn(&StepReport) + Sync + 'a) -> Self {
        self.on_step = Box::new(report);
        self
    }

    /// Resumes from saved rank states and saves checkpoints (see [`Checkpointing`]).
    pub fn checkpointing(mut self, checkpointing: Checkpointing<'a>) -> Self {
        self.checkpointing = checkpointing;
        self
    }

    /// Stops after optimizer step `step` (with [`Checkpointing::at_end`], saving there), as
    /// an interrupted run would; the learning-rate schedule still spans the configuration's
    /// `steps`, so a run resumed from that checkpoint continues it exactly. For training a
    /// long schedule in pieces.
    pub fn stop_after(mut self, step: usize) -> Self {
        self.stop_after = Some(step);
        self
    }

    /// Makes a rank fail as told, to test that a failure stops every rank with an error
    /// naming it.
    pub fn inject_fault(mut self, fault: Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// The configuration's engine settings and programs, the fault included.
    fn prepare(&self) -> Result<(EngineConfig, PipelineSchedule), EngineError> {
        let mut engine = self.config.engine()?;
        engine.fault = self.fault;
        engine.stop_after = self.stop_after;
        let program = engine.program()?;
        Ok((engine, program))
    }
}

impl<'a> Trainer<'a, Threads> {
    /// Trains `model` on `data`; returns the losses, the trained model (on the device it came
    /// on), every rank's timeline and the run's counts.
    pub fn fit<B, M, D>(self, model: M, data: D) -> Result<TrainOutcome<M>, EngineError>
    where
        B: AutodiffBackend,
        M: PipelineModel<B> + Clone,
        M::Stage: Send,
        D: DataSource<B>,
    {
        let device = model.devices().into_iter().next().unwrap_or_default();
        let devices = vec![device; self.config.world_size()];
        self.on_devices(devices).fit(model, data)
    }
}

impl<'a, Dv: Clone> Trainer<'a, ThreadsOn<Dv>> {
    /// Trains `model` on `data` with world rank `r` on device `r`; the trained model comes
    /// back on the device `model` is on.
    pub fn fit<B, M, D>(self, model: M, data: D) -> Result<TrainOutcome<M>, EngineError>
    where
        B: AutodiffBackend<Device = Dv>,
        M: PipelineModel<B> + Clone,
        M::Stage: Send,
        D: DataSource<B>,
    {
        // Only the layout and the communication settings: the programs are compiled once,
        // by the communicator world's `fit` below.
        let engine = self.config.engine()?;
        let grid = RankGrid::new(engine.pp, engine.dp)?;
        let comms: Vec<LocalComm<B::InnerBackend>> =
            LocalComm::create_with_devices(grid, self.world.0.clone(), engine.comm_config())?;
        self.with_world(ThreadComms(comms)).fit(model, data)
    }
}

impl<'a, C> Trainer<'a, ThreadComms<C>> {
    /// Trains `model` on `data` with a thread per communicator.
    pub fn fit<B, M, D>(self, model: M, data: D) -> Result<TrainOutcome<M>, EngineError>
    where
        B: AutodiffBackend,
        M: PipelineModel<B> + Clone,
        M::Stage: Send,
        C: ThreadRank + Communicator<B::InnerBackend>,
        D: DataSource<B>,
    {
        let (engine, program) = self.prepare()?;
        let shapes = dry_run(&model, &engine, &program, &data, &self.checkpointing)?;
        let Trainer {
            world,
            checkpointing,
            on_step,
            ..
        } = self;
        train_world(
            &model,
            &engine,
            program,
            world.0,
            shapes,
            &data,
            &on_step,
            checkpointing,
        )
    }
}

impl<'a, C> Trainer<'a, ProcessWorld<'a, C>> {
    /// Trains this process's rank of `model` on `data`; world rank 0 returns the outcome
    /// (every rank's timeline and counts, the trained model), the other ranks `None`.
    pub fn fit<B, M, D>(self, model: M, data: D) -> Result<Option<TrainOutcome<M>>, EngineError>
    where
        B: AutodiffBackend,
        M: PipelineModel<B> + Clone,
        C: ProcessRank<B::InnerBackend>,
        D: DataSource<B>,
    {
        let (engine, program) = match self.prepare() {
            Ok(prepared) => prepared,
            Err(e) => {
                // Every process checks the same configuration, but tell the others anyway.
                self.world.0.abort(&e.to_string());
                return Err(e);
            }
        };
        let shapes = match dry_run(&model, &engine, &program, &data, &self.checkpointing) {
            Ok(shapes) => shapes,
            Err(e) => {
                self.world.0.abort(&e.to_string());
                return Err(e);
            }
        };
        let Trainer {
            world,
            checkpointing,
            on_step,
            ..
        } = self;
        train_processes(
            world.0,
            &model,
            &engine,
            program,
            shapes,
            &data,
            &on_step,
            checkpointing,
        )
    }
}

/// The shapes a run's tensors have, from its dry run: the micro-batches' inputs and targets,
/// and the activation that crosses every stage boundary (`s → s + 1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shapes {
    pub(crate) activations: Vec<[usize; 3]>,
    pub(crate) inputs: Vec<usize>,
    pub(crate) targets: Vec<usize>,
    /// The last stage's [`PipelineStage::target_classes`].
    pub(crate) target_classes: Option<usize>,
}

impl Shapes {
    /// Fails, saying how, unless `batch` has the dry run's shapes.
    pub(crate) fn check<B: burn::tensor::backend::Backend>(
        &self,
        batch: &MicroBatch<B>,
    ) -> Result<(), String> {
        let (inputs, targets) = batch_dims(batch);
        if inputs != self.inputs || targets != self.targets {
            return Err(format!(
                "inputs of shape {inputs:?} and targets of shape {targets:?}, where the first \
                 micro-batch had {:?} and {:?}: every micro-batch must have one shape",
                self.inputs, self.targets
            ));
        }
        Ok(())
    }
}

/// The shapes of a micro-batch's inputs and targets.
fn batch_dims<B: burn::tensor::backend::Backend>(
    batch: &MicroBatch<B>,
) -> (Vec<usize>, Vec<usize>) {
    use crate::model::{Inputs, Targets};
    let inputs = match &batch.inputs {
        Inputs::Tokens(t) => t.dims().to_vec(),
        Inputs::Features(t) => t.dims().to_vec(),
    };
    let targets = match &batch.targets {
        Targets::Tokens(t) => t.dims().to_vec(),
        Targets::Values(t) => t.dims().to_vec(),
    };
    (inputs, targets)
}

/// The dry run: the first micro-batch through the stages on one device, without gradients,
/// for the shapes of the activation that crosses every stage boundary and of the data.
/// Refuses a split whose stages do not return activations where they should, or whose last
/// stage does not return a loss.
pub(crate) fn dry_run<B, M, D>(
    model: &M,
    engine: &EngineConfig,
    program: &PipelineSchedule,
    data: &D,
    checkpointing: &Checkpointing<'_>,
) -> Result<Shapes, EngineError>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
    D: DataSource<B>,
{
    let ranges = split_model(model, program.num_stages(), &engine.split)?;
    let stages = model.stages(&ranges)?;
    let step = checkpointing.start_step() + 1;
    let device = model.devices().into_iter().next().unwrap_or_default();
    let batch: MicroBatch<B> = data
        .micro_batch(step, 0, 0)
        .map_err(|e| EngineError::Data {
            rank: 0,
            step,
            microbatch: 0,
            reason: format!(
                "the data source failed: {e} (the first micro-batch, read to size the \
                 activations)"
            ),
        })?
        .to_device(&device);
    let (inputs, targets) = batch_dims(&batch);
    let mut activations = Vec::with_capacity(stages.len().saturating_sub(1));
    let mut input = StageInput::Data(batch.inputs.clone());
    let last = stages.len().saturating_sub(1);
    let split_backward = program.ranks.iter().flatten().any(|a| {
        matches!(
            a.kind,
            ActionKind::BackwardInput | ActionKind::BackwardWeight
        )
    });
    for (s, stage) in stages.into_iter().enumerate() {
        if split_backward && !stage.splits_weight_grads() {
            return Err(ModelError::Split(format!(
                "stage {s} (layers {:?}) does not defer its weight gradients, and the schedule \
                 splits each backward into I (input gradient) and W (weight gradients): build \
                 the stage's matrix products from burn_bfpp::model::SplitLinear and return \
                 true from `splits_weight_grads`, or choose a schedule with a full backward \
                 (gpipe, 1f1b, interleaved, breadth-first)",
                stage.layers()
            ))
            .into());
        }
        // No gradients: nothing of the dry run is kept.
        let stage = stage.no_grad();
        let targets_in = (s == last).then_some(&batch.targets);
        let target_classes = stage.target_classes();
        match (stage.forward(input, targets_in)?, s == last) {
            (StageOutput::Hidden(h), false) => {
                activations.push(h.dims());
                input = StageInput::Hidden(h);
            }
            (StageOutput::Loss(_), true) => {
                return Ok(Shapes {
                    activations,
                    inputs,
                    targets,
                    target_classes,
                })
            }
            (StageOutput::Loss(_), false) => {
                return Err(ModelError::Split(format!(
                    "stage {s} of {} returned a loss: only the last stage may hold the head",
                    last + 1
                ))
                .into())
            }
            (StageOutput::Hidden(_), true) => {
                return Err(ModelError::Split(
                    "the last stage returned activations, not a loss: its layers must end \
                     with the model's head (its loss)"
                        .into(),
                )
                .into())
            }
        }
    }
    Err(EngineError::from(CommError::InvalidGrid {
        pp: engine.pp,
        dp: engine.dp,
        reason: "the schedule has no stages".into(),
    }))
}
