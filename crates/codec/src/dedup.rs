//! GM-Dedup: split pages into 256-byte chunks, look each up by its
//! SuperFastHash in a 2-way set-associative chunk cache with LRU
//! replacement, confirm a hash hit by comparing bytes, and send a slot
//! reference instead of the chunk.
//!
//! Record: a u16 bitmap (bit i: chunk i is a reference), then for each of
//! the 16 chunks in order either a u32 slot number or the 256 bytes. At
//! most 4098 bytes. Every literal chunk is inserted into its set's least
//! recently used way on both ends; a reference marks its way used.

use crate::error::CodecError;
use crate::superfasthash::superfasthash;
use crate::PAGE;

/// Bytes per chunk.
pub const CHUNK: usize = 256;
const CHUNKS: usize = PAGE / CHUNK;
/// Longest record.
pub const MAX_RECORD: usize = 2 + PAGE;

/// The chunk cache both ends keep.
pub struct ChunkCache {
    sets: usize,
    valid: Vec<bool>,
    lru: Vec<u8>,
    data: Vec<u8>,
    /// Chunks sent as references.
    pub hits: u64,
    /// Chunks sent as literals.
    pub misses: u64,
}

impl ChunkCache {
    /// A cache of about `bytes` (lazily backed).
    pub fn new(bytes: usize) -> ChunkCache {
        let sets = (bytes / CHUNK / 2).max(1);
        ChunkCache {
            sets,
            valid: vec![false; sets * 2],
            lru: vec![0; sets],
            data: vec![0; sets * 2 * CHUNK],
            hits: 0,
            misses: 0,
        }
    }

    fn chunk(&self, slot: usize) -> &[u8] {
        &self.data[slot * CHUNK..(slot + 1) * CHUNK]
    }

    fn touch(&mut self, slot: usize) {
        self.lru[slot / 2] = 1 - (slot % 2) as u8;
    }

    fn insert(&mut self, set: usize, chunk: &[u8]) {
        let slot = set * 2 + self.lru[set] as usize;
        self.valid[slot] = true;
        self.data[slot * CHUNK..(slot + 1) * CHUNK].copy_from_slice(chunk);
        self.touch(slot);
    }
}

/// The sending side.
pub struct DedupEncoder {
    /// The cache.
    pub cache: ChunkCache,
}

impl DedupEncoder {
    /// An encoder with a cache of `bytes`.
    pub fn new(bytes: usize) -> Self {
        DedupEncoder { cache: ChunkCache::new(bytes) }
    }

    /// Encodes `page` into `out` (cleared first); returns chunks referenced.
    pub fn encode(&mut self, page: &[u8; PAGE], out: &mut Vec<u8>) -> usize {
        out.clear();
        out.extend_from_slice(&[0, 0]);
        let mut refs = 0u16;
        for (i, chunk) in page.chunks_exact(CHUNK).enumerate() {
            let set = superfasthash(chunk) as usize % self.cache.sets;
            let hit = (0..2).map(|w| set * 2 + w).find(|&s| self.cache.valid[s] && self.cache.chunk(s) == chunk);
            match hit {
                Some(slot) => {
                    refs |= 1 << i;
                    out.extend_from_slice(&(slot as u32).to_le_bytes());
                    self.cache.touch(slot);
                    self.cache.hits += 1;
                }
                None => {
                    out.extend_from_slice(chunk);
                    self.cache.insert(set, chunk);
                    self.cache.misses += 1;
                }
            }
        }
        out[..2].copy_from_slice(&refs.to_le_bytes());
        refs.count_ones() as usize
    }
}

/// The receiving side.
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
    pub fn decode(&mut self, index: u64, input: &[u8], out: &mut [u8; PAGE]) -> Result<(), CodecError> {
        let truncated = CodecError::Truncated { codec: "dedup", page: index };
        let refs = u16::from_le_bytes(input.get(..2).ok_or(truncated.clone())?.try_into().unwrap());
        let mut pos = 2;
        for i in 0..CHUNKS {
            let dst = &mut out[i * CHUNK..(i + 1) * CHUNK];
            if refs & (1 << i) != 0 {
                let raw = input.get(pos..pos + 4).ok_or(truncated.clone())?;
                let slot = u32::from_le_bytes(raw.try_into().unwrap()) as usize;
                if slot >= self.cache.valid.len() || !self.cache.valid[slot] {
                    return Err(CodecError::CacheMiss { codec: "dedup", page: index });
                }
                dst.copy_from_slice(self.cache.chunk(slot));
                self.cache.touch(slot);
                pos += 4;
            } else {
                let chunk = input.get(pos..pos + CHUNK).ok_or(truncated.clone())?;
                dst.copy_from_slice(chunk);
                let set = superfasthash(chunk) as usize % self.cache.sets;
                self.cache.insert(set, chunk);
                pos += CHUNK;
            }
        }
        if pos != input.len() {
            return Err(CodecError::Trailing { codec: "dedup", page: index, extra: input.len() - pos });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_chunks_become_references() {
        let mut enc = DedupEncoder::new(1 << 20);
        let mut dec = DedupDecoder::new(1 << 20);
        let mut page = [0u8; PAGE];
        for (i, b) in page.iter_mut().enumerate() {
            *b = (i / CHUNK % 4) as u8; // 4 distinct chunks, each 4 times
        }
        let mut out = Vec::new();
        assert_eq!(enc.encode(&page, &mut out), 12);
        assert_eq!(out.len(), 2 + 4 * CHUNK + 12 * 4);
        let mut back = [9u8; PAGE];
        dec.decode(0, &out, &mut back).unwrap();
        assert_eq!(back, page);
        // A second identical page is all references.
        assert_eq!(enc.encode(&page, &mut out), 16);
        dec.decode(1, &out, &mut back).unwrap();
        assert_eq!(back, page);
    }

    #[test]
    fn hostile_records_fail_cleanly() {
        let mut dec = DedupDecoder::new(1 << 16);
        let mut page = [0u8; PAGE];
        assert!(dec.decode(0, &[], &mut page).is_err());
        assert!(dec.decode(0, &[1, 0, 0, 0, 0, 0], &mut page).is_err(), "reference to an empty slot");
        assert!(dec.decode(0, &[1, 0, 0xFF, 0xFF, 0xFF, 0xFF], &mut page).is_err(), "slot out of range");
        assert!(dec.decode(0, &[0, 0, 1, 2, 3], &mut page).is_err(), "short literal");
    }
}
