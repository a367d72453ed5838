//! Post-copy at the destination: the VM runs while its missing pages
//! arrive. Guest memory is registered for missing-page faults
//! (`tsubame_vmm::uffd`); the fault thread asks the source for each page
//! a guest (or a VMM thread) touches and installs known-zero pages itself;
//! whichever connection brings a page installs it, which wakes the waiting
//! threads. Once every page is in, the memory as received is compared
//! with the source's digest page by page (the guest has been writing to
//! it meanwhile, so it cannot be hashed again) and the source is told.

pub mod fuzz;
mod link;
mod shared;

use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use tsubame_vmm::uffd::{FaultStats, PageFaults};
use tsubame_vmm::PAGE_SIZE;

pub(crate) use self::link::Reconnect;
use self::link::{spawn_acceptor, spawn_reader, spawn_urgent, tell_done_apart, Event};
pub use self::shared::BackChannel;
pub(crate) use self::shared::{write_flushed, PostcopyShared, Unpacker};
use crate::destination::error::ReceiveError;
use crate::protocol::{self, Digest, ErrorMessage, FrameKind, PostcopyDone, ReceiverState};
use crate::stats::process_cpu_seconds;
use crate::transport::Stream;

/// Frames read from channel 0 and not yet installed, at most.
const EVENTS_QUEUED: usize = 4;

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
        std::thread::Builder::new().name("postcopy-faults".into()).spawn(move || {
            // A vCPU waiting on a page waits for this thread: it runs
            // first (it blocks on the fault descriptor between faults).
            let _realtime = tsubame_vmm::cpu_time::realtime_thread();
            shared.fault_loop()
        })
    };
    if let Some(stream) = urgent {
        spawn_urgent(shared.clone(), stream);
    }
    // Few frames between channel 0's reader and their installing: the
    // source counts a page the push took as on its way and does not send
    // it again when asked, so a fault on one waits for every frame queued
    // ahead of it (unbounded, a push compressed 25 to 1 ran 100+ ms ahead
    // of the installs). Full, the queue holds the reader, TCP the push.
    let (events_tx, events) = crossbeam_channel::bounded(EVENTS_QUEUED);
    spawn_reader(channel0, 0, events_tx.clone());
    let can_resume = reconnect.is_some();
    if let Some(reconnect) = reconnect {
        spawn_acceptor(shared.clone(), reconnect, events_tx.clone());
    }
    let main = shared.clone();
    let thread = std::thread::Builder::new()
        .name("postcopy".into())
        .spawn(move || {
            // Installing pushed pages is bulk work: the fault thread, the
            // request connection's reader and the vCPU go first.
            let _background = tsubame_vmm::cpu_time::lower_thread_priority();
            let result = phase(&main, &events, &events_tx, digest_region, can_resume);
            main.end(None);
            main.stop.store(true, Ordering::Release);
            if let Ok(handle) = faults {
                let _ = handle.join();
            }
            result
        })
        .expect("spawn post-copy thread");
    PostcopyHandle { shared, thread }
}

/// One frame of channel 0 during the phase: pages to install, or the
/// source's digest (returned); anything else fails the phase (the why).
pub(super) fn on_frame(
    shared: &PostcopyShared,
    kind: FrameKind,
    frame: &[u8],
    unpacker: &mut Unpacker,
    region: u32,
) -> Result<Option<Digest>, String> {
    if kind == FrameKind::Error {
        return Err(format!("the source gave up: {}", ErrorMessage::decode(frame).0));
    }
    ReceiverState::Postcopy.check(kind).map_err(|e| e.to_string())?;
    match kind {
        FrameKind::PostcopyPages | FrameKind::PostcopyPagesCompressed => {
            shared.install_pushed(kind, frame, unpacker).map_err(|e| e.to_string())?
        }
        _ => {
            let regions = (shared.pages * PAGE_SIZE as u64).div_ceil(region as u64) as usize;
            return Ok(Some(Digest::decode(frame, region, regions).map_err(|e| e.to_string())?));
        }
    }
    Ok(None)
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
    let mut theirs = None;
    let mut unpacker = Unpacker::default();
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
                if let Some(digest) = on_frame(shared, kind, &frame, &mut unpacker, region).map_err(fail)? {
                    theirs = Some(digest);
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
    // Links that came back after the last look at the queue are told how
    // the phase ended, once it is known; later ones wait for it at the
    // acceptor.
    shared.close_links();
    let late: Vec<Stream> = events
        .try_iter()
        .filter_map(|event| match event {
            Event::Resumed(stream) => Some(stream),
            _ => None,
        })
        .collect();
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
    shared.end(differing.is_empty().then(|| done.encode()));
    {
        let mut back = shared.back.lock().unwrap();
        let _ = protocol::write_frame(&mut *back, FrameKind::PostcopyDone, &done.encode()).and_then(|_| back.flush());
    }
    if differing.is_empty() {
        for stream in late {
            tell_done_apart(stream, done.encode());
        }
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
