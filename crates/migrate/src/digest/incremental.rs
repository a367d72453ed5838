//! The digest itself: each page's hash, and each region's over its pages'.

use std::sync::Arc;

use tsubame_vmm::{memory, DirtyBitmap, GuestMemory, PAGE_SIZE};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

/// Default region size: 256 KiB (32 KiB of hashes per GiB). Small enough
/// that a few scattered dirty pages cost little re-hashing (see
/// [`IncrementalDigest`]).
pub const DEFAULT_REGION: u32 = 256 << 10;

/// The hash of each `region`-byte slice of guest memory, in order: xxh3
/// over the xxh3 of each of its pages (little-endian u64s), so that a
/// changed page costs hashing one page again, not its whole region. Runs
/// on `threads` threads; the VM must not be running. Pages the kernel
/// never populated are zeros: their hash is known, not read.
pub fn memory_digest(mem: &GuestMemory, region: u32, threads: usize) -> Vec<u64> {
    let mut digest = IncrementalDigest::new(mem, region, None);
    digest.refresh(mem, threads);
    digest.regions
}

/// The source's digest, kept up to date while pre-copy runs, so that
/// stop-and-copy hashes only the last dirty pages instead of all memory
/// while the guest is paused.
///
/// A page is hashed after an iteration sent it (its dirty bit cleared and
/// the page read first). A guest write after that read sets the dirty bit
/// again, so the page is in a later iteration's dirty set, or in the final
/// one, and is hashed again then.
pub struct IncrementalDigest {
    region: u32,
    /// Far memory's pages: one not populated here takes its far copy's hash.
    far: Option<Arc<FarPageHashes>>,
    /// Per page.
    pages: Vec<u64>,
    /// Per page: to hash again.
    stale_pages: Vec<bool>,
    /// Per region: over its pages' hashes.
    regions: Vec<u64>,
    /// Per region: some page of it is stale.
    stale_regions: Vec<bool>,
    /// The stale pages, and the stale regions in the order marked: a
    /// refresh of a few pages (each stop's, on both ends) visits only
    /// theirs, not every page's flag (a million per 4 GiB).
    stale_count: usize,
    stale_list: Vec<u32>,
}

impl IncrementalDigest {
    /// Every page stale: the first [`IncrementalDigest::refresh`] hashes all.
    pub fn new(mem: &GuestMemory, region: u32, far: Option<Arc<FarPageHashes>>) -> IncrementalDigest {
        let pages = memory::page_count(mem) as usize;
        let regions = memory::size(mem).div_ceil(region as u64) as usize;
        IncrementalDigest {
            region,
            far,
            pages: vec![0; pages],
            stale_pages: vec![true; pages],
            regions: vec![0; regions],
            stale_regions: vec![true; regions],
            stale_count: pages,
            stale_list: (0..regions as u32).collect(),
        }
    }

    /// Memory known to hold only zeros: nothing stale.
    pub fn zeros(mem: &GuestMemory, region: u32) -> IncrementalDigest {
        let pages = vec![zero_page_hash(); memory::page_count(mem) as usize];
        let regions = region_hashes(&pages, region);
        IncrementalDigest {
            region,
            far: None,
            stale_pages: vec![false; pages.len()],
            stale_regions: vec![false; regions.len()],
            stale_count: 0,
            stale_list: Vec::new(),
            pages,
            regions,
        }
    }

    fn pages_per_region(&self) -> usize {
        (self.region as usize / PAGE_SIZE).max(1)
    }

    /// Marks the pages set in `dirty` to be hashed again.
    pub fn mark(&mut self, dirty: &DirtyBitmap) {
        self.mark_pages(dirty.iter());
    }

    /// Marks these pages to be hashed again.
    pub fn mark_pages(&mut self, pages: impl Iterator<Item = u64>) {
        let per_region = self.pages_per_region();
        for page in pages {
            if let Some(mark) = self.stale_pages.get_mut(page as usize) {
                self.stale_count += usize::from(!*mark);
                *mark = true;
                self.stale_region(page as usize / per_region);
            }
        }
    }

    /// Takes the zero page's hash for the pages set in `zeros`, pages read
    /// as all zeros after their dirty bit was cleared: a write since then
    /// marks them again, and hashing them would read them a second time.
    /// (One marked before and not hashed yet is hashed no more.)
    pub fn known_zero(&mut self, zeros: &DirtyBitmap) {
        let zero = zero_page_hash();
        self.known(zeros.iter().map(|page| (page, zero)));
    }

    /// Takes each `(page, hash)` as the page's hash: from a reader that
    /// read the page after its dirty bit was cleared, as in
    /// [`IncrementalDigest::known_zero`].
    pub fn known(&mut self, hashes: impl Iterator<Item = (u64, u64)>) {
        let per_region = self.pages_per_region();
        for (page, hash) in hashes {
            let i = page as usize;
            if let Some(mark) = self.stale_pages.get_mut(i) {
                self.stale_count -= usize::from(std::mem::take(mark));
                self.pages[i] = hash;
                self.stale_region(i / per_region);
            }
        }
    }

    /// Leaves the pages set in `pages` unhashed for now: their hashes
    /// come later ([`IncrementalDigest::known`]), or they are marked again.
    /// Until then their regions' hashes are not valid.
    pub fn unmark(&mut self, pages: &DirtyBitmap) {
        for page in pages.iter() {
            if let Some(mark) = self.stale_pages.get_mut(page as usize) {
                self.stale_count -= usize::from(std::mem::take(mark));
            }
        }
    }

    fn stale_region(&mut self, region: usize) {
        if !std::mem::replace(&mut self.stale_regions[region], true) {
            self.stale_list.push(region as u32);
        }
    }

    /// Hashes the marked pages and their regions on `threads` threads;
    /// returns how many pages it read (a page the kernel never populated
    /// takes the zero page's hash unread).
    pub fn refresh(&mut self, mem: &GuestMemory, threads: usize) -> usize {
        let per_region = self.pages_per_region();
        let count = self.regions.len();
        // Threads pay only for real work (and a short-lived thread's
        // teardown outlives its scope, which leak checkers flag).
        let stale = std::mem::take(&mut self.stale_count);
        let threads = if stale * PAGE_SIZE < MIN_BYTES_PER_THREAD { 1 } else { threads.clamp(1, count.max(1)) };
        let mut stale_list = std::mem::take(&mut self.stale_list);
        // Regions stale only for hashes handed over read nothing (a
        // destination's, many times a second).
        let pagemap = if stale > 0 { memory::Pagemap::open().ok() } else { None };
        let slice = |first_page: u64, regions, stale_regions, pages, stale_pages| Slice {
            far: self.far.as_deref(),
            first_page,
            per_region,
            regions,
            stale_regions,
            pages,
            stale_pages,
        };
        let hashed = if threads == 1 {
            // Only the regions marked, not every region's flag.
            let mut all = slice(0, &mut self.regions, &mut self.stale_regions, &mut self.pages, &mut self.stale_pages);
            all.hash_regions(stale_list.iter().map(|&r| r as usize), mem, pagemap.as_ref())
        } else {
            let regions_per_thread = count.div_ceil(threads).max(1);
            let chunks = self
                .regions
                .chunks_mut(regions_per_thread)
                .zip(self.stale_regions.chunks_mut(regions_per_thread))
                .zip(self.pages.chunks_mut(regions_per_thread * per_region))
                .zip(self.stale_pages.chunks_mut(regions_per_thread * per_region))
                .enumerate()
                .map(|(t, (((regions, stale_regions), pages), stale_pages))| {
                    slice((t * regions_per_thread * per_region) as u64, regions, stale_regions, pages, stale_pages)
                });
            let pagemap = pagemap.as_ref();
            std::thread::scope(|scope| {
                let handles: Vec<_> = chunks
                    .filter(|slice| slice.stale_regions.contains(&true))
                    .map(|mut slice| scope.spawn(move || slice.hash_regions(0..slice.regions.len(), mem, pagemap)))
                    .collect();
                handles.into_iter().map(|h| h.join().expect("digest thread")).sum()
            })
        };
        stale_list.clear();
        self.stale_list = stale_list;
        hashed
    }

    /// The region hashes (valid after a refresh with the guest paused).
    pub fn hashes(&self) -> &[u64] {
        &self.regions
    }

    /// Each page's hash (valid after a refresh, as the region hashes),
    /// handed over: the digest is spent.
    pub fn take_page_hashes(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.pages)
    }
}

/// The hash of one page as the digest takes it: the low half of its
/// xxh3-128, so that far memory's hash of a far copy gives a far page's
/// hash without reading it ([`far_copy_hash`]).
pub fn page_hash(page: &[u8; PAGE_SIZE]) -> u64 {
    xxh3_128(page) as u64
}

/// What hashing a page already in cache costs on this host: the least of
/// a few timed rounds (a round may be preempted), timed once per process.
pub fn page_hash_cost() -> std::time::Duration {
    const ROUNDS: u32 = 4;
    const PAGES: u32 = 64;
    static COST: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *COST.get_or_init(|| {
        let page = std::hint::black_box([0x5a_u8; PAGE_SIZE]);
        (0..ROUNDS)
            .map(|_| {
                let start = std::time::Instant::now();
                (0..PAGES).for_each(|_| {
                    std::hint::black_box(page_hash(std::hint::black_box(&page)));
                });
                start.elapsed() / PAGES
            })
            .min()
            .unwrap_or_default()
    })
}

/// A far page's digest hash from the xxh3-128 far memory keeps of its copy.
pub fn far_copy_hash(copy: u128) -> u64 {
    copy as u64
}

/// The pages a VM keeps on a memory host and their copies' hashes: both
/// ends' digests take those for a far page instead of reading it (which
/// would fetch it, or read zeros where nothing is mapped yet).
#[derive(Debug)]
pub struct FarPageHashes {
    /// Pages whose only copy is far (when not populated here).
    pub far: DirtyBitmap,
    /// Per page, the xxh3-128 of its far copy (valid where `far`).
    pub hashes: Vec<u128>,
}

/// The hash of a zero page (and of a page never populated).
pub fn zero_page_hash() -> u64 {
    static ZERO: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ZERO.get_or_init(|| page_hash(&[0u8; PAGE_SIZE]))
}

/// The region hashes of `region`-byte regions from each page's hash: what
/// [`memory_digest`] gives for memory holding those pages.
pub fn region_hashes(pages: &[u64], region: u32) -> Vec<u64> {
    region_hashes_by(pages.len(), region, |page| pages[page])
}

/// [`region_hashes`] of `pages` pages whose hashes `hash` gives one by one
/// (no copy of them all first: 8 MiB for a 4 GiB guest, whose first
/// touch took most of 25 ms here).
pub fn region_hashes_by(pages: usize, region: u32, hash: impl Fn(usize) -> u64) -> Vec<u64> {
    let per_region = (region as usize / PAGE_SIZE).max(1);
    let mut bytes = Vec::with_capacity(per_region * 8);
    (0..pages)
        .step_by(per_region)
        .map(|first| combine((first..pages.min(first + per_region)).map(&hash), &mut bytes))
        .collect()
}

/// A region's hash: that of its pages' hashes as little-endian bytes,
/// laid out in `bytes`.
fn combine(hashes: impl IntoIterator<Item = u64>, bytes: &mut Vec<u8>) -> u64 {
    bytes.clear();
    for hash in hashes {
        bytes.extend_from_slice(&hash.to_le_bytes());
    }
    xxh3_64(bytes)
}

/// Stale pages of a region from which the page map is asked which of them
/// the kernel never populated, instead of reading them all.
const PAGEMAP_WORTH: usize = 16;

/// Less stale memory than this is hashed on the calling thread alone.
const MIN_BYTES_PER_THREAD: usize = 64 << 20;

/// One thread's share of an [`IncrementalDigest`]: whole regions.
struct Slice<'a> {
    far: Option<&'a FarPageHashes>,
    first_page: u64,
    per_region: usize,
    regions: &'a mut [u64],
    stale_regions: &'a mut [bool],
    pages: &'a mut [u64],
    stale_pages: &'a mut [bool],
}

impl Slice<'_> {
    /// Hashes the stale pages of the given regions (indices into this
    /// slice; regions not stale are passed over) and the regions; returns
    /// the pages read (a page never populated takes a known hash).
    fn hash_regions(
        &mut self,
        which: impl Iterator<Item = usize>,
        mem: &GuestMemory,
        pagemap: Option<&memory::Pagemap>,
    ) -> usize {
        let per_region = self.per_region;
        let zero_page = zero_page_hash();
        let mut page = [0u8; PAGE_SIZE];
        let mut populated = vec![true; per_region];
        let mut combined = Vec::with_capacity(per_region * 8);
        let mut n = 0;
        for r in which {
            if !std::mem::take(&mut self.stale_regions[r]) {
                continue;
            }
            let first = r * per_region;
            let last = (first + per_region).min(self.pages.len());
            let first_page = self.first_page + first as u64;
            let populated = &mut populated[..last - first];
            // The page map saves reading pages never populated (most of a
            // fresh VM on the first pass); for a few stale pages reading
            // them costs less than asking it (a kv guest's scattered pages
            // hashed at 3.5 µs each with a page-map read per region). A
            // region stale only for pages whose hash is known (zeros read
            // by the fetcher) needs neither. With far memory it is always
            // asked: reading a far page here would fetch it.
            let stale = self.stale_pages[first..last].iter().filter(|&&s| s).count();
            let ask = stale > 0 && (self.far.is_some() || stale >= PAGEMAP_WORTH);
            if !ask || pagemap.is_none_or(|p| p.populated(mem, first_page, populated).is_err()) {
                populated.fill(true);
            }
            for i in first..last {
                if !std::mem::take(&mut self.stale_pages[i]) {
                    continue;
                }
                let index = first_page + (i - first) as u64;
                self.pages[i] = if populated[i - first] {
                    memory::read_page(mem, index, &mut page).expect("page inside guest memory");
                    n += 1;
                    page_hash(&page)
                } else {
                    match self.far.filter(|f| f.far.get(index)) {
                        Some(far) => far_copy_hash(far.hashes[index as usize]),
                        None => zero_page,
                    }
                };
            }
            self.regions[r] = combine(self.pages[first..last].iter().copied(), &mut combined);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::messages::{Digest, Mismatch};

    #[test]
    fn digest_finds_the_changed_region() {
        let mem = memory::create(16 << 20, false).unwrap();
        let before = memory_digest(&mem, 1 << 20, 2);
        assert_eq!(before.len(), 16);
        memory::write(&mem, 5 * (1 << 20) + 123, &[1]).unwrap();
        let after = memory_digest(&mem, 1 << 20, 2);
        let sent = Digest { region: 1 << 20, hashes: before.clone() }.encode();
        assert_eq!(Digest::decode(&sent, 1 << 20, 16).unwrap().differing(&after), vec![5]);
        let short = Digest { region: 1 << 20, hashes: before[..3].to_vec() }.encode();
        assert!(Digest::decode(&short, 1 << 20, 16).is_err());
        assert!(Digest::decode(&Digest { region: 1 << 19, hashes: before }.encode(), 1 << 20, 16).is_err());
    }

    #[test]
    fn incremental_digest_matches_a_full_one() {
        let mem = memory::create(16 << 20, false).unwrap();
        // Every page populated: every page is read.
        memory::write(&mem, 0, &[3; 16 << 20]).unwrap();
        memory::write(&mem, 3 << 20, &[7; 8192]).unwrap();
        let mut incremental = IncrementalDigest::new(&mem, 256 << 10, None);
        assert_eq!(incremental.refresh(&mem, 2), 4096);
        assert_eq!(incremental.hashes(), memory_digest(&mem, 256 << 10, 1));
        // Pages 1000 and 4095 change: only their regions are hashed again.
        memory::write(&mem, 1000 * 4096, &[1]).unwrap();
        memory::write(&mem, 4095 * 4096 + 17, &[2]).unwrap();
        let mut dirty = DirtyBitmap::new(4096);
        dirty.set(1000);
        dirty.set(4095);
        incremental.mark(&dirty);
        assert_eq!(incremental.refresh(&mem, 2), 2);
        assert_eq!(incremental.hashes(), memory_digest(&mem, 256 << 10, 2));
        assert_eq!(incremental.refresh(&mem, 2), 0);

        // Enough memory for the threaded path: the same hashes as one thread.
        let big = memory::create(128 << 20, false).unwrap();
        memory::write(&big, 100 << 20, &[9; 4096]).unwrap();
        let mut one = IncrementalDigest::new(&big, 256 << 10, None);
        one.refresh(&big, 1);
        assert_eq!(one.hashes(), memory_digest(&big, 256 << 10, 2));
    }

    #[test]
    fn pages_known_zero_are_not_read_again() {
        let mem = memory::create(16 << 20, false).unwrap();
        memory::write(&mem, 3 << 20, &[7; 8192]).unwrap();
        let mut digest = IncrementalDigest::new(&mem, 256 << 10, None);
        digest.refresh(&mem, 1);
        // The two pages are zeroed and read as zeros; a third changes.
        let first = (3 << 20) / PAGE_SIZE as u64;
        memory::write(&mem, 3 << 20, &[0; 8192]).unwrap();
        memory::write(&mem, 5 << 20, &[1]).unwrap();
        let mut sent = DirtyBitmap::new(4096);
        let mut zeros = DirtyBitmap::new(4096);
        [first, first + 1].into_iter().for_each(|p| {
            sent.set(p);
            zeros.set(p);
        });
        sent.set((5 << 20) / PAGE_SIZE as u64);
        digest.mark(&sent);
        digest.known_zero(&zeros);
        assert_eq!(digest.refresh(&mem, 1), 1, "only the changed page is read");
        assert_eq!(digest.hashes(), memory_digest(&mem, 256 << 10, 1));
    }

    #[test]
    fn mismatch_lists_are_bounded() {
        let list = |regions: &[u32]| Mismatch { regions: regions.to_vec() }.encode();
        assert_eq!(Mismatch::decode(&list(&[1, 5]), 16).unwrap().regions, vec![1, 5]);
        assert!(Mismatch::decode(&list(&[16]), 16).is_err());
        assert!(Mismatch::decode(&list(&[]), 16).is_err());
        assert!(Mismatch::decode(&list(&[1, 2, 3]), 2).is_err());
    }
}
