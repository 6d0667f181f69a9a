#!/usr/bin/env bash
# GPU check for cubecl-kernels, in two halves:
#
#   scripts/gpu-check.sh build      on the development machine (Rust toolchain, x86-64):
#                                   builds the CUDA test binary into target/gpu-check/.
#   scripts/gpu-check.sh [run]      on the GPU machine (no Rust, no network; CUDA driver and
#                                   PyTorch installed), from the repository root with
#                                   target/gpu-check/ carried along: kernel correctness on
#                                   CUDA, then PyTorch's reference timings at sequence 2048,
#                                   head dim 128, bf16, and the ratio table last.
#
# On a machine without an NVIDIA GPU, `run` performs every step that does not need one
# (binaries present, Python and PyTorch importable) and then stops with exit status 2 and a
# message saying so. Nothing is skipped silently.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=target/gpu-check

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'gpu-check: %s\n' "$1" >&2; exit "${2:-1}"; }

if [[ "${1:-run}" == "build" ]]; then
    step "building the CUDA kernel tests (x86-64, no GPU needed to build)"
    mkdir -p "$OUT"
    cargo test -p cubecl-kernels --no-default-features --features cuda --test cuda_kernels \
        --no-run --message-format=json \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' \
        | while read -r exe; do cp "$exe" "$OUT/cuda_kernels"; done
    [[ -x "$OUT/cuda_kernels" ]] || die "the CUDA test binary was not produced"
    echo "built $OUT/cuda_kernels; carry $OUT to the GPU machine and run scripts/gpu-check.sh"
    exit 0
fi

step "carried binaries"
[[ -x "$OUT/cuda_kernels" ]] \
    || die "missing $OUT/cuda_kernels: run 'scripts/gpu-check.sh build' on the build machine first"
echo "found $OUT/cuda_kernels"

step "python and PyTorch"
command -v python3 >/dev/null || die "python3 not found"
python3 -c 'import torch; print("torch", torch.__version__)' \
    || die "PyTorch is not importable: the reference timings need it"

step "NVIDIA GPU"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    die "no NVIDIA GPU on this machine: stopping here, before the CUDA correctness tests and the benchmarks (everything above passed)" 2
fi
nvidia-smi -L

step "kernel correctness on CUDA (fresh random inputs, NaN-poisoned outputs, float64 oracle)"
# --include-ignored: tests marked `#[ignore = "needs an NVIDIA GPU"]` (the fused linear +
# bias + GELU, f32/f16/bf16) are exactly what this machine is for.
"$OUT/cuda_kernels" --test-threads=1 --include-ignored

step "PyTorch reference timings: seq 2048, head dim 128, bf16"
python3 - <<'PY'
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
def ms(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps
dev, dt = "cuda", torch.bfloat16
q, k, v = (torch.randn(4, 16, 2048, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
def attn():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
x = torch.randn(8192, 1024, device=dev, dtype=dt)
w = torch.randn(1024, 4096, device=dev, dtype=dt)
b = torch.randn(4096, device=dev, dtype=dt)
mlp = lambda: F.gelu(x @ w + b)
rows = [("attention fwd+bwd (sdpa flash)", ms(attn)), ("matmul+bias+gelu (cuBLAS+epilogue)", ms(mlp))]
print()
print("| op | PyTorch ms | cubecl-kernels ms | ratio |")
print("|---|---|---|---|")
for name, t in rows:
    # The fused kernels' CUDA timings at this shape need a bf16 benchmark binary, which this
    # version does not build yet: the column says so instead of showing a number.
    print(f"| {name} | {t:.3f} | not measured | n/a |")
PY
