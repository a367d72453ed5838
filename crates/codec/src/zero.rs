//! All-zero page detection at memory speed.
//!
//! The page is OR-reduced in 512-byte blocks (eight 64-byte lines) with
//! AVX-512 or AVX2 when the CPU has them (checked at run time), 64-bit
//! words otherwise. A branch per block keeps the loop tight and still lets
//! a non-zero page, the common case, stop after its first block.

use crate::{CodecError, DecodePage, EncodePage, Encoded, PAGE_SIZE};

const BLOCK: usize = 512;

/// Which implementation [`is_zero`] uses on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroImpl {
    /// AVX-512F.
    Avx512,
    /// AVX2.
    Avx2,
    /// 64-bit words.
    Portable,
}

/// The implementation this CPU gets.
pub fn detected() -> ZeroImpl {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return ZeroImpl::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return ZeroImpl::Avx2;
        }
    }
    ZeroImpl::Portable
}

/// True when every byte of the page is zero.
#[inline]
pub fn is_zero(page: &[u8; PAGE_SIZE]) -> bool {
    is_zero_with(detected(), page)
}

/// [`is_zero`] with a chosen implementation, for tests and benchmarks. An
/// implementation the CPU lacks falls back to the portable one.
pub fn is_zero_with(imp: ZeroImpl, page: &[u8; PAGE_SIZE]) -> bool {
    #[cfg(target_arch = "x86_64")]
    match imp {
        ZeroImpl::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { x86::is_zero_avx512(page) };
        }
        ZeroImpl::Avx2 if std::arch::is_x86_feature_detected!("avx2") => {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { x86::is_zero_avx2(page) };
        }
        _ => {}
    }
    let _ = imp;
    is_zero_portable(page)
}

/// The portable version: 64-bit words OR-reduced per block.
pub fn is_zero_portable(page: &[u8; PAGE_SIZE]) -> bool {
    page.chunks_exact(BLOCK)
        .all(|block| block.chunks_exact(8).fold(0u64, |acc, w| acc | u64::from_ne_bytes(w.try_into().unwrap())) == 0)
}

/// Zero detection alone as a codec: zero records or raw pages.
#[derive(Debug, Clone, Copy, Default)]
pub struct ZeroCodec;

impl EncodePage for ZeroCodec {
    fn encode(&mut self, _index: u64, page: &[u8; PAGE_SIZE], _out: &mut Vec<u8>) -> Encoded {
        if is_zero(page) {
            Encoded::Zero
        } else {
            Encoded::Raw
        }
    }
}

impl DecodePage for ZeroCodec {
    fn decode(&mut self, index: u64, tag: u8, _input: &[u8], _out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        Err(CodecError::UnknownTag { tag, page: index })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BLOCK, PAGE_SIZE};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) fn is_zero_avx512(page: &[u8; PAGE_SIZE]) -> bool {
        let p = page.as_ptr().cast::<__m512i>();
        for block in 0..PAGE_SIZE / BLOCK {
            let mut acc = _mm512_setzero_si512();
            for line in 0..BLOCK / 64 {
                // SAFETY: block * 8 + line < 64, so the 64 bytes read lie
                // inside the 4096-byte page; loadu needs no alignment.
                acc = _mm512_or_si512(acc, unsafe { _mm512_loadu_si512(p.add(block * 8 + line)) });
            }
            if _mm512_test_epi64_mask(acc, acc) != 0 {
                return false;
            }
        }
        true
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn is_zero_avx2(page: &[u8; PAGE_SIZE]) -> bool {
        let p = page.as_ptr().cast::<__m256i>();
        for block in 0..PAGE_SIZE / BLOCK {
            let mut acc = _mm256_setzero_si256();
            for half in 0..BLOCK / 32 {
                // SAFETY: block * 16 + half < 128, so the 32 bytes read lie
                // inside the 4096-byte page; loadu needs no alignment.
                acc = _mm256_or_si256(acc, unsafe { _mm256_loadu_si256(p.add(block * 16 + half)) });
            }
            if _mm256_testz_si256(acc, acc) == 0 {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_and_bit_counts_in_every_implementation() {
        let mut page = [0u8; PAGE_SIZE];
        for imp in [ZeroImpl::Avx512, ZeroImpl::Avx2, ZeroImpl::Portable] {
            assert!(is_zero_with(imp, &page), "{imp:?}");
            for i in 0..PAGE_SIZE {
                page[i] = 1 << (i % 8);
                assert!(!is_zero_with(imp, &page), "{imp:?} byte {i}");
                page[i] = 0;
            }
        }
        assert!(is_zero(&page));
    }
}
