//! A module's float parameters as one flat 1-D buffer and back, and the recombination of
//! stages into the full model.
//!
//! The order is the module's [`Module::visit`] order, which `#[derive(Module)]` makes the
//! field declaration order: deterministic, identical on every rank, and — for models whose
//! stages hold the same fields in the same order (as [`super::Gpt`] does) — the concatenation
//! of the stages' buffers in stage order is the full model's buffer. Only float parameters
//! are included; integer and boolean parameters are left untouched by [`load_flat`].

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::ModelError;

/// Forces every lazily initialised parameter of `module` to take its value now, in visit order.
///
/// Burn initialises parameters lazily, on first use, and a clone of a still-lazy parameter
/// initialises *independently*. Splitting a model into stages clones its parameters, so a
/// model must be materialised before it is split, or the stages would draw fresh random
/// values that differ from the model's. Materialising right after seeding also makes the
/// values depend only on the seed and the visit order.
pub fn materialize<B: Backend, M: Module<B>>(module: &M) {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            // `val` fills the parameter's shared cell, so the module itself keeps the value.
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}

/// All float parameters of `module`, flattened and concatenated in visit order (detached).
///
/// A module without float parameters gives an empty buffer on the default device.
pub fn flatten_params<B: Backend, M: Module<B>>(module: &M) -> Tensor<B, 1> {
    struct Flatten<B: Backend> {
        parts: Vec<Tensor<B, 1>>,
    }
    impl<B: Backend> ModuleVisitor<B> for Flatten<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val().detach();
            let n = value.shape().num_elements();
            self.parts.push(value.reshape([n]));
        }
    }
    let mut visitor = Flatten { parts: Vec::new() };
    module.visit(&mut visitor);
    concat_or_empty(visitor.parts, module)
}

/// A tensor with no elements on `device`, made without launching a kernel. Burn's `zeros`
/// launches a fill over zero elements, which CubeCL 0.10 turns into a grid of zero blocks that
/// CUDA refuses (`CUDA_ERROR_INVALID_VALUE`; it stopped ZeRO-3 training on an H200, where
/// every released parameter is such a tensor). CPU and Vulkan backends accept either.
pub(crate) fn no_elements<B: Backend, const D: usize>(device: &B::Device) -> Tensor<B, D> {
    Tensor::empty([0; D], device)
}

/// `n` zeros on `device`; an empty tensor without a fill kernel when `n` is 0 (see
/// [`no_elements`]).
pub(crate) fn zeros_flat<B: Backend>(n: usize, device: &B::Device) -> Tensor<B, 1> {
    if n == 0 {
        no_elements(device)
    } else {
        Tensor::zeros([n], device)
    }
}

/// Concatenates flat parts; an empty list gives an empty tensor on the module's device.
pub(crate) fn concat_or_empty<B: Backend, M: Module<B>, const D: usize>(
    parts: Vec<Tensor<B, D>>,
    module: &M,
) -> Tensor<B, D> {
    if parts.is_empty() {
        let device = module.devices().into_iter().next().unwrap_or_default();
        no_elements(&device)
    } else {
        Tensor::cat(parts, 0)
    }
}

/// Replaces every float parameter of `module` by its slice of `flat` (the layout of
/// [`flatten_params`]), keeping parameter ids, devices and whether each requires a gradient.
///
/// The new values are fresh leaves: no autodiff history of `flat` is carried into the module.
pub fn load_flat<B: Backend, M: Module<B>>(
    module: M,
    flat: &Tensor<B, 1>,
) -> Result<M, ModelError> {
    let shapes = param_shapes(&module);
    load_flat_shaped(module, flat, &shapes)
}

/// The shape of every float parameter of `module`, in the layout order of [`flatten_params`].
pub fn param_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            // The lazy shape: a parameter not yet initialised stays so (nothing drawn).
            self.0.push(param.lazy_shape().to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    shapes.0
}

/// The module path (`blocks.0.attention.query.weight`, as Burn's records and burn-store name
/// parameters) and shape of every float parameter of `module`, in the order of
/// [`flatten_params`]. Parameters not yet initialised stay so.
pub fn named_param_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    struct Names {
        path: Vec<String>,
        out: Vec<(String, Vec<usize>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Names {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.out
                .push((self.path.join("."), param.lazy_shape().to_vec()));
        }
    }
    let mut names = Names {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut names);
    names.out
}

/// The paths of a stage's parameters as the whole model names them, for stages whose module
/// holds the model's `blocks` vector from block `first_block` on (and the model's other
/// fields under their own names): `blocks.{i}.…` becomes `blocks.{i + first_block}.…`.
pub(crate) fn model_paths<B: Backend, M: Module<B>>(stage: &M, first_block: usize) -> Vec<String> {
    named_param_shapes(stage)
        .into_iter()
        .map(|(path, _)| {
            let mut parts = path.splitn(3, '.');
            match (
                parts.next(),
                parts.next().map(str::parse::<usize>),
                parts.next(),
            ) {
                (Some("blocks"), Some(Ok(i)), Some(rest)) => {
                    format!("blocks.{}.{rest}", i + first_block)
                }
                _ => path,
            }
        })
        .collect()
}

/// The [`burn::module::ParamId`] value of every float parameter of `module`, in the order of
/// [`flatten_params`]: how a deferred weight gradient (tagged with its weight's id) finds its
/// place in the flat buffer.
pub(crate) fn param_ids<B: Backend, M: Module<B>>(module: &M) -> Vec<u64> {
    struct Ids(Vec<u64>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.id.val());
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// Frees the values of every float parameter of `module` (each becomes an empty tensor of
/// the same rank, id and device): what a ZeRO-3 rank does with a stage it stops using.
/// [`load_flat_shaped`] with the shapes recorded by [`param_shapes`] brings the values back.
pub fn release_params<B: Backend, M: Module<B>>(module: M) -> M {
    struct Release;
    impl<B: Backend> ModuleMapper<B> for Release {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, old, mapper) = param.consume();
            let empty = no_elements::<B, D>(&old.device()).set_require_grad(old.is_require_grad());
            Param::from_mapped_value(id, empty, mapper)
        }
    }
    module.map(&mut Release)
}

/// [`load_flat`] with the parameter shapes given rather than read from the module, so it also
/// fills a module whose parameters were freed by [`release_params`].
pub fn load_flat_shaped<B: Backend, M: Module<B>>(
    module: M,
    flat: &Tensor<B, 1>,
    shapes: &[Vec<usize>],
) -> Result<M, ModelError> {
    let expected: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let [got] = flat.dims();
    if got != expected || shapes.len() != param_shapes(&module).len() {
        return Err(ModelError::shape(
            "flat parameter buffer",
            format!("[{expected}] over {} parameters", shapes.len()),
            format!(
                "[{got}] for a module of {} parameters",
                param_shapes(&module).len()
            ),
        ));
    }
    struct Load<'a, B: Backend> {
        flat: Tensor<B, 1>,
        shapes: &'a [Vec<usize>],
        index: usize,
        offset: usize,
    }
    impl<B: Backend> ModuleMapper<B> for Load<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, old, mapper) = param.consume();
            let shape: [usize; D] = self
                .shapes
                .get(self.index)
                .and_then(|s| s.as_slice().try_into().ok())
                .unwrap_or_else(|| old.dims());
            let n: usize = shape.iter().product();
            let value = self
                .flat
                .clone()
                .narrow(0, self.offset, n)
                .reshape(shape)
                .to_device(&old.device())
                .detach()
                .set_require_grad(old.is_require_grad());
            self.index += 1;
            self.offset += n;
            Param::from_mapped_value(id, value, mapper)
        }
    }
    Ok(module.map(&mut Load {
        flat: flat.clone(),
        shapes,
        index: 0,
        offset: 0,
    }))
}

/// Rebuilds the full model from its stages: every float parameter of `model` takes the value
/// of the stage parameter with the same [`ParamId`], moved to the model parameter's device.
///
/// Stages made by [`super::PipelineModel::stage`] keep their model's parameter ids, and
/// [`load_flat`], `fork` and `to_device` preserve them, so after training each rank's stages
/// can be recombined into a template of the model (for example the model the stages were cut
/// from) and compared with a model trained on one device. Every model parameter must be found
/// in some stage with the same shape.
pub fn recombine<B: Backend, M: Module<B>, S: Module<B>>(
    model: M,
    stages: &[S],
) -> Result<M, ModelError> {
    struct Collect<B: Backend> {
        values: HashMap<ParamId, (Vec<usize>, Tensor<B, 1>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val().detach();
            let dims = value.dims().to_vec();
            let n = value.shape().num_elements();
            self.values.insert(param.id, (dims, value.reshape([n])));
        }
    }
    let mut collect = Collect {
        values: HashMap::new(),
    };
    for stage in stages {
        stage.visit(&mut collect);
    }

    struct Replace<B: Backend> {
        values: HashMap<ParamId, (Vec<usize>, Tensor<B, 1>)>,
        // A mapper cannot fail, so the first problem is kept and reported after the walk.
        error: Option<ModelError>,
    }
    impl<B: Backend> ModuleMapper<B> for Replace<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, old, mapper) = param.consume();
            let found = self.values.get(&id).cloned();
            let value = match found {
                Some((dims, flat)) if dims == old.dims() => flat
                    .reshape(old.dims())
                    .to_device(&old.device())
                    .detach()
                    .set_require_grad(old.is_require_grad()),
                Some((dims, _)) => {
                    self.error.get_or_insert(ModelError::shape(
                        format!("parameter {id}"),
                        format!("{:?}", old.dims()),
                        format!("{dims:?}"),
                    ));
                    old
                }
                None => {
                    self.error.get_or_insert(ModelError::Params(format!(
                        "model parameter {id} of shape {:?} is in none of the stages; \
                         recombine stages cut from this model (or a clone of it)",
                        old.dims()
                    )));
                    old
                }
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let mut replace = Replace {
        values: collect.values,
        error: None,
    };
    let model = model.map(&mut replace);
    match replace.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}
