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
BIN="${MEMTRAIN_BUILD:-$ROOT/build}/memtrain"
"$BIN" "${config[@]}" --log.overwrite=true "$@"
# The run's memory.png (matplotlib in the venv): its folder is [log] dir / name, the config file's stem by default.
resolved="$("$BIN" "${config[@]}" "$@" --print-config 2>/dev/null)"
get() { awk -v s="[$1]" -v k="$2" '$0==s{f=1;next} /^\[/{f=0} f&&$1==k{sub(/^[^=]*= ?/,"");print;exit}' <<<"$resolved"; }
name="$(get log name)"
if [ -z "$name" ]; then
  src="$(sed -n 's/^# resolved from //p;q' <<<"$resolved")"
  for a in "${config[@]}" "$@"; do case "$a" in --config=*) src="${a#--config=}";; esac; done
  prev=""; for a in "${config[@]}" "$@"; do [ "$prev" = "--config" ] && src="$a"; prev="$a"; done
  name="$(basename "${src:-run}" .ini)"
fi
VENV_PY="$("$ROOT/scripts/setup.sh" --print-venv)/bin/python"
"$VENV_PY" "$ROOT/scripts/plot_memory.py" "$(get log dir)/$name" || echo "train.sh: memory.png not drawn" >&2
