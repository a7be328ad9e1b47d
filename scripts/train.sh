#!/usr/bin/env bash
# The main job: set up whatever is missing (packages, venv, data, build), then train the default config
# (a byte-level GPT on Jane Austen, on the CPU). Extra arguments are passed to memtrain, e.g.
#   scripts/train.sh --train.steps=100
#   scripts/train.sh --config examples/configs/mlp_fashion_cpu.ini
#   scripts/train.sh --checkpoint.resume=auto      continue an interrupted run from its last checkpoint
# Each call starts the run over in its folder (--log.overwrite=true, earlier checkpoints deleted) unless
# it resumes; memtrain itself refuses to overwrite another run without being told.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
config=(--config examples/configs/gpt_austen_cpu.ini)
for a in "$@"; do [[ "$a" == --config* ]] && config=(); done
exec "${MEMTRAIN_BUILD:-$ROOT/build}/memtrain" "${config[@]}" --log.overwrite=true "$@"
