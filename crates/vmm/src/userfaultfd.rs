//! The kernel's userfaultfd interface, the few calls [`crate::uffd`] uses:
//! open, API handshake, register/unregister a range in missing mode, read
//! fault events, and install (copy, zero page) or wake.
//!
//! Written over `libc` and vmm-sys-util's ioctl helpers with the kernel's
//! structs (include/uapi/linux/userfaultfd.h) spelt out here, so that the
//! build needs no libclang (the `userfaultfd` crate generates them with
//! bindgen). The ABI is stable: these structs have not changed since
//! Linux 4.14 added the thread id.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use vmm_sys_util::ioctl::ioctl_with_mut_ref;
use vmm_sys_util::{ioctl_ior_nr, ioctl_iowr_nr};

const UFFD_API: u64 = 0xAA;
const UFFDIO: u32 = 0xAA;
const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
const UFFDIO_COPY_MODE_DONTWAKE: u64 = 1 << 0;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    /// Bytes copied, or a negated errno.
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    /// Bytes zeroed, or a negated errno.
    zeropage: i64,
}

/// `struct uffd_msg` (packed, 32 bytes) as the page-fault event lays it
/// out: event byte, 7 reserved, then flags, address and the thread id.
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    flags: u64,
    address: u64,
    ptid: u32,
    pad: u32,
}

const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);
const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);

ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, UffdioApi);
ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, UffdioRegister);
ioctl_ior_nr!(UFFDIO_UNREGISTER, UFFDIO, 0x01, UffdioRange);
ioctl_ior_nr!(UFFDIO_WAKE, UFFDIO, 0x02, UffdioRange);
ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, UffdioCopy);
ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, UffdioZeropage);

/// What an install (copy or zero page) did.
#[derive(Debug, PartialEq, Eq)]
pub enum InstallError {
    /// It stopped at a present page after installing this many bytes
    /// (the kernel's EAGAIN with a positive count).
    Partial(usize),
    /// It failed with this errno (EEXIST: the first page is present).
    Errno(i32),
}

/// One missing-page fault event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageFault {
    /// The faulting address.
    pub address: u64,
    /// The faulting thread.
    pub thread: i32,
    /// A write access.
    pub write: bool,
}

/// An open userfaultfd, non-blocking, with thread ids in its events.
pub struct Userfaultfd {
    fd: OwnedFd,
}

impl Userfaultfd {
    /// Opens one for faults from both user and kernel mode (KVM touches
    /// guest memory from the kernel) and agrees on the API.
    pub fn open() -> io::Result<Userfaultfd> {
        // SAFETY: the userfaultfd syscall takes one flags argument and
        // returns a new descriptor or -1; no memory is passed.
        let raw = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor the kernel just opened for us and
        // nothing else owns.
        let uffd = Userfaultfd { fd: unsafe { OwnedFd::from_raw_fd(raw as RawFd) } };
        let mut api = UffdioApi { api: UFFD_API, features: UFFD_FEATURE_THREAD_ID, ioctls: 0 };
        // SAFETY: UFFDIO_API reads and writes one uffdio_api, which `api` is.
        let r = unsafe { ioctl_with_mut_ref(&uffd.fd, UFFDIO_API(), &mut api) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if api.features & UFFD_FEATURE_THREAD_ID == 0 {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "the kernel's userfaultfd gives no thread ids"));
        }
        Ok(uffd)
    }

    /// Registers `start..start + len` in missing mode.
    pub fn register(&self, start: usize, len: usize) -> io::Result<()> {
        let mut reg = UffdioRegister {
            range: UffdioRange { start: start as u64, len: len as u64 },
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one uffdio_register; the
        // kernel checks that the range is a mapping of this process.
        let r = unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_REGISTER(), &mut reg) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Unregisters a range: its missing pages fill with zeros on access,
    /// and the threads waiting on them are woken.
    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        self.range_ioctl(UFFDIO_UNREGISTER(), start, len)
    }

    /// Wakes the threads waiting on a range.
    pub fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        self.range_ioctl(UFFDIO_WAKE(), start, len)
    }

    fn range_ioctl(&self, request: libc::c_ulong, start: usize, len: usize) -> io::Result<()> {
        let mut range = UffdioRange { start: start as u64, len: len as u64 };
        // SAFETY: UFFDIO_UNREGISTER and UFFDIO_WAKE read one uffdio_range.
        let r = unsafe { ioctl_with_mut_ref(&self.fd, request, &mut range) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Copies `len` bytes from `src` into the missing pages at `dst` and
    /// wakes their waiters: the bytes installed, or why it stopped.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes; `dst..dst + len` must be
    /// pages of a range registered with this userfaultfd.
    pub unsafe fn copy(&self, src: *const u8, dst: usize, len: usize) -> Result<usize, InstallError> {
        let mut copy = UffdioCopy { dst: dst as u64, src: src as u64, len: len as u64, mode: 0, copy: 0 };
        debug_assert_eq!(copy.mode & UFFDIO_COPY_MODE_DONTWAKE, 0);
        // SAFETY: UFFDIO_COPY reads and writes one uffdio_copy; the caller
        // vouches for the source and destination ranges.
        let r = unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_COPY(), &mut copy) };
        install_outcome(r, copy.copy)
    }

    /// Installs zero pages at `dst..dst + len` and wakes their waiters.
    pub fn zeropage(&self, dst: usize, len: usize) -> Result<usize, InstallError> {
        let mut zero =
            UffdioZeropage { range: UffdioRange { start: dst as u64, len: len as u64 }, mode: 0, zeropage: 0 };
        // SAFETY: UFFDIO_ZEROPAGE reads and writes one uffdio_zeropage; the
        // kernel only maps zero pages into registered missing ranges.
        let r = unsafe { ioctl_with_mut_ref(&self.fd, UFFDIO_ZEROPAGE(), &mut zero) };
        install_outcome(r, zero.zeropage)
    }

    /// Reads the queued page-fault events into `out` until none is left;
    /// other events are dropped.
    pub fn read_faults(&self, out: &mut Vec<PageFault>) -> io::Result<()> {
        const BATCH: usize = 64;
        let zero =
            UffdMsg { event: 0, reserved1: 0, reserved2: 0, reserved3: 0, flags: 0, address: 0, ptid: 0, pad: 0 };
        let mut msgs = [zero; BATCH];
        loop {
            // SAFETY: `msgs` is writable for its whole size; the kernel
            // writes whole uffd_msg records into it.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), msgs.as_mut_ptr().cast(), std::mem::size_of_val(&msgs)) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(()),
                    Some(libc::EINTR) => continue,
                    _ => Err(e),
                };
            }
            let count = n as usize / std::mem::size_of::<UffdMsg>();
            for msg in &msgs[..count] {
                if msg.event == UFFD_EVENT_PAGEFAULT {
                    let flags = msg.flags;
                    out.push(PageFault {
                        address: msg.address,
                        thread: msg.ptid as i32,
                        write: flags & UFFD_PAGEFAULT_FLAG_WRITE != 0,
                    });
                }
            }
            if count < BATCH {
                return Ok(());
            }
        }
    }

    /// A second descriptor for the same userfaultfd.
    pub fn try_clone(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

impl AsRawFd for Userfaultfd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl From<OwnedFd> for Userfaultfd {
    /// Takes back a descriptor from [`Userfaultfd::try_clone`].
    fn from(fd: OwnedFd) -> Userfaultfd {
        Userfaultfd { fd }
    }
}

/// The result of a copy or zero-page ioctl from its return value and the
/// count the kernel wrote back.
fn install_outcome(ret: i32, count: i64) -> Result<usize, InstallError> {
    if ret == 0 {
        return Ok(count.max(0) as usize);
    }
    if count > 0 {
        return Err(InstallError::Partial(count as usize));
    }
    if count < 0 {
        return Err(InstallError::Errno(-count as i32));
    }
    Err(InstallError::Errno(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        // From the kernel headers (x86_64).
        assert_eq!(UFFDIO_API(), 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER(), 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER(), 0x8010_aa01);
        assert_eq!(UFFDIO_WAKE(), 0x8010_aa02);
        assert_eq!(UFFDIO_COPY(), 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE(), 0xc020_aa04);
    }

    #[test]
    fn install_outcomes() {
        assert_eq!(install_outcome(0, 8192), Ok(8192));
        assert_eq!(install_outcome(-1, 4096), Err(InstallError::Partial(4096)));
        assert_eq!(install_outcome(-1, -(libc::EEXIST as i64)), Err(InstallError::Errno(libc::EEXIST)));
    }
}
