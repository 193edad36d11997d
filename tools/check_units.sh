#!/usr/bin/env bash
# Checks the systemd units: 'systemd-analyze verify' must print nothing (it
# exits 0 on unknown keys, so any output fails), and the offline security
# review must rate each service at an exposure of 2.5 or lower.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v systemd-analyze >/dev/null; then
  echo "check_units: systemd-analyze not found (apt-get install systemd)" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The units name the robot's install paths; point them at this checkout's venv
# so that verify can check the executables exist.
venv="${REACHY_MEMORY_VENV:-$PWD/.venv}"
for unit in systemd/*.service systemd/*.timer; do
  sed -e "s#/opt/reachy-memory/venv#$venv#g" -e "s#^User=reachy#User=root#" -e "s#^Group=reachy#Group=root#" \
    "$unit" > "$tmp/$(basename "$unit")"
done
out=$(cd "$tmp" && SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no ./*.service ./*.timer 2>&1 || true)
if [ -n "$out" ]; then
  echo "systemd-analyze verify reported:" >&2
  echo "$out" >&2
  exit 1
fi
for unit in "$tmp"/*.service; do
  score=$(systemd-analyze security --offline=true --threshold=25 "$unit" 2>&1 | tail -n 1)
  systemd-analyze security --offline=true --threshold=25 "$unit" >/dev/null 2>&1 || {
    echo "$(basename "$unit"): exposure above 2.5 ($score)" >&2
    exit 1
  }
  echo "$(basename "$unit"): $score"
done
echo "units OK"
