#!/bin/bash
# Issue 53's check on a lent GPU machine, in one device call (about 2.5
# minutes on the H200; each step has its own time limit, and none runs
# past BUDGET seconds, 480 by default). Run bench/device/gpu_prepare.sh
# here first, then
#   run(command='bash bench/device/gpu_check.sh', carry=['.gpu'], timeout_s=540)
# Everything comes back under $OUT: check.log (all output), bench.jsonl
# (gpu_bench), replay.jsonl (one line per `tsubame replay` run), and
# summary.txt. A step that fails is logged and the next one still runs.
set -u
root=$PWD
[ -n "${OUT:-}" ] || { echo "gpu_check: OUT is not set (it runs on the device machine)" >&2; exit 1; }
[ -x .gpu/bin/tsubame ] || { echo "gpu_check: .gpu/bin/tsubame missing: run bench/device/gpu_prepare.sh and carry .gpu" >&2; exit 1; }
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
exec > >(tee -a "$OUT/check.log") 2>&1
summary=$OUT/summary.txt
deadline=$((SECONDS + ${BUDGET:-480}))
# A step's time limit: its own, or what is left of the budget (5 s at least).
limit() {
    local left=$((deadline - SECONDS))
    ((left < 5)) && left=5
    echo $(($1 < left ? $1 : left))
}
step() { echo "== $(date +%T) $*"; }
result() { echo "$*" | tee -a "$summary"; }

step "host: $(nproc) CPUs, $(uname -r)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$summary"

# NVRTC: this machine's own (its CUDA 13); the wheel's is too large to carry.
if [ -z "${TSUBAME_NVRTC:-}" ]; then
    for f in /usr/local/cuda/lib64/libnvrtc.so.13 /usr/local/cuda/lib64/libnvrtc.so.12 /usr/local/cuda/lib64/libnvrtc.so \
        /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 \
        /opt/torch/.venv/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.1[23]; do
        [ -e "$f" ] && { TSUBAME_NVRTC=$f; break; }
    done
fi
if [ -z "${TSUBAME_NVRTC:-}" ]; then
    TSUBAME_NVRTC=$(timeout 60 find / -xdev \( -name 'libnvrtc.so.13' -o -name 'libnvrtc.so.12' \) -print -quit 2>/dev/null)
fi
[ -n "${TSUBAME_NVRTC:-}" ] && export TSUBAME_NVRTC
export TSUBAME_NVCOMP=$root/.gpu/lib/libnvcomp.so.6
result "NVRTC: ${TSUBAME_NVRTC:-none found}; nvCOMP: $TSUBAME_NVCOMP"

# The workloads' pages, unpacked.
export TSUBAME_GPU_PAGES=/tmp/gpu-pages
mkdir -p $TSUBAME_GPU_PAGES
python3 - <<'PY'
import glob, lzma, os
for f in sorted(glob.glob(".gpu/pages/*.pages.xz")):
    with lzma.open(f) as src, open("/tmp/gpu-pages/" + os.path.basename(f)[:-3], "wb") as dst:
        dst.write(src.read())
print("pages:", " ".join(sorted(os.listdir("/tmp/gpu-pages"))))
PY

# 1. The GPU tests (tests/gpu.rs, tests/gpu_workloads.rs with the race
# check, tests/no_gpu.rs's NVRTC and nvCOMP checks); none may skip.
# nvCOMP's test runs in a process of its own: a fault in one of our
# kernels would poison the CUDA context it shares.
export TSUBAME_REQUIRE_GPU=1
gpu_test() {
    local name=$1
    shift
    step "test $name"
    timeout "$(limit 150)" "$@" --nocapture --test-threads=4
    local rc=$?
    result "test $name: $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)")"
}
gpu_test no_gpu .gpu/bin/test-no_gpu
gpu_test gpu:nvcomp .gpu/bin/test-gpu nvcomp
gpu_test gpu .gpu/bin/test-gpu --skip nvcomp
gpu_test gpu_workloads .gpu/bin/test-gpu_workloads

# 2. Throughput per codec against one CPU core, the wait policies, nvCOMP.
step "gpu_bench"
timeout "$(limit 150)" .gpu/bin/gpu_bench 65536 | tee "$OUT/bench.jsonl"
result "gpu_bench: exit ${PIPESTATUS[0]}, $(wc -l <"$OUT/bench.jsonl") lines"

# 3. Migrations with --gpu (the real engine replaying a kv trace into a
# memory-only destination; the digest is verified at the end), each wait
# policy, and the CPU codecs for comparison; then zstd over the frames,
# on the CPU and with --gpu (nvCOMP where the first frames measured it
# faster).
replay() {
    local mode=$1
    shift
    step "replay $mode"
    local json=/tmp/replay-$mode.json
    rm -f "$json"
    timeout "$(limit 60)" .gpu/bin/tsubame replay --trace .gpu/kv.trace --postcopy off --encode-threads 2 "$@" --json "$json"
    python3 - "$mode" "$json" "$OUT/replay.jsonl" <<'PY' | tee -a "$summary"
import json, sys
mode, path, out = sys.argv[1:]
try:
    s = json.load(open(path))
except Exception as e:
    print(f"replay {mode}: no statistics ({e})")
    sys.exit()
if s.get("status") != "completed" or "pipeline" not in s:
    print(f"replay {mode}: {s.get('status')}: {s.get('error', '?')}")
    sys.exit()
encode = next(st for st in s["pipeline"]["stages"] if st["name"] == "encode")
gb = s["pages_sent"] * 4096 / 1e9
frames = next((f"{c['chose']} ({c['why']})" for c in s["choices"] if c["what"] == "frame compression"), "-")
row = {"mode": mode, "status": s["status"], "digest_verified": s["digest_verified"],
       "total_time_ms": s["total_time_ms"], "downtime_ms": s["downtime_ms"], "gb_encoded": gb,
       "bytes_on_wire": s["bytes_on_wire"], "encode_cpu_s": encode["cpu_seconds"],
       "encode_cpu_s_per_gb": encode["cpu_seconds"] / gb, "source_cpu_s": s["cpu_seconds"]["source"],
       "iterations": s["iterations"], "frame_compression": frames}
open(out, "a").write(json.dumps(row) + "\n")
print(f"replay {mode}: {row['status']}, digest verified {row['digest_verified']}, {row['total_time_ms']:.0f} ms, "
      f"{row['bytes_on_wire'] / 2**20:.0f} MiB sent, encode {row['encode_cpu_s']:.2f} CPU-s for {gb:.2f} GB "
      f"({row['encode_cpu_s_per_gb']:.2f} CPU-s/GB); frames: {frames}")
PY
}
codecs=zero,xbzrle,dedup,rle
replay cpu --codec $codecs
for wait in spin sleep-min blocking; do
    replay "$wait" --codec $codecs --gpu --gpu-wait "$wait"
done
replay cpu-zstd --codec zero,xbzrle,rle,zstd
replay gpu-zstd --codec zero,xbzrle,rle,zstd --gpu --gpu-wait blocking
step "done"
cat "$summary"
