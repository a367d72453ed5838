//! Guest memory: one anonymous mapping per VM, registered as KVM slot 0 at
//! guest physical address 0. Every write the VMM makes through it (device
//! emulation, an arriving migration) marks its pages in the mapping's
//! bitmap ([`VmmDirty`]), which KVM's dirty log cannot see:
//! [`take_vmm_dirty`] reads them for the migration's dirty set.

use std::sync::atomic::{AtomicBool, Ordering};

use vm_memory::bitmap::{AtomicBitmap, Bitmap, NewBitmap, RefSlice, WithBitmapSlice};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::bitmap::DirtyBitmap;

/// Guest memory as the rust-vmm crates see it, with a bitmap of the pages
/// the VMM wrote.
pub type GuestMemory = vm_memory::GuestMemoryMmap<VmmDirty>;

/// The pages the VMM wrote into a region, and whether it wrote any since
/// they were last taken: a migration's stop looks at them with the VM
/// paused, and taking 4 GiB's worth of marks word by word cost ~50 µs of
/// it even when the VMM had written nothing.
#[derive(Debug, Default)]
pub struct VmmDirty {
    pages: AtomicBitmap,
    /// Set after the marks of every write (so a take that sees it clear
    /// misses only writes still under way, which the next take sees).
    marked: AtomicBool,
}

impl VmmDirty {
    fn mark_range(&self, offset: usize, len: usize) {
        self.pages.set_addr_range(offset, len);
        self.marked.store(true, Ordering::Release);
    }

    /// The marks as words of 64 pages, cleared; None when none was set.
    fn take(&self) -> Option<Vec<u64>> {
        self.marked.swap(false, Ordering::AcqRel).then(|| self.pages.get_and_reset())
    }
}

impl<'a> WithBitmapSlice<'a> for VmmDirty {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for VmmDirty {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if len > 0 {
            self.mark_range(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.pages.dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

impl NewBitmap for VmmDirty {
    fn with_len(len: usize) -> Self {
        VmmDirty { pages: AtomicBitmap::with_len(len), marked: AtomicBool::new(false) }
    }
}

/// The page size of guest memory and of the dirty log: the codecs' page.
pub use tsubame_codec::PAGE_SIZE;

/// Smallest VM: the guest image sits at 1 MiB and its workloads need room.
pub const MIN_MEMORY: u64 = 8 << 20;
/// Largest VM: the guest's page tables map up to 64 GiB.
pub const MAX_MEMORY: u64 = 64 << 30;

/// Why guest memory could not be set up or accessed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The requested size is outside what the guest supports.
    #[error("memory size {0} bytes is out of range: give between 8 MiB and 64 GiB, a multiple of 2 MiB")]
    BadSize(u64),
    /// mmap failed.
    #[error("cannot map {0} bytes of guest memory")]
    Map(u64, #[source] vm_memory::mmap::FromRangesError),
    /// An access fell outside guest memory.
    #[error("guest memory access at {addr:#x} (+{len}) is out of range")]
    OutOfRange {
        /// Guest physical address.
        addr: u64,
        /// Length of the access.
        len: usize,
    },
}

/// Maps `bytes` of zeroed guest memory (lazily backed: untouched pages cost
/// nothing), optionally asking for transparent huge pages.
pub fn create(bytes: u64, hugepages: bool) -> Result<GuestMemory, MemoryError> {
    if !(MIN_MEMORY..=MAX_MEMORY).contains(&bytes) || !bytes.is_multiple_of(2 << 20) {
        return Err(MemoryError::BadSize(bytes));
    }
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), bytes as usize)]).map_err(|e| MemoryError::Map(bytes, e))?;
    if hugepages {
        advise_hugepages(&mem);
    }
    Ok(mem)
}

/// Asks for transparent huge pages behind guest memory from now on (pages
/// already backed stay as they are until khugepaged collapses them).
pub fn advise_hugepages(mem: &GuestMemory) {
    for region in mem.iter() {
        let host = host_address(mem, region.start_addr().0);
        // SAFETY: the range is exactly one mapping owned by `mem`, and
        // MADV_HUGEPAGE only changes how the kernel backs it.
        unsafe { libc::madvise(host.cast(), region.len() as usize, libc::MADV_HUGEPAGE) };
    }
}

/// Pages of a 2 MiB range that make it dense enough for a huge page: one
/// costs at most an eighth more memory than the pages it replaces.
pub const DENSE_PAGES: usize = 448;
const HUGE_PAGE: usize = 2 << 20;

/// What [`back_dense_with_huge_pages`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HugePageBacking {
    /// 2 MiB ranges looked at.
    pub ranges: u64,
    /// Ranges with [`DENSE_PAGES`] or more pages backed.
    pub dense: u64,
    /// Dense ranges now backed by a huge page.
    pub backed: u64,
}

/// Backs guest memory's densely populated 2 MiB ranges with huge pages,
/// one range at a time (MADV_COLLAPSE), resting `rest` after each, until
/// done or `stop` says so. For memory written in 4 KiB pages, as a
/// destination receives it: asking the kernel for huge pages there
/// (MADV_HUGEPAGE) leaves the work to khugepaged, which under PVM held the
/// process's mmap lock for more than 10 s at a time while it collapsed
/// ranges under a running vCPU at its low priority, took
/// minutes to get to a large guest, and filled sparse ranges too. A kernel
/// without MADV_COLLAPSE (before 6.1) leaves memory as it is.
pub fn back_dense_with_huge_pages(
    mem: &GuestMemory,
    rest: std::time::Duration,
    stop: &dyn Fn() -> bool,
) -> HugePageBacking {
    let mut done = HugePageBacking::default();
    let Some((base, len)) = single_mapping(mem) else { return done };
    // The huge-page-aligned part of the mapping (all of it, as the kernel
    // aligns large anonymous mappings).
    let first = (base as usize).next_multiple_of(HUGE_PAGE) - base as usize;
    let mut resident = [0u8; HUGE_PAGE / PAGE_SIZE];
    for offset in (first..len.saturating_sub(HUGE_PAGE - 1)).step_by(HUGE_PAGE) {
        if stop() {
            break;
        }
        done.ranges += 1;
        // SAFETY: offset..offset + 2 MiB lies inside guest memory's one
        // mapping, and `resident` holds one byte per page of it.
        let range = unsafe { base.add(offset) }.cast_mut().cast::<libc::c_void>();
        // SAFETY: as above; mincore only reports which pages are backed.
        if unsafe { libc::mincore(range, HUGE_PAGE, resident.as_mut_ptr()) } != 0 {
            break;
        }
        if resident.iter().filter(|&&r| r & 1 != 0).count() < DENSE_PAGES {
            continue;
        }
        done.dense += 1;
        // SAFETY: as above; MADV_COLLAPSE copies the range's pages into a
        // huge page, contents unchanged (empty ones read as zeros either way).
        if unsafe { libc::madvise(range, HUGE_PAGE, libc::MADV_COLLAPSE) } == 0 {
            done.backed += 1;
        } else if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            break; // no MADV_COLLAPSE here
        }
        std::thread::sleep(rest);
    }
    done
}

/// [`back_dense_with_huge_pages`] on a thread of its own, for memory
/// received in 4 KiB pages whose guest runs now: a range at a time with
/// 5 ms rests keeps the mmap lock mostly free, yet the guest ran at under
/// half its pace while this went on (~4 s for 1 GiB under PVM). Longer
/// rests, bursts, or all at once spread the same cost differently (a
/// collapse is ~5 ms of CPU a range here). It stops when the memory's
/// last other holder (the VM) lets go.
pub fn back_dense_with_huge_pages_later(mem: std::sync::Arc<GuestMemory>) {
    const REST: std::time::Duration = std::time::Duration::from_millis(5);
    let _ = std::thread::Builder::new()
        .name("huge-pages".into())
        .spawn(move || back_dense_with_huge_pages(&mem, REST, &|| std::sync::Arc::strong_count(&mem) == 1));
}

/// Backs `pages` pages of guest memory from page `first` on (clipped to
/// guest memory) in one call, ahead of writing them: the kernel fills the
/// range without a page fault per page. Nothing unless guest memory is one
/// mapping, as [`create`] makes it; a kernel without MADV_POPULATE_WRITE
/// (before 5.14) leaves the pages to fault in when written.
pub fn populate(mem: &GuestMemory, first: u64, pages: u64) {
    let Some((base, len)) = single_mapping(mem) else { return };
    let start = (first as usize).saturating_mul(PAGE_SIZE).min(len);
    let end = (first.saturating_add(pages) as usize).saturating_mul(PAGE_SIZE).min(len);
    if start < end {
        // SAFETY: start..end lies inside guest memory's one mapping, and
        // MADV_POPULATE_WRITE backs its pages without changing their
        // contents (fresh ones read as zeros either way).
        unsafe { libc::madvise(base.add(start).cast_mut().cast(), end - start, libc::MADV_POPULATE_WRITE) };
    }
}

/// Size of guest memory in bytes.
pub fn size(mem: &GuestMemory) -> u64 {
    mem.iter().map(|r| r.len()).sum()
}

/// Number of 4 KiB pages of guest memory.
pub fn page_count(mem: &GuestMemory) -> u64 {
    size(mem) / PAGE_SIZE as u64
}

/// Host virtual address of a guest physical address.
pub(crate) fn host_address(mem: &GuestMemory, gpa: u64) -> *mut u8 {
    mem.get_host_address(GuestAddress(gpa)).expect("address inside guest memory")
}

/// The host mapping behind guest memory, when it is one mapping (as
/// [`create`] makes it): its address and length. For zero-copy sends, which
/// hand guest pages to the kernel by address.
pub fn single_mapping(mem: &GuestMemory) -> Option<(*const u8, usize)> {
    let mut regions = mem.iter();
    let region = regions.next()?;
    if regions.next().is_some() || region.start_addr().0 != 0 {
        return None;
    }
    Some((host_address(mem, 0).cast_const(), region.len() as usize))
}

/// Copies page `index` out of guest memory.
pub fn read_page(mem: &GuestMemory, index: u64, out: &mut [u8; PAGE_SIZE]) -> Result<(), MemoryError> {
    let addr = index * PAGE_SIZE as u64;
    mem.read_slice(out, GuestAddress(addr)).map_err(|_| MemoryError::OutOfRange { addr, len: PAGE_SIZE })
}

/// True when page `index` reads as all zeros, checked in place without
/// copying it out. The guest may be writing the page meanwhile: migration
/// clears its dirty bit first, so a racing write dirties it again.
pub fn page_is_zero(mem: &GuestMemory, index: u64) -> bool {
    if index >= page_count(mem) {
        return false;
    }
    let page = host_address(mem, index * PAGE_SIZE as u64).cast_const();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above); the page lies
        // inside one mapping of `mem` (index checked above).
        return unsafe { zero_scan::page_is_zero_avx2(page) };
    }
    let page = page.cast::<[u64; 8]>();
    (0..PAGE_SIZE / 64).all(|i| {
        // SAFETY: the page lies inside one mapping of `mem` (index checked
        // above; guest memory is page-aligned), so every 64-byte chunk is
        // readable; volatile reads because the guest writes it concurrently.
        let chunk = unsafe { std::ptr::read_volatile(page.add(i)) };
        chunk.iter().fold(0, |acc, w| acc | w) == 0
    })
}

#[cfg(target_arch = "x86_64")]
mod zero_scan {
    use std::arch::x86_64::{__m256i, _mm256_or_si256, _mm256_setzero_si256, _mm256_testz_si256};

    use super::PAGE_SIZE;

    /// Bytes OR-ed together before one test: 256-byte blocks stop early at
    /// a page's first data without a branch per cache line.
    const BLOCK: usize = 256;

    /// [`super::page_is_zero`] 32 bytes per load: the scan of an idle
    /// guest's memory is bound by the loads (8-byte loads took 0.62 s for 4
    /// GiB here, 32-byte ones 0.38-0.45). Not the codec's `is_zero`, which
    /// takes a reference: memory the guest writes meanwhile is read here
    /// only through volatile loads.
    ///
    /// # Safety
    /// The CPU has AVX2, and `page` points at `PAGE_SIZE` readable bytes,
    /// page-aligned.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn page_is_zero_avx2(page: *const u8) -> bool {
        let lanes = page.cast::<__m256i>();
        for block in 0..PAGE_SIZE / BLOCK {
            let mut acc = _mm256_setzero_si256();
            for lane in 0..BLOCK / 32 {
                // SAFETY: block * 8 + lane < 128, so the 32 bytes read lie
                // inside the page (the caller's promise), 32-byte aligned
                // as guest pages are page-aligned; volatile because the
                // guest writes the page concurrently.
                let v = unsafe { std::ptr::read_volatile(lanes.add(block * (BLOCK / 32) + lane)) };
                acc = _mm256_or_si256(acc, v);
            }
            if _mm256_testz_si256(acc, acc) == 0 {
                return false;
            }
        }
        true
    }
}

/// Copies bytes into guest memory at `addr`.
pub fn write(mem: &GuestMemory, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
    mem.write_slice(data, GuestAddress(addr)).map_err(|_| MemoryError::OutOfRange { addr, len: data.len() })
}

/// Takes the pages the VMM wrote into guest memory since the last call
/// (clearing their marks): the part of the dirty set KVM does not log.
pub fn take_vmm_dirty(mem: &GuestMemory) -> DirtyBitmap {
    let mut dirty = DirtyBitmap::new(page_count(mem));
    add_vmm_dirty(mem, &mut dirty);
    dirty
}

/// Adds to `dirty` (a bitmap of all guest memory) what [`take_vmm_dirty`]
/// would return.
pub fn add_vmm_dirty(mem: &GuestMemory, dirty: &mut DirtyBitmap) {
    for region in mem.iter() {
        // Regions start on page boundaries; ours is one region at 0.
        let first_word = (region.start_addr().0 / PAGE_SIZE as u64 / 64) as usize;
        if let Some(words) = vm_memory::MmapRegion::bitmap(region).take() {
            dirty.words_mut()[first_word..].iter_mut().zip(&words).for_each(|(a, b)| *a |= b);
        }
    }
}

/// Marks `count` pages from `first` as written by the VMM (what
/// [`take_vmm_dirty`] hands out next): for pages filled behind guest
/// memory's back, e.g. installed through userfaultfd.
pub fn mark_vmm_dirty(mem: &GuestMemory, first: u64, count: u64) {
    for region in mem.iter() {
        let start = region.start_addr().0 / PAGE_SIZE as u64;
        let end = start + region.len() / PAGE_SIZE as u64;
        let (from, to) = (first.max(start), (first + count).min(end));
        if from < to {
            vm_memory::MmapRegion::bitmap(region)
                .mark_range(((from - start) * PAGE_SIZE as u64) as usize, ((to - from) * PAGE_SIZE as u64) as usize);
        }
    }
}

/// Copies bytes out of guest memory at `addr`.
pub fn read(mem: &GuestMemory, addr: u64, out: &mut [u8]) -> Result<(), MemoryError> {
    mem.read_slice(out, GuestAddress(addr)).map_err(|_| MemoryError::OutOfRange { addr, len: out.len() })
}

/// The kernel's page table of this process (/proc/self/pagemap): tells
/// which pages of guest memory were never populated. Such pages of our
/// private anonymous mapping read as zeros, so a digest need not read them.
pub struct Pagemap(std::fs::File);

impl Pagemap {
    /// Opens /proc/self/pagemap.
    pub fn open() -> std::io::Result<Pagemap> {
        std::fs::File::open("/proc/self/pagemap").map(Pagemap)
    }

    /// Fills `populated` with one flag per guest page from `first_page`:
    /// false when the page is neither in RAM nor in swap (so reads zero).
    pub fn populated(&self, mem: &GuestMemory, first_page: u64, populated: &mut [bool]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let pages = populated.len() as u64;
        if first_page.checked_add(pages).is_none_or(|end| end > page_count(mem)) {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "range outside guest memory"));
        }
        let first = host_address(mem, first_page * PAGE_SIZE as u64) as u64 / PAGE_SIZE as u64;
        let mut entries = vec![0u8; populated.len() * 8];
        self.0.read_exact_at(&mut entries, first * 8)?;
        // Bit 63: present in RAM; bit 62: swapped out.
        for (flag, e) in populated.iter_mut().zip(entries.chunks_exact(8)) {
            *flag = u64::from_le_bytes(e.try_into().unwrap()) >> 62 != 0;
        }
        Ok(())
    }

    /// True when no page of `[addr, addr + len)` is in RAM or swap.
    pub fn unpopulated(&self, mem: &GuestMemory, addr: u64, len: u64) -> std::io::Result<bool> {
        let mut flags = vec![false; len.div_ceil(PAGE_SIZE as u64) as usize];
        self.populated(mem, addr / PAGE_SIZE as u64, &mut flags)?;
        Ok(flags.iter().all(|&p| !p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        assert!(matches!(create(4 << 20, false), Err(MemoryError::BadSize(_))));
        assert!(matches!(create((16 << 20) + 4096, false), Err(MemoryError::BadSize(_))));
        assert!(matches!(create(128 << 30, false), Err(MemoryError::BadSize(_))));
    }

    #[test]
    fn dense_ranges_get_huge_pages_and_keep_their_bytes() {
        let mem = create(16 << 20, false).unwrap();
        // 2 MiB ranges 0 and 1 written whole, range 2 in 64 scattered pages.
        for page in (0..1024u64).chain((1024..1536).step_by(8)) {
            write(&mem, page * PAGE_SIZE as u64 + 7, &[page as u8 | 1]).unwrap();
        }
        let done = back_dense_with_huge_pages(&mem, std::time::Duration::ZERO, &|| false);
        assert_eq!(done, HugePageBacking { ranges: 8, dense: 2, backed: 2 });
        for page in 0..4096u64 {
            let mut byte = [0u8];
            mem.read_slice(&mut byte, GuestAddress(page * PAGE_SIZE as u64 + 7)).unwrap();
            let written = page < 1024 || (page < 1536 && page % 8 == 0);
            assert_eq!(byte[0], if written { page as u8 | 1 } else { 0 }, "page {page}");
        }
        let stopped = back_dense_with_huge_pages(&mem, std::time::Duration::ZERO, &|| true);
        assert_eq!(stopped, HugePageBacking::default());
    }

    #[test]
    fn a_page_reads_as_zero_until_any_byte_of_it_is_not() {
        let mem = create(16 << 20, false).unwrap();
        assert!(page_is_zero(&mem, 3));
        assert!(!page_is_zero(&mem, page_count(&mem)), "past the end");
        // One byte in each 32-byte lane and 256-byte block, first and last.
        for offset in [0, 31, 32, 255, 256, 2047, 4064, 4095] {
            let addr = 3 * PAGE_SIZE as u64 + offset;
            write(&mem, addr, &[0x80]).unwrap();
            assert!(!page_is_zero(&mem, 3), "byte {offset}");
            assert!(page_is_zero(&mem, 2) && page_is_zero(&mem, 4), "byte {offset} of page 3 only");
            write(&mem, addr, &[0]).unwrap();
            assert!(page_is_zero(&mem, 3));
        }
    }

    #[test]
    fn pagemap_sees_written_pages() {
        let mem = create(16 << 20, false).unwrap();
        let pagemap = Pagemap::open().unwrap();
        assert!(pagemap.unpopulated(&mem, 0, 16 << 20).unwrap());
        write(&mem, (5 << 20) + 10, &[1]).unwrap();
        assert!(!pagemap.unpopulated(&mem, 5 << 20, 1 << 20).unwrap());
        assert!(pagemap.unpopulated(&mem, 6 << 20, 1 << 20).unwrap());
        assert!(pagemap.unpopulated(&mem, 15 << 20, 2 << 20).is_err());
    }

    #[test]
    fn populate_backs_the_range_as_zeros() {
        let mem = create(16 << 20, false).unwrap();
        let pagemap = Pagemap::open().unwrap();
        populate(&mem, 256, 16);
        assert!(!pagemap.unpopulated(&mem, 256 * PAGE_SIZE as u64, 16 * PAGE_SIZE as u64).unwrap());
        assert!(pagemap.unpopulated(&mem, 272 * PAGE_SIZE as u64, 1 << 20).unwrap());
        let mut back = [1u8; PAGE_SIZE];
        read_page(&mem, 260, &mut back).unwrap();
        assert_eq!(back, [0u8; PAGE_SIZE]);
        // Clipped to guest memory.
        populate(&mem, 4090, u64::MAX);
        assert!(!pagemap.unpopulated(&mem, 4090 * PAGE_SIZE as u64, 6 * PAGE_SIZE as u64).unwrap());
        populate(&mem, u64::MAX, 1);
    }

    #[test]
    fn pages_round_trip() {
        let mem = create(16 << 20, false).unwrap();
        assert_eq!(page_count(&mem), 4096);
        let page = [0xA5u8; PAGE_SIZE];
        write(&mem, 3 * PAGE_SIZE as u64, &page).unwrap();
        let mut back = [0u8; PAGE_SIZE];
        read_page(&mem, 3, &mut back).unwrap();
        assert_eq!(back, page);
        assert!(read_page(&mem, 4096, &mut back).is_err());
    }
}
