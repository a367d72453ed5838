//! The batch encoder and decoder: the kernels of [`crate::kernels`] in the
//! order that reproduces the CPU `PageEncoder` / `PageDecoder` byte for
//! byte (zero → XBZRLE hit → dedup → GM-RLE → raw, with the caches on the
//! device), on any [`Backend`].
//!
//! Unlike the CPU chooser, no codec is switched off for not paying (the
//! chooser with an unknown bandwidth behaves the same): the caller decides
//! per stream whether the GPU pays.

use tsubame_codec::{CodecError, CodecList, PAGE_SIZE, TAG_DEDUP, TAG_RAW, TAG_RLE, TAG_XBZRLE, TAG_ZERO};

use crate::backend::{blocks, Arg, Backend, DevPtr, BLOCK};
use crate::geometry::{dedup_sets, split_unique, xbzrle_sets};
use crate::GpuError;

const CHUNKS: usize = 16;
const LINES: usize = 64;
/// Bytes per page reserved for its record on the device (kernels' REC_STRIDE).
const REC_STRIDE: usize = 4352;
const NONE: u32 = u32::MAX;
/// Lengths each thread of the prefix sum adds up (`SCAN_RUN` in pack.cu).
const SCAN_RUN: usize = 32;

/// Default pages per submitted batch.
pub const DEFAULT_BATCH_PAGES: usize = 1024;

/// The records of a batch, as the CPU encoder would produce them: for page
/// `i`, tag `tags[i]` and bytes `data[offsets[i]..offsets[i + 1]]` (a raw
/// record is the page itself, a zero record is empty).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedBatch {
    /// Page indices, in order.
    pub indices: Vec<u64>,
    /// Record tags (`tsubame_codec::TAG_*`).
    pub tags: Vec<u8>,
    /// `len + 1` offsets into `data`.
    pub offsets: Vec<u64>,
    /// The records, back to back.
    pub data: Vec<u8>,
}

impl EncodedBatch {
    /// Pages in the batch.
    pub fn len(&self) -> usize {
        self.tags.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.tags.is_empty()
    }

    /// Page `i`'s (index, tag, record bytes).
    pub fn record(&self, i: usize) -> (u64, u8, &[u8]) {
        (self.indices[i], self.tags[i], &self.data[self.offsets[i] as usize..self.offsets[i + 1] as usize])
    }

    /// Appends a record.
    pub fn push(&mut self, index: u64, tag: u8, bytes: &[u8]) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.indices.push(index);
        self.tags.push(tag);
        self.data.extend_from_slice(bytes);
        self.offsets.push(self.data.len() as u64);
    }

    /// Appends every record of `other`, in bulk (a batch's sub-batches
    /// are joined this way: record by record cost as much as the copy
    /// back from the GPU).
    fn append(&mut self, mut other: EncodedBatch) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        if self.data.is_empty() && self.tags.is_empty() {
            std::mem::swap(self, &mut other);
            return;
        }
        let base = self.data.len() as u64;
        self.indices.append(&mut other.indices);
        self.tags.append(&mut other.tags);
        self.data.append(&mut other.data);
        self.offsets.extend(other.offsets.iter().skip(1).map(|o| o + base));
    }
}

/// The caches, on the device.
struct Caches {
    xsets: u32,
    xtags: DevPtr,
    xlru: DevPtr,
    xdata: DevPtr,
    xclaim: DevPtr,
    dsets: u32,
    dhash: DevPtr,
    dvalid: DevPtr,
    dlru: DevPtr,
    ddata: DevPtr,
    dclaim: DevPtr,
}

impl Caches {
    fn new<B: Backend>(b: &mut B, list: &CodecList) -> Result<Caches, GpuError> {
        let mut c = Caches {
            xsets: 0,
            xtags: 0,
            xlru: 0,
            xdata: 0,
            xclaim: 0,
            dsets: 0,
            dhash: 0,
            dvalid: 0,
            dlru: 0,
            ddata: 0,
            dclaim: 0,
        };
        let fill = |b: &mut B, p: DevPtr, n: usize| {
            b.launch(0, "fill_u32", blocks(n), BLOCK, &[Arg::Ptr(p), Arg::U32(n as u32), Arg::U32(NONE)])
        };
        if let Some(bytes) = list.xbzrle {
            let sets = xbzrle_sets(bytes);
            c.xsets = sets as u32;
            c.xtags = b.alloc(sets * 2 * 8)?;
            fill(b, c.xtags, sets * 4)?; // u64::MAX: empty
            c.xlru = b.alloc(sets)?;
            c.xdata = b.alloc(sets * 2 * PAGE_SIZE)?;
            c.xclaim = b.alloc(sets * 4)?;
            fill(b, c.xclaim, sets)?;
        }
        if let Some(bytes) = list.dedup {
            let sets = dedup_sets(bytes);
            c.dsets = sets as u32;
            c.dhash = b.alloc(sets * 2 * 4)?;
            c.dvalid = b.alloc(sets * 2)?;
            c.dlru = b.alloc(sets)?;
            c.ddata = b.alloc(sets * 2 * 256)?;
            c.dclaim = b.alloc(sets * 4)?;
            fill(b, c.dclaim, sets)?;
        }
        b.wait(0)?;
        Ok(c)
    }
}

/// Per-lane device buffers for a batch of up to `max` pages.
struct Lane {
    pages: DevPtr,
    idx: DevPtr,
    is_zero: DevPtr,
    tag: DevPtr,
    len: DevPtr,
    done: DevPtr,
    csize: DevPtr,
    ev: DevPtr,
    xset: DevPtr,
    kind: DevPtr,
    slot: DevPtr,
    xfin: DevPtr,
    masks: DevPtr,
    dset: DevPtr,
    dhv: DevPtr,
    dref: DevPtr,
    dsrc: DevPtr,
    dfin: DevPtr,
    rec: DevPtr,
    off: DevPtr,
    /// The prefix sum's per-run sums.
    part: DevPtr,
    out: DevPtr,
    err: DevPtr,
    errv: DevPtr,
}

impl Lane {
    fn new<B: Backend>(b: &mut B, max: usize) -> Result<Lane, GpuError> {
        let chunks = max * CHUNKS;
        Ok(Lane {
            // Decoder records go here too: a dedup record is 2 bytes over a page.
            pages: b.alloc(max * (PAGE_SIZE + 8))?,
            idx: b.alloc(max * 8)?,
            is_zero: b.alloc(max * 4)?,
            tag: b.alloc(max)?,
            len: b.alloc(max * 4)?,
            done: b.alloc(max)?,
            csize: b.alloc(chunks * 4)?,
            ev: b.alloc(max)?,
            xset: b.alloc(max * 4)?,
            kind: b.alloc(max * 4)?,
            slot: b.alloc(max * 4)?,
            xfin: b.alloc(max * 4)?,
            masks: b.alloc(max * LINES * 8)?,
            dset: b.alloc(chunks * 4)?,
            dhv: b.alloc(chunks * 4)?,
            dref: b.alloc(chunks * 4)?,
            dsrc: b.alloc(chunks * 4)?,
            dfin: b.alloc(chunks * 4)?,
            rec: b.alloc(max * REC_STRIDE)?,
            off: b.alloc((max + 1) * 8)?,
            part: b.alloc(max.div_ceil(SCAN_RUN) * 8)?,
            out: b.alloc(max * (PAGE_SIZE + 8))?,
            err: b.alloc(max * 4)?,
            errv: b.alloc(max * 4)?,
        })
    }
}

/// A batch queued on a lane, waiting for [`GpuEncoder::finish`].
struct InFlight {
    lane: usize,
    indices: Vec<u64>,
    /// Where the tags and the offsets will lie in the lane's staging.
    tags_at: usize,
    offsets_at: usize,
}

/// The sending side: encodes batches of pages on the device.
pub struct GpuEncoder<B: Backend> {
    backend: B,
    list: CodecList,
    max: usize,
    caches: Caches,
    lanes: Vec<Lane>,
    queue: std::collections::VecDeque<InFlight>,
    next_lane: usize,
    last_lane: Option<usize>,
}

impl<B: Backend> GpuEncoder<B> {
    /// An encoder for `list` (its zero, rle, xbzrle and dedup; a batch
    /// compressor in the list is the caller's) taking batches of up to
    /// `max_pages` pages.
    pub fn new(mut backend: B, list: &CodecList, max_pages: usize) -> Result<Self, GpuError> {
        let max = max_pages.max(1);
        let caches = Caches::new(&mut backend, list)?;
        let lanes = (0..backend.lanes()).map(|_| Lane::new(&mut backend, max)).collect::<Result<Vec<_>, _>>()?;
        Ok(GpuEncoder {
            backend,
            list: list.clone(),
            max,
            caches,
            lanes,
            queue: Default::default(),
            next_lane: 0,
            last_lane: None,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Largest batch [`GpuEncoder::submit`] takes.
    pub fn max_pages(&self) -> usize {
        self.max
    }

    /// Batches queued and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// Encodes `indices.len()` pages (`pages` holds them back to back) and
    /// returns their records in order. Splits the batch where an index
    /// repeats or `max_pages` is reached, keeping up to one sub-batch per
    /// lane in flight so copies and kernels overlap.
    pub fn encode_batch(&mut self, pages: &[u8], indices: &[u64]) -> Result<EncodedBatch, GpuError> {
        if pages.len() != indices.len() * PAGE_SIZE {
            return Err(GpuError::BadBatch(format!("{} bytes for {} pages", pages.len(), indices.len())));
        }
        let mut all = EncodedBatch { offsets: vec![0], ..Default::default() };
        for r in split_unique(indices, self.max) {
            if self.queue.len() == self.lanes.len() {
                all.append(self.finish()?.expect("a batch is in flight"));
            }
            self.submit(&pages[r.start * PAGE_SIZE..r.end * PAGE_SIZE], &indices[r])?;
        }
        while let Some(b) = self.finish()? {
            all.append(b);
        }
        Ok(all)
    }

    /// Queues a batch (at most `max_pages`, no index twice) on the next
    /// lane; the caller must [`finish`](Self::finish) the oldest batch
    /// first when every lane is busy.
    pub fn submit(&mut self, pages: &[u8], indices: &[u64]) -> Result<(), GpuError> {
        let n = indices.len();
        if n == 0 || n > self.max || pages.len() != n * PAGE_SIZE {
            return Err(GpuError::BadBatch(format!("{n} pages (1 to {} per submit)", self.max)));
        }
        if split_unique(indices, n).len() != 1 {
            return Err(GpuError::BadBatch("an index occurs twice in one submit".into()));
        }
        if self.queue.len() == self.lanes.len() {
            return Err(GpuError::BadBatch("every lane is busy: finish a batch first".into()));
        }
        let lane = self.next_lane;
        self.next_lane = (lane + 1) % self.lanes.len();
        let b = &mut self.backend;
        let l = &self.lanes[lane];
        let c = &self.caches;
        b.reset_staging(lane);
        b.upload(lane, l.pages, pages)?;
        let idx_bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_le_bytes()).collect();
        b.upload(lane, l.idx, &idx_bytes)?;
        // The caches belong to the previous batch until its kernels end.
        if let Some(prev) = self.last_lane {
            b.order(lane, prev)?;
        }
        let nn = Arg::U32(n as u32);
        let (g_pages, g_chunks, g_lines) = (blocks(n), blocks(n * CHUNKS), blocks(n * LINES));
        let zero = u32::from(self.list.zero);
        b.launch(lane, "fill_u32", g_pages, BLOCK, &[Arg::Ptr(l.is_zero), nn, Arg::U32(zero)])?;
        if self.list.zero {
            b.launch(lane, "zero_detect", g_chunks, BLOCK, &[Arg::Ptr(l.pages), nn, Arg::Ptr(l.is_zero)])?;
        }
        let p = Arg::Ptr;
        b.launch(lane, "batch_init", g_pages, BLOCK, &[nn, p(l.is_zero), p(l.tag), p(l.len), p(l.done)])?;
        if self.list.xbzrle.is_some() {
            let sets = Arg::U32(c.xsets);
            b.launch(lane, "xb_ev_encode", g_pages, BLOCK, &[nn, p(l.is_zero), p(l.ev)])?;
            b.launch(lane, "xb_claim", g_pages, BLOCK, &[p(l.idx), nn, sets, p(l.xset), p(c.xclaim)])?;
            let plan =
                [p(l.idx), nn, p(l.ev), p(l.xset), p(c.xclaim), p(c.xtags), p(c.xlru), p(l.kind), p(l.slot), p(l.xfin)];
            b.launch(lane, "xb_plan", g_pages, BLOCK, &plan)?;
            b.launch(
                lane,
                "xb_masks",
                g_lines,
                BLOCK,
                &[p(l.pages), nn, p(l.kind), p(l.slot), p(c.xdata), p(l.masks)],
            )?;
            let enc = [p(l.pages), nn, p(l.kind), p(l.masks), p(l.rec), p(l.tag), p(l.len), p(l.done)];
            b.launch(lane, "xb_encode", g_pages, BLOCK, &enc)?;
            b.launch(lane, "xb_update", n as u32, BLOCK, &[p(l.pages), nn, p(l.xfin), p(c.xdata)])?;
        }
        if self.list.dedup.is_some() {
            let sets = Arg::U32(c.dsets);
            // Chunks outside every walk (pages already done) write nothing.
            b.launch(lane, "fill_u32", g_chunks, BLOCK, &[p(l.dfin), Arg::U32((n * CHUNKS) as u32), Arg::U32(NONE)])?;
            let hash = [p(l.pages), nn, p(l.done), sets, p(l.dset), p(l.dhv), p(c.dclaim)];
            b.launch(lane, "dd_hash", g_chunks, BLOCK, &hash)?;
            let plan = [
                p(l.pages),
                nn,
                p(l.dset),
                p(l.dhv),
                p(c.dclaim),
                p(c.dhash),
                p(c.dvalid),
                p(c.dlru),
                p(c.ddata),
                p(l.dref),
                p(l.dfin),
            ];
            b.launch(lane, "dd_plan", g_chunks, BLOCK, &plan)?;
            b.launch(lane, "dd_encode", g_chunks, BLOCK, &[p(l.pages), nn, p(l.done), p(l.dref), p(l.rec)])?;
            b.launch(lane, "dd_finish", g_pages, BLOCK, &[nn, p(l.dref), p(l.rec), p(l.tag), p(l.len), p(l.done)])?;
            b.launch(lane, "dd_update", g_chunks, BLOCK, &[p(l.pages), nn, p(l.dfin), p(c.ddata)])?;
        }
        if self.list.rle {
            b.launch(lane, "rle_size", g_chunks, BLOCK, &[p(l.pages), nn, p(l.done), p(l.csize)])?;
            let write = [p(l.pages), nn, p(l.done), p(l.csize), p(l.rec), p(l.tag), p(l.len)];
            b.launch(lane, "rle_write", g_chunks, BLOCK, &write)?;
        }
        let g_runs = blocks(n.div_ceil(SCAN_RUN));
        b.launch(lane, "scan_parts", g_runs, BLOCK, &[nn, p(l.len), p(l.part)])?;
        b.launch(lane, "scan_sums", 1, 1, &[nn, p(l.part)])?;
        b.launch(lane, "scan_write", g_runs, BLOCK, &[nn, p(l.len), p(l.part), p(l.off)])?;
        b.launch(lane, "pack", n as u32, BLOCK, &[nn, p(l.tag), p(l.len), p(l.off), p(l.pages), p(l.rec), p(l.out)])?;
        // Tags, then the n + 1 offsets, come back first; the records once
        // their total is known.
        let tags_at = b.download(lane, l.tag, n)?;
        let offsets_at = b.download(lane, l.off, (n + 1) * 8)?;
        self.last_lane = Some(lane);
        self.queue.push_back(InFlight { lane, indices: indices.to_vec(), tags_at, offsets_at });
        Ok(())
    }

    /// Waits for the oldest queued batch and returns its records; None when
    /// nothing is queued.
    pub fn finish(&mut self) -> Result<Option<EncodedBatch>, GpuError> {
        let Some(f) = self.queue.pop_front() else { return Ok(None) };
        let n = f.indices.len();
        let b = &mut self.backend;
        b.wait(f.lane)?;
        let tags = b.staged(f.lane, f.tags_at, n).to_vec();
        let offsets: Vec<u64> = b
            .staged(f.lane, f.offsets_at, (n + 1) * 8)
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let total = offsets[n] as usize;
        let at = b.download(f.lane, self.lanes[f.lane].out, total)?;
        b.wait(f.lane)?;
        let data = b.staged(f.lane, at, total).to_vec();
        Ok(Some(EncodedBatch { indices: f.indices, tags, offsets, data }))
    }
}

/// The receiving side: decodes batches of records on the device, keeping
/// caches identical to the sender's.
pub struct GpuDecoder<B: Backend> {
    backend: B,
    list: CodecList,
    max: usize,
    caches: Caches,
    lane: Lane,
}

impl<B: Backend> GpuDecoder<B> {
    /// A decoder for the sender's `list`, batches of up to `max_pages`.
    pub fn new(mut backend: B, list: &CodecList, max_pages: usize) -> Result<Self, GpuError> {
        let max = max_pages.max(1);
        let caches = Caches::new(&mut backend, list)?;
        let lane = Lane::new(&mut backend, max)?;
        Ok(GpuDecoder { backend, list: list.clone(), max, caches, lane })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Checks what can be checked on the host without touching the bytes:
    /// the tag is enabled and the length fits it.
    fn check(&self, index: u64, tag: u8, rec: &[u8]) -> Result<(), CodecError> {
        let unknown = CodecError::UnknownTag { tag, page: index };
        match tag {
            TAG_RAW if rec.len() < PAGE_SIZE => Err(CodecError::Truncated { codec: "raw", page: index }),
            TAG_RAW if rec.len() > PAGE_SIZE => {
                Err(CodecError::Trailing { codec: "raw", page: index, extra: rec.len() - PAGE_SIZE })
            }
            TAG_ZERO if !rec.is_empty() => Err(CodecError::Trailing { codec: "zero", page: index, extra: rec.len() }),
            TAG_RAW | TAG_ZERO => Ok(()),
            TAG_RLE if self.list.rle => Ok(()),
            TAG_XBZRLE if self.list.xbzrle.is_some() => Ok(()),
            TAG_DEDUP if self.list.dedup.is_some() => {
                let head = rec.get(..2).ok_or(CodecError::Truncated { codec: "dedup", page: index })?;
                let refs = u16::from_le_bytes([head[0], head[1]]).count_ones() as usize;
                let want = 2 + 4 * refs + 256 * (CHUNKS - refs);
                match rec.len().cmp(&want) {
                    std::cmp::Ordering::Less => Err(CodecError::Truncated { codec: "dedup", page: index }),
                    std::cmp::Ordering::Greater => {
                        Err(CodecError::Trailing { codec: "dedup", page: index, extra: rec.len() - want })
                    }
                    std::cmp::Ordering::Equal => Ok(()),
                }
            }
            _ => Err(unknown),
        }
    }

    /// Decodes every record of `batch` (in order) into pages, back to back.
    pub fn decode_batch(&mut self, batch: &EncodedBatch) -> Result<Vec<u8>, GpuError> {
        let mut pages = Vec::with_capacity(batch.len() * PAGE_SIZE);
        for r in split_unique(&batch.indices, self.max) {
            self.decode_part(batch, r, &mut pages)?;
        }
        Ok(pages)
    }

    fn decode_part(
        &mut self,
        batch: &EncodedBatch,
        r: std::ops::Range<usize>,
        pages: &mut Vec<u8>,
    ) -> Result<(), GpuError> {
        let n = r.len();
        let base = batch.offsets[r.start];
        let mut data = Vec::with_capacity((batch.offsets[r.end] - base) as usize);
        let mut offs = Vec::with_capacity((n + 1) * 8);
        let mut lens = Vec::with_capacity(n * 4);
        for i in r.clone() {
            let (index, tag, rec) = batch.record(i);
            self.check(index, tag, rec)?;
            offs.extend_from_slice(&(data.len() as u64).to_le_bytes());
            lens.extend_from_slice(&(rec.len() as u32).to_le_bytes());
            data.extend_from_slice(rec);
        }
        offs.extend_from_slice(&(data.len() as u64).to_le_bytes());
        let (b, l, c) = (&mut self.backend, &self.lane, &self.caches);
        // Records go where pages go on the encoder (sized for raw pages).
        let rec = l.pages;
        b.reset_staging(0);
        b.upload(0, rec, &data)?;
        b.upload(0, l.off, &offs)?;
        b.upload(0, l.len, &lens)?;
        b.upload(0, l.tag, &batch.tags[r.clone()])?;
        let idx: Vec<u8> = batch.indices[r.clone()].iter().flat_map(|i| i.to_le_bytes()).collect();
        b.upload(0, l.idx, &idx)?;
        let (p, nn) = (Arg::Ptr, Arg::U32(n as u32));
        let (g_pages, g_chunks) = (blocks(n), blocks(n * CHUNKS));
        b.launch(0, "fill_u32", g_pages, BLOCK, &[p(l.err), nn, Arg::U32(0)])?;
        b.launch(0, "dec_copy", n as u32, BLOCK, &[nn, p(l.tag), p(rec), p(l.off), p(l.out)])?;
        if self.list.rle {
            let args = [nn, p(l.tag), p(rec), p(l.off), p(l.len), p(l.out), p(l.err), p(l.errv)];
            b.launch(0, "rle_decode", g_pages, BLOCK, &args)?;
        }
        if self.list.dedup.is_some() {
            // Chunks of other records write nothing to the chunk cache.
            b.launch(0, "fill_u32", g_chunks, BLOCK, &[p(l.dfin), Arg::U32((n * CHUNKS) as u32), Arg::U32(NONE)])?;
            let prep = [
                nn,
                p(l.tag),
                p(rec),
                p(l.off),
                p(l.out),
                Arg::U32(c.dsets),
                p(l.dset),
                p(l.dhv),
                p(l.dref),
                p(c.dclaim),
                p(l.err),
            ];
            b.launch(0, "dd_dec_prep", g_chunks, BLOCK, &prep)?;
            let plan = [
                nn,
                p(l.dset),
                p(l.dhv),
                p(l.dref),
                p(c.dclaim),
                p(c.dhash),
                p(c.dvalid),
                p(c.dlru),
                p(l.dsrc),
                p(l.dfin),
                p(l.err),
            ];
            b.launch(0, "dd_plan_dec", g_chunks, BLOCK, &plan)?;
            b.launch(0, "dd_dec_refs", g_chunks, BLOCK, &[nn, p(l.dref), p(l.dsrc), p(c.ddata), p(l.out)])?;
            b.launch(0, "dd_update", g_chunks, BLOCK, &[p(l.out), nn, p(l.dfin), p(c.ddata)])?;
        }
        if self.list.xbzrle.is_some() {
            b.launch(0, "xb_ev_decode", g_pages, BLOCK, &[nn, p(l.tag), p(l.ev)])?;
            b.launch(0, "xb_claim", g_pages, BLOCK, &[p(l.idx), nn, Arg::U32(c.xsets), p(l.xset), p(c.xclaim)])?;
            let plan =
                [p(l.idx), nn, p(l.ev), p(l.xset), p(c.xclaim), p(c.xtags), p(c.xlru), p(l.kind), p(l.slot), p(l.xfin)];
            b.launch(0, "xb_plan", g_pages, BLOCK, &plan)?;
            let apply = [
                nn,
                p(l.tag),
                p(rec),
                p(l.off),
                p(l.len),
                p(l.kind),
                p(l.slot),
                p(c.xdata),
                p(l.out),
                p(l.err),
                p(l.errv),
            ];
            b.launch(0, "xb_apply", g_pages, BLOCK, &apply)?;
            b.launch(0, "xb_update", n as u32, BLOCK, &[p(l.out), nn, p(l.xfin), p(c.xdata)])?;
        }
        let err_at = b.download(0, l.err, n * 4)?;
        let errv_at = b.download(0, l.errv, n * 4)?;
        let out_at = b.download(0, l.out, n * PAGE_SIZE)?;
        b.wait(0)?;
        let word = |at: usize, i: usize| u32::from_le_bytes(b.staged(0, at + 4 * i, 4).try_into().unwrap());
        for i in 0..n {
            let code = word(err_at, i);
            if code != 0 {
                let (index, tag, _) = batch.record(r.start + i);
                return Err(gpu_error(code, word(errv_at, i), index, tag).into());
            }
        }
        pages.extend_from_slice(b.staged(0, out_at, n * PAGE_SIZE));
        Ok(())
    }
}

/// The CodecError for a kernel's error code (kernels/common.cuh).
fn gpu_error(code: u32, value: u32, page: u64, tag: u8) -> CodecError {
    let codec = match tag {
        TAG_RLE => "rle",
        TAG_XBZRLE => "xbzrle",
        TAG_DEDUP => "dedup",
        _ => "raw",
    };
    match code {
        1 => CodecError::Truncated { codec, page },
        2 => {
            CodecError::Malformed { codec, page, what: if tag == TAG_RLE { "empty run" } else { "empty literal run" } }
        }
        3 => CodecError::Overrun { codec, page, offset: value as usize },
        4 => CodecError::Trailing { codec, page, extra: value as usize },
        _ => CodecError::CacheMiss { codec, page },
    }
}
