//! The fp32 master weights a rank updates for one stage, their optimizer state, and the
//! reduced gradients waiting for the update.
//!
//! Unsharded (ZeRO-0), a rank updates the whole stage, and it keeps it one tensor per
//! parameter, as plain Burn does: the module computes with views of these tensors (fp32) or
//! casts of them, and AdamW updates one parameter at a time, so neither a second copy of the
//! stage nor an update temporary of the stage's size ever exists. Sharded (ZeRO ≥ 1), a rank
//! updates a contiguous part of the padded flat parameters that cuts through parameters, so
//! it keeps that part as one tensor; it is a `1/dp` of the stage.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::EngineError;
use crate::host_read::{read, ReadPurpose};
use crate::model::zeros_flat;
use crate::optim::{sq_norm_on_device, AdamWSettings, ShardOptimizer};

/// A stage's fp32 master weights on this rank, with their AdamW state.
#[derive(Debug)]
pub(super) enum Master<B: Backend> {
    /// The whole stage, one flat tensor per parameter, each with its own AdamW state.
    Params {
        values: Vec<Tensor<B, 1>>,
        optimizers: Vec<ShardOptimizer<B>>,
    },
    /// This rank's part of the padded flat parameters (ZeRO ≥ 1) and its AdamW state.
    Shard {
        owned: Tensor<B, 1>,
        optimizer: ShardOptimizer<B>,
    },
}

/// Reduced gradients waiting for the update, in fp32, summed over the step's reductions.
#[derive(Debug)]
pub(super) enum Reduced<B: Backend> {
    /// The stage's padded flat gradient (ZeRO-0 after an all-reduce), or this rank's part of
    /// it (ZeRO ≥ 1 after a reduce-scatter).
    Flat(Tensor<B, 1>),
    /// One gradient per parameter, `None` for a parameter that got none (ZeRO-0 without
    /// data-parallel peers, where the reduction is the identity).
    Params(Vec<Option<Tensor<B, 1>>>),
}

impl<B: Backend> Reduced<B> {
    /// `self + other`, elementwise; both from the same stage and layout.
    pub(super) fn add(self, other: Reduced<B>) -> Result<Reduced<B>, EngineError> {
        match (self, other) {
            (Reduced::Flat(a), Reduced::Flat(b)) => Ok(Reduced::Flat(a + b)),
            (Reduced::Params(a), Reduced::Params(b)) => Ok(Reduced::Params(
                a.into_iter()
                    .zip(b)
                    .map(|(x, y)| match (x, y) {
                        (Some(x), Some(y)) => Some(x + y),
                        (x, None) => x,
                        (None, y) => y,
                    })
                    .collect(),
            )),
            _ => Err(EngineError::Config(
                "two reductions of one stage in one step gave differently laid out gradients"
                    .into(),
            )),
        }
    }

    /// The sum of squares of every element, as a 1-element fp32 tensor on the device.
    pub(super) fn sq_norm(&self, device: &B::Device) -> Tensor<B, 1> {
        match self {
            Reduced::Flat(g) => sq_norm_on_device(g),
            Reduced::Params(parts) => parts
                .iter()
                .flatten()
                .map(sq_norm_on_device)
                .reduce(|a, b| a + b)
                .unwrap_or_else(|| Tensor::zeros([1], device)),
        }
    }
}

impl<B: Backend> Master<B> {
    /// One AdamW step with `lr` on gradients `grad`, each first scaled by the clipping
    /// `coefficient`. `offsets` are the parameters' offsets in the flat layout (for a flat
    /// gradient of an unsharded stage). Each parameter's tensor is held by nothing else while
    /// it is updated, so the backend may update it in place.
    pub(super) fn update(
        &mut self,
        lr: f64,
        grad: Reduced<B>,
        coefficient: f64,
        offsets: &[usize],
    ) -> Result<(), EngineError> {
        let failed = |e: crate::optim::OptimError| EngineError::Optimizer(e.to_string());
        match (self, grad) {
            (Master::Shard { owned, optimizer }, Reduced::Flat(g)) => {
                let values = std::mem::replace(owned, Tensor::empty([0], &g.device()));
                *owned = optimizer
                    .step_clipped(lr, values, g, coefficient)
                    .map_err(failed)?;
                Ok(())
            }
            (Master::Params { values, optimizers }, grad) => {
                let mut flat = None;
                let mut parts = match grad {
                    Reduced::Params(parts) => parts,
                    Reduced::Flat(g) => {
                        flat = Some(g);
                        Vec::new()
                    }
                };
                for (i, (value, optimizer)) in values.iter_mut().zip(optimizers).enumerate() {
                    let [n] = value.dims();
                    let g = match &flat {
                        Some(g) => g.clone().narrow(0, offsets[i], n),
                        // A parameter without a gradient (unused in the step) still decays
                        // and follows its moments, as every element of a flat shard does.
                        None => parts
                            .get_mut(i)
                            .and_then(Option::take)
                            .unwrap_or_else(|| zeros_flat(n, &value.device())),
                    };
                    let current = std::mem::replace(value, Tensor::empty([0], &g.device()));
                    *value = optimizer
                        .step_clipped(lr, current, g, coefficient)
                        .map_err(failed)?;
                }
                Ok(())
            }
            (Master::Shard { .. }, Reduced::Params(_)) => Err(EngineError::Config(
                "a sharded stage got unreduced per-parameter gradients".into(),
            )),
        }
    }

    /// The optimizer steps taken (the same for every parameter).
    pub(super) fn steps(&self) -> usize {
        match self {
            Master::Params { optimizers, .. } => {
                optimizers.first().map_or(0, ShardOptimizer::steps)
            }
            Master::Shard { optimizer, .. } => optimizer.steps(),
        }
    }

    /// The sum of squares of the master weights, read to the host one tensor at a time and
    /// summed in f64, so the figure does not depend on how the model is sharded.
    pub(super) fn sum_of_squares(&self) -> Result<f64, EngineError> {
        let mut sum = 0.0;
        for t in self.tensors() {
            sum += host_values(t)?
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum::<f64>();
        }
        Ok(sum)
    }

    fn tensors(&self) -> Vec<&Tensor<B, 1>> {
        match self {
            Master::Params { values, .. } => values.iter().collect(),
            Master::Shard { owned, .. } => vec![owned],
        }
    }

    /// The owned part of the padded flat parameters and its two moments as host vectors of
    /// `len` values (the unsharded stage's padding reads as zeros): a checkpoint's form.
    pub(super) fn to_host(&self, len: usize) -> Result<[Vec<f32>; 3], EngineError> {
        let mut out = [
            Vec::with_capacity(len),
            Vec::with_capacity(len),
            Vec::with_capacity(len),
        ];
        match self {
            Master::Shard { owned, optimizer } => {
                out[0] = host_values(owned)?;
                out[1] = host_values(&optimizer.first_moment())?;
                out[2] = host_values(&optimizer.second_moment())?;
            }
            Master::Params { values, optimizers } => {
                for (value, optimizer) in values.iter().zip(optimizers) {
                    out[0].extend(host_values(value)?);
                    out[1].extend(host_values(&optimizer.first_moment())?);
                    out[2].extend(host_values(&optimizer.second_moment())?);
                }
            }
        }
        for v in &mut out {
            v.resize(len, 0.0);
        }
        Ok(out)
    }

    /// The master weights and moments of a checkpoint (the form of [`Self::to_host`]) in
    /// place of the current ones, on `device`, in this master's form.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn restore(
        &mut self,
        values: &[f32],
        moment_1: &[f32],
        moment_2: &[f32],
        steps: usize,
        settings: &AdamWSettings,
        device: &B::Device,
    ) -> Result<(), EngineError> {
        let tensor =
            |v: &[f32]| Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device);
        let optimizer = |m: &[f32], v: &[f32]| {
            ShardOptimizer::from_state(settings.clone(), tensor(m), tensor(v), steps)
                .map_err(|e| EngineError::Optimizer(e.to_string()))
        };
        match self {
            Master::Shard {
                owned,
                optimizer: o,
            } => {
                *owned = tensor(values);
                *o = optimizer(moment_1, moment_2)?;
            }
            Master::Params {
                values: params,
                optimizers,
            } => {
                let mut at = 0;
                for (param, o) in params.iter_mut().zip(optimizers.iter_mut()) {
                    let [n] = param.dims();
                    let range = at..at + n;
                    *param = tensor(&values[range.clone()]);
                    *o = optimizer(&moment_1[range.clone()], &moment_2[range])?;
                    at += n;
                }
            }
        }
        Ok(())
    }
}

/// A 1-D tensor's values on the host, as f32.
pub(super) fn host_values<B: Backend>(t: &Tensor<B, 1>) -> Result<Vec<f32>, EngineError> {
    read(t.clone(), ReadPurpose::Sync)
        .map_err(|e| EngineError::Config(format!("reading master weights: {e:?}")))?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| EngineError::Config(format!("reading master weights: {e:?}")))
}
