#!/usr/bin/env bash
# For .ci/run: tools/check_arm64.sh where this machine can run arm64 binaries (root, binfmt_misc,
# qemu-user-static), bounded to 25 minutes (REACHY_MEMORY_ARM64_MINUTES), at nice 10 (the
# emulation takes a core for 10-20 minutes; the first run also builds the root: ~7 of them).
# Exit 0 when it passed or could not run here (it says why), non-zero when it failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${REACHY_MEMORY_ARM64_MINUTES:-25}
start=$SECONDS
# timeout signals its whole process group (the chroot's emulated processes too); check_arm64 unmounts
timeout --kill-after=60 "${minutes}m" nice -n 10 bash tools/check_arm64.sh
rc=$?
took=$(( (SECONDS - start) / 60 ))
case $rc in
  0) echo "arm64 check: passed in ${took} min" ;;
  77) echo "arm64 check: skipped on this machine (reason above)"; rc=0 ;;
  124|137) echo "arm64 check: FAILED, not done within ${minutes} min" ;;
  *) echo "arm64 check: FAILED (exit $rc) after ${took} min" ;;
esac
exit $rc
