//! The interpreter: runs one rank's lowered action list, one optimizer step at a time.
//!
//! It makes no scheduling decision of its own. Every transfer, gather, free and reduction
//! happens where the lowered list puts it, so what runs is exactly what the validator checked
//! and what the simulator timed.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

use super::nonfinite::NonFinitePolicy;
use super::precision::{LossScaler, LossScaling, Precision, ScalerState};
use super::stage::{in_dtype, LocalStage};
use super::timeline::Recorder;
use super::{EngineError, StepCounts};
use crate::comm::{Communicator, Group, Pending};
use crate::host_read;
use crate::model::autodiff::serial_autodiff;
use crate::model::{
    fresh_leaves, input_grad, input_leaf, loss_backward, release_params, stage_backward,
    MicroBatch, PipelineStage, StageInput, StageOutput, Targets,
};
use crate::schedule::TimedEvent;
use crate::schedule::{Action, ActionKind, ZeroLevel};
use cubecl_kernels::{defer_weight_grads, DeferredWeightGrad};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

mod collectives;
mod transfers;
mod update;

/// The micro-batches of the step being run: `(dp_index, microbatch)` → the micro-batch on the
/// rank's device, or the data source's error naming the step, the rank and the micro-batch.
pub(crate) type Batches<'a, B> =
    dyn Fn(usize, usize) -> Result<MicroBatch<B>, EngineError> + Sync + 'a;

/// A stage run: the module copy it used, its input leaf (if not the first stage), its output.
type StageRun<B, S> = (S, Option<Tensor<B, 3>>, StageOutput<B>);

/// What a rank hands back after its last step.
pub(crate) struct Finished<S> {
    /// Its stages, by global index, with their final weights (fp32); empty unless asked for.
    pub(crate) stages: Vec<(usize, S)>,
    /// What it kept of its timeline.
    pub(crate) recorder: Recorder,
    /// Highest bytes of parameter values it held.
    pub(crate) peak_param_bytes: usize,
    /// The sum of squares of the final parameters this rank is the keeper of: its owned
    /// shards where stages are sharded, the whole stage on data-parallel rank 0 where not;
    /// so the world's sum is the model's.
    pub(crate) param_sq: f64,
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

/// Settings shared by every rank's executor.
#[derive(Debug, Clone)]
pub(crate) struct ExecutorSettings {
    pub(crate) zero: ZeroLevel,
    pub(crate) recompute: bool,
    pub(crate) microbatches: usize,
    pub(crate) num_stages: usize,
    /// Pipeline rank of every stage.
    pub(crate) stage_ranks: Vec<usize>,
    /// Shape of the activation across every stage boundary `s → s + 1`, by `s`.
    pub(crate) activation_shapes: Vec<[usize; 3]>,
    pub(crate) max_grad_norm: f64,
    /// What a step with a non-finite loss or gradient norm does.
    pub(crate) on_nonfinite: NonFinitePolicy,
    /// The dtype the stages compute in.
    pub(crate) precision: Precision,
    /// Dynamic loss scaling (f16).
    pub(crate) loss_scaling: LossScaling,
    /// Token targets must lie in `0..classes` (checked on the device); `None`: unchecked.
    pub(crate) target_classes: Option<usize>,
    /// Whether this rank shares its process with other thread ranks (see
    /// [`crate::model::autodiff::serial_autodiff`]).
    pub(crate) threads: bool,
}

/// What one optimizer step produced on a rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepOutcome {
    /// The step's mean loss over the global batch, on ranks holding the last stage.
    pub(crate) loss: Option<f64>,
    /// Whether the update was skipped (non-finite loss or gradient norm, policy `skip`).
    pub(crate) skipped: bool,
    /// The step's host reads and bytes sent.
    pub(crate) counts: StepCounts,
}

/// A collective started by `UNSHARD` or `REDUCE_GRAD` whose result is not yet used.
struct InFlight<B: Backend> {
    /// The action that started it, which also names its waits.
    action: Action,
    pending: Pending<B>,
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
    /// What an `I` kept for its `W`: each deferred weight's input and output gradient.
    deferred: HashMap<(usize, usize), Vec<DeferredWeightGrad<Inner<B>>>>,
    /// The sum of this step's micro-batch losses (last-stage ranks), fp32 on the device: read
    /// once, at the end of the step, with everything else the host needs (see
    /// [`super::summary`]).
    loss_sum: Option<Tensor<Inner<B>, 1>>,
    /// The step's first micro-batch with a token target outside `0..target_classes`, as
    /// `microbatches − m` (0: none), kept on the device with the losses (last-stage ranks).
    bad_targets: Option<Tensor<Inner<B>, 1>>,
    /// Recorded actions of the run, in seconds since `epoch`: a window of recent steps.
    pub(crate) recorder: Recorder,
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
        recorder: Recorder,
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
            deferred: HashMap::new(),
            loss_sum: None,
            bad_targets: None,
            recorder,
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
        batch: &Batches<'_, B>,
    ) -> Result<StepOutcome, EngineError> {
        self.loss_sum = None;
        self.bad_targets = None;
        let reads_before = host_read::counts();
        let bytes_before = self.comm.bytes_sent();
        let program = std::mem::take(&mut self.program);
        let result = self.run_list(step, &program, batch);
        self.program = program;
        result?;
        self.finish_collectives(step, self.in_flight.len())?;
        // The list's traffic; the step's table below is a few floats of control.
        let comm_bytes = self.comm.bytes_sent().since(bytes_before);
        let summary = self.step_summary()?;
        if let Some(bad) = summary.bad_targets {
            // Every rank read the same table: every rank stops here, before the update.
            return Err(EngineError::Data {
                rank: bad.rank,
                step,
                microbatch: bad.microbatch,
                reason: format!(
                    "a target token id is outside the {} classes of the model's head (0..{}); \
                     fix the data, or give the model a larger vocabulary",
                    self.settings.target_classes.unwrap_or(0),
                    self.settings.target_classes.unwrap_or(0)
                ),
            });
        }
        let skipped = self.optimizer_step(step, lr, &summary)?;
        let holds_loss = self.local(self.settings.num_stages - 1);
        let reads = host_read::counts().since(reads_before);
        Ok(StepOutcome {
            loss: holds_loss.then_some(summary.loss),
            skipped,
            counts: StepCounts {
                host_reads: reads.sync,
                host_transfer_reads: reads.transfer,
                comm_bytes,
            },
        })
    }

    /// Runs `list` in order; where the communicator moves transfers as device operations
    /// that must be posted together ([`Communicator::groups_transfers`]), each run of
    /// consecutive transfers goes as one group.
    fn run_list(
        &mut self,
        step: usize,
        list: &[Action],
        batch: &Batches<'_, B>,
    ) -> Result<(), EngineError> {
        let grouped = self.comm.groups_transfers();
        let mut at = 0;
        while let Some(&action) = list.get(at) {
            if grouped && action.kind.is_p2p() {
                let len = list[at..].iter().take_while(|a| a.kind.is_p2p()).count();
                self.transfer_group(step, &list[at..at + len])?;
                at += len;
                continue;
            }
            self.finish_needed_by(step, action)?;
            self.timed(step, action, |exec| {
                // Actions that record, run or drop autodiff graphs; the others only move
                // inner-backend tensors (and may wait on peers, which no turn may span).
                let _turn = matches!(
                    action.kind,
                    ActionKind::Forward
                        | ActionKind::Backward
                        | ActionKind::BackwardInput
                        | ActionKind::Reshard
                )
                .then(|| exec.autodiff_turn())
                .flatten();
                exec.run(action, batch)
            })?;
            at += 1;
        }
        Ok(())
    }

    fn run(&mut self, action: Action, batch: &Batches<'_, B>) -> Result<(), EngineError> {
        let (s, m) = (action.stage, action.mb());
        match action.kind {
            ActionKind::Forward => self.forward(s, m, batch),
            ActionKind::Backward => self.backward(s, m, batch, false),
            ActionKind::BackwardInput => self.backward(s, m, batch, true),
            ActionKind::BackwardWeight => self.weight_backward(s, m),
            ActionKind::SendForward
            | ActionKind::SendBackward
            | ActionKind::RecvForward
            | ActionKind::RecvBackward => self.transfer(action),
            ActionKind::Unshard => self.unshard(s),
            ActionKind::Reshard => {
                let stage = self.stage_mut(s)?;
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
    fn forward(&mut self, s: usize, m: usize, batch: &Batches<'_, B>) -> Result<(), EngineError> {
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
        let (out, loss) = match &output {
            // Activations travel in the compute dtype (bf16 as bf16).
            StageOutput::Hidden(h) => (Some(h.clone().inner()), None),
            // Summed on the device, read with the step's table: no host read here.
            StageOutput::Loss(l) => {
                let loss = in_dtype(l.clone().inner(), DType::F32);
                (
                    None,
                    Some(if self.poison {
                        loss.mul_scalar(f32::NAN)
                    } else {
                        loss
                    }),
                )
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
        self.saved.insert((s, m), saved);
        if let Some(loss) = loss {
            self.loss_sum = Some(match self.loss_sum.take() {
                Some(sum) => sum + loss,
                None => loss,
            });
        }
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
        batch: &Batches<'_, B>,
    ) -> Result<StageRun<B, S>, EngineError> {
        let last = s + 1 == self.settings.num_stages;
        let data = (s == 0 || last)
            .then(|| batch(self.dp_index, m))
            .transpose()?;
        // Ranks that are threads record their graphs concurrently; they never share an
        // autodiff node (see crate::model::autodiff).
        let compute = self.settings.precision.dtype();
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
        let targets = match (last, &data, self.settings.target_classes) {
            (true, Some(d), Some(classes)) => Some(self.checked_targets(&d.targets, classes, m)),
            (true, Some(d), None) => Some(d.targets.clone()),
            _ => None,
        };
        // Fresh parameter leaves for every micro-batch keep each (stage, micro-batch) graph
        // self-contained: Burn 0.21 merges graphs that share leaves, and with ranks as
        // threads the merged graphs of different micro-batches were seen to lose gradient
        // contributions depending on the interleaving.
        let module = fresh_leaves(&self.stage_mut(s)?.module);
        let output = module.forward(input, targets.as_ref())?;
        Ok((module, leaf, output))
    }

    /// `targets` with token ids clamped into `0..classes`, after noting on the device whether
    /// any was outside (the step's table carries it; see [`super::summary`]).
    fn checked_targets(&mut self, targets: &Targets<B>, classes: usize, m: usize) -> Targets<B> {
        let Targets::Tokens(ids) = targets else {
            return targets.clone();
        };
        let top = classes.saturating_sub(1) as i64;
        let outside = ids
            .clone()
            .lower_elem(0)
            .bool_or(ids.clone().greater_elem(top))
            .any();
        // microbatches − m for the first bad micro-batch: the largest such value, by `max`.
        let mark = outside
            .float()
            .inner()
            .mul_scalar((self.settings.microbatches - m) as f32);
        let mark = in_dtype(mark, DType::F32);
        self.bad_targets = Some(match self.bad_targets.take() {
            Some(seen) => seen.max_pair(mark),
            None => mark,
        });
        Targets::Tokens(ids.clone().clamp(0, top))
    }

    /// Backward of micro-batch `m` through stage `s`: accumulates the parameter gradients and
    /// hands the input gradient to the previous stage. With `split` (an `I` action) the
    /// weight gradients of the stage's [`crate::model::SplitLinear`]s are deferred: their
    /// operands wait in `deferred` for the `W` action ([`Self::weight_backward`]).
    fn backward(
        &mut self,
        s: usize,
        m: usize,
        batch: &Batches<'_, B>,
        split: bool,
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
        let out_grad = self.out_grads.remove(&(s, m));
        // The loss scale (f16) multiplies the seed of the backward; the parameter gradients
        // are divided by it again below, in fp32, and the input gradient stays scaled.
        let loss_scale = self.scaler.scale;
        let scale = loss_scale / self.settings.microbatches as f64;
        let compute = self.settings.precision.dtype();
        let local_prev = s > 0 && self.local(s - 1);
        let run = || -> Result<_, EngineError> {
            match &output {
                StageOutput::Loss(loss) => Ok(loss_backward(loss, scale)),
                StageOutput::Hidden(h) => {
                    let g = out_grad.ok_or(EngineError::Missing {
                        what: "output gradient",
                        stage: s,
                        microbatch: m,
                    })?;
                    Ok(stage_backward(h, in_dtype(g, compute))?)
                }
            }
        };
        let grads = if split {
            let (grads, deferred) = defer_weight_grads::<Inner<B>, _>(run);
            self.deferred.insert((s, m), deferred);
            grads?
        } else {
            run()?
        };
        // Input gradients travel in the compute dtype, like the activations.
        let in_grad = leaf.as_ref().map(|leaf| input_grad(leaf, &grads));
        drop((output, leaf));
        let factor = self.grad_factor();
        let mut grads = grads;
        self.stage_mut(s)?.accumulate(&module, &mut grads, factor);
        drop((grads, module));
        if let Some(g) = in_grad {
            if local_prev {
                self.out_grads.insert((s - 1, m), g);
            } else {
                self.to_send_backward.insert((s, m), g);
            }
        }
        Ok(())
    }

    /// The `W` of a split backward: the weight gradients its `I` deferred, `xᵀ·dy` for each
    /// deferred weight, on the inner backend (the graph went with the `I`).
    fn weight_backward(&mut self, s: usize, m: usize) -> Result<(), EngineError> {
        let deferred = self.deferred.remove(&(s, m)).ok_or(EngineError::Missing {
            what: "input-gradient pass (I) before this weight-gradient pass (W)",
            stage: s,
            microbatch: m,
        })?;
        if deferred.is_empty() {
            return Ok(());
        }
        let factor = self.grad_factor();
        self.stage_mut(s)?.accumulate_deferred(deferred, factor)
    }

    /// This rank's turn at autodiff work, where thread ranks take turns
    /// ([`crate::model::autodiff::serial_autodiff`]); `None` where they need not.
    pub(super) fn autodiff_turn(&self) -> Option<std::sync::MutexGuard<'static, ()>> {
        serial_autodiff(self.settings.threads)
    }

    /// What every gradient is multiplied by on its way into a stage's window: the inverse
    /// loss scale (1 unless f16), or NaN in a step with an injected non-finite fault.
    fn grad_factor(&self) -> f64 {
        if self.poison {
            f64::NAN
        } else {
            1.0 / self.scaler.scale
        }
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
        self.recorder.record(TimedEvent {
            step,
            action,
            start,
            end,
        });
        Ok(())
    }

    /// Ends the run on this rank: with `hand_back`, gathers every stage's current weights into
    /// its module (fp32, the master weights themselves) and returns the stages, so the trained
    /// model can be assembled; without, the stages stay as they are and nothing is gathered
    /// (a rank of a model larger than one process keeps its own share only).
    pub(crate) fn finish(mut self, hand_back: bool) -> Result<Finished<S>, EngineError> {
        let param_sq = self
            .stages
            .iter()
            .map(LocalStage::param_sq)
            .sum::<Result<f64, _>>()?;
        let indices: Vec<usize> = self.stages.iter().map(|s| s.index).collect();
        // Gathering everything for the hand-back is not part of training's footprint.
        let peak = self.peak_param_bytes;
        let comm = self.comm;
        if hand_back {
            for s in indices {
                let threads = self.settings.threads;
                let stage = self.stage_mut(s)?;
                if stage.layout.sharded {
                    let shard = stage.shard_to_gather_as(DType::F32)?;
                    let full = comm.all_gather(Group::DataParallel, shard)?;
                    let _turn = serial_autodiff(threads);
                    stage.refill_as(full, DType::F32)?;
                } else {
                    let _turn = serial_autodiff(threads);
                    stage.refill_from_master_as(DType::F32)?;
                }
            }
        }
        self.peak_param_bytes = peak;
        Ok(Finished {
            stages: if hand_back {
                self.stages
                    .into_iter()
                    .map(|s| (s.index, s.module))
                    .collect()
            } else {
                Vec::new()
            },
            recorder: self.recorder,
            peak_param_bytes: self.peak_param_bytes,
            param_sq,
        })
    }
}
