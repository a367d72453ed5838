//! Migration statistics: the JSON that `--json` writes and `query-migrate`
//! returns (its fields are a contract: docs/architecture.md). Typed on
//! both sides: the engine fills them, the CLI reads them back.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How a migration ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The destination runs the VM.
    Completed,
    /// It did not (before COMMIT: the VM runs at the source).
    #[default]
    Failed,
}

/// Why iterating stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// It never stopped (the migration failed before).
    #[default]
    #[serde(rename = "")]
    NotStopped,
    /// The rest fit the downtime limit.
    #[serde(rename = "converged")]
    Converged,
    /// Nothing was dirty.
    #[serde(rename = "no-dirty-pages")]
    NoDirtyPages,
    /// The iteration limit.
    #[serde(rename = "max-iterations")]
    MaxIterations,
    /// Three times memory went out (Xen's limit).
    #[serde(rename = "sent-3x-memory")]
    Sent3xMemory,
    /// Pre-copy handed over to post-copy.
    #[serde(rename = "postcopy")]
    Postcopy,
}

impl StopReason {
    /// True when the rest fit the downtime limit.
    pub fn converged(self) -> bool {
        matches!(self, StopReason::Converged | StopReason::NoDirtyPages)
    }

    /// The name in the statistics.
    pub fn name(self) -> &'static str {
        match self {
            StopReason::NotStopped => "",
            StopReason::Converged => "converged",
            StopReason::NoDirtyPages => "no-dirty-pages",
            StopReason::MaxIterations => "max-iterations",
            StopReason::Sent3xMemory => "sent-3x-memory",
            StopReason::Postcopy => "postcopy",
        }
    }
}

/// One pre-copy iteration (the last one is stop-and-copy).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
    /// Busy time of its page stages, the fetch's and one encoder thread's
    /// added up: what its length follows where the link does not bound it.
    /// Added, not the busier of the two: on a host whose cores the guest
    /// or the destination's decoders share they run in turn more than
    /// side by side (a kv guest's stop took 1.7 µs a page, its fetch 0.8
    /// and its encoder 0.65). The fetch's clearing of dirty bits and
    /// reading of the page map are left out: the stop does neither.
    #[serde(default)]
    pub work_ms: f64,
    /// The same work as CPU time of the threads that did it, what the
    /// stop's estimate goes by: without their waits for a CPU, which on a
    /// host whose cores the guest shares vary from one half hour to the
    /// next (a kv guest's whole pages: 3.4 µs a page of wall time, 1.1 of
    /// CPU time).
    #[serde(default)]
    pub work_cpu_ms: f64,
    /// Busy time of its senders, per sender: writing and waiting for the
    /// link (or `--max-bandwidth`) to take the bytes. What the link's
    /// capacity is measured by: an iteration bound by its page work
    /// leaves the senders waiting for pages, not busy.
    #[serde(default)]
    pub send_ms: f64,
    /// Share of the time the guest was made to sleep (auto-converge).
    pub throttle: f64,
}

/// CPU-seconds (user + system) of each side's process during migration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CpuSeconds {
    /// The source process (vCPU thread included).
    pub source: f64,
    /// The destination process, from connection to resume.
    pub destination: f64,
    /// The source's migration thread alone.
    pub source_migration_thread: f64,
}

/// Where the downtime went, in milliseconds, in order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DowntimeBreakdown {
    /// Stopping the vCPU.
    pub pause_ms: f64,
    /// Sending the last dirty pages (post-copy: reading the dirty log for
    /// the pages that went stale last).
    pub final_pages_ms: f64,
    /// Saving and sending vCPU state.
    pub state_ms: f64,
    /// Hashing memory on the source.
    pub source_digest_ms: f64,
    /// Waiting for the destination to verify its memory and say READY.
    pub destination_verify_ms: f64,
    /// COMMIT until the destination confirmed it runs the VM (post-copy:
    /// from the state's sending until then).
    pub commit_ms: f64,
}

/// The post-copy phase, when the migration switched to it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PostcopyStats {
    /// When the source paused its VM for the switch, from the start.
    pub started_at_ms: f64,
    /// The switch to the destination holding every page.
    pub duration_ms: f64,
    /// Pages the destination lacked at the switch.
    pub pages_missing: u64,
    /// Pages the destination asked for (its guest faulted on them).
    pub pages_requested: u64,
    /// Pages sent because they were asked for (first, on their own
    /// connection).
    pub pages_sent_on_request: u64,
    /// Of those, pages the push had sent already: sent again while the
    /// push compresses well, as one queues behind many of its pages.
    pub pages_sent_again: u64,
    /// Pages pushed in the background.
    pub pages_pushed: u64,
    /// Of the pushed, zero records.
    pub pages_zero: u64,
    /// Faults the destination read.
    pub faults: u64,
    /// Fault service time (fault to page installed), median, µs.
    pub fault_latency_p50_us: u64,
    /// 99th percentile, µs.
    pub fault_latency_p99_us: u64,
    /// Longest, µs.
    pub fault_latency_max_us: u64,
    /// The guest's ops/s at the destination during the phase (0: unknown).
    pub guest_ops_per_sec: f64,
    /// Times a cut link was taken back up.
    pub resumes: u32,
    /// The destination said it runs the VM (POSTCOPY_RUNNING, or a
    /// reconnection it took): from then on this copy is stale. Until then
    /// a failure leaves it paused, not lost.
    pub switch_confirmed: bool,
}

/// Per-codec counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CodecStats {
    /// Pages this codec encoded.
    pub pages: u64,
    /// Bytes in.
    pub bytes_in: u64,
    /// Bytes out.
    pub bytes_out: u64,
}

/// Everything `--json` writes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MigrationStats {
    /// completed or failed.
    pub status: Status,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Where the VM went.
    pub destination: String,
    /// Start to destination running (or to failure).
    pub total_time_ms: f64,
    /// Source pause to destination running.
    pub downtime_ms: f64,
    /// When the source paused the VM, in seconds of the host's
    /// CLOCK_MONOTONIC (0 if it never did): to line the stop up with a
    /// trace of the host, e.g. `perf record -k mono` (bench/stop_cpus.py).
    pub paused_at_monotonic_s: f64,
    /// When the source's vCPU stopped for the switch, in µs of the host's
    /// CLOCK_REALTIME since the Unix epoch (0 if it never did): the
    /// destination's control socket says when its vCPU ran
    /// (`stats`.`vcpu`.`resumed_at_unix_us`); the difference is the stop
    /// measured as QEMU's STOP and RESUME events measure it.
    pub paused_at_unix_us: u64,
    /// Connection and handshake.
    pub setup_time_ms: f64,
    /// Iterations, stop-and-copy included.
    pub iterations: u32,
    /// True when iteration stopped because the rest fit the downtime limit.
    pub converged: bool,
    /// Why iterating stopped.
    pub stop_reason: StopReason,
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
    /// The downtime limit the run was given (a stop-and-copy starts only
    /// when the rest is expected to fit it).
    pub downtime_limit_ms: f64,
    /// Where the downtime went.
    pub downtime_breakdown: DowntimeBreakdown,
    /// What the engine chose and why, in the order it decided.
    pub choices: Vec<Choice>,
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
    pub pipeline: Option<PipelineStats>,
    /// The post-copy phase, when there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub postcopy: Option<PostcopyStats>,
    /// The disk's warm migration, when the VM has a disk with a cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_cache: Option<WarmCacheStats>,
    /// What stayed on the memory host and what came back, when the VM has
    /// far memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub far_memory: Option<FarMigrationStats>,
}

impl MigrationStats {
    /// By how much the measured downtime went over the limit, when it did
    /// (a post-copy run's downtime is its switch, held to the same limit).
    pub fn over_limit_ms(&self) -> Option<f64> {
        let over = self.downtime_ms - self.downtime_limit_ms;
        (self.status == Status::Completed && self.downtime_limit_ms > 0.0 && over > 0.0).then_some(over)
    }
}

/// A far-memory VM's migration: only resident pages move, but eviction
/// stops meanwhile, so pages the guest touches come back from the memory
/// host and may have to go too. These say how many, so that what was sent
/// can be checked against what could have been.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FarMigrationStats {
    /// The limit on resident memory (suspended during the migration).
    pub local_limit_bytes: u64,
    /// Pages whose only copy was on the memory host when the migration
    /// took the map.
    pub far_pages_at_start: u64,
    /// Of those, pages never sent: the destination reads them from the
    /// memory host.
    pub pages_left_far: u64,
    /// Of those, pages that came back here during the migration (a fault
    /// or read-ahead): the only ones of them that may have been sent.
    pub pages_came_back: u64,
    /// Resident pages when the migration started.
    pub resident_pages_at_start: u64,
    /// Resident pages when it ended: an iteration sends each page at most
    /// once, and only resident ones.
    pub resident_pages_at_end: u64,
    /// Faults served here during the migration (from the memory host, or
    /// zeros for pages never sent away).
    pub faults: u64,
    /// Pages read ahead of those faults.
    pub readahead_pages: u64,
    /// Bytes read from the memory host during the migration.
    pub bytes_read: u64,
}

/// One thing the engine chose for a migration, and why.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// What was chosen: granularity, codecs, auto-converge, post-copy.
    pub what: String,
    /// The choice.
    pub chose: String,
    /// Why: asked for (a flag), the default, or what the engine measured.
    pub why: String,
}

/// What a warm migration sent about the disk cache.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WarmCacheStats {
    /// Blocks of the source's cache named to the destination, hottest first.
    pub blocks_listed: u64,
    /// Blocks the guest wrote during the migration (their early copies at
    /// the destination were dropped).
    pub blocks_written: u64,
    /// Blocks whose contents went over the migration stream (WARM_DATA),
    /// so the destination did not wait for storage.
    pub blocks_sent: u64,
    /// The guest's recent disk reads when the contents began to go, in
    /// bytes per second (what `--warm-data auto` paces them by).
    #[serde(default)]
    pub read_bytes_per_sec: f64,
    /// Seconds the contents took to send.
    #[serde(default)]
    pub data_seconds: f64,
}

/// Busy and waiting time of one stage, summed over its threads.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StageStats {
    /// fetch, encode, send.
    pub name: String,
    /// Threads running the stage.
    pub threads: u32,
    /// Seconds doing the stage's work.
    pub busy_seconds: f64,
    /// Seconds waiting for input (an empty queue).
    pub wait_input_seconds: f64,
    /// Seconds waiting for room downstream (a full queue, no free buffer).
    pub wait_output_seconds: f64,
    /// Items (batches or frames) handled.
    pub items: u64,
    /// Mean depth of the stage's output queue, sampled at each push.
    pub mean_queue_depth: f64,
    /// Deepest the output queue got.
    pub max_queue_depth: u64,
    /// CPU-seconds of the stage's threads (user + system).
    pub cpu_seconds: f64,
}

impl StageStats {
    /// A stage of one thread with nothing counted yet.
    pub fn named(name: &str) -> StageStats {
        StageStats { name: name.into(), threads: 1, ..Default::default() }
    }

    /// Records the depth of the stage's output queue at a push.
    pub fn sample_queue(&mut self, depth: usize, samples: &mut u64) {
        *samples += 1;
        self.mean_queue_depth += (depth as f64 - self.mean_queue_depth) / *samples as f64;
        self.max_queue_depth = self.max_queue_depth.max(depth as u64);
    }

    /// Adds another thread's figures of the same stage.
    pub fn merge(&mut self, other: &StageStats) {
        let items = (self.items + other.items).max(1) as f64;
        self.mean_queue_depth =
            (self.mean_queue_depth * self.items as f64 + other.mean_queue_depth * other.items as f64) / items;
        self.threads += other.threads;
        self.busy_seconds += other.busy_seconds;
        self.wait_input_seconds += other.wait_input_seconds;
        self.wait_output_seconds += other.wait_output_seconds;
        self.items += other.items;
        self.max_queue_depth = self.max_queue_depth.max(other.max_queue_depth);
        self.cpu_seconds += other.cpu_seconds;
    }
}

/// The `pipeline` field of the statistics.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PipelineStats {
    /// "pipelined" or "sequential" (`--no-pipeline`).
    pub mode: String,
    /// Connections.
    pub channels: u16,
    /// Codec shards (= encode threads when pipelined).
    pub shards: u16,
    /// Pages per batch.
    pub batch_pages: u64,
    /// Buffers per stage.
    pub buffers: usize,
    /// fetch, encode, send.
    pub stages: Vec<StageStats>,
    /// `--zero-copy` sends and their completions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_copy: Option<ZeroCopyStats>,
}

/// Counters of zero-copy sends, for the statistics' `pipeline` field.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ZeroCopyStats {
    /// `sendmsg` calls with `MSG_ZEROCOPY`.
    pub sends: u64,
    /// Bytes they carried.
    pub bytes: u64,
    /// Of the sends, those whose completion arrived.
    pub completed: u64,
    /// Of the completed, those the kernel copied after all (always so over
    /// loopback, where no NIC reads the pages).
    pub copied: u64,
}

impl ZeroCopyStats {
    /// Adds another channel's counters.
    pub fn add(&mut self, other: &ZeroCopyStats) {
        self.sends += other.sends;
        self.bytes += other.bytes;
        self.completed += other.completed;
        self.copied += other.copied;
    }
}

pub use tsubame_vmm::cpu_time::{process_cpu_seconds, thread_cpu_seconds, thread_cpu_time};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn far_memory_is_absent_without_it_and_round_trips_with_it() {
        let plain = serde_json::to_value(MigrationStats::default()).unwrap();
        assert!(plain.get("far_memory").is_none(), "a VM without far memory: no key");
        let far =
            FarMigrationStats { far_pages_at_start: 9, pages_left_far: 7, pages_came_back: 2, ..Default::default() };
        let stats = MigrationStats { far_memory: Some(far.clone()), ..Default::default() };
        let back: MigrationStats = serde_json::from_str(&serde_json::to_string(&stats).unwrap()).unwrap();
        assert_eq!(back.far_memory, Some(far));
        // Statistics written before the field read back without it.
        let old: MigrationStats = serde_json::from_value(plain).unwrap();
        assert!(old.far_memory.is_none());
    }

    #[test]
    fn a_downtime_over_the_limit_says_by_how_much() {
        let run = |downtime_ms, status| MigrationStats {
            downtime_ms,
            downtime_limit_ms: 300.0,
            status,
            ..Default::default()
        };
        assert_eq!(run(120.0, Status::Completed).over_limit_ms(), None);
        assert_eq!(run(300.0, Status::Completed).over_limit_ms(), None);
        assert_eq!(run(412.5, Status::Completed).over_limit_ms(), Some(112.5));
        // A failed run had no downtime to keep; statistics from before the
        // field (limit 0) promised nothing.
        assert_eq!(run(412.5, Status::Failed).over_limit_ms(), None);
        let old = MigrationStats { downtime_ms: 412.5, status: Status::Completed, ..Default::default() };
        assert_eq!(old.over_limit_ms(), None);
    }
}
