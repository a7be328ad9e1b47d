#!/usr/bin/env bash
# CTest: memtrain as an installed package. Installs the build into a temporary prefix, moves the prefix
# (the package must be relocatable), builds examples/embed against it from outside the source tree,
# runs it, and checks that both of its networks' losses fall. A decoy Boost ahead on the prefix path checks that
# the package takes the Boost it was built against.
#   embed_example.sh BUILD_DIR SOURCE_DIR TORCH_PREFIX
set -euo pipefail
BUILD="$1" SRC="$2" TORCH_PREFIX="$3"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/memtrain-embed-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD" --prefix "$WORK/staged" >/dev/null
mv "$WORK/staged" "$WORK/prefix"  # relocated: nothing may point at the staging path
if grep -rq "$WORK/staged" "$WORK/prefix/lib/cmake"; then
  echo "FAIL: the installed package names its install path"; exit 1
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# A newer Boost ahead on the embedder's path, without program_options (as the GPU image's 1.83 was, 2026-12-04:
# the embedder's configure failed there): the package must still take the Boost memtrain was built against.
mkdir -p "$WORK/shadow/lib/cmake/Boost-1.99.0"
cat >"$WORK/shadow/lib/cmake/Boost-1.99.0/BoostConfigVersion.cmake" <<'V'
set(PACKAGE_VERSION 1.99.0)
set(PACKAGE_VERSION_COMPATIBLE TRUE)
V
cat >"$WORK/shadow/lib/cmake/Boost-1.99.0/BoostConfig.cmake" <<'C'
message(FATAL_ERROR "the shadow Boost 1.99 was used: it has no program_options")
C
cmake -S "$SRC/examples/embed" -B "$WORK/build" -G Ninja "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$WORK/shadow;$WORK/prefix;$TORCH_PREFIX" >"$WORK/configure.log" 2>&1 || { cat "$WORK/configure.log"; exit 1; }
cmake --build "$WORK/build" 2>&1 | grep -vE '^\[[0-9]+/[0-9]+\] ' || true
[ -x "$WORK/build/embed_train" ] || { echo "FAIL: embed_train was not built"; exit 1; }
"$WORK/build/embed_train" 200 | tee "$WORK/out.txt"
# "<name> loss: first A last B": each network must end well below where it started.
for net in cnn gru; do
  line="$(grep "^$net loss: first" "$WORK/out.txt")" || { echo "FAIL: no loss line for $net"; exit 1; }
  awk -v l="$line" 'BEGIN { split(l, f, " "); first = f[4]; last = f[6];
       if (!(last < 0.5 * first)) { printf "FAIL: %s: loss %g -> %g did not halve\n", f[1], first, last; exit 1 }
       printf "ok: %s loss %g -> %g\n", f[1], first, last }'
done
grep -q "peak" "$WORK/out.txt" || { echo "FAIL: no memory table"; exit 1; }
# The embedder's own loop wrote the run folder through memtrain::RunReport, as fit() does.
for net in cnn gru; do
  for f in config.ini metrics.jsonl memory.rank0.jsonl summary.json; do
    [ -s "${TMPDIR:-/tmp}/memtrain-embed/$net/$f" ] || { echo "FAIL: $net: no $f from RunReport"; exit 1; }
  done
  grep -q '"steps": 200' "${TMPDIR:-/tmp}/memtrain-embed/$net/summary.json" || { echo "FAIL: $net: summary.json"; exit 1; }
done
echo "embed example: built against the installed package and trained"
