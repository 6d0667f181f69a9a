//! Where stages live (stage → rank) and which layers make up a stage (layer → stage).

use std::ops::Range;

use super::ScheduleError;

/// How the `pp · loops` stages are laid onto the `pp` pipeline ranks. In configuration files:
/// its command-line name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Placement {
    /// Stage `s` on rank `s mod pp`: a micro-batch goes around the rank ring `loops` times.
    /// With `loops = 1` this is the contiguous placement of GPipe and 1F1B.
    #[default]
    Looping,
    /// Loop `v` runs ranks upwards when `v` is even and downwards when odd, so stages
    /// `pp-1` and `pp` share a rank (the "V" of zero-bubble schedules).
    VShape,
}

impl Placement {
    /// The rank of every stage, indexed by stage, for `pp` ranks and `loops` stages per rank.
    pub fn stage_ranks(self, pp: usize, loops: usize) -> Vec<usize> {
        (0..pp * loops)
            .map(|stage| {
                let (lap, pos) = (stage / pp, stage % pp);
                match self {
                    Placement::Looping => pos,
                    Placement::VShape if lap % 2 == 1 => pp - 1 - pos,
                    Placement::VShape => pos,
                }
            })
            .collect()
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Looping => "looping",
            Placement::VShape => "v-shape",
        }
    }
}

impl From<Placement> for String {
    fn from(placement: Placement) -> String {
        placement.name().to_string()
    }
}

impl TryFrom<String> for Placement {
    type Error = ScheduleError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl std::str::FromStr for Placement {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "looping" | "contiguous" => Ok(Placement::Looping),
            "v-shape" | "vshape" | "v" => Ok(Placement::VShape),
            other => Err(ScheduleError::Config(format!(
                "unknown placement `{other}`; use `looping` (contiguous when loops = 1) or `v-shape`"
            ))),
        }
    }
}

/// The stages of each rank in local order (the order in which a micro-batch meets them).
pub fn rank_stages(stage_ranks: &[usize], num_ranks: usize) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); num_ranks];
    for (stage, &rank) in stage_ranks.iter().enumerate() {
        out[rank].push(stage);
    }
    out
}

/// How a model's layers are divided into stages.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LayerSplit {
    /// As even as the counts allow; the first `layers mod stages` stages get one layer more.
    #[default]
    Even,
    /// Explicit layer count per stage; must have one entry per stage and sum to the layer count.
    Explicit(Vec<usize>),
}

/// Split `num_layers` consecutive layers into `num_stages` stages; returns each stage's layer range.
///
/// Every stage gets at least one layer: a stage without work would still cost a pipeline hop.
pub fn split_layers(
    num_layers: usize,
    num_stages: usize,
    split: &LayerSplit,
) -> Result<Vec<Range<usize>>, ScheduleError> {
    if num_stages == 0 {
        return Err(ScheduleError::Config(
            "a model needs at least one stage; use pp ≥ 1 and loops ≥ 1".into(),
        ));
    }
    let counts: Vec<usize> = match split {
        LayerSplit::Even => {
            if num_layers < num_stages {
                return Err(ScheduleError::Config(format!(
                    "the model has {num_layers} layers but the layout needs {num_stages} stages \
                     (pp × loops); every stage needs at least one layer: lower pp or loops to make \
                     pp × loops ≤ {num_layers}, or use a deeper model"
                )));
            }
            let (base, extra) = (num_layers / num_stages, num_layers % num_stages);
            (0..num_stages)
                .map(|s| base + usize::from(s < extra))
                .collect()
        }
        LayerSplit::Explicit(counts) => {
            if counts.len() != num_stages {
                return Err(ScheduleError::Config(format!(
                    "the explicit layer split lists {} stages but the layout has {num_stages} \
                     (pp × loops); give one layer count per stage",
                    counts.len()
                )));
            }
            if let Some(stage) = counts.iter().position(|&c| c == 0) {
                return Err(ScheduleError::Config(format!(
                    "the explicit layer split gives stage {stage} no layers; every stage needs at least one"
                )));
            }
            let total: usize = counts.iter().sum();
            if total != num_layers {
                return Err(ScheduleError::Config(format!(
                    "the explicit layer split covers {total} layers but the model has {num_layers}; \
                     make the counts sum to {num_layers}"
                )));
            }
            counts.clone()
        }
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            let range = start..start + c;
            start += c;
            range
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looping_places_stage_s_on_rank_s_mod_p() {
        assert_eq!(Placement::Looping.stage_ranks(3, 2), vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn v_shape_turns_back_on_odd_loops() {
        assert_eq!(
            Placement::VShape.stage_ranks(3, 3),
            vec![0, 1, 2, 2, 1, 0, 0, 1, 2]
        );
        assert_eq!(
            rank_stages(&Placement::VShape.stage_ranks(2, 2), 2),
            vec![vec![0, 3], vec![1, 2]]
        );
    }

    #[test]
    fn even_split_gives_the_remainder_to_the_first_stages() {
        let ranges = split_layers(10, 4, &LayerSplit::Even).unwrap();
        assert_eq!(ranges, vec![0..3, 3..6, 6..8, 8..10]);
    }

    #[test]
    fn explicit_split_is_checked() {
        let ok = split_layers(5, 2, &LayerSplit::Explicit(vec![2, 3])).unwrap();
        assert_eq!(ok, vec![0..2, 2..5]);
        for bad in [vec![2, 2], vec![5], vec![0, 5]] {
            assert!(split_layers(5, 2, &LayerSplit::Explicit(bad)).is_err());
        }
        let err = split_layers(3, 4, &LayerSplit::Even)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("3 layers") && err.contains("4 stages"),
            "{err}"
        );
    }
}
