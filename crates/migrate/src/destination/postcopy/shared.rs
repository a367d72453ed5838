//! What the post-copy threads share: missing pages, faults, the link's
//! state, and installing what arrives.

use std::collections::HashSet;
use std::io::Write;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tsubame_codec::batch::BatchDecompressor;
use tsubame_farmem::FarReader;
use tsubame_vmm::memory::{self, GuestMemory};
use tsubame_vmm::uffd::{FaultError, Installed, PageFaults};
use tsubame_vmm::{DirtyBitmap, PAGE_SIZE};
use vm_memory::bitmap::AtomicBitmap;

use crate::destination::error::ReceiveError;
use crate::digest::{page_hash, region_hashes_by, zero_page_hash, FarPageHashes};
use crate::protocol::pages::{for_each_record, CompressedHeader, Encoding, MAX_UNPACKED};
use crate::protocol::{self, FrameKind, PageRequest, PostcopyInstalled, WireError};
use crate::stats::process_cpu_seconds;

/// A channel back to the source, shared by the receiver and the fault
/// thread.
pub type BackChannel = Arc<Mutex<Box<dyn Write + Send>>>;

/// Writes to the back channel and flushes it.
pub(crate) fn write_flushed(
    writer: &BackChannel,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), ReceiveError> {
    let mut w = writer.lock().unwrap();
    write(&mut *w)?;
    w.flush()?;
    Ok(())
}

/// Pushed pages taken in between two POSTCOPY_INSTALLED (512 KiB).
const REPORT_EVERY: u64 = 128;

/// A fault this few pages past the last page installed is taken to be on
/// its way: the source pushes in ascending order from the page after the
/// last one asked for, 64 pages at a time, and its socket holds about half
/// a millisecond of the link more. (A guest that writes memory in order
/// follows the push and faults on pages in flight: fill-random's 4 GiB
/// asked for 47-88 thousand of them, each a wake-up of two source threads,
/// ~0.17 of a CPU there, for pages the source then found sent.)
const IN_FLIGHT_AHEAD: u64 = 128;
/// How long such a page is waited for before it is asked for all the same:
/// a push of 64 pages takes 2.1 ms to arrive at 1 Gbit/s, behind up to 0.5
/// ms of queue, and is installed once whole (with 2 ms, 7 thousand of
/// fill-random's 12 thousand faults were asked for, all sent already).
const IN_FLIGHT_WAIT: Duration = Duration::from_millis(5);

/// The guest's progress counter, with where it stood when watching began.
pub(super) type GuestOps = (Box<dyn Fn() -> u64 + Send + Sync>, u64, Instant);

/// What the post-copy threads share.
pub(crate) struct PostcopyShared {
    pub(super) faults: Arc<PageFaults>,
    /// A VM with far memory: its far pages, read from the memory host when
    /// touched. Memory stays registered once every page is here: far
    /// memory takes the registration over.
    pub(super) far: Option<(Mutex<FarReader>, Arc<FarPageHashes>)>,
    pub(super) mem: Arc<GuestMemory>,
    pub(super) pages: u64,
    /// Pages still missing here.
    pub(super) missing: AtomicBitmap,
    pub(super) remaining: AtomicU64,
    /// Each page's hash as received (or as held at the switch).
    pub(super) page_hashes: Vec<AtomicU64>,
    /// Pages asked for (or waited for as on their way) and not arrived yet.
    pub(super) requested: Mutex<HashSet<u64>>,
    /// The page installed last ([`IN_FLIGHT_AHEAD`]); u64::MAX before any.
    last_installed: AtomicU64,
    pub(super) requests_sent: AtomicU64,
    /// Pages of the push's frames taken in, all links together
    /// (POSTCOPY_INSTALLED).
    pushed_in: AtomicU64,
    pub(super) back: BackChannel,
    /// Every page is here (`remaining` reached zero), or a failure.
    pub(super) settled: (Mutex<bool>, Condvar),
    pub(super) failure: Mutex<Option<String>>,
    pub(super) stop: AtomicBool,
    pub(super) guest_ops: Mutex<Option<GuestOps>>,
    pub(super) started: Instant,
    pub(super) cpu_at_start: f64,
    /// False while the link to the source is cut.
    pub(super) link_up: AtomicBool,
    /// How long a cut link is waited for.
    pub(super) timeout: Duration,
    /// Times the link came back.
    pub(super) resumes: AtomicU64,
    /// How the phase ended, for a source cut off before it heard
    /// POSTCOPY_DONE: it reconnects and is told again.
    ending: (Mutex<Ending>, Condvar),
    /// Back memory with huge pages once every page is here.
    hugepages: bool,
}

/// Where the phase stands for a source that comes back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    /// Taking links: a reconnected channel 0 goes to the phase.
    Open,
    /// Every page and the digest are here and being compared: a source
    /// that comes back now waits for the outcome (a link handed to the
    /// phase then would never be read: a cut test lost its VM that way).
    Closing,
    /// POSTCOPY_DONE as sent once every page was here and matched.
    Done(Vec<u8>),
    /// Failed or mismatched: nothing to tell.
    Failed,
}

impl Ending {
    /// POSTCOPY_DONE's bytes, once it is Done.
    fn done(&self) -> Option<Vec<u8>> {
        match self {
            Ending::Done(done) => Some(done.clone()),
            _ => None,
        }
    }
}

impl PostcopyShared {
    /// Registers `mem` for faults, drops the `missing` pages, and takes the
    /// page hashes of what is held (`held_hashes`, from the digest).
    pub(crate) fn start(
        mem: Arc<GuestMemory>,
        missing: &DirtyBitmap,
        held_hashes: Vec<u64>,
        back: BackChannel,
        timeout: Duration,
        far: Option<(FarReader, Arc<FarPageHashes>)>,
        hugepages: bool,
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
            last_installed: AtomicU64::new(u64::MAX),
            requests_sent: AtomicU64::new(0),
            pushed_in: AtomicU64::new(0),
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
            ending: (Mutex::new(Ending::Open), Condvar::new()),
            hugepages,
        }))
    }

    /// Pages of guest memory.
    pub(crate) fn pages(&self) -> u64 {
        self.pages
    }

    /// Drops the pages of `more` too: they went stale at the source since
    /// the last look. Only before the VM runs here (nothing faults yet).
    pub(crate) fn add_missing(&self, more: &DirtyBitmap) -> Result<(), ReceiveError> {
        // The pause's set is often empty: nothing to walk on the switch's
        // path (the walks below take ~60 µs for 4 GiB).
        if more.is_empty() {
            return Ok(());
        }
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

    /// Installs the pages of a POSTCOPY_PAGES_COMPRESSED frame.
    pub(crate) fn install_compressed(&self, payload: &[u8], unpacker: &mut Unpacker) -> Result<u64, ReceiveError> {
        let (header, packed) = CompressedHeader::parse(payload)?;
        unpacker
            .decompressor
            .decompress(header.compressor, packed, header.unpacked_len as usize, MAX_UNPACKED, &mut unpacker.buf)
            .map_err(|e| WireError::bad("postcopy_pages_compressed", e.to_string()))?;
        self.install_frame(&unpacker.buf)
    }

    /// Installs a frame of the push (plain or compressed) and tells the
    /// source every [`REPORT_EVERY`] pages how many it took in, which it
    /// keeps its push close to.
    pub(crate) fn install_pushed(&self, kind: FrameKind, frame: &[u8], un: &mut Unpacker) -> Result<(), ReceiveError> {
        let pages = match kind {
            FrameKind::PostcopyPagesCompressed => self.install_compressed(frame, un)?,
            _ => self.install_frame(frame)?,
        };
        let before = self.pushed_in.fetch_add(pages, Ordering::Relaxed);
        if (before + pages) / REPORT_EVERY != before / REPORT_EVERY {
            // The fault thread asks through the same lock: this thread
            // (nice 10) must not be preempted holding it. Best effort: a
            // cut link shows on channel 0's reader.
            let _first = tsubame_vmm::cpu_time::realtime_thread();
            let installed = PostcopyInstalled { pages: before + pages }.encode();
            let _ = write_flushed(&self.back, |w| protocol::write_frame(w, FrameKind::PostcopyInstalled, &installed));
        }
        Ok(())
    }

    /// Installs the pages of a POSTCOPY_PAGES frame (raw, raw-run and
    /// zero records). Pages may come twice (asked for and pushed); once
    /// every page is here the rest are duplicates and are dropped. Returns
    /// the pages the frame carried.
    pub(crate) fn install_frame(&self, payload: &[u8]) -> Result<u64, ReceiveError> {
        // Neighbouring zero records go in as one run.
        let mut zeros: Option<(u64, u64)> = None;
        let mut pages = 0;
        for_each_record(payload, self.pages, PAGE_SIZE, |record| {
            let first = record.page_index;
            pages += (record.data.len() / PAGE_SIZE).max(1) as u64;
            if record.encoding == Encoding::Zero {
                zeros = match zeros {
                    Some((start, count)) if start + count == first => Some((start, count + 1)),
                    Some((start, count)) => {
                        self.install_zero_run(start, count)?;
                        Some((first, 1))
                    }
                    None => Some((first, 1)),
                };
                return Ok(());
            }
            if let Some((start, count)) = zeros.take() {
                self.install_zero_run(start, count)?;
            }
            match record.encoding {
                Encoding::Raw | Encoding::RawRun => self.install_run(first, record.data),
                other => {
                    Err(WireError::bad("postcopy_pages.encoding", format!("{other:?} (raw, raw-run or zero only)")))
                }
            }
        })?;
        if let Some((start, count)) = zeros {
            self.install_zero_run(start, count)?;
        }
        Ok(pages)
    }

    /// Installs consecutive pages from `first`: those still missing here
    /// in runs of one `UFFDIO_COPY` each (a guest following the push
    /// faulted on nearly every page of a run installed page by page:
    /// fill-random's 4 GiB took 90-160 thousand faults), the others one by
    /// one.
    fn install_run(&self, first: u64, data: &[u8]) -> Result<(), WireError> {
        let page = |i: u64| -> Option<&[u8; PAGE_SIZE]> {
            Some(data[i as usize * PAGE_SIZE..][..PAGE_SIZE].try_into().expect("whole pages"))
        };
        self.install_pages(first, (data.len() / PAGE_SIZE) as u64, page, |at, count| {
            self.faults.install_leading(first + at, &data[at as usize * PAGE_SIZE..(at + count) as usize * PAGE_SIZE])
        })
    }

    /// Installs `count` zero pages from `first` the same way, in runs of
    /// one `UFFDIO_ZEROPAGE` each.
    fn install_zero_run(&self, first: u64, count: u64) -> Result<(), WireError> {
        self.install_pages(first, count, |_| None, |at, n| self.faults.install_zero_leading(first + at, n))
    }

    /// The loop of both: `leading(at, n)` installs up to `n` missing pages
    /// from `first + at` in one call and says how many it did; `page(i)` is
    /// page `first + i`'s data (`None`: zeros) for one-by-one installs.
    fn install_pages<'d>(
        &self,
        first: u64,
        count: u64,
        page: impl Fn(u64) -> Option<&'d [u8; PAGE_SIZE]>,
        leading: impl Fn(u64, u64) -> Result<u64, FaultError>,
    ) -> Result<(), WireError> {
        let mut at = 0;
        while at < count && self.remaining.load(Ordering::Acquire) > 0 {
            let missing = (at..count).take_while(|&i| self.missing.is_bit_set((first + i) as usize)).count() as u64;
            let installed = if missing > 1 {
                match leading(at, missing) {
                    Ok(installed) => installed,
                    // The last page came meanwhile and memory was unregistered.
                    Err(_) if self.remaining.load(Ordering::Acquire) == 0 => return Ok(()),
                    Err(e) => return Err(WireError::bad("postcopy_pages.page", e.to_string())),
                }
            } else {
                0
            };
            for i in at..at + installed {
                self.arrived(first + i, page(i));
            }
            at += installed;
            // A page present already, or a run of one.
            if installed < missing.max(1) && at < count {
                self.install_page(first + at, page(at))?;
                at += 1;
            }
        }
        Ok(())
    }

    /// Installs one page (`None`: zeros) unless it is here already.
    fn install_page(&self, page: u64, data: Option<&[u8; PAGE_SIZE]>) -> Result<(), WireError> {
        if self.remaining.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let installed = match data {
            Some(data) => self.faults.install(page, data),
            None => self.faults.install_zero(page),
        };
        let installed = match installed {
            Ok(installed) => installed,
            // The last page came meanwhile and memory was unregistered.
            Err(_) if self.remaining.load(Ordering::Acquire) == 0 => return Ok(()),
            Err(e) => return Err(WireError::bad("postcopy_pages.page", e.to_string())),
        };
        if installed == Installed::Now {
            self.arrived(page, data);
        }
        Ok(())
    }

    /// Counts in a page just installed here (`None`: zeros).
    fn arrived(&self, page: u64, data: Option<&[u8; PAGE_SIZE]>) {
        if !self.missing.is_bit_set(page as usize) {
            return;
        }
        self.missing.reset_bit(page as usize);
        let hash = data.map_or_else(zero_page_hash, page_hash);
        self.page_hashes[page as usize].store(hash, Ordering::Relaxed);
        self.requested.lock().unwrap().remove(&page);
        self.last_installed.store(page, Ordering::Relaxed);
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Every page is here: faults are the kernel's again (a page
            // never populated reads as zeros), and huge pages may back
            // memory from now on. Not with far memory, which takes the
            // registration over.
            if self.far.is_none() {
                let _ = self.faults.unregister();
                if self.hugepages {
                    memory::back_dense_with_huge_pages_later(self.mem.clone());
                }
            }
            self.settle();
        }
    }

    pub(super) fn settle(&self) {
        *self.settled.0.lock().unwrap() = true;
        self.settled.1.notify_all();
    }

    /// Ends the phase with a failure (the first one counts). The missing
    /// pages stay unresolvable: the guest blocks on them rather than read
    /// zeros (the VM is lost, never corrupted).
    pub(crate) fn fail(&self, why: String) {
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
    pub(super) fn fault_loop(&self) {
        let mut faults = Vec::new();
        let mut ask = Vec::new();
        let mut awaited = Awaited::default();
        while !self.stop.load(Ordering::Acquire) && self.remaining.load(Ordering::Acquire) > 0 {
            if let Err(e) = self.faults.wait_faults(awaited.wait(Instant::now()), &mut faults) {
                self.fail(format!("serving page faults: {e}"));
                return;
            }
            {
                let mut requested = self.requested.lock().unwrap();
                let last = Some(self.last_installed.load(Ordering::Relaxed)).filter(|&p| p != u64::MAX);
                let now = Instant::now();
                for fault in faults.drain(..) {
                    if self.missing.is_bit_set(fault.page as usize) {
                        if requested.insert(fault.page) && !awaited.awaits(fault.page, last, now) {
                            ask.push(fault.page);
                        }
                    } else if let Err(e) = self.install_not_missing(fault.page) {
                        drop(requested);
                        self.fail(e);
                        return;
                    }
                }
            }
            awaited.due(Instant::now(), |page| self.missing.is_bit_set(page as usize), &mut ask);
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
    pub(super) fn install_not_missing(&self, page: u64) -> Result<(), String> {
        match &self.far {
            Some((reader, map)) if map.far.get(page) => {
                let mut data = [0u8; PAGE_SIZE];
                let hash = map.hashes[page as usize];
                reader.lock().unwrap().read_page(page, hash, &mut data).map_err(|e| e.to_string())?;
                self.faults.install(page, &data).map(drop).map_err(|e| format!("installing a far page: {e}"))
            }
            _ => match self.faults.install_zero(page) {
                Ok(_) => Ok(()),
                // The last missing page came meanwhile and memory was
                // unregistered (UFFDIO_ZEROPAGE then fails with ENOENT): the
                // kernel serves this fault itself now, with zeros.
                Err(_) if self.far.is_none() && self.remaining.load(Ordering::Acquire) == 0 => Ok(()),
                Err(e) => Err(format!("installing a zero page: {e}")),
            },
        }
    }

    /// Asks the source for `pages`.
    pub(super) fn ask(&self, pages: &[u64]) -> std::io::Result<()> {
        let mut back = self.back.lock().unwrap();
        for chunk in pages.chunks(protocol::MAX_REQUEST) {
            let request = PageRequest { pages: chunk.to_vec() }.encode();
            protocol::write_frame(&mut *back, FrameKind::PageRequest, &request)?;
            self.requests_sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        back.flush()
    }

    /// The phase's ending, held (it cannot change meanwhile).
    pub(super) fn ending(&self) -> std::sync::MutexGuard<'_, Ending> {
        self.ending.0.lock().unwrap()
    }

    /// The phase takes no more links (an open phase only).
    pub(super) fn close_links(&self) {
        let mut ending = self.ending.0.lock().unwrap();
        if *ending == Ending::Open {
            *ending = Ending::Closing;
        }
    }

    /// How the phase ended: POSTCOPY_DONE's bytes, or None for a failure.
    /// The first call counts.
    pub(super) fn end(&self, done: Option<Vec<u8>>) {
        let mut ending = self.ending.0.lock().unwrap();
        if matches!(*ending, Ending::Open | Ending::Closing) {
            *ending = done.map_or(Ending::Failed, Ending::Done);
            self.ending.1.notify_all();
        }
    }

    /// POSTCOPY_DONE's bytes once every page was here and matched; None
    /// while the phase goes on, or after a failure.
    pub(super) fn done(&self) -> Option<Vec<u8>> {
        self.ending().done()
    }

    /// Like [`Self::done`], but waits out a phase that is closing.
    pub(super) fn wait_done(&self) -> Option<Vec<u8>> {
        self.ending.1.wait_while(self.ending(), |e| *e == Ending::Closing).unwrap().done()
    }

    /// True when every page is here (or the phase failed).
    pub(super) fn settled(&self) -> bool {
        *self.settled.0.lock().unwrap()
    }

    /// The pages still missing.
    pub(super) fn missing_now(&self) -> DirtyBitmap {
        let mut missing = DirtyBitmap::new(self.pages);
        for p in 0..self.pages {
            if self.missing.is_bit_set(p as usize) {
                missing.set(p);
            }
        }
        missing
    }

    /// The digest of memory as received, from every page's hash.
    pub(super) fn digest(&self, region: u32) -> Vec<u64> {
        region_hashes_by(self.page_hashes.len(), region, |page| self.page_hashes[page].load(Ordering::Relaxed))
    }
}

/// Faulted pages taken to be on their way ([`IN_FLIGHT_AHEAD`]), each
/// with the time it is asked for all the same, and whether the guest
/// follows the push.
#[derive(Default)]
struct Awaited {
    pages: Vec<(u64, Instant)>,
    /// The last fault lay just past the page installed last.
    following: bool,
}

impl Awaited {
    /// Whether `page`, just faulted on, is awaited instead of asked for:
    /// it lies less than [`IN_FLIGHT_AHEAD`] pages past `last`, the page
    /// installed last, and so did the fault before it (a guest that
    /// follows the push). One such fault alone is chance: a guest that
    /// reads memory at random asks for pages all over it, each ask moves
    /// the push there, and the page it was near never came (a kv guest's
    /// fault p99 was the whole [`IN_FLIGHT_WAIT`], 4 ms).
    fn awaits(&mut self, page: u64, last: Option<u64>, now: Instant) -> bool {
        let ahead = last.and_then(|last| page.checked_sub(last + 1));
        let near = ahead.is_some_and(|ahead| ahead < IN_FLIGHT_AHEAD);
        let awaits = near && self.following;
        self.following = near;
        if awaits {
            self.pages.push((page, now + IN_FLIGHT_WAIT));
        }
        awaits
    }

    /// How long the fault loop may wait for faults: until the first
    /// awaited page is due (at least the poll's millisecond).
    fn wait(&self, now: Instant) -> Duration {
        let first = self.pages.iter().map(|&(_, due)| due.saturating_duration_since(now)).min();
        first.map_or(Duration::from_millis(50), |wait| wait.max(Duration::from_millis(1)))
    }

    /// Moves the pages due by `now` and still `missing` to `ask`, and
    /// forgets those that arrived.
    fn due(&mut self, now: Instant, missing: impl Fn(u64) -> bool, ask: &mut Vec<u64>) {
        self.pages.retain(|&(page, due)| {
            let missing = missing(page);
            if missing && due <= now {
                ask.push(page);
            }
            missing && due > now
        });
    }
}

/// What a thread that reads compressed post-copy frames keeps.
#[derive(Default)]
pub(crate) struct Unpacker {
    decompressor: BatchDecompressor,
    buf: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_just_past_the_last_page_installed_is_awaited_while_the_guest_follows_the_push() {
        let now = Instant::now();
        let mut awaited = Awaited::default();
        assert!(!awaited.awaits(5, None, now), "nothing installed yet: ask");
        assert!(!awaited.awaits(100, Some(100), now), "the page installed last is no fault");
        assert!(!awaited.awaits(99, Some(100), now), "behind the push: ask");
        assert!(!awaited.awaits(101 + IN_FLIGHT_AHEAD, Some(100), now), "too far ahead: ask");
        assert!(!awaited.awaits(101, Some(100), now), "near the push by chance: ask");
        assert!(awaited.awaits(101, Some(100), now), "following the push");
        assert!(awaited.awaits(100 + IN_FLIGHT_AHEAD, Some(100), now));
        assert_eq!(awaited.wait(now), IN_FLIGHT_WAIT);

        let mut ask = Vec::new();
        awaited.due(now, |_| true, &mut ask);
        assert!(ask.is_empty(), "not due yet");
        // Page 101 arrived; the other is asked for once due.
        awaited.due(now + IN_FLIGHT_WAIT, |page| page != 101, &mut ask);
        assert_eq!(ask, vec![100 + IN_FLIGHT_AHEAD]);
        assert_eq!(awaited.wait(now), Duration::from_millis(50), "none left");
    }
}
