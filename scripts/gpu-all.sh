#!/usr/bin/env bash
# Both GPU checks in one go, for a GPU machine lent for a short while: records the machine
# (GPU, driver, CUDA/NCCL libraries, PyTorch), then runs scripts/gpu-check.sh and
# scripts/gpu-run.sh, each under its own time budget so one that hangs cannot eat the other's
# time, and copies the logs and results into one folder.
#
#   scripts/gpu-all.sh build              on the build machine: both scripts' builds, then one
#                                         compressed archive, target/gpu-bins.tar.xz, to carry
#   scripts/gpu-all.sh [run] [LOG_DIR]    on the GPU machine, from the repository root, with
#                                         the archive (or target/gpu-check and target/gpu-run)
#                                         carried; logs go to LOG_DIR (default target/gpu-all)
#
# CHECK_S and RUN_S set the budgets in seconds (default 270 each: both scripts are sized to
# run in under 6 minutes on one H200 or H100).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${1:-run}" == "build" ]]; then
    set -e
    bash scripts/gpu-check.sh build
    bash scripts/gpu-run.sh build
    tar -cf - -C target gpu-check gpu-run | xz -T0 -6 > target/gpu-bins.tar.xz
    echo "carry target/gpu-bins.tar.xz ($(du -h target/gpu-bins.tar.xz | cut -f1)) and run scripts/gpu-all.sh"
    exit 0
fi
[[ "${1:-}" == "run" ]] && shift
LOG_DIR=${1:-target/gpu-all}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
if [[ -f target/gpu-bins.tar.xz ]]; then
    tar -xJf target/gpu-bins.tar.xz -C target || { echo "gpu-all: cannot unpack target/gpu-bins.tar.xz" >&2; exit 1; }
fi
{
    date -u
    nvidia-smi || echo "gpu-all: nvidia-smi failed"
    echo "--- loader: $(ldconfig -p 2>/dev/null | grep -cE 'libcuda\.so|libnvrtc|libnccl') CUDA/NVRTC/NCCL entries"
    ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc|libnccl'
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
} > "$LOG_DIR/machine.log" 2>&1
cat "$LOG_DIR/machine.log"
# Exit status: 0 when both passed, 2 when both stopped for want of a GPU, 1 otherwise.
failed=0 no_gpu=0
for script in gpu-check gpu-run; do
    budget=$([[ $script == gpu-check ]] && echo "${CHECK_S:-270}" || echo "${RUN_S:-270}")
    SECONDS=0
    timeout "$budget" bash "scripts/$script.sh" run 2>&1 | tee "$LOG_DIR/$script.log"
    rc=${PIPESTATUS[0]}
    echo "gpu-all: $script exit status $rc after ${SECONDS} s (budget $budget s; 124 = out of time)" \
        | tee -a "$LOG_DIR/$script.log"
    if ((rc == 2)); then no_gpu=$((no_gpu + 1)); elif ((rc != 0)); then failed=1; fi
done
cp target/gpu-check/kernels.json "$LOG_DIR/" 2>/dev/null
# Burn's autotune results (each candidate kernel's time per shape class, and the winner), so
# that the routine behind every matmul figure can be read afterwards.
tar -czf "$LOG_DIR/autotune.tar.gz" -C target autotune 2>/dev/null
# Every run's timeline, trace and metrics, and its --json report.
(cd target/gpu-run 2>/dev/null && tar -czf - out-* ./*.json) >"$LOG_DIR/timelines.tar.gz" 2>/dev/null
cp target/gpu-run/*.log "$LOG_DIR/" 2>/dev/null
if ((failed)); then exit 1; elif ((no_gpu == 2)); then exit 2; fi
