//! One stage held by a rank: its module, its shard of the flat parameters and gradients, and
//! the optimizer state of that shard. The interpreter ([`super::executor`]) drives it.

use burn::module::{ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};

use burn::module::Module;
use burn::tensor::backend::Backend;

use super::master::{Master, Reduced};
use super::shard::{ShardLayout, StageState};
use super::EngineError;
use crate::model::{
    flatten_params, load_flat_shaped, param_ids, param_shapes, release_params, zeros_flat,
    PipelineStage,
};
use crate::optim::{AdamWSettings, ShardOptimizer};
use crate::schedule::ZeroLevel;
use cubecl_kernels::DeferredWeightGrad;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// One stage held by this rank: its module, the master weights it updates with their
/// optimizer state, and its gradients.
pub(crate) struct LocalStage<B: AutodiffBackend, S> {
    /// Global stage index.
    pub(crate) index: usize,
    /// The stage's module; its parameter values are current only while gathered.
    pub(crate) module: S,
    pub(super) layout: ShardLayout,
    /// The fp32 master weights this rank updates (see [`Master`]).
    pub(super) master: Master<Inner<B>>,
    /// Gradients accumulated since the last reduction, one fp32 tensor per parameter:
    /// each backward adds into them (in place where the backend can), nothing is
    /// concatenated until a reduction needs one buffer.
    window: Vec<Option<Tensor<Inner<B>, 1>>>,
    /// Reduced gradients of the owned part, summed over this step's reductions.
    pub(super) reduced: Option<Reduced<Inner<B>>>,
    /// Parameter shapes, to refill the module after its values were freed.
    pub(super) shapes: Vec<Vec<usize>>,
    /// Parameter ids in the same order: where a deferred weight gradient goes.
    pub(super) ids: Vec<u64>,
    /// Where each parameter starts in the flat layout.
    offsets: Vec<usize>,
    pub(super) gathered: bool,
    /// The dtype the module computes in; the master weights, moments and gradients stay fp32.
    pub(super) compute: DType,
    adamw: AdamWSettings,
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
        let shapes = param_shapes(&module);
        let offsets: Vec<usize> = shapes
            .iter()
            .scan(0, |at, shape| {
                let start = *at;
                *at += shape.iter().product::<usize>();
                Some(start)
            })
            .collect();
        let numel = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        let layout = ShardLayout::new(numel, dp, dp_index, zero);
        let device = module.devices().into_iter().next().unwrap_or_default();
        let master = if layout.sharded {
            let flat = in_dtype(flatten_params(&module).inner(), DType::F32);
            let owned = pad(flat, layout.padded)
                .narrow(0, layout.owned_offset(), layout.owned_len())
                // A buffer of its own: a view would keep the whole stage's buffer alive.
                .mul_scalar(1.0);
            Master::Shard {
                optimizer: ShardOptimizer::new(layout.owned_len(), adamw.clone(), &device),
                owned,
            }
        } else {
            let values: Vec<Tensor<Inner<B>, 1>> = param_values(&module)
                .into_iter()
                .map(|v| in_dtype(v, DType::F32))
                .collect();
            Master::Params {
                optimizers: values
                    .iter()
                    .map(|v| ShardOptimizer::new(v.dims()[0], adamw.clone(), &device))
                    .collect(),
                values,
            }
        };
        let mut stage = LocalStage {
            index,
            ids: param_ids(&module),
            window: vec![None; shapes.len()],
            shapes,
            offsets,
            module,
            layout,
            master,
            reduced: None,
            // ZeRO-0 keeps its full, current weights; above, the list gathers them.
            gathered: zero == ZeroLevel::Zero0,
            compute,
            adamw: adamw.clone(),
        };
        if stage.gathered {
            // ZeRO-0 computes with the master weights themselves: in fp32 the module's
            // parameters become views of them (one copy of the stage, not two), in a half
            // precision casts of them.
            stage.refill_from_master()?;
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

    /// The module's parameters from the unsharded master weights, in the compute dtype
    /// (views of them in fp32). A sharded stage's module is filled by `UNSHARD` instead.
    pub(super) fn refill_from_master(&mut self) -> Result<(), EngineError> {
        self.refill_from_master_as(self.compute)
    }

    /// [`Self::refill_from_master`] in `dtype`.
    pub(super) fn refill_from_master_as(&mut self, dtype: DType) -> Result<(), EngineError> {
        let Master::Params { values, .. } = &self.master else {
            return Err(EngineError::Config(format!(
                "stage {}: a sharded stage's module is filled by UNSHARD",
                self.index
            )));
        };
        let values: Vec<Tensor<B, 1>> = values
            .iter()
            .map(|v| Tensor::from_inner(in_dtype(v.clone(), dtype)))
            .collect();
        self.module = load_params(self.module.clone(), values, &self.shapes)?;
        Ok(())
    }

    /// The owned part of the padded flat parameters in the compute dtype: what `UNSHARD`
    /// gathers (sharded stages only).
    pub(super) fn shard_to_gather(&self) -> Result<Tensor<Inner<B>, 1>, EngineError> {
        self.shard_to_gather_as(self.compute)
    }

    /// [`Self::shard_to_gather`] in `dtype`.
    pub(super) fn shard_to_gather_as(
        &self,
        dtype: DType,
    ) -> Result<Tensor<Inner<B>, 1>, EngineError> {
        match &self.master {
            Master::Shard { owned, .. } => Ok(in_dtype(owned.clone(), dtype)),
            Master::Params { .. } => Err(EngineError::Config(format!(
                "stage {}: UNSHARD of a stage that is not sharded",
                self.index
            ))),
        }
    }

    /// The gradients accumulated since the last reduction, taken out of the window: one
    /// padded flat buffer (zeros where a parameter got none), the input of a reduction.
    pub(super) fn take_window_flat(&mut self) -> Tensor<Inner<B>, 1> {
        let device = self.master_device();
        let mut parts: Vec<Tensor<Inner<B>, 1>> = self
            .window
            .iter_mut()
            .zip(&self.shapes)
            .map(|(g, shape)| {
                g.take()
                    .unwrap_or_else(|| zeros_flat(shape.iter().product::<usize>(), &device))
            })
            .collect();
        if self.layout.padded > self.layout.numel {
            parts.push(Tensor::zeros(
                [self.layout.padded - self.layout.numel],
                &device,
            ));
        }
        if parts.is_empty() {
            return zeros_flat(0, &device);
        }
        Tensor::cat(parts, 0)
    }

    /// The gradients accumulated since the last reduction, one per parameter, taken out of
    /// the window: the reduction itself where the stage has no data-parallel peer.
    pub(super) fn take_window_params(&mut self) -> Reduced<Inner<B>> {
        Reduced::Params(self.window.iter_mut().map(Option::take).collect())
    }

    /// Adds a reduction's result to the step's reduced gradients.
    pub(super) fn add_reduced(&mut self, result: Reduced<Inner<B>>) -> Result<(), EngineError> {
        self.reduced = Some(match self.reduced.take() {
            Some(acc) => acc.add(result)?,
            None => result,
        });
        Ok(())
    }

    /// The update with the step's reduced gradients, each scaled by the clipping
    /// `coefficient` first. An unsharded module lets go of its parameters (views of the
    /// master weights) for the update, so the master weights are rewritten in place where
    /// the backend can, and takes the new values back.
    pub(super) fn update(&mut self, lr: f64, coefficient: f64) -> Result<(), EngineError> {
        let grad = self.reduced.take().ok_or(EngineError::Missing {
            what: "reduced gradient",
            stage: self.index,
            microbatch: 0,
        })?;
        let unsharded = matches!(self.master, Master::Params { .. });
        if unsharded {
            self.module = release_params(self.module.clone());
        }
        self.master.update(lr, grad, coefficient, &self.offsets)?;
        if unsharded {
            self.refill_from_master()?;
        }
        Ok(())
    }

    fn master_device(&self) -> burn::tensor::Device<Inner<B>> {
        match &self.master {
            Master::Shard { owned, .. } => owned.device(),
            Master::Params { values, .. } => values
                .first()
                .map(Tensor::device)
                .unwrap_or_else(|| self.module.devices().into_iter().next().unwrap_or_default()),
        }
    }

    /// Adds one parameter's gradient `grad` (its flat values, fp32) into the open window: the
    /// first one is kept as it is, later ones added (in place where the backend can).
    fn add_to_window(&mut self, param: usize, grad: Tensor<Inner<B>, 1>) {
        let slot = &mut self.window[param];
        *slot = Some(match slot.take() {
            Some(acc) => acc + grad,
            None => grad,
        });
    }

    /// Adds the parameter gradients of `module` (the micro-batch's own copy of this stage,
    /// see [`crate::model::fresh_leaves`]) found in `grads` to the window, in fp32, each
    /// multiplied by `factor` (the inverse loss scale; NaN for an injected fault) when it is
    /// not 1, and each removed from `grads` as it is added, so the backward's gradients are
    /// freed as the window takes them. Parameters without a gradient add nothing.
    pub(super) fn accumulate(
        &mut self,
        module: &S,
        grads: &mut <B as AutodiffBackend>::Gradients,
        factor: f64,
    ) {
        // The gradient of each parameter leaves `grads` and enters the window before the
        // next one is read.
        struct Take<'a, B: AutodiffBackend, S> {
            stage: &'a mut LocalStage<B, S>,
            grads: &'a mut B::Gradients,
            factor: f64,
            index: usize,
        }
        impl<B: AutodiffBackend, S: PipelineStage<B>> ModuleVisitor<B> for Take<'_, B, S> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let index = self.index;
                self.index += 1;
                let Some(grad) = param.val().grad_remove(self.grads) else {
                    return;
                };
                let n = grad.shape().num_elements();
                let mut grad = in_dtype(grad.reshape([n]), DType::F32);
                if self.factor != 1.0 {
                    grad = grad.mul_scalar(self.factor);
                }
                self.stage.add_to_window(index, grad);
            }
        }
        module.visit(&mut Take {
            stage: self,
            grads,
            factor,
            index: 0,
        });
    }

    /// Adds the weight gradients an `I` deferred, computed now (`xᵀ·dy`, summed per weight),
    /// to the window like [`Self::accumulate`]: only the parameters they cover. Fails if a
    /// gradient's tag names no parameter of the stage (a `split_linear` on a tensor that is
    /// not one of the stage's parameters).
    pub(super) fn accumulate_deferred(
        &mut self,
        deferred: Vec<DeferredWeightGrad<Inner<B>>>,
        factor: f64,
    ) -> Result<(), EngineError> {
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
        for (i, grad) in by_param.into_iter().enumerate() {
            let Some(grad) = grad else { continue };
            let n = grad.shape().num_elements();
            // fp32, the dtype the window accumulates in: under mixed precision a deferred
            // gradient's dtype is that of its operands, which can differ.
            let mut grad = in_dtype(grad.reshape([n]), DType::F32);
            if factor != 1.0 {
                grad = grad.mul_scalar(factor);
            }
            self.add_to_window(i, grad);
        }
        Ok(())
    }

    /// This stage's training state, copied out of the backend (a checkpoint).
    pub(crate) fn snapshot(&self) -> Result<StageState, EngineError> {
        let [owned, moment_1, moment_2] = self
            .master
            .to_host(self.layout.owned_len())
            .map_err(|e| EngineError::Config(format!("stage {}: {e}", self.index)))?;
        Ok(StageState {
            stage: self.index,
            layout: self.layout,
            owned,
            moment_1,
            moment_2,
            optimizer_steps: self.master.steps(),
        })
    }

    /// Replace the freshly initialised master weights and optimizer state by a saved one
    /// (already resharded for this layout); refuses a state whose layout differs from this
    /// stage's.
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
        let device = self.master_device();
        self.master.restore(
            &state.owned,
            &state.moment_1,
            &state.moment_2,
            state.optimizer_steps,
            &self.adamw,
            &device,
        )?;
        if !self.layout.sharded {
            // ZeRO-0 keeps its weights gathered: the module must hold the restored values.
            self.refill_from_master()?;
        }
        Ok(())
    }

    /// The sum of squares of the final parameters this rank keeps: its owned shard where
    /// the stage is sharded, the whole stage on data-parallel rank 0 where not (so the
    /// world's sum is the model's); summed in f64 on the host.
    pub(super) fn param_sq(&self) -> Result<f64, EngineError> {
        if !self.layout.sharded && self.layout.dp_index != 0 {
            return Ok(0.0);
        }
        self.master
            .sum_of_squares()
            .map_err(|e| EngineError::Config(format!("stage {}: {e}", self.index)))
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

/// Every float parameter's value of `module`, flattened to 1-D (views, no copy), in visit
/// order.
fn param_values<B: AutodiffBackend, M: Module<B>>(module: &M) -> Vec<Tensor<Inner<B>, 1>> {
    struct Values<B: AutodiffBackend>(Vec<Tensor<Inner<B>, 1>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val().inner();
            let n = value.shape().num_elements();
            self.0.push(value.reshape([n]));
        }
    }
    let mut values = Values::<B>(Vec::new());
    module.visit(&mut values);
    values.0
}

/// `module` with every float parameter replaced by its tensor of `values` (1-D, in visit
/// order) reshaped to `shapes`: views of `values`, as fresh leaves that keep each
/// parameter's id and `require_grad`.
fn load_params<B: AutodiffBackend, M: Module<B>>(
    module: M,
    values: Vec<Tensor<B, 1>>,
    shapes: &[Vec<usize>],
) -> Result<M, EngineError> {
    struct Load<B: Backend> {
        values: std::vec::IntoIter<Tensor<B, 1>>,
        shapes: Vec<Vec<usize>>,
        index: usize,
        error: Option<String>,
    }
    impl<B: Backend> burn::module::ModuleMapper<B> for Load<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, old, mapper) = param.consume();
            let shape: Option<[usize; D]> = self
                .shapes
                .get(self.index)
                .and_then(|s| s.as_slice().try_into().ok());
            self.index += 1;
            match (self.values.next(), shape) {
                (Some(value), Some(shape)) => {
                    let value = value
                        .reshape(shape)
                        .detach()
                        .set_require_grad(old.is_require_grad());
                    Param::from_mapped_value(id, value, mapper)
                }
                _ => {
                    self.error.get_or_insert_with(|| {
                        format!("no value of shape for parameter {}", self.index - 1)
                    });
                    Param::from_mapped_value(id, old, mapper)
                }
            }
        }
    }
    let mut load = Load {
        values: values.into_iter(),
        shapes: shapes.to_vec(),
        index: 0,
        error: None,
    };
    let module = module.map(&mut load);
    match load.error {
        Some(e) => Err(EngineError::Config(format!("refilling a stage: {e}"))),
        None => Ok(module),
    }
}
