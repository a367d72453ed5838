//! Post-copy at the destination: the VM runs while its missing pages
//! arrive. Guest memory is registered for missing-page faults
//! (`tsubame_vmm::uffd`); the fault thread asks the source for each page
//! a guest (or a VMM thread) touches and installs known-zero pages itself;
//! whichever connection brings a page installs it, which wakes the waiting
//! threads. Once every page is in, the memory as received is compared
//! with the source's digest page by page (the guest has been writing to
//! it meanwhile, so it cannot be hashed again) and the source is told.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crossbeam_channel::{Receiver, Sender};
use std::time::{Duration, Instant};

use tsubame_farmem::FarReader;
use tsubame_vmm::memory::{self, GuestMemory};
use tsubame_vmm::uffd::{FaultStats, Installed, PageFaults};
use tsubame_vmm::{DirtyBitmap, PAGE_SIZE};
use vm_memory::bitmap::AtomicBitmap;

use super::error::ReceiveError;
use crate::digest::{page_hash, region_hashes, zero_page_hash, FarPageHashes};
use crate::protocol::pages::{for_each_record, Encoding};
use crate::protocol::{
    self, Digest, ErrorMessage, FrameKind, PageRequest, PostcopyDone, ReceiverState, Resume, ResumeAck, WireError,
};
use crate::stats::process_cpu_seconds;
use crate::transport::{Listener, Security, Stream};

/// A channel back to the source, shared by the receiver and the fault
/// thread.
pub type BackChannel = Arc<Mutex<Box<dyn Write + Send>>>;

/// What a finished post-copy phase saw.
#[derive(Debug, Clone)]
pub struct PostcopyOutcome {
    /// Faults and their service times.
    pub faults: FaultStats,
    /// Pages asked of the source.
    pub requested: u64,
    /// The guest's ops per second during the phase (0: not watched).
    pub guest_ops_per_sec: f64,
    /// The phase's length.
    pub duration: Duration,
    /// Times a cut link came back.
    pub resumes: u64,
}

/// The guest's progress counter, with where it stood when watching began.
type GuestOps = (Box<dyn Fn() -> u64 + Send + Sync>, u64, Instant);

/// What the post-copy threads share.
pub(super) struct PostcopyShared {
    faults: Arc<PageFaults>,
    /// A VM with far memory: its far pages, read from the memory host when
    /// touched. Memory stays registered once every page is here: far
    /// memory takes the registration over.
    far: Option<(Mutex<FarReader>, Arc<FarPageHashes>)>,
    mem: Arc<GuestMemory>,
    pages: u64,
    /// Pages still missing here.
    missing: AtomicBitmap,
    remaining: AtomicU64,
    /// Each page's hash as received (or as held at the switch).
    page_hashes: Vec<AtomicU64>,
    /// Pages asked for and not arrived yet.
    requested: Mutex<HashSet<u64>>,
    requests_sent: AtomicU64,
    back: BackChannel,
    /// Every page is here (`remaining` reached zero), or a failure.
    settled: (Mutex<bool>, Condvar),
    failure: Mutex<Option<String>>,
    stop: AtomicBool,
    guest_ops: Mutex<Option<GuestOps>>,
    started: Instant,
    cpu_at_start: f64,
    /// False while the link to the source is cut.
    link_up: AtomicBool,
    /// How long a cut link is waited for.
    timeout: Duration,
    /// Times the link came back.
    resumes: AtomicU64,
}

impl PostcopyShared {
    /// Registers `mem` for faults, drops the `missing` pages, and takes the
    /// page hashes of what is held (`held_hashes`, from the digest).
    pub(super) fn start(
        mem: Arc<GuestMemory>,
        missing: &DirtyBitmap,
        held_hashes: Vec<u64>,
        back: BackChannel,
        timeout: Duration,
        far: Option<(FarReader, Arc<FarPageHashes>)>,
    ) -> Result<Arc<PostcopyShared>, ReceiveError> {
        let faults = PageFaults::register(&mem).map_err(|e| ReceiveError::Postcopy(e.to_string()))?;
        faults.discard_set(missing).map_err(|e| ReceiveError::Postcopy(e.to_string()))?;
        let pages = memory::page_count(&mem);
        let marks = AtomicBitmap::new(pages as usize * PAGE_SIZE, NonZeroUsize::new(PAGE_SIZE).expect("non-zero"));
        for p in missing.iter() {
            marks.set_bit(p as usize);
        }
        Ok(Arc::new(PostcopyShared {
            faults: Arc::new(faults),
            far: far.map(|(reader, map)| (Mutex::new(reader), map)),
            mem,
            pages,
            missing: marks,
            remaining: AtomicU64::new(missing.count()),
            page_hashes: held_hashes.into_iter().map(AtomicU64::new).collect(),
            requested: Mutex::default(),
            requests_sent: AtomicU64::new(0),
            back,
            settled: (Mutex::new(missing.is_empty()), Condvar::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            guest_ops: Mutex::new(None),
            started: Instant::now(),
            cpu_at_start: process_cpu_seconds(),
            link_up: AtomicBool::new(true),
            timeout,
            resumes: AtomicU64::new(0),
        }))
    }

    /// Pages of guest memory.
    pub(super) fn pages(&self) -> u64 {
        self.pages
    }

    /// Drops the pages of `more` too: they went stale at the source since
    /// the last look. Only before the VM runs here (nothing faults yet).
    pub(super) fn add_missing(&self, more: &DirtyBitmap) -> Result<(), ReceiveError> {
        let mut new = DirtyBitmap::new(self.pages);
        for p in more.iter().filter(|&p| !self.missing.is_bit_set(p as usize)) {
            new.set(p);
        }
        self.faults.discard_set(&new).map_err(|e| ReceiveError::Postcopy(e.to_string()))?;
        for p in new.iter() {
            self.missing.set_bit(p as usize);
        }
        let added = new.count();
        if added > 0 {
            self.remaining.fetch_add(added, Ordering::AcqRel);
            *self.settled.0.lock().unwrap() = false;
        }
        Ok(())
    }

    /// Installs the pages of a POSTCOPY_PAGES frame (raw and zero records).
    /// Pages may come twice (asked for and pushed); once every page is
    /// here the rest are duplicates and are dropped.
    pub(super) fn install_frame(&self, payload: &[u8]) -> Result<(), ReceiveError> {
        for_each_record(payload, self.pages, PAGE_SIZE, |record| {
            if self.remaining.load(Ordering::Acquire) == 0 {
                return Ok(());
            }
            let page = record.page_index;
            let (installed, hash) = match record.encoding {
                Encoding::Raw => {
                    let data: &[u8; PAGE_SIZE] = record.data.try_into().expect("checked length");
                    (self.faults.install(page, data), page_hash(data))
                }
                Encoding::Zero => (self.faults.install_zero(page), zero_page_hash()),
                other => {
                    return Err(WireError::bad("postcopy_pages.encoding", format!("{other:?} (raw or zero only)")))
                }
            };
            let installed = match installed {
                Ok(installed) => installed,
                // The last page came meanwhile and memory was unregistered.
                Err(_) if self.remaining.load(Ordering::Acquire) == 0 => return Ok(()),
                Err(e) => return Err(WireError::bad("postcopy_pages.page", e.to_string())),
            };
            if installed == Installed::Now && self.missing.is_bit_set(page as usize) {
                self.missing.reset_bit(page as usize);
                self.page_hashes[page as usize].store(hash, Ordering::Relaxed);
                self.requested.lock().unwrap().remove(&page);
                if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                    // Every page is here: faults are the kernel's again (a
                    // page never populated reads as zeros), and huge pages
                    // may back memory from now on. Not with far memory,
                    // which takes the registration over.
                    if self.far.is_none() {
                        let _ = self.faults.unregister();
                        memory::advise_hugepages(&self.mem);
                    }
                    self.settle();
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    fn settle(&self) {
        *self.settled.0.lock().unwrap() = true;
        self.settled.1.notify_all();
    }

    /// Ends the phase with a failure (the first one counts). The missing
    /// pages stay unresolvable: the guest blocks on them rather than read
    /// zeros (the VM is lost, never corrupted).
    pub(super) fn fail(&self, why: String) {
        self.failure.lock().unwrap().get_or_insert(why);
        if self.remaining.load(Ordering::Acquire) > 0 {
            let _ = self.faults.freeze();
        }
        self.stop.store(true, Ordering::Release);
        self.settle();
    }

    /// Serves faults until every page is here or the phase fails: asks the
    /// source for missing pages, installs known-zero ones. While the link
    /// is cut the asked-for pages wait in `requested`; they are asked
    /// again when it comes back.
    fn fault_loop(&self) {
        let mut faults = Vec::new();
        let mut ask = Vec::new();
        while !self.stop.load(Ordering::Acquire) && self.remaining.load(Ordering::Acquire) > 0 {
            if let Err(e) = self.faults.wait_faults(Duration::from_millis(50), &mut faults) {
                self.fail(format!("serving page faults: {e}"));
                return;
            }
            {
                let mut requested = self.requested.lock().unwrap();
                for fault in faults.drain(..) {
                    if self.missing.is_bit_set(fault.page as usize) {
                        if requested.insert(fault.page) {
                            ask.push(fault.page);
                        }
                    } else if let Err(e) = self.install_not_missing(fault.page) {
                        drop(requested);
                        self.fail(e);
                        return;
                    }
                }
            }
            if !ask.is_empty() && self.link_up.load(Ordering::Acquire) {
                // A failed ask is a cut link: channel 0's reader reports
                // it and the phase waits for it to come back.
                let _ = self.ask(&ask);
            }
            ask.clear();
        }
    }

    /// Installs a page the source does not send: its far copy for a far
    /// page, else zeros (never populated, never missing).
    fn install_not_missing(&self, page: u64) -> Result<(), String> {
        match &self.far {
            Some((reader, map)) if map.far.get(page) => {
                let mut data = [0u8; PAGE_SIZE];
                let hash = map.hashes[page as usize];
                reader.lock().unwrap().read_page(page, hash, &mut data).map_err(|e| e.to_string())?;
                self.faults.install(page, &data).map(drop).map_err(|e| format!("installing a far page: {e}"))
            }
            _ => self.faults.install_zero(page).map(drop).map_err(|e| format!("installing a zero page: {e}")),
        }
    }

    /// Asks the source for `pages`.
    fn ask(&self, pages: &[u64]) -> std::io::Result<()> {
        let mut back = self.back.lock().unwrap();
        for chunk in pages.chunks(protocol::MAX_REQUEST) {
            let request = PageRequest { pages: chunk.to_vec() }.encode();
            protocol::write_frame(&mut *back, FrameKind::PageRequest, &request)?;
            self.requests_sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        back.flush()
    }

    /// True when every page is here (or the phase failed).
    fn settled(&self) -> bool {
        *self.settled.0.lock().unwrap()
    }

    /// The pages still missing.
    fn missing_now(&self) -> DirtyBitmap {
        let mut missing = DirtyBitmap::new(self.pages);
        for p in 0..self.pages {
            if self.missing.is_bit_set(p as usize) {
                missing.set(p);
            }
        }
        missing
    }

    /// The digest of memory as received, from every page's hash.
    fn digest(&self, region: u32) -> Vec<u64> {
        let pages: Vec<u64> = self.page_hashes.iter().map(|h| h.load(Ordering::Relaxed)).collect();
        region_hashes(&pages, region)
    }
}

/// A post-copy migration in progress: the VM runs here while its missing
/// pages arrive.
pub struct PostcopyHandle {
    shared: Arc<PostcopyShared>,
    thread: std::thread::JoinHandle<Result<PostcopyOutcome, ReceiveError>>,
}

impl std::fmt::Debug for PostcopyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PostcopyHandle({} pages missing)", self.shared.remaining.load(Ordering::Relaxed))
    }
}

impl PostcopyHandle {
    /// Guest memory's registration for faults: with far memory, it takes
    /// it over once the phase is done (until then faults wait).
    pub fn page_faults(&self) -> Arc<PageFaults> {
        self.shared.faults.clone()
    }

    /// Lets the phase measure the guest's progress (its ops counter).
    pub fn watch_guest(&self, ops: Box<dyn Fn() -> u64 + Send + Sync>) {
        let now = ops();
        *self.shared.guest_ops.lock().unwrap() = Some((ops, now, Instant::now()));
    }

    /// True once the phase ended (done or failed).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for every page to arrive and the digest to compare.
    pub fn wait(self) -> Result<PostcopyOutcome, ReceiveError> {
        self.thread.join().unwrap_or_else(|_| Err(ReceiveError::Postcopy("the post-copy thread failed".into())))
    }
}

/// How a cut link comes back: the source reconnects to this listener and
/// names its session.
pub(super) struct Reconnect {
    /// A handle on the listener the migration came in on.
    pub(super) listener: Listener,
    /// What a reconnecting source must pass.
    pub(super) security: Security,
    /// The migration's HELLO session.
    pub(super) session: u64,
    /// The request connection's channel number.
    pub(super) urgent_channel: u16,
}

/// What channel 0's reader threads and the acceptor tell the phase.
enum Event {
    Frame(FrameKind, Vec<u8>),
    /// Channel 0 of the given link (0 first, 1 after the first resume...)
    /// broke.
    Lost(u64, String),
    /// A reconnected channel 0: its stream.
    Resumed(Stream),
}

/// Reads channel 0's frames on a thread of its own, so the phase can wait
/// for frames, a reconnection and its deadlines at once.
fn spawn_reader(mut reader: Box<dyn Read + Send>, link: u64, events: Sender<Event>) {
    let _ = std::thread::Builder::new().name("postcopy-ch0".into()).spawn(move || loop {
        let mut frame = Vec::new();
        match protocol::read_frame(&mut reader, &mut frame) {
            Ok(kind) => {
                if events.send(Event::Frame(kind, frame)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = events.send(Event::Lost(link, format!("link to the source lost: {e}")));
                return;
            }
        }
    });
}

/// Reads a request connection's POSTCOPY_PAGES until it closes.
fn spawn_urgent(shared: Arc<PostcopyShared>, stream: Stream) {
    let _ = std::thread::Builder::new().name("postcopy-urgent".into()).spawn(move || {
        let mut reader = std::io::BufReader::with_capacity(256 << 10, stream);
        let mut frame = Vec::new();
        while !shared.stop.load(Ordering::Acquire) {
            match protocol::read_frame(&mut reader, &mut frame) {
                Ok(FrameKind::PostcopyPages) => {
                    if let Err(e) = shared.install_frame(&frame) {
                        shared.fail(format!("request connection: {e}"));
                    }
                }
                Ok(other) => shared.fail(format!("request connection: unexpected {other:?}")),
                // The source closes it when done; channel 0 tells a cut.
                Err(_) => return,
            }
        }
    });
}

/// Takes reconnections: a RESUME of channel 0 goes to the phase (after
/// RESUME_ACK with the pages still missing), one of the request channel
/// gets a reader; anything else is refused.
fn spawn_acceptor(shared: Arc<PostcopyShared>, reconnect: Reconnect, events: Sender<Event>) {
    let _ = std::thread::Builder::new().name("postcopy-accept".into()).spawn(move || {
        let stop = || shared.stop.load(Ordering::Acquire);
        while !stop() {
            let Ok(Some(stream)) = reconnect.listener.accept_until(&stop) else { continue };
            let Ok(stream) = reconnect.security.accepted(stream) else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let result = (|| -> Result<Option<Stream>, ReceiveError> {
                let mut io = stream.try_clone()?;
                protocol::read_preamble(&mut io)?;
                protocol::write_preamble(&mut io, protocol::VERSION)?;
                let mut frame = Vec::new();
                let resume = match protocol::read_frame(&mut io, &mut frame)? {
                    FrameKind::Resume => Resume::decode(&frame)?,
                    other => return Err(WireError::Unexpected { got: other, expected: "RESUME" }.into()),
                };
                if resume.session != reconnect.session {
                    let refusal = ErrorMessage("no post-copy migration of that session here".into()).encode();
                    let _ = protocol::write_frame(&mut io, FrameKind::Error, &refusal);
                    return Ok(None);
                }
                if resume.channel == reconnect.urgent_channel {
                    spawn_urgent(shared.clone(), stream.try_clone()?);
                    return Ok(None);
                }
                let ack = ResumeAck { missing: shared.missing_now() }.encode();
                protocol::write_frame(&mut io, FrameKind::ResumeAck, &ack)?;
                io.flush()?;
                Ok(Some(stream.try_clone()?))
            })();
            if let Ok(Some(stream)) = result {
                let _ = stream.set_read_timeout(None);
                if events.send(Event::Resumed(stream)).is_err() {
                    return;
                }
            }
        }
    });
}

/// Runs the post-copy phase on its threads: faults, channel 0 (pages,
/// the digest), the request connection, and taking back a cut link.
pub(super) fn run(
    shared: Arc<PostcopyShared>,
    channel0: Box<dyn Read + Send>,
    urgent: Option<Stream>,
    digest_region: u32,
    reconnect: Option<Reconnect>,
) -> PostcopyHandle {
    let faults = {
        let shared = shared.clone();
        std::thread::Builder::new().name("postcopy-faults".into()).spawn(move || shared.fault_loop())
    };
    if let Some(stream) = urgent {
        spawn_urgent(shared.clone(), stream);
    }
    let (events_tx, events) = crossbeam_channel::unbounded();
    spawn_reader(channel0, 0, events_tx.clone());
    let can_resume = reconnect.is_some();
    if let Some(reconnect) = reconnect {
        spawn_acceptor(shared.clone(), reconnect, events_tx.clone());
    }
    let main = shared.clone();
    let thread = std::thread::Builder::new()
        .name("postcopy".into())
        .spawn(move || {
            let result = phase(&main, &events, &events_tx, digest_region, can_resume);
            main.stop.store(true, Ordering::Release);
            if let Ok(handle) = faults {
                let _ = handle.join();
            }
            result
        })
        .expect("spawn post-copy thread");
    PostcopyHandle { shared, thread }
}

/// The phase: pages and the source's digest from channel 0 (and from
/// channel 0 again after a cut), until every page is here; then the
/// comparison and POSTCOPY_DONE.
fn phase(
    shared: &PostcopyShared,
    events: &Receiver<Event>,
    events_tx: &Sender<Event>,
    region: u32,
    can_resume: bool,
) -> Result<PostcopyOutcome, ReceiveError> {
    let fail = |why: String| {
        shared.fail(why.clone());
        ReceiveError::Postcopy(why)
    };
    let regions = (shared.pages * PAGE_SIZE as u64).div_ceil(region as u64) as usize;
    let mut theirs = None;
    let mut cut_at: Option<(Instant, String)> = None;
    // Which link is current: a late report that an older one broke (its
    // reader noticed after the source had reconnected) is no cut.
    let mut link = 0u64;
    loop {
        if shared.settled() {
            if let Some(why) = shared.failure.lock().unwrap().clone() {
                return Err(ReceiveError::Postcopy(why));
            }
            if theirs.is_some() && cut_at.is_none() {
                break;
            }
        }
        if let Some((at, why)) = &cut_at {
            if at.elapsed() > shared.timeout {
                return Err(fail(format!("{why}, and it did not come back within {} s", shared.timeout.as_secs())));
            }
        }
        match events.recv_timeout(Duration::from_millis(100)) {
            Ok(Event::Frame(kind, frame)) => {
                if kind == FrameKind::Error {
                    return Err(fail(format!("the source gave up: {}", ErrorMessage::decode(&frame).0)));
                }
                ReceiverState::Postcopy.check(kind).map_err(|e| fail(e.to_string()))?;
                match kind {
                    FrameKind::PostcopyPages => shared.install_frame(&frame).map_err(|e| fail(e.to_string()))?,
                    _ => theirs = Some(Digest::decode(&frame, region, regions).map_err(|e| fail(e.to_string()))?),
                }
            }
            Ok(Event::Lost(of, _)) if of != link => {}
            Ok(Event::Lost(_, why)) => {
                if !can_resume {
                    return Err(fail(why));
                }
                shared.link_up.store(false, Ordering::Release);
                cut_at.get_or_insert((Instant::now(), why));
            }
            Ok(Event::Resumed(stream)) => {
                // The source sends what is missing and its digest again.
                let reader = Box::new(std::io::BufReader::with_capacity(1 << 20, stream.try_clone()?));
                *shared.back.lock().unwrap() = Box::new(stream);
                link += 1;
                spawn_reader(reader, link, events_tx.clone());
                shared.resumes.fetch_add(1, Ordering::Relaxed);
                cut_at = None;
                shared.link_up.store(true, Ordering::Release);
                let asked: Vec<u64> = shared.requested.lock().unwrap().iter().copied().collect();
                if !asked.is_empty() && shared.ask(&asked).is_err() {
                    shared.link_up.store(false, Ordering::Release);
                }
            }
            Err(_) => {}
        }
    }
    let theirs = theirs.expect("checked above");
    let ours = shared.digest(region);
    let differing = theirs.differing(&ours);
    let stats = shared.faults.stats();
    let duration = shared.started.elapsed();
    let guest_ops_per_sec = match &*shared.guest_ops.lock().unwrap() {
        Some((ops, at_start, since)) => ops().saturating_sub(*at_start) as f64 / since.elapsed().as_secs_f64(),
        None => 0.0,
    };
    let requested = shared.requests_sent.load(Ordering::Relaxed);
    let done = PostcopyDone {
        mismatched: differing.len() as u32,
        faults: stats.faults,
        requested,
        latency_p50_us: stats.latency_p50_us,
        latency_p99_us: stats.latency_p99_us,
        latency_max_us: stats.latency_max_us,
        cpu_micros: ((process_cpu_seconds() - shared.cpu_at_start) * 1e6) as u64,
        guest_ops_per_sec,
    };
    {
        let mut back = shared.back.lock().unwrap();
        let _ = protocol::write_frame(&mut *back, FrameKind::PostcopyDone, &done.encode()).and_then(|_| back.flush());
    }
    if let Some(&first) = differing.first() {
        return Err(ReceiveError::DigestMismatch {
            count: differing.len(),
            total: ours.len(),
            first: first as u64 * region as u64,
        });
    }
    let resumes = shared.resumes.load(Ordering::Relaxed);
    Ok(PostcopyOutcome { faults: stats, requested, guest_ops_per_sec, duration, resumes })
}
