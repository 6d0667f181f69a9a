//! Which layers make up each stage: even, explicit (both from [`crate::schedule::split_layers`])
//! or balanced by per-layer cost.

use std::ops::Range;

use burn::tensor::backend::Backend;

use super::{ModelDescription, ModelError, PipelineModel};
use crate::schedule::{split_layers, LayerSplit};

/// How a model's layers are divided into stages. In configuration files: `"even"`,
/// `"balanced"` or layer counts such as `"3,4,4,3"`.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ModelSplit {
    /// As even as the layer counts allow; the first `layers mod stages` stages get one more.
    #[default]
    Even,
    /// Contiguous ranges minimising the largest stage cost, using
    /// [`PipelineModel::layer_costs`]; see [`balanced_split`].
    Balanced,
    /// Explicit layer count per stage (one entry per stage, summing to the layer count).
    Explicit(Vec<usize>),
}

impl From<ModelSplit> for String {
    fn from(split: ModelSplit) -> String {
        match split {
            ModelSplit::Even => "even".into(),
            ModelSplit::Balanced => "balanced".into(),
            ModelSplit::Explicit(counts) => counts
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(","),
        }
    }
}

impl TryFrom<String> for ModelSplit {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl std::str::FromStr for ModelSplit {
    type Err = ModelError;

    /// Parses `even`, `balanced` or a comma-separated list of layer counts such as `3,4,4,3`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "even" => Ok(ModelSplit::Even),
            "balanced" | "cost" => Ok(ModelSplit::Balanced),
            list => list
                .split(',')
                .map(|c| c.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map(ModelSplit::Explicit)
                .map_err(|_| {
                    ModelError::Split(format!(
                        "unknown layer split `{s}`; use `even`, `balanced`, or layer counts per \
                         stage such as `3,4,4,3`"
                    ))
                }),
        }
    }
}

/// The layer range of every stage of `model` for `num_stages` stages.
pub fn split_model<B: Backend, M: PipelineModel<B>>(
    model: &M,
    num_stages: usize,
    split: &ModelSplit,
) -> Result<Vec<Range<usize>>, ModelError> {
    split.ranges(model.num_layers(), || model.layer_costs(), num_stages)
}

/// The layer range of every stage of a described model for `num_stages` stages.
pub fn split_described<B: Backend, M: ModelDescription<B>>(
    model: &M,
    num_stages: usize,
    split: &ModelSplit,
) -> Result<Vec<Range<usize>>, ModelError> {
    split.ranges(model.num_layers(), || model.layer_costs(), num_stages)
}

impl ModelSplit {
    /// The layer range of every stage for a model of `num_layers` layers whose costs
    /// `costs` gives (asked for only by [`ModelSplit::Balanced`]).
    fn ranges(
        &self,
        num_layers: usize,
        costs: impl FnOnce() -> Vec<f64>,
        num_stages: usize,
    ) -> Result<Vec<Range<usize>>, ModelError> {
        let by_count = |split: LayerSplit| {
            split_layers(num_layers, num_stages, &split)
                .map_err(|e| ModelError::Split(e.to_string()))
        };
        match self {
            ModelSplit::Even => by_count(LayerSplit::Even),
            ModelSplit::Explicit(counts) => by_count(LayerSplit::Explicit(counts.clone())),
            ModelSplit::Balanced => {
                let costs = costs();
                if costs.len() != num_layers {
                    return Err(ModelError::Split(format!(
                        "the model reports {} layer costs for {num_layers} layers; \
                         `layer_costs` must return one cost per layer",
                        costs.len()
                    )));
                }
                balanced_split(&costs, num_stages)
            }
        }
    }
}

/// Splits layers with the given relative costs into `num_stages` contiguous, non-empty ranges
/// so that the most expensive stage is as cheap as possible.
///
/// The pipeline runs at the pace of its slowest stage, so the largest stage cost is the
/// quantity to minimise. Among the splits that reach it, the one with the smallest sum of
/// squared stage costs is chosen (the most even one), and remaining ties give earlier stages
/// more layers, so equal costs give exactly the [`ModelSplit::Even`] split.
///
/// Costs must be finite and non-negative. Runs in `O(stages · layers²)`, which is negligible
/// for the few hundred layers of any real model.
pub fn balanced_split(costs: &[f64], num_stages: usize) -> Result<Vec<Range<usize>>, ModelError> {
    let n = costs.len();
    if num_stages == 0 {
        return Err(ModelError::Split(
            "a model needs at least one stage; use pp ≥ 1 and loops ≥ 1".into(),
        ));
    }
    if n < num_stages {
        return Err(ModelError::Split(format!(
            "the model has {n} layers but the layout needs {num_stages} stages (pp × loops); \
             every stage needs at least one layer: lower pp or loops, or use a deeper model"
        )));
    }
    if let Some(i) = costs.iter().position(|c| !c.is_finite() || *c < 0.0) {
        return Err(ModelError::Split(format!(
            "layer {i} has cost {}; layer costs must be finite and non-negative",
            costs[i]
        )));
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let cost = |j: usize, i: usize| prefix[i] - prefix[j];

    // Phase 1: the smallest achievable maximum stage cost. best[k][i] is the optimum for the
    // first i layers in k stages.
    let mut best = vec![vec![f64::INFINITY; n + 1]; num_stages + 1];
    best[0][0] = 0.0;
    for k in 1..=num_stages {
        for i in k..=n - (num_stages - k) {
            best[k][i] = (k - 1..i)
                .map(|j| best[k - 1][j].max(cost(j, i)))
                .fold(f64::INFINITY, f64::min);
        }
    }
    // Allow for rounding in the prefix sums so that splits of equal true cost all qualify.
    let cap = best[num_stages][n] * (1.0 + 1e-12) + 1e-300;

    // Phase 2: under that cap, minimise the sum of squared stage costs; `from[k][i]` keeps the
    // start of the last stage. Scanning `j` downwards with a strict `<` keeps the largest `j`
    // among equal sums, i.e. later stages get fewer layers, matching the even split's rule.
    let mut sq = vec![vec![f64::INFINITY; n + 1]; num_stages + 1];
    let mut from = vec![vec![0usize; n + 1]; num_stages + 1];
    sq[0][0] = 0.0;
    for k in 1..=num_stages {
        for i in k..=n - (num_stages - k) {
            for j in (k - 1..i).rev() {
                let c = cost(j, i);
                if c <= cap && sq[k - 1][j].is_finite() {
                    let total = sq[k - 1][j] + c * c;
                    if total < sq[k][i] {
                        sq[k][i] = total;
                        from[k][i] = j;
                    }
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(num_stages);
    let mut end = n;
    for k in (1..=num_stages).rev() {
        let start = from[k][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

/// The summed cost of each stage's layers.
pub fn stage_costs(costs: &[f64], ranges: &[Range<usize>]) -> Vec<f64> {
    ranges
        .iter()
        .map(|r| costs.get(r.clone()).map_or(0.0, |c| c.iter().sum()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimum by brute force over all contiguous splits (small inputs only).
    fn brute_force_max(costs: &[f64], stages: usize) -> f64 {
        fn go(costs: &[f64], start: usize, stages: usize) -> f64 {
            if stages == 1 {
                return costs[start..].iter().sum();
            }
            (start + 1..=costs.len() - (stages - 1))
                .map(|end| {
                    let here: f64 = costs[start..end].iter().sum();
                    here.max(go(costs, end, stages - 1))
                })
                .fold(f64::INFINITY, f64::min)
        }
        go(costs, 0, stages)
    }

    fn check_cover(ranges: &[Range<usize>], n: usize, stages: usize) {
        assert_eq!(ranges.len(), stages);
        assert_eq!(ranges[0].start, 0);
        assert_eq!(ranges[stages - 1].end, n);
        for w in ranges.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        assert!(ranges.iter().all(|r| !r.is_empty()));
    }

    #[test]
    fn equal_costs_give_the_even_split() {
        for n in 1..14 {
            for stages in 1..=n {
                let balanced = balanced_split(&vec![1.0; n], stages).unwrap();
                let even = split_layers(n, stages, &LayerSplit::Even).unwrap();
                assert_eq!(balanced, even, "n = {n}, stages = {stages}");
            }
        }
    }

    #[test]
    fn heavy_ends_get_stages_of_their_own() {
        // A GPT-like profile: cheap embedding, eight blocks, an expensive head.
        let mut costs = vec![0.1];
        costs.extend([1.0; 8]);
        costs.push(3.0);
        let ranges = balanced_split(&costs, 4).unwrap();
        check_cover(&ranges, costs.len(), 4);
        assert_eq!(ranges[3], 9..10, "the head alone is the slowest stage");
        let max = stage_costs(&costs, &ranges).into_iter().fold(0.0, f64::max);
        assert_eq!(max, 3.0);
        // The even split would put the head with another block.
        let even = split_layers(10, 4, &LayerSplit::Even).unwrap();
        assert!(stage_costs(&costs, &even).into_iter().fold(0.0, f64::max) > 3.0);
    }

    #[test]
    fn matches_brute_force_on_irregular_costs() {
        // A fixed pseudo-random sequence keeps the test deterministic.
        let mut state = 12345u64;
        for case in 0..60 {
            let n = 1 + case % 9;
            let costs: Vec<f64> = (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 97) as f64 / 7.0
                })
                .collect();
            for stages in 1..=n {
                let ranges = balanced_split(&costs, stages).unwrap();
                check_cover(&ranges, n, stages);
                let got = stage_costs(&costs, &ranges).into_iter().fold(0.0, f64::max);
                let want = brute_force_max(&costs, stages);
                assert!(
                    (got - want).abs() <= 1e-9 * want.max(1.0),
                    "{costs:?} / {stages}"
                );
            }
        }
    }

    #[test]
    fn rejects_impossible_requests() {
        assert!(matches!(
            balanced_split(&[1.0; 3], 0),
            Err(ModelError::Split(_))
        ));
        assert!(matches!(
            balanced_split(&[1.0; 3], 4),
            Err(ModelError::Split(_))
        ));
        assert!(matches!(
            balanced_split(&[1.0, f64::NAN], 1),
            Err(ModelError::Split(_))
        ));
        assert!(matches!(
            balanced_split(&[1.0, -1.0], 1),
            Err(ModelError::Split(_))
        ));
    }

    #[test]
    fn parses_split_names() {
        assert_eq!("even".parse::<ModelSplit>().unwrap(), ModelSplit::Even);
        assert_eq!(
            "balanced".parse::<ModelSplit>().unwrap(),
            ModelSplit::Balanced
        );
        assert_eq!(
            "3, 4,3".parse::<ModelSplit>().unwrap(),
            ModelSplit::Explicit(vec![3, 4, 3])
        );
        assert!("fast".parse::<ModelSplit>().is_err());
    }
}
