//! Models described rather than built: the engine asks a [`ModelDescription`] for the stage
//! holding layers `a..b` on a rank's device, so no process ever allocates a parameter of a
//! stage it does not run.
//!
//! Initial values are drawn one layer at a time on Burn's CPU backend, each layer from its
//! own seed derived from (run seed, layer index) ([`layer_seed`]), and copied into the stage
//! on its device ([`fill_params`]). So a layer starts from the same values whatever the
//! layout (pp, loops, dp, split), the backend, or whether ranks are threads or processes,
//! and the whole model never exists in one place: the largest host buffer of the draw is one
//! layer.

use std::collections::VecDeque;
use std::ops::Range;

use burn::backend::Flex;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::{module_to_device, random_init_lock, ModelError, PipelineModel, PipelineStage};
use crate::data::rng::mix64;
use crate::host_read::{self, ReadPurpose};

/// A pipeline model described, not built: it builds the stage holding any contiguous range
/// of its layers directly on a device.
///
/// This is what lets a model larger than one device train: each rank builds only its own
/// stages, and the engine never asks for the whole model. [`super::GptConfig::described`]
/// and [`super::LayerStack::described`] are descriptions; a model built whole
/// ([`PipelineModel`]) is trained with [`crate::engine::Trainer::fit`], which cuts its stages
/// from it instead.
///
/// Contract: the stage of `layers` must hold exactly the parameters the whole model has for
/// those layers, in the order of the whole model's [`flatten_params`](super::flatten_params),
/// and its initial values must depend only on the layers themselves (never on which other
/// stages exist), so that every layout starts from the same model.
pub trait ModelDescription<B: Backend> {
    /// The module type of one stage.
    type Stage: PipelineStage<B>;

    /// How many layers the model has (each stage gets at least one).
    fn num_layers(&self) -> usize;

    /// Relative cost of each layer, for [`super::ModelSplit::Balanced`]; every layer costs 1
    /// by default.
    fn layer_costs(&self) -> Vec<f64> {
        vec![1.0; self.num_layers()]
    }

    /// Builds the stage holding `layers` on `device`, allocating its parameters only.
    fn build_stage(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError>;

    /// The stage holding `layers` on `device` with its parameters not yet initialised
    /// (Burn's lazy parameters: nothing drawn or allocated), for values loaded from a file
    /// to fill ([`fill_params`]). The default builds the stage with its initial values.
    fn stage_skeleton(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError> {
        self.build_stage(layers, device)
    }
}

/// A model built whole, as a description: its stages are cut from it (sharing its
/// parameters) and moved to the device asked for. For models that exist whole anyway (small
/// ones, or ones loaded from a record); [`crate::engine::Trainer::fit`] takes the model
/// itself and wraps it in this.
#[derive(Debug, Clone)]
pub struct Whole<M>(pub M);

impl<B: Backend, M: PipelineModel<B>> ModelDescription<B> for Whole<M> {
    type Stage = M::Stage;

    fn num_layers(&self) -> usize {
        self.0.num_layers()
    }

    fn layer_costs(&self) -> Vec<f64> {
        self.0.layer_costs()
    }

    fn build_stage(
        &self,
        layers: Range<usize>,
        device: &B::Device,
    ) -> Result<Self::Stage, ModelError> {
        Ok(module_to_device(self.0.stage(layers)?, device))
    }
}

/// The seed layer `layer` of a model seeded with `seed` draws its initial values from: a
/// function of the two alone, so a layer's values do not depend on how many layers are drawn
/// before it, or where.
pub fn layer_seed(seed: u64, layer: usize) -> u64 {
    mix64(seed ^ mix64((layer as u64).wrapping_add(0x6c61_7965_725f_7365)))
}

/// Draws the initial values of one layer: seeds Burn's CPU backend with
/// [`layer_seed`]`(seed, layer)`, lets `build` construct the layer's module on the CPU, and
/// returns every float parameter's values in visit order. The draw holds the process-wide
/// random state (see [`random_init_lock`]), so concurrent draws of other threads cannot
/// interleave with it.
pub fn draw_layer<M: Module<Flex>>(
    seed: u64,
    layer: usize,
    build: impl FnOnce(&burn::tensor::Device<Flex>) -> Result<M, ModelError>,
) -> Result<Vec<TensorData>, ModelError> {
    let module = {
        let _draws = random_init_lock();
        let cpu = Default::default();
        Flex::seed(&cpu, layer_seed(seed, layer));
        let module = build(&cpu)?;
        super::materialize(&module);
        module
    };
    struct Values(Vec<Result<TensorData, String>>);
    impl ModuleVisitor<Flex> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Flex, D>>) {
            self.0.push(
                host_read::read(param.val(), ReadPurpose::Sync)
                    .map_err(|e| format!("reading a drawn parameter: {e:?}")),
            );
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values
        .0
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(ModelError::Params)
}

/// Fills every float parameter of `module` (in visit order) with the next values of
/// `values`, which yields one layer's values at a time (see [`draw_layer`]), on the device
/// each parameter lives (or would be initialised) on. Parameters not yet initialised are
/// never initialised: their random draw and allocation on the device are skipped. Refuses a
/// module whose parameter count or shapes differ from the values given, naming the first
/// difference.
pub fn fill_params<B: Backend, M: Module<B>>(
    module: M,
    mut values: impl FnMut() -> Option<Result<Vec<TensorData>, ModelError>>,
) -> Result<M, ModelError> {
    struct Fill<'a, B: Backend> {
        next: &'a mut dyn FnMut() -> Option<Result<Vec<TensorData>, ModelError>>,
        queue: VecDeque<TensorData>,
        index: usize,
        error: Option<ModelError>,
        _backend: std::marker::PhantomData<B>,
    }
    impl<B: Backend> Fill<'_, B> {
        fn take(&mut self) -> Option<TensorData> {
            while self.queue.is_empty() {
                match (self.next)() {
                    Some(Ok(layer)) => self.queue.extend(layer),
                    Some(Err(e)) => {
                        self.error.get_or_insert(e);
                        return None;
                    }
                    None => return None,
                }
            }
            self.queue.pop_front()
        }
    }
    impl<B: Backend> ModuleMapper<B> for Fill<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let index = self.index;
            self.index += 1;
            if self.error.is_some() {
                return param;
            }
            let shape = param.lazy_shape();
            let Some(data) = self.take() else {
                self.error.get_or_insert_with(|| {
                    ModelError::Params(format!(
                        "the module has more float parameters than the values drawn for it \
                         ({index} given); parameter {index} has shape {:?}",
                        shape.as_slice()
                    ))
                });
                return param;
            };
            if data.shape != shape {
                self.error.get_or_insert_with(|| {
                    ModelError::shape(
                        format!("initial values of parameter {index}"),
                        format!("{:?}", shape.as_slice()),
                        format!("{:?}", data.shape.as_slice()),
                    )
                });
                return param;
            }
            let device = param.lazy_device();
            // A lazy parameter is trainable (burn-nn's initialisers make them so); an
            // initialised one keeps its own setting.
            let require_grad = !param.is_initialized() || param.val().is_require_grad();
            let id = param.id;
            let value = Tensor::<B, D>::from_data(data, &device).set_require_grad(require_grad);
            Param::initialized(id, value)
        }
    }
    let mut fill = Fill::<B> {
        next: &mut values,
        queue: VecDeque::new(),
        index: 0,
        error: None,
        _backend: std::marker::PhantomData,
    };
    let module = module.map(&mut fill);
    if let Some(e) = fill.error {
        return Err(e);
    }
    if fill.take().is_some() || fill.error.is_some() {
        return Err(fill.error.unwrap_or_else(|| {
            ModelError::Params(format!(
                "more values were drawn than the module's {} float parameters",
                fill.index
            ))
        }));
    }
    Ok(module)
}

/// Builds the stage of `layers` with `skeleton` (parameters left lazy, so nothing is drawn or
/// allocated yet) and fills it layer by layer with `draw`'s values: the common body of every
/// seeded description.
pub(crate) fn build_seeded<B: Backend, S: Module<B>>(
    layers: Range<usize>,
    skeleton: S,
    mut draw: impl FnMut(usize) -> Result<Vec<TensorData>, ModelError>,
) -> Result<S, ModelError> {
    let mut next = layers;
    fill_params(skeleton, move || next.next().map(&mut draw))
}
