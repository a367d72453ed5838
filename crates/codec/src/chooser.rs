//! Picks a codec per page — zero, then an XBZRLE hit, then dedup (or
//! GM-RLE), else the raw page — and switches a codec off while it does
//! not pay at the current link bandwidth.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use crate::batch::BatchCodec;
use crate::dedup::{DedupDecoder, DedupEncoder};
use crate::error::CodecError;
use crate::xbzrle::{Outcome, XbzrleDecoder, XbzrleEncoder};
use crate::{rle, zero, PAGE};

/// Record tag of a GM-RLE page.
pub const TAG_RLE: u8 = 3;
/// Record tag of an XBZRLE page.
pub const TAG_XBZRLE: u8 = 4;
/// Record tag of a dedup page.
pub const TAG_DEDUP: u8 = 5;

/// Default XBZRLE cache: 512 MiB, as GMigrate and the SPP paper used.
pub const DEFAULT_XBZRLE_CACHE: usize = 512 << 20;
/// Default dedup chunk cache.
pub const DEFAULT_DEDUP_CACHE: usize = 64 << 20;

/// Which codecs a stream uses, and their cache sizes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CodecList {
    /// Detect all-zero pages.
    pub zero: bool,
    /// GM-RLE for pages no cached codec took.
    pub rle: bool,
    /// XBZRLE with a page cache of this many bytes.
    pub xbzrle: Option<usize>,
    /// Dedup with a chunk cache of this many bytes.
    pub dedup: Option<usize>,
    /// lz4 or zstd over each batch.
    pub batch: Option<BatchCodec>,
}

impl CodecList {
    /// True when only raw pages (and maybe zero records) are sent.
    pub fn is_plain(&self) -> bool {
        !self.rle && self.xbzrle.is_none() && self.dedup.is_none() && self.batch.is_none()
    }
}

fn parse_bytes(text: &str) -> Option<usize> {
    let t = text.to_ascii_lowercase();
    let (digits, shift) = match t.chars().last()? {
        'k' => (&t[..t.len() - 1], 10),
        'm' => (&t[..t.len() - 1], 20),
        'g' => (&t[..t.len() - 1], 30),
        _ => (t.as_str(), 0),
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

impl std::str::FromStr for CodecList {
    type Err = CodecError;

    /// `none`, or a comma list of `zero`, `rle`, `xbzrle[=SIZE]`,
    /// `dedup[=SIZE]`, `lz4`, `zstd[=LEVEL]`.
    fn from_str(s: &str) -> Result<CodecList, CodecError> {
        let mut list = CodecList::default();
        if s.trim() == "none" {
            return Ok(list);
        }
        let bad = |m: String| CodecError::BadList(m);
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (item, None),
            };
            let size = |default: usize| -> Result<usize, CodecError> {
                match value {
                    None => Ok(default),
                    Some(v) => parse_bytes(v)
                        .filter(|&b| (2 * PAGE..=(64usize << 30)).contains(&b))
                        .ok_or_else(|| bad(format!("'{item}': cache size must be 8K to 64G"))),
                }
            };
            match name {
                "zero" if value.is_none() => list.zero = true,
                "rle" if value.is_none() => list.rle = true,
                "xbzrle" => list.xbzrle = Some(size(DEFAULT_XBZRLE_CACHE)?),
                "dedup" => list.dedup = Some(size(DEFAULT_DEDUP_CACHE)?),
                "lz4" if value.is_none() => list.batch = Some(BatchCodec::Lz4),
                "zstd" => {
                    let level = match value {
                        None => 1,
                        Some(v) => v
                            .parse::<i32>()
                            .ok()
                            .filter(|l| (1..=19).contains(l))
                            .ok_or_else(|| bad(format!("'{item}': zstd level must be 1 to 19")))?,
                    };
                    list.batch = Some(BatchCodec::Zstd(level));
                }
                _ => {
                    return Err(bad(format!(
                    "unknown codec '{item}' (known: none, zero, rle, xbzrle[=SIZE], dedup[=SIZE], lz4, zstd[=LEVEL])"
                )))
                }
            }
        }
        Ok(list)
    }
}

impl std::fmt::Display for CodecList {
    /// The canonical form, as sent in a stream's setup.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.zero {
            parts.push("zero".to_string());
        }
        if let Some(b) = self.xbzrle {
            parts.push(format!("xbzrle={b}"));
        }
        if let Some(b) = self.dedup {
            parts.push(format!("dedup={b}"));
        }
        if self.rle {
            parts.push("rle".into());
        }
        match self.batch {
            Some(BatchCodec::Lz4) => parts.push("lz4".into()),
            Some(BatchCodec::Zstd(l)) => parts.push(format!("zstd={l}")),
            None => {}
        }
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

/// Pages, bytes in and bytes out of one codec.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CodecStats {
    /// Pages (or batches) it encoded.
    pub pages: u64,
    /// Bytes it was given.
    pub bytes_in: u64,
    /// Bytes it produced.
    pub bytes_out: u64,
}

/// What to send for a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoded {
    /// A zero record.
    Zero,
    /// The page as it is.
    Raw,
    /// A codec record with this tag; the bytes are in the output buffer.
    Record(u8),
}

/// Tracks whether a codec pays for its time at the current bandwidth, and
/// benches it for a while when it does not.
#[derive(Debug, Default, Clone, Copy)]
pub struct Payoff {
    seconds: f64,
    bytes_in: u64,
    bytes_out: u64,
    samples: u32,
    off_for: u32,
}

/// Pages (or batches) per payoff judgement.
const JUDGE_EVERY: u32 = 256;
/// Pages (or batches) a codec sits out when it does not pay.
const BENCH_FOR: u32 = 4096;

impl Payoff {
    /// Whether to use the codec for the next item.
    pub fn enabled(&mut self) -> bool {
        if self.off_for > 0 {
            self.off_for -= 1;
            return false;
        }
        true
    }

    /// Records one use; at the end of a window, judges it against
    /// `bandwidth` (bytes/s): wire time saved must exceed encode time.
    pub fn record(&mut self, seconds: f64, bytes_in: usize, bytes_out: usize, bandwidth: f64) {
        self.seconds += seconds;
        self.bytes_in += bytes_in as u64;
        self.bytes_out += bytes_out as u64;
        self.samples += 1;
        if self.samples >= JUDGE_EVERY {
            let saved = self.bytes_in.saturating_sub(self.bytes_out) as f64 / bandwidth.max(1.0);
            if saved <= self.seconds {
                self.off_for = BENCH_FOR;
            }
            *self = Payoff { off_for: self.off_for, ..Payoff::default() };
        }
    }
}

/// The sending side's codecs for one stream.
pub struct PageEncoder {
    list: CodecList,
    xbzrle: Option<XbzrleEncoder>,
    dedup: Option<DedupEncoder>,
    xbzrle_payoff: Payoff,
    dedup_payoff: Payoff,
    rle_payoff: Payoff,
    bandwidth: f64,
    /// Counters per codec name.
    pub stats: BTreeMap<&'static str, CodecStats>,
}

impl PageEncoder {
    /// Encoders for `list`.
    pub fn new(list: &CodecList) -> PageEncoder {
        PageEncoder {
            xbzrle: list.xbzrle.map(XbzrleEncoder::new),
            dedup: list.dedup.map(DedupEncoder::new),
            list: list.clone(),
            xbzrle_payoff: Payoff::default(),
            dedup_payoff: Payoff::default(),
            rle_payoff: Payoff::default(),
            bandwidth: f64::INFINITY,
            stats: BTreeMap::new(),
        }
    }

    /// The link's bytes per second, for the payoff judgements.
    pub fn set_bandwidth(&mut self, bytes_per_second: f64) {
        self.bandwidth = bytes_per_second;
    }

    fn count(&mut self, name: &'static str, bytes_out: usize) {
        let s = self.stats.entry(name).or_default();
        s.pages += 1;
        s.bytes_in += PAGE as u64;
        s.bytes_out += bytes_out as u64;
    }

    /// A page the caller sent raw without asking (e.g. a repair): keeps
    /// the XBZRLE cache in step with the decoder's `observe`.
    pub fn observe_raw(&mut self, index: u64, page: &[u8; PAGE]) {
        if let Some(x) = &mut self.xbzrle {
            x.observe(index, page);
        }
    }

    /// A page the caller sent as a zero record on its own.
    pub fn observe_zero(&mut self, index: u64) {
        if let Some(x) = &mut self.xbzrle {
            x.note_zero(index);
        }
    }

    /// The codec list.
    pub fn list(&self) -> &CodecList {
        &self.list
    }

    /// Counts a compressed batch.
    pub fn count_batch(&mut self, name: &'static str, bytes_in: usize, bytes_out: usize) {
        let s = self.stats.entry(name).or_default();
        s.pages += 1;
        s.bytes_in += bytes_in as u64;
        s.bytes_out += bytes_out as u64;
    }

    /// Chooses how to send `page`; codec records go into `out`.
    pub fn encode(&mut self, index: u64, page: &[u8; PAGE], out: &mut Vec<u8>) -> Encoded {
        if self.list.zero && zero::is_zero(page) {
            if let Some(x) = &mut self.xbzrle {
                x.note_zero(index);
            }
            self.count("zero", 0);
            return Encoded::Zero;
        }
        if let Some(x) = &mut self.xbzrle {
            if self.xbzrle_payoff.enabled() {
                let start = Instant::now();
                let outcome = x.encode(index, page, out);
                let seconds = start.elapsed().as_secs_f64();
                let produced = if outcome == Outcome::Encoded { out.len() } else { PAGE };
                if outcome != Outcome::Miss {
                    self.xbzrle_payoff.record(seconds, PAGE, produced, self.bandwidth);
                }
                if outcome == Outcome::Encoded {
                    self.count("xbzrle", out.len());
                    return Encoded::Record(TAG_XBZRLE);
                }
            } else {
                // Benched, but the caches must still see the page.
                x.observe(index, page);
            }
        }
        if let Some(d) = &mut self.dedup {
            if self.dedup_payoff.enabled() {
                let start = Instant::now();
                d.encode(page, out);
                self.dedup_payoff.record(start.elapsed().as_secs_f64(), PAGE, out.len(), self.bandwidth);
                self.count("dedup", out.len());
                return Encoded::Record(TAG_DEDUP);
            }
        }
        if self.list.rle && self.rle_payoff.enabled() {
            let start = Instant::now();
            let fits = rle::encode(page, out);
            let produced = if fits { out.len() } else { PAGE };
            self.rle_payoff.record(start.elapsed().as_secs_f64(), PAGE, produced, self.bandwidth);
            if fits {
                self.count("rle", out.len());
                return Encoded::Record(TAG_RLE);
            }
        }
        self.count("raw", PAGE);
        Encoded::Raw
    }
}

/// The receiving side's codecs for one stream.
pub struct PageDecoder {
    xbzrle: Option<XbzrleDecoder>,
    dedup: Option<DedupDecoder>,
    rle: bool,
}

impl PageDecoder {
    /// Decoders for `list` (the sender's list, from the stream's setup).
    pub fn new(list: &CodecList) -> PageDecoder {
        PageDecoder {
            xbzrle: list.xbzrle.map(XbzrleDecoder::new),
            dedup: list.dedup.map(DedupDecoder::new),
            rle: list.rle,
        }
    }

    /// Decodes a codec record of page `index` into `out`.
    pub fn decode(&mut self, index: u64, tag: u8, data: &[u8], out: &mut [u8; PAGE]) -> Result<(), CodecError> {
        match tag {
            TAG_XBZRLE => match &mut self.xbzrle {
                Some(x) => return x.decode(index, data, out),
                None => return Err(CodecError::UnknownTag { tag, page: index }),
            },
            TAG_DEDUP => match &mut self.dedup {
                Some(d) => d.decode(index, data, out)?,
                None => return Err(CodecError::UnknownTag { tag, page: index }),
            },
            TAG_RLE if self.rle => rle::decode(data, index, out)?,
            _ => return Err(CodecError::UnknownTag { tag, page: index }),
        }
        self.observe(index, out);
        Ok(())
    }

    /// A non-zero page that arrived raw: keeps the XBZRLE cache in step.
    pub fn observe(&mut self, index: u64, page: &[u8; PAGE]) {
        if let Some(x) = &mut self.xbzrle {
            x.observe(index, page);
        }
    }

    /// A page that arrived as a zero record.
    pub fn observe_zero(&mut self, index: u64) {
        if let Some(x) = &mut self.xbzrle {
            x.note_zero(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lists_parse_and_print() {
        let l: CodecList = "zero,xbzrle,dedup=1M,zstd=3".parse().unwrap();
        assert_eq!(l.xbzrle, Some(DEFAULT_XBZRLE_CACHE));
        assert_eq!(l.dedup, Some(1 << 20));
        assert_eq!(l.batch, Some(BatchCodec::Zstd(3)));
        assert_eq!(l.to_string().parse::<CodecList>().unwrap(), l);
        assert!("none".parse::<CodecList>().unwrap().is_plain());
        for bad in ["gzip", "zero=1", "xbzrle=1", "zstd=99", "dedup=lots"] {
            assert!(bad.parse::<CodecList>().is_err(), "{bad}");
        }
    }

    #[test]
    fn payoff_benches_a_slow_codec() {
        let mut p = Payoff::default();
        for _ in 0..JUDGE_EVERY {
            assert!(p.enabled());
            p.record(1e-3, PAGE, PAGE - 1, 1e9); // saves 1 ns of wire per 1 ms
        }
        assert!(!p.enabled());
    }

    /// How a page changes from one round to the next.
    fn mutate(page: &mut [u8; PAGE], kind: u8, seed: u64) {
        let mut x = seed | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        match kind % 5 {
            0 => page.iter_mut().for_each(|b| *b = next() as u8),
            1 => page.fill(0),
            2 => {
                for _ in 0..3 {
                    let i = next() as usize % PAGE;
                    page[i] = next() as u8;
                }
            }
            3 => {
                let chunk = next() as usize % 16 * 256;
                let src = next() as usize % 16 * 256;
                page.copy_within(src..src + 256, chunk);
            }
            _ => {
                for (i, w) in page.chunks_exact_mut(8).enumerate() {
                    w.copy_from_slice(&(seed + i as u64).to_le_bytes());
                }
            }
        }
    }

    /// Every codec list: decode(encode(p)) == p over a sequence of pages
    /// and mutations, and the caches stay in step.
    fn round_trip(list: &str, steps: &[(u8, u8, u64)]) {
        let list: CodecList = list.parse().unwrap();
        let mut enc = PageEncoder::new(&list);
        let mut dec = PageDecoder::new(&list);
        let mut pages = [[0u8; PAGE]; 8];
        let mut out = Vec::new();
        for &(which, kind, seed) in steps {
            let index = (which % 8) as u64;
            let page = &mut pages[index as usize];
            mutate(page, kind, seed);
            let mut back = [0x55u8; PAGE];
            match enc.encode(index, page, &mut out) {
                Encoded::Zero => {
                    dec.observe_zero(index);
                    back = [0u8; PAGE];
                }
                Encoded::Raw => {
                    back = *page;
                    dec.observe(index, &back);
                }
                Encoded::Record(tag) => {
                    assert!(out.len() <= PAGE + 2, "record of {} bytes", out.len());
                    dec.decode(index, tag, &out, &mut back).unwrap();
                }
            }
            assert_eq!(&back, page, "page {index} after mutation {kind}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_codec_round_trips(steps in proptest::collection::vec((any::<u8>(), any::<u8>(), any::<u64>()), 1..60)) {
            for list in ["none", "zero", "zero,rle", "zero,xbzrle=16K", "xbzrle=8K", "zero,dedup=64K", "zero,xbzrle=16K,dedup=64K", "zero,xbzrle=16K,rle"] {
                round_trip(list, &steps);
            }
        }

        #[test]
        fn hostile_records_never_panic(tag in 0u8..8, data in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let list: CodecList = "zero,xbzrle=16K,dedup=64K,rle".parse().unwrap();
            let mut dec = PageDecoder::new(&list);
            let mut out = [0u8; PAGE];
            let _ = dec.decode(1, tag, &data, &mut out);
        }
    }
}
