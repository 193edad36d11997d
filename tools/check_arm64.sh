#!/usr/bin/env bash
# The robot's computer, emulated: installs reachy-memory into an arm64 Debian bookworm root
# (Reachy Mini Wireless runs a Raspberry Pi CM4: Cortex-A72, ARMv8.0-A) as the robot's
# owner would (a venv, `pip install` from the checkout, `reachy-memory model fetch`), with
# no C compiler in that root, then runs the model build and a named subset of the tests
# there under qemu-user emulating a Cortex-A72 (QEMU_CPU), so no instruction the CM4 lacks
# (dot product, LSE atomics...) can pass unnoticed.
#
#   sudo bash tools/check_arm64.sh            # as root: debootstrap, chroot and binfmt need it
#
# Needs: root, Debian's qemu-user-static, debootstrap and binfmt-support (installed here
# with apt-get when missing), binfmt_misc (mounted here when missing), PyPI and Debian's
# mirror. The root is built once (about 10 minutes) and kept in
# ${REACHY_MEMORY_ARM64_CACHE:-~/.cache/reachy-memory}/arm64-root with its venv, pip's
# cache and the model; later runs reinstall only the project (all of it when
# pyproject.toml changed). Emulation is 10-30x slower than the host: the subset is small
# (about 10-15 minutes once the root exists). Exit 77 (and a line saying why) when this
# machine cannot run arm64 binaries; any other non-zero exit is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
CACHE=${REACHY_MEMORY_ARM64_CACHE:-$HOME/.cache/reachy-memory}
ROOT=$CACHE/arm64-root
SHARED=${REACHY_MEMORY_SHARED:-$SRC/../shared}
MIRROR=${REACHY_MEMORY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CPU=${REACHY_MEMORY_QEMU_CPU:-cortex-a72}
ROOT_VERSION=1  # bump when the root's package list changes: it is built again
# The named subset (tests/<module>::<test> or -k expressions run as separate pytest calls).
TESTS=(
  "tests/test_embedding.py::test_fp32_parity_every_text"
  "tests/test_embedding.py::test_int8_is_the_default_and_close_to_the_reference"
  "tests/test_embedding.py::test_vectors_are_unit_length"
  "tests/test_vector_index.py"
  "tests/test_journal.py::test_round_trip"
  "tests/test_journal.py::test_corruption_mid_file_names_file_and_offset"
  "tests/test_journal.py::test_repair_keeps_every_valid_frame_and_moves_damaged_file_aside"
  "tests/test_power_cut.py::test_every_acknowledged_write_survives_a_power_cut_at_every_fsync"
  "tests/test_store.py::test_store_get_search_forget"
  "tests/test_store.py::test_vector_search_finds_meaning_without_shared_words"
  "tests/test_store.py::test_everything_survives_reopen"
  "tests/test_store.py::test_reopen_from_journal_only_after_a_crash"
  "tests/test_store.py::test_slot_reuse_keeps_indexes_consistent"
  "tests/test_server.py::test_every_op_round_trips"
  "tests/test_bridge.py::test_round_trip_with_the_daemon"
  "tests/test_mcp.py::test_tools_schemas_and_round_trip"
)
# Every reference sentence is a 7 min (int8) / 27 min (fp32) affair under emulation: 1 in 24.
REFERENCE_EVERY=${REACHY_MEMORY_REFERENCE_EVERY:-24}

say() { printf 'check_arm64: %s\n' "$*" >&2; }
skip() { say "skipped: $*"; exit 77; }

[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, chroot, binfmt_misc)"
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || skip "host $(uname -m) not handled"

emulated=true
[ "$(uname -m)" != aarch64 ] || emulated=false
if ! command -v debootstrap >/dev/null || { $emulated && ! [ -x /usr/bin/qemu-aarch64-static ]; }; then
  command -v apt-get >/dev/null || skip "qemu-user-static and debootstrap are missing and there is no apt-get"
  say "installing qemu-user-static, debootstrap and binfmt-support (once)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap binfmt-support >/dev/null
fi
if $emulated; then
  [ -e /proc/sys/fs/binfmt_misc/status ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
    || skip "binfmt_misc cannot be mounted here"
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || skip "qemu-aarch64 is not registered with binfmt_misc"
  grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
    || skip "qemu-aarch64 is registered without the F flag: it cannot run inside a chroot"
fi

# -- the root: Debian bookworm arm64, python3 and venv, no compiler ---------------------------------
if [ "$(cat "$ROOT/.reachy-memory-root" 2>/dev/null)" != "$ROOT_VERSION" ]; then
  say "building the arm64 Debian bookworm root in $ROOT (once; about 10 minutes)"
  rm -rf "$ROOT.tmp"
  mkdir -p "$CACHE"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOT.tmp" "$MIRROR" >"$CACHE/arm64-debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/arm64-debootstrap.log" >&2; exit 1; }
  rm -rf "$ROOT"
  mv "$ROOT.tmp" "$ROOT"
  echo "$ROOT_VERSION" >"$ROOT/.reachy-memory-root"
fi

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # (timeout's SIGTERM): the EXIT trap unmounts
bind() {  # bind SOURCE TARGET [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounted+=("$2")
  [ "${3:-}" != ro ] || mount -o remount,bind,ro "$2"
}
mount -t proc proc "$ROOT/proc" && mounted+=("$ROOT/proc")
# No /sys: onnxruntime's cpuinfo reads the CPU list there, and the host's (x86) makes it crash under
# emulation; without it, it warns ("Error in cpuinfo: failed to parse ...") and runs. The robot has its own.
bind /dev "$ROOT/dev"
mount -t devpts devpts "$ROOT/dev/pts" 2>/dev/null && mounted+=("$ROOT/dev/pts") || true
mount -t tmpfs tmpfs "$ROOT/dev/shm" 2>/dev/null && mounted+=("$ROOT/dev/shm") || true
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# This host's CA bundle (a proxy's CA, where there is one) for pip inside the root.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-bundle.crt"

in_root() {  # in_root COMMAND...: as root in the arm64 root, a clean environment
  chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/reachy-memory/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 QEMU_CPU="$CPU" PIP_CERT=/etc/ssl/certs/host-bundle.crt \
    SSL_CERT_FILE=/etc/ssl/certs/host-bundle.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
    "${extra_env[@]}" "$@"
}
extra_env=()
in_root /usr/bin/python3 -c 'import platform; assert platform.machine() == "aarch64", platform.machine()'
for cc in cc gcc g++ c++ clang; do
  if in_root sh -c "command -v $cc" >/dev/null; then say "the root has a compiler ($cc): it must not"; exit 1; fi
done

# -- the checkout, as a robot owner copies it (tracked and new files, no .git, no venv) -------------
rm -rf "$ROOT/opt/src"
mkdir -p "$ROOT/opt/src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$ROOT/opt/src"
else
  tar --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$ROOT/opt/src"
fi
if [ -f "$SHARED/data/minilm-reference/sentences.json" ]; then
  bind "$SHARED/data/minilm-reference" "$ROOT/opt/shared/data/minilm-reference" ro
  extra_env+=(REACHY_MEMORY_SHARED=/opt/shared)
elif [ "${CI:-}" = true ]; then
  say "the embedding reference is missing from $SHARED/data/minilm-reference"; exit 1
fi
[ -z "${CI:-}" ] || extra_env+=(CI="$CI")
extra_env+=(REACHY_MEMORY_REFERENCE_EVERY="$REFERENCE_EVERY")

# -- install as the robot would: venv, pip install from the checkout, model fetch --------------------
stamp="/opt/reachy-memory/venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$ROOT$stamp" ]; then
  say "installing reachy-memory[test,mcp] into /opt/reachy-memory/venv in the root (wheels only)"
  rm -rf "$ROOT/opt/reachy-memory/venv"
  in_root python3 -m venv /opt/reachy-memory/venv
  start=$SECONDS
  # --only-binary: what installs on a robot without a compiler; setuptools builds the project itself
  in_root pip install --quiet --only-binary=:all: setuptools wheel
  in_root pip install --quiet --only-binary=:all: --no-build-isolation '/opt/src[test,mcp]'
  touch "$ROOT$stamp"
  say "installed in $((SECONDS - start)) s"
else
  in_root pip install --quiet --no-deps --force-reinstall --no-build-isolation /opt/src
fi
in_root python -c 'import hnswlib, onnxruntime, reachy_memory; print("check_arm64: hnswlib from", hnswlib.__file__)' >&2

start=$SECONDS
in_root reachy-memory model fetch >&2
say "model fetched and built in $((SECONDS - start)) s"

# -- the named subset -------------------------------------------------------------------------------
start=$SECONDS
in_root sh -c 'cd /opt/src && exec python -m pytest -q -p no:cacheprovider -o addopts=-ra --timeout=900 \
  --hypothesis-profile=emulated --durations=8 "$@"' \
  pytest "${TESTS[@]}"
say "tests passed in $((SECONDS - start)) s (QEMU_CPU=$CPU)"
