//! [`Trainer`]: the one entry point of training. `Trainer::new(config).fit(model, data)` runs
//! the ranks as threads of this process on the model's device; the world is chosen by value
//! before `fit` (ranks on given devices, ranks over given communicators, or this process as
//! one rank of a world of processes).

use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;

use super::data::DataSource;
use super::multiprocess::train_processes;
use super::thread_world::train_world;
use super::{
    Checkpointing, EngineConfig, EngineError, StepReport, TrainConfig, TrainOutcome, TrainedStages,
    DEFAULT_TIMELINE_STEPS,
};
use crate::comm::{Communicator, LocalComm, ProcessRank, RankGrid, ThreadRank};
use crate::model::{module_to_device, recombine, ModelDescription, PipelineModel, Whole};
use crate::schedule::PipelineSchedule;

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
    #[cfg(feature = "fault-injection")]
    fault: Option<super::Fault>,
    stop_after: Option<usize>,
    timeline_steps: usize,
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
            #[cfg(feature = "fault-injection")]
            fault: None,
            stop_after: None,
            timeline_steps: DEFAULT_TIMELINE_STEPS,
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
            #[cfg(feature = "fault-injection")]
            fault: self.fault,
            stop_after: self.stop_after,
            timeline_steps: self.timeline_steps,
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

    /// Keeps every action of the last `steps` steps in the outcome's timelines (default
    /// [`DEFAULT_TIMELINE_STEPS`]; 0 keeps none). Earlier steps leave only their times and
    /// collective shares behind, so a run's memory does not grow with its length.
    pub fn timeline_steps(mut self, steps: usize) -> Self {
        self.timeline_steps = steps;
        self
    }

    /// Makes a rank fail as told, to test that a failure stops every rank with an error
    /// naming it. Only with the test-only feature `fault-injection`.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(mut self, fault: super::Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// The configuration's engine settings and programs, the fault included.
    fn prepare(&self) -> Result<(EngineConfig, PipelineSchedule), EngineError> {
        let mut engine = self.config.engine()?;
        #[cfg(feature = "fault-injection")]
        {
            engine.fault = self.fault;
        }
        engine.stop_after = self.stop_after;
        let program = engine.program()?;
        Ok((engine, program))
    }
}

impl<'a> Trainer<'a, Threads> {
    /// Trains `model` on `data`; returns the losses, the trained model (on the device it came
    /// on), the last steps' timelines and the run's counts.
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

    /// Trains the model `model` describes on `data`, every rank on the default device,
    /// building each rank's stages there (see [`ModelDescription`]): the model never exists
    /// whole. Returns the trained stages of replica 0.
    pub fn fit_described<B, M, D>(
        self,
        model: &M,
        data: D,
    ) -> Result<TrainOutcome<TrainedStages<M::Stage>>, EngineError>
    where
        B: AutodiffBackend,
        M: ModelDescription<B>,
        M::Stage: Send,
        D: DataSource<B>,
    {
        let devices = vec![Default::default(); self.config.world_size()];
        self.on_devices(devices).fit_described(model, data)
    }
}

impl<'a, Dv: Clone> Trainer<'a, ThreadsOn<Dv>> {
    /// The thread world over `self`'s devices.
    fn thread_comms<B: AutodiffBackend<Device = Dv>>(
        self,
    ) -> Result<Trainer<'a, ThreadComms<LocalComm<B::InnerBackend>>>, EngineError> {
        // Only the layout and the communication settings: the programs are compiled once,
        // by the communicator world's `fit` below.
        let engine = self.config.engine()?;
        let grid = RankGrid::new(engine.pp, engine.dp)?;
        let comms: Vec<LocalComm<B::InnerBackend>> =
            LocalComm::create_with_devices(grid, self.world.0.clone(), engine.comm_config())?;
        Ok(self.with_world(ThreadComms(comms)))
    }

    /// Trains `model` on `data` with world rank `r` on device `r`; the trained model comes
    /// back on the device `model` is on.
    pub fn fit<B, M, D>(self, model: M, data: D) -> Result<TrainOutcome<M>, EngineError>
    where
        B: AutodiffBackend<Device = Dv>,
        M: PipelineModel<B> + Clone,
        M::Stage: Send,
        D: DataSource<B>,
    {
        self.thread_comms::<B>()?.fit(model, data)
    }

    /// Trains the model `model` describes on `data` with world rank `r` on device `r`, each
    /// rank's stages built on its device.
    pub fn fit_described<B, M, D>(
        self,
        model: &M,
        data: D,
    ) -> Result<TrainOutcome<TrainedStages<M::Stage>>, EngineError>
    where
        B: AutodiffBackend<Device = Dv>,
        M: ModelDescription<B>,
        M::Stage: Send,
        D: DataSource<B>,
    {
        self.thread_comms::<B>()?.fit_described(model, data)
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
        let home = model.devices().into_iter().next().unwrap_or_default();
        let model = Whole(model);
        let outcome = self.fit_described(&model, data)?;
        outcome.try_map_model(|trained| {
            let stages: Vec<M::Stage> = trained
                .stages
                .into_iter()
                .map(|s| module_to_device(s, &home))
                .collect();
            recombine(model.0, &stages).map_err(EngineError::from)
        })
    }

    /// Trains the model `model` describes on `data` with a thread per communicator, each
    /// rank's stages built on its communicator's device.
    pub fn fit_described<B, M, D>(
        self,
        model: &M,
        data: D,
    ) -> Result<TrainOutcome<TrainedStages<M::Stage>>, EngineError>
    where
        B: AutodiffBackend,
        M: ModelDescription<B>,
        M::Stage: Send,
        C: ThreadRank + Communicator<B::InnerBackend>,
        D: DataSource<B>,
    {
        let (engine, program) = self.prepare()?;
        let Trainer {
            world,
            checkpointing,
            on_step,
            timeline_steps,
            ..
        } = self;
        train_world(
            model,
            &engine,
            program,
            world.0,
            &data,
            &on_step,
            checkpointing,
            timeline_steps,
        )
    }
}

impl<'a, C> Trainer<'a, ProcessWorld<'a, C>> {
    /// Trains this process's rank of `model` on `data`; world rank 0 returns the outcome
    /// (every rank's timeline and counts, the trained model), the other ranks `None`. Every
    /// process holds the model it was given; rank 0 also receives the other ranks' trained
    /// stages to assemble it, so this is for models one process can hold:
    /// [`Trainer::fit_described`] is for the others.
    pub fn fit<B, M, D>(self, model: M, data: D) -> Result<Option<TrainOutcome<M>>, EngineError>
    where
        B: AutodiffBackend,
        M: PipelineModel<B> + Clone,
        C: ProcessRank<B::InnerBackend>,
        D: DataSource<B>,
    {
        let model = Whole(model);
        let outcome = self.run_process(&model, data, Some(&model.0))?;
        outcome
            .map(|o| {
                o.try_map_model(|m| {
                    m.ok_or_else(|| {
                        EngineError::RankFailure("rank 0 assembled no trained model".into())
                    })
                })
            })
            .transpose()
    }

    /// Trains this process's rank of the model `model` describes on `data`, building only
    /// this rank's stages; world rank 0 returns the outcome, the other ranks `None`. The
    /// trained weights stay on their ranks ([`TrainedStages`] is empty): save them with a
    /// checkpoint ([`Trainer::checkpointing`]).
    pub fn fit_described<B, M, D>(
        self,
        model: &M,
        data: D,
    ) -> Result<Option<TrainOutcome<TrainedStages<M::Stage>>>, EngineError>
    where
        B: AutodiffBackend,
        M: ModelDescription<B>,
        C: ProcessRank<B::InnerBackend>,
        D: DataSource<B>,
    {
        let outcome = self.run_process::<B, M, D, M::Stage>(model, data, None)?;
        outcome
            .map(|o| {
                o.try_map_model(|_| Ok::<_, EngineError>(TrainedStages { stages: Vec::new() }))
            })
            .transpose()
    }

    /// The body of both `fit`s: with `whole`, rank 0 assembles the trained model into a copy
    /// of it.
    fn run_process<B, M, D, W>(
        self,
        model: &M,
        data: D,
        whole: Option<&W>,
    ) -> Result<Option<TrainOutcome<Option<W>>>, EngineError>
    where
        B: AutodiffBackend,
        M: ModelDescription<B>,
        W: Module<B> + Clone,
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
        let Trainer {
            world,
            checkpointing,
            on_step,
            timeline_steps,
            ..
        } = self;
        train_processes(
            world.0,
            model,
            whole,
            &engine,
            program,
            &data,
            &on_step,
            checkpointing,
            timeline_steps,
        )
    }
}
