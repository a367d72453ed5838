//! What a user can ask of a migration, and what the engine reports while
//! it runs.

use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::digest;
use crate::subpage::Detector;
use tsubame_codec::batch::BatchCodec;
use tsubame_codec::CodecList;

/// Whole pages, as a granularity.
const PAGE_BYTES: u32 = tsubame_codec::PAGE_SIZE as u32;

/// Knobs of a pre-copy migration (CLI flags map one to one).
#[derive(Debug, Clone)]
pub struct MigrateOptions {
    /// Cap on bytes per second written to the connection.
    pub max_bandwidth: Option<u64>,
    /// Stop iterating when the rest should take at most this long.
    pub downtime_limit: Duration,
    /// Stop iterating after this many iterations (stop-and-copy anyway).
    pub max_iterations: u32,
    /// Fail instead of a long stop-and-copy when not converged.
    pub abort_if_not_converged: bool,
    /// Slow the guest (sleep its vCPU a growing share of the time) while
    /// it dirties memory faster than the migration sends it.
    pub auto_converge: bool,
    /// Digest region size in bytes.
    pub digest_region: u32,
    /// How long to wait for the destination to answer.
    pub io_timeout: Duration,
    /// How long to retry connecting while the destination is not up yet.
    pub connect_timeout: Duration,
    /// Bytes per sub-page sent for dirty pages (4096: whole pages).
    pub granularity: u32,
    /// `--granularity auto` (the default): sub-pages of `granularity`
    /// until the re-sent pages show they do not pay, then whole pages;
    /// whole pages from the start where zero-copy or the GPU needs them.
    pub granularity_auto: bool,
    /// How sub-page changes are detected.
    pub subpage_detector: Detector,
    /// Bits of the sub-page hash that count; tests clear bits to forge
    /// collisions and exercise the repair pass.
    pub subpage_hash_mask: u64,
    /// Page codecs (zero detection by default).
    pub codecs: CodecList,
    /// Run fetch, encode and send in their own threads (false: in turn).
    pub pipeline: bool,
    /// Pages per batch handed from fetch to encode.
    pub batch_pages: u64,
    /// Encode threads (= codec shards) when pipelined.
    pub encode_threads: u16,
    /// Buffers per stage (the depth of each queue).
    pub buffers: usize,
    /// Parallel connections.
    pub channels: u16,
    /// Send raw pages straight from guest memory with `MSG_ZEROCOPY` (TCP).
    pub zero_copy: bool,
    /// Run the per-page codecs on a GPU.
    pub gpu: Option<GpuOffload>,
    /// How every connection is protected (pre-shared key, TLS, or plain).
    pub security: crate::transport::Security,
    /// Whether and when to switch to post-copy.
    pub postcopy: PostcopyMode,
    /// How long a cut post-copy link is retried before the VM is given up.
    pub postcopy_timeout: Duration,
    /// Send the disk cache's block list ahead so the destination's cache
    /// is warm when the VM arrives (`--no-warm-cache` turns it off).
    pub warm_cache: bool,
    /// Which cached blocks' contents go over the migration link besides
    /// their names (`--warm-data`).
    pub warm_data: WarmData,
}

/// `--warm-data`: which of the disk cache's blocks a warm migration sends
/// the contents of, besides naming them all. The destination reads the
/// named blocks from the shared storage itself meanwhile; contents sent
/// over the link arrive whatever the storage's speed, but lengthen the
/// migration by their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WarmData {
    /// The blocks the guest reads first at the destination: contents go
    /// while what went is less than what the guest reads, at its recent
    /// rate, from the list's start to [`WARM_DATA_WINDOW`] past now; so
    /// a guest that reads faster than the link carries gets them all, one
    /// that reads nothing none (the default).
    #[default]
    Budget,
    /// Every cached block.
    All,
    /// None: the destination reads every named block from storage.
    Off,
}

/// How far ahead of the guest's reads [`WarmData::Budget`] sends: its
/// first seconds at the destination, in which a cold cache shows. Each
/// second more costs every VM on the link its bytes, and by then the
/// destination's reads from storage have run for the whole migration.
pub const WARM_DATA_WINDOW: Duration = Duration::from_secs(2);

impl std::str::FromStr for WarmData {
    type Err = String;
    fn from_str(s: &str) -> Result<WarmData, String> {
        match s {
            "auto" => Ok(WarmData::Budget),
            "all" => Ok(WarmData::All),
            "none" => Ok(WarmData::Off),
            _ => Err(format!("warm data '{s}': use auto, all or none")),
        }
    }
}

impl std::fmt::Display for WarmData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WarmData::Budget => "auto",
            WarmData::All => "all",
            WarmData::Off => "none",
        })
    }
}

/// `--postcopy`: whether to finish with post-copy instead of a long
/// stop-and-copy (the destination runs the VM at once and is sent the
/// pages it lacks, those it faults on first).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PostcopyMode {
    /// Pre-copy only.
    Off,
    /// Switch when pre-copy is not converging, as judged from the measured
    /// dirty rate and link rate (the default: a guest that converges never
    /// switches; one that does not would otherwise end in a long stop).
    #[default]
    Auto,
    /// Switch after this many pre-copy iterations (0: at once).
    After(u32),
}

impl std::str::FromStr for PostcopyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<PostcopyMode, String> {
        match s {
            "off" => Ok(PostcopyMode::Off),
            "auto" => Ok(PostcopyMode::Auto),
            _ => match s.strip_prefix("after=").and_then(|n| n.parse::<u32>().ok()) {
                Some(n) if n <= 1000 => Ok(PostcopyMode::After(n)),
                _ => Err(format!("postcopy mode '{s}': use off, auto or after=N (N pre-copy iterations, 0 to 1000)")),
            },
        }
    }
}

impl std::fmt::Display for PostcopyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PostcopyMode::Off => f.write_str("off"),
            PostcopyMode::Auto => f.write_str("auto"),
            PostcopyMode::After(n) => write!(f, "after={n}"),
        }
    }
}

/// Where `--gpu` runs the codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuOffload {
    /// A CUDA GPU, the host waiting as the policy says.
    Cuda(tsubame_gpu::WaitPolicy),
    /// The same kernels compiled for the host: tests the pipeline's GPU
    /// path where there is no GPU.
    Emulator,
}

/// The page codecs unless asked for others: zero pages as a flag, and lz4
/// over each batch while it pays at the link's rate (pages a guest wrote
/// a few words of shrink 20-200 times; it switches itself off on pages it
/// does not shrink); zero only where pages go out raw (`zero_copy`) or a
/// GPU encodes them (`gpu`).
pub fn default_codecs(zero_copy: bool, gpu: bool) -> CodecList {
    CodecList { zero: true, batch: (!zero_copy && !gpu).then_some(BatchCodec::Lz4), ..CodecList::default() }
}

/// Default encode threads: every core but one (which fetches and sends).
pub fn default_encode_threads() -> u16 {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cores.saturating_sub(1)).clamp(1, crate::protocol::MAX_SHARDS as usize) as u16
}

/// Parses `--granularity`: `auto`, or a fixed size in bytes; returns the
/// size to start with and whether it is automatic.
pub fn parse_granularity(text: &str) -> Result<(u32, bool), String> {
    if text == "auto" {
        return Ok((AUTO_GRANULARITY, true));
    }
    let bytes = text.parse().map_err(|_| format!("'{text}': use auto or a size in bytes (64 to 4096)"))?;
    crate::subpage::check_granularity(bytes)?;
    Ok((bytes, false))
}

/// Where `--granularity auto` starts: 128-byte sub-pages (the SPP paper's
/// size) saved the most on every workload measured that re-sends pages.
pub const AUTO_GRANULARITY: u32 = 128;

/// The sub-page granularity a migration starts with, and whether
/// `--granularity auto` may drop sub-pages for whole pages later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granularity {
    /// Bytes per sub-page (4096: whole pages).
    pub bytes: u32,
    /// Whether whole pages may replace sub-pages once they stop paying.
    pub auto: bool,
}

impl Granularity {
    /// Whether it sends whole pages.
    pub fn whole_pages(&self) -> bool {
        self.bytes == PAGE_BYTES
    }
}

impl MigrateOptions {
    /// The granularity the engine starts with: `auto` sends whole pages
    /// where the send path needs them (zero-copy, the GPU's codecs).
    pub fn start_granularity(&self) -> Granularity {
        let bytes =
            if self.granularity_auto && (self.zero_copy || self.gpu.is_some()) { PAGE_BYTES } else { self.granularity };
        Granularity { bytes, auto: self.granularity_auto }
    }

    /// Combinations the engine refuses, as a message.
    pub fn check(&self) -> Result<(), String> {
        crate::subpage::check_granularity(self.granularity)?;
        if !(64..=4096).contains(&self.batch_pages) || !self.batch_pages.is_multiple_of(64) {
            return Err(format!("--batch-pages must be a multiple of 64 from 64 to 4096, not {}", self.batch_pages));
        }
        if !(1..=crate::protocol::MAX_CHANNELS).contains(&self.channels) {
            return Err(format!("--channels must be 1 to {}, not {}", crate::protocol::MAX_CHANNELS, self.channels));
        }
        if !(1..=crate::protocol::MAX_SHARDS).contains(&self.encode_threads) {
            return Err(format!(
                "--encode-threads must be 1 to {}, not {}",
                crate::protocol::MAX_SHARDS,
                self.encode_threads
            ));
        }
        if self.zero_copy && !(self.codecs.is_plain() && self.start_granularity().whole_pages()) {
            return Err("--zero-copy sends raw pages: use it with --codec none or zero and --granularity 4096".into());
        }
        if self.gpu.is_some() && (!self.start_granularity().whole_pages() || self.zero_copy) {
            return Err("--gpu encodes whole pages: use it with --granularity 4096 and without --zero-copy".into());
        }
        if !(1..=64).contains(&self.buffers) {
            return Err(format!("--buffers must be 1 to 64, not {}", self.buffers));
        }
        if self.security.psk.is_some() && self.security.tls.is_some() {
            return Err(crate::secure::SecureError::BothModes.to_string());
        }
        Ok(())
    }

    /// Codec shards: one per encode thread (sequential: one per channel),
    /// never fewer than channels.
    pub fn shards(&self) -> u16 {
        if self.pipeline {
            self.encode_threads.max(self.channels)
        } else {
            self.channels
        }
    }
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            max_bandwidth: None,
            downtime_limit: Duration::from_millis(300),
            max_iterations: 30,
            abort_if_not_converged: false,
            auto_converge: false,
            digest_region: digest::DEFAULT_REGION,
            io_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            granularity: AUTO_GRANULARITY,
            granularity_auto: true,
            subpage_detector: Detector::Hash,
            subpage_hash_mask: u64::MAX,
            codecs: default_codecs(false, false),
            pipeline: true,
            batch_pages: 1024,
            encode_threads: default_encode_threads(),
            buffers: 3,
            channels: 1,
            zero_copy: false,
            gpu: None,
            security: Default::default(),
            postcopy: PostcopyMode::Auto,
            postcopy_timeout: Duration::from_secs(60),
            warm_cache: true,
            warm_data: WarmData::Budget,
        }
    }
}

/// Where a running migration is, for `query-migrate` and progress bars.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Progress {
    /// setup, iterating, stop-and-copy, committing, completed, failed.
    pub phase: crate::protocol::SourceState,
    /// Current iteration.
    pub iteration: u32,
    /// Pages dirty at the start of this iteration.
    pub dirty_pages: u64,
    /// Pages of this iteration still to send.
    pub remaining_pages: u64,
    /// Bytes written so far.
    pub bytes_on_wire: u64,
    /// Measured bytes per second of the last iteration.
    pub bandwidth: f64,
    /// Guest memory size.
    pub memory_bytes: u64,
    /// Each pipeline stage's busy share, e.g. "fetch 20% encode 85% send 60%".
    pub pipeline: String,
}

/// A manual resume of a paused post-copy migration: maybe another
/// address, and where to say how the attempt went.
pub type ResumeRequest = (Option<crate::Address>, crossbeam_channel::Sender<Result<(), String>>);

/// A progress value shared between the engine and its observers, and the
/// one thing an observer may ask of a running migration: to resume a
/// paused post-copy now (`tsubame migrate --resume`).
#[derive(Default)]
pub struct ProgressCell {
    progress: Mutex<Progress>,
    resume: Mutex<Option<ResumeRequest>>,
    asked: std::sync::Condvar,
}

impl ProgressCell {
    /// Updates the progress in place.
    pub fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.progress.lock().unwrap());
    }

    /// A copy of the current progress.
    pub fn get(&self) -> Progress {
        self.progress.lock().unwrap().clone()
    }

    /// Asks a paused post-copy migration to try its link again now (at
    /// `to`, when given); the answer comes on the returned channel. Fails
    /// at once when no post-copy migration is paused.
    pub fn request_resume(
        &self,
        to: Option<crate::Address>,
    ) -> Result<crossbeam_channel::Receiver<Result<(), String>>, String> {
        if self.get().phase != crate::protocol::SourceState::PostcopyPaused {
            return Err("no paused post-copy migration to resume".into());
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        *self.resume.lock().unwrap() = Some((to, tx));
        self.asked.notify_all();
        Ok(rx)
    }

    /// The pending manual resume, if any.
    pub(crate) fn take_resume_request(&self) -> Option<ResumeRequest> {
        self.resume.lock().unwrap().take()
    }

    /// Sleeps up to `timeout`, less when a manual resume is asked for.
    pub(crate) fn wait_resume_request(&self, timeout: std::time::Duration) {
        let pending = self.resume.lock().unwrap();
        if pending.is_none() {
            let _ = self.asked.wait_timeout(pending, timeout);
        }
    }
}
