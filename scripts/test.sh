#!/usr/bin/env bash
# Every test of the project, on a fresh Debian machine: installs the system packages the tests
# need when they are missing (scripts/system-packages.sh), then runs each test stage with a
# bound on its run time. The README's test command and CI (.ci/run) both call this script.
#
#   bash scripts/test.sh           every stage (about 45 min cold on 2 cores, 15 min rebuilt)
#   bash scripts/test.sh --quick   only `cargo test --workspace` (no Vulkan, MPI or NVRTC stages)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

quick=false
case "${1:-}" in
    "") ;;
    --quick) quick=true ;;
    *)
        echo "usage: bash scripts/test.sh [--quick]" >&2
        exit 2
        ;;
esac

# Each stage starts with the disk it has left, so a full disk is seen coming in CI's log.
stage() {
    printf '\n==> %s\n' "$*"
    printf 'disk: %s free; target/ holds %s\n' "$(df -h --output=avail . | tail -1 | tr -d ' ')" \
        "$(du -sh target 2>/dev/null | cut -f1 || echo 0)"
}

# `cargo test ARGS` with its run bounded (the build is not): a hung test fails naming the
# command, instead of holding CI to its 90-minute limit.
bounded_test() {
    local limit=$1
    shift
    cargo test "$@" --no-run
    local rc=0
    timeout --kill-after=30 "$limit" cargo test "$@" || rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "error: \`cargo test $*\` was still running after ${limit} s (a hang?), so it was stopped" >&2
    fi
    return "$rc"
}

if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    source "$HOME/.cargo/env"
fi

stage "system packages"
bash scripts/system-packages.sh

stage "cargo test --workspace"
bounded_test 2400 --workspace
if $quick; then
    exit 0
fi

stage "schedule core without Burn: cargo build -p burn-bfpp --no-default-features"
# The schedule IR, passes, simulator, planner and pictures build with no Burn or CubeCL crate.
cargo build -p burn-bfpp --no-default-features
heavy=$(cargo tree -p burn-bfpp --no-default-features -e normal --prefix none |
    grep -E '^(burn|cubecl)' | grep -v '^burn-bfpp ' || true)
if [[ -n "$heavy" ]]; then
    echo "error: burn-bfpp without default features still depends on:" >&2
    echo "$heavy" | sort -u >&2
    exit 1
fi
cargo test -p burn-bfpp --no-default-features --lib
cargo build --no-default-features --bin bfpp
./target/debug/bfpp simulate --pp 4 --loops 2 --microbatches 8 >/dev/null
if ./target/debug/bfpp train 2>/tmp/bfpp-train-err; then
    echo "error: bfpp built without features trained instead of naming the feature" >&2
    exit 1
fi
grep -q -- '--features' /tmp/bfpp-train-err

stage "the binary a user builds has no fault injection: cargo build --bin bfpp"
# Fault injection is the test-only feature `fault-injection`, which the tests' binary gets
# through a dev-dependency of the package on itself; `cargo build` leaves it out, so its
# binary must refuse BFPP_FAULT_INJECT, naming the feature, rather than inject or ignore it.
cargo build --bin bfpp
if BFPP_FAULT_INJECT=rank=0,step=1 ./target/debug/bfpp train --steps 1 >/dev/null 2>/tmp/bfpp-fault-err; then
    echo "error: bfpp built without fault-injection trained with BFPP_FAULT_INJECT set" >&2
    exit 1
fi
grep -q -- '--features fault-injection' /tmp/bfpp-fault-err

stage "engine and CLI on the wgpu backend (lavapipe)"
# The engine and the thread handoff on a CubeCL backend, and `bfpp train --backend wgpu`
# against the Flex run of the same config; Mesa's software Vulkan stands in for a GPU.
# One feature set for both packages, so the library and its dependencies compile once for the
# stage (two invocations resolved different feature sets and compiled Burn twice).
wgpu_tests=(-p burn-bfpp -p bfpp --features bfpp/wgpu)
bounded_test 1200 "${wgpu_tests[@]}" --test engine_wgpu --test comm_wgpu
bounded_test 900 "${wgpu_tests[@]}" --test train_backends

stage "kernel_bench --small on lavapipe (the program scripts/gpu-check.sh runs on CUDA)"
# Every step of the GPU benchmark at tiny shapes, so a broken benchmark is found here and not
# on a borrowed GPU.
cargo build --features wgpu --example kernel_bench
timeout --kill-after=30 900 cargo run --features wgpu --example kernel_bench -- --small --attn-tiles 1x1,2x2

stage "cuda_codegen: every kernel's CUDA C++ for Hopper, compiled by NVRTC (no GPU needed)"
# NVRTC 13.0 from PyPI's wheels does what the first kernel launch on a GPU would do, so a
# kernel that does not compile for CUDA is found here rather than on a borrowed GPU.
# (assigned first so that a failed download stops the script here, under `set -e`)
nvrtc_env=$(bash scripts/nvrtc-wheels.sh target/nvrtc-wheels)
eval "$nvrtc_env"
bounded_test 1200 -p cubecl-kernels --features cuda --test cuda_codegen --test fused_defaults

# Ranks as separate processes under `mpirun -np 4` (OpenMPI from the system packages).
stage "ranks as MPI processes (process_ranks, mpi_bubble, launch_cli, process_checkpoint_cli, memory_cli)"
mpi_tests=(-p burn-bfpp -p bfpp --features bfpp/mpi)
bounded_test 900 "${mpi_tests[@]}" --test process_ranks --test mpi_bubble
bounded_test 900 "${mpi_tests[@]}" --test launch_cli --test process_checkpoint_cli --test memory_cli

stage "a Burn user's own project (tests/downstream: burn-bfpp by path, no [patch.crates-io])"
# Four thread ranks on the published burn-autodiff take turns at autodiff work; ten runs must
# each equal plain Burn within 1e-5, and their speed against MPI processes is printed.
bash scripts/downstream.sh

stage "done: every test stage passed"
