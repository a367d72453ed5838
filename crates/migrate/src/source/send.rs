//! The send stage: one [`SendStage`] per channel writes what its shards'
//! encoders made, in order, and ends each iteration on its channel with an
//! ITERATION_END once every shard it carries has ended it.

use std::io::{BufWriter, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::encode::SendItem;
use super::error::PipelineError;
use super::zerocopy::{GuestPages, ZeroCopySender};
use crate::protocol::{self, FrameKind, IterationEnd};
use crate::transport::{Metered, Pacer, Stream};

/// A channel's writer, shared by its send stage and (between iterations,
/// for control frames) the migration thread.
pub type Writer = BufWriter<Metered<Stream>>;

/// How long a sender waits for the kernel to finish with its buffers: as
/// long as a silent destination may take to read them.
const ZERO_COPY_PATIENCE: Duration = Duration::from_secs(30);

/// One channel's sender.
pub struct SendStage {
    channel: u16,
    /// Shards this channel carries: ITERATION_END waits for each.
    shards: usize,
    writer: Arc<Mutex<Writer>>,
    pacer: Arc<Pacer>,
    /// `--zero-copy`: guest memory, where raw pages come from.
    guest: Option<GuestPages>,
    /// The channel's zero-copy state, shared with the stages before and
    /// after this one.
    zero_copy: Arc<Mutex<ZeroCopySender>>,
    /// Zero-copy header buffers the kernel may hold while we go on: one
    /// when threads keep encoders busy meanwhile, none when run in turn.
    keep: usize,
    /// Shards that ended the iteration in progress, and their records.
    ends: usize,
    records: u64,
}

impl SendStage {
    /// The send stage of `channel`, which carries `shards` shards.
    pub fn new(
        channel: u16,
        shards: usize,
        writer: Arc<Mutex<Writer>>,
        zero_copy: Arc<Mutex<ZeroCopySender>>,
        pacer: Arc<Pacer>,
        guest: Option<GuestPages>,
        keep: usize,
    ) -> SendStage {
        SendStage { channel, shards, writer, pacer, guest, zero_copy, keep, ends: 0, records: 0 }
    }

    /// Sends one item. Returns the buffers it is done with (to reuse) and,
    /// when the item ended the iteration on this channel, the records the
    /// channel carried in it (ITERATION_END is written and flushed then).
    pub fn send(&mut self, item: SendItem) -> Result<(Vec<Vec<u8>>, Option<u64>), PipelineError> {
        let write = |source| PipelineError::Write { channel: self.channel, source };
        match item {
            SendItem::Frames(bytes) => {
                self.writer.lock().unwrap().write_all(&bytes).map_err(write)?;
                Ok((vec![bytes], None))
            }
            SendItem::ZeroCopy(headers) => {
                let guest = self.guest.as_ref().expect("zero-copy batches come with guest memory");
                let mut writer = self.writer.lock().unwrap();
                let mut sender = self.zero_copy.lock().unwrap();
                let released = send_by_reference(&mut writer, &mut sender, headers, guest, &self.pacer, self.keep);
                Ok((released.map_err(write)?, None))
            }
            SendItem::End { iteration, records } => {
                self.ends += 1;
                self.records += records;
                if self.ends < self.shards {
                    return Ok((Vec::new(), None));
                }
                let records = std::mem::take(&mut self.records);
                self.ends = 0;
                let end = IterationEnd { iteration, records };
                write_frame_flushed(&mut *self.writer.lock().unwrap(), FrameKind::IterationEnd, &end.encode())
                    .map_err(write)?;
                Ok((Vec::new(), Some(records)))
            }
        }
    }

    /// Waits (briefly) for the kernel to finish the channel's zero-copy
    /// sends.
    pub fn finish(self) {
        let mut sender = self.zero_copy.lock().unwrap();
        if sender.stats.sends > 0 {
            if let Some(fd) = tcp_fd(&self.writer.lock().unwrap()) {
                let _ = sender.settle(fd, 0, Duration::from_secs(2));
            }
        }
    }
}

/// Writes a frame and flushes the writer.
pub fn write_frame_flushed(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> std::io::Result<()> {
    protocol::write_frame(w, kind, payload)?;
    w.flush()
}

/// Bytes written to a writer's socket and not yet taken by the peer (for
/// TCP: not acknowledged, so this counts a shaped link's queue too), or
/// None for a stream it cannot tell (encrypted).
pub fn unsent_bytes(writer: &Writer) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let fd = match writer.get_ref().get_ref() {
        Stream::Tcp(s) => s.as_raw_fd(),
        Stream::Unix(s) => s.as_raw_fd(),
        Stream::Secure(_) => return None,
    };
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer,
    // which points to a live local; `fd` is this writer's open socket.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) };
    (r == 0).then_some(queued.max(0) as usize)
}

/// The lowest round trip a writer's TCP connection has seen (the link's
/// own delay, without its queues), or None for another stream.
pub fn min_rtt(writer: &Writer) -> Option<Duration> {
    let fd = tcp_fd(writer)?;
    // SAFETY: tcp_info is plain old data, for which all-zero bytes are valid.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a live
    // local of that size; `fd` is this writer's open socket.
    let r = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut info as *mut libc::tcp_info).cast(), &mut len)
    };
    let seen = info.tcpi_min_rtt > 0 && info.tcpi_min_rtt != u32::MAX;
    (r == 0 && seen).then(|| Duration::from_micros(info.tcpi_min_rtt as u64))
}

/// Bytes a channel may still hold in flight when the guest is paused for
/// the stop or the switch to post-copy (64 KiB: half a millisecond at 1
/// Gbit/s): what is queued in the link before the pause would be waited
/// for during it.
pub const DRAINED: usize = 64 << 10;
/// The longest wait for a link to drain before a pause.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(1);

/// Waits (at most `limit`) until the sockets under `writers` hold at most
/// `keep` bytes each that the peer has not taken.
pub fn drain(writers: &[&Writer], keep: usize, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline && writers.iter().any(|w| unsent_bytes(w).is_some_and(|n| n > keep)) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The socket under a writer, when it is TCP (zero-copy needs one).
pub fn tcp_fd(writer: &Writer) -> Option<std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    match writer.get_ref().get_ref() {
        Stream::Tcp(s) => Some(s.as_raw_fd()),
        _ => None,
    }
}

/// Sends zero-copy frames on a channel, after whatever its writer holds,
/// then waits until the kernel holds at most `keep` header buffers; returns
/// the buffers it is done with.
fn send_by_reference(
    writer: &mut Writer,
    sender: &mut ZeroCopySender,
    headers: Vec<u8>,
    guest: &GuestPages,
    pacer: &Pacer,
    keep: usize,
) -> std::io::Result<Vec<Vec<u8>>> {
    writer.flush()?;
    let fd = tcp_fd(writer).ok_or_else(|| std::io::Error::other("--zero-copy needs a TCP connection"))?;
    sender.send(fd, headers, guest, &|n| pacer.pace(n))?;
    sender.settle(fd, keep, ZERO_COPY_PATIENCE)
}
