# Sourced by scripts/gpu-check.sh and scripts/gpu-run.sh on the GPU machine: makes the CUDA
# libraries that CubeCL and cudarc load at run time findable, and says which ones it uses.
#
# cudarc (built here without a CUDA toolkit, so for the newest CUDA 13 it knows) dlopens
# `libcuda.so.1`, `libnvrtc.so.13` / `libnvrtc.so` and `libnccl.so` by name. The driver's
# libcuda is normally on the loader path already; NVRTC and NCCL often are not: the CUDA
# toolkit keeps NVRTC in /usr/local/cuda/lib64 (preferred: it matches the driver, and CubeCL
# hands the driver NVRTC's PTX), and PyTorch's wheels ship both under site-packages/nvidia,
# with NCCL only as libnccl.so.2.
# Usage: gpu_libs <folder for links>
prepend_lib_path() {
    export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# CubeCL's CUDA runtime hands NVRTC `--include-path=$CUDA_PATH/include` for every kernel it
# compiles (the generated code includes cuda_runtime.h, cuda_bf16.h and mma.h), and panics
# when CUDA_PATH is unset and neither /usr/local/cuda, /opt/cuda nor /usr/bin/nvcc exists.
# So CUDA_PATH is set to the first folder whose include/ holds the headers: the toolkit
# beside `nvcc`, the usual toolkit folders, then PyTorch's CUDA 13 wheels (nvidia/cu13).
cuda_headers() {
    local dir candidates=()
    if [[ -n "${CUDA_PATH:-}" && -f "$CUDA_PATH/include/cuda_runtime.h" ]]; then
        return
    fi
    if command -v nvcc >/dev/null 2>&1; then
        candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
    fi
    candidates+=(/usr/local/cuda /opt/cuda)
    if [[ -n "$py_dirs" ]]; then
        # shellcheck disable=SC2086
        candidates+=($(find $py_dirs -maxdepth 3 -path '*/include/cuda_runtime.h' 2>/dev/null |
            sed 's|/include/cuda_runtime.h$||' | sort))
    fi
    unset CUDA_PATH
    for dir in "${candidates[@]}"; do
        if [[ -f "$dir/include/cuda_runtime.h" && -f "$dir/include/mma.h" ]]; then
            export CUDA_PATH=$dir
            return
        fi
    done
}

gpu_libs() {
    local links=$1 found dir py_dirs nvrtc nccl
    mkdir -p "$links" && links=$(cd "$links" && pwd)
    py_dirs=$(python3 -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null || true)
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
        for dir in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
            if [[ -e "$dir/libcuda.so.1" ]]; then
                prepend_lib_path "$dir"
                break
            fi
        done
    fi
    nvrtc=""
    if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so\.13 '; then
        for found in /usr/local/cuda/lib64/libnvrtc.so.13*; do
            [[ -e "$found" ]] && nvrtc=$found && break
        done
        if [[ -z "$nvrtc" && -n "$py_dirs" ]]; then
            # shellcheck disable=SC2086
            nvrtc=$(find $py_dirs -name 'libnvrtc.so.13*' 2>/dev/null | sort | head -1)
        fi
        if [[ -n "$nvrtc" ]]; then
            ln -sf "$nvrtc" "$links/libnvrtc.so.13"
            # NVRTC loads its builtins library from the loader path too.
            prepend_lib_path "$(dirname "$nvrtc")"
        else
            nvrtc="NOT FOUND (no CUDA toolkit, no PyTorch nvidia wheels): CUDA kernels cannot compile"
            # Another major version present is the likelier case; name it and the fix.
            # shellcheck disable=SC2086
            found=$( (ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null; \
                [[ -n "$py_dirs" ]] && find $py_dirs -name 'libnvrtc.so.*' 2>/dev/null) | head -1 || true)
            [[ -z "$found" ]] || nvrtc="NOT FOUND: only $found, but these binaries load CUDA 13's libnvrtc.so.13; install the CUDA 13 toolkit or PyTorch's CUDA 13 wheels (nvidia/cu13)"
        fi
    fi
    nccl=""
    if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
        if [[ -n "$py_dirs" ]]; then
            # shellcheck disable=SC2086
            nccl=$(find $py_dirs -name 'libnccl.so.2*' 2>/dev/null | sort | head -1)
        fi
        if [[ -n "$nccl" ]]; then
            ln -sf "$nccl" "$links/libnccl.so"
        else
            nccl="NOT FOUND: the NCCL steps will fail"
        fi
    fi
    prepend_lib_path "$links"
    cuda_headers
    # The binaries are built against CUDA 13 (cudarc's newest bindings, NVRTC 13's PTX), which
    # an older driver cannot run; say so before its errors, which do not.
    local driver_cuda
    driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -1)
    if [[ -n "$driver_cuda" ]] && ((driver_cuda < 13)); then
        echo "gpu-libs: WARNING: the driver supports CUDA $driver_cuda only; these binaries need a CUDA 13 driver (R580 or newer)" >&2
    fi
    echo "gpu-libs: nvrtc ${nvrtc:-from the loader path}, nccl ${nccl:-from the loader path}"
    echo "gpu-libs: CUDA_PATH=${CUDA_PATH:-NOT SET (no CUDA headers found: CUDA kernels cannot compile)}"
    echo "gpu-libs: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}
