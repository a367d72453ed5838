//! All-zero page detection at memory speed: an OR over 8-byte words with
//! no early exit, compiled for AVX-512 or AVX2 when the CPU has them.

use crate::PAGE;

fn or_words(page: &[u8; PAGE]) -> u64 {
    page.chunks_exact(8).fold(0u64, |acc, w| acc | u64::from_ne_bytes(w.try_into().unwrap()))
}

#[target_feature(enable = "avx512f,avx512bw")]
fn or_words_avx512(page: &[u8; PAGE]) -> u64 {
    or_words(page)
}

#[target_feature(enable = "avx2")]
fn or_words_avx2(page: &[u8; PAGE]) -> u64 {
    or_words(page)
}

/// True when every byte of the page is zero.
pub fn is_zero(page: &[u8; PAGE]) -> bool {
    let acc = if is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has AVX-512F/BW (checked just above).
        unsafe { or_words_avx512(page) }
    } else if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { or_words_avx2(page) }
    } else {
        or_words(page)
    };
    acc == 0
}

/// The portable version, for comparison in tests and benchmarks.
pub fn is_zero_portable(page: &[u8; PAGE]) -> bool {
    or_words(page) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_position_counts() {
        let mut page = [0u8; PAGE];
        assert!(is_zero(&page) && is_zero_portable(&page));
        for i in [0, 1, 7, 8, 63, 64, 2047, 4095] {
            page[i] = 0x10;
            assert!(!is_zero(&page) && !is_zero_portable(&page), "byte {i}");
            page[i] = 0;
        }
    }
}
