//! The sending side of pre-copy: iterate over dirty pages until the rest
//! fits the downtime limit, then stop-and-copy, verify, commit.
//!
//! The migration thread fetches dirty pages into batches; the pipeline
//! (pipeline.rs) encodes and sends them over one or more channels.
//!
//! The VM is never lost: any failure before COMMIT is written resumes the
//! source VM; once COMMIT is written the source never resumes on its own.

use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tsubame_trace::auto_converge::AutoConverge;
use tsubame_vmm::{memory, PAGE_SIZE};

use crate::digest;
use crate::options::{MigrateOptions, ProgressCell};
use crate::pages::count_pages;
use crate::pipeline::{Batch, EncoderSetup, Engine, EngineSetup, PipelineError, ShardLayout, Writer};
pub use crate::source_vm::SourceVm;
use crate::stats::{process_cpu_seconds, thread_cpu_seconds, IterationStats, MigrationStats};
use crate::transport::{Address, Metered, Pacer, Stream, TransportError};
use crate::wire::{self, FrameKind, Hello, WireError};
use crate::zerocopy::{self, GuestPages};

/// Unhashed pages (512 MiB) above which a converged pre-copy lets the
/// digest catch up before it pauses the guest: hashing in the downtime ran
/// at ~8 GB/s on this 2-core host (4 GiB in 508 ms), so less than this
/// costs the downtime under ~60 ms.
const DIGEST_LAG_PAGES: u64 = 131_072;

/// Times the verification pass may re-send regions before giving up.
const MAX_REPAIR_ROUNDS: u32 = 2;

/// Why a migration failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Connecting.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The stream.
    #[error("migration stream: {0}")]
    Wire(#[from] WireError),
    /// Encoding or sending.
    #[error("migration stream: {0}")]
    Pipeline(#[from] PipelineError),
    /// The destination said no.
    #[error("destination refused: {0}")]
    Refused(String),
    /// A VM operation.
    #[error("VM: {0}")]
    Vm(#[from] tsubame_vmm::VmError),
    /// The VM is not in a state to migrate.
    #[error("the VM is {0}; only a running VM can be migrated")]
    NotRunning(&'static str),
    /// Iterating did not converge and the user asked to abort then.
    #[error("did not converge ({0}) and --abort-if-not-converged was given")]
    NotConverged(String),
    /// The options contradict each other.
    #[error("{0}")]
    BadOptions(String),
    /// COMMIT went out but the destination never confirmed.
    #[error("commit was sent but the destination did not confirm ({0}); the VM stays paused here and may be running at the destination — check it before resuming")]
    CommitUnconfirmed(String),
}

impl From<std::io::Error> for SourceError {
    fn from(e: std::io::Error) -> Self {
        SourceError::Wire(WireError::Io(e))
    }
}

/// Migrates `vm` to `to`. Always returns statistics; `status` says
/// whether it worked. On failure before commit the VM runs again here.
pub fn migrate(vm: &dyn SourceVm, to: &Address, options: &MigrateOptions, progress: &ProgressCell) -> MigrationStats {
    let start = Instant::now();
    let cpu_process = process_cpu_seconds();
    let cpu_thread = thread_cpu_seconds();
    let mut run = SourceRun {
        vm,
        options,
        progress,
        stats: MigrationStats {
            destination: to.to_string(),
            memory_bytes: vm.memory_bytes(),
            pages_total: memory::page_count(vm.memory()),
            ..Default::default()
        },
        committed: false,
        start,
        pending: None,
        pagemap: memory::Pagemap::open().ok(),
        reader: None,
        engine: None,
        bandwidth: Arc::new(AtomicU64::new(0)),
        digest: None,
        auto_converge: AutoConverge::default(),
    };
    progress.update(|p| {
        p.phase = "setup".into();
        p.memory_bytes = vm.memory_bytes();
    });
    let result = run.run(to);
    // Whatever happened, the guest runs at full speed from here (on
    // failure it goes on here; after commit this copy is done with).
    if run.auto_converge.fraction > 0.0 {
        vm.set_throttle(0.0);
    }
    let committed = run.committed;
    run.finish_engine();
    let mut stats = std::mem::take(&mut run.stats);
    stats.total_time_ms = ms(start.elapsed());
    stats.cpu_seconds.source = process_cpu_seconds() - cpu_process;
    stats.cpu_seconds.source_migration_thread = thread_cpu_seconds() - cpu_thread;
    match result {
        Ok(()) => {
            stats.status = "completed".into();
            progress.update(|p| p.phase = "completed".into());
        }
        Err(e) => {
            stats.status = "failed".into();
            // A broken connection often means the destination refused
            // something and hung up: its ERROR frame says what.
            let peer_said = match &e {
                SourceError::Wire(WireError::Io(_)) | SourceError::Pipeline(_) => run.peer_error(),
                _ => None,
            };
            let mut message = match peer_said {
                Some(reason) => format!("destination refused: {reason}"),
                None => error_chain(&e),
            };
            if !committed {
                let _ = vm.set_dirty_logging(false);
                if let Err(resume) = vm.resume() {
                    message.push_str(&format!("; resuming the VM here failed too: {resume}"));
                } else {
                    message.push_str("; the VM keeps running here");
                }
            }
            stats.error = Some(message);
            progress.update(|p| p.phase = "failed".into());
        }
    }
    stats
}

/// "outer: inner: innermost", one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        // `#[error("...: {0}")]` with `#[from]` shows its source already.
        let inner_text = inner.to_string();
        if !text.ends_with(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        source = inner.source();
    }
    text
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct SourceRun<'a> {
    vm: &'a dyn SourceVm,
    options: &'a MigrateOptions,
    progress: &'a ProgressCell,
    stats: MigrationStats,
    committed: bool,
    start: Instant,
    /// Dirty pages still to send when iterating stopped.
    pending: Option<Vec<u64>>,
    /// Tells never-populated (zero) pages apart without reading them.
    pagemap: Option<memory::Pagemap>,
    /// Channel 0's reading half: replies, and a last ERROR frame.
    reader: Option<std::io::BufReader<Stream>>,
    /// The encode and send stages.
    engine: Option<Engine>,
    /// Measured link bandwidth for the codecs' payoff checks (f64 bits).
    bandwidth: Arc<AtomicU64>,
    /// The memory digest, hashed as pages go rather than during downtime.
    digest: Option<digest::BackgroundDigest>,
    /// The guest's throttle, when `auto_converge` is on.
    auto_converge: AutoConverge,
}

impl SourceRun<'_> {
    fn run(&mut self, to: &Address) -> Result<(), SourceError> {
        let vm = self.vm;
        let options = self.options;
        options.check().map_err(SourceError::BadOptions)?;
        match vm.status() {
            tsubame_vmm::VcpuStatus::Running => {}
            other => {
                return Err(SourceError::NotRunning(match other {
                    tsubame_vmm::VcpuStatus::Paused => "paused",
                    tsubame_vmm::VcpuStatus::Halted => "halted",
                    _ => "not running",
                }))
            }
        }
        let layout =
            ShardLayout { batch_pages: options.batch_pages, shards: options.shards(), channels: options.channels };
        let pacer = Pacer::new(options.max_bandwidth);
        let stream = Stream::connect_with(to, options.connect_timeout, &options.security)?;
        stream.set_read_timeout(Some(options.io_timeout))?;
        let reader = self.reader.insert(std::io::BufReader::new(stream.try_clone()?));
        let mut writer: Writer = BufWriter::with_capacity(1 << 20, Metered::new(stream, pacer.clone()));
        let mut frame = Vec::new();

        wire::write_preamble(&mut writer, wire::VERSION)?;
        wire::read_preamble(reader)?;
        let session = session_id();
        let hello = Hello {
            memory_bytes: vm.memory_bytes(),
            page_size: PAGE_SIZE as u32,
            vcpus: 1,
            digest_region: options.digest_region,
            granularity: options.granularity,
            codecs: options.codecs.to_string(),
            session,
            channels: layout.channels,
            shards: layout.shards,
        };
        wire::write_frame(&mut writer, FrameKind::Hello, &hello.encode())?;
        writer.flush()?;
        match wire::read_frame(reader, &mut frame)? {
            FrameKind::Accept => {}
            FrameKind::Error => return Err(SourceError::Refused(String::from_utf8_lossy(&frame).into_owned())),
            other => return Err(WireError::Unexpected { got: other, expected: "ACCEPT" }.into()),
        }
        // The other channels name the session; the destination accepts
        // them only after its ACCEPT.
        let mut writers = vec![writer];
        for channel in 1..layout.channels {
            let stream = Stream::connect_with(to, options.connect_timeout, &options.security)?;
            stream.set_read_timeout(Some(options.io_timeout))?;
            let mut w: Writer = BufWriter::with_capacity(1 << 20, Metered::new(stream.try_clone()?, pacer.clone()));
            wire::write_preamble(&mut w, wire::VERSION)?;
            wire::write_frame(&mut w, FrameKind::Channel, &wire::encode_channel(session, channel))?;
            w.flush()?;
            wire::read_preamble(&mut std::io::BufReader::new(stream))?;
            writers.push(w);
        }
        if options.zero_copy {
            if GuestPages::of(vm.memory()).is_none() {
                return Err(SourceError::BadOptions("--zero-copy needs guest memory in one mapping".into()));
            }
            for w in &writers {
                let fd = crate::pipeline::tcp_fd(w).ok_or_else(|| {
                    SourceError::BadOptions(format!(
                        "--zero-copy needs a plain tcp: connection (no unix:, no --psk-file or --tls-*), not {to}"
                    ))
                })?;
                zerocopy::enable(fd).map_err(|e| {
                    SourceError::BadOptions(format!("--zero-copy: the kernel refused SO_ZEROCOPY ({e})"))
                })?;
            }
        }
        self.stats.setup_time_ms = ms(self.start.elapsed());

        let encoder_setup = EncoderSetup {
            codecs: &options.codecs,
            granularity: options.granularity,
            detector: options.subpage_detector,
            hash_mask: options.subpage_hash_mask,
            pages_total: self.stats.pages_total,
            layout,
            bandwidth: self.bandwidth.clone(),
            gpu: options.gpu,
        };
        self.engine = Some(Engine::start(&self.engine_setup(), &encoder_setup, writers, pacer)?);

        self.precopy()?;
        let mut reader = self.reader.take().expect("set above");
        let result = self.stop_and_copy(&mut reader, &mut frame);
        self.reader = Some(reader);
        result
    }

    fn engine_setup(&self) -> EngineSetup {
        EngineSetup {
            pipelined: self.options.pipeline,
            buffers: self.options.buffers,
            guest: if self.options.zero_copy { GuestPages::of(self.vm.memory()) } else { None },
        }
    }

    fn engine(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("engine runs while migrating")
    }

    /// Stops the pipeline's threads and takes their counters.
    fn finish_engine(&mut self) {
        let Some(engine) = self.engine.take() else { return };
        self.stats.bytes_on_wire = engine.bytes();
        let (encoders, pipeline) = engine.finish(&self.engine_setup());
        for encoder in &encoders {
            self.stats.pages_zero += encoder.zero_pages;
            for (name, s) in encoder.codec_stats().iter() {
                let total = self.stats.codec.entry(name.to_string()).or_default();
                total.pages += s.pages;
                total.bytes_in += s.bytes_in;
                total.bytes_out += s.bytes_out;
            }
            if let Some(sub) = encoder.subpage_stats() {
                self.stats.subpage.get_or_insert_with(|| sub.clone().emptied()).add(sub);
            }
        }
        if let Some(sub) = &mut self.stats.subpage {
            sub.regions_repaired = self.stats.regions_repaired;
        }
        self.stats.pipeline = Some(pipeline);
    }

    /// After a broken connection: the destination's ERROR frame, if it
    /// sent one before hanging up.
    fn peer_error(&mut self) -> Option<String> {
        let reader = self.reader.as_mut()?;
        let _ = reader.get_ref().set_read_timeout(Some(Duration::from_millis(500)));
        let mut frame = Vec::new();
        for _ in 0..4 {
            match wire::read_frame(reader, &mut frame) {
                Ok(FrameKind::Error) => return Some(String::from_utf8_lossy(&frame).into_owned()),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
        None
    }

    /// Iterations while the guest runs; returns with the VM still running.
    fn precopy(&mut self) -> Result<(), SourceError> {
        let vm = self.vm;
        let pages_total = self.stats.pages_total;
        let mut bitmap = vec![0u64; vm.dirty_bitmap_words()];
        vm.set_dirty_logging(true)?;
        if vm.manual_dirty_protect() {
            vm.dirty_log(&mut bitmap)?; // all ones: logging just started
        } else {
            set_all(&mut bitmap, pages_total);
        }
        let mut bandwidth = 0.0f64;
        let mut bytes_per_page = (PAGE_SIZE + crate::pages::RECORD_HEADER) as f64;
        let mut iteration = 0u32;
        loop {
            self.progress.update(|p| {
                p.phase = "iterating".into();
                p.iteration = iteration;
            });
            let it = self.send_dirty(&bitmap, iteration)?;
            self.refresh_digest(&bitmap);
            // Iteration 0 also carries never-touched memory (cheap zero
            // records), which says nothing about what the guest dirties:
            // estimate later rounds from later rounds only.
            if it.index > 0 && it.pages_sent > 0 {
                bytes_per_page = it.bytes_on_wire as f64 / it.pages_sent as f64;
            }
            if it.duration_ms > 1.0 {
                bandwidth = it.bytes_on_wire as f64 / (it.duration_ms / 1e3);
            }
            let bw = self.options.max_bandwidth.map_or(bandwidth, |cap| bandwidth.min(cap as f64)).max(1.0);
            let summary = self.pipeline_summary();
            self.progress.update(|p| {
                p.bandwidth = bw;
                p.pipeline = summary;
            });
            self.bandwidth.store(bw.to_bits(), Ordering::Relaxed);
            let (index, sent) = (it.index, it.bytes_on_wire as f64);
            self.stats.per_iteration.push(it);
            iteration += 1;

            vm.dirty_log(&mut bitmap)?;
            let remaining = count_pages(&bitmap);
            let expected = Duration::from_secs_f64(remaining as f64 * bytes_per_page / bw);
            self.stats.expected_downtime_ms = ms(expected);
            let stop = if remaining == 0 {
                Some(("no-dirty-pages", true))
            } else if expected <= self.options.downtime_limit {
                Some(("converged", true))
            } else if iteration >= self.options.max_iterations {
                Some(("max-iterations", false))
            } else if self.stats.bytes_on_wire > 3 * vm.memory_bytes() {
                Some(("sent-3x-memory", false))
            } else {
                None
            };
            if stop.is_none() && self.options.auto_converge && index > 0 {
                let dirtied = remaining as f64 * bytes_per_page;
                if let Some(fraction) = self.auto_converge.after_iteration(dirtied, sent) {
                    vm.set_throttle(fraction);
                }
            }
            if let Some((reason, converged)) = stop {
                self.stats.stop_reason = reason.into();
                self.stats.converged = converged;
                if !converged && self.options.abort_if_not_converged {
                    return Err(SourceError::NotConverged(reason.into()));
                }
                if converged && self.digest_lags() {
                    // Hash the backlog while the guest still runs: in the
                    // downtime it took 0.3-0.8 s for a 4 GiB VM that
                    // converged in two quick iterations. What the guest
                    // dirties meanwhile joins the final pages.
                    self.progress.update(|p| p.phase = "hashing before the stop".into());
                    let _ = self.digest.as_ref().map(|d| d.hashes());
                }
                // Without manual protect, `bitmap` was cleared in KVM: keep
                // it for stop-and-copy, which ORs in what comes after.
                self.pending = Some(bitmap);
                return Ok(());
            }
        }
    }

    /// Whether the memory digest has so much left to hash that doing it
    /// during the downtime would matter.
    fn digest_lags(&self) -> bool {
        self.digest.as_ref().is_some_and(|d| d.backlog_pages() > DIGEST_LAG_PAGES)
    }

    /// Hands the pages just sent to the digest thread, which hashes them
    /// (all memory the first time) while the next iteration runs.
    fn refresh_digest(&mut self, sent: &[u64]) {
        let vm = self.vm;
        let digest = self
            .digest
            .get_or_insert_with(|| digest::BackgroundDigest::start(vm.memory().clone(), self.options.digest_region));
        digest.mark(sent.to_vec());
    }

    /// Each stage's busy share so far, for the progress bar.
    fn pipeline_summary(&self) -> String {
        self.engine.as_ref().map_or_else(String::new, Engine::summary)
    }

    /// Sends every page whose bit is set, clearing each batch's bits in KVM
    /// right before reading it.
    fn send_dirty(&mut self, bitmap: &[u64], iteration: u32) -> Result<IterationStats, SourceError> {
        let vm = self.vm;
        let started = Instant::now();
        let bytes_before = self.engine().bytes();
        let dirty_pages = count_pages(bitmap);
        let throttle = self.auto_converge.fraction;
        let mut it = IterationStats { index: iteration, dirty_pages, throttle, ..Default::default() };
        let layout = self.engine().layout();
        let words_per_batch = (layout.batch_pages / 64) as usize;
        let mut populated = vec![true; layout.batch_pages as usize];
        let mut remaining = dirty_pages;
        // With `--codec none` even untouched pages go raw: a true baseline.
        let zero_records = self.options.codecs.zero;
        for (batch_index, chunk) in bitmap.chunks(words_per_batch).enumerate() {
            if chunk.iter().all(|&w| w == 0) {
                continue;
            }
            let first_page = (batch_index * words_per_batch * 64) as u64;
            let mut batch = self.engine().take_batch()?;
            let fetch_start = Instant::now();
            batch.clear(iteration, layout.shard(first_page), false);
            batch.by_reference = self.options.zero_copy;
            vm.clear_dirty_log(first_page, chunk)?;
            // Pages the kernel never populated are zeros: don't read them
            // (reading would populate them, and cost a fault each).
            let populated = &mut populated[..chunk.len() * 64];
            if self.pagemap.as_ref().is_none_or(|p| p.populated(vm.memory(), first_page, populated).is_err()) {
                populated.fill(true);
            }
            for (w, &word) in chunk.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let offset = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let index = first_page + offset as u64;
                    // A zero page costs a check in place, not a copy.
                    let backed = !zero_records || (populated[offset] && !memory::page_is_zero(vm.memory(), index));
                    if backed && !batch.by_reference {
                        memory::read_page(vm.memory(), index, batch.next_slot()).map_err(tsubame_vmm::VmError::from)?;
                    }
                    batch.push(index, backed);
                }
            }
            let pages = batch.len() as u64;
            let engine = self.engine();
            engine.fetched(fetch_start.elapsed());
            engine.submit(batch)?;
            remaining = remaining.saturating_sub(pages);
            let wire_bytes = engine.bytes();
            self.progress.update(|p| {
                p.remaining_pages = remaining;
                p.dirty_pages = dirty_pages;
                p.bytes_on_wire = wire_bytes;
            });
        }
        it.pages_sent = self.engine().end_iteration(iteration)?;
        it.bytes_on_wire = self.engine().bytes() - bytes_before;
        it.duration_ms = ms(started.elapsed());
        self.stats.pages_sent += it.pages_sent;
        self.stats.bytes_on_wire = self.engine().bytes();
        self.stats.iterations = iteration + 1;
        Ok(it)
    }
}

impl SourceRun<'_> {
    /// Pauses the guest, sends the last dirty pages, state and digest, and
    /// commits once the destination is ready.
    fn stop_and_copy(&mut self, reader: &mut impl std::io::Read, frame: &mut Vec<u8>) -> Result<(), SourceError> {
        let vm = self.vm;
        let mut pending = self.pending.take().expect("precopy leaves the pending dirty set");
        self.progress.update(|p| p.phase = "stop-and-copy".into());
        let paused = Instant::now();
        let mut lap = paused;
        let mut laps = |slot: &mut f64| {
            let now = Instant::now();
            *slot = ms(now - lap);
            lap = now;
        };
        let mut breakdown = crate::stats::DowntimeBreakdown::default();
        vm.pause()?;
        laps(&mut breakdown.pause_ms);
        let mut fresh = vec![0u64; pending.len()];
        vm.dirty_log(&mut fresh)?;
        if vm.manual_dirty_protect() {
            pending = fresh; // bits stay set in KVM until cleared: a superset
        } else {
            pending.iter_mut().zip(&fresh).for_each(|(p, f)| *p |= f);
        }
        let iteration = self.stats.iterations;
        let it = self.send_dirty(&pending, iteration)?;
        self.stats.per_iteration.push(it);
        laps(&mut breakdown.final_pages_ms);

        // Every channel ended the iteration: channel 0 carries the rest.
        let blob = vm.state_blob()?;
        self.write_control(FrameKind::State, &blob)?;
        laps(&mut breakdown.state_ms);
        // Only the last pages (and what the hasher has not reached) need
        // hashing now.
        self.refresh_digest(&pending);
        let hashes = self.digest.as_ref().expect("pre-copy marked memory").hashes();
        let digest_payload = digest::encode(self.options.digest_region, &hashes);
        self.write_control(FrameKind::Digest, &digest_payload)?;
        self.stats.bytes_on_wire = self.engine().bytes();
        laps(&mut breakdown.source_digest_ms);

        let mut rounds = 0;
        loop {
            match wire::read_frame(reader, frame)? {
                FrameKind::Ready => break,
                FrameKind::Error => return Err(SourceError::Refused(String::from_utf8_lossy(frame).into_owned())),
                FrameKind::Mismatch if rounds < MAX_REPAIR_ROUNDS => {
                    rounds += 1;
                    let regions = digest::decode_mismatch(frame, hashes.len())?;
                    self.resend_regions(&regions, iteration + rounds)?;
                    self.write_control(FrameKind::Digest, &digest_payload)?;
                }
                other => return Err(WireError::Unexpected { got: other, expected: "READY" }.into()),
            }
        }
        self.stats.digest_verified = true;
        laps(&mut breakdown.destination_verify_ms);

        // The point of no return: once COMMIT is out, only the destination
        // may run the VM. A failed write means it cannot have arrived whole.
        self.progress.update(|p| p.phase = "committing".into());
        self.write_control(FrameKind::Commit, &[])?;
        self.committed = true;
        let confirmed = wire::read_frame(reader, frame).map_err(|e| SourceError::CommitUnconfirmed(e.to_string()))?;
        if confirmed != FrameKind::Resumed {
            return Err(SourceError::CommitUnconfirmed(format!("got {confirmed:?} instead of RESUMED")));
        }
        laps(&mut breakdown.commit_ms);
        self.stats.downtime_ms = ms(paused.elapsed());
        self.stats.downtime_breakdown = breakdown;
        if let Some(micros) = frame.get(..8) {
            self.stats.cpu_seconds.destination = u64::from_le_bytes(micros.try_into().unwrap()) as f64 / 1e6;
        }
        self.stats.bytes_on_wire = self.engine().bytes();
        Ok(())
    }

    /// Writes a control frame on channel 0 and flushes it.
    fn write_control(&mut self, kind: FrameKind, payload: &[u8]) -> Result<(), SourceError> {
        let mut writer = self.engine().writer(0);
        wire::write_frame(&mut *writer, kind, payload)?;
        writer.flush()?;
        Ok(())
    }

    /// Sends every page of the given digest regions whole, through the
    /// pages' own shards so the codec caches see them in order: the repair
    /// pass after the destination reported a mismatch.
    fn resend_regions(&mut self, regions: &[u32], iteration: u32) -> Result<(), SourceError> {
        let vm = self.vm;
        let pages_per_region = (self.options.digest_region as usize / PAGE_SIZE) as u64;
        let layout = self.engine().layout();
        let mut batch: Option<Batch> = None;
        let mut batch_first = u64::MAX;
        for &region in regions {
            let first = region as u64 * pages_per_region;
            for index in first..(first + pages_per_region).min(self.stats.pages_total) {
                let chunk_first = index - index % layout.batch_pages;
                if batch.is_some() && chunk_first != batch_first {
                    self.engine().submit(batch.take().unwrap())?;
                }
                if batch.is_none() {
                    let mut fresh = self.engine().take_batch()?;
                    fresh.clear(iteration, layout.shard(chunk_first), true);
                    batch = Some(fresh);
                    batch_first = chunk_first;
                }
                let b = batch.as_mut().unwrap();
                memory::read_page(vm.memory(), index, b.next_slot()).map_err(tsubame_vmm::VmError::from)?;
                b.push(index, true);
            }
        }
        if let Some(b) = batch {
            self.engine().submit(b)?;
        }
        self.stats.pages_sent += self.engine().end_iteration(iteration)?;
        self.stats.regions_repaired += regions.len() as u64;
        Ok(())
    }
}

/// A migration's name on its extra channels: unguessable enough that a
/// stray connection cannot join another migration by accident.
fn session_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.write_u32(std::process::id());
    h.finish()
}

fn set_all(bitmap: &mut [u64], pages: u64) {
    for (i, w) in bitmap.iter_mut().enumerate() {
        let first = i as u64 * 64;
        *w = if first + 64 <= pages { u64::MAX } else { (1u64 << (pages - first)) - 1 };
    }
}
