//! Guest memory: one anonymous mapping per VM, registered as KVM slot 0 at
//! guest physical address 0, and KVM's dirty log over it.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

/// Guest memory as the rust-vmm crates see it.
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;

/// The page size of guest memory and of the dirty log.
pub const PAGE_SIZE: usize = 4096;

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
        for region in mem.iter() {
            let host = host_address(&mem, region.start_addr().0);
            // SAFETY: the range is exactly one mapping owned by `mem`, and
            // MADV_HUGEPAGE only changes how the kernel backs it.
            unsafe { libc::madvise(host.cast(), region.len() as usize, libc::MADV_HUGEPAGE) };
        }
    }
    Ok(mem)
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

/// Copies page `index` out of guest memory.
pub fn read_page(mem: &GuestMemory, index: u64, out: &mut [u8; PAGE_SIZE]) -> Result<(), MemoryError> {
    let addr = index * PAGE_SIZE as u64;
    mem.read_slice(out, GuestAddress(addr)).map_err(|_| MemoryError::OutOfRange { addr, len: PAGE_SIZE })
}

/// Copies bytes into guest memory at `addr`.
pub fn write(mem: &GuestMemory, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
    mem.write_slice(data, GuestAddress(addr)).map_err(|_| MemoryError::OutOfRange { addr, len: data.len() })
}

/// Copies bytes out of guest memory at `addr`.
pub fn read(mem: &GuestMemory, addr: u64, out: &mut [u8]) -> Result<(), MemoryError> {
    mem.read_slice(out, GuestAddress(addr)).map_err(|_| MemoryError::OutOfRange { addr, len: out.len() })
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
