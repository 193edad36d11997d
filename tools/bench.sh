#!/usr/bin/env bash
# Runs one benchmark with what it needs installed: `bash tools/bench.sh NAME [ARGS...]` runs
# `python -m tools.bench_NAME ARGS...` in .venv, made and filled by tools/_venv.sh as for the
# tests (the test, mcp and robot extras: pytest, reachy-mini...), the model fetched first.
#   bash tools/bench.sh control_loop --seconds 10 --runs 3
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: bash tools/bench.sh NAME [ARGS...]  (NAME: control_loop, daemon, engine, embed...)}
shift
[ -f "tools/bench_$name.py" ] || { echo "no tools/bench_$name.py" >&2; exit 2; }
source tools/_venv.sh
"$VENV/bin/reachy-memory" model fetch >&2
exec "$VENV/bin/python" -m "tools.bench_$name" "$@"
