//! The two sides of far memory and the state they share: which pages are
//! resident, which have a far copy and what that copy hashes to, which
//! are being written back, and the CLOCK's hand.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tsubame_vmm::memory::{self, Pagemap};
use tsubame_vmm::uffd::{Installed, PageFaults};
use tsubame_vmm::{DirtyBitmap, GuestMemory, Vm, PAGE_SIZE};
use xxhash_rust::xxh3::xxh3_128;

use crate::store::Stores;
use crate::{FarError, FarStats};

/// Most pages read ahead of one fault.
const MAX_WINDOW: u64 = 64;
/// First read-ahead window once a run is seen.
const FIRST_WINDOW: u64 = 4;
/// Largest stride (in pages) followed.
const MAX_STRIDE: i64 = 16;
/// Most pages evicted while the vCPU is stopped: the copy of 8 MiB takes
/// about a millisecond.
const MAX_BATCH: u64 = 2048;
/// Longest run written back in one request.
const MAX_WRITE_RUN: usize = 256;
/// Longest a fault waits for the evictor to make room.
const ROOM_WAIT: Duration = Duration::from_millis(50);

/// A batch being written back; faults on its pages are served from here.
struct Batch {
    data: Vec<u8>,
    index: HashMap<u64, usize>,
}

/// What both sides share.
pub(crate) struct State {
    mem: Arc<GuestMemory>,
    limit: u64,
    resident: DirtyBitmap,
    resident_count: u64,
    referenced: DirtyBitmap,
    /// The export holds a copy of the page.
    on_far: DirtyBitmap,
    /// Per page, the hash (xxh3-128) of its far copy, valid where `on_far`.
    /// A victim that still hashes the same is dropped without a write.
    /// Content, not the dirty log, decides: this KVM logs a page as dirty
    /// when it maps it after a read fault, so the log would call every
    /// page that came back dirty.
    far_hash: Vec<u128>,
    /// Read ahead and not yet seen used.
    prefetched: DirtyBitmap,
    inflight: HashMap<u64, Arc<Batch>>,
    /// The CLOCK's hand, a word of the bitmaps.
    hand: usize,
    /// A migration holds the far map: no eviction (the far copies must
    /// stay as the map says), and pages that come back are marked for it.
    pub(crate) handed_over: bool,
    /// The evictor chose a batch and has not finished writing it back.
    pub(crate) evicting: bool,
    pub(crate) stats: FarStats,
}

impl State {
    pub(crate) fn new(mem: &Arc<GuestMemory>, pages: u64, limit: u64) -> State {
        // Pages populated before the vCPU ran (the loaded guest) are
        // resident without a fault.
        let mut resident = DirtyBitmap::new(pages);
        if let Ok(map) = Pagemap::open() {
            let mut flags = vec![false; pages as usize];
            if map.populated(mem, 0, &mut flags).is_ok() {
                flags.iter().enumerate().filter(|(_, &p)| p).for_each(|(i, _)| resident.set(i as u64));
            }
        }
        let resident_count = resident.count();
        State {
            mem: mem.clone(),
            limit,
            referenced: DirtyBitmap::new(pages),
            on_far: DirtyBitmap::new(pages),
            far_hash: vec![0; pages as usize],
            prefetched: DirtyBitmap::new(pages),
            inflight: HashMap::new(),
            hand: 0,
            handed_over: false,
            evicting: false,
            stats: FarStats {
                local_limit_bytes: limit * PAGE_SIZE as u64,
                resident_max_pages: resident_count,
                ..FarStats::default()
            },
            resident,
            resident_count,
        }
    }

    /// A migrated VM's far pages: their copies are where the source left
    /// them, with these hashes.
    pub(crate) fn seed(&mut self, far: DirtyBitmap, hashes: Vec<u128>) {
        self.on_far = far;
        self.far_hash = hashes;
    }

    /// Pages whose only copy is far, and each far copy's hash.
    pub(crate) fn far_map(&self) -> (DirtyBitmap, Vec<u128>) {
        let mut far = self.on_far.clone();
        far.words_mut().iter_mut().zip(self.resident.words()).for_each(|(f, r)| *f &= !r);
        (far, self.far_hash.clone())
    }

    pub(crate) fn stats(&self) -> FarStats {
        let mut s = self.stats.clone();
        s.resident_pages = self.resident_count;
        s.far_pages =
            self.on_far.words().iter().zip(self.resident.words()).map(|(f, r)| (f & !r).count_ones() as u64).sum();
        s
    }

    fn mark_resident(&mut self, page: u64, referenced: bool) {
        if self.handed_over {
            // The migration must send it: it no longer lives (only) far.
            memory::mark_vmm_dirty(&self.mem, page, 1);
        }
        if !self.resident.get(page) {
            self.resident.set(page);
            self.resident_count += 1;
            self.stats.resident_max_pages = self.stats.resident_max_pages.max(self.resident_count);
        }
        if referenced {
            self.referenced.set(page);
        }
    }

    /// Pages written since the last look (or mapped after a fault): used
    /// again.
    fn note_dirty(&mut self, dirty: &DirtyBitmap) {
        let words = dirty.words();
        for (i, &d) in words.iter().enumerate() {
            if d != 0 {
                let r = self.resident.words()[i];
                self.referenced.words_mut()[i] |= d & r;
                let used = self.prefetched.words()[i] & d;
                if used != 0 {
                    self.stats.readahead_hits += used.count_ones() as u64;
                    self.prefetched.words_mut()[i] &= !d;
                }
            }
        }
    }

    /// Up to `n` resident pages not referenced since the hand last passed
    /// them; the hand clears the bits of those it passes.
    fn clock(&mut self, n: u64) -> Vec<u64> {
        let words = self.resident.words().len();
        let mut victims = Vec::new();
        for _ in 0..2 * words {
            if victims.len() as u64 >= n {
                break;
            }
            let w = self.hand;
            let r = self.resident.words()[w];
            let mut candidates = r & !self.referenced.words()[w];
            let mut took = 0;
            while candidates != 0 && (victims.len() as u64) < n {
                let bit = candidates.trailing_zeros() as u64;
                candidates &= candidates - 1;
                took |= 1 << bit;
                victims.push(w as u64 * 64 + bit);
            }
            if candidates == 0 {
                // Second chance used: the next pass may take them.
                self.referenced.words_mut()[w] &= !r;
                self.hand = (w + 1) % words;
            }
            // Referenced until the caller drops them: a second lap took them
            // again, and each take counted a page out of residency.
            self.referenced.words_mut()[w] |= took;
        }
        victims
    }
}

/// The fault side tells the evictor that residency crossed its mark.
#[derive(Default)]
pub(crate) struct Wake {
    flag: Mutex<bool>,
    cond: Condvar,
}

impl Wake {
    pub(crate) fn notify(&self) {
        *self.flag.lock().unwrap() = true;
        self.cond.notify_one();
    }

    fn wait(&self, timeout: Duration) {
        let guard = self.flag.lock().unwrap();
        let (mut guard, _) = self.cond.wait_timeout_while(guard, timeout, |set| !*set).unwrap();
        *guard = false;
    }
}

/// Residency above which the evictor starts, and down to which it goes.
fn marks(limit: u64) -> (u64, u64) {
    let reserve = (limit / 32).max(64);
    (limit.saturating_sub(reserve), limit.saturating_sub(2 * reserve))
}

/// Sequential and strided runs of faults (as Leap): once two faults in a
/// row are the same small stride apart, the pages that would follow are
/// read with the fault, in a window that doubles while the run goes on.
#[derive(Default)]
struct Readahead {
    last: u64,
    stride: i64,
    window: u64,
    /// Where the run's next fault lands if the guest used the window.
    expect: Option<u64>,
}

impl Readahead {
    /// The stride and window to read after a fault on `page`.
    fn plan(&mut self, page: u64) -> (i64, u64) {
        let delta = page as i64 - self.last as i64;
        if self.expect == Some(page) {
            self.window = (self.window * 2).min(MAX_WINDOW);
        } else if delta != 0 && delta == self.stride && delta.abs() <= MAX_STRIDE {
            self.window = FIRST_WINDOW;
        } else {
            self.stride = delta;
            self.window = 0;
        }
        self.last = page;
        self.expect = None;
        (self.stride, self.window)
    }
}

/// Serves faults.
pub(crate) struct FaultSide {
    pub state: Arc<Mutex<State>>,
    pub faults: Arc<PageFaults>,
    pub stores: Stores,
    pub stop: Arc<AtomicBool>,
    pub wake: Arc<Wake>,
}

impl FaultSide {
    pub(crate) fn run(&mut self) {
        let mut seen = Vec::new();
        let mut readahead = Readahead::default();
        let mut buf = vec![0u8; (MAX_WINDOW as usize + 1) * PAGE_SIZE];
        let mut lost = false;
        while !self.stop.load(Ordering::Acquire) {
            if self.faults.wait_faults(Duration::from_millis(20), &mut seen).is_err() {
                break;
            }
            if lost {
                // A vCPU on a far page waits: the VM stays paused.
                seen.clear();
                continue;
            }
            seen.sort_unstable_by_key(|f| f.page);
            seen.dedup_by_key(|f| f.page);
            for fault in std::mem::take(&mut seen) {
                self.wait_for_room();
                if let Err(e) = self.serve(fault.page, &mut readahead, &mut buf) {
                    self.lose(e);
                    lost = true;
                    break;
                }
            }
            let over = {
                let state = self.state.lock().unwrap();
                state.resident_count > marks(state.limit).0
            };
            if over {
                self.wake.notify();
            }
        }
    }

    /// At the limit, gives the evictor a moment to make room before a page
    /// comes back, so that residency stays under `--local-memory` even when
    /// the evictor ran late. Bounded: a guest is never stalled for long on
    /// it (and a migration holding the map suspends the limit).
    fn wait_for_room(&self) {
        let deadline = Instant::now() + ROOM_WAIT;
        loop {
            {
                let state = self.state.lock().unwrap();
                if state.handed_over || state.stats.error.is_some() || state.resident_count < state.limit {
                    return;
                }
            }
            if Instant::now() > deadline || self.stop.load(Ordering::Acquire) {
                return;
            }
            self.wake.notify();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn lose(&self, e: FarError) {
        let mut state = self.state.lock().unwrap();
        if state.stats.error.is_none() {
            state.stats.error = Some(e.to_string());
        }
        // Closing the userfaultfd would let the kernel zero-fill the pages
        // that live far: keep it, so they are never read as zeros.
        let _ = self.faults.freeze();
    }

    fn serve(&mut self, page: u64, readahead: &mut Readahead, buf: &mut [u8]) -> Result<(), FarError> {
        let installed =
            |r: Result<Installed, tsubame_vmm::uffd::FaultError>| r.map_err(|e| FarError::Vm(e.to_string()));
        let mut state = self.state.lock().unwrap();
        state.stats.faults += 1;
        if state.resident.get(page) {
            // Served already (read ahead after this fault was queued). Only
            // a wake: were the map ever wrong, the thread faults again
            // instead of reading zeros.
            self.faults.wake(page).map_err(|e| FarError::Vm(e.to_string()))?;
            return Ok(());
        }
        if let Some(batch) = state.inflight.get(&page).cloned() {
            let at = batch.index[&page] * PAGE_SIZE;
            installed(self.faults.install(page, page_array(&batch.data[at..at + PAGE_SIZE])))?;
            state.mark_resident(page, true);
            state.stats.inflight_hits += 1;
            return Ok(());
        }
        if !state.on_far.get(page) {
            installed(self.faults.install_zero(page))?;
            state.mark_resident(page, true);
            state.stats.zero_fills += 1;
            return Ok(());
        }
        // The faulting page, then the run that follows it.
        let (stride, window) = readahead.plan(page);
        // Read-ahead never takes residency past the limit.
        let room = if state.handed_over { window } else { state.limit.saturating_sub(state.resident_count + 1) };
        let window = window.min(room);
        let follows = |state: &State, p: u64| {
            p < state.resident.pages()
                && state.on_far.get(p)
                && !state.resident.get(p)
                && !state.inflight.contains_key(&p)
        };
        let mut more = Vec::new();
        for i in 1..=window as i64 {
            let p = page as i64 + stride * i;
            if p < 0 || !follows(&state, p as u64) {
                break;
            }
            more.push(p as u64);
        }
        let count = 1 + more.len();
        // Every page read back must hash to what it was when it went away.
        let matches = |first: u64, bytes: &[u8]| {
            bytes.chunks(PAGE_SIZE).enumerate().all(|(i, p)| xxh3_128(p) == state.far_hash[first as usize + i])
        };
        if stride == 1 {
            let check = |bytes: &[u8]| matches(page, bytes);
            self.stores.read_checked(page * PAGE_SIZE as u64, &mut buf[..count * PAGE_SIZE], &check)?;
        } else {
            self.stores.read_checked(page * PAGE_SIZE as u64, &mut buf[..PAGE_SIZE], &|b| matches(page, b))?;
            for (i, &p) in more.iter().enumerate() {
                let at = (i + 1) * PAGE_SIZE;
                self.stores.read_checked(p * PAGE_SIZE as u64, &mut buf[at..at + PAGE_SIZE], &|b| matches(p, b))?;
            }
        }
        state.stats.bytes_read += (count * PAGE_SIZE) as u64;
        if stride == 1 {
            // One copy for the whole run.
            self.faults.install_run(page, &buf[..count * PAGE_SIZE]).map_err(|e| FarError::Vm(e.to_string()))?;
        } else {
            installed(self.faults.install(page, page_array(&buf[..PAGE_SIZE])))?;
            for (i, &p) in more.iter().enumerate() {
                let at = (i + 1) * PAGE_SIZE;
                installed(self.faults.install(p, page_array(&buf[at..at + PAGE_SIZE])))?;
            }
        }
        state.mark_resident(page, true);
        for &p in &more {
            state.mark_resident(p, false);
            state.prefetched.set(p);
        }
        state.stats.readahead_pages += more.len() as u64;
        if let Some(&last) = more.last() {
            readahead.expect = Some((last as i64 + stride) as u64);
            readahead.last = last;
        }
        Ok(())
    }
}

fn page_array(bytes: &[u8]) -> &[u8; PAGE_SIZE] {
    bytes.try_into().expect("a page")
}

/// Keeps residency under the limit.
pub(crate) struct Evictor {
    pub state: Arc<Mutex<State>>,
    pub faults: Arc<PageFaults>,
    pub stores: Stores,
    pub stop: Arc<AtomicBool>,
    pub wake: Arc<Wake>,
    pub vm: Arc<Vm>,
    pub dirty: Option<DirtyBitmap>,
}

impl Evictor {
    pub(crate) fn run(&mut self) {
        while !self.stop.load(Ordering::Acquire) {
            self.wake.wait(Duration::from_millis(50));
            loop {
                let (count, limit, lost, handed_over) = {
                    let s = self.state.lock().unwrap();
                    (s.resident_count, s.limit, s.stats.error.is_some(), s.handed_over)
                };
                let (start, target) = marks(limit);
                if lost || handed_over || count <= start || self.stop.load(Ordering::Acquire) {
                    break;
                }
                let result = self.evict((count - target).min(MAX_BATCH));
                self.state.lock().unwrap().evicting = false;
                match result {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => {
                        let mut state = self.state.lock().unwrap();
                        if state.stats.error.is_none() {
                            state.stats.error = Some(e.to_string());
                        }
                        drop(state);
                        // Pages of the failed write stay in memory (served
                        // from the batch); stop the guest before it needs
                        // one that cannot come back.
                        let _ = self.vm.pause();
                        let _ = self.faults.freeze();
                        break;
                    }
                }
            }
        }
    }

    /// Evicts up to `n` pages; returns how many.
    fn evict(&mut self, n: u64) -> Result<u64, FarError> {
        {
            // Said before the vCPU stops, so that a migration taking the
            // map waits for this batch, and never finds the VM paused by it.
            let mut state = self.state.lock().unwrap();
            if state.handed_over {
                return Ok(0);
            }
            state.evicting = true;
        }
        let running = !self.vm.status().is_stopped();
        let stopped_at = Instant::now();
        if running && self.vm.pause().is_err() {
            return Ok(0); // try again later
        }
        let (batch, writes, count) = {
            let mut state = self.state.lock().unwrap();
            let dirty = self.dirty.get_or_insert_with(|| DirtyBitmap::new(state.resident.pages()));
            dirty.clear();
            // The log only feeds the CLOCK's reference bits: without it the
            // choice of victims is worse, never wrong.
            if self.vm.dirty_log(dirty).is_ok() && self.vm.clear_dirty_log(0, dirty.words()).is_ok() {
                state.note_dirty(dirty);
            }
            let victims = state.clock(n);
            let mut data = Vec::new();
            let mut index = HashMap::new();
            let mut writes = Vec::new();
            let mut page_buf = [0u8; PAGE_SIZE];
            for &v in &victims {
                memory::read_page(&state.mem, v, &mut page_buf).map_err(|e| FarError::Vm(e.to_string()))?;
                let hash = xxh3_128(&page_buf);
                if state.on_far.get(v) && state.far_hash[v as usize] == hash {
                    state.stats.clean_drops += 1;
                    continue;
                }
                state.far_hash[v as usize] = hash;
                index.insert(v, writes.len());
                writes.push(v);
                data.extend_from_slice(&page_buf);
            }
            discard_runs(&self.faults, &victims)?;
            let batch = Arc::new(Batch { data, index });
            for &v in &victims {
                state.resident.unset(v);
                state.referenced.unset(v);
                state.prefetched.unset(v);
                state.on_far.set(v);
            }
            for &v in &writes {
                state.inflight.insert(v, batch.clone());
            }
            state.resident_count -= victims.len() as u64;
            state.stats.evicted_pages += victims.len() as u64;
            state.stats.evictions += 1;
            (batch, writes, victims.len() as u64)
        };
        if running {
            let _ = self.vm.resume();
        }
        self.state.lock().unwrap().stats.eviction_pause_ms += stopped_at.elapsed().as_secs_f64() * 1e3;
        // Write back while the guest runs, contiguous pages in one request.
        let mut i = 0;
        while i < writes.len() {
            let mut j = i + 1;
            while j < writes.len() && j - i < MAX_WRITE_RUN && writes[j] == writes[j - 1] + 1 {
                j += 1;
            }
            self.stores.write(writes[i] * PAGE_SIZE as u64, &batch.data[i * PAGE_SIZE..j * PAGE_SIZE])?;
            i = j;
        }
        let mut state = self.state.lock().unwrap();
        state.stats.bytes_written += (writes.len() * PAGE_SIZE) as u64;
        for v in &writes {
            if state.inflight.get(v).is_some_and(|b| Arc::ptr_eq(b, &batch)) {
                state.inflight.remove(v);
            }
        }
        Ok(count)
    }
}

/// Drops the pages of `victims` (sorted), a run at a time.
fn discard_runs(faults: &PageFaults, victims: &[u64]) -> Result<(), FarError> {
    let mut i = 0;
    while i < victims.len() {
        let mut j = i + 1;
        while j < victims.len() && victims[j] == victims[j - 1] + 1 {
            j += 1;
        }
        faults.discard(victims[i], (j - i) as u64).map_err(|e| FarError::Vm(e.to_string()))?;
        i = j;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequential_run_reads_ahead_in_a_growing_window() {
        let mut ra = Readahead::default();
        assert_eq!(ra.plan(100).1, 0);
        assert_eq!(ra.plan(101), (1, 0));
        assert_eq!(ra.plan(102), (1, FIRST_WINDOW));
        // The guest used the window: its next fault is past it.
        ra.expect = Some(107);
        ra.last = 106;
        assert_eq!(ra.plan(107), (1, 2 * FIRST_WINDOW));
        // A jump ends the run.
        assert_eq!(ra.plan(5000).1, 0);
        // Strided.
        ra.plan(5008);
        assert_eq!(ra.plan(5016), (8, FIRST_WINDOW));
        // Too wide a stride is not followed.
        ra.plan(9000);
        ra.plan(9100);
        assert_eq!(ra.plan(9200).1, 0);
    }

    #[test]
    fn the_clock_gives_a_second_chance_to_referenced_pages() {
        let mem = Arc::new(memory::create(8 << 20, false).unwrap());
        let mut state = State::new(&mem, 2048, 512);
        for p in 0..200 {
            state.mark_resident(p, p < 100);
        }
        // The unreferenced first.
        let first = state.clock(50);
        assert_eq!(first, (100..150).collect::<Vec<_>>());
        // Marks below: victims are taken, but no page lost its state yet.
        for &v in &first {
            state.resident.unset(v);
        }
        let next = state.clock(60);
        assert_eq!(next[..50], (150..200).collect::<Vec<_>>()[..]);
        // Then, their bits cleared by the pass, the referenced ones.
        assert!(next[50..].iter().all(|&p| p < 100), "{next:?}");
        // A lap that comes back to its own victims (not dropped yet) skips them.
        let mut lapped = State::new(&mem, 2048, 512);
        (0..200).for_each(|p| lapped.mark_resident(p, p < 100));
        let mut all = lapped.clock(250);
        all.sort_unstable();
        assert_eq!(all, (0..200).collect::<Vec<_>>());
    }
}
