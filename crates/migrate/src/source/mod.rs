//! The sending side: connect, pre-copy iterations while the guest runs,
//! then stop-and-copy, verify, commit. docs/architecture.md follows a page
//! through these files: [`precopy`] decides what to send and [`fetch`]
//! reads it, [`encode`] and [`send`] (run by [`engine`]) put it on the
//! wire, [`stop`] ends the migration.
//!
//! The VM is never lost: any failure before COMMIT is written resumes the
//! source VM; once COMMIT is written the source never resumes on its own.

pub mod busy;
pub mod choices;
pub mod encode;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod handover;
pub mod link;
pub mod policy;
mod postcopy;
mod precopy;
pub mod send;
mod stop;
mod threads;
pub mod vm;
mod warm;
pub mod zerocopy;

use std::io::{BufWriter, Write};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tsubame_farmem::{FarMemory, FarStats};
use tsubame_vmm::{memory, DirtyBitmap, VcpuStatus, Vm, PAGE_SIZE};

pub use error::{PipelineError, SourceError};
pub use vm::SourceVm;

use self::encode::EncoderSetup;
use self::engine::{Engine, EngineSetup};
use self::fetch::FarFilter;
use self::link::LinkRate;
use self::policy::PrecopyPolicy;
use self::send::{tcp_fd, write_frame_flushed, Writer};
use self::zerocopy::GuestPages;
use crate::digest::{self, FarPageHashes};
use crate::options::{Granularity, MigrateOptions, PostcopyMode, ProgressCell};
use crate::protocol::far::{FarMemory as FarMemoryFrame, FarPages};
use crate::protocol::{
    self, ChannelOpen, ErrorMessage, FrameKind, Hello, ShardLayout, SourceState, WireError, HELLO_FAR_MEMORY,
    HELLO_POSTCOPY,
};
use crate::stats::{process_cpu_seconds, thread_cpu_seconds, FarMigrationStats, MigrationStats, Status};
use crate::transport::{Address, Metered, Pacer, Stream};

/// Migrates `vm` to `to`. Always returns statistics; `status` says
/// whether it worked. On failure before commit the VM runs again here.
pub fn migrate(vm: &dyn SourceVm, to: &Address, options: &MigrateOptions, progress: &ProgressCell) -> MigrationStats {
    migrate_with(vm, None, to, options, progress)
}

/// Migrates a VM with far memory: only its resident pages move, and the
/// map of the pages that live on its memory hosts, which the destination
/// attaches to (eviction stops here for the migration; on failure it goes
/// on, and after commit this side never writes to the exports again).
pub fn migrate_far(
    vm: &Vm,
    far: &FarMemory,
    to: &Address,
    options: &MigrateOptions,
    progress: &ProgressCell,
) -> MigrationStats {
    migrate_with(vm, Some(far), to, options, progress)
}

fn migrate_with(
    vm: &dyn SourceVm,
    far: Option<&FarMemory>,
    to: &Address,
    options: &MigrateOptions,
    progress: &ProgressCell,
) -> MigrationStats {
    let start = Instant::now();
    let cpu_process = process_cpu_seconds();
    let cpu_thread = thread_cpu_seconds();
    let granularity = options.start_granularity();
    let mut run = SourceRun {
        vm,
        options,
        progress,
        stats: MigrationStats {
            destination: to.to_string(),
            memory_bytes: vm.memory_bytes(),
            pages_total: memory::page_count(vm.memory()),
            choices: choices::initial_choices(options, granularity),
            downtime_limit_ms: ms(options.downtime_limit),
            ..Default::default()
        },
        state: SourceState::Setup,
        start,
        pending: None,
        digest_sent: None,
        reader: None,
        engine: None,
        bandwidth: Arc::new(AtomicU64::new(0)),
        digest: None,
        apart: None,
        policy: PrecopyPolicy::for_this_host(),
        urgent: None,
        pacer: None,
        to: to.clone(),
        session: session_id(),
        warm_unsent: None,
        far,
        far_map: None,
        far_filter: None,
        far_start: None,
        held_nonzero: DirtyBitmap::new(memory::page_count(vm.memory())),
    };
    progress.update(|p| {
        p.phase = SourceState::Setup;
        p.memory_bytes = vm.memory_bytes();
    });
    let result = run.run(to, granularity);
    // Before a failure's take_back: eviction would make pages far again.
    if let (Some(far), Some(filter), Some(start)) = (far, &run.far_filter, &run.far_start) {
        run.stats.far_memory = Some(far_stats(far, filter, start));
    }
    // Whatever happened, the guest runs at full speed from here (on
    // failure it goes on here; after commit this copy is done with).
    if run.policy.auto_converge.fraction > 0.0 {
        vm.set_throttle(0.0);
    }
    let committed = run.committed();
    run.finish_engine();
    vm.disk_warm_stop();
    let mut stats = std::mem::take(&mut run.stats);
    stats.total_time_ms = ms(start.elapsed());
    stats.cpu_seconds.source = process_cpu_seconds() - cpu_process;
    stats.cpu_seconds.source_migration_thread = thread_cpu_seconds() - cpu_thread;
    match result {
        Ok(()) => {
            stats.status = Status::Completed;
            progress.update(|p| p.phase = SourceState::Completed);
        }
        Err(e) => {
            stats.status = Status::Failed;
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
                // Far memory keeps the log on: its evictor reads it.
                if far.is_none() {
                    let _ = vm.set_dirty_logging(false);
                }
                if far.is_some_and(|f| f.stats().error.is_some()) {
                    // Its memory host is gone: far memory paused it, and a
                    // resumed guest would only wait on a lost page.
                    message.push_str("; the VM stays paused here (its far memory is lost)");
                } else if let Err(resume) = vm.resume() {
                    message.push_str(&format!("; resuming the VM here failed too: {resume}"));
                } else {
                    message.push_str("; the VM keeps running here");
                }
                // Eviction goes on only now: it pauses the VM for each
                // batch, and a resume of ours in the middle of one would
                // let the guest write to pages being dropped.
                if let Some(far) = far {
                    far.take_back();
                }
            }
            stats.error = Some(message);
            progress.update(|p| p.phase = SourceState::Failed);
        }
    }
    stats
}

/// What became of the far pages: far memory's counters now against
/// `start`, taken with the map, and what `filter` saw sent.
fn far_stats(far: &FarMemory, filter: &FarFilter, start: &FarStats) -> FarMigrationStats {
    let now = far.stats();
    let at_start = filter.far_at_start();
    FarMigrationStats {
        local_limit_bytes: now.local_limit_bytes,
        far_pages_at_start: at_start,
        pages_left_far: filter.left_far(),
        // Nothing is evicted meanwhile: a page of the map that is not far
        // now came back.
        pages_came_back: at_start.saturating_sub(now.far_pages),
        resident_pages_at_start: start.resident_pages,
        resident_pages_at_end: now.resident_pages,
        faults: now.faults.saturating_sub(start.faults),
        readahead_pages: now.readahead_pages.saturating_sub(start.readahead_pages),
        bytes_read: now.bytes_read.saturating_sub(start.bytes_read),
    }
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

/// One migration in progress: the source's state machine.
/// How pre-copy ended.
enum PrecopyEnd {
    /// Stop the guest and send the rest (`self.pending`).
    StopAndCopy,
    /// Hand over to post-copy: the destination lacks `missing` (stale or
    /// never sent); `last_iteration` is the last one ended on every channel.
    Postcopy { missing: DirtyBitmap, last_iteration: Option<u32> },
}

struct SourceRun<'a> {
    vm: &'a dyn SourceVm,
    options: &'a MigrateOptions,
    progress: &'a ProgressCell,
    stats: MigrationStats,
    state: SourceState,
    start: Instant,
    /// Dirty pages still to send when iterating stopped.
    pending: Option<DirtyBitmap>,
    /// The digest sent before the pause: the stop sends what changed.
    digest_sent: Option<Vec<u64>>,
    /// Channel 0's reading half: replies, and a last ERROR frame.
    reader: Option<std::io::BufReader<Stream>>,
    /// The encode and send stages.
    engine: Option<Engine>,
    /// Measured link bandwidth for the codecs' payoff checks (f64 bits).
    bandwidth: Arc<AtomicU64>,
    /// The memory digest, hashed as pages go rather than during downtime.
    digest: Option<digest::BackgroundDigest>,
    /// Every CPU, while the stop keeps the digest's thread apart.
    apart: Option<Vec<usize>>,
    /// When to stop iterating.
    policy: PrecopyPolicy,
    /// The connection kept for the pages a post-copy destination asks for.
    urgent: Option<Stream>,
    /// The data channels' shared pacer.
    pacer: Option<Arc<Pacer>>,
    /// Where the VM goes (a post-copy resume may name another address).
    to: Address,
    /// Names this migration on its extra channels and on a resume.
    session: u64,
    /// The disk cache's blocks named in WARM_BLOCKS whose contents may
    /// still go (WARM_DATA after the first iteration).
    warm_unsent: Option<warm::WarmUnsent>,
    /// The VM's far memory, if it has some.
    far: Option<&'a FarMemory>,
    /// Its map, taken when the migration started: pages that live far are
    /// not sent (unless they come back and change).
    far_map: Option<(FarMemoryFrame, Arc<FarPageHashes>)>,
    /// What the fetcher skips of it.
    far_filter: Option<Arc<FarFilter>>,
    /// Far memory's counters when the map was taken.
    far_start: Option<FarStats>,
    /// Pages the destination may hold other than zeros (sent with data
    /// last): a zero page outside it needs no record at all.
    held_nonzero: DirtyBitmap,
}

impl SourceRun<'_> {
    /// Moves to `state`, which the progress bar and `query-migrate` show.
    fn enter(&mut self, state: SourceState) {
        self.state = state;
        self.progress.update(|p| p.phase = state);
    }

    /// True once COMMIT went out: from then on only the destination may
    /// run the VM.
    fn committed(&self) -> bool {
        matches!(
            self.state,
            SourceState::Committing | SourceState::Completed | SourceState::Postcopy | SourceState::PostcopyPaused
        )
    }

    fn run(&mut self, to: &Address, granularity: Granularity) -> Result<(), SourceError> {
        let vm = self.vm;
        let options = self.options;
        options.check().map_err(SourceError::BadOptions)?;
        // First: its eviction stops the vCPU for moments, and stops no more
        // once the map is handed over.
        if let Some(far) = self.far {
            let map = far.hand_over().map_err(|e| SourceError::FarMemory(e.to_string()))?;
            self.far_start = Some(far.stats());
            let frame = FarMemoryFrame { local_bytes: map.local_bytes, far_pages: map.far.count(), stores: map.stores };
            let pages = Arc::new(FarPageHashes { far: map.far, hashes: map.hashes });
            self.far_filter = Some(Arc::new(FarFilter::new(pages.clone())));
            self.far_map = Some((frame, pages));
        }
        match vm.status() {
            VcpuStatus::Running => {}
            other => {
                return Err(SourceError::NotRunning(match other {
                    VcpuStatus::Paused => "paused",
                    VcpuStatus::Halted => "halted",
                    _ => "not running",
                }))
            }
        }
        let layout =
            ShardLayout { batch_pages: options.batch_pages, shards: options.shards(), channels: options.channels };
        let pacer = Pacer::new(LinkRate::of(options).pacer_rate());
        self.pacer = Some(pacer.clone());
        let writers = self.connect(to, layout, &pacer, granularity)?;
        self.stats.setup_time_ms = ms(self.start.elapsed());

        let encoder_setup = EncoderSetup {
            codecs: &options.codecs,
            granularity,
            detector: options.subpage_detector,
            hash_mask: options.subpage_hash_mask,
            pages_total: self.stats.pages_total,
            layout,
            bandwidth: self.bandwidth.clone(),
            gpu: options.gpu,
            far_pages: self.far_map.as_ref().map(|(_, pages)| &pages.far),
        };
        self.engine = Some(Engine::start(&self.engine_setup(), &encoder_setup, writers, pacer)?);

        self.send_warm_blocks()?;
        self.enter(SourceState::Iterating);
        match self.precopy()? {
            PrecopyEnd::StopAndCopy => self.stop_and_copy(),
            PrecopyEnd::Postcopy { missing, last_iteration } => self.postcopy(missing, last_iteration),
        }
    }

    /// Connects every channel: the handshake, HELLO and ACCEPT on channel 0,
    /// then the others, which name the session.
    fn connect(
        &mut self,
        to: &Address,
        layout: ShardLayout,
        pacer: &Arc<Pacer>,
        granularity: Granularity,
    ) -> Result<Vec<Writer>, SourceError> {
        let options = self.options;
        let stream = Stream::connect_with(to, options.connect_timeout, &options.security)?;
        stream.set_read_timeout(Some(options.io_timeout))?;
        let reader = self.reader.insert(std::io::BufReader::new(stream.try_clone()?));
        let mut writer: Writer = BufWriter::with_capacity(1 << 20, Metered::new(stream, pacer.clone()));
        let mut frame = Vec::new();

        protocol::write_preamble(&mut writer, protocol::VERSION)?;
        protocol::read_preamble(reader)?;
        let session = self.session;
        let hello = Hello {
            memory_bytes: self.vm.memory_bytes(),
            page_size: PAGE_SIZE as u32,
            vcpus: 1,
            digest_region: options.digest_region,
            granularity: granularity.bytes,
            codecs: options.codecs.to_string(),
            session,
            channels: layout.channels,
            shards: layout.shards,
            flags: if options.postcopy == PostcopyMode::Off { 0 } else { HELLO_POSTCOPY }
                | if self.far_map.is_some() { HELLO_FAR_MEMORY } else { 0 },
        };
        write_frame_flushed(&mut writer, FrameKind::Hello, &hello.encode())?;
        let kind = protocol::read_frame(reader, &mut frame)?;
        self.state.check(kind)?;
        if kind == FrameKind::Error {
            return Err(SourceError::Refused(ErrorMessage::decode(&frame).0));
        }
        if let Some((far, pages)) = &self.far_map {
            // Before any page, and before the other channels open: the
            // destination must know which pages live far before it lands one.
            protocol::write_frame(&mut writer, FrameKind::FarMemory, &far.encode())?;
            for run in FarPages::split(&pages.far, &pages.hashes) {
                protocol::write_frame(&mut writer, FrameKind::FarPages, &run.encode())?;
            }
            writer.flush()?;
        }
        // The other channels name the session; the destination accepts
        // them only after its ACCEPT.
        let mut writers = vec![writer];
        for channel in 1..layout.channels {
            let stream = self.open_channel(to, session, channel)?;
            writers.push(BufWriter::with_capacity(1 << 20, Metered::new(stream, pacer.clone())));
        }
        if options.postcopy != PostcopyMode::Off {
            // Asked-for post-copy pages pass the background push on a
            // connection of their own, unpaced.
            self.urgent = Some(self.open_channel(to, session, layout.channels)?);
        }
        if options.zero_copy {
            if GuestPages::of(self.vm.memory()).is_none() {
                return Err(SourceError::BadOptions("--zero-copy needs guest memory in one mapping".into()));
            }
            for w in &writers {
                let fd = tcp_fd(w).ok_or_else(|| {
                    SourceError::BadOptions(format!(
                        "--zero-copy needs a plain tcp: connection (no unix:, no --psk-file or --tls-*), not {to}"
                    ))
                })?;
                zerocopy::enable(fd).map_err(|e| {
                    SourceError::BadOptions(format!("--zero-copy: the kernel refused SO_ZEROCOPY ({e})"))
                })?;
            }
        }
        Ok(writers)
    }

    /// Connects channel `channel` of `session`.
    fn open_channel(&self, to: &Address, session: u64, channel: u16) -> Result<Stream, SourceError> {
        let options = self.options;
        let stream = Stream::connect_with(to, options.connect_timeout, &options.security)?;
        stream.set_read_timeout(Some(options.io_timeout))?;
        let mut w = stream.try_clone()?;
        protocol::write_preamble(&mut w, protocol::VERSION)?;
        write_frame_flushed(&mut w, FrameKind::Channel, &ChannelOpen { session, channel }.encode())?;
        protocol::read_preamble(&mut std::io::BufReader::new(stream.try_clone()?))?;
        Ok(stream)
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

    /// Stops the pipeline's threads and takes their counters; returns the
    /// channels' writers.
    fn finish_engine(&mut self) -> Vec<Writer> {
        let Some(engine) = self.engine.take() else { return Vec::new() };
        self.stats.bytes_on_wire = engine.bytes();
        let (encoders, pipeline, writers) = engine.finish();
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
        choices::granularity_choice(&mut self.stats.choices, self.options, self.stats.subpage.as_ref());
        self.stats.pipeline = Some(pipeline);
        writers
    }

    /// After a broken connection: the destination's ERROR frame, if it
    /// sent one before hanging up.
    fn peer_error(&mut self) -> Option<String> {
        let reader = self.reader.as_mut()?;
        let _ = reader.get_ref().set_read_timeout(Some(Duration::from_millis(500)));
        let mut frame = Vec::new();
        for _ in 0..4 {
            match protocol::read_frame(reader, &mut frame) {
                Ok(FrameKind::Error) => return Some(ErrorMessage::decode(&frame).0),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
        None
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
