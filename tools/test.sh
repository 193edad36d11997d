#!/usr/bin/env bash
# Runs the test suite on a fresh machine: makes .venv, installs the project with its
# test extras, fetches the model (cached in ~/.cache/reachy-memory between runs) and
# runs pytest on two workers (pytest-xdist; the model and daemon fixtures are shared
# per worker).
#
#   bash tools/test.sh             the whole suite (what CI runs)
#   bash tools/test.sh --quick     the inner loop: engine, journal, filters, protocol and
#                                  a round trip through a real daemon (about a minute)
#   bash tools/test.sh ARGS...     pytest's own arguments (a file, -k, -x ...)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_venv.sh
"$VENV/bin/reachy-memory" model fetch
QUICK=(tests/test_journal.py tests/test_state.py tests/test_filters_chroma.py tests/test_lexical_index.py
       tests/test_vector_index.py tests/test_ranking.py tests/test_operations.py tests/test_config.py
       tests/test_temporal.py tests/test_supersession.py tests/test_clock.py
       "tests/test_server.py::test_every_op_round_trips")
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- "${QUICK[@]}" "$@"
fi
# --dist loadfile: a module's tests run in order on one worker, as they do without xdist
exec "$VENV/bin/python" -m pytest -q -n "${REACHY_MEMORY_TEST_WORKERS:-2}" --dist loadfile "$@"
