//! The one compile path from a schedule to the lowered per-rank programs: generate the
//! compute order, add the point-to-point transfers, add the data-parallel collectives at the
//! ZeRO level with the given buffers, and validate. The command line, the simulator and the
//! engine all take a [`Program`], so none of them can lower differently.

use super::{
    lower_data_parallel, lower_p2p, validate, DataParallelLowering, PipelineSchedule,
    ScheduleError, ScheduleSpec, ValidationReport, ZeroLevel,
};

/// Everything that decides the lowered per-rank programs of a step: the schedule and layout,
/// the ZeRO level and the rotating full-size weight and gradient buffers per rank. (Whether
/// stages recompute their forward does not change the programs: it changes what a forward
/// keeps, which the engine and the simulator's memory model read from their own settings.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramSpec {
    /// The schedule family and layout (P, V, M, K, placement).
    pub schedule: ScheduleSpec,
    /// The ZeRO level over the data-parallel group.
    pub zero: ZeroLevel,
    /// Full-size gathered-weight and gradient buffers per rank (ZeRO-2/3; at least 1).
    pub buffers: usize,
}

/// The default of rotating buffers of each kind: one in use and one being filled.
pub const DEFAULT_BUFFERS: usize = 2;

impl ProgramSpec {
    /// `schedule` at `zero` with the default two buffers of each kind.
    pub fn new(schedule: ScheduleSpec, zero: ZeroLevel) -> Self {
        ProgramSpec {
            schedule,
            zero,
            buffers: DEFAULT_BUFFERS,
        }
    }

    /// The same with `buffers` weight and gradient buffers per rank.
    pub fn with_buffers(mut self, buffers: usize) -> Self {
        self.buffers = buffers;
        self
    }

    /// Generate, lower and validate: the programs every consumer runs.
    pub fn compile(&self) -> Result<Program, ScheduleError> {
        Program::lower(self.schedule.generate()?, self.zero, self.buffers)
    }
}

/// A compiled step: the compute order, the lowered per-rank programs and the validator's
/// report on them.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The ZeRO level the collectives were placed for.
    pub zero: ZeroLevel,
    /// The weight and gradient buffers per rank the collectives were placed for.
    pub buffers: usize,
    /// The compute actions only, in each rank's order (what `bfpp schedule --format
    /// actions|grid` draws).
    pub compute: PipelineSchedule,
    /// The per-rank programs with transfers and collectives: what the simulator replays and
    /// the engine executes.
    pub lowered: PipelineSchedule,
    /// The validator's report on `lowered` (makespan, bubble of the unit-cost replay).
    pub report: ValidationReport,
}

impl Program {
    /// The second half of [`ProgramSpec::compile`], for a compute order that was not
    /// generated (a schedule file): add the transfers and the collectives at `zero` with
    /// `buffers`, and validate. Transfers and collectives already in `compute` are dropped and
    /// placed again, so a file lowered elsewhere runs as this crate would have lowered it.
    pub fn lower(
        compute: PipelineSchedule,
        zero: ZeroLevel,
        buffers: usize,
    ) -> Result<Program, ScheduleError> {
        let compute = compute.compute_only();
        super::validate::validate_pairs(&compute)?;
        let lowering = DataParallelLowering {
            zero,
            weight_buffers: buffers,
            grad_buffers: buffers,
        };
        let lowered = lower_data_parallel(&lower_p2p(&compute)?, &lowering)?;
        let report = validate(&lowered)?;
        Ok(Program {
            zero,
            buffers,
            compute,
            lowered,
            report,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{ActionKind, ScheduleKind};

    fn spec(zero: ZeroLevel, buffers: usize) -> ProgramSpec {
        ProgramSpec::new(ScheduleSpec::new(ScheduleKind::BreadthFirst, 2, 2, 4), zero)
            .with_buffers(buffers)
    }

    #[test]
    fn compiles_the_same_programs_as_the_passes_run_by_hand() {
        let s = spec(ZeroLevel::Zero3, 2);
        let program = s.compile().unwrap();
        let by_hand = lower_data_parallel(
            &lower_p2p(&s.schedule.generate().unwrap()).unwrap(),
            &DataParallelLowering::new(ZeroLevel::Zero3),
        )
        .unwrap();
        assert_eq!(program.lowered, by_hand);
        assert_eq!(program.compute, s.schedule.generate().unwrap());
        // A lowered schedule lowers again to itself: what a schedule file written by
        // `bfpp schedule --format csv` runs as.
        let again = Program::lower(program.lowered.clone(), ZeroLevel::Zero3, 2).unwrap();
        assert_eq!(again, program);
    }

    #[test]
    fn buffers_change_the_lowered_programs() {
        let unshards = |p: &Program| {
            p.lowered.ranks[0]
                .iter()
                .filter(|a| a.kind == ActionKind::Unshard)
                .count()
        };
        let one = spec(ZeroLevel::Zero3, 1).compile().unwrap();
        let four = spec(ZeroLevel::Zero3, 4).compile().unwrap();
        // With one weight buffer each of a rank's two stages is gathered again for the
        // backward; with four both stay resident, gathered once.
        assert!(
            unshards(&one) > unshards(&four),
            "{} vs {}",
            unshards(&one),
            unshards(&four)
        );
    }

    #[test]
    fn zero_buffers_are_refused() {
        assert!(spec(ZeroLevel::Zero3, 0).compile().is_err());
    }
}
