#!/bin/bash
# Fills .dev/ (ignored by git, carried to a lent device machine) with what
# bench/device/stop_check.sh needs there and that machine may lack: a stripped
# release tsubame, and ip and tc with their libraries (the harness's links
# are veth pairs in network namespaces with a tbf qdisc).
# Usage: bench/device/prepare.sh   (after `cargo build --release`)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -x target/release/tsubame ] || { echo "prepare: target/release/tsubame missing: run cargo build --release" >&2; exit 1; }
exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.dev/' "$exclude" 2>/dev/null || echo '/.dev/' >>"$exclude"
rm -rf .dev && mkdir -p .dev/bin .dev/lib
strip -o .dev/bin/tsubame target/release/tsubame
for tool in ip tc; do
    path=$(command -v "$tool") || { echo "prepare: $tool missing: apt-get install iproute2" >&2; exit 1; }
    cp "$path" .dev/bin/
    # Every library but the C library and the loader, which the machine has.
    ldd "$path" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|ld-linux[^/]*)\.so' |
        xargs -r -I{} cp -L {} .dev/lib/
done
echo "prepare: .dev holds $(du -sh .dev | cut -f1); carry it: run(command='bash bench/device/stop_check.sh', carry=['.dev'])"
