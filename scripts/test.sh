#!/usr/bin/env bash
# The test suite: set up whatever is missing (packages, venv, data, build), then run every test with
# CTest. CUDA-only tests skip themselves on machines without a GPU. Extra arguments go to ctest,
# e.g. scripts/test.sh -R Checkpointing
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
exec ctest --test-dir "${MEMTRAIN_BUILD:-$ROOT/build}" --output-on-failure -j"${MEMTRAIN_TEST_JOBS:-2}" "$@"
