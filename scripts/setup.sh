#!/usr/bin/env bash
# memtrain set-up, shared by the README's two commands, .ci/run and the Dockerfile.
# Idempotent and quiet when everything is in place:
#   1. Debian packages (Boost.Program_options, GoogleTest, nlohmann-json, ccache, ninja, Fashion-MNIST);
#   2. the torch==2.11.0 virtualenv (CUDA 13 wheel) in a cache outside the clone, keyed by its pins;
#   3. the real datasets, prepared into the same cache;
#   4. CMake configure + build (ccache in the cache) into ./build.
# Environment: MEMTRAIN_CACHE (default ~/.cache/memtrain), MEMTRAIN_BUILD (default ./build),
#              MEMTRAIN_BUILD_TYPE (default Release), MEMTRAIN_TORCH (pip pin, default torch==2.11.0).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MEMTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/memtrain}"
TORCH_PIN="${MEMTRAIN_TORCH:-torch==2.11.0}"
PYTHON="${MEMTRAIN_PYTHON_BASE:-python3}"
DATA="$CACHE/data"
BUILD="${MEMTRAIN_BUILD:-$ROOT/build}"
BUILD_TYPE="${MEMTRAIN_BUILD_TYPE:-Release}"
APT_PACKAGES=(cmake ninja-build g++ ccache libboost-program-options-dev libgtest-dev googletest
              nlohmann-json3-dev zlib1g-dev dataset-fashion-mnist dpkg-dev)

log() { echo "[setup] $*" >&2; }

# 1. Debian packages: install only what is missing.
# A python3 without venv/ensurepip (Debian's and Ubuntu's system python) needs python3-venv.
command -v "$PYTHON" >/dev/null || APT_PACKAGES+=(python3)
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || APT_PACKAGES+=(python3-venv)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# apt-get download (data preparation) needs package lists even when nothing is missing.
if ((${#missing[@]})) || ! apt-cache show r-cran-janeaustenr >/dev/null 2>&1; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  if ((${#missing[@]})); then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# The torch wheel is a CUDA 13 build: its CMake config needs the CUDA toolkit (nvcc, headers) even on
# machines without a GPU. The project's machines and the Dockerfile's base image have it.
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "[setup] the CUDA 13 toolkit was not found at $CUDA_HOME (set CUDA_HOME): find_package(Torch) for the" \
       "cu130 torch wheel needs nvcc and the CUDA headers even to build for CPU" >&2
  exit 1
fi

# 2. The torch virtualenv, shared by every clone on this machine, keyed by the torch pin and Python.
PYVER="$("$PYTHON" -c 'import sys;print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
VENV="$CACHE/venv-${TORCH_PIN//=/}-py$PYVER"
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
  log "creating $VENV with $TORCH_PIN (a few minutes on a fresh machine)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q "$TORCH_PIN" numpy
  cuda_major="$("$VENV/bin/python" -c 'import torch;print((torch.version.cuda or "none").split(".")[0])')"
  if [ "$cuda_major" != "13" ]; then
    echo "[setup] $TORCH_PIN was built for CUDA '$cuda_major', expected 13.x to match /usr/local/cuda" >&2
    exit 1
  fi
  touch "$VENV/.complete"
fi

# 3. Data from Debian packages (a failure here fails the set-up).
"$VENV/bin/python" "$ROOT/scripts/prepare_data.py" "$DATA" | { grep -v '^prepared .*fashion-mnist$' || true; }

# 4. Configure and build.
export CCACHE_DIR="$CACHE/ccache" CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=5G
if [ ! -f "$BUILD/build.ninja" ]; then
  log "configuring $BUILD ($BUILD_TYPE)"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DCMAKE_PREFIX_PATH="$("$VENV/bin/python" -c 'import torch;print(torch.utils.cmake_prefix_path)')" \
    -DMEMTRAIN_PYTHON="$VENV/bin/python" -DMEMTRAIN_DATA_DIR="$DATA" -DCUDAToolkit_ROOT="$CUDA_HOME" \
    -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >"$CACHE/configure.log" 2>&1 \
    || { cat "$CACHE/configure.log" >&2; exit 1; }
fi
# Ninja's progress lines are dropped; warnings and errors still show, and a failed build fails here.
cmake --build "$BUILD" -j"${MEMTRAIN_JOBS:-$(nproc)}" 2>&1 | { grep -vE '^\[[0-9]+/[0-9]+\] |^ninja: no work' || true; }
