//! Applying pages: each shard's decoder ([`ShardWorker`]) unpacks and
//! decodes its frames in order and writes the pages into guest memory.

use std::num::NonZeroUsize;
use std::sync::Arc;

use crossbeam_channel::Receiver;
use tsubame_codec::batch::BatchDecompressor;
use tsubame_codec::PageDecoder;
use tsubame_vmm::memory::{self, GuestMemory};
use tsubame_vmm::PAGE_SIZE;
use vm_memory::bitmap::AtomicBitmap;

use super::dispatch::{ShardWork, Shared};
use super::error::ReceiveError;
use crate::buffer_budget::recycle;
use crate::digest::{page_hash, zero_page_hash, DigestFeed};
use crate::protocol::pages::{for_each_record, for_each_subpage, shard_of, CompressedHeader, Encoding, MAX_UNPACKED};
use crate::protocol::{FrameKind, WireError};

/// Consecutive pages of one frame, none written before, that are backed
/// in one call before they are written. Writing into fresh memory page by
/// page took a page fault each, 73 % of a 2 GiB kv migration's decoder
/// samples on this PVM host; backed in runs, its CPU time fell by a tenth.
/// A huge page per dense 2 MiB instead made
/// the same migration 3× slower: zeroing fresh huge pages is slow here.
const RUN_PAGES: u64 = 8;

/// Pages ever written by an arriving migration: a zero record for an
/// untouched page writes nothing, so fresh memory stays unbacked.
pub(super) struct PageMarks {
    touched: AtomicBitmap,
}

impl PageMarks {
    pub(super) fn new(pages: u64) -> PageMarks {
        let page_size = NonZeroUsize::new(PAGE_SIZE).expect("a page is bytes");
        PageMarks { touched: AtomicBitmap::new(pages as usize * PAGE_SIZE, page_size) }
    }

    pub(super) fn touch(&self, index: u64) {
        self.touched.set_bit(index as usize);
    }

    fn touched(&self, index: u64) -> bool {
        self.touched.is_bit_set(index as usize)
    }

    /// Before a frame's pages are written: backs each run of at least
    /// [`RUN_PAGES`] consecutive pages never written before in one call.
    fn back_runs(&self, frame: &[u8], mem: &GuestMemory, granularity: usize) -> Result<(), WireError> {
        let back = |(first, pages): (u64, u64)| {
            if pages >= RUN_PAGES {
                memory::populate(mem, first, pages);
            }
        };
        let mut run: Option<(u64, u64)> = None;
        for_each_record(frame, memory::page_count(mem), granularity, |record| {
            let index = record.page_index;
            if record.encoding == Encoding::Zero || self.touched(index) {
                return Ok(());
            }
            match &mut run {
                Some((first, pages)) if *first + *pages == index => *pages += 1,
                _ => {
                    if let Some(done) = run.replace((index, 1)) {
                        back(done);
                    }
                }
            }
            Ok(())
        })?;
        if let Some(done) = run {
            back(done);
        }
        Ok(())
    }
}

/// Decompresses a PAGES_COMPRESSED payload into `out`, never past the
/// frame size limit. The decompressor keeps its context: creating a zstd
/// context per batch cost ~1 ms each.
fn unpack(frame: &[u8], decompressor: &mut BatchDecompressor, out: &mut Vec<u8>) -> Result<(), ReceiveError> {
    let (header, packed) = CompressedHeader::parse(frame)?;
    decompressor
        .decompress(header.compressor, packed, header.unpacked_len as usize, MAX_UNPACKED, out)
        .map_err(|e| WireError::bad("pages_compressed", e.to_string()))?;
    if shard_of(FrameKind::Pages, out)? != header.shard {
        return Err(WireError::bad("pages.shard", "differs from its PAGES_COMPRESSED frame").into());
    }
    Ok(())
}

/// Writes the records of a PAGES frame into guest memory and adds the
/// digest's hash of each page written to `hashes` (hashed here, in cache,
/// rather than read again by the digest: a digest thread left behind had
/// up to 5300 pages to hash inside the stop). Codec records are decoded,
/// and the codecs' caches see every page as the sender's did.
fn apply_pages(
    frame: &[u8],
    mem: &GuestMemory,
    granularity: usize,
    marks: &PageMarks,
    decoder: &mut PageDecoder,
    hashes: &mut Vec<(u64, u64)>,
) -> Result<(), ReceiveError> {
    marks.back_runs(frame, mem, granularity)?;
    let page_count = memory::page_count(mem);
    let zero_page = [0u8; PAGE_SIZE];
    let mut page = [0u8; PAGE_SIZE];
    for_each_record(frame, page_count, granularity, |record| {
        let index = record.page_index;
        let addr = index * PAGE_SIZE as u64;
        let result = match record.encoding {
            Encoding::Raw => {
                marks.touch(index);
                // Hashed and observed where it lies in the frame: a copy
                // of its own doubled the decoder's copying.
                let Ok(data) = <&[u8; PAGE_SIZE]>::try_from(record.data) else {
                    return Err(WireError::bad("pages.length", format!("{} for a raw page", record.data.len())));
                };
                decoder.observe(index, data);
                hashes.push((index, page_hash(data)));
                memory::write(mem, addr, data)
            }
            Encoding::Zero => {
                decoder.observe_zero(index);
                // An untouched page is zeros already, as the digest has it.
                if marks.touched(index) {
                    hashes.push((index, zero_page_hash()));
                    memory::write(mem, addr, &zero_page)
                } else {
                    Ok(())
                }
            }
            Encoding::Subpage => {
                marks.touch(index);
                let mut result = Ok(());
                for_each_subpage(record.data, granularity, |offset, bytes| {
                    if result.is_ok() {
                        result = memory::write(mem, addr + offset as u64, bytes);
                    }
                });
                // The page as the pieces left it: its hash, and for XBZRLE,
                // which codes pages sent whole against what was last sent
                // of them, the cache's copy (it mirrors the source's).
                if result.is_ok() {
                    result = memory::read_page(mem, index, &mut page);
                    hashes.push((index, page_hash(&page)));
                    if decoder.keeps_pages() {
                        decoder.observe(index, &page);
                    }
                }
                result
            }
            Encoding::Rle | Encoding::Xbzrle | Encoding::Dedup => {
                marks.touch(index);
                let tag = record.encoding.codec_tag().expect("codec encodings have tags");
                if let Err(e) = decoder.decode(index, tag, record.data, &mut page) {
                    return Err(WireError::BadField { field: "pages.codec_record", detail: e.to_string() });
                }
                hashes.push((index, page_hash(&page)));
                memory::write(mem, addr, &page)
            }
            Encoding::RawRun => {
                return Err(WireError::bad("pages.encoding", "a raw run outside post-copy".to_string()));
            }
        };
        result.map_err(|e| WireError::BadField { field: "pages.page_index", detail: e.to_string() })
    })?;
    Ok(())
}

/// One shard's decoder: decodes and applies its frames in order.
pub(super) struct ShardWorker {
    pub(super) shard: u16,
    pub(super) mem: Arc<GuestMemory>,
    pub(super) granularity: usize,
    pub(super) marks: Arc<PageMarks>,
    /// Where the hashes of the pages written go.
    pub(super) digest: DigestFeed,
    pub(super) decoder: PageDecoder,
    pub(super) shared: Arc<Shared>,
}

impl ShardWorker {
    pub(super) fn run(mut self, input: Receiver<ShardWork>) {
        let mut decompressor = BatchDecompressor::default();
        let mut unpacked = Vec::new();
        let mut hashes = Vec::new();
        while let Ok(work) = input.recv() {
            let result = match work {
                ShardWork::Frame { kind, mut payload, pool, lease } => {
                    let mut apply = |frame: &[u8]| {
                        apply_pages(frame, &self.mem, self.granularity, &self.marks, &mut self.decoder, &mut hashes)
                    };
                    let r = if kind == FrameKind::PagesCompressed {
                        unpack(&payload, &mut decompressor, &mut unpacked).and_then(|_| apply(&unpacked))
                    } else {
                        apply(&payload)
                    };
                    // Before the iteration's end is told (below): a wait
                    // for it then finds the hashes handed over.
                    self.digest.known(std::mem::take(&mut hashes));
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
