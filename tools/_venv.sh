# Sourced by tools/*.sh: creates .venv and installs the project with its test, mcp and
# robot extras once per change of pyproject.toml (stamp file).  The robot extra
# (reachy-mini) builds PyGObject, which needs a few Debian packages: installed here
# when missing and we are root (CI and the robot image are), else say what to install.
# The household page's browser tests need Debian's chromium and chromium-driver: installed
# the same way (root and apt-get), else those tests skip saying so.
VENV="${REACHY_MEMORY_VENV:-$PWD/.venv}"
APT_PACKAGES="libcairo2-dev libgirepository1.0-dev gir1.2-gst-plugins-base-1.0 gir1.2-gst-plugins-bad-1.0 \
gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad pkg-config"
BROWSER_PACKAGES="chromium chromium-driver"
if ! command -v chromedriver >/dev/null || ! { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing $BROWSER_PACKAGES for the household page's browser tests (once)..." >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $BROWSER_PACKAGES >/dev/null \
      || echo "note: could not install $BROWSER_PACKAGES: the browser tests will be skipped" >&2
  else
    echo "note: the browser tests will be skipped; to run them: sudo apt-get install $BROWSER_PACKAGES" >&2
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  extras="test,mcp"
  if pkg-config --exists gobject-introspection-1.0 cairo 2>/dev/null; then
    extras="test,mcp,robot"
  elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing the Debian packages reachy-mini needs (once)..." >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_PACKAGES >/dev/null \
      && extras="test,mcp,robot"
  else
    echo "note: robot tests will be skipped; to run them: sudo apt-get install $APT_PACKAGES" >&2
  fi
  # --quiet: say what the silent minute or two is (a first run looked stuck)
  echo "installing reachy-memory[$extras] into $VENV (once per change of pyproject.toml)..." >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
  touch "$stamp"
fi
# An mcp 1.x client beside it (the conversation app's: mcp>=1.27.1; the project's mcp is 2.x), for
# tests/test_mcp_app_client.py and tools/bench_mcp_http.py: its own small venv, made once per pin.
MCP1_PIN="mcp>=1.27.1,<2"
MCP1_VENV="${REACHY_MEMORY_MCP1_VENV:-$VENV-mcp1}"
mcp1_stamp="$MCP1_VENV/.installed-$(echo "$MCP1_PIN" | sha256sum | cut -c1-16)"
if [ ! -f "$mcp1_stamp" ]; then
  echo "installing an mcp 1.x client ($MCP1_PIN) into $MCP1_VENV (once)..." >&2
  python3 -m venv "$MCP1_VENV" && "$MCP1_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "$MCP1_PIN" && touch "$mcp1_stamp"
fi
export REACHY_MEMORY_MCP1_PYTHON="$MCP1_VENV/bin/python"
