#!/usr/bin/env bash
# GPU check for cubecl-kernels, in two halves:
#
#   scripts/gpu-check.sh build      on the development machine (Rust toolchain, x86-64):
#                                   builds the CUDA test binary and the kernel benchmark
#                                   (examples/kernel_bench/) into target/gpu-check/.
#   scripts/gpu-check.sh [run]      on the GPU machine (no Rust, no network; CUDA driver and
#                                   PyTorch installed), from the repository root with
#                                   target/gpu-check/ carried along: kernel correctness on
#                                   CUDA, then the fused kernels against Burn's CUDA path and
#                                   PyTorch at sequence 2048, head dim 128, bf16 (and the
#                                   measured peak memory of the fused cross-entropy), the
#                                   attention tile kernels under each cube shape of ATTN_TILES
#                                   (planes x streamed 16-row fragments; default below) with
#                                   their accumulators in each place of ATTN_ACC (default
#                                   registers,shared), and the ratio table last.
#
# On a machine without an NVIDIA GPU, `run` performs every step that does not need one
# (binaries present, Python and PyTorch importable) and then stops with exit status 2 and a
# message saying so. Nothing is skipped silently.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=target/gpu-check

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'gpu-check: %s\n' "$1" >&2; exit "${2:-1}"; }
# Prints the failed steps (if any) with a last word; the caller exits.
report_failures() {
    local failure
    for failure in "${failures[@]}"; do printf 'gpu-check: FAILED: %s\n' "$failure" >&2; done
    [[ -z "${1:-}" ]] || printf 'gpu-check: %s\n' "$1" >&2
}

if [[ "${1:-run}" == "build" ]]; then
    step "building the CUDA kernel tests (x86-64, no GPU needed to build)"
    mkdir -p "$OUT"
    cargo test -p cubecl-kernels --no-default-features --features cuda --test cuda_kernels \
        --no-run --message-format=json \
        | python3 scripts/test-executables.py \
        | while read -r exe; do cp "$exe" "$OUT/cuda_kernels"; done
    [[ -x "$OUT/cuda_kernels" ]] || die "the CUDA test binary was not produced"
    # The root package's feature set, shared with scripts/gpu-run.sh's build.
    cargo build --release --features cuda --example kernel_bench
    cp target/release/examples/kernel_bench "$OUT/kernel_bench"
    # Without debug information the binaries are a tenth of the size to carry.
    strip "$OUT/cuda_kernels" "$OUT/kernel_bench"
    echo "built $OUT/cuda_kernels; carry $OUT to the GPU machine and run scripts/gpu-check.sh"
    exit 0
fi

step "carried binaries"
for bin in cuda_kernels kernel_bench; do
    [[ -x "$OUT/$bin" ]] \
        || die "missing $OUT/$bin: run 'scripts/gpu-check.sh build' on the build machine first"
    echo "found $OUT/$bin"
done

step "NVIDIA GPU"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    die "no NVIDIA GPU on this machine: stopping here, before the CUDA correctness tests and the benchmarks (everything above passed)" 2
fi
nvidia-smi -L

step "CUDA libraries (NVRTC, NCCL) for the dynamic loader"
# shellcheck source=scripts/gpu-libs.sh
source scripts/gpu-libs.sh
gpu_libs "$OUT/libs"

step "python and PyTorch"
command -v python3 >/dev/null || die "python3 not found"
python3 -c 'import torch; print("torch", torch.__version__)' \
    || die "PyTorch is not importable: the reference timings need it"

step "kernel correctness on CUDA (fresh random inputs, NaN-poisoned outputs, float64 oracle)"
# --include-ignored: tests marked `#[ignore = "needs an NVIDIA GPU"]` (the fused linear +
# bias + GELU, f32/f16/bf16) are exactly what this machine is for.
# A failing step is recorded and the next one still runs: on a machine lent for minutes, one
# failure must not cost the figures of the steps after it. The exit status says it at the end.
failures=()
# One process per test: a kernel fault leaves CUDA's context unusable ("the server is in an
# invalid state"), and in a shared process every later test would fail with it.
tests=$("$OUT/cuda_kernels" --list --include-ignored 2>/dev/null | sed -n 's/: test$//p')
[[ -n "$tests" ]] || failures+=("the kernel test binary lists no tests")
SECONDS=0
for test in $tests; do
    left=$(( ${CORRECTNESS_S:-150} - SECONDS ))
    if ((left <= 0)); then
        failures+=("kernel test $test: not run, the correctness budget (CORRECTNESS_S) is spent")
        continue
    fi
    timeout "$left" "$OUT/cuda_kernels" "$test" --exact --include-ignored \
        || failures+=("kernel test $test (exit status $?; 124 = out of time)")
done

step "fused kernels against Burn's CUDA path (bf16; cross-entropy f32), time and measured peak memory"
rm -f "$OUT/kernels.json"
# The tile shapes to time beside the default (the candidates for the launchers'
# preference), each with the accumulators in fragments and in shared memory (the place
# before 2026-12-05): 10 configurations, each compiled by NVRTC on first use.
timeout "${BENCH_S:-200}" "$OUT/kernel_bench" --json "$OUT/kernels.json" \
    --attn-tiles "${ATTN_TILES:-4x1,2x2,4x2,2x4,4x4}" \
    --attn-acc "${ATTN_ACC:-registers,shared}" \
    || failures+=("kernel_bench (exit status $?; 124 = out of time)")
[[ -f "$OUT/kernels.json" ]] || {
    report_failures "no $OUT/kernels.json, so no ratio table"
    exit 1
}

step "PyTorch reference timings at the same shapes, and the ratio table"
KERNELS_JSON="$OUT/kernels.json" timeout "${TORCH_S:-120}" python3 - <<'PY' \
    || failures+=("PyTorch timings and ratio table (exit status $?)")
import json, os
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
ours = json.load(open(os.environ["KERNELS_JSON"]))
def ms(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps
dev, dt = "cuda", torch.bfloat16
b, h, n, d = ours["attn_shape"]
q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
def attn():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
def attn_fwd():
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
rows_, din, dout = ours["mlp_shape"]
x = torch.randn(rows_, din, device=dev, dtype=dt)
w = torch.randn(din, dout, device=dev, dtype=dt)
bias = torch.randn(dout, device=dev, dtype=dt)
mlp = lambda: F.gelu(x @ w + bias)
torch_attn, torch_attn_fwd, torch_mlp = ms(attn), ms(attn_fwd), ms(mlp)
print(f"\nshapes: attention {ours['attn_shape']} causal, MLP {ours['mlp_shape']}, {ours['dtype']}; "
      f"head cross-entropy {ours['ce_shape']} f32; Burn's matmul {ours.get('burn_matmul', 'not recorded')}")
print()
print("| op | PyTorch ms | Burn CUDA ms | cubecl-kernels ms | speed vs PyTorch | speed vs Burn | goal |")
print("|---|---|---|---|---|---|---|")
for name, t, o, goal in [
    ("attention fwd+bwd (sdpa flash)", torch_attn, ours["attn_fwd_bwd_ms"], 0.7),
    ("matmul+bias+GELU fwd (cuBLAS + epilogue)", torch_mlp, ours["mlp_fwd_ms"], 0.8),
]:
    ratio = t / o["fused"]
    verdict = "met" if ratio >= goal else "NOT met"
    print(f"| {name} | {t:.3f} | {o['burn']:.3f} | {o['fused']:.3f} | {ratio:.2f}x | "
          f"{o['burn'] / o['fused']:.2f}x | >= {goal}x: {verdict} |")
o = ours["attn_kernels_ms"]
# Burn's column here is its fused forward outside autodiff (no log-sum-exp, so no training).
print(f"| attention fwd, default kernels ({o['default_kernels']}) | {torch_attn_fwd:.3f} | "
      f"{o['fwd']['burn']:.3f} | {o['fwd']['default']:.3f} | {torch_attn_fwd / o['fwd']['default']:.2f}x | "
      f"{o['fwd']['burn'] / o['fwd']['default']:.2f}x | - |")
print(f"| attention fwd, portable scalar kernel | {torch_attn_fwd:.3f} | - | {o['fwd']['scalar']:.3f} | "
      f"{torch_attn_fwd / o['fwd']['scalar']:.2f}x | - | - |")
print(f"| attention fwd+bwd, portable scalar kernels | {torch_attn:.3f} | - | {o['fwd_bwd']['scalar']:.3f} | "
      f"{torch_attn / o['fwd_bwd']['scalar']:.2f}x | - | - |")
shapes = o.get("default_tile_shapes", {})
if shapes:
    print(f"| attention default tile shapes: forward {shapes['forward']}, dQ {shapes['dq']}, "
          f"dK/dV {shapes['dkdv']} | - | - | - | - | - | - |")
for row in o.get("tile_sweep", []):
    k = row["kernels"]
    print(f"| attention tiles {row['shape']}, accumulators in {row.get('accumulators', 'shared')} "
          f"(fwd {k['forward']}, dQ {k['dq']}, dK/dV {k['dkdv']}): "
          f"fwd / fwd+bwd | {torch_attn_fwd:.3f} / {torch_attn:.3f} | - | {row['fwd']:.3f} / {row['fwd_bwd']:.3f} | "
          f"{torch_attn_fwd / row['fwd']:.2f}x / {torch_attn / row['fwd_bwd']:.2f}x | - | - |")
o = ours["mlp_fwd_bwd_ms"]
print(f"| matmul+bias+GELU fwd+bwd | - | {o['burn']:.3f} | {o['fused']:.3f} | - | {o['burn'] / o['fused']:.2f}x | - |")
o = ours["ce_fwd_bwd_ms"]
print(f"| linear cross-entropy fwd+bwd | - | {o['burn']:.3f} | {o['fused']:.3f} | - | {o['burn'] / o['fused']:.2f}x | - |")
# The same fused op with each f32 routine: exact f32 (unit) against Burn's TF32 matmul.
f = ours.get("ce_f32_matmul_ms")
if f:
    for name in ("unit", "burn_matmul"):
        print(f"| linear cross-entropy fwd+bwd, f32 products on {name}"
              f"{' (the default)' if f['default'] == name else ''} | - | {o['burn']:.3f} | {f[name]:.3f} | - | "
              f"{o['burn'] / f[name]:.2f}x | - |")
print("\npeak memory over forward + backward (measured CubeCL pool growth, each path in its own process):")
print("| op | Burn MiB | fused MiB | Burn / fused |")
print("|---|---|---|---|")
for op, m in ours["peak_bytes"].items():
    ratio = m["burn"] / max(m["fused"], 1)
    goal = f" (goal >= 10x: {'met' if ratio >= 10 else 'NOT met'})" if op == "ce" else ""
    print(f"| {op} | {m['burn'] / 2**20:.1f} | {m['fused'] / 2**20:.1f} | {ratio:.1f}x{goal} |")
PY
if ((${#failures[@]})); then
    report_failures "the figures above are from the steps that ran to the end"
    exit 1
fi
