#!/usr/bin/env bash
# Thread ranks against MPI process ranks on the default job (`bfpp train`, pp 2 × dp 2,
# breadth-first, ZeRO-3), in one run: each configuration RUNS times, interleaved so that the
# machine's drift hits all of them alike; prints every run's tokens/s and final loss, the
# medians and the ratios.
#
#   scripts/bench-ranks.sh                 this tree, built with --features mpi
#   OLD=/path/to/old/bfpp scripts/bench-ranks.sh
#                                          also an older build's binary (a worktree of an
#                                          earlier commit, built with --features mpi), for a
#                                          before/after
#
# STEPS (default 30) and RUNS (default 5) set the length. Needs OpenMPI (mpirun).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=${STEPS:-30}
RUNS=${RUNS:-5}
cargo build --release --features mpi --quiet
NEW=$PWD/target/release/bfpp
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

configs=("new-threads" "new-mpi")
[[ -n "${OLD:-}" ]] && configs+=("old-threads" "old-mpi")

run() {
    local name=$1 bin cmd
    case $name in
        new-*) bin=$NEW ;;
        old-*) bin=$OLD ;;
    esac
    case $name in
        *-threads) cmd=("$bin" train) ;;
        *-mpi) cmd=("$bin" launch --nproc 4 -- train) ;;
    esac
    "${cmd[@]}" --steps "$STEPS" --json --out-dir "$out/$name" >"$out/$name.json" 2>"$out/$name.err" \
        || { cat "$out/$name.err" >&2; exit 1; }
    python3 - "$name" "$out/$name.json" <<'PY' | tee -a "$out/results"
import json, sys
d = json.load(open(sys.argv[2]))
print(sys.argv[1], round(d["tokens_per_s"], 1), repr(d["losses"][-1]))
PY
}

for ((i = 1; i <= RUNS; i++)); do
    for c in "${configs[@]}"; do run "$c"; done
done

python3 - "$out/results" <<'PY'
import statistics, sys
runs = {}
loss = {}
for line in open(sys.argv[1]):
    name, tps, last = line.split()
    runs.setdefault(name, []).append(float(tps))
    loss.setdefault(name, set()).add(last)
med = {k: statistics.median(v) for k, v in runs.items()}
print()
for k, v in runs.items():
    print(f"{k:12s} median {med[k]:8.1f} tokens/s  runs {v}  final loss {sorted(loss[k])}")
print(f"threads / MPI processes (this tree): {med['new-threads'] / med['new-mpi']:.3f}")
if "old-mpi" in med:
    print(f"MPI processes, this tree / old: {med['new-mpi'] / med['old-mpi']:.3f}")
    print(f"threads, this tree / old: {med['new-threads'] / med['old-threads']:.3f}")
    print(f"threads / MPI processes (old): {med['old-threads'] / med['old-mpi']:.3f}")
same = loss["new-threads"] == loss["new-mpi"] and len(loss["new-threads"]) == 1
print("threads and MPI processes end at the same loss, bit for bit:", same)
PY
