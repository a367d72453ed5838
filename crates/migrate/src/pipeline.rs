//! The source's pipeline: fetch → encode → send, joined by bounded queues
//! of reusable buffers, so reading guest memory, running the codecs and
//! writing to the link overlap (GMigrate's three threads; QEMU's multifd).
//!
//! Pages are split into codec shards by page index, in chunks of
//! `batch_pages`: every page always goes through the same shard, whose
//! encoder owns its codec caches and whose frames travel on one channel in
//! order. The destination keeps one decoder per shard, so caches agree on
//! both ends and a page's records can never overtake each other, however
//! the channels interleave. `--no-pipeline` runs the same stages in turn
//! on one thread.

use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use serde::Serialize;

use tsubame_codec::batch::BatchCompressor;
use tsubame_codec::chooser::Payoff;
use tsubame_codec::{CodecList, Encoded, PageEncoder, StatsTable};
use tsubame_gpu::{Cuda, CudaOptions, Emulator, EncodedBatch, GpuEncoder, GpuError};
use tsubame_vmm::PAGE_SIZE;

use crate::options::GpuOffload;
use crate::pages::{Encoding, PagesBuilder};
use crate::pages::{PAGES_HEADER, RECORD_HEADER};
use crate::stats::thread_cpu_seconds;
use crate::subpage::{encode_partial, Change, Detector, SubpageStats, SubpageTracker};
use crate::transport::{Metered, Pacer, Stream};
use crate::wire::{self, FrameKind};
use crate::zerocopy::{GuestPages, ZeroCopySender, ZeroCopyStats};

/// Page records per PAGES frame.
pub const RECORDS_PER_FRAME: usize = 256;

/// A channel's writer, shared by its sender thread and (between
/// iterations, for control frames) the migration thread.
pub type Writer = BufWriter<Metered<Stream>>;

/// How page indices map to shards and channels.
#[derive(Debug, Clone, Copy)]
pub struct ShardLayout {
    /// Pages per batch; shards own whole batches.
    pub batch_pages: u64,
    /// Codec shards.
    pub shards: u16,
    /// Connections.
    pub channels: u16,
}

impl ShardLayout {
    /// The shard of a batch starting at `first_page`.
    pub fn shard(&self, first_page: u64) -> u16 {
        ((first_page / self.batch_pages) % self.shards as u64) as u16
    }

    /// The channel that carries a shard's frames.
    pub fn channel(&self, shard: u16) -> u16 {
        shard % self.channels
    }

    /// The shards a channel carries.
    pub fn shards_of(&self, channel: u16) -> impl Iterator<Item = u16> + '_ {
        (0..self.shards).filter(move |&s| self.channel(s) == channel)
    }

    /// Index of `page` among its shard's pages (for per-shard tables).
    pub fn local_index(&self, page: u64) -> u64 {
        let chunk = page / self.batch_pages;
        (chunk / self.shards as u64) * self.batch_pages + page % self.batch_pages
    }

    /// Pages a shard's tables must hold for `pages_total` guest pages.
    pub fn pages_per_shard(&self, pages_total: u64) -> u64 {
        pages_total.div_ceil(self.batch_pages).div_ceil(self.shards as u64) * self.batch_pages
    }
}

/// The codec list of one shard: the caches split evenly, and none larger
/// than guest memory (more could never be used, and the destination
/// allocates what the source's HELLO names). Both ends compute it alike.
pub fn shard_codecs(codecs: &CodecList, shards: u16, memory_bytes: u64) -> CodecList {
    let memory = usize::try_from(memory_bytes).unwrap_or(usize::MAX);
    let split = |bytes: usize| (bytes.min(memory) / shards as usize).max(2 * PAGE_SIZE);
    CodecList { xbzrle: codecs.xbzrle.map(split), dedup: codecs.dedup.map(split), ..codecs.clone() }
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
    fn with_capacity(pages: usize) -> Batch {
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

    fn page(&self, i: usize) -> &[u8; PAGE_SIZE] {
        self.pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].try_into().unwrap()
    }
}

/// One shard's encoder: codecs and caches, sub-page tables, lz4/zstd.
pub struct ShardEncoder {
    shard: u16,
    layout: ShardLayout,
    granularity: usize,
    /// With `--codec none` even untouched pages go raw: a true baseline.
    zero_records: bool,
    encoder: PageEncoder,
    subpage: Option<SubpageTracker>,
    compressor: Option<BatchCompressor>,
    payoff: Payoff,
    builder: PagesBuilder,
    codec_buf: Vec<u8>,
    subpage_buf: Vec<u8>,
    packed: Vec<u8>,
    compressed_frame: Vec<u8>,
    bandwidth: Arc<AtomicU64>,
    bandwidth_seen: u64,
    /// `--gpu`: the per-page codecs run there.
    gpu: Option<Box<dyn GpuBatchEncoder>>,
    /// `--gpu`: a batch with its never-backed pages zeroed.
    gpu_pages: Vec<u8>,
    /// Records and zero records encoded.
    pub records: u64,
    /// Of those, zero records.
    pub zero_pages: u64,
}

/// What a shard encoder needs to know of the migration.
pub struct EncoderSetup<'a> {
    /// Codecs of the whole stream.
    pub codecs: &'a CodecList,
    /// Sub-page size.
    pub granularity: u32,
    /// Sub-page detector.
    pub detector: Detector,
    /// Hash bits that count (tests forge collisions).
    pub hash_mask: u64,
    /// Pages of guest memory.
    pub pages_total: u64,
    /// Shards and channels.
    pub layout: ShardLayout,
    /// Current link bandwidth (f64 bits), set by the migration thread.
    pub bandwidth: Arc<AtomicU64>,
    /// `--gpu`: where the per-page codecs run.
    pub gpu: Option<GpuOffload>,
}

/// A GPU encoder of whole batches, whatever its backend.
trait GpuBatchEncoder: Send {
    fn encode_batch(&mut self, pages: &[u8], indices: &[u64]) -> Result<EncodedBatch, GpuError>;
}

impl<B: tsubame_gpu::Backend + Send> GpuBatchEncoder for GpuEncoder<B> {
    fn encode_batch(&mut self, pages: &[u8], indices: &[u64]) -> Result<EncodedBatch, GpuError> {
        GpuEncoder::encode_batch(self, pages, indices)
    }
}

/// Opens the GPU encoder of one shard, with that shard's codec caches.
fn open_gpu(gpu: GpuOffload, codecs: &CodecList, batch_pages: usize) -> Result<Box<dyn GpuBatchEncoder>, GpuError> {
    Ok(match gpu {
        GpuOffload::Cuda(wait) => {
            let cuda = Cuda::open(CudaOptions { max_pages: batch_pages, wait, ..CudaOptions::default() })?;
            Box::new(GpuEncoder::new(cuda, codecs, batch_pages)?)
        }
        GpuOffload::Emulator => Box::new(GpuEncoder::new(Emulator::new(2), codecs, batch_pages)?),
    })
}

impl ShardEncoder {
    /// The encoder of `shard`; fails only when `--gpu` finds no GPU.
    pub fn new(shard: u16, setup: &EncoderSetup) -> Result<ShardEncoder, GpuError> {
        let codecs = shard_codecs(setup.codecs, setup.layout.shards, setup.pages_total * PAGE_SIZE as u64);
        let gpu = match setup.gpu {
            Some(gpu) => Some(open_gpu(gpu, &codecs, setup.layout.batch_pages as usize)?),
            None => None,
        };
        Ok(ShardEncoder {
            shard,
            layout: setup.layout,
            granularity: setup.granularity as usize,
            zero_records: codecs.zero,
            subpage: (setup.granularity < PAGE_SIZE as u32).then(|| {
                SubpageTracker::new(
                    setup.detector,
                    setup.granularity,
                    setup.layout.pages_per_shard(setup.pages_total),
                    setup.hash_mask,
                )
            }),
            compressor: codecs.batch.map(BatchCompressor::new),
            encoder: PageEncoder::new(&codecs),
            payoff: Payoff::default(),
            builder: PagesBuilder::new(RECORDS_PER_FRAME),
            codec_buf: Vec::with_capacity(2 * PAGE_SIZE),
            subpage_buf: Vec::with_capacity(8 + PAGE_SIZE),
            packed: Vec::new(),
            compressed_frame: Vec::new(),
            bandwidth: setup.bandwidth.clone(),
            bandwidth_seen: 0,
            gpu,
            gpu_pages: Vec::new(),
            records: 0,
            zero_pages: 0,
        })
    }

    /// Encodes a batch into complete frames appended to `out`; returns the
    /// records written.
    pub fn encode(&mut self, batch: &Batch, out: &mut Vec<u8>) -> Result<u64, GpuError> {
        if batch.by_reference {
            return Ok(self.encode_by_reference(batch, out));
        }
        if self.gpu.is_some() && !batch.repair {
            return self.encode_on_gpu(batch, out);
        }
        let bw = self.bandwidth.load(Ordering::Relaxed);
        if bw != self.bandwidth_seen {
            self.bandwidth_seen = bw;
            self.encoder.set_bandwidth(f64::from_bits(bw));
        }
        let mut records = 0;
        self.builder.reset(batch.iteration, self.shard);
        for (i, &index) in batch.indices.iter().enumerate() {
            let page = batch.page(i);
            let local = self.layout.local_index(index);
            if batch.repair {
                if let Some(tracker) = &mut self.subpage {
                    tracker.set(local, page);
                }
                self.encoder.observe_raw(index, page);
                self.builder.push(index, Encoding::Raw, page);
            } else {
                let change = if !batch.populated[i] && self.zero_records {
                    match &mut self.subpage {
                        Some(tracker) => tracker.diff_zero(local),
                        None => Change::Zero,
                    }
                } else {
                    match &mut self.subpage {
                        Some(tracker) => tracker.diff(local, page),
                        None => Change::Full,
                    }
                };
                match change {
                    Change::Unchanged => continue,
                    Change::Zero => {
                        self.builder.push(index, Encoding::Zero, &[]);
                        self.encoder.observe_zero(index);
                        // Found zero by fetch (in place, or never backed):
                        // the zero codec's work all the same.
                        self.encoder.count_record(tsubame_codec::TAG_ZERO, 0);
                        self.zero_pages += 1;
                    }
                    Change::Full => match self.encoder.encode(index, page, &mut self.codec_buf) {
                        Encoded::Zero => {
                            self.builder.push(index, Encoding::Zero, &[]);
                            self.zero_pages += 1;
                        }
                        Encoded::Raw => self.builder.push(index, Encoding::Raw, page),
                        Encoded::Record(tag) => {
                            self.builder.push(index, Encoding::from_codec_tag(tag), &self.codec_buf)
                        }
                    },
                    Change::Partial(mask) => {
                        encode_partial(page, self.granularity, mask, &mut self.subpage_buf);
                        self.builder.push(index, Encoding::Subpage, &self.subpage_buf);
                    }
                }
            }
            records += 1;
            if self.builder.len() as usize == RECORDS_PER_FRAME {
                self.flush_frame(batch.repair, out);
                self.builder.reset(batch.iteration, self.shard);
            }
        }
        if !self.builder.is_empty() {
            self.flush_frame(batch.repair, out);
        }
        self.records += records;
        Ok(records)
    }

    /// `--gpu`: the whole batch's records come from the GPU, byte for byte
    /// what the CPU codecs would make (the destination decodes them on its
    /// CPU). Pages the kernel never backed were not read: they are zeroed
    /// here so the GPU sees what the guest would.
    fn encode_on_gpu(&mut self, batch: &Batch, out: &mut Vec<u8>) -> Result<u64, GpuError> {
        let mut pages = &batch.pages[..batch.len() * PAGE_SIZE];
        if batch.populated.contains(&false) {
            self.gpu_pages.clear();
            self.gpu_pages.extend_from_slice(pages);
            for (i, _) in batch.populated.iter().enumerate().filter(|(_, &populated)| !populated) {
                self.gpu_pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE].fill(0);
            }
            pages = &self.gpu_pages;
        }
        let gpu = self.gpu.as_mut().expect("called with a GPU");
        let records = gpu.encode_batch(pages, &batch.indices)?;
        self.builder.reset(batch.iteration, self.shard);
        for i in 0..records.len() {
            let (index, tag, bytes) = records.record(i);
            self.encoder.count_record(tag, bytes.len());
            let encoding = match tag {
                tsubame_codec::TAG_RAW => Encoding::Raw,
                tsubame_codec::TAG_ZERO => {
                    self.zero_pages += 1;
                    Encoding::Zero
                }
                tag => Encoding::from_codec_tag(tag),
            };
            self.builder.push(index, encoding, bytes);
            if self.builder.len() as usize == RECORDS_PER_FRAME {
                self.flush_frame(false, out);
                self.builder.reset(batch.iteration, self.shard);
            }
        }
        if !self.builder.is_empty() {
            self.flush_frame(false, out);
        }
        let records = records.len() as u64;
        self.records += records;
        Ok(records)
    }

    /// `--zero-copy`: appends, per frame, its header, the PAGES header and
    /// the record headers, without the pages, which [`ZeroCopySender`]
    /// splices in from guest memory. Pages fetch found zero (never backed,
    /// or all zeros in place) are zero records; every other page goes raw.
    fn encode_by_reference(&mut self, batch: &Batch, out: &mut Vec<u8>) -> u64 {
        for (frame, indices) in batch.indices.chunks(RECORDS_PER_FRAME).enumerate() {
            self.builder.reset(batch.iteration, self.shard);
            let mut payload_len = PAGES_HEADER;
            for (i, &index) in indices.iter().enumerate() {
                if self.zero_records && !batch.populated[frame * RECORDS_PER_FRAME + i] {
                    self.builder.push_header(index, Encoding::Zero, 0);
                    self.zero_pages += 1;
                    payload_len += RECORD_HEADER;
                } else {
                    self.builder.push_header(index, Encoding::Raw, PAGE_SIZE);
                    payload_len += RECORD_HEADER + PAGE_SIZE;
                }
            }
            let headers = self.builder.payload();
            out.extend_from_slice(&wire::zero_copy_frame_header(payload_len, headers));
            out.extend_from_slice(headers);
        }
        let records = batch.len() as u64;
        self.records += records;
        records
    }

    /// Appends the builder's PAGES payload as a frame, compressed with
    /// lz4/zstd when the stream uses one, it shrinks the batch, and it pays
    /// at this bandwidth. Repair frames stay plain: they are rare.
    fn flush_frame(&mut self, repair: bool, out: &mut Vec<u8>) {
        let payload = self.builder.payload();
        if let (Some(compressor), false) = (&mut self.compressor, repair) {
            if self.payoff.enabled() {
                let start = Instant::now();
                let codec = compressor.codec();
                compressor.compress(payload, &mut self.packed);
                let frame = &mut self.compressed_frame;
                frame.clear();
                frame.extend_from_slice(&self.shard.to_le_bytes());
                frame.push(codec.id());
                frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
                frame.extend_from_slice(&self.packed);
                let bandwidth = f64::from_bits(self.bandwidth_seen);
                let bandwidth = if bandwidth > 0.0 { bandwidth } else { f64::INFINITY };
                self.payoff.record(
                    start.elapsed().as_secs_f64(),
                    payload.len(),
                    frame.len().min(payload.len()),
                    bandwidth,
                );
                if frame.len() < payload.len() {
                    self.encoder.count_batch(codec.name(), payload.len(), frame.len());
                    wire::write_frame(out, FrameKind::PagesCompressed, frame).expect("Vec writes");
                    return;
                }
            }
        }
        wire::write_frame(out, FrameKind::Pages, payload).expect("Vec writes");
    }

    /// Per-codec counters.
    pub fn codec_stats(&self) -> &StatsTable {
        &self.encoder.stats
    }

    /// Sub-page counters, when tracking sub-pages.
    pub fn subpage_stats(&self) -> Option<&SubpageStats> {
        self.subpage.as_ref().map(|t| &t.stats)
    }
}

/// Busy and waiting time of one stage, summed over its threads.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageStats {
    /// fetch, encode, send.
    pub name: String,
    /// Threads running the stage.
    pub threads: u32,
    /// Seconds doing the stage's work.
    pub busy_seconds: f64,
    /// Seconds waiting for input (an empty queue).
    pub wait_input_seconds: f64,
    /// Seconds waiting for room downstream (a full queue, no free buffer).
    pub wait_output_seconds: f64,
    /// Items (batches or frames) handled.
    pub items: u64,
    /// Mean depth of the stage's output queue, sampled at each push.
    pub mean_queue_depth: f64,
    /// Deepest the output queue got.
    pub max_queue_depth: u64,
    /// CPU-seconds of the stage's threads (user + system).
    pub cpu_seconds: f64,
}

impl StageStats {
    fn named(name: &str) -> StageStats {
        StageStats { name: name.into(), threads: 1, ..Default::default() }
    }

    fn sample_queue(&mut self, depth: usize, samples: &mut u64) {
        *samples += 1;
        self.mean_queue_depth += (depth as f64 - self.mean_queue_depth) / *samples as f64;
        self.max_queue_depth = self.max_queue_depth.max(depth as u64);
    }

    fn merge(&mut self, other: &StageStats) {
        let items = (self.items + other.items).max(1) as f64;
        self.mean_queue_depth =
            (self.mean_queue_depth * self.items as f64 + other.mean_queue_depth * other.items as f64) / items;
        self.threads += other.threads;
        self.busy_seconds += other.busy_seconds;
        self.wait_input_seconds += other.wait_input_seconds;
        self.wait_output_seconds += other.wait_output_seconds;
        self.items += other.items;
        self.max_queue_depth = self.max_queue_depth.max(other.max_queue_depth);
        self.cpu_seconds += other.cpu_seconds;
    }
}

/// The `pipeline` field of the statistics.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PipelineStats {
    /// "pipelined" or "sequential" (`--no-pipeline`).
    pub mode: String,
    /// Connections.
    pub channels: u16,
    /// Codec shards (= encode threads when pipelined).
    pub shards: u16,
    /// Pages per batch.
    pub batch_pages: u64,
    /// Buffers per stage.
    pub buffers: usize,
    /// fetch, encode, send.
    pub stages: Vec<StageStats>,
    /// `--zero-copy` sends and their completions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_copy: Option<ZeroCopyStats>,
}

/// What went wrong inside the pipeline.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Writing to a channel failed.
    #[error("channel {channel}: connection lost while writing")]
    Write {
        /// Which channel.
        channel: u16,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The GPU failed to encode a batch.
    #[error("GPU encoding failed")]
    Gpu(#[from] GpuError),
    /// A stage thread is gone (it failed first: see the other error).
    #[error("a pipeline stage stopped")]
    Stopped,
}

/// Busy nanoseconds per stage, updated as the threads work: what the
/// progress bar shows while the final statistics are still in the threads.
#[derive(Default)]
struct LiveBusy {
    fetch: AtomicU64,
    encode: AtomicU64,
    send: AtomicU64,
    since: Mutex<Option<Instant>>,
}

fn add_busy(counter: &AtomicU64, d: Duration) {
    counter.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

enum ToEncoder {
    Batch(Batch),
    End(u32),
}

enum ToSender {
    Frames(Vec<u8>),
    /// Frame and record headers whose pages come from guest memory.
    ZeroCopy(Vec<u8>),
    End {
        iteration: u32,
        records: u64,
    },
}

/// The stages and their threads (or, sequential, their state in turn).
pub struct Engine {
    layout: ShardLayout,
    pacer: Arc<Pacer>,
    live: Arc<LiveBusy>,
    threads: (u32, u32),
    writers: Vec<Arc<Mutex<Writer>>>,
    guest: Option<GuestPages>,
    fetch: StageStats,
    fetch_samples: u64,
    mode: Mode,
}

enum Mode {
    Sequential {
        encoders: Vec<ShardEncoder>,
        batch: Option<Batch>,
        out: Vec<u8>,
        encode: Box<StageStats>,
        send: Box<StageStats>,
        records: Vec<u64>,
        zero_copy: Vec<ZeroCopySender>,
    },
    Threads {
        to_encoders: Vec<Sender<ToEncoder>>,
        free_batches: Receiver<Batch>,
        done: Receiver<Result<u64, PipelineError>>,
        encoders: Vec<std::thread::JoinHandle<(ShardEncoder, StageStats)>>,
        senders: Vec<std::thread::JoinHandle<(StageStats, ZeroCopyStats)>>,
    },
}

/// Knobs of the engine.
pub struct EngineSetup {
    /// Threads and queues, or everything in turn on the caller's thread.
    pub pipelined: bool,
    /// Buffers per stage (queue depth).
    pub buffers: usize,
    /// `--zero-copy`: guest memory, where the senders take raw pages from.
    pub guest: Option<GuestPages>,
}

impl Engine {
    /// Starts the stages over `writers` (one per channel).
    pub fn start(
        setup: &EngineSetup,
        encoder: &EncoderSetup,
        writers: Vec<Writer>,
        pacer: Arc<Pacer>,
    ) -> Result<Engine, PipelineError> {
        let layout = encoder.layout;
        let batch_pages = layout.batch_pages as usize;
        let writers: Vec<_> = writers.into_iter().map(|w| Arc::new(Mutex::new(w))).collect();
        let encoders = (0..layout.shards).map(|s| ShardEncoder::new(s, encoder)).collect::<Result<Vec<_>, _>>()?;
        let live = Arc::new(LiveBusy { since: Mutex::new(Some(Instant::now())), ..Default::default() });
        let threads = if setup.pipelined { (layout.shards as u32, layout.channels as u32) } else { (1, 1) };
        let mode = if !setup.pipelined {
            Mode::Sequential {
                encoders,
                batch: Some(Batch::with_capacity(batch_pages)),
                out: Vec::with_capacity(batch_pages * (PAGE_SIZE + 64)),
                encode: Box::new(StageStats::named("encode")),
                send: Box::new(StageStats::named("send")),
                records: vec![0; layout.channels as usize],
                zero_copy: (0..layout.channels).map(|_| ZeroCopySender::default()).collect(),
            }
        } else {
            let buffers = setup.buffers.max(1);
            let shards = layout.shards as usize;
            // Each encoder may hold one batch while `buffers` wait in its queue.
            let (free_tx, free_rx) = bounded(shards * (buffers + 1) + 1);
            for _ in 0..shards * (buffers + 1) + 1 {
                free_tx.send(Batch::with_capacity(batch_pages)).expect("pool has room");
            }
            let (done_tx, done_rx) = bounded(4 * (shards + layout.channels as usize));
            let mut to_senders = Vec::new();
            let mut senders = Vec::new();
            let mut out_pools = Vec::new();
            for (channel, writer) in writers.iter().enumerate() {
                let channel = channel as u16;
                let carried = layout.shards_of(channel).count();
                let (tx, rx) = bounded::<ToSender>(buffers * carried + carried);
                let (pool_tx, pool_rx) = bounded::<Vec<u8>>(buffers * carried + 2 * carried);
                for _ in 0..buffers * carried + 2 * carried {
                    pool_tx.send(Vec::with_capacity(batch_pages * (PAGE_SIZE + 64))).expect("pool has room");
                }
                let sender = SendLoop {
                    channel,
                    shards: carried,
                    writer: writer.clone(),
                    input: rx,
                    pool: pool_tx,
                    done: done_tx.clone(),
                    live: live.clone(),
                    pacer: pacer.clone(),
                    guest: setup.guest,
                };
                senders.push(
                    std::thread::Builder::new()
                        .name(format!("send-{channel}"))
                        .spawn(move || sender.run())
                        .expect("spawn sender"),
                );
                to_senders.push(tx);
                out_pools.push(pool_rx);
            }
            let mut to_encoders = Vec::new();
            let mut handles = Vec::new();
            for encoder in encoders {
                let channel = layout.channel(encoder.shard) as usize;
                let (tx, rx) = bounded::<ToEncoder>(buffers);
                let ctx = EncodeLoop {
                    input: rx,
                    free_batches: free_tx.clone(),
                    output: to_senders[channel].clone(),
                    out_pool: out_pools[channel].clone(),
                    done: done_tx.clone(),
                    live: live.clone(),
                };
                handles.push(
                    std::thread::Builder::new()
                        .name(format!("encode-{}", encoder.shard))
                        .spawn(move || ctx.run(encoder))
                        .expect("spawn encoder"),
                );
                to_encoders.push(tx);
            }
            Mode::Threads { to_encoders, free_batches: free_rx, done: done_rx, encoders: handles, senders }
        };
        Ok(Engine {
            layout,
            pacer,
            live,
            threads,
            writers,
            guest: setup.guest,
            fetch: StageStats::named("fetch"),
            fetch_samples: 0,
            mode,
        })
    }

    /// The layout of shards and channels.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// A free batch to fill (waits while every buffer is in flight).
    pub fn take_batch(&mut self) -> Result<Batch, PipelineError> {
        match &mut self.mode {
            Mode::Sequential { batch, .. } => Ok(batch.take().expect("one batch in flight at a time")),
            Mode::Threads { free_batches, .. } => {
                let start = Instant::now();
                let batch = free_batches.recv();
                self.fetch.wait_output_seconds += start.elapsed().as_secs_f64();
                batch.map_err(|_| self.stopped())
            }
        }
    }

    /// A stage thread is gone: the error that stopped it (a write that
    /// failed, say), which waits in `done` behind the stages that merely
    /// stopped after it.
    fn stopped(&self) -> PipelineError {
        if let Mode::Threads { done, .. } = &self.mode {
            let deadline = Instant::now() + Duration::from_secs(2);
            while let Ok(result) = done.recv_deadline(deadline) {
                if let Err(e @ (PipelineError::Write { .. } | PipelineError::Gpu(_))) = result {
                    return e;
                }
            }
        }
        PipelineError::Stopped
    }

    /// Counts fetch work (timed by the caller).
    pub fn fetched(&mut self, busy: Duration) {
        self.fetch.busy_seconds += busy.as_secs_f64();
        self.fetch.items += 1;
        add_busy(&self.live.fetch, busy);
    }

    /// Each stage's busy share of its threads so far, e.g.
    /// "fetch 12% encode 85%×3 send 40%".
    pub fn summary(&self) -> String {
        let wall = self.live.since.lock().unwrap().map_or(0.0, |t| t.elapsed().as_secs_f64()).max(1e-9);
        let share =
            |c: &AtomicU64, threads: u32| 100.0 * c.load(Ordering::Relaxed) as f64 / 1e9 / wall / threads as f64;
        let (encoders, senders) = self.threads;
        format!(
            "fetch {:.0}% encode {:.0}%×{encoders} send {:.0}%×{senders}",
            share(&self.live.fetch, 1),
            share(&self.live.encode, encoders),
            share(&self.live.send, senders)
        )
    }

    /// Hands a filled batch to its shard's encoder.
    pub fn submit(&mut self, batch: Batch) -> Result<(), PipelineError> {
        let layout = self.layout;
        match &mut self.mode {
            Mode::Sequential { encoders, batch: slot, out, encode, send, records, zero_copy } => {
                let start = Instant::now();
                out.clear();
                let shard = batch.shard;
                let by_reference = batch.by_reference;
                let encoded = encoders[shard as usize].encode(&batch, out);
                encode.busy_seconds += start.elapsed().as_secs_f64();
                add_busy(&self.live.encode, start.elapsed());
                encode.items += 1;
                *slot = Some(batch);
                records[layout.channel(shard) as usize] += encoded?;
                let start = Instant::now();
                let channel = layout.channel(shard);
                let mut writer = self.writers[channel as usize].lock().unwrap();
                let sent = match (by_reference, &self.guest) {
                    // One buffer in turn: wait until the kernel is done with it.
                    (true, Some(guest)) => {
                        let sender = &mut zero_copy[channel as usize];
                        send_by_reference(&mut writer, sender, std::mem::take(out), guest, &self.pacer, 0).map(
                            |mut released| {
                                *out = released.pop().unwrap_or_default();
                            },
                        )
                    }
                    _ => writer.write_all(out),
                };
                sent.map_err(|source| PipelineError::Write { channel, source })?;
                send.busy_seconds += start.elapsed().as_secs_f64();
                add_busy(&self.live.send, start.elapsed());
                send.items += 1;
                Ok(())
            }
            Mode::Threads { to_encoders, .. } => {
                let queue = &to_encoders[batch.shard as usize];
                self.fetch.sample_queue(queue.len(), &mut self.fetch_samples);
                let start = Instant::now();
                let sent = queue.send(ToEncoder::Batch(batch));
                self.fetch.wait_output_seconds += start.elapsed().as_secs_f64();
                sent.map_err(|_| self.stopped())
            }
        }
    }

    /// Ends `iteration` on every channel (ITERATION_END after all its
    /// pages), waits until every channel has written and flushed it, and
    /// returns the records the iteration sent.
    pub fn end_iteration(&mut self, iteration: u32) -> Result<u64, PipelineError> {
        let mut total = 0;
        match &mut self.mode {
            Mode::Sequential { records, send, .. } => {
                let start = Instant::now();
                for (channel, writer) in self.writers.iter().enumerate() {
                    let mut w = writer.lock().unwrap();
                    write_iteration_end(&mut *w, iteration, records[channel])
                        .map_err(|source| PipelineError::Write { channel: channel as u16, source })?;
                    total += records[channel];
                    records[channel] = 0;
                }
                send.busy_seconds += start.elapsed().as_secs_f64();
            }
            Mode::Threads { to_encoders, done, .. } => {
                let mut ended = to_encoders.iter().all(|queue| queue.send(ToEncoder::End(iteration)).is_ok());
                for _ in 0..self.layout.channels {
                    match done.recv() {
                        Ok(Ok(records)) if ended => total += records,
                        Ok(Err(e @ (PipelineError::Write { .. } | PipelineError::Gpu(_)))) => return Err(e),
                        _ => ended = false,
                    }
                    if !ended {
                        break;
                    }
                }
                if !ended {
                    return Err(self.stopped());
                }
            }
        }
        Ok(total)
    }

    /// Channel `c`'s writer, for control frames between iterations (the
    /// pipeline is idle then).
    pub fn writer(&self, channel: u16) -> std::sync::MutexGuard<'_, Writer> {
        self.writers[channel as usize].lock().unwrap()
    }

    /// Bytes written so far on every channel.
    pub fn bytes(&self) -> u64 {
        self.pacer.bytes()
    }

    /// Stops the threads; returns the encoders (for their counters) and
    /// the per-stage statistics.
    pub fn finish(self, options: &EngineSetup) -> (Vec<ShardEncoder>, PipelineStats) {
        let mut fetch = self.fetch;
        fetch.cpu_seconds = 0.0; // the migration thread's CPU is reported on its own
        let mut zero_copy_total = ZeroCopyStats::default();
        let (encoders, mut encode, mut send, mode) = match self.mode {
            Mode::Sequential { encoders, encode, send, zero_copy, .. } => {
                for sender in &zero_copy {
                    zero_copy_total.add(&sender.stats);
                }
                (encoders, *encode, *send, "sequential")
            }
            Mode::Threads { to_encoders, encoders, senders, .. } => {
                drop(to_encoders);
                let mut encode = StageStats { threads: 0, ..StageStats::named("encode") };
                let mut send = StageStats { threads: 0, ..StageStats::named("send") };
                let mut shard_encoders = Vec::new();
                for handle in encoders {
                    if let Ok((encoder, stats)) = handle.join() {
                        encode.merge(&stats);
                        shard_encoders.push(encoder);
                    }
                }
                for handle in senders {
                    if let Ok((stats, zero_copy)) = handle.join() {
                        send.merge(&stats);
                        zero_copy_total.add(&zero_copy);
                    }
                }
                (shard_encoders, encode, send, "pipelined")
            }
        };
        encode.name = "encode".into();
        send.name = "send".into();
        let stats = PipelineStats {
            mode: mode.into(),
            channels: self.layout.channels,
            shards: self.layout.shards,
            batch_pages: self.layout.batch_pages,
            buffers: options.buffers,
            stages: vec![fetch, encode, send],
            zero_copy: self.guest.is_some().then_some(zero_copy_total),
        };
        (encoders, stats)
    }
}

fn write_iteration_end(w: &mut impl Write, iteration: u32, records: u64) -> std::io::Result<()> {
    let mut end = [0u8; 12];
    end[..4].copy_from_slice(&iteration.to_le_bytes());
    end[4..].copy_from_slice(&records.to_le_bytes());
    wire::write_frame(w, FrameKind::IterationEnd, &end)?;
    w.flush()
}

struct EncodeLoop {
    input: Receiver<ToEncoder>,
    free_batches: Sender<Batch>,
    output: Sender<ToSender>,
    out_pool: Receiver<Vec<u8>>,
    done: Sender<Result<u64, PipelineError>>,
    live: Arc<LiveBusy>,
}

impl EncodeLoop {
    fn run(self, mut encoder: ShardEncoder) -> (ShardEncoder, StageStats) {
        let cpu = thread_cpu_seconds();
        let mut stats = StageStats::named("encode");
        let mut samples = 0;
        let mut records = 0u64;
        loop {
            let start = Instant::now();
            let Ok(item) = self.input.recv() else { break };
            stats.wait_input_seconds += start.elapsed().as_secs_f64();
            match item {
                ToEncoder::Batch(batch) => {
                    let start = Instant::now();
                    let Ok(mut out) = self.out_pool.recv() else {
                        let _ = self.done.send(Err(PipelineError::Stopped));
                        break;
                    };
                    stats.wait_output_seconds += start.elapsed().as_secs_f64();
                    let start = Instant::now();
                    out.clear();
                    let encoded = encoder.encode(&batch, &mut out);
                    stats.busy_seconds += start.elapsed().as_secs_f64();
                    add_busy(&self.live.encode, start.elapsed());
                    stats.items += 1;
                    let item = if batch.by_reference { ToSender::ZeroCopy(out) } else { ToSender::Frames(out) };
                    let _ = self.free_batches.send(batch);
                    match encoded {
                        Ok(n) => records += n,
                        Err(e) => {
                            let _ = self.done.send(Err(e.into()));
                            break;
                        }
                    }
                    stats.sample_queue(self.output.len(), &mut samples);
                    let start = Instant::now();
                    if self.output.send(item).is_err() {
                        let _ = self.done.send(Err(PipelineError::Stopped));
                        break;
                    }
                    stats.wait_output_seconds += start.elapsed().as_secs_f64();
                }
                ToEncoder::End(iteration) => {
                    if self.output.send(ToSender::End { iteration, records }).is_err() {
                        let _ = self.done.send(Err(PipelineError::Stopped));
                        break;
                    }
                    records = 0;
                }
            }
        }
        stats.cpu_seconds = thread_cpu_seconds() - cpu;
        (encoder, stats)
    }
}

/// A channel's sender thread: writes what the encoders made, in order.
struct SendLoop {
    channel: u16,
    /// Shards this channel carries: ITERATION_END waits for each.
    shards: usize,
    writer: Arc<Mutex<Writer>>,
    input: Receiver<ToSender>,
    pool: Sender<Vec<u8>>,
    done: Sender<Result<u64, PipelineError>>,
    live: Arc<LiveBusy>,
    pacer: Arc<Pacer>,
    guest: Option<GuestPages>,
}

impl SendLoop {
    fn run(self) -> (StageStats, ZeroCopyStats) {
        let cpu = thread_cpu_seconds();
        let mut stats = StageStats::named("send");
        let mut zero_copy = ZeroCopySender::default();
        let mut ends = 0;
        let mut records = 0u64;
        loop {
            let start = Instant::now();
            let Ok(item) = self.input.recv() else { break };
            stats.wait_input_seconds += start.elapsed().as_secs_f64();
            let start = Instant::now();
            let result = match item {
                ToSender::Frames(bytes) => {
                    let r = self.writer.lock().unwrap().write_all(&bytes);
                    let _ = self.pool.send(bytes);
                    stats.items += 1;
                    r
                }
                ToSender::ZeroCopy(headers) => {
                    let guest = self.guest.as_ref().expect("zero-copy batches come with guest memory");
                    let mut writer = self.writer.lock().unwrap();
                    // Hold one buffer in the kernel at most, so the encoders
                    // never run out while we wait for completions.
                    stats.items += 1;
                    send_by_reference(&mut writer, &mut zero_copy, headers, guest, &self.pacer, 1).map(|released| {
                        for buffer in released {
                            let _ = self.pool.send(buffer);
                        }
                    })
                }
                ToSender::End { iteration, records: shard_records } => {
                    ends += 1;
                    records += shard_records;
                    if ends < self.shards {
                        Ok(())
                    } else {
                        ends = 0;
                        let r = write_iteration_end(&mut *self.writer.lock().unwrap(), iteration, records);
                        if r.is_ok() {
                            let _ = self.done.send(Ok(records));
                        }
                        records = 0;
                        r
                    }
                }
            };
            stats.busy_seconds += start.elapsed().as_secs_f64();
            add_busy(&self.live.send, start.elapsed());
            if let Err(source) = result {
                let _ = self.done.send(Err(PipelineError::Write { channel: self.channel, source }));
                break;
            }
        }
        if zero_copy.stats.sends > 0 {
            if let Some(fd) = tcp_fd(&self.writer.lock().unwrap()) {
                let _ = zero_copy.settle(fd, 0, Duration::from_secs(2));
            }
        }
        stats.cpu_seconds = thread_cpu_seconds() - cpu;
        (stats, zero_copy.stats)
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

/// How long a sender waits for the kernel to finish with its buffers: as
/// long as a silent destination may take to read them.
const ZERO_COPY_PATIENCE: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_maps_every_page_once() {
        let layout = ShardLayout { batch_pages: 64, shards: 3, channels: 2 };
        let pages = 1000;
        let per_shard = layout.pages_per_shard(pages);
        let mut seen = vec![std::collections::HashSet::new(); 3];
        for page in 0..pages {
            let shard = layout.shard(page - page % 64);
            let local = layout.local_index(page);
            assert!(local < per_shard, "page {page} local {local} >= {per_shard}");
            assert!(seen[shard as usize].insert(local), "page {page} collides in shard {shard}");
        }
        assert_eq!(layout.shards_of(0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(layout.shards_of(1).collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn caches_split_across_shards() {
        let codecs: CodecList = "zero,xbzrle=64M,dedup=8M".parse().unwrap();
        let split = shard_codecs(&codecs, 4, 1 << 30);
        assert_eq!(split.xbzrle, Some(16 << 20));
        assert_eq!(split.dedup, Some(2 << 20));
        assert!(split.zero);
        // A cache larger than memory is cut to memory: a hostile HELLO
        // cannot make the destination allocate more.
        let huge: CodecList = "zero,xbzrle=38G".parse().unwrap();
        assert_eq!(shard_codecs(&huge, 2, 32 << 20).xbzrle, Some(16 << 20));
    }
}
