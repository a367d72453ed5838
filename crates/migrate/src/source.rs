//! The sending side of pre-copy: iterate over dirty pages until the rest
//! fits the downtime limit, then stop-and-copy, verify, commit.
//!
//! The VM is never lost: any failure before COMMIT is written resumes the
//! source VM; once COMMIT is written the source never resumes on its own.

use std::io::{BufWriter, Write};
use std::time::{Duration, Instant};

use tsubame_vmm::{memory, Vm, PAGE_SIZE};

use crate::digest;
use crate::options::{MigrateOptions, ProgressCell};
use crate::pages::{Encoding, PagesBuilder};
use crate::stats::CodecStats;
use crate::stats::{process_cpu_seconds, thread_cpu_seconds, IterationStats, MigrationStats};
use crate::subpage::{encode_partial, Change, SubpageTracker};
use crate::transport::{Address, Metered, Stream, TransportError};
use crate::wire::{self, FrameKind, Hello, WireError};
use tsubame_codec::batch::BatchCompressor;
use tsubame_codec::chooser::Payoff;
use tsubame_codec::{Encoded, PageEncoder};

/// Page records per PAGES frame.
const RECORDS_PER_FRAME: usize = 256;
/// Dirty-bitmap words handled per clear + send step (1024 pages).
const WORDS_PER_CHUNK: usize = 16;
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
pub fn migrate(vm: &Vm, to: &Address, options: &MigrateOptions, progress: &ProgressCell) -> MigrationStats {
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
        subpage: (options.granularity < PAGE_SIZE as u32).then(|| {
            SubpageTracker::new(
                options.subpage_detector,
                options.granularity,
                memory::page_count(vm.memory()),
                options.subpage_hash_mask,
            )
        }),
        subpage_buf: Vec::with_capacity(8 + PAGE_SIZE),
        encoder: PageEncoder::new(&options.codecs),
        codec_buf: Vec::with_capacity(2 * PAGE_SIZE),
        batch_buf: Vec::new(),
        batch_payoff: Payoff::default(),
        compressor: options.codecs.batch.map(BatchCompressor::new),
        bandwidth: f64::INFINITY,
    };
    progress.update(|p| {
        p.phase = "setup".into();
        p.memory_bytes = vm.memory_bytes();
    });
    let result = run.run(to);
    let committed = run.committed;
    let mut stats = std::mem::take(&mut run.stats);
    stats.subpage = run.subpage.as_ref().map(|t| t.stats.clone());
    stats.codec = run
        .encoder
        .stats
        .iter()
        .map(|(name, s)| {
            (name.to_string(), CodecStats { pages: s.pages, bytes_in: s.bytes_in, bytes_out: s.bytes_out })
        })
        .collect();
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
                SourceError::Wire(WireError::Io(_)) => run.peer_error(),
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
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct SourceRun<'a> {
    vm: &'a Vm,
    options: &'a MigrateOptions,
    progress: &'a ProgressCell,
    stats: MigrationStats,
    committed: bool,
    start: Instant,
    /// Dirty pages still to send when iterating stopped.
    pending: Option<Vec<u64>>,
    /// Tells never-populated (zero) pages apart without reading them.
    pagemap: Option<memory::Pagemap>,
    /// The connection's reading half, kept to hear a last ERROR frame.
    reader: Option<std::io::BufReader<Stream>>,
    /// What the destination holds, per sub-page (granularity < 4096).
    subpage: Option<SubpageTracker>,
    /// Scratch for SUBPAGE record data.
    subpage_buf: Vec<u8>,
    /// The page codecs and their caches.
    encoder: PageEncoder,
    /// Scratch for codec records.
    codec_buf: Vec<u8>,
    /// Scratch for compressed batches.
    batch_buf: Vec<u8>,
    /// Whether batch compression pays at the current bandwidth.
    batch_payoff: Payoff,
    /// lz4/zstd with its context kept between batches.
    compressor: Option<BatchCompressor>,
    /// Current measured bandwidth, bytes per second.
    bandwidth: f64,
}

type Writer = BufWriter<Metered<Stream>>;

impl SourceRun<'_> {
    fn run(&mut self, to: &Address) -> Result<(), SourceError> {
        let vm = self.vm;
        self.options.check().map_err(SourceError::BadOptions)?;
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
        let stream = Stream::connect(to, self.options.connect_timeout)?;
        stream.set_read_timeout(Some(self.options.io_timeout))?;
        let reader = self.reader.insert(std::io::BufReader::new(stream.try_clone()?));
        let mut writer: Writer = BufWriter::with_capacity(1 << 20, Metered::new(stream, self.options.max_bandwidth));
        let mut frame = Vec::new();

        wire::write_preamble(&mut writer, wire::VERSION)?;
        wire::read_preamble(reader)?;
        let hello = Hello {
            memory_bytes: vm.memory_bytes(),
            page_size: PAGE_SIZE as u32,
            vcpus: 1,
            digest_region: self.options.digest_region,
            granularity: self.options.granularity,
            codecs: self.options.codecs.to_string(),
        };
        wire::write_frame(&mut writer, FrameKind::Hello, &hello.encode())?;
        writer.flush()?;
        match wire::read_frame(reader, &mut frame)? {
            FrameKind::Accept => {}
            FrameKind::Error => return Err(SourceError::Refused(String::from_utf8_lossy(&frame).into_owned())),
            other => return Err(WireError::Unexpected { got: other, expected: "ACCEPT" }.into()),
        }
        self.stats.setup_time_ms = ms(self.start.elapsed());

        self.precopy(&mut writer)?;
        let mut reader = self.reader.take().expect("set above");
        let result = self.stop_and_copy(&mut writer, &mut reader, &mut frame);
        self.reader = Some(reader);
        result
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
    fn precopy(&mut self, writer: &mut Writer) -> Result<(), SourceError> {
        let vm = self.vm;
        let pages_total = self.stats.pages_total;
        let mut bitmap = vec![0u64; vm.dirty_bitmap_words()];
        vm.set_dirty_logging(true)?;
        if vm.manual_dirty_protect() {
            vm.dirty_log(&mut bitmap)?; // all ones: logging just started
        } else {
            set_all(&mut bitmap, pages_total);
        }
        let mut builder = PagesBuilder::new(RECORDS_PER_FRAME);
        let mut bandwidth = 0.0f64;
        let mut bytes_per_page = (PAGE_SIZE + crate::pages::RECORD_HEADER) as f64;
        let mut iteration = 0u32;
        loop {
            self.progress.update(|p| {
                p.phase = "iterating".into();
                p.iteration = iteration;
            });
            let it = self.send_dirty(writer, &bitmap, iteration, &mut builder)?;
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
            self.progress.update(|p| p.bandwidth = bw);
            self.bandwidth = bw;
            self.encoder.set_bandwidth(bw);
            self.stats.per_iteration.push(it);
            iteration += 1;

            vm.dirty_log(&mut bitmap)?;
            let remaining = count(&bitmap);
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
            if let Some((reason, converged)) = stop {
                self.stats.stop_reason = reason.into();
                self.stats.converged = converged;
                if !converged && self.options.abort_if_not_converged {
                    return Err(SourceError::NotConverged(reason.into()));
                }
                // Without manual protect, `bitmap` was cleared in KVM: keep
                // it for stop-and-copy, which ORs in what comes after.
                self.pending = Some(bitmap);
                return Ok(());
            }
        }
    }

    /// Sends every page whose bit is set, clearing each chunk's bits in KVM
    /// right before reading it.
    fn send_dirty(
        &mut self,
        writer: &mut Writer,
        bitmap: &[u64],
        iteration: u32,
        builder: &mut PagesBuilder,
    ) -> Result<IterationStats, SourceError> {
        let vm = self.vm;
        let started = Instant::now();
        let bytes_before = writer.get_ref().bytes + writer.buffer().len() as u64;
        let dirty_pages = count(bitmap);
        let mut it = IterationStats { index: iteration, dirty_pages, ..Default::default() };
        let mut page = [0u8; PAGE_SIZE];
        let mut populated = [true; WORDS_PER_CHUNK * 64];
        let mut remaining = dirty_pages;
        // With `--codec none` even untouched pages go raw: a true baseline.
        let zero_records = self.options.codecs.zero;
        builder.reset(iteration);
        for (chunk_index, chunk) in bitmap.chunks(WORDS_PER_CHUNK).enumerate() {
            if chunk.iter().all(|&w| w == 0) {
                continue;
            }
            let first_page = (chunk_index * WORDS_PER_CHUNK * 64) as u64;
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
                    let index = first_page + offset as u64;
                    bits &= bits - 1;
                    let change = if !populated[offset] && zero_records {
                        match &mut self.subpage {
                            Some(tracker) => tracker.diff_zero(index),
                            None => Change::Zero,
                        }
                    } else {
                        memory::read_page(vm.memory(), index, &mut page).map_err(tsubame_vmm::VmError::from)?;
                        match &mut self.subpage {
                            Some(tracker) => tracker.diff(index, &page),
                            None => Change::Full,
                        }
                    };
                    match change {
                        Change::Unchanged => continue,
                        Change::Zero => {
                            builder.push(index, Encoding::Zero, &[]);
                            self.encoder.observe_zero(index);
                            self.stats.pages_zero += 1;
                        }
                        Change::Full => match self.encoder.encode(index, &page, &mut self.codec_buf) {
                            Encoded::Zero => {
                                builder.push(index, Encoding::Zero, &[]);
                                self.stats.pages_zero += 1;
                            }
                            Encoded::Raw => builder.push(index, Encoding::Raw, &page),
                            Encoded::Record(tag) => builder.push(index, Encoding::from_codec_tag(tag), &self.codec_buf),
                        },
                        Change::Partial(mask) => {
                            let g = self.options.granularity as usize;
                            encode_partial(&page, g, mask, &mut self.subpage_buf);
                            builder.push(index, Encoding::Subpage, &self.subpage_buf);
                        }
                    }
                    it.pages_sent += 1;
                    if builder.len() as usize == RECORDS_PER_FRAME {
                        self.write_pages(writer, builder.payload())?;
                        builder.reset(iteration);
                    }
                }
            }
            remaining = remaining.saturating_sub(chunk.iter().map(|w| w.count_ones() as u64).sum());
            let wire_bytes = writer.get_ref().bytes;
            self.progress.update(|p| {
                p.remaining_pages = remaining;
                p.dirty_pages = dirty_pages;
                p.bytes_on_wire = wire_bytes;
            });
        }
        if !builder.is_empty() {
            self.write_pages(writer, builder.payload())?;
            builder.reset(iteration);
        }
        let mut end = Vec::with_capacity(20);
        end.extend_from_slice(&iteration.to_le_bytes());
        end.extend_from_slice(&it.pages_sent.to_le_bytes());
        wire::write_frame(writer, FrameKind::IterationEnd, &end)?;
        writer.flush()?;
        it.bytes_on_wire = writer.get_ref().bytes - bytes_before;
        it.duration_ms = ms(started.elapsed());
        self.stats.pages_sent += it.pages_sent;
        self.stats.bytes_on_wire = writer.get_ref().bytes;
        self.stats.iterations = iteration + 1;
        Ok(it)
    }
}

impl SourceRun<'_> {
    /// Pauses the guest, sends the last dirty pages, state and digest, and
    /// commits once the destination is ready.
    fn stop_and_copy(
        &mut self,
        writer: &mut Writer,
        reader: &mut impl std::io::Read,
        frame: &mut Vec<u8>,
    ) -> Result<(), SourceError> {
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
        let mut builder = PagesBuilder::new(RECORDS_PER_FRAME);
        let it = self.send_dirty(writer, &pending, iteration, &mut builder)?;
        self.stats.per_iteration.push(it);
        laps(&mut breakdown.final_pages_ms);

        let state = vm.save_state()?;
        let blob = postcard::to_stdvec(&state).expect("VM state serializes");
        wire::write_frame(writer, FrameKind::State, &blob)?;
        writer.flush()?;
        laps(&mut breakdown.state_ms);
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let hashes = digest::memory_digest(vm.memory(), self.options.digest_region, threads);
        wire::write_frame(writer, FrameKind::Digest, &digest::encode(self.options.digest_region, &hashes))?;
        writer.flush()?;
        self.stats.bytes_on_wire = writer.get_ref().bytes;
        laps(&mut breakdown.source_digest_ms);

        let digest_payload = digest::encode(self.options.digest_region, &hashes);
        let mut rounds = 0;
        loop {
            match wire::read_frame(reader, frame)? {
                FrameKind::Ready => break,
                FrameKind::Error => return Err(SourceError::Refused(String::from_utf8_lossy(frame).into_owned())),
                FrameKind::Mismatch if rounds < MAX_REPAIR_ROUNDS => {
                    rounds += 1;
                    let regions = digest::decode_mismatch(frame, hashes.len())?;
                    self.resend_regions(writer, &regions, iteration + rounds)?;
                    wire::write_frame(writer, FrameKind::Digest, &digest_payload)?;
                    writer.flush()?;
                }
                other => return Err(WireError::Unexpected { got: other, expected: "READY" }.into()),
            }
        }
        self.stats.digest_verified = true;
        laps(&mut breakdown.destination_verify_ms);

        // The point of no return: once COMMIT is out, only the destination
        // may run the VM. A failed write means it cannot have arrived whole.
        self.progress.update(|p| p.phase = "committing".into());
        wire::write_frame(writer, FrameKind::Commit, &[])?;
        writer.flush()?;
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
        self.stats.bytes_on_wire = writer.get_ref().bytes;
        Ok(())
    }
}

impl SourceRun<'_> {
    /// Sends every page of the given digest regions whole: the repair pass
    /// after the destination reported a mismatch.
    fn resend_regions(&mut self, writer: &mut Writer, regions: &[u32], iteration: u32) -> Result<(), SourceError> {
        let vm = self.vm;
        let pages_per_region = (self.options.digest_region as usize / PAGE_SIZE) as u64;
        let mut builder = PagesBuilder::new(RECORDS_PER_FRAME);
        builder.reset(iteration);
        let mut page = [0u8; PAGE_SIZE];
        for &region in regions {
            let first = region as u64 * pages_per_region;
            for index in first..(first + pages_per_region).min(self.stats.pages_total) {
                memory::read_page(vm.memory(), index, &mut page).map_err(tsubame_vmm::VmError::from)?;
                if let Some(tracker) = &mut self.subpage {
                    tracker.set(index, &page);
                }
                self.encoder.observe_raw(index, &page);
                builder.push(index, Encoding::Raw, &page);
                self.stats.pages_sent += 1;
                if builder.len() as usize == RECORDS_PER_FRAME {
                    wire::write_frame(writer, FrameKind::Pages, builder.payload())?;
                    builder.reset(iteration);
                }
            }
        }
        if !builder.is_empty() {
            wire::write_frame(writer, FrameKind::Pages, builder.payload())?;
        }
        self.stats.regions_repaired += regions.len() as u64;
        if let Some(tracker) = &mut self.subpage {
            tracker.stats.regions_repaired += regions.len() as u64;
        }
        Ok(())
    }
}

impl SourceRun<'_> {
    /// Writes a PAGES payload, compressed with lz4/zstd when the stream
    /// uses one, it shrinks the batch, and it pays at this bandwidth.
    fn write_pages(&mut self, writer: &mut Writer, payload: &[u8]) -> Result<(), SourceError> {
        if let Some(compressor) = &mut self.compressor {
            if self.batch_payoff.enabled() {
                let start = Instant::now();
                let codec = compressor.codec();
                self.batch_buf.clear();
                self.batch_buf.push(codec.id());
                self.batch_buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
                let mut packed = std::mem::take(&mut self.codec_buf);
                compressor.compress(payload, &mut packed);
                self.batch_buf.extend_from_slice(&packed);
                self.codec_buf = packed;
                self.batch_payoff.record(
                    start.elapsed().as_secs_f64(),
                    payload.len(),
                    self.batch_buf.len().min(payload.len()),
                    self.bandwidth,
                );
                if self.batch_buf.len() < payload.len() {
                    self.encoder.count_batch(codec.name(), payload.len(), self.batch_buf.len());
                    wire::write_frame(writer, FrameKind::PagesCompressed, &self.batch_buf)?;
                    return Ok(());
                }
            }
        }
        wire::write_frame(writer, FrameKind::Pages, payload)?;
        Ok(())
    }
}

fn count(bitmap: &[u64]) -> u64 {
    bitmap.iter().map(|w| w.count_ones() as u64).sum()
}

fn set_all(bitmap: &mut [u64], pages: u64) {
    for (i, w) in bitmap.iter_mut().enumerate() {
        let first = i as u64 * 64;
        *w = if first + 64 <= pages { u64::MAX } else { (1u64 << (pages - first)) - 1 };
    }
}
