#!/usr/bin/env bash
# Installs the Debian packages the tests need when any is missing, and names them otherwise:
#   mesa-vulkan-drivers libvulkan1  software Vulkan (lavapipe) for the wgpu backend's tests
#   openmpi-bin libopenmpi-dev      `mpirun` and the headers the `mpi` crate binds
#   libclang-dev pkg-config         bindgen (the `mpi` crate's build script)
# Needs root or sudo only when something is missing.
set -euo pipefail

packages=(mesa-vulkan-drivers libvulkan1 openmpi-bin libopenmpi-dev libclang-dev pkg-config)
missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$pkg")
    fi
done
if ((${#missing[@]} == 0)); then
    echo "system packages: already installed: ${packages[*]}"
    exit 0
fi

echo "system packages: installing ${missing[*]}"
if ! command -v apt-get >/dev/null; then
    echo "error: the tests need ${missing[*]} (Debian names) and this machine has no apt-get;" \
        "install their equivalents with your package manager and run again" >&2
    exit 1
fi
sudo=()
if ((EUID != 0)); then
    if ! command -v sudo >/dev/null; then
        echo "error: installing ${missing[*]} needs root; run as root or install sudo" >&2
        exit 1
    fi
    sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
