//! Golden files: the exact lowered schedules for P=4, V=2, M=4 (V=1 for GPipe and 1F1B, which
//! are not looped), without and with the ZeRO-3 lowering. A change to a generator or a pass
//! shows up here as a diff to review. Regenerate with `BFPP_BLESS=1 cargo test --test schedule_golden`.

use std::path::PathBuf;

use burn_bfpp::schedule::{
    from_csv, lower_data_parallel, lower_p2p, to_csv, validate, DataParallelLowering, ScheduleKind,
    ScheduleSpec, ZeroLevel,
};

fn golden(name: &str, csv: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("BFPP_BLESS").is_some() {
        std::fs::write(&path, csv).expect("write golden file");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with BFPP_BLESS=1 to create it",
            path.display()
        )
    });
    assert_eq!(csv, want, "{name} differs from its golden file");
    validate(&from_csv(&want).unwrap()).unwrap();
}

fn check(kind: ScheduleKind, loops: usize, bf: Option<usize>) {
    let mut spec = ScheduleSpec::new(kind, 4, loops, 4);
    spec.bf_microbatches = bf;
    let s = spec.generate().unwrap();
    let p2p = lower_p2p(&s).unwrap();
    let suffix = bf.map(|k| format!("-k{k}")).unwrap_or_default();
    let base = format!("{}-p4-v{loops}-m4{suffix}", kind.name());
    golden(&format!("{base}.csv"), &to_csv(&p2p));
    let zero3 = lower_data_parallel(&p2p, &DataParallelLowering::new(ZeroLevel::Zero3)).unwrap();
    golden(&format!("{base}-zero3.csv"), &to_csv(&zero3));
}

#[test]
fn gpipe() {
    check(ScheduleKind::GPipe, 1, None);
}

#[test]
fn one_f_one_b() {
    check(ScheduleKind::OneFOneB, 1, None);
}

#[test]
fn interleaved() {
    check(ScheduleKind::Interleaved, 2, None);
}

#[test]
fn breadth_first() {
    check(ScheduleKind::BreadthFirst, 2, None);
}

#[test]
fn hybrid() {
    check(ScheduleKind::BreadthFirst, 2, Some(2));
}
