#!/usr/bin/env bash
# GPU training run of the reference GPT, in two halves:
#
#   scripts/gpu-run.sh build      on the development machine (Rust toolchain, x86-64): builds
#                                 examples/gpu_run/ with the CUDA backend into target/gpu-run/.
#   scripts/gpu-run.sh [run]      on the GPU machine (no Rust, no network; CUDA driver, NCCL
#                                 loaded at run time), from the repository root with
#                                 target/gpu-run/ carried along: trains the GPT with a
#                                 breadth-first pipeline of several stages on GPU 0 (ranks as
#                                 threads sharing it), prints tokens/s, TFLOP/s, MFU against the
#                                 GPU's bf16 peak and the bubble, measured beside the
#                                 simulator's prediction for the same layout, and writes both
#                                 timelines to target/gpu-run/out/.
#
# It then measures the engine against a plain Burn CUDA training loop of the same GPT on GPU 0
# (`gpu_run --baseline`): the engine with one rank (pp=1), and a pp=2 × loops=2 breadth-first
# ZeRO-3 run, each as a ratio of tokens/s to the plain loop's, with every run's MFU. Then the
# NCCL communicator's GPU test (every collective on NCCL against host values), the same
# training with it (`--comm nccl`: data-parallel collectives on the device buffers, here
# groups of one rank) and, with more than one GPU, the ranks spread over all GPUs as threads
# and as one process per GPU (NCCL for collectives and pipeline transfers, the TCP control
# channel for the rest); each must end at the one-GPU run's final loss.
#
# On a machine without an NVIDIA GPU, `run` performs every step that does not need one (binary
# present and runnable) and then stops with exit status 2 and a message saying so.
# GPU_RUN_ARGS adds flags to the training run (see `target/gpu-run/gpu_run --help`); e.g.
# GPU_RUN_ARGS='--attention scalar' trains with the portable attention kernels instead of the
# tensor-core ones (to compare, or to rule them out).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=target/gpu-run

step() { printf '\n==> %s\n' "$*"; }

# Final losses of two logs must agree to 1e-2 (bf16 kernels autotuned per device, and NCCL's
# sums, may round differently).
compare_losses() {
    local a b
    a=$(grep '^final loss' "$2" | awk '{print $3}' | tr -d ,)
    b=$(grep '^final loss' "$4" | awk '{print $3}' | tr -d ,)
    python3 - "$1" "$a" "$3" "$b" <<'PY'
import sys
na, a, nb, b = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
rel = abs(a - b) / abs(a)
print(f"final loss: {na} {a:.4f}, {nb} {b:.4f}, relative difference {rel:.2e}")
sys.exit(0 if rel <= 1e-2 else f"check FAILED: {na} and {nb} differ by more than 1e-2")
PY
}
die() { printf 'gpu-run: %s\n' "$1" >&2; exit "${2:-1}"; }
# A failing step is recorded and the next one still runs: on a machine lent for minutes, one
# failure must not cost the figures of the steps after it. The exit status says it at the end.
failures=()
failed() { failures+=("$1"); printf 'gpu-run: FAILED: %s\n' "$1" >&2; }

if [[ "${1:-run}" == "build" ]]; then
    step "building examples/gpu_run/ with the CUDA backend (x86-64, no GPU needed to build)"
    mkdir -p "$OUT"
    cargo build --release --features cuda --example gpu_run
    cp target/release/examples/gpu_run "$OUT/gpu_run"
    step "building the NcclComm GPU test (burn-bfpp/tests/nccl_comm.rs)"
    cargo test -p burn-bfpp --features cuda --test nccl_comm --no-run --message-format=json \
        | python3 scripts/test-executables.py \
        | while read -r exe; do cp "$exe" "$OUT/nccl_comm"; done
    [[ -x "$OUT/nccl_comm" ]] || die "the NcclComm test binary was not produced"
    strip "$OUT/gpu_run" "$OUT/nccl_comm"
    echo "built $OUT/gpu_run and $OUT/nccl_comm; carry $OUT to the GPU machine and run scripts/gpu-run.sh"
    exit 0
fi

step "carried binaries"
for bin in gpu_run nccl_comm; do
    [[ -x "$OUT/$bin" ]] \
        || die "missing $OUT/$bin: run 'scripts/gpu-run.sh build' on the build machine first"
    "$OUT/$bin" --help >/dev/null || die "$OUT/$bin does not start on this machine"
    echo "found $OUT/$bin"
done

step "NVIDIA GPU"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    die "no NVIDIA GPU on this machine: stopping here, before the CUDA training run (everything above passed)" 2
fi
nvidia-smi -L

# NCCL kernels wait on the GPU for their peers; with CUDA's lazy module loading a kernel loaded
# meanwhile can wait for them in turn (NCCL's troubleshooting notes): load modules eagerly.
export CUDA_MODULE_LOADING=EAGER

step "CUDA libraries (NVRTC, NCCL) for the dynamic loader"
# shellcheck source=scripts/gpu-libs.sh
source scripts/gpu-libs.sh
gpu_libs "$OUT/libs"
gpus=$(nvidia-smi -L | grep -c '^GPU ')

step "training on GPU 0: breadth-first pp=4 loops=2 (8 stages), ZeRO-3, ranks sharing the GPU"
# shellcheck disable=SC2086
timeout "${TRAIN_S:-150}" "$OUT/gpu_run" --backend cuda --out "$OUT/out" ${GPU_RUN_ARGS:-} 2>&1 \
    | tee "$OUT/one-gpu.log" || failed "the one-GPU training run (exit status $?; 124 = out of time)"

step "engine against a plain Burn loop of the same GPT on GPU 0 (tokens/s ratios, MFU)"
# The same model, data, micro-batches and steps: the plain loop (one device, one backward per
# step), the engine with one rank, and the engine with a pp=2 × loops=2 breadth-first ZeRO-3
# pipeline of threads sharing the GPU.
# shellcheck disable=SC2086
timeout "${BASELINE_S:-120}" "$OUT/gpu_run" --backend cuda --baseline ${GPU_RUN_ARGS:-} 2>&1 \
    | tee "$OUT/plain.log" || failed "the plain Burn run (exit status $?)"
# shellcheck disable=SC2086
timeout "${BASELINE_S:-120}" "$OUT/gpu_run" --backend cuda --pp 1 --loops 1 --zero 0 \
    --out "$OUT/out-pp1" ${GPU_RUN_ARGS:-} 2>&1 | tee "$OUT/pp1.log" || failed "the pp=1 engine run (exit status $?)"
# shellcheck disable=SC2086
timeout "${BASELINE_S:-120}" "$OUT/gpu_run" --backend cuda --pp 2 --loops 2 --zero 3 \
    --out "$OUT/out-pp2" ${GPU_RUN_ARGS:-} 2>&1 | tee "$OUT/pp2.log" || failed "the pp=2 engine run (exit status $?)"
python3 - "$OUT/plain.log" "$OUT/pp1.log" "$OUT/pp2.log" <<'PY' || failed "the baseline comparison"
import sys
def figure(path, name):
    for line in open(path):
        if line.startswith(name):
            return float(line.split()[len(name.split())].rstrip("%"))
    sys.exit(f"no `{name}` line in {path}")
plain = figure(sys.argv[1], "tokens/s")
print(f"{'run':38} {'tokens/s':>10} {'/ plain':>8} {'MFU':>8}")
for label, path in [("plain Burn loop", sys.argv[1]), ("engine, one rank (pp=1)", sys.argv[2]),
                    ("engine, pp=2 loops=2 BF ZeRO-3", sys.argv[3])]:
    tps = figure(path, "tokens/s")
    print(f"{label:38} {tps:10.0f} {tps / plain:8.3f} {figure(path, 'MFU'):7.2f}%")
PY

step "NCCL communicator: collectives on every GPU, then the same run with --comm nccl"
timeout 90 "$OUT/nccl_comm" --include-ignored --test-threads=1 \
    || failed "the NcclComm tests (exit status $?)"
# shellcheck disable=SC2086
timeout "${TRAIN_S:-150}" "$OUT/gpu_run" --backend cuda --comm nccl --out "$OUT/out-nccl" ${GPU_RUN_ARGS:-} 2>&1 \
    | tee "$OUT/nccl.log" || failed "the --comm nccl training run (exit status $?)"
compare_losses "LocalComm" "$OUT/one-gpu.log" "NcclComm" "$OUT/nccl.log" || failed "LocalComm against NcclComm"

if ((gpus > 1)); then
    step "multi-GPU check: the same run with the ranks spread over $gpus GPUs"
    # With LocalComm, pipeline transfers cross GPUs through host memory, so this checks
    # placement and equivalence, not scaling: the final loss must match the one-GPU run's.
    # shellcheck disable=SC2086
    timeout "${TRAIN_S:-150}" "$OUT/gpu_run" --backend cuda --gpus "$gpus" --out "$OUT/out-multi" ${GPU_RUN_ARGS:-} 2>&1 \
        | tee "$OUT/multi-gpu.log" || failed "the multi-GPU run (exit status $?)"
    compare_losses "one GPU" "$OUT/one-gpu.log" "spread over GPUs" "$OUT/multi-gpu.log" || failed "one GPU against spread"
    step "multi-GPU check with NcclComm: collectives on NCCL, transfers as peer copies"
    # shellcheck disable=SC2086
    timeout "${TRAIN_S:-150}" "$OUT/gpu_run" --backend cuda --comm nccl --gpus "$gpus" --out "$OUT/out-multi-nccl" \
        ${GPU_RUN_ARGS:-} 2>&1 | tee "$OUT/multi-gpu-nccl.log" || failed "the multi-GPU NCCL run (exit status $?)"
    compare_losses "one GPU" "$OUT/one-gpu.log" "NCCL over GPUs" "$OUT/multi-gpu-nccl.log" || failed "one GPU against NCCL over GPUs"

    step "process ranks: one process per GPU ($gpus), NCCL for data, the TCP control channel for the rest"
    # What `bfpp launch -- train --backend cuda` and torchrun do: rank r on GPU r; the pipeline
    # group spans the GPUs, so transfers are NCCL sends and receives.
    port=$((20000 + RANDOM % 20000))
    pids=()
    for ((rank = 0; rank < gpus; rank++)); do
        # shellcheck disable=SC2086
        RANK=$rank WORLD_SIZE=$gpus LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            timeout "${TRAIN_S:-150}" "$OUT/gpu_run" --backend cuda --comm nccl --gpus "$gpus" \
            --pp "$gpus" --loops 2 --out "$OUT/out-processes" ${GPU_RUN_ARGS:-} >"$OUT/process-$rank.log" 2>&1 &
        pids+=($!)
    done
    ranks_failed=0
    for ((rank = 0; rank < gpus; rank++)); do
        wait "${pids[$rank]}" || { ranks_failed=1; echo "rank $rank failed:"; tail -n 5 "$OUT/process-$rank.log"; }
    done
    cat "$OUT/process-0.log"
    if ((ranks_failed)); then
        failed "the process-rank run (logs: $OUT/process-*.log)"
    fi
fi
if ((${#failures[@]})); then
    printf 'gpu-run: FAILED: %s\n' "${failures[@]}" >&2
    exit 1
fi
step "done: figures above, timelines in $OUT/out/"
