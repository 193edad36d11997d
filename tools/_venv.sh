# Sourced by tools/*.sh: creates .venv and installs the project with its test
# and mcp extras once per change of pyproject.toml (stamp file). The robot
# extra (reachy-mini, which needs apt packages: README "Reachy Mini
# integration") is not installed here until tests use it.
VENV="${REACHY_MEMORY_VENV:-$PWD/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test,mcp]'
  touch "$stamp"
fi
