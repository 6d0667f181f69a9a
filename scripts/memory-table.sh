#!/usr/bin/env bash
# Peak resident memory (the operating system's VmHWM, `peak_rss_bytes` of --json) of the
# 176 M-parameter GPT at pp 1, 2, 4 and 8 (one MPI process per rank, dp 1), ZeRO 0 and 3,
# beside plain Burn on one device: the table of docs/benchmarks.md ("Memory per rank").
#
#   bash scripts/memory-table.sh [STEPS]    (default 2: the second step runs AdamW with its
#                                            moments already allocated)
#
# Builds the release binary with MPI (`cargo build --release --features mpi`) and needs
# `mpirun` (scripts/system-packages.sh). About 10 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

steps=${1:-2}
cargo build --release --features mpi
bfpp=target/release/bfpp
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

model=(--hidden 1024 --layers 14 --heads 8 --seq-len 32 --micro-batch-size 1 --microbatches 4
    --loops 1 --dp 1 --steps "$steps" --json --out-dir "$out")

# Each rank's peak in MiB, from a run's --json on standard input.
peaks() {
    python3 -c 'import json, sys
d = json.load(sys.stdin)
print(" ".join(str(round(b / 2**20)) for b in d["peak_rss_bytes"]))'
}

plain=$("$bfpp" train "${model[@]}" --pp 1 --plain-burn 2>/dev/null | peaks)
echo "plain Burn, one device: $plain MiB"
echo "| pp | processes | ZeRO | peak RSS per process (MiB) | largest / pp=1 | largest / plain Burn |"
echo "|---|---|---|---|---|---|"
declare -A first
for zero in 0 3; do
    for pp in 1 2 4 8; do
        if ((pp == 1)); then
            line=$("$bfpp" train "${model[@]}" --pp 1 --zero "$zero" --comm local 2>/dev/null | peaks)
        else
            line=$(mpirun --allow-run-as-root --oversubscribe -np "$pp" \
                "$bfpp" train "${model[@]}" --pp "$pp" --zero "$zero" 2>/dev/null | peaks)
        fi
        largest=$(tr ' ' '\n' <<<"$line" | sort -n | tail -1)
        if ((pp == 1)); then first[$zero]=$largest; fi
        ratio=$(python3 -c "print(f'{$largest / ${first[$zero]}:.3f}')")
        vs_plain=$(python3 -c "print(f'{$largest / $plain:.3f}')")
        echo "| $pp | $pp | $zero | ${line// /, } | $ratio | $vs_plain |"
    done
done
