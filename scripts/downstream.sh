#!/usr/bin/env bash
# A Burn user's own project (tests/downstream: burn-bfpp by path, no [patch.crates-io], so the
# published burn-autodiff 0.21.0), built and run as a user would: the layer-stack example's
# model at pp 2 × loops 2 × dp 2 on four thread ranks, ten times, each equal to plain Burn
# (max_rel_diff ≤ 1e-5); then the same ten runs on four MPI processes, for the thread ranks'
# speed against process ranks (printed; docs/benchmarks.md records it).
#
#   bash scripts/downstream.sh
#
# Shares this repository's target folder and lock file, so only burn-autodiff and what
# depends on it are compiled again. Needs mpirun (scripts/system-packages.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

crate=tests/downstream
# The repository's resolved versions (the user's project would have its own lock file).
cp Cargo.lock "$crate/Cargo.lock"
export CARGO_TARGET_DIR="$PWD/target"
cargo build --manifest-path "$crate/Cargo.toml"
bin=target/debug/bfpp-downstream

threads=$(timeout --kill-after=30 900 "$bin" threads 10)
processes=$(timeout --kill-after=30 900 mpirun --allow-run-as-root --oversubscribe -np 4 "$bin" processes 10)
echo "threads:   $threads"
echo "processes: $processes"
python3 - "$threads" "$processes" <<'PY'
import json, statistics, sys
threads, processes = (json.loads(a) for a in sys.argv[1:3])
for run in (threads, processes):
    assert run["patched_autodiff"] is False, f"the downstream build has the patched autodiff: {run}"
    diffs = run["max_rel_diff"]
    assert len(diffs) == 10, f"{run['mode']}: {len(diffs)} runs, not 10"
    bad = [d for d in diffs if not d <= 1e-5]
    assert not bad, f"{run['mode']}: max_rel_diff above 1e-5 in {len(bad)} of 10 runs: {diffs}"
t, p = (statistics.median(r["seconds"][1:]) for r in (threads, processes))
print(f"downstream, published burn-autodiff: 10 of 10 runs within 1e-5 on threads and on "
      f"processes; median run {t:.3f} s on four thread ranks, {p:.3f} s on four MPI "
      f"processes: threads at {p / t:.2f}x the speed of processes")
PY
