//! GM-RLE (GMigrate): replace each 64-bit word by its difference from the
//! previous word (wrapping; the word before the first is 0), then
//! run-length encode only the zero differences. Runs of equal words, of
//! zeros, and of arithmetic sequences all become zero runs.
//!
//! Record: tokens until 512 words are produced. A token is a varint
//! `n << 1 | 1` (n zero differences) or `n << 1` followed by n
//! little-endian u64 differences.

use crate::error::CodecError;
use crate::{varint, PAGE};

const WORDS: usize = PAGE / 8;

fn word(page: &[u8; PAGE], i: usize) -> u64 {
    u64::from_le_bytes(page[i * 8..i * 8 + 8].try_into().unwrap())
}

/// Encodes `page` into `out` (cleared first). False when the record would
/// be larger than a page: send it raw.
pub fn encode(page: &[u8; PAGE], out: &mut Vec<u8>) -> bool {
    out.clear();
    let mut prev = 0u64;
    let mut i = 0;
    while i < WORDS {
        let start = i;
        while i < WORDS && word(page, i) == prev {
            i += 1;
        }
        if i > start {
            varint::put(out, (i - start) << 1 | 1);
        }
        let lit_start = i;
        let mut p = prev;
        while i < WORDS && word(page, i) != p {
            p = word(page, i);
            i += 1;
        }
        if i > lit_start {
            varint::put(out, (i - lit_start) << 1);
            let mut q = prev;
            for j in lit_start..i {
                let w = word(page, j);
                out.extend_from_slice(&w.wrapping_sub(q).to_le_bytes());
                q = w;
            }
            if out.len() > PAGE {
                return false;
            }
        }
        prev = p;
    }
    out.len() <= PAGE
}

/// Decodes a record of page `index` into `page`.
pub fn decode(input: &[u8], index: u64, page: &mut [u8; PAGE]) -> Result<(), CodecError> {
    let truncated = CodecError::Truncated { codec: "rle", page: index };
    let mut pos = 0;
    let mut i = 0;
    let mut prev = 0u64;
    while i < WORDS {
        let token = varint::get(input, &mut pos).ok_or(truncated.clone())?;
        let n = token >> 1;
        if n == 0 || i + n > WORDS {
            return Err(CodecError::Overrun { codec: "rle", page: index, offset: (i + n) * 8 });
        }
        for j in i..i + n {
            if token & 1 == 0 {
                let d = input.get(pos..pos + 8).ok_or(truncated.clone())?;
                prev = prev.wrapping_add(u64::from_le_bytes(d.try_into().unwrap()));
                pos += 8;
            }
            page[j * 8..j * 8 + 8].copy_from_slice(&prev.to_le_bytes());
        }
        i += n;
    }
    if pos != input.len() {
        return Err(CodecError::Trailing { codec: "rle", page: index, extra: input.len() - pos });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_compress_and_round_trip() {
        let mut page = [0u8; PAGE];
        let mut out = Vec::new();
        assert!(encode(&page, &mut out));
        assert_eq!(out.len(), 2, "one zero run of 512 words");
        for (i, w) in page.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(1000 + (i / 100) as u64).to_le_bytes()); // runs of equal words
        }
        assert!(encode(&page, &mut out));
        assert!(out.len() < 80, "{}", out.len());
        let mut back = [0xAAu8; PAGE];
        decode(&out, 0, &mut back).unwrap();
        assert_eq!(back, page);
    }

    #[test]
    fn random_pages_overflow() {
        let mut page = [0u8; PAGE];
        let mut x = 1u64;
        for b in page.iter_mut() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            *b = (x >> 56) as u8;
        }
        assert!(!encode(&page, &mut Vec::new()));
    }

    #[test]
    fn hostile_records_fail_cleanly() {
        let mut page = [0u8; PAGE];
        assert!(decode(&[], 1, &mut page).is_err());
        assert!(decode(&[0x80], 1, &mut page).is_err());
        assert!(decode(&[(513 << 1 | 1) as u8 & 0x7F | 0x80, 8], 1, &mut page).is_err());
        assert!(decode(&[2, 1, 2], 1, &mut page).is_err()); // literal without its 8 bytes
    }
}
