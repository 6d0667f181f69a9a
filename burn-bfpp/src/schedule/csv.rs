//! CSV import/export of schedules, one row per rank (PyTorch pipelining's layout).
//!
//! `torch.distributed.pipelining` dumps a schedule with Python's `csv.writer`: row `r` holds
//! rank `r`'s actions in order, and idle slots of a compute-only schedule are empty cells. This
//! module writes the same layout without idle slots and reads both forms: cells are trimmed,
//! optional surrounding double quotes are removed, and empty cells are skipped.

use super::{Action, PipelineSchedule, ScheduleError};

/// Write one line per rank, actions separated by commas.
///
/// A rank without actions is an empty line; the text ends with a newline. Communication and
/// collectives are written like compute actions (`1SEND_F0`, `4UNSHARD`).
pub fn to_csv(schedule: &PipelineSchedule) -> String {
    let mut out = String::new();
    for list in &schedule.ranks {
        let row: Vec<String> = list.iter().map(Action::to_string).collect();
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

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
        let action = cell
            .parse::<Action>()
            .map_err(|source| ScheduleError::Csv {
                line,
                column: i + 1,
                source: Box::new(source),
            })?;
        actions.push(action);
    }
    Ok(actions)
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
