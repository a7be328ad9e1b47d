#!/usr/bin/env bash
# Every PyTorch reference fixture the C++ tests read, into OUT:  write_fixtures.sh PYTHON OUT
# Run by the build (tests/CMakeLists.txt) with the venv's python, and by scripts/gpu_deps.sh for the GPU check
# (which carries them). OUT/.stamp last, once every script has written its files.
set -euo pipefail
PY="$1" OUT="$2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$OUT"
"$PY" "$HERE/make_fixtures.py" "$OUT"
"$PY" "$HERE/hf_models.py" "$OUT/hf"
"$PY" "$HERE/peft_models.py" "$OUT/hf"
"$PY" "$HERE/lowbit_ref.py" "$OUT"
"$PY" "$HERE/nf4_ref.py" "$OUT"
"$PY" "$HERE/chat_ref.py" "$OUT"
"$PY" "$HERE/tp_ref.py" "$OUT"
touch "$OUT/.stamp"
