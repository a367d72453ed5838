//! Paul Hsieh's SuperFastHash (2004), as GM-Dedup uses it for 256-byte
//! chunks. Written from the published algorithm; the test vectors come
//! from compiling the reference C.

fn get16(d: &[u8], i: usize) -> u32 {
    u32::from(d[i]) | u32::from(d[i + 1]) << 8
}

/// One round of the main loop over 4 bytes.
#[inline(always)]
fn round(hash: u32, lo: u32, hi: u32) -> u32 {
    let hash = hash.wrapping_add(lo);
    let tmp = (hi << 11) ^ hash;
    let hash = (hash << 16) ^ tmp;
    hash.wrapping_add(hash >> 11)
}

/// The final "avalanche".
#[inline(always)]
fn finish(mut hash: u32) -> u32 {
    hash ^= hash << 3;
    hash = hash.wrapping_add(hash >> 5);
    hash ^= hash << 4;
    hash = hash.wrapping_add(hash >> 17);
    hash ^= hash << 25;
    hash.wrapping_add(hash >> 6)
}

fn seeded(data: &[u8], seed: u32) -> u32 {
    if data.is_empty() {
        return 0;
    }
    let mut hash = seed;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        hash = round(hash, get16(w, 0), get16(w, 2));
    }
    // The reference reads tail bytes as `signed char`.
    let signed = |b: u8| b as i8 as i32 as u32;
    let rem = words.remainder();
    match rem.len() {
        3 => {
            hash = hash.wrapping_add(get16(rem, 0));
            hash ^= hash << 16;
            hash ^= signed(rem[2]) << 18;
            hash = hash.wrapping_add(hash >> 11);
        }
        2 => {
            hash = hash.wrapping_add(get16(rem, 0));
            hash ^= hash << 11;
            hash = hash.wrapping_add(hash >> 17);
        }
        1 => {
            hash = hash.wrapping_add(signed(rem[0]));
            hash ^= hash << 10;
            hash = hash.wrapping_add(hash >> 1);
        }
        _ => {}
    }
    finish(hash)
}

/// SuperFastHash of `data`, seeded with its length as the reference code
/// does (the hash of no bytes is 0).
pub fn superfasthash(data: &[u8]) -> u32 {
    seeded(data, data.len() as u32)
}

/// Bytes of a chunk that [`superfasthash_chunks`] hashes.
pub const CHUNK: usize = 256;

/// SuperFastHash of four 256-byte chunks at once. The hash is one long
/// dependency chain (about 1.5 bytes per cycle); four interleaved chains
/// keep the ALUs busy. Equal to [`superfasthash`] of each chunk.
pub fn superfasthash_chunks(chunks: [&[u8; CHUNK]; 4]) -> [u32; 4] {
    let mut h = [CHUNK as u32; 4];
    for i in (0..CHUNK).step_by(4) {
        for (h, c) in h.iter_mut().zip(&chunks) {
            *h = round(*h, get16(&c[..], i), get16(&c[..], i + 2));
        }
    }
    h.map(finish)
}

/// Most chunks [`superfasthash_many`] hashes in one call.
pub const MAX_CHUNKS: usize = 16;

/// SuperFastHash of up to 16 chunks of 256 bytes, `base[s..s + 256]` for
/// each `s` in `starts`; lanes past `starts.len()` are 0. With AVX-512 or
/// AVX2 the chunks are hashed 16 or 8 at a time, one per SIMD lane (a
/// gather loads the next 4 bytes of every chunk), which is how GMigrate
/// ran one GPU thread per chunk.
///
/// Panics if `starts` has more than 16 entries or a chunk lies outside
/// `base` (callers pass chunks they have bounds-checked).
pub fn superfasthash_many(base: &[u8], starts: &[usize]) -> [u32; MAX_CHUNKS] {
    assert!(starts.len() <= MAX_CHUNKS, "at most 16 chunks");
    assert!(starts.iter().all(|&s| s.checked_add(CHUNK).is_some_and(|end| end <= base.len())), "chunk outside base");
    assert!(base.len() <= i32::MAX as usize, "offsets fit in i32");
    let mut out = [0u32; MAX_CHUNKS];
    if starts.is_empty() {
        return out;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above); every
            // chunk lies inside `base` and offsets fit in i32 (asserted).
            unsafe { x86::hash16_avx512(base, starts, &mut out) };
            return out;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            for (starts, out) in starts.chunks(8).zip(out.chunks_mut(8)) {
                // SAFETY: as above, with AVX2 checked just above.
                unsafe { x86::hash8_avx2(base, starts, out.try_into().unwrap()) };
            }
            return out;
        }
    }
    for (starts, out) in starts.chunks(4).zip(out.chunks_mut(4)) {
        let chunk = |k: usize| -> &[u8; CHUNK] {
            let s = starts.get(k).copied().unwrap_or(starts[0]);
            base[s..s + CHUNK].try_into().unwrap()
        };
        let h = superfasthash_chunks([chunk(0), chunk(1), chunk(2), chunk(3)]);
        out.copy_from_slice(&h[..out.len().min(starts.len())]);
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHUNK;
    use std::arch::x86_64::*;

    /// Lanes past `starts.len()` hash `starts[0]` again and are dropped.
    fn offsets<const N: usize>(starts: &[usize]) -> [i32; N] {
        std::array::from_fn(|k| starts.get(k).copied().unwrap_or(starts[0]) as i32)
    }

    /// # Safety
    /// The CPU has AVX-512F; 1 <= starts.len() <= 16; every
    /// `base[s..s + CHUNK]` is in bounds and `s` fits in i32.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn hash16_avx512(base: &[u8], starts: &[usize], out: &mut [u32; 16]) {
        let offs = offsets::<16>(starts);
        // SAFETY: `offs` is 64 bytes; loadu needs no alignment.
        let mut at = unsafe { _mm512_loadu_si512(offs.as_ptr().cast()) };
        let mut h = _mm512_set1_epi32(CHUNK as i32);
        let low16 = _mm512_set1_epi32(0xFFFF);
        for _ in 0..CHUNK / 4 {
            // SAFETY: each lane reads 4 bytes at base + s + 4i with
            // 4i + 4 <= CHUNK, inside `base` (the caller's contract).
            let w = unsafe { _mm512_i32gather_epi32::<1>(at, base.as_ptr().cast()) };
            h = _mm512_add_epi32(h, _mm512_and_si512(w, low16));
            let tmp = _mm512_xor_si512(_mm512_slli_epi32::<11>(_mm512_srli_epi32::<16>(w)), h);
            h = _mm512_xor_si512(_mm512_slli_epi32::<16>(h), tmp);
            h = _mm512_add_epi32(h, _mm512_srli_epi32::<11>(h));
            at = _mm512_add_epi32(at, _mm512_set1_epi32(4));
        }
        h = _mm512_xor_si512(h, _mm512_slli_epi32::<3>(h));
        h = _mm512_add_epi32(h, _mm512_srli_epi32::<5>(h));
        h = _mm512_xor_si512(h, _mm512_slli_epi32::<4>(h));
        h = _mm512_add_epi32(h, _mm512_srli_epi32::<17>(h));
        h = _mm512_xor_si512(h, _mm512_slli_epi32::<25>(h));
        h = _mm512_add_epi32(h, _mm512_srli_epi32::<6>(h));
        let mut all = [0u32; 16];
        // SAFETY: `all` is 64 bytes; storeu needs no alignment.
        unsafe { _mm512_storeu_si512(all.as_mut_ptr().cast(), h) };
        out[..starts.len()].copy_from_slice(&all[..starts.len()]);
    }

    /// # Safety
    /// The CPU has AVX2; 1 <= starts.len() <= 8; every
    /// `base[s..s + CHUNK]` is in bounds and `s` fits in i32.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn hash8_avx2(base: &[u8], starts: &[usize], out: &mut [u32; 8]) {
        let offs = offsets::<8>(starts);
        // SAFETY: `offs` is 32 bytes; loadu needs no alignment.
        let mut at = unsafe { _mm256_loadu_si256(offs.as_ptr().cast()) };
        let mut h = _mm256_set1_epi32(CHUNK as i32);
        let low16 = _mm256_set1_epi32(0xFFFF);
        for _ in 0..CHUNK / 4 {
            // SAFETY: each lane reads 4 bytes at base + s + 4i with
            // 4i + 4 <= CHUNK, inside `base` (the caller's contract).
            let w = unsafe { _mm256_i32gather_epi32::<1>(base.as_ptr().cast(), at) };
            h = _mm256_add_epi32(h, _mm256_and_si256(w, low16));
            let tmp = _mm256_xor_si256(_mm256_slli_epi32::<11>(_mm256_srli_epi32::<16>(w)), h);
            h = _mm256_xor_si256(_mm256_slli_epi32::<16>(h), tmp);
            h = _mm256_add_epi32(h, _mm256_srli_epi32::<11>(h));
            at = _mm256_add_epi32(at, _mm256_set1_epi32(4));
        }
        h = _mm256_xor_si256(h, _mm256_slli_epi32::<3>(h));
        h = _mm256_add_epi32(h, _mm256_srli_epi32::<5>(h));
        h = _mm256_xor_si256(h, _mm256_slli_epi32::<4>(h));
        h = _mm256_add_epi32(h, _mm256_srli_epi32::<17>(h));
        h = _mm256_xor_si256(h, _mm256_slli_epi32::<25>(h));
        h = _mm256_add_epi32(h, _mm256_srli_epi32::<6>(h));
        let mut all = [0u32; 8];
        // SAFETY: `all` is 32 bytes; storeu needs no alignment.
        unsafe { _mm256_storeu_si256(all.as_mut_ptr().cast(), h) };
        out[..starts.len()].copy_from_slice(&all[..starts.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_c() {
        // Values printed by Paul Hsieh's C code (gcc, x86-64), covering
        // every tail length and signed tail bytes.
        let vectors: [(&[u8], u32); 11] = [
            (b"", 0),
            (b"*", 1646217348),
            (b"ab", 1366002500),
            (b"hst", 2335890029),
            (b"abcd", 3671636187),
            (b"Pjotr", 2001670728),
            (b"abcdef", 2520489434),
            (b"hstiaashccaht", 581064253),
            (b"\xff", 0),
            (b"\x80\x81\xfe", 1221393449),
            (b"abc\xf0\x9f\x92\xa9x\xff", 3230089077),
        ];
        for (data, want) in vectors {
            assert_eq!(superfasthash(data), want, "{data:?}");
        }
        let counting: Vec<u8> = (0..=255).collect();
        assert_eq!(superfasthash(&counting), 3840866583);
        assert_eq!(superfasthash(&[0u8; 256]), 3158290672);
    }

    #[test]
    fn matches_a_published_port_seeded_with_zero() {
        // Sambamba's D port (bio2/hashing.d) seeds with 0 instead of the
        // length; its unit-test values check our rounds independently.
        for (data, want) in
            [(&b"*"[..], 1029965590), (b"hst", 1867544282), (b"hstiaashccaht", 2173265029), (b"Pjotr", 2808102289)]
        {
            assert_eq!(seeded(data, 0), want, "{data:?}");
        }
    }

    #[test]
    fn four_lanes_equal_one_at_a_time() {
        let mut page = [0u8; 4 * CHUNK];
        for (i, b) in page.iter_mut().enumerate() {
            *b = (i * 7 + i / 3) as u8;
        }
        let c: Vec<&[u8; CHUNK]> = page.chunks_exact(CHUNK).map(|c| c.try_into().unwrap()).collect();
        let lanes = superfasthash_chunks([c[0], c[1], c[2], c[3]]);
        for i in 0..4 {
            assert_eq!(lanes[i], superfasthash(c[i]));
        }
    }

    #[test]
    fn many_lanes_equal_one_at_a_time_on_every_path() {
        let base: Vec<u8> = (0..5000u32).map(|i| (i * 31 + i / 7) as u8 ^ 0x80).collect();
        let starts: Vec<usize> = (0..16).map(|k| k * 283 + 3).collect();
        for n in [1, 3, 4, 8, 9, 16] {
            let got = superfasthash_many(&base, &starts[..n]);
            for k in 0..16 {
                let want = if k < n { superfasthash(&base[starts[k]..starts[k] + CHUNK]) } else { 0 };
                assert_eq!(got[k], want, "{n} chunks, lane {k}");
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                let mut out = [0u32; 8];
                let m = n.min(8);
                // SAFETY: the CPU has AVX2; the chunks lie inside `base`.
                unsafe { x86::hash8_avx2(&base, &starts[..m], &mut out) };
                assert_eq!(out[..m], got[..m]);
            }
        }
    }
}
