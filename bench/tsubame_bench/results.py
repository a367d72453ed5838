"""One run's figures, as runs.jsonl stores them."""
from dataclasses import dataclass, field


@dataclass
class RunResult:
    """One migration of one case under one configuration (one line of runs.jsonl)."""

    case: str
    config: str
    vmm: str
    repetition: int
    started_at: str
    memory: str
    workload: str
    link: str
    max_bandwidth_bits: int | None
    cmdline: str
    status: str  # completed | failed | timeout
    error: str | None = None
    total_time_s: float | None = None  # the VMM's own figure
    wall_time_s: float | None = None  # harness: migrate command -> seen completed
    time_to_destination_s: float | None = None  # harness: migrate command -> first destination progress line
    vmm_downtime_ms: float | None = None
    # downtime measured the same way for both VMMs (bench/README.md): the guest's own largest stall
    # (its `gap_us`), from migration start to the end of the watch; which side's line reported it and
    # when (s from migration start); and source vCPU stop -> destination vCPU resume from the VMMs'
    # own events (QMP STOP/RESUME; tsubame's paused_at/resumed_at_unix_us), Unix seconds of one clock
    guest_stall_ms: float | None = None
    guest_stall_side: str | None = None
    guest_stall_at_s: float | None = None
    vmm_stop_resume_ms: float | None = None
    vmm_stopped_at_unix_s: float | None = None
    vmm_resumed_at_unix_s: float | None = None
    guest_downtime_ms: float | None = None  # largest gap between progress lines around the switch-over
    switchover_gap_ms: float | None = None  # last source progress line -> first destination line
    max_source_gap_ms: float | None = None  # largest gap between source lines during the migration
    setup_time_ms: float | None = None
    bytes_on_wire: int | None = None  # source-side tx_bytes delta
    vmm_bytes: int | None = None  # the VMM's own figure
    cpu_source_s: float | None = None  # utime+stime of the source process, migration start -> end
    cpu_destination_s: float | None = None
    cpu_source_vcpu_s: float | None = None  # of that, the vCPU threads (the guest's own work)
    cpu_destination_vcpu_s: float | None = None
    iterations: int | None = None
    converged: bool | None = None
    ops_per_sec_before: float | None = None
    ops_per_sec_during: float | None = None
    ops_per_sec_after: float | None = None
    ops_continuous: bool | None = None
    destination_progress_lines: int = 0
    guest_banner_source: str | None = None
    # post-copy: when the phase began and how long it lasted (from migration start), the guest's ops/s
    # at the destination meanwhile, and fault figures (tsubame: service latency; QEMU (7.2 and 10) exposes
    # only the vCPUs' total blocked time, postcopy-blocktime)
    postcopy_start_s: float | None = None
    postcopy_duration_s: float | None = None
    ops_per_sec_postcopy: float | None = None
    fault_latency_p50_us: float | None = None
    fault_latency_p99_us: float | None = None
    postcopy_blocktime_ms: float | None = None
    timeline: dict = field(default_factory=dict)  # {"source": [[t, ops]], "destination": [...]}, t from migration start
    migration_end_s: float | None = None  # from migration start, for the plots
    vmm_stats: dict = field(default_factory=dict)  # the VMM's raw final statistics
