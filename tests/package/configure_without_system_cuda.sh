#!/usr/bin/env bash
# CTest: a machine without a CUDA toolkit. scripts/setup.sh's CUDA-from-PyPI part (--cuda-from-pip)
# assembles the toolkit in the venv of VENV_PYTHON, then tests/package/torch_probe (find_package(Torch)
# and a 5-line LibTorch program) is configured against it, built and run, with the system toolkit
# hidden: CUDA_HOME, CUDA_PATH, CUDACXX unset, no "cuda" entry in PATH & co., and, where the kernel lets us
# (root or unprivileged user namespaces), an empty tmpfs mounted over the system toolkit's directory in
# a private mount namespace, which also hides the links into it (/usr/local/{bin,lib,lib64,include} on
# some images). Passes only when nothing CMake found, nothing compiled and nothing loaded at run time
# lies in the system toolkit.
#   configure_without_system_cuda.sh VENV_PYTHON SOURCE_DIR
# MEMTRAIN_BUILD_LOCK: a file to flock(1) around the (one-file) build, for machines whose cores are shared.
set -euo pipefail
shopt -s inherit_errexit
PY="$1" SRC="$2"

# The system toolkit's real directories (the default locations, and CUDA_HOME/CUDA_PATH if set), never
# a shared prefix such as /usr.
system=()
for d in /usr/local/cuda /usr/local/cuda-* /opt/cuda /usr/lib/cuda ${CUDA_HOME:-} ${CUDA_PATH:-}; do
  if [ -d "$d" ]; then
    d="$(readlink -f "$d")"
    case "$d" in /|/usr|/usr/local|/opt|/usr/lib) ;; *) system+=("$d") ;; esac
  fi
done
mapfile -t system < <(printf '%s\n' "${system[@]}" | sort -u | sed '/^$/d')

if [ -z "${MEMTRAIN_PROBE_HIDDEN:-}" ] && ((${#system[@]})); then
  ns=(unshare --mount)
  [ "$(id -u)" -eq 0 ] || ns+=(--map-root-user)
  if "${ns[@]}" true 2>/dev/null; then
    echo "hiding ${system[*]} under empty tmpfs mounts (private mount namespace)"
    # shellcheck disable=SC2016
    exec "${ns[@]}" env MEMTRAIN_PROBE_HIDDEN=1 MEMTRAIN_PROBE_SYSTEM="${system[*]}" bash -c \
      'set -e; for d in $MEMTRAIN_PROBE_SYSTEM; do mount -t tmpfs tmpfs "$d"; done; exec bash "$@"' \
      hide "$0" "$@"
  fi
  echo "no mount namespace here: the system toolkit stays visible; the checks below still apply"
fi

# Tools resolved before PATH loses its CUDA entries.
CMAKE="$(command -v cmake)"
NINJA="$(command -v ninja || true)"
generator=()
[ -n "$NINJA" ] && generator=(-G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA")
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache)")
unset CUDA_HOME CUDA_PATH CUDACXX CUDAToolkit_ROOT CUDA_BIN_PATH CUDA_TOOLKIT_ROOT
without_cuda() {  # a :-separated list without its CUDA entries
  local kept=() p
  IFS=: read -ra entries <<<"$1"
  for p in "${entries[@]}"; do [[ -z "$p" || "$p" == *cuda* ]] || kept+=("$p"); done
  (IFS=:; echo "${kept[*]}")
}
for v in PATH LD_LIBRARY_PATH LIBRARY_PATH CPATH C_INCLUDE_PATH CPLUS_INCLUDE_PATH; do
  if [ -n "${!v:-}" ]; then export "$v=$(without_cuda "${!v}")"; fi
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/memtrain-nocuda-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# ccache hits across runs although each run builds in a new directory.
export CCACHE_BASEDIR="$WORK" CCACHE_NOHASHDIR=1
start=$SECONDS

CUDA_ROOT="$("$SRC/scripts/setup.sh" --cuda-from-pip "$PY")"
echo "CUDA toolkit from PyPI: $CUDA_ROOT ($((SECONDS - start)) s)"
[ -x "$CUDA_ROOT/bin/nvcc" ] || { echo "FAIL: no $CUDA_ROOT/bin/nvcc"; exit 1; }

"$CMAKE" -S "$SRC/tests/package/torch_probe" -B "$WORK/build" "${generator[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch;print(torch.utils.cmake_prefix_path)')" \
  -DCUDAToolkit_ROOT="$CUDA_ROOT" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" \
  -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc" >"$WORK/configure.log" 2>&1 \
  || { cat "$WORK/configure.log"; echo "FAIL: find_package(Torch) did not configure"; exit 1; }
echo "configured ($((SECONDS - start)) s)"

# Nothing CMake cached or recorded about its compilers may point into the system toolkit: neither by
# name (/usr/local/cuda...) nor through a link (e.g. /usr/local/lib64/stubs/libcuda.so).
fail=0
cache=("$WORK/build/CMakeCache.txt" "$WORK"/build/CMakeFiles/[0-9]*/CMake*Compiler.cmake)
if grep -n '/usr/local/cuda' "${cache[@]}"; then
  echo "FAIL: the CMake cache names /usr/local/cuda"; fail=1
fi
in_system() {  # path -> 0 when its real path lies in the system toolkit
  local real s
  real="$(readlink -m "$1")"
  for s in "${system[@]}"; do [[ "$real" == "$s" || "$real" == "$s"/* ]] && return 0; done
  return 1
}
while read -r p; do
  if in_system "$p"; then echo "FAIL: the CMake cache has $p, which is the system toolkit's"; fail=1; fi
done < <(grep -ohE '/[^;" ]+' "${cache[@]}" | sort -u)
grep -q "^CMAKE_CUDA_COMPILER:[A-Z]*=$CUDA_ROOT/bin/nvcc$" "$WORK/build/CMakeCache.txt" \
  || { echo "FAIL: CMAKE_CUDA_COMPILER is not $CUDA_ROOT/bin/nvcc"; fail=1; }
grep -q "^CUDA_TOOLKIT_ROOT_DIR:[A-Z]*=$CUDA_ROOT$" "$WORK/build/CMakeCache.txt" \
  || { echo "FAIL: torch's FindCUDA did not take CUDA_TOOLKIT_ROOT_DIR=$CUDA_ROOT"; fail=1; }
((fail == 0)) || exit 1

lock=()
[ -n "${MEMTRAIN_BUILD_LOCK:-}" ] && lock=(flock "$MEMTRAIN_BUILD_LOCK")
"${lock[@]}" "$CMAKE" --build "$WORK/build" >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; echo "FAIL: the probe did not build"; exit 1; }
echo "built ($((SECONDS - start)) s)"
out="$("$WORK/build/torch_probe")"
echo "$out"
[[ "$out" == "sum 2, cuda "* ]] || { echo "FAIL: unexpected output"; exit 1; }

# The headers it compiled with and the libraries it loads.
if [ -f "$WORK/build/build.ninja" ]; then
  while read -r p; do
    if in_system "$p"; then echo "FAIL: compiled with the system toolkit's $p"; fail=1; fi
  done < <("$NINJA" -C "$WORK/build" -t deps | grep -oE '^ +/\S+' | sort -u)
fi
while read -r p; do
  if in_system "$p"; then echo "FAIL: loads the system toolkit's $p"; fail=1; fi
done < <(ldd "$WORK/build/torch_probe" | grep -oE '=> /\S+' | cut -c4-)
((fail == 0)) || exit 1
echo "find_package(Torch) configured, built and ran with the CUDA toolkit from PyPI alone ($((SECONDS - start)) s)"
