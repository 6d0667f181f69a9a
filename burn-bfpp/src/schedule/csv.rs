//! CSV import/export of schedules, one row per rank (PyTorch pipelining's layout).
//!
//! `torch.distributed.pipelining` dumps a schedule with Python's `csv.writer`: row `r` holds
//! rank `r`'s actions in order, and idle slots of a compute-only schedule are empty cells. This
//! module writes the same layout without idle slots and reads both forms: cells are trimmed,
//! optional surrounding double quotes are removed, and empty cells are skipped.
//!
//! PyTorch has named the backward actions in two generations. The current one (since its
//! `_ComputationType` gained `BACKWARD_INPUT`/`FULL_BACKWARD`) writes `I` for the input-only
//! backward, `W` for the weight backward and `B` for the full backward; the earlier one wrote
//! `B` for the backward (input-only when a `W` of the same stage and micro-batch follows),
//! `W` for the weight backward and `BW` for the full backward. [`from_csv`] reads both (a `B`
//! with a `W` of its own stage and micro-batch on its rank is the input-only backward, which
//! no current file can mean otherwise, since there a `W` needs an `I`); [`to_csv_with`]
//! writes either.
//!
//! An overlapped forward/backward pair is one cell, `(0F7;7B3)OVERLAP_F_B` as PyTorch's
//! DualPipeV writes it; it reads as its two actions, the first marked
//! [`Action::overlaps_next`](super::Action::overlaps_next), and is written back the same way.

use super::{units, Action, ActionKind, PipelineSchedule, ScheduleError};

/// Which generation of PyTorch's action names a schedule CSV uses for the backward actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CsvNaming {
    /// `I` input-only backward, `W` weight backward, `B` full backward (PyTorch today).
    #[default]
    Current,
    /// `B` input-only backward (followed by its `W`), `W` weight backward, `BW` full
    /// backward (PyTorch's earlier zero-bubble files).
    Legacy,
}

/// Write one line per rank, actions separated by commas, in PyTorch's current naming.
///
/// A rank without actions is an empty line; the text ends with a newline. Communication and
/// collectives are written like compute actions (`1SEND_F0`, `4UNSHARD`).
pub fn to_csv(schedule: &PipelineSchedule) -> String {
    to_csv_with(schedule, CsvNaming::Current)
}

/// [`to_csv`] in the given naming generation.
pub fn to_csv_with(schedule: &PipelineSchedule, naming: CsvNaming) -> String {
    let cell = |a: &Action| match (naming, a.kind) {
        (CsvNaming::Legacy, ActionKind::BackwardInput) => format!("{}B{}", a.stage, a.mb()),
        (CsvNaming::Legacy, ActionKind::Backward) => format!("{}BW{}", a.stage, a.mb()),
        _ => a.to_string(),
    };
    let mut out = String::new();
    for list in &schedule.ranks {
        let row: Vec<String> = units(list)
            .into_iter()
            .map(|unit| match unit {
                (a, Some(second)) => format!("({};{}){OVERLAP}", cell(a), cell(second)),
                (a, None) => cell(a),
            })
            .collect();
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

/// PyTorch's name of the composite action that holds an overlapped forward/backward pair.
const OVERLAP: &str = "OVERLAP_F_B";

/// Read a schedule written by [`to_csv`] or by PyTorch (empty cells are idle slots).
///
/// Line `r` (1-based `r + 1`) is rank `r`; an empty line is a rank without actions. A cell that
/// is not an action string fails with [`ScheduleError::Csv`] naming its line and column.
pub fn from_csv(text: &str) -> Result<PipelineSchedule, ScheduleError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let ranks: Vec<Vec<Action>> = text
        .lines()
        .enumerate()
        .map(|(i, line)| parse_row(i + 1, line))
        .collect::<Result<_, _>>()?;
    if ranks.iter().all(Vec::is_empty) {
        return Err(ScheduleError::Invalid {
            report: "the schedule CSV holds no actions; expected one line per rank with \
                     comma-separated actions, as in `0F0,0F1,0B0,0B1`"
                .into(),
        });
    }
    PipelineSchedule::from_rank_lists(ranks)
}

fn parse_row(line: usize, row: &str) -> Result<Vec<Action>, ScheduleError> {
    let mut actions = Vec::new();
    for (i, cell) in row.split(',').enumerate() {
        let cell = unquote(cell.trim()).trim();
        if cell.is_empty() {
            continue;
        }
        let parsed = parse_composite(cell).map_err(|source| ScheduleError::Csv {
            line,
            column: i + 1,
            source: Box::new(source),
        })?;
        actions.extend(parsed);
    }
    Ok(earlier_backwards_as_input_only(actions))
}

/// One cell: an action, or a `(first;second)OVERLAP_F_B` pair as its two actions with the
/// first marked [`Action::overlaps_next`].
fn parse_composite(cell: &str) -> Result<Vec<Action>, ScheduleError> {
    let Some(inner) = cell.strip_prefix('(') else {
        return Ok(vec![parse_cell(cell)?]);
    };
    let bad = |reason: &str| ScheduleError::ParseAction {
        text: cell.to_string(),
        reason: reason.to_string(),
    };
    let Some((halves, kind)) = inner.split_once(')') else {
        return Err(bad(
            "a composite action needs its closing parenthesis, as in `(0F7;7B3)OVERLAP_F_B`",
        ));
    };
    if kind.trim() != OVERLAP {
        return Err(bad(&format!(
            "the only composite action is {OVERLAP}, an overlapped forward/backward pair \
             written `(0F7;7B3){OVERLAP}`"
        )));
    }
    let halves: Vec<&str> = halves.split(';').map(str::trim).collect();
    let [first, second] = halves[..] else {
        return Err(bad(&format!(
            "an {OVERLAP} pair holds exactly two actions separated by `;` (found {}), as in \
             `(0F7;7B3){OVERLAP}`",
            halves.len()
        )));
    };
    Ok(vec![
        parse_cell(first)?.overlapping_next(),
        parse_cell(second)?,
    ])
}

/// One action, in either naming generation (`BW` is the earlier full backward).
fn parse_cell(cell: &str) -> Result<Action, ScheduleError> {
    let unsupported = |reason: &str| ScheduleError::ParseAction {
        text: cell.to_string(),
        reason: reason.to_string(),
    };
    if cell.starts_with('(') {
        return Err(unsupported(
            "a composite action cannot hold another composite action; write each pair as \
             `(forward;backward)OVERLAP_F_B`",
        ));
    }
    if cell.contains("SEND_F_RECV_B") || cell.contains("SEND_B_RECV_F") {
        return Err(unsupported(
            "PyTorch's earlier combined send/receive actions are not supported; write the \
             SEND and the RECV as two actions",
        ));
    }
    let digits = cell.find(|c: char| !c.is_ascii_digit()).unwrap_or(0);
    if let Some(mb) = cell[digits..].strip_prefix("BW") {
        let as_full = format!("{}B{mb}", &cell[..digits]);
        return as_full.parse::<Action>();
    }
    cell.parse()
}

/// A rank's `B` whose stage and micro-batch also have a `W` on that rank is the earlier
/// naming's input-only backward.
fn earlier_backwards_as_input_only(mut actions: Vec<Action>) -> Vec<Action> {
    let weights: std::collections::HashSet<(usize, usize)> = actions
        .iter()
        .filter(|a| a.kind == ActionKind::BackwardWeight)
        .map(|a| (a.stage, a.mb()))
        .collect();
    for a in &mut actions {
        if a.kind == ActionKind::Backward && weights.contains(&(a.stage, a.mb())) {
            a.kind = ActionKind::BackwardInput;
        }
    }
    actions
}

/// `message` (an error about a schedule read with [`from_csv`]) with the file line of every
/// rank it names: `rank 2` becomes `rank 2 (line 3)`, since line r + 1 holds rank r. Lines of
/// a drawn grid (columns separated by ` | `) stay as they are, aligned.
pub fn with_file_lines(message: &str) -> String {
    message
        .split('\n')
        .map(|line| {
            if line.contains(" | ") {
                line.to_string()
            } else {
                annotate_ranks(line)
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn annotate_ranks(line: &str) -> String {
    let mut out = String::with_capacity(line.len() + 16);
    let mut rest = line;
    while let Some(at) = rest.find("rank ") {
        let (before, after) = rest.split_at(at + "rank ".len());
        out.push_str(before);
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let (number, tail) = after.split_at(digits);
        out.push_str(number);
        if let Ok(rank) = number.parse::<usize>() {
            out.push_str(&format!(" (line {})", rank + 1));
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

fn unquote(cell: &str) -> &str {
    cell.strip_prefix('"')
        .and_then(|c| c.strip_suffix('"'))
        .unwrap_or(cell)
}

#[cfg(test)]
mod tests {
    use super::super::{ActionKind, Placement, ScheduleKind, ScheduleSpec};
    use super::*;

    #[test]
    fn errors_name_the_file_line_of_each_rank() {
        assert_eq!(
            with_file_lines("0W0 runs before 0I0 on rank 0; rank 12 waits, ranks agree"),
            "0W0 runs before 0I0 on rank 0 (line 1); rank 12 (line 13) waits, ranks agree"
        );
        let s = from_csv("0F0,0W0,0I0\n").unwrap();
        let msg = with_file_lines(&super::super::validate(&s).unwrap_err().to_string());
        assert!(msg.contains("rank 0 (line 1)"), "{msg}");
        let grid = "   step | rank 0 | rank 1\n      0 | 0F0    | .";
        assert_eq!(with_file_lines(grid), grid);
    }

    #[test]
    fn generated_schedules_round_trip() {
        let specs = [
            ScheduleSpec::new(ScheduleKind::GPipe, 3, 1, 4),
            ScheduleSpec::new(ScheduleKind::OneFOneB, 4, 1, 6),
            ScheduleSpec::new(ScheduleKind::Interleaved, 2, 3, 4),
            ScheduleSpec::new(ScheduleKind::BreadthFirst, 4, 2, 8),
            ScheduleSpec::new(ScheduleKind::BreadthFirst, 3, 2, 6)
                .with_bf_microbatches(2)
                .with_placement(Placement::VShape),
        ];
        for spec in specs {
            let schedule = spec.generate().unwrap();
            let text = to_csv(&schedule);
            assert_eq!(text.lines().count(), spec.pp, "{spec:?}");
            assert!(text.ends_with('\n'));
            assert_eq!(from_csv(&text).unwrap(), schedule, "{spec:?}");
        }
    }

    #[test]
    fn communication_and_collectives_round_trip() {
        let ranks = vec![
            vec![
                Action::collective(0, ActionKind::Unshard),
                Action::forward(0, 0),
                Action::new(0, ActionKind::SendForward, 0),
                Action::new(0, ActionKind::RecvBackward, 0),
                Action::backward(0, 0),
                Action::collective(0, ActionKind::ReduceGrad),
            ],
            vec![
                Action::new(1, ActionKind::RecvForward, 0),
                Action::forward(1, 0),
                Action::backward(1, 0),
                Action::new(1, ActionKind::SendBackward, 0),
            ],
        ];
        let schedule = PipelineSchedule::from_rank_lists(ranks).unwrap();
        let text = to_csv(&schedule);
        assert_eq!(
            text,
            "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\n1RECV_F0,1F0,1B0,1SEND_B0\n"
        );
        assert_eq!(from_csv(&text).unwrap(), schedule);
    }

    #[test]
    fn pytorch_rows_with_idle_cells_quotes_and_spaces() {
        // As csv.writer dumps a compute-only schedule whose idle slots are None.
        let text = "0F0,0F1,,,0B0,0B1\r\n,1F0, 1F1 ,1B0,\"1B1\",\r\n";
        let schedule = from_csv(text).unwrap();
        assert_eq!(schedule.stage_ranks, vec![0, 1]);
        assert_eq!(schedule.microbatches, 2);
        assert_eq!(
            schedule.ranks[1],
            vec![
                Action::forward(1, 0),
                Action::forward(1, 1),
                Action::backward(1, 0),
                Action::backward(1, 1)
            ]
        );
        assert_eq!(
            to_csv(&schedule),
            "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n",
            "idle slots are not written back"
        );
    }

    #[test]
    fn empty_lines_are_ranks_without_actions() {
        let schedule = PipelineSchedule {
            stage_ranks: vec![0, 2],
            microbatches: 1,
            ranks: vec![
                vec![Action::forward(0, 0), Action::backward(0, 0)],
                vec![],
                vec![Action::forward(1, 0), Action::backward(1, 0)],
            ],
        };
        let text = to_csv(&schedule);
        assert_eq!(text, "0F0,0B0\n\n1F0,1B0\n");
        assert_eq!(from_csv(&text).unwrap(), schedule);
    }

    #[test]
    fn malformed_cell_names_line_and_column() {
        let err = from_csv("0F0,0B0\n1F0,,1X0,1B0\n").unwrap_err();
        match &err {
            ScheduleError::Csv {
                line,
                column,
                source,
            } => {
                assert_eq!((*line, *column), (2, 3));
                assert!(matches!(**source, ScheduleError::ParseAction { .. }));
            }
            other => panic!("expected a CSV error, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("line 2") && msg.contains("column 3"), "{msg}");
        assert!(msg.contains("1X0"), "{msg}");
    }

    /// A 1F1B schedule whose backwards are split into `I` then `W`, the weight passes of the
    /// first micro-batches postponed to the end (as zero-bubble schedules do), plus one full
    /// backward, so that both generations' every backward name occurs.
    fn split_backward_schedule() -> PipelineSchedule {
        let mut s = ScheduleSpec::new(ScheduleKind::OneFOneB, 2, 1, 3)
            .generate()
            .unwrap();
        for list in &mut s.ranks {
            let mut out = Vec::new();
            let mut postponed = Vec::new();
            for &a in list.iter() {
                if a.kind == ActionKind::Backward && a.mb() < 2 {
                    out.push(Action::new(a.stage, ActionKind::BackwardInput, a.mb()));
                    postponed.push(Action::new(a.stage, ActionKind::BackwardWeight, a.mb()));
                } else {
                    out.push(a);
                }
            }
            out.extend(postponed);
            *list = out;
        }
        s
    }

    #[test]
    fn both_backward_namings_round_trip() {
        let schedule = split_backward_schedule();
        let current = to_csv(&schedule);
        assert!(
            current.starts_with("0F0,0F1,0I0,0F2,0I1,0B2,0W0,0W1\n"),
            "{current}"
        );
        let legacy = to_csv_with(&schedule, CsvNaming::Legacy);
        assert!(
            legacy.starts_with("0F0,0F1,0B0,0F2,0B1,0BW2,0W0,0W1\n"),
            "{legacy}"
        );
        assert_eq!(from_csv(&current).unwrap(), schedule);
        assert_eq!(from_csv(&legacy).unwrap(), schedule);
        // A generated schedule without weight passes reads the same in both.
        let plain = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 4)
            .generate()
            .unwrap();
        let legacy = to_csv_with(&plain, CsvNaming::Legacy);
        assert!(legacy.contains("BW"), "{legacy}");
        assert_eq!(from_csv(&legacy).unwrap(), plain);
    }

    #[test]
    fn overlapped_pairs_read_as_two_actions_and_write_back_as_one_cell() {
        let text = "0F0,(0F1;1B0)OVERLAP_F_B,0B1\n";
        let s = from_csv(text).unwrap();
        assert_eq!(
            s.ranks[0],
            vec![
                Action::forward(0, 0),
                Action::forward(0, 1).overlapping_next(),
                Action::backward(1, 0),
                Action::backward(0, 1),
            ]
        );
        assert_eq!(to_csv(&s), text);
        // Spaces and quotes as csv.writer may leave them; the earlier naming inside a pair.
        let s = from_csv("\" ( 0F2 ; 1BW1 )OVERLAP_F_B\"\n").unwrap();
        assert_eq!(
            s.ranks[0],
            vec![
                Action::forward(0, 2).overlapping_next(),
                Action::backward(1, 1)
            ]
        );
        assert_eq!(
            to_csv_with(&s, CsvNaming::Legacy),
            "(0F2;1BW1)OVERLAP_F_B\n"
        );
    }

    #[test]
    fn malformed_pairs_name_line_column_and_form() {
        for (cell, want) in [
            ("(0F1;1B0", "closing parenthesis"),
            ("(0F1;1B0)OVERLAP_B_F", "only composite action"),
            ("(0F1)OVERLAP_F_B", "exactly two actions"),
            ("(0F1;1B0;0B1)OVERLAP_F_B", "exactly two actions"),
            ("(0F1;1X0)OVERLAP_F_B", "unknown action kind"),
        ] {
            let msg = from_csv(&format!("0F0\n1F0,{cell}\n"))
                .unwrap_err()
                .to_string();
            assert!(msg.contains("line 2") && msg.contains("column 2"), "{msg}");
            assert!(msg.contains(want), "{cell}: {msg}");
        }
        let msg = from_csv("0F0\n1SEND_B_RECV_F0\n").unwrap_err().to_string();
        assert!(
            msg.contains("line 2") && msg.contains("two actions"),
            "{msg}"
        );
    }

    #[test]
    fn a_pair_whose_halves_belong_to_different_ranks_is_refused() {
        // Stage 1 runs on rank 1, so rank 0 cannot run 1B0 in a pair.
        let msg = from_csv("0F0,(0F1;1B0)OVERLAP_F_B,0B0,0B1\n1F0,1F1,1B1\n")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("stage 1") && msg.contains("OVERLAP_F_B pair"),
            "{msg}"
        );
        assert!(msg.contains("rank 0") && msg.contains("rank 1"), "{msg}");
    }

    #[test]
    fn empty_file_is_a_clear_error() {
        for text in ["", "\n", " , \n\n"] {
            let msg = from_csv(text).unwrap_err().to_string();
            assert!(msg.contains("no actions"), "{text:?}: {msg}");
        }
    }

    #[test]
    fn stage_on_two_ranks_is_rejected() {
        let msg = from_csv("0F0,0B0\n0F1\n").unwrap_err().to_string();
        assert!(msg.contains("stage 0"), "{msg}");
    }
}
