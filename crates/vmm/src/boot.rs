//! Multiboot v1 loading: ELF program headers into guest memory, the info
//! structure with command line and memory map, and the vCPU's entry state
//! (32-bit protected mode, paging off, EAX = magic, EBX = info), exactly
//! what QEMU's `-kernel` gives the same image.

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};

use crate::memory::{self, GuestMemory, MemoryError};

const MULTIBOOT_HEADER_MAGIC: u32 = 0x1BAD_B002;
const MULTIBOOT_BOOTLOADER_MAGIC: u32 = 0x2BAD_B002;
/// The header must lie within the first 8 KiB of the image.
const MULTIBOOT_SEARCH: usize = 8192;

/// Where the loader puts its structures: low memory, below the image.
const MMAP_ADDR: u64 = 0x8000;
const INFO_ADDR: u64 = 0x9000;
const CMDLINE_ADDR: u64 = 0x9100;
/// The command line may use the rest of that page range up to 0x10000.
pub const MAX_CMDLINE: usize = 0x10000 - 0x9100 - 1;
/// Images load at or above 1 MiB.
const IMAGE_MIN_ADDR: u64 = 0x10_0000;

/// Why the guest image could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Not an ELF file, or a kind we do not load.
    #[error("guest ELF is invalid: {0}")]
    BadElf(&'static str),
    /// No multiboot v1 header in the first 8 KiB.
    #[error("guest image has no multiboot v1 header in its first 8 KiB")]
    NoMultibootHeader,
    /// A segment does not fit in guest memory.
    #[error("guest ELF segment at {addr:#x} (+{size:#x} bytes) does not fit in guest memory")]
    SegmentOutOfRange {
        /// Load address.
        addr: u64,
        /// Bytes in memory.
        size: u64,
    },
    /// The command line is longer than the loader's area.
    #[error("guest command line is {0} bytes; at most {MAX_CMDLINE} fit")]
    CmdlineTooLong(usize),
    /// Writing into guest memory failed.
    #[error("cannot write the guest image")]
    Memory(#[from] MemoryError),
}

/// The vCPU state a multiboot loader hands to the image.
pub struct EntryState {
    /// General registers (RIP, EAX magic, EBX info pointer).
    pub regs: kvm_regs,
    /// Flat 32-bit protected-mode segments, paging off.
    pub sregs: kvm_sregs,
}

fn u16_at(b: &[u8], off: usize) -> Result<u16, BootError> {
    b.get(off..off + 2).map(|s| u16::from_le_bytes([s[0], s[1]])).ok_or(BootError::BadElf("truncated"))
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, BootError> {
    b.get(off..off + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap())).ok_or(BootError::BadElf("truncated"))
}

fn u64_at(b: &[u8], off: usize) -> Result<u64, BootError> {
    b.get(off..off + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap())).ok_or(BootError::BadElf("truncated"))
}

fn has_multiboot_header(image: &[u8]) -> bool {
    let end = image.len().min(MULTIBOOT_SEARCH);
    (0..end.saturating_sub(11)).step_by(4).any(|off| {
        let magic = u32::from_le_bytes(image[off..off + 4].try_into().unwrap());
        let flags = u32::from_le_bytes(image[off + 4..off + 8].try_into().unwrap());
        let sum = u32::from_le_bytes(image[off + 8..off + 12].try_into().unwrap());
        magic == MULTIBOOT_HEADER_MAGIC && magic.wrapping_add(flags).wrapping_add(sum) == 0
    })
}

/// One PT_LOAD segment: where it goes and which file bytes fill it.
struct Segment {
    paddr: u64,
    offset: u64,
    filesz: u64,
    memsz: u64,
}

/// Reads entry point and loadable segments from an ELF32 or ELF64 image.
fn parse_elf(image: &[u8]) -> Result<(u64, Vec<Segment>), BootError> {
    if image.len() < 52 || &image[..4] != b"\x7fELF" {
        return Err(BootError::BadElf("no ELF magic"));
    }
    if image[5] != 1 {
        return Err(BootError::BadElf("not little-endian"));
    }
    let is64 = match image[4] {
        1 => false,
        2 => true,
        _ => return Err(BootError::BadElf("unknown ELF class")),
    };
    let machine = u16_at(image, 18)?;
    if machine != 3 && machine != 62 {
        return Err(BootError::BadElf("not an x86 image"));
    }
    let (entry, phoff, phentsize, phnum) = if is64 {
        (u64_at(image, 24)?, u64_at(image, 32)?, u16_at(image, 54)?, u16_at(image, 56)?)
    } else {
        (u32_at(image, 24)? as u64, u32_at(image, 28)? as u64, u16_at(image, 42)?, u16_at(image, 44)?)
    };
    let mut segments = Vec::new();
    for i in 0..phnum as u64 {
        let ph = phoff
            .checked_add(i * phentsize as u64)
            .and_then(|o| usize::try_from(o).ok())
            .ok_or(BootError::BadElf("program header offset overflows"))?;
        if u32_at(image, ph)? != 1 {
            continue; // not PT_LOAD
        }
        let seg = if is64 {
            Segment {
                offset: u64_at(image, ph + 8)?,
                paddr: u64_at(image, ph + 24)?,
                filesz: u64_at(image, ph + 32)?,
                memsz: u64_at(image, ph + 40)?,
            }
        } else {
            Segment {
                offset: u32_at(image, ph + 4)? as u64,
                paddr: u32_at(image, ph + 12)? as u64,
                filesz: u32_at(image, ph + 16)? as u64,
                memsz: u32_at(image, ph + 20)? as u64,
            }
        };
        if seg.filesz > seg.memsz {
            return Err(BootError::BadElf("segment file size exceeds memory size"));
        }
        if seg.offset.checked_add(seg.filesz).is_none_or(|end| end > image.len() as u64) {
            return Err(BootError::BadElf("segment extends past the end of the file"));
        }
        segments.push(seg);
    }
    if segments.is_empty() {
        return Err(BootError::BadElf("no loadable segments"));
    }
    if entry > u32::MAX as u64 {
        return Err(BootError::BadElf("entry point above 4 GiB"));
    }
    Ok((entry, segments))
}

/// Loads the image and builds the multiboot info; returns the entry state.
pub fn load_multiboot(mem: &GuestMemory, image: &[u8], cmdline: &str) -> Result<EntryState, BootError> {
    if !has_multiboot_header(image) {
        return Err(BootError::NoMultibootHeader);
    }
    let (entry, segments) = parse_elf(image)?;
    let mem_size = memory::size(mem);
    for seg in &segments {
        let end = seg.paddr.checked_add(seg.memsz);
        if seg.paddr < IMAGE_MIN_ADDR || end.is_none_or(|e| e > mem_size) {
            return Err(BootError::SegmentOutOfRange { addr: seg.paddr, size: seg.memsz });
        }
        let file = &image[seg.offset as usize..(seg.offset + seg.filesz) as usize];
        memory::write(mem, seg.paddr, file)?;
        // Fresh guest memory is already zero; the .bss part needs no writes.
    }

    if cmdline.len() > MAX_CMDLINE {
        return Err(BootError::CmdlineTooLong(cmdline.len()));
    }
    let mut cmd = cmdline.as_bytes().to_vec();
    cmd.push(0);
    memory::write(mem, CMDLINE_ADDR, &cmd)?;

    // A PC-like map: low RAM, the legacy hole, then everything above 1 MiB.
    let ranges: [(u64, u64, u32); 3] =
        [(0, 0x9_FC00, 1), (0x9_FC00, IMAGE_MIN_ADDR - 0x9_FC00, 2), (IMAGE_MIN_ADDR, mem_size - IMAGE_MIN_ADDR, 1)];
    let mut mmap = Vec::new();
    for (addr, len, kind) in ranges {
        mmap.extend_from_slice(&20u32.to_le_bytes());
        mmap.extend_from_slice(&addr.to_le_bytes());
        mmap.extend_from_slice(&len.to_le_bytes());
        mmap.extend_from_slice(&kind.to_le_bytes());
    }
    memory::write(mem, MMAP_ADDR, &mmap)?;

    let mem_upper_kib = (mem_size.min(4 << 30) - IMAGE_MIN_ADDR) / 1024;
    let mut info = [0u8; 52];
    let flags: u32 = 1 | (1 << 2) | (1 << 6); // mem_*, cmdline, mmap
    info[0..4].copy_from_slice(&flags.to_le_bytes());
    info[4..8].copy_from_slice(&639u32.to_le_bytes());
    info[8..12].copy_from_slice(&(mem_upper_kib as u32).to_le_bytes());
    info[16..20].copy_from_slice(&(CMDLINE_ADDR as u32).to_le_bytes());
    info[44..48].copy_from_slice(&(mmap.len() as u32).to_le_bytes());
    info[48..52].copy_from_slice(&(MMAP_ADDR as u32).to_le_bytes());
    memory::write(mem, INFO_ADDR, &info)?;

    Ok(EntryState { regs: entry_regs(entry), sregs: protected_mode_sregs() })
}

fn entry_regs(entry: u64) -> kvm_regs {
    kvm_regs { rip: entry, rax: MULTIBOOT_BOOTLOADER_MAGIC as u64, rbx: INFO_ADDR, rflags: 0x2, ..Default::default() }
}

fn flat_segment(selector: u16, type_: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xFFFF_FFFF,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Flat 4 GiB code and data segments, CR0.PE only, as multiboot specifies.
fn protected_mode_sregs() -> kvm_sregs {
    let code = flat_segment(0x08, 0xB);
    let data = flat_segment(0x10, 0x3);
    let tr =
        kvm_segment { limit: 0xFFFF, type_: 0xB, present: 1, s: 0, db: 0, g: 0, selector: 0, ..flat_segment(0, 0) };
    let ldt = kvm_segment { limit: 0xFFFF, type_: 0x2, present: 1, s: 0, db: 0, g: 0, ..flat_segment(0, 0) };
    kvm_sregs {
        cs: code,
        ds: data,
        es: data,
        fs: data,
        gs: data,
        ss: data,
        tr,
        ldt,
        cr0: 0x11, // PE | ET
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_elf::GUEST_ELF;

    #[test]
    fn embedded_guest_loads() {
        let mem = memory::create(16 << 20, false).unwrap();
        let state = load_multiboot(&mem, GUEST_ELF, "workload=idle").unwrap();
        assert!(state.regs.rip >= IMAGE_MIN_ADDR);
        assert_eq!(state.regs.rax, 0x2BAD_B002);
        let mut cmd = [0u8; 14];
        memory::read(&mem, CMDLINE_ADDR, &mut cmd).unwrap();
        assert_eq!(&cmd, b"workload=idle\0");
    }

    #[test]
    fn rejects_bad_images() {
        let mem = memory::create(16 << 20, false).unwrap();
        assert!(matches!(load_multiboot(&mem, b"hello", ""), Err(BootError::NoMultibootHeader)));
        let mut truncated = GUEST_ELF[..200].to_vec();
        truncated[0] = 0;
        assert!(load_multiboot(&mem, &truncated, "").is_err());
        let long = "x".repeat(MAX_CMDLINE + 1);
        assert!(matches!(load_multiboot(&mem, GUEST_ELF, &long), Err(BootError::CmdlineTooLong(_))));
    }
}
