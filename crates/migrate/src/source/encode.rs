//! The encode stage: one [`ShardEncoder`] per codec shard turns a batch of
//! fetched pages into complete frames — zero records, codec records
//! (on the CPU or a GPU), sub-page records, raw pages, lz4/zstd packing —
//! or, with `--zero-copy`, into frame headers whose pages the send stage
//! splices in from guest memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tsubame_codec::{CodecList, Encoded, PageEncoder, StatsTable};
use tsubame_gpu::{Cuda, CudaOptions, Emulator, EncodedBatch, GpuEncoder, GpuError};
use tsubame_vmm::{DirtyBitmap, PAGE_SIZE};

use super::fetch::Batch;
use super::pack::FramePacker;
use crate::options::{GpuOffload, Granularity};
use crate::protocol::pages::{Encoding, PagesBuilder, PAGES_HEADER, RECORDS_PER_FRAME, RECORD_HEADER};
use crate::protocol::{self, shard_codecs, FrameKind, ShardLayout};
use crate::subpage::{encode_partial, saved_share, Change, Detector, SubpageStats, SubpageTracker};

/// `--granularity auto` judges sub-pages on samples of this many re-sent
/// pages (4 MiB) per shard.
const SUBPAGE_SAMPLE: u64 = 1024;
/// Sub-pages are kept while they save at least this share of the re-sent
/// pages' bytes: below it, hashing every sub-page of every dirty page
/// costs more CPU (and 1/16 of guest memory) than the bytes it saves.
pub(super) const SUBPAGES_PAY: f64 = 1.0 / 16.0;

/// One shard's encoder: codecs and caches, sub-page tables, lz4/zstd.
pub struct ShardEncoder {
    shard: u16,
    layout: ShardLayout,
    granularity: usize,
    /// With `--codec none` even untouched pages go raw: a true baseline.
    zero_records: bool,
    encoder: PageEncoder,
    subpage: Option<SubpageTracker>,
    /// With far memory and sub-pages: this shard's pages (local indices)
    /// the destination holds as their far copy, until each is first sent.
    far_unseen: Option<DirtyBitmap>,
    /// `--granularity auto`: where the current sample of re-sent pages
    /// began (pages, bytes); None when the granularity is fixed.
    sample_start: Option<(u64, u64)>,
    /// The tracker's counters once auto dropped it for whole pages.
    dropped: Option<SubpageStats>,
    packer: Option<FramePacker>,
    builder: PagesBuilder,
    codec_buf: Vec<u8>,
    subpage_buf: Vec<u8>,
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
    /// Sub-page size, and whether whole pages may replace sub-pages.
    pub granularity: Granularity,
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
    /// With far memory: the pages the destination holds as their far
    /// copy, not as zeros (global indices).
    pub far_pages: Option<&'a DirtyBitmap>,
}

/// The far pages of `shard` as local indices, where a sub-page tracker
/// would otherwise take their baseline for zeros.
fn far_unseen(shard: u16, setup: &EncoderSetup) -> Option<DirtyBitmap> {
    let far = setup.far_pages.filter(|_| !setup.granularity.whole_pages())?;
    let layout = setup.layout;
    let mut mine = DirtyBitmap::new(layout.pages_per_shard(setup.pages_total));
    for page in far.iter().filter(|&page| layout.shard(page) == shard) {
        mine.set(layout.local_index(page));
    }
    Some(mine)
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
        GpuOffload::Emulator if !tsubame_gpu::emu::available() => return Err(GpuError::NoEmulator),
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
            granularity: setup.granularity.bytes as usize,
            zero_records: codecs.zero,
            far_unseen: far_unseen(shard, setup),
            subpage: (!setup.granularity.whole_pages()).then(|| {
                SubpageTracker::new(
                    setup.detector,
                    setup.granularity.bytes,
                    setup.layout.pages_per_shard(setup.pages_total),
                    setup.hash_mask,
                )
            }),
            sample_start: setup.granularity.auto.then_some((0, 0)),
            dropped: None,
            packer: codecs.batch.map(|codec| match setup.gpu {
                Some(GpuOffload::Cuda(_)) => FramePacker::with_gpu(codec),
                _ => FramePacker::new(codec),
            }),
            encoder: PageEncoder::new(&codecs),
            builder: PagesBuilder::new(RECORDS_PER_FRAME),
            codec_buf: Vec::with_capacity(2 * PAGE_SIZE),
            subpage_buf: Vec::with_capacity(8 + PAGE_SIZE),
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
            let unseen = self.far_unseen.as_mut().is_some_and(|far| {
                let unseen = far.get(local);
                far.unset(local);
                unseen
            });
            if batch.repair {
                if let Some(tracker) = &mut self.subpage {
                    tracker.set(local, page);
                }
                self.encoder.observe_raw(index, page);
                self.builder.push(index, Encoding::Raw, page);
            } else {
                let zero = !batch.populated[i] && self.zero_records;
                let change = if let (true, Some(tracker)) = (unseen, &mut self.subpage) {
                    // A far page that came back: the destination holds its
                    // far copy, which the tracker never saw (it would diff
                    // against zeros), so it goes whole once.
                    if zero || tsubame_codec::zero::is_zero(page) {
                        tracker.set(local, &[0u8; PAGE_SIZE]);
                        Change::Zero
                    } else {
                        tracker.set(local, page);
                        Change::Full
                    }
                } else if zero {
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
                        // The destination now holds this page: XBZRLE's
                        // next delta of it is against these bytes.
                        self.encoder.observe_raw(index, page);
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
        self.judge_subpages(batch.iteration);
        Ok(records)
    }

    /// `--granularity auto`: after each sample of re-sent pages, drops the
    /// sub-page tracker (its hashing and its table) for whole pages when
    /// sub-pages saved too little of those pages' bytes. A guest that
    /// rewrites whole pages (fill-random, bwmem) saves nothing.
    fn judge_subpages(&mut self, iteration: u32) {
        let (Some(start), Some(tracker)) = (self.sample_start, &self.subpage) else { return };
        let (pages, bytes) = (tracker.stats.resent_pages - start.0, tracker.stats.resent_bytes - start.1);
        if pages < SUBPAGE_SAMPLE {
            return;
        }
        if saved_share(pages, bytes) >= SUBPAGES_PAY {
            self.sample_start = Some((tracker.stats.resent_pages, tracker.stats.resent_bytes));
            return;
        }
        let mut stats = self.subpage.take().expect("checked above").stats;
        stats.whole_pages_from = Some(iteration);
        self.dropped = Some(stats);
        self.sample_start = None;
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
            out.extend_from_slice(&protocol::zero_copy_frame_header(payload_len, headers));
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
        if let (Some(packer), false) = (&mut self.packer, repair) {
            let bandwidth = f64::from_bits(self.bandwidth_seen);
            let bandwidth = if bandwidth > 0.0 { bandwidth } else { f64::INFINITY };
            let frame = &mut self.compressed_frame;
            if packer.pack(self.shard, payload, bandwidth, frame) {
                self.encoder.count_batch(packer.codec().name(), payload.len(), frame.len());
                protocol::write_frame(out, FrameKind::PagesCompressed, frame).expect("Vec writes");
                return;
            }
        }
        protocol::write_frame(out, FrameKind::Pages, payload).expect("Vec writes");
    }

    /// With `--gpu` and a frame compressor: where frames were compressed,
    /// and why.
    pub fn frame_choice(&self) -> Option<&(String, String)> {
        self.packer.as_ref()?.gpu_choice()
    }

    /// Per-codec counters.
    pub fn codec_stats(&self) -> &StatsTable {
        &self.encoder.stats
    }

    /// Sub-page counters, when tracking sub-pages (or until auto dropped them).
    pub fn subpage_stats(&self) -> Option<&SubpageStats> {
        self.subpage.as_ref().map(|t| &t.stats).or(self.dropped.as_ref())
    }
}

/// What the encode stage hands its channel's send stage.
pub enum SendItem {
    /// Complete frames.
    Frames(Vec<u8>),
    /// Frame and record headers whose pages come from guest memory.
    ZeroCopy(Vec<u8>),
    /// The shard ended an iteration after sending this many records.
    End {
        /// The iteration.
        iteration: u32,
        /// Records the shard sent in it.
        records: u64,
    },
}

/// One shard's encode stage: its encoder, and the records of the
/// iteration in progress.
pub struct EncodeStage {
    /// The shard's encoder (its counters are read at the end).
    pub encoder: ShardEncoder,
    records: u64,
}

impl EncodeStage {
    /// The stage around `encoder`.
    pub fn new(encoder: ShardEncoder) -> EncodeStage {
        EncodeStage { encoder, records: 0 }
    }

    /// The shard this stage encodes.
    pub fn shard(&self) -> u16 {
        self.encoder.shard
    }

    /// Encodes `batch` into `out` (cleared first).
    pub fn batch(&mut self, batch: &Batch, mut out: Vec<u8>) -> Result<SendItem, GpuError> {
        out.clear();
        self.records += self.encoder.encode(batch, &mut out)?;
        Ok(if batch.by_reference { SendItem::ZeroCopy(out) } else { SendItem::Frames(out) })
    }

    /// Ends `iteration` for this shard.
    pub fn end(&mut self, iteration: u32) -> SendItem {
        SendItem::End { iteration, records: std::mem::take(&mut self.records) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::pages::for_each_record;

    /// Encodes `batch` and returns each record's page and encoding.
    fn records(encoder: &mut ShardEncoder, batch: &Batch) -> Vec<(u64, Encoding)> {
        let mut out = Vec::new();
        encoder.encode(batch, &mut out).unwrap();
        let mut reader = &out[..];
        let (mut frame, mut found) = (Vec::new(), Vec::new());
        while !reader.is_empty() {
            assert_eq!(protocol::read_frame(&mut reader, &mut frame).unwrap(), FrameKind::Pages);
            for_each_record(&frame, 64, 128, |r| {
                found.push((r.page_index, r.encoding));
                Ok(())
            })
            .unwrap();
        }
        found
    }

    fn batch(pages: &[(u64, Option<&[u8; PAGE_SIZE]>)]) -> Batch {
        let mut batch = Batch::with_capacity(pages.len());
        batch.clear(1, 0, false);
        for &(index, page) in pages {
            if let Some(page) = page {
                batch.next_slot().copy_from_slice(page);
            }
            batch.push(index, page.is_some());
        }
        batch
    }

    #[test]
    fn a_far_page_that_came_back_goes_whole_once_then_as_sub_pages() {
        let codecs: CodecList = "zero".parse().unwrap();
        let mut far = DirtyBitmap::new(64);
        far.set(3);
        far.set(4);
        let setup = EncoderSetup {
            codecs: &codecs,
            granularity: Granularity { bytes: 128, auto: false },
            detector: Detector::Shadow,
            hash_mask: u64::MAX,
            pages_total: 64,
            layout: ShardLayout { batch_pages: 64, shards: 1, channels: 1 },
            bandwidth: Arc::new(AtomicU64::new(0)),
            gpu: None,
            far_pages: Some(&far),
        };
        let mut encoder = ShardEncoder::new(0, &setup).unwrap();
        let mut written = [0u8; PAGE_SIZE];
        written[10] = 7;
        // The destination holds 3 and 4 as their far copies: cleared, 3
        // needs a zero record; 4 with one byte written goes whole. Page 5
        // is not far: the destination holds zeros there already.
        let first = records(&mut encoder, &batch(&[(3, None), (4, Some(&written)), (5, None)]));
        assert_eq!(first, [(3, Encoding::Zero), (4, Encoding::Raw)]);
        // From then on the tracker knows what the destination holds.
        written[200] = 9;
        let again = records(&mut encoder, &batch(&[(3, None), (4, Some(&written))]));
        assert_eq!(again, [(4, Encoding::Subpage)]);
    }
}
