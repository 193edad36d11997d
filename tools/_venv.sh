# Sourced by tools/*.sh: creates .venv and installs the project into it once
# per change of pyproject.toml (stamp files). Extras: test and mcp always;
# robot (reachy-mini) too, which needs apt packages to build PyGObject: in CI
# (CI=true, root) they are installed when missing and the robot extra must
# install; elsewhere a failed robot install only warns (its tests then skip).
VENV="${REACHY_MEMORY_VENV:-$PWD/.venv}"
ROBOT_APT="libcairo2-dev libgirepository1.0-dev gir1.2-gst-plugins-base-1.0 gir1.2-gst-plugins-bad-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad pkg-config"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test,mcp]'
  touch "$stamp"
fi
robot_stamp="$VENV/.robot-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$robot_stamp" ]; then
  if [ "${CI:-}" = "true" ] && [ "$(id -u)" = 0 ]; then
    missing=$(for p in $ROBOT_APT; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
    if [ -n "$missing" ]; then
      apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
    fi
  fi
  if "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test,mcp,robot]'; then
    touch "$robot_stamp"
  elif [ "${CI:-}" = "true" ]; then
    echo "error: the robot extra did not install" >&2; exit 1
  else
    echo "warning: the robot extra (reachy-mini) did not install; see README 'Reachy Mini integration'" >&2
  fi
fi
