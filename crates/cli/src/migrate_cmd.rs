//! `tsubame migrate`: ask a running VM (through its control socket) to
//! migrate, show progress, and report the result.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use tsubame_migrate::options::{default_codecs, parse_granularity};
use tsubame_migrate::secure::{Psk, TlsConfig};
use tsubame_migrate::stats::Status;
use tsubame_migrate::transport::Security;
use tsubame_migrate::{Address, GpuOffload, MigrateOptions, MigrationStats, Progress};
use tsubame_vmm::PAGE_SIZE;

use crate::control::{ControlClient, SocketClosed};
use crate::request::{canonical, MigrateRequest, SecurityFiles};
use crate::units::{format_bytes, parse_rate};
use crate::{outcome_unknown, usage_error};

/// `tsubame migrate --help`'s last paragraph.
pub const EXIT_STATUS: &str = "Exit status: 0 when the VM runs at the destination (the statistics \
were received); 1 when the migration failed (before the switch the VM runs here again; once the \
destination confirmed a switch to post-copy it is lost; an unconfirmed switch leaves it paused here) or could not start; 2 on a usage error; 3 when the outcome is \
unknown: the VM's process closed the control socket (or went silent) before saying how the \
migration ended — ask the destination (`stats` on its control socket) whether the VM runs there.";

/// How to migrate (shared by `migrate` and `demo`).
#[derive(Args, Debug, Clone)]
pub struct MigrateFlags {
    /// Cap the migration stream, e.g. 1Gbit, 100Mbit or 500MB (per second).
    #[arg(long, value_name = "RATE")]
    pub max_bandwidth: Option<String>,
    /// Stop iterating once the remaining dirty memory should take at most
    /// this many milliseconds to send (the expected downtime).
    #[arg(long, value_name = "MS", default_value_t = 300)]
    pub downtime_limit: u64,
    /// Stop iterating after this many iterations and stop-and-copy anyway.
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub max_iterations: u32,
    /// Fail (the VM keeps running here) instead of a stop-and-copy that
    /// would exceed the downtime limit.
    #[arg(long)]
    pub abort_if_not_converged: bool,
    /// Slow the guest while it dirties memory faster than the migration
    /// sends it, as QEMU's auto-converge: once the pages dirtied during an
    /// iteration outweigh half of what it sent (twice), the vCPU sleeps
    /// 20 % of the time, 10 % more at each further time, at most 99 %.
    /// The guest runs at full speed again as soon as the migration ends.
    #[arg(long)]
    pub auto_converge: bool,
    /// Finish with post-copy instead of a long stop-and-copy: the
    /// destination runs the VM at once and is sent the pages it lacks,
    /// those its guest touches first. `auto` (the default: switch only
    /// when the guest dirties memory about as fast as the link carries
    /// it, which pre-copy cannot finish without a long stop); `after=N`
    /// (switch after N pre-copy iterations, 0 at once); `off` (pre-copy
    /// only). Once the switch happened the VM runs only at the
    /// destination: a link cut pauses both ends until it is back (see
    /// --postcopy-timeout), and losing either process loses the VM
    /// (docs/security.md).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub postcopy: String,
    /// How long a cut post-copy link is retried before the VM is given up.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub postcopy_timeout: u64,
    /// Do not send the disk cache's block list ahead: the destination's
    /// block cache starts cold (for comparison; warm is the default).
    #[arg(long)]
    pub no_warm_cache: bool,
    /// Which cached blocks' contents go over the migration link with the
    /// list (the destination reads the rest from the storage itself):
    /// `auto` (the default: those the guest likely reads next, until they
    /// are 2 s of its reads, at its recent rate, ahead of where it reads:
    /// all of them where it reads faster than the link carries), `all`
    /// (every cached block: the guest's reads hold up best, the migration
    /// takes longest) or `none` (the list only)
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub warm_data: String,
    /// Page codecs, comma-separated: zero, rle, xbzrle[=CACHE], dedup[=CACHE],
    /// lz4, zstd[=LEVEL]; or none (raw pages). Per page: zero, then an
    /// XBZRLE hit, then dedup or rle, else raw; lz4/zstd compress each
    /// batch. A codec that does not pay at the measured bandwidth is
    /// switched off for a while [default: zero,lz4; zero with --zero-copy
    /// or --gpu]
    #[arg(long, value_name = "LIST")]
    pub codec: Option<String>,
    /// Send only the changed BYTES-sized sub-pages of each dirty page
    /// (a power of two, 64 to 4096; 4096 sends whole pages). `auto` (the
    /// default) starts with 128-byte sub-pages and sends whole pages from
    /// the moment sub-pages save under 1/16 of the bytes of the pages sent
    /// again (a guest that rewrites whole pages); whole pages from the
    /// start with --zero-copy or --gpu. XBZRLE, when asked for, codes the
    /// pages whose every sub-page changed.
    #[arg(long, value_name = "BYTES", default_value = "auto")]
    pub granularity: String,
    /// How changed sub-pages are found: `hash` keeps a 64-bit hash per
    /// sub-page (1/16 of memory at 128 B; the final memory verification
    /// catches a collision and re-sends the region); `shadow` keeps a copy
    /// of what was sent (exact, but as much memory as the VM, and slower
    /// for full-page rewrites because every page is copied).
    #[arg(long, value_name = "DETECTOR", default_value = "hash")]
    pub subpage_detect: String,
    /// Parallel connections to the destination. Pages are split into
    /// codec shards by page index; each shard always travels on the same
    /// channel, so its codec caches agree on both ends.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub channels: u16,
    /// Threads encoding pages (one codec shard each); default: every core
    /// but one.
    #[arg(long, value_name = "N")]
    pub encode_threads: Option<u16>,
    /// Pages per batch handed from the fetch stage to an encoder (a
    /// multiple of 64, 64 to 4096).
    #[arg(long, value_name = "PAGES", default_value_t = 1024)]
    pub batch_pages: u64,
    /// Buffers per pipeline stage: how far fetch may run ahead of encode,
    /// and encode ahead of send.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub buffers: usize,
    /// Run fetch, encode and send in turn on one thread instead of a
    /// pipeline (to measure what the pipeline gains).
    #[arg(long)]
    pub no_pipeline: bool,
    /// Send raw pages straight from guest memory with MSG_ZEROCOPY (tcp:
    /// destinations, --codec none or zero, whole pages). Over loopback the
    /// kernel still copies; the JSON's pipeline.zero_copy says how often.
    #[arg(long)]
    pub zero_copy: bool,
    /// Run the page codecs (zero, rle, xbzrle, dedup) on a CUDA GPU; the
    /// records are the CPU codecs' byte for byte. Fails with one line where
    /// no CUDA driver is found.
    #[arg(long)]
    pub gpu: bool,
    /// How the host waits for the GPU: spin, sleep-min (GMigrate: sleep
    /// for the shortest batch time seen, then sync) or blocking (CUDA
    /// blocking-sync events).
    #[arg(long, value_name = "POLICY", default_value = "blocking", requires = "gpu")]
    pub gpu_wait: String,
    /// Where --gpu runs the kernels: cuda, or emulator (the same kernels
    /// compiled for this CPU; slow, to test the GPU path without a GPU).
    #[arg(long, value_name = "BACKEND", default_value = "cuda", requires = "gpu")]
    pub gpu_backend: String,
    /// Authenticate both ends and encrypt every channel with the
    /// pre-shared key in FILE (at least 16 bytes; the destination needs
    /// the same file). See docs/security.md.
    #[arg(long, value_name = "FILE")]
    pub psk_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: TlsFlags,
    /// Allow unencrypted TCP to a destination that is not on this host.
    #[arg(long)]
    pub insecure: bool,
    /// Write the migration statistics as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl MigrateFlags {
    fn gpu(&self) -> Result<Option<GpuOffload>, String> {
        if !self.gpu {
            return Ok(None);
        }
        let wait = self.gpu_wait.parse().map_err(|e| format!("--gpu-wait: {e}"))?;
        match self.gpu_backend.as_str() {
            "cuda" => Ok(Some(GpuOffload::Cuda(wait))),
            "emulator" => Ok(Some(GpuOffload::Emulator)),
            other => Err(format!("--gpu-backend: unknown '{other}' (known: cuda, emulator)")),
        }
    }

    /// The engine's options, checked.
    pub fn options(&self) -> anyhow::Result<MigrateOptions> {
        let max_bandwidth = match &self.max_bandwidth {
            Some(text) => Some(parse_rate(text).map_err(|e| usage_error(format!("--max-bandwidth: {e}")))?),
            None => None,
        };
        if self.max_iterations == 0 || self.max_iterations > 1000 {
            return Err(usage_error("--max-iterations must be between 1 and 1000"));
        }
        let (granularity, granularity_auto) =
            parse_granularity(&self.granularity).map_err(|e| usage_error(format!("--granularity: {e}")))?;
        let subpage_detector =
            self.subpage_detect.parse().map_err(|e: String| usage_error(format!("--subpage-detect: {e}")))?;
        let codecs = match &self.codec {
            Some(list) => list.parse().map_err(|e: tsubame_codec::CodecError| usage_error(format!("--codec: {e}")))?,
            None => default_codecs(self.zero_copy, self.gpu),
        };
        let postcopy = self.postcopy.parse().map_err(|e: String| usage_error(format!("--postcopy: {e}")))?;
        if self.postcopy_timeout == 0 {
            return Err(usage_error("--postcopy-timeout must be at least 1 second"));
        }
        let options = MigrateOptions {
            codecs,
            max_bandwidth,
            downtime_limit: Duration::from_millis(self.downtime_limit),
            max_iterations: self.max_iterations,
            abort_if_not_converged: self.abort_if_not_converged,
            auto_converge: self.auto_converge,
            granularity,
            granularity_auto,
            subpage_detector,
            channels: self.channels,
            encode_threads: self.encode_threads.unwrap_or_else(tsubame_migrate::options::default_encode_threads),
            batch_pages: self.batch_pages,
            buffers: self.buffers,
            pipeline: !self.no_pipeline,
            zero_copy: self.zero_copy,
            gpu: self.gpu().map_err(usage_error)?,
            security: security(self.psk_file.as_deref(), &self.tls, self.insecure)?,
            postcopy,
            postcopy_timeout: Duration::from_secs(self.postcopy_timeout),
            warm_cache: !self.no_warm_cache,
            warm_data: self.warm_data.parse().map_err(usage_error)?,
            ..MigrateOptions::default()
        };
        options.check().map_err(usage_error)?;
        Ok(options)
    }
}

/// Mutual TLS 1.3 (shared by `migrate`, `receive` and `demo`): all three
/// files or none.
#[derive(Args, Debug, Clone, Default)]
pub struct TlsFlags {
    /// Authenticate with mutual TLS 1.3 and encrypt every channel: this
    /// end's certificate (PEM; a chain, leaf first, may follow). The peer
    /// must trust its CA. A source checks the destination's certificate
    /// against the host it dials (tcp:HOST:PORT; localhost for unix:).
    /// Needs --tls-key and --tls-ca; see docs/security.md.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"], conflicts_with = "psk_file")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"], conflicts_with = "psk_file")]
    pub tls_key: Option<PathBuf>,
    /// The CA certificate(s) (PEM) that must have signed the peer's
    /// certificate; a peer without one is refused.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"], conflicts_with = "psk_file")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsFlags {
    /// The three files, if given.
    pub fn files(&self) -> Option<[&std::path::Path; 3]> {
        Some([self.tls_cert.as_deref()?, self.tls_key.as_deref()?, self.tls_ca.as_deref()?])
    }

    /// The flags and their files, for a child process's command line.
    pub fn args(&self) -> Vec<std::ffi::OsString> {
        let mut args = Vec::new();
        if let Some(files) = self.files() {
            for (flag, file) in ["--tls-cert", "--tls-key", "--tls-ca"].into_iter().zip(files) {
                args.push(flag.into());
                args.push(file.as_os_str().to_owned());
            }
        }
        args
    }
}

/// Reads `--psk-file` or the `--tls-*` files (a bad file is a usage
/// error) into a [`Security`].
pub fn security(psk_file: Option<&std::path::Path>, tls: &TlsFlags, insecure: bool) -> anyhow::Result<Security> {
    let psk = match psk_file {
        Some(path) => Some(Psk::read(path).map_err(|e| usage_error(format!("--psk-file: {e}")))?),
        None => None,
    };
    let tls = match tls.files() {
        Some([cert, key, ca]) => Some(TlsConfig::load(cert, key, ca).map_err(|e| usage_error(e.to_string()))?),
        None => None,
    };
    Ok(Security { psk, tls, insecure })
}

/// Options of `tsubame migrate`.
#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Control socket of the running VM (`tsubame run --control PATH`).
    #[arg(long)]
    pub control: PathBuf,
    /// Destination: tcp:HOST:PORT or unix:PATH (where `tsubame receive` listens).
    #[arg(long, required_unless_present = "resume")]
    pub to: Option<String>,
    /// Resume a post-copy migration whose link was cut: reconnect now
    /// (to --to, when given: the destination's new address) instead of
    /// waiting for the next automatic retry, then follow it to the end.
    /// Fails when no post-copy migration of that VM is paused.
    #[arg(long)]
    pub resume: bool,
    #[command(flatten)]
    pub flags: MigrateFlags,
}

/// A progress bar on stderr (drawn only when stderr is a terminal).
pub fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}").expect("valid template"));
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// The bar's text for the engine's progress.
pub fn progress_message(p: &Progress) -> String {
    let phase = serde_json::to_value(p.phase).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    format!(
        "{phase} · iteration {} · dirty {} pages · {} left · {}/s · {} sent{}",
        p.iteration,
        p.dirty_pages,
        format_bytes(p.remaining_pages * PAGE_SIZE as u64),
        format_bytes(p.bandwidth as u64),
        format_bytes(p.bytes_on_wire),
        if p.pipeline.is_empty() { String::new() } else { format!(" · {}", p.pipeline) },
    )
}

/// Prints the readable summary of a migration's statistics.
pub fn print_summary(stats: &MigrationStats) {
    let status = match stats.status {
        Status::Completed => "completed",
        Status::Failed => "failed",
    };
    println!("migration {status} to {}", stats.destination);
    if let Some(error) = &stats.error {
        println!("  error:       {error}");
    }
    println!("  total time:  {:.1} ms (setup {:.1} ms)", stats.total_time_ms, stats.setup_time_ms);
    for (i, choice) in stats.choices.iter().enumerate() {
        let label = if i == 0 { "choices:" } else { "" };
        println!("  {label:<12} {} {} ({})", choice.what, choice.chose, choice.why);
    }
    let limit = match stats.over_limit_ms() {
        Some(over) => format!("; over the {:.0} ms limit by {over:.1} ms", stats.downtime_limit_ms),
        None if stats.downtime_limit_ms > 0.0 => format!("; limit {:.0} ms", stats.downtime_limit_ms),
        None => String::new(),
    };
    if stats.postcopy.is_some() {
        // The expected figure is a stop-and-copy's, which did not happen.
        println!("  downtime:    {:.1} ms (the switch to post-copy{limit})", stats.downtime_ms);
    } else {
        println!("  downtime:    {:.1} ms (expected {:.1} ms{limit})", stats.downtime_ms, stats.expected_downtime_ms);
    }
    println!(
        "  iterations:  {} ({}, stop reason: {})",
        stats.iterations,
        if stats.converged { "converged" } else { "not converged" },
        match stats.stop_reason.name() {
            "" => "-",
            name => name,
        },
    );
    println!(
        "  sent:        {} on the wire; {} page records ({} zero) for {} pages of memory",
        format_bytes(stats.bytes_on_wire),
        stats.pages_sent,
        stats.pages_zero,
        stats.pages_total,
    );
    let throttles: Vec<f64> = stats.per_iteration.iter().map(|i| i.throttle).collect();
    if let Some(first) = throttles.iter().position(|&t| t > 0.0) {
        let most = throttles.iter().cloned().fold(0.0, f64::max);
        println!(
            "  throttled:   from iteration {first}, up to {:.0} % of the guest's time (auto-converge)",
            most * 100.0
        );
    }
    let cpu = &stats.cpu_seconds;
    println!(
        "  cpu:         source {:.2} s (migration thread {:.2} s), destination {:.2} s",
        cpu.source, cpu.source_migration_thread, cpu.destination
    );
    if !stats.codec.is_empty() {
        let parts: Vec<String> = stats
            .codec
            .iter()
            .map(|(name, c)| {
                format!("{name} {} ({} → {})", c.pages, format_bytes(c.bytes_in), format_bytes(c.bytes_out))
            })
            .collect();
        println!("  codecs:      {}", parts.join("; "));
    }
    if let Some(sub) = &stats.subpage {
        println!(
            "  sub-pages:   {} B, {} detector ({}): {} sub-pages sent, {} pages whole, {} unchanged, {} zeroed",
            sub.granularity,
            sub.detector,
            format_bytes(sub.memory_bytes),
            sub.subpages_sent,
            sub.pages_full,
            sub.pages_unchanged,
            sub.pages_zeroed,
        );
        if let Some(saved) = sub.saved_share() {
            let whole = sub.whole_pages_from.map_or(String::new(), |i| format!("; whole pages from iteration {i}"));
            println!(
                "               of {} pages sent again, {:.0} % of the bytes saved{whole}",
                sub.resent_pages,
                saved * 100.0
            );
        }
    }
    if let Some(pipeline) = &stats.pipeline {
        let stages: Vec<String> = pipeline
            .stages
            .iter()
            .map(|s| {
                format!(
                    "{} ×{} busy {:.2} s, waiting {:.2} s, {:.2} CPU-s",
                    s.name,
                    s.threads,
                    s.busy_seconds,
                    s.wait_input_seconds + s.wait_output_seconds,
                    s.cpu_seconds
                )
            })
            .collect();
        println!("  pipeline:    {}, {} channel(s): {}", pipeline.mode, pipeline.channels, stages.join("; "));
        if let Some(zc) = &pipeline.zero_copy {
            println!(
                "  zero-copy:   {} sends ({}), {} completed, {} copied by the kernel after all",
                zc.sends,
                format_bytes(zc.bytes),
                zc.completed,
                zc.copied
            );
        }
    }
    if let Some(p) = &stats.postcopy {
        println!(
            "  post-copy:   from {:.0} ms for {:.0} ms: {} pages missing, {} asked for ({} faults, service p50 {} µs, p99 {} µs, max {} µs), {} pushed{}{}",
            p.started_at_ms,
            p.duration_ms,
            p.pages_missing,
            p.pages_requested,
            p.faults,
            p.fault_latency_p50_us,
            p.fault_latency_p99_us,
            p.fault_latency_max_us,
            p.pages_pushed,
            if p.pages_sent_again > 0 { format!(" ({} of them sent again on request)", p.pages_sent_again) } else { String::new() },
            if p.guest_ops_per_sec > 0.0 { format!("; guest {:.0} ops/s meanwhile", p.guest_ops_per_sec) } else { String::new() }
        );
    }
    if let Some(f) = &stats.far_memory {
        println!(
            "  far memory:  {} of {} far pages left on the memory host; {} came back meanwhile ({} faults, {} read ahead, {} read); resident {} → {} pages (limit {})",
            f.pages_left_far,
            f.far_pages_at_start,
            f.pages_came_back,
            f.faults,
            f.readahead_pages,
            format_bytes(f.bytes_read),
            f.resident_pages_at_start,
            f.resident_pages_at_end,
            format_bytes(f.local_limit_bytes),
        );
    }
    if let Some(w) = &stats.warm_cache {
        println!(
            "  warm cache:  {} blocks of the disk cache named ahead ({}), {} of them sent in {:.2} s (the guest read {}/s), {} written during the migration and dropped there",
            w.blocks_listed,
            format_bytes(w.blocks_listed * 4096),
            w.blocks_sent,
            w.data_seconds,
            format_bytes(w.read_bytes_per_sec as u64),
            w.blocks_written
        );
    }
    println!("  verified:    {}", if stats.digest_verified { "memory digest matched" } else { "no" });
}

/// Writes the statistics JSON if asked to.
pub fn write_json(path: &Option<PathBuf>, stats: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(stats)?;
        std::fs::write(path, text + "\n").map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Runs `tsubame migrate`.
pub fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let to: Option<Address> = match &args.to {
        Some(to) => {
            Some(to.parse().map_err(|e: tsubame_migrate::transport::TransportError| usage_error(e.to_string()))?)
        }
        None => None,
    };
    // Bad flags are a usage error (exit 2) before anything is asked of the VM.
    let options = if args.resume { None } else { Some(args.flags.options()?) };
    let mut client = ControlClient::connect(&args.control)?;
    if args.resume {
        let mut request = serde_json::json!({"cmd": "migrate-resume"});
        if let Some(to) = &to {
            request["to"] = Value::String(to.to_string());
        }
        client.request(&request).map_err(|e| unknown_if_closed(e, "migrate-resume", None))?;
        eprintln!("post-copy link resumed; following the migration");
        return follow(&mut client, &args.flags.json);
    }
    let to = to.expect("clap requires --to without --resume");
    let options = options.expect("parsed above without --resume");
    // The VM's process reads the key files: give it paths from anywhere.
    let files = SecurityFiles {
        psk: canonical(args.flags.psk_file.as_deref())?,
        tls_cert: canonical(args.flags.tls.tls_cert.as_deref())?,
        tls_key: canonical(args.flags.tls.tls_key.as_deref())?,
        tls_ca: canonical(args.flags.tls.tls_ca.as_deref())?,
    };
    client
        .request(&serde_json::to_value(MigrateRequest::new(&to, &options, &files))?)
        .map_err(|e| unknown_if_closed(e, "migrate", None))?;
    follow(&mut client, &args.flags.json)
}

/// A request whose connection ended before the reply: the migration may
/// have gone either way (exit 3); other errors stay what they are.
fn unknown_if_closed(e: anyhow::Error, asked: &str, last: Option<&Progress>) -> anyhow::Error {
    let Some(closed) = e.downcast_ref::<SocketClosed>() else { return e };
    let seen = match last {
        Some(p) => format!(
            "; last seen: {} in iteration {}",
            serde_json::to_value(p.phase).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
            p.iteration
        ),
        None => String::new(),
    };
    outcome_unknown(format!(
        "outcome unknown: {closed} to '{asked}'{seen} — the VM may run at the destination or here; ask the destination"
    ))
}

/// Shows the running migration's progress until it ends, then its summary.
fn follow(client: &mut ControlClient, json: &Option<PathBuf>) -> anyhow::Result<()> {
    let bar = progress_bar();
    let mut last: Option<Progress> = None;
    let stats: MigrationStats = loop {
        std::thread::sleep(Duration::from_millis(100));
        let reply = match client.request(&serde_json::json!({"cmd": "query-migrate"})) {
            Ok(reply) => reply,
            Err(e) => {
                bar.finish_and_clear();
                return Err(unknown_if_closed(e, "query-migrate", last.as_ref()));
            }
        };
        match reply.get("status").and_then(Value::as_str) {
            Some("active") => {
                let progress: Progress = serde_json::from_value(reply["progress"].clone())?;
                bar.set_message(progress_message(&progress));
                last = Some(progress);
            }
            Some("completed") | Some("failed") => break serde_json::from_value(reply["stats"].clone())?,
            other => anyhow::bail!("unexpected query-migrate status {other:?}"),
        }
    };
    bar.finish_and_clear();
    print_summary(&stats);
    write_json(json, &stats)?;
    if stats.status != Status::Completed {
        anyhow::bail!("migration failed: {}", stats.error.as_deref().unwrap_or("unknown error"));
    }
    Ok(())
}
