//! Picks a codec per page — zero, then an XBZRLE hit, then dedup, then
//! GM-RLE, else the raw page — and switches a codec off while it does not
//! pay at the current link bandwidth (GMigrate saw compression raise
//! downtime tenfold on small final rounds).

use std::time::Instant;

use serde::ser::SerializeMap;
use serde::Serialize;

use crate::codec_list::CodecList;
use crate::dedup::{DedupDecoder, DedupEncoder, DedupStats};
use crate::error::CodecError;
pub use crate::payoff::{Payoff, UNKNOWN_SAVING};
use crate::xbzrle::{CacheStats, Outcome, XbzrleDecoder, XbzrleEncoder};
use crate::{rle, zero, DecodePage, EncodePage, Encoded, PAGE_SIZE, TAG_DEDUP, TAG_RAW, TAG_RLE, TAG_XBZRLE, TAG_ZERO};

/// A codec, for statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Zero records.
    Zero,
    /// XBZRLE records.
    Xbzrle,
    /// Dedup records.
    Dedup,
    /// GM-RLE records.
    Rle,
    /// Raw pages.
    Raw,
    /// lz4 batches.
    Lz4,
    /// zstd batches.
    Zstd,
}

impl Codec {
    const ALL: [Codec; 7] = [Codec::Zero, Codec::Xbzrle, Codec::Dedup, Codec::Rle, Codec::Raw, Codec::Lz4, Codec::Zstd];

    /// The name in statistics.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Zero => "zero",
            Codec::Xbzrle => "xbzrle",
            Codec::Dedup => "dedup",
            Codec::Rle => "rle",
            Codec::Raw => "raw",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }
}

/// What one codec did over a stream. Bytes out are the codec's own bytes,
/// without the caller's record header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CodecStats {
    /// Pages (or batches) it encoded.
    pub pages: u64,
    /// Bytes it was given.
    pub bytes_in: u64,
    /// Bytes it produced.
    pub bytes_out: u64,
    /// Input bytes whose encoding was timed (a sample).
    pub timed_bytes: u64,
    /// Nanoseconds those took.
    pub timed_ns: u64,
    /// Times it was switched off for not paying.
    pub switched_off: u64,
}

impl CodecStats {
    /// Bytes out per byte in.
    pub fn ratio(&self) -> f64 {
        self.bytes_out as f64 / self.bytes_in.max(1) as f64
    }

    /// Measured encode time per input byte.
    pub fn ns_per_byte(&self) -> f64 {
        self.timed_ns as f64 / self.timed_bytes.max(1) as f64
    }
}

/// Per-codec statistics; serializes as a map from name to
/// [`CodecStats`], listing only codecs that were used.
#[derive(Debug, Clone, Default)]
pub struct StatsTable([CodecStats; 7]);

impl StatsTable {
    /// One codec's statistics.
    pub fn get(&self, codec: Codec) -> &CodecStats {
        &self.0[codec as usize]
    }

    fn get_mut(&mut self, codec: Codec) -> &mut CodecStats {
        &mut self.0[codec as usize]
    }

    /// (name, statistics) of every codec that was used or switched off.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &CodecStats)> {
        Codec::ALL.iter().map(|&c| (c.name(), self.get(c))).filter(|(_, s)| s.pages > 0 || s.switched_off > 0)
    }

    fn count(&mut self, codec: Codec, bytes_in: usize, bytes_out: usize) {
        let s = self.get_mut(codec);
        s.pages += 1;
        s.bytes_in += bytes_in as u64;
        s.bytes_out += bytes_out as u64;
    }
}

impl Serialize for StatsTable {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        for (name, stats) in self.iter() {
            map.serialize_entry(name, stats)?;
        }
        map.end()
    }
}

/// The caches' own counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheReport {
    /// The XBZRLE page cache, when in use.
    pub xbzrle: Option<CacheStats>,
    /// The dedup chunk cache, when in use.
    pub dedup: Option<DedupStats>,
}

/// One page in this many has its encoding timed (a clock read costs
/// about as much as encoding 1 KiB).
const TIME_ONE_IN: u32 = 8;

/// The sending side's codecs for one stream.
pub struct PageEncoder {
    list: CodecList,
    xbzrle: Option<XbzrleEncoder>,
    dedup: Option<DedupEncoder>,
    xbzrle_payoff: Payoff,
    dedup_payoff: Payoff,
    rle_payoff: Payoff,
    bandwidth: f64,
    tick: u32,
    /// Counters per codec.
    pub stats: StatsTable,
}

/// A timer that reads the clock only on sampled pages.
struct Sample(Option<Instant>);

impl Sample {
    fn seconds(&self) -> Option<f64> {
        self.0.map(|t| t.elapsed().as_secs_f64())
    }
}

fn record(payoff: &mut Payoff, stats: &mut CodecStats, timed: Option<f64>, bytes_out: usize, bandwidth: f64) {
    match timed {
        Some(seconds) => {
            payoff.record(seconds, PAGE_SIZE, bytes_out, bandwidth);
            stats.timed_bytes += PAGE_SIZE as u64;
            stats.timed_ns += (seconds * 1e9) as u64;
        }
        None => payoff.record_untimed(PAGE_SIZE, bytes_out, bandwidth),
    }
    stats.switched_off = payoff.switched_off();
}

impl PageEncoder {
    /// Encoders for `list` (caches allocated now, backed lazily).
    pub fn new(list: &CodecList) -> PageEncoder {
        PageEncoder {
            xbzrle: list.xbzrle.map(XbzrleEncoder::new),
            dedup: list.dedup.map(DedupEncoder::new),
            list: list.clone(),
            xbzrle_payoff: Payoff::default(),
            dedup_payoff: Payoff::default(),
            rle_payoff: Payoff::default(),
            bandwidth: f64::INFINITY,
            tick: 0,
            stats: StatsTable::default(),
        }
    }

    /// The link's bytes per second, for the payoff judgements (not finite
    /// or not positive: unknown, codecs stay on).
    pub fn set_bandwidth(&mut self, bytes_per_second: f64) {
        self.bandwidth = bytes_per_second;
    }

    /// Keeps every codec on whether it pays or not, as the GPU encoder
    /// does (the reference its records are compared with, byte for byte).
    pub fn keep_codecs_on(&mut self) {
        self.xbzrle_payoff = Payoff::always_on();
        self.dedup_payoff = Payoff::always_on();
        self.rle_payoff = Payoff::always_on();
    }

    /// The codec list.
    pub fn list(&self) -> &CodecList {
        &self.list
    }

    /// The caches' counters.
    pub fn cache_stats(&self) -> CacheReport {
        CacheReport {
            xbzrle: self.xbzrle.as_ref().map(|x| x.cache.stats),
            dedup: self.dedup.as_ref().map(|d| d.cache.stats),
        }
    }

    /// True when `decoder`'s caches hold exactly what ours do (a check for
    /// tests and debugging; compares every cached byte).
    pub fn same_caches(&self, decoder: &PageDecoder) -> bool {
        let x = match (&self.xbzrle, &decoder.xbzrle) {
            (Some(e), Some(d)) => e.cache.same_state(&d.cache),
            (None, None) => true,
            _ => false,
        };
        let d = match (&self.dedup, &decoder.dedup) {
            (Some(e), Some(d)) => e.cache.same_state(&d.cache),
            (None, None) => true,
            _ => false,
        };
        x && d
    }

    /// Whether each switchable codec is in use now: (xbzrle, dedup, rle).
    pub fn enabled_now(&self) -> (bool, bool, bool) {
        (self.xbzrle_payoff.is_on(), self.dedup_payoff.is_on(), self.rle_payoff.is_on())
    }

    /// A page the caller sent raw without asking (e.g. a repair): keeps
    /// the XBZRLE cache in step with the decoder's `observe`.
    pub fn observe_raw(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
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

    /// Counts a record another encoder (the GPU's) made for one page:
    /// `tag` is its record tag, `bytes_out` its length.
    pub fn count_record(&mut self, tag: u8, bytes_out: usize) {
        let codec = match tag {
            crate::TAG_ZERO => Codec::Zero,
            crate::TAG_RLE => Codec::Rle,
            crate::TAG_XBZRLE => Codec::Xbzrle,
            crate::TAG_DEDUP => Codec::Dedup,
            _ => Codec::Raw,
        };
        self.stats.count(codec, PAGE_SIZE, bytes_out);
    }

    /// Counts a compressed batch under `name` ("lz4" or "zstd").
    pub fn count_batch(&mut self, name: &str, bytes_in: usize, bytes_out: usize) {
        let codec = match name {
            "lz4" => Codec::Lz4,
            "zstd" => Codec::Zstd,
            _ => return,
        };
        self.stats.count(codec, bytes_in, bytes_out);
    }

    /// Chooses how to send `page`; a codec record goes into `out`.
    pub fn encode(&mut self, index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Encoded {
        if self.list.zero && zero::is_zero(page) {
            if let Some(x) = &mut self.xbzrle {
                x.note_zero(index);
            }
            self.stats.count(Codec::Zero, PAGE_SIZE, 0);
            return Encoded::Zero;
        }
        self.tick = self.tick.wrapping_add(1);
        let timed = self.tick.is_multiple_of(TIME_ONE_IN);
        let clock = || Sample(timed.then(Instant::now));
        let bw = self.bandwidth;
        if let Some(x) = &mut self.xbzrle {
            if self.xbzrle_payoff.enabled() {
                let t = clock();
                let outcome = x.encode(index, page, out);
                if outcome != Outcome::Miss {
                    let produced = if outcome == Outcome::Encoded { out.len() } else { PAGE_SIZE };
                    let stats = self.stats.get_mut(Codec::Xbzrle);
                    record(&mut self.xbzrle_payoff, stats, t.seconds(), produced, bw);
                }
                if outcome == Outcome::Encoded {
                    self.stats.count(Codec::Xbzrle, PAGE_SIZE, out.len());
                    return Encoded::Record(TAG_XBZRLE);
                }
            } else {
                // Benched, but both caches must still see the page.
                x.observe(index, page);
            }
        }
        if let Some(d) = &mut self.dedup {
            if self.dedup_payoff.enabled() {
                let t = clock();
                d.encode(page, out);
                let stats = self.stats.get_mut(Codec::Dedup);
                record(&mut self.dedup_payoff, stats, t.seconds(), out.len(), bw);
                self.stats.count(Codec::Dedup, PAGE_SIZE, out.len());
                return Encoded::Record(TAG_DEDUP);
            }
        }
        if self.list.rle && self.rle_payoff.enabled() {
            let t = clock();
            let fits = rle::encode(page, out);
            let produced = if fits { out.len() } else { PAGE_SIZE };
            record(&mut self.rle_payoff, self.stats.get_mut(Codec::Rle), t.seconds(), produced, bw);
            if fits {
                self.stats.count(Codec::Rle, PAGE_SIZE, out.len());
                return Encoded::Record(TAG_RLE);
            }
        }
        self.stats.count(Codec::Raw, PAGE_SIZE, PAGE_SIZE);
        Encoded::Raw
    }
}

impl EncodePage for PageEncoder {
    fn encode(&mut self, index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Encoded {
        PageEncoder::encode(self, index, page, out)
    }

    fn observe_raw(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        PageEncoder::observe_raw(self, index, page)
    }

    fn observe_zero(&mut self, index: u64) {
        PageEncoder::observe_zero(self, index)
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

    /// Decodes a record with `tag` of page `index` into `out`. Raw and
    /// zero records are accepted too (and observed).
    pub fn decode(&mut self, index: u64, tag: u8, data: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        let unknown = CodecError::UnknownTag { tag, page: index };
        match tag {
            TAG_RAW => {
                let page: &[u8; PAGE_SIZE] = data.try_into().map_err(|_| {
                    if data.len() < PAGE_SIZE {
                        CodecError::Truncated { codec: "raw", page: index }
                    } else {
                        CodecError::Trailing { codec: "raw", page: index, extra: data.len() - PAGE_SIZE }
                    }
                })?;
                out.copy_from_slice(page);
            }
            TAG_ZERO => {
                if !data.is_empty() {
                    return Err(CodecError::Trailing { codec: "zero", page: index, extra: data.len() });
                }
                out.fill(0);
                self.observe_zero(index);
                return Ok(());
            }
            TAG_XBZRLE => return self.xbzrle.as_mut().ok_or(unknown)?.decode(index, data, out),
            TAG_DEDUP => self.dedup.as_mut().ok_or(unknown)?.decode(index, data, out)?,
            TAG_RLE if self.rle => rle::decode(data, index, out)?,
            _ => return Err(unknown),
        }
        self.observe(index, out);
        Ok(())
    }

    /// Whether a page that arrived another way (in sub-pages) must be
    /// observed: the XBZRLE cache keeps whole pages.
    pub fn keeps_pages(&self) -> bool {
        self.xbzrle.is_some()
    }

    /// A non-zero page that arrived raw: keeps the XBZRLE cache in step.
    pub fn observe(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
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

impl DecodePage for PageDecoder {
    fn decode(&mut self, index: u64, tag: u8, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        PageDecoder::decode(self, index, tag, input, out)
    }

    fn observe(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        PageDecoder::observe(self, index, page)
    }

    fn observe_zero(&mut self, index: u64) {
        PageDecoder::observe_zero(self, index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chooser_switches_a_codec_off_on_a_fast_link_and_back_on() {
        let list: CodecList = "rle".parse().unwrap();
        let mut enc = PageEncoder::new(&list);
        enc.set_bandwidth(1e15); // nothing pays at a petabyte per second
        let page = [0u8; PAGE_SIZE];
        let mut out = Vec::new();
        let mut raw = 0;
        for i in 0..10_000 {
            if enc.encode(i, &page, &mut out) == Encoded::Raw {
                raw += 1;
            }
        }
        assert!(raw > 4096, "{raw} raw pages");
        assert!(enc.stats.get(Codec::Rle).switched_off >= 2, "it was tried again");
        enc.set_bandwidth(1e6);
        for i in 0..5_000 {
            enc.encode(i, &page, &mut out);
        }
        assert!(enc.enabled_now().2, "pays at 1 MB/s");
        let json = serde_json_like(&enc.stats);
        assert!(json.contains("rle") && json.contains("raw") && !json.contains("dedup"), "{json}");
    }

    /// The names a StatsTable serializes, without a JSON dependency.
    fn serde_json_like(t: &StatsTable) -> String {
        t.iter().map(|(n, s)| format!("{n}:{}/{}", s.bytes_in, s.bytes_out)).collect::<Vec<_>>().join(",")
    }

    #[test]
    fn decode_accepts_raw_and_zero_records_and_rejects_others() {
        let list: CodecList = "zero,xbzrle=16K".parse().unwrap();
        let mut dec = PageDecoder::new(&list);
        let mut out = [1u8; PAGE_SIZE];
        dec.decode(1, TAG_ZERO, &[], &mut out).unwrap();
        assert_eq!(out, [0u8; PAGE_SIZE]);
        dec.decode(1, TAG_RAW, &[7; PAGE_SIZE], &mut out).unwrap();
        assert_eq!(dec.xbzrle.as_ref().unwrap().cache.peek(1), Some(&[7; PAGE_SIZE]));
        assert!(dec.decode(1, TAG_RAW, &[7; 100], &mut out).is_err());
        assert!(dec.decode(1, TAG_ZERO, &[0], &mut out).is_err());
        let e = dec.decode(17, TAG_DEDUP, &[], &mut out).unwrap_err();
        assert_eq!(e.to_string(), "page 17 uses codec tag 5, which this stream did not enable");
    }
}
