//! GM-Dedup: split pages into 256-byte chunks, look each up by its
//! SuperFastHash in a 2-way set-associative chunk cache with LRU
//! replacement, confirm a hash hit by comparing the bytes, and send the
//! slot number instead of the chunk.
//!
//! Record: a u16 bitmap (bit i: chunk i is a reference), then for each of
//! the 16 chunks in order either a u32 slot number or the 256 bytes; the
//! length is therefore fixed by the bitmap (2 + 4·refs + 256·literals,
//! at most 4098 bytes when nothing repeats). Both ends walk the chunks in
//! order: a reference marks its way recently used, a literal is inserted
//! into its set's least recently used way. So the caches stay identical.

use serde::Serialize;

use crate::error::CodecError;
use crate::superfasthash::superfasthash_many;
use crate::{DecodePage, EncodePage, Encoded, PAGE_SIZE, TAG_DEDUP};

/// Bytes per chunk.
pub const CHUNK: usize = 256;
const CHUNKS: usize = PAGE_SIZE / CHUNK;
/// Longest record (no chunk found in the cache).
pub const MAX_RECORD: usize = 2 + PAGE_SIZE;

/// Chunk cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DedupStats {
    /// Chunks sent (or received) as references.
    pub hits: u64,
    /// Chunks sent as literals.
    pub misses: u64,
    /// Literals that pushed another chunk out.
    pub evictions: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(16))]
struct SetMeta {
    /// Each way's chunk hash.
    hash: [u32; 2],
    /// Whether each way holds a chunk.
    valid: [bool; 2],
    /// The way to evict next.
    lru: u8,
}

/// The chunk cache both ends keep.
#[derive(Clone)]
pub struct ChunkCache {
    sets: usize,
    /// Per set, in one 16-byte entry so a lookup touches one cache line.
    meta: Vec<SetMeta>,
    /// Chunk of slot `set * 2 + way`.
    data: Vec<u8>,
    /// Counters.
    pub stats: DedupStats,
}

impl ChunkCache {
    /// A cache of about `bytes` (at least two chunks; lazily backed).
    pub fn new(bytes: usize) -> ChunkCache {
        let sets = (bytes / CHUNK / 2).max(1);
        ChunkCache {
            sets,
            meta: vec![SetMeta::default(); sets],
            data: vec![0; sets * 2 * CHUNK],
            stats: DedupStats::default(),
        }
    }

    /// The set of a hash: its value scaled to the number of sets.
    fn set_of(&self, hash: u32) -> usize {
        ((u64::from(hash) * self.sets as u64) >> 32) as usize
    }

    fn chunk(&self, slot: usize) -> &[u8; CHUNK] {
        (&self.data[slot * CHUNK..(slot + 1) * CHUNK]).try_into().unwrap()
    }

    fn find(&self, set: usize, hash: u32, chunk: &[u8; CHUNK]) -> Option<usize> {
        let m = &self.meta[set];
        (0..2).find(|&w| m.valid[w] && m.hash[w] == hash && self.chunk(set * 2 + w) == chunk).map(|w| set * 2 + w)
    }

    fn is_valid(&self, slot: usize) -> bool {
        self.meta.get(slot / 2).is_some_and(|m| m.valid[slot % 2])
    }

    fn touch(&mut self, slot: usize) {
        self.meta[slot / 2].lru = 1 - (slot % 2) as u8;
    }

    fn insert(&mut self, set: usize, hash: u32, chunk: &[u8; CHUNK]) {
        let m = &mut self.meta[set];
        let way = m.lru as usize;
        if m.valid[way] {
            self.stats.evictions += 1;
        }
        m.valid[way] = true;
        m.hash[way] = hash;
        m.lru = 1 - way as u8;
        let slot = set * 2 + way;
        self.data[slot * CHUNK..(slot + 1) * CHUNK].copy_from_slice(chunk);
    }

    /// True when both caches hold the same chunks in the same slots, with
    /// the same LRU state.
    pub fn same_state(&self, other: &ChunkCache) -> bool {
        self.meta == other.meta && self.data == other.data
    }
}

fn chunks(page: &[u8; PAGE_SIZE]) -> [&[u8; CHUNK]; CHUNKS] {
    std::array::from_fn(|i| (&page[i * CHUNK..(i + 1) * CHUNK]).try_into().unwrap())
}

/// The sending side.
#[derive(Clone)]
pub struct DedupEncoder {
    /// The cache.
    pub cache: ChunkCache,
}

impl DedupEncoder {
    /// An encoder with a cache of `bytes`.
    pub fn new(bytes: usize) -> Self {
        DedupEncoder { cache: ChunkCache::new(bytes) }
    }

    /// Encodes `page` into `out` (cleared first; at most [`MAX_RECORD`]
    /// bytes); returns how many chunks became references.
    pub fn encode(&mut self, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> usize {
        let chunks = chunks(page);
        const STARTS: [usize; CHUNKS] = {
            let mut s = [0; CHUNKS];
            let mut i = 0;
            while i < CHUNKS {
                s[i] = i * CHUNK;
                i += 1;
            }
            s
        };
        let hashes = superfasthash_many(page, &STARTS);
        out.clear();
        out.extend_from_slice(&[0, 0]);
        let mut refs = 0u16;
        for (i, (chunk, &hash)) in chunks.iter().zip(&hashes).enumerate() {
            let set = self.cache.set_of(hash);
            match self.cache.find(set, hash, chunk) {
                Some(slot) => {
                    refs |= 1 << i;
                    out.extend_from_slice(&(slot as u32).to_le_bytes());
                    self.cache.touch(slot);
                    self.cache.stats.hits += 1;
                }
                None => {
                    out.extend_from_slice(&chunk[..]);
                    self.cache.insert(set, hash, chunk);
                    self.cache.stats.misses += 1;
                }
            }
        }
        out[..2].copy_from_slice(&refs.to_le_bytes());
        refs.count_ones() as usize
    }
}

/// The receiving side.
#[derive(Clone)]
pub struct DedupDecoder {
    /// The cache.
    pub cache: ChunkCache,
}

impl DedupDecoder {
    /// A decoder with a cache of `bytes` (the encoder's size).
    pub fn new(bytes: usize) -> Self {
        DedupDecoder { cache: ChunkCache::new(bytes) }
    }

    /// Decodes a record of page `index` into `out`.
    pub fn decode(&mut self, index: u64, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        let head = input.get(..2).ok_or(CodecError::Truncated { codec: "dedup", page: index })?;
        let refs = u16::from_le_bytes(head.try_into().unwrap());
        let n_refs = refs.count_ones() as usize;
        let want = 2 + 4 * n_refs + CHUNK * (CHUNKS - n_refs);
        if input.len() < want {
            return Err(CodecError::Truncated { codec: "dedup", page: index });
        }
        if input.len() > want {
            return Err(CodecError::Trailing { codec: "dedup", page: index, extra: input.len() - want });
        }
        // First the literals go to their places in `out` (the length check
        // above keeps every chunk inside `input`) and are hashed there,
        // all at once: `out` is page-aligned in practice, the record is
        // not. Then the chunks are walked in order, as the encoder did.
        let mut at = [0usize; CHUNKS];
        let mut literal_starts = [0usize; CHUNKS];
        let mut n_literals = 0;
        let mut pos = 2;
        for (i, at) in at.iter_mut().enumerate() {
            *at = pos;
            if refs & (1 << i) != 0 {
                pos += 4;
            } else {
                out[i * CHUNK..(i + 1) * CHUNK].copy_from_slice(&input[pos..pos + CHUNK]);
                literal_starts[n_literals] = i * CHUNK;
                n_literals += 1;
                pos += CHUNK;
            }
        }
        let hashes = superfasthash_many(out, &literal_starts[..n_literals]);
        let mut next_literal = 0;
        for (i, dst) in out.chunks_exact_mut(CHUNK).enumerate() {
            let dst: &mut [u8; CHUNK] = dst.try_into().unwrap();
            if refs & (1 << i) != 0 {
                let slot = u32::from_le_bytes(input[at[i]..at[i] + 4].try_into().unwrap()) as usize;
                if !self.cache.is_valid(slot) {
                    return Err(CodecError::CacheMiss { codec: "dedup", page: index });
                }
                dst.copy_from_slice(self.cache.chunk(slot));
                self.cache.touch(slot);
                self.cache.stats.hits += 1;
            } else {
                let hash = hashes[next_literal];
                next_literal += 1;
                self.cache.insert(self.cache.set_of(hash), hash, dst);
                self.cache.stats.misses += 1;
            }
        }
        Ok(())
    }
}

impl EncodePage for DedupEncoder {
    /// Dedup alone: always a record (at most 2 bytes over the page).
    fn encode(&mut self, _index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Encoded {
        DedupEncoder::encode(self, page, out);
        Encoded::Record(TAG_DEDUP)
    }
}

impl DecodePage for DedupDecoder {
    fn decode(&mut self, index: u64, tag: u8, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        match tag {
            TAG_DEDUP => DedupDecoder::decode(self, index, input, out),
            _ => Err(CodecError::UnknownTag { tag, page: index }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_chunks_become_references() {
        let mut enc = DedupEncoder::new(1 << 20);
        let mut dec = DedupDecoder::new(1 << 20);
        let mut page = [0u8; PAGE_SIZE];
        for (i, b) in page.iter_mut().enumerate() {
            *b = (i / CHUNK % 4) as u8; // 4 distinct chunks, each 4 times
        }
        let mut out = Vec::new();
        assert_eq!(enc.encode(&page, &mut out), 12);
        assert_eq!(out.len(), 2 + 4 * CHUNK + 12 * 4);
        let mut back = [9u8; PAGE_SIZE];
        dec.decode(0, &out, &mut back).unwrap();
        assert_eq!(back, page);
        // A second identical page is all references.
        assert_eq!(enc.encode(&page, &mut out), 16);
        assert_eq!(out.len(), 2 + 16 * 4);
        dec.decode(1, &out, &mut back).unwrap();
        assert_eq!(back, page);
        assert!(enc.cache.same_state(&dec.cache));
        assert_eq!(enc.cache.stats, dec.cache.stats);
    }

    #[test]
    fn a_hash_collision_is_not_a_hit() {
        // One set: every chunk lands in it; only equal bytes may match.
        let mut enc = DedupEncoder::new(2 * CHUNK);
        let mut page = [0u8; PAGE_SIZE];
        for (i, b) in page.iter_mut().enumerate() {
            *b = (i / CHUNK) as u8;
        }
        let mut out = Vec::new();
        assert_eq!(enc.encode(&page, &mut out), 0);
        assert_eq!(out.len(), MAX_RECORD);
        assert_eq!(enc.cache.stats.evictions, 14);
    }

    #[test]
    fn hostile_records_fail_cleanly() {
        let mut dec = DedupDecoder::new(1 << 16);
        let mut page = [0u8; PAGE_SIZE];
        let all_refs = |slot: u32| {
            let mut r = vec![0xFF, 0xFF];
            for _ in 0..16 {
                r.extend_from_slice(&slot.to_le_bytes());
            }
            r
        };
        assert!(dec.decode(0, &[], &mut page).is_err());
        assert!(dec.decode(0, &all_refs(0), &mut page).is_err(), "reference to an empty slot");
        assert!(dec.decode(0, &all_refs(u32::MAX), &mut page).is_err(), "slot out of range");
        assert!(dec.decode(0, &[0, 0, 1, 2, 3], &mut page).is_err(), "short literal");
        let mut long = all_refs(0);
        long.push(0);
        let e = dec.decode(5, &long, &mut page).unwrap_err();
        assert_eq!(e.to_string(), "dedup record for page 5 has 1 trailing bytes");
    }
}
