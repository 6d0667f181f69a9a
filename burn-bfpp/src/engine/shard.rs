//! Layout of a stage's flat parameter buffer across the data-parallel group.

use crate::schedule::ZeroLevel;

/// How one stage's parameters are laid out: `numel` real values, padded with zeros to a
/// multiple of the data-parallel size so every rank owns an equal contiguous shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    /// Number of real parameter values of the stage.
    pub numel: usize,
    /// Length after padding (a multiple of `dp`).
    pub padded: usize,
    /// Data-parallel group size.
    pub dp: usize,
    /// This rank's index in the data-parallel group.
    pub dp_index: usize,
    /// Whether the optimizer state and the update are sharded (ZeRO ≥ 1).
    pub sharded: bool,
}

impl ShardLayout {
    /// The layout of a stage with `numel` parameters for a rank of a data-parallel group.
    pub fn new(numel: usize, dp: usize, dp_index: usize, zero: ZeroLevel) -> Self {
        ShardLayout {
            numel,
            padded: numel.div_ceil(dp.max(1)) * dp.max(1),
            dp,
            dp_index,
            sharded: zero != ZeroLevel::Zero0,
        }
    }

    /// Length of the part of the buffer this rank updates (its shard, or everything at ZeRO-0).
    pub fn owned_len(&self) -> usize {
        if self.sharded {
            self.padded / self.dp
        } else {
            self.padded
        }
    }

    /// Offset of the owned part in the padded buffer.
    pub fn owned_offset(&self) -> usize {
        if self.sharded {
            self.dp_index * self.owned_len()
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_equal_and_cover_the_padded_buffer() {
        let layouts: Vec<_> = (0..3)
            .map(|i| ShardLayout::new(10, 3, i, ZeroLevel::Zero3))
            .collect();
        assert_eq!(layouts[0].padded, 12);
        assert_eq!(
            layouts
                .iter()
                .map(|l| (l.owned_offset(), l.owned_len()))
                .collect::<Vec<_>>(),
            vec![(0, 4), (4, 4), (8, 4)]
        );
        let zero0 = ShardLayout::new(10, 3, 2, ZeroLevel::Zero0);
        assert_eq!((zero0.owned_offset(), zero0.owned_len()), (0, 12));
    }
}

/// One stage's training state on one rank: its owned shard of the padded flat parameters and
/// the AdamW moments of that shard.
#[derive(Debug, Clone, PartialEq)]
pub struct StageState {
    /// Global stage index.
    pub stage: usize,
    /// How the stage's flat parameters are laid out over the data-parallel group.
    pub layout: ShardLayout,
    /// The owned part of the padded flat parameters (`layout.owned_len()` values).
    pub owned: Vec<f32>,
    /// AdamW first moment of the owned part.
    pub moment_1: Vec<f32>,
    /// AdamW second moment of the owned part.
    pub moment_2: Vec<f32>,
    /// AdamW steps taken (the bias-correction counter).
    pub optimizer_steps: usize,
}
