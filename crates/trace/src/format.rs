//! The trace file: what a running VM dirtied, interval by interval.
//! docs/trace-format.md is the reference; this is its code.
//!
//! ```text
//! header   magic "TSBTRACE", version u32, then a record
//! records  length u32, crc32c u32, payload[length]   (repeated)
//!          first record: the setup; second: the initial non-zero pages;
//!          then one record per interval.
//! ```

use std::io::{Read, Write};

use tsubame_codec::PAGE_SIZE;

/// First bytes of every trace file.
pub const MAGIC: [u8; 8] = *b"TSBTRACE";
/// Version of the layout written (2 added the guest's ops counter; 1 is
/// still read).
pub const VERSION: u32 = 2;
/// Largest record accepted (an interval where all of 64 GiB changed
/// needs ~16 M entries of a few bytes: records are split well below this).
pub const MAX_RECORD: usize = 64 << 20;
/// Largest memory a trace may describe.
pub const MAX_MEMORY: u64 = 64 << 30;

/// What can be wrong with a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading or writing the file.
    #[error("trace file")]
    Io(#[from] std::io::Error),
    /// Not a trace file.
    #[error("not a tsubame trace (bad magic)")]
    BadMagic,
    /// Another version.
    #[error("trace version {0} is not supported (this tsubame reads version {VERSION})")]
    BadVersion(u32),
    /// The file ends inside a record.
    #[error("trace is truncated (cut inside a record)")]
    Truncated,
    /// A record failed its checksum.
    #[error("trace record {0} is corrupted (CRC32C mismatch)")]
    BadCrc(u64),
    /// A field out of range.
    #[error("trace field {field} is invalid: {detail}")]
    BadField {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        detail: String,
    },
}

fn bad(field: &'static str, detail: impl Into<String>) -> TraceError {
    TraceError::BadField { field, detail: detail.into() }
}

/// What was traced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// Guest memory size.
    pub memory_bytes: u64,
    /// Sub-page size of the masks.
    pub granularity: u32,
    /// Requested interval between dirty-log reads, microseconds.
    pub interval_us: u32,
    /// The guest's workload command line.
    pub workload: String,
    /// The guest's speed before recording began (no dirty logging), in
    /// its progress lines' ops per second; 0 if unknown (version 1).
    pub native_ops_per_sec: u64,
    /// Guest memory asked for transparent huge pages (then KVM maps it in
    /// 2 MiB pieces until dirty logging splits them; version 2 on).
    pub huge_pages: bool,
}

impl Setup {
    /// Pages of guest memory.
    pub fn pages(&self) -> u64 {
        self.memory_bytes / (PAGE_SIZE as u64)
    }
}

/// One page dirtied in an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageChange {
    /// Guest page number.
    pub page: u64,
    /// Sub-pages that differ from the page's previous contents.
    pub mask: u64,
    /// Bytes an XBZRLE encoding of the change against the previous
    /// contents would take (QEMU's format: zero-run/literal-run varints).
    pub xbzrle_bytes: u32,
    /// The page is all zeros now.
    pub zero: bool,
}

/// One interval of the trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interval {
    /// Microseconds since recording started, at the dirty-log read.
    pub at_us: u64,
    /// The guest's ops counter (its latest progress line) at the read;
    /// 0 if unknown (version 1).
    pub ops: u64,
    /// Pages dirtied since the previous read, ascending.
    pub changes: Vec<PageChange>,
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], TraceError> {
        if self.bytes.len() < n {
            return Err(bad(field, "record ends early"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, TraceError> {
        Ok(u32::from_le_bytes(self.take(4, field)?.try_into().unwrap()))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, TraceError> {
        Ok(u64::from_le_bytes(self.take(8, field)?.try_into().unwrap()))
    }
    fn varint(&mut self, field: &'static str) -> Result<u64, TraceError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1, field)?[0];
            v |= ((b & 0x7F) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(bad(field, "varint longer than 64 bits"))
    }
}

/// Writes a trace.
pub struct TraceWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
}

impl<W: Write> TraceWriter<W> {
    /// Starts a trace: header, setup and the initially non-zero pages
    /// (one bit per page).
    pub fn new(mut out: W, setup: &Setup, nonzero: &[u64]) -> Result<Self, TraceError> {
        out.write_all(&MAGIC)?;
        out.write_all(&VERSION.to_le_bytes())?;
        let mut w = TraceWriter { out, buf: Vec::new() };
        let mut p = Vec::new();
        p.extend_from_slice(&setup.memory_bytes.to_le_bytes());
        p.extend_from_slice(&setup.granularity.to_le_bytes());
        p.extend_from_slice(&setup.interval_us.to_le_bytes());
        let name = setup.workload.as_bytes();
        p.extend_from_slice(&(name.len().min(1024) as u32).to_le_bytes());
        p.extend_from_slice(&name[..name.len().min(1024)]);
        p.extend_from_slice(&setup.native_ops_per_sec.to_le_bytes());
        p.extend_from_slice(&u32::from(setup.huge_pages).to_le_bytes());
        w.record(&p)?;
        let mut p = Vec::with_capacity(nonzero.len() * 8);
        for word in nonzero {
            p.extend_from_slice(&word.to_le_bytes());
        }
        w.record(&p)?;
        Ok(w)
    }

    fn record(&mut self, payload: &[u8]) -> Result<(), TraceError> {
        self.out.write_all(&(payload.len() as u32).to_le_bytes())?;
        self.out.write_all(&crc32c::crc32c(payload).to_le_bytes())?;
        self.out.write_all(payload)?;
        Ok(())
    }

    /// Appends one interval (changes ascending by page); `ops` is the
    /// guest's ops counter at the read.
    pub fn interval(&mut self, at_us: u64, ops: u64, changes: &[PageChange]) -> Result<(), TraceError> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.extend_from_slice(&at_us.to_le_bytes());
        buf.extend_from_slice(&ops.to_le_bytes());
        buf.extend_from_slice(&(changes.len() as u32).to_le_bytes());
        let mut next = 0u64;
        for c in changes {
            debug_assert!(c.page >= next, "changes must ascend");
            put_varint(&mut buf, c.page - next);
            next = c.page + 1;
            put_varint(&mut buf, c.mask);
            put_varint(&mut buf, c.xbzrle_bytes as u64);
            buf.push(c.zero as u8);
        }
        let result = self.record(&buf);
        self.buf = buf;
        result
    }

    /// Flushes and returns the writer.
    pub fn finish(mut self) -> Result<W, TraceError> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A whole trace in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// What was traced.
    pub setup: Setup,
    /// Pages non-zero when recording started, one bit each.
    pub nonzero: Vec<u64>,
    /// The intervals, in time order.
    pub intervals: Vec<Interval>,
}

fn read_record(r: &mut impl Read, index: u64, buf: &mut Vec<u8>) -> Result<bool, TraceError> {
    let mut head = [0u8; 8];
    match r.read(&mut head[..1])? {
        0 => return Ok(false),
        _ => r.read_exact(&mut head[1..]).map_err(|_| TraceError::Truncated)?,
    }
    let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
    if len > MAX_RECORD {
        return Err(bad("record.length", format!("{len} bytes (at most {MAX_RECORD})")));
    }
    buf.resize(len, 0);
    r.read_exact(buf).map_err(|_| TraceError::Truncated)?;
    if crc32c::crc32c(buf) != u32::from_le_bytes(head[4..].try_into().unwrap()) {
        return Err(TraceError::BadCrc(index));
    }
    Ok(true)
}

impl Trace {
    /// Reads and validates a whole trace.
    pub fn read(mut r: impl Read) -> Result<Trace, TraceError> {
        let mut head = [0u8; 12];
        r.read_exact(&mut head).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => TraceError::BadMagic,
            _ => TraceError::Io(e),
        })?;
        if head[..8] != MAGIC {
            return Err(TraceError::BadMagic);
        }
        let version = u32::from_le_bytes(head[8..].try_into().unwrap());
        if !(1..=VERSION).contains(&version) {
            return Err(TraceError::BadVersion(version));
        }
        let mut buf = Vec::new();
        if !read_record(&mut r, 0, &mut buf)? {
            return Err(TraceError::Truncated);
        }
        let mut c = Cursor { bytes: &buf };
        let memory_bytes = c.u64("setup.memory_bytes")?;
        let granularity = c.u32("setup.granularity")?;
        let interval_us = c.u32("setup.interval_us")?;
        let name_len = c.u32("setup.workload")? as usize;
        if name_len > 1024 {
            return Err(bad("setup.workload", format!("{name_len} bytes")));
        }
        let workload = String::from_utf8(c.take(name_len, "setup.workload")?.to_vec())
            .map_err(|_| bad("setup.workload", "not UTF-8"))?;
        let (native_ops_per_sec, flags) =
            if version >= 2 { (c.u64("setup.native_ops_per_sec")?, c.u32("setup.flags")?) } else { (0, 0) };
        if flags > 1 {
            return Err(bad("setup.flags", format!("{flags:#x} (only bit 0, huge pages, is defined)")));
        }
        if !c.bytes.is_empty() {
            return Err(bad("setup", format!("{} trailing bytes", c.bytes.len())));
        }
        if memory_bytes == 0 || memory_bytes > MAX_MEMORY || memory_bytes % (PAGE_SIZE as u64) != 0 {
            return Err(bad("setup.memory_bytes", memory_bytes.to_string()));
        }
        if !granularity.is_power_of_two() || !(64..=4096).contains(&granularity) {
            return Err(bad("setup.granularity", granularity.to_string()));
        }
        let setup =
            Setup { memory_bytes, granularity, interval_us, workload, native_ops_per_sec, huge_pages: flags == 1 };
        let pages = setup.pages();
        let words = pages.div_ceil(64) as usize;

        if !read_record(&mut r, 1, &mut buf)? {
            return Err(TraceError::Truncated);
        }
        if buf.len() != words * 8 {
            return Err(bad("nonzero", format!("{} bytes for {pages} pages", buf.len())));
        }
        let nonzero = buf.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap())).collect();

        let mut intervals = Vec::new();
        let mut index = 2;
        let mut last_at = 0;
        let mut last_ops = 0;
        while read_record(&mut r, index, &mut buf)? {
            let mut c = Cursor { bytes: &buf };
            let at_us = c.u64("interval.at_us")?;
            if at_us < last_at {
                return Err(bad("interval.at_us", format!("{at_us} goes back in time")));
            }
            last_at = at_us;
            let ops = if version >= 2 { c.u64("interval.ops")? } else { 0 };
            if ops < last_ops {
                return Err(bad("interval.ops", format!("{ops} goes back from {last_ops}")));
            }
            last_ops = ops;
            let count = c.u32("interval.count")? as u64;
            if count > pages {
                return Err(bad("interval.count", format!("{count} changes for {pages} pages")));
            }
            let mut changes = Vec::with_capacity(count as usize);
            let mut next = 0u64;
            for _ in 0..count {
                let page = next
                    .checked_add(c.varint("change.page")?)
                    .filter(|&p| p < pages)
                    .ok_or_else(|| bad("change.page", format!("beyond the last page {}", pages - 1)))?;
                next = page + 1;
                let mask = c.varint("change.mask")?;
                let per_page = 4096 / granularity as u64;
                if per_page < 64 && mask >> per_page != 0 {
                    return Err(bad("change.mask", format!("{mask:#x} has bits past sub-page {per_page}")));
                }
                let xbzrle_bytes = c.varint("change.xbzrle_bytes")?;
                if xbzrle_bytes > 2 * (PAGE_SIZE as u64) {
                    return Err(bad("change.xbzrle_bytes", xbzrle_bytes.to_string()));
                }
                let zero = match c.take(1, "change.zero")?[0] {
                    0 => false,
                    1 => true,
                    other => return Err(bad("change.zero", other.to_string())),
                };
                changes.push(PageChange { page, mask, xbzrle_bytes: xbzrle_bytes as u32, zero });
            }
            if !c.bytes.is_empty() {
                return Err(bad("interval", format!("{} trailing bytes", c.bytes.len())));
            }
            intervals.push(Interval { at_us, ops, changes });
            index += 1;
        }
        Ok(Trace { setup, nonzero, intervals })
    }

    /// Reads a trace file.
    pub fn open(path: &std::path::Path) -> Result<Trace, TraceError> {
        Trace::read(std::io::BufReader::new(std::fs::File::open(path)?))
    }

    /// Recording length in seconds (time of the last interval).
    pub fn duration_s(&self) -> f64 {
        self.intervals.last().map_or(0.0, |i| i.at_us as f64 / 1e6)
    }

    /// Number of pages non-zero at the start.
    pub fn nonzero_pages(&self) -> u64 {
        self.nonzero.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Whether `page` was non-zero when recording started.
    pub fn is_nonzero(&self, page: u64) -> bool {
        self.nonzero[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// Whether the trace knows the guest's progress (ops counter and its
    /// speed before recording), so replay can follow guest work rather
    /// than wall time.
    pub fn has_guest_ops(&self) -> bool {
        self.setup.native_ops_per_sec > 0
            && self.intervals.last().zip(self.intervals.first()).is_some_and(|(l, f)| l.ops > f.ops)
    }
}

/// Bytes of the XBZRLE record that turns `old` into `new` (two pages), or
/// None when the codec would send the page raw instead. It runs the codec
/// itself, so the estimate is the record the migration would send.
pub fn xbzrle_size(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE]) -> Option<u32> {
    let mut record = Vec::with_capacity(PAGE_SIZE);
    tsubame_codec::xbzrle::encode_delta(old, new, &mut record, tsubame_codec::xbzrle::MAX_RECORD)
        .then_some(record.len() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Setup, Vec<u64>, Vec<Interval>) {
        let setup = Setup {
            memory_bytes: 1 << 20,
            granularity: 128,
            interval_us: 10_000,
            workload: "workload=kv".into(),
            native_ops_per_sec: 1_000_000,
            huge_pages: true,
        };
        let nonzero = vec![0b1011, 0, 0, 0];
        let intervals = vec![
            Interval {
                at_us: 10_000,
                ops: 5_000,
                changes: vec![
                    PageChange { page: 3, mask: 1, xbzrle_bytes: 12, zero: false },
                    PageChange { page: 200, mask: u32::MAX as u64, xbzrle_bytes: 4096, zero: true },
                ],
            },
            Interval { at_us: 20_000, ops: 9_000, changes: vec![] },
        ];
        (setup, nonzero, intervals)
    }

    fn encode() -> Vec<u8> {
        let (setup, nonzero, intervals) = sample();
        let mut w = TraceWriter::new(Vec::new(), &setup, &nonzero).unwrap();
        for i in &intervals {
            w.interval(i.at_us, i.ops, &i.changes).unwrap();
        }
        w.finish().unwrap()
    }

    #[test]
    fn round_trip() {
        let (setup, nonzero, intervals) = sample();
        let t = Trace::read(encode().as_slice()).unwrap();
        assert_eq!(t, Trace { setup, nonzero, intervals });
        assert_eq!(t.nonzero_pages(), 3);
        assert!((t.duration_s() - 0.02).abs() < 1e-9);
    }

    #[test]
    fn bad_files_are_refused_clearly() {
        let good = encode();
        assert!(matches!(Trace::read(&b"NOTATRACE..."[..]), Err(TraceError::BadMagic)));
        assert!(matches!(Trace::read(&b"TSB"[..]), Err(TraceError::BadMagic)));
        let mut v3 = good.clone();
        v3[8] = 3;
        assert!(matches!(Trace::read(v3.as_slice()), Err(TraceError::BadVersion(3))));
        for cut in [13, 30, good.len() - 1] {
            let err = Trace::read(&good[..cut]).unwrap_err();
            assert!(matches!(err, TraceError::Truncated), "cut at {cut}: {err}");
        }
        let mut flipped = good.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 1;
        assert!(matches!(Trace::read(flipped.as_slice()), Err(TraceError::BadCrc(_))));
    }

    #[test]
    fn hostile_bytes_never_panic() {
        // Flip, cut and splice a valid trace at every position.
        let good = encode();
        for i in 0..good.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = good.clone();
                bad[i] ^= bit;
                let _ = Trace::read(bad.as_slice());
            }
            let _ = Trace::read(&good[..i]);
        }
        let mut seed = 0x1234_5678_9abc_def0u64;
        for _ in 0..2000 {
            let mut bytes = good[..12].to_vec();
            for _ in 0..64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                bytes.push(seed as u8);
            }
            let _ = Trace::read(bytes.as_slice());
        }
    }

    /// The estimate is the record the cache-keeping encoder sends, byte
    /// for byte, including its rule for 1–2-byte gaps.
    #[test]
    fn xbzrle_size_is_the_codecs_record_length() {
        use tsubame_codec::xbzrle::{Outcome, XbzrleEncoder};
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut encoder = XbzrleEncoder::new(64 << 20);
        let mut record = Vec::new();
        for index in 0..2000u64 {
            let mut old = [0u8; PAGE_SIZE];
            old.iter_mut().for_each(|b| *b = next() as u8);
            let mut new = old;
            // Sparse bytes, short gaps, long runs, or most of the page.
            let changes = [1, 3, 40, 400, 3000][(next() % 5) as usize];
            let mut at = (next() % PAGE_SIZE as u64) as usize;
            for _ in 0..changes {
                new[at] = new[at].wrapping_add(1 + (next() % 255) as u8);
                at = (at + 1 + (next() % [3, 4, 64][(next() % 3) as usize]) as usize) % PAGE_SIZE;
            }
            assert_eq!(encoder.encode(index, &old, &mut record), Outcome::Miss);
            let expected = match encoder.encode(index, &new, &mut record) {
                Outcome::Encoded => Some(record.len() as u32),
                Outcome::Overflow => None,
                Outcome::Miss => unreachable!("page {index} was just cached"),
            };
            assert_eq!(xbzrle_size(&old, &new), expected, "page pair {index} ({changes} changes)");
        }
    }

    #[test]
    fn xbzrle_sizes() {
        let old = [0u8; 4096];
        let mut new = old;
        assert_eq!(xbzrle_size(&old, &new), Some(0));
        new[100] = 1;
        assert_eq!(xbzrle_size(&old, &new), Some(1 + 1 + 1));
        assert_eq!(xbzrle_size(&old, &[1u8; 4096]), None);
    }
}
