//! The digest kept in a thread of its own while a migration runs.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;

use tsubame_vmm::{memory, DirtyBitmap, GuestMemory};

use super::incremental::{FarPageHashes, IncrementalDigest};

/// An [`IncrementalDigest`] in a thread of its own: pages handed to
/// [`BackgroundDigest::mark`] are hashed while migration goes on, and
/// [`BackgroundDigest::hashes`] waits only for what is still marked. Hand
/// over a page only after it was read for sending (source): a later change
/// marks it again. A writer that hashes what it writes (a destination's
/// decoders) hands the hashes over instead ([`BackgroundDigest::feed`]).
pub struct BackgroundDigest {
    region: u32,
    requests: crossbeam_channel::Sender<Request>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Pages handed over and not hashed yet (an upper bound: a page marked
    /// twice before its hash counts twice).
    backlog: Arc<AtomicU64>,
    /// Whether it should let normal threads go first, and its thread's id.
    yielding: Arc<Yielding>,
}

/// [`BackgroundDigest::run_in_background`]'s request, which the thread
/// takes up as it starts, or its caller through the thread's id: one of
/// them sees the other's write.
#[derive(Default)]
struct Yielding {
    asked: AtomicBool,
    /// The thread's kernel id once it runs (0 before).
    tid: AtomicI32,
}

enum Request {
    /// Pages to hash again, and pages known to be zeros.
    Mark(DirtyBitmap, Option<DirtyBitmap>),
    /// Pages to hash again, listed (a few).
    MarkPages(Vec<u64>),
    /// The digest, answered ahead of every normal thread when `first`.
    Hashes { reply: crossbeam_channel::Sender<Vec<u64>>, first: bool },
    /// Each page's hash, handed over: the digest ends with it.
    TakePageHashes(crossbeam_channel::Sender<Vec<u64>>),
    /// Pages whose hashes a reader will hand over (Known): hashed here
    /// only when someone asks for the digest before they came.
    Await(DirtyBitmap),
    /// Pages' hashes, `(page, hash)`, from a reader of paused memory.
    Known(Vec<(u64, u64)>),
    /// The digest is dropped: the thread ends (a [`DigestFeed`] may still
    /// hold the channel open).
    Stop,
}

impl BackgroundDigest {
    /// Starts the thread; every page is marked at first. With `far`, a far
    /// page not populated takes its far copy's hash.
    pub fn start(mem: Arc<GuestMemory>, region: u32, far: Option<Arc<FarPageHashes>>) -> BackgroundDigest {
        BackgroundDigest::spawn(mem, region, Some(far))
    }

    /// Starts the thread for memory just mapped, whose every write is
    /// marked or its hash handed over (a destination's): all zeros,
    /// nothing to hash until then.
    /// (Hashing 4 GiB of it page by page took 27-60 ms, longer than an
    /// idle VM's whole pre-copy.)
    pub fn start_fresh(mem: Arc<GuestMemory>, region: u32) -> BackgroundDigest {
        BackgroundDigest::spawn(mem, region, None)
    }

    /// `from`: None for fresh memory, else the far map (if any) of memory
    /// to hash as it is.
    fn spawn(mem: Arc<GuestMemory>, region: u32, from: Option<Option<Arc<FarPageHashes>>>) -> BackgroundDigest {
        let (requests, rx) = crossbeam_channel::unbounded::<Request>();
        let stale = if from.is_some() { memory::page_count(&mem) } else { 0 };
        let backlog = Arc::new(AtomicU64::new(stale));
        let thread_backlog = backlog.clone();
        let yielding = Arc::new(Yielding::default());
        let thread_yielding = yielding.clone();
        let thread = std::thread::Builder::new()
            .name("digest".into())
            .spawn(move || {
                let tid = tsubame_vmm::cpu_time::current_thread_id();
                thread_yielding.tid.store(tid, Ordering::SeqCst);
                if thread_yielding.asked.load(Ordering::SeqCst) {
                    tsubame_vmm::cpu_time::lower_priority_of(tid);
                }
                let mut digest = match from {
                    Some(far) => IncrementalDigest::new(&mem, region, far),
                    None => IncrementalDigest::zeros(&mem, region),
                };
                let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
                let mut taken = stale;
                let mut awaited = DirtyBitmap::new(memory::page_count(&mem));
                // The next answer's buffer, written once already: a fresh
                // one faults in on the copy (a 4 GiB guest's 128 KiB took
                // ~0.05 ms of a stop's, on both ends).
                let mut spare = touched(digest.hashes().len());
                while let Ok(first) = rx.recv() {
                    // Take every request queued so far, then hash once.
                    let mut waiting = Vec::new();
                    for request in std::iter::once(first).chain(rx.try_iter()) {
                        match request {
                            Request::Mark(pages, zeros) => {
                                // Hashed here from memory: no longer awaited.
                                awaited.subtract(&pages);
                                taken += pages.count();
                                digest.mark(&pages);
                                if let Some(zeros) = zeros {
                                    awaited.subtract(&zeros);
                                    digest.known_zero(&zeros);
                                }
                            }
                            Request::MarkPages(pages) => {
                                pages.iter().for_each(|&page| awaited.unset(page));
                                taken += pages.len() as u64;
                                digest.mark_pages(pages.into_iter());
                            }
                            Request::Await(pages) => {
                                digest.unmark(&pages);
                                awaited.union_with(&pages);
                            }
                            Request::Known(hashes) => {
                                hashes.iter().for_each(|&(page, _)| awaited.unset(page));
                                digest.known(hashes.into_iter());
                            }
                            other => waiting.push(other),
                        }
                    }
                    if waiting.iter().any(|r| matches!(r, Request::Stop)) {
                        break;
                    }
                    // The hashing it starts inherits the policy.
                    let _first = waiting
                        .iter()
                        .any(|r| matches!(r, Request::Hashes { first: true, .. }))
                        .then(tsubame_vmm::cpu_time::realtime_thread);
                    // Whoever waits gets every page, those still awaited
                    // too. (Only a source awaits: on a destination the pass
                    // over the empty bitmap and its first clear took 0.12
                    // ms of the stop.)
                    if !waiting.is_empty() && !awaited.is_empty() {
                        digest.mark(&awaited);
                        awaited.clear();
                    }
                    // One thread while the migration runs beside it; every
                    // core when someone waits (the guest is paused then).
                    digest.refresh(&mem, if waiting.is_empty() { 1 } else { cores });
                    thread_backlog.fetch_sub(std::mem::take(&mut taken), Ordering::Relaxed);
                    for request in waiting {
                        match request {
                            Request::Hashes { reply, first } => {
                                let mut answer = std::mem::take(&mut spare);
                                answer.clear();
                                answer.extend_from_slice(digest.hashes());
                                drop(reply.send(answer));
                                // Not in a stop: another answer may come.
                                if !first {
                                    spare = touched(digest.hashes().len());
                                }
                            }
                            Request::TakePageHashes(reply) => {
                                drop(reply.send(digest.take_page_hashes()));
                                return;
                            }
                            Request::Mark(..)
                            | Request::MarkPages(_)
                            | Request::Await(_)
                            | Request::Known(_)
                            | Request::Stop => {}
                        }
                    }
                }
            })
            .expect("spawn digest thread");
        BackgroundDigest { region, requests, thread: Some(thread), backlog, yielding }
    }

    /// Lets its thread (and the threads it starts) run only on `cpus`.
    pub fn run_on(&self, cpus: &[usize]) {
        use std::os::unix::thread::JoinHandleExt;
        if let Some(thread) = &self.thread {
            tsubame_vmm::cpu_time::set_thread_cpus(thread.as_pthread_t(), cpus);
        }
    }

    /// Lets every normal thread go first from now on (nice 10, also for
    /// the threads its hashing starts), even in the middle of a hash of
    /// all memory: post-copy's, where the guest runs at the destination
    /// and waits on pages that the push (nice 10 itself) and the
    /// destination's installs deliver. At normal priority its hashing held
    /// them back 20-35 ms at a time while a bwmem guest waited on a fault
    /// (perf sched_switch, 2026-11-29).
    pub fn run_in_background(&self) {
        self.yielding.asked.store(true, Ordering::SeqCst);
        let tid = self.yielding.tid.load(Ordering::SeqCst);
        if tid > 0 {
            tsubame_vmm::cpu_time::lower_priority_of(tid);
        }
    }

    /// The region size.
    pub fn region(&self) -> u32 {
        self.region
    }

    /// Hands over pages to hash.
    pub fn mark(&self, pages: DirtyBitmap) {
        self.mark_read(pages, None);
    }

    /// Hands over pages read for sending, of which those in `zeros` were
    /// all zeros: those take the zero page's hash without being read again
    /// (nor counted in the backlog).
    pub fn mark_read(&self, mut pages: DirtyBitmap, zeros: Option<DirtyBitmap>) {
        if let Some(zeros) = &zeros {
            pages.subtract(zeros);
        }
        self.backlog.fetch_add(pages.count(), Ordering::Relaxed);
        let _ = self.requests.send(Request::Mark(pages, zeros));
    }

    /// Hands over these pages to hash: a short list, where a bitmap of
    /// all memory would cost more than the pages.
    pub fn mark_pages(&self, pages: Vec<u64>) {
        if !pages.is_empty() {
            self.backlog.fetch_add(pages.len() as u64, Ordering::Relaxed);
            let _ = self.requests.send(Request::MarkPages(pages));
        }
    }

    /// Pages whose hashes a reader of paused memory hands over through
    /// [`BackgroundDigest::feed`] (post-copy's senders, which read each
    /// page once anyway): not read here, unless the digest is asked for
    /// before a page's hash came.
    pub fn await_hashes(&self, pages: DirtyBitmap) {
        let _ = self.requests.send(Request::Await(pages));
    }

    /// A handle that hands pages' hashes over from another thread: hashes
    /// of pages read after their dirty bit was cleared, or written and
    /// then hashed by their only writer.
    pub fn feed(&self) -> DigestFeed {
        DigestFeed { requests: self.requests.clone() }
    }

    /// Pages handed over and not hashed yet (at most).
    pub fn backlog_pages(&self) -> u64 {
        self.backlog.load(Ordering::Relaxed)
    }

    /// The digest with every marked page hashed.
    pub fn hashes(&self) -> Vec<u64> {
        self.request(false).recv().expect("digest thread answers")
    }

    /// Asks for the digest with every marked page hashed; it comes on the
    /// returned channel (for a caller with something to do meanwhile).
    pub fn request_hashes(&self) -> crossbeam_channel::Receiver<Vec<u64>> {
        self.request(false)
    }

    /// [`BackgroundDigest::request_hashes`] in a stop, whose end waits for
    /// it: the thread hashes what is left and answers under SCHED_FIFO
    /// (behind the stop's other threads on 2 cores, an answer of 0.05 ms
    /// of work came 0.4-1.9 ms late in 1 stop of 10). Only with the guest
    /// paused and the backlog hashed beforehand: the work must be short.
    pub fn request_hashes_in_stop(&self) -> crossbeam_channel::Receiver<Vec<u64>> {
        self.request(true)
    }

    fn request(&self, first: bool) -> crossbeam_channel::Receiver<Vec<u64>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.requests.send(Request::Hashes { reply: tx, first }).expect("digest thread runs");
        rx
    }

    /// Each page's hash, every marked page hashed: the start of a digest
    /// kept page by page from then on ([`region_hashes`]). This digest ends
    /// with it: handed over, not copied (a 4 GiB guest's copy took 8.8 ms
    /// of the first round of the switch to post-copy, the hand-over 0.1).
    pub fn take_page_hashes(self) -> Vec<u64> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.requests.send(Request::TakePageHashes(tx)).expect("digest thread runs");
        rx.recv().expect("digest thread answers")
    }
}

/// A buffer for `len` hashes with every page of it written.
#[allow(clippy::slow_vector_initialization)] // Writing is the point: vec![0; n] leaves pages to fault in.
fn touched(len: usize) -> Vec<u64> {
    let mut buffer = Vec::with_capacity(len);
    buffer.resize(len, 0);
    buffer
}

/// Hands pages' hashes to a [`BackgroundDigest`] (see
/// [`BackgroundDigest::await_hashes`]).
#[derive(Clone)]
pub struct DigestFeed {
    requests: crossbeam_channel::Sender<Request>,
}

impl DigestFeed {
    /// Takes each `(page, hash)` as the page's hash.
    pub fn known(&self, hashes: Vec<(u64, u64)>) {
        if !hashes.is_empty() {
            let _ = self.requests.send(Request::Known(hashes));
        }
    }
}

impl Drop for BackgroundDigest {
    fn drop(&mut self) {
        // The thread ends after the requests in hand.
        let _ = self.requests.send(Request::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{memory_digest, page_hash, region_hashes};
    use tsubame_vmm::PAGE_SIZE;

    #[test]
    fn region_hashes_from_page_hashes_match_a_full_digest() {
        let mem = std::sync::Arc::new(memory::create(16 << 20, false).unwrap());
        memory::write(&mem, 3 << 20, &[7; 8192]).unwrap();
        let digest = BackgroundDigest::start(mem.clone(), 256 << 10, None);
        assert_eq!(region_hashes(&digest.take_page_hashes(), 256 << 10), memory_digest(&mem, 256 << 10, 1));
    }

    #[test]
    fn background_digest_counts_what_it_has_not_hashed() {
        let mem = std::sync::Arc::new(memory::create(16 << 20, false).unwrap());
        let digest = BackgroundDigest::start(mem.clone(), 256 << 10, None);
        assert!(digest.backlog_pages() <= 4096, "all pages at first, at most");
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
        assert_eq!(digest.backlog_pages(), 0);
        let mut dirty = DirtyBitmap::new(4096);
        [0, 1, 3].into_iter().for_each(|p| dirty.set(p));
        memory::write(&mem, 4096, &[5]).unwrap();
        digest.mark(dirty);
        assert!(digest.backlog_pages() <= 3);
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
        assert_eq!(digest.backlog_pages(), 0);
        // Listed pages count and hash as marked ones do.
        memory::write(&mem, 4000 * 4096, &[6]).unwrap();
        digest.mark_pages(vec![4000]);
        assert_eq!(digest.backlog_pages(), 1);
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
        assert_eq!(digest.backlog_pages(), 0);
    }

    #[test]
    fn awaited_hashes_come_from_the_reader_or_are_hashed_when_asked_for() {
        let mem = std::sync::Arc::new(memory::create(16 << 20, false).unwrap());
        let digest = BackgroundDigest::start(mem.clone(), 256 << 10, None);
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
        // Pages 5, 6 and 900 change; the reader hands over 5's and 900's
        // hashes (900's stale: what it read before a later write would
        // be marked again), 6's never comes.
        let mut changed = DirtyBitmap::new(4096);
        for page in [5u64, 6, 900] {
            memory::write(&mem, page * 4096 + 9, &[page as u8]).unwrap();
            changed.set(page);
        }
        digest.await_hashes(changed.clone());
        let mut page = [0u8; PAGE_SIZE];
        memory::read_page(&mem, 5, &mut page).unwrap();
        let feed = digest.feed();
        feed.known(vec![(5, page_hash(&page)), (900, 12345)]);
        let mut again = DirtyBitmap::new(4096);
        again.set(900);
        digest.mark(again);
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
        drop(digest); // ends its thread although the feed lives on
        feed.known(vec![(1, 1)]);
    }

    #[test]
    fn fresh_memory_hashes_only_what_is_marked() {
        let mem = std::sync::Arc::new(memory::create(16 << 20, false).unwrap());
        let digest = BackgroundDigest::start_fresh(mem.clone(), 256 << 10);
        assert_eq!(digest.backlog_pages(), 0);
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
        memory::write(&mem, 5 << 20, &[3; 100]).unwrap();
        digest.mark(memory::take_vmm_dirty(&mem));
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
    }
}
