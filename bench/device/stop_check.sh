#!/bin/bash
# Issue 21's stop check on a lent device machine (16 CPUs): the paper
# cases that converge, tsubame's three configurations, 3 repetitions, so
# expected and measured downtime can be compared where both ends have CPUs
# to spare. About 5.5 minutes on the H100 machine (2026-11-27); the log and
# a tarball of the harness's output come back under $OUT. Run
# bench/device/prepare.sh here first. BUDGET (seconds, default 480) stops
# the harness early, keeping the runs done.
set -u
root=$PWD
[ -n "${OUT:-}" ] || { echo "stop_check: OUT is not set (it runs on the device machine)" >&2; exit 1; }
[ -x .dev/bin/tsubame ] || { echo "stop_check: .dev/bin/tsubame missing: run bench/device/prepare.sh and carry .dev" >&2; exit 1; }
export PATH=$root/.dev/bin:$PATH LD_LIBRARY_PATH=$root/.dev/lib PYTHONUNBUFFERED=1
echo "== $(date +%T) host: $(uname -r), $(nproc) CPUs, cpuidle $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo '?')"
[ -c /dev/kvm ] || { echo "stop_check: no /dev/kvm on this machine"; exit 2; }
timeout -s INT "${BUDGET:-480}" python3 bench/compare.py bench/cases/paper.toml \
    --only gmigrate-best-4G-1gbit,rdma-bwmem-2G-10gbit,rdma-kv-2G-10gbit \
    --configs tsubame-auto,tsubame-4096,tsubame-spp128 --repetitions 3 \
    --tsubame "$root/.dev/bin/tsubame" --qemu /bin/true --no-plots --out /tmp/stop_check 2>&1 | tee "$OUT/compare.log"
echo "== $(date +%T) done"
tar czf "$OUT/stop_check.tar.gz" -C /tmp stop_check
