//! The linear layer of models trained with zero-bubble schedules: burn-nn's `Linear` whose
//! weight gradient can wait for a later `W` action.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use cubecl_kernels::FusedOps;

/// A linear layer, `y = x·W + b`, with burn-nn `Linear`'s parameters, layout and record, whose
/// weight gradient the engine can defer: in a schedule with a split backward, the `I` action
/// computes the input gradient (and the bias's), keeps `x` and the output gradient, and the
/// `W` action computes `xᵀ·dy` later, where it fills a pipeline bubble.
///
/// Outside such a schedule it trains exactly like `Linear`. Build one from a `Linear`, so
/// initialisation and checkpoints stay burn-nn's:
///
/// ```
/// use burn::backend::Flex;
/// use burn::nn::LinearConfig;
/// use burn_bfpp::model::SplitLinear;
///
/// let layer: SplitLinear<Flex> = LinearConfig::new(16, 32).init(&Default::default()).into();
/// assert_eq!(layer.weight.dims(), [16, 32]);
/// ```
///
/// A stage built only of these (plus embeddings, norms, biases and other parameter-free or
/// vector-parameter layers, whose gradients `I` computes) reports
/// [`super::PipelineStage::splits_weight_grads`]; the engine refuses `I`/`W` schedules for
/// stages that do not.
#[derive(Module, Debug)]
pub struct SplitLinear<B: Backend> {
    /// `[d_in, d_out]`, as in burn-nn's `Linear`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_out]`, if the layer has a bias.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> From<Linear<B>> for SplitLinear<B> {
    fn from(linear: Linear<B>) -> Self {
        SplitLinear {
            weight: linear.weight,
            bias: linear.bias,
        }
    }
}

impl<B: FusedOps> SplitLinear<B> {
    /// `x·W + b` over the last dimension of `x` (`[..., d_in]` → `[..., d_out]`).
    ///
    /// # Panics
    /// If the last dimension of `x` is not `d_in`, as burn-nn's `Linear` does.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let [d_in, d_out] = self.weight.dims();
        assert_eq!(
            dims[D - 1],
            d_in,
            "SplitLinear: the input's last dimension must be the layer's d_in"
        );
        let tokens = dims[..D - 1].iter().product::<usize>();
        // The weight goes into the op as the parameter itself: its tag is the parameter id
        // the engine finds it by, and nothing tracked sits between (see `split_linear`).
        let y = cubecl_kernels::split_linear(
            x.reshape([tokens, d_in]),
            self.weight.val(),
            self.weight.id.val(),
        );
        let y = match &self.bias {
            Some(bias) => y + bias.val().unsqueeze::<2>(),
            None => y,
        };
        let mut out = dims;
        out[D - 1] = d_out;
        y.reshape(out)
    }
}
