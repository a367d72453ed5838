//! The channels of an incoming migration and the threads behind them:
//! accepting the extra channels, reading each one's frames and handing
//! them to the decoders of the shards it carries ([`Dispatcher`]), and
//! what those threads share.

use std::io::{BufReader, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::error::ReceiveError;
use super::postcopy::{write_flushed, BackChannel, PostcopyShared, Unpacker};
use crate::buffer_budget::{recycle, BufferBudget, Lease};
use crate::digest::BackgroundDigest;
use crate::protocol::pages::shard_of;
use crate::protocol::{self, ChannelOpen, FrameKind, IterationEnd, ShardLayout, WireError};
use crate::transport::{Listener, Stream};

/// Counts bytes read.
pub(super) struct Counted<R> {
    pub(super) inner: R,
    pub(super) bytes: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// A frame buffer whose payload bytes are reserved from the receive's
/// [`BufferBudget`] while the frame is held.
pub(super) struct LeasedFrame {
    pub(super) buf: Vec<u8>,
    pub(super) lease: Option<Lease>,
    pub(super) budget: Arc<BufferBudget>,
    pub(super) stopped: Arc<AtomicBool>,
}

impl LeasedFrame {
    pub(super) fn new(budget: Arc<BufferBudget>, stopped: Arc<AtomicBool>) -> LeasedFrame {
        LeasedFrame { buf: Vec::new(), lease: None, budget, stopped }
    }

    /// Reads the next frame, giving back the previous one's bytes first.
    pub(super) fn read(&mut self, r: &mut impl Read) -> Result<FrameKind, ReceiveError> {
        self.lease = None;
        recycle(&mut self.buf);
        let (budget, stop, lease) = (&self.budget, &self.stopped, &mut self.lease);
        protocol::read_frame_reserving(r, &mut self.buf, |len| {
            *lease = budget.reserve(len, &|| stop.load(Ordering::Acquire));
            lease.as_ref().map(|_| ()).ok_or_else(stopped)
        })
    }
}

/// Where extra channels come from.
pub(super) struct ChannelSource<'a> {
    pub(super) listener: Option<&'a Listener>,
    pub(super) first: Stream,
    pub(super) bytes: Arc<AtomicU64>,
}

impl ChannelSource<'_> {
    /// Accepts the source's channels 1..count of `session`, in any order.
    pub(super) fn accept(
        &self,
        session: u64,
        count: u16,
        timeout: Duration,
        security: &crate::transport::Security,
    ) -> Result<Vec<Stream>, ReceiveError> {
        let mut streams: Vec<Option<Stream>> = (1..count).map(|_| None).collect();
        if count <= 1 {
            return Ok(Vec::new());
        }
        let Some(listener) = self.listener else {
            return Err(ReceiveError::Mismatch(format!("the source wants {count} channels; this receiver takes one")));
        };
        let deadline = Instant::now() + timeout;
        let mut frame = Vec::new();
        while streams.iter().any(Option::is_none) {
            let Some(stream) = listener.accept_until(&|| Instant::now() > deadline)? else {
                return Err(ReceiveError::Mismatch(format!(
                    "the source's channels did not all connect within {} s",
                    timeout.as_secs()
                )));
            };
            let stream = security.accepted(stream)?;
            stream.set_read_timeout(Some(timeout))?;
            let mut reader = stream.try_clone()?;
            let mut writer = stream.try_clone()?;
            protocol::read_preamble(&mut reader)?;
            protocol::write_preamble(&mut writer, protocol::VERSION)?;
            let ChannelOpen { session: got_session, channel } = match protocol::read_frame(&mut reader, &mut frame)? {
                FrameKind::Channel => ChannelOpen::decode(&frame)?,
                other => return Err(WireError::Unexpected { got: other, expected: "CHANNEL" }.into()),
            };
            if got_session != session || channel == 0 || channel >= count || streams[channel as usize - 1].is_some() {
                // Someone else's connection, or a duplicate: not ours to use.
                stream.shutdown();
                continue;
            }
            streams[channel as usize - 1] = Some(stream);
        }
        Ok(streams.into_iter().map(|s| s.expect("all accepted")).collect())
    }
}

/// What the channel readers and shard workers share.
pub(super) struct Shared {
    /// Per shard: iterations fully applied (count, so 0 = none yet).
    pub(super) applied: Mutex<Vec<u32>>,
    pub(super) changed: Condvar,
    /// The first failure of any thread.
    pub(super) failure: Mutex<Option<ReceiveError>>,
    /// Every channel's stream, its reading half shut down on failure to wake
    /// blocked reads.
    pub(super) streams: Mutex<Vec<Stream>>,
    /// The source finished: a closed channel is expected now.
    pub(super) done: AtomicBool,
    /// Set on the first failure: ends waits for the buffer budget.
    pub(super) stopped: Arc<AtomicBool>,
    /// The frame bytes every channel and decoder hold together.
    pub(super) budget: Arc<BufferBudget>,
    /// Set when the source switched to post-copy: where post-copy pages go.
    pub(super) postcopy: std::sync::OnceLock<Arc<PostcopyShared>>,
}

impl Shared {
    /// Answers a DIGEST sent before the pause with CAUGHT_UP once every
    /// page sent before it (up to ITERATION_END `last`) is written and
    /// hashed: the source pauses the VM only then, or the pages the
    /// decoders still held would be the stop's (lz4 shrank a bwmem guest's
    /// 256 MiB to 1 MiB, which the link's buffers took at once: 124-195 ms
    /// of downtime).
    pub(super) fn catch_up(
        &self,
        last: Option<u32>,
        digest: &BackgroundDigest,
        writer: &BackChannel,
    ) -> Result<(), ReceiveError> {
        if let Some(last) = last {
            self.wait_applied(last)?;
        }
        let _ = digest.hashes();
        write_flushed(writer, |w| protocol::write_frame(w, FrameKind::CaughtUp, &[]))
    }

    pub(super) fn fail(&self, e: ReceiveError) {
        let mut failure = self.failure.lock().unwrap();
        if failure.is_none() {
            *failure = Some(e);
        }
        drop(failure);
        self.stopped.store(true, Ordering::Release);
        for s in self.streams.lock().unwrap().iter() {
            s.shutdown_read();
        }
        self.changed.notify_all();
    }

    pub(super) fn take_failure(&self) -> Option<ReceiveError> {
        self.failure.lock().unwrap().take()
    }

    /// Waits until every shard applied iterations up to `iteration`.
    pub(super) fn wait_applied(&self, iteration: u32) -> Result<(), ReceiveError> {
        let mut applied = self.applied.lock().unwrap();
        loop {
            if let Some(e) = self.take_failure() {
                return Err(e);
            }
            if applied.iter().all(|&a| a > iteration) {
                return Ok(());
            }
            applied = self.changed.wait_timeout(applied, Duration::from_millis(100)).unwrap().0;
        }
    }
}

/// Work for a shard's decoder.
pub(super) enum ShardWork {
    /// A PAGES or PAGES_COMPRESSED frame; the buffer goes back to `pool`,
    /// and its bytes to the budget when `lease` drops.
    Frame { kind: FrameKind, payload: Vec<u8>, pool: Sender<Vec<u8>>, lease: Lease },
    /// Every earlier frame of this shard belongs to iterations ≤ this.
    End(u32),
}

/// Hands frames of one channel to the decoders of the shards it carries.
pub(super) struct Dispatcher {
    pub(super) channel: u16,
    pub(super) layout: ShardLayout,
    pub(super) to_shards: Vec<Sender<ShardWork>>,
    pub(super) pool_tx: Sender<Vec<u8>>,
    pub(super) pool_rx: Receiver<Vec<u8>>,
}

impl Dispatcher {
    /// Passes a pages frame held in `frame` on (swapping in a free buffer).
    pub(super) fn pages(&self, kind: FrameKind, frame: &mut LeasedFrame) -> Result<(), ReceiveError> {
        let shard = shard_of(kind, &frame.buf)?;
        if shard >= self.layout.shards || self.layout.channel(shard) != self.channel {
            return Err(WireError::BadField {
                field: "pages.shard",
                detail: format!("{shard} does not travel on channel {}", self.channel),
            }
            .into());
        }
        let lease = frame.lease.take().expect("a frame read holds its lease");
        let spare = self.pool_rx.recv().map_err(|_| stopped())?;
        let payload = std::mem::replace(&mut frame.buf, spare);
        self.to_shards[shard as usize]
            .send(ShardWork::Frame { kind, payload, pool: self.pool_tx.clone(), lease })
            .map_err(|_| stopped())
    }

    /// ITERATION_END on this channel: mark it in each of its shards.
    pub(super) fn end(&self, frame: &[u8]) -> Result<u32, ReceiveError> {
        let IterationEnd { iteration, .. } = IterationEnd::decode(frame)?;
        for shard in self.layout.shards_of(self.channel) {
            self.to_shards[shard as usize].send(ShardWork::End(iteration)).map_err(|_| stopped())?;
        }
        Ok(iteration)
    }
}

/// A receiving thread stopped (after another failed first).
pub(super) fn stopped() -> ReceiveError {
    ReceiveError::ThreadStopped
}
/// An extra channel: reads frames and hands them to its shards' decoders.
pub(super) fn channel_loop(stream: Stream, dispatch: Dispatcher, bytes: Arc<AtomicU64>, shared: Arc<Shared>) {
    let mut reader = Counted { inner: BufReader::with_capacity(1 << 20, stream), bytes };
    let mut frame = LeasedFrame::new(shared.budget.clone(), shared.stopped.clone());
    let mut unpacker = Unpacker::default();
    let mut background = None;
    loop {
        let result = match frame.read(&mut reader) {
            Ok(kind) if kind.carries_pages() => dispatch.pages(kind, &mut frame),
            Ok(kind @ (FrameKind::PostcopyPages | FrameKind::PostcopyPagesCompressed)) => {
                // Pushed pages are bulk work: the fault's threads go first.
                background.get_or_insert_with(tsubame_vmm::cpu_time::lower_thread_priority);
                match shared.postcopy.get() {
                    Some(postcopy) => postcopy.install_pushed(kind, &frame.buf, &mut unpacker),
                    None => Err(WireError::Unexpected { got: kind, expected: "PAGES" }.into()),
                }
            }
            Ok(FrameKind::IterationEnd) => dispatch.end(&frame.buf).map(|_| ()),
            Ok(other) => Err(WireError::Unexpected { got: other, expected: "PAGES or ITERATION_END" }.into()),
            Err(_) if shared.done.load(Ordering::Acquire) => return,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            if !shared.done.load(Ordering::Acquire) {
                shared.fail(ReceiveError::Channel { channel: dispatch.channel, source: Box::new(e) });
            }
            return;
        }
    }
}
