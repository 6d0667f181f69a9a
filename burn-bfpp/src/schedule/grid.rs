//! Text renderings of a schedule: the per-rank compute order and the time-step × rank grid.
//!
//! The grid is drawn from the same unit-time replay the validator runs (forward 1, backward 2,
//! transfers and collectives free), so what it shows is what the validator measured.

use std::fmt::Write as _;

use super::{
    replay, unit_cost, units, PipelineSchedule, ReplayOutcome, ScheduleError, SendMode, Timeline,
};

/// Mark of a rank that is idle during a time step.
const IDLE: &str = ".";

/// One line per rank, `rank R: ` then its compute actions in order.
///
/// Communication and collectives are left out; an overlapped pair is written `(0F7;7B3)`; the
/// line of a rank without compute actions is just `rank R: `.
pub fn render_actions(schedule: &PipelineSchedule) -> String {
    let mut out = String::new();
    for (rank, list) in schedule.ranks.iter().enumerate() {
        let actions: Vec<String> = units(list.iter().filter(|a| a.kind.is_compute()))
            .into_iter()
            .map(|unit| match unit {
                (a, Some(second)) => format!("({a};{second})"),
                (a, None) => a.to_string(),
            })
            .collect();
        // Writing into a String cannot fail.
        let _ = writeln!(out, "rank {rank}: {}", actions.join(" "));
    }
    out
}

/// The time-step × rank table of the unit-time replay (forward 1, backward 2), idle visible.
///
/// Only compute actions are drawn. One row per unit step from 0 to the makespan; a cell holds
/// the action the rank runs during that step (a backward fills two rows) or `.` when idle. A
/// summary line with the makespan and the bubble fraction follows the table. A schedule that
/// deadlocks fails with [`ScheduleError::Invalid`] whose report shows the grid up to the stall
/// and what every blocked rank waits for.
pub fn render_grid(schedule: &PipelineSchedule) -> Result<String, ScheduleError> {
    let compute = schedule.compute_only();
    let outcome = replay(&compute, SendMode::Eager, unit_cost)?;
    if !outcome.completed() {
        return Err(ScheduleError::Invalid {
            report: deadlock_report(&compute, &outcome),
        });
    }
    let timeline = &outcome.timeline;
    let num_ranks = compute.num_ranks();
    let mut out = table(num_ranks, &grid_rows(num_ranks, timeline), None);
    let makespan = timeline.makespan();
    let busy = timeline
        .ranks
        .iter()
        .map(|list| list.iter().map(|t| t.end - t.start).sum::<f64>())
        .fold(0.0, f64::max);
    let bubble = if busy > 0.0 {
        (makespan - busy) / busy
    } else {
        0.0
    };
    let _ = writeln!(
        out,
        "makespan {makespan} units (forward 1, backward 2); busiest rank computes {busy} units; \
         bubble (makespan - busy) / busy = {bubble:.4}"
    );
    Ok(out)
}

/// The diagnosis of a replay that stopped with blocked ranks: the grid up to the stall, a final
/// `blocked` row marking each blocked action as `[action]` (ranks that finished show `done`),
/// then one line per blocked rank saying what it waits for.
///
/// Positions are indices into the lists of `schedule`, the schedule that was replayed.
pub(crate) fn deadlock_report(schedule: &PipelineSchedule, outcome: &ReplayOutcome) -> String {
    let num_ranks = schedule.num_ranks().max(outcome.timeline.ranks.len());
    let stopped = outcome.timeline.makespan();
    let mut out = format!(
        "deadlock: {} of {num_ranks} ranks cannot proceed; the unit-time replay stopped at time {stopped}\n",
        outcome.blocked.len(),
    );
    let mut marks = vec!["done".to_string(); num_ranks];
    for b in &outcome.blocked {
        if let Some(mark) = marks.get_mut(b.rank) {
            *mark = format!("[{}]", b.action);
        }
    }
    out.push_str(&table(
        num_ranks,
        &grid_rows(num_ranks, &outcome.timeline),
        Some(("blocked", marks)),
    ));
    for b in &outcome.blocked {
        let _ = writeln!(
            out,
            "rank {} blocked at {} (position {}): {}",
            b.rank, b.action, b.position, b.waits_for
        );
    }
    out
}

/// Cell labels indexed `[step][rank]`; actions that take no time occupy no cell.
fn grid_rows(num_ranks: usize, timeline: &Timeline) -> Vec<Vec<String>> {
    let steps = timeline.makespan().ceil().max(0.0) as usize;
    let mut rows = vec![vec![IDLE.to_string(); num_ranks]; steps];
    for (rank, list) in timeline.ranks.iter().enumerate().take(num_ranks) {
        for timed in list.iter().filter(|t| t.end > t.start) {
            let label = timed.action.to_string();
            let first = timed.start.floor().max(0.0) as usize;
            let last = (timed.end.ceil() as usize).min(steps);
            for row in &mut rows[first..last] {
                row[rank] = label.clone();
            }
        }
    }
    rows
}

/// Align the header, one row per step, and an optional labelled final row into columns.
fn table(num_ranks: usize, rows: &[Vec<String>], last: Option<(&str, Vec<String>)>) -> String {
    let header: Vec<String> = (0..num_ranks).map(|r| format!("rank {r}")).collect();
    let mut labelled: Vec<(String, &[String])> = vec![("step".to_string(), &header[..])];
    labelled.extend(
        rows.iter()
            .enumerate()
            .map(|(i, r)| (i.to_string(), &r[..])),
    );
    if let Some((label, cells)) = &last {
        labelled.push((label.to_string(), &cells[..]));
    }
    let label_width = labelled.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..num_ranks)
        .map(|c| {
            labelled
                .iter()
                .filter_map(|(_, cells)| cells.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (label, cells) in labelled {
        let mut line = format!("{label:>label_width$}");
        for (cell, width) in cells.iter().zip(&widths) {
            let _ = write!(line, " | {cell:<width$}");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{from_csv, Action, ActionKind, ScheduleKind, ScheduleSpec};
    use super::*;

    #[test]
    fn actions_are_one_line_per_rank_without_communication() {
        let schedule = PipelineSchedule {
            stage_ranks: vec![0, 1],
            microbatches: 1,
            ranks: vec![
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
                    Action::new(1, ActionKind::BackwardInput, 0),
                    Action::new(1, ActionKind::SendBackward, 0),
                    Action::new(1, ActionKind::BackwardWeight, 0),
                ],
            ],
        };
        assert_eq!(
            render_actions(&schedule),
            "rank 0: 0F0 0B0\nrank 1: 1F0 1I0 1W0\n"
        );
    }

    #[test]
    fn actions_of_a_generated_schedule() {
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 2)
            .generate()
            .unwrap();
        assert_eq!(
            render_actions(&s),
            "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n\
             rank 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1\n"
        );
    }

    #[test]
    fn one_f_one_b_grid_shows_idle_steps_and_two_step_backwards() {
        let s = ScheduleSpec::new(ScheduleKind::OneFOneB, 2, 1, 2)
            .generate()
            .unwrap();
        let grid = render_grid(&s).unwrap();
        let expected = "\
step | rank 0 | rank 1
   0 | 0F0    | .
   1 | 0F1    | 1F0
   2 | .      | 1B0
   3 | .      | 1B0
   4 | 0B0    | 1F1
   5 | 0B0    | 1B1
   6 | .      | 1B1
   7 | 0B1    | .
   8 | 0B1    | .
makespan 9 units (forward 1, backward 2); busiest rank computes 6 units; \
bubble (makespan - busy) / busy = 0.5000
";
        assert_eq!(grid, expected);
    }

    #[test]
    fn breadth_first_grid_matches_the_closed_form_bubble() {
        // β = (P − 1)/(V·M) = 3/16 for P = 4, V = 2, M = 8; busy = 3·V·M = 48.
        let s = ScheduleSpec::new(ScheduleKind::BreadthFirst, 4, 2, 8)
            .generate()
            .unwrap();
        let grid = render_grid(&s).unwrap();
        let lines: Vec<&str> = grid.lines().collect();
        assert_eq!(lines.len(), 1 + 57 + 1);
        assert!(lines[0].starts_with("step | rank 0 | rank 1 | rank 2 | rank 3"));
        let last = lines.last().unwrap();
        assert!(last.contains("makespan 57 units"), "{last}");
        assert!(last.contains("computes 48 units"), "{last}");
        assert!(last.contains("0.1875"), "{last}");
        // Every row has the same column layout.
        let bars = |l: &str| l.match_indices('|').map(|(i, _)| i).collect::<Vec<_>>();
        for line in &lines[1..lines.len() - 1] {
            assert_eq!(bars(line), bars(lines[0]), "{line}");
        }
    }

    #[test]
    fn deadlock_reports_the_partial_grid_and_blocked_ranks() {
        let s = from_csv("0F0,0B0\n1B0,1F0\n").unwrap();
        let err = render_grid(&s).unwrap_err();
        let ScheduleError::Invalid { report } = &err else {
            panic!("expected Invalid, got {err:?}");
        };
        let expected_grid = "\
   step | rank 0 | rank 1
      0 | 0F0    | .
blocked | [0B0]  | [1B0]
";
        assert!(report.contains(expected_grid), "{report}");
        assert!(report.starts_with("deadlock: 2 of 2 ranks"), "{report}");
        assert!(
            report.contains("rank 0 blocked at 0B0 (position 1): waits for 1B0"),
            "{report}"
        );
        assert!(
            report.contains("rank 1 blocked at 1B0 (position 0): waits for 1F0"),
            "{report}"
        );
    }

    #[test]
    fn finished_ranks_show_done_in_the_blocked_row() {
        // Rank 1 finishes its list without ever running 1B1, so rank 0's 0B1 waits forever.
        let s = from_csv("0F0,0F1,0B1\n1F0,1B0\n").unwrap();
        let err = render_grid(&s).unwrap_err().to_string();
        assert!(err.contains("[0B1]"), "{err}");
        assert!(err.contains("done"), "{err}");
        assert!(err.contains("rank 0 blocked at 0B1 (position 2)"), "{err}");
    }
}
