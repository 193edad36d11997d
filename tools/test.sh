#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: makes .venv, installs the
# project with its test extras, fetches the model (cached in
# ~/.cache/reachy-memory between runs) and runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_venv.sh
"$VENV/bin/reachy-memory" model fetch
exec "$VENV/bin/python" -m pytest -q "$@"
