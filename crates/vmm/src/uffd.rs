//! Missing-page faults of guest memory, served by the VMM (userfaultfd):
//! the mechanism under post-copy migration (a missing page comes from the
//! migration source) and far memory (from a memory host).
//!
//! Guest memory is registered in missing mode: a first access to a page
//! that is not backed — by a vCPU inside KVM, which touches guest memory
//! from kernel mode (hence no user-mode-only flag), or by a VMM thread —
//! blocks that thread and queues a fault. One thread reads the faults
//! ([`PageFaults::wait_faults`]) and hands them to whoever provides pages;
//! any thread installs a page ([`PageFaults::install`], `UFFDIO_COPY`, or
//! [`PageFaults::install_zero`]) whenever it has it, asked for or not,
//! which wakes every thread waiting on it. A page installed twice is no
//! error: the second install finds it present. [`PageFaults::discard`]
//! makes pages missing again (`MADV_DONTNEED`).
//!
//! The one rule: a thread that installs pages must never itself touch a
//! guest page that may be missing, or it waits on itself. The threads
//! that serve faults get page contents from the network or from a
//! snapshot, never from guest memory.
//!
//! Limits: guest memory must be one anonymous private mapping (as
//! `memory::create` makes it); transparent huge pages are not used while
//! registered (khugepaged leaves registered ranges alone), so back memory
//! with them only after [`PageFaults::unregister`].

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::userfaultfd::{InstallError, Userfaultfd};
use serde::{Deserialize, Serialize};

use crate::memory::{self, GuestMemory, PAGE_SIZE};

/// Why faults cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// userfaultfd is missing or refused (needs root, or
    /// vm.unprivileged_userfaultfd=1 with kernel-mode faults).
    #[error("userfaultfd is not available: {0}")]
    Unavailable(String),
    /// Guest memory is not one mapping.
    #[error("guest memory must be one mapping to serve its page faults")]
    NotOneMapping,
    /// Registering, reading faults, or installing a page failed.
    #[error("{what} failed: {detail}")]
    Op {
        /// The operation.
        what: &'static str,
        /// What the kernel said.
        detail: String,
    },
    /// A page index outside guest memory.
    #[error("page {0} is outside guest memory")]
    OutOfRange(u64),
}

fn op(what: &'static str) -> impl Fn(std::io::Error) -> FaultError {
    move |e| FaultError::Op { what, detail: e.to_string() }
}

fn install_failed(what: &'static str, e: InstallError) -> FaultError {
    let detail = match e {
        InstallError::Partial(bytes) => format!("stopped after {bytes} bytes"),
        InstallError::Errno(errno) => std::io::Error::from_raw_os_error(errno).to_string(),
    };
    FaultError::Op { what, detail }
}

/// One missing-page fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The guest page.
    pub page: u64,
    /// The faulting thread (a vCPU or a VMM thread).
    pub thread: i32,
    /// True for a write access.
    pub write: bool,
}

/// What an install found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// The page is now present.
    Now,
    /// It was present already (installed before, or never missing).
    Already,
}

/// Counts and service times of faults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultStats {
    /// Faults read.
    pub faults: u64,
    /// Of those, served: the page installed after the fault was read.
    pub served: u64,
    /// Pages installed (asked for or not).
    pub installed: u64,
    /// Service time (fault read to page installed), median, µs.
    pub latency_p50_us: u64,
    /// 99th percentile, µs.
    pub latency_p99_us: u64,
    /// Longest, µs.
    pub latency_max_us: u64,
}

/// Service times, one sample per served fault (µs).
#[derive(Default)]
struct Latencies {
    waiting: HashMap<u64, Instant>,
    samples: Vec<u32>,
    faults: u64,
    installed: u64,
}

/// A userfaultfd kept open by [`PageFaults::freeze`].
struct Frozen {
    base: usize,
    len: usize,
    fd: std::os::fd::OwnedFd,
}

/// The frozen userfaultfds of this process.
static FROZEN: Mutex<Vec<Frozen>> = Mutex::new(Vec::new());

/// Releases the frozen faults of the guest memory `mem` (blocked vCPU
/// threads get zero pages): only for a VM being torn down whose vCPU has
/// been told to stop, so that it leaves KVM_RUN instead of running on.
pub fn thaw(mem: &GuestMemory) {
    let Some((base, _)) = memory::single_mapping(mem) else { return };
    let mut frozen = FROZEN.lock().unwrap();
    let (ours, others): (Vec<Frozen>, Vec<Frozen>) = frozen.drain(..).partition(|f| f.base == base as usize);
    *frozen = others;
    for f in ours {
        // Unregistering wakes the threads waiting on it; dropping the
        // descriptor closes it.
        let _ = Userfaultfd::from(f.fd).unregister(f.base, f.len);
    }
}

/// A set of pages this small is dropped without reading the page map.
const FEW_PAGES: u64 = 4096;

/// Guest memory registered for missing-page faults.
pub struct PageFaults {
    /// Keeps the mapping alive while faults may be served.
    _memory: std::sync::Arc<GuestMemory>,
    uffd: Userfaultfd,
    /// Host address of guest page 0, and the pages of the mapping.
    base: usize,
    pages: u64,
    latencies: Mutex<Latencies>,
}

impl PageFaults {
    /// Registers all of `mem` in missing mode. Pages already backed stay
    /// present; every other page faults on first access until installed.
    pub fn register(mem: &std::sync::Arc<GuestMemory>) -> Result<PageFaults, FaultError> {
        let (base, len) = memory::single_mapping(mem).ok_or(FaultError::NotOneMapping)?;
        let uffd = Userfaultfd::open().map_err(|e| FaultError::Unavailable(e.to_string()))?;
        uffd.register(base as usize, len).map_err(op("UFFDIO_REGISTER"))?;
        Ok(PageFaults {
            _memory: mem.clone(),
            uffd,
            base: base as usize,
            pages: (len / PAGE_SIZE) as u64,
            latencies: Mutex::default(),
        })
    }

    /// Pages of the registered memory.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    fn address(&self, page: u64) -> Result<usize, FaultError> {
        if page >= self.pages {
            return Err(FaultError::OutOfRange(page));
        }
        Ok(self.base + page as usize * PAGE_SIZE)
    }

    /// Waits up to `timeout` for faults and appends them to `out` (one per
    /// page and thread); returns with none when the time passes.
    pub fn wait_faults(&self, timeout: Duration, out: &mut Vec<Fault>) -> Result<(), FaultError> {
        let mut poll = libc::pollfd { fd: self.uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one pollfd that lives across the call.
        let ready = unsafe { libc::poll(&mut poll, 1, ms) };
        if ready <= 0 {
            return Ok(());
        }
        let now = Instant::now();
        let mut events = Vec::new();
        self.uffd.read_faults(&mut events).map_err(op("reading a userfaultfd event"))?;
        let mut latencies = self.latencies.lock().unwrap();
        for event in events {
            let offset = (event.address as usize).wrapping_sub(self.base);
            let page = (offset / PAGE_SIZE) as u64;
            if page >= self.pages {
                continue;
            }
            latencies.faults += 1;
            latencies.waiting.entry(page).or_insert(now);
            out.push(Fault { page, thread: event.thread, write: event.write });
        }
        Ok(())
    }

    fn installed(
        &self,
        page: u64,
        result: Result<usize, InstallError>,
        what: &'static str,
    ) -> Result<Installed, FaultError> {
        let outcome = match result {
            Ok(_) => Installed::Now,
            Err(InstallError::Errno(libc::EEXIST)) => {
                // Present already: whoever faulted on it was woken then.
                let _ = self.uffd.wake(self.address(page)?, PAGE_SIZE);
                Installed::Already
            }
            Err(e) => return Err(install_failed(what, e)),
        };
        let mut latencies = self.latencies.lock().unwrap();
        if outcome == Installed::Now {
            latencies.installed += 1;
        }
        if let Some(at) = latencies.waiting.remove(&page) {
            let us = at.elapsed().as_micros().min(u32::MAX as u128) as u32;
            latencies.samples.push(us);
        }
        Ok(outcome)
    }

    /// Installs `data` as page `page` (`UFFDIO_COPY`) and wakes the threads
    /// waiting on it.
    pub fn install(&self, page: u64, data: &[u8; PAGE_SIZE]) -> Result<Installed, FaultError> {
        let dst = self.address(page)?;
        // SAFETY: `dst` is a page of the registered mapping (range checked
        // above) and `data` a readable page; UFFDIO_COPY copies it in
        // atomically and fails with EEXIST if the page is present.
        let result = unsafe { self.uffd.copy(data.as_ptr(), dst, PAGE_SIZE) };
        self.installed(page, result, "UFFDIO_COPY")
    }

    /// Installs `data` (whole pages) as the pages from `first` in one
    /// `UFFDIO_COPY` up to the first page found present, and wakes the
    /// threads waiting on those: returns how many it installed (0 when
    /// the first is present). A thread faulting on the run runs on only
    /// once all of it is in, instead of faulting again on the next page
    /// while the one before is being installed.
    pub fn install_leading(&self, first: u64, data: &[u8]) -> Result<u64, FaultError> {
        if !data.len().is_multiple_of(PAGE_SIZE) {
            return Ok(0);
        }
        self.install_leading_with(first, (data.len() / PAGE_SIZE) as u64, "UFFDIO_COPY", |dst| {
            // SAFETY: `dst..dst + data.len()` lies inside the registered
            // mapping (both ends range checked before this runs) and `data` is
            // readable for that length; UFFDIO_COPY copies atomically per
            // page and stops at the first present one.
            unsafe { self.uffd.copy(data.as_ptr(), dst, data.len()) }
        })
    }

    /// Installs zero pages from `first`, up to `count`, in one
    /// `UFFDIO_ZEROPAGE` that stops at the first page found present, and
    /// wakes the threads waiting on those: returns how many it installed
    /// (0 when the first is present). A zero-filled guest's post-copy
    /// push took one ioctl a page otherwise.
    pub fn install_zero_leading(&self, first: u64, count: u64) -> Result<u64, FaultError> {
        self.install_leading_with(first, count, "UFFDIO_ZEROPAGE", |dst| {
            self.uffd.zeropage(dst, count as usize * PAGE_SIZE)
        })
    }

    /// Both of the above: `call(dst)` fills `pages` pages from `first`'s
    /// address, stopping at a present one.
    fn install_leading_with(
        &self,
        first: u64,
        pages: u64,
        what: &'static str,
        call: impl FnOnce(usize) -> Result<usize, InstallError>,
    ) -> Result<u64, FaultError> {
        if pages == 0 {
            return Ok(0);
        }
        let dst = self.address(first)?;
        self.address(first + pages - 1)?;
        let installed = match call(dst) {
            // Stopped at a present page: EAGAIN, with what it filled (and
            // woke) before.
            Ok(bytes) | Err(InstallError::Partial(bytes)) => (bytes / PAGE_SIZE) as u64,
            Err(InstallError::Errno(libc::EEXIST)) => 0,
            Err(e) => return Err(install_failed(what, e)),
        };
        for page in first..first + installed {
            self.installed(page, Ok(PAGE_SIZE), what)?;
        }
        Ok(installed)
    }

    /// Installs `data` (whole pages) as the pages from `first` in one
    /// `UFFDIO_COPY`, waking their waiters; a page found present already
    /// keeps its contents (the rest are installed one by one).
    pub fn install_run(&self, first: u64, data: &[u8]) -> Result<(), FaultError> {
        let installed = self.install_leading(first, data)?;
        for (i, page) in data.chunks_exact(PAGE_SIZE).enumerate().skip(installed as usize) {
            self.install(first + i as u64, page.try_into().expect("a page"))?;
        }
        Ok(())
    }

    /// Wakes the threads waiting on `page`, which the caller knows to be
    /// present (if it is not, they fault again).
    pub fn wake(&self, page: u64) -> Result<(), FaultError> {
        self.uffd.wake(self.address(page)?, PAGE_SIZE).map_err(op("UFFDIO_WAKE"))?;
        let mut latencies = self.latencies.lock().unwrap();
        if let Some(at) = latencies.waiting.remove(&page) {
            latencies.samples.push(at.elapsed().as_micros().min(u32::MAX as u128) as u32);
        }
        Ok(())
    }

    /// Installs a zero page (`UFFDIO_ZEROPAGE`) and wakes its waiters.
    pub fn install_zero(&self, page: u64) -> Result<Installed, FaultError> {
        let dst = self.address(page)?;
        let result = self.uffd.zeropage(dst, PAGE_SIZE);
        self.installed(page, result, "UFFDIO_ZEROPAGE")
    }

    /// Makes `count` pages from `first` missing again: their contents are
    /// dropped and the next access faults.
    pub fn discard(&self, first: u64, count: u64) -> Result<(), FaultError> {
        if count == 0 {
            return Ok(());
        }
        if first.checked_add(count).is_none_or(|end| end > self.pages) {
            return Err(FaultError::OutOfRange(first + count - 1));
        }
        let start = self.address(first)?;
        // SAFETY: the range lies inside the registered private anonymous
        // mapping (checked above); MADV_DONTNEED drops its pages, which then
        // read as missing.
        let r = unsafe { libc::madvise(start as *mut libc::c_void, count as usize * PAGE_SIZE, libc::MADV_DONTNEED) };
        if r != 0 {
            return Err(FaultError::Op { what: "MADV_DONTNEED", detail: std::io::Error::last_os_error().to_string() });
        }
        Ok(())
    }

    /// Discards every page set in `pages` that holds data. A page never
    /// populated is missing already and costs nothing; runs may span such
    /// pages, so a scattered set takes few calls. Each MADV_DONTNEED of a
    /// lone page costs ~1.4 µs (140k scattered stale pages were 200 ms of
    /// a post-copy switch), so the calls are spread over the cores.
    pub fn discard_set(&self, pages: &crate::DirtyBitmap) -> Result<(), FaultError> {
        if pages.count() <= FEW_PAGES {
            // Too few to pay for reading the page map (2 MB of it per GiB
            // of memory): one call per run of neighbours, populated or not.
            let mut run: Option<(u64, u64)> = None;
            for page in pages.iter() {
                run = match run {
                    Some((first, end)) if end == page => Some((first, page + 1)),
                    Some((first, end)) => {
                        self.discard(first, end - first)?;
                        Some((page, page + 1))
                    }
                    None => Some((page, page + 1)),
                };
            }
            return match run {
                Some((first, end)) => self.discard(first, end - first),
                None => Ok(()),
            };
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4) as u64;
        let share = self.pages.div_ceil(threads).div_ceil(64) * 64;
        std::thread::scope(|scope| {
            let parts: Vec<_> = (0..threads)
                .map(|i| (i * share, ((i + 1) * share).min(self.pages)))
                .filter(|(first, end)| first < end)
                .map(|(first, end)| scope.spawn(move || self.discard_range(pages, first, end)))
                .collect();
            parts.into_iter().try_for_each(|part| part.join().expect("discard thread"))
        })
    }

    /// [`Self::discard_set`] for pages `first..end`.
    fn discard_range(&self, pages: &crate::DirtyBitmap, first: u64, end: u64) -> Result<(), FaultError> {
        const CHUNK: u64 = 1 << 16;
        let pagemap = memory::Pagemap::open().ok();
        let mut populated = vec![true; CHUNK as usize];
        // The run being built: its first page, its end, and whether a page
        // in it holds data.
        let mut run: Option<(u64, u64, bool)> = None;
        let mut chunk_start = first;
        while chunk_start < end {
            let len = CHUNK.min(end - chunk_start) as usize;
            let words = &pages.words()[(chunk_start / 64) as usize..(chunk_start + len as u64).div_ceil(64) as usize];
            if words.iter().all(|&w| w == 0) {
                // Nothing to drop here: no need to know what is populated.
                if let Some((first, end, true)) = run.take() {
                    self.discard(first, end - first)?;
                }
                chunk_start += len as u64;
                continue;
            }
            let flags = &mut populated[..len];
            match &pagemap {
                Some(map) if map.populated(&self._memory, chunk_start, flags).is_ok() => {}
                _ => flags.fill(true),
            }
            for (i, &held) in flags.iter().enumerate() {
                let page = chunk_start + i as u64;
                let missing = pages.get(page);
                if missing || !held {
                    let needed = missing && held;
                    run = Some(match run {
                        Some((first, _, any)) => (first, page + 1, any || needed),
                        None => (page, page + 1, needed),
                    });
                } else if let Some((first, end, any)) = run.take() {
                    if any {
                        self.discard(first, end - first)?;
                    }
                }
            }
            chunk_start += len as u64;
        }
        if let Some((first, end, true)) = run {
            self.discard(first, end - first)?;
        }
        Ok(())
    }

    /// Stops serving faults: afterwards a missing page is zero-filled by
    /// the kernel on access, as in any anonymous mapping.
    pub fn unregister(&self) -> Result<(), FaultError> {
        self.uffd.unregister(self.base, self.pages as usize * PAGE_SIZE).map_err(op("UFFDIO_UNREGISTER"))
    }

    /// Makes the missing pages unresolvable until the VM is torn down: a
    /// post-copy that failed must never let its guest read a page it lacks
    /// as zeros. Closing the last descriptor of a userfaultfd would let the
    /// kernel zero-fill them, so one is kept open; a vCPU that touches a
    /// missing page waits. [`crate::Vm::shutdown`] lets it go ([`thaw`])
    /// once the vCPU is told to stop: it leaves KVM_RUN before it could
    /// run guest code again.
    pub fn freeze(&self) -> Result<(), FaultError> {
        let kept = self.uffd.try_clone().map_err(|e| FaultError::Op { what: "dup", detail: e.to_string() })?;
        FROZEN.lock().unwrap().push(Frozen { base: self.base, len: self.pages as usize * PAGE_SIZE, fd: kept });
        Ok(())
    }

    /// Counts and service times so far.
    pub fn stats(&self) -> FaultStats {
        let latencies = self.latencies.lock().unwrap();
        let mut samples = latencies.samples.clone();
        samples.sort_unstable();
        let at = |q: f64| samples.get(((samples.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0) as u64;
        FaultStats {
            faults: latencies.faults,
            served: samples.len() as u64,
            installed: latencies.installed,
            latency_p50_us: at(0.5),
            latency_p99_us: at(0.99),
            latency_max_us: samples.last().copied().unwrap_or(0) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn page_of(byte: u8) -> [u8; PAGE_SIZE] {
        [byte; PAGE_SIZE]
    }

    #[test]
    fn faults_are_served_and_pages_can_go_missing_again() {
        let mem = Arc::new(memory::create(16 << 20, false).unwrap());
        memory::write(&mem, 5 * PAGE_SIZE as u64, &[9]).unwrap(); // backed before: stays present
        let faults = Arc::new(PageFaults::register(&mem).unwrap());
        // A reader of three missing pages and one present one.
        let reader = {
            let mem = mem.clone();
            std::thread::spawn(move || {
                [3u64, 5, 7, 3].map(|page| {
                    let mut byte = [0u8];
                    memory::read(&mem, page * PAGE_SIZE as u64, &mut byte).unwrap();
                    byte[0]
                })
            })
        };
        let mut served = 0;
        let mut seen = Vec::new();
        while served < 2 {
            faults.wait_faults(Duration::from_millis(500), &mut seen).unwrap();
            for fault in seen.drain(..) {
                assert_ne!(fault.page, 5, "a present page faulted");
                if faults.install(fault.page, &page_of(fault.page as u8 + 100)).unwrap() == Installed::Now {
                    served += 1;
                }
            }
        }
        assert_eq!(reader.join().unwrap(), [103, 9, 107, 103]);
        // A second install of a present page, and a zero page.
        assert_eq!(faults.install(3, &page_of(1)).unwrap(), Installed::Already);
        assert_eq!(faults.install_zero(9).unwrap(), Installed::Now);
        let stats = faults.stats();
        assert_eq!((stats.faults, stats.served, stats.installed), (2, 2, 3));
        assert!(stats.latency_max_us >= stats.latency_p50_us);

        // Discarded pages fault again.
        let mut gone = crate::DirtyBitmap::new(faults.pages());
        gone.set(3);
        gone.set(4);
        faults.discard_set(&gone).unwrap();
        let reader = {
            let mem = mem.clone();
            std::thread::spawn(move || {
                let mut byte = [0u8];
                memory::read(&mem, 3 * PAGE_SIZE as u64, &mut byte).unwrap();
                byte[0]
            })
        };
        loop {
            faults.wait_faults(Duration::from_millis(500), &mut seen).unwrap();
            if let Some(fault) = seen.pop() {
                assert_eq!(fault.page, 3);
                faults.install(3, &page_of(42)).unwrap();
                break;
            }
        }
        assert_eq!(reader.join().unwrap(), 42);
        assert!(matches!(faults.install(faults.pages(), &page_of(0)), Err(FaultError::OutOfRange(_))));
        faults.unregister().unwrap();
        // Unregistered: a missing page reads as zeros without a fault.
        let mut byte = [1u8];
        memory::read(&mem, 4 * PAGE_SIZE as u64, &mut byte).unwrap();
        assert_eq!(byte[0], 0);
    }

    #[test]
    fn a_run_is_installed_in_one_copy_up_to_a_present_page_which_keeps_its_contents() {
        let mem = Arc::new(memory::create(8 << 20, false).unwrap());
        let faults = PageFaults::register(&mem).unwrap();
        faults.install(21, &page_of(9)).unwrap();
        let run: Vec<u8> = (0..4u8).flat_map(|i| page_of(50 + i)).collect();
        // Pages 10..14: one copy.
        faults.install_run(10, &run).unwrap();
        // Pages 20..24, 21 present: the others one by one.
        faults.install_run(20, &run).unwrap();
        let byte = |page: u64| {
            let mut b = [0u8];
            memory::read(&mem, page * PAGE_SIZE as u64, &mut b).unwrap();
            b[0]
        };
        assert_eq!([10, 11, 12, 13].map(byte), [50, 51, 52, 53]);
        assert_eq!([20, 21, 22, 23].map(byte), [50, 9, 52, 53]);
        assert!(faults.install_run(faults.pages() - 1, &run).is_err(), "past the end");

        // Pages 30..34, 32 present: 30 and 31 only.
        faults.install(32, &page_of(9)).unwrap();
        assert_eq!(faults.install_leading(30, &run).unwrap(), 2);
        assert_eq!(faults.install_leading(32, &run[..PAGE_SIZE]).unwrap(), 0, "present");
        assert_eq!(faults.install(33, &page_of(7)).unwrap(), Installed::Now, "left missing");
        assert_eq!([30, 31, 32, 33].map(byte), [50, 51, 9, 7]);
    }

    #[test]
    fn a_page_pushed_while_its_fault_waits_wakes_the_reader() {
        let mem = Arc::new(memory::create(8 << 20, false).unwrap());
        let faults = Arc::new(PageFaults::register(&mem).unwrap());
        let reader = {
            let mem = mem.clone();
            std::thread::spawn(move || {
                let mut byte = [0u8];
                memory::read(&mem, 11 * PAGE_SIZE as u64, &mut byte).unwrap();
                byte[0]
            })
        };
        // Another thread installs the page without reading the fault.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(faults.install(11, &page_of(77)).unwrap(), Installed::Now);
        assert_eq!(reader.join().unwrap(), 77);
        // The fault read late finds the page present.
        let mut seen = Vec::new();
        faults.wait_faults(Duration::from_millis(200), &mut seen).unwrap();
        for fault in seen {
            assert_eq!(faults.install(fault.page, &page_of(1)).unwrap(), Installed::Already);
        }
    }
}
