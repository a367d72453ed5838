//! Paul Hsieh's SuperFastHash (2004), as GM-Dedup uses it for 256-byte
//! chunks. Written from the published algorithm.

fn get16(d: &[u8], i: usize) -> u32 {
    d[i] as u32 | (d[i + 1] as u32) << 8
}

/// SuperFastHash of `data`, with the length as the seed (as the
/// reference code does).
pub fn superfasthash(data: &[u8]) -> u32 {
    if data.is_empty() {
        return 0;
    }
    let mut hash = data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        hash = hash.wrapping_add(get16(c, 0));
        let tmp = (get16(c, 2) << 11) ^ hash;
        hash = (hash << 16) ^ tmp;
        hash = hash.wrapping_add(hash >> 11);
    }
    let rem = chunks.remainder();
    match rem.len() {
        3 => {
            hash = hash.wrapping_add(get16(rem, 0));
            hash ^= hash << 16;
            hash ^= ((rem[2] as i8) as i32 as u32) << 18;
            hash = hash.wrapping_add(hash >> 11);
        }
        2 => {
            hash = hash.wrapping_add(get16(rem, 0));
            hash ^= hash << 11;
            hash = hash.wrapping_add(hash >> 17);
        }
        1 => {
            hash = hash.wrapping_add((rem[0] as i8) as i32 as u32);
            hash ^= hash << 10;
            hash = hash.wrapping_add(hash >> 1);
        }
        _ => {}
    }
    hash ^= hash << 3;
    hash = hash.wrapping_add(hash >> 5);
    hash ^= hash << 4;
    hash = hash.wrapping_add(hash >> 17);
    hash ^= hash << 25;
    hash.wrapping_add(hash >> 6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(superfasthash(b""), 0);
        // Different inputs, lengths and tails hash apart.
        let hashes: Vec<u32> =
            [&b"a"[..], b"ab", b"abc", b"abcd", b"abcde", b"abcdf"].iter().map(|d| superfasthash(d)).collect();
        for (i, a) in hashes.iter().enumerate() {
            for b in &hashes[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(superfasthash(&[0u8; 256]), superfasthash(&[0u8; 256]));
    }
}
