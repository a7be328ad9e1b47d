#!/usr/bin/env bash
# Assemble .gpu/ (git-ignored) for the lent GPU machine, which has CUDA, CMake and torch but none of
# our Debian packages and no network. Run HERE after scripts/setup.sh; the device tool carries the
# folder there (carry [".gpu"], command "bash scripts/gpu_check.sh").
#   .gpu/usr/...   exactly what the build needs from this machine's packages (Boost.Program_options,
#                  GoogleTest, nlohmann-json, zlib, and gloo's headers: the wheel ships c10d's Gloo
#                  backend but not the headers its ProcessGroupGloo.hpp includes), at Debian's own paths,
#                  so that the packages' CMake config files, which locate everything relative to
#                  themselves, keep working;
#   .gpu/data/text the prepared Austen text, .gpu/data/tokens its BPE token files, and Fashion-MNIST's four
#                  gzipped files (31 MB; unpacked there);
#   .gpu/fixtures  the PyTorch reference fixtures written here (scripts/reference), for the scripts that
#                  cannot run there (the check writes the rest with that machine's own PyTorch).
# Files are copied with links resolved (no symbolic links travel). Idempotent: rebuilds .gpu from
# scratch, then proves it self-sufficient with scripts/gpu_smoke, /usr being ignored.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
P="$ROOT/.gpu"
DATA="${MEMTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/memtrain}/data"
LIB=/usr/lib/x86_64-linux-gnu
BOOST=1.74.0
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
log() { echo "[gpu_deps] $*" >&2; }
put() { for f; do mkdir -p "$P$(dirname "$f")"; cp -rL "$f" "$P$f"; done; }  # /x/y -> .gpu/x/y

[ -f "$DATA/text/austen.txt" ] || { log "no $DATA/text/austen.txt: run scripts/setup.sh first"; exit 1; }
rm -rf "$P"; mkdir -p "$P/data/text"
cp "$DATA/text/austen.txt" "$P/data/text/"
if [ -d "$DATA/tokens" ]; then
  mkdir -p "$P/data/tokens"
  for set in "$DATA"/tokens/austen-bpe*; do cp -r "$set" "$P/data/tokens/"; done
fi

# Fashion-MNIST as Debian ships it (31 MB gzipped; gpu_check.sh unpacks it there into .gpu/data/fashion-mnist).
mkdir -p "$P/data/fashion-mnist-gz"
cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$P/data/fashion-mnist-gz/"

# The PyTorch reference fixtures, written here by the venv's torch 2.11 and the pinned transformers/peft/torchao
# (the GPU image has other versions of those, and its run of scripts/reference/ddp_ref.py crashed): the GPU
# build copies them (MEMTRAIN_FIXTURES_FROM) instead of running Python.
VENV_PY="$(bash "$ROOT/scripts/setup.sh" --print-venv)/bin/python"
[ -x "$VENV_PY" ] || { log "no venv python at $VENV_PY: run scripts/setup.sh first"; exit 1; }
bash "$ROOT/scripts/reference/write_fixtures.sh" "$VENV_PY" "$P/fixtures" >"$TMP/fixtures.log" 2>&1 \
  || { cat "$TMP/fixtures.log" >&2; log "writing the fixtures failed"; exit 1; }

# Boost.Program_options: the shared library, the config dirs, and only the headers that
# <boost/program_options.hpp> and any other Boost header our sources name pull in (under C++17 and
# C++20), plus all of boost/config, whose choices may differ with the GPU machine's compiler.
put $LIB/libboost_program_options.so $LIB/libboost_program_options.so.$BOOST \
    $LIB/cmake/BoostDetectToolset-$BOOST.cmake $LIB/cmake/Boost-$BOOST \
    $LIB/cmake/boost_headers-$BOOST $LIB/cmake/boost_program_options-$BOOST \
    /usr/include/boost/config /usr/include/boost/version.hpp
{ echo '#include <boost/program_options.hpp>'
  grep -rhoE '^#include <boost/[^>]+>' --include='*.cpp' --include='*.h' "$ROOT"/{runtime,models,optim,data,distributed,tests} || true
} >"$TMP/po.cpp"
echo '#include <gloo/context.h>' >"$TMP/gloo.cpp"
for std in c++17 c++20; do g++ -std=$std -M "$TMP/po.cpp"; done \
  | tr -s ' \\' '\n' | grep '^/usr/include/boost/' | xargs realpath -ms | sort -u >"$TMP/boost.txt"
put $(cat "$TMP/boost.txt")
# GoogleTest (gmock too: GTestConfig.cmake loads GMockTargets.cmake, which checks its libraries exist).
put /usr/include/gtest /usr/include/gmock $LIB/cmake/GTest \
    $LIB/libgtest.a $LIB/libgtest_main.a $LIB/libgmock.a $LIB/libgmock_main.a
# nlohmann-json (header-only) and zlib (FindZLIB looks for zlib.h and libz.so under the prefixes).
# Only the link-time libz.so travels: at run time every machine has its own libz.so.1, and a copy
# of ours on LD_LIBRARY_PATH there would shadow a newer system one for torch and python too.
put /usr/include/nlohmann /usr/share/cmake/nlohmann_json
put /usr/include/zlib.h /usr/include/zconf.h $LIB/libz.so
# gloo's headers (libgloo-dev): CMakeLists.txt's find_path(MEMTRAIN_GLOO_INCLUDE gloo/context.h) must find them.
put /usr/include/gloo
log "$(wc -l <"$TMP/boost.txt") Boost headers; .gpu holds $(find "$P" -type f | wc -l) files, $(du -sh "$P" | cut -f1)"

# Proof 1: every header of the four packages resolves inside .gpu when it comes first on the path.
for f in "$TMP/po.cpp" "$TMP/gloo.cpp" "$ROOT/scripts/gpu_smoke/smoke.cpp"; do g++ -std=c++20 -M -isystem "$P/usr/include" "$f"; done \
  | tr -s ' \\' '\n' \
  | grep -E '^/usr/include/(boost|gtest|gmock|nlohmann|gloo|zlib\.h|zconf\.h)' >"$TMP/leaks.txt" || true
if [ -s "$TMP/leaks.txt" ]; then log "headers missing from .gpu:"; cat "$TMP/leaks.txt" >&2; exit 1; fi
# Proof 2: CMake finds all four in .gpu alone (system prefixes ignored), links, and the test passes.
cmake -S "$ROOT/scripts/gpu_smoke" -B "$TMP/smoke" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$P/usr" -DCMAKE_IGNORE_PREFIX_PATH="/usr;/usr/local;/" -DEXPECT_PREFIX="$P" \
  >"$TMP/configure.log" 2>&1 || { cat "$TMP/configure.log" >&2; exit 1; }
grep 'smoke:' "$TMP/configure.log" >&2
cmake --build "$TMP/smoke" >"$TMP/build.log" 2>&1 || { cat "$TMP/build.log" >&2; exit 1; }
ldd "$TMP/smoke/smoke" | grep -E 'boost|libz' >&2
"$TMP/smoke/smoke" --gtest_brief=1 >&2
log "ok: .gpu is self-sufficient ($(du -sh "$P" | cut -f1))"
