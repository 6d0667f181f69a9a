//! One stage held by a rank: its module, its shard of the flat parameters and gradients, and
//! the optimizer state of that shard. The interpreter ([`super::executor`]) drives it.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use super::shard::ShardLayout;
use super::snapshot::StageState;
use super::EngineError;
use crate::host_read::{read, ReadPurpose};
use crate::model::{flatten_params, load_flat_shaped, param_ids, param_shapes, PipelineStage};
use crate::optim::{AdamWSettings, ShardOptimizer};
use crate::schedule::ZeroLevel;
use cubecl_kernels::DeferredWeightGrad;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// One stage held by this rank: its module, its shard of the flat parameters and gradients,
/// and the optimizer state of that shard.
pub(crate) struct LocalStage<B: AutodiffBackend, S> {
    /// Global stage index.
    pub(crate) index: usize,
    /// The stage's module; its parameter values are current only while gathered.
    pub(crate) module: S,
    pub(super) layout: ShardLayout,
    /// The part of the padded flat parameters this rank updates.
    pub(super) owned: Tensor<Inner<B>, 1>,
    /// Gradients accumulated since the last reduction, full padded length.
    pub(super) grad_window: Option<Tensor<Inner<B>, 1>>,
    /// Reduced gradients of the owned part, summed over this step's reductions.
    pub(super) grad_owned: Option<Tensor<Inner<B>, 1>>,
    pub(super) optimizer: ShardOptimizer<Inner<B>>,
    /// Parameter shapes, to refill the module after its values were freed.
    pub(super) shapes: Vec<Vec<usize>>,
    /// Parameter ids in the same order: where a deferred weight gradient goes.
    pub(super) ids: Vec<u64>,
    pub(super) gathered: bool,
    /// The dtype the module computes in; the shard, its moments and gradients stay fp32.
    pub(super) compute: DType,
}

/// `t` in `dtype`, untouched when it is already (so fp32 runs do exactly what they did).
pub(super) fn in_dtype<B: burn::tensor::backend::Backend, const D: usize>(
    t: Tensor<B, D>,
    dtype: DType,
) -> Tensor<B, D> {
    if t.dtype() == dtype {
        t
    } else {
        t.cast(dtype)
    }
}

impl<B: AutodiffBackend, S: PipelineStage<B>> LocalStage<B, S> {
    /// Take ownership of `module` as global stage `index` on a rank of a data-parallel group.
    pub(crate) fn new(
        index: usize,
        module: S,
        dp: usize,
        dp_index: usize,
        zero: ZeroLevel,
        adamw: &AdamWSettings,
        compute: DType,
    ) -> Result<Self, EngineError> {
        let flat = in_dtype(flatten_params(&module).inner(), DType::F32);
        let [numel] = flat.dims();
        let layout = ShardLayout::new(numel, dp, dp_index, zero);
        let padded = pad(flat, layout.padded);
        let owned = padded
            .clone()
            .narrow(0, layout.owned_offset(), layout.owned_len());
        let device = owned.device();
        let mut stage = LocalStage {
            index,
            shapes: param_shapes(&module),
            ids: param_ids(&module),
            module,
            layout,
            optimizer: ShardOptimizer::new(layout.owned_len(), adamw.clone(), &device),
            owned,
            grad_window: None,
            grad_owned: None,
            // ZeRO-0 keeps its full, current weights; above, the list gathers them.
            gathered: zero == ZeroLevel::Zero0,
            compute,
        };
        if stage.gathered && compute != DType::F32 {
            // ZeRO-0 computes with the module as given: it must hold compute-dtype values.
            stage.refill(padded)?;
        }
        Ok(stage)
    }

    /// Put the stage's full padded flat parameters `padded` into its module (refilling it if
    /// `RESHARD` freed it), cast to the compute dtype.
    pub(super) fn refill(&mut self, padded: Tensor<Inner<B>, 1>) -> Result<(), EngineError> {
        self.refill_as(padded, self.compute)
    }

    /// [`Self::refill`] in `dtype` (fp32 for the trained model handed back).
    pub(super) fn refill_as(
        &mut self,
        padded: Tensor<Inner<B>, 1>,
        dtype: DType,
    ) -> Result<(), EngineError> {
        let values = Tensor::from_inner(in_dtype(padded.narrow(0, 0, self.layout.numel), dtype));
        self.module = load_flat_shaped(self.module.clone(), &values, &self.shapes)?;
        Ok(())
    }

    /// The weight gradients an `I` deferred, computed now (`xᵀ·dy`, summed per weight) and
    /// laid out as the stage's flat gradient in fp32: zeros for every parameter `I` already
    /// covered.
    /// Fails if a gradient's tag names no parameter of the stage (a `split_linear` on a
    /// tensor that is not one of the stage's parameters).
    pub(super) fn weight_grads_flat(
        &self,
        deferred: Vec<DeferredWeightGrad<Inner<B>>>,
    ) -> Result<Tensor<Inner<B>, 1>, EngineError> {
        let mut by_param: Vec<Option<Tensor<Inner<B>, 2>>> = vec![None; self.ids.len()];
        for entry in deferred {
            let i = self
                .ids
                .iter()
                .position(|&id| id == entry.tag)
                .ok_or_else(|| {
                    EngineError::Config(format!(
                        "stage {}: a deferred weight gradient belongs to no parameter of the \
                     stage; split_linear must take the stage's own weight parameter",
                        self.index
                    ))
                })?;
            let grad = entry.weight_grad();
            by_param[i] = Some(match by_param[i].take() {
                Some(sum) => sum + grad,
                None => grad,
            });
        }
        let device = self.owned.device();
        let parts = by_param
            .into_iter()
            .zip(&self.shapes)
            .map(|(grad, shape)| {
                let n = shape.iter().product::<usize>();
                // fp32, the dtype the window accumulates in: under mixed precision a
                // deferred gradient's dtype is that of its operands, which can differ.
                match grad {
                    Some(g) => in_dtype(g.reshape([n]), DType::F32),
                    None => Tensor::<Inner<B>, 1>::zeros([n], &device),
                }
            })
            .collect();
        Ok(Tensor::cat(parts, 0))
    }

    /// This stage's training state, copied out of the backend (a checkpoint).
    pub(crate) fn snapshot(&self) -> Result<StageState, EngineError> {
        let read = |t: &Tensor<Inner<B>, 1>| {
            read(t.clone(), ReadPurpose::Sync)
                .map_err(|e| EngineError::Config(format!("stage {}: {e:?}", self.index)))?
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| EngineError::Config(format!("stage {}: {e:?}", self.index)))
        };
        Ok(StageState {
            stage: self.index,
            layout: self.layout,
            owned: read(&self.owned)?,
            moment_1: read(self.optimizer.first_moment())?,
            moment_2: read(self.optimizer.second_moment())?,
            optimizer_steps: self.optimizer.steps(),
        })
    }

    /// Replace the freshly initialised shard and optimizer state by a saved one (already
    /// resharded for this layout); refuses a state whose layout differs from this stage's.
    pub(crate) fn restore(&mut self, state: &StageState) -> Result<(), EngineError> {
        let lens = [
            state.owned.len(),
            state.moment_1.len(),
            state.moment_2.len(),
        ];
        if state.stage != self.index
            || state.layout != self.layout
            || lens.iter().any(|&n| n != self.layout.owned_len())
        {
            return Err(EngineError::Config(format!(
                "restored state of stage {} ({:?}, lengths {lens:?}) does not fit stage {} \
                 ({:?}); reshard the checkpoint for this layout",
                state.stage, state.layout, self.index, self.layout
            )));
        }
        let device = self.owned.device();
        let tensor = |v: &[f32]| {
            Tensor::<Inner<B>, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device)
        };
        self.owned = tensor(&state.owned);
        self.optimizer = ShardOptimizer::from_state(
            self.optimizer.settings().clone(),
            tensor(&state.moment_1),
            tensor(&state.moment_2),
            state.optimizer_steps,
        )
        .map_err(|e| EngineError::Optimizer(e.to_string()))?;
        if !self.layout.sharded {
            // ZeRO-0 keeps its weights gathered: the module must hold the restored values.
            self.refill(self.owned.clone())?;
        }
        Ok(())
    }

    /// Bytes of parameter values held now: the gathered full copy (in the compute dtype),
    /// and the fp32 owned shard when it is a separate buffer (sharded, or a half-precision
    /// module beside the fp32 master copy).
    pub(super) fn param_bytes(&self) -> usize {
        let full = if self.gathered {
            self.layout.numel * self.compute.size()
        } else {
            0
        };
        let shard = if self.layout.sharded || self.compute != DType::F32 {
            self.layout.owned_len() * std::mem::size_of::<f32>()
        } else {
            0
        };
        full + shard
    }
}

/// Zero-pad a flat buffer to `len`.
pub(super) fn pad<B: burn::tensor::backend::Backend>(
    flat: Tensor<B, 1>,
    len: usize,
) -> Tensor<B, 1> {
    let [n] = flat.dims();
    if n == len {
        return flat;
    }
    let zeros = Tensor::zeros([len - n], &flat.device());
    Tensor::cat(vec![flat, zeros], 0)
}
