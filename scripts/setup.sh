#!/usr/bin/env bash
# What tsubame needs beyond Rust and a C compiler, in one list, installed
# when missing. README's commands run it (`cargo xtask test` always;
# `tsubame ... --far-memory auto` when nbdkit is missing), and so does
# .ci/run: there is no other package list.
#
#   scripts/setup.sh           install what is missing (as root), or print
#                              the one sudo command that would
#   scripts/setup.sh --check   list what is missing, install nothing
#                              (exit 1 when something is)
#   scripts/setup.sh nbdkit    only what the named programs need
#
# QEMU 10 comes from Debian's bookworm-backports (bookworm's own QEMU is
# 7.2): on bookworm the script writes that apt source, once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Each need: a name, how to tell it is there, the Debian package(s).
# (c++: the GPU kernel emulator, which the tests use; the build does
# without it.)
# "backports:" marks packages taken from bookworm-backports on bookworm.
needs=(
    "gcc|command -v gcc|gcc"
    "ld|command -v ld && command -v objcopy|binutils"
    "c++|command -v c++|g++"
    "nbdkit|command -v nbdkit|nbdkit"
    "qemu-system-x86_64|qemu_is_10|backports:qemu-system-x86"
    "qemu-nbd|command -v qemu-nbd && command -v qemu-img|backports:qemu-utils"
    "ip|command -v ip && command -v tc|iproute2"
    "socat|command -v socat|socat"
    "python3|command -v python3|python3"
    "python-modules|python3 -c 'import matplotlib, pytest' 2>/dev/null|python:python3-matplotlib python3-pytest"
    "qemu.qmp|python3 -c 'import qemu.qmp' 2>/dev/null|pip:qemu.qmp==0.0.6"
    "fonts|test -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf|fonts-dejavu-core"
    "nvrtc|python3 -c 'import nvidia.cuda_nvrtc' 2>/dev/null|optional-pip:nvidia-cuda-nvrtc-cu12"
    "nvcomp|python3 -c 'import nvidia.libnvcomp' 2>/dev/null|optional-pip:nvidia-libnvcomp-cu13==6.0.0.12"
)
# optional-pip: NVRTC alone (no GPU, no driver) compiles every CUDA kernel
# to PTX, so the GPU crate's compile test runs instead of skipping; nvCOMP's
# library answers its host-only calls (sizes, alignments) without one. Only
# where pip may install (not Debian's own python3); a failure is a note.
# pip: QEMU's QMP client library (bench/test_qmp.py drives the control
# socket with it) has no Debian package: pip installs it, into Debian's
# own python3 too (with python3-pip, --break-system-packages: it is pure
# Python without dependencies).

qemu_is_10() {
    local v
    v="$(qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p')"
    [ -n "$v" ] && [ "$v" -ge 10 ]
}

check_only=false
wanted=()
for arg in "$@"; do
    case "$arg" in
        --check) check_only=true ;;
        -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "setup.sh: unknown option '$arg' (--check, --help)" >&2; exit 2 ;;
        *) wanted+=("$arg") ;;
    esac
done

missing_names=()
apt_main=()
apt_backports=()
python_modules=false
optional_pip=()
pip_only=()
debian_python=false
if [ "$(command -v python3 || echo /usr/bin/python3)" = /usr/bin/python3 ]; then
    debian_python=true
fi
for need in "${needs[@]}"; do
    IFS='|' read -r name test packages <<<"$need"
    if ((${#wanted[@]})) && [[ ! " ${wanted[*]} " == *" $name "* ]]; then
        continue
    fi
    if bash -c "$(declare -f qemu_is_10); $test" >/dev/null 2>&1; then
        continue
    fi
    if [[ "$packages" == optional-pip:* ]]; then
        $debian_python || optional_pip+=(${packages#optional-pip:})
        continue
    fi
    missing_names+=("$name")
    case "$packages" in
        backports:*) apt_backports+=(${packages#backports:}) ;;
        python:*) python_modules=true ;;
        pip:*) pip_only+=(${packages#pip:}) ;;
        *) apt_main+=($packages) ;;
    esac
done

if ((${#missing_names[@]} == 0 && ${#optional_pip[@]} == 0)); then
    exit 0
fi
if ((${#missing_names[@]})); then
    echo "setup: missing: ${missing_names[*]}"
fi
if $check_only; then
    ((${#optional_pip[@]})) && echo "setup: optional, not installed: ${optional_pip[*]}"
    ((${#missing_names[@]} == 0))
    exit
fi

# Python modules: Debian's python3 takes Debian's packages (pip is
# refused there, PEP 668); any other python3 (pyenv, a venv) takes pip's.
python_pip=false
if $python_modules; then
    if $debian_python; then
        apt_main+=(python3-matplotlib python3-pytest)
    else
        python_pip=true
    fi
fi
pip_flags=()
if ((${#pip_only[@]})) && $debian_python; then
    python3 -m pip --version >/dev/null 2>&1 || apt_main+=(python3-pip)
    pip_flags=(--break-system-packages)
fi

if ((${#apt_main[@]} + ${#apt_backports[@]})); then
    if [ "$(id -u)" != 0 ]; then
        echo "setup: installing needs root; run:  sudo $root/scripts/setup.sh $*" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null; then
        echo "setup: no apt-get here: install ${apt_main[*]} ${apt_backports[*]} (QEMU 10 or newer) by hand" >&2
        exit 1
    fi
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    backports=()
    if ((${#apt_backports[@]})) && [ "$codename" = bookworm ]; then
        if ! grep -rqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
            echo "setup: adding Debian's bookworm-backports (QEMU 10) to /etc/apt/sources.list.d/tsubame-backports.list"
            echo "deb http://deb.debian.org/debian bookworm-backports main" >/etc/apt/sources.list.d/tsubame-backports.list
        fi
        backports=(-t bookworm-backports)
    fi
    export DEBIAN_FRONTEND=noninteractive
    echo "setup: apt-get install ${apt_main[*]} ${apt_backports[*]}"
    apt-get update -qq
    if ((${#apt_main[@]})); then
        apt-get install -y -qq --no-install-recommends "${apt_main[@]}" >/dev/null
    fi
    if ((${#apt_backports[@]})); then
        apt-get install -y -qq --no-install-recommends "${backports[@]}" "${apt_backports[@]}" >/dev/null
    fi
fi

if $python_pip; then
    echo "setup: python3 -m pip install -r bench/requirements.txt"
    python3 -m pip install -q -r "$root/bench/requirements.txt"
fi

if ((${#pip_only[@]})); then
    if $debian_python && [ "$(id -u)" != 0 ]; then
        echo "setup: installing ${pip_only[*]} into Debian's python3 needs root; run:  sudo $root/scripts/setup.sh $*" >&2
        exit 1
    fi
    echo "setup: python3 -m pip install ${pip_flags[*]} ${pip_only[*]}"
    python3 -m pip install -q "${pip_flags[@]}" "${pip_only[@]}"
fi

if ((${#optional_pip[@]})); then
    echo "setup: python3 -m pip install ${optional_pip[*]} (optional)"
    python3 -m pip install -q "${optional_pip[@]}" || echo "setup: ${optional_pip[*]} not installed: the tests that need it will say skipped"
fi

# What is still missing after installing is a failure, said once.
still=()
for need in "${needs[@]}"; do
    IFS='|' read -r name test _ <<<"$need"
    if [[ " ${missing_names[*]} " == *" $name "* ]] && ! bash -c "$(declare -f qemu_is_10); $test" >/dev/null 2>&1; then
        still+=("$name")
    fi
done
if ((${#still[@]})); then
    echo "setup: still missing after installing: ${still[*]}" >&2
    exit 1
fi
echo "setup: done"
