//! The receiving side: accept one stream, build the VM from it, verify,
//! and resume the guest only when the source commits.
//!
//! Every byte from the peer is checked before use (wire.rs, pages.rs);
//! on any failure the half-built VM is dropped and the source told why.

use std::io::{BufReader, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use tsubame_vmm::memory::GuestMemory;
use tsubame_vmm::{memory, Vm, VmConfig, VmState, PAGE_SIZE};

use crate::buffer_budget::{recycle, BufferBudget, Lease};
use crate::digest::{self, BackgroundDigest};
use crate::pages::{for_each_record, for_each_subpage, Encoding};
use crate::stats::process_cpu_seconds;
use crate::transport::{Listener, Stream, TransportError};
use crate::wire::{self, FrameKind, Hello, WireError};
use tsubame_codec::batch::BatchDecompressor;
use tsubame_codec::{CodecList, PageDecoder};

/// What the receiver may insist on.
#[derive(Debug, Clone)]
pub struct ReceiveOptions {
    /// Refuse a VM whose memory size differs.
    pub expect_memory: Option<u64>,
    /// Give up when the source is silent this long.
    pub io_timeout: Duration,
    /// Back guest memory with transparent huge pages.
    pub hugepages: bool,
    /// What the source's extra channels must pass (channel 0 is
    /// protected by whoever accepted it).
    pub security: crate::transport::Security,
    /// Frame bytes held at once across all channels and decoders; a peer
    /// that sends faster than they decode waits (docs/security.md).
    pub in_flight_limit: usize,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions {
            expect_memory: None,
            io_timeout: Duration::from_secs(30),
            hugepages: true,
            security: Default::default(),
            in_flight_limit: crate::buffer_budget::IN_FLIGHT_LIMIT,
        }
    }
}

/// Why an incoming migration failed.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// Accepting.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The stream.
    #[error("migration stream: {0}")]
    Wire(#[from] WireError),
    /// Building the VM.
    #[error("VM: {0}")]
    Vm(#[from] tsubame_vmm::VmError),
    /// The source's setup does not fit this destination.
    #[error("{0}")]
    Mismatch(String),
    /// The source gave up and said why.
    #[error("source aborted: {0}")]
    SourceAborted(String),
    /// The memory does not match the source's digest.
    #[error("memory digest mismatch in {count} of {total} regions (first at byte {first:#x})")]
    DigestMismatch {
        /// Regions that differ.
        count: usize,
        /// Regions compared.
        total: usize,
        /// Address of the first differing region.
        first: u64,
    },
    /// The VM state blob did not decode.
    #[error("VM state frame does not decode: {0}")]
    BadState(String),
    /// An extra channel failed.
    #[error("channel {channel}: {source}")]
    Channel {
        /// Which channel.
        channel: u16,
        /// What went wrong on it.
        source: Box<ReceiveError>,
    },
}

impl From<std::io::Error> for ReceiveError {
    fn from(e: std::io::Error) -> Self {
        ReceiveError::Wire(WireError::Io(e))
    }
}

/// A VM that arrived and runs here now.
pub struct Incoming {
    /// The running VM.
    pub vm: Vm,
    /// Iterations received (stop-and-copy included).
    pub iterations: u32,
    /// Bytes read from the stream (every channel).
    pub bytes: u64,
    /// CPU-seconds this process spent from connection to resume.
    pub cpu_seconds: f64,
    /// Connection to resume.
    pub duration: Duration,
}

/// Counts bytes read.
struct Counted<R> {
    inner: R,
    bytes: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Where an incoming VM lands: a real VM, or (fuzzing, tests) plain memory.
pub trait Landing {
    /// Maps guest memory of this size (already range-checked).
    fn create(&mut self, memory_bytes: u64) -> Result<Arc<GuestMemory>, ReceiveError>;
    /// Loads the vCPU and device state from the STATE frame.
    fn restore(&mut self, state: &[u8]) -> Result<(), ReceiveError>;
    /// Runs the guest: the source has committed.
    fn start(&mut self) -> Result<(), ReceiveError>;
}

/// Lands the VM in a KVM VM.
///
/// Memory is mapped with 4 KiB pages while pages arrive and asks for huge
/// pages only when the guest starts: with huge pages, every page written
/// into a fresh 2 MiB region costs the kernel zeroing all 2 MiB, and a
/// guest whose pages are few and scattered (GMigrate's "Best") made the
/// destination zero gigabytes it never needed (12-15 s instead of 1.8 s
/// for 4 GiB of `fill-zero` at 1 Gbit/s).
struct VmLanding {
    vm: Option<Vm>,
    hugepages: bool,
}

impl Landing for VmLanding {
    fn create(&mut self, memory_bytes: u64) -> Result<Arc<GuestMemory>, ReceiveError> {
        let vm = self.vm.insert(Vm::create(&VmConfig { memory_bytes, hugepages: false })?);
        Ok(vm.memory().clone())
    }

    fn restore(&mut self, blob: &[u8]) -> Result<(), ReceiveError> {
        if blob.is_empty() {
            return Err(ReceiveError::BadState(
                "the source sent no vCPU state (a trace replay?); receive it with --memory-only".into(),
            ));
        }
        let state: VmState = postcard::from_bytes(blob).map_err(|e| ReceiveError::BadState(e.to_string()))?;
        Ok(self.vm.as_mut().expect("created first").restore_state(&state)?)
    }

    fn start(&mut self) -> Result<(), ReceiveError> {
        let vm = self.vm.as_mut().expect("created first");
        if self.hugepages {
            tsubame_vmm::memory::advise_hugepages(vm.memory());
        }
        Ok(vm.start(false)?)
    }
}

/// Lands the VM's memory in plain memory (no KVM): for fuzzing the
/// receiver and for tests. Refuses memory above `max_bytes`.
pub struct MemoryLanding {
    /// Largest memory accepted.
    pub max_bytes: u64,
    /// The memory, once created.
    pub memory: Option<Arc<GuestMemory>>,
    /// True once the source committed.
    pub started: bool,
}

impl Landing for MemoryLanding {
    fn create(&mut self, memory_bytes: u64) -> Result<Arc<GuestMemory>, ReceiveError> {
        if memory_bytes > self.max_bytes {
            return Err(ReceiveError::Mismatch(format!("{memory_bytes} bytes of memory exceed {}", self.max_bytes)));
        }
        let mem = Arc::new(memory::create(memory_bytes, false).map_err(tsubame_vmm::VmError::from)?);
        Ok(self.memory.insert(mem).clone())
    }

    fn restore(&mut self, _state: &[u8]) -> Result<(), ReceiveError> {
        Ok(())
    }

    fn start(&mut self) -> Result<(), ReceiveError> {
        self.started = true;
        Ok(())
    }
}

/// Decompresses a PAGES_COMPRESSED payload (shard u16, compressor u8,
/// length u32, bytes) into `out`, never past the frame size limit. The
/// decompressor keeps its context: creating a zstd context per batch cost
/// ~1 ms each.
fn unpack(frame: &[u8], decompressor: &mut BatchDecompressor, out: &mut Vec<u8>) -> Result<(), ReceiveError> {
    let mut f = crate::wire::Fields::new(FrameKind::PagesCompressed, frame);
    let _shard = f.u16()?;
    let id = f.u8()?;
    let len = f.u32()? as usize;
    decompressor
        .decompress(id, f.rest(), len, wire::MAX_UNPACKED, out)
        .map_err(|e| WireError::BadField { field: "pages_compressed", detail: e.to_string() })?;
    if crate::pages::shard_of(FrameKind::Pages, out)? != crate::pages::shard_of(FrameKind::PagesCompressed, frame)? {
        return Err(WireError::BadField {
            field: "pages.shard",
            detail: "differs from its PAGES_COMPRESSED frame".into(),
        }
        .into());
    }
    Ok(())
}

/// Times a destination asks for mismatched regions before giving up.
const MAX_REPAIR_ROUNDS: u32 = 2;

/// One bit per guest page, set by the decoders.
struct PageMarks {
    /// Ever written: a zero record for an untouched page writes nothing.
    touched: Vec<AtomicU64>,
    /// Written since the digest last hashed them; set after the write.
    written: Vec<AtomicU64>,
}

impl PageMarks {
    fn new(pages: u64) -> PageMarks {
        let words = || (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        PageMarks { touched: words(), written: words() }
    }

    /// Takes the `written` bits (clearing them) for the digest.
    fn take_written(&self) -> Vec<u64> {
        self.written.iter().map(|w| w.swap(0, Ordering::AcqRel)).collect()
    }
}

/// Writes the records of a PAGES frame into guest memory. `touched` marks
/// pages ever written: a zero record for an untouched page writes nothing,
/// so fresh memory stays unbacked. Codec records are decoded, and the
/// codecs' caches see every page as the sender's did.
fn apply_pages(
    frame: &[u8],
    mem: &GuestMemory,
    granularity: usize,
    marks: &PageMarks,
    decoder: &mut PageDecoder,
) -> Result<(), ReceiveError> {
    let page_count = memory::page_count(mem);
    let zero_page = [0u8; PAGE_SIZE];
    let mut page = [0u8; PAGE_SIZE];
    for_each_record(frame, page_count, granularity, |record| {
        let word = &marks.touched[(record.page_index / 64) as usize];
        let bit = 1u64 << (record.page_index % 64);
        let index = record.page_index;
        let addr = index * PAGE_SIZE as u64;
        let result = match record.encoding {
            Encoding::Raw => {
                word.fetch_or(bit, Ordering::Relaxed);
                page.copy_from_slice(record.data);
                decoder.observe(index, &page);
                memory::write(mem, addr, record.data)
            }
            Encoding::Zero => {
                decoder.observe_zero(index);
                if word.load(Ordering::Relaxed) & bit != 0 {
                    memory::write(mem, addr, &zero_page)
                } else {
                    Ok(())
                }
            }
            Encoding::Subpage => {
                word.fetch_or(bit, Ordering::Relaxed);
                let mut result = Ok(());
                for_each_subpage(record.data, granularity, |offset, bytes| {
                    if result.is_ok() {
                        result = memory::write(mem, addr + offset as u64, bytes);
                    }
                });
                result
            }
            Encoding::Rle | Encoding::Xbzrle | Encoding::Dedup => {
                word.fetch_or(bit, Ordering::Relaxed);
                let tag = record.encoding.codec_tag().expect("codec encodings have tags");
                if let Err(e) = decoder.decode(index, tag, record.data, &mut page) {
                    return Err(WireError::BadField { field: "pages.codec_record", detail: e.to_string() });
                }
                memory::write(mem, addr, &page)
            }
        };
        if result.is_ok() {
            marks.written[(index / 64) as usize].fetch_or(bit, Ordering::Release);
        }
        result.map_err(|e| WireError::BadField { field: "pages.page_index", detail: e.to_string() })
    })?;
    Ok(())
}

/// Accepts one connection and receives a VM over it (and over the extra
/// channels it announces, accepted from the same listener). `log` hears
/// the milestones (for the CLI's stderr).
pub fn receive(listener: &Listener, options: &ReceiveOptions, log: &dyn Fn(&str)) -> Result<Incoming, ReceiveError> {
    let stream = listener.accept()?;
    receive_on(stream, Some(listener), options, log)
}

/// Receives a VM over an accepted connection; extra channels, if the
/// source asks for them, come from `listener`.
pub fn receive_on(
    stream: Stream,
    listener: Option<&Listener>,
    options: &ReceiveOptions,
    log: &dyn Fn(&str),
) -> Result<Incoming, ReceiveError> {
    let mut landing = VmLanding { vm: None, hugepages: options.hugepages };
    let received = receive_into(stream, listener, options, log, &mut landing)?;
    Ok(Incoming {
        vm: landing.vm.expect("a received VM exists"),
        iterations: received.iterations,
        bytes: received.bytes,
        cpu_seconds: received.cpu_seconds,
        duration: received.duration,
    })
}

/// What a receive cost.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    /// Iterations received (stop-and-copy included).
    pub iterations: u32,
    /// Bytes read from the stream (every channel).
    pub bytes: u64,
    /// CPU-seconds this process spent from connection to resume.
    pub cpu_seconds: f64,
    /// Connection to resume.
    pub duration: Duration,
}

/// Receives over an accepted connection into `landing` (a VM, or plain
/// memory for `receive --memory-only`).
pub fn receive_into(
    stream: Stream,
    listener: Option<&Listener>,
    options: &ReceiveOptions,
    log: &dyn Fn(&str),
    landing: &mut dyn Landing,
) -> Result<Received, ReceiveError> {
    let started = Instant::now();
    let cpu_start = process_cpu_seconds();
    stream.set_read_timeout(Some(options.io_timeout))?;
    let mut writer = stream.try_clone()?;
    let bytes = Arc::new(AtomicU64::new(0));
    let mut reader = Counted { inner: BufReader::with_capacity(1 << 20, stream.try_clone()?), bytes: bytes.clone() };
    let channels = ChannelSource { listener, first: stream, bytes: bytes.clone() };
    let result = StreamReceiver::new(options, log).run(&mut reader, &mut writer, landing, Some(&channels));
    match result {
        Ok(iterations) => {
            let cpu = process_cpu_seconds() - cpu_start;
            // Tell the source we run, and what it cost us.
            let micros = ((cpu * 1e6) as u64).to_le_bytes();
            let _ = wire::write_frame(&mut writer, FrameKind::Resumed, &micros).and_then(|_| writer.flush());
            Ok(Received {
                iterations,
                bytes: bytes.load(Ordering::Relaxed),
                cpu_seconds: cpu,
                duration: started.elapsed(),
            })
        }
        Err(e) => {
            if !matches!(e, ReceiveError::SourceAborted(_)) {
                let message = e.to_string();
                let mut payload = message.as_bytes().to_vec();
                payload.truncate(wire::MAX_ERROR_MESSAGE);
                let _ = wire::write_frame(&mut writer, FrameKind::Error, &payload).and_then(|_| writer.flush());
            }
            Err(e)
        }
    }
}

/// Runs the receiver's state machine over one byte stream into `landing`
/// (no extra channels): the fuzz target's entry, and tests'.
pub fn receive_stream(
    reader: &mut impl Read,
    writer: &mut impl Write,
    landing: &mut dyn Landing,
    options: &ReceiveOptions,
) -> Result<u32, ReceiveError> {
    StreamReceiver::new(options, &|_| {}).run(reader, writer, landing, None)
}

/// Where extra channels come from.
struct ChannelSource<'a> {
    listener: Option<&'a Listener>,
    first: Stream,
    bytes: Arc<AtomicU64>,
}

impl ChannelSource<'_> {
    /// Accepts the source's channels 1..count of `session`, in any order.
    fn accept(
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
            wire::read_preamble(&mut reader)?;
            wire::write_preamble(&mut writer, wire::VERSION)?;
            let (got_session, channel) = match wire::read_frame(&mut reader, &mut frame)? {
                FrameKind::Channel => wire::decode_channel(&frame)?,
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
struct Shared {
    /// Per shard: iterations fully applied (count, so 0 = none yet).
    applied: Mutex<Vec<u32>>,
    changed: Condvar,
    /// The first failure of any thread.
    failure: Mutex<Option<ReceiveError>>,
    /// Every channel's stream, its reading half shut down on failure to wake
    /// blocked reads.
    streams: Mutex<Vec<Stream>>,
    /// The source finished: a closed channel is expected now.
    done: AtomicBool,
    /// Set on the first failure: ends waits for the buffer budget.
    stopped: Arc<AtomicBool>,
    /// The frame bytes every channel and decoder hold together.
    budget: Arc<BufferBudget>,
}

impl Shared {
    fn fail(&self, e: ReceiveError) {
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

    fn take_failure(&self) -> Option<ReceiveError> {
        self.failure.lock().unwrap().take()
    }

    /// Waits until every shard applied iterations up to `iteration`.
    fn wait_applied(&self, iteration: u32) -> Result<(), ReceiveError> {
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
enum ShardWork {
    /// A PAGES or PAGES_COMPRESSED frame; the buffer goes back to `pool`,
    /// and its bytes to the budget when `lease` drops.
    Frame { kind: FrameKind, payload: Vec<u8>, pool: Sender<Vec<u8>>, lease: Lease },
    /// Every earlier frame of this shard belongs to iterations ≤ this.
    End(u32),
}

/// Hands frames of one channel to the decoders of the shards it carries.
struct Dispatcher {
    channel: u16,
    channels: u16,
    to_shards: Vec<Sender<ShardWork>>,
    pool_tx: Sender<Vec<u8>>,
    pool_rx: Receiver<Vec<u8>>,
}

impl Dispatcher {
    /// Passes a pages frame held in `frame` on (swapping in a free buffer).
    fn pages(&self, kind: FrameKind, frame: &mut LeasedFrame) -> Result<(), ReceiveError> {
        let shard = crate::pages::shard_of(kind, &frame.buf)?;
        if shard as usize >= self.to_shards.len() || shard % self.channels != self.channel {
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
    fn end(&self, frame: &[u8]) -> Result<u32, ReceiveError> {
        let mut f = crate::wire::Fields::new(FrameKind::IterationEnd, frame);
        let iteration = f.u32()?;
        let _records = f.u64()?;
        f.finish()?;
        for (shard, queue) in self.to_shards.iter().enumerate() {
            if shard as u16 % self.channels == self.channel {
                queue.send(ShardWork::End(iteration)).map_err(|_| stopped())?;
            }
        }
        Ok(iteration)
    }
}

fn stopped() -> ReceiveError {
    ReceiveError::Mismatch("a receiving thread stopped".into())
}

/// A frame buffer whose payload bytes are reserved from the receive's
/// [`BufferBudget`] while the frame is held.
struct LeasedFrame {
    buf: Vec<u8>,
    lease: Option<Lease>,
    budget: Arc<BufferBudget>,
    stopped: Arc<AtomicBool>,
}

impl LeasedFrame {
    fn new(budget: Arc<BufferBudget>, stopped: Arc<AtomicBool>) -> LeasedFrame {
        LeasedFrame { buf: Vec::new(), lease: None, budget, stopped }
    }

    /// Reads the next frame, giving back the previous one's bytes first.
    fn read(&mut self, r: &mut impl Read) -> Result<FrameKind, ReceiveError> {
        self.lease = None;
        recycle(&mut self.buf);
        let (budget, stop, lease) = (&self.budget, &self.stopped, &mut self.lease);
        wire::read_frame_reserving(r, &mut self.buf, |len| {
            *lease = budget.reserve(len, &|| stop.load(Ordering::Acquire));
            lease.as_ref().map(|_| ()).ok_or_else(stopped)
        })
    }
}

struct StreamReceiver<'a> {
    options: &'a ReceiveOptions,
    log: &'a dyn Fn(&str),
    frame: LeasedFrame,
    iterations: u32,
}

/// Frame buffers each channel keeps in flight.
const BUFFERS_PER_CHANNEL: usize = 8;

impl<'a> StreamReceiver<'a> {
    fn new(options: &'a ReceiveOptions, log: &'a dyn Fn(&str)) -> Self {
        let budget = BufferBudget::new(options.in_flight_limit);
        StreamReceiver { options, log, frame: LeasedFrame::new(budget, Arc::default()), iterations: 0 }
    }

    fn next(&mut self, reader: &mut impl Read) -> Result<FrameKind, ReceiveError> {
        match self.frame.read(reader)? {
            FrameKind::Error => Err(ReceiveError::SourceAborted(
                String::from_utf8_lossy(&self.frame.buf[..self.frame.buf.len().min(wire::MAX_ERROR_MESSAGE)])
                    .into_owned(),
            )),
            kind => Ok(kind),
        }
    }

    fn run(
        mut self,
        reader: &mut impl Read,
        writer: &mut impl Write,
        landing: &mut dyn Landing,
        channels: Option<&ChannelSource>,
    ) -> Result<u32, ReceiveError> {
        wire::write_preamble(writer, wire::VERSION)?;
        wire::read_preamble(reader)?;
        let hello = match self.next(reader)? {
            FrameKind::Hello => Hello::decode(&self.frame.buf)?,
            other => return Err(WireError::Unexpected { got: other, expected: "HELLO" }.into()),
        };
        if let Some(expected) = self.options.expect_memory {
            if expected != hello.memory_bytes {
                return Err(ReceiveError::Mismatch(format!(
                    "memory size mismatch: the source VM has {} bytes, this destination takes {} (--memory)",
                    hello.memory_bytes, expected
                )));
            }
        }
        let codecs: CodecList = hello
            .codecs
            .parse()
            .map_err(|e| ReceiveError::Mismatch(format!("source's codecs '{}': {e}", hello.codecs)))?;
        if hello.channels > 1 && channels.is_none_or(|c| c.listener.is_none()) {
            return Err(ReceiveError::Mismatch(format!(
                "the source wants {} channels; this receiver takes one",
                hello.channels
            )));
        }
        let mem = landing.create(hello.memory_bytes)?;
        wire::write_frame(writer, FrameKind::Accept, &[])?;
        writer.flush()?;
        (self.log)(&format!(
            "receiving a VM with {} MiB of memory over {} channel(s)",
            hello.memory_bytes >> 20,
            hello.channels
        ));
        let extra = match channels {
            Some(source) => {
                source.accept(hello.session, hello.channels, self.options.io_timeout, &self.options.security)?
            }
            None => Vec::new(),
        };

        let shared = Arc::new(Shared {
            applied: Mutex::new(vec![0; hello.shards as usize]),
            changed: Condvar::new(),
            failure: Mutex::new(None),
            streams: Mutex::new(extra.iter().map(|s| s.try_clone()).collect::<Result<_, _>>()?),
            done: AtomicBool::new(false),
            stopped: self.frame.stopped.clone(),
            budget: self.frame.budget.clone(),
        });
        if let Some(source) = channels {
            shared.streams.lock().unwrap().push(source.first.try_clone()?);
        }
        let page_count = memory::page_count(&mem);
        let marks = Arc::new(PageMarks::new(page_count));
        let shard_list = crate::pipeline::shard_codecs(&codecs, hello.shards, hello.memory_bytes);
        let granularity = hello.granularity as usize;
        let mut to_shards = Vec::new();
        let mut workers = Vec::new();
        for shard in 0..hello.shards {
            let (tx, rx) = bounded::<ShardWork>(BUFFERS_PER_CHANNEL);
            let worker = ShardWorker {
                shard,
                mem: mem.clone(),
                granularity,
                marks: marks.clone(),
                decoder: PageDecoder::new(&shard_list),
                shared: shared.clone(),
            };
            workers.push(
                std::thread::Builder::new()
                    .name(format!("decode-{shard}"))
                    .spawn(move || worker.run(rx))
                    .expect("spawn decoder"),
            );
            to_shards.push(tx);
        }
        let dispatcher = |channel: u16| {
            let (pool_tx, pool_rx) = bounded(BUFFERS_PER_CHANNEL + 2);
            for _ in 0..BUFFERS_PER_CHANNEL + 2 {
                pool_tx.send(Vec::new()).expect("pool has room");
            }
            Dispatcher { channel, channels: hello.channels, to_shards: to_shards.clone(), pool_tx, pool_rx }
        };
        let mut readers = Vec::new();
        for (i, stream) in extra.into_iter().enumerate() {
            let dispatch = dispatcher(i as u16 + 1);
            let shared = shared.clone();
            let bytes = channels.map(|c| c.bytes.clone()).unwrap_or_default();
            readers.push(
                std::thread::Builder::new()
                    .name(format!("receive-{}", i + 1))
                    .spawn(move || channel_loop(stream, dispatch, bytes, shared))
                    .expect("spawn channel reader"),
            );
        }
        let main = dispatcher(0);
        drop(to_shards);
        // Hashed in the background as pages land, so that after STATE only
        // the last pages need hashing before READY.
        let digest = BackgroundDigest::start(mem.clone(), hello.digest_region);
        let result = self.receive_memory(reader, writer, &main, &shared, &digest, &marks);
        drop(digest);
        shared.done.store(true, Ordering::Release);
        drop(main);
        if readers.is_empty() {
            // One channel: the decoders' queues closed with `main`.
            for w in workers.drain(..) {
                let _ = w.join();
            }
        }
        let state = match result {
            Ok(state) => state,
            Err(e) => {
                shared.fail(ReceiveError::Mismatch("stopped".into()));
                for r in readers {
                    let _ = r.join();
                }
                // Their queues closed with the readers: no decoder outlives
                // a failed migration (still holding its memory).
                for w in workers {
                    let _ = w.join();
                }
                return Err(e);
            }
        };
        landing.restore(&state)?;
        wire::write_frame(writer, FrameKind::Ready, &[])?;
        writer.flush()?;
        (self.log)("memory verified; ready, waiting for commit");
        match self.next(reader)? {
            FrameKind::Commit => {}
            other => return Err(WireError::Unexpected { got: other, expected: "COMMIT" }.into()),
        }
        landing.start()?;
        (self.log)("committed; the VM runs here now");
        // Extra channels' readers and their decoders end when the source
        // closes its channels; nothing waits for that.
        drop(readers);
        drop(workers);
        Ok(self.iterations)
    }

    /// Pages until STATE, then the digest check and repair passes; returns
    /// the VM state once the memory matches.
    fn receive_memory(
        &mut self,
        reader: &mut impl Read,
        writer: &mut impl Write,
        main: &Dispatcher,
        shared: &Shared,
        digest: &BackgroundDigest,
        marks: &PageMarks,
    ) -> Result<Vec<u8>, ReceiveError> {
        let with_failure = |e: ReceiveError| shared.take_failure().unwrap_or(e);
        let mut last_iteration = None;
        let state: Vec<u8> = loop {
            match self.next(reader).map_err(with_failure)? {
                kind @ (FrameKind::Pages | FrameKind::PagesCompressed | FrameKind::PagesZeroCopy) => {
                    main.pages(kind, &mut self.frame).map_err(with_failure)?
                }
                FrameKind::IterationEnd => {
                    last_iteration = Some(main.end(&self.frame.buf).map_err(with_failure)?);
                    self.iterations += 1;
                    digest.mark(marks.take_written());
                }
                FrameKind::State => break std::mem::take(&mut self.frame.buf),
                other => {
                    return Err(WireError::Unexpected { got: other, expected: "PAGES, ITERATION_END or STATE" }.into())
                }
            }
        };
        let Some(final_iteration) = last_iteration else {
            return Err(WireError::Unexpected { got: FrameKind::State, expected: "ITERATION_END" }.into());
        };
        // Every channel's last pages are applied before memory is hashed;
        // most of it was hashed already as it landed.
        shared.wait_applied(final_iteration)?;
        digest.mark(marks.take_written());
        let mut ours = digest.hashes();
        match self.next(reader)? {
            FrameKind::Digest => {}
            other => return Err(WireError::Unexpected { got: other, expected: "DIGEST" }.into()),
        }
        // Verify; on a mismatch ask for those regions again (the repair
        // pass), then compare anew.
        let mut rounds = 0;
        let mut repair_iteration = final_iteration;
        loop {
            let mismatched = digest::compare(&self.frame.buf, digest.region(), &ours)?;
            let Some(&first) = mismatched.first() else { break };
            if rounds == MAX_REPAIR_ROUNDS || mismatched.len() > digest::MAX_MISMATCH {
                return Err(ReceiveError::DigestMismatch {
                    count: mismatched.len(),
                    total: ours.len(),
                    first: first as u64 * digest.region() as u64,
                });
            }
            rounds += 1;
            (self.log)(&format!("memory differs in {} regions; asking for them again", mismatched.len()));
            wire::write_frame(writer, FrameKind::Mismatch, &digest::encode_mismatch(&mismatched))?;
            writer.flush()?;
            loop {
                match self.next(reader).map_err(with_failure)? {
                    kind @ FrameKind::Pages => main.pages(kind, &mut self.frame).map_err(with_failure)?,
                    FrameKind::IterationEnd => repair_iteration = main.end(&self.frame.buf).map_err(with_failure)?,
                    FrameKind::Digest => break,
                    other => return Err(WireError::Unexpected { got: other, expected: "PAGES or DIGEST" }.into()),
                }
            }
            shared.wait_applied(repair_iteration)?;
            digest.mark(marks.take_written());
            ours = digest.hashes();
        }
        Ok(state)
    }
}

/// An extra channel: reads frames and hands them to its shards' decoders.
fn channel_loop(stream: Stream, dispatch: Dispatcher, bytes: Arc<AtomicU64>, shared: Arc<Shared>) {
    let mut reader = Counted { inner: BufReader::with_capacity(1 << 20, stream), bytes };
    let mut frame = LeasedFrame::new(shared.budget.clone(), shared.stopped.clone());
    loop {
        let result = match frame.read(&mut reader) {
            Ok(kind @ (FrameKind::Pages | FrameKind::PagesCompressed | FrameKind::PagesZeroCopy)) => {
                dispatch.pages(kind, &mut frame)
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

/// One shard's decoder: decodes and applies its frames in order.
struct ShardWorker {
    shard: u16,
    mem: Arc<GuestMemory>,
    granularity: usize,
    marks: Arc<PageMarks>,
    decoder: PageDecoder,
    shared: Arc<Shared>,
}

impl ShardWorker {
    fn run(mut self, input: Receiver<ShardWork>) {
        let mut decompressor = BatchDecompressor::default();
        let mut unpacked = Vec::new();
        while let Ok(work) = input.recv() {
            let result = match work {
                ShardWork::Frame { kind, mut payload, pool, lease } => {
                    let r = if kind == FrameKind::PagesCompressed {
                        unpack(&payload, &mut decompressor, &mut unpacked).and_then(|_| {
                            apply_pages(&unpacked, &self.mem, self.granularity, &self.marks, &mut self.decoder)
                        })
                    } else {
                        apply_pages(&payload, &self.mem, self.granularity, &self.marks, &mut self.decoder)
                    };
                    recycle(&mut payload);
                    recycle(&mut unpacked);
                    let _ = pool.send(payload);
                    drop(lease);
                    r
                }
                ShardWork::End(iteration) => {
                    let mut applied = self.shared.applied.lock().unwrap();
                    let slot = &mut applied[self.shard as usize];
                    *slot = (*slot).max(iteration + 1);
                    self.shared.changed.notify_all();
                    Ok(())
                }
            };
            if let Err(e) = result {
                self.shared.fail(e);
                return;
            }
        }
    }
}
