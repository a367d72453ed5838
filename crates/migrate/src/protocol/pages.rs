//! The page records inside PAGES, PAGES_COMPRESSED and PAGES_ZEROCOPY
//! frames: the one place their layout is written and read.
//!
//! PAGES payload: `iteration u32, shard u16, reserved u16, count u32`, then
//! `count` records of `page_index u64, encoding u8, length u32, data[length]`.
//! PAGES_COMPRESSED payload: `shard u16, compressor u8, unpacked_len u32`,
//! then a PAGES payload compressed by lz4 or zstd. PAGES_ZEROCOPY: a PAGES
//! payload whose raw pages were spliced in from guest memory after the
//! headers were written (its CRC covers the headers only).

use tsubame_codec::PAGE_SIZE;

use super::fields::Fields;
use super::kind::{FrameKind, WireError};

/// Bytes of a PAGES payload's header.
pub const PAGES_HEADER: usize = 12;
/// Bytes of a record's header.
pub const RECORD_HEADER: usize = 13;
/// Most records in one PAGES frame.
pub const MAX_RECORDS: u32 = 4096;
/// Page records a source packs into one PAGES frame.
pub const RECORDS_PER_FRAME: usize = 256;
/// Most pages in one raw run record (a source's whole frame).
pub const MAX_RUN_PAGES: usize = RECORDS_PER_FRAME;
/// Largest PAGES payload inside a PAGES_COMPRESSED frame: a source packs
/// at most 256 records (~1 MiB) per frame, so 2 MiB bounds what each
/// decoder holds for unpacking.
pub const MAX_UNPACKED: usize = 2 << 20;

/// How a record's data encodes the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Encoding {
    /// 4096 bytes of page.
    Raw = 0,
    /// The page is all zeros; no data.
    Zero = 1,
    /// Some sub-pages: a u64 mask, then the sub-pages it names, in order.
    Subpage = 2,
    /// A GM-RLE record (docs/codec-format.md).
    Rle = 3,
    /// An XBZRLE record against the page cache.
    Xbzrle = 4,
    /// A dedup record against the chunk cache.
    Dedup = 5,
    /// 2 to [`MAX_RUN_PAGES`] consecutive pages raw, from the record's
    /// page on: post-copy's push only (a record header per 4 KiB page
    /// was 0.3 % of its bytes).
    RawRun = 6,
}

impl Encoding {
    /// The codec tag of a codec record (the same numbers).
    pub fn codec_tag(self) -> Option<u8> {
        match self {
            Encoding::Rle | Encoding::Xbzrle | Encoding::Dedup => Some(self as u8),
            _ => None,
        }
    }

    /// The encoding of a codec tag.
    pub fn from_codec_tag(tag: u8) -> Encoding {
        match tag {
            3 => Encoding::Rle,
            4 => Encoding::Xbzrle,
            _ => Encoding::Dedup,
        }
    }
}

impl Encoding {
    fn from_u8(v: u8) -> Option<Encoding> {
        match v {
            0 => Some(Encoding::Raw),
            1 => Some(Encoding::Zero),
            2 => Some(Encoding::Subpage),
            3 => Some(Encoding::Rle),
            4 => Some(Encoding::Xbzrle),
            5 => Some(Encoding::Dedup),
            6 => Some(Encoding::RawRun),
            _ => None,
        }
    }
}

/// Builds a PAGES payload in a reused buffer.
pub struct PagesBuilder {
    buf: Vec<u8>,
    count: u32,
    /// Bytes kept before the payload ([`Self::reset_leaving`]).
    prefix: usize,
    /// The raw run [`Self::run_page`] appends to: its record's offset,
    /// first page and pages.
    run: Option<(usize, u64, usize)>,
}

impl PagesBuilder {
    /// An empty batch with room for `capacity_pages` raw pages.
    pub fn new(capacity_pages: usize) -> Self {
        let capacity = PAGES_HEADER + capacity_pages * (RECORD_HEADER + PAGE_SIZE);
        PagesBuilder { buf: Vec::with_capacity(capacity), count: 0, prefix: 0, run: None }
    }

    /// Starts a new batch of `iteration` for codec `shard`, keeping the allocation.
    pub fn reset(&mut self, iteration: u32, shard: u16) {
        self.reset_leaving(0, iteration, shard);
    }

    /// Like [`Self::reset`], leaving `room` bytes before the payload for
    /// the caller's frame header ([`Self::room_mut`]): [`Self::all`] is
    /// then the frame, without copying the payload.
    pub fn reset_leaving(&mut self, room: usize, iteration: u32, shard: u16) {
        self.buf.clear();
        self.buf.resize(room, 0);
        self.buf.extend_from_slice(&iteration.to_le_bytes());
        self.buf.extend_from_slice(&shard.to_le_bytes());
        self.buf.extend_from_slice(&0u16.to_le_bytes());
        self.buf.extend_from_slice(&0u32.to_le_bytes());
        self.count = 0;
        self.prefix = room;
        self.run = None;
    }

    /// Appends a record.
    pub fn push(&mut self, page_index: u64, encoding: Encoding, data: &[u8]) {
        self.push_header(page_index, encoding, data.len());
        self.buf.extend_from_slice(data);
    }

    /// Appends a record's header alone: its `len` data bytes travel
    /// separately (zero-copy sends).
    pub fn push_header(&mut self, page_index: u64, encoding: Encoding, len: usize) {
        self.buf.extend_from_slice(&page_index.to_le_bytes());
        self.buf.push(encoding as u8);
        self.buf.extend_from_slice(&(len as u32).to_le_bytes());
        self.set_count(self.count + 1);
        self.run = None;
    }

    fn set_count(&mut self, count: u32) {
        self.count = count;
        let at = self.prefix + 8;
        self.buf[at..at + 4].copy_from_slice(&count.to_le_bytes());
    }

    /// Appends page `page_index` to a raw record, the last one if it ends
    /// just before (a raw run once it has two pages), and returns the
    /// page's bytes to fill: a page is read straight into the payload.
    pub fn run_page(&mut self, page_index: u64) -> &mut [u8; PAGE_SIZE] {
        let run = match self.run {
            Some((at, first, pages)) if page_index == first + pages as u64 && pages < MAX_RUN_PAGES => {
                (at, first, pages + 1)
            }
            _ => {
                let at = self.buf.len();
                self.push_header(page_index, Encoding::Raw, PAGE_SIZE);
                (at, page_index, 1)
            }
        };
        self.set_run(run);
        let end = self.buf.len();
        self.buf.resize(end + PAGE_SIZE, 0);
        (&mut self.buf[end..]).try_into().expect("one page")
    }

    /// Takes back the page [`Self::run_page`] appended last (it turned
    /// out to need another record).
    pub fn unpush_page(&mut self) {
        let Some((at, first, pages)) = self.run else { return };
        self.buf.truncate(self.buf.len() - PAGE_SIZE);
        if pages == 1 {
            self.buf.truncate(at);
            self.set_count(self.count - 1);
            self.run = None;
        } else {
            self.set_run((at, first, pages - 1));
        }
    }

    /// Records `run` as the raw record being appended to, its encoding
    /// and length as its pages say.
    fn set_run(&mut self, (at, first, pages): (usize, u64, usize)) {
        self.buf[at + 8] = if pages == 1 { Encoding::Raw } else { Encoding::RawRun } as u8;
        self.buf[at + 9..at + 13].copy_from_slice(&((pages * PAGE_SIZE) as u32).to_le_bytes());
        self.run = Some((at, first, pages));
    }

    /// The room left before the payload ([`Self::reset_leaving`]).
    pub fn room_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.prefix]
    }

    /// The room before the payload and the payload.
    pub fn all(&self) -> &[u8] {
        &self.buf
    }

    /// Records so far.
    pub fn len(&self) -> u32 {
        self.count
    }

    /// True when no record was pushed.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.buf[self.prefix..]
    }
}

/// One decoded record, borrowing the frame.
#[derive(Debug, PartialEq, Eq)]
pub struct Record<'a> {
    /// Guest page number.
    pub page_index: u64,
    /// Encoding of `data`.
    pub encoding: Encoding,
    /// The encoded bytes.
    pub data: &'a [u8],
}

/// The codec shard a PAGES, PAGES_ZEROCOPY or PAGES_COMPRESSED payload
/// belongs to, read without decompressing (a PAGES_COMPRESSED payload
/// starts with it).
pub fn shard_of(kind: FrameKind, payload: &[u8]) -> Result<u16, WireError> {
    let at = if kind == FrameKind::PagesCompressed { 0 } else { 4 };
    let bytes = payload.get(at..at + 2).ok_or(WireError::Truncated(kind))?;
    Ok(u16::from_le_bytes(bytes.try_into().unwrap()))
}

/// Parses a PAGES payload, checking every record against `page_count`
/// and the sub-page `granularity` agreed in HELLO; calls `apply` for each.
/// Returns the iteration number.
pub fn for_each_record<'a>(
    payload: &'a [u8],
    page_count: u64,
    granularity: usize,
    mut apply: impl FnMut(Record<'a>) -> Result<(), WireError>,
) -> Result<u32, WireError> {
    let mut f = Fields::new(FrameKind::Pages, payload);
    let iteration = f.u32()?;
    let _shard = f.u16()?;
    let reserved = f.u16()?;
    if reserved != 0 {
        return Err(WireError::BadField { field: "pages.reserved", detail: format!("{reserved} (must be 0)") });
    }
    let count = f.u32()?;
    if count > MAX_RECORDS {
        return Err(WireError::BadField { field: "pages.count", detail: format!("{count} (at most {MAX_RECORDS})") });
    }
    for _ in 0..count {
        let page_index = f.u64()?;
        if page_index >= page_count {
            return Err(WireError::BadField {
                field: "pages.page_index",
                detail: format!("{page_index} is beyond the last page {}", page_count.saturating_sub(1)),
            });
        }
        let raw_encoding = f.u8()?;
        let encoding = Encoding::from_u8(raw_encoding).ok_or_else(|| WireError::BadField {
            field: "pages.encoding",
            detail: format!("unknown {raw_encoding}"),
        })?;
        let len = f.u32()? as usize;
        let expected = match encoding {
            Encoding::Raw => PAGE_SIZE,
            Encoding::RawRun => {
                let run = len / PAGE_SIZE;
                let fits = len.is_multiple_of(PAGE_SIZE) && (2..=MAX_RUN_PAGES).contains(&run);
                if !fits || page_index + run as u64 > page_count {
                    return Err(WireError::bad(
                        "pages.length",
                        format!("{len} for a raw run from page {page_index} (2 to {MAX_RUN_PAGES} whole pages, inside memory)"),
                    ));
                }
                len
            }
            Encoding::Zero => 0,
            // Codec records: at most a page and the dedup header; the
            // codec's decoder checks the contents.
            Encoding::Rle | Encoding::Xbzrle | Encoding::Dedup if len <= PAGE_SIZE + 2 => len,
            Encoding::Rle | Encoding::Xbzrle | Encoding::Dedup => PAGE_SIZE + 2,
            Encoding::Subpage => {
                let mask_bytes = f.rest().get(..8).ok_or(WireError::Truncated(FrameKind::Pages))?;
                let mask = u64::from_le_bytes(mask_bytes.try_into().unwrap());
                let per_page = PAGE_SIZE / granularity;
                if granularity == PAGE_SIZE || mask == 0 || (per_page < 64 && mask >> per_page != 0) {
                    return Err(WireError::bad(
                        "pages.subpage_mask",
                        format!("{mask:#x} for page {page_index} at granularity {granularity}"),
                    ));
                }
                8 + mask.count_ones() as usize * granularity
            }
        };
        if len != expected {
            return Err(WireError::BadField {
                field: "pages.length",
                detail: format!("{len} for a {encoding:?} record of page {page_index} (must be {expected})"),
            });
        }
        let data = f.take(len)?;
        apply(Record { page_index, encoding, data })?;
    }
    f.finish()?;
    Ok(iteration)
}

/// Calls `write(offset, bytes)` for each sub-page of a SUBPAGE record's
/// data (already length-checked by [`for_each_record`]).
pub fn for_each_subpage(data: &[u8], granularity: usize, mut write: impl FnMut(usize, &[u8])) {
    let mask = u64::from_le_bytes(data[..8].try_into().unwrap());
    let mut bits = mask;
    for chunk in data[8..].chunks_exact(granularity) {
        let i = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        write(i * granularity, chunk);
    }
}

/// The header of a PAGES_COMPRESSED payload; the compressed PAGES payload
/// follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressedHeader {
    /// The codec shard of the PAGES payload inside.
    pub shard: u16,
    /// The batch compressor's id (`tsubame_codec::batch`).
    pub compressor: u8,
    /// Bytes of the PAGES payload once decompressed.
    pub unpacked_len: u32,
}

impl CompressedHeader {
    /// Bytes of the header.
    pub const LEN: usize = 7;

    /// Appends the header; the compressed bytes go right after it.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.shard.to_le_bytes());
        out.push(self.compressor);
        out.extend_from_slice(&self.unpacked_len.to_le_bytes());
    }

    /// Splits a PAGES_COMPRESSED payload into its header and the compressed
    /// bytes; the unpacked length is checked against [`MAX_UNPACKED`].
    pub fn parse(payload: &[u8]) -> Result<(CompressedHeader, &[u8]), WireError> {
        let mut f = Fields::new(FrameKind::PagesCompressed, payload);
        let header = CompressedHeader { shard: f.u16()?, compressor: f.u8()?, unpacked_len: f.u32()? };
        if header.unpacked_len as usize > MAX_UNPACKED {
            return Err(WireError::bad(
                "pages_compressed.unpacked_len",
                format!("{} (at most {MAX_UNPACKED})", header.unpacked_len),
            ));
        }
        Ok((header, f.rest()))
    }
}

/// Walks a headers-only PAGES payload (as a zero-copy sender builds it:
/// the PAGES header, then every record's header back to back, the data
/// travelling separately). Calls `record(end, page_index, data_len)` for
/// each record, `end` being the offset just past its header; returns the
/// length of the headers, or None when `headers` is shorter than they are.
pub fn walk_record_headers(headers: &[u8], mut record: impl FnMut(usize, u64, usize)) -> Option<usize> {
    let count = u32::from_le_bytes(headers.get(8..12)?.try_into().unwrap()) as usize;
    let len = PAGES_HEADER + count.min(MAX_RECORDS as usize) * RECORD_HEADER;
    let headers = headers.get(..len)?;
    for at in (PAGES_HEADER..len).step_by(RECORD_HEADER) {
        let index = u64::from_le_bytes(headers[at..at + 8].try_into().unwrap());
        let data_len = u32::from_le_bytes(headers[at + 9..at + 13].try_into().unwrap()) as usize;
        record(at + RECORD_HEADER, index, data_len);
    }
    Some(len)
}

/// Calls `covered` with each part of a PAGES_ZEROCOPY payload its CRC
/// covers: the PAGES header and every record header, skipping record data.
/// None when the records run past the payload.
pub fn zero_copy_covered(payload: &[u8], mut covered: impl FnMut(&[u8])) -> Option<()> {
    covered(payload.get(..PAGES_HEADER)?);
    let count = u32::from_le_bytes(payload[8..12].try_into().unwrap());
    let mut at = PAGES_HEADER;
    for _ in 0..count.min(MAX_RECORDS) {
        let record = payload.get(at..at + RECORD_HEADER)?;
        covered(record);
        at += RECORD_HEADER + u32::from_le_bytes(record[9..13].try_into().unwrap()) as usize;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let mut b = PagesBuilder::new(2);
        b.reset(3, 0);
        let page = [7u8; PAGE_SIZE];
        b.push(5, Encoding::Raw, &page);
        b.push(9, Encoding::Zero, &[]);
        let mut seen = Vec::new();
        let it = for_each_record(b.payload(), 10, PAGE_SIZE, |r| {
            seen.push((r.page_index, r.encoding, r.data.len()));
            Ok(())
        })
        .unwrap();
        assert_eq!(it, 3);
        assert_eq!(seen, vec![(5, Encoding::Raw, PAGE_SIZE), (9, Encoding::Zero, 0)]);
    }

    #[test]
    fn hostile_records_are_rejected() {
        let mut b = PagesBuilder::new(1);
        b.reset(0, 0);
        b.push(10, Encoding::Zero, &[]);
        let err = for_each_record(b.payload(), 10, PAGE_SIZE, |_| Ok(())).unwrap_err();
        assert!(err.to_string().contains("pages.page_index"), "{err}");

        b.reset(0, 0);
        b.push(1, Encoding::Raw, &[1, 2, 3]);
        assert!(for_each_record(b.payload(), 10, PAGE_SIZE, |_| Ok(()))
            .unwrap_err()
            .to_string()
            .contains("pages.length"));

        b.reset(0, 0);
        b.push(1, Encoding::Zero, &[]);
        let mut bytes = b.payload().to_vec();
        bytes[20] = 77; // encoding byte
        assert!(for_each_record(&bytes, 10, PAGE_SIZE, |_| Ok(())).unwrap_err().to_string().contains("pages.encoding"));
        bytes[8..12].copy_from_slice(&5u32.to_le_bytes()); // claims 5 records
        assert!(for_each_record(&bytes, 10, PAGE_SIZE, |_| Ok(())).is_err());
    }

    #[test]
    fn raw_runs_are_checked() {
        let mut b = PagesBuilder::new(4);
        let pages = [9u8; 3 * PAGE_SIZE];
        b.reset(u32::MAX, 0);
        b.push(7, Encoding::RawRun, &pages);
        let mut seen = Vec::new();
        for_each_record(b.payload(), 10, PAGE_SIZE, |r| {
            seen.push((r.page_index, r.encoding, r.data.len()));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![(7, Encoding::RawRun, 3 * PAGE_SIZE)]);
        // Past the last page, a single page, a part of a page, too long.
        let too_long = vec![0u8; (MAX_RUN_PAGES + 1) * PAGE_SIZE];
        for (first, data) in [(8, &pages[..]), (1, &pages[..PAGE_SIZE]), (1, &pages[..PAGE_SIZE + 8]), (0, &too_long)] {
            b.reset(u32::MAX, 0);
            b.push(first, Encoding::RawRun, data);
            let err = for_each_record(b.payload(), 1000, PAGE_SIZE, |_| Ok(()));
            let err = if first == 8 { for_each_record(b.payload(), 10, PAGE_SIZE, |_| Ok(())) } else { err };
            assert!(err.unwrap_err().to_string().contains("pages.length"), "run of {} bytes from {first}", data.len());
        }
    }

    #[test]
    fn subpage_records_are_checked() {
        let mut b = PagesBuilder::new(1);
        let mut data = 0b11u64.to_le_bytes().to_vec();
        data.extend_from_slice(&[1u8; 256]);
        b.reset(0, 0);
        b.push(2, Encoding::Subpage, &data);
        let mut writes = Vec::new();
        for_each_record(b.payload(), 10, 128, |r| {
            for_each_subpage(r.data, 128, |off, bytes| writes.push((off, bytes.len())));
            Ok(())
        })
        .unwrap();
        assert_eq!(writes, vec![(0, 128), (128, 128)]);
        // Wrong length for the mask, a mask bit past the page, granularity 4096.
        b.reset(0, 0);
        b.push(2, Encoding::Subpage, &data[..200]);
        assert!(for_each_record(b.payload(), 10, 128, |_| Ok(())).is_err());
        let mut high = (1u64 << 40).to_le_bytes().to_vec();
        high.extend_from_slice(&[0u8; 128]);
        b.reset(0, 0);
        b.push(2, Encoding::Subpage, &high);
        assert!(for_each_record(b.payload(), 10, 128, |_| Ok(())).unwrap_err().to_string().contains("subpage_mask"));
        b.reset(0, 0);
        b.push(2, Encoding::Subpage, &data);
        assert!(for_each_record(b.payload(), 10, PAGE_SIZE, |_| Ok(())).is_err());
    }
}
