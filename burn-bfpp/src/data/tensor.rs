//! Turning samples into the Burn tensors the pipeline stages consume.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::{BatchLayout, Batcher, DataError, Sample};
use crate::model::{Inputs, MicroBatch, Targets};

/// Stacks samples into a token micro-batch: inputs and targets `[samples, seq_len]`.
pub fn to_micro_batch<B: Backend>(
    samples: &[Sample<'_>],
    device: &B::Device,
) -> Result<MicroBatch<B>, DataError> {
    let seq_len = samples.first().map_or(0, |s| s.inputs.len());
    if seq_len == 0 || samples.iter().any(|s| s.inputs.len() != seq_len) {
        return Err(DataError::Layout(
            "a micro-batch needs at least one sample, all of the same non-zero length".into(),
        ));
    }
    let stack = |targets: bool| {
        let ids: Vec<i64> = samples
            .iter()
            .flat_map(|s| if targets { s.targets } else { s.inputs })
            .map(|&t| i64::from(t))
            .collect();
        // `from_data` converts the i64 ids to the backend's integer type.
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [samples.len(), seq_len]), device)
    };
    Ok(MicroBatch {
        inputs: Inputs::Tokens(stack(false)),
        targets: Targets::Tokens(stack(true)),
    })
}

impl Batcher {
    /// Micro-batch `microbatch` of data-parallel replica `dp_index` in optimizer step `step`
    /// (0-based) as Burn tensors on `device`; see [`Batcher::micro_batch_samples`] for which
    /// samples it holds.
    pub fn micro_batch<B: Backend>(
        &self,
        step: u64,
        layout: &BatchLayout,
        dp_index: usize,
        microbatch: usize,
        device: &B::Device,
    ) -> Result<MicroBatch<B>, DataError> {
        let samples = self.micro_batch_samples(step, layout, dp_index, microbatch)?;
        to_micro_batch(&samples, device)
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::data::BatchConfig;

    type B = burn::backend::Flex;

    #[test]
    fn micro_batch_tensors_hold_the_samples() {
        let tokens: std::sync::Arc<[u32]> = (0..200u32).map(|t| t % 256).collect();
        let batcher =
            Batcher::from_tokens(tokens, "counting", BatchConfig::new(5, 4, 3)).expect("batcher");
        let layout = BatchLayout {
            dp: 2,
            microbatches: 1,
            micro_batch_size: 2,
        };
        let device = Default::default();
        let batch = batcher
            .micro_batch::<B>(3, &layout, 1, 0, &device)
            .expect("micro-batch");
        let samples = batcher
            .micro_batch_samples(3, &layout, 1, 0)
            .expect("samples");
        let (Inputs::Tokens(inputs), Targets::Tokens(targets)) = (batch.inputs, batch.targets)
        else {
            panic!("token micro-batch expected");
        };
        assert_eq!(inputs.dims(), [2, 5]);
        let flat = |t: Tensor<B, 2, Int>| -> Vec<i64> {
            t.into_data().convert::<i64>().to_vec().expect("int data")
        };
        let expect = |targets: bool| -> Vec<i64> {
            samples
                .iter()
                .flat_map(|s| if targets { s.targets } else { s.inputs })
                .map(|&t| i64::from(t))
                .collect()
        };
        assert_eq!(flat(inputs), expect(false));
        assert_eq!(flat(targets), expect(true));
        assert!(to_micro_batch::<B>(&[], &device).is_err());
    }
}
