//! Migration statistics, serialized as the JSON of DESIGN.md.

use std::collections::BTreeMap;

use serde::Serialize;

/// One pre-copy iteration (the last one is stop-and-copy).
#[derive(Debug, Clone, Default, Serialize)]
pub struct IterationStats {
    /// 0-based; iteration 0 sends all memory.
    pub index: u32,
    /// Pages dirty when the iteration started.
    pub dirty_pages: u64,
    /// Page records sent.
    pub pages_sent: u64,
    /// Bytes written to the connection.
    pub bytes_on_wire: u64,
    /// Wall time of the iteration.
    pub duration_ms: f64,
    /// Share of the time the guest was made to sleep (auto-converge).
    pub throttle: f64,
}

/// CPU-seconds (user + system) of each side's process during migration.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuSeconds {
    /// The source process (vCPU thread included).
    pub source: f64,
    /// The destination process, from connection to resume.
    pub destination: f64,
    /// The source's migration thread alone.
    pub source_migration_thread: f64,
}

/// Where the downtime went, in milliseconds, in order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DowntimeBreakdown {
    /// Stopping the vCPU.
    pub pause_ms: f64,
    /// Sending the last dirty pages.
    pub final_pages_ms: f64,
    /// Saving and sending vCPU state.
    pub state_ms: f64,
    /// Hashing memory on the source.
    pub source_digest_ms: f64,
    /// Waiting for the destination to verify its memory and say READY.
    pub destination_verify_ms: f64,
    /// COMMIT until the destination confirmed it runs the VM.
    pub commit_ms: f64,
}

/// Per-codec counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CodecStats {
    /// Pages this codec encoded.
    pub pages: u64,
    /// Bytes in.
    pub bytes_in: u64,
    /// Bytes out.
    pub bytes_out: u64,
}

/// Everything `--json` writes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MigrationStats {
    /// "completed" or "failed".
    pub status: String,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Where the VM went.
    pub destination: String,
    /// Start to destination running (or to failure).
    pub total_time_ms: f64,
    /// Source pause to destination running.
    pub downtime_ms: f64,
    /// Connection and handshake.
    pub setup_time_ms: f64,
    /// Iterations, stop-and-copy included.
    pub iterations: u32,
    /// True when iteration stopped because the rest fit the downtime limit.
    pub converged: bool,
    /// Why iterating stopped: converged, max-iterations, sent-3x-memory, no-dirty-pages.
    pub stop_reason: String,
    /// Bytes written to the connection.
    pub bytes_on_wire: u64,
    /// Pages of guest memory.
    pub pages_total: u64,
    /// Page records sent (all iterations).
    pub pages_sent: u64,
    /// Of those, zero-page records.
    pub pages_zero: u64,
    /// Guest memory size.
    pub memory_bytes: u64,
    /// CPU cost.
    pub cpu_seconds: CpuSeconds,
    /// The destination's memory matched the source's digest.
    pub digest_verified: bool,
    /// Downtime the source expected when it stopped iterating.
    pub expected_downtime_ms: f64,
    /// Where the downtime went.
    pub downtime_breakdown: DowntimeBreakdown,
    /// Per iteration.
    pub per_iteration: Vec<IterationStats>,
    /// Per codec.
    pub codec: BTreeMap<String, CodecStats>,
    /// Sub-page tracking, when `--granularity` is below 4096.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subpage: Option<crate::subpage::SubpageStats>,
    /// Digest regions the verification pass found different and re-sent.
    pub regions_repaired: u64,
    /// The source's stages: busy and waiting time, queues, CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::pipeline::PipelineStats>,
}

pub use tsubame_vmm::host::{process_cpu_seconds, thread_cpu_seconds};
