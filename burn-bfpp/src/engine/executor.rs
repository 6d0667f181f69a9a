//! The interpreter: runs one rank's lowered action list, one optimizer step at a time.
//!
//! It makes no scheduling decision of its own. Every transfer, gather, free and reduction
//! happens where the lowered list puts it, so what runs is exactly what the validator checked
//! and what the simulator timed.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor, TensorData};

use super::nonfinite::{NonFinitePolicy, NonFiniteReport, GRADIENT, LOSS};
use super::precision::{LossScaler, LossScaling, Precision, ScalerState};
use super::stage::{in_dtype, pad, LocalStage};
use super::{EngineError, TimedEvent};
use crate::comm::{Communicator, Group, ReduceOp};
use crate::model::{
    autodiff_lock, flatten_grads, fresh_leaves, input_grad, input_leaf, loss_backward,
    release_params, stage_backward, MicroBatch, PipelineStage, StageInput, StageOutput,
};
use crate::optim::{clip_coefficient, clip_grad, sq_norm};
use crate::schedule::{Action, ActionKind, ZeroLevel};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

mod collectives;
use collectives::InFlight;

/// A stage run: the module copy it used, its input leaf (if not the first stage), its output.
type StageRun<B, S> = (S, Option<Tensor<B, 3>>, StageOutput<B>);

/// What a rank hands back after its last step.
pub(crate) struct Finished<S> {
    /// Its stages, by global index, with their final weights.
    pub(crate) stages: Vec<(usize, S)>,
    /// Every action it ran.
    pub(crate) events: Vec<TimedEvent>,
    /// Highest bytes of parameter values it held.
    pub(crate) peak_param_bytes: usize,
}

/// What a forward keeps for its backward.
struct Saved<B: AutodiffBackend, S> {
    /// The module copy whose parameter leaves this micro-batch's graph starts from.
    module: Option<S>,
    /// The input leaf (None for the first stage, whose input is data).
    leaf: Option<Tensor<B, 3>>,
    /// The output (None under recomputation: the backward runs the forward again).
    output: Option<StageOutput<B>>,
    /// The input value, kept under recomputation to rebuild the leaf.
    input: Option<Tensor<Inner<B>, 3>>,
}

/// Tag of the transfer that leaves `stage` for micro-batch `mb` (`backward`: gradient).
fn tag(stage: usize, mb: usize, backward: bool) -> u64 {
    ((stage as u64) << 33) | ((mb as u64) << 1) | u64::from(backward)
}

/// Settings shared by every rank's executor.
#[derive(Debug, Clone)]
pub(crate) struct ExecutorSettings {
    pub(crate) zero: ZeroLevel,
    pub(crate) recompute: bool,
    pub(crate) microbatches: usize,
    pub(crate) num_stages: usize,
    /// Pipeline rank of every stage.
    pub(crate) stage_ranks: Vec<usize>,
    /// Shape of every activation passed between stages.
    pub(crate) activation_shape: [usize; 3],
    pub(crate) max_grad_norm: f64,
    /// What a step with a non-finite loss or gradient norm does.
    pub(crate) on_nonfinite: NonFinitePolicy,
    /// The dtype the stages compute in.
    pub(crate) precision: Precision,
    /// Dynamic loss scaling (f16).
    pub(crate) loss_scaling: LossScaling,
}

/// What one optimizer step produced on a rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepOutcome {
    /// The step's mean loss over the global batch, on ranks holding the last stage.
    pub(crate) loss: Option<f64>,
    /// Whether the update was skipped (non-finite loss or gradient norm, policy `skip`).
    pub(crate) skipped: bool,
}

/// One rank's interpreter and its state.
pub(crate) struct RankExecutor<'c, B: AutodiffBackend, S, C> {
    comm: &'c C,
    settings: ExecutorSettings,
    program: Vec<Action>,
    pub(crate) stages: Vec<LocalStage<B, S>>,
    /// Index into `stages` of each global stage held here.
    slot: HashMap<usize, usize>,
    dp_index: usize,
    // Per-step state, keyed by (stage, micro-batch).
    inputs: HashMap<(usize, usize), Tensor<Inner<B>, 3>>,
    saved: HashMap<(usize, usize), Saved<B, S>>,
    out_grads: HashMap<(usize, usize), Tensor<Inner<B>, 3>>,
    to_send_forward: HashMap<(usize, usize), Tensor<Inner<B>, 3>>,
    to_send_backward: HashMap<(usize, usize), Tensor<Inner<B>, 3>>,
    losses: Vec<f64>,
    /// Recorded actions of the run: (step, action, start, end) in seconds since `epoch`.
    pub(crate) events: Vec<TimedEvent>,
    epoch: Instant,
    /// Highest [`LocalStage::param_bytes`] total seen.
    pub(crate) peak_param_bytes: usize,
    /// Make this step's losses and gradients NaN (an injected fault, for tests).
    pub(crate) poison: bool,
    /// The loss scale (f16) and its history of good steps.
    scaler: LossScaler,
    /// Data-parallel collectives started and not yet finished, oldest first.
    in_flight: VecDeque<InFlight<Inner<B>>>,
}

impl<'c, B, S, C> RankExecutor<'c, B, S, C>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<Inner<B>>,
{
    pub(crate) fn new(
        comm: &'c C,
        settings: ExecutorSettings,
        program: Vec<Action>,
        stages: Vec<LocalStage<B, S>>,
        epoch: Instant,
    ) -> Self {
        let slot = stages
            .iter()
            .enumerate()
            .map(|(i, s)| (s.index, i))
            .collect();
        let dp_index = comm.group_rank(Group::DataParallel);
        let scaler = LossScaler::new(settings.precision, settings.loss_scaling);
        let mut exec = RankExecutor {
            comm,
            settings,
            program,
            stages,
            slot,
            dp_index,
            inputs: HashMap::new(),
            saved: HashMap::new(),
            out_grads: HashMap::new(),
            to_send_forward: HashMap::new(),
            to_send_backward: HashMap::new(),
            losses: Vec::new(),
            events: Vec::new(),
            epoch,
            peak_param_bytes: 0,
            poison: false,
            scaler,
            in_flight: VecDeque::new(),
        };
        exec.note_memory();
        exec
    }

    /// The current loss scale (1 unless f16).
    /// The loss scaler's state, for a checkpoint.
    pub(crate) fn scaler_state(&self) -> Option<ScalerState> {
        self.scaler.state()
    }

    /// Continue with a checkpoint's loss scale.
    pub(crate) fn restore_scaler(&mut self, state: ScalerState) {
        self.scaler.restore(state);
    }

    pub(crate) fn loss_scale(&self) -> f64 {
        self.scaler.scale
    }

    fn note_memory(&mut self) {
        let bytes = self.stages.iter().map(LocalStage::param_bytes).sum();
        self.peak_param_bytes = self.peak_param_bytes.max(bytes);
    }

    fn local(&self, stage: usize) -> bool {
        self.slot.contains_key(&stage)
    }

    fn stage_mut(&mut self, stage: usize) -> Result<&mut LocalStage<B, S>, EngineError> {
        let i = *self.slot.get(&stage).ok_or_else(|| {
            EngineError::Config(format!(
                "the program names stage {stage}, which this rank does not hold"
            ))
        })?;
        Ok(&mut self.stages[i])
    }

    /// World rank of the data-parallel replica of the rank holding `stage`.
    fn peer(&self, stage: usize) -> usize {
        self.comm
            .grid()
            .rank_of(self.settings.stage_ranks[stage], self.dp_index)
    }

    /// Run the rank's program for one optimizer step (1-based `step`) and update the owned
    /// shards with learning rate `lr` (unless the step is not finite and the policy skips
    /// it). Returns the step's mean loss on ranks holding the last stage.
    pub(crate) fn step(
        &mut self,
        step: usize,
        lr: f64,
        batch: &(dyn Fn(usize, usize) -> MicroBatch<B> + Sync),
    ) -> Result<StepOutcome, EngineError> {
        self.losses.clear();
        let program = std::mem::take(&mut self.program);
        let result: Result<(), EngineError> = program.iter().try_for_each(|&action| {
            self.finish_needed_by(step, action)?;
            self.timed(step, action, |exec| exec.run(action, batch))
        });
        self.program = program;
        result?;
        self.finish_collectives(step, self.in_flight.len())?;
        let skipped = self.optimizer_step(step, lr)?;
        Ok(StepOutcome {
            loss: self.step_loss()?,
            skipped,
        })
    }

    fn run(
        &mut self,
        action: Action,
        batch: &(dyn Fn(usize, usize) -> MicroBatch<B> + Sync),
    ) -> Result<(), EngineError> {
        let (s, m) = (action.stage, action.mb());
        match action.kind {
            ActionKind::Forward => self.forward(s, m, batch),
            ActionKind::Backward => self.backward(s, m, batch),
            ActionKind::BackwardInput | ActionKind::BackwardWeight => Err(EngineError::Config(
                "split backward (I/W) is not executed yet; generate schedules with full B".into(),
            )),
            ActionKind::SendForward => {
                let t = self
                    .to_send_forward
                    .remove(&(s, m))
                    .ok_or(EngineError::Missing {
                        what: "forward output",
                        stage: s,
                        microbatch: m,
                    })?;
                let peer = self.peer(s + 1);
                Ok(self.comm.send(peer, tag(s, m, false), t)?)
            }
            ActionKind::SendBackward => {
                let t = self
                    .to_send_backward
                    .remove(&(s, m))
                    .ok_or(EngineError::Missing {
                        what: "input gradient",
                        stage: s,
                        microbatch: m,
                    })?;
                let peer = self.peer(s - 1);
                Ok(self.comm.send(peer, tag(s, m, true), t)?)
            }
            ActionKind::RecvForward => {
                let peer = self.peer(s - 1);
                let t =
                    self.comm
                        .recv(peer, tag(s - 1, m, false), self.settings.activation_shape)?;
                self.inputs.insert((s, m), t);
                Ok(())
            }
            ActionKind::RecvBackward => {
                let peer = self.peer(s + 1);
                let t =
                    self.comm
                        .recv(peer, tag(s + 1, m, true), self.settings.activation_shape)?;
                self.out_grads.insert((s, m), t);
                Ok(())
            }
            ActionKind::Unshard => self.unshard(s),
            ActionKind::Reshard => {
                let stage = self.stage_mut(s)?;
                let _autodiff = autodiff_lock();
                // Free the gathered values for real: the next UNSHARD refills them.
                stage.module = release_params(stage.module.clone());
                stage.gathered = false;
                Ok(())
            }
            ActionKind::ReduceGrad => self.reduce_grad(s),
        }
    }

    /// Forward of micro-batch `m` through stage `s`; keeps what the backward needs and hands
    /// the output to the next stage (in memory if it is local, else queued for `SEND_F`).
    fn forward(
        &mut self,
        s: usize,
        m: usize,
        batch: &(dyn Fn(usize, usize) -> MicroBatch<B> + Sync),
    ) -> Result<(), EngineError> {
        let value = if s == 0 {
            None
        } else {
            Some(self.inputs.remove(&(s, m)).ok_or(EngineError::Missing {
                what: "input activation",
                stage: s,
                microbatch: m,
            })?)
        };
        let (module, leaf, output) = self.run_stage(s, m, value.clone(), batch)?;
        let autodiff = autodiff_lock();
        let (out, loss) = match &output {
            // Activations travel as fp32 (exact for half values): see super::precision.
            StageOutput::Hidden(h) => (Some(in_dtype(h.clone().inner(), DType::F32)), None),
            StageOutput::Loss(l) => {
                let loss = l.clone().into_scalar().elem::<f64>();
                (None, Some(if self.poison { f64::NAN } else { loss }))
            }
        };
        let saved = if self.settings.recompute {
            drop((module, leaf, output));
            Saved {
                module: None,
                leaf: None,
                output: None,
                input: value,
            }
        } else {
            Saved {
                module: Some(module),
                leaf,
                output: Some(output),
                input: None,
            }
        };
        drop(autodiff);
        self.saved.insert((s, m), saved);
        self.losses.extend(loss);
        if let Some(out) = out {
            if self.local(s + 1) {
                self.inputs.insert((s + 1, m), out);
            } else {
                self.to_send_forward.insert((s, m), out);
            }
        }
        Ok(())
    }

    /// Run stage `s` on micro-batch `m` with `value` as its input (None: the data).
    fn run_stage(
        &mut self,
        s: usize,
        m: usize,
        value: Option<Tensor<Inner<B>, 3>>,
        batch: &(dyn Fn(usize, usize) -> MicroBatch<B> + Sync),
    ) -> Result<StageRun<B, S>, EngineError> {
        let last = s + 1 == self.settings.num_stages;
        let data = (s == 0 || last).then(|| batch(self.dp_index, m));
        // Burn 0.21's autodiff registry is process-wide and not safe to drive from several
        // threads (see crate::model::autodiff): record graphs only while holding the lock,
        // and never hold it across a blocking communication.
        let compute = self.settings.precision.dtype();
        let _autodiff = autodiff_lock();
        let (input, leaf) = match (value, &data) {
            (Some(v), _) => {
                let leaf = input_leaf(Tensor::<B, 3>::from_inner(in_dtype(v, compute)));
                (StageInput::Hidden(leaf.clone()), Some(leaf))
            }
            (None, Some(d)) => (StageInput::Data(d.inputs.clone()), None),
            (None, None) => {
                return Err(EngineError::Missing {
                    what: "input activation",
                    stage: s,
                    microbatch: m,
                })
            }
        };
        let targets = if last {
            data.as_ref().map(|d| &d.targets)
        } else {
            None
        };
        // Fresh parameter leaves for every micro-batch keep each (stage, micro-batch) graph
        // self-contained: Burn 0.21 merges graphs that share leaves, and with ranks as
        // threads the merged graphs of different micro-batches were seen to lose gradient
        // contributions depending on the interleaving.
        let module = fresh_leaves(&self.stage_mut(s)?.module);
        let output = module.forward(input, targets)?;
        Ok((module, leaf, output))
    }

    /// Backward of micro-batch `m` through stage `s`: accumulates the parameter gradients and
    /// hands the input gradient to the previous stage.
    fn backward(
        &mut self,
        s: usize,
        m: usize,
        batch: &(dyn Fn(usize, usize) -> MicroBatch<B> + Sync),
    ) -> Result<(), EngineError> {
        let saved = self.saved.remove(&(s, m)).ok_or(EngineError::Missing {
            what: "saved forward",
            stage: s,
            microbatch: m,
        })?;
        let (module, leaf, output) = match (saved.module, saved.output) {
            (Some(module), Some(output)) => (module, saved.leaf, output),
            _ => self.run_stage(s, m, saved.input, batch)?,
        };
        // Taken before the lock: a missing gradient is an error, not a wait.
        let out_grad = self.out_grads.remove(&(s, m));
        // The loss scale (f16) multiplies the seed of the backward; the parameter gradients
        // are divided by it again below, in fp32, and the input gradient stays scaled.
        let loss_scale = self.scaler.scale;
        let scale = loss_scale / self.settings.microbatches as f64;
        let compute = self.settings.precision.dtype();
        let local_prev = s > 0 && self.local(s - 1);
        let poison = self.poison;
        let autodiff = autodiff_lock();
        let grads = match &output {
            StageOutput::Loss(loss) => loss_backward(loss, scale),
            StageOutput::Hidden(h) => {
                let g = out_grad.ok_or(EngineError::Missing {
                    what: "output gradient",
                    stage: s,
                    microbatch: m,
                })?;
                stage_backward(h, in_dtype(g, compute))?
            }
        };
        let in_grad = leaf
            .as_ref()
            .map(|leaf| in_dtype(input_grad(leaf, &grads), DType::F32));
        let stage = self.stage_mut(s)?;
        let mut flat = in_dtype(flatten_grads(&module, &grads), DType::F32);
        if loss_scale != 1.0 {
            flat = flat.mul_scalar(1.0 / loss_scale);
        }
        let mut flat = pad(flat, stage.layout.padded);
        if poison {
            flat = flat.mul_scalar(f32::NAN);
        }
        // Autodiff values are dropped under the lock too: dropping touches the registry.
        drop((grads, output, leaf, module));
        drop(autodiff);
        stage.grad_window = Some(match stage.grad_window.take() {
            Some(acc) => acc + flat,
            None => flat,
        });
        if let Some(g) = in_grad {
            if local_prev {
                self.out_grads.insert((s - 1, m), g);
            } else {
                self.to_send_backward.insert((s, m), g);
            }
        }
        Ok(())
    }

    /// Runs `work` on behalf of `action` of `step`: its time goes into the timeline under
    /// `action`, and its error names the rank, the step and `action`.
    fn timed(
        &mut self,
        step: usize,
        action: Action,
        work: impl FnOnce(&mut Self) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let start = self.epoch.elapsed().as_secs_f64();
        work(self).map_err(|source| EngineError::Action {
            rank: self.comm.rank(),
            step,
            action,
            source: Box::new(source),
        })?;
        let end = self.epoch.elapsed().as_secs_f64();
        self.events.push(TimedEvent {
            step,
            action,
            start,
            end,
        });
        Ok(())
    }

    /// Clip by the global gradient norm and update every owned shard; returns whether the
    /// update was skipped.
    ///
    /// The squared norm travels with the non-finite flags (see [`super::nonfinite`]) in one
    /// all-reduce per group, so every rank learns the same norm and the same flags and takes
    /// the same decision.
    fn optimizer_step(&mut self, step: usize, lr: f64) -> Result<bool, EngineError> {
        let stage_sq: Vec<f64> = self
            .stages
            .iter()
            .map(|st| st.grad_owned.as_ref().map_or(0.0, sq_norm))
            .collect();
        let local_sq: f64 = stage_sq.iter().sum();
        let num_stages = self.settings.num_stages;
        let dp = self.comm.grid().dp();
        // Slot 0: the squared norm; then one flag per (replica, stage), written by its holder.
        let mut values = vec![0.0f32; 1 + dp * num_stages];
        values[0] = local_sq as f32;
        let last = num_stages - 1;
        let loss_bad = self.losses.iter().any(|l| !l.is_finite());
        for (st, sq) in self.stages.iter().zip(&stage_sq) {
            let slot = 1 + self.dp_index * num_stages + st.index;
            if !sq.is_finite() {
                values[slot] += GRADIENT;
            }
            if st.index == last && loss_bad {
                values[slot] += LOSS;
            }
        }
        // Every parameter value is owned once per pipeline replica at ZeRO-0 and once
        // globally above: sum the norm over the pipeline, and above ZeRO-0 over the replicas
        // too. At ZeRO-0 the replicas hold the same norm, so only replica 0 contributes it to
        // the data-parallel sum (x + 0 + … + 0 = x exactly), which the flags need anyway.
        let device = self.comm.device().clone();
        let len = values.len();
        let mut total = Tensor::<Inner<B>, 1>::from_data(TensorData::new(values, [len]), &device);
        total = self
            .comm
            .all_reduce(Group::Pipeline, total, ReduceOp::Sum)?;
        if self.settings.zero == ZeroLevel::Zero0 && self.dp_index != 0 {
            total = total.slice_fill(0..1, 0.0);
        }
        total = self
            .comm
            .all_reduce(Group::DataParallel, total, ReduceOp::Sum)?;
        let reduced = total
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| EngineError::Optimizer(format!("gradient norm: {e:?}")))?;
        let total_sq = f64::from(reduced[0]);
        let report = NonFiniteReport::from_flags(
            &reduced[1..],
            self.comm.grid(),
            &self.settings.stage_ranks,
            total_sq.is_finite(),
        );
        if report.any() {
            if self.scaler.enabled() && report.loss.is_empty() {
                return Ok(self.overflow_step(step, report));
            }
            return self.non_finite_step(step, report);
        }
        self.scaler.good();
        let coefficient = clip_coefficient(total_sq, self.settings.max_grad_norm);
        for stage in &mut self.stages {
            let grad = stage.grad_owned.take().ok_or(EngineError::Missing {
                what: "reduced gradient",
                stage: stage.index,
                microbatch: 0,
            })?;
            let grad = clip_grad(grad, coefficient);
            stage.owned = stage
                .optimizer
                .step(lr, stage.owned.clone(), grad)
                .map_err(|e| EngineError::Optimizer(e.to_string()))?;
            if !stage.layout.sharded {
                stage.refill(stage.owned.clone())?;
            }
        }
        Ok(false)
    }

    /// Carries out the non-finite policy for `step`, identically on every rank: stop with an
    /// error, or drop the step's gradients and report the update as skipped.
    fn non_finite_step(
        &mut self,
        step: usize,
        report: NonFiniteReport,
    ) -> Result<bool, EngineError> {
        let rank = self.comm.rank();
        match self.settings.on_nonfinite {
            NonFinitePolicy::Stop => Err(EngineError::NonFinite { step, rank, report }),
            NonFinitePolicy::Skip => {
                for stage in &mut self.stages {
                    stage.grad_owned = None;
                }
                // Every rank knows; one says it.
                if rank == 0 {
                    tracing::warn!(step, %report, "optimizer update skipped (on_nonfinite = skip)");
                }
                Ok(true)
            }
        }
    }

    /// An f16 step whose gradients overflowed the loss scale: every rank drops the step's
    /// gradients and halves the scale (whatever the non-finite policy: this is the normal
    /// working of dynamic loss scaling, not a divergence). Returns that the update was skipped.
    fn overflow_step(&mut self, step: usize, report: NonFiniteReport) -> bool {
        for stage in &mut self.stages {
            stage.grad_owned = None;
        }
        let old = self.scaler.scale;
        self.scaler.overflow();
        if self.comm.rank() == 0 {
            tracing::warn!(
                step,
                %report,
                old_scale = old,
                new_scale = self.scaler.scale,
                "f16 gradients overflowed: optimizer update skipped, loss scale halved"
            );
        }
        true
    }

    /// The step's mean loss over every micro-batch of every replica, on last-stage ranks.
    fn step_loss(&mut self) -> Result<Option<f64>, EngineError> {
        if !self.local(self.settings.num_stages - 1) {
            return Ok(None);
        }
        let mean = self.losses.iter().sum::<f64>() / self.losses.len().max(1) as f64;
        let device = self.comm.device().clone();
        let t = Tensor::<Inner<B>, 1>::from_floats([mean as f32], &device);
        let t = self
            .comm
            .all_reduce(Group::DataParallel, t, ReduceOp::Mean)?;
        Ok(Some(t.into_scalar().elem()))
    }

    /// Gather every stage's current weights into its module (after the last step, so the
    /// trained stages can be recombined), and return the stages.
    pub(crate) fn finish(mut self) -> Result<Finished<S>, EngineError> {
        let indices: Vec<usize> = self.stages.iter().map(|s| s.index).collect();
        // Gathering everything for the hand-back is not part of training's footprint.
        let peak = self.peak_param_bytes;
        let comm = self.comm;
        for s in indices {
            // The trained model is handed back in fp32: the master weights themselves.
            let stage = self.stage_mut(s)?;
            let full = if stage.layout.sharded {
                comm.all_gather(Group::DataParallel, stage.owned.clone())?
            } else {
                stage.owned.clone()
            };
            stage.refill_as(full, DType::F32)?;
        }
        self.peak_param_bytes = peak;
        Ok(Finished {
            stages: self
                .stages
                .into_iter()
                .map(|s| (s.index, s.module))
                .collect(),
            events: self.events,
            peak_param_bytes: self.peak_param_bytes,
        })
    }
}
