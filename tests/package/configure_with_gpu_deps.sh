#!/usr/bin/env bash
# CTest: the GPU machine's build, rehearsed here. The lent GPU machine has CUDA, CMake and torch but none of our
# Debian packages: scripts/gpu_deps.sh assembles .gpu/ (Boost.Program_options, GoogleTest, nlohmann-json, zlib,
# gloo's headers, the data and the reference fixtures), and scripts/gpu_check.sh configures memtrain against .gpu and the wheel. This test runs
# gpu_deps.sh, then configures memtrain itself as gpu_check.sh does, with the system's copies of those packages
# out of reach: CMAKE_IGNORE_PREFIX_PATH keeps every find_* off /usr and /usr/local, and, in a private mount
# namespace where the kernel allows one, empty tmpfs mounts hide /usr/include/{boost,gtest,gmock,nlohmann,gloo}
# from the compiler. Then it builds memtrain::core and memtrain::distributed (Boost, nlohmann-json, zlib, gloo)
# and the fixtures target (a copy of .gpu/fixtures), and checks that CMake found each package in .gpu. Passes only when all of that holds.
#   configure_with_gpu_deps.sh PYTHON SOURCE_DIR BUILD_DIR
set -euo pipefail
PY="$1" SRC="$2" OUTER="$3"
P="$SRC/.gpu"
B="$OUTER/gpu-deps-check"

if [ -z "${MEMTRAIN_GPU_DEPS_HIDDEN:-}" ]; then
  bash "$SRC/scripts/gpu_deps.sh" 2>&1 | tail -1
  ns=(unshare --mount)
  [ "$(id -u)" -eq 0 ] || ns+=(--map-root-user)
  if "${ns[@]}" true 2>/dev/null; then
    echo "hiding the system's Boost, GoogleTest, nlohmann-json and gloo headers (private mount namespace)"
    # shellcheck disable=SC2016
    exec "${ns[@]}" env MEMTRAIN_GPU_DEPS_HIDDEN=1 bash -c \
      'set -e; for d in /usr/include/boost /usr/include/gtest /usr/include/gmock /usr/include/nlohmann /usr/include/gloo; do
         [ -d "$d" ] && mount -t tmpfs tmpfs "$d"; done; exec bash "$@"' hide "$0" "$@"
  fi
  echo "no mount namespace here: the system headers stay visible to the compiler; CMake's searches are still kept off them"
fi

TORCH_PREFIX="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
rm -rf "$B"
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$P/usr/lib/x86_64-linux-gnu/cmake;$P/usr" \
  -DCMAKE_IGNORE_PREFIX_PATH="/usr;/usr/local" \
  -DMEMTRAIN_PYTHON="$PY" -DMEMTRAIN_DATA_DIR="$P/data" -DMEMTRAIN_FIXTURES_FROM="$P/fixtures" \
  -DCMAKE_BUILD_RPATH="$P/usr/lib/x86_64-linux-gnu" >"$B.configure.log" 2>&1 \
  || { cat "$B.configure.log"; echo "FAIL: memtrain does not configure with .gpu alone"; exit 1; }
# Each package CMake found lies in .gpu.
for var in Boost_DIR GTest_DIR nlohmann_json_DIR ZLIB_INCLUDE_DIR MEMTRAIN_GLOO_INCLUDE; do
  value="$(grep -E "^$var(:[A-Z]+)?=" "$B/CMakeCache.txt" | head -1 | cut -d= -f2-)"
  case "$value" in
    "$P"/*) echo "ok: $var = $value" ;;
    *) echo "FAIL: $var = '$value' is not in $P"; exit 1 ;;
  esac
done
cmake --build "$B" --target memtrain_core memtrain_distributed 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\] ' || true
[ -f "$B/libmemtrain_distributed.a" ] || { echo "FAIL: memtrain::distributed did not build with .gpu alone"; exit 1; }
# The carried reference fixtures (gpu_deps.sh wrote them with this machine's venv) are what the tests read there.
cmake --build "$B" --target memtrain_fixtures >/dev/null
for f in gpt_master.safetensors ddp_zero.safetensors lowbit.safetensors hf/gpt2/config.json; do
  cmp -s "$P/fixtures/$f" "$B/fixtures/$f" || { echo "FAIL: the build's fixtures/$f is not the carried one"; exit 1; }
done
echo "memtrain configures and builds with .gpu and the wheel alone"
