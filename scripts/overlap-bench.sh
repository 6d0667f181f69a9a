#!/usr/bin/env bash
# Overlapped against waiting data-parallel collectives, on this machine: alternates runs of
# `bfpp train` with and without --no-overlap (ranks as threads, then as MPI processes)
# and prints each run's tokens/s and mean collective share (the ranks' share of list time in
# data-parallel gathers and reductions), then the ratio of the medians. Results are bitwise
# equal, so only the time differs.
#
#   cargo build --release --features mpi && bash scripts/overlap-bench.sh [PAIRS] [STEPS] [extra train flags…]
#
# MODES="processes" runs only the multi-process half. To give the processes a network whose
# transfers take time of their own, shape the loopback first (root; undo with
# `tc qdisc del dev lo root`):
#   tc qdisc add dev lo root tbf rate 100mbit burst 256kb limit 64mb
set -euo pipefail
pairs=${1:-3}
steps=${2:-30}
shift $(( $# < 2 ? $# : 2 ))
bin=${BFPP:-target/release/bfpp}
[ -x "$bin" ] || { echo "no $bin: run cargo build --release first" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

tokens() { grep -o '"tokens_per_s":[0-9.]*' "$1" | cut -d: -f2; }
# Mean over the ranks of `collective_share`, in percent.
share() {
  grep -o '"collective_share":\[[^]]*\]' "$1" | sed 's/.*\[//; s/\]//' | tr ',' '\n' |
    awk '{s += $1; n++} END {printf "%.1f", 100 * s / n}'
}
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

for mode in ${MODES:-threads processes}; do
  : >"$out/on"; : >"$out/off"
  for i in $(seq "$pairs"); do
    for variant in on off; do
      flags=(--steps "$steps" --json --out-dir "$out/run" "$@")
      [ "$variant" = off ] && flags+=(--no-overlap)
      if [ "$mode" = threads ]; then
        "$bin" train "${flags[@]}" >"$out/json" 2>/dev/null
      else
        "$bin" launch --nproc 4 -- train "${flags[@]}" >"$out/json" 2>/dev/null
      fi
      t=$(tokens "$out/json")
      echo "$mode pair $i overlap $variant: $t tokens/s, collectives $(share "$out/json") % of list time"
      echo "$t" >>"$out/$variant"
    done
  done
  on=$(median <"$out/on"); off=$(median <"$out/off")
  echo "$mode: median $on tokens/s overlapped, $off waiting: ratio $(awk -v a="$on" -v b="$off" 'BEGIN {printf "%.3f", a / b}')"
done
