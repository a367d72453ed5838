"""Running `tsubame demo --json` (the one-command migration) and reading
its statistics."""
import json
import os
import subprocess

from . import HarnessError


def run_demo(binary, args, json_path, check=True):
    """Runs `BINARY demo ARGS --json JSON_PATH`; returns (statistics dict, CompletedProcess).

    With check, a run that wrote no statistics, or whose migration did not
    complete with its memory digest verified, raises HarnessError naming why."""
    proc = subprocess.run([binary, "demo"] + list(args) + ["--json", json_path], capture_output=True, text=True)
    if not os.path.exists(json_path):
        if check:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            raise HarnessError(f"no statistics from {binary} demo {' '.join(args)}: {tail[0]}")
        return None, proc
    with open(json_path) as f:
        stats = json.load(f)
    if check and (stats.get("status") != "completed" or not stats.get("digest_verified")):
        raise HarnessError(f"{binary} demo {' '.join(args)}: migration did not complete and verify: {stats.get('error')}")
    return stats, proc


def migration_cpu(stats):
    """CPU-seconds the source spent migrating (its migration and stage threads, not the guest's
    vCPU) and the destination's, from a statistics dict."""
    cpu = stats.get("cpu_seconds", {})
    stages = sum(s.get("cpu_seconds", 0) for s in (stats.get("pipeline") or {}).get("stages", []))
    return cpu.get("source_migration_thread", 0) + stages, cpu.get("destination", 0)


def tsubame_figures(stats):
    """The figures of `tsubame migrate --json` statistics."""
    return {
        "status": stats.get("status"),
        "error": stats.get("error"),
        "total_time_s": stats["total_time_ms"] / 1e3 if "total_time_ms" in stats else None,
        "vmm_downtime_ms": stats.get("downtime_ms"),
        "setup_time_ms": stats.get("setup_time_ms"),
        "iterations": stats.get("iterations"),
        "vmm_bytes": stats.get("bytes_on_wire"),
        "converged": stats.get("converged"),
    }
