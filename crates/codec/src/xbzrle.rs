//! XBZRLE (QEMU's delta encoding, GMigrate's XBRLE / GM-DeltaC): keep the
//! last sent version of pages in a cache; send a page as the runs of bytes
//! where it differs from the cached version (the runs where the XOR of the
//! two is non-zero), carrying the new bytes, as QEMU does.
//!
//! Record: repeated `unchanged_run varint, literal_len varint, literal
//! bytes` (literal_len >= 1; the trailing unchanged run is implicit, so an
//! unchanged page is an empty record). Gaps of 1 or 2 unchanged bytes
//! inside a change are sent as literal bytes: a new run would cost 2.
//!
//! The cache is 2-way set-associative by page number with one LRU bit per
//! set; encoder and decoder update it in the same order, so they stay
//! identical. The difference is found 64 bytes at a time as a bit mask
//! (AVX-512BW, AVX2 or 64-bit words), so the unchanged parts of a page
//! cost one compare per 64 bytes and the cache is written only where the
//! page changed.

use serde::Serialize;

use crate::error::CodecError;
use crate::{varint, DecodePage, EncodePage, Encoded, PAGE_SIZE, TAG_XBZRLE};

/// Cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Lookups that found the page.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Inserts that pushed another page out.
    pub evictions: u64,
}

const EMPTY: u64 = u64::MAX;

/// Longest record sent: a delta that would take a whole page goes raw.
pub const MAX_RECORD: usize = PAGE_SIZE - 1;

/// The page cache both ends keep.
#[derive(Clone)]
pub struct PageCache {
    sets: usize,
    /// Page index per slot (`set * 2 + way`), EMPTY when free.
    tags: Vec<u64>,
    /// Per set: the way to evict next.
    lru: Vec<u8>,
    data: Vec<u8>,
    /// Counters.
    pub stats: CacheStats,
}

impl PageCache {
    /// A cache of about `bytes` (at least two pages). The data is one
    /// zeroed allocation, which the OS backs only as pages arrive.
    pub fn new(bytes: usize) -> PageCache {
        let sets = largest_prime_at_most(bytes / PAGE_SIZE / 2);
        PageCache {
            sets,
            tags: vec![EMPTY; sets * 2],
            lru: vec![0; sets],
            data: vec![0u8; sets * 2 * PAGE_SIZE],
            stats: CacheStats::default(),
        }
    }

    /// Bytes of page data the cache can hold.
    pub fn capacity_bytes(&self) -> usize {
        self.data.len()
    }

    /// The set of a page: its number modulo the (prime) number of sets.
    /// Consecutive pages, and pages with a stride (one channel's share of
    /// memory), fill every set before any set takes a third page.
    fn set_of(&self, page: u64) -> usize {
        (page % self.sets as u64) as usize
    }

    /// The slot holding `page`, marking it recently used.
    fn lookup(&mut self, page: u64) -> Option<usize> {
        let set = self.set_of(page);
        for way in 0..2 {
            if self.tags[set * 2 + way] == page {
                self.lru[set] = 1 - way as u8;
                self.stats.hits += 1;
                return Some(set * 2 + way);
            }
        }
        self.stats.misses += 1;
        None
    }

    /// Puts `page` in its set's least recently used way.
    fn insert(&mut self, page: u64, contents: &[u8; PAGE_SIZE]) {
        let set = self.set_of(page);
        let way = self.lru[set] as usize;
        let slot = set * 2 + way;
        if self.tags[slot] != EMPTY {
            self.stats.evictions += 1;
        }
        self.tags[slot] = page;
        self.lru[set] = 1 - way as u8;
        self.slot_mut(slot).copy_from_slice(contents);
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8; PAGE_SIZE] {
        (&mut self.data[slot * PAGE_SIZE..(slot + 1) * PAGE_SIZE]).try_into().unwrap()
    }

    /// The cached copy of `page`, without marking it used.
    pub fn peek(&self, page: u64) -> Option<&[u8; PAGE_SIZE]> {
        let set = self.set_of(page);
        (0..2)
            .map(|way| set * 2 + way)
            .find(|&slot| self.tags[slot] == page)
            .map(|slot| (&self.data[slot * PAGE_SIZE..(slot + 1) * PAGE_SIZE]).try_into().unwrap())
    }

    /// True when both caches hold the same pages, contents and LRU state.
    pub fn same_state(&self, other: &PageCache) -> bool {
        self.tags == other.tags && self.lru == other.lru && self.data == other.data
    }

    /// A non-zero page that was sent another way: update or insert.
    fn observe(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        match self.lookup(index) {
            Some(slot) => self.slot_mut(slot).copy_from_slice(page),
            None => self.insert(index, page),
        }
    }

    /// A page sent as zeros: a cached copy becomes zeros (no insert, the
    /// LRU bit untouched).
    fn note_zero(&mut self, index: u64) {
        let set = self.set_of(index);
        for way in 0..2 {
            if self.tags[set * 2 + way] == index {
                self.slot_mut(set * 2 + way).fill(0);
            }
        }
    }
}

/// The number of sets: the largest prime not above `n` (1 for n <= 1).
fn largest_prime_at_most(n: usize) -> usize {
    let is_prime = |k: usize| k >= 2 && (2..).take_while(|d| d * d <= k).all(|d| !k.is_multiple_of(d));
    (2..=n).rev().find(|&k| is_prime(k)).unwrap_or(1)
}

/// Per 64-byte line of the page, bit i set when byte i differs.
type Masks = [u64; PAGE_SIZE / 64];

fn diff_masks(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], masks: &mut Masks) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512F/BW (checked just above).
            return unsafe { x86::diff_masks_avx512(old, new, masks) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { x86::diff_masks_avx2(old, new, masks) };
        }
    }
    diff_masks_portable(old, new, masks)
}

fn diff_masks_portable(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], masks: &mut Masks) {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    for ((m, a), b) in masks.iter_mut().zip(old.chunks_exact(64)).zip(new.chunks_exact(64)) {
        let mut bits = 0u64;
        for (w, (a, b)) in a.chunks_exact(8).zip(b.chunks_exact(8)).enumerate() {
            let x = u64::from_le_bytes(a.try_into().unwrap()) ^ u64::from_le_bytes(b.try_into().unwrap());
            // High bit of each byte set when the byte is non-zero...
            let high = ((x & LOW7).wrapping_add(LOW7) | x) & !LOW7;
            // ...gathered into 8 bits, byte 0 lowest.
            bits |= ((high >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * w);
        }
        *m = bits;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Masks, PAGE_SIZE};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn diff_masks_avx512(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], masks: &mut Masks) {
        let (a, b) = (old.as_ptr().cast::<__m512i>(), new.as_ptr().cast::<__m512i>());
        for (line, m) in masks.iter_mut().enumerate() {
            // SAFETY: line < 64, so both 64-byte reads lie inside their
            // 4096-byte pages; loadu needs no alignment.
            let (x, y) = unsafe { (_mm512_loadu_si512(a.add(line)), _mm512_loadu_si512(b.add(line))) };
            *m = _mm512_cmpneq_epi8_mask(x, y);
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn diff_masks_avx2(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], masks: &mut Masks) {
        let (a, b) = (old.as_ptr().cast::<__m256i>(), new.as_ptr().cast::<__m256i>());
        for (line, m) in masks.iter_mut().enumerate() {
            // SAFETY: line < 64, so the 32-byte reads at 2*line and
            // 2*line+1 lie inside their 4096-byte pages; loadu needs no
            // alignment.
            let (lo, hi) = unsafe {
                (
                    _mm256_cmpeq_epi8(_mm256_loadu_si256(a.add(2 * line)), _mm256_loadu_si256(b.add(2 * line))),
                    _mm256_cmpeq_epi8(_mm256_loadu_si256(a.add(2 * line + 1)), _mm256_loadu_si256(b.add(2 * line + 1))),
                )
            };
            let equal = _mm256_movemask_epi8(lo) as u32 as u64 | (_mm256_movemask_epi8(hi) as u32 as u64) << 32;
            *m = !equal;
        }
    }
}

/// The first byte at or after `pos` whose "differs" bit is `!flip`'s
/// (flip = 0: first differing byte; flip = !0: first equal byte), or PAGE_SIZE.
#[inline]
fn next(masks: &Masks, pos: usize, flip: u64) -> usize {
    let mut line = pos / 64;
    if line >= masks.len() {
        return PAGE_SIZE;
    }
    let mut m = (masks[line] ^ flip) & (!0u64 << (pos % 64));
    loop {
        if m != 0 {
            return line * 64 + m.trailing_zeros() as usize;
        }
        line += 1;
        if line == masks.len() {
            return PAGE_SIZE;
        }
        m = masks[line] ^ flip;
    }
}

const DIFF: u64 = 0;
const SAME: u64 = !0;

/// Writes the record for `new` against the cached `slot` into `out` and
/// brings `slot` up to `new` where they differ. False (and nothing useful
/// in `out`, `slot` partly updated) once the record would pass `limit`.
fn encode_runs(
    masks: &Masks,
    slot: &mut [u8; PAGE_SIZE],
    new: &[u8; PAGE_SIZE],
    out: &mut Vec<u8>,
    limit: usize,
) -> bool {
    out.clear();
    let mut done = 0;
    let mut start = next(masks, 0, DIFF);
    while start < PAGE_SIZE {
        let mut end = next(masks, start, SAME);
        let mut following = next(masks, end, DIFF);
        while following < PAGE_SIZE && following - end <= 2 {
            end = next(masks, following, SAME);
            following = next(masks, end, DIFF);
        }
        let literal = end - start;
        if out.len() + varint::len(start - done) + varint::len(literal) + literal > limit {
            return false;
        }
        varint::put(out, start - done);
        varint::put(out, literal);
        out.extend_from_slice(&new[start..end]);
        slot[start..end].copy_from_slice(&new[start..end]);
        done = end;
        start = following;
    }
    true
}

/// Encodes `new` against `old` into `out` (cleared first); false when the
/// record would be longer than `limit`. The cache-free form, for tests and
/// benchmarks.
pub fn encode_delta(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], out: &mut Vec<u8>, limit: usize) -> bool {
    let mut masks = [0u64; PAGE_SIZE / 64];
    diff_masks(old, new, &mut masks);
    let mut scratch = *old;
    encode_runs(&masks, &mut scratch, new, out, limit)
}

/// Applies a delta record of page `index` to `page` (which holds the old
/// contents). On error `page` may be partly updated.
pub fn decode_delta(input: &[u8], index: u64, page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
    let truncated = || CodecError::Truncated { codec: "xbzrle", page: index };
    let mut pos = 0;
    let mut offset = 0;
    while pos < input.len() {
        let unchanged = varint::get(input, &mut pos).ok_or_else(truncated)?;
        let literal = varint::get(input, &mut pos).ok_or_else(truncated)?;
        if literal == 0 {
            return Err(CodecError::Malformed { codec: "xbzrle", page: index, what: "empty literal run" });
        }
        // Both are below 2^21 (3-byte varints): no overflow.
        let start = offset + unchanged;
        let end = start + literal;
        if end > PAGE_SIZE {
            return Err(CodecError::Overrun { codec: "xbzrle", page: index, offset: end });
        }
        let bytes = input.get(pos..pos + literal).ok_or_else(truncated)?;
        page[start..end].copy_from_slice(bytes);
        pos += literal;
        offset = end;
    }
    Ok(())
}

/// What the encoder did with a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Encoded into the output (cache updated).
    Encoded,
    /// The page was cached, but its record would not be smaller than the
    /// page (cache updated; send it another way).
    Overflow,
    /// Not cached (now inserted; send it another way).
    Miss,
}

/// The sending side.
#[derive(Clone)]
pub struct XbzrleEncoder {
    /// The cache.
    pub cache: PageCache,
}

impl XbzrleEncoder {
    /// An encoder with a cache of `bytes`.
    pub fn new(bytes: usize) -> Self {
        XbzrleEncoder { cache: PageCache::new(bytes) }
    }

    /// Tries to encode `page` into `out`; the cache ends up holding it
    /// either way. A record is always shorter than a page.
    pub fn encode(&mut self, index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Outcome {
        let Some(slot) = self.cache.lookup(index) else {
            self.cache.insert(index, page);
            return Outcome::Miss;
        };
        let mut masks = [0u64; PAGE_SIZE / 64];
        let cached = self.cache.slot_mut(slot);
        diff_masks(cached, page, &mut masks);
        if encode_runs(&masks, cached, page, out, MAX_RECORD) {
            Outcome::Encoded
        } else {
            cached.copy_from_slice(page);
            Outcome::Overflow
        }
    }

    /// A non-zero page sent another way without `encode`: update or insert,
    /// exactly as the decoder's `observe` will.
    pub fn observe(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        self.cache.observe(index, page);
    }

    /// A page sent as a zero record: a cached copy becomes zeros.
    pub fn note_zero(&mut self, index: u64) {
        self.cache.note_zero(index);
    }
}

/// The receiving side.
#[derive(Clone)]
pub struct XbzrleDecoder {
    /// The cache.
    pub cache: PageCache,
}

impl XbzrleDecoder {
    /// A decoder with a cache of `bytes` (the encoder's size).
    pub fn new(bytes: usize) -> Self {
        XbzrleDecoder { cache: PageCache::new(bytes) }
    }

    /// Decodes an XBZRLE record of page `index` into `out`.
    pub fn decode(&mut self, index: u64, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        let slot = self.cache.lookup(index).ok_or(CodecError::CacheMiss { codec: "xbzrle", page: index })?;
        let cached = self.cache.slot_mut(slot);
        decode_delta(input, index, cached)?;
        out.copy_from_slice(cached);
        Ok(())
    }

    /// A non-zero page that arrived another way: mirror the encoder's
    /// update or insert.
    pub fn observe(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        self.cache.observe(index, page);
    }

    /// A page that arrived as a zero record.
    pub fn note_zero(&mut self, index: u64) {
        self.cache.note_zero(index);
    }
}

impl EncodePage for XbzrleEncoder {
    /// XBZRLE alone: a record on a hit, else the page raw.
    fn encode(&mut self, index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Encoded {
        match XbzrleEncoder::encode(self, index, page, out) {
            Outcome::Encoded => Encoded::Record(TAG_XBZRLE),
            Outcome::Overflow | Outcome::Miss => Encoded::Raw,
        }
    }

    fn observe_raw(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        self.observe(index, page);
    }

    fn observe_zero(&mut self, index: u64) {
        self.note_zero(index);
    }
}

impl DecodePage for XbzrleDecoder {
    fn decode(&mut self, index: u64, tag: u8, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        match tag {
            TAG_XBZRLE => XbzrleDecoder::decode(self, index, input, out),
            _ => Err(CodecError::UnknownTag { tag, page: index }),
        }
    }

    fn observe(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        XbzrleDecoder::observe(self, index, page);
    }

    fn observe_zero(&mut self, index: u64) {
        self.note_zero(index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT_SETS: usize = (512 << 20) / PAGE_SIZE / 2;

    fn noise(seed: u64) -> [u8; PAGE_SIZE] {
        let mut x = seed | 1;
        let mut page = [0u8; PAGE_SIZE];
        for b in page.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        page
    }

    #[test]
    fn every_mask_implementation_agrees() {
        let old = noise(1);
        let mut new = old;
        for i in (0..PAGE_SIZE).step_by(37) {
            new[i] ^= 0x40;
        }
        new[4095] ^= 1;
        let mut want = [0u64; 64];
        for (i, (a, b)) in old.iter().zip(&new).enumerate() {
            want[i / 64] |= u64::from(a != b) << (i % 64);
        }
        let mut got = [0u64; 64];
        diff_masks_portable(&old, &new, &mut got);
        assert_eq!(got, want);
        diff_masks(&old, &new, &mut got);
        assert_eq!(got, want);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            unsafe { x86::diff_masks_avx2(&old, &new, &mut got) };
            assert_eq!(got, want);
        }
    }

    #[test]
    fn small_changes_encode_small() {
        let mut enc = XbzrleEncoder::new(1 << 20);
        let mut dec = XbzrleDecoder::new(1 << 20);
        let mut out = Vec::new();
        let mut page = [7u8; PAGE_SIZE];
        assert_eq!(enc.encode(3, &page, &mut out), Outcome::Miss);
        dec.observe(3, &page);
        assert_eq!(enc.encode(3, &page, &mut out), Outcome::Encoded);
        assert!(out.is_empty(), "an unchanged page is an empty record");
        page[100] = 1;
        page[2000..2008].copy_from_slice(b"12345678");
        page[2010] = 0; // a 2-byte gap joins the literal
        assert_eq!(enc.encode(3, &page, &mut out), Outcome::Encoded);
        assert_eq!(out.len(), (1 + 1 + 1) + (2 + 1 + 11), "{out:?}");
        let mut back = [0u8; PAGE_SIZE];
        dec.decode(3, &[], &mut back).unwrap();
        dec.decode(3, &out, &mut back).unwrap();
        assert_eq!(back, page);
        assert!(enc.cache.same_state(&dec.cache));
        let e = dec.decode(4, &out, &mut back).unwrap_err();
        assert_eq!(e.to_string(), "xbzrle record for page 4 refers to a cache entry this side does not hold");
    }

    #[test]
    fn rewritten_pages_overflow_and_still_update_the_cache() {
        let mut enc = XbzrleEncoder::new(1 << 20);
        let mut out = Vec::new();
        enc.encode(9, &noise(1), &mut out);
        assert_eq!(enc.encode(9, &noise(2), &mut out), Outcome::Overflow);
        assert_eq!(enc.cache.peek(9), Some(&noise(2)));
    }

    #[test]
    fn two_ways_and_lru_eviction_match_on_both_ends() {
        let mut enc = XbzrleEncoder::new(2 * PAGE_SIZE); // one set, two ways
        let mut dec = XbzrleDecoder::new(2 * PAGE_SIZE);
        let mut out = Vec::new();
        for index in [1u64, 2, 1, 3] {
            let page = [index as u8; PAGE_SIZE];
            if enc.encode(index, &page, &mut out) != Outcome::Encoded {
                dec.observe(index, &page);
            } else {
                let mut back = [0u8; PAGE_SIZE];
                dec.decode(index, &out, &mut back).unwrap();
            }
        }
        // 1 was used after 2, so 3 evicted 2.
        assert!(enc.cache.same_state(&dec.cache));
        assert!(enc.cache.peek(1).is_some() && enc.cache.peek(3).is_some() && enc.cache.peek(2).is_none());
        assert_eq!(enc.cache.stats.evictions, 1);
    }

    #[test]
    fn consecutive_and_strided_pages_spread_over_the_sets() {
        // A cache as large as memory keeps nearly every page (2039 sets,
        // the largest prime in 2048: 18 sets get a third page).
        for stride in [1u64, 2, 3, 4, 8] {
            let mut cache = PageCache::new(4096 * PAGE_SIZE);
            for p in 0..4096u64 {
                cache.insert(p * stride, &[0; PAGE_SIZE]);
            }
            assert_eq!(cache.stats.evictions, 18, "stride {stride}");
        }
        assert_eq!(largest_prime_at_most(DEFAULT_SETS), 65521);
        assert_eq!([0, 1, 2, 3, 4, 10].map(largest_prime_at_most), [1, 1, 2, 3, 3, 7]);
    }

    #[test]
    fn hostile_records_fail_cleanly() {
        let mut page = [0u8; PAGE_SIZE];
        assert!(decode_delta(&[0x80], 1, &mut page).is_err());
        assert!(decode_delta(&[0, 5, 1, 2], 1, &mut page).is_err());
        let e = decode_delta(&[0xFF, 0x1F, 5, 1, 2, 3, 4, 5], 17, &mut page).unwrap_err();
        assert_eq!(e.to_string(), "xbzrle record for page 17 overruns the page at offset 4100");
        assert!(decode_delta(&[3, 0], 1, &mut page).is_err());
    }
}
