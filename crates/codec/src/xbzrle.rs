//! XBZRLE (QEMU's delta encoding, GMigrate's XBRLE): keep the last sent
//! version of pages in a cache; encode a page as the runs where it differs
//! from the cached version.
//!
//! Record: repeated `zero_run varint, literal_len varint, literal bytes`
//! (a trailing unchanged run is implicit). The cache is 2-way
//! set-associative by page number with one LRU bit per set; encoder and
//! decoder update it in the same order, so they stay identical.

use serde::Serialize;

use crate::error::CodecError;
use crate::{varint, PAGE};

/// Cache counters.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CacheStats {
    /// Lookups that found the page.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Inserts that pushed another page out.
    pub evictions: u64,
}

const EMPTY: u64 = u64::MAX;

/// The page cache both ends keep.
pub struct PageCache {
    sets: usize,
    tags: Vec<u64>,
    /// Per set: the way to evict next.
    lru: Vec<u8>,
    data: Vec<u8>,
    /// Counters.
    pub stats: CacheStats,
}

impl PageCache {
    /// A cache of about `bytes` (at least two pages). The data is a lazily
    /// zeroed allocation: memory is used only as pages arrive.
    pub fn new(bytes: usize) -> PageCache {
        let sets = (bytes / PAGE / 2).max(1);
        PageCache {
            sets,
            tags: vec![EMPTY; sets * 2],
            lru: vec![0; sets],
            data: vec![0u8; sets * 2 * PAGE],
            stats: CacheStats::default(),
        }
    }

    /// Bytes of page data the cache can hold.
    pub fn capacity_bytes(&self) -> usize {
        self.data.len()
    }

    fn set_of(&self, page: u64) -> usize {
        // Spread neighbouring pages over sets (Fibonacci hashing).
        ((page.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) % self.sets as u64) as usize
    }

    /// The slot holding `page`, marking it recently used.
    pub fn lookup(&mut self, page: u64) -> Option<usize> {
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
    pub fn insert(&mut self, page: u64, contents: &[u8; PAGE]) {
        let set = self.set_of(page);
        let way = self.lru[set] as usize;
        let slot = set * 2 + way;
        if self.tags[slot] != EMPTY {
            self.stats.evictions += 1;
        }
        self.tags[slot] = page;
        self.lru[set] = 1 - way as u8;
        self.data[slot * PAGE..(slot + 1) * PAGE].copy_from_slice(contents);
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        &mut self.data[slot * PAGE..(slot + 1) * PAGE]
    }
}

/// What the encoder did with a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Encoded into the output (cache updated).
    Encoded,
    /// The page was cached, but its delta is larger than a page (cache
    /// updated; send it another way).
    Overflow,
    /// Not cached (now inserted; send it another way).
    Miss,
}

/// Encodes `new` against `old` into `out`; false past `limit` bytes.
pub fn encode_delta(old: &[u8], new: &[u8; PAGE], out: &mut Vec<u8>, limit: usize) -> bool {
    out.clear();
    let mut i = 0;
    while i < PAGE {
        let start = i;
        // Compare 8 bytes at a time while equal.
        while i + 8 <= PAGE && old[i..i + 8] == new[i..i + 8] {
            i += 8;
        }
        while i < PAGE && old[i] == new[i] {
            i += 1;
        }
        if i == PAGE {
            break;
        }
        let zero_run = i - start;
        let lit = i;
        while i < PAGE && old[i] != new[i] {
            i += 1;
        }
        varint::put(out, zero_run);
        varint::put(out, i - lit);
        out.extend_from_slice(&new[lit..i]);
        if out.len() > limit {
            return false;
        }
    }
    true
}

/// Applies a delta record to `page` (which holds the old contents).
pub fn decode_delta(input: &[u8], index: u64, page: &mut [u8]) -> Result<(), CodecError> {
    let truncated = CodecError::Truncated { codec: "xbzrle", page: index };
    let mut pos = 0;
    let mut offset = 0;
    while pos < input.len() {
        let zero_run = varint::get(input, &mut pos).ok_or(truncated.clone())?;
        let literal = varint::get(input, &mut pos).ok_or(truncated.clone())?;
        let end = offset + zero_run + literal;
        if literal == 0 || end > PAGE {
            return Err(CodecError::Overrun { codec: "xbzrle", page: index, offset: end });
        }
        let bytes = input.get(pos..pos + literal).ok_or(truncated.clone())?;
        page[offset + zero_run..end].copy_from_slice(bytes);
        pos += literal;
        offset = end;
    }
    Ok(())
}

/// The sending side.
pub struct XbzrleEncoder {
    /// The cache.
    pub cache: PageCache,
}

impl XbzrleEncoder {
    /// An encoder with a cache of `bytes`.
    pub fn new(bytes: usize) -> Self {
        XbzrleEncoder { cache: PageCache::new(bytes) }
    }

    /// Tries to encode `page`; the cache ends up holding it either way.
    pub fn encode(&mut self, index: u64, page: &[u8; PAGE], out: &mut Vec<u8>) -> Outcome {
        match self.cache.lookup(index) {
            Some(slot) => {
                let ok = encode_delta(self.cache.slot_mut(slot), page, out, PAGE);
                self.cache.slot_mut(slot).copy_from_slice(page);
                if ok {
                    Outcome::Encoded
                } else {
                    Outcome::Overflow
                }
            }
            None => {
                self.cache.insert(index, page);
                Outcome::Miss
            }
        }
    }

    /// A page sent another way without trying to encode it: update or
    /// insert, exactly as the decoder's `observe` will.
    pub fn observe(&mut self, index: u64, page: &[u8; PAGE]) {
        observe(&mut self.cache, index, page);
    }

    /// A page sent as zeros: a cached copy becomes zeros (no insert).
    pub fn note_zero(&mut self, index: u64) {
        note_zero(&mut self.cache, index);
    }
}

fn observe(cache: &mut PageCache, index: u64, page: &[u8; PAGE]) {
    match cache.lookup(index) {
        Some(slot) => cache.slot_mut(slot).copy_from_slice(page),
        None => cache.insert(index, page),
    }
}

fn note_zero(cache: &mut PageCache, index: u64) {
    let set = cache.set_of(index);
    for way in 0..2 {
        if cache.tags[set * 2 + way] == index {
            cache.slot_mut(set * 2 + way).fill(0);
        }
    }
}

/// The receiving side.
pub struct XbzrleDecoder {
    /// The cache.
    pub cache: PageCache,
}

impl XbzrleDecoder {
    /// A decoder with a cache of `bytes` (the encoder's size).
    pub fn new(bytes: usize) -> Self {
        XbzrleDecoder { cache: PageCache::new(bytes) }
    }

    /// Decodes an XBZRLE record into `out`.
    pub fn decode(&mut self, index: u64, input: &[u8], out: &mut [u8; PAGE]) -> Result<(), CodecError> {
        let slot = self.cache.lookup(index).ok_or(CodecError::CacheMiss { codec: "xbzrle", page: index })?;
        let cached = self.cache.slot_mut(slot);
        let mut page = [0u8; PAGE];
        page.copy_from_slice(cached);
        decode_delta(input, index, &mut page)?;
        cached.copy_from_slice(&page);
        *out = page;
        Ok(())
    }

    /// A non-zero page that arrived another way: mirror the encoder's
    /// update or insert.
    pub fn observe(&mut self, index: u64, page: &[u8; PAGE]) {
        observe(&mut self.cache, index, page);
    }

    /// A page that arrived as zeros.
    pub fn note_zero(&mut self, index: u64) {
        note_zero(&mut self.cache, index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_changes_encode_small() {
        let mut enc = XbzrleEncoder::new(1 << 20);
        let mut dec = XbzrleDecoder::new(1 << 20);
        let mut out = Vec::new();
        let mut page = [7u8; PAGE];
        assert_eq!(enc.encode(3, &page, &mut out), Outcome::Miss);
        dec.observe(3, &page);
        page[100] = 1;
        page[2000..2008].copy_from_slice(b"12345678");
        assert_eq!(enc.encode(3, &page, &mut out), Outcome::Encoded);
        assert!(out.len() < 16, "{}", out.len());
        let mut back = [0u8; PAGE];
        dec.decode(3, &out, &mut back).unwrap();
        assert_eq!(back, page);
        assert!(dec.decode(4, &out, &mut back).is_err(), "page 4 is not cached");
    }

    #[test]
    fn two_ways_and_lru_eviction_match_on_both_ends() {
        let mut enc = XbzrleEncoder::new(2 * PAGE); // one set, two ways
        let mut dec = XbzrleDecoder::new(2 * PAGE);
        let mut out = Vec::new();
        for index in [1u64, 2, 1, 3] {
            let page = [index as u8; PAGE];
            if enc.encode(index, &page, &mut out) != Outcome::Encoded {
                dec.observe(index, &page);
            } else {
                let mut back = [0u8; PAGE];
                dec.decode(index, &out, &mut back).unwrap();
            }
        }
        // 1 was used after 2, so 3 evicted 2.
        assert_eq!(enc.cache.tags, dec.cache.tags);
        assert!(enc.cache.tags.contains(&1) && enc.cache.tags.contains(&3));
        assert_eq!(enc.cache.stats.evictions, 1);
    }

    #[test]
    fn hostile_records_fail_cleanly() {
        let mut page = [0u8; PAGE];
        assert!(decode_delta(&[0x80], 1, &mut page).is_err());
        assert!(decode_delta(&[0, 5, 1, 2], 1, &mut page).is_err());
        assert!(decode_delta(&[0xFF, 0x7F, 1, 0], 1, &mut page).is_err());
        assert!(decode_delta(&[3, 0], 1, &mut page).is_err());
    }
}
