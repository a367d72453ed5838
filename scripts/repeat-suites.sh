#!/usr/bin/env bash
# Runs the timing-sensitive suites (far memory, post-copy, faults) N times
# in a row, optionally beside a CPU hog (one busy loop per CPU at normal
# priority), and prints one line per run and a closing count: the check
# that none of them is flaky.
#
#   scripts/repeat-suites.sh [--hog] [N]      N defaults to 5
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
hog=false
runs=5
for arg in "$@"; do
    case "$arg" in
        --hog) hog=true ;;
        -h|--help) sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *[!0-9]*) echo "repeat-suites.sh: unknown argument '$arg'" >&2; exit 2 ;;
        *) runs="$arg" ;;
    esac
done
suites=(
    "-p tsubame --test far_memory"
    "-p tsubame-migrate --test postcopy"
    "-p tsubame --test postcopy"
    "-p tsubame --test faults"
)
export TSUBAME_REQUIRE_KVM=1 TSUBAME_REQUIRE_TOOLS=1
cargo build --release --workspace --tests -q
hogs=()
stop_hogs() { ((${#hogs[@]})) && kill "${hogs[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop_hogs EXIT
if $hog; then
    for _ in $(seq "$(nproc)"); do
        sh -c 'while :; do :; done' &
        hogs+=($!)
    done
    echo "beside $(nproc) busy loops"
fi
passed=0
failed=0
log="target/repeat-suites.log"
: >"$log"
for run in $(seq "$runs"); do
    for suite in "${suites[@]}"; do
        start=$(date +%s)
        # shellcheck disable=SC2086
        if cargo test --release -q $suite >>"$log" 2>&1; then
            result=passed
            passed=$((passed + 1))
        else
            result=FAILED
            failed=$((failed + 1))
        fi
        echo "run $run: $suite: $result in $(($(date +%s) - start)) s"
    done
done
echo "suites: $passed passed, $failed failed, 0 skipped (log: $log)"
((failed == 0))
