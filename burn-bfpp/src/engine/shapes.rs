//! What each rank learns before its first step: the shape of the activation crossing every
//! stage boundary, and the checks the stages must pass, found by each rank on its own stages
//! and its own device.
//!
//! The stages are visited in pipeline order, as a micro-batch would flow: the rank holding
//! stage 0 runs its first micro-batch through it (no gradients), every later stage runs on
//! zeros of the shape its upstream stage produced, and the table of shapes found so far
//! travels with the pipeline from rank to rank. The rank of the last stage completes the
//! table (adding the classes its loss takes targets in) and broadcasts it over the pipeline
//! group. So no rank ever runs a stage it does not hold, and the cost is one forward of one
//! micro-batch through the model, spread over the ranks.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};

use super::data::DataSource;
use super::EngineError;
use crate::comm::{Communicator, Group};
use crate::host_read::{self, ReadPurpose};
use crate::model::{
    Inputs, MicroBatch, ModelError, PipelineStage, StageInput, StageOutput, Targets,
};
use crate::schedule::{ActionKind, PipelineSchedule};

/// The tags of the shape tables: far above the executor's transfer tags (stage `<< 33`) and
/// below the parameter hand-back's (`1 << 62`).
const SHAPES_TAG: u64 = 1 << 61;

/// The shapes a rank's run works with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shapes {
    /// The activation crossing every stage boundary `s → s + 1`, by `s`.
    pub(crate) activations: Vec<[usize; 3]>,
    /// The last stage's [`PipelineStage::target_classes`].
    pub(crate) target_classes: Option<usize>,
}

/// The shapes of a micro-batch's inputs and targets.
pub(crate) fn batch_dims<B: Backend>(batch: &MicroBatch<B>) -> (Vec<usize>, Vec<usize>) {
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

/// Every dimension travels as three 16-bit digits, each exact in an f32.
const DIGITS: usize = 3;

/// The table as floats: `3 × (stages − 1)` dimensions, then the target classes plus one (0:
/// none), each as [`DIGITS`] base-65536 digits.
fn encode(activations: &[Option<[usize; 3]>], classes: Option<usize>) -> Vec<f32> {
    let mut values: Vec<usize> = activations
        .iter()
        .flat_map(|a| a.unwrap_or([0; 3]))
        .collect();
    values.push(classes.map_or(0, |c| c + 1));
    values
        .into_iter()
        .flat_map(|v| (0..DIGITS).map(move |d| ((v >> (16 * d)) & 0xffff) as f32))
        .collect()
}

fn decode(floats: &[f32], boundaries: usize) -> (Vec<Option<[usize; 3]>>, Option<usize>) {
    let values: Vec<usize> = floats
        .chunks(DIGITS)
        .map(|c| {
            c.iter()
                .enumerate()
                .map(|(d, &x)| (x as usize) << (16 * d))
                .sum()
        })
        .collect();
    let activations = (0..boundaries)
        .map(|s| {
            let dims = [values[3 * s], values[3 * s + 1], values[3 * s + 2]];
            (dims != [0; 3]).then_some(dims)
        })
        .collect();
    let classes = values[3 * boundaries].checked_sub(1);
    (activations, classes)
}

/// The refusal for a stage that cannot run a split backward's `I` and `W`.
fn no_split_backward(s: usize, layers: std::ops::Range<usize>) -> EngineError {
    ModelError::Split(format!(
        "stage {s} (layers {layers:?}) does not defer its weight gradients, and the schedule \
         splits each backward into I (input gradient) and W (weight gradients): build the \
         stage's matrix products from burn_bfpp::model::SplitLinear and return true from \
         `splits_weight_grads`, or choose a schedule with a full backward (gpipe, 1f1b, \
         interleaved, breadth-first)"
    ))
    .into()
}

/// Finds the run's [`Shapes`] on this rank (see the [module docs](self)), and refuses stages
/// that cannot run the program: a stage without deferred weight gradients under a split
/// backward, a loss from a stage other than the last, activations from the last. `stages`
/// are this rank's, in the order it holds them; `step` is the first step the run trains.
pub(crate) fn find_shapes<B, S, C, D>(
    comm: &C,
    program: &PipelineSchedule,
    stages: &[(usize, S)],
    data: &D,
    step: usize,
    threads: bool,
) -> Result<Shapes, EngineError>
where
    B: AutodiffBackend,
    S: PipelineStage<B>,
    C: Communicator<B::InnerBackend>,
    D: DataSource<B>,
{
    let rank = comm.rank();
    let dp_index = comm.group_rank(Group::DataParallel);
    let num_stages = program.num_stages();
    let last = num_stages - 1;
    let boundaries = last;
    let peer = |stage: usize| comm.grid().rank_of(program.stage_ranks[stage], dp_index);
    let split_backward = program.ranks.iter().flatten().any(|a| {
        matches!(
            a.kind,
            ActionKind::BackwardInput | ActionKind::BackwardWeight
        )
    });
    let device = comm.device().clone();
    let first_batch = || -> Result<MicroBatch<B>, EngineError> {
        let batch = data
            .micro_batch(step, dp_index, 0)
            .map_err(|e| EngineError::Data {
                rank,
                step,
                microbatch: 0,
                reason: format!(
                    "the data source failed: {e} (the first micro-batch, read to size the \
                     activations)"
                ),
            })?;
        Ok(batch.to_device(&device))
    };
    let table_len = encode(&vec![None; boundaries], None).len();
    let send_table = |to: usize, table: &[Option<[usize; 3]>], classes| {
        let values = encode(table, classes);
        let tensor =
            Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(values, [table_len]), &device);
        comm.send(peer(to), SHAPES_TAG + to as u64, tensor)
    };
    let mut table: Vec<Option<[usize; 3]>> = vec![None; boundaries];
    let mut classes = None;
    let mut batch: Option<MicroBatch<B>> = None;
    for (s, stage) in stages {
        let s = *s;
        if split_backward && !stage.splits_weight_grads() {
            return Err(no_split_backward(s, stage.layers()));
        }
        let input = if s == 0 {
            let b = first_batch()?;
            let inputs = b.inputs.clone();
            batch = Some(b);
            StageInput::Data(inputs)
        } else {
            if table[s - 1].is_none() {
                let received =
                    comm.recv::<1>(peer(s - 1), SHAPES_TAG + s as u64, [table_len], DType::F32)?;
                let floats = read_floats(received)?;
                table = decode(&floats, boundaries).0;
            }
            let dims = table[s - 1].ok_or_else(|| {
                EngineError::RankFailure(format!(
                    "rank {rank}: the shape table from the rank of stage {} lacks the \
                     activation entering stage {s}",
                    s - 1
                ))
            })?;
            StageInput::Hidden(Tensor::zeros(dims, &device))
        };
        let targets = if s == last {
            if batch.is_none() {
                batch = Some(first_batch()?);
            }
            batch.as_ref().map(|b| &b.targets)
        } else {
            None
        };
        // No gradients: nothing of this forward is kept. Thread ranks may have to take turns
        // at autodiff work, but never while waiting on a peer.
        let turn = crate::model::autodiff::serial_autodiff(threads);
        let stage = stage.clone().no_grad();
        let output = stage.forward(input, targets)?;
        drop(turn);
        match (output, s == last) {
            (StageOutput::Hidden(h), false) => {
                table[s] = Some(h.dims());
                let downstream_here = stages.iter().any(|(t, _)| *t == s + 1);
                if !downstream_here {
                    send_table(s + 1, &table, None)?;
                }
            }
            (StageOutput::Loss(_), true) => classes = stage.target_classes(),
            (StageOutput::Loss(_), false) => {
                return Err(ModelError::Split(format!(
                    "stage {s} of {num_stages} returned a loss: only the last stage may hold \
                     the head"
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
    // The rank of the last stage holds the whole table: every pipeline rank gets it.
    let root = program.stage_ranks[last];
    let values = encode(&table, classes);
    let mine =
        Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(values, [table_len]), &device);
    let shared = comm.broadcast(Group::Pipeline, root, mine)?;
    let (activations, target_classes) = decode(&read_floats(shared)?, boundaries);
    let activations = activations
        .into_iter()
        .enumerate()
        .map(|(s, a)| {
            a.ok_or_else(|| {
                EngineError::RankFailure(format!(
                    "rank {rank}: no rank reported the activation leaving stage {s}"
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Shapes {
        activations,
        target_classes,
    })
}

fn read_floats<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, EngineError> {
    host_read::read(t, ReadPurpose::Sync)
        .map_err(|e| EngineError::RankFailure(format!("reading a shape table: {e:?}")))?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| EngineError::RankFailure(format!("reading a shape table: {e:?}")))
}

/// Each later micro-batch must have the first one's shapes (the transfers' buffers are sized
/// once); this rank's first micro-batch sets them.
#[derive(Debug, Default)]
pub(crate) struct BatchShapes(std::sync::Mutex<Option<(Vec<usize>, Vec<usize>)>>);

impl BatchShapes {
    /// Fails, saying how, unless `batch` has the shapes of the first micro-batch checked here.
    pub(crate) fn check<B: Backend>(&self, batch: &MicroBatch<B>) -> Result<(), String> {
        let dims = batch_dims(batch);
        let mut first = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*first {
            None => {
                *first = Some(dims);
                Ok(())
            }
            Some(seen) if *seen == dims => Ok(()),
            Some((inputs, targets)) => Err(format!(
                "inputs of shape {:?} and targets of shape {:?}, where the first micro-batch \
                 had {inputs:?} and {targets:?}: every micro-batch must have one shape",
                dims.0, dims.1
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_exactly() {
        let table = vec![Some([2, 64, 1024]), None, Some([1, 1, (1 << 40) + 3])];
        let floats = encode(&table, Some(50_257));
        assert_eq!(decode(&floats, 3), (table, Some(50_257)));
        assert_eq!(decode(&encode(&[], None), 0), (vec![], None));
        assert_eq!(decode(&encode(&[], Some(0)), 0).1, Some(0));
    }
}
