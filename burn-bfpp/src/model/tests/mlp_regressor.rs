//! A second model for the splitting tests: a deep MLP regressor. Layer 0 maps features to the
//! hidden width, layers 1..=depth are hidden layers, the last layer is the output projection
//! with a mean squared error. Between stages the activations are [batch, 1, width].

use std::ops::Range;

use burn::module::{Initializer, Module};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;

use super::super::*;

#[derive(Module, Debug)]
pub(super) struct Mlp<B: Backend> {
    pub(super) layers: Vec<Linear<B>>,
}

#[derive(Module, Debug)]
pub(super) struct MlpStage<B: Backend> {
    layers: Vec<Linear<B>>,
    start: usize,
    end: usize,
    num_layers: usize,
}

impl<B: Backend> Mlp<B> {
    pub(super) fn new(
        inputs: usize,
        width: usize,
        depth: usize,
        outputs: usize,
        device: &B::Device,
    ) -> Self {
        // Tests build models on parallel threads: keep the draws of one model together.
        let _draws = crate::model::random_init_lock();
        let mut dims = vec![inputs];
        dims.extend(std::iter::repeat_n(width, depth + 1));
        dims.push(outputs);
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.3,
        };
        let layers = dims
            .windows(2)
            .map(|d| {
                LinearConfig::new(d[0], d[1])
                    .with_initializer(init.clone())
                    .init(device)
            })
            .collect();
        let model = Mlp { layers };
        materialize(&model);
        model
    }
}

impl<B: Backend> PipelineModel<B> for Mlp<B> {
    type Stage = MlpStage<B>;

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer_costs(&self) -> Vec<f64> {
        self.layers
            .iter()
            .map(|l| l.weight.shape().num_elements() as f64)
            .collect()
    }

    fn stage(&self, layers: Range<usize>) -> Result<MlpStage<B>, ModelError> {
        check_range(&layers, self.num_layers())?;
        Ok(MlpStage {
            layers: self.layers[layers.clone()].to_vec(),
            start: layers.start,
            end: layers.end,
            num_layers: self.num_layers(),
        })
    }
}

impl<B: Backend> PipelineStage<B> for MlpStage<B> {
    fn layers(&self) -> Range<usize> {
        self.start..self.end
    }

    fn is_last(&self) -> bool {
        self.end == self.num_layers
    }

    fn forward(
        &self,
        input: StageInput<B>,
        targets: Option<&Targets<B>>,
    ) -> Result<StageOutput<B>, ModelError> {
        let wrong = |reason: &str| ModelError::StageInput {
            layers: self.layers(),
            reason: reason.into(),
        };
        let mut x = match (input, self.is_first()) {
            (StageInput::Data(Inputs::Features(f)), true) => f.unsqueeze_dim::<3>(1),
            (StageInput::Hidden(h), false) => h,
            _ => {
                return Err(wrong(
                    "first stage takes features, the others hidden states",
                ))
            }
        };
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if self.start + i + 1 < self.num_layers {
                x = gelu(x);
            }
        }
        if !self.is_last() {
            return Ok(StageOutput::Hidden(x));
        }
        let Some(Targets::Values(t)) = targets else {
            return Err(wrong("the last stage needs target values"));
        };
        let [batch, _, outputs] = x.dims();
        let diff = x.reshape([batch, outputs]) - t.clone();
        Ok(StageOutput::Loss(diff.powi_scalar(2).mean()))
    }
}
