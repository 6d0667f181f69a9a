#!/usr/bin/env bash
# GPU training run of the reference GPT with `bfpp train --backend cuda`, in two halves:
#
#   scripts/gpu-run.sh build      on the development machine (Rust toolchain, x86-64): builds
#                                 `bfpp` with the CUDA backend into target/gpu-run/.
#   scripts/gpu-run.sh [run]      on the GPU machine (no Rust, no network; CUDA driver, NCCL
#                                 loaded at run time), from the repository root with
#                                 target/gpu-run/ carried along: trains the GPT with a
#                                 breadth-first pipeline of several stages on GPU 0 (ranks as
#                                 threads sharing it) and prints tokens/s, MFU against the
#                                 GPU's bf16 peak and the simulator's prediction for the same
#                                 layout (`--hardware auto`), and writes the timeline.
#
# It then measures the engine against a plain Burn CUDA training loop of the same GPT on GPU 0
# (`bfpp train --plain-burn`): the engine with one rank (pp=1), and a pp=2 × loops=2
# breadth-first ZeRO-3 run, each as a ratio of steady tokens/s to the plain loop's, with every
# run's MFU. Then the NCCL communicator's GPU test (every collective on NCCL against host
# values), the same training with `--comm nccl` and, with more than one GPU, the ranks spread
# over all GPUs as threads and as one process per GPU (`bfpp launch --nproc N -- train
# --backend cuda`: NCCL for collectives and pipeline transfers, the TCP control channel for
# the rest); each must end at the one-GPU run's final loss.
#
# On a machine without an NVIDIA GPU, `run` performs every step that does not need one (binary
# present and runnable) and then stops with exit status 2 and a message saying so.
# BFPP_ARGS adds flags to every training run (see `target/gpu-run/bfpp train --help`); e.g.
# BFPP_ARGS='--fused on' trains with every fused kernel, attention included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=target/gpu-run
# The GPT and layout of every run: 16 blocks of width 1024, 8 heads, 1024 tokens, byte
# vocabulary; 8 micro-batches of 8 samples per step, bf16, 6 steps at a constant 1e-4.
MODEL=(--layers 16 --hidden 1024 --heads 8 --seq-len 1024 --microbatches 8 --micro-batch-size 8
    --dp 1 --precision bf16 --steps 6 --lr 1e-4 --min-lr 1e-4 --warmup-steps 0 --comm-timeout 600)

step() { printf '\n==> %s\n' "$*"; }

# Final losses of two --json reports must agree to 1e-2 (bf16 kernels autotuned per device,
# and NCCL's sums, may round differently).
compare_losses() {
    python3 - "$@" <<'PY'
import json, sys
na, pa, nb, pb = sys.argv[1:5]
a = json.load(open(pa))["losses"][-1]
b = json.load(open(pb))["losses"][-1]
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
    step "building bfpp with the CUDA backend (x86-64, no GPU needed to build)"
    mkdir -p "$OUT"
    cargo build --release --features cuda --bin bfpp
    cp target/release/bfpp "$OUT/bfpp"
    step "building the NcclComm GPU test (burn-bfpp/tests/nccl_comm.rs)"
    cargo test -p burn-bfpp --features cuda --test nccl_comm --no-run --message-format=json \
        | python3 scripts/test-executables.py \
        | while read -r exe; do cp "$exe" "$OUT/nccl_comm"; done
    [[ -x "$OUT/nccl_comm" ]] || die "the NcclComm test binary was not produced"
    strip "$OUT/bfpp" "$OUT/nccl_comm"
    echo "built $OUT/bfpp and $OUT/nccl_comm; carry $OUT to the GPU machine and run scripts/gpu-run.sh"
    exit 0
fi

step "carried binaries"
for bin in bfpp nccl_comm; do
    [[ -x "$OUT/$bin" ]] \
        || die "missing $OUT/$bin: run 'scripts/gpu-run.sh build' on the build machine first"
    "$OUT/$bin" --help >/dev/null || die "$OUT/$bin does not start on this machine"
    echo "found $OUT/$bin"
done
"$OUT/bfpp" train --backend cuda --print-config >/dev/null \
    || die "$OUT/bfpp was built without the CUDA backend: rebuild with 'scripts/gpu-run.sh build'"

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

# `bfpp train` on the GPU with the model and layout above; $1 names the run (its --json report
# goes to $OUT/$1.json, its log to $OUT/$1.log, its outputs to $OUT/out-$1/), the rest are flags.
train() {
    local name=$1
    shift
    # shellcheck disable=SC2086
    timeout "${TRAIN_S:-150}" "$OUT/bfpp" train --backend cuda "${MODEL[@]}" --hardware auto \
        --out-dir "$OUT/out-$name" --json "$@" ${BFPP_ARGS:-} >"$OUT/$name.json" 2>"$OUT/$name.log"
    local rc=$?
    tail -n 3 "$OUT/$name.log"
    return $rc
}

# One line per run: steady tokens/s, its ratio to the first run's, MFU, predicted MFU.
figures() {
    python3 - "$@" <<'PY'
import json, sys
runs = [(name, json.load(open(path))) for name, path in zip(sys.argv[1::2], sys.argv[2::2])]
base = runs[0][1]["steady_tokens_per_s"]
print(f"{'run':40} {'tokens/s':>10} {'/ first':>8} {'MFU':>8} {'sim MFU':>8}")
for name, doc in runs:
    tps = doc["steady_tokens_per_s"]
    hw = doc["hardware"]
    print(f"{name:40} {tps:10.0f} {tps / base:8.3f} {100 * hw['measured']['mfu']:7.2f}% "
          f"{100 * hw['predicted']['mfu']:7.2f}%")
PY
}

step "training on GPU 0: breadth-first pp=4 loops=2 (8 stages), ZeRO-3, ranks sharing the GPU"
train one-gpu --pp 4 --loops 2 --zero 3 || failed "the one-GPU training run (exit status $?; 124 = out of time)"
figures "bfpp train pp=4 loops=2 ZeRO-3" "$OUT/one-gpu.json" || failed "reading the one-GPU run"

step "engine against a plain Burn loop of the same GPT on GPU 0 (tokens/s ratios, MFU)"
# The same model, data, micro-batches and steps: the plain loop (one device, one backward per
# step), the engine with one rank, and the engine with a pp=2 × loops=2 breadth-first ZeRO-3
# pipeline of threads sharing the GPU.
train plain --plain-burn || failed "the plain Burn run (exit status $?)"
train pp1 --pp 1 --loops 1 --zero 0 || failed "the pp=1 engine run (exit status $?)"
train pp2 --pp 2 --loops 2 --zero 3 || failed "the pp=2 engine run (exit status $?)"
figures "plain Burn loop" "$OUT/plain.json" "engine, one rank (pp=1)" "$OUT/pp1.json" \
    "engine, pp=2 loops=2 BF ZeRO-3" "$OUT/pp2.json" || failed "the baseline comparison"

step "NCCL communicator: collectives on every GPU, then the same run with --comm nccl"
timeout 90 "$OUT/nccl_comm" --include-ignored --test-threads=1 \
    || failed "the NcclComm tests (exit status $?)"
train nccl --pp 4 --loops 2 --zero 3 --comm nccl || failed "the --comm nccl training run (exit status $?)"
compare_losses "LocalComm" "$OUT/one-gpu.json" "NcclComm" "$OUT/nccl.json" || failed "LocalComm against NcclComm"

if ((gpus > 1)); then
    step "multi-GPU check: the same run with the ranks spread over $gpus GPUs"
    # With LocalComm, pipeline transfers cross GPUs through host memory, so this checks
    # placement and equivalence, not scaling: the final loss must match the one-GPU run's.
    train multi --pp 4 --loops 2 --zero 3 --gpus "$gpus" || failed "the multi-GPU run (exit status $?)"
    compare_losses "one GPU" "$OUT/one-gpu.json" "spread over GPUs" "$OUT/multi.json" || failed "one GPU against spread"
    step "multi-GPU check with NcclComm: collectives on NCCL, transfers as peer copies"
    train multi-nccl --pp 4 --loops 2 --zero 3 --gpus "$gpus" --comm nccl \
        || failed "the multi-GPU NCCL run (exit status $?)"
    compare_losses "one GPU" "$OUT/one-gpu.json" "NCCL over GPUs" "$OUT/multi-nccl.json" || failed "one GPU against NCCL over GPUs"

    step "process ranks: one process per GPU ($gpus), NCCL for data, the TCP control channel for the rest"
    # rank r on GPU r; the pipeline group spans the GPUs, so transfers are NCCL sends and
    # receives. World rank 0 writes the report.
    # shellcheck disable=SC2086
    timeout "${TRAIN_S:-150}" "$OUT/bfpp" launch --nproc "$gpus" -- train --backend cuda \
        "${MODEL[@]}" --pp "$gpus" --loops 2 --zero 3 --hardware auto --out-dir "$OUT/out-processes" \
        --json ${BFPP_ARGS:-} >"$OUT/processes.json" 2>"$OUT/processes.log" \
        || { tail -n 20 "$OUT/processes.log"; failed "the process-rank run (log: $OUT/processes.log)"; }
    figures "$gpus processes, pp=$gpus loops=2" "$OUT/processes.json" || failed "reading the process-rank run"
fi
if ((${#failures[@]})); then
    printf 'gpu-run: FAILED: %s\n' "${failures[@]}" >&2
    exit 1
fi
step "done: figures above, timelines in $OUT/out-*/"
