#!/usr/bin/env bash
# memtrain set-up, shared by the README's two commands, .ci/run and the Dockerfile.
# Idempotent and quiet when everything is in place:
#   1. Debian packages (scripts/packages.txt: Boost.Program_options, GoogleTest, nlohmann-json, gloo
#      headers, ccache, ninja, Fashion-MNIST);
#   2. the torch==2.11.0 virtualenv (CUDA 13 wheel) in a cache outside the clone, keyed by its pins;
#   3. the real datasets, prepared into the same cache;
#   4. CMake configure + build (ccache in the cache) into ./build.
# Environment: MEMTRAIN_CACHE (default ~/.cache/memtrain), MEMTRAIN_BUILD (default ./build),
#              MEMTRAIN_BUILD_TYPE (default Release), MEMTRAIN_TORCH (pip pin, default torch==2.11.0),
#              MEMTRAIN_CUDA: which CUDA 13 toolkit CMake gets (torch's config needs one even for CPU use):
#                auto (default): $CUDA_HOME (default /usr/local/cuda) when it has bin/nvcc, else pip;
#                system: $CUDA_HOME only; pip: NVIDIA's PyPI packages, installed into the venv (once).
# `setup.sh --no-build` stops before configuring (the Dockerfile's dependency layer).
# `setup.sh --cuda-from-pip VENV_PYTHON` only does the pip part for that venv and prints the toolkit root
# (tests/package/configure_without_system_cuda.sh).
set -euo pipefail
shopt -s inherit_errexit

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MEMTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/memtrain}"
TORCH_PIN="${MEMTRAIN_TORCH:-torch==2.11.0}"
TOKENIZERS_PIN="tokenizers==0.22.1"  # Hugging Face's, for the BPE vocabularies of the GPT examples
MATPLOTLIB_PIN="matplotlib==3.10.7"  # scripts/plot_memory.py: each run's memory.png
TRANSFORMERS_PIN="transformers==4.57.6"  # the oracle of the Hugging Face tests and the export's reader
PEFT_PIN="peft==0.17.1"  # the oracle of the LoRA tests and the adapter export's reader
TORCHAO_PIN="torchao==0.18.0"  # the oracle of the 8/4-bit optimizer tests (its optim code is pure Python; --no-deps keeps torch)
PYTHON="${MEMTRAIN_PYTHON_BASE:-python3}"
DATA="$CACHE/data"
BUILD="${MEMTRAIN_BUILD:-$ROOT/build}"
BUILD_TYPE="${MEMTRAIN_BUILD_TYPE:-Release}"
mapfile -t APT_PACKAGES < <(grep -vE '^\s*(#|$)' "$ROOT/scripts/packages.txt")

log() { echo "[setup] $*" >&2; }
die() { echo "[setup] $*" >&2; exit 1; }

# The CUDA 13.0 compiler and what it needs, from PyPI: the versions that torch 2.11.0's own pin
# cuda-toolkit==13.0.2 names for its extras nvcc, crt, nvvm and cccl. The venv already has the runtime,
# nvrtc, cuBLAS, ... (torch depends on them); nvidia-cuda-nvcc depends on nvidia-cuda-runtime, which
# torch pins. PyPI has no libcuda.so driver stub: torch's config does without it (CUDA::cuda_driver
# then does not exist; nothing in TORCH_LIBRARIES links it).
CUDA_PIP_PACKAGES=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
                   nvidia-cuda-cccl==13.0.85)

# Sets CUDA_ROOT to a CUDA toolkit assembled from PyPI in the venv of python $1, installing it once.
# The packages land in site-packages/nvidia/cu13/{bin,include,lib,nvvm}, which nvcc runs from but
# CMake and nvcc's own profile do not find everything in: nvcc links with -L$TOP/lib64, FindCUDA and
# FindCUDAToolkit look for unversioned libcudart.so & co. $VENV/cuda-toolkit is that layout in
# (relative) symlinks: bin/ one link per tool (nvcc takes its TOP from the path it was started by),
# nvvm, include/ with the headers plus NCCL's (nvidia-nccl-cu13, a torch dependency: CMakeLists.txt
# looks for nccl.h in the toolkit), lib/ with the libraries plus libX.so -> libX.so.N, lib64 -> lib.
cuda_from_pip() {
  local py="$1" venv cu13 stamp
  venv="$("$py" -c 'import sys;print(sys.prefix)')"
  CUDA_ROOT="$venv/cuda-toolkit"
  stamp="layout 2: ${CUDA_PIP_PACKAGES[*]}"  # a new layout or pin set redoes it
  [ "$(cat "$CUDA_ROOT/.pins" 2>/dev/null)" != "$stamp" ] || return 0
  exec 9>"$venv/.cuda-toolkit.lock"
  flock 9  # the venv is shared by every clone: one installer at a time
  if [ "$(cat "$CUDA_ROOT/.pins" 2>/dev/null)" != "$stamp" ]; then
    log "installing the CUDA 13 toolkit from PyPI into $venv: ${CUDA_PIP_PACKAGES[*]}"
    "$py" -m pip install -q --disable-pip-version-check "${CUDA_PIP_PACKAGES[@]}"
    cu13="$("$py" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
    local tmp="$CUDA_ROOT.tmp" f n
    rm -rf "$tmp" "$CUDA_ROOT"
    mkdir -p "$tmp/bin" "$tmp/include" "$tmp/lib"
    for f in "$cu13"/bin/*; do ln -sr "$f" "$tmp/bin/"; done
    for f in "$cu13"/include/* "$cu13"/../nccl/include/*; do
      if [ -e "$f" ] && [ ! -e "$tmp/include/${f##*/}" ]; then ln -sr "$f" "$tmp/include/"; fi
    done
    for f in "$cu13"/lib/*; do ln -sr "$f" "$tmp/lib/"; done
    for f in "$cu13"/lib/lib*.so.*; do
      n="${f##*/}"
      if [ ! -e "$tmp/lib/${n%%.so.*}.so" ]; then ln -s "$n" "$tmp/lib/${n%%.so.*}.so"; fi
    done
    ln -sr "$cu13/nvvm" "$tmp/nvvm"
    ln -s lib "$tmp/lib64"
    for f in bin/nvcc bin/ptxas bin/fatbinary bin/nvlink nvvm/bin/cicc include/cuda_runtime.h \
             include/crt/host_config.h include/nv/target include/nccl.h lib/libcudart.so lib/libcudart_static.a; do
      [ -e "$tmp/$f" ] || die "the CUDA toolkit from PyPI lacks $f (in $cu13)"
    done
    "$tmp/bin/nvcc" --version | grep -q 'release 13\.0' || die "$tmp/bin/nvcc is not CUDA 13.0"
    echo "$stamp" >"$tmp/.pins"
    mv "$tmp" "$CUDA_ROOT"
  fi
  exec 9>&-
}

if [ "${1:-}" = "--cuda-from-pip" ]; then
  [ -x "${2:-}" ] || die "usage: setup.sh --cuda-from-pip VENV_PYTHON"
  cuda_from_pip "$2"
  echo "$CUDA_ROOT"
  exit 0
fi

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

# 2. The torch virtualenv, shared by every clone on this machine, keyed by the torch pin and Python.
PYVER="$("$PYTHON" -c 'import sys;print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
VENV="$CACHE/venv-${TORCH_PIN//=/}-py$PYVER"
if [ "${1:-}" = "--print-venv" ]; then echo "$VENV"; exit 0; fi  # train.sh: where the plot's Python is
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
  log "creating $VENV with $TORCH_PIN (a few minutes on a fresh machine)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q "$TORCH_PIN" numpy
  cuda_major="$("$VENV/bin/python" -c 'import torch;print((torch.version.cuda or "none").split(".")[0])')"
  if [ "$cuda_major" != "13" ]; then
    die "$TORCH_PIN was built for CUDA '$cuda_major', expected 13.x to match the CUDA 13 toolkit"
  fi
  touch "$VENV/.complete"
fi

# The torch wheel is a CUDA 13 build: its CMake config needs the CUDA toolkit (nvcc, headers, cudart)
# even on machines without a GPU. The project's machines and the Dockerfile's base image have one.
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
case "${MEMTRAIN_CUDA:-auto}" in
  auto)   if [ -x "$CUDA_HOME/bin/nvcc" ]; then CUDA_ROOT="$CUDA_HOME"; else cuda_from_pip "$VENV/bin/python"; fi ;;
  system) [ -x "$CUDA_HOME/bin/nvcc" ] || die "MEMTRAIN_CUDA=system, but $CUDA_HOME/bin/nvcc does not exist (set CUDA_HOME)"
          CUDA_ROOT="$CUDA_HOME" ;;
  pip)    cuda_from_pip "$VENV/bin/python" ;;
  *)      die "MEMTRAIN_CUDA=${MEMTRAIN_CUDA}: expected auto, system or pip" ;;
esac

# Hugging Face tokenizers in the same venv (added to an existing venv once; the pin is checked each time).
if [ "$("$VENV/bin/python" -c 'import tokenizers;print(tokenizers.__version__)' 2>/dev/null)" != "${TOKENIZERS_PIN#*==}" ]; then
  log "installing $TOKENIZERS_PIN into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TOKENIZERS_PIN"
fi
if [ "$("$VENV/bin/python" -c 'import transformers;print(transformers.__version__)' 2>/dev/null)" != "${TRANSFORMERS_PIN#*==}" ]; then
  log "installing $TRANSFORMERS_PIN into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TRANSFORMERS_PIN" "$TOKENIZERS_PIN"
fi
if [ "$("$VENV/bin/python" -c 'import peft;print(peft.__version__)' 2>/dev/null)" != "${PEFT_PIN#*==}" ]; then
  log "installing $PEFT_PIN into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$PEFT_PIN" "$TRANSFORMERS_PIN" "$TOKENIZERS_PIN"
fi
# torchao in a folder of its own beside the venv, on PYTHONPATH only for the scripts that use it: installed in the
# venv, peft 0.17.1 would find it and import names torchao 0.18 no longer has.
TORCHAO_DIR="$CACHE/${TORCHAO_PIN//=/}"
if [ "$(PYTHONPATH="$TORCHAO_DIR" "$VENV/bin/python" -c 'import torchao;print(torchao.__version__)' 2>/dev/null)" != "${TORCHAO_PIN#*==}" ]; then
  log "installing $TORCHAO_PIN into $TORCHAO_DIR"
  rm -rf "$TORCHAO_DIR.partial"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$TORCHAO_DIR.partial" "$TORCHAO_PIN"
  rm -rf "$TORCHAO_DIR" && mv "$TORCHAO_DIR.partial" "$TORCHAO_DIR"
fi
if [ "$("$VENV/bin/python" -c 'import matplotlib;print(matplotlib.__version__)' 2>/dev/null)" != "${MATPLOTLIB_PIN#*==}" ]; then
  log "installing $MATPLOTLIB_PIN into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$MATPLOTLIB_PIN"
fi

# 3. Data from Debian packages (a failure here fails the set-up), and the BPE token files made from it
#    (byte-level BPE vocabularies of 8,192 and 50,257 entries trained on the Austen corpus, once).
"$VENV/bin/python" "$ROOT/scripts/prepare_data.py" "$DATA" | { grep -v '^prepared .*fashion-mnist$' || true; }
"$VENV/bin/python" "$ROOT/scripts/prepare_tokens.py" "$DATA"
# Chat records for data.dataset = chat's example (examples/configs/llama_austen_chat_lora_cpu.ini): "continue this
# passage" records from the novels, with the 8,192-entry BPE tokenizer, once.
if [ ! -f "$DATA/chat/austen-continue/train.safetensors" ]; then
  "$VENV/bin/python" "$ROOT/scripts/prepare_chat.py" --austen "$DATA/text/austen.txt" \
    --tokenizer "$DATA/tokens/austen-bpe8192" --out "$DATA/chat/austen-continue" --max-tokens 129 | tail -1
fi

[ "${1:-}" = "--no-build" ] && exit 0

# 4. Configure and build.
export CCACHE_DIR="$CACHE/ccache" CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=5G
# A build configured with another toolkit is configured afresh (CMake caches every path it found).
# The three variables: CMAKE_CUDA_COMPILER for enable_language(CUDA), CUDA_TOOLKIT_ROOT_DIR for torch's
# copy of FindCUDA (which otherwise searches PATH and /usr/local), CUDAToolkit_ROOT for FindCUDAToolkit.
fresh=()
configured_cuda="$(sed -n 's/^CUDAToolkit_ROOT:[A-Z]*=//p' "$BUILD/CMakeCache.txt" 2>/dev/null || true)"
if [ -f "$BUILD/build.ninja" ] && [ -n "$configured_cuda" ] && [ "$configured_cuda" != "$CUDA_ROOT" ]; then
  log "$BUILD was configured with the CUDA toolkit $configured_cuda: configuring it afresh with $CUDA_ROOT"
  fresh=(--fresh)
fi
if [ ! -f "$BUILD/build.ninja" ] || ((${#fresh[@]})); then
  log "configuring $BUILD ($BUILD_TYPE)"
  cmake "${fresh[@]}" -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DCMAKE_PREFIX_PATH="$("$VENV/bin/python" -c 'import torch;print(torch.utils.cmake_prefix_path)')" \
    -DMEMTRAIN_PYTHON="$VENV/bin/python" -DMEMTRAIN_DATA_DIR="$DATA" -DCUDAToolkit_ROOT="$CUDA_ROOT" \
    -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >"$CACHE/configure.log" 2>&1 \
    || { cat "$CACHE/configure.log" >&2; exit 1; }
fi
# Ninja's progress lines become one line on stderr that counts up ("[setup] building 37/80"): a first build
# takes minutes on 2 cores and must not look hung. Warnings and errors still show in full, and a failed
# build fails here (pipefail).
cmake --build "$BUILD" -j"${MEMTRAIN_JOBS:-$(nproc)}" 2>&1 | awk '
  /^\[[0-9]+\/[0-9]+\] / { printf "\r[setup] building %s", substr($1, 2, length($1) - 2) > "/dev/stderr"; fflush("/dev/stderr"); shown = 1; next }
  /^ninja: no work/ { next }
  { if (shown) { printf "\n" > "/dev/stderr"; shown = 0 } print; fflush() }
  END { if (shown) printf "\n" > "/dev/stderr" }'
log "built $BUILD"
