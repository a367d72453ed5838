#!/usr/bin/env bash
# Proves README's two commands need nothing installed by hand: builds a
# clean Debian 12 (bookworm) root with debootstrap, puts into it only
# what README's "Needs" line asks for (Rust, gcc; ca-certificates so cargo
# can reach crates.io), clones this repository's HEAD there and runs, as a
# newcomer would:
#
#   cargo run --release -- demo --memory 1G --workload kv
#   cargo xtask test
#
# Both must succeed; the second installs the rest itself (scripts/setup.sh:
# QEMU 10 from bookworm-backports, nbdkit, python3, ...) inside that root.
#
# Why a debootstrap chroot: it is a whole Debian with its own dpkg and apt
# state, so nothing this host has installed is visible in it, while
# /dev/kvm (bind-mounted) and the host's kernel are the same. The Rust
# toolchain is the host's, mounted read-only (rustup cannot be fetched
# here); cargo's registry inside the root starts empty.
#
#   scripts/fresh-machine.sh [--keep] [DIR]   DIR defaults to /var/tmp/tsubame-fresh
#
# Needs root. Takes ~20 minutes on 2 cores (most of it the two builds).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
keep=false
dir=/var/tmp/tsubame-fresh
for arg in "$@"; do
    case "$arg" in
        --keep) keep=true ;;
        -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "fresh-machine.sh: unknown option '$arg'" >&2; exit 2 ;;
        *) dir="$arg" ;;
    esac
done
if [ "$(id -u)" != 0 ]; then
    echo "fresh-machine.sh: needs root (debootstrap, chroot, mounts)" >&2
    exit 1
fi
toolchain="$(dirname "$(dirname "$(rustup which cargo 2>/dev/null || command -v cargo)")")"
if [ ! -x "$toolchain/bin/cargo" ] || [ ! -x "$toolchain/bin/rustc" ]; then
    echo "fresh-machine.sh: no Rust toolchain found (rustup which cargo)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || {
    echo "fresh-machine.sh: installing debootstrap (the check's own tool)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}

mounts=()
# Every mount under the root, deepest first: ours, and those the tests make
# inside it (`ip netns` mounts /run/netns there).
unmount_all() {
    local m
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        umount -l "${mounts[i]}" 2>/dev/null || true
    done
    mounts=()
    awk -v root="$dir/" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done
}
cleanup() {
    unmount_all
    if ! $keep; then
        rm -rf --one-file-system "$dir"
    fi
}
trap cleanup EXIT
mount_into() { # mount_into SOURCE TARGET [OPTIONS...]
    local src="$1" target="$dir$2"
    shift 2
    mkdir -p "$target"
    mount "$@" "$src" "$target"
    mounts+=("$target")
}

unmount_all
rm -rf --one-file-system "$dir"
mkdir -p "$dir"
echo "fresh: debootstrap bookworm (minbase) into $dir"
start=$(date +%s)
debootstrap --variant=minbase bookworm "$dir" http://deb.debian.org/debian >"$dir.debootstrap.log" 2>&1 || {
    tail -20 "$dir.debootstrap.log" >&2
    exit 1
}
cat >"$dir/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
cp /etc/resolv.conf "$dir/etc/resolv.conf"
# The root a mount point of its own, as on a machine: `ip netns exec` (the
# harness's links) remounts / as a slave, which a plain directory refuses.
mount_into "$dir" "" --bind
mount_into proc /proc -t proc
mount_into sysfs /sys -t sysfs
mount_into /dev /dev --rbind
mount_into tmpfs /tmp -t tmpfs
mount_into "$toolchain" /opt/rust --bind -o ro
mount -o remount,bind,ro "$dir/opt/rust"

in_root() {
    chroot "$dir" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        CARGO_TERM_PROGRESS_WHEN=never "$@"
}
# This workplace reaches package registries through a TLS proxy with its
# own CA, which every machine here has in its base system: the clean root
# gets the same local CAs (ca-certificates adds them to the bundle).
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    mkdir -p "$dir/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/"
fi
echo "fresh: apt-get install gcc ca-certificates (README's \"Needs\": Rust and gcc)"
in_root sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc ca-certificates >/dev/null'
git clone -q --no-local "$repo" "$dir/root/tsubame"
git -C "$dir/root/tsubame" log --oneline -1

status=0
echo "fresh: README's first command: cargo run --release -- demo --memory 1G --workload kv"
if in_root sh -c 'cd /root/tsubame && cargo run --release -- demo --memory 1G --workload kv' >"$dir.demo.log" 2>&1; then
    grep -E "^(migrated|total|downtime|memory)" "$dir.demo.log" | head -5 || true
    tail -3 "$dir.demo.log"
else
    echo "fresh: the demo FAILED:" >&2
    tail -30 "$dir.demo.log" >&2
    status=1
fi
echo "fresh: README's second command: cargo xtask test"
if in_root sh -c 'cd /root/tsubame && cargo xtask test' >"$dir.test.log" 2>&1; then
    grep -E "^(setup:|skipped:)" "$dir.test.log" || true
    tail -1 "$dir.test.log"
else
    echo "fresh: the tests FAILED:" >&2
    grep -E "^(setup:|test .* FAILED|failures:|---- )" "$dir.test.log" >&2 || true
    tail -30 "$dir.test.log" >&2
    status=1
fi
echo "fresh: $((($(date +%s) - start) / 60)) min; logs: $dir.demo.log $dir.test.log"
if ((status == 0)); then
    echo "fresh: both of README's commands succeeded on a clean bookworm with only Rust and gcc"
fi
exit $status
