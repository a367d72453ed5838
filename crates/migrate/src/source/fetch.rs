//! The fetch stage: turns the dirty set into batches of pages read from
//! guest memory, one batch per shard-sized run of the bitmap. Each run's
//! dirty bits are cleared in KVM right before its pages are read, so a
//! write racing the read dirties the page again and nothing is missed.

use std::num::NonZeroUsize;
use std::sync::Arc;

use tsubame_vmm::{memory, DirtyBitmap, GuestMemory, VmError, PAGE_SIZE};
use vm_memory::bitmap::AtomicBitmap;
use xxhash_rust::xxh3::xxh3_128;

use super::busy::{StageWork, Stopwatch};
use super::vm::SourceVm;
use crate::digest::{page_hash, zero_page_hash, FarPageHashes};

/// Reads dirty pages into batches.
pub struct Fetcher {
    /// Tells never-populated (zero) pages apart without reading them.
    pagemap: Option<memory::Pagemap>,
    /// Scratch: one flag per page of a run.
    populated: Vec<bool>,
    /// Zero records for pages found zero (false with `--codec none`, which
    /// sends even untouched pages raw: a true baseline).
    zero_records: bool,
    /// `--zero-copy`: leave pages in guest memory; the sender splices them.
    by_reference: bool,
    /// Far memory's map, and what of it was sent.
    pub far: Option<Arc<FarFilter>>,
    /// The pages found all zeros (or never populated) after their dirty
    /// bit was cleared: the digest takes their hash without reading them.
    pub zeros: DirtyBitmap,
    /// The pages the destination may hold other than zeros: those last
    /// fetched with data. A zero page outside it is not fetched at all
    /// (its zero record would change nothing there).
    pub held_nonzero: DirtyBitmap,
    /// The pages [`Fetcher::pick`] chose, and whether each has data.
    picked: Vec<(u64, bool)>,
    /// Scratch for far pages' comparisons.
    scratch: Box<[u8; PAGE_SIZE]>,
    /// When set, the digest's hash of each page read, `(page, hash)`: in
    /// the stop, where the guest is paused and the digest would otherwise
    /// read every page again after it went out.
    pub hashes: Option<Vec<(u64, u64)>>,
    /// The guest is paused (the stop): no write races a read, so no dirty
    /// bit is cleared (left set, a resumed guest's next log holds them
    /// again: a superset), and without far memory no page map is asked
    /// (its dirty pages were written: populated). A kv guest's few hundred
    /// scattered last pages cost 5-8 µs each with a clear and a page-map
    /// read per run.
    pub paused: bool,
    /// Time spent clearing dirty bits and reading the page map, which a
    /// paused fetch skips (wall and CPU).
    pub bookkeeping: StageWork,
}

/// Far memory as the fetcher sees it. A page of the map is not sent while
/// it is not populated here, nor while it was never sent and still equals
/// its far copy: the destination reads it from the memory host. Once sent
/// (it came back and changed), the destination holds it, so it goes again
/// whenever it is dirty, even back to its far copy's contents.
pub struct FarFilter {
    map: Arc<FarPageHashes>,
    sent: AtomicBitmap,
}

impl FarFilter {
    /// Nothing sent yet.
    pub fn new(map: Arc<FarPageHashes>) -> FarFilter {
        let page = NonZeroUsize::new(PAGE_SIZE).expect("a page is bytes");
        let sent = AtomicBitmap::new(map.far.pages() as usize * PAGE_SIZE, page);
        FarFilter { map, sent }
    }

    /// True when mapped page `index` is still what the destination will
    /// read from the memory host: not populated here, or never sent and
    /// equal to its far copy (read into `scratch` to tell).
    fn still_far(
        &self,
        memory: &GuestMemory,
        index: u64,
        populated: bool,
        scratch: &mut [u8; PAGE_SIZE],
    ) -> Result<bool, VmError> {
        if !populated {
            return Ok(true);
        }
        if self.sent.is_bit_set(index as usize) {
            return Ok(false);
        }
        memory::read_page(memory, index, scratch)?;
        Ok(xxh3_128(scratch) == self.map.hashes[index as usize])
    }

    /// Page `page` goes to the destination other than through the fetcher
    /// (post-copy, a repair pass): if the map names it, it is not left far.
    pub fn mark_sent(&self, page: u64) {
        if self.map.far.get(page) {
            self.sent.set_bit(page as usize);
        }
    }

    /// The pages the map named when the migration started.
    pub fn far_at_start(&self) -> u64 {
        self.map.far.count()
    }

    /// Of those, the pages never sent: the destination reads them from the
    /// memory host.
    pub fn left_far(&self) -> u64 {
        self.map.far.iter().filter(|&page| !self.sent.is_bit_set(page as usize)).count() as u64
    }

    /// Takes out of post-copy's missing set the pages that are not the
    /// source's to send: those the destination reads from the memory host,
    /// and those never populated here (zeros: the destination's fresh
    /// memory holds them already, and a zero record would make it populate
    /// and then evict them).
    pub fn remove_unneeded(&self, memory: &GuestMemory, pages: &mut DirtyBitmap) -> Result<(), VmError> {
        remove_unpopulated(memory, pages);
        let mut scratch = [0u8; PAGE_SIZE];
        let listed: Vec<u64> = pages.iter().collect();
        for page in listed {
            if self.map.far.get(page) && self.still_far(memory, page, true, &mut scratch)? {
                pages.unset(page);
            }
        }
        Ok(())
    }
}

/// Takes out of `pages` those never populated in `memory`: zeros, which a
/// destination's fresh memory holds already. Runs of `pages` with nothing
/// set are not looked up; where the page map cannot be read, the rest
/// stays as it is.
pub fn remove_unpopulated(memory: &GuestMemory, pages: &mut DirtyBitmap) {
    const CHUNK: usize = 1 << 16;
    let Ok(pagemap) = memory::Pagemap::open() else { return };
    let mut populated = vec![true; CHUNK];
    let total = pages.pages();
    for first in (0..total).step_by(CHUNK) {
        let len = (total - first).min(CHUNK as u64) as usize;
        let words = (first / 64) as usize..(first + len as u64).div_ceil(64) as usize;
        if pages.words()[words].iter().all(|&w| w == 0) {
            continue;
        }
        if pagemap.populated(memory, first, &mut populated[..len]).is_err() {
            return;
        }
        for (i, _) in populated[..len].iter().enumerate().filter(|(_, &p)| !p) {
            pages.unset(first + i as u64);
        }
    }
}

impl Fetcher {
    /// A fetcher for batches of up to `batch_pages` pages; `held_nonzero`
    /// as the last iteration's fetcher left it (none at first).
    pub fn new(batch_pages: usize, held_nonzero: DirtyBitmap, zero_records: bool, by_reference: bool) -> Fetcher {
        Fetcher {
            pagemap: memory::Pagemap::open().ok(),
            populated: vec![true; batch_pages],
            zero_records,
            by_reference,
            far: None,
            zeros: DirtyBitmap::new(held_nonzero.pages()),
            held_nonzero,
            picked: Vec::with_capacity(batch_pages),
            scratch: Box::new([0; PAGE_SIZE]),
            hashes: None,
            paused: false,
            bookkeeping: StageWork::default(),
        }
    }

    /// Picks the pages to send of those set in `chunk`, the run of the
    /// dirty bitmap from `first_page`: clears their dirty bits in KVM, then
    /// tells zeros (checked in place; pages never populated are not read)
    /// from pages with data. Zeros the destination holds already are left
    /// out. Returns how many it picked, for [`Fetcher::fill`].
    pub fn pick(&mut self, vm: &dyn SourceVm, first_page: u64, chunk: &[u64]) -> Result<usize, VmError> {
        self.picked.clear();
        let ask = !self.paused || self.far.is_some();
        // Timed only where there is something to time (a look at the CPU
        // clock is a system call).
        let started = ask.then(Stopwatch::start);
        if !self.paused {
            vm.clear_dirty_log(first_page, chunk)?;
        }
        // Pages the kernel never populated are zeros: don't read them
        // (reading would populate them, and cost a fault each).
        let populated = &mut self.populated[..chunk.len() * 64];
        if !ask || self.pagemap.as_ref().is_none_or(|p| p.populated(vm.memory(), first_page, populated).is_err()) {
            populated.fill(true);
        }
        if let Some(started) = started {
            self.bookkeeping += started.elapsed();
        }
        for (w, &word) in chunk.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let offset = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let index = first_page + offset as u64;
                let far = self.far.as_deref().filter(|f| f.map.far.get(index));
                if let Some(far) = far {
                    if far.still_far(vm.memory(), index, populated[offset], &mut self.scratch)? {
                        continue;
                    }
                    far.sent.set_bit(index as usize);
                }
                let backed = !self.zero_records || (populated[offset] && !memory::page_is_zero(vm.memory(), index));
                if backed {
                    self.held_nonzero.set(index);
                } else {
                    self.zeros.set(index);
                    // (A far page's zero record overrides its far copy.)
                    if far.is_none() && !self.held_nonzero.get(index) {
                        continue;
                    }
                    self.held_nonzero.unset(index);
                }
                self.picked.push((index, backed));
            }
        }
        Ok(self.picked.len())
    }

    /// In the stop, after the last page: the hash of each page of `dirty`
    /// that is known without reading it again (those read, in page order,
    /// and the zeros), and the pages not read (left in guest memory for
    /// zero-copy, or still on the memory host), for the digest to read.
    /// Lists, not bitmaps of all memory: two copies of a 4 GiB guest's
    /// bitmap took 0.11 ms of a one-page stop, most of it faulting in
    /// fresh memory. The zeros are taken.
    pub fn stop_hashes(&mut self, dirty: &DirtyBitmap) -> (Vec<(u64, u64)>, Vec<u64>) {
        let mut hashes = self.hashes.take().unwrap_or_default();
        let zeros = std::mem::replace(&mut self.zeros, DirtyBitmap::new(0));
        debug_assert!(hashes.is_sorted_by_key(|&(page, _)| page), "fetched in page order");
        let (read, zero) = (hashes.len(), zero_page_hash());
        let (mut next, mut unread) = (0, Vec::new());
        for page in dirty.iter() {
            if next < read && hashes[next].0 == page {
                next += 1;
            } else if zeros.get(page) {
                hashes.push((page, zero));
            } else {
                unread.push(page);
            }
        }
        (hashes, unread)
    }

    /// Adds the pages just picked to `batch` (cleared for its iteration and
    /// shard, with room for them), reading those with data.
    pub fn fill(&mut self, vm: &dyn SourceVm, batch: &mut Batch) -> Result<(), VmError> {
        batch.by_reference = self.by_reference;
        for &(index, backed) in &self.picked {
            if backed && !batch.by_reference {
                let slot = batch.next_slot();
                memory::read_page(vm.memory(), index, slot)?;
                if let Some(hashes) = &mut self.hashes {
                    hashes.push((index, page_hash(slot)));
                }
            }
            batch.push(index, backed);
        }
        Ok(())
    }
}

/// Pages of one shard fetched from guest memory.
pub struct Batch {
    /// Iteration the pages belong to.
    pub iteration: u32,
    /// Their shard.
    pub shard: u16,
    /// The verification pass: send every page raw.
    pub repair: bool,
    /// `--zero-copy`: the pages were not read; the sender hands them to the
    /// kernel straight from guest memory.
    pub by_reference: bool,
    /// Page numbers.
    pub indices: Vec<u64>,
    /// False for pages the kernel never backed (zeros, not read).
    pub populated: Vec<bool>,
    /// `PAGE_SIZE` bytes per index; unread for unpopulated pages.
    pub pages: Vec<u8>,
}

impl Batch {
    /// An empty batch with room for `pages` pages.
    pub fn with_capacity(pages: usize) -> Batch {
        Batch {
            iteration: 0,
            shard: 0,
            repair: false,
            by_reference: false,
            indices: Vec::with_capacity(pages),
            populated: Vec::with_capacity(pages),
            pages: vec![0u8; pages * PAGE_SIZE],
        }
    }

    /// Empties the batch for reuse.
    pub fn clear(&mut self, iteration: u32, shard: u16, repair: bool) {
        self.iteration = iteration;
        self.shard = shard;
        self.repair = repair;
        self.by_reference = false;
        self.indices.clear();
        self.populated.clear();
    }

    /// The slot for the next page: call [`Batch::push`] after filling it.
    pub fn next_slot(&mut self) -> &mut [u8; PAGE_SIZE] {
        let at = self.indices.len() * PAGE_SIZE;
        (&mut self.pages[at..at + PAGE_SIZE]).try_into().unwrap()
    }

    /// Adds page `index` (its bytes in the slot when `populated`).
    pub fn push(&mut self, index: u64, populated: bool) {
        self.indices.push(index);
        self.populated.push(populated);
    }

    /// Pages in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True when no page was pushed.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The bytes of the batch's `i`th page.
    pub fn page(&self, i: usize) -> &[u8; PAGE_SIZE] {
        self.pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].try_into().unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_hands_the_digest_every_hash_it_knows_and_lists_the_rest() {
        let mut fetcher = Fetcher::new(64, DirtyBitmap::new(256), true, false);
        fetcher.hashes = Some(vec![(1, 11), (5, 55)]);
        fetcher.zeros.set(3);
        let mut dirty = DirtyBitmap::new(256);
        [1, 3, 5, 7].into_iter().for_each(|p| dirty.set(p));
        let (hashes, unread) = fetcher.stop_hashes(&dirty);
        assert_eq!(hashes, vec![(1, 11), (5, 55), (3, zero_page_hash())]);
        assert_eq!(unread, vec![7], "neither read nor zero: the digest reads it");
        assert!(fetcher.hashes.is_none() && fetcher.zeros.is_empty(), "taken");
    }
}
