//! How batches are split and how large the device's caches are: the same
//! arithmetic as crates/codec, so both ends' caches line up.

use std::collections::HashSet;

use tsubame_codec::PAGE_SIZE;

/// Splits `indices` into runs of at most `max` pages in which no index
/// occurs twice (the kernels' cache plan assumes that, see xbzrle.cu).
pub fn split_unique(indices: &[u64], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut start = 0;
    for (i, &index) in indices.iter().enumerate() {
        if i - start == max || !seen.insert(index) {
            out.push(start..i);
            start = i;
            seen.clear();
            seen.insert(index);
        }
    }
    if start < indices.len() {
        out.push(start..indices.len());
    }
    out
}

/// The XBZRLE cache's number of sets, as crates/codec (largest prime at
/// most `bytes / 8192`, 1 for less).
pub fn xbzrle_sets(bytes: usize) -> usize {
    let n = bytes / PAGE_SIZE / 2;
    let is_prime = |k: usize| k >= 2 && (2..).take_while(|d| d * d <= k).all(|d| !k.is_multiple_of(d));
    (2..=n).rev().find(|&k| is_prime(k)).unwrap_or(1)
}

/// The dedup cache's number of sets, as crates/codec.
pub fn dedup_sets(bytes: usize) -> usize {
    (bytes / 256 / 2).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_where_an_index_repeats_or_the_batch_is_full() {
        assert_eq!(split_unique(&[], 4), vec![]);
        assert_eq!(split_unique(&[1, 2, 3], 4), vec![0..3]);
        assert_eq!(split_unique(&[1, 2, 1, 3, 2], 8), vec![0..2, 2..5]);
        assert_eq!(split_unique(&[1, 2, 3, 4, 5], 2), vec![0..2, 2..4, 4..5]);
        assert_eq!(split_unique(&[7, 7, 7], 8), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn cache_geometry_matches_the_cpu_codecs() {
        assert_eq!(xbzrle_sets(512 << 20), 65521);
        assert_eq!(xbzrle_sets(2 * PAGE_SIZE), 1);
        assert_eq!(xbzrle_sets(4096 * PAGE_SIZE), 2039);
        assert_eq!(dedup_sets(64 << 20), 131072);
        assert_eq!(dedup_sets(100), 1);
    }
}
