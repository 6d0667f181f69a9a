#!/usr/bin/env bash
# Fetches NVIDIA's NVRTC, nvJitLink (ptxas as a library) and CUDA headers from PyPI into DIR (no GPU, no CUDA toolkit and no
# root needed), for compiling the kernels' CUDA C++ on a CPU-only machine:
#   cargo test -p cubecl-kernels --features cuda --test cuda_codegen
# Pinned to CUDA 13.0, the version of the H200 machines' driver and toolkit.
# Usage: scripts/nvrtc-wheels.sh DIR   (then set the two variables it prints)
set -euo pipefail
dir=${1:?usage: scripts/nvrtc-wheels.sh DIR}
version=13.0.88
# nvrtc: CUDA C++ to PTX; nvjitlink: PTX to machine code (ptxas); runtime: cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, mma.h; crt: the
# headers those include (crt/mma.h, host_defines.h, ...).
wheels=(nvidia-cuda-nvrtc nvidia-nvjitlink nvidia-cuda-runtime nvidia-cuda-crt)
mkdir -p "$dir" && dir=$(cd "$dir" && pwd)
root=$dir/nvidia/cu13
if [[ ! -f $root/include/cuda_runtime.h || ! -f $root/include/crt/mma.h || ! -e $root/lib/libnvrtc.so.13 ||
    ! -e $root/lib/libnvJitLink.so.13 ]]; then
    python3 -m pip download --quiet --no-deps --dest "$dir/wheels" \
        "${wheels[@]/%/==$version}"
    # A wheel is a zip archive; unpacking it is all these need (they hold no Python code).
    for wheel in "$dir"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$dir"
    done
fi
for needed in include/cuda_runtime.h include/mma.h include/crt/mma.h lib/libnvrtc.so.13 \
    lib/libnvJitLink.so.13; do
    [[ -e $root/$needed ]] || { echo "nvrtc-wheels: $root/$needed missing after unpacking" >&2; exit 1; }
done
echo "export LD_LIBRARY_PATH=$root/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export BFPP_CUDA_INCLUDE=$root/include"
