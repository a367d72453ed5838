//! GM-RLE (GMigrate): replace each 64-bit little-endian word by its
//! wrapping difference from the previous word (the word before the first
//! is 0), then run-length encode only the zero differences. Runs of equal
//! words (zeros included) become zero runs; everything else is sent as
//! differences. Only zeros are counted, so the encoder has one branch per
//! word (GMigrate chose this for its GPU kernels).
//!
//! Wrapping subtraction rather than XOR: both make equal words zero, but a
//! difference also turns counters and pointer tables (x, x+8, x+16...)
//! into repeated small values that lz4/zstd on the batch compress well.
//!
//! Record: tokens until 512 words are produced. A token is a varint
//! `n << 1 | 1` (n zero differences: the previous word repeated n times)
//! or `n << 1` followed by n little-endian u64 differences; 1 <= n <= 512.

use crate::error::CodecError;
use crate::{varint, DecodePage, EncodePage, Encoded, PAGE_SIZE, TAG_RLE};

const WORDS: usize = PAGE_SIZE / 8;

#[inline(always)]
fn word(page: &[u8; PAGE_SIZE], i: usize) -> u64 {
    u64::from_le_bytes(page[i * 8..i * 8 + 8].try_into().unwrap())
}

/// Encodes `page` into `out` (cleared first). False when the record would
/// not be smaller than the page (the overflow case): send it raw.
pub fn encode(page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> bool {
    out.clear();
    let mut prev = 0u64;
    let mut i = 0;
    while i < WORDS {
        // A run of words equal to their predecessor.
        let start = i;
        while i < WORDS && word(page, i) == prev {
            i += 1;
        }
        if i > start {
            varint::put(out, (i - start) << 1 | 1);
        }
        if i == WORDS {
            break;
        }
        // A run of words that differ from their predecessor.
        let lit_start = i;
        let mut last = prev;
        while i < WORDS && word(page, i) != last {
            last = word(page, i);
            i += 1;
        }
        let token = (i - lit_start) << 1;
        if out.len() + varint::len(token) + (i - lit_start) * 8 >= PAGE_SIZE {
            return false;
        }
        varint::put(out, token);
        for j in lit_start..i {
            let w = word(page, j);
            out.extend_from_slice(&w.wrapping_sub(prev).to_le_bytes());
            prev = w;
        }
    }
    out.len() < PAGE_SIZE
}

/// Decodes a record of page `index` into `page`.
pub fn decode(input: &[u8], index: u64, page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
    let truncated = || CodecError::Truncated { codec: "rle", page: index };
    let mut pos = 0;
    let mut i = 0;
    let mut prev = 0u64;
    while i < WORDS {
        let token = varint::get(input, &mut pos).ok_or_else(truncated)?;
        let n = token >> 1;
        if n == 0 {
            return Err(CodecError::Malformed { codec: "rle", page: index, what: "empty run" });
        }
        if i + n > WORDS {
            return Err(CodecError::Overrun { codec: "rle", page: index, offset: (i + n) * 8 });
        }
        let dst = &mut page[i * 8..(i + n) * 8];
        if token & 1 == 1 {
            let bytes = prev.to_le_bytes();
            for w in dst.chunks_exact_mut(8) {
                w.copy_from_slice(&bytes);
            }
        } else {
            let diffs = input.get(pos..pos + n * 8).ok_or_else(truncated)?;
            for (w, d) in dst.chunks_exact_mut(8).zip(diffs.chunks_exact(8)) {
                prev = prev.wrapping_add(u64::from_le_bytes(d.try_into().unwrap()));
                w.copy_from_slice(&prev.to_le_bytes());
            }
            pos += n * 8;
        }
        i += n;
    }
    if pos != input.len() {
        return Err(CodecError::Trailing { codec: "rle", page: index, extra: input.len() - pos });
    }
    Ok(())
}

/// GM-RLE as a codec: RLE records, raw pages when they do not shrink.
#[derive(Debug, Clone, Copy, Default)]
pub struct RleCodec;

impl EncodePage for RleCodec {
    fn encode(&mut self, _index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Encoded {
        if encode(page, out) {
            Encoded::Record(TAG_RLE)
        } else {
            Encoded::Raw
        }
    }
}

impl DecodePage for RleCodec {
    fn decode(&mut self, index: u64, tag: u8, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        match tag {
            TAG_RLE => decode(input, index, out),
            _ => Err(CodecError::UnknownTag { tag, page: index }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_sequences_compress_and_round_trip() {
        let mut page = [0u8; PAGE_SIZE];
        let mut out = Vec::new();
        assert!(encode(&page, &mut out));
        assert_eq!(out, [0x81, 0x08], "one zero run of 512 words: varint(1025)");
        for (i, w) in page.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(1000 + (i / 100) as u64).to_le_bytes()); // runs of equal words
        }
        assert!(encode(&page, &mut out));
        assert!(out.len() < 80, "{}", out.len());
        let mut back = [0xAAu8; PAGE_SIZE];
        decode(&out, 0, &mut back).unwrap();
        assert_eq!(back, page);
        // An arithmetic sequence has equal, not zero, differences: GM-RLE
        // leaves those to lz4/zstd on the batch.
        for (i, w) in page.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(0x7f00_0000 + 8 * i as u64).to_le_bytes());
        }
        assert!(!encode(&page, &mut out));
        // Half a page of repeated words, half of a sequence.
        page[..2048].fill(0xAB);
        assert!(encode(&page, &mut out));
        decode(&out, 0, &mut back).unwrap();
        assert_eq!(back, page);
    }

    #[test]
    fn random_pages_overflow() {
        let mut page = [0u8; PAGE_SIZE];
        let mut x = 1u64;
        for b in page.iter_mut() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            *b = (x >> 56) as u8;
        }
        assert!(!encode(&page, &mut Vec::new()));
    }

    #[test]
    fn hostile_records_fail_cleanly() {
        let mut page = [0u8; PAGE_SIZE];
        let e = decode(&[], 17, &mut page).unwrap_err();
        assert_eq!(e.to_string(), "rle record for page 17 is truncated");
        assert!(decode(&[0x80], 1, &mut page).is_err());
        let e = decode(&[0x83, 0x08], 17, &mut page).unwrap_err(); // 513 zero words
        assert_eq!(e.to_string(), "rle record for page 17 overruns the page at offset 4104");
        assert!(decode(&[2, 1, 2], 1, &mut page).is_err(), "literal without its 8 bytes");
        assert!(decode(&[1], 1, &mut page).is_err(), "empty run");
        assert!(decode(&[0x81, 0x08, 0], 1, &mut page).is_err(), "trailing byte");
    }
}
