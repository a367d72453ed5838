//! `--zero-copy`: raw pages go from guest memory to a TCP socket with
//! `MSG_ZEROCOPY`, without being copied into a batch or a frame first.
//!
//! The kernel pins the pages and reads them when it transmits, after
//! `sendmsg` has returned. Two things follow:
//! - The guest may write a page between our send and the kernel's read.
//!   That is safe because fetch cleared the page's dirty bit before the
//!   send: the write makes it dirty again and a later iteration sends it
//!   again (stop-and-copy runs with the guest paused). The same page always
//!   travels on the same channel, so the newest copy is the last one.
//! - The page bytes are not known when the frame's CRC is computed, so a
//!   PAGES_ZEROCOPY frame's CRC covers its headers only; the destination's
//!   memory digest, checked before it resumes, covers the data.
//!
//! The kernel also reads the frame and record headers late, so their
//! buffer is held until the sends that carry them complete. Completions
//! come back on the socket's error queue; we count them, and the sends the
//! kernel copied after all (loopback always does).

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use tsubame_vmm::PAGE_SIZE;

use crate::protocol::pages::walk_record_headers;
use crate::protocol::FRAME_HEADER_LEN;
use crate::stats::ZeroCopyStats;

// From the kernel's uapi headers (asm-generic/socket.h, linux/errqueue.h);
// the libc crate lacks them.
const SO_ZEROCOPY: libc::c_int = 60;
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// Guest memory as one host mapping, shared with the sender threads. It
/// only ever hands addresses to the kernel; Rust code never reads through
/// it (the guest writes the memory concurrently).
#[derive(Clone, Copy)]
pub struct GuestPages {
    base: *const u8,
    len: usize,
}

// SAFETY: GuestPages is an address range, used only as `sendmsg` iovecs.
// The mapping belongs to the VM, which outlives the migration that borrows
// it, and the kernel pins the pages of a zero-copy send until it completes.
unsafe impl Send for GuestPages {}
// SAFETY: as above; sharing the address range changes nothing.
unsafe impl Sync for GuestPages {}

impl GuestPages {
    /// The pages of `mem`, when it is one mapping.
    pub fn of(mem: &tsubame_vmm::GuestMemory) -> Option<GuestPages> {
        tsubame_vmm::memory::single_mapping(mem).map(|(base, len)| GuestPages { base, len })
    }

    fn iovec(&self, index: u64) -> io::Result<libc::iovec> {
        let offset = index as usize * PAGE_SIZE;
        if index as usize >= self.len / PAGE_SIZE {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("page {index} is outside guest memory")));
        }
        Ok(libc::iovec { iov_base: self.base.wrapping_add(offset) as *mut libc::c_void, iov_len: PAGE_SIZE })
    }
}

/// Turns `SO_ZEROCOPY` on for a TCP socket.
pub fn enable(fd: RawFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `fd` is an open socket and the option value is a c_int that
    // lives across the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_ZEROCOPY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One channel's zero-copy sender: its scratch iovecs, the header
/// buffers the kernel may still read, and counters.
#[derive(Default)]
pub struct ZeroCopySender {
    iov: Vec<libc::iovec>,
    /// Header buffers with the number of the last send that carries them.
    held: std::collections::VecDeque<(u32, Vec<u8>)>,
    /// Sends numbered below this have all completed.
    done_below: u32,
    /// Completed ranges above `done_below` (first → last), should the
    /// kernel report them out of order.
    done_ahead: std::collections::BTreeMap<u32, u32>,
    /// What it sent and what completed.
    pub stats: ZeroCopyStats,
}

// SAFETY: the iovecs are scratch space, rebuilt before every send; they
// point into the frames being sent and into guest memory (see GuestPages).
unsafe impl Send for ZeroCopySender {}

impl ZeroCopySender {
    /// Sends zero-copy frames: `frames` holds, for each frame, its header,
    /// the PAGES header and the record headers of raw and zero pages (as
    /// [`super::encode::ShardEncoder`] builds them); the pages themselves
    /// come from `guest`. `pace(n)` is called before `n` bytes go out. The
    /// buffer is held until its sends complete: see [`Self::settle`].
    pub fn send(&mut self, fd: RawFd, frames: Vec<u8>, guest: &GuestPages, pace: &dyn Fn(usize)) -> io::Result<()> {
        let result = self.send_frames(fd, &frames, guest, pace);
        self.held.push_back((self.stats.sends as u32, frames));
        result
    }

    /// Reaps completions until at most `keep` buffers are held (waiting up
    /// to `patience` for them), and returns the buffers the kernel is done
    /// with.
    pub fn settle(&mut self, fd: RawFd, keep: usize, patience: Duration) -> io::Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + patience;
        let mut released = Vec::new();
        loop {
            self.reap(fd)?;
            while let Some((last, _)) = self.held.front() {
                if *last > self.done_below {
                    break;
                }
                released.push(self.held.pop_front().expect("front exists").1);
            }
            if self.held.len() <= keep {
                return Ok(released);
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "zero-copy sends did not complete"));
            }
            wait_for_error_queue(fd, deadline - Instant::now());
        }
    }

    fn send_frames(&mut self, fd: RawFd, frames: &[u8], guest: &GuestPages, pace: &dyn Fn(usize)) -> io::Result<()> {
        let mut at = 0;
        while at < frames.len() {
            let frame = frames.get(at + FRAME_HEADER_LEN..).ok_or_else(malformed)?;
            // The frame header and the PAGES and record headers go out as
            // they are, each raw page spliced in after its record header.
            let mut splices = Vec::new();
            let len = walk_record_headers(frame, |end, index, data_len| splices.push((end, index, data_len)))
                .ok_or_else(malformed)?;
            let headers = &frames[at..at + FRAME_HEADER_LEN + len];
            self.iov.clear();
            let mut from = 0;
            let mut total = 0;
            for (end, index, data_len) in splices {
                match data_len {
                    0 => continue, // a zero record: its header is all
                    PAGE_SIZE => {}
                    _ => return Err(malformed()),
                }
                let upto = FRAME_HEADER_LEN + end;
                self.iov.push(iovec(&headers[from..upto]));
                self.iov.push(guest.iovec(index)?);
                total += upto - from + PAGE_SIZE;
                from = upto;
            }
            if from < headers.len() {
                self.iov.push(iovec(&headers[from..]));
                total += headers.len() - from;
            }
            pace(total);
            self.send_all(fd, total)?;
            at += headers.len();
        }
        Ok(())
    }

    /// `sendmsg` until the iovecs are all out.
    fn send_all(&mut self, fd: RawFd, total: usize) -> io::Result<()> {
        let mut first = 0;
        let mut left = total;
        while left > 0 {
            let iov = &mut self.iov[first..];
            // SAFETY: msghdr is plain data; all-zeros is a valid empty one.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len().min(1024) as _;
            // SAFETY: the iovecs point into `frames` (borrowed by our
            // caller for the call) and into guest memory (GuestPages).
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_ZEROCOPY | libc::MSG_NOSIGNAL) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // Too many completions not yet reaped: reap, retry.
                    Some(libc::ENOBUFS) => {
                        self.reap(fd)?;
                        wait_for_error_queue(fd, Duration::from_millis(10));
                        continue;
                    }
                    _ => return Err(e),
                }
            }
            self.stats.sends += 1;
            let mut n = n as usize;
            self.stats.bytes += n as u64;
            left -= n;
            // Skip what went out; a partly sent iovec keeps its tail.
            while n > 0 {
                let v = &mut self.iov[first];
                if n >= v.iov_len {
                    n -= v.iov_len;
                    first += 1;
                } else {
                    v.iov_base = (v.iov_base as *mut u8).wrapping_add(n).cast();
                    v.iov_len -= n;
                    n = 0;
                }
            }
        }
        Ok(())
    }

    /// Reads the completions waiting on the error queue.
    fn reap(&mut self, fd: RawFd) -> io::Result<()> {
        let mut control = [0u64; 16];
        loop {
            if self.stats.completed >= self.stats.sends {
                return Ok(());
            }
            // SAFETY: msghdr is plain data; all-zeros is a valid empty one.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of_val(&control) as _;
            // SAFETY: `msg` names a control buffer we own and no data
            // buffers; the error queue is read without blocking.
            let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => return Ok(()),
                    _ => return Err(e),
                }
            }
            self.count_completions(&msg);
        }
    }

    fn count_completions(&mut self, msg: &libc::msghdr) {
        // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR/NXTHDR walk
        // its control buffer within msg_controllen.
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
        while !cmsg.is_null() {
            // SAFETY: CMSG_FIRSTHDR/NXTHDR returned a header inside the buffer.
            let header = unsafe { &*cmsg };
            let is_error = (header.cmsg_level == libc::SOL_IP && header.cmsg_type == libc::IP_RECVERR)
                || (header.cmsg_level == libc::SOL_IPV6 && header.cmsg_type == libc::IPV6_RECVERR);
            if is_error {
                // SAFETY: an IP(V6)_RECVERR message carries a
                // sock_extended_err; read_unaligned copes with its alignment.
                let err: libc::sock_extended_err = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast()) };
                if err.ee_errno == 0 && err.ee_origin == SO_EE_ORIGIN_ZEROCOPY {
                    // Completions of send numbers ee_info..=ee_data.
                    let n = err.ee_data.wrapping_sub(err.ee_info) as u64 + 1;
                    self.stats.completed += n;
                    if err.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                        self.stats.copied += n;
                    }
                    self.done_ahead.insert(err.ee_info, err.ee_data);
                    while let Some(last) = self.done_ahead.remove(&self.done_below) {
                        self.done_below = last.wrapping_add(1);
                    }
                }
            }
            // SAFETY: as above.
            cmsg = unsafe { libc::CMSG_NXTHDR(msg, cmsg) };
        }
    }
}

/// Sleeps until the socket has something on its error queue (POLLERR),
/// or `timeout`.
fn wait_for_error_queue(fd: RawFd, timeout: Duration) {
    let mut pfd = libc::pollfd { fd, events: 0, revents: 0 };
    let ms = timeout.as_millis().clamp(1, 1000) as libc::c_int;
    // SAFETY: one pollfd that lives across the call.
    unsafe { libc::poll(&mut pfd, 1, ms) };
}

fn iovec(bytes: &[u8]) -> libc::iovec {
    libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() }
}

fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed zero-copy frame list")
}
