#!/bin/bash
# Fills .gpu/ (ignored by git, carried to a lent GPU machine) with what
# bench/device/gpu_check.sh needs there, which has no network and no
# /dev/kvm: stripped release binaries (tsubame, the tsubame-gpu test
# binaries, gpu_bench), nvCOMP's library from the PyPI wheel for the
# machine's CUDA 13 driver, pages of every guest workload (saved from
# running VMs: needs /dev/kvm here) and a kv trace for `tsubame replay
# --gpu`. CI runs it (it builds and packs; it runs nothing on a GPU).
# Usage: bench/device/gpu_prepare.sh   then, on the device tool:
#   run(command='bash bench/device/gpu_check.sh', carry=['.gpu'], timeout_s=540)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
say() { echo "gpu_prepare: $*"; }
fail() { echo "gpu_prepare: $*" >&2; exit 1; }
[ -c /dev/kvm ] || fail "no /dev/kvm: the workloads' pages and the trace come from running VMs"
NVCOMP_WHEEL=nvidia-libnvcomp-cu13==6.0.0.12

cargo build --release -p tsubame
cargo build --release -p tsubame-gpu --example gpu_bench
# The test binaries' paths, from cargo's own report.
tests=$(cargo test --release -p tsubame-gpu --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
[ -n "$tests" ] || fail "cargo test --no-run built no test binary of tsubame-gpu"

exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib .gpu/pages
strip -o .gpu/bin/tsubame target/release/tsubame
strip -o .gpu/bin/gpu_bench target/release/examples/gpu_bench
while read -r name path; do
    case "$name" in gpu | gpu_workloads | no_gpu) strip -o ".gpu/bin/test-$name" "$path" ;; esac
done <<<"$tests"
for name in gpu gpu_workloads no_gpu; do
    [ -x ".gpu/bin/test-$name" ] || fail "the $name test binary was not built"
done

# nvCOMP: from the wheel scripts/setup.sh installed (optional there), else
# downloaded once into target/.
installed=$(python3 -c 'import glob, nvidia.libnvcomp as m
print(next(iter(glob.glob(m.__path__[0] + "/lib64/libnvcomp.so.6")), ""))' 2>/dev/null || true)
if [ -n "$installed" ] && python3 -c "import importlib.metadata as m, sys
sys.exit(m.version('nvidia-libnvcomp-cu13') != '${NVCOMP_WHEEL#*==}')" 2>/dev/null; then
    cp "$installed" .gpu/lib/libnvcomp.so.6
else
    wheels=target/gpu-wheels
    if ! ls "$wheels"/nvidia_libnvcomp_cu13-*.whl >/dev/null 2>&1; then
        mkdir -p "$wheels"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 -d "$wheels" "$NVCOMP_WHEEL" ||
            fail "pip could not download $NVCOMP_WHEEL (nvCOMP's library for the GPU machine)"
    fi
    python3 - "$wheels" <<'PY'
import glob, sys, zipfile
wheel = sorted(glob.glob(sys.argv[1] + "/nvidia_libnvcomp_cu13-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/libnvcomp.so.6"))
    with z.open(name) as src, open(".gpu/lib/libnvcomp.so.6", "wb") as dst:
        dst.write(src.read())
PY
fi

# Pages of every workload, and a 3-s trace of a 512-MiB kv guest.
python3 bench/device/sample_pages.py target/release/tsubame .gpu/pages
tmp=$(mktemp -d)
trap 'kill $vm 2>/dev/null || true; rm -rf "$tmp"' EXIT
target/release/tsubame run --quiet --memory 512M --workload kv --control "$tmp/vm.sock" >/dev/null 2>&1 &
vm=$!
for _ in $(seq 100); do [ -S "$tmp/vm.sock" ] && break; sleep 0.1; done
[ -S "$tmp/vm.sock" ] || fail "the kv VM for the trace did not start"
sleep 1
target/release/tsubame trace --control "$tmp/vm.sock" --out .gpu/kv.trace --seconds 3 --baseline 1s
kill $vm 2>/dev/null || true

size=$(du -sb .gpu | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | python3 -c 'import os,sys
print(sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if os.path.isfile(p)))')
say ".gpu holds $((size >> 20)) MiB ($(ls .gpu/bin | tr '\n' ' ')); with the work tree $(((size + tree) >> 20)) MiB of the 64 MiB a device call carries"
((size + tree < 60 << 20)) || fail "too large to carry"
