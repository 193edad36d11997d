#!/usr/bin/env bash
# Runs the main job on a fresh machine with the embedded defaults: makes .venv,
# installs reachy-memory, fetches and builds the model (once; cached), then
# serves in the foreground (data in ~/.reachy/memory, private ipc socket).
# Stop it with Ctrl-C (SIGINT) or SIGTERM: in-flight requests finish first.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_venv.sh
"$VENV/bin/reachy-memory" model fetch
exec "$VENV/bin/reachy-memory" serve "$@"
