#!/usr/bin/env bash
# The whole project and its tests built with AddressSanitizer and UndefinedBehaviorSanitizer, and the
# whole CTest suite run under them. LibTorch itself is not instrumented (ASan still checks every
# malloc/free it makes, and memtrain's counting CPU allocator hands out posix_memalign blocks that ASan
# tracks like any other).
#   scripts/sanitize.sh [ctest arguments, e.g. -R Fuzz]
# Environment: MEMTRAIN_SANITIZE_BUILD (default ./build-asan), MEMTRAIN_TEST_JOBS (default 2), and
# setup.sh's own (MEMTRAIN_CACHE, MEMTRAIN_CUDA, MEMTRAIN_JOBS, ...).
# Prints a summary: tests passed and failed, and every sanitizer report (one line each, with its file).
# Exits non-zero when a test failed or a sanitizer reported anything.
set -euo pipefail
shopt -s inherit_errexit

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${MEMTRAIN_SANITIZE_BUILD:-$ROOT/build-asan}"
LOGS="$BUILD/sanitizer-logs"

# -O2 -g (RelWithDebInfo) keeps the suite's training tests at a tolerable speed; the frame pointers give
# ASan's fast unwinder whole stacks. The flags reach CMake through CXXFLAGS/LDFLAGS, which it reads
# when a build folder is first configured: setup.sh's configure logic (venv, CUDA toolkit, cache
# variables, ccache settings) is reused unchanged. They stay exported for the tests, so that the ones
# that configure a CMake project of their own (Package.EmbedExampleBuildsAndTrains links the
# instrumented static libraries) build it with the same flags.
SANITIZERS="-fsanitize=address,undefined -fno-omit-frame-pointer"
export CXXFLAGS="$SANITIZERS" LDFLAGS="-fsanitize=address,undefined"
export MEMTRAIN_BUILD="$BUILD" MEMTRAIN_BUILD_TYPE=RelWithDebInfo

# detect_leaks=0: LibTorch allocates registries, thread pools and kernels' caches once per process and
# never frees them; LeakSanitizer reports thousands of these at every exit, which would bury a real leak
# and fail every test (including the build's own test discovery, which runs the test binary).
# protect_shadow_gap=0: the CUDA driver maps memory in ASan's shadow gap; without it any CUDA call
# fails (harmless on a machine without a GPU).
# log_path: reports go to files, one per process, so that a report of a child process (the ranks that
# memtrain-run and torchrun start, whose output some tests capture) is never lost.
# halt_on_error: a sanitizer report fails the test that caused it.
mkdir -p "$LOGS"
rm -f "$LOGS"/*
export ASAN_OPTIONS="detect_leaks=0:protect_shadow_gap=0:halt_on_error=1:abort_on_error=0:log_path=$LOGS/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$LOGS/ubsan"

# A build folder configured with other flags (by hand, or by an older version of this script) is
# reconfigured with these.
if [ -f "$BUILD/CMakeCache.txt" ] &&
   [ "$(sed -n 's/^CMAKE_CXX_FLAGS:[A-Z]*=//p' "$BUILD/CMakeCache.txt")" != "$CXXFLAGS" ]; then
  echo "[sanitize] reconfiguring $BUILD with $CXXFLAGS" >&2
  cmake -B "$BUILD" -DCMAKE_CXX_FLAGS="$CXXFLAGS" -DCMAKE_EXE_LINKER_FLAGS="$LDFLAGS" \
    -DCMAKE_SHARED_LINKER_FLAGS="$LDFLAGS" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
start=$SECONDS
"$ROOT/scripts/setup.sh"
echo "[sanitize] built $BUILD in $((SECONDS - start)) s" >&2

start=$SECONDS
status=0
ctest --test-dir "$BUILD" --output-on-failure -j"${MEMTRAIN_TEST_JOBS:-2}" "$@" >"$BUILD/ctest.log" 2>&1 || status=$?
sed -n '/The following tests FAILED/,$p' "$BUILD/ctest.log"

echo
echo "== sanitize.sh summary ($((SECONDS - start)) s of tests; full log: $BUILD/ctest.log) =="
grep -E '^[0-9]+% tests passed' "$BUILD/ctest.log" || echo "no CTest summary line (did ctest run?)"
reports=0
for f in "$LOGS"/*; do
  [ -e "$f" ] || continue
  reports=$((reports + 1))
  # The first line that says what happened: "ERROR: AddressSanitizer: ..." or "file:line:col: runtime error: ...".
  echo "sanitizer report $f:"
  grep -m1 -E 'ERROR: AddressSanitizer|runtime error:|ERROR: [A-Za-z]+Sanitizer' "$f" | sed 's/^/  /'
  grep -m1 -E '^SUMMARY:' "$f" | sed 's/^/  /' || true
  # The innermost frames in memtrain's own sources (the build names them ../core/src/..., ../tests/...).
  grep -E '^ *#[0-9]+ ' "$f" | grep -E " (\.\./|$ROOT/)(core|models|data|optim|distributed|runtime|tests|bench|examples)/" |
    head -n 3 | sed 's/^ */  /' || true
done
# UBSan in a process that also has ASan writes to stderr whatever log_path says: those reports are in
# the tests' output, one "file:line:col: runtime error: ..." line each (counted once per place).
ubsan="$(grep -hoE '[^ ]+:[0-9]+:[0-9]+: runtime error: .*' "$BUILD/ctest.log" "$LOGS"/* 2>/dev/null | sort | uniq -c || true)"
if [ -n "$ubsan" ]; then
  echo "UndefinedBehaviorSanitizer reports (times seen, place, what):"
  echo "$ubsan" | sed 's/^ */  /'
  reports=$((reports + $(echo "$ubsan" | wc -l)))
fi
asan_inline="$(grep -c 'ERROR: AddressSanitizer' "$BUILD/ctest.log" || true)"
[ "$asan_inline" -eq 0 ] || { echo "AddressSanitizer reports in the tests' output: $asan_inline (see $BUILD/ctest.log)"; reports=$((reports + asan_inline)); }
echo "sanitizer reports: $reports"
[ "$reports" -eq 0 ] && [ "$status" -eq 0 ]
